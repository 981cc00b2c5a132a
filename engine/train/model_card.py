"""The adapter's model card (adapter/README.md, written over PEFT's generic one): what was trained on what.

The card names the base model (the checkpoint and its model_type, or the profile's architecture), the moe-tune
version, the LoRA settings and the modules adapted (routed experts included or not), the data (from the data
summary when the run has one: sources, formats, records, documents, tokens), the schedule, the final train loss and
the eval loss when there is one, the precision and the date. The YAML front matter keeps the keys the Hugging Face
hub reads (library_name, base_model, tags)."""

from __future__ import annotations

import datetime
import json
import math
from importlib import metadata
from pathlib import Path
from typing import Any

from moe_tune.profiles.schema import JobProfile

CARD_NAME = "README.md"


def moe_tune_version() -> str:
    try:
        return metadata.version("moe-tune")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _model_type(checkpoint: Path) -> str | None:
    try:
        config = json.loads((checkpoint / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config.get("model_type") if isinstance(config, dict) else None


def base_model_lines(profile: JobProfile) -> list[str]:
    model = profile.model
    if model.checkpoint is not None:
        model_type = _model_type(model.checkpoint)
        return [f"- checkpoint: `{model.checkpoint}`" + (f" (model_type `{model_type}`)" if model_type else "")]
    kinds = sorted({f"{layer.attention}/{layer.mlp}" for layer in model.layers})
    lines = [
        "- built from the profile's architecture (random initialisation): "
        f"{len(model.layers)} layers ({', '.join(kinds)}), hidden size {model.hidden_size}, "
        f"vocabulary {model.vocab_size}"
    ]
    if model.moe is not None:
        lines.append(f"- routed experts: {model.moe.num_experts}, {model.moe.top_k} per token")
    return lines


def lora_lines(profile: JobProfile) -> list[str]:
    lora = profile.lora
    lines = [
        f"- rank {lora.r}, alpha {lora.alpha:g} (scale {lora.alpha / lora.r:g}), dropout {lora.dropout:g}",
        f"- target modules: {', '.join(f'`{name}`' for name in lora.target_modules) or 'none'}",
    ]
    has_experts = profile.model.moe is not None and any(layer.mlp == "moe" for layer in profile.model.layers)
    if has_experts:
        experts = "adapted (an A and a B per expert)" if lora.experts else "not adapted (frozen)"
        lines.append(f"- routed experts: {experts}")
    if lora.modules_to_save:
        lines.append(f"- trained in full: {', '.join(f'`{name}`' for name in lora.modules_to_save)}")
    if profile.model.vision is not None:
        lines.append(f"- vision tower: {lora.vision_tower}; vision merger: {lora.vision_merger}")
    return lines


def data_lines(profile: JobProfile, summary: Any) -> list[str]:
    data = profile.data
    if summary is not None and callable(getattr(summary, "lines", None)):
        lines = [f"- {line}" for line in summary.lines()]
    elif getattr(data, "sources", None):
        lines = [f"- {source.path} (weight {source.weight:g})" for source in data.sources]
    elif data.path is not None:
        lines = [f"- `{data.path}`"]
    else:
        lines = [f"- the built-in `{data.corpus}` corpus"]
    lines.append(f"- tokenizer: `{profile.tokenizer}`, rows of {data.seq_len} tokens")
    return lines


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" + ("" if number == 1 else "s")


def _loss(value: float | None) -> str:
    if value is None:
        return "-"
    perplexity = math.exp(value) if value < 700 else math.inf
    return f"{value:.4f} (perplexity {perplexity:.4g})"


def training_lines(profile: JobProfile, result: Any) -> list[str]:
    train = profile.train
    steps = getattr(result, "total_steps", 0) or train.steps
    epochs = getattr(result, "epochs", None)
    losses = getattr(result, "losses", [])
    lines = [
        f"- steps: {result.last_step} of {steps}" + (f" ({epochs} epochs)" if epochs is not None else "")
        + (f", stopped by {result.interrupted_by}" if getattr(result, "interrupted_by", None) else ""),
        f"- batch per rank: {_count(train.micro_batch_size, 'row')} x "
        f"{_count(train.gradient_accumulation_steps, 'accumulation step')}",
        f"- optimizer: AdamW, lr {train.lr:g} ({train.lr_schedule}), weight decay {train.weight_decay:g}",
        f"- precision: {train.precision}; ZeRO stage {profile.parallel.zero_stage}, expert-parallel "
        f"{profile.parallel.expert_parallel}",
        f"- final train loss: {_loss(losses[-1] if losses else None)}",
    ]
    eval_loss = getattr(result, "eval_loss", None)
    if eval_loss is not None:
        lines.append(f"- eval loss (step {getattr(result, 'eval_step', None) or result.last_step}): {_loss(eval_loss)}")
    best = getattr(result, "best_eval_loss", None)
    if best is not None and best != eval_loss:
        lines.append(f"- best eval loss (step {result.best_eval_step}): {_loss(best)}")
    return lines


def model_card(profile: JobProfile, result: Any, summary: Any = None, date: str | None = None) -> str:
    """The card's Markdown. `result`: the trainer's RunResult (last_step, losses; eval_loss, total_steps and epochs
    when the run has them); `summary`: the data summary, or None."""
    date = date or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    version = moe_tune_version()
    front = ["---", "library_name: peft", "tags:", "- moe-tune", "- lora"]
    if profile.model.checkpoint is not None:
        front.insert(2, f"base_model: {json.dumps(str(profile.model.checkpoint))}")
    front.append("---")
    sections = [
        (f"# {profile.name}: LoRA adapter", [f"Trained with moe-tune {version} on {date}."]),
        ("## Base model", base_model_lines(profile)),
        ("## LoRA", lora_lines(profile)),
        ("## Data", data_lines(profile, summary)),
        ("## Training", training_lines(profile, result)),
        ("## Use", [
            "- `moe-tune generate RUN_DIR` loads the base model with this adapter; the run's `profile.yaml` holds "
            "every setting.",
            *(["- `adapter-transformers/` beside this folder is the adapter for transformers + PEFT on the checkpoint."]
              if profile.model.checkpoint is not None else []),
        ]),
    ]  # fmt: skip
    body = "\n\n".join(f"{title}\n\n" + "\n".join(lines) for title, lines in sections)
    return "\n".join(front) + "\n\n" + body + "\n"


def write_model_card(adapter_dir: Path, profile: JobProfile, result: Any, summary: Any = None) -> Path:
    path = adapter_dir / CARD_NAME
    path.write_text(model_card(profile, result, summary), encoding="utf-8")
    return path
