"""Launches of the causal conv kernels (ops/causal_conv: ConvLaunch) against each other at the hybrid's shape, on
one CUDA device (docs/bench.md, "Launch sweep").

    python -m moe_tune.engine.bench.causal_conv_sweep OUT.json [--rounds N]

Every candidate of `sweep_candidates` (ConvLaunch fields over pick_launch's; the first is pick_launch's own) runs
causal_conv_heads as bench-qwen3-next's gated delta nets call it: q, k [1, T, Hk K] and v [1, T, Hv V] (Hk 16,
Hv 32, K = V = 128, width 4) over one packed row of T 8192 tokens in 150-token documents, forward alone and forward
+ backward. Each candidate is first checked against the fp64 reference on a row of odd documents (CHECK_LENGTHS:
the outputs and every input gradient, relative RMS error, linear_attention_sweep's rule) and then timed (median of
triton.testing.do_bench) in `rounds` turns over all candidates. The best forward and the best backward (forward +
backward less forward) may come from different candidates: their fields together make one more candidate, checked
and timed beside pick_launch's for as many turns. The launch applies to causal_conv too (one pick_launch).

The JSON holds {machine, shape, sweep: [rows], best_forward, best_backward, combined, complete}, written after each
candidate's check and each turn too (a run stopped midway keeps what it measured).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from moe_tune.engine.bench.arguments import OneLineParser, positive_int
from moe_tune.engine.bench.linear_attention_sweep import (
    check_candidate, check_output_and_device, relative_errors, summarize_timings,
)  # fmt: skip
from moe_tune.engine.bench.machine import machine_info
from moe_tune.engine.bench.timing import median_ms
from moe_tune.engine.train.checkpoint import write_json_atomic

ROUNDS = 3
SWEEP_REP_MS = 50
SHAPE = dict(tokens=8192, document=150, key_heads=16, value_heads=32, key_dim=128, value_dim=128, width=4)
# The check's row: documents of 1 and 63 tokens beside longer ones, 1000 tokens in all (no multiple of a tile).
CHECK_LENGTHS = (1, 63, 700, 5, 231)
FORWARD_FIELDS = ("block_t", "block_c", "num_warps")
NAMES = ("q", "k", "v", "dq", "dk", "dv", "dweight")


def sweep_candidates() -> list[dict]:
    """ConvLaunch overrides to try, the first ({}) pick_launch's: the forward's tile and warps, the two-pass
    backward's, and the one-pass backward's. sm_90 (ptxas, Triton 3.6): a forward of 64 x 128 at 4 warps takes 240
    registers a thread (two programs of 4 warps an SM) and a second backward pass of 64 x 128 255 and 72 bytes of
    stack; halving the elements a thread holds (32 tokens, 64 channels or 8 warps) halves the registers. The
    one-pass backward holds a tap's W loads of x and R of dy for each of W taps: at 64 x 128 and 4 warps 3 KB of
    stack, none at 16 x 128 or 32 x 64 (slower than the two-pass backward at every launch the H200 ran:
    docs/perf-history.md)."""
    forward = [
        {"block_t": 64},
        {"num_warps": 8},
        {"block_t": 64, "num_warps": 8},
        {"block_c": 64},
        {"block_t": 16},
        {"block_t": 128, "num_warps": 16},
    ]
    two_pass = [
        {"grad_block_c": 128},
        {"grad_block_t": 32},
        {"grad_block_c": 32},
        {"grad_num_warps": 8},
        {"grad_block_t": 128, "grad_num_warps": 8},
    ]
    one_pass = [
        {"grad_block_t": 32},
        {"grad_block_t": 16, "grad_block_c": 128},
        {"grad_block_t": 16},
    ]
    return [{}, *forward, *two_pass, *({"one_pass_backward": True, **fields} for fields in one_pass)]


def combine(best_forward: dict, best_backward: dict) -> dict:
    """The forward fields of one candidate's overrides with the backward fields of another's."""
    forward = {k: v for k, v in best_forward.items() if k in FORWARD_FIELDS}
    backward = {k: v for k, v in best_backward.items() if k not in FORWARD_FIELDS}
    return {**forward, **backward}


def best_rows(rows: list[dict]) -> tuple[dict | None, dict | None]:
    """The timed row with the shortest forward and the one with the shortest backward (fwd+bwd less fwd)."""
    timed = [row for row in rows if "fwd_ms" in row]
    if not timed:
        return None, None
    return min(timed, key=lambda row: row["fwd_ms"]), min(timed, key=lambda row: row["bwd_ms"])


@contextmanager
def launched_with(launch) -> Iterator[None]:
    """Within the block the conv's kernels launch under `launch`: pick_launch, as the autograd functions read it in
    forward (the backward reuses the forward's), answers it."""
    import moe_tune.ops.causal_conv.autograd as autograd

    chosen = autograd.pick_launch
    autograd.pick_launch = lambda _x: launch
    try:
        yield
    finally:
        autograd.pick_launch = chosen


def make_inputs(lengths: list[int], dtype: torch.dtype, device: str, seed: int = 0):
    """(q, k, v, weight) needing gradients, positions, and the three outputs' gradients for documents of lengths."""
    from moe_tune.engine.model.blocks import document_positions

    s = SHAPE
    gen = torch.Generator(device=device).manual_seed(seed)
    tokens = sum(lengths)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device)
    positions = document_positions(cu_seqlens, tokens)
    widths = (s["key_heads"] * s["key_dim"], s["key_heads"] * s["key_dim"], s["value_heads"] * s["value_dim"])
    q, k, v = (torch.randn(1, tokens, c, generator=gen, device=device).to(dtype).requires_grad_() for c in widths)
    weight = (torch.randn(sum(widths), s["width"], generator=gen, device=device) * 0.5).to(dtype).requires_grad_()
    dims = (s["key_dim"], s["key_dim"], s["value_dim"])
    grads = [torch.randn(1, tokens, s["value_heads"], d, generator=gen, device=device).to(dtype) for d in dims]
    return (q, k, v, weight), positions, grads


