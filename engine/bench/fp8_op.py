"""Benchmark of the dense FP8 linear on CUDA: ops.fp8's kernel path against bf16 F.linear (cuBLAS) on the same shapes.

Shapes: M rows (tokens), I in_features, O out_features; the weight is frozen in every impl (a LoRA or frozen-base
fine-tune), so forward+backward is the forward and the input gradient.

`bench_fp8_linear(shapes)` runs on the GPU (nothing runs at import); `python -m moe_tune.engine.bench.fp8_op` times
DEFAULT_SHAPES and prints one JSON line per row. Implementations:
  triton      ops.fp8's Fp8LinearFunction: the FP8 weight dequantized into x's dtype by the Triton kernel, then
              cuBLAS (forward; backward dequantizes again for dx = dy @ deq(W))
  torch_bf16  F.linear on the bf16 weight (cuBLAS), what a bf16 base runs
Times are medians of triton.testing.do_bench. FLOPs: 2*M*I*O forward, twice that forward+backward. Each row carries
its error against the exact product fp32 x @ deq(W)^T (rel_err_exact) and, for triton rows, against fp8_linear_ref
(rel_err_ref: the kernel path's own error); both relative to the largest reference value, forward output and dx.
"""

from __future__ import annotations

import json
from typing import Callable

import torch
import torch.nn.functional as F_nn

from moe_tune.engine.bench.machine import machine_info
from moe_tune.engine.bench.timing import median_ms

# The frozen projections of issue 35's 30B-A3B (hidden 2048) over B1 T8192: q (2048 -> 4096), o (4096 -> 2048),
# and an expert-width projection (2048 -> 768).
DEFAULT_SHAPES = (dict(M=8192, I=2048, O=4096), dict(M=8192, I=4096, O=2048), dict(M=8192, I=2048, O=768))
IMPLS = ("triton", "torch_bf16")


def bench_fp8_linear(
    shapes: list[dict] | tuple[dict, ...] = DEFAULT_SHAPES,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    rep_ms: int = 100,
) -> list[dict]:
    """One dict per (shape, impl): M, I, O, shape, impl, dtype, fwd_ms, fwd_bwd_ms, fwd_tflops, fwd_bwd_tflops,
    rel_err_exact, rel_err_ref (triton rows), and machine_info's keys (device, machine, driver, torch, triton, commit,
    date)."""
    from moe_tune.ops.fp8 import dequantize_weight, fp8_linear_ref, quantize_weight
    from moe_tune.ops.fp8.autograd import Fp8LinearFunction

    if not torch.cuda.is_available():
        raise RuntimeError("bench_fp8_linear needs a CUDA device")
    machine = machine_info(is_cuda=True)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    results = []
    for shape in shapes:
        M, I, O = shape["M"], shape["I"], shape["O"]
        x = torch.randn(M, I, generator=gen, device="cuda").to(dtype).requires_grad_()
        w = torch.randn(O, I, generator=gen, device="cuda") * I**-0.5
        w_q, scale_inv = quantize_weight(w)
        w_deq = dequantize_weight(w_q, scale_inv)
        w_bf16 = w_deq.to(dtype)
        grad_y = torch.randn(M, O, generator=gen, device="cuda").to(dtype)
        y_exact, dx_exact = x.detach().float() @ w_deq.T, grad_y.float() @ w_deq
        x32 = x.detach().float().requires_grad_()
        y_ref, dx_ref = _forward_backward(lambda: fp8_linear_ref(x32, w_q, scale_inv), x32, grad_y.float())

        def fp8_fn(x=x, w_q=w_q, scale_inv=scale_inv):
            return Fp8LinearFunction.apply(x, w_q, scale_inv, None)

        impls: dict[str, Callable[[], torch.Tensor]] = {
            "triton": fp8_fn,
            "torch_bf16": lambda: F_nn.linear(x, w_bf16),
        }
        fwd_flops = 2 * M * I * O
        for impl, fn in impls.items():
            y, dx = _forward_backward(fn, x, grad_y)
            row = dict(M=M, I=I, O=O, shape=f"M{M} I{I} O{O}", impl=impl, dtype=str(dtype).removeprefix("torch."))
            row["rel_err_exact"] = max(_rel_err(y, y_exact), _rel_err(dx, dx_exact))
            if impl == "triton":
                row["rel_err_ref"] = max(_rel_err(y, y_ref), _rel_err(dx, dx_ref))

            def step(fn=fn, with_backward=False):
                y = fn()
                if with_backward:
                    y.backward(grad_y)

            row["fwd_ms"] = median_ms(step, rep_ms=rep_ms)
            row["fwd_bwd_ms"] = median_ms(lambda: step(with_backward=True), [x], rep_ms)
            row["fwd_tflops"] = fwd_flops / row["fwd_ms"] * 1e-9
            row["fwd_bwd_tflops"] = 2 * fwd_flops / row["fwd_bwd_ms"] * 1e-9
            results.append(row | machine)
        del x, x32, w, w_q, w_deq, w_bf16, grad_y, y_exact, dx_exact, y_ref, dx_ref
        torch.cuda.empty_cache()
    return results


def _forward_backward(fn, x: torch.Tensor, grad_y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, dx) of one call, in fp32."""
    x.grad = None
    y = fn()
    y.backward(grad_y)
    dx = x.grad.float()
    x.grad = None
    return y.detach().float(), dx


def _rel_err(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float((value.float() - reference).abs().max() / reference.abs().max().clamp_min(1e-12))


def main() -> None:
    for row in bench_fp8_linear():
        print(json.dumps(row))


if __name__ == "__main__":
    main()
