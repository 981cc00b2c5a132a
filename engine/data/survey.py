"""What `moe-tune validate` reports about a profile's data: the checks finetune makes on it before training (the
tokenizer fits the model, every record reads, something is trained, the warm-up fits the steps train.epochs gives),
then per source and in total the records, documents, tokens and trained tokens, with the records left out, and the
run's optimizer steps.

Nothing is written: the built-in shapes corpus is generated into a temporary folder, removed afterwards.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from moe_tune.profiles import ProfileError
from moe_tune.profiles.schema import JobProfile

from .chat import ChatOptions, chat_options
from .dataset import DataSummary, PackedDataset, load_splits, vision_input
from .tokenizer import load_tokenizer

# Bad records collected before reading stops: every one is listed up to here (the terminal prints the first ones and
# counts the rest); past it, memory would grow with a file of nothing but bad records.
MAX_PROBLEMS = 100_000


@dataclass(frozen=True)
class Schedule:
    """The run's optimizer steps as finetune derives them on one rank (run_steps): train.steps, or the steps that
    cover train.epochs' packed rows."""

    steps: int
    epochs: int | None = None
    rows: int | None = None  # rows in those epochs
    seq_len: int | None = None

    def line(self) -> str:
        if self.epochs is None:
            return f"steps: {self.steps}"
        epochs = "1 epoch" if self.epochs == 1 else f"{self.epochs} epochs"
        rows = "1 row" if self.rows == 1 else f"{self.rows} rows"
        return f"steps: {self.steps} for {epochs} on one rank ({rows} of {self.seq_len} tokens)"


@dataclass(frozen=True)
class DataSurvey:
    tokenizer: str  # the tokenizer as the profile resolves it ('byte' or a directory)
    vocab_size: int
    model_vocab_size: int
    chat: ChatOptions
    has_own_template: bool  # the tokenizer has a chat template
    summary: DataSummary
    skipped: list[str] = field(default_factory=list)  # records left out under data.bad_images: skip
    schedule: Schedule | None = None  # the run's steps (None: not counted)
    # The first training documents (validate --show), each its text with the trained runs marked (shown_document).
    shown: list[str] = field(default_factory=list)

    def lines(self, max_refused: int = 20) -> list[str]:
        """The report for a terminal: the tokenizer and chat options, a line per source and the totals (from
        DataSummary.lines), then the records left out (up to `max_refused`, then a count of the rest)."""
        lines = [f"tokenizer {self.tokenizer}: {self.vocab_size} tokens (model.vocab_size {self.model_vocab_size})"]
        # A text record is trained in full whatever the chat options say.
        if any(s.chats for s in self.summary.sources):
            lines.append(f"chat records: {describe_chat(self.chat, self.has_own_template)}")
        lines += self.summary.lines()
        refused = list(self.summary.refused) or self.skipped
        if refused:
            lines.append(f"{len(refused)} records left out (data.bad_images: skip):")
            lines += [f"  {line}" for line in refused[:max_refused]]
            if len(refused) > max_refused:
                lines.append(f"  ... and {len(refused) - max_refused} more")
        return lines


def describe_chat(options: ChatOptions, has_own_template: bool) -> str:
    """How chat records are rendered and trained, in words."""
    if options.template is not None:
        template = "rendered by data.chat_template"
    elif has_own_template:
        template = "rendered by the tokenizer's chat template"
    else:
        template = "rendered in the built-in format <|role|>\\n...\\n"
    if options.trains_all:
        return f"{template}, every token trained (data.train_on: all)"
    header = "with" if options.train_header else "without"
    return f"{template}, assistant turns trained {header} their header (data.train_on: assistant)"


