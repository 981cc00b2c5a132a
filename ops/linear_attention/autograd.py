"""Autograd wiring of the chunked gated delta rule kernels, per-head decay (kernels_wy.py, kernels_state.py,
kernels_output.py, kernels_bwd.py) and per-channel decay, KDA (kernels_kda.py plus the shared state and output
kernels).

Shapes: B batch, T tokens, H heads, K key dim, V value dim, N sequences, NC chunk slots, C chunk length;
g is [B, T, H] per head or [B, T, H, K] per channel, its flattened form g_TH or g_THK.

Saved for backward: the inputs themselves (no copies) and the chunk layout (three small int32 tensors). Then one
of two modes (the op's save_intermediates):
- recompute (default): backward reruns the WY pass (G, (I + A)^-1, W, U) and the serial state pass (the states
  entering every chunk and v_new) before its own kernels: one parallel and one serial pass at forward cost;
- save: forward keeps what it already wrote (G, W, the states, v_new, k exp(G_C - G); KDA also its decayed q k^T and
  k k^T), has the WY pass store (I + A)^-1 too and, with the decayed k, the output kernel the reverse pass's prepared
  q exp(G) and decayed q k^T; backward starts from them: about [T, H, 2C + 3K + V] 16-bit values and the fp32 G per
  layer plus [NC, H, K, V] of states, held from forward to backward, for three fewer passes.
For power-of-two K (`has_k_end`) both serial passes read their decayed operands from parallel passes: the WY pass's
k exp(G_C - G) and, in backward, prepare_state_bwd's q exp(G) and decayed causal q k^T (KDA's from its pairs kernel).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from moe_tune.ops.linear_attention.kernels_bwd import chunk_grad, chunk_state_bwd, prepare_state_bwd
from moe_tune.ops.linear_attention.kernels_common import ChunkLayout, pick_config, prepare_chunks
from moe_tune.ops.linear_attention.kernels_kda import kda_grad, kda_wy_fwd
from moe_tune.ops.linear_attention.kernels_output import chunk_output, has_output_kernel
from moe_tune.ops.linear_attention.kernels_state import chunk_state_fwd
from moe_tune.ops.linear_attention.kernels_wy import chunk_wy_fwd, has_k_end


class GatedDeltaRuleFunction(torch.autograd.Function):
    """(o, final_state) = gated_delta_rule(q, k, v, g, beta, ...) or kda(...) on the Triton kernels; the shape of g
    picks the variant.

    Arguments as `moe_tune.ops.linear_attention.gated_delta_rule`, already checked, with scale a float.
    """

    @staticmethod
    def forward(
        ctx, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm, A_log, dt_bias,
        save_intermediates,
    ):  # fmt: skip
        B, T, H, K = q.shape
        V = v.shape[-1]
        q_THK, k_THK = q.reshape(B * T, H, K).contiguous(), k.reshape(B * T, H, K).contiguous()
        v_THV = v.reshape(B * T, H, V).contiguous()
        g_flat = g.reshape(B * T, *g.shape[2:]).contiguous()
        beta_TH = beta.reshape(B * T, H).contiguous()
        if initial_state is not None:
            initial_state = initial_state.contiguous()
        layout = prepare_chunks(cu_seqlens, B, T, device=q.device)
        config = pick_config(q)
        # KDA with the gate in the kernel: g is the raw gate a, the log decay -exp(A_log) softplus(a + dt_bias).
        gate = None if A_log is None else (A_log.contiguous(), dt_bias.reshape(-1).contiguous())
        output_kernel = has_output_kernel(K, V, config)
        # Nothing to keep when no input needs a gradient (inference, or timing the forward alone).
        is_saving = save_intermediates and any(ctx.needs_input_grad)
        g_cumsum, w_THK, u_THV, qk_THC, inverse_THC, kk_THC, k_end_THK = _wy_pass(
            q_THK, k_THK, v_THV, g_flat, beta_TH, layout, config, scale, use_qk_l2norm, is_saving, gate,
            store_k_end=(output_kernel or is_saving) and has_k_end(K),
        )  # fmt: skip
        if output_kernel:
            # The serial pass only carries the state (storing it per chunk, with v_new) and a parallel kernel
            # computes the output (KDA: from the pairs kernel's decayed q k^T).
            _, final_state, states_NCHKV, v_new_THV = chunk_state_fwd(
                q_THK, k_THK, w_THK, u_THV, g_cumsum, initial_state, layout, config, scale, use_qk_l2norm,
                output_final_state, compute_output=False, store_states=True, k_end_THK=k_end_THK,
            )  # fmt: skip
            del u_THV
            if not is_saving:
                del k_end_THK
            # Saving with the decayed k (the reverse pass's prepared path): the output kernel also writes the
            # prepared q exp(G) and decayed q k^T, and backward runs no prepare_state_bwd.
            o_THV, q_dec_THK, qk_prepared = chunk_output(
                q_THK, k_THK, g_cumsum, states_NCHKV, v_new_THV, layout, config, scale, use_qk_l2norm, qk_THC,
                store_bwd_operands=is_saving and k_end_THK is not None,
            )  # fmt: skip
        else:
            # The serial pass computes the output (and, when saving, stores the states and v_new too); the decayed
            # k is then stored for backward only: this pass, computing the output, builds its own in the loop.
            o_THV, final_state, states_NCHKV, v_new_THV = chunk_state_fwd(
                q_THK, k_THK, w_THK, u_THV, g_cumsum, initial_state, layout, config, scale, use_qk_l2norm,
                output_final_state, store_states=is_saving, qk_THC=qk_THC,
            )  # fmt: skip
            q_dec_THK = qk_prepared = None
        # Not saving: the passes' outputs are freed on return and backward recomputes them.
        kept = (
            (g_cumsum, w_THK, qk_THC, inverse_THC, kk_THC, k_end_THK, states_NCHKV, v_new_THV, q_dec_THK, qk_prepared)
            if is_saving
            else ()
        )
        ctx.num_kept = len(kept)
        ctx.save_for_backward(
            q_THK, k_THK, v_THV, g_flat, beta_TH, initial_state, layout.cu_seqlens, layout.chunk_offsets,
            layout.chunk_map, *(gate if gate is not None else (None, None)), *kept,
        )  # fmt: skip
        ctx.dt_bias_shape = None if dt_bias is None else dt_bias.shape
        ctx.layout_sizes = (layout.num_slots, layout.chunk_size)
        ctx.scale = scale
        ctx.use_qk_l2norm = use_qk_l2norm
        ctx.shape = (B, T, H, K, V)
        return o_THV.view(B, T, H, V), final_state

    @staticmethod
    @once_differentiable
    def backward(ctx, do, final_state_grad):
        saved = ctx.saved_tensors
        (q_THK, k_THK, v_THV, g_flat, beta_TH, initial_state, cu_seqlens, chunk_offsets, chunk_map, A_log,
         dt_bias) = saved[: len(saved) - ctx.num_kept]  # fmt: skip
        gate = None if A_log is None else (A_log, dt_bias)
        B, T, H, K, V = ctx.shape
        layout = ChunkLayout(cu_seqlens, chunk_offsets, chunk_map, *ctx.layout_sizes)
        config = pick_config(q_THK)
        scale, use_qk_l2norm = ctx.scale, ctx.use_qk_l2norm
        is_per_channel = g_flat.ndim == 3
        do_THV = do.reshape(B * T, H, V).contiguous()
        if final_state_grad is not None:
            final_state_grad = final_state_grad.contiguous()

        q_dec_THK = qk_prepared = None
        if ctx.num_kept:
            (g_cumsum, w_THK, qk_THC, inverse_THC, kk_THC, k_end_THK, states_NCHKV, v_new_THV, q_dec_THK,
             qk_prepared) = saved[-ctx.num_kept :]  # fmt: skip
        else:
            g_cumsum, w_THK, u_THV, qk_THC, inverse_THC, kk_THC, k_end_THK = _wy_pass(
                q_THK, k_THK, v_THV, g_flat, beta_TH, layout, config, scale, use_qk_l2norm, True, gate,
                store_k_end=has_k_end(K),
            )  # fmt: skip
            _, _, states_NCHKV, v_new_THV = chunk_state_fwd(
                q_THK, k_THK, w_THK, u_THV, g_cumsum, initial_state, layout, config, scale, use_qk_l2norm,
                output_final_state=False, compute_output=False, store_states=True, k_end_THK=k_end_THK,
            )  # fmt: skip
            del u_THV
        del saved
        prepared = None
        if k_end_THK is not None:
            # The reverse serial pass reads its decayed operands as the forward's does (has_k_end's K only).
            if q_dec_THK is None:
                q_dec_THK, qk_prepared = prepare_state_bwd(
                    q_THK, k_THK, g_cumsum, layout, config, scale, use_qk_l2norm, store_qk=qk_THC is None
                )
            prepared = (k_end_THK, q_dec_THK, qk_THC if qk_THC is not None else qk_prepared)
            del k_end_THK, q_dec_THK, qk_prepared
        state_grads_NCHKV, dv_new_THV, initial_state_grad = chunk_state_bwd(
            q_THK, k_THK, w_THK, g_cumsum, do_THV, final_state_grad, layout, config, scale, use_qk_l2norm,
            initial_state.dtype if initial_state is not None else None, qk_THC=qk_THC, prepared=prepared,
        )  # fmt: skip
        del w_THK, qk_THC, prepared
        grad_args = (
            q_THK, k_THK, v_THV, g_flat.dtype, beta_TH, g_cumsum, inverse_THC, states_NCHKV, state_grads_NCHKV,
            v_new_THV, dv_new_THV, do_THV, layout, config, scale, use_qk_l2norm,
        )  # fmt: skip
        dA_log = ddt_bias = None
        if is_per_channel:
            grad_args = (*grad_args[:7], kk_THC, *grad_args[7:])
            dq, dk, dv, dbeta, dg, dA_log, ddt_bias = kda_grad(
                *grad_args, gate=None if gate is None else (g_flat, *gate)
            )
            if gate is not None:
                dA_log = dA_log.to(A_log.dtype)
                ddt_bias = ddt_bias.to(dt_bias.dtype).reshape(ctx.dt_bias_shape)
        else:
            dq, dk, dv, dbeta, dg = chunk_grad(*grad_args)
        return (
            dq.view(B, T, H, K),
            dk.view(B, T, H, K),
            dv.view(B, T, H, V),
            dg.view(B, T, H, *dg.shape[2:]),
            dbeta.view(B, T, H),
            None,
            initial_state_grad,
            None,
            None,
            None,
            dA_log,
            ddt_bias,
            None,
        )


def _wy_pass(
    q_THK, k_THK, v_THV, g_flat, beta_TH, layout, config, scale, use_qk_l2norm, store_for_backward, gate=None,
    store_k_end=False,
):  # fmt: skip
    """(G, W, U, decayed causal q k^T or None, (I + A)^-1 or None, decayed k k^T or None, k exp(G_C - G) or None)
    of either variant; the per-head variant builds q k^T inside the state and output kernels and needs no k k^T in
    backward (KDA returns both always). gate: KDA's (A_log, dt_bias) when g_flat is the raw gate. store_k_end: the
    serial pass's decayed k, for chunk_state_fwd without the output."""
    if g_flat.ndim == 3:
        return kda_wy_fwd(
            q_THK, k_THK, v_THV, g_flat, beta_TH, layout, config, scale, use_qk_l2norm, store_for_backward, gate,
            store_k_end=store_k_end,
        )  # fmt: skip
    g_cumsum_TH, w_THK, u_THV, inverse_THC, k_end_THK = chunk_wy_fwd(
        k_THK, v_THV, g_flat, beta_TH, layout, config, use_qk_l2norm, store_inverse=store_for_backward,
        store_k_end=store_k_end,
    )  # fmt: skip
    return g_cumsum_TH, w_THK, u_THV, None, inverse_THC, None, k_end_THK


def gated_delta_rule_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    save_intermediates: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The kernel path of `gated_delta_rule` (g [B, T, H]) and of `kda` (g [B, T, H, K]); inputs already checked.
    With A_log and dt_bias (kda only) g is the raw gate and the kernels compute the log decay from it.
    save_intermediates: keep the forward's passes for backward instead of recomputing them (module docstring)."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return GatedDeltaRuleFunction.apply(
        q, k, v, g, beta, float(scale), initial_state, output_final_state, cu_seqlens, use_qk_l2norm, A_log, dt_bias,
        save_intermediates,
    )
