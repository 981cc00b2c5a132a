"""One dispatch point per op: Triton kernel or pure-PyTorch reference.

`MOE_TUNE_KERNELS=reference|triton|auto` (default auto) forces the path for every op. auto takes the kernel when
one exists and every input is on a CUDA device, the reference everywhere else; an explicit `triton` that cannot run
raises instead of falling back. Only an explicit `triton` runs kernels on CPU tensors, through the Triton
interpreter (`TRITON_INTERPRET=1`): that is how the kernels are tested without a GPU.
"""

from __future__ import annotations

import logging
import os

import torch

KERNELS_ENV = "MOE_TUNE_KERNELS"
KERNEL_MODES = ("reference", "triton", "auto")

_log = logging.getLogger("moe_tune.ops")
_logged_choices: set[tuple[str, str]] = set()


def kernel_mode() -> str:
    """The path the environment asks for: one of KERNEL_MODES."""
    mode = os.environ.get(KERNELS_ENV, "auto").strip().lower() or "auto"
    if mode not in KERNEL_MODES:
        raise ValueError(f"{KERNELS_ENV} ({mode!r}) must be one of {', '.join(KERNEL_MODES)}")
    return mode


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def sm_count(device: torch.device) -> int:
    """The streaming multiprocessors of a CUDA device: the grid size of a launch with one program per SM."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def use_kernel(op_name: str, *tensors: torch.Tensor, has_kernel: bool) -> bool:
    """True when `op_name` should run its Triton kernel on `tensors`, False for the reference.

    has_kernel: whether the op has a kernel for this case (dtype, options) at all.
    """
    mode = kernel_mode()
    on_cuda = all(t.is_cuda for t in tensors if t is not None)
    if mode == "reference":
        choice = False
    elif mode == "triton":
        if not has_kernel:
            raise RuntimeError(f"{KERNELS_ENV}=triton but {op_name} has no Triton kernel for these inputs")
        if not (on_cuda or triton_interpreting()):
            raise RuntimeError(
                f"{KERNELS_ENV}=triton but {op_name} got CPU tensors: run on a CUDA device or set TRITON_INTERPRET=1"
            )
        choice = True
    else:
        choice = has_kernel and on_cuda
    path = "triton" if choice else "reference"
    if (op_name, path) not in _logged_choices:
        _logged_choices.add((op_name, path))
        _log.info("%s: %s path (%s=%s)", op_name, path, KERNELS_ENV, mode)
    return choice
