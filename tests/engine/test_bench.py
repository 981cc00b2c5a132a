"""The kernel benchmark harness: its registry, the CPU fallback's rows, and the regression check."""

import time

import pytest
import torch

from moe_tune.engine.bench import OPS, ROW_KEYS, SHAPE_DIMS, find_regressions, parse_shapes, run_kernels


@pytest.fixture
def no_cuda(monkeypatch):
    # The CPU path, even on a machine with a GPU: these tests must stay fast and device-free.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_registry_names_every_op():
    assert list(OPS) == [
        "moe", "gated_delta_rule", "kda", "sparse_attention", "topk_indexer", "cross_entropy", "rms_norm",
        "causal_conv", "rotary", "swiglu", "fp8_linear",
    ]


def test_unknown_op_is_refused_with_the_registered_names():
    with pytest.raises(ValueError, match=r"ops \('foo'\) must name registered ops: moe, gated_delta_rule, kda"):
        run_kernels(["foo"])


def test_unknown_preset_is_refused():
    with pytest.raises(ValueError, match=r"shapes \('huge'\) must be a preset \(small, anchor\) or a SPEC .*'huge'"):
        run_kernels(["moe"], "huge")


@pytest.mark.parametrize(
    "spec, ops, message",
    [
        pytest.param("B4,T8k", ["kda"], r"'T8k' is not a dimension name followed by a positive integer", id="syntax"),
        pytest.param("B0,T8", ["kda"], r"'B0' is not a dimension name followed by a positive integer", id="zero"),
        pytest.param("B4,T8,B2", ["kda"], r"dimension B is given twice", id="twice"),
        pytest.param("B4,T8,H2,K16", ["kda"], r"kda takes exactly B,T,H,K,V \(missing V\)", id="missing"),
        # Names are case-sensitive: k is MoE's experts per token, K the key dim.
        pytest.param("B4,T8,H2,k16,V16", ["gated_delta_rule"], r"B,T,H,K,V \(it has no k; missing K\)", id="case"),
        pytest.param("B1,T8,H2,K16,V16", ["moe"], r"moe takes exactly N,D,F,E,k \(it has no B, T, H, K, V;", id="moe"),
        pytest.param("B1,T8", ["sparse_attention"], r"sparse_attention takes presets only", id="no_spec"),
    ],
)
def test_bad_shape_spec_names_the_value_and_the_rule(spec, ops, message):
    with pytest.raises(ValueError, match=rf"shapes \('{spec}'\).*{message}"):
        parse_shapes(spec, ops)


def test_shape_spec_gives_each_op_its_dimensions():
    assert parse_shapes("anchor", ["moe"]) == "anchor"
    assert parse_shapes(" V8, K16,H2,T64,B1", ["gated_delta_rule", "kda"]) == {
        op: dict(B=1, T=64, H=2, K=16, V=8) for op in ("gated_delta_rule", "kda")
    }
    assert set(SHAPE_DIMS) <= set(OPS)


def test_cpu_run_of_a_spec_times_the_reference_at_that_shape(no_cuda):
    said = []
    rows, _, _ = run_kernels(["kda"], "B1,T40,H1,K16,V8", on_start=said.append)
    assert said == [
        "no CUDA device: timing the pure-PyTorch references on the given shapes (time.perf_counter medians)"
    ]
    (row,) = rows
    assert (row["op"], row["shape"], row["dtype"]) == ("kda", "B1 T40 H1 K16 V8", "float32")
    assert row["fwd_ms"] > 0 and row["fwd_bwd_ms"] > 0


