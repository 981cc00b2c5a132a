"""Launch configs of the gated delta rule and KDA kernels against each other, and where their training pass spends
its kernel time beside FLA's, on one CUDA device (docs/perf-history.md, "Chunked linear attention").

    python -m moe_tune.engine.bench.linear_attention_sweep OUT.json [--ops gdn,kda] [--rounds N] [--no-breakdown]
        [--candidate FIELD=VALUE[,FIELD=VALUE...] ...]

Sweep: every candidate of `sweep_candidates` (KernelConfig fields over pick_config's choice; the first candidate is
pick_config's own), or pick_config's and those named by `--candidate`, runs the op's forward and backward as the
model calls it (the forward's passes kept for backward) at the anchor shape. Each candidate is first checked
against the fp32 chunk reference on two documents of odd lengths in one row (CHECK_SHAPE: the output and every
input gradient, relative RMS error; the reference at the anchor shape would need tens of GB for KDA) and then timed (median of triton.testing.do_bench) in
`rounds` turns over all candidates, so a drift of the machine reaches every candidate alike; a candidate's spread
over the turns says what a difference must exceed to count.
Breakdown: the kernel time of one forward and backward, per kernel name, of ours and of FLA's chunk op (when FLA is
importable), from torch.profiler over a few passes after a warm-up.

The JSON holds {machine, shape, sweep: [rows], breakdown: [rows], complete}, written after each candidate's check,
each turn and each profile (a run stopped midway, by a time limit or a crash, keeps what it measured) and after
every op.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from moe_tune.engine.bench.arguments import OneLineParser, positive_int
from moe_tune.engine.bench.linear_attention_op import ANCHOR_SHAPE, fla_op_for, make_inputs
from moe_tune.engine.bench.machine import machine_info
from moe_tune.engine.bench.timing import median_ms
from moe_tune.engine.train.checkpoint import write_json_atomic

OPS = ("gdn", "kda")
# A candidate is wrong when one of its tensors' relative RMS error against the fp32 reference exceeds the larger
# of this and WRONG_FACTOR times pick_config's error on the same tensor (bf16 rounding; tests/gpu's table).
WRONG_REL_RMS = 2e-2
WRONG_FACTOR = 1.5
ROUNDS = 3
SWEEP_REP_MS = 100
BREAKDOWN_PASSES = 5
CANDIDATE_PROFILE_PASSES = 3
GRAD_NAMES = ("q", "k", "v", "g", "beta")
# The candidates' check: two documents of odd lengths (neither a multiple of the 64-token chunk) in one row, with
# the anchor's heads and head dims, so that the check and the timing launch the same compiled kernels.
CHECK_SHAPE = dict(batch_size=1, seq_len=3001, num_heads=16, head_dim_k=128, head_dim_v=128)
CHECK_DOCUMENTS = (0, 1237, 3001)

def sweep_candidates(op: str) -> list[dict]:
    """KernelConfig overrides to try for op ("gdn" per-head decay, "kda" per-channel), the first ({}) being
    pick_config's choice. Each varies the launch of the kernels the training pass runs: the reverse serial pass
    (block_v_state, num_stages_state, num_warps), the per-chunk gradient kernels
    (block_v_grad, num_warps_grad, num_stages; KDA's two gradient kernels' warps, and its products kernel in key tiles
    or whole, block_k_kda_grad_products), the forward's serial pass (block_v_state_fwd, its stages) and, per head,
    the output kernel's launch and the backward's split (split_grad_wy: the state part in the output kernel or in one
    of its own, grad_state_in_output; the WY kernel's key tiles and warps; where the norms' backward runs,
    grad_dq_norm_in_output and grad_wy_norm_one_pass). On Triton 3.6, whose pick_config launches the output kernel
    at 8 warps and 3 stages, the first output candidate differs from it in stages only."""
    common = [
        {},
        {"num_stages_state": 1},
        {"num_stages_state": 3},
        {"block_v_state": 16},
        {"block_v_state": 64},
        {"num_warps": 8},
        {"num_stages": 2},
        {"block_v_grad": 32},
        {"block_v_grad": 128},
    ]
    if op == "gdn":
        return [
            *common,
            {"num_warps_grad": 4},
            {"num_warps_grad": 16},
            {"block_v_state_fwd": (32, 16)},
            {"num_stages_state_fwd": 3},
            # The per-head output kernel: on Triton 3.7 pick_config launches it at 4 warps and 1 stage
            # (kernels_common.TRITON_37_OUTPUT_LAUNCH; 8 warps and 3 stages computed o wrong there).
            {"num_warps_output": 8, "num_stages_output": 2},
            {"num_warps_output": 4, "num_stages_output": 2},
            # pick_config's per-head backward (kernels_common.GPU_SPLIT_GRAD_WY) against the one WY kernel, the state
            # part in a kernel of its own (at the gradient kernels' 8 warps or 4), the state part in the output kernel
            # in key tiles of 64, the WY kernel's key tiles at the gradient kernels' warps, and the output kernel at
            # 16 warps. Where the norms' backward runs: pick_config takes dq's in the output kernel and dk's in the WY
            # kernel's dk loop (kernels_common.GPU_GRAD_NORMS); each of them back in the WY kernel's fp32 loops. The
            # output kernel's stack a thread (sm_90, bf16 K = V = 128, Triton 3.6; engine/bench/kernel_compile.py):
            # 120 bytes with dq's norm, 64 without, 192 at 16 warps.
            {"grad_dq_norm_in_output": False},
            {"grad_wy_norm_one_pass": False},
            {"grad_wy_norm_one_pass": False, "grad_dq_norm_in_output": False},
            {"num_warps_grad_output": 16},
            {"split_grad_wy": False},
            {"grad_state_in_output": False},
            {"grad_state_in_output": False, "num_warps_grad_state": 4},
            {"block_k_grad_output": 64},
            {"num_warps_grad_wy": None},
        ]
    if op == "kda":
        return [
            *common,
            {"num_warps_kda_grad_wy": 16},
            {"num_warps_kda_grad_products": 4},
            # The products kernel in pick_config's key tiles of 64 (88 bytes of stack a thread at 8 warps, sm_90)
            # against tiles of 32 (none) and the whole K (608 bytes; kernels_common.MAX_WARPS_KDA_PRODUCTS_TILED: at
            # most 8 warps in key tiles).
            {"block_k_kda_grad_products": 32},
            {"block_k_kda_grad_products": None},
            {"block_k_kda_grad_products": None, "num_warps_kda_grad_products": 16},
            {"num_stages_state_fwd_kda": 2},
        ]
    raise ValueError(f"op {op!r}: must be one of {', '.join(OPS)}")


def relative_errors(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> dict[str, float]:
    """||actual - expected|| / ||expected|| per name, in fp32 (inf where expected is all zeros and actual is not,
    NaN where actual has a NaN)."""
    errors = {}
    for name, ref in expected.items():
        diff = torch.linalg.vector_norm(actual[name].float() - ref.float()).item()
        scale = torch.linalg.vector_norm(ref.float()).item()
        errors[name] = diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))
    return errors


def wrong_tensors(errors: dict[str, float], default_errors: dict[str, float]) -> list[str]:
    """The names whose error breaks the sweep's rule (module constants): NaN, or above both WRONG_REL_RMS and
    WRONG_FACTOR times pick_config's error."""
    return [
        name
        for name, err in errors.items()
        if not err <= max(WRONG_REL_RMS, WRONG_FACTOR * default_errors.get(name, 0.0))
    ]


