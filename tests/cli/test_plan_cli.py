"""`moe-tune plan`: the table of layouts, the JSON it writes, and one-line errors for bad arguments."""

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from moe_tune.cli import app
from moe_tune.cli.plan import parse_memory
from moe_tune.profiles import resolve_profile_path

runner = CliRunner()


def test_plan_prints_every_layout_best_first():
    result = runner.invoke(app, ["plan", "seed-2p8t", "--devices", "128"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "2.78T parameters" in out and "bf16 weights 5.56 TB" in out
    rows = [line for line in out.splitlines() if line.startswith("│")]
    layouts = [row.split("│")[1].strip() for row in rows]
    assert len(layouts) == 8 and "2 x 64 *" in layouts
    seed_row = rows[layouts.index("2 x 64 *")]
    assert seed_row.split("│")[2].strip() == "14" and "yes" in seed_row
    assert "* the profile's layout (parallel.expert_parallel 64)" in out


def test_plan_json_matches_the_table(tmp_path):
    out = tmp_path / "plan.json"
    args = ["plan", "seed-2p8t", "--devices", "128", "--device-memory", "141GB", "--json", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    plan = json.loads(out.read_text())
    assert plan["devices"] == 128 and plan["device_memory"] == 141 * 10**9
    assert plan["parameters"]["total"] == pytest.approx(2.8e12, rel=0.02)
    rows = [row for row in result.stdout.splitlines() if row.startswith("│")]
    table_order = [row.split("│")[1].strip().rstrip(" *") for row in rows]
    assert [f"{lay['data_parallel']} x {lay['expert_parallel']}" for lay in plan["layouts"]] == table_order
    (seed,) = [lay for lay in plan["layouts"] if lay["is_profile_layout"]]
    layout = (seed["data_parallel"], seed["expert_parallel"], seed["experts_per_device"], seed["fits"])
    assert layout == (2, 64, 14, True)
    parts = ("dense_weights", "expert_weights", "lora_weights", "gradients", "optimizer", "activations", "gathered")
    assert seed["total"] == sum(seed[p] for p in parts)


def test_plan_takes_overrides(tmp_path):
    out = tmp_path / "plan.json"
    args = ["plan", "seed-2p8t", "--devices", "128", "--set", "train.precision=fp32", "--json", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    plan = json.loads(out.read_text())
    assert plan["weight_bytes"] == 4 * plan["parameters"]["total"]


def test_plan_notes_a_profile_layout_that_does_not_divide_the_devices():
    result = runner.invoke(app, ["plan", "seed-2p8t", "--devices", "96"])
    assert result.exit_code == 0, result.output
    assert "the profile's parallel.expert_parallel (64) does not divide --devices (96)" in result.stdout


def test_plan_of_the_most_devices_takes_no_longer_than_a_few_layouts():
    # The layouts are the expert-parallel sizes dividing both the experts and the devices: never a loop over N.
    result = runner.invoke(app, ["plan", "tiny", "--devices", "16777216"])
    assert result.exit_code == 0, result.output
    assert "16777216 devices" in result.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--devices", "0"], "error: --devices ('0') must be an integer from 1 to 16777216"),
        (["--devices", "many"], "error: --devices ('many') must be an integer from 1 to 16777216"),
        (["--devices", "16777217"], "error: --devices ('16777217') must be an integer from 1 to 16777216"),
        (["--devices", "9" * 5000], "error: --devices ('" + "9" * 60 + "') must be an integer from 1 to 16777216"),
        (["--devices", "\u0663"], "error: --devices ('\u0663') must be an integer from 1 to 16777216"),
        (["--devices", "8", "--device-memory", "141XB"],
         "error: --device-memory ('141XB') must look like 141GB, 80GiB or 1.5TB"),
        (["--devices", "8", "--device-memory", "0GB"],
         "error: --device-memory ('0GB') must look like 141GB, 80GiB or 1.5TB"),
        (["--devices", "8", "--set", "lora.target_modules=[qq_proj]"],
         "error: lora.target_modules ('qq_proj') must name a linear layer of the model, or a dotted suffix of its "
         "name as PEFT matches it (known: a_proj, b_proj, "
         "down_proj, gate, gate_proj, index_k_proj, index_q_proj, index_weights_proj, k_proj, lm_head, o_proj, "
         "q_proj, shared_expert_gate, up_proj, v_proj, z_proj)"),
        (["--devices", "8", "--json", "/nonexistent-dir/plan.json"],
         "error: --json ('/nonexistent-dir/plan.json'): its folder '/nonexistent-dir' does not exist"),
        (["--devices", "8", "--json", "/"], "error: --json ('/') is a folder: name a file to write"),
    ],
    ids=["zero-devices", "devices-not-a-number", "devices-past-the-cap", "devices-of-5000-digits", "arabic-digit",
         "unknown-unit", "zero-memory", "bad-lora-target", "json-in-no-folder", "json-a-folder"],
)
def test_plan_bad_arguments_exit_2_with_one_line(args, message):
    result = runner.invoke(app, ["plan", "tiny", *args])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [message]


@pytest.mark.parametrize(
    "text, size",
    [
        ("141GB", 141 * 10**9),
        ("80GiB", 80 * 2**30),
        ("1.5TB", 15 * 10**11),
        ("512 MiB", 512 * 2**20),
        ("141gb", 141 * 10**9),
    ],
)
def test_parse_memory(text, size):
    assert parse_memory(text) == size


def test_plan_shows_the_memory_policys_host_tier(tmp_path):
    out = tmp_path / "plan.json"
    args = ["plan", "tiny", "--devices", "2", "--set", "memory.preset=max-context", "--set", "memory.min_offload_mb=0",
            "--json", str(out)]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    plan = json.loads(out.read_text())
    acts, lay = plan["activations"], plan["layouts"][0]
    assert acts["host"] > 0 and lay["host_memory"] == 256 * 2**20 and lay["swap_per_step"] == acts["host"]
    lines = result.stdout.splitlines()
    assert any(line.startswith("host memory 268 MB per device: a pinned pool for ") for line in lines), result.output
    assert any(line.startswith("swap per step ") and "s out at 55 GB/s" in line and "s back at 52 GB/s" in line
               for line in lines), result.output  # fmt: skip
    header = next(line for line in lines if "data x expert" in line)
    assert "host" in header and "swap/step" in header
    # A policy that moves nothing prints neither.
    plain = runner.invoke(app, ["plan", "tiny", "--devices", "2"]).stdout
    assert "host memory" not in plain and "swap/step" not in plain


@pytest.mark.parametrize("same", ["as given", "through another path"])
def test_plan_json_naming_the_profile_is_refused_and_the_profile_kept(tmp_path, monkeypatch, same):
    profile = tmp_path / "p.yaml"
    profile.write_text(resolve_profile_path("tiny").read_text())
    before = profile.read_bytes()
    monkeypatch.chdir(tmp_path)
    json_out = str(profile) if same == "as given" else "sub/../p.yaml"
    (tmp_path / "sub").mkdir()
    result = runner.invoke(app, ["plan", str(profile), "--devices", "2", "--json", json_out])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        f"error: --json ({json_out!r}) is the PROFILE file: the run would overwrite it; name another file"]
    assert profile.read_bytes() == before


@pytest.mark.parametrize("target", ["checkpoint/config.json", "checkpoint/new.json", "data.jsonl",
                                    "run/profile.yaml", "run/checkpoints/step-0000001/manifest.json"])  # fmt: skip
def test_plan_json_over_what_the_profile_reads_or_its_run_keeps_is_refused(tmp_path, target):
    """--json must not replace a file of model.checkpoint's folder, the data, or what a run keeps in output.dir;
    one line naming the option and the place, exit 2, the files as they were."""
    from hf_tiny import save_tiny_checkpoint, tiny_qwen3_moe

    checkpoint = save_tiny_checkpoint(tiny_qwen3_moe(), tmp_path / "checkpoint")
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"text": "a document"}) + "\n")
    kept = tmp_path / "run" / "checkpoints" / "step-0000001"
    kept.mkdir(parents=True)
    (kept / "manifest.json").write_text("{}")
    (tmp_path / "run" / "profile.yaml").write_text("name: run\n")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    sets = [f"model={{checkpoint: {checkpoint}}}", "data.tokenizer=byte", f"data.path={data}",
            "lora.target_modules=[q_proj, k_proj]", "lora.modules_to_save=[]", f"output.dir={tmp_path / 'run'}"]
    json_out = tmp_path / target
    result = runner.invoke(app, ["plan", "tiny", "--devices", "2", *[a for s in sets for a in ("--set", s)],
                                 "--json", str(json_out)])  # fmt: skip
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    if target.startswith("run/"):
        place = tmp_path / "run" / target.split("/")[1]
        assert line == (f"error: --json ({str(json_out)!r}) lies in the run's {str(place)!r} (output.dir): it would "
                        "replace what a run keeps there; name a file elsewhere")
    else:
        field, read = ("model.checkpoint", checkpoint) if target.startswith("checkpoint/") else ("data.path", data)
        assert line == (f"error: --json ({str(json_out)!r}) would overwrite what {field} ({str(read)!r}) reads; "
                        "name a file elsewhere")
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    # Beside them, the plan is written.
    result = runner.invoke(app, ["plan", "tiny", "--devices", "2", *[a for s in sets for a in ("--set", s)],
                                 "--json", str(tmp_path / "run" / "plan.json")])  # fmt: skip
    assert result.exit_code == 0, result.output


