"""A profile-built model as a transformers checkpoint: the model type whose config reads back the same architecture,
the keys save_pretrained writes for it, the recipes reading exactly those keys, and a one-line refusal per field no
type expresses."""

import functools
import re

import pytest
import torch
from safetensors import safe_open

from moe_tune.engine.families import UnsupportedModel
from moe_tune.engine.families.hub_config import architecture, differences, hub_config_for_profile
from moe_tune.profiles import load_profile
from moe_tune.profiles.schema import ModelProfile

QWEN3_MOE = dict(
    vocab_size=300, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
    layers=[{"attention": "full", "mlp": "dense"}] + [{"attention": "full", "mlp": "moe"}] * 2,
    rope_theta=5000.0, attention_output_gate=False, tie_word_embeddings=True,
    moe=dict(num_experts=5, top_k=2, expert_intermediate_size=16, renormalize=True, aux_loss_coef=0.01),
)
QWEN3_NEXT = dict(
    vocab_size=320, hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=40,
    layers=[{"attention": "linear"}, {"attention": "full"}, {"attention": "linear", "mlp": "dense"},
            {"attention": "full"}],
    partial_rotary_factor=0.5, norm_one_plus=True,
    linear_attention=dict(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=12),
    moe=dict(num_experts=5, top_k=2, expert_intermediate_size=24, shared_expert_intermediate_size=20,
             capacity_factor=1.5),
)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, num_position_embeddings=16,
              image_token_id=317, vision_start_token_id=318, vision_end_token_id=319, mrope_section=[2, 1, 1])
# Every layer MoE, with a vision tower: only the vision-language qwen3_5_moe has both.
QWEN3_5_MOE = dict(QWEN3_NEXT, layers=[{"attention": k} for k in ("linear", "full", "linear", "full")], vision=VISION)
QWEN4_EXP = dict(
    vocab_size=320, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    layers=[{"attention": "linear", "has_ngram_embedding": True}, {"attention": "qsa"},
            {"attention": "linear", "has_ngram_embedding": True}, {"attention": "qsa"}],
    partial_rotary_factor=0.5, norm_one_plus=True,
    linear_attention=dict(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=12),
    sparse_attention=dict(index_heads=8, index_head_dim=12, topk=8, block_size=4),
    moe=dict(num_experts=5, top_k=2, expert_intermediate_size=16, shared_expert_intermediate_size=24),
    hyper_connections=dict(num_streams=3, mix_rank=8),
    ngram_embedding=dict(embed_dim=16, ngram_size=3, heads_per_ngram=2, vocab_size_base=50, vocab_size_multiple=8,
                         hash_seed=1234, conv_kernel_size=4, boundary_token_id=1),
)
DEEPSEEK_V3 = dict(
    vocab_size=300, hidden_size=48, num_attention_heads=4, num_key_value_heads=4, head_dim=20, intermediate_size=64,
    layers=[{"attention": "mla", "mlp": "dense"}] + [{"attention": "mla"}] * 2, rope_theta=5000.0, rms_norm_eps=1e-5,
    attention_output_gate=False,
    mla=dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10),
    # No selection bias of its own: exported as a zero correction bias.
    moe=dict(num_experts=9, top_k=3, expert_intermediate_size=16, score_func="sigmoid", routed_scaling=2.5,
             shared_expert_intermediate_size=32, shared_expert_gate=False, n_group=3, topk_group=2),
)
DEEPSEEK_V32 = dict(DEEPSEEK_V3,
                    layers=[{"attention": "mla_sparse", "mlp": "dense"}] + [{"attention": "mla_sparse"}] * 2,
                    sparse_attention=dict(index_heads=8, index_head_dim=16, topk=6))
