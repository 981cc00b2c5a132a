"""`moe-tune profile PROFILE --against bf16-base` (engine/bench/bf16_base.py, steps.run_bf16_base): the FP8 base
against its twin holding the FP8 weights dequantized, on the same draws, LoRA init and micro-batches."""

import pytest
import torch

from moe_tune.engine.bench import bf16_base, steps
from moe_tune.engine.bench.bf16_base import fp8_base_weights, load_dequantized
from moe_tune.engine.model.fp8 import Fp8Linear
from moe_tune.engine.model.model import build_model
from moe_tune.engine.model.moe import GroupedExperts
from moe_tune.ops.fp8 import FP8_DTYPE, dequantize_weight
from moe_tune.profiles import ProfileError, load_profile

# The tiny profile cut to two layers 128 wide: attention projections, the shared expert and the routed experts are
# FP8 (the rule's smallest FP8 dim is 128), k/v projections and the linear-attention gates stay float. Every token
# goes to all 8 experts: at init the router's scores nearly tie, and a choice flipped by one rounding moved the first
# loss by 2.8e-4 in one run (not in others); with no choice to flip the loss is a continuous function of the weights.
SMALL_FP8 = [
    "model.base_precision=fp8", "model.hidden_size=128", "model.head_dim=32", "model.moe.top_k=8",
    "model.moe.shared_expert_intermediate_size=128",
    "model.layers=[{attention: full, mlp: moe}, {attention: linear, mlp: moe}]",
    "data.seq_len=32", "train.micro_batch_size=1", "data.corpus_documents=20",
]  # fmt: skip
# First-step loss gap |fp8 - bf16| / bf16 of SMALL_FP8 (fp32, CPU), measured: below 1e-6 with every FP8 GEMM
# computing with the dequantized weight and the unquantized activation (0, the same loss bit for bit, in the runs
# with top-2 routing that flipped no choice); 2.0e-4 for a twin keeping its own draws (the FP8 base is those
# quantized: up to 2^-4 of each weight); with top-2 routing, 1.9e-4 with every FP8 GEMM rounding its activations to
# e4m3 in 1 x 128 groups (up to 2^-4 of each element). What may be left is the order of fp32 sums (~1e-7 of the
# loss); the bound fails a twin that is not the FP8 base dequantized, and FP8 GEMMs that round their operands.
FIRST_STEP_GAP = 1e-6


def small_fp8(*extra: str):
    # The profile command writes nothing to output.dir.
    return load_profile("tiny", [*SMALL_FP8, "output.dir=/nonexistent/small-fp8", *extra])


def gathered_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of every parameter, whole (ZeRO-3 partitions them in the engine)."""
    import deepspeed

    params = list(module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        return {name: p.detach().clone() for name, p in module.named_parameters()}


@pytest.fixture(scope="module")
def run():
    """profile_steps(--against bf16-base) on SMALL_FP8 (1 warm-up + 1 timed step each), with each runner's initial
    parameters (as DeepSpeed holds them) and the micro-batches each step fed; the profiler's step and the GEMM peak
    are stood in (not what is tested here)."""
    from moe_tune.engine.bench import breakdown, flops, launch_sites

    job = small_fp8()
    initial, fed = {}, {"fp8": [], "bf16": []}
    init, launch = steps.StepRunner.__init__, steps.StepRunner.launch

    def spy_init(self, profile, *args, **kwargs):
        init(self, profile, *args, **kwargs)
        initial[profile.model.base_precision] = gathered_state(self.engine.module)

    def spy_launch(self, behind=None):
        fed[self.profile.model.base_precision].append(self.micro_batches(self.steps_done))
        return launch(self, behind)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        mp.setattr(steps.StepRunner, "__init__", spy_init)
        mp.setattr(steps.StepRunner, "launch", spy_launch)
        mp.setattr(breakdown, "profiled_step", lambda runner, basis: {"stood in": True})
        mp.setattr(launch_sites, "launch_sites_step", lambda runner: [])
        mp.setattr(flops, "gemm_peak_tflops", lambda device, precision: 1.0)
        result = steps.profile_steps(job, steps=1, warmup=1, against="bf16-base")
    return result, initial, fed


def dequantized_state(fp8_state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The float weight each FP8 parameter pair stands for (an Fp8Linear's weight, routed experts' two)."""
    out = {}
    for name, scale in fp8_state.items():
        if not name.endswith("scale_inv"):
            continue
        weight_name = name.removesuffix("_scale_inv")
        w_q = fp8_state[weight_name]
        # Experts' w_gate_up: the gate and up halves are scaled apart.
        segments = (w_q.shape[1] // 2,) * 2 if weight_name.endswith("w_gate_up") else None
        out[weight_name] = dequantize_weight(w_q.view(FP8_DTYPE), scale.view(torch.float32), segments, dtype=dtype)
    return out


def test_twin_holds_the_fp8_base_dequantized_and_everything_else_equal(run):
    result, initial, _ = run
    fp8, twin = initial["fp8"], initial["bf16"]
    expected = dequantized_state(fp8, torch.float32)
    assert sum(name.endswith("w_gate_up") for name in expected) == 2  # both layers' routed experts
    assert sum(name.endswith("q_proj.base_layer.weight") for name in expected) == 1  # the full-attention layer's
    assert set(twin) == {name for name in fp8 if not name.endswith("scale_inv")}
    for name, value in twin.items():
        if name in expected:
            assert value.dtype == torch.float32 and torch.equal(value, expected[name]), name
        else:
            # Floating parameters of the same draws, the same LoRA init.
            assert value.dtype == fp8[name].dtype and torch.equal(value, fp8[name]), name
    assert result["against"]["dequantized_modules"] == len(expected) - 2  # experts: one module, two weights


def test_both_train_the_same_micro_batches_and_start_at_the_same_loss(run):
    result, _, fed = run
    assert len(fed["fp8"]) == len(fed["bf16"]) == 2
    for ours, theirs in zip(fed["fp8"], fed["bf16"]):
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.cu_seqlens, b.cu_seqlens)
            assert torch.equal(a.labels, b.labels)
    assert not torch.equal(fed["fp8"][0][0].input_ids, fed["fp8"][1][0].input_ids)
    other = result["against"]
    gap = abs(result["first_step_loss"] - other["first_step_loss"]) / other["first_step_loss"]
    assert gap < FIRST_STEP_GAP, gap


