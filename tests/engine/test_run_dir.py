"""One run per output.dir (engine/train/run_dir.py): the lock and the checks made before anything is written."""

import errno
import json
import os
import socket
from pathlib import Path

import pytest
import torch

from moe_tune.engine.train import run_dir
from processes import dead_pid
from moe_tune.engine.train.distributed import DistInfo
from moe_tune.engine.train.run_dir import (
    LOCK_NAME, OVERWRITTEN, RUN_RESULTS, RUN_SETTINGS, check_output_dir, claim_output_dir,
)
from moe_tune.profiles import ProfileError

HOST = socket.gethostname()


def write_lock(out, pid, host=HOST):
    out.mkdir(parents=True, exist_ok=True)
    (out / LOCK_NAME).write_text(json.dumps({"pid": pid, "host": host, "started": "2026-01-01T00:00:00+00:00"}))


def test_lock_is_created_with_its_holder_and_released(tmp_path):
    out = tmp_path / "run"
    lock, notes = check_output_dir(out, resume=False, overwrite=False)
    holder = json.loads((out / LOCK_NAME).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == HOST and holder["started"]
    assert notes == []
    (out / "metrics.jsonl").write_text("")
    lock.release()
    assert not (out / LOCK_NAME).exists() and out.is_dir()


@pytest.mark.parametrize("holder", ["this process", "a sleeping process"])
def test_a_lock_held_by_a_live_pid_is_refused(tmp_path, holder, sleeper):
    pid = os.getpid() if holder == "this process" else sleeper
    write_lock(tmp_path, pid)
    with pytest.raises(ProfileError, match=rf"^output.dir \({tmp_path}\) is in use by another run: pid {pid} on host "
                                           rf"{HOST}, started 2026-01-01"):  # fmt: skip
        check_output_dir(tmp_path, resume=False, overwrite=False)
    # The holder's lock is untouched.
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == pid


@pytest.mark.parametrize("resume", [False, True])
def test_a_stale_lock_of_a_dead_pid_is_taken_over_with_a_note(tmp_path, resume):
    pid = dead_pid()
    write_lock(tmp_path, pid)
    lock, notes = check_output_dir(tmp_path, resume=resume, overwrite=False)
    assert notes == [f"note: took over the lock of a run that is gone (pid {pid} on host {HOST}, started "
                     f"2026-01-01T00:00:00+00:00) in {tmp_path}"]  # fmt: skip
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert not list(tmp_path.glob(".lock.stale-*"))
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


@pytest.mark.parametrize("pid", ["dead", "live"])
def test_a_lock_from_another_host_is_respected(tmp_path, pid):
    write_lock(tmp_path, dead_pid() if pid == "dead" else os.getpid(), host="other-host")
    with pytest.raises(ProfileError, match=r"is in use by another run: pid \d+ on host other-host.*another host is "
                                           r"respected"):  # fmt: skip
        check_output_dir(tmp_path, resume=False, overwrite=False)
    assert (tmp_path / LOCK_NAME).exists()


@pytest.mark.parametrize("content", [
    "", "{not json", '{"pid": "12", "host": "h"}', "[1, 2]", "directory",
    '{"pid": 99999999999999999999999, "host": "HOST"}',  # past pid_t: os.kill cannot take it
    '{"pid": 0, "host": "HOST"}',  # 0 and -1 name process groups, not a process
    '{"pid": -1, "host": "HOST"}',
    '{"pid": true, "host": "HOST"}',
])  # fmt: skip
def test_a_lock_that_names_no_holder_is_refused(tmp_path, content):
    if content == "directory":
        (tmp_path / LOCK_NAME).mkdir()
    else:
        (tmp_path / LOCK_NAME).write_text(content.replace("HOST", HOST))
    with pytest.raises(ProfileError, match=r"is locked by .*\.lock, which does not name a holder"):
        check_output_dir(tmp_path, resume=False, overwrite=False)
    assert (tmp_path / LOCK_NAME).exists()


@pytest.mark.parametrize("holder", ["none", "dead", "live", "other-host", "no-holder"])
def test_a_folder_is_held_while_its_lock_may_name_a_live_run(tmp_path, holder, sleeper):
    """export and generate read a run's folder only when no run holds it; a lock left by a run killed on this host
    (kill -9, its pid gone) holds nothing."""
    if holder == "no-holder":
        (tmp_path / LOCK_NAME).write_text("{}")
    elif holder != "none":
        pid = sleeper if holder == "live" else dead_pid()
        write_lock(tmp_path, pid, "elsewhere" if holder == "other-host" else HOST)
    assert run_dir.is_held(tmp_path) == (holder in ("live", "other-host", "no-holder"))


def test_a_second_claim_while_the_first_holds_is_refused(tmp_path):
    first, _ = check_output_dir(tmp_path, resume=False, overwrite=False)
    with pytest.raises(ProfileError, match=rf"in use by another run: pid {os.getpid()}"):
        check_output_dir(tmp_path, resume=True, overwrite=False)
    first.release()
    check_output_dir(tmp_path, resume=True, overwrite=False)[0].release()


@pytest.mark.parametrize("kind", ["file", "symlink to a file", "fifo", "parent is a file"])
def test_an_output_dir_that_is_not_a_directory_is_refused(tmp_path, kind):
    target = tmp_path / "out"
    if kind == "file":
        target.write_text("keep me")
    elif kind == "symlink to a file":
        (tmp_path / "f").write_text("keep me")
        target.symlink_to(tmp_path / "f")
    elif kind == "fifo":
        os.mkfifo(target)
    else:
        (tmp_path / "f").write_text("keep me")
        target = tmp_path / "f" / "out"
    if kind == "parent is a file":
        message = rf"^output.dir \({target}\) cannot be created: not a directory$"
    else:
        message = rf"^output.dir \({target}\) is (a file|not a directory): output.dir must be a directory"
    with pytest.raises(ProfileError, match=message):
        check_output_dir(target, resume=False, overwrite=False)
    if kind != "fifo":
        assert (tmp_path / ("f" if kind != "file" else "out")).read_text() == "keep me"


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES, errno.ENOSPC])
def test_an_output_dir_where_the_lock_cannot_be_written_is_refused(tmp_path, monkeypatch, code):
    # Tests run as root, where a chmod does not stop writes: the failure the kernel gives is simulated.
    real_open = os.open

    def failing_open(path, flags, *args):
        if str(path).endswith(LOCK_NAME):
            raise OSError(code, os.strerror(code))
        return real_open(path, flags, *args)

    monkeypatch.setattr(run_dir.os, "open", failing_open)
    with pytest.raises(ProfileError, match=rf"^output.dir \({tmp_path}\) is not writable: cannot create "
                                           rf"{tmp_path / LOCK_NAME} \({os.strerror(code).lower()}\)$"):  # fmt: skip
        check_output_dir(tmp_path, resume=False, overwrite=False)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
