"""Numerical alignment of moe-tune's model against the model's own published implementation (transformers).

Both run in fp32 on the same weights (the checkpoint) and the same documents: ours on one packed row with
cu_seqlens, the reference on each document alone (so packing is checked too). An FP8 checkpoint's reference runs on
its dequantized weights and ours with its FP8 base (model.base_precision fp8), compared with FP8_TOLERANCES.
Compared: the hidden state after every decoder layer, the logits (max abs, cosine, KL), the loss, and the gradients
of LoRA adapters put on the projections the two models share, with identical adapter weights on both sides; for
top-k sparse attention, the keys each query's indexer chose. Images read from files (a --batch's) reach the
reference through transformers' own image processor, and our pixel values and grids are compared with its. The
reference always runs transformers' own PyTorch paths (reference.py), whatever kernel packages are importable.

Shapes: T packed tokens, L tokens of one document, D model dim, V vocabulary, k experts per token.
"""

from __future__ import annotations

import contextlib
import json
import re
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moe_tune.engine.align.reference import describe, external_paths, pure_torch_paths, write_dequantized_checkpoint
from moe_tune.engine.families import Family, UnsupportedModel, load_checkpoint_weights, model_profile_from_checkpoint
from moe_tune.engine.families.base import is_fp8_checkpoint, take
from moe_tune.engine.families.checkpoint import read_config
from moe_tune.profiles.schema import ModelProfile


@dataclass(frozen=True)
class Tolerances:
    logits_max_abs: float = 1e-4
    kl: float = 1e-6
    loss_abs: float = 1e-4
    # per adapter tensor, per row and column: Row.line_rel (line_rel), never below max |g_ours - g_ref| / max |g_ref|
    # (Row.rel; a g_ref all zero: over the largest of all adapters', the only figure there)
    lora_grad_rel: float = 1e-3
    # per layer (and vision features, merged embeddings), per channel: Row.channel_rel (channel_rel), which is
    # never below the whole tensor's max abs / max |reference| (Row.rel)
    hidden_rel: float = 1e-4

    def for_fp8_base(self) -> Tolerances:
        """These tolerances for a model whose base weights are FP8: every field left at the fp32 default takes the
        FP8 default (FP8_TOLERANCES), a field set otherwise stays."""
        default = Tolerances()
        return Tolerances(**{name: getattr(FP8_TOLERANCES if value == getattr(default, name) else self, name)
                             for name, value in vars(self).items()})


# FP8 bases compute with the dequantized weights, as the reference: on the tiny FP8 checkpoints of seven families
# (tests/engine/families/test_fp8_checkpoints.py and glm4_moe, mixtral, kimi_linear; routing pinned or not) the largest
# differences were layer rel 1.7e-6 (per channel 4.9e-6 on qwen3_moe, qwen3_next, deepseek_v3, qwen3_5_moe, massive
# activations or not), logits 6.9e-6, KL 2.5e-8, loss 4.8e-7, LoRA gradient rel 1.5e-5 (per row/column 5.2e-5 on those
# four, massive activations or not): twice those is within the fp32 defaults, which apply.
FP8_TOLERANCES = Tolerances()


@dataclass
class Row:
    """One compared quantity: its name, max abs difference, that relative to the reference's largest value (`rel`),
    and the worst channel's relative difference (`channel_rel`, see channel_rel(): each channel against its own
    scale, so that a few channels of massive activations hide no error in the others; None for LoRA gradients). LoRA
    gradients have the worst row's or column's instead (`line_rel`, see line_rel(); None for the other rows)."""

    name: str
    max_abs: float
    rel: float
    channel_rel: float | None = None
    line_rel: float | None = None

    @property
    def judged_rel(self) -> float:
        """The figure a tolerance applies to: channel_rel or line_rel where computed (never below rel), else rel."""
        if self.channel_rel is not None:
            return self.channel_rel
        return self.rel if self.line_rel is None else self.line_rel


@dataclass
class Selection:
    """The keys one sparse attention layer's indexer chose, ours against the reference's: `rows` query rows compared,
    `differed` of them chose another set (before pinning, when the selection was pinned to the reference's);
    `left_out` rows where the reference's choice left out a key the query sees (elsewhere the budget covers every
    key, so any indexer chooses the same); `beyond_tie` of the differing rows where no near tie explains it: the
    shift of each of our indexer's scores that makes its top-k choose the reference's keys, relative to the row's
    largest |score| (selection_shifts), exceeds the hidden-state tolerance; `tie_shift` the largest such shift."""

    layer: int
    rows: int
    differed: int
    left_out: int = 0
    beyond_tie: int = 0
    tie_shift: float = 0.0


@dataclass
class Routing:
    """The experts one MoE layer's router chose for each token, ours (before pinning, when the routing was pinned)
    against the reference's: `tokens` compared, `differed` of them chose another set, `beyond_tie` of those where no
    near tie explains it (routing_row: moving each router logit by at most the hidden-state tolerance times the
    token's largest |logit| neither makes our rule choose the reference's experts nor changes our own choice)."""

    layer: int
    tokens: int
    differed: int
    beyond_tie: int


@dataclass
class AlignReport:
    checkpoint: str
    model_type: str
    documents: list[int]  # token count of each document
    pinned_routing: bool
    layers: list[Row]
    logits: Row
    logits_cosine: float
    kl: float
    loss_reference: float
    loss_ours: float
    lora_grads: list[Row] = field(default_factory=list)
    tolerances: Tolerances = field(default_factory=Tolerances)
    images: list[int] = field(default_factory=list)  # images in each document
    selections: list[Selection] = field(default_factory=list)  # one per sparse attention layer
    pinned_selection: bool = False  # our indexers took the reference's selection
    reference_paths: str = ""  # which implementation the reference ran (reference.describe)
    routing: list[Routing] = field(default_factory=list)  # one per MoE layer
    # A --batch image whose grid (so its token count) is not the one transformers' image processor gives it
    image_grids: list[str] = field(default_factory=list)

    @property
    def failures(self) -> list[str]:
        tol, out = self.tolerances, list(self.image_grids)
        if not self.logits.max_abs <= tol.logits_max_abs:
            out.append(f"logits max abs {self.logits.max_abs:.3g} > {tol.logits_max_abs:g}")
        if not self.kl <= tol.kl:
            out.append(f"KL {self.kl:.3g} > {tol.kl:g}")
        if not abs(self.loss_ours - self.loss_reference) <= tol.loss_abs:
            out.append(f"loss differs by {abs(self.loss_ours - self.loss_reference):.3g} > {tol.loss_abs:g}")
        out += [
            f"{row.name} rel {row.rel:.3g}"
            + ("" if row.channel_rel is None else f", per channel {row.channel_rel:.3g}")
            + f" > {tol.hidden_rel:g}"
            for row in self.layers
            if not row.judged_rel <= tol.hidden_rel
        ]
        out += [
            f"LoRA gradient {row.name} rel {row.rel:.3g}"
            + ("" if row.line_rel is None else f", per row/column {row.line_rel:.3g}")
            + f" > {tol.lora_grad_rel:g}"
            for row in self.lora_grads
            if not row.judged_rel <= tol.lora_grad_rel
        ]
        # Pinned, the numbers never see our router's own choice: one no near tie explains is a wrong routing rule (a
        # selection bias or group limit ignored). Unpinned, the numbers judge it, and a layer's choice also follows
        # every difference before it.
        if self.pinned_routing:
            out += [
                f"layer {route.layer} routing: {route.beyond_tie} of {route.tokens} tokens chose other experts than "
                "the reference beyond a tie"
                for route in self.routing
                if route.beyond_tie
            ]
        # Likewise a pinned selection: the numbers never see our indexer's own choice (a wrong scale, activation,
        # head weight or rope of the indexer alone).
        if self.pinned_selection:
            out += [
                f"layer {selection.layer} sparse attention: {selection.beyond_tie} of {selection.rows} query rows "
                "chose other keys than the reference beyond a tie"
                for selection in self.selections
                if selection.beyond_tie
            ]
        return out

    @property
    def passed(self) -> bool:
        return not self.failures

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["passed"] = self.passed
        data["failures"] = self.failures
        return data

    def write_json(self, path: Path) -> None:
        """Written atomically (engine/atomic_write.py): a cut write never replaces a whole report."""
        from moe_tune.engine.atomic_write import write_atomically

        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps(self.to_json(), indent=2) + "\n")


