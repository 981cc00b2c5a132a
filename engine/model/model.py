"""The decoder: layers declared one by one in the profile, each a token mixer and a channel mixer.

Shapes: T packed tokens in one row [1, T] (documents separated by cu_seqlens [N + 1]), D model dim, V vocabulary.
"""

from __future__ import annotations

import contextlib

from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from moe_tune.engine.parallel.context import ContextShard, gather_ranks
from moe_tune.engine.parallel.expert_parallel import ExpertLayout
from moe_tune.ops.cross_entropy import cross_entropy, linear_cross_entropy
from moe_tune.profiles.schema import LayerSpec, ModelProfile

from .attention import build_token_mixer, init_token_mixer
from .batch import PackedBatch
from .blocks import RMSNorm, document_ids, document_positions
from .fp8 import Fp8Linear, convert_to_fp8
from .hyper import HyperConnection, HyperDecoderLayer
from .moe import DenseMLP, MoEBlock, RowChunk, channel_mixer, channel_mixer_in_chunks, init_moe
from .ngram import init_ngram
from .vision import VisionTower, mrope_positions

if TYPE_CHECKING:
    from moe_tune.engine.generate.cache import DecodeStep

IGNORE_INDEX = -100
# Where engine/memory attaches its selective-caching manager (a plain attribute: not a submodule, not in the state
# dict).
ACTIVATION_MEMORY_ATTR = "activation_memory"