@pytest.mark.parametrize("where", ["the directory", "its parent"])
def test_a_read_only_output_dir_is_refused(tmp_path, where):
    locked = tmp_path / "ro"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        target = locked if where == "the directory" else locked / "out"
        with pytest.raises(ProfileError, match=r"is not writable|cannot be created: permission denied"):
            check_output_dir(target, resume=False, overwrite=False)
    finally:
        locked.chmod(0o755)


@pytest.mark.parametrize("result", RUN_RESULTS)
def test_a_previous_run_is_refused_without_resume_or_overwrite(tmp_path, result):
    (tmp_path / result).write_text("") if "." in result else (tmp_path / result).mkdir()
    with pytest.raises(ProfileError, match=rf"^output.dir \({tmp_path}\) holds a previous run \({result}\): continue "
                                           r"it with --resume, replace its outputs with --overwrite"):  # fmt: skip
        check_output_dir(tmp_path, resume=False, overwrite=False)
    assert (tmp_path / result).exists() and not (tmp_path / LOCK_NAME).exists()
    check_output_dir(tmp_path, resume=True, overwrite=False)[0].release()
    assert (tmp_path / result).exists()


def _run_profile(out) -> None:
    """profile.yaml as a run writes it: the resolved profile, every section."""
    import yaml

    from moe_tune.engine.train.trainer import resolved_profile_dump
    from moe_tune.profiles import load_profile

    (out / "profile.yaml").write_text(yaml.safe_dump(resolved_profile_dump(load_profile("tiny")), sort_keys=False))


def test_settings_and_other_files_alone_are_not_a_previous_run(tmp_path):
    # profile.yaml, deepspeed_config.json and generated-data are written by a run refused before its first step;
    # other files (the user's data) are never moe-tune's to judge.
    for name in (*RUN_SETTINGS, "data.jsonl"):
        (tmp_path / name).write_text("x")
    _run_profile(tmp_path)
    check_output_dir(tmp_path, resume=False, overwrite=False)[0].release()


@pytest.mark.parametrize("profile", [None, "x", "name: mine\ntrain: {steps: 3}\n", "\udcff"],
                         ids=["none", "not-yaml-mapping", "hand-written", "unreadable"])  # fmt: skip
def test_settings_no_run_wrote_are_refused_and_kept(tmp_path, profile):
    # A user's own deepspeed_config.json (no run's resolved profile.yaml beside it) would be replaced by the run's.
    (tmp_path / "deepspeed_config.json").write_text('{"mine": true}')
    if profile is not None:
        (tmp_path / "profile.yaml").write_bytes(profile.encode("utf-8", "surrogateescape"))
    with pytest.raises(ProfileError) as err:
        check_output_dir(tmp_path, resume=False, overwrite=False)
    named = "deepspeed_config.json" if profile is None else "profile.yaml, deepspeed_config.json"
    assert err.value.problems == [f"output.dir ({tmp_path}) holds {named}, which no run wrote (no run's profile.yaml "
                                  "beside it): the run writes its own there; move it, choose another output.dir, or "
                                  "replace it with --overwrite"]  # fmt: skip
    assert (tmp_path / "deepspeed_config.json").read_text() == '{"mine": true}'
    assert not (tmp_path / LOCK_NAME).exists()
    # With --overwrite the run may write over them, as asked.
    check_output_dir(tmp_path, resume=False, overwrite=True)[0].release()


REPLACED = "removed once this run has read its data and built its model, left in place if it is refused before"


