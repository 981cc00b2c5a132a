"""Export reads a run's `checkpoints/step-N` (engine/export/zero.py): every tensor assembled from DeepSpeed's
per-rank files equals the run's final state bitwise (ZeRO-3 with expert parallel 2 on two gloo ranks, ZeRO-3 and
ZeRO-1 in one process), one tensor in memory at a time; a folder that does not verify or that export cannot read is
one line."""

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moe_tune.engine.export.sources import FinalState, read_run
from moe_tune.engine.export.zero import open_step
from moe_tune.engine.parallel.launch import rank_env, rendezvous
from moe_tune.engine.train.checkpoint import MANIFEST_FILE, STATE_FILE, write_manifest
from moe_tune.engine.train.trainer import finetune
from moe_tune.profiles import ProfileError, load_profile

WORKER = Path(__file__).with_name("dist_worker.py")
RUN = ["data.seq_len=64", "data.corpus_documents=200", "train.warmup_steps=1", "train.grad_clip=0.5",
       "model.moe.aux_loss_coef=0", "train.lr=0.002", "train.steps=2", "output.save_every=1", "output.keep_last=2"]
HARD_TIMEOUT_S = 300


def one_process_run(out: Path, *extra: str) -> Path:
    finetune(load_profile("tiny", [*RUN, "train.micro_batch_size=2", f"output.dir={out}", *extra]),
             show_progress=False)  # fmt: skip
    return out


@pytest.fixture(scope="module")
def full_zero3(tmp_path_factory) -> Path:
    """A full fine-tune in one process, ZeRO-3: model.safetensors and a checkpoint per step."""
    return one_process_run(tmp_path_factory.mktemp("full-zero3"), "lora.enabled=false")


def assert_reads_final_state(run_dir: Path, step: int) -> None:
    """The checkpoint's tensors equal the run's final state bitwise: the adapter (LoRA) or model.safetensors, and
    every tensor of the merged model as the final state's source gives it."""
    run = read_run(run_dir)
    with open_step(run, step, merged=True) as source, FinalState(run, merged=True) as final:
        assert source.names() == final.names()
        if run.profile.lora.enabled:
            saved = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))
            adapter = source.adapter_state()
            assert adapter.keys() == saved.keys()
            assert any(".experts.lora_A.w_gate_up" in key for key in saved)
            for key, tensor in saved.items():
                assert torch.equal(adapter[key], tensor), key
            names = source.names()
        else:
            saved = load_file(str(run_dir / "model.safetensors"))
            assert set(saved) <= set(source.names()) and any(".experts.w_gate_up" in key for key in saved)
            names = list(saved)
        for name in names:
            mine = source.read(name)
            assert mine.shape == final.read(name).shape and torch.equal(mine, final.read(name)), name
            if ".experts.w_" in name:
                # One expert alone, as the writer asks for it: the same bytes as that expert of the whole tensor.
                for e in range(mine.shape[0]):
                    alone = source.read_expert(name, e)
                    assert torch.equal(alone, mine[e : e + 1]) and torch.equal(alone, final.read_expert(name, e)), name


def test_one_process_zero3_checkpoint_reads_as_the_final_state(full_zero3):
    assert_reads_final_state(full_zero3, 2)
    # The earlier step is another state, read the same way.
    with open_step(read_run(full_zero3), 1, merged=True) as first:
        assert not torch.equal(first.read("layers.0.mlp.experts.w_gate_up"),
                               load_file(str(full_zero3 / "model.safetensors"))["layers.0.mlp.experts.w_gate_up"])


def test_one_process_zero1_lora_checkpoint_reads_as_the_final_state(tmp_path):
    assert_reads_final_state(one_process_run(tmp_path / "run", "parallel.zero_stage=1"), 2)


def test_reading_holds_one_tensor_at_a_time(full_zero3, monkeypatch):
    loads = []
    real_load = torch.load

    def spy(*args, **kwargs):
        loads.append(kwargs)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    with open_step(read_run(full_zero3), 2, merged=True) as source:
        checkpoint = source.checkpoint
        sizes = []
        for name in source.names():
            tensor = source.read(name)
            sizes.append(tensor.numel() * tensor.element_size())
            del tensor
        # Every byte the reader allocated belonged to the one tensor being read, and was released with it.
        assert checkpoint.peak_live_bytes == max(sizes) and checkpoint.live_bytes == 0
    # Every rank file is mapped, not read into memory, and nothing but tensor data is unpickled.
    assert loads and all(k.get("mmap") is True and k.get("weights_only") is True for k in loads)


