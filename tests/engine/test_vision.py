"""The vision tower against transformers' Qwen3.5-MoE vision model (qwen4_exp uses the same), with the
checkpoint's weights mapped through the family recipes."""

import pytest
import torch

from moe_tune.engine.families.vision import vision_recipe
from moe_tune.engine.model.vision import VisionTower
from moe_tune.profiles.schema import VisionSpec


def reference_tower(**overrides):
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeVisionConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel

    torch.manual_seed(0)
    config = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4, temporal_patch_size=2,
                  spatial_merge_size=2, out_hidden_size=24, num_position_embeddings=16)
    config.update(overrides)
    vc = Qwen3_5MoeVisionConfig(**config)
    vc._attn_implementation = "eager"
    model = Qwen3_5MoeVisionModel(vc).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model, vc


def our_tower(reference, vc, recipe=vision_recipe):
    spec = VisionSpec(depth=vc.depth, hidden_size=vc.hidden_size, intermediate_size=vc.intermediate_size,
                      num_heads=vc.num_heads, hidden_act=vc.hidden_act, patch_size=vc.patch_size,
                      temporal_patch_size=vc.temporal_patch_size, spatial_merge_size=vc.spatial_merge_size,
                      num_position_embeddings=vc.num_position_embeddings, rope_theta=vc.rope_parameters["rope_theta"],
                      image_token_id=0, vision_start_token_id=1, vision_end_token_id=2)
    tower = VisionTower(spec, vc.out_hidden_size)
    state = {f"model.visual.{k}": v for k, v in reference.state_dict().items()}
    with torch.no_grad():
        for name, param in tower.named_parameters():
            param.copy_(recipe(name)(state.__getitem__))
    return tower


@pytest.mark.parametrize("grids", [[[1, 4, 6]], [[1, 4, 6], [1, 2, 2], [1, 8, 4]]])
def test_tower_equals_reference(grids):
    reference, vc = reference_tower()
    ours = our_tower(reference, vc)
    grid = torch.tensor(grids)
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 4 * 4, requires_grad=True)
    expected = reference(pixels, grid_thw=grid).pooler_output
    got = ours(pixels, grid)
    assert got.shape == (int(grid.prod(-1).sum()) // 4, 24)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    # Gradients of the pixels and of the weights too.
    (g_ref,) = torch.autograd.grad(expected.square().sum(), pixels)
    (g_our,) = torch.autograd.grad(got.square().sum(), pixels)
    torch.testing.assert_close(g_our, g_ref, rtol=0, atol=1e-4 * g_ref.abs().max().item())


def test_images_do_not_see_each_other():
    reference, vc = reference_tower()
    ours = our_tower(reference, vc)
    grid = torch.tensor([[1, 4, 6], [1, 2, 2]])
    pixels = torch.randn(28, 96)
    together = ours(pixels, grid)
    alone = ours(pixels[:24], grid[:1])
    torch.testing.assert_close(together[:6], alone, rtol=0, atol=1e-6)


def test_wrong_mapping_is_caught():
    reference, vc = reference_tower()

    def swapped(name, prefix="model.visual."):  # norm1 and norm2 confused
        if ".norm1." in name:
            name = name.replace(".norm1.", ".norm2.")
        elif ".norm2." in name:
            name = name.replace(".norm2.", ".norm1.")
        return vision_recipe(name, prefix)

    ours = our_tower(reference, vc, swapped)
    grid = torch.tensor([[1, 4, 6]])
    pixels = torch.randn(24, 96)
    assert (ours(pixels, grid) - reference(pixels, grid_thw=grid).pooler_output).abs().max() > 1e-3


def tiny_qwen3_5_config():
    from transformers import Qwen3_5MoeConfig

    text = dict(vocab_size=400, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                shared_expert_intermediate_size=8, linear_num_key_heads=1, linear_num_value_heads=1,
                linear_key_head_dim=8, linear_value_head_dim=8, layer_types=["full_attention"],
                rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5,
                                 "mrope_section": [3, 3, 2]})
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=1, patch_size=4, out_hidden_size=32,
                  num_position_embeddings=16)
    return Qwen3_5MoeConfig(text_config=text, vision_config=vision, image_token_id=300, vision_start_token_id=301,
                            vision_end_token_id=302)


def test_mrope_positions_and_rotary_equal_the_reference():
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeModel, Qwen3_5MoeTextRotaryEmbedding

    from moe_tune.engine.model.blocks import RotaryEmbedding
    from moe_tune.engine.model.vision import mrope_positions

    config = tiny_qwen3_5_config()
    reference = Qwen3_5MoeModel(config)
    docs = [[5, 6, 301] + [300] * 6 + [302, 7, 8, 301] + [300] * 2 + [302, 9], [4, 301] + [300] * 4 + [302, 3]]
    grids = [torch.tensor([[1, 4, 6], [1, 2, 4]]), torch.tensor([[1, 4, 4]])]
    expected = []
    for doc, grid in zip(docs, grids):
        ids = torch.tensor([doc])
        positions, _ = reference.get_rope_index(ids, mm_token_type_ids=(ids == 300).int(), image_grid_thw=grid)
        expected.append(positions[:, 0])
    packed = torch.tensor([docs[0] + docs[1]])
    cu = torch.tensor([0, len(docs[0]), len(docs[0]) + len(docs[1])])
    ours = mrope_positions(packed, cu, torch.cat(grids), 300, 2)
    assert torch.equal(ours, torch.cat(expected, dim=1))  # and each document restarts at 0
    cos, sin = Qwen3_5MoeTextRotaryEmbedding(config.text_config)(torch.zeros(1, 1, 32), torch.cat(expected, 1)[:, None])
    our_cos, our_sin = RotaryEmbedding(32, 0.5, 1000.0, (3, 3, 2)).cos_sin(ours)
    torch.testing.assert_close(our_cos[0, :, 0], cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(our_sin[0, :, 0], sin[0], rtol=0, atol=1e-6)
