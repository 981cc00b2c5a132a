"""engine/bench/moe_op.py's FP8 rows without a GPU: the shapes they time and the `--fp8` entry point (bench_moe
stubbed), which prints each FP8 row's fwd+bwd over its bf16 row."""

import pytest

from moe_tune.engine.bench import moe_op


def test_fp8_shapes_pair_each_fp8_row_with_its_bf16_row():
    # Issue 35's target shapes: E64 top-8 F1024 and E512 top-10 F512 at N16384 D2048, LoRA r16, experts frozen.
    keys = {
        (s["N"], s["D"], s["F"], s["E"], s["k"], s["lora_rank"], s["train_base"], s["fp8"]) for s in moe_op.FP8_SHAPES
    }
    assert keys == {
        (16384, 2048, f, e, k, 16, False, fp8) for f, e, k in ((1024, 64, 8), (512, 512, 10)) for fp8 in (False, True)
    }


# The default run times DEFAULT_SHAPES with every impl (bench_moe's defaults); --fp8 the FP8 shapes, kernels only.
@pytest.mark.parametrize("argv, expected_call", [([], ()), (["--fp8"], ((moe_op.FP8_SHAPES,), {"impls": ("triton",)}))])
def test_main_fp8_times_the_fp8_shapes_and_prints_their_ratios(monkeypatch, capsys, argv, expected_call):
    calls = []

    def bench_moe(*args, **kwargs):
        calls.append((args, kwargs))
        return [
            dict(shape, impl="triton", dtype="bfloat16", max_over_mean_load=1.0, fwd_ms=1.0 + shape["fp8"],
                 fwd_bwd_ms=4.0 if shape["fp8"] else 8.0, correct=True, rel_error=0.0)
            for shape in moe_op.FP8_SHAPES
        ]  # fmt: skip

    monkeypatch.setattr(moe_op, "bench_moe", bench_moe)
    monkeypatch.setattr(moe_op, "format_results", lambda results: f"{len(results)} rows")
    monkeypatch.setattr(moe_op, "lora_overhead", lambda shape: pytest.fail("no LoRA overhead rows here"))
    moe_op.main(argv)
    assert calls == [expected_call or ((), {})]
    out = capsys.readouterr().out
    assert out.startswith("4 rows\n")
    assert "E64 top-8 F1024 LoRA r16: FP8 experts fwd+bwd 4.00 ms over bf16 8.00 ms = 0.500x" in out
    assert "E512 top-10 F512 LoRA r16: FP8 experts fwd+bwd 4.00 ms over bf16 8.00 ms = 0.500x" in out
