"""Sequence chunks (memory.sequence_chunk_tokens): a layer's per-token part (post-attention norm, dense MLP or MoE
block with its router, experts, shared expert and LoRA, residual add) run chunk by chunk, each chunk recomputed in
backward, trains like the whole row: losses, the aux loss, every trainable gradient and the routing statistics (load
counts, capacity drops, the selection-bias update) within 1e-5 in fp32 on the CPU, and bitwise when one chunk holds
the row. It composes with every memory policy, keeps only the chunks' input rows for backward, and splits an
expert-parallel group's all-to-alls chunk by chunk (two gloo ranks)."""

import os
import subprocess
import sys

import pytest
import torch

from moe_tune.engine.lora import inject_lora
from moe_tune.engine.model.model import build_model
from moe_tune.engine.model.moe import MoEBlock, channel_mixer_in_chunks
from moe_tune.profiles import ProfileError, load_profile
from moe_tune.profiles.schema import LoraProfile, ModelProfile

ATTENTION_TARGETS = ["q_proj", "v_proj", "o_proj"]
TOLERANCE = dict(rtol=1e-5, atol=1e-6)
MOE, DENSE = {"attention": "full", "mlp": "moe"}, {"attention": "full", "mlp": "dense"}
# Documents of this many tokens: the chunks cross document bounds, and full attention's cost stays small.
DOCUMENT = 300

# Each variant: MoE options laid over the base's and its layers.
VARIANTS = {
    "shared_expert_gated": ({}, [MOE, DENSE]),
    "no_shared_expert": ({"shared_expert_intermediate_size": 0}, [MOE]),
    "shared_expert_ungated": ({"shared_expert_gate": False}, [MOE]),
    # Capacity 0.5: many slots drop, in the row's arrival order across chunks.
    "capacity": ({"capacity_factor": 0.5}, [MOE]),
    "sigmoid_selection_bias": ({"score_func": "sigmoid", "routed_scaling": 2.5, "bias_update_rate": 0.01}, [MOE]),
    "dense_only": ({}, [DENSE, DENSE]),
}


def model_cfg(moe: dict | None = None, layers=(MOE, DENSE), hyper: bool = False) -> ModelProfile:
    raw = load_profile("tiny").model.model_dump(mode="json")
    raw.update(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=48,
               layers=list(layers))  # fmt: skip
    raw["moe"].update({"num_experts": 8, "top_k": 2, "expert_intermediate_size": 16,
                       "shared_expert_intermediate_size": 24, "aux_loss_coef": 0.01, **(moe or {})})  # fmt: skip
    if hyper:
        raw["hyper_connections"] = {"num_streams": 2, "mix_rank": 4}
    return ModelProfile.model_validate(raw)


def lora_for(cfg: ModelProfile) -> LoraProfile:
    """LoRA on attention, on every SwiGLU (shared expert, dense MLP) and routed expert; the router trained in full."""
    has_moe = any(layer.mlp == "moe" for layer in cfg.layers)
    has_swiglu = not has_moe or cfg.moe.shared_expert_intermediate_size > 0 or len(cfg.layers) > 1
    swiglu = ["gate_proj", "up_proj", "down_proj"] if has_swiglu else []
    return LoraProfile(r=4, alpha=8, target_modules=ATTENTION_TARGETS + swiglu, experts=has_moe,
                       modules_to_save=["gate"] if has_moe else [])  # fmt: skip


def chunked_model(cfg: ModelProfile, chunk: int | None, layout=None):
    torch.manual_seed(0)
    model = inject_lora(build_model(cfg, expert_layout=layout), lora_for(cfg))
    # LoRA's B starts at zero and norms at one: move every parameter so every gradient path carries signal.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    model.base_model.model.set_sequence_chunk_tokens(chunk)
    return model.train()


def row(num_tokens: int):
    ids = torch.randint(0, 259, (1, num_tokens), generator=torch.Generator().manual_seed(2))
    cu_seqlens = torch.tensor([*range(0, num_tokens, DOCUMENT), num_tokens], dtype=torch.int32)
    return ids, cu_seqlens


