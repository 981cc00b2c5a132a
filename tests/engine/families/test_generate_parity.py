"""`moe-tune generate` against transformers: a LoRA run of a tiny checkpoint (adapters with random B factors, on
attention, the dense MLP and the experts), exported merged as `moe-tune export --merge` writes it and loaded by
transformers, gives under greedy decoding exactly the token ids transformers' own `generate` gives (fp32, eager, its
PyTorch paths). Two families: softmax attention only (qwen3_moe) and linear attention in its recurrent form beside
gated softmax attention (qwen3_next)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import hf_tiny
from moe_tune.engine.align.reference import pure_torch_paths

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
FAMILIES = {
    "qwen3_moe": (hf_tiny.tiny_qwen3_moe, ATTENTION + ["gate_proj", "up_proj", "down_proj"]),
    "qwen3_next": (hf_tiny.tiny_qwen3_next, ATTENTION + ["z_proj", "b_proj", "a_proj", "gate_proj", "down_proj"]),
}
# Enough tokens that every layer's cache is read many times; the prompt longer than the tiny sparse windows.
NUM_NEW_TOKENS = 16
PROMPT = "moe-tune packs documents and trains experts; "


def write_lora_run(root: Path, builder, targets: list[str]) -> Path:
    """A finished LoRA run's folder written without training: profile.yaml, summary.json and an adapter (as the
    trainer saves it) whose B factors are random, so the merged model is far from the base."""
    import yaml

    from moe_tune.engine.align.compare import load_ours
    from moe_tune.engine.families import resolve_job
    from moe_tune.engine.lora import inject_lora
    from moe_tune.profiles import validate_profile

    checkpoint = hf_tiny.save_tiny_checkpoint(builder(), root / "checkpoint")
    (root / "data.jsonl").write_text(json.dumps({"text": "one document"}) + "\n")
    job = resolve_job(validate_profile({
        "name": "generate-parity", "model": {"checkpoint": str(checkpoint)},
        "data": {"path": str(root / "data.jsonl"), "tokenizer": "byte", "seq_len": 32},
        "train": {"steps": 2, "micro_batch_size": 1, "lr": 1e-3}, "lora": {"target_modules": targets},
        "output": {"dir": str(root / "run")},
    }))
    run = root / "run"
    run.mkdir()
    (run / "profile.yaml").write_text(yaml.safe_dump(job.model_dump(mode="json"), sort_keys=False))
    (run / "summary.json").write_text(json.dumps({"last_step": 2}) + "\n")
    hf_tiny.save_drawn_adapter(inject_lora(load_ours(job.model), job.lora), run / "adapter", 0.3)
    return run


@pytest.fixture(scope="module", params=list(FAMILIES))
def run_dir(request, tmp_path_factory):
    builder, targets = FAMILIES[request.param]
    return write_lora_run(tmp_path_factory.mktemp(request.param), builder, targets)


def transformers_greedy(directory: Path, prompt: list[int], num_tokens: int) -> list[int]:
    """transformers' generate (greedy, no stop token) on the checkpoint folder `directory`: the new token ids."""
    import transformers

    from moe_tune.engine.families import model_profile_from_checkpoint

    family, _, _ = model_profile_from_checkpoint(directory)
    transformers.logging.set_verbosity_error()
    with pure_torch_paths():
        model = getattr(transformers, family.reference_class).from_pretrained(
            str(directory), dtype=torch.float32, attn_implementation="eager", experts_implementation="eager",
            local_files_only=True, **family.reference_kwargs()).eval()
        model.generation_config.eos_token_id = None
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 do_sample=False, max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                                 pad_token_id=0, use_cache=True)
    return out[0, len(prompt):].tolist()


def test_greedy_generate_equals_transformers_on_the_merged_export(run_dir):
    from moe_tune.engine.export.hub import export_run
    from moe_tune.engine.generate.session import load_session

    session = load_session(str(run_dir), device=torch.device("cpu"))
    prompt = session.prompt(text=PROMPT)
    ours = session.generate(prompt, NUM_NEW_TOKENS, stop=False)
    exported = export_run(run_dir, merge=True, out=None)
    assert len(ours.ids) == NUM_NEW_TOKENS
    assert ours.ids == transformers_greedy(exported, prompt, NUM_NEW_TOKENS)
    # The adapters change what is generated (a load that dropped them could not pass the comparison above): the
    # base model, fed the same tokens, would have chosen others.
    from moe_tune.engine.align.compare import load_ours

    ids = torch.tensor([prompt + ours.ids])
    with torch.no_grad():
        logits = load_ours(session.profile.model)(ids, torch.tensor([0, ids.shape[1]], dtype=torch.int32)).logits
    assert logits[0, len(prompt) - 1 : -1].argmax(-1).tolist() != ours.ids
    # A profile whose output.dir holds no run means its base model: the checkpoint's weights.
    import yaml

    profile = run_dir.parent / "base.yaml"
    raw = session.profile.model_dump(mode="json") | {"model": {"checkpoint": str(checkpoint_of(session))}}
    raw["output"]["dir"] = str(run_dir.parent / "no-run")
    profile.write_text(yaml.safe_dump(raw))
    base = load_session(str(profile), device=torch.device("cpu"))
    assert base.note.startswith(f"model: the base model of {profile} (the weights of {checkpoint_of(session)})")
    with torch.no_grad():
        torch.testing.assert_close(base.model(ids, torch.tensor([0, ids.shape[1]], dtype=torch.int32)).logits, logits,
                                   rtol=0, atol=1e-5)


def checkpoint_of(session) -> Path:
    return session.profile.model.checkpoint
