"""Gated delta rule and its per-channel decay variant (KDA): pure PyTorch ground truth.

Shapes: B batch, T tokens (with cu_seqlens: all sequences packed, B == 1), H heads, K key dim, V value dim,
N sequences (B, or len(cu_seqlens) - 1 when packed), C chunk length, NT number of chunks.

Per head, with state S [K, V], log decay g_t <= 0 (one per head, or one per key channel for KDA), beta_t in (0, 1):
    S_t = diag(exp(g_t)) S_{t-1}                      (a scalar exp(g_t) for the gated delta rule)
    S_t = S_t + beta_t k_t (v_t - S_t^T k_t)^T        (delta rule on the decayed state)
    o_t = scale * S_t^T q_t
This is flash-linear-attention's convention (fused_recurrent_gated_delta_rule, chunk_kda).

Precision: inputs are upcast to fp32 (fp64 stays fp64, so gradients can be checked in double), the output is cast
back to the dtype of q, and states are fp32 (fp64 for fp64 inputs). Inputs are assumed valid: the public functions
in `moe_tune.ops.linear_attention` check them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# flash-linear-attention's l2norm: x / sqrt(sum(x^2) + eps).
L2NORM_EPS = 1e-6
# The chunk length of flash-linear-attention's chunked kernels (and of ours to come): 64 x 64 blocks fill a tensor
# core tile and keep the triangular solve short.
DEFAULT_CHUNK_SIZE = 64


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrent_gated_delta_rule_ref(
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token recurrence: the definition. Arguments as in `chunk_gated_delta_rule_ref`."""
    return _run_sequences(
        _recurrent_core, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm
    )


