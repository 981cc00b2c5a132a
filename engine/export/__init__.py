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

import errno
import glob
import os
import re
import shutil
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Protocol, runtime_checkable

import torch

from moe_tune.profiles import ProfileError


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
    """An OSError raised in the block, or safetensors' SafetensorError (a shard that cannot be written: its OS error
    inside the message), as ExportWriteError: `export to OUT failed: [Errno N] reason`."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, SafetensorError) as err:
        raise ExportWriteError(f"export to {out} failed: {err}") from err


# A writer's temporary folder beside OUT: `.OUT.tmp-HOST-PID`; `.OUT.tmp` alone names no writer.
_STAGING = re.compile(r"\.(?P<name>.+)\.tmp(?:-(?P<host>.+)-(?P<pid>\d+))?")


def staging_folder(out: Path) -> Path:
    """The temporary sibling this process writes the folder `out` into: `.OUT.tmp-HOST-PID`."""
    return out.with_name(f".{out.name}.tmp-{socket.gethostname()}-{os.getpid()}")


def other_writers(out: Path) -> tuple[list[Path], list[Path]]:
    """The temporary folders beside `out` of other writers of it: (those of live writers on this host, those left by
    writers that are gone: killed on this host, or naming none). Another host's are in neither: their writers cannot
    be checked from here."""
    from moe_tune.engine.train.run_dir import pid_alive

    live, left = [], []
    here, ours = socket.gethostname(), staging_folder(out)
    for path in out.parent.glob(f".{glob.escape(out.name)}.tmp*"):
        match = _STAGING.fullmatch(path.name)
        if path == ours or match is None or match["name"] != out.name:
            continue
        if match["pid"] is None:
            left.append(path)
        elif match["host"] == here:
            (live if pid_alive(int(match["pid"])) else left).append(path)
    return live, left


def writing_problem(out: Path, other: Path) -> str:
    """The line refusing a second writer of `out` while the writer of `other` (its temporary folder) lives."""
    return (f"{out}: another export is writing it (into {other.name}); one writer per folder: wait for it to end, or "
            "write into another folder")


@contextmanager
def staged_folder(out: Path) -> Iterator[Path]:
    """The temporary sibling (staging_folder) that the folder `out` is written into, renamed to `out` when the block
    ends normally (replacing `out` if it is an empty folder: rename(2)). On any exception (a refusal, a failed write,
    KeyboardInterrupt) the temporary folder is removed and `out` is left as it was. Temporary folders left by killed
    writers are removed first; a live writer of `out` on this host is a ProfileError naming it, and a writer that
    renamed its folder into place first (on another host) keeps it: this one's is removed, a ProfileError."""
    out = Path(out)
    live, left = other_writers(out)
    if live:
        raise ProfileError([writing_problem(out, live[0])])
    for path in left:
        shutil.rmtree(path, ignore_errors=True)
    tmp = staging_folder(out)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        try:
            tmp.replace(out)
        except OSError as err:
            if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            raise ProfileError([f"{out}: filled while this export ran (by another export, or by hand); it is kept "
                                "as it is, and this export's files are removed"]) from None  # fmt: skip
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