def test_result_carries_both_rows_and_the_loss_gap(run):
    result, _, _ = run
    other = result["against"]
    assert other["baseline"] == "bf16-base" and other["impl"] == "moe-tune, fp32 base"
    assert other["out_of_memory"] is None and other["steps"] == 1 and len(other["losses"]) == 1
    assert other["speedup"] == pytest.approx(result["tokens_per_s"] / other["tokens_per_s"])
    assert other["mfu"] == pytest.approx(other["achieved_tflops"] / 1.0)
    assert other["parameters"] == result["parameters"]
    assert other["trainable_parameters"] == result["trainable_parameters"]
    gap = other["loss_gap"]
    assert gap["steps"] == 2
    assert gap["fp8_losses"] == [result["first_step_loss"], *result["losses"]]
    assert gap["bf16_losses"] == [other["first_step_loss"], *other["losses"]]
    relative = [abs(a - b) / b for a, b in zip(gap["fp8_losses"], gap["bf16_losses"])]
    assert gap["relative"] == pytest.approx(relative)
    assert gap["max"] == max(relative) and gap["mean"] == pytest.approx(sum(relative) / 2)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_load_dequantized_into_a_model_built_in_the_training_dtype(precision):
    """The GPU path builds the twin in the training dtype: its weights are the dequantized ones rounded once."""
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]
    cfg = small_fp8().model
    fp8 = build_model(cfg)
    twin = build_model(cfg.model_copy(update={"base_precision": "bf16"}), param_dtype=dtype)
    before = {name: p.detach().clone() for name, p in twin.named_parameters()}
    weights = fp8_base_weights(fp8)
    num_fp8_modules = len(weights)
    assert load_dequantized(twin, weights) == num_fp8_modules and weights == {}
    expected = dequantized_state({n: p.detach() for n, p in fp8.named_parameters()}, dtype)
    assert num_fp8_modules >= 8 and len(expected) == num_fp8_modules + 2  # experts: one module, two weights
    for name, param in twin.named_parameters():
        assert param.dtype == dtype
        # The FP8-rule weights dequantized and rounded once; nothing else touched.
        assert torch.equal(param, expected.get(name, before[name])), name


def test_load_dequantized_refuses_a_module_that_is_not_the_float_twin():
    cfg = small_fp8().model
    fp8 = build_model(cfg)
    with pytest.raises(RuntimeError, match=r"holds Fp8Linear where the FP8 model holds an FP8 module"):
        load_dequantized(fp8, {n: t for n, t in fp8_base_weights(fp8).items() if isinstance(fp8.get_submodule(n),
                                                                                            Fp8Linear)})
    with pytest.raises(RuntimeError, match=r"holds GroupedExperts where"):
        load_dequantized(fp8, {n: t for n, t in fp8_base_weights(fp8).items() if isinstance(fp8.get_submodule(n),
                                                                                            GroupedExperts)})
    with pytest.raises(RuntimeError, match=r"^layers.9.mixer: the bf16-base twin holds NoneType"):
        load_dequantized(fp8, {"layers.9.mixer": ()})


