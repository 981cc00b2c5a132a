"""Fixtures of the family tests: tiny checkpoints (tests/hf_tiny.py builds and perturbs them) and a short
fine-tune from one."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_tiny import reference_loss, save_tiny_checkpoint


@pytest.fixture
def tiny_checkpoint(tmp_path):
    """`tiny_checkpoint(model)` -> directory of the saved, perturbed checkpoint."""

    def make(model: torch.nn.Module, seed: int = 0) -> Path:
        return save_tiny_checkpoint(model, tmp_path / "checkpoint", seed)

    return make


@pytest.fixture
def short_finetune(tmp_path):
    """`short_finetune(checkpoint_dir, **sections)` -> (RunResult, the reference's loss on the first micro-batch).

    Fine-tunes 3 steps from the checkpoint (ZeRO-3 in this process, LoRA incl. experts) on a small text file with
    the byte tokenizer (the tiny checkpoints have vocab >= 300). The first loss must equal the reference's: the
    adapters start as a no-op, so it checks the trainer's loading path against transformers on real batches."""
    import json

    from moe_tune.engine.align.compare import load_reference
    from moe_tune.engine.data.dataset import PackedDataset, load_documents
    from moe_tune.engine.data.tokenizer import load_tokenizer
    from moe_tune.engine.families import model_profile_from_checkpoint, resolve_job
    from moe_tune.engine.train.trainer import finetune
    from moe_tune.profiles import validate_profile

    def run(checkpoint: Path, **sections):
        data = tmp_path / "data.jsonl"
        data.write_text("".join(json.dumps({"text": f"document {i}: moe-tune packs and trains {i * 7}"}) + "\n"
                                for i in range(40)))
        raw = {
            "name": "family-finetune",
            "model": {"checkpoint": str(checkpoint)},
            "data": {"path": str(data), "tokenizer": "byte", "seq_len": 48},
            "train": {"steps": 3, "micro_batch_size": 2, "lr": 1e-3},
            "output": {"dir": str(tmp_path / "out")},
        }
        raw.update(sections)
        job = resolve_job(validate_profile(raw))
        tok = load_tokenizer(job.tokenizer)
        batch = PackedDataset(load_documents(job.data, tok), job.data.seq_len, tok.pad_id, job.data.seed).micro_batch(
            0, job.train.micro_batch_size
        )
        family, _, _ = model_profile_from_checkpoint(checkpoint)
        expected = reference_loss(load_reference(checkpoint, family), batch.input_ids, batch.cu_seqlens, batch.labels)
        return finetune(job, show_progress=False), expected

    return run