# Readers of a FIFO given as its last argument, printing what they read: one that waits in its open for a writer,
# and one that opens without waiting (says "open" once it has) and reads until a writer has written and closed.
FIFO_READERS = {
    "blocking": ["cat"],
    "non-blocking": [sys.executable, "-c", """
import os, select, sys
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_NONBLOCK)
print("open", flush=True)
data = b""
while True:
    select.select([fd], [], [], 1)
    try:
        chunk = os.read(fd, 1 << 16)
    except BlockingIOError:
        continue
    if not chunk and data:
        break
    data += chunk
sys.stdout.write(data.decode())
"""],
}


@pytest.mark.parametrize("reader", list(FIFO_READERS))
def test_plan_json_into_a_fifo_needs_a_reader(tmp_path, child_env, reader):
    """A FIFO no process reads would hold the plan's write for ever (after the table is printed): refused up front.
    One a process reads takes the plan whole: a reader that waits in its open (`cat`, `jq . <`) is not handed end of
    file by the check, and one that opened without waiting (a shell's `>(jq .)`) reads it too."""
    import os

    fifo = tmp_path / "plan.json"
    os.mkfifo(fifo)
    # In a process of its own: a write that waits for ever fails the test at the timeout instead of holding it.
    plan = [sys.executable, "-m", "moe_tune", "plan", "tiny", "--devices", "1", "--json", str(fifo)]
    refused = subprocess.run(plan, capture_output=True, text=True, timeout=120, env=child_env)
    assert refused.returncode == 2
    assert refused.stderr.strip() == (f"error: --json ({str(fifo)!r}): a FIFO that no process reads: writing it "
                                      "would wait for a reader for ever")  # fmt: skip
    with subprocess.Popen([*FIFO_READERS[reader], str(fifo)], stdout=subprocess.PIPE, text=True) as taker:
        if reader == "non-blocking":
            assert taker.stdout.readline() == "open\n"
        written = subprocess.run(plan, capture_output=True, text=True, timeout=120, env=child_env)
        out, _ = taker.communicate(timeout=60)
    assert written.returncode == 0, written.stderr
    assert json.loads(out)["layouts"]


