"""sparse_attention and topk_indexer Triton kernels on a CUDA device: output and every gradient against reference.py
in bf16 and fp32, token and block level, GQA/MQA, packed documents, issue 6's shape at a smaller T; index sets
equal to the reference's top-k on integer-valued inputs (exact scores); NaN- or poison-filled buffers with guarded
ends.

Run on the GPU machine in its own session (tests/ops imports the kernels in interpreter mode):
pytest -m gpu tests/gpu/test_sparse_attention_gpu.py
Triton 3.6 on Hopper can miscompile kernels that are right in the interpreter: these tests are what can see that.

Shapes: B batch, T tokens, HQ query heads, H kv heads, K / V head dims, S slots, HI indexer heads, DI indexer dim.
"""

import pytest
from guarded_buffers import GUARD_VALUE, GuardedBuffers
from kernel_fixtures import INTERPRETED_ON_GPU
import torch

from moe_tune.ops.sparse_attention import sparse_attention, topk_indexer
from moe_tune.ops.sparse_attention.reference import sparse_attention_ref, topk_indexer_ref

pytestmark = pytest.mark.gpu

# rel_rms = ||actual - expected|| / ||expected|| per tensor, rel_max = max |actual - expected| / max |expected|.
# fp32: ieee dots against the fp64 reference, only summation order and exp2 rounding differ.
# bf16: q, k, v, p and ds are bf16 dot operands (8 mantissa bits, 4e-3 per rounding) and o, dq, dk, dv are stored
# in bf16, against the fp32 reference on the same bf16 inputs; FlashAttention's bf16 tests allow a few 1e-3 RMS.
TOLERANCES = {
    torch.float32: dict(rel_rms=1e-5, rel_max=1e-4),
    torch.bfloat16: dict(rel_rms=1e-2, rel_max=5e-2),
}
GUARD_ELEMENTS = 64 * 16 * 128
INT_POISON = -777


class GuardedIntBuffers(GuardedBuffers):
    """GuardedBuffers that also hands out integer buffers (poisoned with INT_POISON)."""

    def alloc(self, shape, dtype, device):
        if dtype.is_floating_point:
            return super().alloc(shape, dtype, device)
        numel = 1
        for size in shape:
            numel *= size
        flat = torch.full((numel + self.guard_elements,), INT_POISON, dtype=dtype, device=device)
        flat[numel:] = int(GUARD_VALUE)
        self.buffers.append((flat, numel, tuple(shape)))
        return flat[:numel].view(shape)

    def check(self):
        assert self.buffers, "no kernel buffer was allocated: the kernel path did not run"
        for flat, numel, shape in self.buffers:
            guard = GUARD_VALUE if flat.dtype.is_floating_point else int(GUARD_VALUE)
            assert bool((flat[numel:] == guard).all()), f"a kernel wrote past the end of a buffer of shape {shape}"


