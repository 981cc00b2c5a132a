"""GPU memory per test in a GPU run (tests/gpu/conftest.py). Each test's peak of memory reserved by torch's caching
allocator goes into its report (user_properties, which pytest-xdist carries from the workers), the run ends with the
largest, and the cache is emptied after every test, so workers of one run (`-n`) do not keep the blocks their earlier
tests freed while another worker's test needs them. Tests that hold tens of GB are marked GPU_MEMORY_GROUP: with
`--dist loadgroup` they run one after another on one worker, the others spread over the rest."""

import pytest

PEAK_PROPERTY = "peak_gpu_reserved_bytes"
# pytest-xdist's group mark: under --dist loadgroup one worker runs every test of the group (ignored otherwise).
GPU_MEMORY_GROUP = pytest.mark.xdist_group("gpu-memory")
# Tests the end of the run lists.
LISTED = 12


def largest_peaks(reports, count: int = LISTED) -> list[tuple[int, str]]:
    """(peak bytes, node id) of the `count` tests with the largest peaks, largest first. The peak is recorded in the
    test's teardown, so its teardown report holds it (a worker sends each report when it is made); a test met in
    several reports counts once."""
    peaks: dict[str, int] = {}
    for report in reports:
        for name, value in report.user_properties:
            if name == PEAK_PROPERTY:
                peaks[report.nodeid] = max(value, peaks.get(report.nodeid, 0))
    return sorted(((value, nodeid) for nodeid, value in peaks.items()), key=lambda peak: (-peak[0], peak[1]))[:count]


def summary_lines(reports, count: int = LISTED) -> list[str]:
    """The run's closing lines: the largest peaks, one test a line (none without peaks)."""
    peaks = largest_peaks(reports, count)
    if not peaks:
        return []
    return [f"largest GPU memory peaks (reserved by the caching allocator), {len(peaks)} tests:",
            *(f"{value / 2**30:8.2f} GiB  {nodeid}" for value, nodeid in peaks)]  # fmt: skip
