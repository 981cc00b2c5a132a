"""One timer: every GPU time a benchmark reports is timing.median_ms's (triton.testing.do_bench, or a few timed
calls for a slow step), and in engine/bench only timing.py reads a wall clock (its CPU medians and StepClock), besides
the progress clocks named in PROGRESS_CLOCKS."""

import ast
from pathlib import Path

import pytest
import triton.testing

from moe_tune.engine.bench import timing

BENCH = Path(timing.__file__).parent
CLI = BENCH.parents[1] / "cli"
# What times GPU work: do_bench and CUDA events (torch.cuda.Event; threading.Event is no timer).
TIMER_NAMES = {"do_bench", "elapsed_time"}


def is_cuda_event(node: ast.AST) -> bool:
    if not (isinstance(node, ast.Attribute) and node.attr == "Event"):
        return False
    owner = node.value
    return (isinstance(owner, ast.Attribute) and owner.attr == "cuda") or (
        isinstance(owner, ast.Name) and owner.id == "cuda"
    )


# The time module's clocks; datetime's wall date (machine.py's row date) times nothing.
WALL_CLOCKS = {"perf_counter", "perf_counter_ns", "time", "time_ns", "monotonic", "monotonic_ns", "process_time",
               "process_time_ns", "thread_time", "thread_time_ns"}
# Wall-clock reads outside timing.py that time no result, by file and enclosing function, with why.
PROGRESS_CLOCKS = {
    ("kernels.py", "run_kernels"): "each op's wall seconds, only for the progress line ('<op>: N rows in S s', "
                                   "cli/profile_kernels.py); never in a row",
}


def wall_clock_uses(path: Path) -> list[tuple[str, str]]:
    """(enclosing function or '<module>', 'file:line clock') for every read of a time-module clock in `path`:
    `time.perf_counter` under any name the module is imported as, and `from time import perf_counter`."""
    tree = ast.parse(path.read_text())
    modules = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
               for alias in node.names if alias.name == "time"}
    uses = []

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if (isinstance(node, ast.Attribute) and node.attr in WALL_CLOCKS and isinstance(node.value, ast.Name)
                and node.value.id in modules):
            uses.append((function, f"{path.name}:{node.lineno} time.{node.attr}"))
        if isinstance(node, ast.ImportFrom) and node.module == "time":
            uses.extend((function, f"{path.name}:{node.lineno} from time import {alias.name}")
                        for alias in node.names if alias.name in WALL_CLOCKS)
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, "<module>")
    return uses


def timer_uses(path: Path) -> list[str]:
    uses = []
    for node in ast.walk(ast.parse(path.read_text())):
        name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
        if name in TIMER_NAMES or is_cuda_event(node):
            uses.append(f"{path.name}:{node.lineno} {name}")
        if isinstance(node, ast.ImportFrom) and any(alias.name in TIMER_NAMES for alias in node.names):
            uses.append(f"{path.name}:{node.lineno} import")
    return uses


@pytest.mark.parametrize("path", sorted(BENCH.glob("*.py")) + sorted(CLI.glob("*.py")), ids=lambda p: p.name)
def test_only_timing_times_the_gpu(path):
    uses = timer_uses(path)
    assert uses == [] if path != Path(timing.__file__) else uses, uses


@pytest.mark.parametrize("path", sorted(BENCH.glob("*.py")), ids=lambda p: p.name)
def test_only_timing_reads_a_wall_clock(path):
    uses = wall_clock_uses(path)
    if path == Path(timing.__file__):
        assert uses, "timing.py times the CPU medians and StepClock with time.perf_counter"
        return
    timers = [use for function, use in uses if (path.name, function) not in PROGRESS_CLOCKS]
    assert timers == [], f"{timers}: time in engine/bench/timing.py (time_ms, StepClock, median_ms)"


@pytest.mark.parametrize("place", sorted(PROGRESS_CLOCKS), ids=lambda place: f"{place[0]}:{place[1]}")
def test_each_progress_clock_is_still_read(place):
    # An exception whose clock reads are gone must go too: a timer added to that function later would pass unseen.
    name, function = place
    assert any(where == function for where, _ in wall_clock_uses(BENCH / name)), place


def test_the_scan_sees_a_wall_clock(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import time as clock\nfrom time import monotonic, sleep\nimport datetime\n\n"
                      "def step():\n    start = clock.perf_counter()\n    sleep(0)\n    return clock.time() - start\n\n"
                      "date = datetime.datetime.now()\n")
    assert wall_clock_uses(sample) == [("<module>", "sample.py:2 from time import monotonic"),
                                       ("step", "sample.py:6 time.perf_counter"), ("step", "sample.py:8 time.time")]


def test_the_scan_sees_a_timer(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("from triton.testing import do_bench\nimport threading, torch\ne = torch.cuda.Event(True)\n"
                      "t = threading.Event()\n")
    assert len(timer_uses(sample)) == 2


@pytest.mark.parametrize("leaves, rep_ms, expected", [(None, None, {}), ([1], 25, {"rep": 25})])
def test_median_ms_asks_do_bench_for_the_median(monkeypatch, leaves, rep_ms, expected):
    calls = []

    def fake_do_bench(fn, grad_to_none=None, return_mode="mean", **options):
        calls.append((fn, grad_to_none, return_mode, options))
        return 1.5

    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    monkeypatch.setattr(timing, "call_ms", lambda step, leaves: timing.SLOW_STEP_MS - 0.001)
    step = lambda: None  # noqa: E731
    assert timing.median_ms(step, leaves, rep_ms) == 1.5
    assert calls == [(step, leaves, "median", expected)]


@pytest.mark.parametrize("slow_ms", [timing.SLOW_STEP_MS, 4000.0])
def test_a_slow_step_is_timed_by_a_few_calls_not_do_bench(monkeypatch, slow_ms):
    # From SLOW_STEP_MS up, do_bench is not called; the result is the median of the SLOW_STEP_CALLS timed calls (a
    # warm-up call first, untimed), each clearing the leaves' gradients.
    monkeypatch.setattr(triton.testing, "do_bench", lambda *args, **kwargs: pytest.fail("do_bench called"))
    times = iter([slow_ms, slow_ms * 3, slow_ms * 1.5, 1.0])
    timed, steps = [], []
    monkeypatch.setattr(timing, "call_ms", lambda step, leaves: timed.append(leaves) or next(times))
    leaves = [object()]
    assert timing.median_ms(lambda: steps.append(1), leaves) == slow_ms * 1.5
    assert len(timed) == timing.SLOW_STEP_CALLS and all(seen is leaves for seen in timed)
    assert len(steps) == 1  # the warm-up; call_ms (faked here) makes the timed calls