def test_overwrite_removes_the_previous_run_and_nothing_else(tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "precious.txt").write_text("keep")
    out = tmp_path / "out"
    out.mkdir()
    for name in ("metrics.jsonl", "summary.json", "profile.yaml", ".summary.json.tmp", "model.safetensors"):
        (out / name).write_text("old")
    (out / "checkpoints" / "step-0000002").mkdir(parents=True)
    (out / "adapter").symlink_to(outside)  # removed as a link, never followed
    (out / "data.jsonl").write_text("user data")
    (out / "notes").mkdir()
    lock, notes = check_output_dir(out, resume=False, overwrite=True)
    lock.release()
    # Set aside until the run is set up, then removed.
    assert sorted(p.name for p in out.iterdir()) == [OVERWRITTEN, "data.jsonl", "notes"]
    run_dir.drop_set_aside(out)
    assert sorted(p.name for p in out.iterdir()) == ["data.jsonl", "notes"]
    assert (outside / "precious.txt").read_text() == "keep"
    assert notes == [f"note: --overwrite replaces the previous run's metrics.jsonl, summary.json, .summary.json.tmp, "
                     f"checkpoints, adapter, model.safetensors, profile.yaml in {out}: {REPLACED}"]  # fmt: skip


def test_overwrite_removes_what_a_killed_writer_staged(tmp_path):
    """A run killed while writing merged/ (or an export killed writing export/) leaves its temporary sibling,
    named after its writer (export.staging_folder); --overwrite removes it with the rest of the run."""
    from moe_tune.engine.export import staging_folder

    (tmp_path / "metrics.jsonl").write_text("old")
    staged = staging_folder(tmp_path / "merged")
    staged.mkdir()
    (staged / "model-00001-of-00002.safetensors").write_text("half")
    lock, notes = check_output_dir(tmp_path, resume=False, overwrite=True)
    lock.release()
    run_dir.drop_set_aside(tmp_path)
    assert list(tmp_path.iterdir()) == []
    assert notes == [f"note: --overwrite replaces the previous run's metrics.jsonl, {staged.name} in {tmp_path}: "
                     f"{REPLACED}"]


def test_overwrite_keeps_the_tracker_stores_and_says_so(tmp_path):
    """wandb/ and mlruns/ may hold other runs than the one replaced (an MLflow store of every run logged there):
    --overwrite removes the run's own files, loggers.json (its tracker run ids) among them, and keeps the stores."""
    out = tmp_path / "out"
    (out / "mlruns" / "0").mkdir(parents=True)
    (out / "mlruns" / "0" / "meta.yaml").write_text("name: Default")
    (out / "wandb" / "offline-run-1").mkdir(parents=True)
    for name in ("metrics.jsonl", "loggers.json"):
        (out / name).write_text("old")
    lock, notes = check_output_dir(out, resume=False, overwrite=True)
    lock.release()
    run_dir.drop_set_aside(out)
    assert sorted(p.name for p in out.iterdir()) == ["mlruns", "wandb"]
    assert (out / "mlruns" / "0" / "meta.yaml").read_text() == "name: Default"
    assert notes == [f"note: --overwrite replaces the previous run's metrics.jsonl, loggers.json in {out}: {REPLACED}",
                     f"note: --overwrite kept wandb, mlruns in {out}: tracker stores that may hold other runs; the new "
                     "run is logged beside the earlier ones"]  # fmt: skip


def test_tracker_stores_alone_are_not_a_previous_run(tmp_path):
    for name in ("wandb", "mlruns"):
        (tmp_path / name).mkdir()
    lock, notes = check_output_dir(tmp_path, resume=False, overwrite=False)
    lock.release()
    assert notes == []


@pytest.mark.parametrize("mode", ["fresh", "overwrite", "resume"])
@pytest.mark.parametrize("linked", ["wandb", "mlruns"])
def test_a_tracker_store_leading_out_of_the_run_folder_is_refused(tmp_path, linked, mode):
    """Every run logs into the store it finds in output.dir: a link to another folder's is refused, left as it was
    (--overwrite keeps the stores, so it would not remove the link either)."""
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere" / linked
    out.mkdir()
    elsewhere.mkdir(parents=True)
    (out / "summary.json").write_text("{}")
    (out / linked).symlink_to(elsewhere)
    with pytest.raises(ProfileError) as refusal:
        check_output_dir(out, resume=mode == "resume", overwrite=mode == "overwrite")
    link_line = (f"{out / linked}: leads to {str(elsewhere)!r}, outside the run folder; a run's files are read and "
                 "written only inside it")  # fmt: skip
    previous = (f"output.dir ({out}) holds a previous run (summary.json): continue it with --resume, replace its "
                "outputs with --overwrite, or choose another output.dir")  # fmt: skip
    assert refusal.value.problems == ([previous, link_line] if mode == "fresh" else [link_line])
    assert (out / linked).is_symlink() and (out / "summary.json").exists() and not (out / LOCK_NAME).exists()


@pytest.mark.parametrize("linked", ["checkpoints", "metrics.jsonl", "tensorboard", "profile.yaml", "generated-data"])
def test_resume_refuses_a_result_that_leads_out_of_the_run_folder(tmp_path, linked):
    """--resume reads the run's checkpoints and appends to its files: a name of the run's that is a link to another
    folder's (a shared checkpoints folder, another run's metrics) is one line naming it, the link left as it was."""
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere" / linked
    out.mkdir()
    (out / "summary.json").write_text("{}")
    elsewhere.parent.mkdir()
    elsewhere.mkdir() if linked in ("checkpoints", "tensorboard", "generated-data") else elsewhere.write_text("x")
    (out / linked).symlink_to(elsewhere)
    with pytest.raises(ProfileError) as refusal:
        check_output_dir(out, resume=True, overwrite=False)
    assert refusal.value.problems == [f"{out / linked}: leads to {str(elsewhere)!r}, outside the run folder; a run's "
                                      "files are read and written only inside it"]  # fmt: skip
    assert (out / linked).is_symlink() and not (out / LOCK_NAME).exists()