@dataclass
class Document:
    """One document to compare: token ids [L], and its images' patches [P, C*Tp*p*p] and grids [I, 3] if any;
    `image_files` the files they were read from (a --batch record's), which the reference reads with transformers'
    own image processor (reference_images)."""

    input_ids: torch.Tensor
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    image_files: list[Path] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.input_ids)


def pack_documents(docs: list[Document]):
    """Documents side by side in one row as our model takes them: input_ids [1, T], cu_seqlens [N + 1], next-token
    labels [1, T] (-100 at each document's last token), and the images' pixel_values / image_grid_thw (or {})."""
    ids = torch.cat([d.input_ids for d in docs])[None]
    cu = torch.tensor([0] + [len(d) for d in docs]).cumsum(0).to(torch.int32)
    labels = torch.cat([torch.cat([d.input_ids[1:], torch.tensor([-100])]) for d in docs])[None]
    images = {}
    with_images = [d for d in docs if d.pixel_values is not None]
    if with_images:
        images = {"pixel_values": torch.cat([d.pixel_values for d in with_images]),
                  "image_grid_thw": torch.cat([d.image_grid_thw for d in with_images])}
    return ids, cu, labels, images


def default_documents(cfg: ModelProfile, lengths: tuple[int, ...] = (23, 9, 14), seed: int = 0) -> list[Document]:
    """Three random documents; with a vision tower the last two carry one and two images (random patches) between
    random text, so the comparison covers text-only and image rows packed together."""
    gen = torch.Generator().manual_seed(seed)
    docs = [Document(torch.randint(0, cfg.vocab_size, (n,), generator=gen)) for n in lengths]
    spec = cfg.vision
    if spec is None:
        return docs
    special = {spec.image_token_id, spec.vision_start_token_id, spec.vision_end_token_id}
    m = spec.spatial_merge_size
    patch_dim = spec.in_channels * spec.temporal_patch_size * spec.patch_size**2
    for doc, grids in zip(docs[1:], ([[1, 2 * m, 3 * m]], [[1, 2 * m, 2 * m], [1, m, 4 * m]])):
        ids = [t for t in doc.input_ids.tolist() if t not in special]
        pieces, cut = [], len(ids) // (len(grids) + 1)
        for i, (t, h, w) in enumerate(grids):
            pieces += ids[i * cut : (i + 1) * cut] + [spec.vision_start_token_id]
            pieces += [spec.image_token_id] * (t * h * w // m**2) + [spec.vision_end_token_id]
        pieces += ids[len(grids) * cut :]
        doc.input_ids = torch.tensor(pieces)
        grid = torch.tensor(grids)
        doc.image_grid_thw = grid
        doc.pixel_values = torch.randn(int(grid.prod(-1).sum()), patch_dim, generator=gen)
    return docs


def read_batch(path: Path, cfg: ModelProfile, tokenizer_dir: Path | None = None) -> list[Document]:
    """Documents from a JSONL file, one per line: {"input_ids": [...]} or {"text": "..."} (tokenised with the
    checkpoint's tokenizer); a text may hold "<image>" placeholders filled from an "images" list of files (models
    with a vision tower: each becomes <vision_start> <image> x n <vision_end>, n from the checkpoint's image
    processor settings)."""
    from moe_tune.engine.data.images import ImageError, image_token_count, read_image_patches
    from moe_tune.engine.data.multimodal import (
        IMAGE_PLACEHOLDER,
        message_parts,
        refuse_unplaced_images,
        resolve_image_path,
    )
    from moe_tune.profiles import ProfileError

    docs, problems = [], []
    tokenizer = vision = None
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise UnsupportedModel([f"--batch {path}: cannot read ({err})"]) from None
    for number, line in enumerate(lines, 1):
        where = f"--batch {path}:{number}"
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            problems.append(f"{where}: not valid JSON ({err.msg})")
            continue
        except (RecursionError, ValueError) as err:
            # Nested past the recursion limit, or an integer literal longer than Python converts.
            problems.append(f"{where}: not valid JSON ({type(err).__name__})")
            continue
        doc = Document(torch.empty(0, dtype=torch.long))
        is_text = isinstance(record, dict) and "text" in record
        if not isinstance(record, dict) or is_text == ("input_ids" in record):
            both = " (not both)" if is_text else ""
            problems.append(f"{where}: must be {{\"input_ids\": [...]}} or {{\"text\": \"...\"}}{both}")
            continue
        if not is_text and not isinstance(record["input_ids"], list):
            problems.append(f"{where}: input_ids ({_excerpt(record['input_ids'])}) must be a list of token ids")
            continue
        if is_text and not isinstance(record["text"], str):
            problems.append(f"{where}: text ({_excerpt(record['text'])}) must be a string")
            continue
        if not is_text and "images" in record:
            problems.append(f"{where}: images fill a text record's {IMAGE_PLACEHOLDER} placeholders: an input_ids "
                            "record takes none")
            continue
        images = record.get("images", [])
        if not isinstance(images, list) or not all(isinstance(image, str) for image in images):
            problems.append(f"{where}: images ({_excerpt(images)}) must be a list of image paths")
            continue
        ids = record.get("input_ids")
        if is_text:
            if tokenizer is None and tokenizer_dir is not None:
                from moe_tune.engine.data.tokenizer import HFTokenizer

                tokenizer = HFTokenizer(tokenizer_dir)
            if tokenizer is None:
                problems.append(f"{where}: text records need the checkpoint's tokenizer")
                continue
            if images and cfg.vision is None:
                problems.append(f"{where}: has images but the model has no vision tower")
                continue
            if images and vision is None:
                vision = _batch_vision(cfg)
            ids, pixels, grids = [], [], []
            unplaced = list(images)
            try:
                for kind, value in message_parts(record["text"], unplaced, where):
                    if kind == "text":
                        ids += tokenizer.encode(value)
                        continue
                    if isinstance(vision, str):
                        raise ProfileError([f"{where}: {vision}"])
                    image_path = resolve_image_path(value, path.parent, where)
                    patches, grid = read_image_patches(image_path, vision.settings, links=False)
                    pixels.append(patches)
                    grids.append(grid)
                    tokens = vision.tokens
                    ids += [tokens.start] + [tokens.image] * image_token_count(grid, vision.settings) + [tokens.end]
                refuse_unplaced_images(unplaced, where)
                # The reference's images: the record's list read again, in its own order (the n-th placeholder takes
                # the n-th image), not the order our placement took them in.
                doc.image_files = [resolve_image_path(value, path.parent, where) for value in images]
            except ProfileError as err:
                problems += err.problems
                continue
            except ImageError as err:
                problems.append(f"{where}: {err}")
                continue
            if pixels:
                doc.pixel_values, doc.image_grid_thw = torch.cat(pixels), torch.tensor(grids)
        # JSON true and false are Python ints too: a token id is an int and not a bool.
        bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < cfg.vocab_size]
        if is_text and bad:
            problems.append(f"{where}: text ({_excerpt(record['text'])}) gives token {bad[0]}, outside the model's "
                            f"vocabulary [0, {cfg.vocab_size})")  # fmt: skip
            continue
        if is_text and len(ids) < 2:
            problems.append(f"{where}: text ({_excerpt(record['text'])}) gives {len(ids)} token"
                            f"{'' if len(ids) == 1 else 's'}: a document needs >= 2")  # fmt: skip
            continue
        if bad or len(ids) < 2:
            problems.append(
                f"{where}: input_ids must be >= 2 ints in [0, {cfg.vocab_size})" + (f" (got {bad[0]!r})" if bad else "")
            )
            continue
        if cfg.vision is not None and (stray := _stray_image_tokens(ids, doc, cfg)):
            if is_text:
                problems.append(f"{where}: text ({_excerpt(record['text'])}) gives {stray}; remove them from the text")
            else:
                problems.append(f"{where}: input_ids hold {stray}; a record of input_ids carries no images (give "
                                "them to a text record)")
            continue
        doc.input_ids = torch.tensor(ids, dtype=torch.long)
        docs.append(doc)
    if not docs and not problems:
        problems.append(f"--batch {path}: holds no documents")
    if problems:
        raise UnsupportedModel(problems)
    return docs