def check_candidate(row: dict, errors_of: Callable[[], dict[str, float]], default_errors: dict[str, float] | None
                    ) -> dict[str, float] | None:  # fmt: skip
    """A candidate's check into its row: `errors` and `wrong` (wrong_tensors against default_errors, the default
    candidate's own errors when None: it is the default), or `error` where it does not compile or launch here.
    Returns its errors, None after an error."""
    from triton.errors import TritonError

    try:
        errors = errors_of()
    except (RuntimeError, ValueError, TritonError) as err:
        row["error"] = f"{type(err).__name__}: {err}".splitlines()[0]
        return None
    row["errors"] = {name: float(f"{err:.3e}") for name, err in errors.items()}
    row["wrong"] = wrong_tensors(errors, errors if default_errors is None else default_errors)
    return errors


def summarize_timings(times_ms: list[float]) -> dict[str, float]:
    """{ms: the median over turns, spread_ms: max - min} of one candidate's timings."""
    return {"ms": round(statistics.median(times_ms), 4), "spread_ms": round(max(times_ms) - min(times_ms), 4)}


def kernel_totals(events: Iterable[tuple[str, float]], passes: int) -> list[dict]:
    """(kernel name, microseconds) device events of `passes` profiled passes -> rows {kernel, calls, ms} per pass,
    the longest first; calls per pass may be fractional where a kernel ran in some passes only."""
    total_us: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for name, us in events:
        total_us[name] += us
        calls[name] += 1
    rows = [
        {"kernel": name, "calls": calls[name] / passes, "ms": round(total_us[name] / passes / 1e3, 4)}
        for name in total_us
    ]
    return sorted(rows, key=lambda row: -row["ms"])


