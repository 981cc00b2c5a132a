"""Report files written whole or not at all (engine/atomic_write.py), and each report writer going through it: a
write cut short (a full disk, a crash, Ctrl-C) leaves the file as it was and no temporary file beside it."""

import errno
import json
import os
import stat
from pathlib import Path

import pytest

from moe_tune.engine.atomic_write import atomic_path, write_atomically

OLD = b'{"kept": true}\n'


def cut_short(error):
    """A Path.write_bytes / write_text that writes half of what it is given, then raises `error`."""

    def write(path, data, *args, **kwargs):
        data = data.encode() if isinstance(data, str) else data
        with open(path, "wb") as f:
            f.write(data[: len(data) // 2])
        raise error

    return write


@pytest.fixture(params=["disk-full", "interrupt"])
def cut_writes(request, monkeypatch):
    """Every Path.write_bytes and write_text cut short: by a full disk, or by Ctrl-C."""
    error = OSError(errno.ENOSPC, "No space left on device") if request.param == "disk-full" else KeyboardInterrupt()
    for name in ("write_bytes", "write_text"):
        monkeypatch.setattr(Path, name, cut_short(error))
    return type(error)


def test_the_file_is_replaced_whole_with_its_mode_kept(tmp_path):
    path = tmp_path / "report.json"
    write_atomically(path, "new ✓\n")
    assert path.read_text(encoding="utf-8") == "new ✓\n"
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
    path.chmod(0o640)
    write_atomically(path, b"again")
    assert path.read_bytes() == b"again" and stat.S_IMODE(path.stat().st_mode) == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_a_write_cut_short_leaves_the_file_as_it_was(tmp_path, cut_writes):
    path = tmp_path / "report.json"
    with open(path, "wb") as f:
        f.write(OLD)
    with pytest.raises(cut_writes):
        write_atomically(path, json.dumps({"new": "x" * 1000}))
    assert path.read_bytes() == OLD and [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_a_link_is_written_through_and_kept(tmp_path):
    target, link = tmp_path / "target.json", tmp_path / "link.json"
    target.write_bytes(OLD)
    link.symlink_to(target.name)
    write_atomically(link, "new")
    assert link.is_symlink() and target.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "target.json"]


def test_a_fifo_is_written_in_place_never_replaced(tmp_path):
    """A device or FIFO named as the report (/dev/stdout) is written as it comes: renaming a file over it would
    replace the node (as root, /dev/null itself)."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        with atomic_path(fifo) as path:
            assert path == fifo
    finally:
        os.close(reader)
    assert stat.S_ISFIFO(fifo.stat().st_mode) and [p.name for p in tmp_path.iterdir()] == ["pipe"]


def test_a_standard_stream_is_written_in_place(tmp_path):
    """`--json /dev/stdout > file`: /dev/stdout leads (through /proc/self/fd/1) to the shell's regular file, which a
    rename would unlink from under the shell's later output; /dev/null is a device renaming would replace."""
    with open(tmp_path / "shell-output.txt", "wb") as shell:
        stream = Path(f"/proc/self/fd/{shell.fileno()}")
        with atomic_path(stream) as path:
            assert path == stream
    with atomic_path(Path("/dev/null")) as path:
        assert path == Path("/dev/null")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    assert [p.name for p in tmp_path.iterdir()] == ["shell-output.txt"]


def test_two_writers_of_one_file_write_apart(tmp_path):
    path = tmp_path / "plot.png"
    with atomic_path(path) as one, atomic_path(path) as other:
        assert one != other and one.parent == other.parent == tmp_path
        # matplotlib picks the format from the suffix: the temporary file keeps the report's.
        assert one.suffix == other.suffix == ".png" and one.name.startswith(".plot.png.")
        one.write_text("one")
        other.write_text("other")
    assert path.read_text() == "one" and [p.name for p in tmp_path.iterdir()] == ["plot.png"]


def test_report_writers_keep_the_old_file_when_cut_short(tmp_path, monkeypatch, cut_writes):
    """The reports commands write: onboard --json, align --json, profile --kernels --json (bench rows)."""
    from moe_tune.engine.align.compare import AlignReport, Row
    from moe_tune.engine.bench.kernels import write_rows
    from moe_tune.engine.onboard import OnboardReport

    writers = {
        "onboard.json": lambda path: OnboardReport(checkpoint="ckpt", device="cpu").write_json(path),
        "align.json": lambda path: AlignReport("ckpt", "qwen3_moe", [3], False, [], Row("logits", 0.0, 0.0), 1.0, 0.0,
                                               2.0, 2.0).write_json(path),
        "kernels.json": lambda path: write_rows(path, [{"op": "moe"}], True),
    }
    for name, write in writers.items():
        path = tmp_path / name
        with open(path, "wb") as f:
            f.write(OLD)
        with pytest.raises(cut_writes):
            write(path)
        assert path.read_bytes() == OLD, name
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(writers)


def test_a_golden_trace_cut_short_keeps_the_old_one(tmp_path, monkeypatch):
    import safetensors.torch
    import torch

    from moe_tune.engine.align import golden

    def cut(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\0" * 5)
        raise KeyboardInterrupt

    monkeypatch.setattr(golden, "trace", lambda model, docs: {"x": torch.zeros(2)})
    monkeypatch.setattr(safetensors.torch, "save_file", cut)
    path = tmp_path / "golden.safetensors"
    path.write_bytes(OLD)
    with pytest.raises(KeyboardInterrupt):
        golden.record_golden(None, [], path, {})
    assert path.read_bytes() == OLD and [p.name for p in tmp_path.iterdir()] == ["golden.safetensors"]


@pytest.mark.parametrize("plot", ["steps", "kernels"])
def test_a_plot_cut_short_keeps_the_old_one(tmp_path, monkeypatch, plot):
    """profile --plot (steps, and --kernels): matplotlib writing into the file when the disk fills."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from moe_tune.cli.profile_kernels import plot_rows
    from moe_tune.cli.profile_steps import steps_plot

    def cut(figure, fname, *args, **kwargs):
        with open(fname, "wb") as f:
            f.write(b"\x89PNG\r\n")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", cut)
    path = tmp_path / "old.png"
    path.write_bytes(OLD)
    with pytest.raises(OSError, match="No space left on device"):
        if plot == "steps":
            breakdown = {"classes": [{"op_class": "gemm", "share": 0.5}], "timing": "cpu"}
            steps_plot({"against": None, "breakdown": breakdown, "profile": "tiny", "machine": "cpu", "torch": "2",
                        "commit": "abc", "date": "2026"}, path)
        else:
            plot_rows([{"op": "moe", "case": "a", "impl": "ours", "shape": "1", "fwd_ms": 1.0, "fwd_bwd_ms": 2.0,
                        "machine": "cpu", "commit": "abc", "date": "2026"}], path)
    assert path.read_bytes() == OLD and [p.name for p in tmp_path.iterdir()] == ["old.png"]


def test_a_fifo_whose_reader_went_away_is_an_error_not_a_wait(tmp_path):
    """A reader found when the command started and gone by the write (killed, a `head` that exited): the write's
    open would wait for a reader for ever; it is an OSError at once. One still there reads the report whole."""
    from moe_tune.engine.atomic_write import fifo_has_reader

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    assert fifo_has_reader(fifo)
    os.close(reader)
    with pytest.raises(OSError) as err:
        write_atomically(fifo, "report")
    assert err.value.errno == errno.ENXIO
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert fifo_has_reader(fifo)
        write_atomically(fifo, "report")
        assert os.read(reader, 100) == b"report"
    finally:
        os.close(reader)
