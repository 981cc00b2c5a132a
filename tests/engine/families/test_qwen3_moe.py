"""qwen3_moe from a transformers checkpoint: alignment with the reference, a wrong mapping caught, unsupported
configs reported, and a short fine-tune whose first loss is the reference's."""

import pytest
import torch

from moe_tune.engine.align import align_checkpoint
from moe_tune.engine.families import UnsupportedModel, model_profile_from_checkpoint
from moe_tune.engine.families import qwen3_moe as family_module
from moe_tune.engine.families.base import stacked_experts

from hf_tiny import tiny_qwen3_moe


@pytest.fixture
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint(tiny_qwen3_moe())


def test_profile_read_from_config(checkpoint):
    _, _, cfg = model_profile_from_checkpoint(checkpoint)
    assert [(layer.attention, layer.mlp) for layer in cfg.layers] == [("full", "dense"), ("full", "moe"), ("full", "moe")]
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.renormalize) == (7, 2, True)
    assert cfg.rope_theta == 5000.0 and not cfg.attention_output_gate and cfg.checkpoint == checkpoint


@pytest.mark.parametrize("pin", [False, True])
def test_aligned_with_transformers(checkpoint, pin):
    report = align_checkpoint(checkpoint, pin_routing=pin)
    assert report.passed, report.failures
    assert len(report.layers) == 3 and max(row.rel for row in report.layers) < 1e-5
    assert report.logits.max_abs < 1e-5 and report.kl < 1e-7
    # A and B of q, k, v, o in every layer, and of both projections of the experts of the 2 MoE layers.
    assert len(report.lora_grads) == 3 * 4 * 2 + 2 * 2 * 2
    assert max(row.rel for row in report.lora_grads) < 1e-5


def test_swapped_gate_up_is_caught(checkpoint, monkeypatch):
    def swapped(name, module):
        if name.endswith("experts.w_gate_up"):
            base = "model." + name.removesuffix("w_gate_up")
            return stacked_experts(module, lambda e: [f"{base}{e}.up_proj.weight", f"{base}{e}.gate_proj.weight"])
        return original(name, module)

    original = family_module.qwen_recipe
    monkeypatch.setattr(family_module, "qwen_recipe", swapped)
    report = align_checkpoint(checkpoint, pin_routing=True)
    assert not report.passed
    assert report.layers[0].max_abs < 1e-5  # the dense first layer is still right: the table points at layer 1
    assert report.layers[1].max_abs > 1e-4 and report.logits.max_abs > report.tolerances.logits_max_abs


def test_unsupported_config_names_the_field(tiny_checkpoint):
    directory = tiny_checkpoint(tiny_qwen3_moe(hidden_act="gelu", attention_bias=True))
    with pytest.raises(UnsupportedModel) as err:
        model_profile_from_checkpoint(directory)
    assert any("hidden_act ('gelu') is not mapped" in line for line in err.value.problems)
    assert any("attention_bias (True) is not mapped" in line for line in err.value.problems)


def test_unknown_model_type_lists_its_modules(checkpoint):
    import json

    config = json.loads((checkpoint / "config.json").read_text())
    config["model_type"] = "mystery_moe"
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModel) as err:
        model_profile_from_checkpoint(checkpoint)
    assert "model_type ('mystery_moe') is not mapped" in err.value.problems[0]
    assert any(line.endswith("module not mapped: model.layers.*.mlp.experts.*.gate_proj.weight") for line in err.value.problems)


def test_finetune_from_checkpoint_starts_at_the_reference_loss(checkpoint, short_finetune):
    result, reference_first_loss = short_finetune(checkpoint)
    assert len(result.losses) == 3
    assert result.losses[0] == pytest.approx(reference_first_loss, rel=1e-5)
    assert (result.output_dir / "adapter" / "adapter_model.safetensors").is_file()


def test_checkpoint_tokenizer_is_the_default(checkpoint, tmp_path):
    """A profile naming only the checkpoint trains with the tokenizer saved beside the weights."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from typer.testing import CliRunner

    from moe_tune.cli import app
    from moe_tune.engine.families import resolve_job
    from moe_tune.profiles import load_profile

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(40)]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(
        checkpoint
    )
    data = tmp_path / "words.jsonl"
    data.write_text("".join(json.dumps({"text": " ".join(f"w{(i * j) % 40}" for j in range(12))}) + "\n" for i in range(30)))
    profile = tmp_path / "profile.yaml"
    profile.write_text(json.dumps({
        "name": "words", "model": {"checkpoint": str(checkpoint)}, "data": {"path": str(data), "seq_len": 32},
        "train": {"steps": 2, "micro_batch_size": 2, "lr": 1e-3}, "output": {"dir": str(tmp_path / "out")},
    }))
    job = resolve_job(load_profile(profile))
    assert job.tokenizer == str(checkpoint) and job.model.num_attention_heads == 4
    result = CliRunner().invoke(app, ["finetune", str(profile), "--quiet"])
    assert result.exit_code == 0, result.output
    assert "trained steps 1-2" in result.stdout
    # The resolved profile written beside the outputs carries the architecture read from config.json.
    import yaml

    written = yaml.safe_load((tmp_path / "out" / "profile.yaml").read_text())
    assert written["model"]["checkpoint"] == str(checkpoint) and written["model"]["hidden_size"] == 32


def load_problems_after(checkpoint, edit) -> list[str]:
    """The loader's problems with the checkpoint's tensors edited in place by `edit(tensors)` first."""
    from safetensors.torch import load_file, save_file

    from moe_tune.engine.families import load_checkpoint_weights
    from moe_tune.engine.model.model import build_model

    path = checkpoint / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    _, _, cfg = model_profile_from_checkpoint(checkpoint)
    with pytest.raises(UnsupportedModel) as err:
        load_checkpoint_weights(build_model(cfg), cfg)
    return err.value.problems


def test_missing_tensor_is_reported(checkpoint):
    problems = load_problems_after(checkpoint, lambda tensors: tensors.pop("model.layers.2.self_attn.k_norm.weight"))
    assert problems == [
        f"{checkpoint}: tensor model.layers.2.self_attn.k_norm.weight is missing (needed for layers.2.self_attn.k_norm.weight)"
    ]


@pytest.mark.parametrize("key, ours", [("model.layers.2.self_attn.k_norm.weight", "layers.2.self_attn.k_norm.weight"),
                                       ("model.embed_tokens.weight", "embed_tokens.weight")])  # fmt: skip
def test_a_tensor_of_another_shape_is_named_with_its_file(checkpoint, key, ours):
    shapes = {}

    def cut_last_column(tensors):
        shapes["stored"] = tuple(tensors[key].shape)
        tensors[key] = tensors[key][..., :-1].contiguous()
        shapes["cut"] = tuple(tensors[key].shape)

    problems = load_problems_after(checkpoint, cut_last_column)
    assert problems == [f"{checkpoint / 'model.safetensors'}: tensor {key}: makes {ours} of shape {shapes['cut']}, "
                        f"the model expects {shapes['stored']}"]