class CausalLMOutput(NamedTuple):
    """A named tuple, so ZeRO-3 hooks see the tensors inside."""

    loss: torch.Tensor | None  # language-model loss + aux losses (what backward runs on)
    lm_loss: torch.Tensor | None  # mean next-token cross-entropy over labelled tokens (0 when none is labelled)
    aux_loss: torch.Tensor  # sum of the MoE layers' weighted load-balancing losses
    logits: torch.Tensor | None  # [1, T, V]; None when the loss was computed without them (see forward)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelProfile, spec: LayerSpec, layout: ExpertLayout | None = None, index: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_one_plus)
        self.self_attn = build_token_mixer(cfg, spec)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_one_plus)
        self.mlp, self.aux_loss_coef = channel_mixer(cfg, spec, layout, index)

    def forward(self, x: torch.Tensor, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        # x comes back from its norm: the residual's gradient is added in the norm's backward pass.
        x, normed = self.input_layernorm(x, with_input=True)
        mixed = self.self_attn(normed, batch)
        shard = batch.context
        # Without an aux loss a shared row's tokens are routed as any others (sequence chunks included).
        shared_row = shard is not None and shard.size > 1 and is_aux_loss_trained(self.mlp)
        chunk_tokens = self.mlp.sequence_chunk_tokens if self.chunks_with_norm else None
        if not shared_row and chunk_tokens is not None and x.shape[1] > chunk_tokens:
            # The norm and the residual add inside each chunk: only x's rows are kept for backward.
            out, aux = channel_mixer_in_chunks(self.mlp, self._channel_mix, x + mixed, chunk_tokens)
            return out, aux * self.aux_loss_coef
        # The residual add and the post-attention norm of its result in one op, both written where a CUDA-graphed
        # MoE block reads its inputs.
        buffers = self.mlp.input_buffers(mixed) if isinstance(self.mlp, MoEBlock) and not shared_row else (None, None)
        x, normed = self.post_attention_layernorm(mixed, residual=x, y_buffer=buffers[0], h_buffer=buffers[1])
        if shared_row:
            y, aux = moe_on_shared_row(self.mlp, normed, shard)
            return x + y, aux * self.aux_loss_coef
        # The channel mixer adds the residual inside the ops that make its output.
        out, aux = self.mlp(normed, residual=x)
        return out, aux * self.aux_loss_coef

    @property
    def chunks_with_norm(self) -> bool:
        """Whether sequence chunks take the post-attention norm and the residual add in with the channel mixer: a
        mixer PEFT wraps whole (lora.modules_to_save) chunks inside the wrapper instead."""
        return isinstance(self.mlp, (MoEBlock, DenseMLP))

    def _channel_mix(self, x: torch.Tensor, mlp) -> torch.Tensor:
        return x + mlp(self.post_attention_layernorm(x))

    def forward_cached(self, x: torch.Tensor, step: DecodeStep) -> torch.Tensor:
        """x: [1, T, D] of the step's tokens -> [1, T, D]: the token mixer continues from its state, the channel
        mixer runs without capacity limits (engine/generate)."""
        x = x + self.self_attn.forward_cached(self.input_layernorm(x), step)
        return x + self.mlp.forward_inference(self.post_attention_layernorm(x))


def is_aux_loss_trained(mlp: nn.Module) -> bool:
    """Whether `mlp` is a MoE block computing its Switch aux loss in this forward."""
    return isinstance(mlp, MoEBlock) and mlp.training and mlp.spec.aux_loss_coef > 0


def moe_on_shared_row(mlp: MoEBlock, h: torch.Tensor, shard: ContextShard) -> tuple[torch.Tensor, torch.Tensor]:
    """A MoE block on this rank's share h [1, T_local, D] of a row shared by a context group (training): the tokens
    are routed and computed as anywhere (expert parallelism takes them wherever they are held), this rank's loads
    are counted, and the Switch aux loss is the whole row's (every rank of the group returns the same value; its
    gradient reaches every rank's router scores through the gather's backward)."""
    num_experts = mlp.spec.num_experts
    no_slots = torch.zeros(num_experts, dtype=torch.long, device=h.device)
    y, routing = mlp(h, chunk=RowChunk(shard.start, shard.row_tokens, no_slots))
    # Counts this rank's loads (and drops); what it returns is the share's own Switch loss, not the row's.
    mlp.finish_row([routing], h.shape[1])
    counts_E = routing.counts_E.clone()
    torch.distributed.all_reduce(counts_E, group=shard.group)
    prob_sum_E = gather_ranks(routing.prob_sum_E, shard).sum(dim=0)
    # MoEBlock.finish_row's Switch loss over the row's statistics: f_e from its counts, P_e its mean score.
    fraction_E = counts_E.float() / (shard.row_tokens * mlp.spec.top_k)
    return y, num_experts * (fraction_E * (prob_sum_E / shard.row_tokens)).sum()


def run_decoder_layer(model: nn.Module, index: int, layer: nn.Module, x: torch.Tensor, batch):
    """One decoder layer of `model`'s forward, under the model's memory policy: the whole layer recomputed
    (memory.activation_checkpointing), selective caching (a manager attached), or plain."""
    if not (model.training and torch.is_grad_enabled()):
        return layer(x, batch)
    if model.activation_checkpointing:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(layer, x, batch, use_reentrant=False)
    # engine/memory's ActivationMemory, attached by attach_activation_memory.
    manager = getattr(model, ACTIVATION_MEMORY_ATTR, None)
    if manager is None:
        return layer(x, batch)
    return manager.run_layer(index, layer, x, batch)


def draw_normal_(weight: torch.Tensor, std: float) -> None:
    """normal(0, std) drawn in fp32 from the default generator (in place when the weight is fp32): a weight built in
    bf16 holds the fp32 draws rounded once, the numbers its FP8 twin quantizes."""
    if weight.dtype == torch.float32:
        nn.init.normal_(weight, std=std)
    else:
        weight.copy_(torch.empty(weight.shape, device=weight.device).normal_(0.0, std))


def cast_float_parameters(module: nn.Module, dtype: torch.dtype | None) -> None:
    """Cast `module`'s floating parameters to `dtype` in place (None: leave them); FP8 bits and buffers stay."""
    if dtype is None:
        return
    for param in module.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)


