"""`moe-tune align`: exit 0 within tolerance, 1 outside it, 2 on bad input; the JSON report; golden traces."""

import json

import pytest
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from moe_tune.cli import app

from hf_tiny import save_tiny_checkpoint, tiny_deepseek_v32, tiny_qwen3_moe

runner = CliRunner()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tiny_qwen3_moe(), tmp_path_factory.mktemp("align") / "qwen3_moe")


def test_aligned_checkpoint_exits_0_and_writes_json(checkpoint, tmp_path):
    out = tmp_path / "report.json"
    result = runner.invoke(app, ["align", "--reference", str(checkpoint), "--pin-routing", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "aligned: within tolerance" in result.stdout
    assert "reference: transformers' PyTorch paths\n" in result.stdout
    report = json.loads(out.read_text())
    assert report["passed"] and report["pinned_routing"] and report["model_type"] == "qwen3_moe"
    assert report["selections"] == [] and report["pinned_selection"] is False
    assert report["routing"] == [{"layer": i, "tokens": 46, "differed": 0, "beyond_tie": 0} for i in (1, 2)]
    assert "routing: every token chose the reference's experts in the 2 MoE layers before pinning" in result.stdout
    assert [row["name"] for row in report["layers"]] == ["layer 0", "layer 1", "layer 2"]
    assert report["logits"]["max_abs"] <= 1e-4 and report["kl"] <= 1e-6


@pytest.fixture(scope="module")
def massive_checkpoint(checkpoint, tmp_path_factory):
    """The qwen3_moe checkpoint with embedding channels 3 and 7 x1e3: massive activations in every layer."""
    import shutil

    copy = tmp_path_factory.mktemp("align_massive") / "qwen3_moe"
    shutil.copytree(checkpoint, copy)
    (weights,) = copy.glob("*.safetensors")
    tensors = load_file(str(weights))
    tensors["model.embed_tokens.weight"][:, [3, 7]] *= 1e3
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return copy


@pytest.mark.parametrize("bug", [False, True], ids=["correct", "o_proj_1pct_off"])
def test_hidden_states_are_judged_per_channel(massive_checkpoint, tmp_path, monkeypatch, bug):
    import torch

    import moe_tune.engine.align.compare as compare

    load = compare.load_ours

    def planted(cfg):
        model = load(cfg)
        with torch.no_grad():
            dict(model.named_parameters())["layers.1.self_attn.o_proj.weight"].mul_(1.01)
        return model

    if bug:
        monkeypatch.setattr(compare, "load_ours", planted)
    out = tmp_path / "report.json"
    args = ["align", "--reference", str(massive_checkpoint), "--json", str(out), "--grad-rtol", "1"]
    result = runner.invoke(app, args)
    report = json.loads(out.read_text())
    layers = report["layers"]
    lines = result.stdout.splitlines()
    assert [line.split()[-2:] for line in lines if "compared" in line] == [["per", "channel"]]
    for row in layers:
        (line,) = [line for line in lines if line.strip().startswith(row["name"] + " ")]
        assert line.split()[-1] == f"{row['channel_rel']:.3e}"
    assert all(row["rel"] <= 1e-4 for row in layers) and all(row["channel_rel"] >= row["rel"] for row in layers)
    assert report["logits"]["channel_rel"] is not None
    assert report["lora_grads"] and all(row["channel_rel"] is None for row in report["lora_grads"])
    if not bug:
        assert result.exit_code == 0, result.output
        assert max(row["channel_rel"] for row in layers) <= 1e-5
        return
    # Against each layer's largest value the 1% error hides; per channel it fails every layer from the bug on.
    assert result.exit_code == 1, result.output
    assert [row["channel_rel"] > 1e-3 for row in layers] == [False, True, True]
    for row in layers[1:]:
        assert (f"NOT aligned: {row['name']} rel {row['rel']:.3g}, per channel {row['channel_rel']:.3g} > 0.0001"
                in result.stdout)
    # --hidden-rtol sets the per-channel tolerance.
    result = runner.invoke(app, args + ["--hidden-rtol", "1"])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("bug", [False, True], ids=["correct", "token_mixer_backward_1pct_off"])
def test_lora_gradients_are_judged_per_row_and_column(massive_checkpoint, tmp_path, monkeypatch, bug):
    import moe_tune.engine.align.compare as compare

    load = compare.load_ours

    def planted(cfg):
        model = load(cfg)

        # Layer 1's attention passes a gradient 1% off back to its input; its forward is untouched.
        def backward_off(_module, args):
            return (args[0] * 1.01 - args[0].detach() * 0.01, *args[1:])

        model.layers[1].self_attn.register_forward_pre_hook(backward_off)
        return model

    if bug:
        monkeypatch.setattr(compare, "load_ours", planted)
    out = tmp_path / "report.json"
    args = ["align", "--reference", str(massive_checkpoint), "--json", str(out)]
    result = runner.invoke(app, args)
    grads = json.loads(out.read_text())["lora_grads"]
    lines = result.stdout.splitlines()
    for row in grads:
        assert row["channel_rel"] is None and row["line_rel"] >= row["rel"]
        (line,) = [line for line in lines if line.strip().startswith(row["name"] + " ")]
        assert line.split()[-1] == f"{row['line_rel']:.3e}"
    if not bug:
        assert result.exit_code == 0, result.output
        assert max(row["line_rel"] for row in grads) <= 1e-4
        return
    assert result.exit_code == 1, result.output
    failed = [row for row in grads if row["line_rel"] > 1e-3]
    assert failed and all(row["name"].startswith("layers.0.") for row in failed)
    for row in failed:
        assert (f"NOT aligned: LoRA gradient {row['name']} rel {row['rel']:.3g}, per row/column {row['line_rel']:.3g} "
                "> 0.001" in result.stdout)
    # --grad-rtol sets the per-row/column tolerance.
    result = runner.invoke(app, args + ["--grad-rtol", "1"])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("changed", [1, 3], ids=["one", "three"])
def test_a_weight_of_another_shape_than_the_config_says_is_one_line(checkpoint, tmp_path, changed):
    # transformers raised it as a RuntimeError under a printed load report: a traceback.
    import shutil

    import torch

    copy = tmp_path / "ckpt"
    shutil.copytree(checkpoint, copy)
    (weights,) = copy.glob("*.safetensors")
    tensors = load_file(str(weights))
    keys = sorted(k for k in tensors if k.endswith("proj.weight"))[:changed]
    for key in keys:
        tensors[key] = torch.zeros(3, 3)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    result = runner.invoke(app, ["align", "--reference", str(copy)])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    more = f" (and {changed - 1} more)" if changed > 1 else ""
    assert line.startswith(f"error: {copy}: {keys[0]} has shape (3, 3), the architecture its config.json describes "
                           "needs (") and line.endswith(f"){more}"), line


@pytest.mark.parametrize("value, count", [("nan", 1), ("inf", 1), ("-inf", 2), ("nan", 3)],
                         ids=["nan", "inf", "minus_inf_twice", "nan_in_three_layers"])  # fmt: skip
def test_a_checkpoint_holding_non_finite_weights_is_one_line_per_kind_exit_2(checkpoint, tmp_path, value, count):
    # Nothing computed from NaN or infinite weights can be aligned: refused before either model runs, naming the
    # file, the tensor and how many values; tensors of one pattern (the same weight in other layers) grouped.
    import shutil

    import torch

    copy = tmp_path / "ckpt"
    shutil.copytree(checkpoint, copy)
    (weights,) = copy.glob("*.safetensors")
    tensors = load_file(str(weights))
    keys = [f"model.layers.{i}.self_attn.o_proj.weight" for i in range(count)]
    for key in keys:
        tensors[key][0, : 2 if value == "-inf" else 1] = float(value)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    result = runner.invoke(app, ["align", "--reference", str(copy)])
    assert result.exit_code == 2, result.output
    bad = 2 if value == "-inf" else 1
    alike = {1: "", 2: " (and 1 more tensor alike)", 3: " (and 2 more tensors alike)"}[count]
    assert result.stderr.strip().splitlines() == [
        f"error: {weights}: tensor {keys[0]} holds {bad} non-finite value{'s' if bad > 1 else ''} (NaN or infinite)"
        f"{alike}"]
    assert "Traceback" not in result.output and torch.isfinite(load_file(str(checkpoint / weights.name))[keys[0]]).all()


def test_outside_tolerance_exits_1(checkpoint):
    # fp32 against fp32 still differs by rounding (~1e-7): a zero tolerance must fail.
    result = runner.invoke(app, ["align", "--reference", str(checkpoint), "--logits-atol", "0"])
    assert result.exit_code == 1
    assert "NOT aligned: logits max abs" in result.stdout


def test_batch_file(checkpoint, tmp_path):
    batch = tmp_path / "batch.jsonl"
    batch.write_text(json.dumps({"input_ids": [5, 17, 299, 3, 8]}) + "\n" + json.dumps({"input_ids": [1, 2, 3]}) + "\n")
    result = runner.invoke(app, ["align", "--reference", str(checkpoint), "--json", str(tmp_path / "r.json")])
    assert result.exit_code == 0
    result = runner.invoke(app, ["align", "--reference", str(checkpoint), "--batch", str(batch), "--json",
                                 str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "r.json").read_text())["documents"] == [5, 3]


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "error: --reference DIR or --golden FILE is required"),
        (["--reference", "/nonexistent"], "error: --reference ('/nonexistent') must be a checkpoint directory"),
        (["--golden", "g.safetensors", "--pin-routing"], "error: --pin-routing compares with the reference"),
        (["--golden", "g.safetensors", "--kl", "-1"], "error: --kl (-1.0) must be a finite number >= 0"),
        (["--golden", "."], "error: --golden ('.') is a folder: name the trace file"),
        (["--golden", "/", "--update-golden"], "error: --golden ('/') is a folder: name the trace file"),
    ],
)
def test_bad_input_exits_2(args, message, tmp_path):
    result = runner.invoke(app, ["align", *args])
    assert result.exit_code == 2
    assert result.stderr.startswith(message)
    assert "Traceback" not in result.output


