"""`moe-tune align`: compare our model layer by layer with the reference implementation, or with a golden trace."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from moe_tune.profiles import error_line

from ._common import fail, input_file_problems, output_problems, read_profile, user_errors

app = typer.Typer()


@app.command()
def align(
    reference: Annotated[
        Path | None, typer.Option("--reference", help="Hugging Face checkpoint directory (config.json + safetensors)")
    ] = None,
    batch: Annotated[
        Path | None,
        typer.Option("--batch", help='JSONL of documents, {"input_ids": [...]} or {"text": ...} per line; a text\'s '
                     '"<image>" placeholders take the files of its "images" list (default: three random documents)'),
    ] = None,
    pin_routing: Annotated[
        bool, typer.Option("--pin-routing", help="feed the reference's expert choice to moe-tune's routers and its "
                           "sparse attention indexers' key choice to ours")
    ] = False,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the report as JSON here")] = None,
    golden: Annotated[
        Path | None,
        typer.Option("--golden", help="golden trace file: checked when it exists, recorded when it does not "
                     "(compares moe-tune with itself, no reference run)"),
    ] = None,
    update_golden: Annotated[bool, typer.Option("--update-golden", help="re-record the golden trace")] = False,
    profile: Annotated[
        str | None, typer.Option("--profile", help="with --golden and no --reference: the profile whose model to trace")
    ] = None,
    logits_atol: Annotated[float, typer.Option(help="max abs difference of logits allowed")] = 1e-4,
    kl: Annotated[float, typer.Option(help="max mean KL(reference || moe-tune) of next-token distributions")] = 1e-6,
    loss_atol: Annotated[float, typer.Option(help="max abs difference of the loss")] = 1e-4,
    grad_rtol: Annotated[
        float, typer.Option(help="max relative difference of LoRA gradients, per row and column: each row's and "
                            "column's max abs difference over the reference's largest |value| in it")
    ] = 1e-3,
    hidden_rtol: Annotated[
        float, typer.Option(help="max relative difference of each layer's hidden state (and the vision rows), per "
                            "channel: each channel's max abs difference over the reference's largest |value| in it")
    ] = 1e-4,
) -> None:
    """Numerical alignment, layer by layer: hidden states, logits (max abs, cosine, KL), loss, LoRA gradients.
    Exit 0 within tolerance, 1 outside it, 2 on bad input."""
    from safetensors import SafetensorError

    from moe_tune.engine.align import Tolerances, align_checkpoint, read_batch, run_golden
    from moe_tune.engine.families import check_checkpoint, check_finite_weights, model_profile_from_checkpoint

    problems = []
    if reference is None and golden is None:
        problems.append("--reference DIR or --golden FILE is required")
    if reference is not None and not (reference / "config.json").is_file():
        problems.append(f"--reference ('{reference}') must be a checkpoint directory with a config.json")
    if update_golden and golden is None:
        problems.append("--update-golden re-records the --golden trace: give --golden FILE")
    if golden is not None and golden.is_dir():
        problems.append(f"--golden ({str(golden)!r}) is a folder: name the trace file")
    elif golden is not None and not golden.parent.is_dir():
        problems.append(f"--golden ({str(golden)!r}): its folder {str(golden.parent)!r} does not exist")
    if pin_routing and golden is not None:
        problems.append("--pin-routing compares with the reference: it does not apply to --golden")
    if profile is not None and reference is not None:
        problems.append("--profile and --reference both name the model: give one")
    for name, value in (("--logits-atol", logits_atol), ("--kl", kl), ("--loss-atol", loss_atol),
                        ("--grad-rtol", grad_rtol), ("--hidden-rtol", hidden_rtol)):
        # NaN compares false with everything: a NaN tolerance would fail every run, an infinite one pass any.
        if not (math.isfinite(value) and value >= 0):
            problems.append(f"{name} ({value}) must be a finite number >= 0")
    # Before anything runs: an alignment must not end on a --json it cannot write, nor overwrite an input.
    problems += output_problems(json_out, None, None, inputs=_input_files(reference, batch, golden, profile))
    problems += input_file_problems([("--batch", batch), ("--golden", golden)])
    if problems:
        fail(problems)
    tolerances = Tolerances(logits_max_abs=logits_atol, kl=kl, loss_abs=loss_atol, lora_grad_rel=grad_rtol,
                            hidden_rel=hidden_rtol)
    console = Console(highlight=False)
    with user_errors():
        if reference is not None:
            # Refuse unsafe or damaged weight files before the reference implementation opens any of them.
            check_checkpoint(reference)
            check_finite_weights(reference)
        if golden is not None:
            profile_model = read_profile(profile or "tiny", None).model if reference is None else None
            try:
                report, written = run_golden(golden, reference, profile_model, batch, update_golden, tolerances)
            except (OSError, SafetensorError) as err:
                # Raised by the trace's write alone (a full disk): what it reads is refused as UnsupportedModel.
                fail([f"--golden ({str(golden)!r}): cannot write the trace ({error_line(err)}); the file is as it "
                      "was"])
            if written:
                unwritten = "; nothing was compared, so no --json report was written" if json_out is not None else ""
                console.print(f"recorded golden trace {golden}{unwritten}", markup=False, soft_wrap=True)
                return
        else:
            docs = None
            if batch is not None:
                _, _, cfg = model_profile_from_checkpoint(reference)
                docs = read_batch(batch, cfg, reference)
            report = align_checkpoint(reference, docs, pin_routing, tolerances)
    if json_out is not None:
        try:
            report.write_json(json_out)
        except OSError as err:
            fail([f"--json ({str(json_out)!r}): cannot write the report ({err.strerror or err}); the file is as it "
                  "was"])
    print_report(console, report)
    if not report.passed:
        raise typer.Exit(code=1)


def _input_files(reference: Path | None, batch: Path | None, golden: Path | None,
                 profile: str | None) -> list[tuple[str, Path]]:  # fmt: skip
    """(option, path) of every file the command reads: the --batch, the --golden trace, a --profile file and each
    file of the --reference checkpoint."""
    files = [("--batch", batch), ("--golden", golden)]
    if profile is not None and Path(profile).is_file():
        files.append(("--profile", Path(profile)))
    if reference is not None and reference.is_dir():
        files += [(f"--reference {path.name}", path) for path in sorted(reference.iterdir()) if path.is_file()]
    return [(name, path) for name, path in files if path is not None]


def print_report(console: Console, report) -> None:
    against = "golden trace" if report.model_type.startswith("golden") else "reference (transformers, fp32, eager)"
    pinned = [what for what, is_pinned in (("routing", report.pinned_routing),
                                           ("sparse attention selections", report.pinned_selection)) if is_pinned]
    console.print(
        f"{report.model_type}: moe-tune vs {against}, documents {report.documents}"
        + (f", {' and '.join(pinned)} pinned to the reference's" if pinned else ""),
        markup=False,
        soft_wrap=True,
    )
    if report.reference_paths:
        console.print(f"reference: {report.reference_paths}", markup=False, soft_wrap=True)
    table = Table(show_edge=False)
    for col in ("compared", "max abs", "relative", "per channel"):
        table.add_column(col, justify="left" if col == "compared" else "right")
    for row in report.layers + [report.logits] + report.lora_grads:
        # A LoRA gradient's rows and columns are the channels its projection reads and writes (compare.line_rel).
        channels = row.channel_rel if row.channel_rel is not None else row.line_rel
        channels = "" if channels is None else f"{channels:.3e}"
        table.add_row(row.name, f"{row.max_abs:.3e}", f"{row.rel:.3e}", channels)
    console.print(table)
    console.print(
        f"logits cosine {report.logits_cosine:.8f}  KL {report.kl:.3e}  "
        f"loss {report.loss_ours:.6f} (reference {report.loss_reference:.6f})",
        markup=False,
    )
    when = " before pinning" if report.pinned_selection else ""
    for selection in report.selections:
        console.print(
            f"layer {selection.layer} sparse attention: {selection.differed} of {selection.rows} query rows chose "
            f"other keys than the reference{when} (the budget left keys out in {selection.left_out})"
            + (f", {selection.beyond_tie} of them beyond a tie" if selection.differed else ""),
            markup=False,
            soft_wrap=True,
        )
    if report.selections and not any(selection.left_out for selection in report.selections):
        console.print("(every query's budget covered all the keys it sees: the indexers' choice is not tested; give "
                      "--batch documents longer than the budget)", markup=False, soft_wrap=True)
    if not report.pinned_selection and any(selection.differed for selection in report.selections):
        console.print("(a different selection changes every later row; --pin-routing feeds the reference's "
                      "selection to ours, so the attention itself is compared)", markup=False)
    when = " before pinning" if report.pinned_routing else ""
    for route in report.routing:
        if route.differed:
            console.print(
                f"layer {route.layer} routing: {route.differed} of {route.tokens} tokens chose other experts than the "
                f"reference{when}, {route.beyond_tie} of them beyond a tie",
                markup=False,
                soft_wrap=True,
            )
    if report.routing and not any(route.differed for route in report.routing):
        console.print(f"routing: every token chose the reference's experts in the {len(report.routing)} MoE layers"
                      f"{when}", markup=False, soft_wrap=True)
    if report.passed:
        console.print("aligned: within tolerance", markup=False)
    else:
        for line in report.failures:
            console.print(f"NOT aligned: {line}", markup=False, soft_wrap=True)