def test_cpu_run_says_so_and_times_the_sparse_reference(no_cuda):
    said = []
    rows, peaks, machine = run_kernels(["sparse_attention"], "small", on_start=said.append)
    assert said == ["no CUDA device: timing the pure-PyTorch references on small shapes (time.perf_counter medians)"]
    assert peaks.tflops is None and machine["device"] == "cpu"
    (row,) = rows
    assert tuple(row) == ROW_KEYS
    assert row["op"] == "sparse_attention" and "reference only on CPU" in row["note"]
    assert row["fwd_ms"] > 0 and row["fwd_bwd_ms"] > 0 and row["fwd_tflops"] > 0
    assert row["fwd_peak_fraction"] is None and row["peak_memory_bytes"] is None
    assert row["commit"] and row["date"] and row["torch"] == torch.__version__
    # A CPU run has no GPU driver to name.
    assert row["driver"] is None and row["machine"] == machine["machine"]


def _row(impl="reference", fwd_ms=1.0, fwd_bwd_ms=3.0):
    return dict(op="moe", case="uniform", impl=impl, shape="N128", fwd_ms=fwd_ms, fwd_bwd_ms=fwd_bwd_ms)


def test_regression_is_a_row_more_than_ten_percent_slower():
    baseline = [_row(), _row(impl="triton")]
    assert find_regressions([_row(fwd_ms=1.09), _row(impl="triton", fwd_bwd_ms=3.2)], baseline) == []
    (line,) = find_regressions([_row(fwd_ms=1.09), _row(impl="triton", fwd_bwd_ms=3.6)], baseline)
    assert line.startswith("moe / uniform / triton / N128: fwd_bwd_ms 3.600 > 3.000 (+20%")


def test_rows_without_a_match_or_a_timing_are_not_regressions():
    assert find_regressions([_row(impl="new"), _row(fwd_ms=None)], [_row(fwd_ms=0.1), _row(impl="other")]) == []


def test_cross_entropy_entry_times_both_forms_and_checks_their_loss(no_cuda):
    rows, _, _ = run_kernels(["cross_entropy"], "N40,D8,V64")
    assert [row["impl"] for row in rows] == [
        "moe_tune chunked (ops.cross_entropy)", "full logits (F.linear + F.cross_entropy)"
    ]
    for row in rows:
        assert (row["op"], row["shape"], row["dtype"]) == ("cross_entropy", "N40 D8 V64", "float32")
        assert row["fwd_ms"] > 0 and row["fwd_bwd_ms"] > 0
        # The note carries the loss's difference from the fp32 full-logits reference.
        assert abs(float(row["note"].rsplit(" ", 1)[1])) <= 1e-5


def test_rms_norm_entry_times_the_reference_on_cpu_with_its_bytes(no_cuda):
    rows, _, _ = run_kernels(["rms_norm"], "M64,N32")
    assert [(row["case"], row["impl"]) for row in rows] == [
        ("plain", "reference (torch small ops)"), ("gated silu", "reference (torch small ops)"),
        ("residual add", "reference (torch small ops)"),
    ]
    # fp32: plain moves x, y forward and x, dy, dx backward (5 x 64 x 32 x 4 bytes); gated adds z twice and dz; the
    # residual add moves x, r, h, y forward and dy, h, dx backward (7 x 64 x 32 x 4).
    for row, megabytes in zip(rows, ("0.041 MB", "0.066 MB", "0.057 MB"), strict=True):
        assert (row["op"], row["shape"], row["dtype"]) == ("rms_norm", "M64 N32", "float32")
        assert row["fwd_ms"] > 0 and row["fwd_bwd_ms"] > 0
        assert f"moves at least {megabytes} fwd+bwd (fwd " in row["note"]


def test_causal_conv_entry_times_the_reference_on_cpu_with_its_bytes(no_cuda):
    (row,) = run_kernels(["causal_conv"], "T300,C16,W4")[0]
    assert (row["op"], row["impl"], row["shape"], row["dtype"]) == (
        "causal_conv", "reference (torch small ops)", "T300 C16 W4", "float32"
    )
    assert row["fwd_ms"] > 0 and row["fwd_bwd_ms"] > 0
    # fp32: x and y forward, x, dy and dx backward: 5 x 300 x 16 x 4 bytes.
    assert row["note"].startswith("moves at least 0.096 MB fwd+bwd (fwd ")
    assert " 0 GB/s" not in row["note"]