@pytest.mark.parametrize("others", [[], ["--update-golden"], ["--json", "{tmp}/r.json"]],
                         ids=["alone", "update", "with_json"])
def test_a_golden_whose_folder_does_not_exist_is_one_line_exit_2_before_anything_runs(tmp_path, others):
    # As --json: the trace is written where it is named, into a folder that exists.
    golden = tmp_path / "missing" / "g.safetensors"
    result = runner.invoke(app, ["align", "--golden", str(golden), *(a.format(tmp=tmp_path) for a in others)])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [f"error: --golden ('{golden}'): its folder '{golden.parent}' does not exist"]
    assert result.stdout == "" and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("others", [[], ["--reference", "{ckpt}"], ["--reference", "{ckpt}", "--pin-routing"]],
                         ids=["alone", "with_reference", "pinned"])
def test_update_golden_without_golden_is_one_line_exit_2_before_anything_runs(checkpoint, others):
    # It was ignored: the run compared with the reference and exited 0, re-recording nothing.
    result = runner.invoke(app, ["align", "--update-golden", *(a.format(ckpt=checkpoint) for a in others)])
    assert result.exit_code == 2, result.output
    assert "error: --update-golden re-records the --golden trace: give --golden FILE" in result.stderr.splitlines()
    assert result.stdout == ""