class MoECausalLM(nn.Module):
    """Decoder-only language model over packed rows. `forward(input_ids, cu_seqlens, labels)`."""

    def __init__(
        self,
        cfg: ModelProfile,
        activation_checkpointing: bool = False,
        expert_layout: ExpertLayout | None = None,
        param_dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.cfg = cfg
        self.activation_checkpointing = activation_checkpointing
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        layer_class = HyperDecoderLayer if cfg.hyper_connections is not None else DecoderLayer
        self.layers = nn.ModuleList()
        for i, spec in enumerate(cfg.layers):
            layer = layer_class(cfg, spec, expert_layout, i)
            if cfg.base_precision == "fp8":
                # Layer by layer, so no more than one layer's float projections exist at a time (the routed experts
                # are built FP8 already).
                convert_to_fp8(layer, f"layers.{i}.")
            cast_float_parameters(layer, param_dtype)
            self.layers.append(layer)
        # With hyper-connections the final norm is the streams' mixer: it norms every stream and merges them.
        self.norm = (
            HyperConnection(cfg, has_injection=False)
            if cfg.hyper_connections is not None
            else RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_one_plus)
        )
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.sequence_chunk_tokens: int | None = None
        self.vision = VisionTower(cfg.vision, cfg.hidden_size) if cfg.vision is not None else None
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        cast_float_parameters(self, param_dtype)

    def set_sequence_chunk_tokens(self, chunk_tokens: int | None) -> None:
        """Run every layer's per-token part (post-attention norm, channel mixer, residual add; with hyper-connections
        the channel mixer) and its token mixer (engine/model/mixer_chunks.py) chunk_tokens tokens at a time, each
        chunk recomputed in backward (memory.sequence_chunk_tokens; None: whole rows). The LM head's loss is chunked
        on its own (ops/cross_entropy)."""
        self.sequence_chunk_tokens = chunk_tokens
        for module in self.modules():
            if isinstance(module, (MoEBlock, DenseMLP)):
                module.sequence_chunk_tokens = chunk_tokens
        for layer in self.layers:
            layer.self_attn.sequence_chunk_tokens = chunk_tokens

    def sequence_chunked_modules(self) -> list[nn.Module]:
        """The modules that run inside sequence chunks (recomputed in backward with them): empty when chunking is
        off."""
        if self.sequence_chunk_tokens is None:
            return []
        chunked = []
        for layer in self.layers:
            chunked += [layer.self_attn, layer.mlp]
            if isinstance(layer, DecoderLayer) and layer.chunks_with_norm:
                chunked.append(layer.post_attention_layernorm)
        return chunked

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Deterministic init from model.seed: normal(init_std) projections, ones/zeros norms; each routed expert
        from its own generator, so every expert-parallel layout builds the same model."""
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(self.cfg.seed)
        std = self.cfg.init_std
        for module in self.modules():
            if isinstance(module, Fp8Linear):
                # The float layer's numbers (the same draws from the same generator), quantized.
                draw = torch.empty(module.out_features, module.in_features,
                                   device=module.weight.device if module.weight.is_cuda else None)
                module.quantize_from(draw.normal_(0.0, std))
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                draw_normal_(module.weight, std)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(0.0 if module.one_plus else 1.0)
            init_token_mixer(module, std)
            init_moe(module, std, self.cfg.seed)
            init_ngram(module)
        torch.random.set_rng_state(gen_state)

    def forward(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        labels: torch.Tensor | None = None,
        loss_denominator: float | torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        return_logits: bool | None = None,
        context: ContextShard | None = None,
    ) -> CausalLMOutput:
        """input_ids, labels: [1, T] int64 (labels already shifted: label t is the token after t; -100 ignored);
        cu_seqlens: [N + 1] int32 document starts, cu_seqlens[-1] == T.
        loss_denominator: divide the summed cross-entropy by this (a number or a 0-dim tensor) instead of the local
        labelled-token count (the trainer passes the step's labelled tokens over all ranks / (world size x
        accumulation steps): trainer.loss_denominator).
        pixel_values [P, C*Tp*p*p], image_grid_thw [I, 3]: the row's images (engine/data/images.py), whose tokens
        are the runs of model.vision.image_token_id in input_ids.
        return_logits: with labels, also return the [1, T, V] logits. None (default): in eval mode only; a training
        forward with labels computes the loss chunk by chunk without them (ops/cross_entropy) whenever the head is
        a plain linear layer (or PEFT's modules_to_save copy of one); other heads always return the logits.
        context: under context parallelism this rank's share of the row (engine/parallel/context.py): input_ids and
        labels are then the tokens [start, stop) of the row, cu_seqlens their document pieces
        (context.local_cu_seqlens()), and positions count from the start of each whole document; the loss is the
        sum over the labels held here, divided by loss_denominator."""
        total = input_ids.shape[1]
        if context is None:
            positions, doc_ids = document_positions(cu_seqlens, total), document_ids(cu_seqlens, total)
        else:
            positions, doc_ids = self._share_positions(context, total, cu_seqlens.device)
        x = self.embed_tokens(input_ids)
        mrope = None
        if self.vision is not None:
            x = self._merge_images(x, input_ids, pixel_values, image_grid_thw)
            if image_grid_thw is not None:  # without images every position stream is the token position
                spec = self.cfg.vision
                mrope = mrope_positions(input_ids, cu_seqlens, image_grid_thw, spec.image_token_id,
                                        spec.spatial_merge_size)
        batch = PackedBatch(cu_seqlens, positions, doc_ids, input_ids[0], mrope, context)
        if self.cfg.hyper_connections is not None:
            x = x.repeat(1, 1, self.cfg.hyper_connections.num_streams)  # every stream starts as the embedding
        aux_total = x.new_zeros((), dtype=torch.float32)
        for index, layer in enumerate(self.layers):
            # Whole-layer recompute, selective caching (engine/memory) or plain, as the memory profile says.
            x, aux = run_decoder_layer(self, index, layer, x, batch)
            aux_total = aux_total + aux
        hidden = self.norm(x)
        if labels is None:
            return CausalLMOutput(None, None, aux_total, self.lm_head(hidden))
        flat_labels = labels.reshape(-1)
        reduction = "mean" if loss_denominator is None else "sum"
        wants_logits = not self.training if return_logits is None else return_logits
        head = None if wants_logits else plain_linear_head(self.lm_head)
        if head is not None:
            # The [T, V] logits (and their gradient) never exist: at T 32K and V 150K they are ~20 GB in fp32.
            logits = None
            lm_loss = linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), head.weight, flat_labels, head.bias,
                                           ignore_index=IGNORE_INDEX, reduction=reduction)
        else:
            logits = self.lm_head(hidden)
            lm_loss = cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), flat_labels,
                                    ignore_index=IGNORE_INDEX, reduction=reduction)
        if loss_denominator is not None:
            lm_loss = lm_loss / loss_denominator
        return CausalLMOutput(lm_loss + aux_total, lm_loss, aux_total, logits)

    def _share_positions(self, context: ContextShard, total: int, device: torch.device):
        """(positions, document ids) [T_local] of the tokens held here: the whole row's, sliced."""
        if total != context.stop - context.start:
            raise ValueError(f"input_ids: {total} tokens, but the context shard holds tokens [{context.start}, "
                             f"{context.stop}) of the row")  # fmt: skip
        if self.vision is not None:
            raise ValueError("a model with a vision tower cannot share a row between context-parallel ranks")
        row_cu = context.row_cu_seqlens.to(device)
        row_tokens = context.row_tokens
        return (context.local(document_positions(row_cu, row_tokens)),
                context.local(document_ids(row_cu, row_tokens)))  # fmt: skip

    def forward_cached(self, input_ids: torch.Tensor, step: DecodeStep,
                       image_features: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [1, T] continuing one sequence (step's tokens) -> logits [1, T, V], the rows `forward` gives over
        the whole sequence; engine/generate/decode.py runs it. image_features [n, D]: the vision tower's output rows
        for the n image tokens among input_ids, in order (the whole prompt's run once by the caller: an image's
        tokens may span two calls); step.mrope_positions then rotates the tokens as `forward` does."""
        x = self.embed_tokens(input_ids)
        if image_features is not None:
            x = self._place_images(x, input_ids, image_features)
        if self.cfg.hyper_connections is not None:
            x = x.repeat(1, 1, self.cfg.hyper_connections.num_streams)
        for layer in self.layers:
            x = layer.forward_cached(x, step)
        return self.lm_head(self.norm(x))

    def _merge_images(self, x, input_ids, pixel_values, image_grid_thw) -> torch.Tensor:
        """The vision tower's output rows replace the image tokens' embeddings, in order. A row without images
        still runs the tower once on one blank image whose output is added times zero: under ZeRO-3 every rank
        must run the same modules (their parameter gathers are collectives), and the tower's gradients exist."""
        spec = self.cfg.vision
        if pixel_values is None:
            m = spec.spatial_merge_size
            grid = torch.tensor([[1, m, m]], device=x.device)
            blank = torch.zeros(m * m, self.vision.patch_embed.in_features, device=x.device, dtype=x.dtype)
            return x + 0.0 * self.vision(blank, grid).sum().to(x.dtype)
        return self._place_images(x, input_ids, self.vision(pixel_values, image_grid_thw))

    def _place_images(self, x: torch.Tensor, input_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """x [1, T, D] with the image tokens' rows replaced by the vision tower's `features` [n, D], in order."""
        is_image = input_ids[0] == self.cfg.vision.image_token_id
        if features.shape[0] != int(is_image.sum()):
            raise ValueError(
                f"{int(is_image.sum())} image tokens in the row but the images give {features.shape[0]} embeddings"
            )
        x = x.clone()
        x[0, is_image] = features.to(x.dtype)
        return x


def plain_linear_head(head: nn.Module) -> nn.Linear | None:
    """The nn.Linear whose x W^T + b is the head's whole output, or None when the head computes more.

    An nn.Linear (not a subclass with its own forward) is itself. PEFT's ModulesToSaveWrapper forwards to one
    module, chosen as its forward chooses: the active adapter's trained copy, or the original when adapters are
    disabled or the active one has no copy. A LoRA layer on the head (a low-rank term after dropout; merging it
    into one weight would round a small update away in bf16) or any other module gives None: the caller computes
    the full logits through the module. The weight is read outside the head's forward; under ZeRO-3 DeepSpeed's
    engine gathers such a parameter on access (it registers it as an external parameter of the running module).
    """
    if isinstance(head, nn.Linear) and type(head).forward is nn.Linear.forward:
        return head
    if type(head).__module__.startswith("peft."):
        from peft.utils.other import ModulesToSaveWrapper

        if isinstance(head, ModulesToSaveWrapper):
            active = head.active_adapters
            if head.disable_adapters or not active or any(a not in head.modules_to_save for a in active):
                return plain_linear_head(head.original_module)
            return plain_linear_head(head.modules_to_save[active[0]])
    return None


def build_model(
    cfg: ModelProfile,
    activation_checkpointing: bool = False,
    expert_layout: ExpertLayout | None = None,
    device: torch.device | None = None,
    param_dtype: torch.dtype | None = None,
) -> MoECausalLM:
    """The model with its random init. `device` (default the CPU) builds and draws it there; `param_dtype` (default
    fp32) casts its floating parameters, layer by layer as they are built (buffers keep their dtypes, as in
    DeepSpeed's cast), so a 30B-80B model never exists in fp32 whole."""
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = MoECausalLM(cfg, activation_checkpointing, expert_layout, param_dtype)
        model.reset_parameters()
    return model