KIMI_LINEAR = dict(
    vocab_size=300, hidden_size=32, num_attention_heads=4, num_key_value_heads=4, head_dim=24, intermediate_size=48,
    layers=[{"attention": "kda", "mlp": "dense"}, {"attention": "mla"}, {"attention": "kda"}], rms_norm_eps=1e-5,
    attention_output_gate=False, kda_attention=dict(num_heads=2, head_dim=8),
    mla=dict(q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, rope="none"),
    moe=dict(num_experts=6, top_k=2, expert_intermediate_size=16, score_func="sigmoid", routed_scaling=2.446,
             shared_expert_intermediate_size=16, shared_expert_gate=False, has_selection_bias=True,
             bias_update_rate=1e-3),
)
# Spec -> the model type that expresses it (the first candidate whose config reads it back).
SPECS = {
    "qwen3_moe": (QWEN3_MOE, "qwen3_moe"),
    "qwen3_next": (QWEN3_NEXT, "qwen3_next"),
    # qwen3_5_moe's language model without its vision tower is qwen3_next's architecture, tried first.
    "qwen3_5_moe_text": (dict(QWEN3_5_MOE, vision=None), "qwen3_next"),
    "qwen3_5_moe": (QWEN3_5_MOE, "qwen3_5_moe"),
    "qwen4_exp": (QWEN4_EXP, "qwen4_exp_text"),
    "qwen4_exp_vision": (dict(QWEN4_EXP, vision=VISION), "qwen4_exp"),
    "deepseek_v3": (DEEPSEEK_V3, "deepseek_v3"),
    "deepseek_v32": (DEEPSEEK_V32, "deepseek_v32"),
    "kimi_linear": (KIMI_LINEAR, "kimi_linear"),
}


def spec(name: str, **changes) -> ModelProfile:
    return ModelProfile(**{**SPECS[name][0], **changes})


@functools.cache
def exported(name: str, precision: str = "fp32"):
    return hub_config_for_profile(spec(name), precision)


@pytest.mark.parametrize("name", list(SPECS))
def test_spec_round_trips_to_its_model_type(name):
    family, config, layout = exported(name)
    assert family.model_types[0] == SPECS[name][1]
    assert config["model_type"] == SPECS[name][1] and config["architectures"] == [family.reference_class]
    assert differences(architecture(spec(name)), architecture(family.to_profile(config)), SPECS[name][1]) == []
    assert config["dtype"] == "float32" and {dtype for _, dtype in layout.values()} <= {torch.float32, torch.int64}


def test_precision_sets_the_dtype_and_transformers_keeps_its_fp32_tensors():
    _, config, layout = exported("deepseek_v3", "bf16")
    assert config["dtype"] == "bfloat16"
    fp32 = {key for key, (_, dtype) in layout.items() if dtype == torch.float32}
    # DeepSeek's router and its correction bias stay fp32 in transformers (_keep_in_fp32_modules_strict).
    assert fp32 == {f"model.layers.{i}.mlp.gate.{p}" for i in (1, 2) for p in ("weight", "e_score_correction_bias")}
    assert all(dtype == torch.bfloat16 for key, (_, dtype) in layout.items() if key not in fp32)


@pytest.mark.parametrize("name", list(SPECS))
def test_recipes_read_exactly_the_layout(name):
    """Every tensor of our model, built through its family's recipe from a getter over the layout, reads only keys
    of the layout, gets our shape, and all tensors together read every key."""
    from moe_tune.engine.model.model import build_model

    family, _, layout = exported(name)
    cfg = spec(name)
    model = build_model(cfg)
    read = set()

    def get(key):
        if key not in layout:
            raise KeyError(key)
        read.add(key)
        shape, dtype = layout[key]
        return torch.zeros(shape, dtype=dtype, device="meta")

    persistent, seen = set(model.state_dict(keep_vars=True)), set()
    for module_name, module in model.named_modules():
        tensors = list(module.named_parameters(recurse=False)) + [
            (n, b) for n, b in module.named_buffers(recurse=False) if f"{module_name}.{n}".lstrip(".") in persistent
        ]
        for local_name, tensor in tensors:
            if id(tensor) in seen:
                continue  # tied: loaded once, under its first name
            seen.add(id(tensor))
            name_ = f"{module_name}.{local_name}".lstrip(".")
            recipe = family.recipe(name_, module, cfg)
            if recipe is not None:
                assert tuple(recipe(get).shape) == tuple(tensor.shape), name_
    assert sorted(set(layout) - read) == []


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_next", "qwen3_5_moe", "qwen4_exp", "deepseek_v32", "kimi_linear"])
def test_save_pretrained_writes_the_layout(name, tmp_path):
    """The config builds in transformers, and save_pretrained of that (real, tiny) model writes exactly the layout's
    keys, shapes and dtypes."""
    import transformers

    from moe_tune.engine.align.reference import pure_torch_paths
    from moe_tune.engine.families.hub_config import hf_config

    family, config, layout = exported(name)
    with pure_torch_paths():
        model = getattr(transformers, family.reference_class)._from_config(hf_config(config), dtype=torch.float32)
    model.save_pretrained(str(tmp_path))
    written = {}
    for path in tmp_path.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                tensor = f.get_tensor(key)
                written[key] = (tuple(tensor.shape), tensor.dtype)
    assert written == layout