@pytest.mark.parametrize("option", ["--batch", "--golden"])
@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_batch_or_golden_that_is_no_regular_file_is_refused_not_read(checkpoint, tmp_path, option, kind):
    """A FIFO would block the read for ever, a device such as /dev/zero never end it."""
    import os

    path = tmp_path / "pipe" if kind == "fifo" else "/dev/null"
    if kind == "fifo":
        os.mkfifo(path)
    result = runner.invoke(app, ["align", "--reference", str(checkpoint), option, str(path)])
    assert result.exit_code == 2, result.output
    shown = "a FIFO" if kind == "fifo" else "a character device"
    assert result.stderr.splitlines() == [f"error: {option} ({str(path)!r}) is not a regular file ({shown}); name a "
                                          "file"]  # fmt: skip


def test_bad_batch_record_exits_2(checkpoint, tmp_path):
    batch = tmp_path / "batch.jsonl"
    batch.write_text(json.dumps({"input_ids": [5, 300]}) + "\n")
    result = runner.invoke(app, ["align", "--reference", str(checkpoint), "--batch", str(batch)])
    assert result.exit_code == 2
    assert f"--batch {batch}:1: input_ids must be >= 2 ints in [0, 300) (got 300)" in result.stderr


def test_golden_records_then_checks_then_catches_a_change(tmp_path):
    golden = tmp_path / "tiny.golden.safetensors"
    first = runner.invoke(app, ["align", "--golden", str(golden)])
    assert first.exit_code == 0 and "recorded golden trace" in first.stdout
    again = runner.invoke(app, ["align", "--golden", str(golden)])
    assert again.exit_code == 0, again.output
    assert "max abs" in again.stdout
    # A different model (another init seed, another attention kind) is refused naming the field: a mix-up is no
    # regression of the code.
    import yaml

    from moe_tune.profiles import load_profile

    for index, (edit, field) in enumerate([(lambda m: m.update(seed=1), "model.seed 0 there, 1 here"),
                                           (lambda m: m["layers"][0].update(attention="full"),
                                            "model.layers[0].attention \"linear\" there, \"full\" here")]):
        raw = load_profile("tiny").model_dump(mode="json")
        edit(raw["model"])
        other_profile = tmp_path / f"other{index}.yaml"
        other_profile.write_text(yaml.safe_dump(raw))
        changed = runner.invoke(app, ["align", "--golden", str(golden), "--profile", str(other_profile)])
        assert changed.exit_code == 2, changed.output
        assert changed.stderr.splitlines()[0].startswith(f"error: --golden ({str(golden)!r}) was recorded from another "
                                                         f"model: {field}"), changed.stderr
    # A trace whose logits were altered is caught too.
    tensors = load_file(str(golden))
    meta = {"moe_tune_golden": json.dumps({"model": "profile"})}
    tensors["logits"] = tensors["logits"] + 1e-3
    save_file(tensors, str(golden), metadata=meta)
    assert runner.invoke(app, ["align", "--golden", str(golden)]).exit_code == 1


