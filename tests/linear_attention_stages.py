"""Kernel-by-kernel check of the gated delta rule's Triton passes (shared by the interpreter and the GPU tests).

Each pass of ops/linear_attention/kernels_{fwd,bwd}.py runs on the previous pass's outputs and is compared with a
torch fp32 recomputation from those same outputs, so a failure names the broken kernel instead of showing up as a
wrong gradient at the end (this is how the H200 miscompiles of docs/PERF.md were found):
- "wy": G, (I + A)^-1, W, U of every chunk, from the raw inputs;
- "state_fwd": the states entering each chunk (a serial recomputation from the kernel's W and U) and v_new (from the
  kernel's own states);
- "state_bwd": the state gradients leaving each chunk (a reverse recomputation) and dv_new (from the kernel's own
  state gradients);
- "output": the forward's parallel output pass (per-head decay), from the kernel's states and v_new;
- "grad": dq, dk, dv, dg, dbeta as autograd of the chunk-local loss sum(o * do) + sum(S1 * dS1), given the kernel's
  S0 and dS1 (the total gradient of every token's inputs decomposes that way, chunk by chunk).
`stage_errors` returns {stage: {tensor: relative max error}} and whether a second run of the passes was bit-equal.

Legend: T packed tokens, H heads, K / V key / value dims, NS chunk slots, C chunk length.
"""

from __future__ import annotations

import torch

from moe_tune.ops.linear_attention import kernels_bwd, kernels_common, kernels_output, kernels_state, kernels_wy
from moe_tune.ops.linear_attention.reference import l2norm


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest |actual - expected| over the largest |expected| (NaN anywhere gives NaN)."""
    actual, expected = actual.float(), expected.float()
    if bool(actual.isnan().any()):
        return float("nan")
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


class _Slots:
    """The chunk slots of a layout as [NS, C] token indices with a validity mask."""

    def __init__(self, layout: kernels_common.ChunkLayout, num_tokens: int):
        chunk_map = layout.chunk_map.long()
        device = chunk_map.device
        self.C = layout.chunk_size
        self.count = chunk_map.shape[0]
        rows = torch.arange(self.C, device=device)
        self.num_valid = chunk_map[:, 1]
        self.index = (chunk_map[:, :1] + rows[None]).clamp(0, max(num_tokens - 1, 0))
        self.mask = rows[None] < self.num_valid[:, None]
        starts = layout.chunk_offsets.long()
        has_chunks = starts[1:] > starts[:-1]
        self.is_first = torch.zeros(self.count, dtype=torch.bool, device=device)
        self.is_first[starts[:-1][has_chunks]] = True
        self.is_last = torch.zeros(self.count, dtype=torch.bool, device=device)
        self.is_last[starts[1:][has_chunks] - 1] = True

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H, ...] -> [NS, H, C, ...] fp32, zero past each chunk's end."""
        y = x[self.index].float()
        y = y * self.mask.view(self.count, self.C, *([1] * (x.ndim - 1)))
        return y.movedim(1, 2)

    def scatter(self, y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """[NS, H, C, ...] -> [T, H, ...] fp32 (the inverse of gather on valid rows)."""
        out = torch.zeros(like.shape, dtype=torch.float32, device=like.device)
        out[self.index[self.mask]] = y.movedim(2, 1)[self.mask]
        return out

    def valid(self, y: torch.Tensor) -> torch.Tensor:
        """The valid rows of a gathered [NS, H, C, ...] tensor, flattened."""
        return y.movedim(2, 1)[self.mask]


def _chunk_forward(q, k, v, g, beta, scale, states, slots):
    """Per chunk, from gathered fp32 inputs [NS, H, C, *] and the states entering the chunks [NS, H, K, V]: o and the
    state leaving the chunk, differentiable (L2 norm over K inside)."""
    C = slots.C
    device = q.device
    strict = torch.tril(torch.ones(C, C, dtype=torch.bool, device=device), -1)
    causal = torch.tril(torch.ones(C, C, dtype=torch.bool, device=device))
    eye = torch.eye(C, device=device)
    q, k = l2norm(q) * scale, l2norm(k)
    G = g.cumsum(-1)
    log_decay = G[..., :, None] - G[..., None, :]
    zero = torch.zeros((), device=device)
    A = (k @ k.transpose(-1, -2)) * beta[..., None] * torch.exp(torch.where(strict, log_decay, zero)) * strict
    inverse = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)
    W = inverse @ (k * (beta * G.exp())[..., None])
    U = inverse @ (v * beta[..., None])
    v_new = U - W @ states
    M = torch.exp(torch.where(causal, log_decay, zero)) * causal
    o = (q * G.exp()[..., None]) @ states + ((q @ k.transpose(-1, -2)) * M) @ v_new
    G_last = G[..., -1:]  # g is zero past the chunk's end, so G there stays at the last valid value
    end_state = G_last.exp()[..., None] * states + (k * torch.exp(G_last - G)[..., None]).transpose(-1, -2) @ v_new
    return o, end_state, (G, inverse, W, U)