def _conv(inputs, positions):
    """The kernels, as the model's layers reach them (CausalConvHeadsFunction picks the launch)."""
    from moe_tune.ops.causal_conv.autograd import CausalConvHeadsFunction

    return CausalConvHeadsFunction.apply(*inputs, positions, 1, SHAPE["key_dim"], SHAPE["value_dim"])


def _reference(inputs, positions):
    from moe_tune.ops.causal_conv.reference import causal_conv_heads_ref

    return causal_conv_heads_ref(*inputs, positions, SHAPE["key_dim"], SHAPE["value_dim"])


def outputs(op: Callable, inputs, positions, grads) -> dict[str, torch.Tensor]:
    """op's three outputs and the gradients of q, k, v and the weight, by NAMES."""
    out = op(inputs, positions)
    input_grads = torch.autograd.grad(out, inputs, grads)
    return dict(zip(NAMES, (*(t.detach() for t in out), *input_grads), strict=True))


def _steps(launch, inputs, positions, grads) -> tuple[Callable[[], None], Callable[[], None]]:
    def forward() -> None:
        with launched_with(launch), torch.no_grad():
            _conv(inputs, positions)

    def forward_backward() -> None:
        with launched_with(launch):
            torch.autograd.backward(_conv(inputs, positions), grads)

    return forward, forward_backward


