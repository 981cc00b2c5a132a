"""Pure-PyTorch MoE expert MLP, routing and load-balancing loss: the ground truth for the Triton kernels.

Shapes: N tokens, D model dim, F expert hidden dim, E experts, k experts per token (top-k), r LoRA rank;
group-limited routing: G expert groups of e = E / G experts, g groups kept per token.
Expert weights use the transformers 5 fused layout: w_gate_up [E, 2F, D] (gate rows first, then up), w_down [E, D, F].
Expert e on a row x: h = silu(x W_gate^T) * (x W_up^T), y_e = h W_down^T. gpt_oss's experts add biases (b_gate_up
[E, 2F], b_down [E, D]) and take the clamped SwiGLU (ClampedSwiGLU) instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F_nn

from moe_tune.ops.fp8.reference import dequantize_weight

SCORE_FUNCS = ("softmax", "sigmoid")
# The tensors moe_mlp's add_to takes at most (a MoE block's shared expert output and its layer's residual).
MAX_ADD_TO = 2
# moe_mlp's add_to: one [N, D] tensor, a sequence of them (added in order), or None.
AddTo = torch.Tensor | Sequence[torch.Tensor] | None
# Keeps a sigmoid renormalisation finite when every chosen score underflows to 0 (same constant as DeepSeek-V3).
SIGMOID_NORM_EPS = 1e-20


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # fp32 at least; fp64 inputs stay fp64 so that gradient checks in fp64 can be tight.
    return torch.promote_types(dtype, torch.float32)


# eq=False: a generated __eq__ would compare tensors elementwise and fail on the ambiguous truth value.
@dataclass(frozen=True, eq=False)
class ExpertLoRA:
    """Per-expert LoRA on the two expert projections; delta on a projection W x is scaling * B (A x).

    a_gate_up: [E, r, D], b_gate_up: [E, 2F, r]   adapter on w_gate_up, or both None
    a_down:    [E, r, F], b_down:    [E, D, r]    adapter on w_down, or both None
    scaling:   float, keyword (lora_alpha / r in PEFT terms)
    """

    a_gate_up: torch.Tensor | None = None
    b_gate_up: torch.Tensor | None = None
    a_down: torch.Tensor | None = None
    b_down: torch.Tensor | None = None
    scaling: float = field(kw_only=True)

    @property
    def has_gate_up(self) -> bool:
        return self.a_gate_up is not None

    @property
    def has_down(self) -> bool:
        return self.a_down is not None

    def check(self, E: int, D: int, F: int) -> None:
        """Raise ValueError naming the tensor when a shape does not fit experts of E x [D -> F -> D]."""
        _check_pair("a_gate_up", self.a_gate_up, "b_gate_up", self.b_gate_up, E, d_in=D, d_out=2 * F)
        _check_pair("a_down", self.a_down, "b_down", self.b_down, E, d_in=F, d_out=D)


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt_oss's expert activation: gate clamped above at `limit`, up clamped to [-limit, limit], then
    h = gate * sigmoid(alpha * gate) * (up + 1)."""

    alpha: float = 1.702
    limit: float = 7.0


def expert_activation(gate: torch.Tensor, up: torch.Tensor, clamped: ClampedSwiGLU | None) -> torch.Tensor:
    """h from the gate and up halves: silu(gate) * up, or the clamped SwiGLU."""
    if clamped is None:
        return F_nn.silu(gate) * up
    gate = gate.clamp(max=clamped.limit)
    up = up.clamp(-clamped.limit, clamped.limit)
    return gate * torch.sigmoid(gate * clamped.alpha) * (up + 1)


def _check_pair(
    a_name: str, a: torch.Tensor | None, b_name: str, b: torch.Tensor | None, E: int, d_in: int, d_out: int
) -> None:
    if a is None and b is None:
        return
    if a is None or b is None:
        given, missing = (a_name, b_name) if b is None else (b_name, a_name)
        raise ValueError(f"ExpertLoRA.{given} is set but {missing} is None: give both or neither")
    if a.dim() != 3 or a.shape[0] != E or a.shape[2] != d_in:
        raise ValueError(f"ExpertLoRA.{a_name}: shape {tuple(a.shape)} must be [E, r, {d_in}] with E = {E}")
    r = a.shape[1]
    if tuple(b.shape) != (E, d_out, r):
        raise ValueError(f"ExpertLoRA.{b_name}: shape {tuple(b.shape)} must be [E, {d_out}, r] = [{E}, {d_out}, {r}]")


