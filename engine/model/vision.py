"""The vision tower of qwen3_5_moe and qwen4_exp: patch embedding, learned positions resampled to each image's
grid, bidirectional ViT blocks with 2D rotary positions, and the patch merger into the language model's width.

Images arrive as patches from engine/data/images.py, every merge x merge block of neighbouring patches contiguous;
the tower runs on all images of a batch at once, attention kept within each image (cu_seqlens over images).

Shapes: P patches of all images, Dv vision width, hv heads of dim hd, m spatial merge size, D language width,
I images; grid [I, 3] = (t, h, w) in patches per image.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_tune.engine.model.varlen import without_cudnn_sdpa
from moe_tune.profiles.schema import VisionSpec

ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "silu": F.silu,
}


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], -1)


class VisionBlock(nn.Module):
    def __init__(self, spec: VisionSpec):
        super().__init__()
        d = spec.hidden_size
        self.num_heads = spec.num_heads
        self.norm1 = nn.LayerNorm(d, eps=1e-6)
        self.norm2 = nn.LayerNorm(d, eps=1e-6)
        self.qkv = nn.Linear(d, 3 * d, bias=True)
        self.proj = nn.Linear(d, d, bias=True)
        self.linear_fc1 = nn.Linear(d, spec.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(spec.intermediate_size, d, bias=True)
        self.act = ACTIVATIONS[spec.hidden_act]

    def forward(self, x_PD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        p = x_PD.shape[0]
        q, k, v = self.qkv(self.norm1(x_PD)).view(p, 3, self.num_heads, -1).unbind(1)  # [P, hv, hd] each
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(x_PD.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(x_PD.dtype)
        outs = []
        with without_cudnn_sdpa():
            for q_i, k_i, v_i in zip(q.split(lengths), k.split(lengths), v.split(lengths)):
                # [1, hv, L, hd]: SDPA's flash and memory-efficient kernels take 4D inputs only (3D ones run its math
                # path, which keeps the [hv, L, L] probabilities of each image for backward).
                q_i, k_i, v_i = (t.transpose(0, 1)[None] for t in (q_i, k_i, v_i))
                o = F.scaled_dot_product_attention(q_i, k_i, v_i)[0]
                outs.append(o.transpose(0, 1).reshape(o.shape[1], -1))
        x_PD = x_PD + self.proj(torch.cat(outs))
        return x_PD + self.linear_fc2(self.act(self.linear_fc1(self.norm2(x_PD))))


class VisionTower(nn.Module):
    """pixel patches [P, C*Tp*p*p] and grids [I, 3] -> language-model embeddings [P / m^2, D] of the image tokens."""

    def __init__(self, spec: VisionSpec, text_hidden: int):
        super().__init__()
        self.spec = spec
        d, m = spec.hidden_size, spec.spatial_merge_size
        self.patch_embed = nn.Linear(spec.in_channels * spec.temporal_patch_size * spec.patch_size**2, d, bias=True)
        self.pos_embed = nn.Embedding(spec.num_position_embeddings, d)
        self.grid_side = int(spec.num_position_embeddings**0.5)
        head_dim = d // spec.num_heads
        quarter = head_dim // 2
        inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float32) / quarter))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.blocks = nn.ModuleList(VisionBlock(spec) for _ in range(spec.depth))
        self.merger_norm = nn.LayerNorm(d, eps=1e-6)
        self.merger_fc1 = nn.Linear(d * m * m, d * m * m)
        self.merger_fc2 = nn.Linear(d * m * m, text_hidden)

    def _block_order(self, grid_hw: torch.Tensor) -> torch.Tensor:
        """Reorder a [h, w, ...] map into the patch order: merge x merge blocks, row-major within and across."""
        m = self.spec.spatial_merge_size
        h, w = grid_hw.shape[:2]
        blocks = grid_hw.reshape(h // m, m, w // m, m, *grid_hw.shape[2:]).transpose(1, 2)
        return blocks.reshape(h * w, *grid_hw.shape[2:])

    def positions(self, grids: torch.Tensor, dtype: torch.dtype):
        """Learned position embeddings [P, Dv] (the square table bilinearly resampled to each grid, corners
        aligned) and rotary cos, sin [P, 1, hd] from each patch's (row, column)."""
        side = self.grid_side
        table = self.pos_embed.weight.view(side, side, -1).permute(2, 0, 1)[None]  # [1, Dv, side, side]
        pos, coords = [], []
        for t, h, w in grids.tolist():
            grid = F.interpolate(table.float(), size=(h, w), mode="bilinear", align_corners=True)[0]  # [Dv, h, w]
            pos.append(self._block_order(grid.permute(1, 2, 0)).repeat(t, 1))
            rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            coords.append(self._block_order(torch.stack([rows, cols], -1)).repeat(t, 1))
        rc = torch.cat(coords).to(self.inv_freq.device).float()  # [P, 2]
        freqs = torch.cat([rc[:, :1] * self.inv_freq, rc[:, 1:] * self.inv_freq], -1)  # [P, hd / 2]
        angles = torch.cat([freqs, freqs], -1)[:, None, :]
        return torch.cat(pos).to(dtype), angles.cos(), angles.sin()

    def forward(self, pixels: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(pixels.to(self.patch_embed.weight.dtype))
        pos, cos, sin = self.positions(grids, x.dtype)
        x = x + pos
        lengths = [int(h * w) for t, h, w in grids.tolist() for _ in range(t)]  # attention within each frame
        for block in self.blocks:
            x = block(x, cos, sin, lengths)
        m2 = self.spec.spatial_merge_size**2
        x = self.merger_norm(x).view(-1, x.shape[-1] * m2)
        return self.merger_fc2(F.gelu(self.merger_fc1(x)))


def mrope_positions(
    input_ids: torch.Tensor, cu_seqlens: torch.Tensor, grids: torch.Tensor | None, image_token_id: int, merge: int
) -> torch.Tensor:
    """(t, h, w) rotary positions [3, T] of a packed row [1, T], restarting at every document: text tokens count
    up on all three streams; the tokens of an image (a run of image_token_id, t * h * w / merge^2 of them) sit on
    its merged grid, offset by the position reached; after it the count resumes at that offset plus the larger
    side of the merged grid (the Qwen3.5 / Qwen4 convention)."""
    ids = input_ids.reshape(-1)
    is_image = (ids == image_token_id).cpu()
    out = torch.empty(3, len(ids), dtype=torch.long)
    grid_list = grids.tolist() if grids is not None else []
    next_image = 0
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        # Runs of text and of image tokens: text runs count up in one arange, image runs take their grid.
        flags = is_image[start:end]
        change = torch.nonzero(flags[1:] != flags[:-1]).flatten().add(1).tolist()
        pos = 0
        for a, b in zip([0] + change, change + [end - start]):
            if not bool(flags[a]):
                out[:, start + a : start + b] = torch.arange(pos, pos + b - a)
                pos += b - a
                continue
            i = a
            while i < b:
                if next_image == len(grid_list):
                    raise ValueError(
                        f"more runs of image tokens ({image_token_id}) in the row than images ({len(grid_list)})"
                    )
                t, h, w = grid_list[next_image]
                next_image += 1
                gh, gw = h // merge, w // merge
                count = t * gh * gw
                tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
                out[:, start + i : start + i + count] = torch.stack([tt, hh, ww]).reshape(3, -1) + pos
                pos, i = pos + max(gh, gw), i + count
    return out.to(input_ids.device)
