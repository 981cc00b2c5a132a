"""`moe-tune export`: a trained run written as a Hugging Face checkpoint folder in the hub's key layout.

The writer (hub.py) reads the trained model from a *state source*, one tensor at a time, and writes every key of
the base checkpoint (sharded safetensors + index, the base's config, tokenizer and processor files). Sources:

- sources.py: the run's final state (`adapter/` over the base checkpoint, or `model.safetensors` of a full
  fine-tune);
- zero.py: a `checkpoints/step-N` folder of a ZeRO-3 + expert-parallel run, read tensor by tensor.

A run trained on FP8 base weights (`model.base_precision: fp8`) is read as its bf16-base model: names without the
`*_scale_inv` tensors, each FP8 weight dequantized to fp32 as the run held it (fp8.py; sources.DequantizedSource over
a step or the trainer's state), and written unquantized.

The interface every source implements (StateSource below):

  names() -> list[str]
      Our single-process names: the keys of `build_model(cfg).state_dict()` (no PEFT prefix, no `base_layer`),
      every parameter and persistent buffer (tied tensors under each of their names, as state_dict lists them).
  read(name) -> torch.Tensor
      That tensor, whole (routed experts as full [E, ...] tensors, every expert), on the CPU, in the dtype it was
      trained in. With merged=True on a LoRA run: the base weight with the adapter merged in,
      W + (alpha / r) * B @ A per linear layer and per expert (merge_lora below, PEFT's merge), and a module trained
      in full (modules_to_save) as trained. With merged=False: the base weight as it was (the adapter comes from
      adapter_state()). Full fine-tuning: the trained weight. Each call reads only what that tensor needs.
  read_expert(name, e) -> torch.Tensor   (optional)
      Expert e of a grouped expert tensor, [1, ...], reading nothing of the other experts: the writer then holds
      one expert at a time rather than a layer's [E, ...] (every source here has it: a checkpoint step copies the
      expert from only the rank slices that hold it).
  adapter_state() -> dict[str, torch.Tensor] | None
      LoRA runs: the adapter's tensors as PEFT's save_pretrained names them (get_peft_model_state_dict):
      `base_model.model.<name>.lora_A.weight` / `.lora_B.weight`, experts `base_model.model.<...>.experts.lora_A.
      w_gate_up` [E, r, D] (`w_down` [E, r, F]; lora_B [E, 2F, r] / [E, D, r]), modules_to_save tensors as
      `base_model.model.<name>`. None for full fine-tuning. Small (adapters only).
  close() -> None
      Releases open files. Sources are context managers.

The writer needs nothing else from a source: the model profile (ModelProfile, with `.checkpoint` the base folder)
and the LoRA settings come from the run's profile.yaml (RunInfo in sources.py: `run.run_dir`, `run.profile`
(JobProfile), `run.cfg` (its ModelProfile)).

The step reader's entry point, which `moe-tune export --step N` calls (zero.py):

  open_step(run: RunInfo, step: int, merged: bool) -> StateSource
      The source of `run.run_dir / checkpoints / step-NNNNNNN` (verified against its manifest). ProfileError, one
      line each, when the step does not exist or does not verify. merged as for read() above.
"""

from __future__ import annotations

import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Protocol, runtime_checkable

import torch


@runtime_checkable
class StateSource(Protocol):
    def names(self) -> list[str]: ...

    def read(self, name: str) -> torch.Tensor: ...

    def adapter_state(self) -> dict[str, torch.Tensor] | None: ...

    def close(self) -> None: ...


def merge_lora(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """`weight` with one adapter merged in, in weight's dtype: W + scaling * B @ A, computed in fp32. A linear layer:
    W [out, in], A [r, in], B [out, r]. Grouped experts: W [E, out, in], A [E, r, in], B [E, out, r] (per expert)."""
    delta = torch.matmul(b.float(), a.float()) * scaling
    return (weight.float() + delta).to(weight.dtype)


class ExportWriteError(RuntimeError):
    """An export stopped by the OS (a full disk, no permission to write beside the folder): the message names the
    folder and the OS error; the temporary folder is removed and the folder is left as it was (staged_folder)."""


@contextmanager
def write_errors_named(out: Path) -> Iterator[None]:
    """An OSError raised in the block as ExportWriteError: `export to OUT failed: [Errno N] reason`."""
    try:
        yield
    except OSError as err:
        raise ExportWriteError(f"export to {out} failed: {err}") from err


@contextmanager
def staged_folder(out: Path) -> Iterator[Path]:
    """The temporary sibling `.OUT.tmp` that the folder `out` is written into, renamed to `out` when the block ends
    normally (replacing `out` if it is an empty folder: rename(2)). On any exception (a refusal, a failed write,
    KeyboardInterrupt) the temporary folder is removed and `out` is left as it was. A temporary folder left by a
    killed writer is removed first."""
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        tmp.replace(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
