"""The kernel benchmark behind `moe-tune profile --kernels`: one registry of ops, one row format, one baseline check.

Adding an op is one entry in OPS: a name mapped to a function `(shapes, run) -> list[dict]` that returns rows with
ROW_KEYS (missing timings are None, `note` says why). `shapes` is a preset name, or, for an op that also lists its
dimensions in SHAPE_DIMS, the dimensions of a free-form SPEC (`B4,T8192,H16,K128,V128`, see parse_shapes). `run`
is the RunContext: device, measured peaks, the machine facts, and `report`, through which an entry that times several
shapes or cases hands over its rows so far (run_kernels passes them on, so a stopped run keeps them).

On CUDA the MoE and linear attention entries call the per-op benches (moe_op.py, linear_attention_op.py beside this
file: kernel, reference and the external baselines, medians of triton.testing.do_bench) and add peak memory and the
fraction of the peaks measured at start (a large bf16 GEMM, a large device copy). Without CUDA every entry times
its pure-PyTorch reference on the small shapes with time.perf_counter medians; peak fraction and memory are None.

Shapes: N tokens, D model dim, F expert hidden dim, E experts, k experts per token; B batch, T tokens, H (kv) heads,
HQ query heads, K key dim, V value dim, S selected keys per query.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from moe_tune.engine.atomic_write import write_atomically
from moe_tune.engine.bench.linear_attention_op import NUM_DOCS
from moe_tune.engine.bench.machine import MACHINE_KEYS, machine_info
from moe_tune.engine.bench.timing import median_ms, time_ms
from moe_tune.engine.train.resources import available_memory
from moe_tune.ops.causal_conv import MAX_WIDTH as CAUSAL_CONV_MAX_WIDTH
from moe_tune.ops.linear_attention import KERNEL_MAX_KEY_DIM as LINEAR_ATTENTION_MAX_KEY_DIM
from moe_tune.ops.rms_norm import MAX_N as RMS_NORM_MAX_N

PRESETS = ("small", "anchor")
# One item of a --shapes SPEC: a dimension name and a positive integer (T8192, k8); names are case-sensitive.
SPEC_ITEM = re.compile(r"([A-Za-z]+)([1-9][0-9]*)")
# A row got slower than the baseline when its median exceeds the saved one by more than this fraction.
REGRESSION_TOLERANCE = 0.10
TIMED_KEYS = ("fwd_ms", "fwd_bwd_ms")
# Every row has these keys; a timing that could not be taken is None and `note` says why.
ROW_KEYS = (
    "op", "case", "impl", "shape", "dtype",
    "fwd_ms", "fwd_bwd_ms", "fwd_tflops", "fwd_bwd_tflops", "fwd_peak_fraction", "fwd_bwd_peak_fraction",
    "peak_memory_bytes", "note",
    *MACHINE_KEYS,
)  # fmt: skip
MATCH_KEYS = ("op", "case", "impl", "shape")
# Each row of a --json file also says whether its run measured every op (false while it runs, or if it was stopped).
COMPLETE_KEY = "complete"

# Peak probes: an 8192^3 bf16 GEMM saturates the tensor cores of an H100/H200; a 1 GiB copy is far past L2.
PEAK_GEMM_SIZE = 8192
# Rounds of the peak GEMM's timing, the fastest kept: on an H100 one round's median ranged over 680-731 TFLOP/s round
# after round in one process, which moved a run's MFU by as much (docs/PERF.md).
PEAK_ROUNDS = 5
PEAK_COPY_BYTES = 2**30

# Small shapes run on a CPU in well under a second per pass; anchor shapes are those of docs/PERF.md.
MOE_SHAPES = {
    "small": [dict(N=128, D=64, F=32, E=4, k=2, routing="uniform", lora_rank=0)],
    # None: engine/bench/moe_op.py's DEFAULT_SHAPES (issue 7's targets).
    "anchor": None,
}
LINEAR_ATTENTION_SHAPES = {
    "small": dict(batch_size=1, seq_len=128, num_heads=2, head_dim_k=64, head_dim_v=64, num_docs=4),
    # None: engine/bench/linear_attention_op.py's ANCHOR_SHAPE with its 8 documents.
    "anchor": None,
}
SPARSE_ATTENTION_SHAPES = {
    "small": dict(B=1, T=128, HQ=4, H=1, K=32, V=32, S=32),
    # None: sparse_attention_op.py's ATTENTION_CASES (issue 6's targets: T16384 block and token, T65536 block).
    "anchor": None,
}
# CUDA cases of engine/bench/sparse_attention_op.py per preset: (case, T, block_size, S slots), and its shape overrides.
SPARSE_ATTENTION_CUDA_SMALL = dict(
    cases=(("block 4x16", 256, 16, 4), ("token 64", 256, 1, 64)),
    batch_size=1, num_heads=4, num_kv_heads=1, head_dim_k=32, head_dim_v=32,
)  # fmt: skip
TOPK_INDEXER_CUDA_SMALL = dict(cases=(("token top-64", 1, 64), ("block top-4x16", 16, 4)), seq_len=256, num_heads=4,
                               head_dim=32)  # fmt: skip
TOPK_INDEXER_CPU_SHAPE = dict(B=1, T=128, HI=4, DI=32, topk=32)
# Issue 6 names no head count for its indexer target, and its naive baseline (6.6 ms, one [T, T] score matrix) cannot
# have had the model's 64 (ours: 160 ms; docs/perf-history.md, sparse attention): the anchor preset times 1, 4, 16
# and 64 heads.
TOPK_INDEXER_ANCHOR_HEADS = (1, 4, 16, 64)
SPARSE_CPU_NOTE = "reference only on CPU (dense masked softmax in fp32); the Triton kernels run on CUDA"
CROSS_ENTROPY_SHAPES = {
    "small": dict(N=512, D=64, V=4096),
    # A 32K-token row over a Qwen3-size vocabulary: its full fp32 logits alone are 19.9 GB.
    "anchor": dict(N=32768, D=2048, V=151936),
}
RMS_NORM_SHAPES = {
    "small": [dict(M=512, N=256)],
    # The benchmark model's hidden norms (B2 T4096, hidden 2048) and its gated delta nets' per-head output norms.
    "anchor": [dict(M=8192, N=2048), dict(M=8192 * 32, N=128)],
}
CAUSAL_CONV_SHAPES = {
    "small": [dict(T=512, C=256, W=4)],
    # The benchmark model's gated delta net conv: q, k, v together over a packed row of B2 T4096.
    "anchor": [dict(T=8192, C=8192, W=4)],
}
ROTARY_SHAPES = {
    "small": [dict(T=512, H=4, D=64, R=64)],
    # The qwen3_moe-like benchmark model's queries (B2 T4096, 16 heads of 128, full rotary) and the hybrid's
    # (a quarter of 256-dim heads).
    "anchor": [dict(T=8192, H=16, D=128, R=128), dict(T=8192, H=16, D=256, R=64)],
}
SWIGLU_SHAPES = {
    "small": [dict(M=512, F=256)],
    # The benchmark model's gated shared expert (B2 T4096, width 768) and a dense MLP's hidden rows (width 5632).
    "anchor": [dict(M=8192, F=768), dict(M=8192, F=5632)],
}
FP8_LINEAR_SHAPES = {
    "small": [dict(M=256, I=384, O=640)],
    # None: engine/bench/fp8_op.py's DEFAULT_SHAPES (issue 35's 30B-A3B projections over 8192 tokens).
    "anchor": None,
}
# Softmax attention backward FLOPs over forward, as FlashAttention reports (same factor as the linear attention bench).
ATTENTION_BWD_FLOP_FACTOR = 2.5


@dataclass
class Peaks:
    """What this machine reaches: bf16 GEMM TFLOP/s and device copy GB/s (None without CUDA)."""

    tflops: float | None = None
    copy_gb_per_s: float | None = None


def _ignore(rows: list[dict]) -> None:
    pass


@dataclass
class RunContext:
    """What every entry of OPS gets. report(rows): the rows the running op has measured so far (a prefix of what it
    will return), called by the entries that time several shapes or cases after each one."""

    is_cuda: bool
    peaks: Peaks
    machine: dict
    report: Callable[[list[dict]], None] = _ignore


def measure_peaks() -> Peaks:
    """bf16 GEMM TFLOP/s (the fastest of PEAK_ROUNDS medians: the rate the device reaches) and median device copy
    GB/s of the current CUDA device."""
    n = PEAK_GEMM_SIZE
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    gemm_ms = min(median_ms(lambda: a @ b) for _ in range(PEAK_ROUNDS))
    src = torch.randn(PEAK_COPY_BYTES // 4, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src))
    del a, b, src, dst
    torch.cuda.empty_cache()
    # A copy reads and writes every byte.
    return Peaks(tflops=2 * n**3 / gemm_ms * 1e-9, copy_gb_per_s=2 * PEAK_COPY_BYTES / copy_ms * 1e-6)


def make_row(op: str, case: str, impl: str, shape: str, dtype: torch.dtype | str, run: RunContext, **values) -> dict:
    """A row with every ROW_KEYS key; TFLOP/s and peak fractions derived from fwd_flops/bwd_flop_factor if given."""
    fwd_flops = values.pop("fwd_flops", None)
    bwd_flop_factor = values.pop("bwd_flop_factor", 2.0)
    row = dict.fromkeys(ROW_KEYS)
    row.update(op=op, case=case, impl=impl, shape=shape, dtype=str(dtype).removeprefix("torch."), **run.machine)
    row.update(values)
    if fwd_flops is not None:
        for key, factor in (("fwd", 1.0), ("fwd_bwd", 1.0 + bwd_flop_factor)):
            if row[f"{key}_ms"] is not None and row[f"{key}_tflops"] is None:
                row[f"{key}_tflops"] = fwd_flops * factor / row[f"{key}_ms"] * 1e-9
    for key in ("fwd", "fwd_bwd"):
        if run.peaks.tflops and row[f"{key}_tflops"] is not None:
            row[f"{key}_peak_fraction"] = row[f"{key}_tflops"] / run.peaks.tflops
    return row


def _timed(fn, leaves, run: RunContext) -> dict:
    """fwd_ms, fwd_bwd_ms and the larger peak memory of the two passes; a pass that fails leaves None and a note."""
    values, notes, peaks = {}, [], []
    for key, with_backward in (("fwd_ms", False), ("fwd_bwd_ms", True)):
        try:
            values[key], peak = time_ms(fn, leaves, with_backward, run.is_cuda)
        except (RuntimeError, NotImplementedError, ValueError) as err:
            notes.append(f"{key.removesuffix('_ms')} refused: {type(err).__name__}: {str(err).strip()[:160]}")
            continue
        if peak is not None:
            peaks.append(peak)
    values["peak_memory_bytes"] = max(peaks) if peaks else None
    if notes:
        values["note"] = "; ".join(notes)
    return values


def _randn(*shape: int, gen: torch.Generator, device: str, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device=device).to(dtype).requires_grad_()


def bench_moe_op(preset: str | dict[str, int], run: RunContext) -> list[dict]:
    """MoE expert MLP. CUDA: engine/bench/moe_op.py's triton, reference and torch _grouped_mm rows; CPU: the reference.
    A SPEC's N, D, F, E, k make one shape with uniform routing and no LoRA."""
    from moe_tune.engine.bench.moe_op import DEFAULT_SHAPES, bench_moe, lora_overhead

    if isinstance(preset, dict):
        shapes = [dict(preset, routing="uniform", lora_rank=0)]
    else:
        shapes = MOE_SHAPES[preset] or DEFAULT_SHAPES
    rows = []
    if run.is_cuda:
        # One bench_moe call per shape, so peak memory is that of the shape (the largest of its impls).
        results, peaks = [], []
        for shape in shapes:
            torch.cuda.reset_peak_memory_stats()
            shape_results = bench_moe([shape])
            results += shape_results
            peaks += [torch.cuda.max_memory_allocated()] * len(shape_results)
            # Without the LoRA ratios yet: they pair rows of different shapes once all are timed.
            run.report([_moe_row(result, run, peak) for result, peak in zip(results, peaks)])
        # The LoRA target's ratio from both trainings timed by turns (engine/bench/moe_op.py's lora_overhead).
        lora_shapes = [shape for shape in shapes if shape.get("lora_rank") and not shape.get("train_base")]
        notes = lora_overhead_notes(results, [lora_overhead(shape) for shape in lora_shapes])
        return [_moe_row(result, run, peak, note) for result, peak, note in zip(results, peaks, notes)]
    from moe_tune.ops.moe.reference import moe_mlp_ref

    gen = torch.Generator().manual_seed(0)
    for shape in shapes if isinstance(preset, dict) else MOE_SHAPES["small"]:
        N, D, Fh, E, k = (shape[name] for name in ("N", "D", "F", "E", "k"))
        x = _randn(N, D, gen=gen, device="cpu")
        topk_ids = torch.rand(N, E, generator=gen).topk(k, dim=-1).indices
        topk_weights = torch.randn(N, k, generator=gen).softmax(dim=-1).requires_grad_()
        w_gate_up = (torch.randn(E, 2 * Fh, D, generator=gen) * D**-0.5).requires_grad_()
        w_down = (torch.randn(E, D, Fh, generator=gen) * Fh**-0.5).requires_grad_()
        leaves = [x, topk_weights, w_gate_up, w_down]
        timed = _timed(lambda: moe_mlp_ref(x, topk_ids, topk_weights, w_gate_up, w_down), leaves, run)
        rows.append(
            make_row("moe", _moe_case(shape), "reference", _moe_shape(shape), torch.float32, run,
                     fwd_flops=2 * N * k * D * 3 * Fh, **timed)  # fmt: skip
        )
    return rows


