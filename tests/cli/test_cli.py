"""The command line: exit codes, one-line errors without tracebacks, and what validate and schema print."""

import json
import subprocess
import sys

import pytest
import yaml
from typer.testing import CliRunner

from moe_tune.cli import app

runner = CliRunner()


def test_validate_prints_resolved_profile():
    result = runner.invoke(app, ["validate", "tiny", "--set", "train.lr=0.002"])
    assert result.exit_code == 0, result.output
    resolved = yaml.safe_load(result.stdout)
    assert resolved["train"]["lr"] == 0.002
    # Defaults are filled in.
    assert resolved["parallel"]["zero_stage"] == 3


def test_validate_bad_profile_exits_2_with_one_line_per_problem(tmp_path):
    result = runner.invoke(app, ["validate", "tiny", "--set", "model.moe.top_k=99", "--set", "train.lr=-1"])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert lines == [
        "error: model.moe.top_k (99) must be <= model.moe.num_experts (8)",
        "error: train.lr (-1): input should be greater than 0",
    ]


def test_schema_is_json():
    result = runner.invoke(app, ["schema"])
    assert result.exit_code == 0
    assert json.loads(result.stdout)["title"] == "JobProfile"


def test_finetune_bad_input_has_no_traceback(tmp_path, child_env):
    # A real process, as a user runs it: stderr must hold only the one-line error.
    missing = tmp_path / "nope.yaml"
    proc = subprocess.run(
        [sys.executable, "-m", "moe_tune", "finetune", str(missing)], capture_output=True, text=True, timeout=120,
        env=child_env,
    )
    assert proc.returncode == 2
    from moe_tune.profiles import shipped_profiles

    assert "tiny" in shipped_profiles() and "tiny-vl" in shipped_profiles()
    shipped = ", ".join(shipped_profiles())
    assert proc.stderr.strip() == f"error: {missing}: no such file, nor a shipped profile (shipped: {shipped})"
    assert "Traceback" not in proc.stderr + proc.stdout


def test_finetune_bad_dataset_record_names_file_and_line(tmp_path, child_env):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "fine"}\n{"txt": "typo"}\nnot json\n')
    proc = subprocess.run(
        [sys.executable, "-m", "moe_tune", "finetune", "tiny", "--set", f"data.path={data}",
         "--set", f"output.dir={tmp_path / 'out'}", "--quiet"],
        capture_output=True, text=True, timeout=300, env=child_env,
    )
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: {data}:2: a record needs a 'text' or a 'messages' key, or alpaca's 'instruction' and 'output', "
        "or sharegpt's 'conversations' (has: ['txt'])",
        f"error: {data}:3: invalid JSON (Expecting value at column 1)",
    ]
    assert "Traceback" not in proc.stderr
    # Nothing was trained, so no checkpoint exists.
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_finetune_nccl_without_a_gpu_is_one_line_and_exit_2(tmp_path, child_env):
    # No GPU visible to the child, so this runs the same on a GPU machine.
    proc = subprocess.run(
        [sys.executable, "-m", "moe_tune", "finetune", "tiny", "--set", "parallel.backend=nccl",
         "--set", f"output.dir={tmp_path / 'out'}", "--quiet"],
        capture_output=True, text=True, timeout=300, env=dict(child_env, CUDA_VISIBLE_DEVICES=""),
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (
        "error: parallel.backend ('nccl') needs a CUDA GPU and NCCL: this machine has no CUDA GPU (use auto or gloo)"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "backend, on_gpu, has_nccl, expected",
    [("auto", True, True, "nccl"), ("auto", False, False, "gloo"), ("gloo", True, True, "gloo"),
     ("nccl", True, True, "nccl"), ("nccl", True, False, "torch here is built without NCCL"),
     ("nccl", False, True, "this machine has no CUDA GPU")],
)  # fmt: skip
def test_backend_resolution(backend, on_gpu, has_nccl, expected):
    from moe_tune.engine.train.distributed import resolve_backend
    from moe_tune.profiles import ProfileError

    if expected in ("nccl", "gloo"):
        assert resolve_backend(backend, on_gpu, has_nccl) == expected
    else:
        with pytest.raises(ProfileError) as err:
            resolve_backend(backend, on_gpu, has_nccl)
        assert err.value.problems == [
            f"parallel.backend ('nccl') needs a CUDA GPU and NCCL: {expected} (use auto or gloo)"
        ]


def test_finetune_that_diverges_stops_with_one_line_and_exit_1(tmp_path, child_env):
    # lr 1e30: step 2's loss is not finite (tests/engine/test_train.py); the run stops before saving step 2.
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "moe_tune", "finetune", "tiny", "--quiet", "--set", f"output.dir={out}",
         "--set", "train.lr=1e30", "--set", "train.warmup_steps=0", "--set", "output.save_every=1",
         "--set", "data.seq_len=64", "--set", "data.corpus_documents=200"],
        capture_output=True, text=True, timeout=300, env=child_env,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: step 2: loss "), proc.stderr
    assert f"the last checkpoint, {out / 'checkpoints' / 'step-0000001'}, is intact" in errors[0]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("nproc, devices, host_gib, line", [
    (100000, 0, 24, "--nproc (100000) must be at most 48 here: each rank takes at least 0.5 GiB of the host's "
     "24.0 GiB"),
    (49, 0, 24, "--nproc (49) must be at most 48 here"),
    (9, 8, 2048, "--nproc (9) must be at most the 8 CUDA devices here: each rank takes one"),
])  # fmt: skip
def test_more_ranks_than_the_machine_holds_are_refused_before_one_starts(monkeypatch, nproc, devices, host_gib, line):
    import torch

    from moe_tune.engine.parallel import launch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)
    monkeypatch.setattr(launch, "host_memory_bytes", lambda: host_gib * 2**30)
    monkeypatch.setattr(launch, "launch_local", lambda nproc, argv: pytest.fail("a rank started"))
    result = runner.invoke(app, ["finetune", "tiny", "--nproc", str(nproc)])
    assert result.exit_code == 2
    assert result.output.strip().startswith(f"error: {line}") and result.output.count("\n") == 1