class FakeRunner:
    """StepRunner's surface run_bf16_base uses: micro-batches, steps queued (launch, which may run out of memory)
    and read (finish), close."""

    def __init__(self, batches, fail_at=None):
        self.batches, self.fail_at, self.steps_done, self.is_cuda, self.closed = batches, fail_at, 0, False, False

    def micro_batches(self, step):
        return self.batches[step]

    def launch(self, behind=None):
        if self.steps_done == self.fail_at:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        self.steps_done += 1
        return self.steps_done

    def finish(self, queued):
        return {"loss": 5.0, "tokens": 8, "step_time_s": 0.5, "tokens_per_s": 16.0, "pieces": [8]}

    def close(self):
        self.closed = True


def batch(seed):
    from moe_tune.engine.data.dataset import Batch

    ids = torch.randint(0, 259, (1, 8), generator=torch.Generator().manual_seed(seed))
    return Batch(input_ids=ids, labels=ids, cu_seqlens=torch.tensor([0, 8], dtype=torch.int32))


@pytest.mark.parametrize("fail_at, where, steps_done", [(None, None, 2), (0, "warm-up step 1", 0),
                                                        (1, "warm-up step 2", 0), (3, "timed step 2", 1)])  # fmt: skip
def test_twin_out_of_memory_is_a_row_saying_where(monkeypatch, fail_at, where, steps_done):
    batches = [[batch(s)] for s in range(4)]
    fake = FakeRunner(batches, fail_at)
    monkeypatch.setattr(steps, "StepRunner", lambda profile, prepare_model: fake)
    row, records = steps.run_bf16_base(bf16_base.bf16_base_profile(small_fp8()), {}, None, batches, 2)
    assert row["out_of_memory"] == where and row["steps"] == steps_done and fake.closed
    assert (row["tokens_per_s"] is None) == (where is not None)


def test_twin_that_does_not_fit_is_a_row_and_builds_nothing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    huge = bf16_base.bf16_base_profile(small_fp8("model.vocab_size=2000000000"))
    problem = bf16_base.twin_fit_problem(huge)
    assert problem.startswith("model (vocab_size 2000000000, hidden_size 128, 2 layers) needs ~")
    monkeypatch.setattr(steps, "StepRunner", lambda *args, **kwargs: pytest.fail("the twin was built"))
    row, records = steps.run_bf16_base(huge, {}, problem, [[batch(0)]], 0)
    assert row["out_of_memory"] == f"building the model: {problem}" and records == []
    assert bf16_base.twin_fit_problem(bf16_base.bf16_base_profile(small_fp8())) is None


def test_twin_on_other_micro_batches_is_an_error(monkeypatch):
    fake = FakeRunner([[batch(0)], [batch(2)]])
    monkeypatch.setattr(steps, "StepRunner", lambda profile, prepare_model: fake)
    with pytest.raises(RuntimeError, match=r"the twin's micro-batches of step 2 are not ours"):
        steps.run_bf16_base(bf16_base.bf16_base_profile(small_fp8()), {}, None, [[batch(0)], [batch(1)]], 1)
    assert fake.closed


@pytest.mark.parametrize("overrides", [[], ["model.base_precision=bf16"]], ids=["default", "explicit"])
def test_bf16_base_profile_is_refused(overrides):
    with pytest.raises(ProfileError, match=r"^model.base_precision \('bf16'\): --against bf16-base needs 'fp8'"):
        steps.check_against(load_profile("tiny", overrides), "bf16-base")


def test_bf16_base_of_a_model_transformers_cannot_build_is_taken(monkeypatch):
    # tiny's sparse-attention layer has no transformers counterpart; the twin is ours, it needs none.
    job = load_profile("tiny", ["model.base_precision=fp8"])
    steps.check_against(job, "bf16-base")
    with pytest.raises(ProfileError, match=r"--against transformers builds qwen3_moe"):
        steps.check_against(job, "transformers")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ProfileError, match=r"^--against bf16-base runs one process \(WORLD_SIZE is 2\)"):
        steps.check_against(job, "bf16-base")


def test_twin_profile_changes_only_the_base_precision():
    job = small_fp8()
    twin = bf16_base.bf16_base_profile(job)
    assert twin.model.base_precision == "bf16" and job.model.base_precision == "fp8"
    assert twin.model_dump() == job.model_copy(update={"model": twin.model}).model_dump()
    assert twin.model.model_dump(exclude={"base_precision"}) == job.model.model_dump(exclude={"base_precision"})