def test_resume_takes_links_that_stay_inside_the_run_folder(tmp_path):
    """A link to a folder inside the run, and output.dir itself a link to the run's folder, lead nowhere else."""
    real = tmp_path / "real"
    (real / "old-checkpoints").mkdir(parents=True)
    (real / "checkpoints").symlink_to(real / "old-checkpoints")
    (tmp_path / "out").symlink_to(real)
    lock, _ = check_output_dir(tmp_path / "out", resume=True, overwrite=False)
    lock.release()


@pytest.mark.parametrize("where", [".", "merged", "checkpoints/step-0000002", "adapter/../export-merged",
                                   "model.safetensors", "link", ".summary.json.tmp", ".deepspeed_config.json.tmp",
                                   ".profile.yaml.tmp", ".metrics.jsonl.tmp"])  # fmt: skip
@pytest.mark.parametrize("overwrite", [False, True])
def test_a_read_path_where_the_run_writes_is_refused_before_anything_changes(tmp_path, where, overwrite):
    """A checkpoint in output.dir itself, or in (or under) a name the run writes or --overwrite deletes (a previous
    run's merged export as the base of the next): its weights would be replaced; refused, nothing touched."""
    out = tmp_path / "out"
    (out / "merged").mkdir(parents=True)
    (out / "model.safetensors").write_text("weights")
    (out / "link").symlink_to(out / "merged")  # a link to such a place counts as that place
    read = out / where
    with pytest.raises(ProfileError) as refusal:
        check_output_dir(out, resume=False, overwrite=overwrite, reads={"model.checkpoint": read, "data.path": None})
    (line,) = refusal.value.problems
    assert line.startswith(f"model.checkpoint ({str(read)!r}) lies where the run writes (")
    assert line.endswith("set output.dir to another folder")
    assert (out / "model.safetensors").read_text() == "weights" and not (out / LOCK_NAME).exists()


@pytest.mark.parametrize("where", ["base", "data.jsonl", "notes/merged", "../sibling"])
def test_read_paths_beside_what_the_run_writes_are_allowed(tmp_path, where):
    """Inside output.dir but under a name the run never writes, or outside it: nothing of theirs is replaced."""
    out = tmp_path / "out"
    out.mkdir()
    lock, _ = check_output_dir(out, resume=False, overwrite=False, reads={"data.path": out / where})
    lock.release()


def test_output_dir_inside_the_checkpoint_is_allowed(tmp_path):
    """A run folder below a checkpoint's folder writes nothing over the checkpoint's own files."""
    lock, _ = check_output_dir(tmp_path / "runs" / "one", resume=False, overwrite=False,
                               reads={"model.checkpoint": tmp_path})  # fmt: skip
    lock.release()


def test_resume_and_overwrite_together_are_refused(tmp_path):
    with pytest.raises(ProfileError, match=r"^--resume and --overwrite contradict each other"):
        check_output_dir(tmp_path / "out", resume=True, overwrite=True)
    assert not (tmp_path / "out").exists()


def dist_info(rank, world_size):
    return DistInfo(rank=rank, world_size=world_size, local_rank=rank, device=torch.device("cpu"), backend="gloo")


def test_the_claim_is_released_however_the_run_ends_and_an_empty_new_dir_goes(tmp_path):
    out = tmp_path / "new"
    with pytest.raises(RuntimeError, match="boom"):
        with claim_output_dir(out, dist_info(0, 1), resume=False, overwrite=False):
            assert (out / LOCK_NAME).is_file()
            raise RuntimeError("boom")
    # Created by the refused run and left empty: removed again, nothing is left behind.
    assert not out.exists()
    with claim_output_dir(out, dist_info(0, 1), resume=False, overwrite=False):
        (out / "metrics.jsonl").write_text("{}\n")
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]


def test_a_lock_that_is_no_longer_ours_is_not_removed(tmp_path):
    lock, _ = check_output_dir(tmp_path, resume=False, overwrite=False)
    write_lock(tmp_path, 12345, host="other-host")
    lock.release()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["host"] == "other-host"


@pytest.mark.parametrize("main_says", [[], ["output.dir (x) is a file: output.dir must be a directory"]])
def test_other_ranks_take_no_lock_and_share_the_main_ranks_verdict(tmp_path, monkeypatch, main_says):
    def broadcast(objects, src, device):
        assert src == 0
        objects[0] = main_says

    monkeypatch.setattr(torch.distributed, "broadcast_object_list", broadcast)
    write_lock(tmp_path, os.getpid())  # held: rank 1 must not look at it
    if main_says:
        with pytest.raises(ProfileError) as err:
            with claim_output_dir(tmp_path, dist_info(1, 2), resume=False, overwrite=False):
                pass
        assert err.value.problems == main_says
    else:
        with claim_output_dir(tmp_path, dist_info(1, 2), resume=False, overwrite=False) as claim:
            assert claim.notes == [] and claim.lock is None
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()


# ---- readers of a finished run (export) -------------------------------------------------------------------------


def finished_run(out):
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.yaml").write_text("name: run\n")
    (out / "summary.json").write_text("{}\n")
    return out


def marks(out) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name.startswith(run_dir.READER_PREFIX))


def write_mark(out, pid, host=HOST, reader="export") -> str:
    name = f"{run_dir.READER_PREFIX}{host}-{pid}-0123"
    (out / name).write_text(json.dumps({"pid": pid, "host": host, "started": "2026-01-01T00:00:00+00:00",
                                        "reader": reader}))  # fmt: skip
    return name