def ours(**inputs) -> torch.Tensor:
    """The op's output as the model's layers call it (the shape of g picks the variant): passes kept for backward."""
    from moe_tune.ops.linear_attention.autograd import gated_delta_rule_kernel

    return gated_delta_rule_kernel(**inputs, use_qk_l2norm=True, save_intermediates=True)[0]


def _outputs(fn: Callable, inputs: dict, grad_out: torch.Tensor) -> dict[str, torch.Tensor]:
    """The output and every input gradient of one forward and backward."""
    for name in GRAD_NAMES:
        inputs[name].grad = None
    o = fn(**inputs)
    o.backward(grad_out)
    result = {"o": o.detach().clone()}
    result.update({f"d{name}": inputs[name].grad.clone() for name in GRAD_NAMES})
    for name in GRAD_NAMES:
        inputs[name].grad = None
    return result


def _reference_outputs(inputs: dict, grad_out: torch.Tensor) -> dict[str, torch.Tensor]:
    from moe_tune.ops.linear_attention.reference import chunk_gated_delta_rule_ref

    fp32 = {
        name: x.detach().float().requires_grad_() if x.is_floating_point() else x for name, x in inputs.items()
    }

    def reference(**kwargs):
        return chunk_gated_delta_rule_ref(**kwargs, use_qk_l2norm=True)[0]

    return _outputs(reference, fp32, grad_out.float())


def sweep_op(op: str, shape: dict | None = None, rounds: int = ROUNDS, rep_ms: int = SWEEP_REP_MS,
             candidates: list[dict] | None = None, progress: Callable[[list[dict]], None] = lambda rows: None
             ) -> list[dict]:  # fmt: skip
    """Rows {op, config (the overrides), errors, wrong, ms, spread_ms, times_ms, vs_default, kernels_ms (each
    kernel's time in one pass, from CANDIDATE_PROFILE_PASSES profiled passes)} per candidate, or
    {op, config, error} where a candidate does not compile or launch on this device (module docstring); checked at
    CHECK_SHAPE, timed at shape. `progress` gets the rows so far after each candidate's check, after each turn
    (timings of the turns so far) and after each candidate's profile: a run stopped midway keeps them."""
    from moe_tune.ops.linear_attention.kernels_common import pick_config

    shape = dict(ANCHOR_SHAPE if shape is None else shape)
    candidates = sweep_candidates(op) if candidates is None else candidates
    check_inputs = _shape_inputs(CHECK_SHAPE, op)
    check_inputs["cu_seqlens"] = torch.tensor(CHECK_DOCUMENTS, dtype=torch.int32, device=check_inputs["q"].device)
    check_grad = torch.randn_like(check_inputs["v"])
    expected = _reference_outputs(check_inputs, check_grad)
    inputs = _shape_inputs(shape, op)
    leaves = [inputs[name] for name in GRAD_NAMES]
    grad_out = torch.randn_like(inputs["v"])
    base = pick_config(inputs["q"])
    rows: list[dict] = []
    steps: list[Callable[[], None] | None] = []
    default_errors: dict[str, float] = {}
    for overrides in candidates:
        config = dataclasses.replace(base, **overrides)
        row = {"op": op, "config": {k: list(v) if isinstance(v, tuple) else v for k, v in overrides.items()}}

        def errors_of(config=config) -> dict[str, float]:
            with launched_with(config):
                return relative_errors(_outputs(ours, check_inputs, check_grad), expected)

        errors = check_candidate(row, errors_of, None if not overrides else default_errors)
        if not overrides and errors is not None:
            default_errors = errors
        rows.append(row)
        steps.append(None if errors is None or row["wrong"] else _step(ours, config, inputs, grad_out))
        progress(rows)
    times: list[list[float]] = [[] for _ in rows]
    for _ in range(rounds):
        for i, step in enumerate(steps):
            if step is not None:
                times[i].append(median_ms(step, leaves, rep_ms=rep_ms))
        _summarize(rows, times)
        progress(rows)
    for row, step in zip(rows, steps):
        if "ms" in row:
            # Which kernels the launch moved: each kernel's time in one pass.
            row["kernels_ms"] = {k["kernel"]: k["ms"] for k in profiled_kernels(step, CANDIDATE_PROFILE_PASSES)}
            progress(rows)
    default_kernels = rows[0].get("kernels_ms") if rows else None
    for row in rows[1:]:
        if default_kernels and "kernels_ms" in row:
            row["moved"] = largest_kernel_change(default_kernels, row["kernels_ms"])
    return rows