def survey_data(profile: JobProfile, max_problems: int = MAX_PROBLEMS, show: int = 0) -> DataSurvey:
    """Read the profile's data as finetune does (profile resolved by engine.families.resolve_job) and count it, and
    show the first `show` training documents (shown_document). ProfileError lists every problem finetune would refuse
    the data for: a tokenizer larger than the model's vocabulary, each bad record (file:line and why, up to
    `max_problems`), nothing to train on."""
    tok = load_tokenizer(profile.tokenizer)
    problems = []
    if tok.vocab_size > profile.model.vocab_size:
        problems.append(f"model.vocab_size ({profile.model.vocab_size}) must be >= the tokenizer's ({tok.vocab_size})")
    options = chat_options(profile.data)
    skipped: list[str] = []
    try:
        vision = vision_input(profile.model, profile.data)
        with tempfile.TemporaryDirectory(prefix="moe-tune-validate-") as generated:
            splits = load_splits(profile.data, tok, vision, skipped, generated_dir=Path(generated),
                                 max_problems=max_problems)
    except ProfileError as err:
        raise ProfileError(problems + err.problems) from None
    if problems:
        raise ProfileError(problems)
    has_own_template = bool(getattr(tok, "has_chat_template", False))
    names = {}
    if vision is not None:
        t = vision.tokens
        names = {t.start: "<|vision_start|>", t.image: "<|image_pad|>", t.end: "<|vision_end|>"}
    shown = [shown_document(doc, tok, names) for doc in splits.train[:show]]
    return DataSurvey(profile.tokenizer, tok.vocab_size, profile.model.vocab_size, options, has_own_template,
                      splits.summary, skipped, schedule_of(profile, splits.train, tok.pad_id, vision), shown)


# What encloses each run of trained tokens in a shown document.
TRAINED_OPEN, TRAINED_CLOSE = "\u27e6", "\u27e7"  # ⟦ ⟧


def shown_document(doc, tok, names: dict[int, str] | None = None) -> str:
    """A document as the model reads it, its tokens decoded, each run of trained tokens (the ones the loss is taken
    on: every label that is not ignored) between TRAINED_OPEN and TRAINED_CLOSE; special tokens by name (`names`
    those the tokenizer cannot decode: the image tokens of the byte tokenizer), a run of one special token repeated
    (an image's image tokens) as NAMExCOUNT (_tokens_text)."""
    from .dataset import IGNORE_INDEX

    tokens = list(doc.input_ids)
    trained = [False] + [label != IGNORE_INDEX for label in doc.labels]
    if doc.labels and doc.labels[-1] != IGNORE_INDEX:
        tokens.append(doc.labels[-1])
    else:
        trained.pop()
    parts = []
    start = 0
    while start < len(tokens):
        end = start
        while end < len(tokens) and trained[end] == trained[start]:
            end += 1
        # The marks written in a record's own text are escaped: only trained runs are between them.
        text = _tokens_text(tokens[start:end], tok, names or {})
        text = text.replace(TRAINED_OPEN, "\\u27e6").replace(TRAINED_CLOSE, "\\u27e7")
        parts.append(f"{TRAINED_OPEN}{text}{TRAINED_CLOSE}" if trained[start] else text)
        start = end
    return "".join(parts)


def _tokens_text(ids: list[int], tok, names: dict[int, str]) -> str:
    """The tokens decoded, special tokens by name (the tokenizer's; the byte tokenizer's <bos>, <eos>, <pad>, and
    `names` for ids it cannot decode, else <ID>) and a run of 3 or more of one special token as NAMExCOUNT."""
    from .tokenizer import ByteTokenizer

    is_byte = isinstance(tok, ByteTokenizer)
    if is_byte:
        names = {tok.bos_id: "<bos>", tok.eos_id: "<eos>", tok.pad_id: "<pad>", **names}
    out, plain, at = [], [], 0
    while at < len(ids):
        token = ids[at]
        if not (token in tok.special_ids or token in names or (is_byte and token >= 256)):
            plain.append(token)
            at += 1
            continue
        out.append(tok.decode(plain))
        plain = []
        run = 1
        while at + run < len(ids) and ids[at + run] == token:
            run += 1
        name = (None if is_byte else tok.decode([token])) or names.get(token) or f"<{token}>"
        out.append(f"{name}x{run}" if run >= 3 else name * run)
        at += run
    out.append(tok.decode(plain))
    return "".join(out)


def schedule_of(profile: JobProfile, documents: list, pad_id: int, vision) -> Schedule:
    """The run's steps on one rank: the training documents packed as the trainer packs them (build_dataset) and
    counted by its run_steps; ProfileError (run_steps') when the warm-up does not fit them."""
    from moe_tune.engine.train.trainer import run_steps

    train = profile.train
    if train.epochs is None:
        return Schedule(run_steps(train, None, 1))
    data = profile.data
    dataset = PackedDataset(documents, data.seq_len, pad_id, data.seed, vision.settings if vision is not None else None)
    return Schedule(run_steps(train, dataset, 1), train.epochs, dataset.rows_in_epochs(train.epochs), data.seq_len)
