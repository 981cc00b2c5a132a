"""Row length against throughput and memory on one GPU, per memory preset (docs/perf-history.md, "Selective
caching"; docs/memory.md): throughput and peak memory at one length, then every length of a ladder until one runs
out of memory.

    python -m moe_tune.engine.bench.memory_sweep OUT.json [PRESET] [--profile NAME] [--timed-length N]
        [--lengths N,N,...] [--rung-steps N] [--plot PNG] [--set a.b=v ...]

One preset per process (a clean allocator for each ladder); the JSON holds that preset's result (see
steps.sweep_lengths) and the pinned copy bandwidth of the machine; --plot draws tokens/s and peak memory against
the row length.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from moe_tune.engine.atomic_write import atomic_path
from moe_tune.engine.bench.arguments import OneLineParser, positive_int
from moe_tune.engine.bench.steps import pinned_copy_bandwidth, sweep_lengths
from moe_tune.engine.memory.policy import PRESETS
from moe_tune.engine.train.checkpoint import write_json_atomic
from moe_tune.profiles import ProfileError, load_profile

PROFILE = "bench-qwen3-next"
# Where throughput and peak memory are compared (every preset must fit there).
TIMED_LENGTH = 16384
TIMED_STEPS = 3
# The ladder climbs until a step runs out of memory.
LENGTHS = (32768, 49152, 65536, 98304, 131072, 196608, 262144)


def _lengths(text: str) -> list[int]:
    try:
        lengths = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: must be comma-separated integers") from None
    if not lengths or any(n <= 0 for n in lengths) or lengths != sorted(set(lengths)):
        raise argparse.ArgumentTypeError(f"{text!r}: must be positive and strictly ascending")
    return lengths


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = OneLineParser(prog="python -m moe_tune.engine.bench.memory_sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, metavar="OUT.json", help="where the preset's result is written")
    parser.add_argument("preset", nargs="?", default="none", choices=list(PRESETS), metavar="PRESET",
                        help=f"one of {', '.join(PRESETS)} (default: none)")
    parser.add_argument("--profile", default=PROFILE, metavar="NAME", help=f"the profile (default: {PROFILE})")
    parser.add_argument("--timed-length", type=positive_int, default=TIMED_LENGTH, metavar="N",
                        help=f"where throughput and peak are timed first (default: {TIMED_LENGTH})")
    parser.add_argument("--lengths", type=_lengths, default=list(LENGTHS), metavar="N,N,...",
                        help=f"the ladder, ascending (default: {','.join(map(str, LENGTHS))})")
    parser.add_argument("--rung-steps", type=positive_int, default=1, metavar="N",
                        help="steps at each length: tokens/s is the median after the first (default: 1)")
    parser.add_argument("--plot", type=Path, default=None, metavar="PNG",
                        help="draw tokens/s and peak memory against the row length (needs matplotlib)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="a.b=v",
                        help="override a profile field (repeatable)")
    # Intermixed: PRESET may come after the --set options.
    return parser.parse_intermixed_args(argv)


def _fail(*lines: str) -> None:
    for line in lines:
        print(f"python -m moe_tune.engine.bench.memory_sweep: {line}", file=sys.stderr)
    sys.exit(2)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    out, preset, overrides = args.out, args.preset, args.overrides
    try:
        # One row per step: the ladder sizes the row (the benchmark profiles train B2 rows of 4096).
        profile = load_profile(args.profile, ["train.micro_batch_size=1", f"memory.preset={preset}", *overrides])
    except ProfileError as err:
        _fail(*err.problems)
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        _fail(f"--plot ({str(args.plot)!r}) needs matplotlib, which is not installed")
    if not _has_cuda():
        # Peak memory and the pinned copy bandwidth are GPU measurements; on the CPU the ladder would say nothing.
        _fail("needs a CUDA device: it measures peak GPU memory and pinned copies")
    # Written after every measurement (complete: false until the end), so a run stopped by a time limit keeps
    # what it measured.
    def write(result: dict, is_complete: bool = False) -> None:
        write_json_atomic(out, dict(result, overrides=overrides, complete=is_complete))

    result = sweep_lengths(
        profile, args.lengths, args.timed_length, TIMED_STEPS, on_line=lambda line: print(line, flush=True),
        on_result=write, rung_steps=args.rung_steps,
    )
    h2d, d2h = pinned_copy_bandwidth()
    result.update(profile=args.profile, pinned_h2d_gb_per_s=h2d, pinned_d2h_gb_per_s=d2h)
    write(result, is_complete=True)
    if args.plot is not None:
        plot_ladder(result, args.plot)
    print(f"{preset}: max trained length {result['max_trained_length']}; pinned copy {h2d:.1f} / {d2h:.1f} GB/s")


def plot_ladder(result: dict, path: Path) -> None:
    """Tokens/s and peak GPU and host memory against the row length (log2 axis): the timed length and every trained
    rung."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [dict(result["timed"], seq_len=result["timed_length"])]
    rows += [rung for rung in result["ladder"] if rung["outcome"] == "trained"]
    rows.sort(key=lambda row: row["seq_len"])
    lengths = [row["seq_len"] for row in rows]
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(12, 4.5))
    speed.plot(lengths, [row["tokens_per_s"] for row in rows], marker="o")
    speed.set_ylabel("tokens/s")
    memory.plot(lengths, [(row["peak_memory_bytes"] or 0) / 1e9 for row in rows], marker="o", label="GPU, peak")
    if all(row.get("peak_host_bytes") is not None for row in rows):
        memory.plot(lengths, [row["peak_host_bytes"] / 1e9 for row in rows], marker="s",
                    label="host, peak resident")  # fmt: skip
    memory.legend()
    memory.set_ylabel("memory, GB")
    for ax in (speed, memory):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens in the row")
        ax.grid(True, alpha=0.3)
    failed = [rung["seq_len"] for rung in result["ladder"] if rung["outcome"] != "trained"]
    fig.suptitle(f"{result.get('profile', PROFILE)}, memory {result['memory_policy']}: {result.get('machine')}, "
                 f"commit {result.get('commit')}, {result.get('date')}"
                 + (f"; out of memory at {failed[0]}" if failed else ""), fontsize=9)  # fmt: skip
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main(sys.argv[1:])
