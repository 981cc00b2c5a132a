"""The memory presets against each other on one GPU (docs/perf-history.md, "Selective caching"): throughput and peak
memory at one length, and the longest row each preset trains.

    python -m moe_tune.engine.bench.memory_sweep OUT.json [PRESET] [--lengths N,N,...] [--set a.b=v ...]

One preset per process (a clean allocator for each ladder); the JSON holds that preset's result (see
steps.sweep_lengths) and the pinned copy bandwidth of the machine.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

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


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        # One line; argparse would print its usage block first.
        self.exit(2, f"{self.prog}: {message}\n")


def _lengths(text: str) -> list[int]:
    try:
        lengths = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: must be comma-separated integers") from None
    if not lengths or any(n <= 0 for n in lengths) or lengths != sorted(set(lengths)):
        raise argparse.ArgumentTypeError(f"{text!r}: must be positive and strictly ascending")
    return lengths


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = _Parser(prog="python -m moe_tune.engine.bench.memory_sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, metavar="OUT.json", help="where the preset's result is written")
    parser.add_argument("preset", nargs="?", default="none", choices=list(PRESETS), metavar="PRESET",
                        help=f"one of {', '.join(PRESETS)} (default: none)")
    parser.add_argument("--lengths", type=_lengths, default=list(LENGTHS), metavar="N,N,...",
                        help=f"the ladder, ascending (default: {','.join(map(str, LENGTHS))})")
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
        # One row per step: the ladder sizes the row, and the benchmark profile trains B2 rows of 4096.
        profile = load_profile(PROFILE, ["train.micro_batch_size=1", f"memory.preset={preset}", *overrides])
    except ProfileError as err:
        _fail(*err.problems)
    if not _has_cuda():
        # Peak memory and the pinned copy bandwidth are GPU measurements; on the CPU the ladder would say nothing.
        _fail("needs a CUDA device: it measures peak GPU memory and pinned copies")
    # Written after every measurement (complete: false until the end), so a run stopped by a time limit keeps
    # what it measured.
    def write(result: dict, is_complete: bool = False) -> None:
        write_json_atomic(out, dict(result, overrides=overrides, complete=is_complete))

    result = sweep_lengths(
        profile, args.lengths, TIMED_LENGTH, TIMED_STEPS, on_line=lambda line: print(line, flush=True),
        on_result=write,
    )
    h2d, d2h = pinned_copy_bandwidth()
    result.update(pinned_h2d_gb_per_s=h2d, pinned_d2h_gb_per_s=d2h)
    write(result, is_complete=True)
    print(f"{preset}: max trained length {result['max_trained_length']}; pinned copy {h2d:.1f} / {d2h:.1f} GB/s")


if __name__ == "__main__":
    main(sys.argv[1:])