def test_the_rank_limits_at_their_edges():
    from moe_tune.engine.parallel.launch import RANK_HOST_BYTES, nproc_problems

    assert nproc_problems(8, 8, 10**15) == [] and nproc_problems(48, 0, 48 * RANK_HOST_BYTES) == []
    assert nproc_problems(49, 0, 48 * RANK_HOST_BYTES) and nproc_problems(2, 0, None) == []


def test_finetune_with_ranks_exits_as_the_failed_rank(monkeypatch):
    from moe_tune.engine.parallel import launch

    outcomes = iter([launch.LaunchResult(1, 0, "rank 0 exited with code 1; the other ranks were stopped"),
                     launch.LaunchResult(2, 1, "rank 1 exited with code 2; the other ranks were stopped")])  # fmt: skip
    monkeypatch.setattr(launch, "launch_local", lambda nproc, argv: next(outcomes))
    for code, rank in ((1, 0), (2, 1)):
        result = runner.invoke(app, ["finetune", "tiny", "--nproc", "2"])
        assert result.exit_code == code
        assert result.output.strip() == f"error: rank {rank} exited with code {code}; the other ranks were stopped"


def run_main(monkeypatch, capsys, args):
    """The installed command's entry point (moe_tune.cli.main) on `args`: (exit code, stdout, stderr). The SIGINT
    handler main leaves for the process's end is this test's only."""
    import signal

    from moe_tune.cli import main

    monkeypatch.setattr(sys, "argv", ["moe-tune", *args])
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(SystemExit) as exited:
        try:
            main()
        finally:
            signal.signal(signal.SIGINT, handler)
    captured = capsys.readouterr()
    return exited.value.code, captured.out, captured.err


@pytest.mark.parametrize("args, line", [
    (["finetune", "tiny", "--bogus"], "No such option: --bogus (see moe-tune finetune --help)"),
    (["bogus"], "No such command 'bogus'. (see moe-tune --help)"),
    (["finetune"], "Missing argument 'profile'. (see moe-tune finetune --help)"),
    (["generate", "x", "--prompt", "y", "--max-new-tokens", "abc"],
     "--max-new-tokens ('abc'): Input should be a valid integer, unable to parse string as an integer (see moe-tune "
     "generate --help)"),
    (["finetune", "tiny", "--nproc=0"], "--nproc ('0'): Input should be greater than or equal to 1 (see moe-tune "
     "finetune --help)"),
    (["onboard", "x", "--steps", "-1"], "--steps ('-1'): "),
    # Given twice, click takes the last value: the line names it.
    (["generate", "x", "--prompt", "y", "--max-new-tokens", "3", "--max-new-tokens", "abc"],
     "--max-new-tokens ('abc'): Input should be a valid integer"),
    (["generate", "x", "--prompt", "y", "--max-new-tokens=3", "--max-new-tokens=-abc"], "--max-new-tokens ('-abc'): "),
    (["generate", "x", "--prompt"], "Option '--prompt' requires an argument."),
])  # fmt: skip
def test_usage_errors_are_one_line_exit_2(monkeypatch, capsys, args, line):
    code, out, err = run_main(monkeypatch, capsys, args)
    assert code == 2 and out == ""
    (printed,) = err.splitlines()
    assert printed.startswith(f"error: {line}"), printed


