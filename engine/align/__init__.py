"""`moe-tune align`: our model against the reference implementation (compare.py) and against a golden trace of
itself (golden.py)."""

from __future__ import annotations

from pathlib import Path

from moe_tune.engine.families import UnsupportedModel
from moe_tune.profiles import ProfileError

from .compare import AlignReport, Document, Row, Tolerances, align_checkpoint, default_documents, load_ours, read_batch
from .golden import batch_difference, check_golden, read_golden, record_golden

__all__ = [
    "AlignReport",
    "Document",
    "Row",
    "Tolerances",
    "align_checkpoint",
    "check_golden",
    "default_documents",
    "golden_model",
    "read_batch",
    "record_golden",
    "run_golden",
]


def golden_model(reference: Path | None, profile_model=None):
    """Our model for a golden trace: loaded from a checkpoint directory, or built from a profile's `model:` spec
    (its weights come from model.seed, so the same profile always builds the same model)."""
    from moe_tune.engine.families import model_profile_from_checkpoint
    from moe_tune.engine.model.model import build_model

    if reference is not None:
        _, _, cfg = model_profile_from_checkpoint(reference)
        return load_ours(cfg), cfg
    return build_model(profile_model).eval(), profile_model


def run_golden(
    path: Path,
    reference: Path | None = None,
    profile_model=None,
    batch: Path | None = None,
    update: bool = False,
    tolerances: Tolerances = Tolerances(),
) -> tuple[AlignReport | None, bool]:
    """Check the golden trace at `path`, or record it when it does not exist yet (or `update`).
    Returns (the comparison, or None when recorded; whether a trace was written). `update` replaces a golden trace
    only: any other file at `path` is refused, not overwritten."""
    if update and path.exists():
        try:
            read_golden(path)
        except UnsupportedModel as err:
            raise UnsupportedModel([f"{line}: --update-golden replaces a golden trace only; remove the file or name "
                                    "another" for line in err.problems]) from None
    model, cfg = golden_model(reference, profile_model)
    # Read (and so checked) whether it records or checks: a --batch that cannot be read is refused either way.
    docs = read_batch(batch, cfg, reference) if batch is not None else None
    if path.exists() and not update:
        if docs is not None and (difference := batch_difference(path, docs)) is not None:
            raise ProfileError([f"--batch ({str(batch)!r}) is not the batch the golden trace {path} was recorded on "
                                f"({difference}): the trace is checked on its own batch; drop --batch, or record "
                                "the trace again with --update-golden"])  # fmt: skip
        return check_golden(model, path, tolerances), False
    docs = docs if docs is not None else default_documents(cfg)
    description = {"model": str(reference) if reference is not None else "profile", "profile": cfg.model_dump(mode="json")}
    record_golden(model, docs, path, description)
    return None, True
