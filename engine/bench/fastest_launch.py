"""The launch to time next, from launch sweeps' JSON: each sweep's fastest candidate that beats pick_config's (or
pick_launch's) by more than both their spreads, as one `--launch` / MOE_TUNE_LAUNCH text (ops/common/launch.py).

    python -m moe_tune.engine.bench.fastest_launch SWEEP.json [SWEEP.json ...] [--op gdn]

A linear-attention sweep (engine/bench/linear_attention_sweep.py) gives its `--op` rows' best (forward + backward,
`ms`); a causal conv sweep (engine/bench/causal_conv_sweep.py) gives the best of its rows and its `combined` turns
(forward + backward, `fwd_bwd_ms`, each against the default of its own turns). A candidate counts only when it was
checked and not wrong. Prints the entries joined by commas, or nothing when no candidate counts: a device call can
then run `moe-tune profile ... ${L:+--launch "$L"}` beside the default without a round trip (.device/README.md).
A sweep stopped midway counts with the turns it finished.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from moe_tune.engine.bench.arguments import OneLineParser
from moe_tune.ops.common.launch import LaunchError, parse_launch
from moe_tune.profiles import error_line


def beats_default(row: dict, default: dict, ms: str, spread: str) -> bool:
    """Whether a timed, checked row is faster than the default row by more than the larger of their spreads."""
    if row.get("error") or row.get("wrong") or ms not in row or ms not in default:
        return False
    return row[ms] + max(row.get(spread, 0.0), default.get(spread, 0.0)) < default[ms]


def linear_attention_best(result: dict, op: str) -> dict | None:
    """The config of the op's fastest row that beats its first (pick_config's), or None."""
    rows = [row for row in result.get("sweep", []) if row.get("op") == op]
    if not rows or rows[0].get("config"):
        return None
    winners = [row for row in rows[1:] if beats_default(row, rows[0], "ms", "spread_ms")]
    return min(winners, key=lambda row: row["ms"])["config"] if winners else None


def causal_conv_best(result: dict) -> dict | None:
    """The config of the fastest row, of the sweep's or of its `combined` turns, that beats its turns' default,
    ranked by its ratio to that default; or None."""
    winners = []
    for rows in (result.get("sweep") or [], result.get("combined") or []):
        if rows and not rows[0].get("config"):
            winners += [(row["fwd_bwd_ms"] / rows[0]["fwd_bwd_ms"], row) for row in rows[1:]
                        if beats_default(row, rows[0], "fwd_bwd_ms", "fwd_bwd_spread_ms")]  # fmt: skip
    return min(winners, key=lambda pair: pair[0])[1]["config"] if winners else None


def entry_value(value: Any) -> str:
    """A JSON config value as MOE_TUNE_LAUNCH writes it."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "none"
    if isinstance(value, list):
        return "/".join(str(part) for part in value)
    return str(value)


def fastest_launch_text(results: list[dict], op: str) -> str:
    """The entries of every result's best candidate, checked as MOE_TUNE_LAUNCH reads them (LaunchError)."""
    entries = []
    for result in results:
        if "best_forward" in result:
            family, best = "causal_conv", causal_conv_best(result)
        else:
            family, best = "linear_attention", linear_attention_best(result, op)
        entries += [f"{family}.{field}={entry_value(value)}" for field, value in (best or {}).items()]
    text = ",".join(entries)
    if text:
        parse_launch(text, "the sweeps' fastest launch")
    return text


def main(argv: list[str]) -> None:
    parser = OneLineParser(prog="python -m moe_tune.engine.bench.fastest_launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("sweeps", type=Path, nargs="+", help="launch sweeps' JSON files")
    parser.add_argument("--op", default="gdn", choices=("gdn", "kda"), help="the linear-attention sweep's op")
    args = parser.parse_args(argv)
    results = []
    for path in args.sweeps:
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            parser.exit(2, f"{path}: cannot read a sweep's JSON ({error_line(err, plain=())})\n")
        if not isinstance(result, dict) or not isinstance(result.get("sweep"), list):
            parser.exit(2, f"{path}: not a launch sweep's JSON (no 'sweep' list)\n")
        results.append(result)
    try:
        print(fastest_launch_text(results, args.op))
    except LaunchError as err:
        parser.exit(2, f"{err}\n")
    except (KeyError, TypeError, ZeroDivisionError) as err:
        parser.exit(2, f"a sweep's rows are not as a sweep writes them ({error_line(err, plain=())})\n")


if __name__ == "__main__":
    main(sys.argv[1:])
