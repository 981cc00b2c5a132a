"""Speed of the sparse attention and top-k indexer kernels on one CUDA device, beside what users would pick instead.

Run on the GPU machine: python -m moe_tune.engine.bench.sparse_attention_op (or `moe-tune profile --kernels --ops
sparse_attention,topk_indexer --shapes anchor`). Nothing runs at import. Every time is the median of
triton.testing.do_bench; forward+backward rows time one forward and one backward from a random output gradient.
Printed rows carry machine_info's keys (device, machine, driver, torch, triton, commit, date), as kernels.py's do.

Shapes are issue 6's targets: B1, HQ16 query heads sharing one kv head, K = V = 128, 2048 selected keys per query
(block level: 32 blocks of 64; token level: 2048 keys), bf16. Indices are drawn uniformly among each query's causal
keys or complete earlier blocks (the query's own block always kept), deduplicated and ascending as the indexer
emits them. FLOPs count useful work only, q k^T and p v over the selected keys (2 S (K + V) per query and head,
causal clipping ignored), backward 2.5 times that, as FlashAttention reports; SDPA counts its dense causal work.
extra_peak_bytes: peak allocated during the timed pass minus what was allocated before it (inputs included in the
latter), the figure the issue's "extra peak memory" target bounds.

Shapes: B batch, T tokens, HQ query heads, H kv heads, K / V head dims, S selected slots, HI indexer heads, DI
indexer dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from moe_tune.engine.bench.machine import machine_info
from moe_tune.engine.bench.timing import median_ms, time_pass

# Issue 6's attention shape and its three cases: (case, T, block_size, S slots).
ATTENTION_SHAPE = dict(batch_size=1, num_heads=16, num_kv_heads=1, head_dim_k=128, head_dim_v=128)
ATTENTION_CASES = (
    ("block 32x64", 16384, 64, 32),
    ("token 2048", 16384, 1, 2048),
    ("block 32x64 long", 65536, 64, 32),
)
# The indexer shape of profiles/seed-2p8t.yaml: 64 heads of dim 128, 2048 tokens or 32 blocks of 64.
INDEXER_SHAPE = dict(seq_len=16384, num_heads=64, head_dim=128)
INDEXER_CASES = (("token top-2048", 1, 2048), ("block top-32x64", 64, 32))
# Dense masked reference: [HQ, T, T] fp32 scores and probabilities; past this T it cannot fit, so it is not tried.
REFERENCE_MAX_T = 16384
# The naive gather implementation holds [T, S, K] gathered keys and values: past this T it cannot fit.
NAIVE_GATHER_MAX_T = 16384
# Queries per step of the naive indexer (scores + torch.topk): [256, HI, T] fp32 is 1 GiB at HI 64, T 16384.
NAIVE_INDEXER_CHUNK = 256
ATTENTION_BWD_FLOP_FACTOR = 2.5


def random_indices(T: int, block_size: int, S: int, device, seed: int = 0) -> torch.Tensor:
    """int32 [1, T, 1, S]: per query S distinct causal keys (or S - 1 complete earlier blocks plus its own),
    ascending, -1 padded, as topk_indexer emits them."""
    gen = torch.Generator(device=device).manual_seed(seed)
    num_units = T if block_size == 1 else math.ceil(T / block_size)
    pos = torch.arange(T, device=device)
    own = pos if block_size == 1 else pos // block_size
    # Random scores over the units, candidates only (token: s <= t; block: complete blocks before the own block).
    rows = []
    for start in range(0, T, 1024):
        end = min(T, start + 1024)
        scores = torch.rand(end - start, num_units, generator=gen, device=device)
        unit = torch.arange(num_units, device=device)
        own_rows = own[start:end, None]
        is_candidate = unit[None, :] <= own_rows if block_size == 1 else unit[None, :] < own_rows
        scores = scores.masked_fill(~is_candidate, -1.0)
        if block_size > 1:
            scores = scores.scatter(1, own[start:end, None], 2.0)
        top = scores.topk(min(S, num_units), dim=1)
        chosen = torch.where(top.values >= 0, top.indices, num_units).sort(dim=1).values
        chosen = torch.where(chosen == num_units, -1, chosen)
        rows.append(F.pad(chosen, (0, S - chosen.shape[1]), value=-1))
    return torch.cat(rows).int().view(1, T, 1, S)


def naive_gather_attention(q, k, v, indices, block_size=1, scale=None):
    """What a user writes first: gather the selected keys and values per query ([B, T, S', D]), mask, softmax.
    One kv head, one sequence per row (the benched shapes)."""
    B, T, HQ, K = q.shape
    scale = K**-0.5 if scale is None else scale
    idx = indices[:, :, 0].long()
    if block_size > 1:
        # Block ids of one sequence per row: expand each block to its key positions.
        idx = (idx[..., None] * block_size + torch.arange(block_size, device=q.device)).flatten(2)
        idx = torch.where(indices[:, :, 0, :, None].expand(-1, -1, -1, block_size).flatten(2) >= 0, idx, -1)
    pos = torch.arange(T, device=q.device)[None, :, None]
    is_key = (idx >= 0) & (idx <= pos)
    safe = idx.clamp(0, T - 1)
    # One kv head (the benched shape): [B, T, S', K] and [B, T, S', V] gathered copies.
    batch = torch.arange(B, device=q.device)[:, None, None]
    k_sel = k[:, :, 0][batch, safe]
    v_sel = v[:, :, 0][batch, safe]
    scores = torch.einsum("bthk,btsk->bths", q, k_sel).float() * scale
    scores = scores.masked_fill(~is_key[:, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0).to(q.dtype)
    return torch.einsum("bths,btsv->bthv", probs, v_sel)


@torch.no_grad()
def naive_topk_indexer(q_idx, k_idx, w_idx, topk, scale=None):
    """Token-level scores for NAIVE_INDEXER_CHUNK queries at a time, causal mask, torch.topk, ascending."""
    B, T, HI, DI = q_idx.shape
    scale = DI**-0.5 if scale is None else scale
    out = []
    pos = torch.arange(T, device=q_idx.device)
    for start in range(0, T, NAIVE_INDEXER_CHUNK):
        end = min(T, start + NAIVE_INDEXER_CHUNK)
        logits = torch.relu(torch.einsum("bchd,bsd->bchs", q_idx[:, start:end], k_idx).float() * scale)
        scores = torch.einsum("bchs,bch->bcs", logits, w_idx[:, start:end].float())
        scores = scores.masked_fill(pos[None, None, :] > pos[None, start:end, None], float("-inf"))
        top = scores.topk(min(topk, T), dim=-1)
        chosen = torch.where(top.values > float("-inf"), top.indices, T).sort(dim=-1).values
        out.append(torch.where(chosen == T, -1, chosen))
    return torch.cat(out, dim=1).int()


def bench_sparse_attention(cases=ATTENTION_CASES, include_reference: bool = True, **shape) -> list[dict]:
    """Rows of {case, impl, shape, dtype, fwd_ms, fwd_bwd_ms, fwd_tflops, fwd_bwd_tflops, extra_peak_bytes,
    max_abs_err, note}. Implementations: our kernel, the dense masked reference (fp32), a naive gather, SDPA dense
    causal, and FLA's parallel_nsa when importable (block cases). max_abs_err: forward output against the kernel's
    (for baselines) or against the reference where it ran."""
    if not torch.cuda.is_available():
        raise RuntimeError("bench_sparse_attention needs a CUDA device")
    from moe_tune.ops.sparse_attention.autograd import sparse_attention_kernel
    from moe_tune.ops.sparse_attention.reference import sparse_attention_ref

    shape = {**ATTENTION_SHAPE, **shape}
    B, HQ, H, K, V = (shape[n] for n in ("batch_size", "num_heads", "num_kv_heads", "head_dim_k", "head_dim_v"))
    dtype = torch.bfloat16
    rows = []
    for case, T, block_size, S in cases:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(B, T, HQ, K, generator=gen, device="cuda").to(dtype).requires_grad_()
        k = torch.randn(B, T, H, K, generator=gen, device="cuda").to(dtype).requires_grad_()
        v = torch.randn(B, T, H, V, generator=gen, device="cuda").to(dtype).requires_grad_()
        indices = random_indices(T, block_size, S, "cuda").expand(B, T, H, S)
        selected = S * block_size
        flops = 2.0 * B * HQ * T * selected * (K + V)
        label = f"B{B} T{T} HQ{HQ} H{H} K{K} V{V} " + (f"S{S}" if block_size == 1 else f"S{S}x{block_size}")
        with torch.no_grad():
            expected = sparse_attention_kernel(q, k, v, indices, block_size=block_size).float()

        def add(impl, fn, leaves, fwd_flops, err_against=expected):
            row = dict(case=case, impl=impl, shape=label, dtype="bfloat16")
            notes = []
            for key, with_backward in (("fwd", False), ("fwd_bwd", True)):
                try:
                    ms, peak, out = time_pass(fn, leaves, with_backward)
                except (RuntimeError, NotImplementedError, ValueError, ImportError) as err:
                    notes.append(f"{key} refused: {type(err).__name__}: {str(err).strip()[:120]}")
                    torch.cuda.empty_cache()
                    continue
                factor = 1.0 if key == "fwd" else 1.0 + ATTENTION_BWD_FLOP_FACTOR
                row[f"{key}_ms"] = round(ms, 3)
                row[f"{key}_tflops"] = round(fwd_flops * factor / ms * 1e-9, 1)
                row["extra_peak_bytes"] = max(row.get("extra_peak_bytes", 0), peak)
                if key == "fwd" and err_against is not None and out is not None and out.shape == err_against.shape:
                    row["max_abs_err"] = (out.float() - err_against).abs().max().item()
            if notes:
                row["note"] = "; ".join(notes)
            rows.append(row)

        add("moe_tune triton", lambda: sparse_attention_kernel(q, k, v, indices, block_size=block_size), [q, k, v],
            flops, err_against=None)  # fmt: skip
        if include_reference and T <= REFERENCE_MAX_T:
            add("reference (dense masked, fp32)",
                lambda: sparse_attention_ref(q, k, v, indices, block_size=block_size), [q, k, v], flops)  # fmt: skip
        if T <= NAIVE_GATHER_MAX_T:
            add("naive gather (torch)",
                lambda: naive_gather_attention(q, k, v, indices, block_size=block_size), [q, k, v], flops)  # fmt: skip
        sdpa_q, sdpa_k, sdpa_v = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
        add("torch sdpa dense causal",
            lambda: F.scaled_dot_product_attention(sdpa_q, sdpa_k, sdpa_v, is_causal=True, enable_gqa=True),
            [sdpa_q, sdpa_k, sdpa_v], 2.0 * B * HQ * T * T * (K + V) / 2, err_against=None)  # fmt: skip
        if block_size > 1:
            try:
                from fla.ops.nsa import parallel_nsa
            except ImportError:
                rows.append(dict(case=case, impl="fla parallel_nsa", shape=label, dtype="bfloat16",
                                 note="fla not importable on this machine"))  # fmt: skip
            else:
                fla_indices = indices.long()

                def fla_nsa():
                    return parallel_nsa(q, k, v, g_cmp=None, g_slc=torch.ones_like(q[..., 0]), g_swa=None,
                                        block_indices=fla_indices, block_size=block_size)  # fmt: skip

                add("fla parallel_nsa", fla_nsa, [q, k, v], flops)
        del q, k, v, sdpa_q, sdpa_k, sdpa_v, expected
        torch.cuda.empty_cache()
    return rows


def bench_topk_indexer(cases=INDEXER_CASES, **shape) -> list[dict]:
    """Rows for the fused indexer + top-k kernel, beside naive scores + torch.topk (token level); `note` says whether
    the index sets equal the reference's on integer-valued inputs (where every score is exact)."""
    from moe_tune.ops.sparse_attention.autograd import topk_indexer_kernel

    shape = {**INDEXER_SHAPE, **shape}
    T, HI, DI = shape["seq_len"], shape["num_heads"], shape["head_dim"]
    rows = []
    for case, block_size, topk in cases:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q_idx = torch.randn(1, T, HI, DI, generator=gen, device="cuda").bfloat16()
        k_idx = torch.randn(1, T, DI, generator=gen, device="cuda").bfloat16()
        w_idx = torch.randn(1, T, HI, generator=gen, device="cuda").bfloat16()
        label = f"T{T} HI{HI} DI{DI} topk{topk}" + (f"x{block_size}" if block_size > 1 else "")
        candidates = T * (T + 1) / 2 if block_size == 1 else T * T / block_size / 2
        flops = 2.0 * HI * DI * candidates

        def add(impl, fn, note=None):
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            ms = median_ms(fn)
            row = dict(case=case, impl=impl, shape=label, dtype="bfloat16", fwd_ms=round(ms, 3),
                       fwd_tflops=round(flops / ms * 1e-9, 1),
                       extra_peak_bytes=torch.cuda.max_memory_allocated() - before)  # fmt: skip
            if note:
                row["note"] = note
            rows.append(row)

        add("moe_tune triton (fused top-k)",
            lambda: topk_indexer_kernel(q_idx, k_idx, w_idx, topk=topk, block_size=block_size),
            note=_exact_selection_note(T, HI, DI, topk, block_size))  # fmt: skip
        if block_size == 1:
            add("naive scores + torch.topk", lambda: naive_topk_indexer(q_idx, k_idx, w_idx, topk))
        torch.cuda.empty_cache()
    return rows


def _exact_selection_note(T, HI, DI, topk, block_size) -> str:
    """Index-set equality with the reference on integer-valued inputs of the benched size (up to 4096 tokens)."""
    from moe_tune.ops.sparse_attention.autograd import topk_indexer_kernel
    from moe_tune.ops.sparse_attention.reference import topk_indexer_ref

    T = min(T, 4096)
    gen = torch.Generator(device="cuda").manual_seed(1)
    q_idx = torch.randint(-3, 4, (1, T, HI, DI), generator=gen, device="cuda").bfloat16()
    k_idx = (torch.randint(-3, 4, (1, T, DI), generator=gen, device="cuda") * block_size).bfloat16()
    w_idx = torch.randint(-2, 3, (1, T, HI), generator=gen, device="cuda").bfloat16()
    # A power-of-two scale keeps every score exact, so both sides must pick the very same keys.
    options = dict(topk=topk, block_size=block_size, scale=1 / 16)
    actual = topk_indexer_kernel(q_idx, k_idx, w_idx, **options)
    expected = topk_indexer_ref(q_idx, k_idx, w_idx, **options)
    num_differ = int((actual != expected).any(dim=-1).sum())
    return f"index sets equal the reference at T{T}" if num_differ == 0 else f"WRONG: {num_differ} queries differ"


if __name__ == "__main__":
    machine = machine_info(is_cuda=True)
    for row in bench_sparse_attention() + bench_topk_indexer():
        print(row | machine)
