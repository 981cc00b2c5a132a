"""Pure-PyTorch ground truth for top-k sparse attention and its top-k indexer.

Computes in fp32 (fp64 stays fp64) and casts outputs back to the input dtype. Written for clarity, not speed:
attention is dense under a boolean mask built from the indices, so memory grows as T^2.

Shape legend:
    B batch, T tokens (one packed row per batch entry), HQ query heads, H kv heads (HQ % H == 0),
    HI indexer heads, K query/key head dim, V value head dim, DI indexer head dim, S selected slots per query,
    N sequences (cu_seqlens has N + 1 entries), NB block slots of a row (ceil(T / block_size)),
    L tokens of one sequence, J candidate blocks of one sequence.

Index conventions, shared by both functions:
    Sequences: without cu_seqlens, each batch row is one sequence starting at offset o = 0. With cu_seqlens (B == 1),
    sequence n covers row positions [o, e) = [cu_seqlens[n], cu_seqlens[n + 1]).
    block_size == 1: an index is a key position in the packed row (absolute, 0 <= s < T, not relative to o).
    block_size > 1: an index is a block id j local to the query's sequence: block j covers row positions
    [o + j * block_size, min(o + (j + 1) * block_size, e)). Block ids restart at 0 in every sequence.
    Negative entries (-1) are unused slots. A query t attends only to keys s <= t of its own sequence: a selected
    key or block part outside that range contributes nothing, and duplicates count once.
    Queries offset from the keys (query_start): the Tq queries are the last Tq of the T keys, query i at key position
    t = query_start + i (T = query_start + Tq); everything above reads t so, and cu_seqlens bound the keys.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

INDEXER_ACTIVATIONS = {"relu": torch.relu, "none": lambda x: x}

# Indexer queries scored at once: bounds the [chunk, HI, T] fp32 intermediate (64 MiB at HI = 64, T = 4096).
INDEXER_QUERY_CHUNK = 64


def sequence_spans(batch_size: int, num_tokens: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """(row, start, end) of every sequence: one per row without cu_seqlens, else cu_seqlens' spans in row 0."""
    if cu_seqlens is None:
        return [(b, 0, num_tokens) for b in range(batch_size)]
    bounds = cu_seqlens.tolist()
    return [(0, start, end) for start, end in zip(bounds[:-1], bounds[1:])]


