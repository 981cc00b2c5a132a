"""`moe-tune export`: a finished run written as a Hugging Face checkpoint folder (or PEFT adapter) in the hub's
layout."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Annotated

import typer

from ._common import print_error, user_errors

app = typer.Typer()

# The OS refused a read or write of the export (a full disk, no permission): not bad input (that exits 2).
EXPORT_FAILED_EXIT = 1
# Stopped by SIGTERM: the shell's code for it, after the temporary folder is removed (as for Ctrl-C, 130).
TERMINATED_EXIT = 143


def _terminated(signum, frame) -> None:
    # Raised where the export is, so that its temporary folder is removed on the way out (engine/export staged_folder).
    raise SystemExit(TERMINATED_EXIT)


@app.command()
def export(
    run_dir: Annotated[Path, typer.Argument(help="a finetune output.dir")],
    merge: Annotated[
        bool, typer.Option("--merge", help="LoRA runs: the base weights with the adapters merged in (default: the "
                           "PEFT adapter on the checkpoint's module names)")
    ] = False,
    out: Annotated[
        Path | None, typer.Option("--out", help="a new or empty folder (default: RUN_DIR/export, or export-merged)")
    ] = None,
    max_shard_size: Annotated[
        str, typer.Option("--max-shard-size", help="largest safetensors shard, e.g. 500MB, 5GB")
    ] = "5GB",
    step: Annotated[
        int | None, typer.Option("--step", help="export checkpoints/step-N instead of the run's final state")
    ] = None,
    precision: Annotated[
        str, typer.Option("--precision", help="auto: the base checkpoint's dtypes, an FP8 base dequantized (merged "
                          "weights are never re-quantized: fp8 is refused)")
    ] = "auto",
) -> None:
    """Write the run as a checkpoint folder transformers loads (AutoModelForCausalLM.from_pretrained): the base
    checkpoint's config, tokenizer and processor files, the weights in its key layout as sharded safetensors."""
    from moe_tune.engine.export import ExportWriteError
    from moe_tune.engine.export.hub import export_run

    notes: list[str] = []
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        with user_errors():
            written = export_run(run_dir, merge, out, max_shard_size, step, precision, notes)
    except ExportWriteError as err:
        print_error(str(err))
        raise typer.Exit(code=EXPORT_FAILED_EXIT) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    for note in notes:
        typer.echo(note)
    typer.echo(f"exported to {written}")
