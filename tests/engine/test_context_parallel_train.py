"""Context parallelism end to end on gloo ranks: N ranks sharing each packed row train as one process on the same
rows (losses every step, the eval loss, the final LoRA adapters and merged weights within 1e-5, fp32), with and
without expert parallelism; a resumed run continues exactly; a dead rank ends the job.

The model is the tiny profile with the token mixers that run on shared rows (CP_LAYERS) and the Switch aux loss on:
with one context group the row's aux loss is the one process's (engine/model/model.py moe_on_shared_row).
"""

import json
import time

import pytest
import torch
from safetensors.torch import load_file

from moe_tune.engine.train.distributed import ContextLayout
from moe_tune.engine.train.trainer import check_world, share_of_batch
from moe_tune.profiles import ProfileError, load_profile

# The layer kinds this file trains under context parallelism: gated delta rule (scalar decay), KDA (per-channel
# decay), top-k sparse attention (token level) and full attention; the layer tests of engine/model cover every kind
# (tests/engine/test_context_parallel_linear.py, test_context_parallel_attention.py).
CP_LAYERS = ("model.layers=[{attention: linear, mlp: moe}, {attention: kda, mlp: moe}, {attention: sparse, mlp: "
             "moe}, {attention: full, mlp: moe}]")
KDA = "model.kda_attention={num_heads: 4, head_dim: 16}"
# One row of 64 tokens a micro-batch: the ranks' borders (16, 32, 48) fall inside its documents, and its labels (the
# answers of chat records, CHAT_RECORDS) sit unevenly among the ranks, some holding none. Adam turns rounding-level
# gradient differences into updates of size ~lr where gradients are near 0 (fresh LoRA A factors, and single
# elements of B: at lr 0.002 one element of a shared expert's B moved 1.4e-5 apart under CP 4 x EP 2, the other
# 1023 within 1e-6): lr 0.001 keeps those within the comparison's 1e-5.
BASE = ["data.seq_len=64", "train.warmup_steps=1", "train.grad_clip=0.5",
        "train.lr=0.001", "output.save_every=1000", "train.micro_batch_size=1", "data.eval_fraction=0.25",
        CP_LAYERS, KDA]  # fmt: skip
STEPS = 3
WORDS = ("amber", "basil", "cedar", "delta", "ember", "fjord", "grove", "heron")
# A short question and its answer: about 60 byte tokens a record, 13 of them labelled, at the record's end.
CHAT_RECORDS = [{"messages": [{"role": "user", "content": f"Say {WORDS[i % 8]} twice, item {i}."},
                              {"role": "assistant", "content": f"{WORDS[i % 8]} {WORDS[i % 8]}"}]}
                for i in range(64)]  # fmt: skip
HARD_TIMEOUT_S = 300

# (world, overrides) -> (result, output dir): the runs several tests compare, made once per module.
runs = {}
# The dist_forks.py process that forks every run's ranks (tests/engine/test_distributed.py's Forks).
forks = None


@pytest.fixture(scope="module", autouse=True)
def _close_forks():
    yield
    if forks is not None:
        forks.close()


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    """The override that trains on CHAT_RECORDS."""
    path = tmp_path_factory.mktemp("cp-data") / "chat.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in CHAT_RECORDS))
    return f"data.path={path}"


def run(child_env, out, world, overrides, extra=()):
    from test_distributed import Forks, run_in_a_rendezvous

    global forks
    if forks is None or forks.proc.poll() is not None:
        forks = Forks(child_env)
    out.parent.mkdir(parents=True, exist_ok=True)
    result, logs = out / "result.json", [out.with_name(f"{out.name}-rank{r}.log") for r in range(world)]
    settings = [a for o in [*BASE, f"output.dir={out}", *overrides] for a in ("--set", o)]
    codes = run_in_a_rendezvous(forks, world, child_env, ["--result", str(result), *extra, *settings], logs)
    texts = [log.read_text() for log in logs]
    return codes, texts, (json.loads(result.read_text()) if result.exists() else None)