def tamper(folder: Path, how: str) -> str:
    """Damage a copied step folder; return the refusal expected."""
    state_file = folder / STATE_FILE
    if how == "hash":
        data = bytearray((folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt").read_bytes())
        data[-100] ^= 1
        (folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(bytes(data))
        return r"does not verify: zero_pp_rank_0_mp_rank_00_optim_states.pt does not match its sha256"
    if how == "missing":
        (folder / "zero_pp_rank_0_mp_rank_00_model_states.pt").unlink()
        return r"does not verify: zero_pp_rank_0_mp_rank_00_model_states.pt is missing"
    state = json.loads(state_file.read_text())
    if how == "world":
        # A manifest that agrees with a folder of the wrong layout (a checkpoint copied from a smaller run).
        state["signature"]["fixed"]["world_size"] = 2
        expected = r"the states of ranks \[1\] are missing \(the run had 2 ranks\)"
    elif how == "layout":
        state["signature"]["fixed"]["parallel"]["expert_parallel"] = 3
        expected = r"world size 1 and expert_parallel 3 are not a layout export can read"
    else:
        torch.save({"optimizer_state_dict": argparse.Namespace(run="code")},
                   folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
        expected = r"optim_states.pt: refused, it holds pickled objects other than tensor data"
    state_file.write_text(json.dumps(state))
    (folder / MANIFEST_FILE).unlink()
    write_manifest(folder)
    return expected


@pytest.mark.parametrize("how", ["hash", "missing", "world", "layout", "pickle"])
def test_a_step_it_cannot_read_is_one_line(full_zero3, tmp_path, how):
    run_dir = tmp_path / "run"
    shutil.copytree(full_zero3, run_dir, ignore=shutil.ignore_patterns("step-0000001"))
    expected = tamper(run_dir / "checkpoints" / "step-0000002", how)
    with pytest.raises(ProfileError, match=expected) as caught:
        open_step(read_run(run_dir), 2, merged=True)
    assert len(caught.value.problems) == 1 and "\n" not in caught.value.problems[0]


@pytest.mark.parametrize("step", [3, 1])
def test_a_step_that_is_not_there_lists_those_that_are(full_zero3, tmp_path, step):
    run_dir = tmp_path / "run"
    shutil.copytree(full_zero3, run_dir, ignore=shutil.ignore_patterns("step-0000001"))
    with pytest.raises(ProfileError, match=rf"--step {step}: no checkpoint .*step-000000{step} \(the checkpoints "
                                          r"there are steps 2\)"):  # fmt: skip
        open_step(read_run(run_dir), step, merged=True)


@pytest.mark.parametrize("renamed", ["step-1", "step-01", "step-00000001"])
def test_a_step_in_a_folder_named_otherwise_is_not_read_and_the_line_says_why(full_zero3, tmp_path, renamed):
    run_dir = tmp_path / "run"
    shutil.copytree(full_zero3, run_dir)
    checkpoints = run_dir / "checkpoints"
    (checkpoints / "step-0000001").rename(checkpoints / renamed)
    (checkpoints / "step-2x").mkdir()
    with pytest.raises(ProfileError) as caught:
        open_step(read_run(run_dir), 1, merged=True)
    assert caught.value.problems == [
        f"--step 1: no checkpoint {checkpoints / 'step-0000001'} (the checkpoints there are steps 2; {renamed} is not "
        "named as the trainer names checkpoints (step-0000001))"]  # fmt: skip


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.dist
def test_expert_parallel_checkpoint_reads_and_exports_as_the_final_state(tmp_path, child_env):
    """A qwen3_moe checkpoint fine-tuned by two gloo ranks, ZeRO-3, expert parallel 2, LoRA on attention and
    experts: each rank holds half of the experts and half of every dense slice. The step read back in one process
    equals the adapter the run consolidated at its end and every tensor of its final state, bitwise, and exports
    the same bytes (merged model and adapter) as the final state does."""
    from hf_tiny import save_tiny_checkpoint, tiny_qwen3_moe

    from moe_tune.engine.export.hub import export_run

    checkpoint = save_tiny_checkpoint(tiny_qwen3_moe(num_experts=6), tmp_path / "qwen3_moe")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i} about experts {i * 3}"}) + "\n" for i in range(40)))
    out = tmp_path / "ep2"
    profile = tmp_path / "profile.yaml"
    profile.write_text(json.dumps({
        "name": "export-ep2", "model": {"checkpoint": str(checkpoint)},
        "data": {"path": str(data), "tokenizer": "byte", "seq_len": 48},
        "lora": {"experts": True}, "parallel": {"expert_parallel": 2},
        "train": {"steps": 2, "lr": 0.002, "micro_batch_size": 2, "grad_clip": 0.5},
        "output": {"dir": str(out), "save_every": 1},
    }))  # fmt: skip
    cmd = [sys.executable, str(WORKER), "--result", str(tmp_path / "result.json"), "--profile", str(profile)]
    # One intra-op thread a rank: CI runs the suite on two workers on two cores.
    env = {**child_env, "OMP_NUM_THREADS": "1"}
    with rendezvous() as port:
        procs = [subprocess.Popen(cmd, env=rank_env(r, 2, port, env), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for r in range(2)]  # fmt: skip
        logs = [p.communicate(timeout=HARD_TIMEOUT_S)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs[0][-3000:]
    step = out / "checkpoints" / "step-0000002"
    assert sorted(p.name for p in step.glob("*optim_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert_reads_final_state(out, 2)
    for merge in (True, False):
        final = export_run(out, merge, tmp_path / f"final-{merge}")
        from_step = export_run(out, merge, tmp_path / f"step-{merge}", step=2)
        written = folder_bytes(final)
        assert any(name.endswith(".safetensors") for name in written)
        assert folder_bytes(from_step) == written, merge