@pytest.mark.parametrize(("moved", "ms", "shown"), [(10**6, 1.0, "1 GB/s"), (2_500, 1.0, "0.0025 GB/s"),
                                                     (99_940_000, 1.0, "99.9 GB/s"), (3_352_100_000, 1.0, "3,352 GB/s"),
                                                     (123_456, 0.5, "0.247 GB/s")])  # fmt: skip
def test_bytes_notes_give_small_rates_three_digits_and_large_ones_whole(moved, ms, shown):
    """The CPU's small shapes move MB/s: whole GB/s printed them all as 0."""
    from moe_tune.engine.bench.kernels import _gb_per_s

    assert _gb_per_s(moved, ms) == shown


def test_every_result_row_ends_with_the_machine_facts():
    from moe_tune.engine.bench import load_op, steps
    from moe_tune.engine.bench.machine import MACHINE_KEYS, machine_info

    assert MACHINE_KEYS == ("device", "machine", "driver", "torch", "triton", "commit", "date", "launch")
    assert tuple(machine_info(is_cuda=False)) == MACHINE_KEYS
    for keys in (ROW_KEYS, steps.RESULT_KEYS, load_op.RESULT_KEYS):
        assert keys[-len(MACHINE_KEYS):] == MACHINE_KEYS and len(set(keys)) == len(keys)


@pytest.mark.parametrize(("proc_text", "smi_answer", "expected"), [
    ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n", None, "550.54.15"),
    ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.10  Release Build\n", None, "570.86.10"),
    (None, "560.35.03\n", "560.35.03"),  # no /proc file (a container): nvidia-smi answers
    ("NVRM version: something else\n", "535.1\n", "535.1"),  # a file that names no version: nvidia-smi
    (None, None, None),  # neither: unknown, not an error
    (None, "", None),
])
def test_driver_version_from_the_kernel_module_or_nvidia_smi(tmp_path, monkeypatch, proc_text, smi_answer, expected):
    import subprocess

    from moe_tune.engine.bench import machine

    proc = tmp_path / "version"
    if proc_text is not None:
        proc.write_text(proc_text)
    monkeypatch.setattr(machine, "NVIDIA_DRIVER_FILE", proc)

    def nvidia_smi(args, **kwargs):
        if smi_answer is None:
            raise FileNotFoundError("nvidia-smi")
        return subprocess.CompletedProcess(args, 0, stdout=smi_answer, stderr="")

    monkeypatch.setattr(subprocess, "run", nvidia_smi)
    assert machine.driver_version(is_cuda=True) == expected
    assert machine.driver_version(is_cuda=False) is None


def test_commit_outside_a_checkout_comes_from_the_environment(monkeypatch):
    import subprocess

    from moe_tune.engine.bench import machine

    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(subprocess, "run", no_git)
    monkeypatch.delenv("MOE_TUNE_COMMIT", raising=False)
    assert machine.commit() == "unknown"
    monkeypatch.setenv("MOE_TUNE_COMMIT", " 2dbb528 ")
    assert machine.commit() == "2dbb528"


def test_commit_named_in_the_environment_wins_over_git(monkeypatch):
    # A working tree copied onto another machine keeps stale git metadata: whoever copied it names the commit.
    import subprocess

    from moe_tune.engine.bench import machine

    def stale_git(args, **kwargs):
        answer = "a08730c\n" if args[:2] == ["git", "rev-parse"] else " M engine/model/varlen.py\n"
        return subprocess.CompletedProcess(args, 0, stdout=answer, stderr="")

    monkeypatch.setattr(subprocess, "run", stale_git)
    monkeypatch.delenv("MOE_TUNE_COMMIT", raising=False)
    assert machine.commit() == "a08730c+dirty"
    monkeypatch.setenv("MOE_TUNE_COMMIT", "3173e12")
    assert machine.commit() == "3173e12"


