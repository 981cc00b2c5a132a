"""GPU runs (`pytest -m gpu tests/gpu`, in their own session): a test that skips fails, and so does a test module
skipped while it is collected (a module-level pytest.importorskip or pytest.skip) in a run whose -m selects gpu
tests, so a run that did not exercise its kernels (kernels imported in interpreter mode, a missing dependency) is
never green. A run without a CUDA device stops before collection (tests/conftest.py). Each test's GPU memory peak is
reported and its cached memory released after it (gpu_memory).

A test whose CUDA error leaves the process's CUDA context unusable (an illegal memory access: every later CUDA call
there fails alike) fails on its own; a run in one process stops there, and an xdist worker fails each later test
of its share at once as not run, naming that test, where the test's own error would mislead. (The worker is not
ended: xdist 3.8 replaces a crashed worker under `--dist load` only; under loadgroup the run hangs.) The run ends
with the number of tests not run so, and writes their ids, one a line, to the file MOE_TUNE_GPU_RERUN names
(.device/task.sh runs them again in fresh processes).

With MOE_TUNE_GPU_PASSED naming a file, each test that passes has its id added to it as it passes, and a run leaves
out the tests the file names: .device/task.sh keeps one per tree and Triton version, so that a call its time limit
stopped is finished by the next one on the same machine."""

import gc
import os
import re
from pathlib import Path

import pytest
import torch
from gpu_memory import PEAK_PROPERTY, summary_lines
from gpu_session import selects_gpu_tests


def skip_reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    return report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)


# CUDA errors after which the context is unusable (the driver's words, as torch raises them).
STICKY_CUDA_ERRORS = ("an illegal memory access", "unspecified launch failure", "misaligned address",
                      "device-side assert triggered", "an illegal instruction")  # fmt: skip


def sticky_cuda_error(report: pytest.TestReport) -> str | None:
    """The sticky CUDA error a failed report shows, or None."""
    if not report.failed:
        return None
    text = str(report.longrepr)
    return next((error for error in STICKY_CUDA_ERRORS if error in text), None)


# Where a run writes the ids of the tests its processes did not run after losing their CUDA context.
RERUN_ENV = "MOE_TUNE_GPU_RERUN"
NOT_RUN = "not run: this process lost its CUDA context in "
# The test (and its error) in which this process lost its CUDA context, once it has.
_lost_context: list[str] = []
# Where a run adds the id of each test that passes, and finds those that passed before (left out of the run).
PASSED_ENV = "MOE_TUNE_GPU_PASSED"
# Tests whose call passed, until their teardown does too; the error of a failed write to PASSED_ENV's file.
_call_passed: set[str] = set()
_passed_write_error: list[str] = []


def plain_nodeid(nodeid: str) -> str:
    """A test's id without the `@group` suffix that xdist's loadgroup gives the tests of an xdist_group."""
    return re.sub(r"@[\w.-]+$", "", nodeid)


def passed_before() -> set[str]:
    path = os.environ.get(PASSED_ENV)
    if not path or not os.path.isfile(path):
        return set()
    return {plain_nodeid(line) for line in Path(path).read_text().splitlines() if line}


def pytest_collection_modifyitems(config, items):
    passed = passed_before()
    done = [item for item in items if plain_nodeid(item.nodeid) in passed]
    if done:
        config.hook.pytest_deselected(items=done)
        items[:] = [item for item in items if plain_nodeid(item.nodeid) not in passed]


def pytest_runtest_logreport(report):
    # In the controlling process only (xdist's workers report to it), once setup, call and teardown have passed.
    path = os.environ.get(PASSED_ENV)
    if not path or os.environ.get("PYTEST_XDIST_WORKER") or not report.passed:
        return
    if report.when == "call":
        _call_passed.add(report.nodeid)
    elif report.when == "teardown" and report.nodeid in _call_passed and not _passed_write_error:
        try:
            with open(path, "a", encoding="utf-8") as passed:
                passed.write(f"{plain_nodeid(report.nodeid)}\n")
        except OSError as err:
            _passed_write_error.append(f"{PASSED_ENV} ({path!r}): cannot add to it ({err.strerror})")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = skip_reason(report)
        report.outcome = "failed"
        report.longrepr = f"{item.nodeid} skipped on a GPU run ({reason}): every GPU test must run"
    error = sticky_cuda_error(report)
    if error and not _lost_context:
        _lost_context.append(f"{item.nodeid} ({error})")
        if not os.environ.get("PYTEST_XDIST_WORKER"):
            item.session.shouldstop = f"{item.nodeid}: CUDA error ({error}): the process's CUDA context is lost"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if _lost_context:
        pytest.fail(NOT_RUN + _lost_context[0], pytrace=False)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    # A CPU run on a GPU machine collects tests/gpu too, then deselects it: a module it skips is no failure there.
    if report.skipped and selects_gpu_tests(collector.config.option.markexpr or ""):
        reason = skip_reason(report)
        report.outcome = "failed"
        report.longrepr = f"{report.nodeid} skipped at collection on a GPU run ({reason}): every GPU test must run"


@pytest.fixture(autouse=True)
def gpu_memory_per_test(request):
    """The test's peak of reserved memory into its report; the caching allocator's free blocks back to the device
    after it. (tests/test_gpu_session.py runs this conftest without CUDA: then nothing to measure.)"""
    if not torch.cuda.is_available():
        yield
        return
    torch.cuda.reset_peak_memory_stats()
    yield
    request.node.user_properties.append((PEAK_PROPERTY, torch.cuda.max_memory_reserved()))
    gc.collect()
    torch.cuda.empty_cache()


def pytest_terminal_summary(terminalreporter):
    reports = [report for reports in terminalreporter.stats.values() for report in reports
               if isinstance(report, pytest.TestReport)]  # fmt: skip
    for line in _passed_write_error:
        terminalreporter.write_line(line)
    if passed := passed_before():
        terminalreporter.write_line(f"{PASSED_ENV} ({os.environ[PASSED_ENV]!r}) names {len(passed)} passed tests, "
                                    "this run's included: a run leaves them out")  # fmt: skip
    for line in summary_lines(reports):
        terminalreporter.write_line(line)
    not_run = sorted({report.nodeid for report in reports if report.failed and NOT_RUN in str(report.longrepr)})
    rerun = os.environ.get(RERUN_ENV)
    where = f" (set {RERUN_ENV} to have their ids written)"
    if rerun:
        try:
            Path(rerun).write_text("".join(f"{nodeid}\n" for nodeid in not_run))
            where = f": their ids are in {rerun}"
        except OSError as err:
            where = ""
            terminalreporter.write_line(f"{RERUN_ENV} ({rerun!r}): cannot write there ({err.strerror})")
    if not_run:
        terminalreporter.write_line(f"{len(not_run)} tests not run after their process lost its CUDA context{where}")