@pytest.mark.parametrize("resume, overwrite", [(True, False), (False, True), (False, False)])
def test_a_run_is_refused_while_a_reader_reads_its_folder(tmp_path, resume, overwrite):
    out = finished_run(tmp_path / "run")
    with run_dir.reading_run(out, "export"):
        (mark,) = marks(out)
        started = json.loads((out / mark).read_text())["started"]
        with pytest.raises(ProfileError) as refusal:
            check_output_dir(out, resume=resume, overwrite=overwrite)
        assert refusal.value.problems == [
            f"output.dir ({out}) is being read by moe-tune export: pid {os.getpid()} on host {HOST}, started {started} "
            f"({out / mark}); a run would replace what it reads: start the run once it has ended"]
        # Refused before anything changed: the run's files are there and the lock is gone.
        assert sorted(p.name for p in out.iterdir()) == sorted([mark, "profile.yaml", "summary.json"])
    assert marks(out) == []
    check_output_dir(out, resume=True, overwrite=False)[0].release()


def test_a_reader_is_refused_while_a_run_holds_the_folder_and_leaves_no_mark(tmp_path):
    out = finished_run(tmp_path / "run")
    lock, _ = check_output_dir(out, resume=True, overwrite=False)
    with pytest.raises(ProfileError) as refusal:
        with run_dir.reading_run(out, "export"):
            pytest.fail("read while a run holds the folder")
    assert refusal.value.problems == [f"{out}: a run holds this folder (.lock); export it once the run has ended"]
    assert marks(out) == []
    lock.release()


def test_a_reader_marks_the_folder_before_it_looks_at_the_lock(tmp_path, monkeypatch):
    """A reader and a run starting together: each writes its own file before looking for the other's (the run its
    lock, the reader its mark), so whichever looks last sees the other's file and is refused."""
    out = finished_run(tmp_path / "run")
    seen = []
    is_held = run_dir.is_held
    monkeypatch.setattr(run_dir, "is_held", lambda folder: seen.append(marks(folder)) or is_held(folder))
    with run_dir.reading_run(out, "export"):
        pass
    assert len(seen) == 1 and len(seen[0]) == 1 and not seen[0][0].endswith(".tmp")
    # The run looks for readers once its lock is in place.
    looked = []
    reader_problems = run_dir.reader_problems
    monkeypatch.setattr(run_dir, "reader_problems",
                        lambda folder: looked.append((folder / LOCK_NAME).is_file()) or reader_problems(folder))
    check_output_dir(out, resume=True, overwrite=False)[0].release()
    assert looked == [True]


def test_marks_of_readers_that_are_gone_are_removed_and_others_refuse(tmp_path, sleeper):
    out = finished_run(tmp_path / "run")
    gone = write_mark(out, dead_pid())
    lock, _ = check_output_dir(out, resume=True, overwrite=False)
    lock.release()
    assert marks(out) == [], gone
    elsewhere = write_mark(out, os.getpid(), host="other-host")
    live = write_mark(out, sleeper, reader="\x1b[31mexport")  # shown escaped in the line (ProfileError)
    (out / f"{run_dir.READER_PREFIX}junk").write_text("{not json")
    os.mkfifo(out / f"{run_dir.READER_PREFIX}fifo")  # read, it would block for ever
    (out / f"{run_dir.READER_PREFIX}{HOST}-1-x.tmp").write_text("")  # a mark being written
    with pytest.raises(ProfileError) as refusal:
        check_output_dir(out, resume=True, overwrite=False)
    where = f"output.dir ({out})"
    # One line per mark (in the order of their names, where this host's name sorts anywhere).
    assert sorted(refusal.value.problems) == sorted([
        f"{where} is marked as read by {out / (run_dir.READER_PREFIX + 'fifo')}, which does not name a reader (pid "
        "and host): if nothing reads this folder, delete that file",
        f"{where} is marked as read by {out / (run_dir.READER_PREFIX + 'junk')}, which does not name a reader (pid "
        "and host): if nothing reads this folder, delete that file",
        f"{where} is being read by moe-tune \\x1b[31mexport: pid {sleeper} on host {HOST}, started "
        f"2026-01-01T00:00:00+00:00 ({out / live}); a run would replace what it reads: start the run once it has ended",
        f"{where} is being read by moe-tune export: pid {os.getpid()} on host other-host, started "
        f"2026-01-01T00:00:00+00:00 ({out / elsewhere}); a reader on another host is respected, as its pid cannot be "
        "checked from here: if it is gone, delete that file",
    ])
    assert not (out / LOCK_NAME).exists()


def test_a_folder_the_reader_cannot_write_into_is_read_unmarked(tmp_path, monkeypatch):
    import pathlib

    out = finished_run(tmp_path / "run")

    def refused(self, target):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(pathlib.Path, "replace", refused)
    with run_dir.reading_run(out, "export"):
        assert sorted(p.name for p in out.iterdir()) == ["profile.yaml", "summary.json"]


def test_a_folder_that_holds_no_run_is_not_marked(tmp_path):
    with run_dir.reading_run(tmp_path, "export"):
        assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind", ["fifo", "device", "large"])
def test_a_lock_that_is_no_regular_file_is_not_waited_on(tmp_path, kind):
    lock = tmp_path / LOCK_NAME
    if kind == "fifo":
        os.mkfifo(lock)
    elif kind == "device":
        lock.symlink_to("/dev/zero")
    else:
        lock.write_text(json.dumps({"pid": os.getpid(), "host": HOST, "pad": "x" * 10_000}))
    assert run_dir.is_held(tmp_path)
    with pytest.raises(ProfileError, match=r"is locked by .*\.lock, which does not name a holder"):
        check_output_dir(tmp_path, resume=False, overwrite=False)


