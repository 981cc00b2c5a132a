"""The linear-attention launch sweep (engine/bench/linear_attention_sweep.py): its candidates, its correctness rule,
its kernel totals, that a candidate reaches the forward's and the backward's launches, and its command line. The
timings themselves need a CUDA device (docs/perf-history.md)."""

import dataclasses
import math
import types

import pytest
import torch

from moe_tune.engine.bench import linear_attention_sweep as sweep
from moe_tune.ops.linear_attention.kernels_common import KernelConfig, pick_config


def _gpu_config() -> KernelConfig:
    # pick_config reads only whether the tensor is on CUDA (and Triton's version).
    return pick_config(types.SimpleNamespace(is_cuda=True))


@pytest.mark.parametrize("op", sweep.OPS)
def test_candidates_start_with_pick_config_and_each_changes_a_launch(op):
    base = _gpu_config()
    candidates = sweep.sweep_candidates(op)
    assert candidates[0] == {}
    configs = [dataclasses.replace(base, **overrides) for overrides in candidates]
    # Every other candidate differs from pick_config's choice and from each other: none is timed twice.
    assert all(config != base for config in configs[1:])
    assert len(set(configs)) == len(configs)


def test_unknown_op_is_refused():
    with pytest.raises(ValueError, match="op 'gla': must be one of gdn, kda"):
        sweep.sweep_candidates("gla")


def test_relative_errors_are_rms_ratios_with_zero_and_nan_cases():
    expected = {"o": torch.tensor([3.0, 4.0]), "dk": torch.zeros(2), "dv": torch.zeros(2), "dq": torch.ones(2)}
    actual = {
        "o": torch.tensor([3.0, 4.0]) + torch.tensor([0.3, 0.4]),
        "dk": torch.zeros(2),
        "dv": torch.tensor([0.0, 1e-3]),
        "dq": torch.tensor([1.0, float("nan")]),
    }
    errors = sweep.relative_errors(actual, expected)
    assert errors["o"] == pytest.approx(0.1)
    assert errors["dk"] == 0.0 and errors["dv"] == math.inf and math.isnan(errors["dq"])


def test_wrong_tensors_take_the_larger_of_the_floor_and_a_multiple_of_pick_configs_error():
    floor, factor = sweep.WRONG_REL_RMS, sweep.WRONG_FACTOR
    default = {"o": 1e-3, "dq": 0.1}
    # Under the floor passes whatever pick_config's error; above it, up to factor times pick_config's.
    assert sweep.wrong_tensors({"o": floor, "dq": 0.1 * factor}, default) == []
    assert sweep.wrong_tensors({"o": floor * 1.01, "dq": 0.1 * factor * 1.01}, default) == ["o", "dq"]
    assert sweep.wrong_tensors({"o": float("nan"), "dq": math.inf}, default) == ["o", "dq"]
    # pick_config's own row (no errors to compare with yet) is held to the floor.
    assert sweep.wrong_tensors({"o": floor * 2}, {}) == ["o"]


def test_a_candidates_check_fills_its_row_or_says_why_it_did_not_run():
    floor = sweep.WRONG_REL_RMS
    row = {}
    # The default candidate (no errors to compare with): held to the floor and its own errors' multiple.
    assert sweep.check_candidate(row, lambda: {"o": floor * 3, "dq": float("nan")}, None) == {
        "o": floor * 3, "dq": pytest.approx(float("nan"), nan_ok=True)}  # fmt: skip
    assert row["errors"]["o"] == float(f"{floor * 3:.3e}") and row["wrong"] == ["dq"]
    row = {}
    assert sweep.check_candidate(row, lambda: {"o": floor * 3}, {"o": floor}) is not None and row["wrong"] == ["o"]

    def refuses():
        raise RuntimeError("out of resource: shared memory\nRequired: 300000")

    row = {"config": {"num_stages": 5}}
    assert sweep.check_candidate(row, refuses, {}) is None
    assert row == {"config": {"num_stages": 5}, "error": "RuntimeError: out of resource: shared memory"}