def test_the_entry_point_keeps_the_commands_exit_codes_and_help(monkeypatch, capsys, tmp_path):
    assert run_main(monkeypatch, capsys, ["validate", "tiny", "--no-data"])[0] == 0
    code, _, err = run_main(monkeypatch, capsys, ["validate", str(tmp_path / "none.yaml")])
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1
    code, out, _ = run_main(monkeypatch, capsys, [])
    assert code == 2 and "Usage: moe-tune" in out and "finetune" in out
    code, out, _ = run_main(monkeypatch, capsys, ["finetune", "--help"])
    assert code == 0 and "--nproc" in out


# The installed `moe-tune` script (pip's console-script wrapper of moe_tune.cli:main), with an import finder that
# meets the first import of TRIGGER with what a Ctrl-C at that moment does (INTERRUPT), then the command's arguments.
ENTRY_SCRIPT = """
import signal, sys
TRIGGER, INTERRUPT = sys.argv.pop(1), sys.argv.pop(1)
# A background job of a non-interactive shell, or nohup, ignores SIGINT; a command in a terminal's foreground takes
# it (set here: a child inherits an ignored SIGINT from the process that starts it, as from a test worker).
signal.signal(signal.SIGINT, signal.SIG_IGN if INTERRUPT == "ignored" else signal.default_int_handler)

class CtrlC:
    def find_spec(self, name, path=None, target=None):
        if name != TRIGGER:
            return None
        sys.meta_path.remove(self)
        if INTERRUPT == "raised":
            raise KeyboardInterrupt
        # The signal's handler runs here; C code that clears the error it is handed (PyErr_Clear) loses it.
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            pass
        return None

sys.meta_path.insert(0, CtrlC())
from moe_tune.cli import main
sys.exit(main())
"""


