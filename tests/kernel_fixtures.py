"""Fixtures the kernel tests build for their own kernels module: the forced Triton path and guarded output buffers.

    kernel_path = forced_kernel_path(kernels, "_my_fwd_kernel", on_gpu=False)
    guarded = guarded_outputs(kernels, guard_elements=4096)

and `record_launches`, which names the kernels a call launches.
"""

import pytest
from guarded_buffers import GuardedBuffers


def is_interpreted(kernel) -> bool:
    """Whether a @triton.jit kernel was built in interpreter mode (its module imported under TRITON_INTERPRET=1)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


INTERPRETED_ON_GPU = "the kernels were imported in interpreter mode by tests/ops: run tests/gpu in its own session"


def fail_if_interpreted(kernel) -> None:
    """Fail a GPU test whose kernels tests/ops imported in interpreter mode first in this session: a GPU run that
    did not run its kernels must not pass."""
    if is_interpreted(kernel):
        pytest.fail(INTERPRETED_ON_GPU)


def forced_kernel_path(kernels_module, kernel_name: str, on_gpu: bool):
    """A fixture that forces MOE_TUNE_KERNELS=triton: through the interpreter (on_gpu False; the module must have
    been imported with TRITON_INTERPRET=1) or compiled for the GPU (failing when tests/ops imported the module in
    interpreter mode first: run tests/gpu in its own session)."""

    @pytest.fixture
    def kernel_path(monkeypatch):
        kernel = getattr(kernels_module, kernel_name)
        if on_gpu:
            fail_if_interpreted(kernel)
        assert on_gpu or is_interpreted(kernel), (
            f"{kernels_module.__name__} was imported before TRITON_INTERPRET=1 was set: its kernels are compiled for a GPU"
        )
        monkeypatch.setenv("MOE_TUNE_KERNELS", "triton")
        if on_gpu:
            monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        else:
            monkeypatch.setenv("TRITON_INTERPRET", "1")

    return kernel_path


def guarded_outputs(kernels_module, guard_elements: int, alloc_name: str = "_alloc"):
    """A fixture that makes the module's allocator (`alloc_name`) hand out NaN-filled buffers with a guard region
    past the end."""

    @pytest.fixture
    def guarded(monkeypatch, kernel_path) -> GuardedBuffers:
        buffers = GuardedBuffers(guard_elements)
        monkeypatch.setattr(kernels_module, alloc_name, buffers.alloc)
        return buffers

    return guarded


def record_launches(monkeypatch, module, names) -> list[str]:
    """The names of module's kernels `names`, in launch order, as they launch (each still runs)."""
    launched = []

    class Recorded:
        def __init__(self, name):
            self.name, self.kernel = name, getattr(module, name)

        def __getitem__(self, grid):
            launched.append(self.name)
            return self.kernel[grid]

    for name in names:
        monkeypatch.setattr(module, name, Recorded(name))
    return launched


def record_constexpr(monkeypatch, module, name, constexpr) -> list:
    """The value of the keyword argument `constexpr` at each launch of module's kernel `name`, in launch order (the
    kernel still runs)."""
    values = []
    kernel = getattr(module, name)

    class Recorded:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                values.append(kwargs[constexpr])
                return kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(module, name, Recorded())
    return values
