"""The kernel benchmark behind `moe-tune profile --kernels`: one registry of ops, one row format, one baseline check.

Adding an op is one entry in OPS: a name mapped to a function `(preset, run) -> list[dict]` that returns rows with
ROW_KEYS (missing timings are None, `note` says why). `run` is the RunContext: device, measured peaks, the timer
and a cache that entries sharing one bench call (gated_delta_rule and kda) use.

On CUDA the MoE and linear attention entries call the per-op benches (ops/moe/bench.py, ops/linear_attention/bench.py:
kernel, reference and the external baselines, medians of triton.testing.do_bench) and add peak memory and the
fraction of the peaks measured at start (a large bf16 GEMM, a large device copy). Without CUDA every entry times
its pure-PyTorch reference on the small shapes with time.perf_counter medians; peak fraction and memory are None.

Shapes: N tokens, D model dim, F expert hidden dim, E experts, k experts per token; B batch, T tokens, H (kv) heads,
HQ query heads, K key dim, V value dim, S selected keys per query.
"""

from __future__ import annotations

import datetime
import platform
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

PRESETS = ("small", "anchor")
# A row got slower than the baseline when its median exceeds the saved one by more than this fraction.
REGRESSION_TOLERANCE = 0.10
TIMED_KEYS = ("fwd_ms", "fwd_bwd_ms")
# Every row has these keys; a timing that could not be taken is None and `note` says why.
ROW_KEYS = (
    "op", "case", "impl", "shape", "dtype",
    "fwd_ms", "fwd_bwd_ms", "fwd_tflops", "fwd_bwd_tflops", "fwd_peak_fraction", "fwd_bwd_peak_fraction",
    "peak_memory_bytes", "note",
    "device", "machine", "torch", "triton", "commit", "date",
)  # fmt: skip
MATCH_KEYS = ("op", "case", "impl", "shape")

# CPU timing: one warm-up call, then repeats until this much time is spent (at least MIN, at most MAX repeats), so
# that `--shapes small` stays within a few seconds in all on 2 busy cores.
CPU_WARMUP_CALLS = 1
CPU_TIME_BUDGET_S = 0.1
CPU_MIN_REPEATS = 3
CPU_MAX_REPEATS = 20
# Peak probes: an 8192^3 bf16 GEMM saturates the tensor cores of an H100/H200; a 1 GiB copy is far past L2.
PEAK_GEMM_SIZE = 8192
PEAK_COPY_BYTES = 2**30

# Small shapes run on a CPU in well under a second per pass; anchor shapes are those of docs/PERF.md.
MOE_SHAPES = {
    "small": [dict(N=128, D=64, F=32, E=4, k=2, routing="uniform", lora_rank=0)],
    # None: ops/moe/bench.py's DEFAULT_SHAPES (issue 7's targets).
    "anchor": None,
}
LINEAR_ATTENTION_SHAPES = {
    "small": dict(batch_size=1, seq_len=128, num_heads=2, head_dim_k=64, head_dim_v=64, num_docs=4),
    # None: ops/linear_attention/bench.py's ANCHOR_SHAPE with its 8 documents.
    "anchor": None,
}
SPARSE_ATTENTION_SHAPES = {
    "small": dict(B=1, T=128, HQ=4, H=1, K=32, V=32, S=32),
    "anchor": dict(B=1, T=8192, HQ=16, H=1, K=128, V=128, S=2048),
}
# Softmax attention backward FLOPs over forward, as FlashAttention reports (same factor as the linear attention bench).
ATTENTION_BWD_FLOP_FACTOR = 2.5
SPARSE_NOTE = "reference only: no sparse attention kernel exists yet (dense masked softmax in fp32)"


@dataclass
class Peaks:
    """What this machine reaches: bf16 GEMM TFLOP/s and device copy GB/s (None without CUDA)."""

    tflops: float | None = None
    copy_gb_per_s: float | None = None


@dataclass
class RunContext:
    is_cuda: bool
    peaks: Peaks
    machine: dict
    cache: dict = field(default_factory=dict)