@pytest.mark.parametrize(
    "profile, result",
    [
        ("bench-qwen3-moe", "qwen3_moe"),
        ("bench-qwen3-next", "qwen3_next"),
        # The tiny default's top-k sparse layer (single keys, over gated attention) is in no transformers model; its
        # closest, qwen3_next, also scales its norms by (1 + w).
        ("tiny", [r"model.layers[3].attention ('sparse'): qwen3_next has no 'sparse' attention layers",
                  r"model.norm_one_plus (False): not expressible as qwen3_next, whose config reads back True"]),
        ("tiny-vl", [r"model.layers[3].attention ('sparse'): qwen3_5_moe has no 'sparse' attention layers",
                     r"model.norm_one_plus (False): not expressible as qwen3_5_moe, whose config reads back True"]),
    ],
)
def test_shipped_profiles(profile, result):
    job = load_profile(profile)
    if isinstance(result, str):
        family, config, layout = hub_config_for_profile(job.model, job.train.precision)
        assert family.model_types[0] == result and config["num_hidden_layers"] == len(job.model.layers)
        assert config["dtype"] == "bfloat16" and "model.layers.7.mlp.experts.63.down_proj.weight" in layout
    else:
        with pytest.raises(UnsupportedModel) as err:
            hub_config_for_profile(job.model, job.train.precision)
        assert err.value.problems == result


SPARSE = dict(index_heads=2, index_head_dim=8, topk=4)
NO_STREAMS = dict(hyper_connections=None, ngram_embedding=None)


