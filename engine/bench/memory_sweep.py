"""The memory presets against each other on one GPU (docs/PERF.md, "Selective caching"): throughput and peak
memory at one length, and the longest row each preset trains.

    python -m moe_tune.engine.bench.memory_sweep OUT.json [PRESET] [--set a.b=v ...]

One preset per process (a clean allocator for each ladder); the JSON holds that preset's result (see
steps.sweep_lengths) and the pinned copy bandwidth of the machine.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from moe_tune.engine.bench.steps import pinned_copy_bandwidth, sweep_lengths
from moe_tune.profiles import load_profile

PROFILE = "bench-qwen3-next"
# Where throughput and peak memory are compared (every preset must fit there).
TIMED_LENGTH = 16384
TIMED_STEPS = 3
# The ladder climbs until a step runs out of memory.
LENGTHS = (32768, 49152, 65536, 98304, 131072, 196608, 262144)


def main(argv: list[str]) -> None:
    out, preset, overrides = Path(argv[0]), argv[1] if len(argv) > 1 else "none", []
    rest = argv[2:]
    for flag, value in zip(rest[::2], rest[1::2]):
        if flag != "--set":
            raise SystemExit(f"usage: {__doc__.strip().splitlines()[2].strip()}")
        overrides.append(value)
    profile = load_profile(PROFILE, [f"memory.preset={preset}", *overrides])
    result = sweep_lengths(
        profile, list(LENGTHS), TIMED_LENGTH, TIMED_STEPS, on_line=lambda line: print(line, flush=True)
    )
    h2d, d2h = pinned_copy_bandwidth()
    result.update(pinned_h2d_gb_per_s=h2d, pinned_d2h_gb_per_s=d2h, overrides=overrides)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{preset}: max trained length {result['max_trained_length']}; pinned copy {h2d:.1f} / {d2h:.1f} GB/s")


if __name__ == "__main__":
    main(sys.argv[1:])
