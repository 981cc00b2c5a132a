"""Linear attention with a recurrent state: the gated delta rule and its per-channel decay variant (KDA).

Shapes: B batch, T tokens, H heads, K key dim, V value dim, N sequences (B, or len(cu_seqlens) - 1 when packed).
The math is in README.md; the ground truth in reference.py.
"""

from __future__ import annotations

import torch

from moe_tune.ops.common.dispatch import kernel_mode, use_kernel
from moe_tune.ops.common.host_copy import host_values
from moe_tune.ops.linear_attention.reference import chunk_gated_delta_rule_ref, kda_gate_ref

__all__ = ["KERNEL_MAX_KEY_DIM", "gated_delta_rule", "kda"]

# What the Triton kernels cover; anything else runs the reference (or raises under MOE_TUNE_KERNELS=triton).
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# A program holds whole key rows in one tile: past 256 the [C, K] fp32 tiles of the backward spill registers.
KERNEL_MAX_KEY_DIM = 256
# The options the kernels implement; an option added to the public functions runs the reference whenever it is set
# (not None or False) until the kernels learn it.
_KERNEL_OPTIONS = (
    "scale", "initial_state", "output_final_state", "cu_seqlens", "use_qk_l2norm", "A_log", "dt_bias",
    "save_intermediates",
)  # fmt: skip


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    save_intermediates: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule: per head, S_t = exp(g_t) S_{t-1}; S_t += beta_t k_t (v_t - S_t^T k_t)^T; o_t = scale S_t^T q_t.

    Args:
        q: [B, T, H, K] bf16/fp16/fp32 queries.
        k: [B, T, H, K] same dtype as q, keys (L2-normalised, or pass use_qk_l2norm_in_kernel=True).
        v: [B, T, H, V] same dtype as q, values; V may differ from K.
        g: [B, T, H] fp32 or q's dtype, log decay per head and token, <= 0 (not checked per element).
        beta: [B, T, H] fp32 or q's dtype, write strength in (0, 1).
        scale: output scale, default K ** -0.5.
        initial_state: [N, H, K, V] fp32 state entering each sequence, default zeros.
        output_final_state: also return the state after each sequence's last token.
        cu_seqlens: [N + 1] int32/int64 starts of packed sequences (0, ..., T), only with B == 1; the state
            restarts from that sequence's initial_state at every start, so no token sees another document.
        use_qk_l2norm_in_kernel: L2-normalise q and k over K first (eps 1e-6).
        save_intermediates: kernel path only (the reference ignores it): keep the forward's WY factors, per-chunk
            states and v_new (and the reverse pass's prepared operands) for backward instead of recomputing them
            there: backward skips up to three passes (docs/PERF.md has the times) for about (2C + 3K + V) T H
            16-bit values plus the [NC, H, K, V] states per call held until backward (C = 64, NC ~ T / 64).

    Returns:
        o: [B, T, H, V] in q's dtype.
        final_state: [N, H, K, V] fp32, or None unless output_final_state.
    """
    _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, is_per_channel=False)
    return _apply(
        "gated_delta_rule",
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        use_qk_l2norm=use_qk_l2norm_in_kernel,
        save_intermediates=save_intermediates,
    )


def kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    save_intermediates: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kimi delta attention: the gated delta rule with one decay per key channel, S_t = diag(exp(g_t)) S_{t-1}.

    Args and returns as in `gated_delta_rule`, except
        g: [B, T, H, K] fp32 or q's dtype, log decay per key channel and token, <= 0 (not checked per element);
            with use_gate_in_kernel, the raw gate a instead.
        use_gate_in_kernel: the log decay is -exp(A_log[h]) * softplus(a + dt_bias[h, :]), computed inside the
            kernels (the WY pass; the gradient kernel returns da, dA_log and ddt_bias), as flash-linear-attention's
            chunk_kda does: no [B, T, H, K] pass of the gate activation on either side.
        A_log: [H] float (with use_gate_in_kernel).
        dt_bias: [H * K] or [H, K] float (with use_gate_in_kernel).
        save_intermediates: as in `gated_delta_rule`; KDA also keeps its decayed q k^T and k k^T ([T, H, C] each).
    """
    _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, is_per_channel=True)
    _check_gate(q, use_gate_in_kernel, A_log, dt_bias)
    if not use_gate_in_kernel:
        A_log = dt_bias = None
    return _apply(
        "kda",
        q,
        k,
        v,
        g,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        use_qk_l2norm=use_qk_l2norm_in_kernel,
        A_log=A_log,
        dt_bias=dt_bias,
        save_intermediates=save_intermediates,
    )


