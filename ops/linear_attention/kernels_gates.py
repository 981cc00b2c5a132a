"""The Triton kernels of `gates.gdn_gates` and their autograd Function (gates.py has the public op, its checks and the
reference; the math is in README.md, "Gates of the per-head rule").

Legend: M rows (every leading dim of a flattened: tokens), H heads, P programs (one [BLOCK_M, H] tile each).
a, b, g, beta, da, db are [M, H] with rows contiguous; A_log, dt_bias [H]; the parameter gradients' per-program
partial sums [2, P, H] fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_tune.ops.linear_attention.gates import SOFTPLUS_THRESHOLD

# Elements of one [BLOCK_M, BLOCK_H] tile: 8 fp32 values a thread at 4 warps. An 8k-token row of 32 heads makes 256
# programs, about two per H200 SM; the op moves about 3 MB there, so its time is mostly the launch's.
TILE_ELEMENTS = 1024
NUM_WARPS = 4


class GDNGatesFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, A_log, dt_bias):
        num_heads = a.shape[-1]
        a_MH = a.reshape(-1, num_heads).contiguous()
        b_MH = b.reshape(-1, num_heads).contiguous()
        A_log, dt_bias = A_log.contiguous(), dt_bias.contiguous()
        g_MH, beta_MH = gdn_gates_fwd(a_MH, b_MH, A_log, dt_bias)
        # The 16-bit inputs, not the fp32 outputs: backward recomputes the gates from them.
        ctx.save_for_backward(a_MH, b_MH, A_log, dt_bias)
        ctx.shape = a.shape
        return g_MH.view(a.shape), beta_MH.view(a.shape)

    @staticmethod
    def backward(ctx, grad_g, grad_beta):
        a_MH, b_MH, A_log, dt_bias = ctx.saved_tensors
        needs_params = ctx.needs_input_grad[2] or ctx.needs_input_grad[3]
        dg_MH = grad_g.reshape(a_MH.shape).contiguous()
        dbeta_MH = grad_beta.reshape(b_MH.shape).contiguous()
        da_MH, db_MH, dparams_2H = gdn_gates_bwd(dg_MH, dbeta_MH, a_MH, b_MH, A_log, dt_bias, needs_params)
        if dparams_2H is not None and A_log.dtype == dt_bias.dtype:
            # One cast for both (none for fp32 parameters): launches are what this op saves.
            dparams_2H = dparams_2H.to(A_log.dtype)
        dA_log = dparams_2H[0].to(A_log.dtype) if ctx.needs_input_grad[2] else None
        ddt_bias = dparams_2H[1].to(dt_bias.dtype) if ctx.needs_input_grad[3] else None
        return da_MH.view(ctx.shape), db_MH.view(ctx.shape), dA_log, ddt_bias


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every kernel output buffer comes from here (tests swap in guarded, NaN-filled buffers)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _block_sizes(num_heads: int) -> tuple[int, int]:
    """(BLOCK_M rows, BLOCK_H heads) of one program's tile."""
    block_h = triton.next_power_of_2(num_heads)
    return max(1, TILE_ELEMENTS // block_h), block_h


def gdn_gates_fwd(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b: [M, H] contiguous; A_log, dt_bias: [H] contiguous. Returns g, beta: [M, H] fp32."""
    num_rows, num_heads = a.shape
    g = _alloc((num_rows, num_heads), torch.float32, a.device)
    beta = _alloc((num_rows, num_heads), torch.float32, a.device)
    if num_rows == 0:
        return g, beta
    block_m, block_h = _block_sizes(num_heads)
    _gdn_gates_fwd_kernel[(triton.cdiv(num_rows, block_m),)](
        a, b, A_log, dt_bias, g, beta, num_rows, num_heads,
        THRESHOLD=SOFTPLUS_THRESHOLD, BLOCK_M=block_m, BLOCK_H=block_h, num_warps=NUM_WARPS,
    )  # fmt: skip
    return g, beta


def gdn_gates_bwd(
    dg: torch.Tensor,
    dbeta: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    needs_params: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """dg, dbeta: [M, H] contiguous (any float dtype); a, b, A_log, dt_bias as in the forward. Returns da [M, H]
    (a's dtype), db [M, H] (b's dtype), and with needs_params [dA_log, ddt_bias] as one [2, H] fp32 tensor (else
    None)."""
    num_rows, num_heads = a.shape
    da = _alloc((num_rows, num_heads), a.dtype, a.device)
    db = _alloc((num_rows, num_heads), b.dtype, b.device)
    if num_rows == 0:
        return da, db, torch.zeros(2, num_heads, dtype=torch.float32, device=a.device) if needs_params else None
    block_m, block_h = _block_sizes(num_heads)
    num_programs = triton.cdiv(num_rows, block_m)
    # One row of H sums per tile, not a loop over rows per program: 8 / (12 BLOCK_M) of the bytes the kernel reads
    # (16-bit a, b; fp32 dg, dbeta), and the kernel keeps a plain one-tile grid.
    partial = _alloc((2, num_programs, num_heads), torch.float32, a.device) if needs_params else None
    _gdn_gates_bwd_kernel[(num_programs,)](
        a, b, A_log, dt_bias, dg, dbeta, da, db, partial if partial is not None else da,
        num_rows, num_heads, num_programs,
        HAS_PARAM_GRADS=needs_params, THRESHOLD=SOFTPLUS_THRESHOLD,
        BLOCK_M=block_m, BLOCK_H=block_h, num_warps=NUM_WARPS,
    )  # fmt: skip
    # One launch adds up both parameters' partial sums (a fixed order: deterministic).
    return da, db, partial.sum(1) if partial is not None else None


@triton.jit
def _log1p(u):
    """log(1 + u) for u >= 0 to a few ulp (Goldberg's trick; the interpreter has no libdevice log1p): u itself where
    1 + u rounds to 1 (u < 6e-8: u^2 / 2 is below its last bit), elsewhere log(w) scaled by u / (w - 1), which
    cancels the rounding of w = 1 + u."""
    w = 1.0 + u
    d = w - 1.0
    return tl.where(d == 0.0, u, tl.log(w) * (u / tl.where(d == 0.0, 1.0, d)))


@triton.jit
def _softplus_parts(x, THRESHOLD: tl.constexpr):
    """(softplus(x), its derivative) as torch computes them: x and 1 above THRESHOLD, else log1p(e) and e / (e + 1)
    with e = exp(x)."""
    is_linear = x > THRESHOLD
    # exp of at most the threshold: no overflow in the branch not taken.
    e = tl.exp(tl.minimum(x, THRESHOLD))
    softplus = tl.where(is_linear, x, _log1p(e))
    slope = tl.where(is_linear, 1.0, e / (e + 1.0))
    return softplus, slope


@triton.jit
def _load_tile(a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, pid, M, H, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program pid's [BLOCK_M, BLOCK_H] tile: its offsets and masks, -exp(A_log) [BLOCK_H], x = a + dt_bias and b
    (fp32)."""
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    heads = tl.arange(0, BLOCK_H)
    head_mask = heads < H
    mask = (rows < M)[:, None] & head_mask[None, :]
    offsets = rows[:, None].to(tl.int64) * H + heads[None, :]
    neg_rate = -tl.exp(tl.load(A_log_ptr + heads, mask=head_mask, other=0.0).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + heads, mask=head_mask, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    return offsets, mask, head_mask, neg_rate, a + dt_bias[None, :], b


@triton.jit
def _gdn_gates_fwd_kernel(
    a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, g_ptr, beta_ptr,
    M, H,
    THRESHOLD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    offsets, mask, _, neg_rate, x, b = _load_tile(
        a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, tl.program_id(0), M, H, BLOCK_M, BLOCK_H
    )
    softplus, _ = _softplus_parts(x, THRESHOLD)
    tl.store(g_ptr + offsets, neg_rate[None, :] * softplus, mask=mask)
    tl.store(beta_ptr + offsets, tl.sigmoid(b), mask=mask)


@triton.jit
def _gdn_gates_bwd_kernel(
    a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, dg_ptr, dbeta_ptr, da_ptr, db_ptr, partial_ptr,
    M, H, num_programs,
    HAS_PARAM_GRADS: tl.constexpr, THRESHOLD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    offsets, mask, head_mask, neg_rate, x, b = _load_tile(
        a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, pid, M, H, BLOCK_M, BLOCK_H
    )
    heads = tl.arange(0, BLOCK_H)
    # Masked elements load dg = 0: they add nothing to the sums below.
    dg = tl.load(dg_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    dbeta = tl.load(dbeta_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    softplus, slope = _softplus_parts(x, THRESHOLD)
    # In torch's order: mul's backward, then softplus's.
    da = (dg * neg_rate[None, :]) * slope
    tl.store(da_ptr + offsets, da.to(da_ptr.dtype.element_ty), mask=mask)
    beta = tl.sigmoid(b)
    db = dbeta * (1.0 - beta) * beta
    tl.store(db_ptr + offsets, db.to(db_ptr.dtype.element_ty), mask=mask)
    if HAS_PARAM_GRADS:
        # This tile's share of dA_log = sum(dg * g) = -exp(A_log) sum(dg * softplus), and of ddt_bias = sum(da).
        tl.store(partial_ptr + pid * H + heads, neg_rate * tl.sum(dg * softplus, axis=0), mask=head_mask)
        tl.store(partial_ptr + (num_programs + pid) * H + heads, tl.sum(da, axis=0), mask=head_mask)