@pytest.mark.parametrize("update", [[], ["--update-golden"]], ids=["record", "update"])
def test_a_model_the_host_memory_cannot_hold_is_refused_before_it_is_built(tmp_path, monkeypatch, update):
    from moe_tune.engine.model import model as model_module
    from moe_tune.engine.plan import model_parameters
    from moe_tune.engine.train import resources
    from moe_tune.profiles import load_profile

    total = sum(p.numel for p in model_parameters(load_profile("tiny").model))
    monkeypatch.setattr(resources, "host_available_memory", lambda: total * 4 - 1)
    monkeypatch.setattr(model_module, "build_model", lambda cfg: pytest.fail("the model was built"))
    golden = tmp_path / "g.safetensors"
    result = runner.invoke(app, ["align", "--golden", str(golden), *update])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [f"error: the model ({total / 1e9:.2f}B parameters) needs ~"
                                          f"{total * 4 / 1e9:.1f} GB of host memory in fp32 for align, more than the "
                                          f"{(total * 4 - 1) / 1e9:.1f} GB available"]  # fmt: skip
    assert not golden.exists()


def test_a_golden_trace_the_disk_cannot_hold_is_one_line_and_the_old_one_kept(tmp_path, monkeypatch):
    """--update-golden on a full disk: safetensors' own error (no OSError) is one line, the previous trace kept."""
    import safetensors.torch
    from safetensors import SafetensorError

    def disk_full(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\0" * 8)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    golden = tmp_path / "g.safetensors"
    assert runner.invoke(app, ["align", "--golden", str(golden)]).exit_code == 0
    previous = golden.read_bytes()
    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    result = runner.invoke(app, ["align", "--golden", str(golden), "--update-golden"])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [f"error: --golden ({str(golden)!r}): cannot write the trace (Error while "
                                          "serializing: I/O error: No space left on device (os error 28)); the file "
                                          "is as it was"]  # fmt: skip
    assert golden.read_bytes() == previous and [p.name for p in tmp_path.iterdir()] == ["g.safetensors"]


def test_a_batch_given_with_an_existing_golden_trace_is_read_and_must_be_its_batch(tmp_path):
    golden = tmp_path / "g.safetensors"
    recorded = tmp_path / "recorded.jsonl"
    recorded.write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in ([5, 17, 200, 3], [1, 2, 3])))
    assert runner.invoke(app, ["align", "--golden", str(golden), "--batch", str(recorded)]).exit_code == 0
    # The same batch: checked against the trace as without --batch.
    same = runner.invoke(app, ["align", "--golden", str(golden), "--batch", str(recorded)])
    assert same.exit_code == 0, same.output
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"input_ids": [5, 17, 200, 3, 9]}) + "\n")
    shuffled = tmp_path / "shuffled.jsonl"
    shuffled.write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in ([5, 17, 201, 3], [1, 2, 3])))
    for batch, difference in [(other, "documents of [5] tokens, the trace's of [4, 3]"), (shuffled, "other token ids"),
                              (tmp_path / "missing.jsonl", "cannot read"),
                              (_write(tmp_path / "oov.jsonl", {"input_ids": [5, 999999]}), "input_ids must be")]:
        result = runner.invoke(app, ["align", "--golden", str(golden), "--batch", str(batch)])
        assert result.exit_code == 2, (batch, result.output)
        (line,) = result.stderr.strip().splitlines()
        assert difference in line and str(batch) in line, line


