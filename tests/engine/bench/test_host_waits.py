"""engine/bench/host_waits.py: torch's sync warnings recorded with the frames that led to them (torch's and the
warnings module's left out, innermost first), every one counted, other warnings still shown; sites ranked.

torch warns at a synchronizing CUDA call only on a GPU (tests/gpu/test_host_syncs_gpu.py runs it there); here the
warning is raised as torch raises it, from code whose frames must be left out or kept."""

import warnings

import pytest

from moe_tune.engine.bench import host_waits
from moe_tune.engine.bench.host_waits import (
    SITE_FRAMES,
    SYNC_WARNING,
    TOP_SITES,
    host_wait_sites,
    recorded_host_waits,
    site_text,
)

# How this file shows in a frame: from the package root in a checkout, its full path when the package is installed.
THIS_FILE = host_waits.frame_text(host_waits.traceback.FrameSummary(__file__, 0, "")).rsplit(":", 1)[0]


def torch_side(call):
    """A function whose frames are torch's own (its code is compiled as a file inside the torch package)."""
    namespace = {}
    source = "def torch_call(call):\n    return call()\n"
    exec(compile(source, str(host_waits._TORCH_ROOT / "_moe_tune_fake.py"), "exec"), namespace)
    return namespace["torch_call"](call)


def syncs(text=SYNC_WARNING):
    warnings.warn(text, UserWarning)


def reads_a_value():
    torch_side(syncs)


def line_of(function, text: str) -> int:
    import inspect

    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, line in enumerate(lines) if text in line)


def test_each_wait_is_recorded_with_its_callers_innermost_first_and_torch_left_out():
    with recorded_host_waits() as waits:
        for _ in range(3):
            reads_a_value()  # the same line three times: all three count ("always", not once per line)
        syncs(f"{SYNC_WARNING} (Triggered internally at /pytorch/c10/cuda/CUDAFunctions.cpp:171.)")  # as torch says it
    assert len(waits) == 4
    first = waits[0]
    assert first[0] == f"{THIS_FILE}:{line_of(syncs, 'warnings.warn')} (syncs)"
    # torch_call's frame (a torch file) between syncs and torch_side is left out.
    assert [frame.rsplit(" ", 1)[1] for frame in first] == [
        "(syncs)", "(torch_side)", "(reads_a_value)",
        "(test_each_wait_is_recorded_with_its_callers_innermost_first_and_torch_left_out)",
    ]  # fmt: skip
    assert first[2] == f"{THIS_FILE}:{line_of(reads_a_value, 'torch_side')} (reads_a_value)"
    assert len(first) == SITE_FRAMES
    assert waits[0] == waits[1] == waits[2] != waits[3]
    frames = [frame for wait in waits for frame in wait]
    assert not any(frame.startswith("engine/bench/host_waits.py") or "warnings.py" in frame for frame in frames)


def test_other_warnings_are_still_shown_and_the_state_is_restored(recwarn):
    before = list(warnings.filters)
    shown_before = warnings.showwarning
    with recorded_host_waits() as waits:
        warnings.warn("something else", UserWarning)
        syncs()
    assert len(waits) == 1
    # recwarn records through its own catch_warnings: the other warning reached it, the sync did not.
    assert [str(w.message) for w in recwarn] == ["something else"]
    assert warnings.filters == before and warnings.showwarning is shown_before


def test_a_wait_with_no_frame_outside_torch():
    stack = [host_waits.traceback.FrameSummary(str(host_waits._TORCH_ROOT / "x.py"), 1, "inner")]
    assert host_waits.caller_frames(stack) == ()
    assert site_text([]) == "(no Python frame outside torch)"
    assert site_text(["a.py:1 (f)", "b.py:2 (g)"]) == "a.py:1 (f) < b.py:2 (g)"


def test_paths_are_shown_from_the_package_root_or_site_packages():
    from moe_tune.engine.bench import steps

    frame = host_waits.traceback.FrameSummary(steps.__file__, 12, "step")
    assert host_waits.frame_text(frame) == "engine/bench/steps.py:12 (step)"
    import deepspeed

    frame = host_waits.traceback.FrameSummary(deepspeed.__file__, 3, "<module>")
    assert host_waits.frame_text(frame) == "deepspeed/__init__.py:3 (<module>)"
    frame = host_waits.traceback.FrameSummary("/elsewhere/x.py", 5, "f")
    assert host_waits.frame_text(frame) == "/elsewhere/x.py:5 (f)"


def test_sites_are_counted_and_ranked_most_waits_first():
    a, b, c = ("a.py:1 (f)",), ("b.py:2 (g)", "a.py:9 (h)"), ("c.py:3 (k)",)
    assert host_wait_sites([a, b, b, c, a, b]) == [
        dict(count=3, frames=list(b)), dict(count=2, frames=list(a)), dict(count=1, frames=list(c))
    ]  # fmt: skip
    # Ties keep the order first seen; at most TOP_SITES sites.
    many = [(f"f{i}.py:1 (f)",) for i in range(TOP_SITES + 4)]
    sites = host_wait_sites(many)
    assert [site["frames"][0] for site in sites] == [f"f{i}.py:1 (f)" for i in range(TOP_SITES)]
    assert host_wait_sites([]) == []


@pytest.mark.parametrize("sites", [[], [dict(count=2, frames=["engine/bench/steps.py:144 (step)"])]],
                         ids=["none", "one"])  # fmt: skip
def test_the_table_lists_each_site(sites):
    from rich.console import Console

    from moe_tune.cli.profile_steps import host_waits_table

    console = Console(record=True, width=200)
    console.print(host_waits_table(dict(host_waits=sites)))
    text = console.export_text()
    assert ("engine/bench/steps.py:144 (step)" in text) is bool(sites)
