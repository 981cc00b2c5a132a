"""`moe-tune validate` reads the data as finetune would: its report's counts equal a hand count, and it exits 2 (one
line per problem, no traceback) on what finetune would refuse; --no-data skips the reading. The resolved YAML stays
alone on stdout."""

import json

import pytest
import yaml
from typer.testing import CliRunner

from moe_tune.cli import app
from moe_tune.engine.data.tokenizer import ByteTokenizer

runner = CliRunner()
BYTE = ByteTokenizer()
CHATS = [
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
    [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "caf\u00e9"},
     {"role": "user", "content": "thanks"}],
]  # fmt: skip


def write(path, *records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def validate(data, *overrides):
    sets = [a for o in (f"data.path={data}", *overrides) for a in ("--set", o)]
    return runner.invoke(app, ["validate", "tiny", *sets])


def hand_count(chats, header: bool, train_all: bool) -> tuple[int, int]:
    """(input tokens, trained tokens) of chats in the built-in format '<|role|>\\ncontent\\n' on bytes: <bos>, the
    turns, <eos> after a last assistant turn; a document of n ids has n - 1 inputs and labels."""
    tokens = trained = 0
    for chat in chats:
        ends_with_assistant = chat[-1]["role"] == "assistant"
        ids = 1 + ends_with_assistant
        labelled = ends_with_assistant
        for m in chat:
            head, body = len(f"<|{m['role']}|>\n".encode()), len((m["content"] + "\n").encode())
            ids += head + body
            if m["role"] == "assistant":
                labelled += body + head * header
        tokens += ids - 1
        trained += ids - 1 if train_all else labelled
    return tokens, trained


@pytest.mark.parametrize("overrides, header, train_all", [
    ((), False, False),
    (("data.train_on_assistant_header=true",), True, False),
    (("data.train_on=all",), False, True),
])  # fmt: skip
def test_the_report_counts_what_a_hand_count_gives(tmp_path, overrides, header, train_all):
    data = write(tmp_path / "d.jsonl", *({"messages": c} for c in CHATS))
    result = validate(data, *overrides)
    assert result.exit_code == 0, result.output
    # stdout holds the resolved profile alone.
    assert yaml.safe_load(result.stdout)["data"]["path"] == str(data)
    tokens, trained = hand_count(CHATS, header, train_all)
    lines = result.stderr.splitlines()
    counts = f"2 documents, {tokens} tokens, {trained} trained ({100 * trained / tokens:.0f}%)"
    # The format's wording is the loader's (DataSummary); the counts are checked here.
    (source,) = [line for line in lines if line.startswith(f"data: train {data}: JSONL, messages (")]
    assert source.endswith(f"): 2 records -> {counts}"), source
    assert f"data: train: {counts}" in lines
    assert "data: tokenizer byte: 259 tokens (model.vocab_size 259)" in lines
    header_words = "with" if header else "without"
    chat = ("every token trained (data.train_on: all)" if train_all else
            f"assistant turns trained {header_words} their header (data.train_on: assistant)")
    assert f"data: chat records: rendered in the built-in format <|role|>\\n...\\n, {chat}" in lines
    assert lines[-1] == "tiny: valid"


def test_the_survey_counts_equal_the_documents(tmp_path):
    from moe_tune.engine.data.dataset import IGNORE_INDEX, load_documents
    from moe_tune.engine.data.survey import survey_data
    from moe_tune.profiles import load_profile

    data = write(tmp_path / "d.jsonl", *({"messages": c} for c in CHATS))
    job = load_profile("tiny", [f"data.path={data}"])
    survey = survey_data(job)
    documents = load_documents(job.data, BYTE)
    assert (survey.summary.train.documents, survey.summary.train.tokens, survey.summary.train.trained_tokens) == (
        len(documents), sum(len(d.input_ids) for d in documents),
        sum(label != IGNORE_INDEX for d in documents for label in d.labels)) == (2, *hand_count(CHATS, False, False))


def test_bad_records_exit_2_naming_file_and_line(tmp_path):
    data = write(tmp_path / "d.jsonl", {"text": "fine"}, {"txt": "typo"}, "not json", {"text": 3})
    result = validate(data)
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert [line.split(": ", 2)[1] for line in lines] == [f"{data}:{n}" for n in (2, 3, 4)], lines
    assert lines[1] == f"error: {data}:3: invalid JSON (Expecting value at column 1)"
    assert "Traceback" not in result.output


def test_every_bad_record_is_counted_past_the_ones_printed(tmp_path):
    data = write(tmp_path / "d.jsonl", {"text": "fine"}, *(["not json"] * 250))
    result = validate(data)
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    assert lines[0] == f"error: {data}:2: invalid JSON (Expecting value at column 1)"
    assert len(lines) == 201 and lines[-1] == "error: ... and 50 more problems"


# Why two documents train nothing, as the refusal says.
NOTHING = (" (its 2 documents train nothing: a chat trains its assistant turns but those of weight 0 or that say "
           "nothing, a text all but a blank one)")


def test_data_with_nothing_to_train_on_exits_2(tmp_path):
    data = write(tmp_path / "d.jsonl", {"messages": [{"role": "user", "content": "hi"}]},
                 {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]})
    result = validate(data)
    assert result.exit_code == 2
    refused = f"error: data.path ('{data}') must hold at least one token to train on{NOTHING}"
    assert result.stderr.splitlines() == [refused]
    # The user turns are trained with data.train_on: all.
    assert validate(data, "data.train_on=all").exit_code == 0
    # Beside a chat that trains, each is counted as a document with no trained token.
    data = write(tmp_path / "mixed.jsonl", {"messages": [{"role": "user", "content": "hi"}]},
                 {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
    result = validate(data)
    assert result.exit_code == 0, result.output
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("data: train: ")]
    assert line.startswith("data: train: 2 documents (1 with no trained token), "), line


@pytest.mark.parametrize("blank", ["", " ", "\n\t "])
def test_blank_texts_train_nothing(tmp_path, blank):
    """A blank text's <eos> alone is not trained (it would teach the model to end at once): a file of blank texts
    has nothing to train on; beside a real text it adds its <bos> to the tokens and nothing to the trained ones."""
    data = write(tmp_path / "d.jsonl", {"text": blank}, {"text": ""})
    result = validate(data)
    assert result.exit_code == 2
    refused = f"error: data.path ('{data}') must hold at least one token to train on{NOTHING}"
    assert result.stderr.splitlines() == [refused]
    data = write(tmp_path / "mixed.jsonl", {"text": blank}, {"text": "hello"})
    result = validate(data)
    assert result.exit_code == 0, result.output
    tokens = 1 + len(blank.encode()) + 6  # <bos> + the blank bytes; <bos> + hello
    assert f"data: train: 2 documents (1 with no trained token), {tokens} tokens, 6 trained" in result.stderr


def test_a_tokenizer_larger_than_the_model_is_reported_with_the_records(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
    from test_chat import save_tokenizer

    raw = save_tokenizer(tmp_path / "tok", "kimi", True)
    data = write(tmp_path / "d.jsonl", {"messages": CHATS[0]}, "{")
    result = validate(data, f"data.tokenizer={tmp_path / 'tok'}", "model.vocab_size=64")
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [
        f"error: model.vocab_size (64) must be >= the tokenizer's ({len(raw)})",
        f"error: {data}:2: invalid JSON (Expecting property name enclosed in double quotes at column 2)",
    ]


def test_no_data_skips_reading_it(tmp_path):
    data = write(tmp_path / "d.jsonl", "not json")
    assert validate(data).exit_code == 2
    result = runner.invoke(app, ["validate", "tiny", "--no-data", "--set", f"data.path={data}"])
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == ["tiny: valid (data not read: --no-data)"]
    assert yaml.safe_load(result.stdout)["data"]["path"] == str(data)


@pytest.mark.parametrize("name_length", [100, 250])
def test_the_resolved_yaml_holds_long_values_whole(tmp_path, name_length):
    """stdout is the resolved profile as YAML whatever the terminal's width: a path longer than a line reads back."""
    folder = tmp_path / ("d" * name_length)
    folder.mkdir()
    data = write(folder / "data.jsonl", {"text": "one document"})
    result = runner.invoke(app, ["validate", "tiny", "--no-data", "--set", f"data.path={data}"], terminal_width=80)
    assert result.exit_code == 0, result.output
    assert yaml.safe_load(result.stdout)["data"]["path"] == str(data)


def test_the_report_names_the_profiles_chat_template(tmp_path):
    template = write(tmp_path / "chat.jinja", "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    data = write(tmp_path / "d.jsonl", *({"messages": c} for c in CHATS))
    result = validate(data, f"data.chat_template={template}")
    assert result.exit_code == 0, result.output
    assert ("data: chat records: rendered by data.chat_template, assistant turns trained without their header "
            "(data.train_on: assistant)") in result.stderr.splitlines()


@pytest.mark.parametrize("vocab_size", [300, 64])
def test_a_checkpoints_own_tokenizer_is_read_as_finetune_reads_it(tmp_path, vocab_size):
    """model.checkpoint: the job resolved from config.json, the tokenizer and chat template from the checkpoint's
    folder; a tokenizer larger than the checkpoint's vocabulary is refused."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
    from hf_tiny import save_tiny_checkpoint, tiny_qwen3_moe
    from test_chat import save_tokenizer

    checkpoint = save_tiny_checkpoint(tiny_qwen3_moe(vocab_size=vocab_size), tmp_path / "ckpt")
    raw = save_tokenizer(checkpoint, "qwen3", True)
    data = write(tmp_path / "d.jsonl", *({"messages": c} for c in CHATS))
    profile = tmp_path / "p.yaml"
    profile.write_text(yaml.safe_dump({"name": "ckpt", "model": {"checkpoint": str(checkpoint)},
                                       "data": {"path": str(data), "seq_len": 64},
                                       "train": {"steps": 1, "micro_batch_size": 1, "lr": 1e-3},
                                       "output": {"dir": str(tmp_path / "out")}}))
    result = runner.invoke(app, ["validate", str(profile)])
    if vocab_size < len(raw):
        assert result.exit_code == 2, result.output
        assert result.stderr.splitlines() == [
            f"error: model.vocab_size ({vocab_size}) must be >= the tokenizer's ({len(raw)})"]
        return
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    assert f"data: tokenizer {checkpoint}: {len(raw)} tokens (model.vocab_size {vocab_size})" in lines
    assert ("data: chat records: rendered by the tokenizer's chat template, assistant turns trained without their "
            "header (data.train_on: assistant)") in lines
    # transformers' rendering and assistant mask of each chat (no <bos>; the template closes its turns itself).
    rendered = [raw.apply_chat_template(c, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
                for c in CHATS]
    tokens = sum(len(out["input_ids"]) - 1 for out in rendered)
    trained = sum(sum(out["assistant_masks"]) for out in rendered)
    assert f"data: train: 2 documents, {tokens} tokens, {trained} trained ({100 * trained / tokens:.0f}%)" in lines


def test_eval_records_are_reported_apart(tmp_path):
    train = write(tmp_path / "train.jsonl", {"text": "three"}, {"text": "four"})
    held = write(tmp_path / "eval.jsonl", {"text": "one"}, {"text": "two"})
    result = validate(train, f"data.eval_path={held}")
    assert result.exit_code == 0, result.output
    # A text document of n characters: <bos> and n inputs, n + 1 labels (the <eos> last), every one trained.
    lines = result.stderr.splitlines()
    assert "data: train: 2 documents, 11 tokens, 11 trained (100%)" in lines
    assert any(line.startswith("data: eval: 2 documents, 8 tokens, 8 trained (100%)") for line in lines), lines


def test_records_left_out_for_bad_images_are_listed_and_refused_without_skip(tmp_path):
    import numpy as np
    from PIL import Image

    Image.fromarray(np.zeros((16, 16, 3), dtype=np.uint8)).save(tmp_path / "a.png")
    data = write(tmp_path / "d.jsonl", *({"messages": [{"role": "user", "content": "<image>what?"},
                                                       {"role": "assistant", "content": "black"}], "images": [name]}
                                         for name in ("a.png", "missing.png")))
    sets = ["--set", f"data.path={data}"]
    result = runner.invoke(app, ["validate", "tiny-vl", *sets, "--set", "data.bad_images=skip"])
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    missing = f"{data}:2: {tmp_path / 'missing.png'}: no such image file"
    assert lines[-4:] == ["data: 1 records left out (data.bad_images: skip):", f"data:   {missing}", "steps: 200",
                          "tiny-vl: valid"]
    # "<|assistant|>\n" is not trained: "black\n" and <eos>.
    assert any(line.startswith("data: train: 1 documents, ") and line.endswith(" 7 trained (17%)") for line in lines)
    result = runner.invoke(app, ["validate", "tiny-vl", *sets])
    # tiny-vl's generated corpus is not read beside data.path, and validate says so.
    assert result.exit_code == 2 and result.stderr.splitlines() == [
        "note: data.corpus, data.corpus_documents are ignored: data.path is set (the built-in corpus is made only "
        "without it)", f"error: {missing}"]


def epochs_rows(data, epochs: int, seq_len: int) -> int:
    """Rows of `epochs` epochs of the tiny profile's data packed as the trainer packs them, on one rank."""
    from moe_tune.engine.data.dataset import PackedDataset, load_documents
    from moe_tune.profiles import load_profile

    job = load_profile("tiny", [f"data.path={data}", f"data.seq_len={seq_len}"])
    dataset = PackedDataset(load_documents(job.data, BYTE), seq_len, BYTE.pad_id, job.data.seed)
    return dataset.rows_in_epochs(epochs)


TEXTS = [{"text": f"document {i}: " + "moe " * (i % 7)} for i in range(40)]


@pytest.mark.parametrize("epochs, micro_batch, accumulation", [
    (1, 4, 1),
    (3, 4, 1),  # later epochs pack in another order
    (2, 3, 2),  # a step of 6 rows, the last one short
])  # fmt: skip
def test_epochs_report_the_steps_they_give(tmp_path, epochs, micro_batch, accumulation):
    import math

    data = write(tmp_path / "d.jsonl", *TEXTS)
    result = validate(data, "train.steps=null", f"train.epochs={epochs}", "train.warmup_steps=0", "data.seq_len=32",
                      f"train.micro_batch_size={micro_batch}", f"train.gradient_accumulation_steps={accumulation}")
    assert result.exit_code == 0, result.output
    rows = epochs_rows(data, epochs, 32)
    steps = math.ceil(rows / (micro_batch * accumulation))
    word = "epoch" if epochs == 1 else "epochs"
    assert result.stderr.splitlines()[-2:] == [f"steps: {steps} for {epochs} {word} on one rank ({rows} rows of 32 "
                                               "tokens)", "tiny: valid"]


def test_steps_are_reported_as_given(tmp_path):
    result = validate(write(tmp_path / "d.jsonl", *TEXTS), "train.steps=7", "train.warmup_steps=0")
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines()[-2:] == ["steps: 7", "tiny: valid"]


@pytest.mark.parametrize("warmup_offset, ratio, is_refused", [
    (0, None, True),  # warm-up = the steps
    (1, None, True),
    (-1, None, False),
    (None, 0.99, False),  # floor(0.99 x steps) < steps: a ratio (< 1) always fits
])  # fmt: skip
def test_a_warmup_the_epochs_steps_cannot_hold_exits_2(tmp_path, warmup_offset, ratio, is_refused):
    import math

    data = write(tmp_path / "d.jsonl", *TEXTS)
    rows = epochs_rows(data, 1, 32)
    steps = math.ceil(rows / 4)
    overrides = ["train.steps=null", "train.epochs=1", "data.seq_len=32"]
    if ratio is None:
        overrides.append(f"train.warmup_steps={steps + warmup_offset}")
    else:
        overrides += ["train.warmup_steps=0", f"train.warmup_ratio={ratio}"]
    result = validate(data, *overrides)
    if not is_refused:
        assert result.exit_code == 0, result.output
        assert result.stderr.splitlines()[-2].startswith(f"steps: {steps} for 1 epoch")
        return
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [
        f"error: train.warmup_steps ({steps + warmup_offset}) must be < the {steps} steps that train.epochs (1) gives "
        f"({rows} rows / 4 rows a step: micro_batch_size 4 x gradient_accumulation_steps 1 x 1 ranks)"]
    assert "Traceback" not in result.output


@pytest.mark.parametrize("overrides", [
    ["lora.target_modules=[nonexistent]"],
    ["lora.target_modules=[q_proj, qproj]"],
    ["lora.target_modules=[]", "lora.experts=false", "lora.modules_to_save=[]"],
], ids=["unknown-target", "one-of-two-unknown", "nothing-to-adapt"])  # fmt: skip
def test_validate_refuses_the_adapters_finetune_refuses(tmp_path, overrides):
    """LoRA targets the model does not have are found by finetune only once it has built the model: validate says
    the same line from the model's parameter listing (engine/plan)."""
    sets = [a for o in [*overrides, f"output.dir={tmp_path / 'out'}", "train.steps=1", "train.warmup_steps=0",
                        "data.corpus_documents=20", "data.seq_len=32"] for a in ("--set", o)]  # fmt: skip
    checked = runner.invoke(app, ["validate", "tiny", "--no-data", *sets])
    trained = runner.invoke(app, ["finetune", "tiny", "--quiet", *sets])
    assert checked.exit_code == trained.exit_code == 2, (checked.output, trained.output)
    refused = [line for line in trained.stderr.splitlines() if line.startswith("error: ")]
    assert refused and [line for line in checked.stderr.splitlines() if line.startswith("error: ")] == refused


@pytest.mark.parametrize("show", [1, 2, 5])
def test_show_prints_the_first_documents_with_their_trained_tokens_marked(tmp_path, show):
    """--show N: after the report, the first N training documents (all when fewer) as the model reads them, special
    tokens by name, each run of trained tokens between ⟦ ⟧; stdout keeps the YAML alone."""
    data = write(tmp_path / "d.jsonl", {"messages": CHATS[0]}, {"text": "plain"}, {"messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "no", "weight": 0},
        {"role": "user", "content": "\x1b[31mred"}, {"role": "assistant", "content": "ok"}]})  # fmt: skip
    result = runner.invoke(app, ["validate", "tiny", "--set", f"data.path={data}", "--show", str(show)])
    assert result.exit_code == 0, result.output
    yaml.safe_load(result.stdout)
    documents = [
        "<bos><|user|>\nhi\n<|assistant|>\n\u27e6yo\n<eos>\u27e7",
        "<bos>\u27e6plain<eos>\u27e7",
        "<bos><|user|>\nq\n<|assistant|>\nno\n<|user|>\n\\x1b[31mred\n<|assistant|>\n\u27e6ok\n<eos>\u27e7",
    ]
    shown = result.stderr.split("steps: ")[1].split("\n", 1)[1]
    expected = "".join(f"document {i} of 3 (trained tokens between \u27e6 \u27e7):\n{text}\n"
                       for i, text in enumerate(documents[:show], 1))  # fmt: skip
    assert shown == expected + "tiny: valid\n"


def test_show_with_no_data_is_one_line():
    result = runner.invoke(app, ["validate", "tiny", "--no-data", "--show", "3"])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr == "error: --show (3) reads the data, which --no-data skips: give one\n"


def test_a_run_of_one_special_token_is_shown_with_its_count():
    from moe_tune.engine.data.dataset import IGNORE_INDEX, Document
    from moe_tune.engine.data.survey import shown_document

    pad, eos = BYTE.pad_id, BYTE.eos_id
    doc = Document([BYTE.bos_id, 97, pad, pad, 98, pad, pad, pad, pad], [IGNORE_INDEX] * 4 + [pad] * 4 + [eos])
    assert shown_document(doc, BYTE) == "<bos>a<pad><pad>b\u27e6<pad>x4<eos>\u27e7"


@pytest.mark.parametrize("order", ["text first", "chat first"])
def test_a_source_of_texts_and_chats_counts_both_and_says_how_chats_train(tmp_path, order):
    """Text and messages records may share a source: whichever comes first, the line counts both kinds and the chat
    settings are said (they were hidden when a text came first)."""
    records = [{"text": "plain"}, {"text": "more"}, {"messages": CHATS[0]}]
    data = write(tmp_path / "d.jsonl", *(records if order == "text first" else records[::-1]))
    result = validate(data)
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    assert any(line.startswith("data: chat records: rendered in the built-in format") for line in lines)
    (source,) = [line for line in lines if line.startswith(f"data: train {data}:")]
    assert ": 3 records (2 text, 1 chat) -> 3 documents" in source
    only_texts = validate(write(tmp_path / "t.jsonl", *records[:2]))
    assert "chat records" not in only_texts.stderr and "(2 text" not in only_texts.stderr


@pytest.mark.parametrize("roles, unused", [
    ("{humna: user, gpt: assistant}", "'humna'"),
    ("{human: user, gpt: assistant}", None),
    ("{humna: user, bot: assistant}", "'humna', 'bot'"),
])  # fmt: skip
def test_a_data_roles_key_no_record_has_is_noted(tmp_path, roles, unused):
    """A misspelt data.roles key maps nothing: the report says which (ShareGPT's human is mapped without it)."""
    data = write(tmp_path / "d.jsonl", {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]})
    result = validate(data, f"data.roles={roles}")
    assert result.exit_code == 0, result.output
    noted = [line for line in result.stderr.splitlines() if "data.roles maps" in line]
    assert noted == ([f"data: note: data.roles maps {unused}, which no record's role is"] if unused else [])


def test_an_images_tokens_are_shown_by_name_and_count():
    """The byte tokenizer decodes no id past its bytes and <bos>, <eos>, <pad>: an image's tokens were left out of
    the shown document; they are named as the model's vision tokens (an id no name covers as <ID>)."""
    from moe_tune.engine.data.dataset import IGNORE_INDEX, Document
    from moe_tune.engine.data.survey import shown_document

    ids = [BYTE.bos_id, 97, 260, *[259] * 16, 261, 98, 300]
    doc = Document(ids, [IGNORE_INDEX] * (len(ids) - 1) + [BYTE.eos_id])
    names = {260: "<|vision_start|>", 259: "<|image_pad|>", 261: "<|vision_end|>"}
    assert shown_document(doc, BYTE, names) == (
        "<bos>a<|vision_start|><|image_pad|>x16<|vision_end|>b<300>\u27e6<eos>\u27e7")


def test_show_escapes_the_marks_and_the_invisible_characters_a_record_writes(tmp_path):
    """A record's own \u27e6 ... \u27e7 cannot pass an untrained turn off as trained, nor a zero-width space hide."""
    from moe_tune.engine.data.dataset import IGNORE_INDEX, Document
    from moe_tune.engine.data.survey import shown_document

    ids = [BYTE.bos_id, *BYTE.encode("\u27e6x\u27e7")]
    doc = Document(ids, [IGNORE_INDEX] * (len(ids) - 1) + [BYTE.eos_id])
    assert shown_document(doc, BYTE) == "<bos>\\u27e6x\\u27e7\u27e6<eos>\u27e7"
    data_chat = [{"role": "user", "content": "a\u200bb"}, {"role": "assistant", "content": "ok"}]
    data = write(tmp_path / "d.jsonl", {"messages": data_chat})
    result = runner.invoke(app, ["validate", "tiny", "--set", f"data.path={data}", "--show", "1"])
    assert result.exit_code == 0, result.output
    assert "a\\u200bb" in result.stderr and "\u200b" not in result.stderr
