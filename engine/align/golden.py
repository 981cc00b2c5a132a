"""Golden traces: our model's hidden states, logits and loss on a fixed batch, recorded once and checked after
every change (a regression test of moe-tune against itself, no reference implementation needed).

A trace is one safetensors file: the batch (input_ids [1, T], cu_seqlens [N + 1]; with images also pixel_values,
image_grid_thw and images_per_document [N]), `layer.{i}` [T, D] hidden states, `logits` [T, V], `loss` []; its
metadata holds the model profile it was recorded from.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from moe_tune.engine.families import UnsupportedModel

from .compare import AlignReport, Document, Row, Tolerances, diff_row, logits_cosine, logits_kl, pack_documents


def trace(model: nn.Module, docs: list[Document]) -> dict[str, torch.Tensor]:
    """Run `model` (ours, eval mode) on the documents packed in one row; return the trace tensors."""
    ids, cu, labels, images = pack_documents(docs)
    hidden: list[torch.Tensor] = []
    handles = [layer.register_forward_hook(lambda _m, _i, out: hidden.append(out[0][0].detach())) for layer in model.layers]
    try:
        with torch.no_grad():
            out = model(ids, cu, labels, **images)
    finally:
        for h in handles:
            h.remove()
    tensors = {"input_ids": ids, "cu_seqlens": cu, "logits": out.logits[0].float(), "loss": out.lm_loss.float(),
               **images}
    if images:
        tensors["images_per_document"] = torch.tensor([0 if d.image_grid_thw is None else len(d.image_grid_thw)
                                                       for d in docs])
    tensors.update({f"layer.{i}": h.float().contiguous() for i, h in enumerate(hidden)})
    return tensors


def _documents_of(golden: dict[str, torch.Tensor]) -> list[Document]:
    """The batch a trace was recorded on, split back into documents with their images."""
    ids, cu = golden["input_ids"][0], golden["cu_seqlens"].long()
    docs = [Document(ids[int(a) : int(b)]) for a, b in zip(cu[:-1], cu[1:])]
    if "pixel_values" in golden:
        grids, pixels = golden["image_grid_thw"], golden["pixel_values"]
        first_patch = [0] + grids.prod(-1).cumsum(0).tolist()
        image = 0
        for doc, count in zip(docs, golden["images_per_document"].tolist()):
            if count:
                doc.image_grid_thw = grids[image : image + count]
                doc.pixel_values = pixels[first_patch[image] : first_patch[image + count]]
                image += count
    return docs


def record_golden(model: nn.Module, docs: list[torch.Tensor], path: Path, description: dict) -> dict[str, torch.Tensor]:
    """Write the trace of `model` to `path` atomically (a half-written file never replaces a good one)."""
    from safetensors.torch import save_file

    from moe_tune.engine.atomic_write import atomic_path

    tensors = trace(model, docs)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"moe_tune_golden": json.dumps(description, default=str)})
    return tensors


def read_golden(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as err:  # safetensors raises its own types for foreign or truncated files
        raise UnsupportedModel([f"--golden {path}: not a golden trace ({err})"]) from None
    if "moe_tune_golden" not in meta or "logits" not in tensors:
        raise UnsupportedModel([f"--golden {path}: not a golden trace (no moe_tune_golden metadata)"])
    return tensors, json.loads(meta["moe_tune_golden"])


def batch_difference(path: Path, docs: list[Document]) -> str | None:
    """How `docs` differ from the batch the trace at `path` was recorded on (None: the same documents and images)."""
    golden, _ = read_golden(path)
    ids, cu, _, images = pack_documents(docs)
    if not torch.equal(cu.long(), golden["cu_seqlens"].long()):
        recorded = (golden["cu_seqlens"][1:] - golden["cu_seqlens"][:-1]).tolist()
        return f"documents of {(cu[1:] - cu[:-1]).tolist()} tokens, the trace's of {recorded}"
    if not torch.equal(ids, golden["input_ids"]):
        return "other token ids"
    for key in ("pixel_values", "image_grid_thw"):
        if (key in images) != (key in golden) or (key in images and not torch.equal(images[key], golden[key])):
            return "other images"
    return None


def check_golden(model: nn.Module, path: Path, tolerances: Tolerances = Tolerances()) -> AlignReport:
    """Run `model` on the batch stored in the trace and compare with the recorded values."""
    golden, description = read_golden(path)
    now = trace(model, _documents_of(golden))
    layer_keys = sorted((k for k in golden if k.startswith("layer.")), key=lambda k: int(k.split(".")[1]))
    if len(layer_keys) != sum(k.startswith("layer.") for k in now):
        raise UnsupportedModel([f"--golden {path}: recorded {len(layer_keys)} layers, the model has a different count"])
    rows = []
    for key in layer_keys:
        if now[key].shape != golden[key].shape:
            raise UnsupportedModel([f"--golden {path}: {key} has shape {tuple(golden[key].shape)}, "
                                    f"the model gives {tuple(now[key].shape)}"])
        rows.append(diff_row(key.replace(".", " "), now[key], golden[key]))
    if now["logits"].shape != golden["logits"].shape:
        raise UnsupportedModel([f"--golden {path}: logits have shape {tuple(golden['logits'].shape)}, "
                                f"the model gives {tuple(now['logits'].shape)}"])
    kl = logits_kl(now["logits"], golden["logits"])
    return AlignReport(
        checkpoint=str(path),
        model_type=f"golden trace of {description.get('model', '?')}",
        documents=(golden["cu_seqlens"][1:] - golden["cu_seqlens"][:-1]).tolist(),
        pinned_routing=False,
        layers=rows,
        logits=diff_row("logits", now["logits"], golden["logits"]),
        logits_cosine=logits_cosine(now["logits"], golden["logits"]),
        kl=kl,
        loss_reference=golden["loss"].item(),
        loss_ours=now["loss"].item(),
        tolerances=tolerances,
    )


__all__ = ["check_golden", "record_golden", "read_golden", "trace", "Row"]