def machine_info(is_cuda: bool) -> dict:
    """The machine, versions, commit and UTC date every row carries."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    from moe_tune.ops.moe.bench import _commit

    if is_cuda:
        machine = torch.cuda.get_device_name()
    else:
        machine = f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"
    return dict(
        device="cuda" if is_cuda else "cpu",
        machine=machine,
        torch=torch.__version__,
        triton=triton_version,
        commit=_commit(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )


def measure_peaks() -> Peaks:
    """Median bf16 GEMM TFLOP/s and device copy GB/s of the current CUDA device."""
    from triton.testing import do_bench

    n = PEAK_GEMM_SIZE
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    gemm_ms = do_bench(lambda: a @ b, return_mode="median")
    src = torch.randn(PEAK_COPY_BYTES // 4, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    del a, b, src, dst
    torch.cuda.empty_cache()
    # A copy reads and writes every byte.
    return Peaks(tflops=2 * n**3 / gemm_ms * 1e-9, copy_gb_per_s=2 * PEAK_COPY_BYTES / copy_ms * 1e-6)


def time_ms(fn: Callable[[], torch.Tensor], leaves: list[torch.Tensor], with_backward: bool, is_cuda: bool):
    """(median ms, peak bytes or None) of fn() (autograd recording), or of fn() and a backward from a random grad."""
    with torch.no_grad():
        out = fn()
    grad_out = torch.randn_like(out)

    def step() -> None:
        y = fn()
        if with_backward:
            y.backward(grad_out)

    if is_cuda:
        from triton.testing import do_bench

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        ms = do_bench(step, grad_to_none=leaves, return_mode="median")
        return ms, torch.cuda.max_memory_allocated()
    for _ in range(CPU_WARMUP_CALLS):
        step()
    times, spent = [], 0.0
    while len(times) < CPU_MIN_REPEATS or (spent < CPU_TIME_BUDGET_S and len(times) < CPU_MAX_REPEATS):
        for leaf in leaves:
            leaf.grad = None
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
        spent += times[-1] * 1e-3
    return statistics.median(times), None


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


def bench_moe_op(preset: str, run: RunContext) -> list[dict]:
    """MoE expert MLP. CUDA: ops/moe/bench.py's triton, reference and torch _grouped_mm rows; CPU: the reference."""
    from moe_tune.ops.moe.bench import DEFAULT_SHAPES, bench_moe

    shapes = MOE_SHAPES[preset] or DEFAULT_SHAPES
    rows = []
    if run.is_cuda:
        # One bench_moe call per shape, so peak memory is that of the shape (the largest of its impls).
        for shape in shapes:
            torch.cuda.reset_peak_memory_stats()
            results = bench_moe([shape])
            peak = torch.cuda.max_memory_allocated()
            rows += [_moe_row(result, run, peak) for result in results]
        return rows
    from moe_tune.ops.moe.reference import moe_mlp_ref

    gen = torch.Generator().manual_seed(0)
    for shape in MOE_SHAPES["small"]:
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
    return shape["routing"] + (f" lora r{rank}" if rank else "")


def _moe_shape(shape: dict) -> str:
    return " ".join(f"{name}{shape[name]}" for name in ("N", "D", "F", "E", "k"))


def _moe_row(result: dict, run: RunContext, peak: int) -> dict:
    notes = [f"max/mean expert load {result['max_over_mean_load']:.1f}"]
    if "rel_error" in result:
        notes.append(f"rel err {result['rel_error']:.1e}" + ("" if result["correct"] else " WRONG"))
    if "error" in result:
        notes.append(f"refused: {result['error']}")
    if result["lora_rank"] and not result["train_base"]:
        notes.append("expert weights frozen")
    values = {key: result.get(key) for key in ("fwd_ms", "fwd_bwd_ms", "fwd_tflops", "fwd_bwd_tflops")}
    return make_row("moe", _moe_case(result), result["impl"], _moe_shape(result), result["dtype"], run,
                    peak_memory_bytes=peak, note="; ".join(notes), **values)  # fmt: skip


def _linear_attention_cuda_rows(preset: str, run: RunContext) -> list[dict]:
    """bench_linear_attention's rows, run once per harness run for both entries (gdn, kda and varlen cases)."""
    if "linear_attention" not in run.cache:
        from moe_tune.ops.linear_attention.bench import bench_linear_attention

        torch.cuda.reset_peak_memory_stats()
        run.cache["linear_attention"] = (bench_linear_attention(**(LINEAR_ATTENTION_SHAPES[preset] or {})),
                                         torch.cuda.max_memory_allocated())  # fmt: skip
    return run.cache["linear_attention"]


def _linear_attention_op(op: str, cases: tuple[str, ...], is_per_channel: bool):
    def bench(preset: str, run: RunContext) -> list[dict]:
        if run.is_cuda:
            results, peak = _linear_attention_cuda_rows(preset, run)
            rows = []
            for result in results:
                if result["case"] not in cases:
                    continue
                notes = [result["note"]] if result.get("note") else []
                if result.get("max_abs_err") is not None:
                    notes.insert(0, f"max abs err {result['max_abs_err']:.1e}")
                # One bench call covers every linear attention row: its peak bounds each of them.
                notes.append("peak memory of the whole linear attention bench")
                values = {key: result.get(key) for key in ("fwd_ms", "fwd_bwd_ms", "fwd_tflops", "fwd_bwd_tflops")}
                rows.append(make_row(op, result["case"], result["impl"], result["shape"], result["dtype"], run,
                                     peak_memory_bytes=peak, note="; ".join(notes), **values))  # fmt: skip
            return rows
        return [_linear_attention_cpu_row(op, cases[0], is_per_channel, run)]

    return bench