NEIGHBOURS = [
    ("qwen3_moe", dict(layers=[{"attention": "full", "mlp": "dense"}, {"attention": "sparse"},
                               {"attention": "full"}],
                       sparse_attention=SPARSE),
     r"^model\.layers\[1\]\.attention \('sparse'\): qwen3_moe has no 'sparse' attention layers$"),
    ("qwen3_moe", dict(partial_rotary_factor=0.5),
     r"^model\.partial_rotary_factor \(0\.5\): not expressible as qwen3_moe, whose config reads back 1\.0$"),
    ("qwen3_moe", dict(norm_one_plus=True), r"^model\.norm_one_plus \(True\): not expressible as qwen3_moe"),
    ("qwen3_moe", dict(moe=dict(QWEN3_MOE["moe"], score_func="sigmoid")),
     r"^model\.moe\.score_func \('sigmoid'\): not expressible as qwen3_moe, whose config reads back 'softmax'$"),
    ("qwen3_moe", dict(moe=dict(QWEN3_MOE["moe"], bias_update_rate=1e-3)),
     r"^model\.moe\.has_selection_bias \(True, or moe\.bias_update_rate > 0\): qwen3_moe's router has no"),
    ("qwen3_moe", dict(moe=dict(QWEN3_MOE["moe"], shared_expert_intermediate_size=8)),
     r"^model\.moe\.shared_expert_intermediate_size \(8\): not expressible as qwen3_moe, whose config reads "
     r"back 0"),
    ("qwen3_moe", dict(vision=dict(VISION, mrope_section=[2, 1, 1]), head_dim=8, partial_rotary_factor=1.0),
     r"^model\.vision \(depth=1, hidden_size=32, .*\): qwen3_moe has none$"),
    ("qwen3_moe", dict(moe=dict(QWEN3_MOE["moe"], routed_scaling=2.0)),
     r"^model\.moe\.routed_scaling \(2\.0\): not expressible as qwen3_moe, whose config reads back 1\.0$"),
    # Hyper-connections without qwen4_exp's other parts (QSA layers).
    ("qwen3_next", dict(hyper_connections=dict(num_streams=2, mix_rank=8)),
     r"^model\.hyper_connections \(num_streams=2, mix_rank=8\): qwen3_next has none$"),
    ("qwen3_next", dict(layers=[{"attention": "kda"}, {"attention": "full"},
                                {"attention": "linear", "mlp": "dense"},
                                {"attention": "full"}], kda_attention=dict(num_heads=2, head_dim=8)),
     r"^model\.layers\[0\]\.attention \('kda'\): qwen3_next has no 'kda' attention layers$"),
    ("qwen3_next", dict(linear_attention=dict(QWEN3_NEXT["linear_attention"], decay="per_channel")),
     r"^model\.linear_attention\.decay \('per_channel'\): not expressible as qwen3_next"),
    ("qwen3_next", dict(linear_attention=dict(QWEN3_NEXT["linear_attention"], output_gate_activation="sigmoid")),
     r"^model\.linear_attention\.output_gate_activation \('sigmoid'\): not expressible as qwen3_next"),
    ("qwen3_next", dict(moe=dict(QWEN3_NEXT["moe"], shared_expert_gate=False)),
     r"^model\.moe\.shared_expert_gate \(False\): not expressible as qwen3_next, whose config reads back True$"),
    ("qwen3_next", dict(moe=dict(QWEN3_NEXT["moe"], shared_expert_intermediate_size=0)),
     r"^model\.moe\.shared_expert_intermediate_size \(0\): not expressible as qwen3_next"),
    ("qwen4_exp", dict(layers=[{"attention": "linear", "has_ngram_embedding": True},
                               {"attention": "qsa", "has_ngram_embedding": True},
                               {"attention": "linear"}, {"attention": "qsa"}]),
     r"^model\.layers\[1\]\.has_ngram_embedding \(True\): not expressible as qwen4_exp_text, whose config reads "
     r"back False$"),
    ("qwen4_exp", NO_STREAMS | dict(layers=[{"attention": k} for k in ("linear", "qsa", "linear", "qsa")]),
     r"^model\.hyper_connections \(None\): qwen4_exp_text always has one \(num_streams=4, mix_rank=320\)$"),
    ("deepseek_v32", dict(sparse_attention=dict(index_heads=8, index_head_dim=16, topk=6, block_size=2)),
     r"^model\.sparse_attention\.block_size \(2\): not expressible as deepseek_v32, whose config reads back 1$"),
    ("deepseek_v3", dict(layers=[{"attention": "mla"}, {"attention": "mla", "mlp": "dense"}, {"attention": "mla"}]),
     r"^model\.layers\[1\]\.mlp \('dense'\): not expressible as deepseek_v3, whose config reads back 'moe'$"),
    ("deepseek_v3", dict(mla=dict(DEEPSEEK_V3["mla"], latent_norm_eps=1e-5)),
     r"^model\.mla\.latent_norm_eps \(1e-05\): not expressible as deepseek_v3, whose config reads back 1e-06$"),
    ("kimi_linear", dict(mla=dict(KIMI_LINEAR["mla"], rope="interleaved")),
     r"^model\.mla\.rope \('interleaved'\): not expressible as kimi_linear, whose config reads back 'none'$"),
]