def _write(path, record):
    path.write_text(json.dumps(record) + "\n")
    return path


def test_not_a_golden_trace_exits_2(tmp_path):
    bogus = tmp_path / "bogus.safetensors"
    bogus.write_bytes(b"not safetensors")
    result = runner.invoke(app, ["align", "--golden", str(bogus)])
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: --golden {bogus}: not a golden trace")


def test_sparse_attention_selections_pinned_and_counted(tmp_path):
    # 3 indexer heads, 12 keys per query below the 23-token document: tied selections differ before pinning.
    checkpoint = save_tiny_checkpoint(tiny_deepseek_v32(index_n_heads=3, index_topk=12), tmp_path / "dsv32")
    out = tmp_path / "report.json"
    result = runner.invoke(app, ["align", "--reference", str(checkpoint), "--pin-routing", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "routing and sparse attention selections pinned to the reference's" in result.stdout
    report = json.loads(out.read_text())
    for row in report["selections"]:
        line = (f"layer {row['layer']} sparse attention: {row['differed']} of 46 query rows chose other keys than "
                "the reference before pinning")
        assert line in result.stdout
    assert sum(row["differed"] for row in report["selections"]) >= 1
    # Those rows tie (their keys score 0): none is beyond a tie.
    assert all(row["beyond_tie"] == 0 and row["tie_shift"] <= 1e-5 for row in report["selections"])
    assert "0 of them beyond a tie" in result.stdout


def test_a_wrong_indexer_pinning_hides_is_printed_and_fails(tmp_path, monkeypatch):
    # The indexer's ReLU dropped: with the reference's keys pinned every number aligns, our own choice does not.
    import moe_tune.engine.model.mla as mla

    op = mla.topk_indexer
    monkeypatch.setattr(mla, "topk_indexer", lambda *args, **kw: op(*args, **{**kw, "activation": "none"}))
    checkpoint = save_tiny_checkpoint(tiny_deepseek_v32(), tmp_path / "dsv32")
    out = tmp_path / "r.json"
    result = runner.invoke(app, ["align", "--reference", str(checkpoint), "--pin-routing", "--json", str(out)])
    assert result.exit_code == 1, result.output
    report = json.loads(out.read_text())
    assert all(row["rel"] <= 1e-4 for row in report["layers"]) and report["logits"]["max_abs"] <= 1e-4
    selections = report["selections"]
    assert [row["layer"] for row in selections] == [0, 1, 2] and all(row["beyond_tie"] > 0 for row in selections)
    assert all(row["tie_shift"] > 1e-2 and row["left_out"] > 0 for row in selections)
    for row in selections:
        assert (f"layer {row['layer']} sparse attention: {row['differed']} of 46 query rows chose other keys than the "
                f"reference before pinning (the budget left keys out in {row['left_out']}), {row['beyond_tie']} of "
                "them beyond a tie") in result.stdout
        assert (f"NOT aligned: layer {row['layer']} sparse attention: {row['beyond_tie']} of 46 query rows chose "
                "other keys than the reference beyond a tie") in result.stdout
    assert report["failures"] == [line.removeprefix("NOT aligned: ") for line in result.stdout.splitlines()
                                  if line.startswith("NOT aligned: ")]


TOLERANCES = ["--logits-atol", "--kl", "--loss-atol", "--grad-rtol", "--hidden-rtol"]


@pytest.mark.parametrize("value, printed", [("nan", "nan"), ("inf", "inf"), ("-inf", "-inf"), ("-1e-9", "-1e-09")])
@pytest.mark.parametrize("option", TOLERANCES)
def test_a_tolerance_not_finite_and_at_least_0_is_one_line_exit_2_before_anything_runs(tmp_path, option, value,
                                                                                         printed):  # fmt: skip
    golden = tmp_path / "g.safetensors"
    result = runner.invoke(app, ["align", "--golden", str(golden), option, value])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [f"error: {option} ({printed}) must be a finite number >= 0"]
    # Nothing ran: no trace was recorded.
    assert not golden.exists() and result.stdout == ""


@pytest.mark.parametrize("option", TOLERANCES)
def test_a_zero_tolerance_is_accepted(tmp_path, option):
    # 0 is the strictest tolerance, not bad input: the trace is recorded (a record compares nothing).
    golden = tmp_path / "g.safetensors"
    result = runner.invoke(app, ["align", "--golden", str(golden), option, "0"])
    assert result.exit_code == 0, result.output
    assert golden.exists()


@pytest.mark.parametrize(
    "json_at, line",
    [
        ("{tmp}", "--json ('{tmp}') is a folder: name a file to write"),
        ("{tmp}/missing/r.json", "--json ('{tmp}/missing/r.json'): its folder '{tmp}/missing' does not exist"),
        ("{batch}", "--json ('{batch}') is the --batch file: the run would overwrite it; name another file"),
        ("{ckpt}/config.json", "--json ('{ckpt}/config.json') is the --reference config.json file: the run would "
         "overwrite it; name another file"),
        ("{ckpt}/model.safetensors", "--json ('{ckpt}/model.safetensors') is the --reference model.safetensors "
         "file: the run would overwrite it; name another file"),
    ],
    ids=["folder", "no-folder", "batch", "reference-config", "reference-weights"],
)  # fmt: skip
def test_a_json_that_cannot_be_written_or_is_an_input_is_one_line_exit_2_before_anything_runs(
    checkpoint, tmp_path, json_at, line
):
    import shutil

    # A copy: a --json written over its files must not break the module's checkpoint for the tests after this one.
    copy = shutil.copytree(checkpoint, tmp_path / "ckpt")
    batch = tmp_path / "batch.jsonl"
    batch.write_text(json.dumps({"input_ids": [5, 17, 299]}) + "\n")
    inputs = [batch, *sorted(copy.iterdir())]
    before = {path: path.read_bytes() for path in inputs}
    paths = dict(tmp=tmp_path, batch=batch, ckpt=copy)
    result = runner.invoke(app, ["align", "--reference", str(copy), "--batch", str(batch), "--json",
                                 json_at.format(**paths)])  # fmt: skip
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == ["error: " + line.format(**paths)]
    assert result.stdout == "" and {path: path.read_bytes() for path in inputs} == before


@pytest.mark.parametrize("option", ["--golden", "--profile"])
def test_a_json_that_is_the_golden_trace_or_the_profile_is_refused(tmp_path, option):
    other = tmp_path / "input"
    other.write_text("model: {}\n")
    args = ["--golden", str(other)]
    if option == "--profile":
        args = ["--golden", str(tmp_path / "g"), "--profile", str(other)]
    result = runner.invoke(app, ["align", *args, "--json", str(other)])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        f"error: --json ('{other}') is the {option} file: the run would overwrite it; name another file"
    ]
    assert other.read_text() == "model: {}\n"


def test_documents_whose_reference_lora_gradients_are_zero_align(checkpoint, tmp_path):
    # Two-token documents: the one labelled token attends to itself alone, so the reference's q and k adapter
    # gradients are exactly zero and ours hold rounding noise; measured against the scale of all adapters' gradients,
    # that noise is far below the tolerance.
    batch = tmp_path / "pairs.jsonl"
    batch.write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in ([1, 2], [250, 7], [299, 0])))
    out = tmp_path / "r.json"
    result = runner.invoke(app, ["align", "--reference", str(checkpoint), "--batch", str(batch), "--json", str(out)])
    assert result.exit_code == 0, result.output
    grads = {row["name"]: row for row in json.loads(out.read_text())["lora_grads"]}
    zero_reference = [name for name in grads if ".q_proj." in name or ".k_proj." in name]
    assert zero_reference and all(grads[name]["rel"] <= 1e-5 for name in zero_reference)