@pytest.mark.parametrize("name, owned", [
    ("metrics.jsonl", True), (".lock", True), (".lock.reader-h-1-x", True), (".lock.stale-x", True),
    ("mlruns", True), ("wandb", True), (".export.tmp", True), (".export.tmp-host-12", True), ("checkpoints", True),
    ("export", True), ("my-export", False), ("lock", False), (".exporter.tmp-h-1", False), ("notes.txt", False),
])  # fmt: skip
def test_the_names_a_run_keeps_in_its_folder(name, owned):
    assert run_dir.is_owned_name(name) is owned


def write_run_profile(folder) -> None:
    """The resolved profile.yaml every run writes into its output.dir before its first step."""
    import yaml

    from moe_tune.profiles import load_profile

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "profile.yaml").write_text(yaml.safe_dump(load_profile("tiny").model_dump(mode="json")))


@pytest.mark.parametrize("inside, place, where", [
    ("checkpoints/step-0000001", "checkpoints", "lies inside"),
    ("checkpoints/step-0000001/deeper/run", "checkpoints", "lies inside"),
    ("checkpoints", "checkpoints", "is"),
    ("adapter", "adapter", "is"),
    ("export/mine", "export", "lies inside"),
    ("generated-data/x", "generated-data", "lies inside"),
])  # fmt: skip
@pytest.mark.parametrize("through_link", [False, True], ids=["path", "link"])
def test_an_output_dir_inside_a_name_another_run_keeps_is_refused(tmp_path, inside, place, where, through_link):
    # The other run's pruning (checkpoints), --resume or --overwrite would delete or read the new run's files.
    run = tmp_path / "run"
    write_run_profile(run)
    (run / place).mkdir()
    out = run / inside
    if through_link:
        (tmp_path / "link").symlink_to(run / place)
        out = tmp_path / "link" / os.path.relpath(run / inside, run / place)
    with pytest.raises(ProfileError) as err:
        check_output_dir(out, resume=False, overwrite=False)
    assert err.value.problems == [f"output.dir ({out}) {where} {place!r}, a name the run in {run} keeps in its folder "
                                  "(its pruning, --resume or --overwrite would delete or read this run's files); "
                                  "choose another folder"]  # fmt: skip
    assert sorted(p.name for p in run.iterdir()) == sorted(["profile.yaml", place])  # nothing created
    assert [p.name for p in (run / place).iterdir()] == []


@pytest.mark.parametrize("inside", ["notes/run", "checkpoints/run"])
def test_an_output_dir_below_other_folders_is_accepted(tmp_path, inside):
    # A run's own subfolder it does not keep, and a user's folder with their own (hand-written) profile beside a
    # folder named checkpoints, are no run's names.
    write_run_profile(tmp_path / "run")
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "profile.yaml").write_text("name: mine\ntrain: {steps: 3}\n")
    for root in ("run", "project") if inside == "notes/run" else ("project",):
        check_output_dir(tmp_path / root / inside, resume=False, overwrite=False)[0].release()


# What previous_run writes at the top of the folder.
PREVIOUS_RUN_NAMES = sorted(["checkpoints", "metrics.jsonl", "summary.json", "profile.yaml", "deepspeed_config.json",
                             "notes.txt"])


def previous_run(out) -> dict:
    """A finished run's files in `out` (made if missing: a checkpoint folder, a link among them), by path, with their
    bytes."""
    (out / "checkpoints" / "step-0000002").mkdir(parents=True)
    (out / "checkpoints" / "step-0000002" / "model_states.pt").write_bytes(b"weights")
    for name in ("metrics.jsonl", "summary.json", "profile.yaml", "deepspeed_config.json"):
        (out / name).write_text(f"old {name}")
    (out / "notes.txt").write_text("the user's")
    return snapshot(out)


def assert_put_back(out, before: dict) -> None:
    """`out` holds the previous run byte for byte, and nothing the new run wrote."""
    assert snapshot(out) == before
    assert sorted(p.name for p in out.iterdir()) == PREVIOUS_RUN_NAMES


def snapshot(out) -> dict:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("ending", [ProfileError(["data.path: bad"]), KeyboardInterrupt(), RuntimeError("crash")],
                         ids=["refused", "interrupted", "crashed"])  # fmt: skip
def test_overwrite_leaves_the_previous_run_when_the_set_up_ends(tmp_path, ending):
    """--overwrite sets the previous run aside and removes it only once the new run is set up (its data read, its
    model built): a refusal, a signal or an error before puts it back, byte for byte, and removes what the new run
    wrote meanwhile (its generated corpus, its settings)."""
    out = tmp_path / "out"
    before = previous_run(out)
    with pytest.raises(type(ending)):
        with claim_output_dir(out, dist_info(0, 1), False, True) as claim:
            assert claim.notes[0].startswith("note: --overwrite replaces the previous run's metrics.jsonl")
            assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME, OVERWRITTEN, "notes.txt"]
            (out / "generated-data").mkdir()
            (out / "generated-data" / "corpus.jsonl").write_text("new")
            (out / "profile.yaml").write_text("new")
            raise ending
    assert_put_back(out, before)