def sweep(candidates: list[dict], rounds: int = ROUNDS, rep_ms: int = SWEEP_REP_MS, device: str = "cuda",
          progress: Callable[[list[dict]], None] = lambda rows: None) -> list[dict]:  # fmt: skip
    """Rows {config (the overrides), errors, wrong, fwd_ms, fwd_bwd_ms, bwd_ms, spreads, vs_default} per candidate,
    or {config, error} where one does not compile or launch here; checked at CHECK_LENGTHS, timed at SHAPE (on the
    CPU the kernels run in Triton's interpreter: the tests' way through the sweep). `progress` gets the rows so far
    after each check and each turn (the turns' timings so far)."""
    from moe_tune.ops.causal_conv.kernels import pick_launch

    check_inputs, check_positions, check_grads = make_inputs(list(CHECK_LENGTHS), torch.bfloat16, device)
    as_fp64 = [t.detach().double().requires_grad_() for t in check_inputs]
    expected = outputs(_reference, as_fp64, check_positions, [g.double() for g in check_grads])
    tokens, document = SHAPE["tokens"], SHAPE["document"]
    lengths = [document] * (tokens // document) + ([tokens % document] if tokens % document else [])
    inputs, positions, grads = make_inputs(lengths, torch.bfloat16, device, seed=1)
    base = pick_launch(inputs[0])
    rows, steps, default_errors = [], [], {}
    for overrides in candidates:
        launch = dataclasses.replace(base, **overrides)
        row: dict = {"config": overrides}

        def errors_of(launch=launch) -> dict[str, float]:
            with launched_with(launch):
                return relative_errors(outputs(_conv, check_inputs, check_positions, check_grads), expected)

        errors = check_candidate(row, errors_of, None if not overrides else default_errors)
        if not overrides and errors is not None:
            default_errors = errors
        rows.append(row)
        steps.append(None if errors is None or row["wrong"] else _steps(launch, inputs, positions, grads))
        progress(rows)
    leaves = list(inputs)
    times: list[tuple[list[float], list[float]]] = [([], []) for _ in rows]
    for _ in range(rounds):
        for step, (fwd, both) in zip(steps, times, strict=True):
            if step is not None:
                fwd.append(median_ms(step[0], rep_ms=rep_ms))
                both.append(median_ms(step[1], leaves, rep_ms=rep_ms))
        _summarize(rows, times)
        progress(rows)
    return rows


def _summarize(rows: list[dict], times: list[tuple[list[float], list[float]]]) -> None:
    """The timings of the turns so far into the rows (forward, forward + backward, their spreads, vs_default)."""
    for row, (fwd, both) in zip(rows, times, strict=True):
        if both:
            f, b = summarize_timings(fwd), summarize_timings(both)
            row.update(fwd_ms=f["ms"], fwd_bwd_ms=b["ms"], bwd_ms=round(b["ms"] - f["ms"], 4),
                       fwd_spread_ms=f["spread_ms"], fwd_bwd_spread_ms=b["spread_ms"])  # fmt: skip
    default = rows[0] if rows and "fwd_bwd_ms" in rows[0] else None
    for row in rows:
        if default is not None and "fwd_bwd_ms" in row:
            row["vs_default"] = round(row["fwd_bwd_ms"] / default["fwd_bwd_ms"], 4)


def format_sweep(rows: list[dict]) -> str:
    lines = ["| config | fwd ms | fwd+bwd ms | bwd ms | spreads | vs pick_launch | wrong / error |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in rows:
        config = ", ".join(f"{k}={v}" for k, v in row["config"].items()) or "pick_launch"
        problem = row.get("error") or ", ".join(row.get("wrong", []))
        spreads = f"{row['fwd_spread_ms']} / {row['fwd_bwd_spread_ms']}" if "fwd_ms" in row else ""
        lines.append(f"| {config} | {row.get('fwd_ms', '')} | {row.get('fwd_bwd_ms', '')} | {row.get('bwd_ms', '')} "
                     f"| {spreads} | {row.get('vs_default', '')} | {problem} |")  # fmt: skip
    return "\n".join(lines)


def parse_args(argv: list[str]):
    parser = OneLineParser(prog="python -m moe_tune.engine.bench.causal_conv_sweep",
                           description=__doc__.split("\n\n")[0])  # fmt: skip
    parser.add_argument("out", type=Path, help="the JSON to write (after the sweep and after the combined launch)")
    parser.add_argument("--rounds", type=positive_int, default=ROUNDS, help="timing turns over all candidates")
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    check_output_and_device(args.out)
    result = {**machine_info(is_cuda=True), "shape": SHAPE, "check_lengths": list(CHECK_LENGTHS)}
    rows = sweep(sweep_candidates(), rounds=args.rounds,
                 progress=lambda rows: write_json_atomic(args.out, dict(result, sweep=rows, complete=False)))
    fastest_forward, fastest_backward = best_rows(rows)
    result.update(sweep=rows, best_forward=fastest_forward, best_backward=fastest_backward, combined=None)
    write_json_atomic(args.out, dict(result, complete=False))
    print(format_sweep(rows), flush=True)
    if fastest_forward is not None:
        combined = combine(fastest_forward["config"], fastest_backward["config"])
        if combined not in [row["config"] for row in rows]:
            # The combination beside pick_launch's, in turns of their own.
            result["combined"] = sweep([{}, combined], rounds=args.rounds)
            print(format_sweep(result["combined"]), flush=True)
    write_json_atomic(args.out, dict(result, complete=True))


if __name__ == "__main__":
    main(sys.argv[1:])