def test_rotary_entry_times_the_reference_on_cpu_with_its_bytes(no_cuda):
    (row,) = run_kernels(["rotary"], "T100,H3,D32,R16")[0]
    assert (row["op"], row["impl"], row["shape"], row["dtype"]) == (
        "rotary", "reference (torch small ops)", "T100 H3 D32 R16", "float32"
    )
    assert row["fwd_ms"] > 0 and row["fwd_bwd_ms"] > 0
    # fp32: x and y forward, dy and dx backward: 4 x 100 x 3 x 32 x 4 bytes.
    assert row["note"].startswith("moves at least 0.154 MB fwd+bwd (fwd ")


def test_rotary_spec_with_an_odd_rotary_dim_is_refused(no_cuda):
    with pytest.raises(ValueError, match=r"R must be even and <= D"):
        run_kernels(["rotary"], "T10,H1,D8,R3")


def test_swiglu_entry_times_the_reference_plain_and_scaled_on_cpu_with_its_bytes(no_cuda):
    rows = run_kernels(["swiglu"], "M100,F48")[0]
    assert [(row["op"], row["case"], row["impl"], row["shape"], row["dtype"]) for row in rows] == [
        ("swiglu", case, "reference (torch small ops)", "M100 F48", "float32") for case in ("plain", "scaled")
    ]
    for row in rows:
        assert row["fwd_ms"] > 0 and row["fwd_bwd_ms"] > 0
        # fp32: gate, up and h forward; gate, up, dh, dgate and dup backward: 8 x 100 x 48 x 4 bytes.
        assert row["note"].startswith("moves at least 0.154 MB fwd+bwd (fwd ")


def test_fp8_expert_rows_are_named_and_timed_without_torch_grouped_mm():
    # An FP8 row's case names its weights (else it reads as the bf16 row of the same shape), and torch._grouped_mm,
    # which has no block-scaled FP8 path, is not run on it; extra impls (a kernel variant) still are.
    from moe_tune.engine.bench.kernels import _moe_case
    from moe_tune.engine.bench.moe_op import FP8_SHAPES, IMPLS, shape_impls

    bf16, fp8 = (next(shape for shape in FP8_SHAPES if shape["fp8"] is flag) for flag in (False, True))
    assert _moe_case(bf16) == "uniform lora r16"
    assert _moe_case(fp8) == "uniform lora r16 fp8 weights"
    assert _moe_case(dict(routing="zipf", lora_rank=0, train_base=False)) == "zipf experts frozen"
    assert shape_impls(bf16, IMPLS) == list(IMPLS)
    assert shape_impls(fp8, (*IMPLS, "triton_variant")) == ["triton", "reference", "triton_variant"]


def test_lora_rows_carry_their_overhead_over_the_frozen_row():
    # Issue 7's LoRA target compares a LoRA row (experts frozen) with the frozen-expert row of the same shape and impl
    # without LoRA; trained-expert rows and rows of another shape or impl get no note.
    from moe_tune.engine.bench.kernels import lora_overhead_notes

    def result(impl, lora_rank, train_base, fwd_bwd_ms, E=64):
        return dict(N=16, D=8, F=4, E=E, k=2, routing="uniform", impl=impl, lora_rank=lora_rank,
                    train_base=train_base, fwd_bwd_ms=fwd_bwd_ms)  # fmt: skip

    results = [
        result("triton", 0, True, 13.0),
        result("triton", 16, False, 10.0),
        result("torch_grouped_mm", 16, False, 21.0),
        result("triton", 0, False, 8.0),
        result("torch_grouped_mm", 0, False, 16.0),
        result("triton", 16, False, 12.0, E=256),
    ]
    assert lora_overhead_notes(results) == [
        None,
        "fwd+bwd 1.250x the frozen-expert row without LoRA",
        "fwd+bwd 1.312x the frozen-expert row without LoRA",
        None,
        None,
        None,
    ]