def _summarize(rows: list[dict], times: list[list[float]]) -> None:
    """The timings of the turns so far into the rows: ms, spread_ms, times_ms and vs_default (against the first)."""
    for row, row_times in zip(rows, times):
        if row_times:
            row.update(summarize_timings(row_times), times_ms=[round(t, 4) for t in row_times])
    default_ms = rows[0].get("ms") if rows else None
    for row in rows:
        if default_ms and "ms" in row:
            row["vs_default"] = round(row["ms"] / default_ms, 4)


def largest_kernel_change(before: dict[str, float], after: dict[str, float]) -> str:
    """The kernel whose time per pass changed most between two profiles, as `name +0.123 ms` (a kernel in one
    profile only counts from or to zero)."""
    changes = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in {*before, *after}}
    name = max(sorted(changes), key=lambda kernel: abs(changes[kernel]))
    return f"{name} {changes[name]:+.3f} ms"


def _shape_inputs(shape: dict, op: str) -> dict[str, torch.Tensor]:
    return make_inputs(
        shape["batch_size"], shape["seq_len"], shape["num_heads"], shape["head_dim_k"], shape["head_dim_v"],
        torch.bfloat16, is_per_channel=op == "kda",
    )  # fmt: skip


@contextmanager
def launched_with(config) -> Iterator[None]:
    """Within the block the op's kernels launch under config: pick_config, as the autograd function reads it in
    forward and in backward, answers config."""
    import moe_tune.ops.linear_attention.autograd as autograd

    chosen = autograd.pick_config
    autograd.pick_config = lambda _x: config
    try:
        yield
    finally:
        autograd.pick_config = chosen