@pytest.fixture(scope="module")
def checkpoint_with_tokenizer(checkpoint, tmp_path_factory):
    """The tiny checkpoint with a character-level tokenizer: ids 1-96 for the printable characters, 0 unknown."""
    import shutil

    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    directory = tmp_path_factory.mktemp("align-text") / "qwen3_moe"
    shutil.copytree(checkpoint, directory)
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    core = Tokenizer(models.WordLevel({"<unk>": 0} | {c: i + 1 for i, c in enumerate(chars)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>").save_pretrained(directory)
    return directory


def test_every_bad_batch_line_is_reported_with_its_number(checkpoint_with_tokenizer, tmp_path):
    lines = [
        {"input_ids": [1, 2, 3]},
        {"input_ids": [999999, 1]},
        {"input_ids": [1, -1]},
        {"input_ids": []},
        {"input_ids": [7]},
        {"input_ids": [1.5, 2]},
        {"input_ids": [True, False]},
        {"input_ids": [1, [2]]},
        {"input_ids": "abc"},
        {"text": ""},
        {"text": "a"},
        {"text": 12},
        {"text": "hi", "input_ids": [1, 2]},
        {"ids": [1, 2]},
        [1, 2],
        {"text": "ok"},
    ]
    batch = tmp_path / "batch.jsonl"
    batch.write_text("".join(json.dumps(line) + "\n" for line in lines) + "{not json\n")
    result = runner.invoke(app, ["align", "--reference", str(checkpoint_with_tokenizer), "--batch", str(batch)])
    assert result.exit_code == 2, result.output
    ids_rule = "input_ids must be >= 2 ints in [0, 300)"
    records = 'must be {"input_ids": [...]} or {"text": "..."}'
    assert result.stderr.strip().splitlines() == [f"error: --batch {batch}:{number}: {line}" for number, line in [
        (2, f"{ids_rule} (got 999999)"),
        (3, f"{ids_rule} (got -1)"),
        (4, ids_rule),
        (5, ids_rule),
        (6, f"{ids_rule} (got 1.5)"),
        (7, f"{ids_rule} (got True)"),
        (8, f"{ids_rule} (got [2])"),
        (9, "input_ids ('abc') must be a list of token ids"),
        (10, "text ('') gives 0 tokens: a document needs >= 2"),
        (11, "text ('a') gives 1 token: a document needs >= 2"),
        (12, "text (12) must be a string"),
        (13, f"{records} (not both)"),
        (14, records),
        (15, records),
        (17, "not valid JSON (Expecting property name enclosed in double quotes)"),
    ]]  # fmt: skip


def test_a_text_record_is_tokenized_with_the_checkpoints_tokenizer(checkpoint_with_tokenizer, tmp_path):
    batch = tmp_path / "batch.jsonl"
    batch.write_text(json.dumps({"text": "hello"}) + "\n" + json.dumps({"input_ids": [5, 17]}) + "\n")
    out = tmp_path / "r.json"
    result = runner.invoke(app, ["align", "--reference", str(checkpoint_with_tokenizer), "--batch", str(batch),
                                 "--json", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["documents"] == [5, 2]


def test_a_routing_rule_pinning_hides_is_printed_and_fails(checkpoint, tmp_path, monkeypatch):
    # A selection bias where the checkpoint has none: with the reference's experts pinned every number aligns, our
    # own choice does not.
    import torch

    import moe_tune.engine.model.moe as moe_module

    route = moe_module.topk_route

    def biased(logits, top_k, **kw):
        return route(logits, top_k, **{**kw, "selection_bias": torch.linspace(0.0, 1.0, logits.shape[-1])})

    monkeypatch.setattr(moe_module, "topk_route", biased)
    out = tmp_path / "r.json"
    result = runner.invoke(app, ["align", "--reference", str(checkpoint), "--pin-routing", "--json", str(out)])
    assert result.exit_code == 1, result.output
    routing = json.loads(out.read_text())["routing"]
    assert [route["layer"] for route in routing] == [1, 2] and all(route["beyond_tie"] > 0 for route in routing)
    for route in routing:
        assert (f"layer {route['layer']} routing: {route['differed']} of 46 tokens chose other experts than the "
                f"reference before pinning, {route['beyond_tie']} of them beyond a tie") in result.stdout
        assert (f"NOT aligned: layer {route['layer']} routing: {route['beyond_tie']} of 46 tokens chose other experts "
                "than the reference beyond a tie") in result.stdout


def test_a_sparse_budget_covering_every_document_is_said_to_test_no_selection(tmp_path):
    checkpoint = save_tiny_checkpoint(tiny_deepseek_v32(index_topk=64), tmp_path / "dsv32")
    result = runner.invoke(app, ["align", "--reference", str(checkpoint)])
    assert result.exit_code == 0, result.output
    for layer in range(3):
        assert (f"layer {layer} sparse attention: 0 of 46 query rows chose other keys than the reference (the budget "
                "left keys out in 0)") in result.stdout
    assert ("(every query's budget covered all the keys it sees: the indexers' choice is not tested; give --batch "
            "documents longer than the budget)") in result.stdout


@pytest.mark.parametrize("kind", ["text", "empty", "weights"])
def test_update_golden_over_a_file_that_is_no_golden_trace_is_refused_and_the_file_kept(checkpoint, tmp_path, kind):
    target = tmp_path / "file"
    content = {"text": b"my notes", "empty": b"", "weights": (checkpoint / "model.safetensors").read_bytes()}[kind]
    target.write_bytes(content)
    result = runner.invoke(app, ["align", "--golden", str(target), "--update-golden"])
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: --golden {target}: not a golden trace (") and line.endswith(
        "): --update-golden replaces a golden trace only; remove the file or name another"), line
    assert target.read_bytes() == content and "Traceback" not in result.output


def test_update_golden_re_records_a_golden_trace(tmp_path):
    golden = tmp_path / "g.safetensors"
    assert runner.invoke(app, ["align", "--golden", str(golden)]).exit_code == 0
    result = runner.invoke(app, ["align", "--golden", str(golden), "--update-golden"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == f"recorded golden trace {golden}"


def test_recording_a_golden_trace_says_no_json_report_was_written(tmp_path):
    golden, out = tmp_path / "g.safetensors", tmp_path / "r.json"
    result = runner.invoke(app, ["align", "--golden", str(golden), "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == (f"recorded golden trace {golden}; nothing was compared, so no --json report was "
                                     "written")
    assert golden.exists() and not out.exists()
