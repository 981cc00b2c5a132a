"""Speed of the gated delta rule kernels on one CUDA device, beside what users would pick instead.

Run on the GPU machine: python -m moe_tune.engine.bench.linear_attention_op
Nothing runs at import. Every time is the median of triton.testing.do_bench (warm-up, then repeated runs on the
same random inputs); forward+backward rows time one forward and one backward from a random output gradient.

FLOPs are those of the chunked algorithm (chunk C, per chunk and head): q k^T, k k^T and W = (I + A)^-1 (beta k)
are 2 C^2 K each, U and (q k^T) v_new 2 C^2 V each, W S, (q exp(G)) S and the state update 2 C K V each (the
64 x 64 triangular inverse is left out); backward counts twice the forward. SDPA counts 2 T^2 D per head for the
causal forward (half of the 4 T^2 D product) and 2.5 times that for its backward, as FlashAttention reports.

Shapes: B batch, T tokens, H heads, K key dim, V value dim, N documents.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from moe_tune.engine.bench.machine import machine_info
from moe_tune.engine.bench.timing import time_pass
from moe_tune.ops.linear_attention.reference import DEFAULT_CHUNK_SIZE, chunk_gated_delta_rule_ref

# The shape of issue 5's targets (docs/perf-history.md, linear attention).
ANCHOR_SHAPE = dict(batch_size=4, seq_len=8192, num_heads=16, head_dim_k=128, head_dim_v=128)
NUM_DOCS = 8
# Backward FLOPs as a multiple of forward FLOPs (see the module docstring).
LINEAR_BWD_FLOP_FACTOR = 2.0
SDPA_BWD_FLOP_FACTOR = 2.5
CASES = ("gdn", "kda", "varlen")


def bench_linear_attention(
    batch_size: int = ANCHOR_SHAPE["batch_size"],
    seq_len: int = ANCHOR_SHAPE["seq_len"],
    num_heads: int = ANCHOR_SHAPE["num_heads"],
    head_dim_k: int = ANCHOR_SHAPE["head_dim_k"],
    head_dim_v: int = ANCHOR_SHAPE["head_dim_v"],
    dtype: torch.dtype = torch.bfloat16,
    num_docs: int = NUM_DOCS,
    include_reference: bool = True,
    cases: tuple[str, ...] = CASES,
    report: Callable[[list[dict]], None] | None = None,
) -> list[dict]:
    """Rows of {case, impl, shape, dtype, fwd_ms, fwd_tflops, fwd_bwd_ms, fwd_bwd_tflops, peak_memory_bytes,
    max_abs_err, note} and machine_info's keys (device, machine, driver, torch, triton, commit, date).

    Cases: "gdn" (our kernel as the model calls it, keeping the forward's passes for backward, and recomputing them
    there as the op does by default; FLA's chunk_gated_delta_rule, SDPA causal on the same q, k, v as the softmax
    yardstick, and our chunk reference), "kda" (our kernel both ways, FLA's chunk_kda both ways: recomputing in
    backward, its default, and keeping its forward's intermediates, `disable_recompute`; our reference), and "varlen"
    (our gated delta rule kernel, keeping its passes, on the B*T tokens as `num_docs` packed documents of mixed
    lengths, and as one document).
    max_abs_err: the forward output's largest difference from our fp32 reference on the same inputs, so that a fast
    but wrong row shows as such. peak_memory_bytes: the larger of the two passes' peaks, each the most allocated
    during one untimed call above what was allocated before it (inputs and earlier cases excluded). A pass an
    implementation refuses leaves its columns out and says why in `note`; a forward that runs out of memory leaves
    its forward+backward untried. The slow chunk reference comes last in its case, after the peer: a run stopped at
    a time limit (or a reference too large for the card) keeps the comparison.
    KDA FLOPs are counted as the gated delta rule's (the per-channel decays add elementwise work, not products).
    `cases`: which of the three to time (each makes its own inputs, seeded alike); report(rows), if given, gets the
    rows so far after each one.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("bench_linear_attention needs a CUDA device")
    from moe_tune.ops.linear_attention.autograd import gated_delta_rule_kernel

    B, T, H, K, V = batch_size, seq_len, num_heads, head_dim_k, head_dim_v
    machine = machine_info(is_cuda=True)
    rows = []

    def add(case, impl, shape, fn, inputs, flops, expected_o=None, bwd_flop_factor=LINEAR_BWD_FLOP_FACTOR):
        row = dict(case=case, impl=impl, shape=shape, dtype=str(dtype).removeprefix("torch."), **machine)
        notes = []
        out_of_memory = False
        # Forward and forward+backward apart: a library may run one and refuse the other (FLA's gated backward on
        # Hopper with Triton 3.4-3.7.0).
        for pass_name, flop_factor in (("fwd", 1.0), ("fwd_bwd", 1.0 + bwd_flop_factor)):
            if pass_name == "fwd_bwd" and out_of_memory:
                notes.append("fwd_bwd not run: the forward alone ran out of memory")
                continue
            try:
                ms, o, peak = _time(fn, inputs, with_backward=pass_name == "fwd_bwd")
            except Exception as error:  # noqa: BLE001 - a library that refuses to run is a result, not a crash
                notes.append(f"{pass_name} refused: {type(error).__name__}: {str(error).strip()[:200]}")
                out_of_memory = isinstance(error, torch.OutOfMemoryError)
                # An out-of-memory reference (KDA's holds [B, H, 64, 64, K] decays per chunk) must not starve the
                # rows after it.
                torch.cuda.empty_cache()
                continue
            row[f"{pass_name}_ms"] = round(ms, 4)
            row["peak_memory_bytes"] = max(row.get("peak_memory_bytes", 0), peak)
            row[f"{pass_name}_tflops"] = round(flops * flop_factor / ms * 1e-9, 1)
            if expected_o is not None and pass_name == "fwd":
                row["max_abs_err"] = (o.float() - expected_o).abs().max().item()
        if notes:
            row["note"] = "; ".join(notes)
        rows.append(row)
        if report is not None:
            report(list(rows))

    # As the model's layers call it (their saved tensors on the GPU): the forward's passes kept for backward.
    def ours(**inputs):
        return gated_delta_rule_kernel(**inputs, use_qk_l2norm=True, save_intermediates=True)

    def ours_recomputing(**inputs):
        return gated_delta_rule_kernel(**inputs, use_qk_l2norm=True)

    def reference(**inputs):
        return chunk_gated_delta_rule_ref(**inputs, use_qk_l2norm=True)

    shape = f"B{B} T{T} H{H} K{K} V{V}"
    flops = chunk_flops(H, K, V, num_chunks=B * -(-T // DEFAULT_CHUNK_SIZE))
    for case, is_per_channel in (("gdn", False), ("kda", True)):
        if case not in cases:
            continue
        inputs = make_inputs(B, T, H, K, V, dtype, is_per_channel=is_per_channel)
        with torch.no_grad():
            expected_o = reference(**inputs)[0].float()
        add(case, "moe_tune triton", shape, ours, inputs, flops, expected_o)
        add(case, "moe_tune triton, recomputing in backward", shape, ours_recomputing, inputs, flops, expected_o)
        fla_name, fla_op = fla_op_for(case)
        if fla_op is not None:

            def fla(fla_op=fla_op, **inputs):
                return fla_op(**inputs, use_qk_l2norm_in_kernel=True)

            add(case, f"fla {fla_name}", shape, fla, inputs, flops, expected_o)
            if case == "kda":
                # FLA's KDA keeps its forward's intermediates for backward on request, as our first row does: its
                # faster training pass where the memory allows (the peer's best configuration beside ours).
                def fla_keeping(fla_op=fla_op, **inputs):
                    return fla_op(**inputs, use_qk_l2norm_in_kernel=True, disable_recompute=True)

                add(case, f"fla {fla_name}, disable_recompute", shape, fla_keeping, inputs, flops, expected_o)
        if case == "gdn":
            sdpa_inputs = {name: inputs[name].detach().transpose(1, 2).contiguous().requires_grad_() for name in "qkv"}
            sdpa_flops = 2.0 * B * H * T * T * K
            add("gdn", "torch sdpa causal (softmax yardstick)", shape, _sdpa, sdpa_inputs, sdpa_flops,
                bwd_flop_factor=SDPA_BWD_FLOP_FACTOR)  # fmt: skip
        if include_reference:
            add(case, "moe_tune chunk reference (torch small ops)", shape, reference, inputs, flops)

    if "varlen" in cases:
        num_tokens = B * T
        packed = make_inputs(1, num_tokens, H, K, V, dtype, is_per_channel=False)
        doc_lengths = mixed_doc_lengths(num_tokens, num_docs)
        for name, lengths in ((f"{num_docs} documents", doc_lengths), ("1 document", [num_tokens])):
            starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
            cu_seqlens = torch.tensor(starts, dtype=torch.int32, device="cuda")
            num_chunks = sum(-(-length // DEFAULT_CHUNK_SIZE) for length in lengths)
            varlen_flops = chunk_flops(H, K, V, num_chunks=num_chunks)
            add("varlen", f"moe_tune triton, {name}", f"T{num_tokens} H{H} K{K} V{V} lengths {lengths}", ours,
                dict(packed, cu_seqlens=cu_seqlens), varlen_flops)  # fmt: skip
    return rows


def fla_op_for(case: str):
    """(name, FLA's chunk op) of the gated delta rule ("gdn") or KDA ("kda"); (name, None) when FLA is not installed."""
    try:
        if case == "gdn":
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as op
        else:
            from fla.ops.kda import chunk_kda as op
    except ImportError:
        op = None
    return ("chunk_gated_delta_rule" if case == "gdn" else "chunk_kda"), op


def mixed_doc_lengths(num_tokens: int, num_docs: int) -> list[int]:
    """`num_docs` lengths of at least 1 summing to num_tokens (>= num_docs), growing roughly geometrically, all but the
    last odd (none a multiple of the chunk) where num_tokens leaves room."""
    if num_tokens < num_docs:
        raise ValueError(f"num_tokens ({num_tokens}) must be >= num_docs ({num_docs}): a document has a token at least")
    weights = [1.6**i for i in range(num_docs)]
    lengths = []
    for i, w in enumerate(weights[:-1]):
        # Each later document keeps one token at least.
        room = num_tokens - sum(lengths) - (num_docs - 1 - i)
        lengths.append(min(max(1, int(num_tokens * w / sum(weights))) | 1, room))
    return [*lengths, num_tokens - sum(lengths)]


def chunk_flops(H: int, K: int, V: int, num_chunks: int) -> float:
    """FLOPs of the chunked algorithm over num_chunks chunks of H heads (the module docstring's count)."""
    C = DEFAULT_CHUNK_SIZE
    per_chunk = 6 * C * C * K + 4 * C * C * V + 6 * C * K * V
    return float(num_chunks * H * per_chunk)


def make_inputs(B, T, H, K, V, dtype, is_per_channel):
    """Random inputs as a model makes them: raw q, k (normalised in the op), logsigmoid decays, sigmoid beta."""
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    g = F.logsigmoid(randn(B, T, H, K) if is_per_channel else randn(B, T, H))
    inputs = dict(
        q=randn(B, T, H, K).to(dtype),
        k=randn(B, T, H, K).to(dtype),
        v=randn(B, T, H, V).to(dtype),
        g=g,
        beta=torch.sigmoid(randn(B, T, H)).to(dtype),
    )
    for x in inputs.values():
        x.requires_grad_()
    return inputs


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True), None


def _time(fn, inputs, with_backward: bool) -> tuple[float, torch.Tensor, int]:
    """(median ms, forward output, extra peak bytes) of timing.time_pass over fn(**inputs)'s output."""
    leaves = [x for x in inputs.values() if isinstance(x, torch.Tensor) and x.requires_grad]
    ms, peak, o = time_pass(lambda: fn(**inputs)[0], leaves, with_backward)
    return ms, o, peak


if __name__ == "__main__":
    for row in bench_linear_attention():
        print(row)