@pytest.mark.parametrize("timed_by_turns", ["fp8", "bf16", "both"])
def test_fp8_and_bf16_lora_rows_of_one_shape_keep_their_own_overhead(timed_by_turns):
    # An FP8-weight LoRA row and the bf16-weight one of the same shape each get the ratio measured for their own
    # weights (by turns where it was, else from their single timings), never the other's.
    from moe_tune.engine.bench.kernels import lora_overhead_notes

    def result(lora_rank, fp8, fwd_bwd_ms):
        return dict(N=16, D=8, F=4, E=64, k=2, routing="uniform", impl="triton", lora_rank=lora_rank,
                    train_base=False, fp8=fp8, fwd_bwd_ms=fwd_bwd_ms)  # fmt: skip

    results = [result(0, False, 8.0), result(16, False, 9.0), result(16, True, 15.0), result(0, True, 14.0)]
    shape = dict(N=16, D=8, F=4, E=64, k=2, routing="uniform", lora_rank=16)
    turns = {
        False: dict(shape, fp8=False, lora_ms=9.2, frozen_ms=8.0, ratio=1.15, passes=8, pass_ratios=[1.1, 1.2]),
        True: dict(shape, fp8=True, lora_ms=15.0, frozen_ms=12.0, ratio=1.25, passes=8, pass_ratios=[1.2, 1.3]),
    }
    chosen = {"fp8": [True], "bf16": [False], "both": [False, True]}[timed_by_turns]
    notes = lora_overhead_notes(results, [turns[fp8] for fp8 in chosen])
    bf16_note = notes[1]
    assert notes[0] is None and notes[2:] == [
        "fwd+bwd 1.250x frozen experts without LoRA (15.00 against 12.00 ms, medians of 8 passes timing the two by "
        "turns; per pass 1.200-1.300x)" if True in chosen else None,
        None,
    ]
    if False in chosen:
        assert bf16_note.startswith("fwd+bwd 1.150x frozen experts without LoRA (9.20 against 8.00 ms")
    else:
        assert bf16_note == "fwd+bwd 1.125x the frozen-expert row without LoRA"


def test_moe_cuda_rows_carry_each_shapes_peak_and_the_lora_note(monkeypatch):
    # The CUDA path without a GPU: bench_moe and the peak-memory probes stubbed, one call per shape.
    from moe_tune.engine.bench import kernels as bench_kernels
    from moe_tune.engine.bench import moe_op as moe_bench

    shapes = [dict(N=16, D=8, F=4, E=4, k=2, routing="uniform", lora_rank=rank, train_base=False) for rank in (0, 16)]
    peaks = iter([100, 200])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: next(peaks))
    fwd_bwd = {0: 8.0, 16: 9.6}
    monkeypatch.setattr(moe_bench, "bench_moe", lambda shape_list: [
        dict(shape_list[0], impl="triton", dtype="bfloat16", max_over_mean_load=1.0, fwd_ms=1.0,
             fwd_bwd_ms=fwd_bwd[shape_list[0]["lora_rank"]]),
    ])  # fmt: skip
    monkeypatch.setattr(bench_kernels, "MOE_SHAPES", {"anchor": shapes})
    measured = []

    def lora_overhead(shape):
        measured.append(shape)
        return dict(shape, lora_ms=11.5, frozen_ms=10.0, ratio=1.15, passes=8, pass_ratios=[1.14, 1.24, 1.15])

    monkeypatch.setattr(moe_bench, "lora_overhead", lora_overhead)
    run = bench_kernels.RunContext(is_cuda=True, peaks=bench_kernels.Peaks(None, None), machine={})
    rows = bench_kernels.bench_moe_op("anchor", run)
    assert [row["peak_memory_bytes"] for row in rows] == [100, 200]
    # Only the LoRA shape is measured by turns, and its note gives that ratio, not the single timings' 1.200x.
    assert measured == shapes[1:]
    assert "frozen" not in rows[0]["note"].replace("expert weights frozen", "")
    assert rows[1]["note"].endswith(
        "fwd+bwd 1.150x frozen experts without LoRA (11.50 against 10.00 ms, medians of 8 passes timing the two by "
        "turns; per pass 1.140-1.240x)"
    )


