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


def golden_spec(reference: Path | None, profile_model=None):
    """The model spec a golden trace is of: read from a checkpoint directory's config.json, or a profile's
    `model:` spec."""
    from moe_tune.engine.families import model_profile_from_checkpoint

    return model_profile_from_checkpoint(reference)[2] if reference is not None else profile_model


def golden_model(reference: Path | None, cfg):
    """Our model of spec `cfg` for a golden trace, in fp32: loaded from the checkpoint directory, or built from the
    spec (its weights come from model.seed, so the same profile always builds the same model)."""
    from moe_tune.engine.model.model import build_model

    return load_ours(cfg) if reference is not None else build_model(cfg).eval()


def host_memory_problem(cfg, copies: int = 1) -> str | None:
    """A line when `copies` fp32 copies of the model's parameters do not fit the host memory available now (align
    builds the models on the CPU)."""
    from moe_tune.engine.plan import model_parameters
    from moe_tune.engine.train.resources import GB, host_available_memory

    total = sum(p.numel for p in model_parameters(cfg))
    need, available = copies * total * 4, host_available_memory()
    if need <= available:
        return None
    return (f"the model ({total / 1e9:.2f}B parameters) needs ~{need / GB:.1f} GB of host memory in fp32 for align, "
            f"more than the {available / GB:.1f} GB available")


def spec_differences_line(path: Path, recorded, cfg) -> str | None:
    """A line when the golden trace at `path` was recorded from another model spec than `cfg` (its description's
    `profile`): the first field whose values differ, and how many more (fields the recording's version did not
    have, and the checkpoint's folder, are not compared)."""
    from moe_tune.engine.train.checkpoint import signature_differences

    if not isinstance(recorded, dict):
        return None
    current = cfg.model_dump(mode="json")
    differences = [(key, was, now) for key, was, now in signature_differences(recorded, current)
                   if was != "(not set)" and key != "checkpoint"]  # fmt: skip
    if not differences:
        return None
    key, was, now = differences[0]
    more = f" (and {len(differences) - 1} more field{'s' if len(differences) > 2 else ''})" if len(differences) > 1 \
        else ""  # fmt: skip
    return (f"--golden ({str(path)!r}) was recorded from another model: model.{key} {was} there, {now} here{more}; "
            "check it against the model it was recorded from, or record it again with --update-golden")


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
    cfg = golden_spec(reference, profile_model)
    if (memory := host_memory_problem(cfg)) is not None:
        raise ProfileError([memory])
    if path.exists() and not update:
        if (other := spec_differences_line(path, read_golden(path)[1].get("profile"), cfg)) is not None:
            raise ProfileError([other])
    model = golden_model(reference, cfg)
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