def test_a_sweep_stopped_midway_has_handed_out_what_it_measured(monkeypatch):
    # The sweep's own steps on the CPU, its device work faked: three candidates (the second wrong), timed in turns,
    # and a stop (a time limit's SIGINT) in the second turn. progress saw every check, then the first turn's
    # timings with vs_default, as the JSON keeps them.
    checks = iter([{"o": 1e-3}, {"o": 1.0}, {"o": 1e-3}])
    monkeypatch.setattr(sweep, "_shape_inputs", lambda shape, op: _inputs())
    monkeypatch.setattr(sweep, "_reference_outputs", lambda inputs, grad: {})
    monkeypatch.setattr(sweep, "check_candidate", lambda row, errors_of, default: _checked(row, next(checks)))
    timings = iter([2.0, 1.0])

    def median_ms(step, leaves, rep_ms):
        return next(timings)  # the second turn's first timing: StopIteration, standing for the interrupt

    monkeypatch.setattr(sweep, "median_ms", median_ms)
    monkeypatch.setattr(sweep, "profiled_kernels", lambda step, passes: pytest.fail("profiled an unfinished sweep"))
    seen = []
    candidates = [{}, {"num_warps": 2}, {"num_stages": 2}]
    with pytest.raises(StopIteration):
        sweep.sweep_op("gdn", rounds=2, candidates=candidates, progress=lambda rows: seen.append(
            [dict(row) for row in rows]))  # fmt: skip
    assert [len(rows) for rows in seen] == [1, 2, 3, 3]
    first_turn = seen[-1]
    assert [row["config"] for row in first_turn] == candidates
    assert first_turn[1]["wrong"] == ["o"] and "ms" not in first_turn[1]
    assert (first_turn[0]["ms"], first_turn[0]["vs_default"]) == (2.0, 1.0)
    assert (first_turn[2]["ms"], first_turn[2]["vs_default"], first_turn[2]["times_ms"]) == (1.0, 0.5, [1.0])


def _checked(row, errors):
    row["errors"] = errors
    row["wrong"] = [name for name, err in errors.items() if err > sweep.WRONG_REL_RMS]
    return errors


def test_timings_summarised_as_median_and_spread():
    assert sweep.summarize_timings([3.0, 1.0, 2.5]) == {"ms": 2.5, "spread_ms": 2.0}
    assert sweep.summarize_timings([4.0]) == {"ms": 4.0, "spread_ms": 0.0}


def test_kernel_totals_per_pass_longest_first():
    events = [("a", 100.0), ("b", 50.0), ("a", 300.0), ("c", 1000.0), ("b", 50.0), ("a", 200.0)]
    assert sweep.kernel_totals(events, passes=2) == [
        {"kernel": "c", "calls": 0.5, "ms": 0.5},
        {"kernel": "a", "calls": 1.5, "ms": 0.3},
        {"kernel": "b", "calls": 1.0, "ms": 0.05},
    ]


class _Probe(Exception):
    pass


class _ProbeConfig:
    """A config whose first read says that the op asked for it."""

    def __getattr__(self, name):
        raise _Probe(name)


def _inputs(T=8, H=2, K=16, V=16):
    gen = torch.Generator().manual_seed(0)
    return dict(
        q=torch.randn(1, T, H, K, generator=gen),
        k=torch.randn(1, T, H, K, generator=gen),
        v=torch.randn(1, T, H, V, generator=gen),
        g=-torch.rand(1, T, H, generator=gen),
        beta=torch.rand(1, T, H, generator=gen),
    )


def test_a_candidate_reaches_the_forwards_launches_and_pick_config_comes_back():
    from moe_tune.ops.linear_attention import autograd

    chosen = autograd.pick_config
    with pytest.raises(_Probe), sweep.launched_with(_ProbeConfig()):
        sweep.ours(**_inputs())
    assert autograd.pick_config is chosen


def test_a_candidate_reaches_the_backwards_launches():
    # The backward picks its launch config again; under the sweep it must get the candidate too, not pick_config's.
    from moe_tune.ops.linear_attention import autograd
    from moe_tune.ops.linear_attention.kernels_common import prepare_chunks

    inputs = _inputs()
    B, T, H, K = inputs["q"].shape
    V = inputs["v"].shape[-1]
    layout = prepare_chunks(None, B, T, device=inputs["q"].device)
    flat = [inputs[name].reshape(B * T, H, -1).squeeze(-1) for name in ("q", "k", "v", "g", "beta")]
    ctx = types.SimpleNamespace(
        saved_tensors=(*flat, None, layout.cu_seqlens, layout.chunk_offsets, layout.chunk_map, None, None),
        num_kept=0, shape=(B, T, H, K, V), layout_sizes=(layout.num_slots, layout.chunk_size), scale=K**-0.5,
        use_qk_l2norm=True, dt_bias_shape=None,
    )  # fmt: skip
    with pytest.raises(_Probe), sweep.launched_with(_ProbeConfig()):
        autograd.GatedDeltaRuleFunction.backward(ctx, torch.randn(B, T, H, V), None)