def sequence_layout(
    batch_size: int, num_tokens: int, cu_seqlens: torch.Tensor | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position: sequence id and row offset of its sequence start, both int64 [B, T]."""
    pos_T = torch.arange(num_tokens, device=device)
    if cu_seqlens is None:
        zeros_BT = torch.zeros(batch_size, num_tokens, dtype=torch.long, device=device)
        return zeros_BT, zeros_BT
    cu_seqlens = cu_seqlens.to(device=device, dtype=torch.long)
    # right=True puts a position equal to a boundary into the sequence that starts there (skips empty sequences)
    seq_id_T = torch.searchsorted(cu_seqlens[1:], pos_T, right=True)
    return seq_id_T[None], cu_seqlens[seq_id_T][None]


def selected_key_mask(
    indices_BTHS: torch.Tensor,
    block_size: int,
    cu_seqlens: torch.Tensor | None,
    query_start: int = 0,
    num_keys: int | None = None,
) -> torch.Tensor:
    """Bool [B, H, Tq, Tk]: query i (dim 2), at key position t = query_start + i, attends key s (dim 3) -- selected,
    s <= t, same sequence. indices_BTHS [B, Tq, H, S]; num_keys Tk (default Tq); cu_seqlens over the Tk keys."""
    B, Tq, H, S = indices_BTHS.shape
    Tk = Tq if num_keys is None else num_keys
    device = indices_BTHS.device
    key_K = torch.arange(Tk, device=device)
    query_Q = query_start + torch.arange(Tq, device=device)
    seq_id_BK, seq_start_BK = sequence_layout(B, Tk, cu_seqlens, device)
    seq_id_BQ = seq_id_BK[:, query_Q]
    if block_size == 1:
        num_slots = Tk
        key_slot_BK = key_K.expand(B, Tk)
    else:
        num_slots = math.ceil(Tk / block_size)
        key_slot_BK = (key_K - seq_start_BK) // block_size
    # Unused (negative) and out-of-range entries land in one extra slot that is dropped.
    idx_BQHS = indices_BTHS.long()
    idx_BQHS = torch.where((idx_BQHS >= 0) & (idx_BQHS < num_slots), idx_BQHS, num_slots)
    is_slot_selected = torch.zeros(B, Tq, H, num_slots + 1, dtype=torch.bool, device=device)
    is_slot_selected.scatter_(-1, idx_BQHS, True)
    is_selected_BQHK = is_slot_selected[..., :num_slots].gather(
        -1, key_slot_BK[:, None, None, :].expand(B, Tq, H, Tk)
    )
    is_causal_QK = query_Q[:, None] >= key_K[None, :]
    is_same_seq_BQK = seq_id_BQ[:, :, None] == seq_id_BK[:, None, :]
    is_visible_BQK = is_causal_QK[None] & is_same_seq_BQK
    return (is_selected_BQHK & is_visible_BQK[:, :, None, :]).permute(0, 2, 1, 3)


def sparse_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    block_size: int = 1,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    query_start: int = 0,
) -> torch.Tensor:
    """Softmax attention of each query over its selected causal keys; dense under a mask. Differentiable in q, k, v
    and gate.

    q [B, Tq, HQ, K], k [B, Tk, H, K], v [B, Tk, H, V], indices [B, Tq, H, S] or [B, Tq, S] (shared by all kv
    heads), gate [B, Tq, HQ, V] or None -> o [B, Tq, HQ, V] in q's dtype, times sigmoid(gate) when given. Query i
    sits at key position query_start + i (Tk = query_start + Tq; cu_seqlens over the keys). Query head h reads kv
    head h // (HQ // H). A query with no key outputs 0.
    """
    B, T, HQ, K = q.shape
    H = k.shape[2]
    scale = K**-0.5 if scale is None else scale
    compute_dtype = torch.promote_types(q.dtype, torch.float32)
    indices_BTHS = indices if indices.dim() == 4 else indices.unsqueeze(2).expand(-1, -1, H, -1)
    is_attended_BHTT = selected_key_mask(indices_BTHS, block_size, cu_seqlens, query_start, k.shape[1])

    num_groups = HQ // H
    q_BTQK = q.to(compute_dtype)
    k_BTQK = k.to(compute_dtype).repeat_interleave(num_groups, dim=2)
    v_BTQV = v.to(compute_dtype).repeat_interleave(num_groups, dim=2)
    is_attended_BQTT = is_attended_BHTT.repeat_interleave(num_groups, dim=1)
    has_key_BQT1 = is_attended_BQTT.any(dim=-1, keepdim=True)

    scores_BQTT = torch.einsum("bthk,bshk->bhts", q_BTQK, k_BTQK) * scale
    scores_BQTT = scores_BQTT.masked_fill(~is_attended_BQTT, float("-inf"))
    # Rows with no key would softmax to NaN (and NaN gradients): give them finite scores, then zero their weights.
    scores_BQTT = scores_BQTT.masked_fill(~has_key_BQT1, 0.0)
    probs_BQTT = torch.softmax(scores_BQTT, dim=-1) * has_key_BQT1
    o_BTQV = torch.einsum("bhts,bshv->bthv", probs_BQTT, v_BTQV)
    if gate is not None:
        o_BTQV = o_BTQV * torch.sigmoid(gate.to(compute_dtype))
    return o_BTQV.to(q.dtype)


def index_scores(
    q_LHD: torch.Tensor, w_LH: torch.Tensor, keys_MD: torch.Tensor, scale: float, activation: str
) -> torch.Tensor:
    """Indexer score of every query on every key, [L, M]: sum_h w[t, h] * act(scale * q[t, h] . key[m])."""
    act = INDEXER_ACTIVATIONS[activation]
    chunks = []
    for start in range(0, q_LHD.shape[0], INDEXER_QUERY_CHUNK):
        end = start + INDEXER_QUERY_CHUNK
        logits_CHM = act(torch.einsum("chd,md->chm", q_LHD[start:end], keys_MD) * scale)
        chunks.append(torch.einsum("chm,ch->cm", logits_CHM, w_LH[start:end]))
    return torch.cat(chunks) if chunks else q_LHD.new_zeros(0, keys_MD.shape[0])


def select_top(scores_LM: torch.Tensor, is_candidate_LM: torch.Tensor, topk: int) -> torch.Tensor:
    """The topk best candidates per row, int64 [L, topk], ascending, -1 padded; ties go to the lower index."""
    L, M = scores_LM.shape
    scores_LM = scores_LM.masked_fill(~is_candidate_LM, float("-inf"))
    # A stable sort keeps equal scores in index order, so the lower index wins a tie.
    order_LM = torch.sort(scores_LM, dim=-1, descending=True, stable=True).indices[:, :topk]
    is_kept = is_candidate_LM.gather(-1, order_LM)
    # Non-candidates get the sentinel M so that sorting pushes them to the end, where they become -1.
    chosen = torch.sort(torch.where(is_kept, order_LM, M), dim=-1).values
    chosen = torch.where(chosen == M, -1, chosen)
    return F.pad(chosen, (0, topk - chosen.shape[1]), value=-1)


@torch.no_grad()
def topk_indexer_ref(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    w_idx: torch.Tensor | None = None,
    topk: int = 2048,
    scale: float | None = None,
    activation: str = "relu",
    block_size: int = 1,
    cu_seqlens: torch.Tensor | None = None,
    k_idx_is_pooled: bool = False,
    always_keep_own_block: bool = True,
    query_start: int = 0,
) -> torch.Tensor:
    """Top-k key positions (block_size 1) or block ids (block_size > 1) per query; not differentiable.

    q_idx [B, Tq, HI, DI], k_idx [B, Tk, DI], w_idx [B, Tq, HI] (None = ones) -> int32 [B, Tq, topk], ascending,
    -1 padded. Query i sits at key position t = query_start + i (Tk = query_start + Tq; cu_seqlens over the keys).
    Score of query t on key s: sum_h w[t, h] * act(scale * q_idx[t, h] . k_idx[s]), scale = DI**-0.5 by default.
    Block mode scores the mean-pooled keys of the complete blocks before the query's block, keeps the topk - 1 best
    of them, and always keeps the query's own block.
    k_idx_is_pooled (block mode): k_idx already holds each block's key at the block's first row (other rows unused).
    always_keep_own_block False (block mode, QSA): the topk - 1 best of the complete blocks the query sees (its own
    block included once complete) plus its own block only while incomplete (the tail).
    """
    B, Tq, HI, DI = q_idx.shape
    T = k_idx.shape[1]
    scale = DI**-0.5 if scale is None else scale
    compute_dtype = torch.promote_types(q_idx.dtype, torch.float32)
    q_BTHD = q_idx.to(compute_dtype)
    k_BTD = k_idx.to(compute_dtype)
    if w_idx is None:
        w_BTH = torch.ones(B, Tq, HI, dtype=compute_dtype, device=q_idx.device)
    else:
        w_BTH = w_idx.to(compute_dtype)
    indices_BTS = torch.full((B, Tq, topk), -1, dtype=torch.int32, device=q_idx.device)
    for b, start, end in sequence_spans(B, T, cu_seqlens):
        # The sequence's queries: its keys [first, last) that are queries (key positions query_start + i).
        first, last = max(start, query_start), min(end, query_start + Tq)
        if last <= first:
            continue
        rows = slice(first - query_start, last - query_start)
        q_LHD, k_LD, w_LH = q_BTHD[b, rows], k_BTD[b, start:end], w_BTH[b, rows]
        pos_L = torch.arange(end - start, device=q_idx.device)
        query_pos_L = torch.arange(first - start, last - start, device=q_idx.device)
        if block_size == 1:
            scores_LL = index_scores(q_LHD, w_LH, k_LD, scale, activation)
            chosen_LS = select_top(scores_LL, pos_L[None, :] <= query_pos_L[:, None], topk)
            indices_BTS[b, rows] = torch.where(chosen_LS >= 0, chosen_LS + start, -1).int()
        else:
            indices_BTS[b, rows] = select_blocks(
                q_LHD, w_LH, k_LD, topk, scale, activation, block_size, k_idx_is_pooled, always_keep_own_block,
                query_pos_L[:, None],
            ).int()  # fmt: skip
    return indices_BTS


def select_blocks(
    q_LHD: torch.Tensor,
    w_LH: torch.Tensor,
    k_LD: torch.Tensor,
    topk: int,
    scale: float,
    activation: str,
    block_size: int,
    k_idx_is_pooled: bool = False,
    always_keep_own_block: bool = True,
    query_pos_Q1: torch.Tensor | None = None,
) -> torch.Tensor:
    """Block ids [Q, topk] of the queries q_LHD [Q, HI, DI] of one sequence of keys k_LD [L, DI] at positions
    query_pos_Q1 [Q, 1] of it (default: every position, Q = L): the query's own block plus the topk - 1 best complete
    earlier blocks (always_keep_own_block False: the topk - 1 best complete blocks up to the query, plus its own block
    only while it is incomplete)."""
    L, DI = k_LD.shape
    num_blocks = math.ceil(L / block_size)
    num_complete = L // block_size
    if k_idx_is_pooled:
        pooled_JD = k_LD[: num_complete * block_size : block_size]
    else:
        pooled_JD = k_LD[: num_complete * block_size].view(num_complete, block_size, DI).mean(dim=1)
    # The tail block has no pooled key: it is only ever a query's own block, whose score is overridden below.
    scores_LJ = F.pad(index_scores(q_LHD, w_LH, pooled_JD, scale, activation), (0, num_blocks - num_complete))
    if query_pos_Q1 is None:
        query_pos_Q1 = torch.arange(L, device=k_LD.device)[:, None]
    return select_from_block_scores(scores_LJ, query_pos_Q1, topk, block_size, always_keep_own_block)


def select_from_block_scores(
    scores_LJ: torch.Tensor, pos_L1: torch.Tensor, topk: int, block_size: int, always_keep_own_block: bool = True
) -> torch.Tensor:
    """Block ids [L, topk] (ascending, -1 padded) of queries at positions pos_L1 [L, 1] of their sequence, given their
    scores on every block of it [L, J] (a block without a pooled key: any value, never read): select_blocks' rule."""
    num_blocks = scores_LJ.shape[-1]
    own_block_L1 = pos_L1 // block_size
    block_J = torch.arange(num_blocks, device=scores_LJ.device)
    if not always_keep_own_block:
        # QSA: a complete own block competes like any other; the incomplete tail takes the last slot on top.
        num_seen_complete_L1 = (pos_L1 + 1) // block_size
        chosen_LS = select_top(scores_LJ, block_J < num_seen_complete_L1, topk - 1)
        tail_L1 = torch.where(own_block_L1 < num_seen_complete_L1, -1, own_block_L1)
        both_LS = torch.cat([chosen_LS, tail_L1], -1)
        # Ascending with -1 padding last: -1 gets the sentinel num_blocks while sorting.
        both_LS = torch.sort(torch.where(both_LS < 0, num_blocks, both_LS), dim=-1).values
        return torch.where(both_LS == num_blocks, -1, both_LS)
    scores_LJ = scores_LJ.masked_fill(block_J == own_block_L1, float("inf"))
    return select_top(scores_LJ, block_J <= own_block_L1, topk)
