"""Test-wide settings: DeepSpeed on the CPU accelerator, quiet logs."""

import os

# One intra-op thread per test process (set before torch is imported; children inherit it): the suite runs on two
# xdist workers on CI's two cores, and tiny models lose more to thread synchronisation than they gain.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from gpu_session import NO_CUDA, names_gpu_tests, selects_gpu_tests  # noqa: E402
from processes import live_pid  # noqa: E402

# DeepSpeed picks its accelerator when first imported: the CPU one without a GPU (CI); on a GPU machine (pytest -m gpu
# tests/gpu) CUDA's, or an engine there would keep its model on the CPU under an NCCL process group.
os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Triton decides at import whether @triton.jit functions (its own standard library's too) are interpreted. Without a
# GPU, interpret from the start: DeepSpeed imports Triton long before the kernel tests do. Auto dispatch still takes
# the reference on CPU tensors; only tests that force MOE_TUNE_KERNELS=triton run kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Triton compiles or interprets a kernel module as TRITON_INTERPRET says when the module is imported, for the rest
# of the process: tests/gpu and the interpreter tests of tests/ops need processes of their own. Without a GPU
# tests/gpu is not collected, and a run that asks for it is refused (pytest_configure). On a GPU machine:
# pytest -m gpu tests/gpu.
collect_ignore_glob = [] if torch.cuda.is_available() else ["gpu/*"]

# Rendezvous variables a run in this process may have set: a child process must pick its own.
DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")


def pytest_configure(config: pytest.Config) -> None:
    """A run that asks for the GPU tests (-m selecting gpu, or a path in tests/gpu) on a machine without CUDA stops
    with one line and exit code 4, instead of collecting nothing and ending in "no tests ran"."""
    if torch.cuda.is_available():
        return
    if selects_gpu_tests(config.option.markexpr or "") or names_gpu_tests(config.args, config.invocation_params.dir):
        raise pytest.UsageError(NO_CUDA)


@pytest.fixture
def child_env() -> dict[str, str]:
    """Environment for a `moe-tune` child process: unbuffered, without this process's rendezvous."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS}
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture
def sleeper():
    """The pid of a live process of this host (a run or an export that holds a folder, as the test names it)."""
    with live_pid() as pid:
        yield pid