def stage_errors(q, k, v, g, beta, do, cu_seqlens, scale=None):
    """q, k [T, H, K], v, do [T, H, V], g, beta [T, H] (packed along T), cu_seqlens [N + 1] int32; L2 norm in kernel.

    Returns ({stage: {tensor: relative max error}}, repeat_equal) as in the module docstring."""
    T, H, K = q.shape
    scale = K**-0.5 if scale is None else scale
    layout = kernels_common.prepare_chunks(cu_seqlens, 1, T, device=q.device)
    config = kernels_common.pick_config(q)
    slots = _Slots(layout, T)
    errors = {}

    # As the op runs them: the WY pass hands the serial pass k exp(G_C - G) where has_k_end allows it.
    store_k_end = kernels_wy.has_k_end(K)
    g_cumsum, w, u, inverse, k_end = kernels_wy.chunk_wy_fwd(
        k, v, g, beta, layout, config, True, store_inverse=True, store_k_end=store_k_end
    )
    inputs = [slots.gather(x) for x in (q, k, v, g, beta)]
    _, _, (G_ref, inverse_ref, W_ref, U_ref) = _chunk_forward(
        *inputs, scale, torch.zeros(slots.count, H, K, v.shape[-1], device=q.device), slots
    )
    W_k, U_k, G_k = slots.gather(w), slots.gather(u), slots.gather(g_cumsum)
    k_n = l2norm(inputs[1])
    last = (slots.num_valid - 1).clamp(min=0)
    G_last = G_k.gather(2, last[:, None, None].expand(-1, H, 1)).squeeze(2)  # [NS, H]
    k_to_end = k_n * torch.exp(G_last[..., None] - G_k)[..., None] * slots.mask[:, None, :, None]
    errors["wy"] = {
        "G": _rel(slots.valid(slots.gather(g_cumsum)), slots.valid(G_ref)),
        "inverse": _rel(slots.valid(slots.gather(inverse)), slots.valid(inverse_ref)),
        "W": _rel(slots.valid(slots.gather(w)), slots.valid(W_ref)),
        "U": _rel(slots.valid(slots.gather(u)), slots.valid(U_ref)),
    }
    if store_k_end:
        errors["wy"]["k_end"] = _rel(slots.valid(slots.gather(k_end)), slots.valid(k_to_end))

    _, _, states, v_new = kernels_state.chunk_state_fwd(
        q, k, w, u, g_cumsum, None, layout, config, scale, True, False, compute_output=False, store_states=True,
        k_end_THK=k_end,
    )  # fmt: skip
    states_k = states.float()
    states_ref = torch.zeros_like(states_k)
    state = torch.zeros_like(states_k[0])
    used = slots.num_valid > 0
    for s in range(slots.count):
        if not used[s]:
            continue
        if slots.is_first[s]:
            state = torch.zeros_like(state)
        states_ref[s] = state
        state = torch.exp(G_last[s])[:, None, None] * state + k_to_end[s].transpose(-1, -2) @ (U_k[s] - W_k[s] @ state)
    v_new_ref = U_k - W_k @ states_k
    errors["state_fwd"] = {
        "states": _rel(states_k[used], states_ref[used]),
        "v_new": _rel(slots.valid(slots.gather(v_new)), slots.valid(v_new_ref)),
    }

    # As the op runs it: with the decayed k, the reverse pass reads prepared operands too.
    prepared = None
    if store_k_end:
        q_dec, qk = kernels_bwd.prepare_state_bwd(q, k, g_cumsum, layout, config, scale, True, store_qk=True)
        prepared = (k_end, q_dec, qk)
    state_grads, dv_new, _ = kernels_bwd.chunk_state_bwd(
        q, k, w, g_cumsum, do, None, layout, config, scale, True, None, prepared=prepared
    )
    do_c = slots.gather(do)
    q_n = l2norm(inputs[0]) * scale
    C = slots.C
    causal = torch.tril(torch.ones(C, C, dtype=torch.bool, device=q.device))
    M = torch.exp(torch.where(causal, G_k[..., :, None] - G_k[..., None, :], torch.zeros((), device=q.device))) * causal
    qk_t = ((q_n @ k_n.transpose(-1, -2)) * M).transpose(-1, -2)
    grads_k = state_grads.float()
    grads_ref = torch.zeros_like(grads_k)
    dstate = torch.zeros_like(grads_k[0])
    for s in reversed(range(slots.count)):
        if not used[s]:
            continue
        if slots.is_last[s]:
            dstate = torch.zeros_like(dstate)
        grads_ref[s] = dstate
        dv = qk_t[s] @ do_c[s] + k_to_end[s] @ dstate
        dstate = (
            torch.exp(G_last[s])[:, None, None] * dstate
            + (q_n[s] * G_k[s].exp()[..., None]).transpose(-1, -2) @ do_c[s]
            - W_k[s].transpose(-1, -2) @ dv
        )
    dv_new_ref = qk_t @ do_c + k_to_end @ grads_k
    errors["state_bwd"] = {
        "state_grads": _rel(grads_k[used], grads_ref[used]),
        "dv_new": _rel(slots.valid(slots.gather(dv_new)), slots.valid(dv_new_ref)),
    }

    # The forward's parallel output pass, from the states and v_new the serial pass stored.
    o_kernel, _, _ = kernels_output.chunk_output(q, k, g_cumsum, states, v_new, layout, config, scale, True)
    o_ref = (q_n * G_k.exp()[..., None]) @ states_k + ((q_n @ k_n.transpose(-1, -2)) * M) @ slots.gather(v_new)
    errors["output"] = {"o": _rel(slots.valid(slots.gather(o_kernel)), slots.valid(o_ref))}

    kernel_grads = kernels_bwd.chunk_grad(
        q, k, v, g.dtype, beta, g_cumsum, inverse, states, state_grads, v_new, dv_new, do, layout, config, scale, True
    )
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    o, end_state, _ = _chunk_forward(*leaves, scale, states_k, slots)
    ((o * do_c).sum() + (end_state * grads_k).sum()).backward()
    # chunk_grad returns dq, dk, dv, dbeta, dg; the leaves are q, k, v, g, beta.
    q_leaf, k_leaf, v_leaf, g_leaf, beta_leaf = leaves
    errors["grad"] = {
        name: _rel(actual, slots.scatter(leaf.grad, actual))
        for name, actual, leaf in zip(
            ("dq", "dk", "dv", "dbeta", "dg"), kernel_grads, (q_leaf, k_leaf, v_leaf, beta_leaf, g_leaf)
        )
    }

    again = kernels_bwd.chunk_state_bwd(
        q, k, w, g_cumsum, do, None, layout, config, scale, True, None, prepared=prepared
    )
    grads_again = kernels_bwd.chunk_grad(
        q, k, v, g.dtype, beta, g_cumsum, inverse, states, again[0], v_new, again[1], do, layout, config, scale, True
    )
    o_again, _, _ = kernels_output.chunk_output(q, k, g_cumsum, states, v_new, layout, config, scale, True)
    repeat_equal = bool(torch.equal(again[0][used], state_grads[used])) and all(
        torch.equal(a, b) for a, b in zip((*grads_again, o_again), (*kernel_grads, o_kernel))
    )
    return errors, repeat_equal