def _step(fn: Callable, config, inputs: dict, grad_out: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        for name in GRAD_NAMES:
            inputs[name].grad = None
        with launched_with(config):
            fn(**inputs).backward(grad_out)

    return step


def breakdown_op(op: str, shape: dict | None = None, passes: int = BREAKDOWN_PASSES) -> list[dict]:
    """Rows {op, impl, kernel, calls, ms} of one forward and backward: ours (passes kept) and FLA's chunk op."""
    shape = dict(ANCHOR_SHAPE if shape is None else shape)
    inputs = _shape_inputs(shape, op)
    grad_out = torch.randn_like(inputs["v"])
    impls = [("moe_tune triton", ours)]
    fla_name, fla_op = fla_op_for(op)
    if fla_op is not None:
        impls.append((f"fla {fla_name}", lambda fla_op=fla_op, **kw: fla_op(**kw, use_qk_l2norm_in_kernel=True)[0]))
    rows = []
    for impl, fn in impls:

        def one_pass(fn=fn) -> None:
            # Nothing copied out: the profile holds the op's kernels alone.
            for name in GRAD_NAMES:
                inputs[name].grad = None
            fn(**inputs).backward(grad_out)

        try:
            kernels = profiled_kernels(one_pass, passes)
        except Exception as error:  # noqa: BLE001 - a library that refuses to run is a result, not a crash
            rows.append({"op": op, "impl": impl, "error": f"{type(error).__name__}: {error}".splitlines()[0][:200]})
            continue
        rows += [dict(row, op=op, impl=impl) for row in kernels]
    return rows


def profiled_kernels(one_pass: Callable[[], None], passes: int) -> list[dict]:
    """kernel_totals of `passes` calls of one_pass under torch.profiler (CUDA), after two warm-up calls."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        one_pass()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(passes):
            one_pass()
        torch.cuda.synchronize()
    events = [
        (e.name(), e.duration_ns() / 1e3)
        for e in prof.profiler.kineto_results.events()
        if e.device_type() != DeviceType.CPU
    ]
    return kernel_totals(events, passes)


def format_sweep(rows: list[dict]) -> str:
    lines = ["| op | config | fwd+bwd ms (median of turns) | spread | vs pick_config | kernel moved most | "
             "wrong / error |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in rows:
        config = ", ".join(f"{k}={v}" for k, v in row["config"].items()) or "pick_config"
        problem = row.get("error") or ", ".join(row.get("wrong", []))
        lines.append(f"| {row['op']} | {config} | {row.get('ms', '')} | {row.get('spread_ms', '')} | "
                     f"{row.get('vs_default', '')} | {row.get('moved', '')} | {problem} |")  # fmt: skip
    return "\n".join(lines)


def format_breakdown(rows: list[dict]) -> str:
    lines = ["| op | impl | kernel | calls | ms |", "|---|---|---|---|---|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['op']} | {row['impl']} | {row['error']} | | |")
        else:
            lines.append(f"| {row['op']} | {row['impl']} | {row['kernel'][:80]} | {row['calls']:g} | {row['ms']} |")
    totals: dict[tuple[str, str], float] = defaultdict(float)
    for row in rows:
        totals[(row["op"], row["impl"])] += row.get("ms", 0.0)
    lines += [f"| {op} | {impl} | total | | {round(ms, 4)} |" for (op, impl), ms in totals.items()]
    return "\n".join(lines)


def parse_ops(text: str) -> list[str]:
    ops = text.split(",")
    bad = [op for op in ops if op not in OPS]
    if bad or len(set(ops)) != len(ops):
        raise argparse.ArgumentTypeError(f"{text!r}: must be distinct names from {', '.join(OPS)}")
    return ops


def parse_candidate(text: str) -> dict:
    """An argparse type: one candidate's KernelConfig overrides, FIELD=VALUE entries joined by commas (MOE_TUNE_LAUNCH's
    entries without their family, ops/common/launch.py)."""
    from moe_tune.ops.common.launch import LaunchError, parse_launch

    entries = [entry.strip() for entry in text.split(",")]
    if not all("=" in entry for entry in entries):
        raise argparse.ArgumentTypeError(f"{text!r}: must be FIELD=VALUE entries joined by commas")
    try:
        launch = parse_launch(",".join(f"linear_attention.{entry}" for entry in entries), source="--candidate")
    except LaunchError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return launch["linear_attention"]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = OneLineParser(prog="python -m moe_tune.engine.bench.linear_attention_sweep",
                     description=__doc__.split("\n\n")[0])  # fmt: skip
    parser.add_argument("out", type=Path, help="the JSON to write (rows so far after every op)")
    parser.add_argument("--ops", type=parse_ops, default=list(OPS), help="comma-separated: gdn, kda")
    parser.add_argument("--rounds", type=positive_int, default=ROUNDS, help="timing turns over all candidates")
    parser.add_argument("--no-breakdown", action="store_true", help="skip the per-kernel profile")
    parser.add_argument("--candidate", type=parse_candidate, action="append", default=[],
                        help="time pick_config's launch and this one (repeatable), not sweep_candidates")
    args = parser.parse_args(argv)
    named = [sorted(candidate.items()) for candidate in args.candidate]
    if any(named.count(candidate) > 1 for candidate in named):
        parser.error("argument --candidate: each must differ from the others")
    return args


def check_output_and_device(out: Path) -> None:
    """One line and exit 2 where the JSON cannot go to `out` (a missing folder, a folder) or no CUDA device is here."""
    if out.parent != Path("") and not out.parent.is_dir():
        print(f"{out}: its folder does not exist", file=sys.stderr)
        raise SystemExit(2)
    if out.is_dir():
        print(f"{out}: is a folder; the results go into a JSON file", file=sys.stderr)
        raise SystemExit(2)
    if not torch.cuda.is_available():
        print("needs a CUDA device: it times kernels", file=sys.stderr)
        raise SystemExit(2)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    check_output_and_device(args.out)
    result = {**machine_info(is_cuda=True), "shape": ANCHOR_SHAPE, "sweep": [], "breakdown": []}
    for op in args.ops:
        done = list(result["sweep"])

        def progress(rows: list[dict], done=done) -> None:
            write_json_atomic(args.out, dict(result, sweep=done + rows, complete=False))

        candidates = [{}, *args.candidate] if args.candidate else None
        result["sweep"] += sweep_op(op, rounds=args.rounds, candidates=candidates, progress=progress)
        if not args.no_breakdown:
            result["breakdown"] += breakdown_op(op)
        write_json_atomic(args.out, dict(result, complete=False))
        print(format_sweep([row for row in result["sweep"] if row["op"] == op]), flush=True)
        if not args.no_breakdown:
            print(format_breakdown([row for row in result["breakdown"] if row["op"] == op]), flush=True)
    write_json_atomic(args.out, dict(result, complete=True))


if __name__ == "__main__":
    main(sys.argv[1:])