@pytest.mark.parametrize(
    "name, changes, line", NEIGHBOURS,
    ids=[f"{name}-{line.replace(chr(92), '').removeprefix('^model.').split(' (')[0]}" for name, _, line in NEIGHBOURS],
)
def test_neighbours_refused_in_one_line(name, changes, line):
    with pytest.raises(UnsupportedModel) as err:
        hub_config_for_profile(spec(name, **changes))
    assert len(err.value.problems) == 1, err.value.problems
    assert re.search(line, err.value.problems[0]), err.value.problems[0]


class _ModelState:
    """engine/export's StateSource over a model built in this process."""

    def __init__(self, model):
        self.state = model.state_dict()

    def names(self):
        return list(self.state)

    def read(self, name):
        return self.state[name]

    def adapter_state(self):
        return None

    def close(self):
        pass


# One per way a type's keys differ from our names: experts saved per expert, a vision-language nesting, renamed
# modules with fp32 routers, sparse attention's indexer.
@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_5_moe", "kimi_linear", "deepseek_v32"])
def test_exported_model_gives_our_logits(name, tmp_path):
    """Our model built from the spec (every parameter perturbed, routers sharpened), written by the export into the
    layout, loads in transformers with no missing or unexpected keys and gives our logits."""
    import transformers

    from moe_tune.engine.align.reference import pure_torch_paths
    from moe_tune.engine.export.hub import export_hub
    from moe_tune.engine.model.model import build_model

    cfg = spec(name)
    model = build_model(cfg).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            param.add_(torch.randn(param.shape, generator=gen) * (0.1 if param.dim() == 1 else 0.02))
            if param_name.endswith("mlp.gate.weight"):
                param.mul_(20.0)
    family, _, _ = exported(name)
    export_hub(_ModelState(model), cfg, tmp_path / "export", 10**10, "fp32")
    # Longer than the sparse layers' budgets, so their selection matters.
    input_ids = torch.randint(3, 250, (1, 24), generator=gen)
    with torch.no_grad(), pure_torch_paths():
        reference, info = getattr(transformers, family.reference_class).from_pretrained(
            str(tmp_path / "export"), dtype=torch.float32, attn_implementation="eager", output_loading_info=True
        )
        theirs = reference.eval()(input_ids=input_ids).logits
        ours = model(input_ids, torch.tensor([0, 24], dtype=torch.int32)).logits
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert (ours - theirs).abs().max() < 1e-5


@pytest.mark.parametrize("tokenizer", [None, "byte", "folder"])
def test_a_profile_built_export_carries_the_runs_tokenizer_and_its_ids(tokenizer, tmp_path):
    """transformers' generate stops where moe-tune's does: config.json holds the run's tokenizer's bos and eos ids
    (the built-in byte tokenizer's 256 and 257, which has no files; a data.tokenizer folder's own, its files copied
    as they are)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast

    from moe_tune.engine.export.hub import TOKENIZER_FILES, export_hub
    from moe_tune.engine.model.model import build_model

    spec_arg = tokenizer
    if tokenizer == "folder":
        vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {chr(c): c - 29 for c in range(32, 127)}
        core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>",
                                eos_token="</s>").save_pretrained(tmp_path / "tok")  # fmt: skip
        spec_arg = str(tmp_path / "tok")
    cfg = spec("qwen3_moe")
    out = tmp_path / "export"
    export_hub(_ModelState(build_model(cfg)), cfg, out, 10**10, "fp32", tokenizer=spec_arg)
    config = AutoConfig.from_pretrained(str(out))
    eos = GenerationConfig.from_model_config(config).eos_token_id
    copied = sorted(path.name for path in out.iterdir() if path.name in TOKENIZER_FILES)
    if tokenizer == "folder":
        assert (config.bos_token_id, config.eos_token_id, eos) == (1, 2, 2)
        assert copied and all((out / name).read_bytes() == (tmp_path / "tok" / name).read_bytes() for name in copied)
        assert AutoTokenizer.from_pretrained(str(out)).eos_token_id == 2
    else:
        assert (config.bos_token_id, config.eos_token_id, eos) == (256, 257, 257)
        assert copied == []