def test_alternating_times_calls_the_timers_by_turns():
    from moe_tune.engine.bench.moe_op import alternating_times

    calls = []

    def timer(name, values):
        values = iter(values)

        def call():
            calls.append(name)
            return next(values)

        return call

    times = alternating_times({"lora": timer("lora", [3.0, 5.0, 4.0]), "frozen": timer("frozen", [2.0, 2.5, 1.0])}, 3)
    assert calls == ["lora", "frozen"] * 3
    assert times == {"lora": [3.0, 5.0, 4.0], "frozen": [2.0, 2.5, 1.0]}
    with pytest.raises(ValueError, match=r"passes \(0\) must be at least 1"):
        alternating_times({"lora": timer("lora", [])}, 0)


def test_lora_overhead_refuses_a_shape_without_lora():
    from moe_tune.engine.bench.moe_op import lora_overhead

    with pytest.raises(ValueError, match=r"lora_rank \(0\) must be positive"):
        lora_overhead(dict(N=16, D=8, F=4, E=4, k=2, routing="uniform", lora_rank=0))


@pytest.mark.parametrize("with_backward", [False, True], ids=["fwd", "fwd_bwd"])
def test_time_pass_takes_do_bench_median_and_the_peak_of_one_more_call(monkeypatch, with_backward):
    # The CUDA timer without a GPU: do_bench and the allocator's counters are stood in for.
    import triton.testing

    from moe_tune.engine.bench import timing

    calls, backwards, allocated = [], [], {"now": 1000, "peak": 0}

    def fake_do_bench(fn, grad_to_none=None, return_mode="mean", **kwargs):
        assert return_mode == "median" and grad_to_none == [x]
        for _ in range(3):
            fn()
        return 1.25

    def fake_call_ms(step, leaves):
        # One timed call, faster than timing.SLOW_STEP_MS: do_bench times the rest.
        assert leaves == [x]
        step()
        return timing.SLOW_STEP_MS / 10

    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    monkeypatch.setattr(timing, "call_ms", fake_call_ms)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: allocated.update(peak=allocated["now"]))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: allocated["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: allocated["peak"])
    x = torch.randn(4, 3, requires_grad=True)
    x.register_hook(lambda grad: backwards.append(grad.shape))

    def fn():
        calls.append(torch.is_grad_enabled())
        allocated["peak"] = max(allocated["peak"], allocated["now"] + 48)
        return x * 2

    ms, peak, out = timing.time_pass(fn, [x], with_backward)
    assert ms == 1.25 and peak == 48 and torch.equal(out, x.detach() * 2)
    # One untimed forward under no_grad (the output, the gradient's shape), a warm-up call, one timed call (fast: on
    # to do_bench), do_bench's three, one for the peak.
    assert calls == [False] + [True] * 6
    assert len(backwards) == (6 if with_backward else 0) and x.grad is None


@pytest.mark.parametrize("is_cuda", [False, True], ids=["cpu", "cuda"])
def test_step_clock_synchronizes_at_both_ends_and_times_nothing_that_failed(monkeypatch, is_cuda):
    from moe_tune.engine.bench import timing

    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: events.append("sync"))
    ticks = iter([10.0, 12.5, 20.0])
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(ticks))
    with timing.StepClock(is_cuda) as clock:
        events.append("step")
    assert clock.seconds == 2.5
    assert events == (["sync", "step", "sync"] if is_cuda else ["step"])
    with pytest.raises(RuntimeError, match="out of memory"):
        with timing.StepClock(is_cuda) as failed:
            raise RuntimeError("CUDA out of memory")
    assert failed.seconds is None


