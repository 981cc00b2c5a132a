"""GPU runs are never green by accident: a run that asks for the GPU tests on a machine without CUDA stops with one
line (tests/conftest.py), in a GPU run a test skipped when it runs or a module skipped while it is collected fails
(tests/gpu/conftest.py), and every gpu test is in tests/gpu, marked gpu as a whole module, so that
`pytest -m gpu tests/gpu` collects them all."""

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_session import GPU_MARKER, GPU_TESTS, NO_CUDA, names_gpu_tests, selects_gpu_tests

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
# pytest's exit code for a usage error (pytest.UsageError), which the refusal raises.
USAGE_ERROR = 4


def pytest_env() -> dict[str, str]:
    """This environment without CUDA devices and without the outer run's PYTEST_* variables (PYTEST_ADDOPTS,
    xdist's)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


@pytest.mark.parametrize("markexpr, is_gpu_run", [
    ("gpu", True),
    ("gpu and slow", True),  # selects gpu tests only when they are also slow
    ("gpu or dist", True),
    ("gpu and not slow", True),
    ("not not gpu", True),
    ("", False),
    ("not gpu", False),  # the default addopts
    ("not dist", False),  # gpu plays no part
    ("slow or dist", False),
    ("gpu and not gpu", False),
])
def test_marker_expressions_that_ask_for_gpu_tests(markexpr, is_gpu_run):
    assert selects_gpu_tests(markexpr) is is_gpu_run


# Where pytest is started from: the repository's root or tests/gpu.
START = {"root": ROOT, "tests/gpu": GPU_TESTS}


@pytest.mark.parametrize("args, start, is_gpu_run", [
    ("tests/gpu", "root", True),
    ("tests/gpu/", "root", True),
    ("tests/gpu/test_moe_gpu.py::test_moe_forward[E8]", "root", True),
    ("tests/ops tests/gpu/test_moe_gpu.py", "root", True),
    (".", "tests/gpu", True),
    ("test_moe_gpu.py", "tests/gpu", True),
    ("tests", "root", False),  # the CPU suite: tests/gpu lies inside the path given, it is not the path
    ("", "root", False),
    ("tests/ops tests/test_gpu_session.py", "root", False),
    ("tests/gpu_session.py", "root", False),  # begins with tests/gpu as a string, not as a folder
    ("../gpu_session.py", "tests/gpu", False),
])
def test_paths_that_ask_for_gpu_tests(args, start, is_gpu_run):
    assert names_gpu_tests(args.split(), START[start]) is is_gpu_run


def test_gpu_run_without_cuda_stops_with_one_line():
    # The README's GPU command with no CUDA device visible (so also on a GPU machine): refused before collection.
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-m", "gpu", "tests/gpu"],
                         cwd=ROOT, env=pytest_env(), capture_output=True, text=True, timeout=120)
    assert run.returncode == USAGE_ERROR, run.stdout + run.stderr
    assert [line for line in run.stderr.splitlines() if line.strip()] == [f"ERROR: {NO_CUDA}"]
    assert "no tests ran" not in run.stdout


@pytest.fixture
def gpu_test_folder(tmp_path: Path) -> Path:
    """tests/gpu/conftest.py in a folder of its own with the gpu marker registered (no ini file of this repository),
    and gpu test modules: one skipped at collection, one with a passing, a skipping and an xfailing test."""
    with_gpu_conftest(tmp_path)
    (tmp_path / "test_module_skipped.py").write_text(
        "import pytest\npytestmark = pytest.mark.gpu\npytest.importorskip('moe_tune_no_such_module')\n\n"
        "def test_never_collected():\n    pass\n")
    (tmp_path / "test_outcomes.py").write_text(
        "import pytest\npytestmark = pytest.mark.gpu\n\n"
        "def test_passes():\n    pass\n\n"
        "def test_skips():\n    pytest.skip('no kernel')\n\n"
        "@pytest.mark.xfail(reason='known', strict=True)\ndef test_xfails():\n    assert False\n")
    return tmp_path


def with_gpu_conftest(folder: Path) -> Path:
    """`folder` with a copy of tests/gpu/conftest.py and an ini file registering the gpu marker."""
    shutil.copy(GPU_TESTS / "conftest.py", folder / "conftest.py")
    (folder / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a CUDA device\n")
    return folder


def run_pytest_in(folder: Path, markexpr: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    """pytest -m markexpr ARGS on `folder`, with `folder` and tests/ (the copied conftest imports gpu_session and
    gpu_memory from there) on the path and `env` set."""
    path = os.pathsep.join([str(folder), str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])])
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--continue-on-collection-errors",
                           "-rfE", "-m", markexpr, *args, str(folder)], cwd=folder,
                          env=dict(pytest_env(), **env, PYTHONPATH=path), capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def test_gpu_run_fails_a_skipped_test_and_a_module_skipped_at_collection(gpu_test_folder):
    run = run_pytest_in(gpu_test_folder, "gpu")
    out = run.stdout
    assert run.returncode == pytest.ExitCode.TESTS_FAILED, out + run.stderr
    assert "1 failed, 1 passed, 1 xfailed, 1 error" in out, out
    assert ("test_module_skipped.py skipped at collection on a GPU run (Skipped: could not import "
            "'moe_tune_no_such_module'") in out
    assert "test_outcomes.py::test_skips skipped on a GPU run (Skipped: no kernel): every GPU test must run" in out


def test_a_cpu_run_keeps_a_gpu_module_skipped_at_collection_a_skip(gpu_test_folder):
    # The CPU suite on a GPU machine: tests/gpu is collected, then deselected by the default -m "not gpu".
    run = run_pytest_in(gpu_test_folder, "not gpu")
    assert "1 skipped, 3 deselected" in run.stdout and "error" not in run.stdout, run.stdout + run.stderr


# A plugin that makes this machine look like a CUDA one to tests/gpu/conftest.py's memory fixture: each test sets the
# peak it "reserved"; every empty_cache call is written to the file EMPTIED names.
FAKE_CUDA_MEMORY = """import os
import torch