def _moe_case(shape: dict) -> str:
    rank = shape.get("lora_rank", 0)
    # Without LoRA the experts train unless train_base=False (the frozen-expert baseline of the LoRA rows).
    is_frozen = not rank and not shape.get("train_base", True)
    fp8 = " fp8 weights" if shape.get("fp8") else ""
    return shape["routing"] + (f" lora r{rank}" if rank else "") + fp8 + (" experts frozen" if is_frozen else "")


def _moe_shape(shape: dict) -> str:
    return " ".join(f"{name}{shape[name]}" for name in ("N", "D", "F", "E", "k"))


def lora_overhead_notes(results: list[dict], alternating: list[dict] = ()) -> list[str | None]:
    """For each bench_moe result, the note that puts a LoRA row (experts frozen) against frozen-expert training of the
    same shape without LoRA (issue 7: LoRA r16 adds at most 20% to fwd+bwd); None for the other rows.

    alternating: engine/bench/moe_op.py's lora_overhead results (the triton kernels, both trainings timed by turns); a
    triton row with one gets its ratio, every other LoRA row the ratio of its own single timing over the frozen row's
    of the same shape and impl.
    """
    from moe_tune.engine.bench.moe_op import lora_overheads

    shape_names = ("N", "D", "F", "E", "k", "routing", "lora_rank")

    def key(row: dict, impl: str) -> tuple:
        # FP8-weight and bf16-weight rows of one shape are told apart: each has its own frozen twin.
        return (*(row.get(name) for name in shape_names), bool(row.get("fp8")), impl)

    ratios = {}
    for impl in dict.fromkeys(result["impl"] for result in results):
        for overhead in lora_overheads(results, impl=impl):
            ratios[key(overhead, impl)] = f"fwd+bwd {overhead['ratio']:.3f}x the frozen-expert row without LoRA"
    for overhead in alternating:
        ratios[key(overhead, "triton")] = (
            f"fwd+bwd {overhead['ratio']:.3f}x frozen experts without LoRA ({overhead['lora_ms']:.2f} against "
            f"{overhead['frozen_ms']:.2f} ms, medians of {overhead['passes']} passes timing the two by turns; "
            f"per pass {min(overhead['pass_ratios']):.3f}-{max(overhead['pass_ratios']):.3f}x)"
        )
    notes = []
    for result in results:
        # A LoRA row over trained experts has the same key as its frozen twin, so the frozen check stays.
        is_lora_frozen = result.get("lora_rank") and not result.get("train_base")
        notes.append(ratios.get(key(result, result["impl"])) if is_lora_frozen else None)
    return notes