def _expert_mlp(
    x_MD: torch.Tensor,
    w_gate_up_2FD: torch.Tensor,
    w_down_DF: torch.Tensor,
    lora: ExpertLoRA | None,
    e: int,
    b_gate_up_2F: torch.Tensor | None = None,
    b_down_D: torch.Tensor | None = None,
    clamped: ClampedSwiGLU | None = None,
) -> torch.Tensor:
    """SwiGLU MLP of expert e on the M rows routed to it; every tensor already in the compute dtype."""
    num_hidden = w_down_DF.shape[1]
    gate_up_M2F = x_MD @ w_gate_up_2FD.T
    if lora is not None and lora.has_gate_up:
        gate_up_M2F = gate_up_M2F + lora.scaling * ((x_MD @ lora.a_gate_up[e].T) @ lora.b_gate_up[e].T)
    if b_gate_up_2F is not None:
        gate_up_M2F = gate_up_M2F + b_gate_up_2F
    gate_MF, up_MF = gate_up_M2F.split(num_hidden, dim=-1)
    h_MF = expert_activation(gate_MF, up_MF, clamped)
    y_MD = h_MF @ w_down_DF.T
    if lora is not None and lora.has_down:
        y_MD = y_MD + lora.scaling * ((h_MF @ lora.a_down[e].T) @ lora.b_down[e].T)
    if b_down_D is not None:
        y_MD = y_MD + b_down_D
    return y_MD