def test_each_op_is_handed_over_as_soon_as_it_is_measured_with_its_wall_seconds(no_cuda, monkeypatch):
    # A fake slow op: its rows must reach on_op before the next op starts, with at least the time it slept.
    events = []

    def fake(name, seconds):
        def bench(shapes, run):
            events.append(("start", name))
            time.sleep(seconds)
            return [dict(op=name, shapes=shapes)]

        return bench

    monkeypatch.setitem(OPS, "rotary", fake("rotary", 0.05))
    monkeypatch.setitem(OPS, "rms_norm", fake("rms_norm", 0.0))
    rows, _, _ = run_kernels(["rotary", "rms_norm"], on_op=lambda name, op_rows, s: events.append((name, op_rows, s)))
    assert rows == [dict(op="rotary", shapes="small"), dict(op="rms_norm", shapes="small")]
    assert [event[:2] for event in events] == [
        ("start", "rotary"), ("rotary", rows[:1]), ("start", "rms_norm"), ("rms_norm", rows[1:])
    ]  # fmt: skip
    assert events[1][2] >= 0.05 and events[3][2] < 0.05


def _cuda_run(reports: list):
    """A RunContext that takes the CUDA path and keeps what its entry reports."""
    from moe_tune.engine.bench.kernels import Peaks, RunContext
    from moe_tune.engine.bench.machine import machine_info

    return RunContext(is_cuda=True, peaks=Peaks(), machine=machine_info(False), report=reports.append)


def _sparse_result(case, impl="moe_tune triton"):
    return dict(case=case, impl=impl, shape="S", dtype="bfloat16", fwd_ms=1.0)


@pytest.mark.parametrize("preset", ["small", "anchor"])
def test_cuda_sparse_entries_report_each_case_as_it_is_timed(monkeypatch, preset):
    # No GPU needed: the per-op benches are replaced; what is checked is that the entries time one case per call
    # and report the rows so far after each, every case once, in order.
    from moe_tune.engine.bench import kernels, sparse_attention_op

    calls = []

    def fake_attention(cases, **shape):
        calls.append(("attention", [case[0] for case in cases], shape))
        return [_sparse_result(case[0], impl) for case in cases for impl in ("moe_tune triton", "sdpa")]

    def fake_indexer(cases, **shape):
        calls.append(("indexer", [case[0] for case in cases], shape))
        return [_sparse_result(f"{case[0]} {shape.get('num_heads')}") for case in cases]

    monkeypatch.setattr(sparse_attention_op, "bench_sparse_attention", fake_attention)
    monkeypatch.setattr(sparse_attention_op, "bench_topk_indexer", fake_indexer)
    reports = []
    rows = kernels.bench_sparse_attention_op(preset, _cuda_run(reports))
    cases = kernels.SPARSE_ATTENTION_CUDA_SMALL["cases"] if preset == "small" else sparse_attention_op.ATTENTION_CASES
    assert [call[1] for call in calls] == [[case[0]] for case in cases]
    assert [len(report) for report in reports] == [2 * (i + 1) for i in range(len(cases))]
    assert reports[-1] == rows and len(rows) == 2 * len(cases)

    calls.clear()
    reports.clear()
    rows = kernels.bench_topk_indexer_op(preset, _cuda_run(reports))
    if preset == "small":
        expected = [[case[0]] for case in kernels.TOPK_INDEXER_CUDA_SMALL["cases"]]
    else:
        expected = [[case[0]] for _ in kernels.TOPK_INDEXER_ANCHOR_HEADS for case in sparse_attention_op.INDEXER_CASES]
    assert [call[1] for call in calls] == expected
    assert [len(report) for report in reports] == list(range(1, len(expected) + 1))
    assert reports[-1] == rows
    if preset == "anchor":
        heads = [call[2]["num_heads"] for call in calls]
        assert heads == [h for h in kernels.TOPK_INDEXER_ANCHOR_HEADS for _ in sparse_attention_op.INDEXER_CASES]