def test_overwrite_removes_the_previous_run_once_the_run_is_set_up(tmp_path):
    out = tmp_path / "out"
    previous_run(out)
    with pytest.raises(RuntimeError):
        with claim_output_dir(out, dist_info(0, 1), False, True) as claim:
            (out / "profile.yaml").write_text("new")
            claim.set_up()
            (out / "metrics.jsonl").write_text("step 1")
            raise RuntimeError("a later step failed")
    # The new run's files are its own now; the previous run is gone.
    assert snapshot(out) == {"metrics.jsonl": b"step 1", "notes.txt": b"the user's", "profile.yaml": b"new"}


def test_a_previous_run_set_aside_by_a_killed_run_is_put_back(tmp_path):
    # An --overwrite run killed (SIGKILL) while it set up left the previous run set aside and its own settings.
    out = tmp_path / "out"
    before = previous_run(out)
    run_dir.set_aside_run_outputs(out)
    (out / "profile.yaml").write_text("the killed run's")
    with pytest.raises(ProfileError) as err:
        check_output_dir(out, resume=False, overwrite=False)
    assert err.value.problems[0].startswith(f"output.dir ({out}) holds a previous run (metrics.jsonl, summary.json, "
                                            "checkpoints)")  # fmt: skip
    assert snapshot(out) == before
    lock, notes = check_output_dir(out, resume=True, overwrite=False)
    lock.release()
    assert notes == []


@pytest.mark.parametrize("moved", [0, 1, 3], ids=["none-moved", "one-moved", "three-moved"])
def test_a_set_aside_cut_short_puts_back_what_was_moved_and_deletes_nothing(tmp_path, moved):
    """A kill while --overwrite moved the previous run aside leaves some of it moved (no SET_ASIDE_DONE): the next
    claim moves those back and removes none of the rest, which is the previous run's too."""
    out = tmp_path / "out"
    before = previous_run(out)
    (out / OVERWRITTEN).mkdir()
    for entry in run_dir.run_output_entries(out)[:moved]:
        entry.rename(out / OVERWRITTEN / entry.name)
    lock, notes = check_output_dir(out, resume=True, overwrite=False)
    lock.release()
    assert snapshot(out) == before and not (out / OVERWRITTEN).exists()
    assert notes == [f"note: the previous run's outputs that an --overwrite run killed while it set up had set aside "
                     f"are back in {out}"]


def test_a_signal_while_the_previous_run_is_set_aside_puts_it_back(tmp_path, monkeypatch):
    out = tmp_path / "out"
    before = previous_run(out)
    rename, calls = Path.rename, []

    def interrupted(self, target):
        calls.append(self.name)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", interrupted)
    with pytest.raises(KeyboardInterrupt):
        check_output_dir(out, resume=False, overwrite=True)
    monkeypatch.undo()
    assert_put_back(out, before)


def test_a_removal_of_the_set_aside_run_cut_short_is_finished_not_put_back(tmp_path):
    # The new run was set up; a kill in the middle of removing the previous run left part of it renamed DROPPED.
    out = tmp_path / "out"
    previous_run(out)
    run_dir.set_aside_run_outputs(out)
    (out / OVERWRITTEN).rename(out / run_dir.DROPPED)
    (out / "metrics.jsonl").write_text("the new run's step 1")
    with pytest.raises(ProfileError):  # the new run's metrics: a previous run now
        check_output_dir(out, resume=False, overwrite=False)
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl", "notes.txt"]
    assert (out / "metrics.jsonl").read_text() == "the new run's step 1"


