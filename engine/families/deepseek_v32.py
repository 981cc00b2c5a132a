"""deepseek_v32 (DeepSeek-V3.2-Exp): DeepSeek-V3 whose every attention layer is MLA over the keys DeepSeek Sparse
Attention's lightning indexer selects (layer kind mla_sparse); MoE, MLA projections and RoPE as in deepseek_v3
(the attention's RoPE is always interleaved, the indexer's rotate-half).

Checkpoint keys: deepseek_v3's (q_lora_rank is required: no q_proj), plus model.layers.{i}.self_attn.indexer.{wq_b,
wk, k_norm (a LayerNorm: weight and bias), weights_proj}, which are ours under the same names. Dense and MoE layers
follow `mlp_layer_types` ("dense" / "sparse"; by default the first `first_k_dense_replace` are dense).
"""

from __future__ import annotations

from typing import Any

import torch

from .base import HFConfig, show
from .deepseek_v3 import DeepseekV3


class DeepseekV32(DeepseekV3):
    model_types = ("deepseek_v32",)
    reference_class = "DeepseekV32ForCausalLM"
    attention_kind = "mla_sparse"
    # align: the reference's lightning indexers (one per layer), whose choice --pin-routing feeds to ours.
    reference_indexer_suffix = "self_attn.indexer"
    # DeepseekV32Config sets head_dim = qk_rope_head_dim after reading config.json (whose head_dim, an int field,
    # must still be an integer).
    is_head_dim_rotary = False

    def reference_selected_keys(self, output: torch.Tensor) -> torch.Tensor:
        """Bool [L, L] (query, key) from the reference indexer's top-k key positions [1, L, min(index_topk, L)] of
        one document; the acausal keys torch.topk adds for a query with fewer than index_topk keys are dropped."""
        indices_LK = output[0].long()
        length = indices_LK.shape[0]
        chosen = torch.zeros(length, length, dtype=torch.bool).scatter_(1, indices_LK.cpu(), True)
        return chosen & torch.ones(length, length, dtype=torch.bool).tril()

    def rope_kind(self, c: HFConfig) -> str:
        return "interleaved"

    def moe_layers(self, c: HFConfig, num_layers: int) -> list[bool]:
        for i, kind in enumerate(c.get("layer_types") or []):
            if kind != "indexed_attention":
                c.problems.append(
                    f"config.json: layer_types[{i}] ({show(kind)}) is not mapped: must be 'indexed_attention'"
                )
        types = c.get("mlp_layer_types")
        if types is None:
            first_dense = min(c.get("first_k_dense_replace", 3), num_layers)
            types = ["dense"] * first_dense + ["sparse"] * (num_layers - first_dense)
        if len(types) != num_layers or not set(types) <= {"dense", "sparse"}:
            c.problems.append(f"config.json: mlp_layer_types ({show(types)}) is not mapped: must list 'dense' or "
                              f"'sparse' for each of the {num_layers} layers")
            return [False] * num_layers
        return [kind == "sparse" for kind in types]

    def mla_fields(self, c: HFConfig) -> dict[str, Any]:
        c.require("q_lora_rank")
        return super().mla_fields(c)

    def sparse_fields(self, c: HFConfig) -> dict[str, Any] | None:
        return dict(
            index_heads=c.require("index_n_heads"),
            index_head_dim=c.require("index_head_dim"),
            topk=c.require("index_topk"),
            block_size=1,
        )
