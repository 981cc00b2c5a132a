"""GPU runs (`pytest -m gpu tests/gpu`, in their own session): a test that skips fails, so a run that did not
exercise its kernels (no CUDA device, kernels imported in interpreter mode, a missing dependency) is never green."""

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"{item.nodeid} skipped on a GPU run ({reason}): every GPU test must run"
