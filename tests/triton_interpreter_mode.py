"""Importing Triton kernel modules for the interpreter, in the CPU tests of ops/*/kernels*.py."""

import contextlib
import os


@contextlib.contextmanager
def interpreted_kernels():
    """TRITON_INTERPRET=1 inside, for the imports of triton and the kernel modules: @triton.jit picks the interpreter
    when it decorates. Afterwards the variable is as it was: left set, every other test module's auto dispatch would
    take the kernels on CPU tensors; the kernel tests set it again through their fixtures when they run."""
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before