def test_cuda_moe_entry_reports_each_shape_and_adds_the_lora_ratio_at_the_end(monkeypatch):
    from moe_tune.engine.bench import kernels, moe_op

    # The frozen-expert shape and its LoRA twin, each timed by its own bench_moe call.
    shapes = [dict(N=8, D=4, F=2, E=2, k=1, routing="uniform", lora_rank=rank, train_base=False) for rank in (0, 16)]

    def fake_bench(shape_list):
        (shape,) = shape_list
        return [dict(shape, impl="reference", dtype="bfloat16", max_over_mean_load=1.0, fwd_ms=1.0,
                     fwd_bwd_ms=2.0 if not shape["lora_rank"] else 2.2)]  # fmt: skip

    monkeypatch.setattr(moe_op, "bench_moe", fake_bench)
    monkeypatch.setattr(moe_op, "lora_overhead", lambda shape: None)
    monkeypatch.setattr(kernels, "lora_overhead_notes", lambda results, alternating: [None, "the ratio"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 0)
    reports = []
    monkeypatch.setitem(kernels.MOE_SHAPES, "anchor", shapes)
    rows = kernels.bench_moe_op("anchor", _cuda_run(reports))
    assert [len(report) for report in reports] == [1, 2]
    # The reported rows are the final ones but for the note the end adds.
    assert [report["note"] for report in reports[-1]] == [row["note"].removesuffix("; the ratio") for row in rows]
    assert rows[1]["note"].endswith("; the ratio") and not reports[-1][1]["note"].endswith("the ratio")


def test_cuda_fp8_entry_reports_each_shape(monkeypatch):
    from moe_tune.engine.bench import fp8_op, kernels

    calls = []

    def fake_bench(shapes):
        calls.append([(shape["I"], shape["O"]) for shape in shapes])
        return [dict(impl=impl, shape=f"M{shape['M']}", dtype="bfloat16", fwd_ms=1.0, fwd_bwd_ms=2.0, fwd_tflops=1.0,
                     fwd_bwd_tflops=1.0, rel_err_exact=1e-3) for shape in shapes for impl in ("triton", "torch_bf16")]

    monkeypatch.setattr(fp8_op, "bench_fp8_linear", fake_bench)
    reports = []
    rows = kernels.bench_fp8_linear_op("anchor", _cuda_run(reports))
    assert calls == [[(shape["I"], shape["O"])] for shape in fp8_op.DEFAULT_SHAPES]
    assert [len(report) for report in reports] == [2, 4, 6]
    assert reports[-1] == rows


def test_cuda_linear_attention_entries_time_their_own_cases_and_report_each_row(monkeypatch):
    from moe_tune.engine.bench import kernels, linear_attention_op

    calls = []

    def fake_bench(cases=linear_attention_op.CASES, report=lambda rows: None, **shape):
        calls.append((cases, shape))
        results = []
        for case in cases:
            results.append(dict(case=case, impl="moe_tune triton", shape="S", dtype="bfloat16", fwd_ms=1.0,
                                max_abs_err=1e-3))  # fmt: skip
            report(list(results))
        return results

    monkeypatch.setattr(linear_attention_op, "bench_linear_attention", fake_bench)
    reports = []
    gdn_rows = kernels.OPS["gated_delta_rule"]("anchor", _cuda_run(reports))
    kda_rows = kernels.OPS["kda"](dict(B=1, T=64, H=2, K=16, V=16), _cuda_run(reports))
    assert calls == [
        (("gdn", "varlen"), {}),
        (("kda",), dict(batch_size=1, seq_len=64, num_heads=2, head_dim_k=16, head_dim_v=16)),
    ]
    assert [(row["op"], row["case"], row["note"]) for row in gdn_rows + kda_rows] == [
        ("gated_delta_rule", "gdn", "max abs err 1.0e-03"), ("gated_delta_rule", "varlen", "max abs err 1.0e-03"),
        ("kda", "kda", "max abs err 1.0e-03"),
    ]  # fmt: skip
    assert reports == [gdn_rows[:1], gdn_rows, kda_rows]
