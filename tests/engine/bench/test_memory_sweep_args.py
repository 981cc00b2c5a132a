"""The memory sweep's command line (the sweep itself needs a GPU: tests/gpu and docs/PERF.md)."""

import pytest

from moe_tune.engine.bench.memory_sweep import LENGTHS, parse_args


def test_defaults_and_options_in_any_order():
    args = parse_args(["out.json"])
    assert (args.preset, args.lengths, args.overrides) == ("none", list(LENGTHS), [])
    args = parse_args(["out.json", "--set", "a.b=1", "max-context", "--lengths", "131072,196608"])
    assert (args.preset, args.lengths, args.overrides) == ("max-context", [131072, 196608], ["a.b=1"])


@pytest.mark.parametrize(
    "lengths, rule",
    [("4096,x", "must be comma-separated integers"), ("8192,4096", "must be positive and strictly ascending"),
     ("0,4096", "must be positive and strictly ascending"), ("4096,4096", "must be positive and strictly ascending")],
)  # fmt: skip
def test_bad_lengths_one_line_exit_2(lengths, rule, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["out.json", "--lengths", lengths])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1
    assert f"argument --lengths: '{lengths}': {rule}" in err
