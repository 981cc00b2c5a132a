"""The launch to time next from sweeps' JSON (engine/bench/fastest_launch.py): a candidate counts only when checked,
not wrong, and faster than its turns' default by more than both spreads; the fastest per sweep; conv's combined
turns ranked by their ratio to their own default; the text MOE_TUNE_LAUNCH reads; bad files one line, exit 2."""

import json

import pytest

from moe_tune.engine.bench import fastest_launch as fastest
from moe_tune.ops.common.launch import parse_launch


def la_row(config, ms, spread=0.01, op="gdn", **extra):
    return {"op": op, "config": config, "ms": ms, "spread_ms": spread, "wrong": [], **extra}


def conv_row(config, ms, spread=0.001, **extra):
    return {"config": config, "fwd_bwd_ms": ms, "fwd_bwd_spread_ms": spread, "wrong": [], **extra}


LA_SWEEP = {"sweep": [
    la_row({}, 3.70),
    la_row({"num_stages": 2}, 3.60),  # beats 3.70 by 0.10 > 0.01
    la_row({"block_v_state_fwd": [32, 16]}, 3.50, wrong=["dq"]),  # faster but wrong
    la_row({"num_warps": 8}, 3.40, error="RuntimeError: out of resource"),
    la_row({"grad_dq_norm_in_output": True}, 3.65, spread=0.2),  # within its spread
    la_row({"block_k_grad_wy": None}, 3.55, spread=0.2),  # 3.55 + 0.2 > 3.70
    la_row({}, 11.0, op="kda"),
    la_row({"block_k_kda_grad_products": 32}, 10.0, op="kda"),
]}  # fmt: skip


def test_the_fastest_checked_candidate_beyond_the_spreads_per_op():
    assert fastest.linear_attention_best(LA_SWEEP, "gdn") == {"num_stages": 2}
    assert fastest.linear_attention_best(LA_SWEEP, "kda") == {"block_k_kda_grad_products": 32}
    # No winner: the default itself, or a default row not first.
    slower = {"sweep": [la_row({}, 3.0), la_row({"num_stages": 2}, 3.1)]}
    assert fastest.linear_attention_best(slower, "gdn") is None
    assert fastest.linear_attention_best({"sweep": LA_SWEEP["sweep"][1:]}, "gdn") is None
    # A sweep stopped before its first turn: rows without timings.
    untimed = {"sweep": [{"op": "gdn", "config": {}, "wrong": []}, {"op": "gdn", "config": {"a": 1}, "wrong": []}]}
    assert fastest.linear_attention_best(untimed, "gdn") is None


def test_conv_ranks_the_sweep_and_its_combined_turns_by_their_ratio_to_their_own_default():
    sweep = [conv_row({}, 0.82), conv_row({"block_t": 64}, 0.78), conv_row({"grad_block_c": 32}, 0.75, wrong=["dq"])]
    combined = [conv_row({}, 0.80), conv_row({"block_t": 64, "grad_block_c": 128}, 0.72)]
    assert fastest.causal_conv_best({"sweep": sweep, "best_forward": None, "combined": combined}) == {
        "block_t": 64, "grad_block_c": 128}  # 0.90 of its turns' default, against 0.951
    assert fastest.causal_conv_best({"sweep": sweep, "best_forward": None, "combined": None}) == {"block_t": 64}
    noisy = [conv_row({}, 0.82, spread=0.1), conv_row({"block_t": 64}, 0.78)]
    assert fastest.causal_conv_best({"sweep": noisy, "best_forward": None, "combined": None}) is None


@pytest.mark.parametrize("value, text", [(True, "true"), (False, "false"), (None, "none"), ([32, 16], "32/16"),
                                         (64, "64"), ("tf32", "tf32")])  # fmt: skip
def test_values_are_written_as_the_launch_variable_reads_them(value, text):
    assert fastest.entry_value(value) == text


def test_the_text_joins_both_families_and_reads_back(tmp_path, capsys):
    conv = {"sweep": [conv_row({}, 0.82), conv_row({"block_t": 64, "one_pass_backward": True}, 0.70)],
            "best_forward": None, "combined": None}  # fmt: skip
    la = {"sweep": [la_row({}, 3.7), la_row({"block_v_state_fwd": [32, 16], "grad_dq_norm_in_output": True}, 3.5)]}
    paths = []
    for name, result in (("la.json", la), ("conv.json", conv)):
        paths.append(tmp_path / name)
        paths[-1].write_text(json.dumps(result))
    fastest.main([str(path) for path in paths])
    text = capsys.readouterr().out.strip()
    assert text == ("linear_attention.block_v_state_fwd=32/16,linear_attention.grad_dq_norm_in_output=true,"
                    "causal_conv.block_t=64,causal_conv.one_pass_backward=true")  # fmt: skip
    assert parse_launch(text) == {"linear_attention": {"block_v_state_fwd": (32, 16), "grad_dq_norm_in_output": True},
                                  "causal_conv": {"block_t": 64, "one_pass_backward": True}}  # fmt: skip
    # Nothing beats the defaults: an empty line.
    (tmp_path / "slow.json").write_text(json.dumps({"sweep": [la_row({}, 3.0), la_row({"num_stages": 2}, 3.5)]}))
    fastest.main([str(tmp_path / "slow.json")])
    assert capsys.readouterr().out == "\n"


@pytest.mark.parametrize("content, message", [
    (None, "cannot read a sweep's JSON (FileNotFoundError: "),
    ("{", "cannot read a sweep's JSON (JSONDecodeError: "),
    (b"\xff\xfe", "cannot read a sweep's JSON (UnicodeDecodeError: "),
    ("[]", "not a launch sweep's JSON (no 'sweep' list)"),
    ('{"sweep": 3}', "not a launch sweep's JSON (no 'sweep' list)"),
    ('{"sweep": [{"op": "gdn", "config": {}, "ms": 1}, {"op": "gdn", "config": {"num_stages": 2}, "ms": "x"}]}',
     "a sweep's rows are not as a sweep writes them (TypeError: "),
    ('{"sweep": [{"op": "gdn", "config": {}, "ms": 3}, {"op": "gdn", "config": {"no_field": 2}, "ms": 1}]}',
     "the sweeps' fastest launch entry 'linear_attention.no_field=2': linear_attention has no field 'no_field'"),
])  # fmt: skip
def test_a_bad_file_is_one_line_exit_2(tmp_path, capsys, content, message):
    path = tmp_path / "sweep.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exit_:
        fastest.main([str(path)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and message in err, err
