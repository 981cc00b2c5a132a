"""GPU runs (`pytest -m gpu tests/gpu`, in their own session): a test that skips fails, and so does a test module
skipped while it is collected (a module-level pytest.importorskip or pytest.skip) in a run whose -m selects gpu
tests, so a run that did not exercise its kernels (kernels imported in interpreter mode, a missing dependency) is
never green. A run without a CUDA device stops before collection (tests/conftest.py). Each test's GPU memory peak is
reported and its cached memory released after it (gpu_memory)."""

import gc

import pytest
import torch
from gpu_memory import PEAK_PROPERTY, summary_lines
from gpu_session import selects_gpu_tests


def skip_reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    return report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = skip_reason(report)
        report.outcome = "failed"
        report.longrepr = f"{item.nodeid} skipped on a GPU run ({reason}): every GPU test must run"


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
    for line in summary_lines(reports):
        terminalreporter.write_line(line)