def _moe_row(result: dict, run: RunContext, peak: int, lora_note: str | None = None) -> dict:
    notes = [f"max/mean expert load {result['max_over_mean_load']:.1f}"]
    if "rel_error" in result:
        grads = f", grads {result['grad_error']:.2f} of tol" if "grad_error" in result else ""
        notes.append(f"rel err {result['rel_error']:.1e}{grads}" + ("" if result["correct"] else " WRONG"))
    if "error" in result:
        notes.append(f"refused: {result['error']}")
    if result["lora_rank"] and not result["train_base"]:
        notes.append("expert weights frozen")
    if lora_note:
        notes.append(lora_note)
    values = {key: result.get(key) for key in ("fwd_ms", "fwd_bwd_ms", "fwd_tflops", "fwd_bwd_tflops")}
    return make_row("moe", _moe_case(result), result["impl"], _moe_shape(result), result["dtype"], run,
                    peak_memory_bytes=peak, note="; ".join(notes), **values)  # fmt: skip


def _linear_attention_shape(shapes: str | dict[str, int]) -> dict | None:
    """bench_linear_attention's shape arguments of a preset (None: its anchor defaults) or of SPEC dimensions."""
    if isinstance(shapes, dict):
        return dict(batch_size=shapes["B"], seq_len=shapes["T"], num_heads=shapes["H"], head_dim_k=shapes["K"],
                    head_dim_v=shapes["V"])  # fmt: skip
    return LINEAR_ATTENTION_SHAPES[shapes]


def _linear_attention_op(op: str, cases: tuple[str, ...], is_per_channel: bool):
    def bench(shapes: str | dict[str, int], run: RunContext) -> list[dict]:
        if run.is_cuda:
            from moe_tune.engine.bench.linear_attention_op import bench_linear_attention

            def rows_of(results: list[dict]) -> list[dict]:
                return [_linear_attention_row(op, result, run) for result in results]

            options = _linear_attention_shape(shapes) or {}
            results = bench_linear_attention(cases=cases, report=lambda so_far: run.report(rows_of(so_far)), **options)
            return rows_of(results)
        shape = _linear_attention_shape(shapes if isinstance(shapes, dict) else "small")
        return [_linear_attention_cpu_row(op, cases[0], is_per_channel, run, shape)]

    return bench


def _linear_attention_row(op: str, result: dict, run: RunContext) -> dict:
    notes = [result["note"]] if result.get("note") else []
    if result.get("max_abs_err") is not None:
        notes.insert(0, f"max abs err {result['max_abs_err']:.1e}")
    keys = ("fwd_ms", "fwd_bwd_ms", "fwd_tflops", "fwd_bwd_tflops", "peak_memory_bytes")
    values = {key: result.get(key) for key in keys}
    return make_row(op, result["case"], result["impl"], result["shape"], result["dtype"], run,
                    note="; ".join(notes) or None, **values)  # fmt: skip