@pytest.mark.parametrize(
    "argv, message",
    [(["o.json", "--ops", "gdn,gla"], "argument --ops: 'gdn,gla': must be distinct names from gdn, kda"),
     (["o.json", "--ops", "kda,kda"], "argument --ops: 'kda,kda': must be distinct names from gdn, kda"),
     (["o.json", "--rounds", "0"], "argument --rounds: '0': must be positive"),
     (["o.json", "--rounds", "two"], "argument --rounds: 'two': must be an integer")],
)  # fmt: skip
def test_bad_options_one_line_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        sweep.parse_args(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and message in err


def test_options_and_defaults():
    args = sweep.parse_args(["o.json"])
    assert (args.ops, args.rounds, args.no_breakdown) == (list(sweep.OPS), sweep.ROUNDS, False)
    args = sweep.parse_args(["o.json", "--no-breakdown", "--ops", "kda", "--rounds", "1"])
    assert (args.ops, args.rounds, args.no_breakdown) == (["kda"], 1, True)


def test_a_missing_output_folder_a_folder_or_no_cuda_is_one_line_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        sweep.main([str(tmp_path / "absent" / "o.json")])
    missing = tmp_path / "absent" / "o.json"
    assert exc.value.code == 2 and capsys.readouterr().err == f"{missing}: its folder does not exist\n"
    with pytest.raises(SystemExit) as exc:
        sweep.main([str(tmp_path)])
    assert exc.value.code == 2
    assert capsys.readouterr().err == f"{tmp_path}: is a folder; the results go into a JSON file\n"
    with pytest.raises(SystemExit) as exc:
        sweep.main([str(tmp_path / "o.json")])
    assert exc.value.code == 2 and capsys.readouterr().err == "needs a CUDA device: it times kernels\n"
    assert not (tmp_path / "o.json").exists()


def test_largest_kernel_change_names_the_kernel_and_its_signed_change():
    before = {"a": 1.0, "b": 0.5, "gone": 0.2}
    assert sweep.largest_kernel_change(before, {"a": 0.9, "b": 0.75, "gone": 0.2}) == "b +0.250 ms"
    assert sweep.largest_kernel_change(before, {"a": 0.6, "b": 0.5}) == "a -0.400 ms"
    # A kernel in one profile only counts from or to zero (a split kernel appears, one disappears).
    assert sweep.largest_kernel_change(before, {"a": 1.0, "b": 0.5, "new": 0.3}) == "new +0.300 ms"
    assert sweep.largest_kernel_change(before, {"a": 1.0, "b": 0.5}) == "gone -0.200 ms"


@pytest.mark.parametrize("text, message", [
    ("nonsense", "'nonsense': must be FIELD=VALUE entries joined by commas"),
    ("num_stages=2,,block_v_state=64", "'num_stages=2,,block_v_state=64': must be FIELD=VALUE entries"),
    ("num_stages=x", "num_stages must be an integer"),
    ("foo=1", "linear_attention has no field 'foo'"),
    ("num_stages=2,num_stages=3", "linear_attention.num_stages is named twice"),
    ("block_k_kda_grad_products=32,num_warps_kda_grad_products=16", "key tiles launch at most 8 warps"),
], ids=["no equals", "empty entry", "bad value", "no such field", "twice", "refused combination"])  # fmt: skip
def test_a_bad_candidate_is_one_line_exit_2(text, message, capsys):
    with pytest.raises(SystemExit) as exc:
        sweep.parse_args(["o.json", "--candidate", text])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "argument --candidate" in err and message in err, err


@pytest.mark.parametrize("candidates", [["num_stages=2", " num_stages = 2 "], ["num_stages=2", "block_v_state=64",
                                        "block_v_state=64,num_stages=2", "num_stages=2,block_v_state=64"]],
                         ids=["same twice", "same fields in another order"])  # fmt: skip
def test_candidates_named_twice_are_refused(candidates, capsys):
    argv = ["o.json"] + [arg for text in candidates for arg in ("--candidate", text)]
    with pytest.raises(SystemExit) as exc:
        sweep.parse_args(argv)
    assert exc.value.code == 2 and "argument --candidate: each must differ from the others" in capsys.readouterr().err


def test_named_candidates_are_timed_after_pick_configs_for_each_op(monkeypatch, tmp_path):
    args = sweep.parse_args(["o.json", "--candidate", "grad_dq_norm_in_output=true,num_stages=2",
                             "--candidate", "block_v_state=64"])  # fmt: skip
    assert args.candidate == [{"grad_dq_norm_in_output": True, "num_stages": 2}, {"block_v_state": 64}]
    seen = []

    def fake_sweep_op(op, rounds, candidates, progress):
        seen.append((op, candidates))
        return [{"op": op, "config": candidate} for candidate in (candidates or sweep.sweep_candidates(op))]

    monkeypatch.setattr(sweep, "check_output_and_device", lambda out: None)
    monkeypatch.setattr(sweep, "sweep_op", fake_sweep_op)
    monkeypatch.setattr(sweep, "format_sweep", lambda rows: "")
    monkeypatch.setattr(sweep, "machine_info", lambda is_cuda: {})
    out = tmp_path / "o.json"
    sweep.main([str(out), "--no-breakdown", "--candidate", "num_warps_grad_output=16"])
    assert seen == [(op, [{}, {"num_warps_grad_output": 16}]) for op in sweep.OPS]
    seen.clear()
    sweep.main([str(out), "--no-breakdown", "--ops", "kda"])
    assert seen == [("kda", None)]  # every candidate of sweep_candidates