def _check_gate(q, use_gate_in_kernel, A_log, dt_bias):
    """ValueError naming A_log or dt_bias, its shape and the rule, when they do not fit use_gate_in_kernel."""
    if not use_gate_in_kernel:
        if A_log is not None or dt_bias is not None:
            raise ValueError("A_log, dt_bias: given without use_gate_in_kernel=True (g is already the log decay)")
        return
    H, K = q.shape[2], q.shape[3]
    for name, x, shapes in (("A_log", A_log, [(H,)]), ("dt_bias", dt_bias, [(H * K,), (H, K)])):
        if x is None:
            raise ValueError(f"{name}: required with use_gate_in_kernel=True")
        if tuple(x.shape) not in shapes:
            raise ValueError(f"{name}: shape {tuple(x.shape)} must be {' or '.join(str(list(s)) for s in shapes)}")
        if not x.is_floating_point():
            raise ValueError(f"{name}: dtype {x.dtype} must be floating point")
        if x.device != q.device:
            raise ValueError(f"{name}: device {x.device} must match q ({q.device})")


def _apply(op_name, q, k, v, g, beta, **options):
    """The dispatch point of both ops: Triton kernel or the chunked reference."""
    has_kernel = (
        q.dtype in _KERNEL_DTYPES
        and q.shape[-1] <= KERNEL_MAX_KEY_DIM
        # The interpreter's tl.dot returns garbage for bf16 operands (numpy has no bf16), and q sets the operand dtype.
        and (q.is_cuda or q.dtype != torch.bfloat16)
        and all(name in _KERNEL_OPTIONS or value is None or value is False for name, value in options.items())
    )
    if q.is_cuda and q.dtype == torch.float32 and kernel_mode() != "triton":
        # The kernels multiply fp32 operands as 3xTF32 (kernels_common.FP32_DOTS: close to, not exactly, fp32
        # products), where the reference's are exact. Training runs in bf16; fp32 on a GPU runs the reference unless
        # forced.
        has_kernel = False
    if use_kernel(op_name, q, k, v, has_kernel=has_kernel):
        # Imported on use: Triton is a Linux-only dependency, and the reference path must import without it.
        from moe_tune.ops.linear_attention.autograd import gated_delta_rule_kernel

        kernel_options = {name: value for name, value in options.items() if name in _KERNEL_OPTIONS}
        return gated_delta_rule_kernel(q, k, v, g, beta, **kernel_options)
    # Nothing to save or recompute on the reference path: autograd keeps its small ops' own tensors.
    options.pop("save_intermediates", None)
    A_log, dt_bias = options.pop("A_log", None), options.pop("dt_bias", None)
    if A_log is not None:
        g = kda_gate_ref(g, A_log, dt_bias)
    return chunk_gated_delta_rule_ref(q, k, v, g, beta, **options)


def _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, is_per_channel):
    """ValueError naming the tensor, its shape and the rule, on the first input that breaks one."""
    if q.ndim != 4:
        raise ValueError(f"q: shape {tuple(q.shape)} must be [B, T, H, K]")
    if not q.is_floating_point():
        raise ValueError(f"q: dtype {q.dtype} must be floating point")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k: shape {tuple(k.shape)} must match q {tuple(q.shape)}")
    if v.ndim != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v: shape {tuple(v.shape)} must be [B, T, H, V] with B, T, H of q {tuple(q.shape)}")
    if is_per_channel and g.shape != q.shape:
        raise ValueError(f"g: shape {tuple(g.shape)} must be [B, T, H, K] {tuple(q.shape)}: kda decays per key channel")
    if not is_per_channel and g.shape != q.shape[:3]:
        raise ValueError(
            f"g: shape {tuple(g.shape)} must be [B, T, H] {(B, T, H)}: one decay per head (per channel: use kda)"
        )
    if beta.shape != q.shape[:3]:
        raise ValueError(f"beta: shape {tuple(beta.shape)} must be [B, T, H] {(B, T, H)}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise ValueError(f"{name}: dtype {x.dtype} must match q ({q.dtype})")
    for name, x in (("g", g), ("beta", beta)):
        if not x.is_floating_point():
            raise ValueError(f"{name}: dtype {x.dtype} must be floating point")
    for name, x in (("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state)):
        if x is not None and x.device != q.device:
            raise ValueError(f"{name}: device {x.device} must match q ({q.device})")

    num_seqs = B
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"cu_seqlens requires B == 1 (sequences packed along T), got q {tuple(q.shape)}")
        if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens: shape {tuple(cu_seqlens.shape)} must be [N + 1] with N >= 1")
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"cu_seqlens: dtype {cu_seqlens.dtype} must be int32 or int64")
        # The batch's host copy (ops/common/host_copy.py): no wait for the device, once per batch at most.
        bounds = host_values(cu_seqlens).tolist()
        if bounds[0] != 0 or bounds[-1] != T:
            raise ValueError(f"cu_seqlens: must start at 0 and end at T ({T}), got {bounds[0]} ... {bounds[-1]}")
        if any(end < start for start, end in zip(bounds[:-1], bounds[1:])):
            raise ValueError(f"cu_seqlens: must never decrease, got {bounds}")
        num_seqs = len(bounds) - 1

    if initial_state is not None and initial_state.shape != (num_seqs, H, K, v.shape[-1]):
        raise ValueError(
            f"initial_state: shape {tuple(initial_state.shape)} must be [N, H, K, V] {(num_seqs, H, K, v.shape[-1])}"
        )
