"""The dense reference of gpt_oss attention over packed documents (sinks, sliding window, GQA), shared by the CPU
tests (tests/engine/families/test_gpt_oss.py) and the GPU tests (tests/gpu/test_gpt_oss_gpu.py)."""

import torch


def dense_attention(q, k, v, cu_seqlens, sinks, window):
    """Per document, the explicit softmax over [scores, sink] of transformers' gpt_oss eager attention."""
    outputs = []
    group = q.shape[2] // k.shape[2]
    for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        qd, kd, vd = q[0, a:b].transpose(0, 1), k[0, a:b].transpose(0, 1), v[0, a:b].transpose(0, 1)
        kd, vd = kd.repeat_interleave(group, 0), vd.repeat_interleave(group, 0)
        scores = qd @ kd.transpose(1, 2) * q.shape[-1] ** -0.5
        i = torch.arange(b - a, device=q.device)
        allowed = i[None, :] <= i[:, None]
        if window is not None:
            allowed &= i[:, None] - i[None, :] < window
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            scores = torch.cat([scores, sinks[:, None, None].expand(-1, b - a, 1)], -1)
        probs = scores.softmax(-1)[..., : b - a]
        outputs.append((probs @ vd).transpose(0, 1))
    return torch.cat(outputs)[None]