def _lora_to(lora: ExpertLoRA | None, dtype: torch.dtype) -> ExpertLoRA | None:
    if lora is None:
        return None

    def cast(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(dtype)

    return ExpertLoRA(
        cast(lora.a_gate_up), cast(lora.b_gate_up), cast(lora.a_down), cast(lora.b_down), scaling=lora.scaling
    )


def addends_of(add_to: AddTo) -> tuple[torch.Tensor, ...]:
    """add_to as a tuple of its tensors (none for None)."""
    if add_to is None:
        return ()
    return (add_to,) if isinstance(add_to, torch.Tensor) else tuple(add_to)


def moe_mlp_ref(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    lora: ExpertLoRA | None = None,
    *,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    clamped_swiglu: ClampedSwiGLU | None = None,
    gate_up_scale_inv: torch.Tensor | None = None,
    down_scale_inv: torch.Tensor | None = None,
    add_to: AddTo = None,
) -> torch.Tensor:
    """Grouped MoE MLP: sort token-slots by expert, one matmul per expert on its rows, weighted index_add_ combine.

    x: [N, D], topk_ids: [N, k] int64/int32, topk_weights: [N, k] float, w_gate_up: [E, 2F, D], w_down: [E, D, F];
    b_gate_up: [E, 2F], b_down: [E, D] or None; clamped_swiglu: the activation, None for silu(gate) * up.
    gate_up_scale_inv: [E, 2*ceil(F/128), ceil(D/128)] fp32, down_scale_inv: [E, ceil(D/128), ceil(F/128)] fp32, with
    w_gate_up and w_down float8_e4m3fn (frozen FP8 experts: the weights are dequantized, W_q * scale_inv in fp32, and
    the experts run on them as on any other weights; no gradient reaches them), or both None (default).
    add_to: [N, D], a sequence of one or two such tensors, or None: added (in order) to the output before its one
    rounding to x.dtype.
    Returns y: [N, D] in x.dtype, computed in fp32 (fp64 for fp64 inputs). Differentiable in every float input.
    Reads the per-expert counts on the host: a training path for the CPU, not for CUDA.
    """
    top_k = topk_ids.shape[1]
    num_experts = w_gate_up.shape[0]
    dtype = _compute_dtype(x.dtype)
    if gate_up_scale_inv is not None:
        num_hidden = w_down.shape[2]
        w_gate_up = dequantize_weight(w_gate_up, gate_up_scale_inv, (num_hidden, num_hidden), dtype)
        w_down = dequantize_weight(w_down, down_scale_inv, None, dtype)
    x_ND = x.to(dtype)
    w_gate_up_E2FD = w_gate_up.to(dtype)
    w_down_EDF = w_down.to(dtype)
    lora = _lora_to(lora, dtype)
    b_gate_up_E2F = None if b_gate_up is None else b_gate_up.to(dtype)
    b_down_ED = None if b_down is None else b_down.to(dtype)

    # Slot s = token * k + j; a stable sort keeps each expert's rows in token order.
    ids_S = topk_ids.reshape(-1).long()
    order_S = torch.argsort(ids_S, stable=True)
    token_of_row_S = order_S // top_k
    counts_E = torch.bincount(ids_S, minlength=num_experts)
    x_sorted_SD = x_ND[token_of_row_S]

    outputs = []
    start = 0
    for e, count in enumerate(counts_E.tolist()):
        if count == 0:
            continue
        rows_MD = x_sorted_SD[start : start + count]
        outputs.append(_expert_mlp(
            rows_MD, w_gate_up_E2FD[e], w_down_EDF[e], lora, e,
            None if b_gate_up_E2F is None else b_gate_up_E2F[e], None if b_down_ED is None else b_down_ED[e],
            clamped_swiglu,
        ))  # fmt: skip
        start += count
    y_sorted_SD = torch.cat(outputs) if outputs else x_ND.new_zeros((0, x_ND.shape[1]))

    weights_S = topk_weights.reshape(-1).to(dtype)[order_S]
    y_ND = torch.zeros_like(x_ND)
    for addend in addends_of(add_to):
        y_ND = y_ND + addend.to(dtype)
    y_ND = y_ND.index_add_(0, token_of_row_S, y_sorted_SD * weights_S[:, None])
    return y_ND.to(x.dtype)


def moe_mlp_loop_ref(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    lora: ExpertLoRA | None = None,
    *,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    clamped_swiglu: ClampedSwiGLU | None = None,
) -> torch.Tensor:
    """Per-token oracle: for each token and each of its k slots, run the chosen expert on that one token.

    Same shapes, dtypes and result as moe_mlp_ref; written with matrix-vector products and no sorting, for tests only.
    """
    dtype = _compute_dtype(x.dtype)
    # Cast once up front: gradients then sum over slots in the compute dtype, not in the leaves' dtype.
    x_ND, weights_Nk = x.to(dtype), topk_weights.to(dtype)
    w_gate_up_E2FD, w_down_EDF = w_gate_up.to(dtype), w_down.to(dtype)
    lora = _lora_to(lora, dtype)
    num_hidden = w_down.shape[2]
    rows = []
    for t in range(x.shape[0]):
        y_D = torch.zeros_like(x_ND[t])
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            gate_F = w_gate_up_E2FD[e, :num_hidden] @ x_ND[t]
            up_F = w_gate_up_E2FD[e, num_hidden:] @ x_ND[t]
            if lora is not None and lora.a_gate_up is not None:
                delta_2F = lora.scaling * (lora.b_gate_up[e] @ (lora.a_gate_up[e] @ x_ND[t]))
                gate_F = gate_F + delta_2F[:num_hidden]
                up_F = up_F + delta_2F[num_hidden:]
            if b_gate_up is not None:
                gate_F = gate_F + b_gate_up[e, :num_hidden].to(dtype)
                up_F = up_F + b_gate_up[e, num_hidden:].to(dtype)
            if clamped_swiglu is None:
                h_F = gate_F * torch.sigmoid(gate_F) * up_F
            else:
                gate_F = torch.minimum(gate_F, gate_F.new_tensor(clamped_swiglu.limit))
                up_F = torch.maximum(torch.minimum(up_F, up_F.new_tensor(clamped_swiglu.limit)),
                                     up_F.new_tensor(-clamped_swiglu.limit))
                h_F = gate_F * torch.sigmoid(clamped_swiglu.alpha * gate_F) * (up_F + 1)
            out_D = w_down_EDF[e] @ h_F
            if b_down is not None:
                out_D = out_D + b_down[e].to(dtype)
            if lora is not None and lora.a_down is not None:
                out_D = out_D + lora.scaling * (lora.b_down[e] @ (lora.a_down[e] @ h_F))
            y_D = y_D + weights_Nk[t, j] * out_D
        rows.append(y_D)
    if not rows:
        return x.new_zeros(x.shape)
    return torch.stack(rows).to(x.dtype)


def topk_route(
    logits: torch.Tensor,
    top_k: int,
    score_func: str = "softmax",
    renormalize: bool = True,
    selection_bias: torch.Tensor | None = None,
    routed_scaling: float = 1.0,
    pinned_ids: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pick top_k experts per token and their combine weights.

    logits: [N, E] float. selection_bias: [E] float or None, added to the scores for the choice only (aux-loss-free
    balancing); the weights are always the unbiased scores. Defaults: softmax scores, renormalised, scaling 1.0.
    pinned_ids: [N, k] experts to use instead of choosing (alignment against a reference's routing); the weights
    are computed at them as usual.
    n_group, topk_group: group-limited choice (DeepSeek-V3): the E experts form n_group equal groups of consecutive
    ids; each token keeps the topk_group groups with the largest sum of their two best choice scores (bias
    included; the one score of a group of one) and picks its top_k experts inside them. Default 1, 1: no groups.
    Returns topk_ids [N, k] int64, topk_weights [N, k] fp32 (differentiable w.r.t. logits), scores [N, E] fp32.
    """
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func ({score_func!r}) must be one of {', '.join(SCORE_FUNCS)}")
    if logits.dim() != 2:
        raise ValueError(f"logits: shape {tuple(logits.shape)} must be [N, E]")
    num_experts = logits.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k ({top_k}) must be in [1, E] = [1, {num_experts}]")
    if selection_bias is not None and tuple(selection_bias.shape) != (num_experts,):
        raise ValueError(f"selection_bias: shape {tuple(selection_bias.shape)} must be [E] = [{num_experts}]")
    if n_group < 1 or num_experts % n_group:
        raise ValueError(f"n_group ({n_group}) must be >= 1 and divide E ({num_experts})")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group ({topk_group}) must be in [1, n_group] = [1, {n_group}]")
    if top_k > topk_group * (num_experts // n_group):
        raise ValueError(
            f"top_k ({top_k}) must be <= topk_group ({topk_group}) x experts per group ({num_experts // n_group})"
        )

    logits_NE = logits.float()
    scores_NE = logits_NE.softmax(dim=-1) if score_func == "softmax" else logits_NE.sigmoid()
    choice_NE = scores_NE.detach()
    if selection_bias is not None:
        choice_NE = choice_NE + selection_bias.detach().float()
    if topk_group < n_group:
        choice_NE = _keep_top_groups(choice_NE, n_group, topk_group)
    topk_ids_Nk = choice_NE.topk(top_k, dim=-1).indices if pinned_ids is None else pinned_ids.long()
    topk_weights_Nk = scores_NE.gather(-1, topk_ids_Nk)
    if renormalize:
        denom_N1 = topk_weights_Nk.sum(dim=-1, keepdim=True)
        if score_func == "sigmoid":
            denom_N1 = denom_N1 + SIGMOID_NORM_EPS
        topk_weights_Nk = topk_weights_Nk / denom_N1
    return topk_ids_Nk, topk_weights_Nk * routed_scaling, scores_NE


# DeepSeek-V3 ranks a group of experts by the sum of its best this-many choice scores.
GROUP_SCORE_TOP = 2


def _keep_top_groups(choice_NE: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """choice_NE with the experts outside each token's topk_group best groups set to -inf."""
    num_tokens, num_experts = choice_NE.shape
    choice_NGe = choice_NE.view(num_tokens, n_group, num_experts // n_group)
    group_scores_NG = choice_NGe.topk(min(GROUP_SCORE_TOP, choice_NGe.shape[-1]), dim=-1).values.sum(dim=-1)
    group_ids_Ng = group_scores_NG.topk(topk_group, dim=-1).indices
    is_kept_NG = torch.zeros_like(group_scores_NG, dtype=torch.bool).scatter_(1, group_ids_Ng, True)
    return choice_NGe.masked_fill(~is_kept_NG[:, :, None], float("-inf")).view(num_tokens, num_experts)


def switch_aux_loss(scores: torch.Tensor, topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch-Transformer load-balancing loss E * sum_e f_e * P_e; 1.0 for perfectly uniform routing.

    scores: [N, E] float (softmax probs or sigmoid scores), topk_ids: [N, k] int64/int32.
    f_e: fraction of the N*k token-slots routed to e (no gradient); P_e: mean over tokens of the per-token normalised
    score of e. Returns a scalar fp32, differentiable w.r.t. scores.
    """
    if scores.dim() != 2 or scores.shape[1] != num_experts:
        raise ValueError(f"scores: shape {tuple(scores.shape)} must be [N, E] with E = num_experts = {num_experts}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != scores.shape[0]:
        raise ValueError(f"topk_ids: shape {tuple(topk_ids.shape)} must be [N, k] with N = {scores.shape[0]}")
    scores_NE = scores.float()
    # Softmax rows already sum to 1, so normalising every row is exact for them and is what sigmoid scores need.
    probs_NE = scores_NE / (scores_NE.sum(dim=-1, keepdim=True) + SIGMOID_NORM_EPS)
    # scatter_add into E counts, not bincount: bincount sizes its output on the host (a wait for the GPU, and an
    # error inside a CUDA graph capture of the MoE block).
    ids = topk_ids.reshape(-1).long()
    counts_E = torch.zeros(num_experts, dtype=torch.long, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))
    fraction_E = counts_E.float() / topk_ids.numel()
    mean_prob_E = probs_NE.mean(dim=0)
    return num_experts * (fraction_E * mean_prob_E).sum()