def _linear_attention_cpu_row(op: str, case: str, is_per_channel: bool, run: RunContext, shape: dict) -> dict:
    from moe_tune.engine.bench.linear_attention_op import LINEAR_BWD_FLOP_FACTOR, chunk_flops
    from moe_tune.ops.linear_attention.reference import DEFAULT_CHUNK_SIZE, chunk_gated_delta_rule_ref

    B, T, H = shape["batch_size"], shape["seq_len"], shape["num_heads"]
    K, V = shape["head_dim_k"], shape["head_dim_v"]
    gen = torch.Generator().manual_seed(0)
    g = F.logsigmoid(torch.randn(B, T, H, K, generator=gen) if is_per_channel else torch.randn(B, T, H, generator=gen))
    inputs = dict(
        q=_randn(B, T, H, K, gen=gen, device="cpu"),
        k=_randn(B, T, H, K, gen=gen, device="cpu"),
        v=_randn(B, T, H, V, gen=gen, device="cpu"),
        g=g.requires_grad_(),
        beta=torch.sigmoid(torch.randn(B, T, H, generator=gen)).requires_grad_(),
    )
    timed = _timed(lambda: chunk_gated_delta_rule_ref(**inputs, use_qk_l2norm=True)[0], list(inputs.values()), run)
    flops = chunk_flops(H, K, V, num_chunks=B * -(-T // DEFAULT_CHUNK_SIZE))
    return make_row(op, case, "moe_tune chunk reference (torch small ops)", f"B{B} T{T} H{H} K{K} V{V}",
                    torch.float32, run, fwd_flops=flops, bwd_flop_factor=LINEAR_BWD_FLOP_FACTOR, **timed)  # fmt: skip


def bench_sparse_attention_op(preset: str, run: RunContext) -> list[dict]:
    """Top-k sparse attention. CUDA: engine/bench/sparse_attention_op.py's kernel, dense masked reference, naive gather,
    SDPA dense causal and FLA's parallel_nsa (when importable) rows; CPU: the reference, each query over S random
    causal keys."""
    if run.is_cuda:
        from moe_tune.engine.bench.sparse_attention_op import ATTENTION_CASES, bench_sparse_attention

        options = dict(SPARSE_ATTENTION_CUDA_SMALL) if preset == "small" else {}
        rows = []
        # One case at a time (each seeds its own inputs), so each is reported as soon as it is timed.
        for case in options.pop("cases", ATTENTION_CASES):
            results = bench_sparse_attention([case], **options)
            rows += [_sparse_row("sparse_attention", result, run) for result in results]
            run.report(list(rows))
        return rows
    from moe_tune.ops.sparse_attention.reference import sparse_attention_ref

    shape = SPARSE_ATTENTION_SHAPES["small"]
    B, T, HQ, H, K, V, S = (shape[name] for name in ("B", "T", "HQ", "H", "K", "V", "S"))
    gen = torch.Generator().manual_seed(0)
    q = _randn(B, T, HQ, K, gen=gen, device="cpu")
    k = _randn(B, T, H, K, gen=gen, device="cpu")
    v = _randn(B, T, H, V, gen=gen, device="cpu")
    # Query t selects S of its t + 1 causal keys (repeats allowed; queries with t < S see fewer distinct keys).
    positions_T1 = torch.arange(T)[:, None]
    indices = (torch.rand(B, T, S, generator=gen) * (positions_T1 + 1)).long()
    timed = _timed(lambda: sparse_attention_ref(q, k, v, indices), [q, k, v], run)
    # Useful work only: q k^T and p v over the S selected keys per query and head.
    flops = 2.0 * B * HQ * T * S * (K + V)
    return [make_row("sparse_attention", "token top-k", "reference (dense masked, fp32)",
                     f"B{B} T{T} HQ{HQ} H{H} K{K} V{V} S{S}", torch.float32, run, fwd_flops=flops,
                     bwd_flop_factor=ATTENTION_BWD_FLOP_FACTOR, note=SPARSE_CPU_NOTE, **timed)]  # fmt: skip


def bench_topk_indexer_op(preset: str, run: RunContext) -> list[dict]:
    """Top-k indexer (no backward). CUDA: engine/bench/sparse_attention_op.py's fused kernel beside naive scores +
    torch.topk; CPU: the reference."""
    if run.is_cuda:
        from moe_tune.engine.bench.sparse_attention_op import INDEXER_CASES, bench_topk_indexer

        if preset == "small":
            options = dict(TOPK_INDEXER_CUDA_SMALL)
            runs = [(case, options) for case in options.pop("cases")]
        else:
            runs = [(case, dict(num_heads=heads)) for heads in TOPK_INDEXER_ANCHOR_HEADS for case in INDEXER_CASES]
        rows = []
        # One case at a time (each seeds its own inputs), so each is reported as soon as it is timed.
        for case, options in runs:
            rows += [_sparse_row("topk_indexer", result, run) for result in bench_topk_indexer([case], **options)]
            run.report(list(rows))
        return rows
    from moe_tune.ops.sparse_attention.reference import topk_indexer_ref

    B, T, HI, DI, topk = (TOPK_INDEXER_CPU_SHAPE[name] for name in ("B", "T", "HI", "DI", "topk"))
    gen = torch.Generator().manual_seed(0)
    q_idx, k_idx = torch.randn(B, T, HI, DI, generator=gen), torch.randn(B, T, DI, generator=gen)
    w_idx = torch.randn(B, T, HI, generator=gen)
    fwd_ms, _ = time_ms(lambda: topk_indexer_ref(q_idx, k_idx, w_idx, topk=topk).float(), [], False, False)
    return [make_row("topk_indexer", "token top-k", "reference (brute-force scores + sort, fp32)",
                     f"B{B} T{T} HI{HI} DI{DI} topk{topk}", torch.float32, run, fwd_ms=fwd_ms,
                     fwd_flops=2.0 * HI * DI * T * (T + 1) / 2, note="no backward: the indexer is not trained")]


def _sparse_row(op: str, result: dict, run: RunContext) -> dict:
    notes = [result["note"]] if result.get("note") else []
    if result.get("max_abs_err") is not None:
        notes.insert(0, f"max abs err vs kernel {result['max_abs_err']:.1e}")
    values = {key: result.get(key) for key in ("fwd_ms", "fwd_bwd_ms", "fwd_tflops", "fwd_bwd_tflops")}
    return make_row(op, result["case"], result["impl"], result["shape"], result["dtype"], run,
                    peak_memory_bytes=result.get("extra_peak_bytes"), note="; ".join(notes) or None,
                    **values)  # fmt: skip


def bench_cross_entropy_op(shapes: str | dict[str, int], run: RunContext) -> list[dict]:
    """The LM loss over a linear head: ops.cross_entropy.linear_cross_entropy (chunked, never the [N, V] logits)
    beside the full-logits form users write (F.linear, then F.cross_entropy on fp32 logits), bf16 on CUDA and fp32
    on the CPU, the head trained. The chunked op computes its gradients in the forward, so its fwd column already
    holds most of its fwd+bwd work. On CUDA the op's row runs its Triton kernel over each chunk, and one more row
    forces the chunked path's PyTorch passes over fp32 logits (use_kernel False) beside it; on the CPU the op's row
    is that path already. Each note gives the loss's difference from the fp32 reference."""
    from moe_tune.ops.cross_entropy import linear_cross_entropy
    from moe_tune.ops.cross_entropy.autograd import LinearCrossEntropyFunction, default_chunk_size
    from moe_tune.ops.cross_entropy.reference import linear_cross_entropy_ref

    shape = shapes if isinstance(shapes, dict) else CROSS_ENTROPY_SHAPES[shapes if run.is_cuda else "small"]
    N, D, V = shape["N"], shape["D"], shape["V"]
    device, dtype = ("cuda", torch.bfloat16) if run.is_cuda else ("cpu", torch.float32)
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = _randn(N, D, gen=gen, device=device, dtype=dtype)
    weight = (torch.randn(V, D, generator=gen, device=device) * D**-0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=gen, device=device)
    with torch.no_grad():
        expected = float(linear_cross_entropy_ref(hidden.float(), weight.float(), labels))
    impls = {"moe_tune chunked (ops.cross_entropy)": lambda: linear_cross_entropy(hidden, weight, labels)}
    if run.is_cuda:
        torch_rows = default_chunk_size(N, V)
        impls["moe_tune chunked, torch passes (use_kernel False)"] = lambda: LinearCrossEntropyFunction.apply(
            hidden, weight, labels, None, -100, "mean", torch_rows, False
        )
    full_logits = "full logits (F.linear + F.cross_entropy)"
    impls[full_logits] = lambda: F.cross_entropy(F.linear(hidden, weight).float(), labels)
    rows = []
    for impl, loss_fn in impls.items():
        with torch.no_grad():
            loss = float(loss_fn())
        timed = _timed(loss_fn, [hidden, weight], run)
        timed["note"] = "; ".join(filter(None, [timed.get("note"), f"loss - fp32 reference {loss - expected:.1e}"]))
        rows.append(make_row("cross_entropy", "lm head", impl, f"N{N} D{D} V{V}", dtype, run, fwd_flops=2 * N * D * V,
                             **timed))  # fmt: skip
    return rows


def _gb_per_s(moved: int, ms: float) -> str:
    """`moved` bytes in `ms` milliseconds as GB/s: whole GB/s from 100 up, three significant digits below (the CPU's
    small shapes move a few MB/s, which whole GB/s print as 0)."""
    rate = moved / ms * 1e-6
    return f"{rate:,.0f} GB/s" if rate >= 100 else f"{rate:.3g} GB/s"


def _add_bytes_note(timed: dict, fwd_bytes: int, bwd_bytes: int) -> None:
    """Append to a memory-bound row's note the bytes a forward + backward must move at the least, and the rates
    the timed passes make of them."""
    rates = []
    if timed.get("fwd_ms"):
        rates.append(f"fwd {_gb_per_s(fwd_bytes, timed['fwd_ms'])}")
    if timed.get("fwd_bwd_ms"):
        rates.append(f"fwd+bwd {_gb_per_s(fwd_bytes + bwd_bytes, timed['fwd_bwd_ms'])}")
    note = f"moves at least {(fwd_bytes + bwd_bytes) / 1e6:,.3f} MB fwd+bwd"
    if rates:
        note += f" ({', '.join(rates)})"
    timed["note"] = "; ".join(filter(None, [timed.get("note"), note]))


def _memory_bound_setup(shapes: str | dict[str, int], presets: dict[str, list[dict]], run: RunContext):
    """(shape list, device, dtype, seeded generator) of a memory-bound op's bench: a SPEC's one shape or the preset's
    (the small one without CUDA); bf16 on CUDA, fp32 on the CPU."""
    shape_list = [shapes] if isinstance(shapes, dict) else presets[shapes if run.is_cuda else "small"]
    device, dtype = ("cuda", torch.bfloat16) if run.is_cuda else ("cpu", torch.float32)
    return shape_list, device, dtype, torch.Generator(device=device).manual_seed(0)


def bench_rms_norm_op(shapes: str | dict[str, int], run: RunContext) -> list[dict]:
    """RMSNorm, plain (one_plus, as qwen3_next), gated (silu) and after a residual add: the Triton kernel (called
    directly, so it runs while auto dispatch still keeps the reference on CUDA) beside the eager reference, bf16 on
    CUDA; on the CPU the reference in fp32. Each note gives the bytes one pass must move and the rate that makes."""
    from moe_tune.ops.rms_norm.reference import add_rms_norm_ref, rms_norm_ref

    shape_list, device, dtype, gen = _memory_bound_setup(shapes, RMS_NORM_SHAPES, run)
    rows = []
    for shape in shape_list:
        M, N = shape["M"], shape["N"]
        x = _randn(M, N, gen=gen, device=device, dtype=dtype)
        weight = _randn(N, gen=gen, device=device, dtype=dtype)
        gate = _randn(M, N, gen=gen, device=device, dtype=dtype)
        for case, z in (("plain", None), ("gated silu", gate)):
            leaves = [x, weight] + ([z] if z is not None else [])
            impls = {"reference (torch small ops)": lambda z=z: rms_norm_ref(x, weight, 1e-6, True, z)}
            if run.is_cuda:
                from moe_tune.ops.rms_norm.autograd import RMSNormFunction

                impls = {"moe_tune triton": lambda z=z: RMSNormFunction.apply(x, weight, z, 1e-6, True, True), **impls}
            # At the least: x (and z) read and y written forward; x, dy (and z) read, dx (and dz) written backward.
            tensors = 2 if z is None else 3
            fwd_bytes = tensors * M * N * x.element_size()
            bwd_bytes = (tensors + 1 + (z is not None)) * M * N * x.element_size()
            for impl, fn in impls.items():
                timed = _timed(fn, leaves, run)
                _add_bytes_note(timed, fwd_bytes, bwd_bytes)
                rows.append(make_row("rms_norm", case, impl, f"M{M} N{N}", dtype, run, **timed))
        # The decoder layer's residual add and the norm of its sum (x standing for the token mixer's output, gate for
        # the residual stream), timed through the norm's output (the pass takes one output).
        impls = {"reference (torch small ops)": lambda: add_rms_norm_ref(x, gate, weight, 1e-6, True)[1]}
        if run.is_cuda:
            from moe_tune.ops.rms_norm.autograd import AddRMSNormFunction

            impls = {
                "moe_tune triton": lambda: AddRMSNormFunction.apply(x, gate, weight, 1e-6, True, None, None)[1],
                **impls,
            }
        # At the least: x and the residual read, h and y written forward; dy and h read, dx written backward.
        fwd_bytes, bwd_bytes = 4 * M * N * x.element_size(), 3 * M * N * x.element_size()
        for impl, fn in impls.items():
            timed = _timed(fn, [x, gate, weight], run)
            _add_bytes_note(timed, fwd_bytes, bwd_bytes)
            rows.append(make_row("rms_norm", "residual add", impl, f"M{M} N{N}", dtype, run, **timed))
    return rows


def bench_causal_conv_op(shapes: str | dict[str, int], run: RunContext) -> list[dict]:
    """The short causal conv + SiLU over ~150-token documents: the Triton kernel (called directly, so it runs while
    auto dispatch still keeps the reference on CUDA) beside the eager reference, bf16 on CUDA; on the CPU the
    reference in fp32. Each note gives the bytes one pass must move and the rate that makes."""
    from moe_tune.engine.model.blocks import document_positions
    from moe_tune.ops.causal_conv.reference import causal_conv_ref

    shape_list, device, dtype, gen = _memory_bound_setup(shapes, CAUSAL_CONV_SHAPES, run)
    rows = []
    for shape in shape_list:
        T, C, W = shape["T"], shape["C"], shape["W"]
        starts = list(range(0, T, 150)) + [T]
        positions = document_positions(torch.tensor(starts, device=device), T)
        x = _randn(1, T, C, gen=gen, device=device, dtype=dtype)
        weight = _randn(C, W, gen=gen, device=device, dtype=dtype)
        impls = {"reference (torch small ops)": lambda: causal_conv_ref(x, weight, positions)}
        if run.is_cuda:
            from moe_tune.ops.causal_conv.autograd import CausalConvFunction

            impls = {"moe_tune triton": lambda: CausalConvFunction.apply(x, weight, positions, 1), **impls}
        # At the least: x read and y written forward; x and dy read, dx written backward.
        fwd_bytes, bwd_bytes = 2 * T * C * x.element_size(), 3 * T * C * x.element_size()
        for impl, fn in impls.items():
            timed = _timed(fn, [x, weight], run)
            _add_bytes_note(timed, fwd_bytes, bwd_bytes)
            rows.append(make_row("causal_conv", "150-token documents", impl, f"T{T} C{C} W{W}", dtype, run, **timed))
    return rows


def bench_rotary_op(shapes: str | dict[str, int], run: RunContext) -> list[dict]:
    """Rotary embedding of one query tensor: the Triton kernel (called directly, so it runs while auto dispatch
    still keeps the reference on CUDA) beside the eager reference, bf16 on CUDA; on the CPU the reference in fp32.
    Each note gives the bytes one pass must move and the rate that makes."""
    from moe_tune.ops.rotary.reference import rotary_ref

    shape_list, device, dtype, gen = _memory_bound_setup(shapes, ROTARY_SHAPES, run)
    rows = []
    for shape in shape_list:
        T, H, D, R = shape["T"], shape["H"], shape["D"], shape["R"]
        if R % 2 or R > D:
            raise ValueError(f"rotary shape {shape}: R must be even and <= D")
        x = _randn(1, T, H, D, gen=gen, device=device, dtype=dtype)
        angles = torch.arange(T, device=device, dtype=torch.float32)[:, None] * torch.rand(R // 2, generator=gen,
                                                                                         device=device)  # fmt: skip
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
        impls = {"reference (torch small ops)": lambda: rotary_ref(x, cos, sin)}
        if run.is_cuda:
            from moe_tune.ops.rotary.autograd import RotaryFunction

            impls = {"moe_tune triton": lambda: RotaryFunction.apply(x, cos, sin), **impls}
        # At the least: x read and y written forward, dy read and dx written backward (the tables are small).
        fwd_bytes = bwd_bytes = 2 * T * H * D * x.element_size()
        for impl, fn in impls.items():
            timed = _timed(fn, [x], run)
            _add_bytes_note(timed, fwd_bytes, bwd_bytes)
            rows.append(make_row("rotary", "positions 0..T-1", impl, f"T{T} H{H} D{D} R{R}", dtype, run, **timed))
    return rows


def bench_swiglu_op(shapes: str | dict[str, int], run: RunContext) -> list[dict]:
    """SwiGLU's activation, plain and scaled per row (a gated shared expert): the Triton kernel (called directly, so
    it runs while auto dispatch still keeps the reference on CUDA) and eager bf16 ops (silu, then each product,
    rounding after each: what the model ran before the kernel) beside the reference, bf16 on CUDA; on the CPU the
    reference in fp32. Each note gives the bytes one pass must move and the rate that makes."""
    from moe_tune.ops.swiglu.reference import swiglu_ref

    shape_list, device, dtype, gen = _memory_bound_setup(shapes, SWIGLU_SHAPES, run)
    rows = []
    for shape in shape_list:
        M, F_ = shape["M"], shape["F"]
        gate = _randn(M, F_, gen=gen, device=device, dtype=dtype)
        up = _randn(M, F_, gen=gen, device=device, dtype=dtype)
        scale_M1 = torch.rand(M, 1, generator=gen, device=device).to(dtype).requires_grad_()
        for case, scale in (("plain", None), ("scaled", scale_M1)):
            leaves = [gate, up] + ([scale] if scale is not None else [])
            impls = {"reference (torch small ops)": lambda scale=scale: swiglu_ref(gate, up, scale)}
            if run.is_cuda:
                from moe_tune.ops.swiglu.autograd import SwiGLUFunction

                def eager(scale=scale):
                    h = F.silu(gate) * up
                    return h if scale is None else h * scale

                impls = {"moe_tune triton": lambda scale=scale: SwiGLUFunction.apply(gate, up, scale),
                         "eager bf16 (silu, products)": eager, **impls}  # fmt: skip
            # At the least: gate and up read and h written forward; gate, up and dh read, dgate and dup written
            # backward (the scale is one value a row).
            fwd_bytes = 3 * M * F_ * gate.element_size()
            bwd_bytes = 5 * M * F_ * gate.element_size()
            for impl, fn in impls.items():
                timed = _timed(fn, leaves, run)
                _add_bytes_note(timed, fwd_bytes, bwd_bytes)
                rows.append(make_row("swiglu", case, impl, f"M{M} F{F_}", dtype, run, **timed))
    return rows


def bench_fp8_linear_op(shapes: str | dict[str, int], run: RunContext) -> list[dict]:
    """The dense linear through a frozen FP8 weight (128 x 128 block scales), forward and input gradient. CUDA:
    engine/bench/fp8_op.py's Triton rows beside bf16 F.linear (cuBLAS), bf16 x; CPU: fp8_linear_ref in fp32. Each
    CUDA note gives the largest error relative to the exact fp32 product (and, for the kernels, to the reference)."""
    if isinstance(shapes, dict):
        shape_list = [shapes]
    else:
        shape_list = FP8_LINEAR_SHAPES[shapes if run.is_cuda else "small"]
    if run.is_cuda:
        from moe_tune.engine.bench.fp8_op import DEFAULT_SHAPES, bench_fp8_linear

        rows = []
        # One shape a call (each seeded alike), so each is reported as soon as it is timed.
        for shape in shape_list or DEFAULT_SHAPES:
            for result in bench_fp8_linear([shape]):
                note = f"max rel err vs exact fp32 product {result['rel_err_exact']:.1e}"
                if result.get("rel_err_ref") is not None:
                    note += f", vs fp8_linear_ref {result['rel_err_ref']:.1e}"
                values = {key: result[key] for key in ("fwd_ms", "fwd_bwd_ms", "fwd_tflops", "fwd_bwd_tflops")}
                rows.append(make_row("fp8_linear", "frozen weight", result["impl"], result["shape"], result["dtype"],
                                     run, note=note, **values))  # fmt: skip
            run.report(list(rows))
        return rows
    from moe_tune.ops.fp8.reference import fp8_linear_ref, quantize_weight

    gen = torch.Generator().manual_seed(0)
    rows = []
    for shape in shape_list:
        M, I, O = shape["M"], shape["I"], shape["O"]
        x = _randn(M, I, gen=gen, device="cpu")
        weight, scale_inv = quantize_weight(torch.randn(O, I, generator=gen) * I**-0.5)
        timed = _timed(lambda: fp8_linear_ref(x, weight, scale_inv), [x], run)
        rows.append(make_row("fp8_linear", "frozen weight", "reference (dequantize, fp32)", f"M{M} I{I} O{O}",
                             torch.float32, run, fwd_flops=2 * M * I * O, bwd_flop_factor=1.0, **timed))  # fmt: skip
    return rows


# name -> function(preset, run) -> rows. Adding an op is one entry here.
OPS: dict[str, Callable[[str, RunContext], list[dict]]] = {
    "moe": bench_moe_op,
    "gated_delta_rule": _linear_attention_op("gated_delta_rule", ("gdn", "varlen"), is_per_channel=False),
    "kda": _linear_attention_op("kda", ("kda",), is_per_channel=True),
    "sparse_attention": bench_sparse_attention_op,
    "topk_indexer": bench_topk_indexer_op,
    "cross_entropy": bench_cross_entropy_op,
    "rms_norm": bench_rms_norm_op,
    "causal_conv": bench_causal_conv_op,
    "rotary": bench_rotary_op,
    "swiglu": bench_swiglu_op,
    "fp8_linear": bench_fp8_linear_op,
}
# The dimensions a --shapes SPEC gives an op, all of them and no others (ops not listed take presets only).
SHAPE_DIMS: dict[str, tuple[str, ...]] = {
    "moe": ("N", "D", "F", "E", "k"),
    "gated_delta_rule": ("B", "T", "H", "K", "V"),
    "kda": ("B", "T", "H", "K", "V"),
    "cross_entropy": ("N", "D", "V"),
    "rms_norm": ("M", "N"),
    "causal_conv": ("T", "C", "W"),
    "rotary": ("T", "H", "D", "R"),
    "swiglu": ("M", "F"),
    "fp8_linear": ("M", "I", "O"),
}


def parse_shapes(text: str, ops: list[str], label: str = "shapes") -> str | dict[str, dict[str, int]]:
    """A preset name as is, or a SPEC as each op's dimensions: comma-separated items, a dimension name and a positive
    integer each (`B4,T8192,H16,K128,V128`), naming exactly the SHAPE_DIMS of every op in `ops` and keeping its
    SPEC_RULES (MoE's k <= E, the kernels' widest dims, ...).

    Raises ValueError naming `label`, the value and the rule it breaks.
    """
    if text in PRESETS:
        return text
    prefix = f"{label} ({text!r})"
    dims = {}
    for item in (item.strip() for item in text.split(",")):
        match = SPEC_ITEM.fullmatch(item)
        if match is None:
            raise ValueError(
                f"{prefix} must be a preset ({', '.join(PRESETS)}) or a SPEC of comma-separated dimensions such as "
                f"B4,T8192,H16,K128,V128: {item!r} is not a dimension name followed by a positive integer"
            )
        if match.group(1) in dims:
            raise ValueError(f"{prefix}: dimension {match.group(1)} is given twice")
        dims[match.group(1)] = int(match.group(2))
    per_op = {}
    for op in ops:
        if op not in SHAPE_DIMS:
            raise ValueError(
                f"{prefix}: {op} takes presets only ({', '.join(PRESETS)}); a SPEC fits {', '.join(SHAPE_DIMS)}"
            )
        expected = SHAPE_DIMS[op]
        extra = [name for name in dims if name not in expected]
        missing = [name for name in expected if name not in dims]
        problems = [f"it has no {', '.join(extra)}"] if extra else []
        problems += [f"missing {', '.join(missing)}"] if missing else []
        if problems:
            raise ValueError(f"{prefix}: {op} takes exactly {','.join(expected)} ({'; '.join(problems)})")
        per_op[op] = {name: dims[name] for name in expected}
    # Ops sharing a SPEC (gated_delta_rule,kda) share its rules: each broken rule is said once.
    broken = dict.fromkeys(rule for op in per_op for rule in SPEC_RULES.get(op, lambda dims: [])(per_op[op]))
    if broken:
        raise ValueError(f"{prefix}: {'; '.join(broken)}")
    return per_op


def _moe_rules(d: dict[str, int]) -> list[str]:
    return [f"k ({d['k']}) must be <= E ({d['E']}): each token picks k distinct experts"] if d["k"] > d["E"] else []


def _linear_attention_rules(d: dict[str, int]) -> list[str]:
    if d["K"] <= LINEAR_ATTENTION_MAX_KEY_DIM:
        return []
    return [f"K ({d['K']}) must be <= {LINEAR_ATTENTION_MAX_KEY_DIM}: the widest key dim the linear attention kernels "
            "take (wider ones run the reference)"]  # fmt: skip


def _gated_delta_rule_rules(d: dict[str, int]) -> list[str]:
    rules = _linear_attention_rules(d)
    if d["B"] * d["T"] < NUM_DOCS:
        rules.append(f"B*T ({d['B'] * d['T']}) must be >= {NUM_DOCS}: the varlen rows pack the B*T tokens as "
                     f"{NUM_DOCS} documents")  # fmt: skip
    return rules


def _rms_norm_rules(d: dict[str, int]) -> list[str]:
    if d["N"] <= RMS_NORM_MAX_N:
        return []
    return [f"N ({d['N']}) must be <= {RMS_NORM_MAX_N}: the widest row the RMSNorm kernel takes in one tile"]


def _causal_conv_rules(d: dict[str, int]) -> list[str]:
    if d["W"] <= CAUSAL_CONV_MAX_WIDTH:
        return []
    return [f"W ({d['W']}) must be <= {CAUSAL_CONV_MAX_WIDTH}: the most taps the causal conv kernels unroll"]


def _rotary_rules(d: dict[str, int]) -> list[str]:
    if d["R"] % 2 == 0 and d["R"] <= d["D"]:
        return []
    return [f"R must be even and <= D (R{d['R']}, D{d['D']}): the rotary dims are pairs within the head dim"]


# Rules across the dimensions of one op's SPEC, beyond each being a positive integer: what the benchmark's inputs
# and the kernels it times need. Each returns the rules the dimensions break, one phrase each.
SPEC_RULES: dict[str, Callable[[dict[str, int]], list[str]]] = {
    "moe": _moe_rules,
    "gated_delta_rule": _gated_delta_rule_rules,
    "kda": _linear_attention_rules,
    "rms_norm": _rms_norm_rules,
    "causal_conv": _causal_conv_rules,
    "rotary": _rotary_rules,
}


# What one forward + backward of an op holds at SPEC dimensions d, as the benchmark makes its tensors: (elements,
# bytes per element, whether a gradient of the same size is held too) per tensor; `value` is the bytes of the op's
# dtype (bf16 on CUDA, fp32 on the CPU).
SPEC_TENSORS: dict[str, Callable[[dict[str, int], int], list[tuple[int, int, bool]]]] = {
    # x, topk_weights, topk_ids (int64), the uniform routing's [N, E] fp32 scores, w_gate_up, w_down, y.
    "moe": lambda d, value: [
        (d["N"] * d["D"], value, True), (d["N"] * d["k"], value, True), (d["N"] * d["k"], 8, False),
        (d["N"] * d["E"], 4, False), (d["E"] * 2 * d["F"] * d["D"], value, True),
        (d["E"] * d["D"] * d["F"], value, True), (d["N"] * d["D"], value, True),
    ],
    # q, k, v, g (fp32, one per head), beta, o.
    "gated_delta_rule": lambda d, value: [
        *[(d["B"] * d["T"] * d["H"] * d["K"], value, True)] * 2, (d["B"] * d["T"] * d["H"] * d["V"], value, True),
        (d["B"] * d["T"] * d["H"], 4, True), (d["B"] * d["T"] * d["H"], value, True),
        (d["B"] * d["T"] * d["H"] * d["V"], value, True),
    ],
    # q, k, v, g (fp32, one per key channel), beta, o.
    "kda": lambda d, value: [
        *[(d["B"] * d["T"] * d["H"] * d["K"], value, True)] * 2, (d["B"] * d["T"] * d["H"] * d["V"], value, True),
        (d["B"] * d["T"] * d["H"] * d["K"], 4, True), (d["B"] * d["T"] * d["H"], value, True),
        (d["B"] * d["T"] * d["H"] * d["V"], value, True),
    ],
    # hidden, the head's weight, labels (int64).
    "cross_entropy": lambda d, value: [(d["N"] * d["D"], value, True), (d["V"] * d["D"], value, True),
                                       (d["N"], 8, False)],  # fmt: skip
    # x, weight, gate, y.
    "rms_norm": lambda d, value: [(d["M"] * d["N"], value, True), (d["N"], value, True),
                                  (d["M"] * d["N"], value, True), (d["M"] * d["N"], value, True)],  # fmt: skip
    # x, weight, positions (int64), y.
    "causal_conv": lambda d, value: [(d["T"] * d["C"], value, True), (d["C"] * d["W"], value, True),
                                     (d["T"], 8, False), (d["T"] * d["C"], value, True)],  # fmt: skip
    # x, cos and sin (fp32), y.
    "rotary": lambda d, value: [(d["T"] * d["H"] * d["D"], value, True), *[(d["T"] * d["R"], 4, False)] * 2,
                                (d["T"] * d["H"] * d["D"], value, True)],  # fmt: skip
    # gate, up, the per-row scale, h.
    "swiglu": lambda d, value: [*[(d["M"] * d["F"], value, True)] * 2, (d["M"], value, True),
                                (d["M"] * d["F"], value, True)],  # fmt: skip
    # x, the weight drawn in fp32 and its FP8 copy (one byte an element), y.
    "fp8_linear": lambda d, value: [(d["M"] * d["I"], value, True), (d["O"] * d["I"], 4, False),
                                    (d["O"] * d["I"], 1, False), (d["M"] * d["O"], value, True)],  # fmt: skip
}


def spec_bytes(op: str, dims: dict[str, int], is_cuda: bool) -> int:
    """The fewest bytes one forward + backward of `op` at SPEC `dims` holds at once (SPEC_TENSORS): its inputs and
    outputs, with a gradient each for those it differentiates. A lower bound: the passes' intermediates come on top."""
    tensors = SPEC_TENSORS[op](dims, 2 if is_cuda else 4)
    return sum(count * size * (2 if has_gradient else 1) for count, size, has_gradient in tensors)


def memory_problems(text: str, shapes: str | dict[str, dict[str, int]], label: str = "shapes",
                    is_cuda: bool | None = None) -> list[str]:  # fmt: skip
    """One line per op of a parsed SPEC (parse_shapes) whose spec_bytes exceed the memory this machine has: free
    memory of the CUDA device, else the host memory available (default: CUDA when there is a device). Presets are
    not checked: their shapes are the benchmark's own."""
    if not isinstance(shapes, dict):
        return []
    is_cuda = torch.cuda.is_available() if is_cuda is None else is_cuda
    available, where = available_memory(torch.device("cuda" if is_cuda else "cpu"))
    problems = []
    for op, dims in shapes.items():
        need = spec_bytes(op, dims, is_cuda)
        if need > available:
            problems.append(
                f"{label} ({text!r}): {op} needs at least {need:,} bytes ({need / 1e9:,.1f} GB) for its inputs, "
                f"outputs and their gradients, more than the {available:,} bytes ({available / 1e9:,.1f} GB) {where}"
            )
    return problems


def run_kernels(ops: list[str] | None = None, preset: str = "small", on_start: Callable[[str], None] | None = None,
                on_op: Callable[[str, list[dict], float], None] | None = None,
                on_progress: Callable[[str, list[dict], float], None] | None = None):
    """Time the named ops (default: all of OPS) on `preset` shapes: a preset name or a SPEC (parse_shapes).
    Returns (rows, peaks, machine).

    on_start(line) is told what the run does before it starts (the no-CUDA fallback, the measured peaks);
    on_op(name, rows, seconds) gets each op's rows and its wall seconds as soon as that op is measured, in op order,
    so a caller can show and save them before the next op runs; on_progress(name, rows, seconds) the rows an op has
    measured so far, a prefix of its final rows, from the ops that time several shapes or cases (RunContext.report).
    Raises ValueError before anything is allocated for unknown ops, a bad SPEC, or one larger than the memory here
    (memory_problems).
    """
    names = list(OPS) if ops is None else ops
    unknown = [name for name in names if name not in OPS]
    if unknown:
        raise ValueError(f"ops ({', '.join(map(repr, unknown))}) must name registered ops: {', '.join(OPS)}")
    shapes = parse_shapes(preset, names)
    is_cuda = torch.cuda.is_available()
    too_large = memory_problems(preset, shapes, is_cuda=is_cuda)
    if too_large:
        raise ValueError("; ".join(too_large))
    say = on_start or (lambda line: None)
    peaks = Peaks()
    if is_cuda:
        peaks = measure_peaks()
        say(f"measured peaks: bf16 GEMM {peaks.tflops:.0f} TFLOP/s, device copy {peaks.copy_gb_per_s:.0f} GB/s")
    elif isinstance(shapes, dict):
        say("no CUDA device: timing the pure-PyTorch references on the given shapes (time.perf_counter medians)")
    else:
        say("no CUDA device: timing the pure-PyTorch references on small shapes (time.perf_counter medians)")
    run = RunContext(is_cuda=is_cuda, peaks=peaks, machine=machine_info(is_cuda))
    rows = []
    for name in names:
        # Wall seconds of the whole op (inputs, warm-up, every impl): where a run's time goes, not a result.
        start = time.perf_counter()
        if on_progress is not None:
            run.report = lambda op_rows, name=name, start=start: on_progress(name, op_rows, time.perf_counter() - start)
        op_rows = OPS[name](shapes[name] if isinstance(shapes, dict) else shapes, run)
        rows += op_rows
        if on_op is not None:
            on_op(name, op_rows, time.perf_counter() - start)
    return rows, peaks, run.machine


def write_rows(path: Path, rows: list[dict], is_complete: bool) -> None:
    """Write `rows` as --json does, each with COMPLETE_KEY: False while the run goes on, True once every op is
    measured. Atomic (a temporary file renamed over `path`), so a run stopped between two writes leaves the last."""
    write_atomically(path, json.dumps([dict(row, **{COMPLETE_KEY: is_complete}) for row in rows], indent=2))


def is_partial(rows: list[dict]) -> bool:
    """Whether saved rows come from a run stopped before its end: COMPLETE_KEY false, or no row at all (stopped before
    its first op); rows without the key are from a whole run."""
    return not rows or any(row.get(COMPLETE_KEY) is False for row in rows)


def read_baseline(path: Path, label: str = "--baseline") -> tuple[list[dict], list[str]]:
    """The rows of a saved --json run and one line per problem, each naming `label`, the file and, for a row, its
    number (from 1) and field: the file cannot be read or is not JSON, not a list of rows, a row lacks a text
    MATCH_KEYS field, or holds a TIMED_KEYS median that is neither null nor a finite number of milliseconds > 0."""
    where = f"{label} ({str(path)!r})"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        return [], [f"{where}: cannot read it ({err.strerror})"]
    except UnicodeDecodeError:
        return [], [f"{where}: not JSON (not UTF-8 text)"]
    except json.JSONDecodeError as err:
        return [], [f"{where}: not JSON ({err.msg}, line {err.lineno})"]
    except (RecursionError, ValueError) as err:
        # Nested past the recursion limit, or an integer literal longer than Python converts.
        return [], [f"{where}: not JSON ({type(err).__name__})"]
    if not isinstance(data, list) or not all(isinstance(row, dict) for row in data):
        return [], [f"{where} must be a list of rows as --json writes them"]
    problems = []
    for number, row in enumerate(data, 1):
        for key in MATCH_KEYS:
            if key not in row:
                problems.append(f"{where} row {number}: no {key} (a row names its {', '.join(MATCH_KEYS)})")
            elif not isinstance(row[key], str):
                problems.append(f"{where} row {number}: {key} ({row[key]!r}) must be text, as --json writes it")
        for key in TIMED_KEYS:
            value = row.get(key)
            if value is not None and not _is_median(value):
                problems.append(f"{where} row {number}: {key} ({value!r}) must be a finite number of milliseconds "
                                "> 0, or null (not measured)")  # fmt: skip
    return data, problems


def find_regressions(rows: list[dict], baseline: list[dict], tolerance: float = REGRESSION_TOLERANCE) -> list[str]:
    """One line per row and pass whose median is more than `tolerance` slower than the baseline row with the same
    op, case, impl and shape. Rows without a match, or without a timing on either side (None, or not a finite
    median > 0: no ratio to take), are skipped."""
    saved = {tuple(row.get(key) for key in MATCH_KEYS): row for row in baseline}
    lines = []
    for row in rows:
        before = saved.get(tuple(row[key] for key in MATCH_KEYS))
        if before is None:
            continue
        for key in TIMED_KEYS:
            now, then = row.get(key), before.get(key)
            if not (_is_median(now) and _is_median(then)) or now <= then * (1 + tolerance):
                continue
            name = " / ".join(str(row[key]) for key in MATCH_KEYS)
            lines.append(f"{name}: {key} {now:.3f} > {then:.3f} (+{now / then - 1:.0%}, limit +{tolerance:.0%})")
    return lines


def _is_median(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