def _linear_attention_cpu_row(op: str, case: str, is_per_channel: bool, run: RunContext) -> dict:
    from moe_tune.ops.linear_attention.bench import LINEAR_BWD_FLOP_FACTOR, _chunk_flops
    from moe_tune.ops.linear_attention.reference import DEFAULT_CHUNK_SIZE, chunk_gated_delta_rule_ref

    shape = LINEAR_ATTENTION_SHAPES["small"]
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
    flops = _chunk_flops(H, K, V, num_chunks=B * -(-T // DEFAULT_CHUNK_SIZE))
    return make_row(op, case, "moe_tune chunk reference (torch small ops)", f"B{B} T{T} H{H} K{K} V{V}",
                    torch.float32, run, fwd_flops=flops, bwd_flop_factor=LINEAR_BWD_FLOP_FACTOR, **timed)  # fmt: skip


def bench_sparse_attention_op(preset: str, run: RunContext) -> list[dict]:
    """Top-k sparse attention: the reference only (no kernel yet), each query over S random causal keys."""
    from moe_tune.ops.sparse_attention.reference import sparse_attention_ref

    device, dtype = ("cuda", torch.bfloat16) if run.is_cuda else ("cpu", torch.float32)
    shape = SPARSE_ATTENTION_SHAPES[preset if run.is_cuda else "small"]
    B, T, HQ, H, K, V, S = (shape[name] for name in ("B", "T", "HQ", "H", "K", "V", "S"))
    gen = torch.Generator(device=device).manual_seed(0)
    q = _randn(B, T, HQ, K, gen=gen, device=device, dtype=dtype)
    k = _randn(B, T, H, K, gen=gen, device=device, dtype=dtype)
    v = _randn(B, T, H, V, gen=gen, device=device, dtype=dtype)
    # Query t selects S of its t + 1 causal keys (repeats allowed; queries with t < S see fewer distinct keys).
    positions_T1 = torch.arange(T, device=device)[:, None]
    indices = (torch.rand(B, T, S, generator=gen, device=device) * (positions_T1 + 1)).long()
    timed = _timed(lambda: sparse_attention_ref(q, k, v, indices), [q, k, v], run)
    # Useful work only: q k^T and p v over the S selected keys per query and head.
    flops = 2.0 * B * HQ * T * S * (K + V)
    return [make_row("sparse_attention", "token top-k", "reference (dense masked, fp32)",
                     f"B{B} T{T} HQ{HQ} H{H} K{K} V{V} S{S}", dtype, run, fwd_flops=flops,
                     bwd_flop_factor=ATTENTION_BWD_FLOP_FACTOR, note=SPARSE_NOTE, **timed)]  # fmt: skip


# name -> function(preset, run) -> rows. Adding an op is one entry here.
OPS: dict[str, Callable[[str, RunContext], list[dict]]] = {
    "moe": bench_moe_op,
    "gated_delta_rule": _linear_attention_op("gated_delta_rule", ("gdn", "varlen"), is_per_channel=False),
    "kda": _linear_attention_op("kda", ("kda",), is_per_channel=True),
    "sparse_attention": bench_sparse_attention_op,
}


def run_kernels(ops: list[str] | None = None, preset: str = "small", on_start: Callable[[str], None] | None = None):
    """Time the named ops (default: all of OPS) on `preset` shapes. Returns (rows, peaks, machine).

    on_start(line) is told what the run does before it starts (the no-CUDA fallback, the measured peaks).
    """
    if preset not in PRESETS:
        raise ValueError(f"shapes ({preset!r}) must be one of {', '.join(PRESETS)}")
    names = list(OPS) if ops is None else ops
    unknown = [name for name in names if name not in OPS]
    if unknown:
        raise ValueError(f"ops ({', '.join(map(repr, unknown))}) must name registered ops: {', '.join(OPS)}")
    say = on_start or (lambda line: None)
    is_cuda = torch.cuda.is_available()
    peaks = Peaks()
    if is_cuda:
        peaks = measure_peaks()
        say(f"measured peaks: bf16 GEMM {peaks.tflops:.0f} TFLOP/s, device copy {peaks.copy_gb_per_s:.0f} GB/s")
    else:
        say("no CUDA device: timing the pure-PyTorch references on small shapes (time.perf_counter medians)")
    run = RunContext(is_cuda=is_cuda, peaks=peaks, machine=machine_info(is_cuda))
    rows = []
    for name in names:
        rows += OPS[name](preset, run)
    return rows, peaks, run.machine


def find_regressions(rows: list[dict], baseline: list[dict], tolerance: float = REGRESSION_TOLERANCE) -> list[str]:
    """One line per row and pass whose median is more than `tolerance` slower than the baseline row with the same
    op, case, impl and shape. Rows without a match, or without a timing on either side, are skipped."""
    saved = {tuple(row.get(key) for key in MATCH_KEYS): row for row in baseline}
    lines = []
    for row in rows:
        before = saved.get(tuple(row[key] for key in MATCH_KEYS))
        if before is None:
            continue
        for key in TIMED_KEYS:
            now, then = row.get(key), before.get(key)
            if now is None or then is None or now <= then * (1 + tolerance):
                continue
            name = " / ".join(str(row[key]) for key in MATCH_KEYS)
            lines.append(f"{name}: {key} {now:.3f} > {then:.3f} (+{now / then - 1:.0%}, limit +{tolerance:.0%})")
    return lines