def test_a_plan_json_write_cut_short_keeps_the_old_file(tmp_path, monkeypatch):
    """A full disk while --json is written: one line, and the file holds the previous plan, not half of this one."""
    import errno
    from pathlib import Path

    def half_then_disk_full(path, data, *args, **kwargs):
        data = data.encode() if isinstance(data, str) else data
        with open(path, "wb") as f:
            f.write(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    old = tmp_path / "plan.json"
    old.write_bytes(b'{"kept": true}\n')
    monkeypatch.setattr(Path, "write_text", half_then_disk_full)
    monkeypatch.setattr(Path, "write_bytes", half_then_disk_full)
    result = runner.invoke(app, ["plan", "tiny", "--devices", "2", "--json", str(old)])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [f"error: --json ({str(old)!r}): cannot write the plan (No space left on "
                                          "device); the file is as it was"]
    assert old.read_bytes() == b'{"kept": true}\n' and [p.name for p in tmp_path.iterdir()] == ["plan.json"]


def test_plan_shows_the_vision_towers_activations(tmp_path):
    # tiny-vl: its LoRA'd tower and trained merger keep 10.1 MB over the 2048 patches of a micro-batch of 512 image
    # tokens (tests/engine/test_plan.py counts them); a text model's line has no such term.
    out = tmp_path / "plan.json"
    result = runner.invoke(app, ["plan", "tiny-vl", "--devices", "2", "--device-memory", "80GB", "--json", str(out)])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert ("activations 29.9 MB = layers 18.4 MB + head 1.47 MB + linear-attention backward 65.5 KB + vision tower "
            "10.1 MB") in lines, result.output
    assert ("vision tower 10.1 MB: what backward keeps of it over 2048 image patches, the most a micro-batch holds "
            "(all 512 tokens image tokens, 4 patches each)") in lines, result.output
    plan = json.loads(out.read_text())
    acts = plan["activations"]
    assert acts["vision"] == 10_059_776 and plan["vision_patches"] == 2048
    assert acts["total"] == acts["layers"] + acts["head"] + acts["transient"] + acts["context"] + acts["vision"]
    assert {lay["activations"] for lay in plan["layouts"]} == {acts["total"]}
    frozen = runner.invoke(app, ["plan", "tiny-vl", "--devices", "2", "--set", "lora.vision_tower=frozen", "--set",
                                 "lora.vision_merger=frozen"]).stdout  # fmt: skip
    assert "vision tower" not in frozen
    assert "vision tower" not in runner.invoke(app, ["plan", "tiny", "--devices", "2"]).stdout


@pytest.mark.parametrize(
    "overrides, line",
    [
        ([], "LoRA: 229K trainable parameters (dense 114K, experts 115K), backbone frozen but for full copies of "
             "lm_head, the vision merger"),
        (["lora.vision_tower=trained", "lora.vision_merger=lora"], "LoRA: 221K trainable parameters (dense 107K, "
         "experts 115K), backbone frozen but for full copies of lm_head, the vision tower"),
        (["lora.enabled=false", "lora.vision_tower=frozen"], "full fine-tuning: 379K trainable parameters, all but "
         "the vision tower (frozen)"),
        (["lora.enabled=false", "lora.vision_tower=frozen", "lora.vision_merger=frozen"], "full fine-tuning: 354K "
         "trainable parameters, all but the vision tower and vision merger (frozen)"),
        (["lora.enabled=false"], "full fine-tuning: every parameter trainable"),
    ],
    ids=["lora-merger-trained", "lora-tower-trained", "full-tower-frozen", "full-both-frozen", "full-all"],
)
def test_plan_names_what_trains_of_the_vision_tower(overrides, line):
    # The trainable counts are the built model's (tests/engine/test_plan.py checks them against PEFT and the trainer).
    args = ["plan", "tiny-vl", "--devices", "2"] + [arg for o in overrides for arg in ("--set", o)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[1].endswith(line), result.stdout.splitlines()[1]