@pytest.fixture
def guarded(monkeypatch) -> GuardedIntBuffers:
    from triton.runtime.interpreter import InterpretedFunction

    from moe_tune.ops.sparse_attention import kernels_bwd, kernels_fwd, kernels_select

    if isinstance(kernels_fwd._sparse_attn_fwd_kernel, InterpretedFunction):
        pytest.fail(INTERPRETED_ON_GPU)
    monkeypatch.setenv("MOE_TUNE_KERNELS", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    buffers = GuardedIntBuffers(GUARD_ELEMENTS)
    for module in (kernels_fwd, kernels_bwd, kernels_select):
        monkeypatch.setattr(module, "_alloc", buffers.alloc)
    return buffers


def make_qkv(B, T, HQ, H, K, V, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [(B, T, HQ, K), (B, T, H, K), (B, T, H, V)]
    return [torch.randn(shape, generator=gen, device="cuda").to(dtype).requires_grad_() for shape in shapes]


def forward_and_grads(op, q, k, v, indices, **options):
    o = op(q, k, v, indices, **options)
    do = torch.randn(o.shape, generator=torch.Generator(device="cuda").manual_seed(2), device="cuda").to(o.dtype)
    grads = torch.autograd.grad(o, (q, k, v), do)
    return {name: x.detach() for name, x in zip(("o", "dq", "dk", "dv"), (o, *grads))}


def assert_attention_matches_reference(q, k, v, indices, guarded, **options):
    actual = forward_and_grads(sparse_attention, q, k, v, indices, **options)
    reference_dtype = torch.float64 if q.dtype == torch.float32 else torch.float32
    as_reference = [x.detach().to(reference_dtype).requires_grad_() for x in (q, k, v)]
    expected = forward_and_grads(sparse_attention_ref, *as_reference, indices, **options)
    errors = {}
    for name in expected:
        a, e = actual[name].double(), expected[name].double()
        assert bool(a.isfinite().all()), f"{name}: non-finite values (an unwritten element or an overflow)"
        errors[name] = dict(
            rel_rms=((a - e).norm() / e.norm().clamp_min(1e-30)).item(),
            rel_max=((a - e).abs().max() / e.abs().max().clamp_min(1e-30)).item(),
        )
    tolerance = TOLERANCES[q.dtype]
    failed = {name: err for name, err in errors.items() if any(err[m] > tolerance[m] for m in tolerance)}
    assert not failed, f"over {tolerance}: {failed}; all errors: {errors}"
    guarded.check()


def raw_indices(shape, num_units, seed=1):
    """Random raw indices in [-2, num_units + 2): unused, out of range, acausal and repeated slots included."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(-2, num_units + 2, shape, generator=gen, device="cuda")


def causal_indices(B, T, H, S, block_size, seed=1):
    """Distinct causal keys (or earlier blocks plus the own block) per query, ascending, as the indexer emits."""
    from moe_tune.engine.bench.sparse_attention_op import random_indices

    return torch.cat([random_indices(T, block_size, S, "cuda", seed=seed + b) for b in range(B)]).expand(B, T, H, S)


ODD_CASES = [
    # Raw indices with every kind of invalid slot; GQA 8:2, K != V, T not a multiple of any tile.
    pytest.param(dict(B=1, T=333, HQ=8, H=2, K=64, V=128), 1, 100, "raw", id="token-raw-gqa"),
    # MQA, 16 query heads, a block of 64 with a tail, the block ids of a causal selection.
    pytest.param(dict(B=2, T=700, HQ=16, H=1, K=128, V=128), 64, 4, "causal", id="block64-mqa"),
    # Block size 100: two 64-key tiles per block in forward and backward; G = 3.
    pytest.param(dict(B=1, T=650, HQ=6, H=2, K=128, V=64), 100, 3, "raw", id="block100-G3"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape, block_size, S, kind", ODD_CASES)
def test_sparse_attention_matches_reference(guarded, shape, block_size, S, kind, dtype):
    q, k, v = make_qkv(**shape, dtype=dtype)
    B, T, H = shape["B"], shape["T"], shape["H"]
    num_units = T if block_size == 1 else -(-T // block_size)
    if kind == "raw":
        indices = raw_indices((B, T, H, S), num_units)
    else:
        indices = causal_indices(B, T, H, S, block_size)
    assert_attention_matches_reference(q, k, v, indices, guarded, block_size=block_size)


@pytest.mark.parametrize("block_size, S", [(1, 256), (64, 8)], ids=["token", "block64"])
def test_varlen_bf16_matches_reference(guarded, block_size, S):
    # Documents of 1, 63, 64, 65, 700 and 1155 tokens packed in one row; raw indices cross the boundaries.
    lengths = [1, 63, 64, 65, 700, 1155]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    T = sum(lengths)
    q, k, v = make_qkv(1, T, 8, 2, 128, 128, dtype=torch.bfloat16)
    num_units = T if block_size == 1 else -(-T // block_size)
    indices = raw_indices((1, T, 2, S), num_units)
    assert_attention_matches_reference(q, k, v, indices, guarded, block_size=block_size, cu_seqlens=cu_seqlens)


@pytest.mark.parametrize("block_size, S", [(1, 2048), (64, 32)], ids=["token2048", "block32x64"])
def test_issue_shape_at_smaller_T_bf16_matches_reference(guarded, block_size, S):
    # Issue 6's shape (B1, HQ16 sharing one kv head, K = V = 128, 2048 selected keys) at T 4096 instead of 16384.
    q, k, v = make_qkv(1, 4096, 16, 1, 128, 128, dtype=torch.bfloat16)
    indices = causal_indices(1, 4096, 1, S, block_size)
    assert_attention_matches_reference(q, k, v, indices, guarded, block_size=block_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size, S", [(1, 100), (64, 4)], ids=["token", "block64"])
def test_gated_sparse_attention_matches_reference(guarded, block_size, S, dtype):
    # The output gate fused into the kernels: o * sigmoid(gate), dgate beside dq, dk, dv; GQA 8:2, K != V, packed.
    lengths = [1, 63, 700, 236]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    T = sum(lengths)
    q, k, v = make_qkv(1, T, 8, 2, 64, 128, dtype=dtype)
    gen = torch.Generator(device="cuda").manual_seed(4)
    gate = (4 * torch.randn(1, T, 8, 128, generator=gen, device="cuda")).to(dtype).requires_grad_()
    num_units = T if block_size == 1 else -(-T // block_size)
    indices = raw_indices((1, T, 2, S), num_units)
    options = dict(block_size=block_size, cu_seqlens=cu_seqlens)

    def run(op, leaves):
        o = op(*leaves[:3], indices, gate=leaves[3], **options)
        do = torch.randn(o.shape, generator=torch.Generator(device="cuda").manual_seed(2), device="cuda").to(o.dtype)
        return dict(zip(("o", "dq", "dk", "dv", "dgate"), (o, *torch.autograd.grad(o, leaves, do))))

    actual = run(sparse_attention, [q, k, v, gate])
    reference_dtype = torch.float64 if dtype == torch.float32 else torch.float32
    expected = run(sparse_attention_ref, [x.detach().to(reference_dtype).requires_grad_() for x in (q, k, v, gate)])
    tolerance = TOLERANCES[dtype]
    for name in expected:
        a, e = actual[name].double(), expected[name].double()
        assert bool(a.isfinite().all()), f"{name}: non-finite values"
        rel_rms = ((a - e).norm() / e.norm().clamp_min(1e-30)).item()
        rel_max = ((a - e).abs().max() / e.abs().max().clamp_min(1e-30)).item()
        assert rel_rms <= tolerance["rel_rms"] and rel_max <= tolerance["rel_max"], (name, rel_rms, rel_max)
    guarded.check()


def exact_indexer_inputs(request, T, HI, DI, topk, block_size, cu_seqlens, dtype):
    """Integer-valued indexer queries [1, T, HI, DI], keys [1, T, DI] (times block_size: pooled keys stay integers)
    and weights [1, T, HI] on the GPU, and topk_indexer's options with a power-of-two scale (QSA's when the test id
    says qsa): every score is exact in fp32 and bf16."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q_idx = torch.randint(-3, 4, (1, T, HI, DI), generator=gen, device="cuda").to(dtype)
    k_idx = (torch.randint(-3, 4, (1, T, DI), generator=gen, device="cuda") * block_size).to(dtype)
    w_idx = torch.randint(-2, 3, (1, T, HI), generator=gen, device="cuda").to(dtype)
    if cu_seqlens is not None:
        cu_seqlens = torch.tensor(cu_seqlens, dtype=torch.int32, device="cuda")
    options = dict(topk=topk, block_size=block_size, scale=1 / 16, cu_seqlens=cu_seqlens)
    if "qsa" in request.node.callspec.id:
        options.update(k_idx_is_pooled=True, always_keep_own_block=False)
    return q_idx, k_idx, w_idx, options


@pytest.mark.parametrize(
    "T, HI, DI, topk, block_size, cu_seqlens",
    [
        pytest.param(3000, 64, 128, 512, 1, None, id="token-HI64"),
        pytest.param(3000, 64, 128, 8, 64, None, id="block64-HI64"),
        pytest.param(2500, 8, 64, 300, 1, [0, 1, 700, 2500], id="token-varlen"),
        # Up to 6000 candidates: rows of 4096 or more take the sampled bracket (integer scores: ties across it), and
        # every pass reads a query's keys in many 512-key steps.
        pytest.param(6000, 8, 64, 2048, 1, None, id="token-two-chunks"),
        pytest.param(2500, 8, 64, 6, 32, [0, 1, 700, 2500], id="block32-varlen"),
        # QSA: pooled block keys given at each block's first row, own block only while incomplete.
        pytest.param(2500, 8, 64, 6, 32, [0, 1, 700, 2500], id="block32-qsa-varlen"),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_topk_indexer_equals_reference(request, guarded, T, HI, DI, topk, block_size, cu_seqlens, dtype):
    # Integer-valued inputs and a power-of-two scale make every score exact on both sides: the index sets, ties
    # included, must be identical.
    q_idx, k_idx, w_idx, options = exact_indexer_inputs(request, T, HI, DI, topk, block_size, cu_seqlens, dtype)
    actual = topk_indexer(q_idx, k_idx, w_idx, **options)
    expected = topk_indexer_ref(q_idx, k_idx, w_idx, **options)
    mismatched = (actual != expected).any(dim=-1).nonzero().tolist()
    assert not mismatched, f"{len(mismatched)} queries differ, first (b, t): {mismatched[:3]}"
    guarded.check()


QUERY_START_CASES = [
    # Token level, GQA 8:2, K != V: the last 367 of 700 keys are the queries, raw indices with invalid slots.
    pytest.param(dict(B=1, T=700, HQ=8, H=2, K=64, V=128), 1, 100, 333, None, id="token-raw-gqa"),
    # Two rows, blocks of 64 with a tail, the queries starting inside a block.
    pytest.param(dict(B=2, T=700, HQ=16, H=1, K=128, V=128), 64, 4, 290, None, id="block64-two-rows"),
    # Packed documents, the queries starting inside the second; blocks of 32.
    pytest.param(dict(B=1, T=900, HQ=8, H=2, K=128, V=128), 32, 6, 500, [0, 1, 450, 900], id="block32-varlen"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape, block_size, S, query_start, cu_seqlens", QUERY_START_CASES)
def test_query_start_matches_reference_and_the_full_rows(guarded, shape, block_size, S, query_start, cu_seqlens,
                                                         dtype):  # fmt: skip
    # Queries that are the last T - query_start tokens of the keys: the kernels against the reference on the same
    # offset inputs, and against the kernels' own full-length run's last rows (the rows before get no gradient).
    q, k, v = make_qkv(**shape, dtype=dtype)
    B, T, H = shape["B"], shape["T"], shape["H"]
    num_units = T if block_size == 1 else -(-T // block_size)
    indices = raw_indices((B, T, H, S), num_units)
    if cu_seqlens is not None:
        cu_seqlens = torch.tensor(cu_seqlens, dtype=torch.int32, device="cuda")
    options = dict(block_size=block_size, cu_seqlens=cu_seqlens)
    q_last = q[:, query_start:].detach().requires_grad_()
    assert_attention_matches_reference(
        q_last, k, v, indices[:, query_start:], guarded, query_start=query_start, **options
    )  # fmt: skip
    offset = forward_and_grads(sparse_attention, q_last, k, v, indices[:, query_start:], query_start=query_start,
                               **options)  # fmt: skip
    o = sparse_attention(q, k, v, indices, **options)
    do = torch.zeros_like(o)
    do[:, query_start:] = torch.randn(
        offset["o"].shape, generator=torch.Generator(device="cuda").manual_seed(2), device="cuda"
    ).to(dtype)
    full = dict(zip(("o", "dq", "dk", "dv"), (o, *torch.autograd.grad(o, (q, k, v), do))))
    for name in ("o", "dq"):
        full[name] = full[name][:, query_start:]
    for name in full:
        a, e = offset[name].double(), full[name].double()
        rel_max = ((a - e).abs().max() / e.abs().max().clamp_min(1e-30)).item()
        assert rel_max <= TOLERANCES[dtype]["rel_max"], (name, rel_max)


@pytest.mark.parametrize(
    "T, query_start, topk, block_size, cu_seqlens",
    [
        pytest.param(3000, 1800, 512, 1, None, id="token"),
        pytest.param(6000, 1500, 2048, 1, [0, 1, 700, 6000], id="token-varlen-bracketed"),
        pytest.param(3000, 1777, 8, 64, None, id="block64"),
        pytest.param(2500, 1000, 6, 32, [0, 1, 700, 2500], id="block32-qsa-varlen"),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_topk_indexer_query_start_equals_full_rows(request, guarded, T, query_start, topk, block_size, cu_seqlens,
                                                   dtype):  # fmt: skip
    # Integer-valued inputs: exact scores, so the offset run, the full run's last rows and the reference agree.
    q_idx, k_idx, w_idx, options = exact_indexer_inputs(request, T, 8, 64, topk, block_size, cu_seqlens, dtype)
    full = topk_indexer(q_idx, k_idx, w_idx, **options)[:, query_start:]
    rows = (q_idx[:, query_start:], k_idx, w_idx[:, query_start:])
    actual = topk_indexer(*rows, query_start=query_start, **options)
    expected = topk_indexer_ref(*rows, query_start=query_start, **options)
    assert torch.equal(actual, full) and torch.equal(actual, expected)
    guarded.check()