def _batch_vision(cfg: ModelProfile):
    """The image settings and token ids image records of a --batch are read with, as a fine-tune reads them
    (engine/data/dataset.vision_input: the checkpoint's preprocessor_config.json, whose patch sizes must be the
    vision tower's; a --batch sets no pixel bounds of its own), or the line saying why images cannot be read."""
    from types import SimpleNamespace

    from moe_tune.engine.data.dataset import vision_input
    from moe_tune.profiles import ProfileError

    try:
        vision = vision_input(cfg, SimpleNamespace(image_min_pixels=None, image_max_pixels=None))
    except ProfileError as err:
        return err.problems[0]
    return vision if vision.settings is not None else vision.problem


def _stray_image_tokens(ids: list[int], doc: Document, cfg: ModelProfile) -> str | None:
    """What is wrong where `ids` hold the image, vision-start or vision-end token ids elsewhere than the images of
    `doc` put them (each image: start, its image tokens, end), else None. A stray image token would meet no image's
    features, or another image's."""
    spec = cfg.vision
    special = (spec.image_token_id, spec.vision_start_token_id, spec.vision_end_token_id)
    images = 0 if doc.image_grid_thw is None else len(doc.image_grid_thw)
    merge = spec.spatial_merge_size
    expected = 0 if doc.image_grid_thw is None else int(doc.image_grid_thw.prod(-1).sum()) // merge**2
    counts = [ids.count(token) for token in special]
    if counts == [expected, images, images]:
        return None
    return (f"the image token ids ({special[0]}, {special[1]} or {special[2]}) outside {'its ' if images else ''}"
            f"images ({counts[0]} image, {counts[1]} start and {counts[2]} end tokens for {images} images, which put "
            f"{expected}, {images} and {images})")


# Characters of a record's value quoted in a message: enough to find the record, never a whole document.
EXCERPT_CHARS = 40


def _excerpt(value: object) -> str:
    """repr of `value` cut to EXCERPT_CHARS characters."""
    text = repr(value)
    return text if len(text) <= EXCERPT_CHARS else text[: EXCERPT_CHARS - 3] + "..."


def load_reference(directory: Path, family: Family) -> nn.Module:
    """The checkpoint in its published implementation: fp32, eager attention, eager experts, no remote code; built,
    and run at every forward, on transformers' own PyTorch paths (never flash-linear-attention or causal-conv1d)."""
    import warnings

    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    cls = getattr(transformers, family.reference_class)
    with contextlib.ExitStack() as stack, pure_torch_paths():
        source = Path(directory)
        if is_fp8_checkpoint(read_config(source)):
            # transformers' FP8 layers run only on a GPU: the reference is its model on the dequantized weights.
            temporary = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="moe-tune-align-")))
            source = write_dequantized_checkpoint(source, temporary)
        # Mismatched shapes come back listed (transformers raises them as a report printed above a RuntimeError).
        model, loading = cls.from_pretrained(
            str(source),
            dtype=torch.float32,
            attn_implementation="eager",
            experts_implementation="eager",
            local_files_only=True,
            trust_remote_code=False,
            use_safetensors=True,
            ignore_mismatched_sizes=True,
            output_loading_info=True,
            **family.reference_kwargs(),
        )
    if mismatched := sorted(loading.get("mismatched_keys") or (), key=lambda item: item[0]):
        key, stored, needed = mismatched[0]
        more = f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""
        raise UnsupportedModel([f"{directory}: {key} has shape {tuple(stored)}, the architecture its config.json "
                                f"describes needs {tuple(needed)}{more}"])  # fmt: skip
    hold_pure_torch_paths(model)
    return model.eval()


def hold_pure_torch_paths(model: nn.Module) -> None:
    """Every forward of `model` (and so of a PEFT model wrapping it) runs under pure_torch_paths, the backward of
    what it records included; the paths are restored when the forward returns or raises."""
    held = []

    def enter(_module, _args):
        context = pure_torch_paths()
        context.__enter__()
        held.append(context)

    def leave(_module, _args, _output):
        if held:
            held.pop().__exit__(None, None, None)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)


def reference_paths(model: nn.Module) -> str:
    """What the reference ran, for the report: transformers' PyTorch paths, and the external packages its modeling
    module would have called outside pure_torch_paths."""
    import sys

    return describe(external_paths([sys.modules[type(model).__module__]]))


def load_ours(cfg: ModelProfile) -> nn.Module:
    from moe_tune.engine.model.model import build_model

    model = build_model(cfg)
    load_checkpoint_weights(model, cfg)
    return model.eval()


def _submodule(model: nn.Module, path: str) -> nn.Module:
    for part in path.split("."):
        model = getattr(model, part)
    return model


def _capture(modules: list[nn.Module], pick) -> tuple[list[list[torch.Tensor]], list]:
    """Forward hooks appending pick(output) of module i to store[i] on every call."""
    store: list[list[torch.Tensor]] = [[] for _ in modules]
    handles = [
        m.register_forward_hook(lambda _m, _i, out, i=i: store[i].append(pick(out).detach())) for i, m in enumerate(modules)
    ]
    return store, handles


def _capture_inputs(modules: list[nn.Module], pick=lambda x: x) -> tuple[list[list[torch.Tensor]], list]:
    """Forward pre-hooks appending pick(the input hidden state) of module i to store[i] on every call (its first
    positional argument, else its `hidden_states` keyword)."""
    store: list[list[torch.Tensor]] = [[] for _ in modules]

    def hook(i: int):
        def keep(_module, args, kwargs):
            store[i].append(pick(args[0] if args else kwargs["hidden_states"]).detach())

        return keep

    return store, [m.register_forward_pre_hook(hook(i), with_kwargs=True) for i, m in enumerate(modules)]


def _embeddings(width: int):
    """The first `width` channels of a decoder layer's input: the merged text and image embeddings at the first."""
    return lambda hidden: hidden[..., :width]


class _RouterLogits:
    """Router logits standing in for MoEBlock._gate_projections' result, so the block's own rule routes them."""

    def __init__(self, logits_TE: torch.Tensor):
        self.logits_TE = logits_TE

    def of(self, _module: nn.Module) -> tuple[torch.Tensor]:
        return (self.logits_TE,)


