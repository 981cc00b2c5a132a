"""Which pytest invocations ask for the GPU tests: a marker expression that selects `gpu` tests (`-m gpu`,
`-m "gpu and not slow"`) or a path that is tests/gpu or inside it. tests/conftest.py refuses such a run on a
machine without CUDA, where tests/gpu is not collected and the run would otherwise end in "no tests ran"."""

import itertools
import re
from pathlib import Path

# pytest's own parser of -m expressions (no public API exposes it).
from _pytest.mark.expression import Expression

GPU_TESTS = Path(__file__).resolve().parent / "gpu"
GPU_MARKER = "gpu"
NO_CUDA = ("the GPU tests (-m gpu, tests/gpu) need a CUDA device: none is visible "
           "(torch.cuda.is_available() is False)")
# An identifier of a -m expression (pytest's scanner takes these characters) and the expression's operators.
IDENT = re.compile(r"(?:\w|:|\+|-|\.|\[|\]|\\|/)+")
OPERATORS = {"and", "or", "not"}


def selects_gpu_tests(markexpr: str) -> bool:
    """Whether `-m markexpr` asks for gpu tests: for some set of the other markers it names, a test with them is
    deselected and the same test marked gpu too is selected. True for `gpu`, `gpu and slow`, `gpu or dist`; False
    for no expression, `not gpu` (the default addopts) and `not dist`."""
    if not markexpr.strip():
        return False
    expression = Expression.compile(markexpr)
    others = sorted(set(IDENT.findall(markexpr)) - OPERATORS - {GPU_MARKER})
    for count in range(len(others) + 1):
        for marks in map(set, itertools.combinations(others, count)):
            with_gpu = expression.evaluate(lambda name, /, **kwargs: name in marks or name == GPU_MARKER)
            if with_gpu and not expression.evaluate(lambda name, /, **kwargs: name in marks):
                return True
    return False


def names_gpu_tests(args: list[str], invocation_dir: Path) -> bool:
    """Whether a command-line path (relative to `invocation_dir`, a node id's `::` part dropped) is tests/gpu or lies
    inside it."""
    for arg in args:
        path = (Path(invocation_dir) / arg.split("::", 1)[0]).resolve()
        if path == GPU_TESTS or GPU_TESTS in path.parents:
            return True
    return False