def shared(child_env, tmp_path_factory, world, overrides):
    key = (world, tuple(overrides))
    if key not in runs:
        out = tmp_path_factory.mktemp("cp") / "out"
        codes, logs, result = run(child_env, out, world, overrides)
        assert codes == [0] * world, logs[0][-3000:] + (logs[-1][-3000:] if world > 1 else "")
        runs[key] = (result, out)
    return runs[key]


# Two context groups (world 4, CP 2) read rows 2i and 2i + 1 of micro-batch i; one process reads both as one packed
# row of two, whose Switch loss is not the mean of each row's, so that layout runs without an aux loss.
NO_AUX = ("model.moe.aux_loss_coef=0",)


# CP 2 and 4, with and without EP 2 (CP 4 x EP 2: the expert groups inside the context group).
@pytest.mark.dist
@pytest.mark.parametrize("world, cp, ep, extra", [
    pytest.param(2, 2, 1, (), id="cp2"),
    pytest.param(2, 2, 2, (), id="cp2-ep2"),
    pytest.param(4, 4, 1, (), id="cp4"),
    pytest.param(4, 4, 2, (), id="cp4-ep2"),
    pytest.param(4, 2, 2, NO_AUX, id="dp2-cp2-ep2"),
])
def test_context_parallel_equals_one_process(child_env, tmp_path_factory, chat_data, world, cp, ep, extra):
    from test_distributed import assert_grad_norms_equal, merged_weights

    steps = [f"train.steps={STEPS}", chat_data, *extra]
    single, single_out = shared(child_env, tmp_path_factory, 1, [*steps, f"train.micro_batch_size={world // cp}"])
    multi, out = shared(child_env, tmp_path_factory, world,
                        [*steps, f"parallel.context_parallel={cp}", f"parallel.expert_parallel={ep}"])
    assert len(multi["losses"]) == STEPS
    assert multi["losses"] == pytest.approx(single["losses"], rel=1e-5, abs=1e-6)
    assert_grad_norms_equal(out, single_out, BASE)
    # The held-out rows, evaluated after the last step by every context group alike.
    one, many = (json.loads((d / "summary.json").read_text()) for d in (single_out, out))
    assert many["eval_rows"] == one["eval_rows"] > 0 and many["eval_step"] == one["eval_step"] == STEPS
    assert many["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-5)
    one, many = (load_file(str(d / "adapter" / "adapter_model.safetensors")) for d in (single_out, out))
    assert one.keys() == many.keys() and any(".experts.lora_A.w_gate_up" in k for k in one)
    # A factors, and the routed experts' B factors, through what they do (the merged weights below): AdamW's update
    # does not scale with the gradient, so an element whose gradient is near zero or turns sign between steps takes
    # a rounding-level gradient difference to a step-sized one. The A factors' first updates all follow near-zero
    # gradients; one routed expert's B element (1 of 8192) was seen 1.4e-5 apart while the merged expert weights
    # agreed within 3.3e-6. Every other B factor is compared element by element.
    for key in one:
        if ".lora_A." not in key and ".experts.lora_B." not in key:
            torch.testing.assert_close(many[key], one[key], rtol=0, atol=1e-5, msg=key)
    one, many = (merged_weights(d) for d in (single_out, out))
    assert one.keys() == many.keys() and any(".experts.w_down" in k for k in one)
    for key in one:
        torch.testing.assert_close(many[key], one[key], rtol=0, atol=1e-5, msg=key)


@pytest.mark.dist
def test_profile_step_runner_under_context_parallel(child_env, tmp_path, chat_data):
    """`moe-tune profile`'s steps on a row shared by 2 ranks: the losses of one process on the same rows."""
    common = [f"train.steps={STEPS}", chat_data]
    losses = {}
    for world, cp in ((1, 1), (2, 2)):
        codes, logs, result = run(child_env, tmp_path / f"profile-cp{cp}", world,
                                  [*common, f"parallel.context_parallel={cp}"], extra=["--profile-steps", str(STEPS)])
        assert codes == [0] * world, logs[0][-3000:]
        losses[cp] = result["losses"]
    assert len(losses[2]) == STEPS
    assert losses[2] == pytest.approx(losses[1], rel=1e-5, abs=1e-6)


@pytest.mark.dist
def test_resume_under_context_parallel(child_env, tmp_path, tmp_path_factory, chat_data):
    common = [f"train.steps={STEPS}", chat_data, "parallel.context_parallel=2"]
    straight, _ = shared(child_env, tmp_path_factory, 2, [*common, "parallel.expert_parallel=1"])
    codes, logs, first = run(child_env, tmp_path / "b", 2, common, extra=["--stop-after", "2"])
    assert codes == [0, 0], logs[0][-3000:]
    codes, logs, second = run(child_env, tmp_path / "b", 2, common, extra=["--resume"])
    assert codes == [0, 0], logs[0][-3000:]
    assert second["start_step"] == 2
    assert first["losses"] + second["losses"] == straight["losses"]


@pytest.mark.dist
def test_dead_rank_ends_the_context_group(child_env, tmp_path, chat_data):
    # Rank 1 dies after its first step, inside a row it shares with rank 0: rank 0 must fail, not wait forever.
    started = time.time()
    codes, _, _ = run(child_env, tmp_path / "dead", 2,
                      ["train.steps=50", chat_data, "parallel.context_parallel=2", "parallel.timeout_s=20"],
                      extra=["--die-rank", "1"])  # fmt: skip
    assert codes[1] == 9
    assert codes[0] != 0, "the surviving rank must not hang or report success"
    assert time.time() - started < HARD_TIMEOUT_S


def test_ranks_of_a_group_read_the_same_rows_and_split_them():
    from moe_tune.engine.data.dataset import Batch

    cu = torch.tensor([0, 5, 12, 16], dtype=torch.int32)
    batch = Batch(input_ids=torch.arange(16)[None], labels=torch.arange(100, 116)[None], cu_seqlens=cu)
    shares = [share_of_batch(batch, ContextLayout(4, r, 0, 1)) for r in range(4)]
    assert torch.equal(torch.cat([s.input_ids for s in shares], dim=1), batch.input_ids)
    assert torch.equal(torch.cat([s.labels for s in shares], dim=1), batch.labels)
    # The border at 5 cuts share 1; the one at 12 is where share 3 starts.
    assert [s.cu_seqlens.tolist() for s in shares] == [[0, 4], [0, 1, 4], [0, 4], [0, 4]]
    inputs = shares[1].model_inputs(torch.device("cpu"))
    assert (inputs["context"].start, inputs["context"].stop, inputs["context"].rank) == (4, 8, 1)
    assert inputs["input_ids"].tolist() == [[4, 5, 6, 7]]
    assert share_of_batch(batch, ContextLayout()) is batch


@pytest.mark.parametrize("cp, world, message", [
    (2, 1, r"^parallel.context_parallel \(2\) must be <= the world size \(1\)$"),
    (2, 3, r"^parallel.context_parallel \(2\) must divide the world size \(3\)$"),
])
def test_context_groups_must_fit_the_world(cp, world, message):
    with pytest.raises(ProfileError, match=message):
        check_world(load_profile("tiny", [CP_LAYERS, KDA, f"parallel.context_parallel={cp}"]), world)


def test_context_parallel_rules_cuda_graphs_out():
    from moe_tune.engine.train.graphs import graph_blockers

    profile = load_profile("tiny", [CP_LAYERS, KDA, "parallel.context_parallel=2", "parallel.zero_stage=1"])
    assert graph_blockers(profile, "cuda", 1) == [
        "parallel.context_parallel (2) routes each MoE block on a share of the row and combines its aux loss over the "
        "ranks: use 1"
    ]


def test_start_banner_names_the_context_groups(tmp_path):
    from moe_tune.engine.train.banner import start_banner

    profile = load_profile("tiny", [CP_LAYERS, KDA, "parallel.context_parallel=2", "train.micro_batch_size=1"])
    lines = start_banner(profile, tmp_path, torch.device("cpu"), 4, 10)
    assert lines[2].startswith("layout:   world size 4, data-parallel 2, context-parallel 2 (each row's tokens over 2 "
                               "ranks), expert-parallel 1 (expert-data-parallel 4)")  # fmt: skip
    assert lines[-2].startswith("steps:    10, 2 rows of 128 tokens a step")