torch.cuda.is_available = lambda: True
torch.cuda.reset_peak_memory_stats = lambda *args, **kwargs: setattr(torch.cuda, "fake_peak", 0)
torch.cuda.max_memory_reserved = lambda *args, **kwargs: torch.cuda.fake_peak


def empty_cache():
    with open(os.environ["EMPTIED"], "a") as log:
        log.write("emptied\\n")


torch.cuda.empty_cache = empty_cache
"""


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one process", "two xdist workers"])
def test_gpu_run_ends_with_the_largest_memory_peaks(tmp_path, workers):
    """Each test's peak reaches the run's end (through xdist's workers too), largest first, and the cache is emptied
    after every test."""
    with_gpu_conftest(tmp_path)
    (tmp_path / "fake_cuda_memory.py").write_text(FAKE_CUDA_MEMORY)
    gib = {"small": 1, "large": 40, "middle": 12}
    (tmp_path / "test_peaks.py").write_text("import pytest\nimport torch\npytestmark = pytest.mark.gpu\n" + "".join(
        f"\ndef test_{name}():\n    torch.cuda.fake_peak = {size} * 2**30\n" for name, size in gib.items()))
    emptied = tmp_path / "emptied.log"
    run = run_pytest_in(tmp_path, "gpu", "-p", "fake_cuda_memory", *workers, EMPTIED=str(emptied))
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    start = lines.index("largest GPU memory peaks (reserved by the caching allocator), 3 tests:")
    assert [line.split() for line in lines[start + 1:start + 4]] == [
        ["40.00", "GiB", "test_peaks.py::test_large"], ["12.00", "GiB", "test_peaks.py::test_middle"],
        ["1.00", "GiB", "test_peaks.py::test_small"]]  # fmt: skip
    assert emptied.read_text().split() == ["emptied"] * 3


def test_largest_peaks_count_a_test_once_and_order_ties_by_name():
    from types import SimpleNamespace

    from gpu_memory import PEAK_PROPERTY, largest_peaks, summary_lines

    def report(nodeid, when, *peaks):
        return SimpleNamespace(nodeid=nodeid, when=when, user_properties=[(PEAK_PROPERTY, p) for p in peaks])

    reports = [report("a", "setup"), report("a", "call"), report("a", "teardown", 5), report("b", "teardown", 7),
               report("c", "teardown", 5), report("d", "teardown", 1), report("b", "teardown", 3),
               SimpleNamespace(nodeid="e", when="teardown", user_properties=[("other", 99)])]  # fmt: skip
    assert largest_peaks(reports) == [(7, "b"), (5, "a"), (5, "c"), (1, "d")]
    assert largest_peaks(reports, count=2) == [(7, "b"), (5, "a")]
    assert summary_lines([report("a", "call")]) == []


def gpu_marks(tree: ast.AST) -> list[int]:
    """Lines of every `mark.gpu` in a parsed file (pytest.mark.gpu however it is applied)."""
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr == GPU_MARKER
            and isinstance(node.value, ast.Attribute) and node.value.attr == "mark"]


def marks_module_gpu(tree: ast.Module) -> bool:
    """Whether a module-level `pytestmark = ...` holds mark.gpu."""
    return any(isinstance(node, ast.Assign) and gpu_marks(node.value)
               and any(isinstance(target, ast.Name) and target.id == "pytestmark" for target in node.targets)
               for node in tree.body)


def test_gpu_tests_are_in_tests_gpu():
    outside = [f"{path.relative_to(ROOT)}:{line}" for path in sorted(TESTS.rglob("*.py"))
               if GPU_TESTS not in path.parents for line in gpu_marks(ast.parse(path.read_text()))]
    assert outside == [], f"gpu tests outside tests/gpu, which pytest -m gpu tests/gpu does not collect: {outside}"


def test_every_gpu_test_file_is_marked_gpu_as_a_whole():
    unmarked = [path.name for path in sorted(GPU_TESTS.glob("test_*.py"))
                if not marks_module_gpu(ast.parse(path.read_text()))]
    assert unmarked == [], f"tests/gpu files without pytestmark = pytest.mark.gpu (-m gpu deselects them): {unmarked}"


@pytest.mark.parametrize("source, lines, is_module_marked", [
    ("import pytest\n@pytest.mark.gpu\ndef test_a(): pass\n", [2], False),
    ("import pytest\npytestmark = [pytest.mark.gpu, pytest.mark.slow]\n", [2], True),
    ("import pytest\npytestmark = pytest.mark.gpu\n", [2], True),
    ("import pytest\npytestmark = pytest.mark.slow\ngpu = 'pytest.mark.gpu'\n", [], False),
], ids=["decorator", "module list", "module mark", "none"])
def test_the_scan_sees_a_gpu_mark(source, lines, is_module_marked):
    tree = ast.parse(source)
    assert gpu_marks(tree) == lines and marks_module_gpu(tree) is is_module_marked


LOSES_THE_CONTEXT = """import pytest
pytestmark = pytest.mark.gpu


def test_a_loses_the_context():
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_b_fails_alone():
    raise RuntimeError("CUDA error: out of memory")


@pytest.mark.parametrize("i", range(6))
def test_later(i):
    pass
"""


@pytest.mark.parametrize("workers", [[], ["-n", "1", "--dist", "load"], ["-n", "1", "--dist", "loadgroup"]],
                         ids=["one process", "an xdist worker, load", "an xdist worker, loadgroup"])  # fmt: skip
def test_a_lost_cuda_context_fails_its_test_and_names_the_tests_it_kept_from_running(tmp_path, workers):
    """An illegal memory access poisons the process's CUDA context: the test fails on its own; in one process the run
    stops there, naming it; under xdist (either distribution the GPU runs use; a crashed worker hangs loadgroup) the
    worker's later tests fail at once as not run, naming it, and their ids go to MOE_TUNE_GPU_RERUN's file."""
    import re

    with_gpu_conftest(tmp_path)
    (tmp_path / "test_context.py").write_text(LOSES_THE_CONTEXT)
    rerun = tmp_path / "rerun.txt"
    run = run_pytest_in(tmp_path, "gpu", "-rA", *workers, MOE_TUNE_GPU_RERUN=str(rerun))
    out = run.stdout
    outcomes = {nodeid: outcome for outcome, nodeid in re.findall(r"^(PASSED|FAILED|ERROR) (test_context\.py::\S+)",
                                                                 out, re.MULTILINE)}  # fmt: skip
    not_run = rerun.read_text().splitlines()
    assert outcomes["test_context.py::test_a_loses_the_context"] == "FAILED", out
    if not workers:
        assert run.returncode == pytest.ExitCode.INTERRUPTED, out + run.stderr
        assert list(outcomes) == ["test_context.py::test_a_loses_the_context"] and not_run == []
        assert ("Interrupted: test_context.py::test_a_loses_the_context: CUDA error (an illegal memory access): the "
                "process's CUDA context is lost") in out  # fmt: skip
        return
    assert run.returncode == pytest.ExitCode.TESTS_FAILED, out + run.stderr
    everything = ["test_context.py::test_a_loses_the_context", "test_context.py::test_b_fails_alone",
                  *(f"test_context.py::test_later[{i}]" for i in range(6))]  # fmt: skip
    # One worker runs them in file order: every test after the first is not run (test_b's own error included).
    assert outcomes == dict.fromkeys(everything[:1], "FAILED") | dict.fromkeys(everything[1:], "ERROR"), out
    assert not_run == sorted(everything[1:])
    # Once in each test's error section; the short summary repeats it, cut to the terminal's width outside CI.
    sections = out.split("short test summary info")[0]
    assert sections.count("not run: this process lost its CUDA context in test_context.py::test_a_loses_the_context "
                          "(an illegal memory access)") == len(not_run)  # fmt: skip
    assert f"{len(not_run)} tests not run after their process lost its CUDA context: their ids are in {rerun}" in out


def test_a_rerun_file_that_cannot_be_written_is_one_line_at_the_end(tmp_path):
    with_gpu_conftest(tmp_path)
    (tmp_path / "test_context.py").write_text(LOSES_THE_CONTEXT)
    run = run_pytest_in(tmp_path, "gpu", "-n", "1", MOE_TUNE_GPU_RERUN=str(tmp_path))
    out = run.stdout
    assert run.returncode == pytest.ExitCode.TESTS_FAILED and "INTERNALERROR" not in out + run.stderr, out
    assert f"MOE_TUNE_GPU_RERUN ({str(tmp_path)!r}): cannot write there (Is a directory)" in out
    assert "7 tests not run after their process lost its CUDA context\n" in out


def test_another_cuda_error_fails_its_test_alone(tmp_path):
    with_gpu_conftest(tmp_path)
    (tmp_path / "test_context.py").write_text(LOSES_THE_CONTEXT.replace("an illegal memory access was encountered",
                                                                        "out of memory"))  # fmt: skip
    rerun = tmp_path / "rerun.txt"
    run = run_pytest_in(tmp_path, "gpu", "-n", "1", MOE_TUNE_GPU_RERUN=str(rerun))
    assert "2 failed, 6 passed" in run.stdout and rerun.read_text() == "", run.stdout


PASSES_IN_PART = """import pytest
pytestmark = pytest.mark.gpu


def test_passes():
    pass


def test_fails():
    assert False


@pytest.mark.xdist_group("big")
@pytest.mark.parametrize("i", range(3))
def test_grouped(i):
    pass
"""


@pytest.mark.parametrize("workers", [[], ["-n", "2", "--dist", "loadgroup"]],
                         ids=["one process", "two xdist workers, loadgroup"])  # fmt: skip
def test_a_second_run_leaves_out_the_tests_that_passed(tmp_path, workers):
    """MOE_TUNE_GPU_PASSED: each passed test's id (without loadgroup's `@big`) is added as it passes; the next run
    leaves those out and runs the failed one again."""
    with_gpu_conftest(tmp_path)
    (tmp_path / "test_part.py").write_text(PASSES_IN_PART)
    passed = tmp_path / "passed.txt"
    first = run_pytest_in(tmp_path, "gpu", *workers, MOE_TUNE_GPU_PASSED=str(passed))
    assert "1 failed, 4 passed" in first.stdout, first.stdout + first.stderr
    ids = sorted(["test_part.py::test_passes", *(f"test_part.py::test_grouped[{i}]" for i in range(3))])
    assert sorted(passed.read_text().splitlines()) == ids
    second = run_pytest_in(tmp_path, "gpu", *workers, MOE_TUNE_GPU_PASSED=str(passed))
    # xdist's workers deselect: its controller counts the tests it gets.
    assert ("2 workers [1 item]" if workers else "1 failed, 4 deselected") in second.stdout, second.stdout
    assert "test_part.py::test_fails" in second.stdout and "test_passes PASSED" not in second.stdout
    assert f"MOE_TUNE_GPU_PASSED ({str(passed)!r}) names 4 passed tests, this run's included" in second.stdout
    assert sorted(passed.read_text().splitlines()) == ids


def test_a_passed_file_that_cannot_be_added_to_is_one_line_at_the_end(tmp_path):
    with_gpu_conftest(tmp_path)
    (tmp_path / "test_part.py").write_text(PASSES_IN_PART)
    run = run_pytest_in(tmp_path, "gpu", "-n", "1", MOE_TUNE_GPU_PASSED=str(tmp_path))
    assert "1 failed, 4 passed" in run.stdout and "INTERNALERROR" not in run.stdout + run.stderr, run.stdout
    assert f"MOE_TUNE_GPU_PASSED ({str(tmp_path)!r}): cannot add to it (Is a directory)" in run.stdout