def train_step(cfg: ModelProfile, chunk: int | None, num_tokens: int) -> dict:
    """One forward and backward on a row: losses, every trainable gradient, each MoE block's statistics and its
    selection bias after the update."""
    model = chunked_model(cfg, chunk)
    ids, cu_seqlens = row(num_tokens)
    out = model(input_ids=ids, cu_seqlens=cu_seqlens, labels=ids)
    out.loss.backward()
    result = {"loss": out.loss.detach(), "lm_loss": out.lm_loss.detach(), "aux_loss": out.aux_loss.detach()}
    result |= {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    for i, block in enumerate(m for m in model.modules() if isinstance(m, MoEBlock)):
        result[f"load_counts.{i}"] = block.load_counts.clone()
        result[f"dropped_slots.{i}"] = block.dropped_slots.clone()
        block.update_selection_bias()
        result[f"selection_bias.{i}"] = block.selection_bias.clone()
    return result


def assert_same(got: dict, expected: dict, bitwise: bool = False) -> None:
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        if bitwise:
            assert torch.equal(got[name], value), name
        else:
            torch.testing.assert_close(got[name], value, **TOLERANCE, msg=name)


@pytest.fixture(scope="module")
def whole_rows():
    """The unchunked results, computed once per (variant, tokens)."""
    cache = {}

    def get(variant: str, num_tokens: int) -> dict:
        if (variant, num_tokens) not in cache:
            moe, layers = VARIANTS[variant]
            cache[variant, num_tokens] = train_step(model_cfg(moe, layers), None, num_tokens)
        return cache[variant, num_tokens]

    return get


def test_4096_token_row_equals_whole_row(whole_rows):
    # 1500 does not divide 4096: chunks of 1500, 1500 and 1096.
    expected = whole_rows("shared_expert_gated", 4096)
    got = train_step(model_cfg(), 1500, 4096)
    assert_same(got, expected)
    assert expected["aux_loss"] > 0 and any(name.endswith(".gate.modules_to_save.default.weight") for name in got)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_channel_mixer_kind_equals_whole_row(variant, whole_rows):
    expected = whole_rows(variant, 256)
    moe, layers = VARIANTS[variant]
    got = train_step(model_cfg(moe, layers), 37, 256)  # seven chunks of 37 and one of 34
    assert_same(got, expected)
    if variant == "capacity":
        assert expected["dropped_slots.0"] > 0
    if variant == "sigmoid_selection_bias":
        assert expected["selection_bias.0"].abs().sum() > 0


@pytest.mark.parametrize("chunk, num_tokens", [
    (1, 48),  # one token a chunk (a short row: 48 chunks a layer)
    (17, 256),  # a remainder of 1 row
    (64, 256),  # four equal chunks
])  # fmt: skip
def test_chunk_sizes_equal_whole_row(chunk, num_tokens, whole_rows):
    assert_same(train_step(model_cfg(), chunk, num_tokens), whole_rows("shared_expert_gated", num_tokens))


@pytest.mark.parametrize("chunk", [256, 257, 10**6])  # the row exactly; one more; far more
def test_a_chunk_holding_the_row_is_the_whole_row_bitwise(chunk, whole_rows):
    assert_same(train_step(model_cfg(), chunk, 256), whole_rows("shared_expert_gated", 256), bitwise=True)


def test_hyper_connection_layers_chunk_their_channel_mixer():
    # Hyper-connection layers chunk the channel mixer alone (its input is the streams' mix).
    cfg = model_cfg(hyper=True)
    assert_same(train_step(cfg, 50, 160), train_step(cfg, None, 160))


def test_pinned_routing_is_sliced_per_chunk():
    cfg = model_cfg()
    ids, cu_seqlens = row(120)
    logits = []
    for chunk in (None, 50):
        model = chunked_model(cfg, chunk).eval()
        block = next(m for m in model.modules() if isinstance(m, MoEBlock))
        # Every token pinned to the experts it would rank last: a routing no chunk would choose by itself.
        block.pinned_topk_ids = torch.arange(120)[:, None].remainder(4).add(torch.tensor([4, 6])) % 8
        with torch.no_grad():
            logits.append(model(input_ids=ids, cu_seqlens=cu_seqlens).logits)
    torch.testing.assert_close(logits[1], logits[0], **TOLERANCE)


@pytest.mark.parametrize("chunk", [40, None])
def test_backward_keeps_only_the_chunks_input_rows(chunk):
    """What the per-token part saves for backward: chunked, the input rows (and the [E] slot counts); whole, the
    [T k, 2F] expert intermediates and more."""
    model = chunked_model(model_cfg(), None)
    layer = model.base_model.model.layers[0]
    num_tokens, hidden = 200, 32
    x = torch.randn(1, num_tokens, hidden, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if chunk is None:
            y, _ = layer.mlp(layer.post_attention_layernorm(x))
            out = x + y
        else:
            out, _ = channel_mixer_in_chunks(layer.mlp, layer._channel_mix, x, chunk)
    out.sum().backward()
    if chunk is None:
        assert max(saved) >= num_tokens * 2 * 16 * 2  # [T k, 2F]
    else:
        # Besides the rows: each chunk's [E] slot counts, and the aux loss's [E] load fractions.
        assert max(saved) == chunk * hidden and sum(saved) <= num_tokens * hidden + 6 * 8


# Every saved tensor is worth moving here: the tiny model's are far below the 1 MB default.
ALL_SIZES = "memory.min_offload_mb=0"


def tiny_job(*overrides: str):
    return load_profile("tiny", ["data.seq_len=96", "data.corpus_documents=50", "parallel.zero_stage=0", *overrides])


@pytest.fixture(scope="module")
def tiny_batch():
    from moe_tune.engine.data.dataset import PackedDataset, load_documents
    from moe_tune.engine.data.tokenizer import load_tokenizer

    job, tok = tiny_job(), load_tokenizer("byte")
    return PackedDataset(load_documents(job.data, tok), 96, tok.pad_id, 0).micro_batch(0, 1)


def policy_step(batch, *overrides: str):
    from moe_tune.engine.memory import find_activation_memory
    from moe_tune.engine.train.trainer import build_trainable_model

    torch.manual_seed(0)
    model, _ = build_trainable_model(tiny_job(*overrides))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    model.train()
    out = model(input_ids=batch.input_ids, cu_seqlens=batch.cu_seqlens, labels=batch.labels)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    return {"loss": out.loss.detach(), **grads}, model, find_activation_memory(model)


@pytest.mark.parametrize("memory", [
    ("memory.activation_checkpointing=true",),
    ("memory.preset=balanced", ALL_SIZES),
    ("memory.preset=max-context", ALL_SIZES),
    ("memory.router=recompute", "memory.experts=offload", ALL_SIZES),
], ids=["checkpointing", "balanced", "max_context", "router_recompute"])  # fmt: skip
def test_chunks_compose_with_every_memory_policy(memory, tiny_batch):
    expected, _, _ = policy_step(tiny_batch)
    got, model, manager = policy_step(tiny_batch, "memory.sequence_chunk_tokens=40", *memory)
    assert_same(got, expected)
    if manager is not None:
        # Nothing inside a chunk is a recompute region of its own: the chunk recomputes it already.
        chunked = model.base_model.model.sequence_chunked_modules()
        inside = {id(m) for module in chunked for m in module.modules()}
        assert chunked and not any(id(region) in inside for region in manager.regions)


def test_the_memory_policy_sets_the_chunks_on_every_channel_mixer():
    from moe_tune.engine.model.moe import DenseMLP
    from moe_tune.engine.train.trainer import build_trainable_model

    model, _ = build_trainable_model(tiny_job("memory.sequence_chunk_tokens=40"))
    mixers = [m for m in model.modules() if isinstance(m, (MoEBlock, DenseMLP))]
    assert mixers and all(m.sequence_chunk_tokens == 40 for m in mixers)
    model, _ = build_trainable_model(tiny_job())
    assert all(m.sequence_chunk_tokens is None for m in model.modules() if isinstance(m, MoEBlock))


@pytest.mark.parametrize("value, rule", [
    (0, "greater than or equal to 1"),
    (-4096, "greater than or equal to 1"),
    (1.5, "valid integer"),
    ("'many'", "valid integer"),
])  # fmt: skip
def test_sequence_chunk_tokens_must_be_a_positive_integer(value, rule):
    with pytest.raises(ProfileError) as err:
        load_profile("tiny", [f"memory.sequence_chunk_tokens={value}"])
    assert len(err.value.problems) == 1
    assert err.value.problems[0].startswith("memory.sequence_chunk_tokens (") and rule in err.value.problems[0]


@pytest.mark.parametrize("memory", [(), ("memory.activation_checkpointing=true",), ("memory.preset=max-context",)])
def test_sequence_chunk_tokens_goes_with_every_policy(memory):
    assert load_profile("tiny", ["memory.sequence_chunk_tokens=1", *memory]).memory.sequence_chunk_tokens == 1


# ---- moe-tune plan: what backward keeps with sequence chunks ----

# profiles/tiny.yaml (fp32, 4 MoE layers): the bytes a token costs the per-token part of a layer when it runs whole,
# beyond its chunks' input rows. Training dtype (4 bytes): the post-attention norm's output (D 64); dispatch buffer and
# expert outputs (2 k D, k 2), gate_up output and SwiGLU product (3 k F, F 32), shared expert (3 Fs + 1 for its gate,
# Fs 64), expert adapters' x A (2 k r, r 16), the shared expert's three adapters (3 r). fp32: scores (E 8) and routing
# weights (k).
TINY_PER_TOKEN = 4 * (64 + 2 * 2 * 64 + 3 * 2 * 32 + 3 * 64 + 1 + 2 * 2 * 16 + 3 * 16) + 4 * (8 + 2)




def tiny_token_mixers(tokens: int, chunk: int) -> tuple[int, int, int]:
    """profiles/tiny.yaml's token mixers (3 linear, 1 sparse; fp32) in the plan: (bytes the four keep over the row
    run whole, bytes they keep in sequence chunks, bytes backward holds recomputing the largest mixer chunk: a linear
    slab's tensors over C tokens, or the sparse layer's chunk).

    Linear (Hk 2, Hv 4, K = V 16, conv channels 128): conv input and output 2 x 128, q and k at the value heads
    2 x 64, z, o and the norm's output 3 x 64, the kernel's intermediates 4 x (3 x 16 + 16 + 2 x 64) and a [4, 16, 16]
    state every 64 tokens, adapters on q, k, v, z, o 5 x 16; fp32 beta and the decay twice then once more (4 x 4).
    Chunked: one [4, 16, 16] fp32 state a slab. Sparse (H 4, G 2, hd 16, token level, 32 slots): q with gate, k, v
    2 x 64 + 2 x 32, normed and rotated q, k 96, attention and gated output 2 x 64, adapters on q, k, v, o 4 x 16;
    fp32 lse 4 and 32 indices. Chunked: the row's k and v (2 x 2 x 16) and each chunk's selection, 32 int32 indices
    a query (made before the chunk, kept for its backward: the indexer's keys are not kept). Recomputing a chunk of
    C queries over a span of M keys (a document over the row: M = tokens), the queries taken as the span's last C
    (query_start, no padding): its own tensors over C as above, and what ops/sparse_attention's autograd.py and
    kernels_bwd.py make at its backward: saved, the selection bitmap [C, ceil(M / 32)] int32 (one index head: the
    layer passes one selection for every kv head) and the sequence layout's seq_id, seq_start, seq_end [M] int32;
    in backward dq, dgate and the ungated output's gradient [C, 4, 16] each, delta [C, 4] fp32, dk and dv [M, 2, 16]
    and their fp32 partials [G, NC, 1, 128, 16] each, NC = the key tiles + ceil(pairs / pairs a chunk) (pair_chunks)
    of the pairs token_chunking counts for C queries over M keys."""
    from moe_tune.ops.sparse_attention.kernels_bwd import token_chunking
    from moe_tune.ops.sparse_attention.kernels_fwd import (
        GPU_DKV_CHUNK_PAIRS, GPU_DKV_KEY_TILE, GPU_DKV_TOKEN_CHUNKS,
    )  # fmt: skip

    states = -(-tokens // 64)
    linear_whole = 4 * (1424 * tokens + 1024 * states + 16 * tokens)
    sparse_whole = 4 * (480 * tokens + 36 * tokens)
    linear_kept = 4 * 1024 * -(-tokens // chunk)
    sparse_kept = 4 * (64 + 32) * tokens
    pairs, chunk_pairs = token_chunking(
        tokens, tokens, GPU_DKV_KEY_TILE, GPU_DKV_CHUNK_PAIRS, GPU_DKV_TOKEN_CHUNKS, chunk
    )  # fmt: skip
    num_chunks = -(-tokens // GPU_DKV_KEY_TILE) + -(-pairs // chunk_pairs)
    partials = 2 * 2 * num_chunks * GPU_DKV_KEY_TILE * 16
    over_span = chunk * -(-tokens // 32) + 3 * tokens + 2 * 2 * 16 * tokens + partials
    sparse_chunk = 4 * (480 * chunk + 36 * chunk + 3 * 64 * chunk + 4 * chunk + over_span)
    linear_chunk = 4 * (1424 * chunk + 1024 * -(-chunk // 64) + 16 * chunk)
    return 3 * linear_whole + sparse_whole, 3 * linear_kept + sparse_kept, max(linear_chunk, sparse_chunk)


@pytest.mark.parametrize("seq_len, chunk", [(512, 100), (1024, 64), (1000, 999)])
def test_plan_keeps_chunk_inputs_and_one_chunk(seq_len, chunk):
    from moe_tune.engine.plan import activation_bytes

    whole = activation_bytes(load_profile("tiny", [f"data.seq_len={seq_len}"]))
    chunked = activation_bytes(load_profile("tiny", [f"data.seq_len={seq_len}",
                                                     f"memory.sequence_chunk_tokens={chunk}"]))  # fmt: skip
    tokens = 4 * seq_len  # micro_batch_size 4: one packed row
    mixers_whole, mixers_kept, largest_chunk = tiny_token_mixers(tokens, chunk)
    # Four layers drop their per-token intermediates and their token mixers' over the row; backward holds one
    # chunk's, a mixer chunk's (a sparse one's gradients over the span, or a linear slab's tensors), larger than a
    # per-token chunk.
    assert largest_chunk > chunk * TINY_PER_TOKEN
    assert whole.layers - chunked.layers == 4 * tokens * TINY_PER_TOKEN + mixers_whole - mixers_kept - largest_chunk
    assert chunked.head == whole.head
    # The linear-attention backward's state gradients: one slab's chunks of 64 tokens at a time.
    assert chunked.transient == 2 * -(-chunk // 64) * 4 * 16 * 16 * 4


@pytest.mark.parametrize("checkpointing", [False, True])
def test_plan_a_chunk_holding_the_row_changes_only_the_token_mixers(checkpointing):
    from dataclasses import replace

    from moe_tune.engine.plan import plan_layouts

    base = ["data.seq_len=256", f"memory.activation_checkpointing={str(checkpointing).lower()}"]
    whole = plan_layouts(load_profile("tiny", base), 2, 10**12)
    tokens = 4 * 256
    mixers_whole, _, _ = tiny_token_mixers(tokens, tokens)
    # The per-token part runs whole; each token mixer runs whole under activation checkpoint (its one chunk), so backward
    # keeps none of their rows and recomputes one at a time, the largest (a linear layer's). Under whole-layer
    # checkpointing that is what recomputing the layer held already.
    largest = 4 * (1424 * tokens + 1024 * -(-tokens // 64) + 16 * tokens)
    saved = 0 if checkpointing else mixers_whole - largest
    for chunk in (1024, 5000):  # micro_batch_size 4 x 256: the row's 1024 tokens, and more
        chunked = plan_layouts(load_profile("tiny", [*base, f"memory.sequence_chunk_tokens={chunk}"]), 2, 10**12)
        assert chunked.activations.layers == whole.activations.layers - saved
        activations = replace(chunked.activations, layers=whole.activations.layers)
        assert replace(chunked, activations=activations, layouts=[]) == replace(whole, layouts=[])
        for got, expected in zip(chunked.layouts, whole.layouts):
            assert replace(got, activations=0, total=0, fits=True) == replace(expected, activations=0, total=0,
                                                                            fits=True)  # fmt: skip


@pytest.mark.parametrize("checkpointing, all_to_alls", [(False, 6), (True, 8)])
def test_plan_counts_the_recomputed_all_to_alls(checkpointing, all_to_alls):
    from moe_tune.engine.plan import plan_layouts

    base = ["data.seq_len=256", f"memory.activation_checkpointing={str(checkpointing).lower()}"]
    whole = plan_layouts(load_profile("tiny", ["data.seq_len=256"]), 2, 10**12)
    chunked = plan_layouts(load_profile("tiny", [*base, "memory.sequence_chunk_tokens=100"]), 2, 10**12)
    by_ep = {lay.expert_parallel: lay.all_to_all_per_step for lay in whole.layouts}
    # Each chunk's dispatch and combine run again when backward recomputes it (and once more in a recomputed layer).
    assert {lay.expert_parallel: lay.all_to_all_per_step for lay in chunked.layouts} == {
        ep: sent * all_to_alls // 4 for ep, sent in by_ep.items()}


# ---- expert parallelism: two gloo ranks, each chunk's all-to-alls in step ----

EP_TOKENS, EP_CHUNK = 64, 24


def expert_parallel_rank(result: str) -> None:
    """One of two ranks: the model with experts split over both (LoRA on them), on this rank's own row, unchunked
    and chunked; each rank saves its losses and gradients to result.RANK."""
    import torch.distributed as dist

    from moe_tune.engine.parallel.expert_parallel import ExpertLayout

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    layout = ExpertLayout(expert_parallel=2, expert_parallel_rank=rank, group=dist.group.WORLD)
    ids = torch.randint(0, 259, (1, EP_TOKENS), generator=torch.Generator().manual_seed(10 + rank))
    cu_seqlens = torch.tensor([0, EP_TOKENS], dtype=torch.int32)
    results = {}
    model = chunked_model(model_cfg(layers=[MOE]), None, layout)
    for name, chunk in (("whole", None), ("chunked", EP_CHUNK)):
        model.base_model.model.set_sequence_chunk_tokens(chunk)
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, cu_seqlens=cu_seqlens, labels=ids)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        results[name] = {"loss": out.loss.detach(), "aux_loss": out.aux_loss.detach(), **grads}
    torch.save(results, f"{result}.{rank}")
    dist.destroy_process_group()


@pytest.mark.dist
def test_expert_parallel_chunks_equal_whole_rows(tmp_path):
    from moe_tune.engine.parallel.launch import rank_env, rendezvous

    result = tmp_path / "rank.pt"
    with rendezvous() as port:
        procs = [subprocess.Popen([sys.executable, __file__, str(result)],
                                  env=rank_env(rank, 2, port, {**os.environ, "OMP_NUM_THREADS": "1"}),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for rank in range(2)]  # fmt: skip
        logs = [proc.communicate(timeout=180)[0] for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), "\n".join(log[-3000:] for log in logs)
    for rank in range(2):
        results = torch.load(f"{result}.{rank}", weights_only=True)
        assert_same(results["chunked"], results["whole"])
        assert results["whole"]["aux_loss"] > 0


if __name__ == "__main__":
    expert_parallel_rank(sys.argv[1])