def kda_gate_ref(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """KDA's log decay from its raw gate a [B, T, H, K]: -exp(A_log[h]) * softplus(a + dt_bias[h, :]), in fp32 (fp64
    for fp64 inputs)."""
    H, K = a.shape[2], a.shape[3]
    dtype = torch.promote_types(a.dtype, torch.float32)
    return -A_log.to(dtype).exp()[:, None] * F.softplus(a.to(dtype) + dt_bias.to(dtype).view(H, K))


def chunk_gated_delta_rule_ref(
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
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked (WY / UT-transform) form of the recurrence, vectorised over B and H, looping over chunks.

    q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H] (gated delta rule) or [B, T, H, K] (KDA), log decay <= 0;
    beta: [B, T, H] in (0, 1); any floating dtype.
    scale: defaults to K ** -0.5.
    initial_state: [N, H, K, V] fp32, or None for zeros.
    cu_seqlens: [N + 1] int, starts of packed sequences (B == 1); the state restarts at every sequence start.
    use_qk_l2norm: L2-normalise q and k over K first.
    Returns o [B, T, H, V] in q's dtype and the final state [N, H, K, V] fp32 (None unless output_final_state).

    The KDA form holds [B, H, C, C, K] pairwise decays per chunk: a ground truth, not a memory-lean path.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size ({chunk_size}) must be >= 1")

    def core(q, k, v, g, beta, state):
        return _chunk_core(q, k, v, g, beta, state, chunk_size)

    return _run_sequences(core, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm)


# The public reference used in training: the chunked form, the one the kernels implement.
gated_delta_rule_ref = chunk_gated_delta_rule_ref


def _run_sequences(core, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm):
    """Upcast, normalise, scale, go heads-first, and run `core` on the batch or on each packed sequence."""
    out_dtype = q.dtype
    compute_dtype = torch.promote_types(q.dtype, torch.float32)
    B, T, H, K = q.shape
    V = v.shape[-1]
    q, k, v, g, beta = (x.to(compute_dtype) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    if scale is None:
        scale = K**-0.5
    # Heads first: [B, H, T, ...], so the state [B, H, K, V] and the per-token tensors share leading dims.
    q_BHTK = (q * scale).transpose(1, 2)
    k_BHTK = k.transpose(1, 2)
    v_BHTV = v.transpose(1, 2)
    g_BHT = g.transpose(1, 2)  # [B, H, T] or [B, H, T, K]
    beta_BHT = beta.transpose(1, 2)

    def start_state(first: int, count: int) -> torch.Tensor:
        if initial_state is None:
            return q.new_zeros(count, H, K, V)
        return initial_state[first : first + count].to(compute_dtype)

    if cu_seqlens is None:
        o_BHTV, state_NHKV = core(q_BHTK, k_BHTK, v_BHTV, g_BHT, beta_BHT, start_state(0, B))
    else:
        # Each packed sequence becomes one row of a padded batch [N, H, T_max, ...]: one call of `core` for all of
        # them. Padding after a sequence's end has k = v = beta = 0 and g = 0, so its state passes through unchanged
        # and nothing crosses a sequence boundary.
        bounds = cu_seqlens.tolist()
        lengths = [eos - bos for bos, eos in zip(bounds[:-1], bounds[1:])]
        num_seqs, t_max = len(lengths), max(lengths, default=0)
        seq_of_token = torch.repeat_interleave(
            torch.arange(num_seqs, device=q.device), torch.tensor(lengths, device=q.device), output_size=T
        )
        pos_of_token = torch.arange(T, device=q.device) - torch.tensor(bounds[:-1], device=q.device)[seq_of_token]

        def to_padded(x_1HT):
            padded = x_1HT.new_zeros((num_seqs, t_max, H) + x_1HT.shape[3:])
            padded = padded.index_put((seq_of_token, pos_of_token), x_1HT[0].transpose(0, 1))
            return padded.transpose(1, 2)

        o_NHTV, state_NHKV = core(
            *(to_padded(x) for x in (q_BHTK, k_BHTK, v_BHTV, g_BHT, beta_BHT)), start_state(0, num_seqs)
        )
        o_BHTV = o_NHTV.transpose(1, 2)[seq_of_token, pos_of_token].transpose(0, 1)[None]
    o = o_BHTV.transpose(1, 2).to(out_dtype)
    return o, (state_NHKV if output_final_state else None)


def _decay_as_channels(decay: torch.Tensor, is_per_channel: bool) -> torch.Tensor:
    """A per-head decay [..., C] as [..., C, 1] so it broadcasts over K; a per-channel one is already [..., C, K]."""
    return decay if is_per_channel else decay[..., None]


def _recurrent_core(q_BHTK, k_BHTK, v_BHTV, g_BHT, beta_BHT, state_BHKV):
    is_per_channel = g_BHT.ndim == 4
    T = q_BHTK.shape[2]
    outputs = []
    for t in range(T):
        # [B, H, K, 1] (per channel) or [B, H, 1, 1] (per head)
        decay = _decay_as_channels(g_BHT[:, :, t].exp(), is_per_channel)[..., None]
        state_BHKV = state_BHKV * decay
        k_BHK = k_BHTK[:, :, t]
        # What the decayed state predicts for k_t, replaced by v_t at rate beta_t.
        delta_BHV = beta_BHT[:, :, t, None] * (v_BHTV[:, :, t] - torch.einsum("bhk,bhkv->bhv", k_BHK, state_BHKV))
        state_BHKV = state_BHKV + k_BHK[..., :, None] * delta_BHV[..., None, :]
        outputs.append(torch.einsum("bhk,bhkv->bhv", q_BHTK[:, :, t], state_BHKV))
    if not outputs:
        return v_BHTV.new_zeros(v_BHTV.shape), state_BHKV
    return torch.stack(outputs, dim=2), state_BHKV


def _decayed_gram(x_BHCK, y_BHCK, G, mask_CC):
    """[B, H, C, C]: sum_c x[i, c] y[j, c] exp(G[i, c] - G[j, c]) where mask[i, j], 0 elsewhere.

    G: cumulative log decay [B, H, C] (per head) or [B, H, C, K] (per channel). Masked pairs get -inf before the exp:
    for i < j, G_i - G_j can reach +320 within a chunk (64 steps of -5), which overflows fp32 in exp(G_i) * exp(-G_j).
    """
    if G.ndim == 3:
        log_decay_BHCC = G[..., :, None] - G[..., None, :]
        decay_BHCC = log_decay_BHCC.masked_fill(~mask_CC, float("-inf")).exp()
        return (x_BHCK @ y_BHCK.transpose(-1, -2)) * decay_BHCC
    log_decay_BHCCK = G[..., :, None, :] - G[..., None, :, :]
    decay_BHCCK = log_decay_BHCCK.masked_fill(~mask_CC[..., None], float("-inf")).exp()
    return torch.einsum("bhik,bhjk,bhijk->bhij", x_BHCK, y_BHCK, decay_BHCCK)


def _pad_time(x: torch.Tensor, num_pad: int) -> torch.Tensor:
    """Zero-pad dim 2 (T) of a heads-first tensor at the end."""
    num_trailing_dims = x.ndim - 3
    return torch.nn.functional.pad(x, (0, 0) * num_trailing_dims + (0, num_pad))


def _chunk_core(q_BHTK, k_BHTK, v_BHTV, g_BHT, beta_BHT, state_BHKV, chunk_size):
    """One chunk at a time; within a chunk (tokens i, j; G the log decay summed from the chunk start, S0 the state
    entering it, all decays diag over K):
        A[i, j]  = beta_i k_i^T exp(G_i - G_j) k_j                     for j < i
        u        = (I + A)^-1 diag(beta) (v - exp(G) k S0)             (UT transform: u = U - W S0)
        o        = exp(G) q S0 + P u,  P[i, j] = q_i^T exp(G_i - G_j) k_j   for j <= i
        S_end    = exp(G_C) S0 + sum_j exp(G_C - G_j) k_j u_j^T
    u_j is beta_j times the delta-rule error of token j, so S_end unrolls the recurrence exactly.
    """
    B, H, T, K = q_BHTK.shape
    V = v_BHTV.shape[-1]
    C = chunk_size
    is_per_channel = g_BHT.ndim == 4
    num_chunks = math.ceil(T / C)
    num_pad = num_chunks * C - T
    # Padded tokens have k = v = beta = 0 and g = 0 (no decay): they write nothing and leave the state as it is.
    q_BHNCK, k_BHNCK, v_BHNCV, g_BHNC, beta_BHNC = (
        _pad_time(x, num_pad).unflatten(2, (num_chunks, C)) for x in (q_BHTK, k_BHTK, v_BHTV, g_BHT, beta_BHT)
    )
    ones_CC = torch.ones(C, C, dtype=torch.bool, device=q_BHTK.device)
    is_strictly_lower_CC = ones_CC.tril(-1)
    is_lower_CC = ones_CC.tril()
    eye_CC = torch.eye(C, dtype=q_BHTK.dtype, device=q_BHTK.device)

    outputs = []
    for n in range(num_chunks):
        q_BHCK, k_BHCK, v_BHCV, beta_BHC = q_BHNCK[:, :, n], k_BHNCK[:, :, n], v_BHNCV[:, :, n], beta_BHNC[:, :, n]
        # Log decay from the chunk start to each token (inclusive), <= 0: [B, H, C] or [B, H, C, K].
        G = g_BHNC[:, :, n].cumsum(dim=2)
        G_BHCk = _decay_as_channels(G, is_per_channel)  # k is K or 1
        A_BHCC = beta_BHC[..., None] * _decayed_gram(k_BHCK, k_BHCK, G, is_strictly_lower_CC)
        rhs_BHCX = beta_BHC[..., None] * torch.cat([v_BHCV, G_BHCk.exp() * k_BHCK], dim=-1)
        UW_BHCX = torch.linalg.solve_triangular(eye_CC + A_BHCC, rhs_BHCX, upper=False, unitriangular=True)
        U_BHCV, W_BHCK = UW_BHCX.split([V, K], dim=-1)
        u_BHCV = U_BHCV - W_BHCK @ state_BHKV
        o_BHCV = (G_BHCk.exp() * q_BHCK) @ state_BHKV + _decayed_gram(q_BHCK, k_BHCK, G, is_lower_CC) @ u_BHCV
        outputs.append(o_BHCV)
        # G_end - G_j <= 0 because the log decays are <= 0: no overflow.
        G_end_BH1k = G_BHCk[:, :, -1:]
        k_decayed_BHCK = (G_end_BH1k - G_BHCk).exp() * k_BHCK
        state_BHKV = G_end_BH1k.exp().transpose(-1, -2) * state_BHKV + k_decayed_BHCK.transpose(-1, -2) @ u_BHCV
    if not outputs:
        return v_BHTV.new_zeros(v_BHTV.shape), state_BHKV
    return torch.cat(outputs, dim=2)[:, :, :T], state_BHKV