@pytest.mark.parametrize("trigger, interrupt, code, stdout", [
    ("typer", "raised", 130, ""),  # while the commands import
    ("torch", "raised", 130, ""),
    ("typer", "swallowed", 130, ""),  # the KeyboardInterrupt lost on its way: the signal still stops the command
    ("typer", "ignored", 0, "moe-tune "),  # SIGINT ignored by the shell's choice: the command runs
])  # fmt: skip
def test_ctrl_c_while_the_commands_import_exits_130_without_a_traceback(trigger, interrupt, code, stdout):
    done = subprocess.run([sys.executable, "-c", ENTRY_SCRIPT, trigger, interrupt, "--version"], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert (done.returncode, done.stderr) == (code, ""), done.stderr
    assert done.stdout.startswith(stdout) and (stdout or done.stdout == "")


# A library's teardown at the process's end (an atexit handler) that a Ctrl-C meets, after the command's arguments.
TEARDOWN_SCRIPT = """
import atexit, os, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)

def teardown():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)
    print("teardown finished", flush=True)

atexit.register(teardown)
from moe_tune.cli import main
sys.argv = ["moe-tune", *sys.argv[1:]]
main()
"""


@pytest.mark.parametrize("args, code", [(["--version"], 0), (["validate", "none.yaml"], 2)])
def test_ctrl_c_in_the_teardown_after_a_command_ends_the_process_with_its_code(tmp_path, args, code):
    """A Ctrl-C while the process ends (a tracker's upload, a process group's teardown) ends it at once with the
    command's exit code, its output kept, no KeyboardInterrupt traceback from the teardown."""
    done = subprocess.run([sys.executable, "-c", TEARDOWN_SCRIPT, *args], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)  # fmt: skip
    assert done.returncode == code, done.stderr
    assert "Traceback" not in done.stderr and "KeyboardInterrupt" not in done.stderr
    assert "teardown finished" not in done.stdout
    assert done.stdout.startswith("moe-tune ") if code == 0 else done.stderr.startswith("error: none.yaml")


def test_the_command_listing_wraps_each_commands_summary_as_one_text():
    """`moe-tune --help` lists each command by the first paragraph of its help: on a terminal wide enough, one line
    each, not broken where the docstring's lines end."""
    from typer.main import get_command

    result = runner.invoke(app, ["--help"], env={"COLUMNS": "1000"})
    assert result.exit_code == 0, result.output
    lines = [" ".join(line.strip("│ ").split()) for line in result.output.splitlines()]
    for name, command in get_command(app).commands.items():
        summary = " ".join(command.help.split("\n\n")[0].split())
        assert f"{name} {summary}" in lines, name


def test_validate_notes_the_settings_that_do_nothing():
    result = runner.invoke(app, ["validate", "tiny", "--no-data", "--set", "lora.vision_tower=lora"])
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == ["note: lora.vision_tower is ignored: the model has no vision tower "
                                          "(model.vision)", "tiny: valid (data not read: --no-data)"]


@pytest.mark.parametrize("case", ["file", "under-a-file", "link-to-a-file", "fifo", "in-proc"])
def test_validate_refuses_an_output_dir_finetune_refuses(tmp_path, case):
    import os

    (tmp_path / "afile").write_text("kept\n")
    out = {"file": tmp_path / "afile", "under-a-file": tmp_path / "afile" / "run", "link-to-a-file": tmp_path / "link",
           "fifo": tmp_path / "fifo", "in-proc": "/proc/moe-tune-run"}[case]  # fmt: skip
    if case == "link-to-a-file":
        out.symlink_to(tmp_path / "afile")
    if case == "fifo":
        os.mkfifo(out)
    result = runner.invoke(app, ["validate", "tiny", "--no-data", "--set", f"output.dir={out}"])
    assert result.exit_code == 2, result.output
    expected = {
        "file": f"output.dir ({out}) is a file: output.dir must be a directory (or a path to create)",
        "under-a-file": f"output.dir ({out}) cannot be created: '{tmp_path / 'afile'}' is not a folder",
        "link-to-a-file": f"output.dir ({out}) is a file: output.dir must be a directory (or a path to create)",
        "fifo": f"output.dir ({out}) is not a directory: output.dir must be a directory (or a path to create)",
        "in-proc": f"output.dir ({out}) cannot be created: no folder can be created in '/proc' (",
    }[case]
    assert result.stderr.startswith(f"error: {expected}") and len(result.stderr.splitlines()) == 1, result.stderr
    assert (tmp_path / "afile").read_text() == "kept\n" and not os.path.lexists(tmp_path / "afile" / "run")


def test_validate_names_a_previous_run_in_output_dir(tmp_path):
    from moe_tune.engine.train.run_dir import RUN_RESULTS

    out = tmp_path / "run"
    result = runner.invoke(app, ["validate", "tiny", "--no-data", "--set", f"output.dir={out}"])
    assert result.exit_code == 0 and "previous run" not in result.stderr and not out.exists(), result.output
    out.mkdir()
    (out / RUN_RESULTS[0]).mkdir()
    result = runner.invoke(app, ["validate", "tiny", "--no-data", "--set", f"output.dir={out}"])
    assert result.exit_code == 0, result.output
    assert (f"note: output.dir ({out}) holds a previous run ({RUN_RESULTS[0]}): finetune continues it with --resume or "
            "replaces its outputs with --overwrite") in result.stderr.splitlines()


@pytest.mark.parametrize("overrides, refused", [
    ([], True),
    (["train.micro_batch_size=1", "memory.sequence_chunk_tokens=100"], True),
    (["parallel.zero_stage=2"], False),
    (["parallel.zero_stage=1"], False),
    (["lora.experts=false"], False),
    (["lora.enabled=false"], False),
    (["memory.sequence_chunk_tokens=512"], False),
    (["train.micro_batch_size=1"], False),
], ids=["zero3", "below-one-row", "zero2", "zero1", "no-expert-adapters", "full", "chunk-is-the-row", "row-fits"])  # fmt: skip
def test_chunked_expert_adapters_under_zero3_are_refused_in_one_line(overrides, refused):
    # ZeRO-3 reduces a leaf module's gradients at each of its runs: deepspeed asserted at the first step of finetune
    # and profile (tiny: 4 rows of 128 tokens, one packed row of 512). validate refuses what finetune refuses.
    from moe_tune.engine.train.trainer import check_chunked_expert_adapters
    from moe_tune.profiles import load_profile

    settings = ["memory.sequence_chunk_tokens=128", *overrides]
    result = runner.invoke(app, ["validate", "tiny", "--no-data", *[a for o in settings for a in ("--set", o)]])
    if not refused:
        assert result.exit_code == 0, result.output
        check_chunked_expert_adapters(load_profile("tiny", settings))
        return
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.splitlines()
    assert line.startswith("error: memory.sequence_chunk_tokens (") and "use parallel.zero_stage 1 or 2" in line, line