def block_router_logits(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The router logits [T, E] of our MoE block on its input x [..., D]."""
    with torch.no_grad():
        return block.gate(x.reshape(-1, x.shape[-1])).float()


def block_rule(block: nn.Module):
    """Our MoE block's routing rule (score function, selection bias, group limit) as a function of its router
    logits [T, E] -> experts [T, k]; never pinned. The block's own _route, so the rule compared is the one it runs."""

    def choose(logits_TE: torch.Tensor) -> torch.Tensor:
        assert block.pinned_topk_ids is None, "the routing is read back after the run, unpinned"
        with torch.no_grad():
            return block._route(logits_TE, _RouterLogits(logits_TE))[1]

    return choose


def routing_row(layer: int, choose, logits_TE: torch.Tensor, ref_ids_Tk: torch.Tensor, rel_shift: float,
                n_group: int = 1) -> Routing:  # fmt: skip
    """Our routing rule `choose` (router logits [T, E] -> experts [T, k]) on our router's logits against the experts
    the reference chose, ref_ids_Tk [T, k]. A token whose set of experts differs is within a tie when moving each of
    its logits by at most rel_shift times its largest |logit| either makes `choose` pick the reference's set (up at
    its experts, down in the groups, n_group equal runs of expert ids, that hold none of them) or changes our own
    choice (down at our experts, up elsewhere); otherwise it counts in `beyond_tie`."""
    ours_Tk = choose(logits_TE).long().sort(-1).values
    ref_Tk = ref_ids_Tk.long().to(ours_Tk.device).sort(-1).values
    if ours_Tk.shape != ref_Tk.shape:
        return Routing(layer, len(ref_Tk), len(ref_Tk), len(ref_Tk))
    differs_T = (ours_Tk != ref_Tk).any(-1)
    beyond = 0
    if differs_T.any():
        logits_NE, ref_Nk, ours_Nk = logits_TE[differs_T].float(), ref_Tk[differs_T], ours_Tk[differs_T]
        shift_N1 = rel_shift * logits_NE.abs().amax(-1, keepdim=True)
        to_ref_NE = logits_NE + _towards(ref_Nk, logits_NE.shape, n_group) * shift_N1
        away_NE = logits_NE - _towards(ours_Nk, logits_NE.shape, logits_NE.shape[1]) * shift_N1
        reaches_ref_N = (choose(to_ref_NE).long().sort(-1).values == ref_Nk).all(-1)
        leaves_ours_N = (choose(away_NE).long().sort(-1).values != ours_Nk).any(-1)
        beyond = int((~reaches_ref_N & ~leaves_ours_N).sum())
    return Routing(layer, len(ref_Tk), int(differs_T.sum()), beyond)


def _towards(ids_Nk: torch.Tensor, shape: torch.Size, n_group: int) -> torch.Tensor:
    """[N, E]: 1 at the experts ids_Nk, 0 at the other experts of their groups, -1 in the groups holding none."""
    num_tokens, num_experts = shape
    is_chosen_NE = torch.zeros(shape, dtype=torch.bool, device=ids_Nk.device).scatter_(1, ids_Nk, True)
    in_group_NGe = is_chosen_NE.view(num_tokens, n_group, -1).any(-1, keepdim=True)
    in_group_NE = in_group_NGe.expand(-1, -1, num_experts // n_group).reshape(shape)
    return torch.where(is_chosen_NE, 1.0, torch.where(in_group_NE, 0.0, -1.0))


def _reference_inputs(doc: Document, cfg: ModelProfile,
                      pixel_values: torch.Tensor | None = None) -> dict[str, torch.Tensor]:  # fmt: skip
    """The reference's inputs for one document: its tokens, and its images as `pixel_values` (default: the
    document's own patches) with the document's grids."""
    inputs = {"input_ids": doc.input_ids[None]}
    if doc.pixel_values is not None:
        pixels = doc.pixel_values if pixel_values is None else pixel_values
        inputs.update(pixel_values=pixels, image_grid_thw=doc.image_grid_thw,
                      mm_token_type_ids=(doc.input_ids[None] == cfg.vision.image_token_id).int())
    return inputs


def reference_images(directory: Path, files: list[Path]) -> list[tuple[torch.Tensor, list[int]]]:
    """transformers' pixel values [P, C*Tp*p*p] and grid [t, h, w] of each image file: opened with Pillow and turned
    upright by its EXIF orientation (as transformers' load_image), then through transformers' Qwen2-VL image
    processor (its Pillow backend, whose resize ours is) with the checkpoint's preprocessor_config.json: converted
    to RGB (transparency over white), resized to the patch grid, rescaled, normalised, cut into patches."""
    from PIL import Image, ImageOps
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from moe_tune.engine.data.images import ImageError

    processor = Qwen2VLImageProcessorPil.from_pretrained(str(directory), local_files_only=True)
    out = []
    for file in files:
        with Image.open(file) as image:
            if image.format == "EPS":  # decoding PostScript runs Ghostscript (load_image has refused it already)
                raise ImageError(f"{file}: an EPS file: not read")
            image.load()
            upright = ImageOps.exif_transpose(image)
        processed = processor(images=[upright], return_tensors="pt")
        out.append((processed["pixel_values"].float(), processed["image_grid_thw"][0].tolist()))
    return out


def reference_pixels(directory: Path,
                     docs: list[Document]) -> tuple[list[torch.Tensor | None], Row | None, list[str]]:  # fmt: skip
    """The pixel values the reference runs each document on: transformers' (reference_images) for a document read
    from image files, where every grid transformers gives equals ours (its image tokens are ours); else our own
    (random patches, or a grid transformers gives otherwise: the reference would not run on our tokens). Also the
    `pixel values` row, ours against transformers' over the images whose grids agree (None without image files),
    and a line for each image whose grid differs."""
    per_doc, ours, theirs, lines = [], [], [], []
    for number, doc in enumerate(docs):
        if not doc.image_files:
            per_doc.append(doc.pixel_values)
            continue
        images = reference_images(directory, doc.image_files)
        our_grids = doc.image_grid_thw.tolist()
        first = [0] + doc.image_grid_thw.prod(-1).cumsum(0).tolist()
        for i, ((pixels, grid), our_grid, file) in enumerate(zip(images, our_grids, doc.image_files)):
            if grid == our_grid:
                ours.append(doc.pixel_values[first[i] : first[i + 1]])
                theirs.append(pixels)
            else:
                lines.append(f"document {number} image {i} ({file}): grid {our_grid}, transformers' image processor "
                             f"gives {grid}")
        agree = all(grid == our_grid for (_, grid), our_grid in zip(images, our_grids))
        per_doc.append(torch.cat([pixels for pixels, _ in images]) if agree else doc.pixel_values)
    row = diff_row("pixel values", torch.cat(ours), torch.cat(theirs)) if ours else None
    return per_doc, row, lines


def _sum_loss(logits_LV: torch.Tensor, ids_L: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy of one document (its last token predicts nothing)."""
    return F.cross_entropy(logits_LV[:-1].float(), ids_L[1:], reduction="sum")


def _lora_pairs(ours: nn.Module, cfg: ModelProfile, family: Family, targets: tuple[str, ...]) -> dict[str, str]:
    """Our linear layers whose weight is a checkpoint tensor taken as is, named by suffix in `targets`, paired with
    the reference module that holds that tensor: {our module name: reference module name}."""
    pairs = {}
    for name, module in ours.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in targets:
            recipe = family.recipe(f"{name}.weight", module, cfg)
            if isinstance(recipe, take) and recipe.key.endswith(".weight"):
                pairs[name] = family.reference_name(recipe.key).removesuffix(".weight")
    return pairs


EXPERT_PARAMS = {"w_gate_up": "gate_up_proj", "w_down": "down_proj"}


def _expert_pairs(ours: nn.Module, reference: nn.Module) -> dict[str, str]:
    """Our grouped experts paired with the reference's fused experts module of the same MoE layer (in order),
    where both hold the same weights in the same layout: {our module name: reference module name}. Families whose
    reference stores experts differently simply get no expert pairs."""
    from moe_tune.engine.model.moe import GroupedExperts

    our_experts = [(n, m) for n, m in ours.named_modules() if isinstance(m, GroupedExperts)]
    ref_experts = [(n, m) for n, m in reference.named_modules()
                   if all(isinstance(getattr(m, p, None), nn.Parameter) for p in EXPERT_PARAMS.values())]
    pairs = {}
    if len(our_experts) == len(ref_experts):
        for (our_name, our_m), (ref_name, ref_m) in zip(our_experts, ref_experts):
            weights = _expert_weights(our_m)
            if all(weights[o].shape == getattr(ref_m, r).shape and torch.equal(weights[o], getattr(ref_m, r))
                   for o, r in EXPERT_PARAMS.items()):
                pairs[our_name] = ref_name
    return pairs


def _expert_weights(experts: nn.Module) -> dict[str, torch.Tensor]:
    """Our grouped experts' w_gate_up and w_down as the weights they stand for (FP8 experts dequantized, fp32)."""
    if not getattr(experts, "fp8", False):
        return {name: getattr(experts, name) for name in EXPERT_PARAMS}
    from moe_tune.ops.fp8 import dequantize_weight

    gate_up, gate_up_scale, down, down_scale = experts.fp8_tensors()
    return {"w_gate_up": dequantize_weight(gate_up, gate_up_scale, experts.gate_up_segments),
            "w_down": dequantize_weight(down, down_scale)}


class SharedAdapters:
    """Identical LoRA adapters on both models: PEFT Linear adapters on the paired projections, and per-expert
    adapters on paired experts (ours: GroupedExpertsLoRA A [E, r, in], B [E, out, r]; the reference: PEFT's
    target_parameters wrapper, A [E*r, in] with expert e in rows e*r.., B [out, r*E] with expert e in columns
    j*E + e). Random A and B (B non-zero so A gets a gradient)."""

    def __init__(self, ours, reference, linear: dict[str, str], experts: dict[str, str], rank: int):
        from peft import LoraConfig, get_peft_model

        from moe_tune.engine.lora import with_expert_lora

        self.linear, self.experts, self.rank = linear, experts, rank
        alpha = 2.0 * rank
        self.ours = get_peft_model(
            ours, with_expert_lora(LoraConfig(r=rank, lora_alpha=alpha, target_modules=sorted(linear) + sorted(experts)))
        )
        ref_params = [f"{name}.{p}" for name in sorted(experts.values()) for p in EXPERT_PARAMS.values()]
        self.reference = get_peft_model(
            reference,
            LoraConfig(r=rank, lora_alpha=alpha, target_modules=sorted(linear.values()) or None,
                       target_parameters=ref_params or None),
        )
        self.our_modules = dict(self.ours.base_model.model.named_modules())
        self.ref_modules = dict(self.reference.base_model.model.named_modules())
        gen = torch.Generator().manual_seed(1234)
        with torch.no_grad():
            for our_name, ref_name in linear.items():
                for part in ("lora_A", "lora_B"):
                    ref_w = getattr(self.ref_modules[ref_name], part)["default"].weight
                    ref_w.copy_(torch.randn(ref_w.shape, generator=gen) * 0.1)
                    getattr(self.our_modules[our_name], part)["default"].weight.copy_(ref_w)
            for our_name, ref_name in experts.items():
                for ours_p, ref_p in EXPERT_PARAMS.items():
                    ours_a, ours_b = self._our_factors(our_name, ours_p)
                    ours_a.copy_(torch.randn(ours_a.shape, generator=gen) * 0.1)
                    ours_b.copy_(torch.randn(ours_b.shape, generator=gen) * 0.1)
                    ref_a, ref_b = self._ref_factors(ref_name, ref_p)
                    ref_a.copy_(self._to_ref_a(ours_a))
                    ref_b.copy_(self._to_ref_b(ours_b))

    def _our_factors(self, name: str, param: str):
        module = self.our_modules[name]
        return getattr(module.lora_A["default"], param), getattr(module.lora_B["default"], param)

    def _ref_factors(self, name: str, param: str):
        # PEFT nests one ParamWrapper per targeted parameter around the module; find the one wrapping `param`.
        module = self.ref_modules[name]
        while hasattr(module, "parameter_name"):
            if module.parameter_name == param:
                return module.lora_A["default"].weight, module.lora_B["default"].weight
            module = module.base_layer
        raise KeyError(f"{name}.{param}: no LoRA wrapper in the reference")

    @staticmethod
    def _to_ref_a(a_ERI: torch.Tensor) -> torch.Tensor:
        return a_ERI.reshape(-1, a_ERI.shape[-1])

    @staticmethod
    def _to_ref_b(b_EOR: torch.Tensor) -> torch.Tensor:
        return b_EOR.permute(1, 2, 0).reshape(b_EOR.shape[1], -1)

    def gradient_rows(self) -> list[Row]:
        """lora_gradient_rows of every adapter tensor: ours against the reference's."""
        pairs = []
        for our_name, ref_name in sorted(self.linear.items()):
            for part in ("lora_A", "lora_B"):
                g_ref = getattr(self.ref_modules[ref_name], part)["default"].weight.grad
                g_our = getattr(self.our_modules[our_name], part)["default"].weight.grad
                pairs.append((f"{our_name}.{part}", g_our, g_ref))
        for our_name, ref_name in sorted(self.experts.items()):
            for ours_p, ref_p in EXPERT_PARAMS.items():
                ours_a, ours_b = self._our_factors(our_name, ours_p)
                ref_a, ref_b = self._ref_factors(ref_name, ref_p)
                pairs.append((f"{our_name}.lora_A.{ours_p}", _grad(ours_a, self._to_ref_a), ref_a.grad))
                pairs.append((f"{our_name}.lora_B.{ours_p}", _grad(ours_b, self._to_ref_b), ref_b.grad))
        return lora_gradient_rows(pairs)


def lora_gradient_rows(pairs: list[tuple[str, torch.Tensor | None, torch.Tensor | None]]) -> list[Row]:
    """diff_row of each (name, ours, reference) adapter gradient, relative to the reference's largest value, and
    line_rel: each row and column against its own largest reference value. A gradient the reference holds at exactly
    zero (the query and key adapters when every labelled token attends to itself alone, as in two-token documents)
    has no scale of its own: its difference is taken relative to the largest reference gradient of all the adapters,
    the scale at which ours rounds, and it has no line_rel."""
    references = [ref for _, _, ref in pairs if ref is not None and ref.numel()]
    scale = max((ref.float().abs().max().item() for ref in references), default=0.0)
    rows = []
    for name, ours, ref in pairs:
        row = diff_row(name, ours, ref, zero_scale=scale, per_channel=False)
        if ours is not None and ref is not None and ref.dim() >= 2 and bool(ref.any()):
            lines = line_rel((ours.float() - ref.float()).abs(), ref.float())
            # Never below rel, which fp32 rounding of the per-line quotients could cross (a NaN stays).
            row.line_rel = row.rel if lines < row.rel else lines
        rows.append(row)
    return rows


def _grad(param: torch.Tensor, convert) -> torch.Tensor | None:
    return None if param.grad is None else convert(param.grad)


_LAYER_NUMBER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _layer_of(name: str) -> int | None:
    found = _LAYER_NUMBER.search(f"{name}.")
    return int(found.group(1)) if found else None


def _indexer_pairs(our_root: nn.Module, ref_root: nn.Module, family: Family, directory: Path):
    """[(layer, our indexer, the reference's indexer)] of every sparse attention layer, paired by layer number: ours
    are the PinnableSelection modules, the reference's the modules named by the family's reference_indexer_suffix."""
    from moe_tune.engine.model.selection import PinnableSelection

    ours = {_layer_of(n): m for n, m in our_root.named_modules() if isinstance(m, PinnableSelection)}
    if not ours:
        return []
    suffix = getattr(family, "reference_indexer_suffix", "")
    refs = {_layer_of(n): m for n, m in ref_root.named_modules() if suffix and n.endswith(suffix)}
    if None in ours or None in refs or sorted(ours) != sorted(refs):
        raise UnsupportedModel([f"{directory}: sparse attention in layers {sorted(k for k in ours if k is not None)}, "
                                f"reference indexers ('{suffix}') in layers {sorted(k for k in refs if k is not None)}"])
    return [(i, ours[i], refs[i]) for i in sorted(ours)]


def _our_selected_keys(indices_1TS: torch.Tensor, block_size: int, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Bool [T, T] (query, key) of our indexer's choice over the packed row: causal keys of the query's document."""
    from moe_tune.ops.sparse_attention.reference import selected_key_mask

    return selected_key_mask(indices_1TS[:, :, None, :], block_size, cu_seqlens)[0, 0]


def _pinned_indices(layer: int, ref_keys: list[torch.Tensor], block_size: int, slots: int,
                    cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The reference's choice (bool [L, L] per document) as our indexer's output, int32 [1, T, slots]: key positions
    in the packed row (block_size 1) or block ids local to the document. UnsupportedModel where our indices cannot
    say it (more keys than slots, part of a block)."""
    bounds = cu_seqlens.tolist()
    out = torch.full((1, bounds[-1], slots), -1, dtype=torch.int32)
    for keys_LL, start in zip(ref_keys, bounds[:-1]):
        for t in range(keys_LL.shape[0]):
            chosen = keys_LL[t].nonzero().flatten()
            units = chosen + start if block_size == 1 else torch.unique(chosen // block_size)
            if len(units) > slots:
                raise UnsupportedModel([f"layer {layer}: the reference's indexer chose {len(units)} units for query "
                                        f"{t}, more than our {slots} slots"])
            out[0, start + t, : len(units)] = units.to(torch.int32)
    mask = _our_selected_keys(out, block_size, cu_seqlens)
    for keys_LL, a, b in zip(ref_keys, bounds[:-1], bounds[1:]):
        if not torch.equal(mask[a:b, a:b], keys_LL):
            raise UnsupportedModel([f"layer {layer}: the reference's indexer chose keys that our block-size "
                                    f"{block_size} indices cannot express"])
    return out


@contextlib.contextmanager
def _recording_indexer_calls(modules: list[nn.Module]):
    """Yields {id(module): [the bound arguments of every top-k op call it made]} for our indexer modules (the
    PinnableSelection modules, each choosing with the `topk_indexer` of its class's module, ops.sparse_attention's):
    that name is rebound to a recorder inside the block, and a call is filed under the indexer whose forward makes
    it."""
    import inspect
    import sys

    from moe_tune.ops.sparse_attention import topk_indexer

    signature = inspect.signature(topk_indexer)
    calls: dict[int, list[dict[str, Any]]] = {id(m): [] for m in modules}
    running: list[nn.Module] = []

    def recorder(op):
        def record(*args, **kwargs):
            if running:
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                calls[id(running[-1])].append(dict(bound.arguments))
            return op(*args, **kwargs)

        return record

    namespaces = {sys.modules[type(m).__module__] for m in modules}
    assert all(hasattr(ns, "topk_indexer") for ns in namespaces), "our indexers choose with ops' topk_indexer"
    originals = {ns: ns.topk_indexer for ns in namespaces}

    def enter(module, _args):
        running.append(module)

    def leave(_module, _args, _output):
        running.pop()

    handles = [m.register_forward_pre_hook(enter) for m in modules]
    handles += [m.register_forward_hook(leave, always_call=True) for m in modules]
    try:
        for ns, op in originals.items():
            ns.topk_indexer = recorder(op)
        yield calls
    finally:
        for ns, op in originals.items():
            ns.topk_indexer = op
        for h in handles:
            h.remove()


def _document_scores(call: dict[str, Any], start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Our indexer's scores of one document's queries on its units (keys, or key blocks) [L, U], fp32, from the
    arguments of the top-k op call that chose them (ops.sparse_attention.topk_indexer's rule), and the candidates
    [L, U] bool: the units the op ranks for its free slots (a query's own block, kept whatever it scores, is none)."""
    from moe_tune.ops.sparse_attention.reference import index_scores

    assert call["query_start"] == 0 and call["q_idx"].shape[0] == 1, "align runs one packed row, all its queries"
    q_LHD = call["q_idx"][0, start:end].float().cpu()
    k_LD = call["k_idx"][0, start:end].float().cpu()
    w = call["w_idx"]
    w_LH = torch.ones(q_LHD.shape[:2]) if w is None else w[0, start:end].float().cpu()
    scale = q_LHD.shape[-1] ** -0.5 if call["scale"] is None else call["scale"]
    block_size, length = call["block_size"], end - start
    pos_L1 = torch.arange(length)[:, None]
    if block_size == 1:
        scores_LU = index_scores(q_LHD, w_LH, k_LD, scale, call["activation"])
        return scores_LU, torch.arange(length)[None] <= pos_L1
    num_complete, num_blocks = length // block_size, -(-length // block_size)
    if call["k_idx_is_pooled"]:
        pooled_JD = k_LD[: num_complete * block_size : block_size]
    else:
        pooled_JD = k_LD[: num_complete * block_size].view(num_complete, block_size, -1).mean(1)
    scores_LU = F.pad(index_scores(q_LHD, w_LH, pooled_JD, scale, call["activation"]), (0, num_blocks - num_complete))
    seen_L1 = pos_L1 // block_size if call["always_keep_own_block"] else (pos_L1 + 1) // block_size
    return scores_LU, torch.arange(num_blocks)[None] < seen_L1


def _units(keys_LL: torch.Tensor, block_size: int) -> torch.Tensor:
    """Bool [L, U]: the units (keys, or blocks of block_size keys) holding a chosen key of keys_LL [L, L]."""
    length = keys_LL.shape[-1]
    num_blocks = -(-length // block_size)
    return F.pad(keys_LL, (0, num_blocks * block_size - length)).view(length, num_blocks, block_size).any(-1)


def selection_shifts(scores_LU: torch.Tensor, candidates_LU: torch.Tensor, ours_LU: torch.Tensor,
                     ref_LU: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """Per query row [L], the shift its difference needs to be a tie: under our indexer's scores scores_LU [L, U] (U
    keys or key blocks), half the gap between the best candidate the reference's set ref_LU [L, U] bool leaves out
    and the worst one it holds, over the row's largest |score| among the candidates (candidates_LU: the units the
    top-k ranks). Moving each score by that fraction of the largest makes the top-k choose the reference's set. Our
    own set ours_LU is held to the same rule: it is the top-k of these scores unless they are not the scores that
    chose it. 0 where the sets are equal; inf where they differ outside the candidates or hold different numbers of
    candidates, or where a gap is positive and every score of the row is 0."""
    differs_L = (ours_LU != ref_LU).any(-1)
    outside_L = ((ours_LU != ref_LU) & ~candidates_LU).any(-1)
    counts_differ_L = (ours_LU & candidates_LU).sum(-1) != (ref_LU & candidates_LU).sum(-1)
    scores_LU = scores_LU.float()
    scale_L = torch.where(candidates_LU, scores_LU.abs(), 0.0).amax(-1)

    def gap(chosen_LU: torch.Tensor) -> torch.Tensor:
        best_left_L = torch.where(candidates_LU & ~chosen_LU, scores_LU, float("-inf")).amax(-1)
        worst_held_L = torch.where(candidates_LU & chosen_LU, scores_LU, float("inf")).amin(-1)
        return (best_left_L - worst_held_L).nan_to_num(nan=float("-inf"))

    gap_L = torch.maximum(gap(ref_LU), gap(ours_LU)).clamp_min(0.0)
    shift_L = torch.where(scale_L > 0, gap_L / (2 * scale_L.clamp_min(torch.finfo(torch.float32).tiny)),
                          torch.where(gap_L > 0, float("inf"), 0.0))
    shift_L = torch.where(outside_L | counts_differ_L, float("inf"), shift_L)
    return torch.where(differs_L, shift_L, 0.0)


def _selection_row(layer: int, ours_TT: torch.Tensor, ref_keys: list[torch.Tensor], cu_seqlens: torch.Tensor,
                   call: dict[str, Any], rel_shift: float) -> Selection:  # fmt: skip
    """Selection of one sparse attention layer: our choice ours_TT [T, T] (query, key) over the packed row against
    the reference's per document, and the rows no shift of at most rel_shift explains (selection_shifts)."""
    bounds = cu_seqlens.tolist()
    differed = left_out = beyond = 0
    worst = 0.0
    for keys_LL, a, b in zip(ref_keys, bounds[:-1], bounds[1:]):
        differed += int((ours_TT[a:b, a:b] != keys_LL).any(-1).sum())
        left_out += int((keys_LL != torch.ones_like(keys_LL).tril()).any(-1).sum())
        scores_LU, candidates_LU = _document_scores(call, a, b)
        shift_L = selection_shifts(scores_LU, candidates_LU, _units(ours_TT[a:b, a:b], call["block_size"]),
                                   _units(keys_LL, call["block_size"]))
        beyond += int((shift_L > rel_shift).sum())
        worst = max(worst, shift_L.max().item() if len(shift_L) else 0.0)
    return Selection(layer=layer, rows=bounds[-1], differed=differed, left_out=left_out, beyond_tie=beyond,
                     tie_shift=worst)


def align_checkpoint(
    directory: Path,
    documents: list[Document] | list[torch.Tensor] | None = None,
    pin_routing: bool = False,
    tolerances: Tolerances = Tolerances(),
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj"),
    lora_rank: int = 4,
    pin_selection: bool | None = None,
) -> AlignReport:
    """Run the reference and moe-tune on `documents` (default: three random documents) and compare them. The whole
    run holds pure_torch_paths: the reference is transformers' PyTorch definition whatever is importable.
    pin_routing: our routers take the reference's experts; pin_selection (default: as pin_routing) our sparse
    attention indexers take the reference's keys. A pinned selection hides a wrong indexer from the numbers; the
    report's `selections` still count the rows where ours chose differently, and a pinned one fails where a row
    differs beyond a near tie under our indexer's own scores (selection_shifts)."""
    pin_selection = pin_routing if pin_selection is None else pin_selection
    with pure_torch_paths():
        return _align_checkpoint(directory, documents, pin_routing, pin_selection, tolerances, lora_targets,
                                 lora_rank)


def _align_checkpoint(directory, documents, pin_routing, pin_selection, tolerances, lora_targets,
                      lora_rank) -> AlignReport:
    import warnings

    from moe_tune.engine.model.moe import MoEBlock

    # PEFT warns about our grouped-experts layer, which is registered with it on purpose.
    warnings.filterwarnings("ignore", message="Unsupported layer type", module="peft")
    directory = Path(directory)
    family, config, cfg = model_profile_from_checkpoint(directory)
    if getattr(cfg, "base_precision", "bf16") == "fp8":
        tolerances = tolerances.for_fp8_base()
    reference = load_reference(directory, family)
    ours = load_ours(cfg)
    docs = documents if documents is not None else default_documents(cfg)
    docs = [d if isinstance(d, Document) else Document(d) for d in docs]
    ref_pixels, pixel_row, image_grids = reference_pixels(directory, docs)

    # LoRA on the projections and experts both models share, with the same random A and B on both sides.
    linear_pairs = _lora_pairs(ours, cfg, family, lora_targets)
    expert_pairs = _expert_pairs(ours, reference)
    adapters = None
    if linear_pairs or expert_pairs:
        adapters = SharedAdapters(ours, reference, linear_pairs, expert_pairs, lora_rank)
        ours, reference = adapters.ours, adapters.reference
    ref_root = reference.base_model.model if adapters else reference
    our_root = ours.base_model.model if adapters else ours

    ref_layers = list(_submodule(ref_root, family.reference_layers))
    our_layers = list(our_root.layers)
    if len(ref_layers) != len(our_layers):
        raise UnsupportedModel([f"{directory}: reference has {len(ref_layers)} layers, ours {len(our_layers)}"])
    routers = [m for n, m in ref_root.named_modules() if n.endswith(family.reference_router_suffix)]
    moe_blocks = [m for m in our_root.modules() if isinstance(m, MoEBlock)]
    indexers = _indexer_pairs(our_root, ref_root, family, directory)

    # Reference: each document alone; loss = summed token losses / all labelled tokens, as our packed loss.
    labelled = sum(len(d) - 1 for d in docs)
    ref_hidden, handles = _capture(ref_layers, family.reference_layer_output)
    ref_routes, route_handles = _capture(routers, family.reference_topk_ids)
    ref_keys, key_handles = _capture([ref for _, _, ref in indexers],
                                     lambda out: family.reference_selected_keys(out))
    ref_embeds, embed_handles = _capture_inputs([ref_layers[0]], _embeddings(cfg.hidden_size))
    ref_vision, vision_handles = [], []
    if cfg.vision is not None:
        ref_vision, vision_handles = _capture([_submodule(ref_root, family.reference_vision)],
                                              lambda out: out.pooler_output)
    ref_logits, ref_loss = [], 0.0
    try:
        for doc, pixels in zip(docs, ref_pixels):
            logits = reference(**_reference_inputs(doc, cfg, pixels)).logits[0]
            loss = _sum_loss(logits, doc.input_ids) / labelled
            loss.backward()
            ref_loss += loss.item()
            ref_logits.append(logits.detach())
    finally:
        for h in handles + route_handles + key_handles + embed_handles + vision_handles:
            h.remove()

    ids, cu, labels, images = pack_documents(docs)
    for (layer, ours_indexer, _), keys in zip(indexers, ref_keys):
        ours_indexer.selection_log = []
        if pin_selection:
            ours_indexer.pinned_indices = _pinned_indices(layer, keys, ours_indexer.block_size,
                                                          ours_indexer.num_selected, cu)
    if pin_routing:
        if len(routers) != len(moe_blocks):
            raise UnsupportedModel([f"{directory}: {len(routers)} reference routers, {len(moe_blocks)} MoE layers"])
        for block, routes in zip(moe_blocks, ref_routes):
            block.pinned_topk_ids = torch.cat([r.reshape(-1, r.shape[-1]) for r in routes])

    with_images = bool(images)
    # Our routers' inputs, from which their own choice is taken again after the run (pinned or not).
    router_inputs, router_handles = [], []
    if len(routers) == len(moe_blocks):
        router_inputs, router_handles = _capture_inputs(moe_blocks)
    our_hidden, handles = _capture(our_layers, family.our_layer_output)
    our_embeds, embed_handles = _capture_inputs([our_layers[0]], _embeddings(cfg.hidden_size))
    our_vision, vision_handles = [], []
    if cfg.vision is not None and with_images:
        our_vision, vision_handles = _capture([our_root.vision], lambda out: out)
    try:
        with _recording_indexer_calls([m for _, m, _ in indexers]) as index_calls:
            out = ours(ids, cu, labels, **images)
        out.lm_loss.backward()
    finally:
        for h in handles + embed_handles + vision_handles + router_handles:
            h.remove()
        for block in moe_blocks:
            block.pinned_topk_ids = None
        own_choices = []
        for _, ours_indexer, _ in indexers:
            own_choices.append(ours_indexer.selection_log)
            ours_indexer.selection_log = ours_indexer.pinned_indices = None
    selections = [
        _selection_row(layer, _our_selected_keys(choice[0], ours_indexer.block_size, cu), keys, cu,
                       index_calls[id(ours_indexer)][0], tolerances.hidden_rel)
        for (layer, ours_indexer, _), keys, choice in zip(indexers, ref_keys, own_choices)
    ]

    block_layers = {id(m): _layer_of(n) for n, m in our_root.named_modules() if isinstance(m, MoEBlock)}
    routing = [
        routing_row(block_layers[id(block)], block_rule(block), block_router_logits(block, inputs[0]),
                    torch.cat([r.reshape(-1, r.shape[-1]) for r in routes]), tolerances.hidden_rel, block.spec.n_group)
        for block, inputs, routes in zip(moe_blocks, router_inputs, ref_routes)
    ]

    rows = [] if pixel_row is None else [pixel_row]
    if with_images:
        ref_features = torch.cat([f for f in ref_vision[0]])
        rows.append(diff_row("vision features", our_vision[0][0], ref_features))
        rows.append(diff_row("merged embeddings", our_embeds[0][0].reshape(-1, cfg.hidden_size),
                             torch.cat([e.reshape(-1, cfg.hidden_size) for e in ref_embeds[0]])))
    for i, (ref_h, our_h) in enumerate(zip(ref_hidden, our_hidden)):
        ref_cat = torch.cat([h.reshape(-1, *h.shape[2:]) for h in ref_h])
        rows.append(diff_row(f"layer {i}", our_h[0].reshape(ref_cat.shape), ref_cat))
    ref_all = torch.cat(ref_logits).float()
    our_all = out.logits[0].detach().float()
    logits_row = diff_row("logits", our_all, ref_all)
    kl = logits_kl(our_all, ref_all)

    grads = adapters.gradient_rows() if adapters else []
    return AlignReport(
        checkpoint=str(directory),
        model_type=str(config.get("model_type")),
        documents=[len(d) for d in docs],
        images=[0 if d.image_grid_thw is None else len(d.image_grid_thw) for d in docs],
        pinned_routing=pin_routing,
        pinned_selection=pin_selection and bool(indexers),
        layers=rows,
        logits=logits_row,
        logits_cosine=logits_cosine(our_all, ref_all),
        kl=kl,
        loss_reference=ref_loss,
        loss_ours=out.lm_loss.item(),
        lora_grads=grads,
        tolerances=tolerances,
        selections=selections,
        reference_paths=reference_paths(ref_root),
        routing=routing,
        image_grids=image_grids,
    )


def logits_kl(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """KL(reference || ours) of the next-token distributions, the mean over positions, in float64 (float32's
    log-probabilities near -5 cancel to rounding: 1.2e-8 apart read as 0, or below it), clamped at 0."""
    ref_logp, our_logp = reference.double().log_softmax(-1), ours.double().log_softmax(-1)
    return max(0.0, (ref_logp.exp() * (ref_logp - our_logp)).sum(-1).mean().item())


def logits_cosine(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """The cosine of the two logits tensors, flattened, summed in float64 and clamped to [-1, 1]: float32 sums put
    two equal tensors of 300,000 logits at 1.0000027, wrong in the sixth of the eight digits align prints."""
    value = F.cosine_similarity(ours.double().flatten(), reference.double().flatten(), dim=0).item()
    return min(1.0, max(-1.0, value))


def diff_row(name: str, ours: torch.Tensor | None, ref: torch.Tensor | None, zero_scale: float = 0.0,
             per_channel: bool = True) -> Row:
    """The largest absolute difference of ours from the reference and that over the reference's largest magnitude,
    or over `zero_scale` where the reference is all zero (inf where a gradient is missing on either side, or where
    there is no scale and the difference is not zero); with `per_channel`, channel_rel of tensors of 2 dims or more."""
    if ours is None or ref is None:
        missing = "ours" if ours is None else "reference"
        return Row(f"{name} (no gradient in {missing})", float("inf"), float("inf"))
    diff = (ours.float() - ref.float()).abs()
    largest = diff.max().item()
    scale = ref.float().abs().max().item() or zero_scale
    rel = largest / scale if scale > 0 else (0.0 if largest == 0 else float("inf"))
    channels = channel_rel(diff, ref.float()) if per_channel and ref.dim() >= 2 else None
    return Row(name, largest, rel, channels)


# A channel whose largest reference |value| is below this fraction of the median channel's is measured against that
# fraction of it: a channel the reference leaves near zero still holds rounding from the others.
CHANNEL_FLOOR = 1e-2


def channel_rel(diff: torch.Tensor, ref: torch.Tensor, floor_of_nonzero: bool = False) -> float:
    """max over channels c (the last dim; every other dim is tokens) of max_t |diff[t, c]| / s_c, s_c the reference's
    largest |value| in channel c, at least CHANNEL_FLOOR times the median over channels of those largest values
    (`floor_of_nonzero`: over the channels where it is not zero). A few channels of massive activations (100-10,000x
    the others, common in LLM residual streams) then set the scale of their own errors only. Never below max |diff| /
    max |ref|: no s_c exceeds the largest |ref|. A zero s_c (most channels all zero) gives 0 where the channel's
    difference is zero, else inf."""
    diff_C = diff.reshape(-1, diff.shape[-1]).amax(0)
    scale_C = ref.abs().reshape(-1, ref.shape[-1]).amax(0)
    counted_C = scale_C[scale_C > 0] if floor_of_nonzero else scale_C
    scale_C = scale_C.clamp_min(CHANNEL_FLOOR * (counted_C.median().item() if counted_C.numel() else 0.0))
    ratio_C = torch.where(scale_C > 0, diff_C / scale_C.clamp_min(torch.finfo(torch.float32).tiny),
                          torch.where(diff_C == 0, 0.0, float("inf")))
    return ratio_C.max().item()


def line_rel(diff: torch.Tensor, ref: torch.Tensor) -> float:
    """A gradient's channel_rel along its rows and along its columns, the worse of the two (tensors of more than 2 dims
    taken as [first dim, the rest]). The gradient of a LoRA A [r, in] scales, per column, with the input channel it
    reads, and of B [out, r], per row, with the gradient of the output channel it writes: massive activations make a
    few of them 100-10,000x the others, and against the whole tensor's largest value an error in the others shrinks
    by that factor. In the experts' fused layouts (A [E*r, in], B [out, r*E]) each expert also has rows (columns) of
    its own. The floor counts only rows (columns) that are not all zero: each expert no token chose gives zero ones,
    which may be most of them."""
    diff_RC, ref_RC = diff.reshape(diff.shape[0], -1), ref.reshape(ref.shape[0], -1)
    # torch's max, not Python's: a NaN (ours) must win whichever side it is on.
    return torch.tensor([channel_rel(diff_RC, ref_RC, floor_of_nonzero=True),
                         channel_rel(diff_RC.T, ref_RC.T, floor_of_nonzero=True)]).max().item()