@pytest.mark.parametrize("inside", ["adapter", "checkpoints/step-0000003", "export/merged"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_another_run_inside_a_name_this_folder_keeps_is_never_removed(tmp_path, inside, overwrite):
    """A run whose output.dir was `P/adapter` (made before such folders were refused, or by hand): a run in P would
    replace or, with --overwrite, remove it."""
    parent = tmp_path / "P"
    write_run_profile(parent / inside)
    (parent / inside / "metrics.jsonl").write_text("its steps")
    before = snapshot(parent)
    with pytest.raises(ProfileError) as err:
        check_output_dir(parent, resume=False, overwrite=overwrite)
    assert err.value.problems == [f"output.dir ({parent}) holds another run in {parent / inside}: a run's output.dir "
                                  "inside a name this folder's runs keep; a run here would replace or remove it: move "
                                  "it, or choose another output.dir"]  # fmt: skip
    assert snapshot(parent) == before


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_fresh_run_refused_in_its_set_up_removes_only_what_it_wrote(tmp_path, overwrite):
    """Its generated corpus and settings would otherwise be refused by the next run as settings no run wrote; a
    user's file it found (a deepspeed_config.json --overwrite may replace) stays."""
    out = tmp_path / "out"
    out.mkdir()
    if overwrite:
        (out / "deepspeed_config.json").write_text('{"mine": true}')
    with pytest.raises(ProfileError):
        with claim_output_dir(out, dist_info(0, 1), False, overwrite):
            (out / "generated-data").mkdir()
            (out / "generated-data" / "corpus.jsonl").write_text("made")
            raise ProfileError(["data: refused"])
    assert snapshot(out) == ({"deepspeed_config.json": b'{"mine": true}'} if overwrite else {})
    check_output_dir(out, resume=False, overwrite=overwrite)[0].release()


def test_a_run_set_aside_by_a_killed_overwrite_is_named_to_its_readers(tmp_path):
    # export and generate read the run folder: "no run here" would send the user looking elsewhere.
    from moe_tune.engine.export.sources import read_run

    out = tmp_path / "out"
    previous_run(out)
    run_dir.set_aside_run_outputs(out)
    with pytest.raises(ProfileError) as err:
        read_run(out)
    assert err.value.problems == [f"{out}: its run is set aside in {OVERWRITTEN} by a finetune --overwrite that "
                                  "stopped while it set up (killed?); a finetune --resume into the folder puts it back"]
    lock, _ = check_output_dir(out, resume=True, overwrite=False)
    lock.release()
    assert (out / "profile.yaml").read_text() == "old profile.yaml"


def test_a_runs_profile_names_its_files_absolute(tmp_path, monkeypatch):
    # Relative paths are read from the working directory: the run's profile.yaml (and its checkpoints' signature)
    # names them absolute, so export, generate and --resume find them from any folder.
    from moe_tune.engine.train.checkpoint import run_signature
    from moe_tune.engine.train.trainer import resolved_profile_dump
    from moe_tune.profiles import load_profile

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tok").mkdir()
    for name in ("a.jsonl", "b.jsonl", "e.jsonl"):
        (tmp_path / name).write_text('{"text": "Ada has three red cats."}\n')
    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}")
    relative = ["data.path=null", "data.sources=[{path: a.jsonl}, {path: b.jsonl, weight: 2}]",
                "data.eval_path=e.jsonl", "data.tokenizer=tok", "data.chat_template=t.jinja", "output.dir=runs/x"]
    dumped = resolved_profile_dump(load_profile("tiny", relative))
    assert [s["path"] for s in dumped["data"]["sources"]] == [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]
    assert dumped["data"]["eval_path"] == str(tmp_path / "e.jsonl")
    assert dumped["data"]["tokenizer"] == str(tmp_path / "tok")
    assert dumped["data"]["chat_template"] == "{{ messages[0]['content'] }}"
    assert dumped["output"]["dir"] == str(tmp_path / "runs" / "x")
    absolute = [o.replace("a.jsonl", str(tmp_path / "a.jsonl")).replace("=e.jsonl", f"={tmp_path / 'e.jsonl'}")
                for o in relative]  # fmt: skip
    assert absolute != relative
    assert run_signature(load_profile("tiny", absolute), 1) == run_signature(load_profile("tiny", relative), 1)
    (tmp_path / "f.jsonl").write_text((tmp_path / "e.jsonl").read_text())
    assert run_signature(load_profile("tiny", ["data.eval_path=f.jsonl", *relative[:2]]), 1) != run_signature(
        load_profile("tiny", ["data.eval_path=e.jsonl", *relative[:2]]), 1)


@pytest.mark.parametrize("case", ["copied", "moved", "relative-elsewhere"])
def test_a_run_folders_profile_naming_another_folder_is_refused(tmp_path, monkeypatch, case):
    # finetune (--resume or --overwrite would continue or replace the other folder's run) and generate PROFILE (it
    # would read the other folder's weights) refuse it, naming the folder the profile.yaml lies in.
    import yaml
    from typer.testing import CliRunner

    from moe_tune.cli import app
    from moe_tune.engine.train.run_dir import moved_run_profile_problem
    from moe_tune.engine.train.trainer import resolved_profile_dump
    from moe_tune.profiles import load_profile

    original, here = tmp_path / "runs" / "a", tmp_path / "runs" / "b"
    original.mkdir(parents=True)
    dumped = resolved_profile_dump(load_profile("tiny", [f"output.dir={original}"]))
    if case == "relative-elsewhere":
        dumped["output"]["dir"] = "runs/b"  # as a run of an earlier version wrote it, read from another folder
        (tmp_path / "elsewhere").mkdir()
        monkeypatch.chdir(tmp_path / "elsewhere")
    (original / "profile.yaml").write_text(yaml.safe_dump(dumped, sort_keys=False))
    (original / "checkpoints").mkdir()
    if case == "moved":
        original.rename(here)
    else:
        (here / "checkpoints").mkdir(parents=True)
        (here / "profile.yaml").write_text((original / "profile.yaml").read_text())
    given = here / "profile.yaml"
    out = Path(dumped["output"]["dir"])
    line = (f"PROFILE ({given}) is the profile.yaml of the run in {here}, but its output.dir is {out}: the run was "
            "copied or moved, so output.dir names another folder; ")
    runner = CliRunner()
    for resume in (["--resume"], ["--overwrite"], []):
        result = runner.invoke(app, ["finetune", str(given), *resume])
        assert result.exit_code == 2, result.output
        assert result.stderr.splitlines() == [f"error: {line}give --set output.dir={here} to use this run, or "
                                              "another output.dir with --set"]  # fmt: skip
    result = runner.invoke(app, ["generate", str(given), "--prompt", "Ada"])
    assert result.exit_code == 2 and result.stderr.splitlines() == [f"error: {line}give the run's folder ({here})"]
    assert sorted(p.name for p in here.iterdir()) == ["checkpoints", "profile.yaml"]
    assert not (tmp_path / "elsewhere" / "runs").exists()
    # Its own folder as output.dir, or a profile that is no run's profile.yaml, is no such case.
    assert moved_run_profile_problem(given, here, "") is None
    (here / "job.yaml").write_text((here / "profile.yaml").read_text())
    assert moved_run_profile_problem(here / "job.yaml", out, "") is None
    assert moved_run_profile_problem(tmp_path / "profile.yaml", out, "") is None
    # A whole profile named profile.yaml in a folder without a run's results is a user's profile, not a run's.
    (here / "checkpoints").rmdir()
    assert moved_run_profile_problem(given, out, "") is None
