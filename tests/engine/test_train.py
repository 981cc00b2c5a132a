"""Training through DeepSpeed ZeRO-3 in one CPU process: equal to a plain PyTorch loop, exact resume, atomic
checkpoints, clean stop on signals, and exports that load back."""

import json
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from moe_tune.engine.data.dataset import PackedDataset, load_documents
from moe_tune.engine.data.tokenizer import load_tokenizer
from moe_tune.engine.lora import load_adapter
from moe_tune.engine.model.model import build_model
from moe_tune.engine.train.checkpoint import checkpoint_name, complete_checkpoints
from moe_tune.engine.train.ds_config import deepspeed_config, zero_stage_note
from moe_tune.engine.train.trainer import (
    TrainingDiverged,
    build_trainable_model,
    check_finite,
    ensure_training,
    finetune,
    lr_factor,
)
from moe_tune.profiles import ProfileError, load_profile

SMALL = ["data.seq_len=64", "train.micro_batch_size=2", "train.warmup_steps=1", "data.corpus_documents=200"]


def small_profile(out, *extra):
    return load_profile("tiny", [*SMALL, f"output.dir={out}", *extra])


def plain_pytorch_losses(profile, steps):
    """The same training written without DeepSpeed: the oracle for ZeRO-3 in one process."""
    tok = load_tokenizer(profile.tokenizer)
    data = PackedDataset(load_documents(profile.data, tok), profile.data.seq_len, tok.pad_id, profile.data.seed)
    torch.manual_seed(profile.train.seed)
    model, trainable = build_trainable_model(profile)
    opt = torch.optim.AdamW(
        trainable, lr=profile.train.lr, betas=profile.train.betas, weight_decay=profile.train.weight_decay, foreach=False
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, profile.train))
    losses = []
    for step in range(steps):
        batch = data.micro_batch(step, profile.train.micro_batch_size)
        out = model(input_ids=batch.input_ids, cu_seqlens=batch.cu_seqlens, labels=batch.labels)
        out.loss.backward()
        if profile.train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(trainable, profile.train.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(out.lm_loss.item())
    return losses


def chats_of_uneven_answers(path, records=40):
    """Chat records whose rows train very different numbers of tokens: a long question with a two-letter answer, or
    a short one with a long answer."""
    rng = random.Random(0)
    with path.open("w") as f:
        for i in range(records):
            question, answer = [("tell me " * rng.randint(4, 7), "ok"), ("hi", " ".join(
                str(rng.randint(0, 999)) for _ in range(rng.randint(8, 14))))][i % 2]
            f.write(json.dumps({"messages": [{"role": "user", "content": question},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    return path


@pytest.mark.parametrize("stage", [3, 1])
def test_accumulated_micro_batches_train_as_one_batch_of_their_rows(tmp_path, stage):
    """micro_batch_size 1 x 2 accumulation steps reads the rows micro_batch_size 2 reads in one: the same losses and
    adapters, however many tokens each row trains (the mean is over the step's tokens, not of the micro-batches'
    means, which would weigh a row's few tokens as much as another's many)."""
    data = chats_of_uneven_answers(tmp_path / "chats.jsonl")
    common = [f"data.path={data}", "train.steps=3", "train.warmup_steps=0", "train.lr=1e-3", "train.grad_clip=0",
              "model.moe.aux_loss_coef=0", f"parallel.zero_stage={stage}"]
    results = [finetune(load_profile("tiny", [*common, f"output.dir={tmp_path / name}", *shape]), show_progress=False)
               for name, shape in (("one", ["train.micro_batch_size=2"]),
                                   ("two", ["train.micro_batch_size=1", "train.gradient_accumulation_steps=2"]))]
    tok, data = load_tokenizer("byte"), load_profile("tiny", [*common, "output.dir=x"]).data
    rows = PackedDataset(load_documents(data, tok), data.seq_len, tok.pad_id, data.seed)
    counts = [sum(label != -100 for label in rows.row(i).labels) for i in range(6)]
    assert len(set(counts)) > 2, counts  # the rows train unequal numbers of tokens
    adapters = [load_file(str(r.adapter / "adapter_model.safetensors")) for r in results]
    for name, tensor in adapters[0].items():
        # Adam turns rounding in a gradient's near-zero elements into steps of about lr: the B factors (zero at the
        # start, 3 steps in) differ by 0.25% of their norm, where averaging the micro-batches' means moves them by
        # a third.
        assert (adapters[1][name] - tensor).norm() <= 1e-2 * tensor.norm(), name
    assert results[1].losses == pytest.approx(results[0].losses, rel=1e-5)


@pytest.mark.parametrize("stage", [3, 2, 1])  # 1: what the benchmark profiles run on their one GPU
def test_zero_equals_plain_pytorch(tmp_path, stage):
    # A low clipping threshold so clipping is active on every step.
    profile = small_profile(tmp_path, "train.steps=4", "train.grad_clip=0.5", f"parallel.zero_stage={stage}")
    result = finetune(profile, show_progress=False)
    expected = plain_pytorch_losses(profile, 4)
    assert result.losses == pytest.approx(expected, rel=1e-5, abs=1e-6)
    config = json.loads((tmp_path / "deepspeed_config.json").read_text())
    assert config["zero_optimization"]["stage"] == stage
    assert config["gradient_clipping"] == 0.5


@pytest.mark.parametrize("stage, what", [(3, "gradients and dense weights"), (2, "gradients")])
def test_zero_2_and_3_on_one_gpu_get_a_one_line_note(stage, what):
    profile = load_profile("tiny", [f"parallel.zero_stage={stage}"])
    note = zero_stage_note(profile, 1, "cuda")
    assert note.startswith(f"note: parallel.zero_stage {stage} on one GPU partitions the {what} over")
    assert "\n" not in note
    assert note.endswith("on one GPU set parallel.zero_stage: 1")
    # Several processes (sharding pays), the CPU, or stage 0 or 1 already: nothing to say.
    assert zero_stage_note(profile, 2, "cuda") is None
    assert zero_stage_note(profile, 1, "cpu") is None
    for quiet in (0, 1):
        assert zero_stage_note(load_profile("tiny", [f"parallel.zero_stage={quiet}"]), 1, "cuda") is None


@pytest.mark.parametrize("zero_stage", [3, 1])
def test_resume_continues_with_identical_losses(tmp_path, zero_stage):
    # ZeRO-1/2 checkpoints also hold DeepSpeed's parameter slice mappings (fragment_address), which the safe loader
    # must allow.
    stage = f"parallel.zero_stage={zero_stage}"
    straight = finetune(small_profile(tmp_path / "a", "train.steps=6", "output.save_every=3", stage),
                        show_progress=False)  # fmt: skip
    split_profile = small_profile(tmp_path / "b", "train.steps=6", "output.save_every=3", stage)
    first = finetune(split_profile, show_progress=False, stop_after=3)
    assert [p.name for p in complete_checkpoints(tmp_path / "b" / "checkpoints")] == ["step-0000003"]
    # A crash mid-write leaves a temporary directory and a step directory without its state file: both ignored.
    (tmp_path / "b" / "checkpoints" / ".incomplete-step-0000004").mkdir()
    (tmp_path / "b" / "checkpoints" / "step-0000005").mkdir()
    second = finetune(split_profile, show_progress=False, resume=True)
    assert second.start_step == 3 and not any("other documents" in note for note in second.resume_notes)
    assert first.losses + second.losses == straight.losses
    assert not (tmp_path / "b" / "checkpoints" / ".incomplete-step-0000004").exists()
    # The metrics file reads as one uninterrupted run.
    steps = [json.loads(line)["step"] for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("change", ["fewer records", "same counts"])
def test_a_resume_on_other_documents_says_so(tmp_path, change):
    """A data file regenerated between a run and its --resume: a note names what the checkpoint trained on and what
    the data gives now (the same counts with other tokens said so); the run goes on."""
    data = tmp_path / "d.jsonl"
    texts = ["alpha beta gamma", "delta epsilon", "zeta eta theta iota", "kappa lambda"]
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    profile = small_profile(tmp_path / "run", "train.steps=3", "output.save_every=1", f"data.path={data}")
    finetune(profile, show_progress=False, stop_after=1)
    now = texts[:2] if change == "fewer records" else [t.upper() for t in texts]
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in now))
    result = finetune(profile, show_progress=False, resume=True)
    tokens = {t: len(t) + 1 for t in texts}  # the byte tokenizer: <bos> and each byte
    was = f"4 documents, {sum(tokens.values())} tokens, 0 evaluation documents"
    is_now = f"{len(now)} documents, {sum(len(t) + 1 for t in now)} tokens, 0 evaluation documents"
    same = " (the same counts, other tokens or another order)" if change == "same counts" else ""
    assert result.start_step == 1 and result.resume_notes == [
        f"note: {tmp_path / 'run' / 'checkpoints' / 'step-0000001'} was trained on other documents than the data "
        f"gives now ({was} then; {is_now} now{same}): the rows from step 1 on are not those of an uninterrupted run"]


@pytest.mark.parametrize("refused", ["lora.r=8", "model.hidden_size=32", "damaged", "finished"])
def test_a_refused_resume_leaves_the_run_settings_as_trained(tmp_path, refused):
    """profile.yaml and deepspeed_config.json describe the checkpoints beside them (generate and export read the
    model from profile.yaml): a --resume refused for its profile or its checkpoints must not rewrite them. A finished
    run resumed has nothing to train: its folder stays byte for byte (its summary, adapter and model card were
    rewritten without losses)."""
    profile = small_profile(tmp_path, "train.steps=2", "output.save_every=1")
    finetune(profile, show_progress=False)
    written = {name: (tmp_path / name).read_bytes() for name in ("profile.yaml", "deepspeed_config.json")}
    if refused == "finished":
        files = {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()}
        changed = small_profile(tmp_path, "train.steps=2", "output.save_every=1", "train.lr=0.001")
        with pytest.raises(ProfileError) as err:
            finetune(changed, show_progress=False, resume=True)
        assert err.value.problems == ["--resume: the newest checkpoint is already at the run's last step (2); nothing "
                                      "to train"]
        assert {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()} == files
        return
    if refused == "damaged":
        for folder in complete_checkpoints(tmp_path / "checkpoints"):
            (folder / "trainer_state.json").write_text("{")
        changed = small_profile(tmp_path, "train.steps=4", "output.save_every=1", "train.lr=0.001")
    else:
        changed = small_profile(tmp_path, "train.steps=2", "output.save_every=1", refused)
    with pytest.raises(ProfileError, match="^--resume: "):
        finetune(changed, show_progress=False, resume=True)
    assert {name: (tmp_path / name).read_bytes() for name in written} == written


@pytest.mark.parametrize("targets", ["[]", "[down_proj]"])
def test_zero3_trains_expert_adapters_with_nothing_trained_before_the_first_moe_block(tmp_path, targets):
    """ZeRO-3 releases a leaf module's gathered parameters after its backward only when one of its inputs requires
    grad; the first MoE block's input requires none when no adapter sits before its routed experts."""
    profile = small_profile(tmp_path, "train.steps=3", "parallel.zero_stage=3", f"lora.target_modules={targets}",
                            "lora.modules_to_save=[]")  # fmt: skip
    result = finetune(profile, show_progress=False)
    assert result.losses == pytest.approx(plain_pytorch_losses(profile, 3), rel=1e-5, abs=1e-6)


def test_trained_adapter_loads_in_one_process(tmp_path):
    profile = small_profile(tmp_path, "train.steps=8", "train.lr=0.01")
    result = finetune(profile, show_progress=False)
    tok = load_tokenizer("byte")
    batch = PackedDataset(load_documents(profile.data, tok), 64, tok.pad_id, 0).micro_batch(0, 2)
    base = build_model(profile.model).eval()
    with torch.no_grad():
        base_loss = base(batch.input_ids, batch.cu_seqlens, batch.labels).lm_loss.item()
        tuned = load_adapter(build_model(profile.model), result.adapter).eval()
        tuned_loss = tuned(input_ids=batch.input_ids, cu_seqlens=batch.cu_seqlens, labels=batch.labels).lm_loss.item()
    assert base_loss == pytest.approx(result.losses[0], rel=1e-5)
    assert tuned_loss < base_loss - 0.3


def test_full_finetune_exports_every_weight(tmp_path):
    profile = small_profile(tmp_path, "train.steps=2", "lora.enabled=false")
    result = finetune(profile, show_progress=False)
    assert result.adapter is None
    state = load_file(str(result.weights))
    model = build_model(profile.model)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(state, strict=False)
    assert set(state) == {n for n, _ in model.named_parameters()}
    changed = [k for k in state if not torch.equal(state[k], initial[k])]
    # Full fine-tuning moves the backbone, not only an adapter.
    assert any(".experts.w_gate_up" in k for k in changed) and any("embed_tokens" in k for k in changed)


@pytest.mark.slow
def test_sigint_checkpoints_and_exits_cleanly(tmp_path, child_env):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "moe_tune", "finetune", "tiny", *[a for s in SMALL for a in ("--set", s)],
           "--set", f"output.dir={out}", "--set", "train.steps=500", "--set", "output.save_every=1000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=child_env)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    last_step = json.loads(metrics.read_text().splitlines()[-1])["step"]
    (checkpoint,) = complete_checkpoints(out / "checkpoints")
    assert json.loads((checkpoint / "trainer_state.json").read_text())["step"] == last_step
    assert "stopped by SIGINT" in stdout and "--resume" in stdout
    assert (out / "adapter" / "adapter_model.safetensors").is_file()


def test_merged_export_equals_the_adapter(tmp_path):
    """output.save_merged writes the merged model in a transformers model type's layout (tests/engine/
    test_export_hub.py checks checkpoint runs); the tiny profile's architecture has none (sparse attention, a routing
    bias): the run names why and writes no model in moe-tune's internal names. The merged weights (W + s B A per
    tensor, what any export writes) give the adapter's logits."""
    from moe_tune.engine.export.sources import FinalState, read_run

    profile = small_profile(tmp_path, "train.steps=3", "output.save_merged=true")
    result = finetune(profile, show_progress=False)
    assert result.merged is None and "not exportable as a transformers model" in result.merged_problem
    assert not (tmp_path / "merged").exists() and not (tmp_path / "merged.safetensors").exists()
    tok = load_tokenizer("byte")
    batch = PackedDataset(load_documents(profile.data, tok), 64, tok.pad_id, 0).micro_batch(1, 2)
    merged = build_model(profile.model).eval()
    with FinalState(read_run(tmp_path), merged=True) as source:
        merged.load_state_dict({name: source.read(name) for name in source.names()}, strict=True)
    adapted = load_adapter(build_model(profile.model), result.adapter).eval()
    with torch.no_grad():
        expected = adapted(input_ids=batch.input_ids, cu_seqlens=batch.cu_seqlens).logits
        with adapted.disable_adapter():
            assert (expected - adapted(input_ids=batch.input_ids, cu_seqlens=batch.cu_seqlens).logits).abs().max() > 1e-3
        torch.testing.assert_close(merged(batch.input_ids, batch.cu_seqlens).logits, expected, atol=1e-5, rtol=1e-5)


def test_a_non_finite_step_stops_training_before_it_is_saved(tmp_path):
    # Adam moves every weight by about lr whatever the gradient: after step 1 the LoRA weights are ~1e30 and step 2's
    # loss overflows. Step 1's checkpoint must stay the newest, and step 2 must be in the metrics for diagnosis.
    profile = small_profile(tmp_path, "train.steps=4", "output.save_every=1", "train.lr=1e30", "train.warmup_steps=0")
    with pytest.raises(TrainingDiverged, match=r"^step 2: loss (nan|inf).* not finite: .* checkpoint, .*step-0*1"):
        finetune(profile, show_progress=False)
    assert [c.name for c in complete_checkpoints(tmp_path / "checkpoints")] == [checkpoint_name(1)]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert torch.isfinite(torch.tensor(records[0]["loss"])) and not torch.isfinite(torch.tensor(records[1]["loss"]))


def test_check_finite_names_what_is_not_finite():
    check_finite({"step": 3, "loss": 1.5, "grad_norm": None}, None)
    check_finite({"step": 3, "loss": 1.5, "grad_norm": 0.25}, None)
    with pytest.raises(TrainingDiverged, match=r"^step 3: grad_norm inf not finite: .*no checkpoint was written"):
        check_finite({"step": 3, "loss": 1.5, "grad_norm": float("inf")}, None)
    with pytest.raises(TrainingDiverged, match=r"^step 3: loss nan and grad_norm nan not finite"):
        check_finite({"step": 3, "loss": float("nan"), "grad_norm": float("nan")}, None)


def test_bf16_config_has_no_per_gradient_overflow_check():
    # The check reads every gradient to the host each step; bf16 has no loss scale to adjust (check_finite stops
    # a run whose loss or gradient norm is not finite instead).
    bf16 = deepspeed_config(load_profile("tiny", ["train.precision=bf16"]), world_size=1)
    assert bf16["bf16"] == {"enabled": True, "check_grad_overflow": False}
    assert "bf16" not in deepspeed_config(load_profile("tiny", ["train.precision=fp32"]), world_size=1)


def test_deepspeed_throughput_timer_never_waits_for_the_device():
    # Enabled (DeepSpeed's default) it synchronizes at every forward's start and every step.
    from deepspeed.utils.config import get_timers_config

    for stage in (1, 3):
        config = deepspeed_config(load_profile("tiny", [f"parallel.zero_stage={stage}"]), world_size=1)
        assert get_timers_config(config).enabled is False


class _Engine:
    """DeepSpeed's engine as ensure_training sees it: train(mode) sets the model's mode, counted."""

    def __init__(self, module):
        self.module, self.calls = module, 0

    def train(self, mode=True):
        self.calls += 1
        self.module.train(mode)

    def eval(self):
        self.module.train(False)


def test_ensure_training_switches_only_when_needed():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Dropout(), torch.nn.Linear(2, 2)))
    model[1][0].eval()  # a submodule left in eval mode by whoever built the model
    engine = _Engine(model)
    ensure_training(engine)
    assert engine.calls == 1 and all(m.training for m in model.modules())
    ensure_training(engine)
    assert engine.calls == 1
    engine.eval()  # evaluate() and the document losses switch the whole model
    ensure_training(engine)
    assert engine.calls == 2 and all(m.training for m in model.modules())


@pytest.mark.parametrize("stage, world_size, contiguous", [(1, 1, False), (1, 2, True), (2, 1, True), (3, 1, True)])
def test_contiguous_gradients_only_off_for_stage_1_in_one_process(stage, world_size, contiguous):
    # One process at stage 1 skips DeepSpeed's two gradient copies a tensor (test_zero_equals_plain_pytorch trains
    # with the generated config at every stage); stage 2 partitions into that buffer, and several ranks keep it.
    config = deepspeed_config(load_profile("tiny", [f"parallel.zero_stage={stage}"]), world_size=world_size)
    assert config["zero_optimization"]["contiguous_gradients"] is contiguous


@pytest.mark.parametrize("stage, takes_fast_path", [(1, True), (3, False)])
def test_bf16_training_takes_the_lora_fast_path_unless_zero_3(tmp_path, monkeypatch, stage, takes_fast_path):
    # PEFT creates adapters in the base weights' dtype at injection (fp32 here) and DeepSpeed casts the model to bf16
    # after: adapters and inputs then agree, so the fast path applies (the projections node over the tiny model's
    # bias-free bases); ZeRO-3 partitions the adapters (PEFT's path).
    from moe_tune.engine.model import projections

    dtypes = []
    apply = projections.SharedInputLinearsFunction.apply
    monkeypatch.setattr(projections.SharedInputLinearsFunction, "apply",
                        lambda x, *args: dtypes.append(x.dtype) or apply(x, *args))  # fmt: skip
    profile = small_profile(tmp_path, "train.precision=bf16", f"parallel.zero_stage={stage}", "train.steps=2")
    finetune(profile, show_progress=False)
    assert set(dtypes) == ({torch.bfloat16} if takes_fast_path else set())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_bias_update_of_all_layers_at_once_equals_each_layers_own(dtype):
    """trainer.update_moe_bias (stacked loads, foreach updates) against MoEBlock.update_selection_bias layer by
    layer: the same biases bit for bit, loads and drops zeroed, and the per-layer max/mean and drop count."""
    import copy
    import types

    from moe_tune.engine.model.moe import MoEBlock
    from moe_tune.engine.train.trainer import moe_load_stats, update_moe_bias
    from moe_tune.profiles.schema import MoESpec

    spec = MoESpec(num_experts=7, top_k=2, expert_intermediate_size=8, bias_update_rate=0.01)
    gen = torch.Generator().manual_seed(0)
    blocks = torch.nn.ModuleList(MoEBlock(16, spec, layer_index=i) for i in range(3)).to(dtype)
    for i, block in enumerate(blocks):
        block.selection_bias.copy_(torch.randn(7, generator=gen))
        block.load_counts.copy_(torch.randint(0, 50, (7,), generator=gen).float())
        block.dropped_slots.fill_(3.0 * i)
    blocks[1].load_counts.zero_()  # no loads counted: the bias stays
    initial = [block.selection_bias.clone() for block in blocks]
    expected = copy.deepcopy(blocks)
    want = []
    for block in expected:
        counts = block.load_counts
        mean, peak = counts.mean().item(), counts.max().item()
        want.append((round(peak / mean, 4) if mean > 0 else 0.0, block.dropped_slots.item()))
        block.update_selection_bias()
    engine = types.SimpleNamespace(module=blocks)
    imbalance, dropped = moe_load_stats(update_moe_bias(engine, types.SimpleNamespace(world_size=1)).tolist())
    assert imbalance == [w[0] for w in want] and dropped == int(sum(w[1] for w in want)) == 9
    for ours, theirs in zip(blocks, expected, strict=True):
        assert torch.equal(ours.selection_bias, theirs.selection_bias)
        assert not ours.load_counts.any() and ours.dropped_slots.item() == 0
    assert not torch.equal(blocks[0].selection_bias, initial[0]) and torch.equal(blocks[1].selection_bias, initial[1])


@pytest.mark.parametrize("device, offload, fused", [("cuda", False, True), ("cuda", True, False), ("cpu", False, False),
                                                    ("cpu", True, False)])  # fmt: skip
def test_the_optimizer_is_torch_fused_adamw_where_its_state_is_on_cuda(device, offload, fused):
    from moe_tune.engine.train.trainer import build_optimizer

    profile = load_profile("tiny", ["train.lr=3e-3", "train.weight_decay=0.05", "train.betas=[0.8, 0.95]",
                                    f"parallel.offload_optimizer={offload}", "parallel.zero_stage=1"])  # fmt: skip
    weights = [torch.nn.Parameter(torch.randn(37, 5, generator=torch.Generator().manual_seed(i))) for i in range(3)]
    optimizer = build_optimizer(weights, profile, torch.device(device))
    defaults = optimizer.defaults
    assert bool(defaults["fused"]) is fused and defaults["foreach"] is (None if fused else False)
    assert (defaults["lr"], defaults["betas"], defaults["weight_decay"]) == (3e-3, (0.8, 0.95), 0.05)
    # The same AdamW either way: a few steps of the fused kernel (CPU's here) and of the single-tensor form agree.
    twins = [torch.nn.Parameter(w.detach().clone()) for w in weights]
    start = [w.detach().clone() for w in weights]
    single = build_optimizer(twins, profile, torch.device("cpu"))
    for step in range(4):
        for a, b in zip(weights, twins):
            a.grad = b.grad = torch.randn(a.shape, generator=torch.Generator().manual_seed(100 + step))
        optimizer.step()
        single.step()
    for a, b, before in zip(weights, twins, start):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert (a - before).abs().min() > 0  # every element moved


def transformers_decayed_names(model: torch.nn.Module) -> set[str]:
    """The parameters transformers' Trainer applies weight decay to (Trainer.get_decay_parameter_names reads only
    the model): the reference for a Trainer + PEFT user's expectation."""
    from transformers import Trainer

    return set(Trainer.get_decay_parameter_names(None, model))


@pytest.mark.parametrize("name, overrides", [
    ("tiny", ["lora.enabled=false"]),  # full fine-tuning: norms and the linear attention's dt_bias train
    ("tiny-vl", ["lora.vision_tower=trained"]),  # LoRA, the vision blocks (LayerNorms, biases) trained in full
])  # fmt: skip
def test_optimizer_groups_decay_what_transformers_trainer_decays(name, overrides):
    from moe_tune.engine.train.trainer import optimizer_groups

    model, trainable = build_trainable_model(load_profile(name, [*overrides, "output.dir=unused"]))
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = transformers_decayed_names(model) & {names[id(p)] for p in trainable}
    groups = optimizer_groups(model, 0.1)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert {names[id(p)] for p in groups[0]["params"]} == decayed
    assert {names[id(p)] for p in groups[1]["params"]} == {names[id(p)] for p in trainable} - decayed
    assert len(decayed) < len(trainable)
    # The same groups without weight decay (a resume may change it and must load the checkpoint's optimizer state).
    assert [[id(p) for p in g["params"]] for g in optimizer_groups(model, 0.0)] == [
        [id(p) for p in g["params"]] for g in groups]
    assert [g["weight_decay"] for g in optimizer_groups(model, 0.0)] == [0.0, 0.0]


def test_training_decays_only_what_transformers_trainer_decays(tmp_path):
    """One full fine-tuning step (ZeRO-3) with weight decay against the same step without: AdamW's decoupled decay
    moves each weight by -lr x weight_decay x its initial value, the rest of the step being the same, so the
    difference shows which weights were decayed; biases and norm weights must not be."""
    lr, decay = 5e-3, 0.5
    common = ["train.steps=1", "train.warmup_steps=0", f"train.lr={lr}", "lora.enabled=false"]
    runs = [load_file(str(finetune(small_profile(tmp_path / f"wd{wd}", *common, f"train.weight_decay={wd}"),
                                   show_progress=False).weights)) for wd in (decay, 0)]  # fmt: skip
    model = build_model(small_profile(tmp_path / "ref").model)
    initial = dict(model.named_parameters())
    decayed = transformers_decayed_names(model)
    assert "norm.weight" not in decayed and "layers.0.self_attn.dt_bias" not in decayed
    for name, weight in runs[0].items():
        expected = -lr * decay * initial[name].detach() if name in decayed else torch.zeros_like(weight)
        torch.testing.assert_close(weight - runs[1][name], expected, rtol=0, atol=1e-6, msg=name)


def test_resume_trains_with_the_profiles_changed_optimizer_settings(tmp_path, monkeypatch):
    """train.lr, betas and weight_decay may change on --resume (a note names each): the resumed steps train with the
    profile's values, which the metrics log, not with the checkpoint's (DeepSpeed loads those with the optimizer
    state). Full fine-tuning: a group with weight decay and one without (biases, norms)."""
    from moe_tune.engine.train import trainer

    applied = []
    launch = trainer.launch_step

    def spy(run, step, *args, **kwargs):
        groups = run.engine.lr_scheduler.optimizer.param_groups
        applied.append([(group["lr"], tuple(group["betas"]), group["weight_decay"]) for group in groups])
        return launch(run, step, *args, **kwargs)

    monkeypatch.setattr(trainer, "launch_step", spy)
    common = ["train.steps=4", "output.save_every=2", "lora.enabled=false"]
    finetune(small_profile(tmp_path, *common), show_progress=False, stop_after=2)
    profile = small_profile(tmp_path, *common, "train.lr=0.02", "train.betas=[0.8, 0.95]", "train.weight_decay=0.1")
    result = finetune(profile, show_progress=False, resume=True)
    assert result.start_step == 2 and any("train.lr 0.005, the profile says 0.02" in n for n in result.resume_notes)
    for step, groups in zip((2, 3), applied[2:], strict=True):
        lr = 0.02 * lr_factor(step, profile.train)
        assert groups == [(lr, (0.8, 0.95), 0.1), (lr, (0.8, 0.95), 0.0)], step
    logged = [json.loads(line)["lr"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert logged[2:] == [groups[0][0] for groups in applied[2:]]


def test_a_resume_with_nothing_to_train_says_where_it_stands():
    from moe_tune.engine.train.trainer import nothing_to_resume

    assert nothing_to_resume(6, 6, 6) == ("--resume: the newest checkpoint is already at the run's last step (6); "
                                          "nothing to train")
    assert nothing_to_resume(8, 6, 6) == ("--resume: the newest checkpoint is at step 8, at or past the run's last "
                                          "step (6); nothing to train")
    assert nothing_to_resume(3, 3, 6) == ("--resume: the newest checkpoint is at step 3, at or past the step to stop "
                                          "at (3); nothing to train")
