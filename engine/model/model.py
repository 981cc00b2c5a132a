"""The decoder: layers declared one by one in the profile, each a token mixer and a channel mixer.

Shapes: T packed tokens in one row [1, T] (documents separated by cu_seqlens [N + 1]), D model dim, V vocabulary.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from moe_tune.engine.parallel.expert_parallel import ExpertLayout
from moe_tune.profiles.schema import LayerSpec, ModelProfile

from .attention import TOKEN_MIXERS, PackedBatch, init_token_mixer
from .blocks import RMSNorm, document_ids, document_positions
from .moe import DenseMLP, MoEBlock, init_moe

IGNORE_INDEX = -100


class CausalLMOutput(NamedTuple):
    """A named tuple, so ZeRO-3 hooks see the tensors inside."""

    loss: torch.Tensor | None  # language-model loss + aux losses (what backward runs on)
    lm_loss: torch.Tensor | None  # mean next-token cross-entropy over labelled tokens
    aux_loss: torch.Tensor  # sum of the MoE layers' weighted load-balancing losses
    logits: torch.Tensor  # [1, T, V]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelProfile, spec: LayerSpec, layout: ExpertLayout | None = None, index: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_one_plus)
        self.self_attn = TOKEN_MIXERS[spec.attention](cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_one_plus)
        if spec.mlp == "moe":
            assert cfg.moe is not None, "the schema requires model.moe for moe layers"
            self.mlp: nn.Module = MoEBlock(cfg.hidden_size, cfg.moe, layout, layer_index=index)
            self.aux_loss_coef = cfg.moe.aux_loss_coef
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size)
            self.aux_loss_coef = 0.0

    def forward(self, x: torch.Tensor, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.self_attn(self.input_layernorm(x), batch)
        y, aux = self.mlp(self.post_attention_layernorm(x))
        return x + y, aux * self.aux_loss_coef


class MoECausalLM(nn.Module):
    """Decoder-only language model over packed rows. `forward(input_ids, cu_seqlens, labels)`."""

    def __init__(
        self, cfg: ModelProfile, activation_checkpointing: bool = False, expert_layout: ExpertLayout | None = None
    ):
        super().__init__()
        self.cfg = cfg
        self.activation_checkpointing = activation_checkpointing
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, spec, expert_layout, i) for i, spec in enumerate(cfg.layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_one_plus)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Deterministic init from model.seed: normal(init_std) projections, ones/zeros norms; each routed expert
        from its own generator, so every expert-parallel layout builds the same model."""
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(self.cfg.seed)
        std = self.cfg.init_std
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(0.0 if module.one_plus else 1.0)
            init_token_mixer(module, std)
            init_moe(module, std, self.cfg.seed)
        torch.random.set_rng_state(gen_state)

    def forward(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        labels: torch.Tensor | None = None,
        loss_denominator: float | None = None,
    ) -> CausalLMOutput:
        """input_ids, labels: [1, T] int64 (labels already shifted: label t is the token after t; -100 ignored);
        cu_seqlens: [N + 1] int32 document starts, cu_seqlens[-1] == T.
        loss_denominator: divide the summed cross-entropy by this instead of the local labelled-token count (data
        parallel runs pass global count / world size, so averaging gradients over ranks gives the global mean)."""
        total = input_ids.shape[1]
        batch = PackedBatch(cu_seqlens, document_positions(cu_seqlens, total), document_ids(cu_seqlens, total))
        x = self.embed_tokens(input_ids)
        aux_total = x.new_zeros((), dtype=torch.float32)
        for layer in self.layers:
            if self.activation_checkpointing and self.training:
                x, aux = checkpoint(layer, x, batch, use_reentrant=False)
            else:
                x, aux = layer(x, batch)
            aux_total = aux_total + aux
        logits = self.lm_head(self.norm(x))
        if labels is None:
            return CausalLMOutput(None, None, aux_total, logits)
        flat_logits, flat_labels = logits.view(-1, logits.shape[-1]).float(), labels.view(-1)
        if loss_denominator is None:
            lm_loss = F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE_INDEX)
        else:
            lm_loss = F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE_INDEX, reduction="sum")
            lm_loss = lm_loss / loss_denominator
        return CausalLMOutput(lm_loss + aux_total, lm_loss, aux_total, logits)



def build_model(
    cfg: ModelProfile, activation_checkpointing: bool = False, expert_layout: ExpertLayout | None = None
) -> MoECausalLM:
    model = MoECausalLM(cfg, activation_checkpointing, expert_layout)
    model.reset_parameters()
    return model
