"""Data: records become documents with shifted labels, packing keeps documents apart, batches depend on the step."""

import json

import pytest

from moe_tune.engine.data.corpus import generate_corpus
from moe_tune.engine.data.dataset import (
    IGNORE_INDEX,
    Document,
    MicroBatchesAhead,
    PackedDataset,
    collate,
    load_documents,
    pack_rows,
    text_document,
)
from moe_tune.engine.data.tokenizer import ByteTokenizer
from moe_tune.profiles import ProfileError
from moe_tune.profiles.schema import DataProfile

TOK = ByteTokenizer()


def test_text_document_labels_are_next_tokens():
    doc = text_document("abc", TOK)
    assert doc.input_ids == [TOK.bos_id, 97, 98, 99]
    assert doc.labels == [97, 98, 99, TOK.eos_id]


def test_chat_record_trains_on_assistant_turns_only(tmp_path):
    path = tmp_path / "chat.jsonl"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    path.write_text(json.dumps({"messages": messages}) + "\n")
    (doc,) = load_documents(DataProfile(path=path, seq_len=16), TOK)
    untrained = len("<|user|>\nhi\n<|assistant|>\n")
    assistant = TOK.encode("yo\n") + [TOK.eos_id]
    # Label t predicts token t + 1: the user turn (after <bos>) and the assistant's header are masked (data.train_on:
    # assistant), the assistant's content and <eos> are kept.
    assert doc.labels[:untrained] == [IGNORE_INDEX] * untrained
    assert doc.labels[untrained:] == assistant


def test_packing_splits_long_documents_and_pads_the_last_row():
    docs = [Document(list(range(10)), list(range(1, 11))), Document([20, 21, 22], [21, 22, 23])]
    rows = pack_rows(docs, seq_len=8, pad_id=99)
    assert [r.input_ids for r in rows] == [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 20, 21, 22, 99, 99, 99]]
    assert [r.starts for r in rows] == [[0], [0, 2, 5]]
    assert rows[1].labels == [9, 10, 21, 22, 23, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]


def _greedy(docs: list[Document], seq_len: int, pad_id: int) -> list[tuple[list[int], list[int], list[int]]]:
    """(ids, labels, starts) of each row as greedy packing cuts the documents' stream, every row full but the last."""
    ids, labels, starts = [], [], []
    for doc in docs:
        starts.append(len(ids))
        ids += doc.input_ids
        labels += doc.labels
    rows = []
    for at in range(0, len(ids), seq_len):
        room = max(0, at + seq_len - len(ids))
        inside = sorted({0, *(s - at for s in starts if at < s < at + seq_len)} | ({seq_len - room} if room else set()))
        rows.append((ids[at : at + seq_len] + [pad_id] * room, labels[at : at + seq_len] + [IGNORE_INDEX] * room,
                     inside))  # fmt: skip
    return rows


def _documents(lengths: list[int], whole: bool, first: int = 0) -> list[Document]:
    """Documents of the given lengths, their tokens numbered apart (first, first + 1, ...) and labelled +1000."""
    docs, token = [], first
    for n in lengths:
        ids = list(range(token, token + n))
        docs.append(Document(ids, [t + 1000 for t in ids], whole=whole))
        token += n
    return docs


@pytest.mark.parametrize("seq_len", [1, 7, 16, 64])
def test_text_documents_pack_as_greedy_packing_cuts_them(seq_len):
    import random

    lengths = [random.Random(seq_len).randint(1, 40) for _ in range(60)]
    rows = pack_rows(_documents(lengths, whole=False), seq_len, pad_id=-1)
    assert [(r.input_ids, r.labels, r.starts) for r in rows] == _greedy(_documents(lengths, False), seq_len, -1)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("seq_len", [48, 128])
def test_a_chat_that_fits_a_row_is_never_cut_and_rows_close_nearly_full(seq_len, seed):
    """Chats (and texts between them) of random lengths: every chat lies whole in one row as one piece, the chats of a
    row in their order; every token is packed once; rows hold few padding tokens (first fit over pack_rows'
    open rows)."""
    import random

    rng = random.Random(seed)
    docs, token = [], 0
    for _ in range(300):
        whole = rng.random() < 0.8
        (doc,) = _documents([rng.randint(1, seq_len if whole else 3 * seq_len)], whole, token)
        docs.append(doc)
        token += len(doc.input_ids)
    rows = pack_rows(docs, seq_len, pad_id=-1)
    assert all(len(r.input_ids) == len(r.labels) == seq_len for r in rows)
    pieces = [(r.input_ids[a:b], r.labels[a:b]) for r in rows for a, b in zip(r.starts, [*r.starts[1:], seq_len])]
    real = [(ids, labels) for ids, labels in pieces if ids[0] != -1]
    assert all(ids == [-1] * len(ids) and labels == [IGNORE_INDEX] * len(ids) for ids, labels in pieces if ids[0] == -1)
    assert sorted(t for ids, _ in real for t in ids) == list(range(token))
    starts = {doc.input_ids[0]: doc for doc in docs}
    for ids, labels in real:
        assert labels == [t + 1000 for t in ids] and ids == list(range(ids[0], ids[-1] + 1))
        if ids[0] in starts and starts[ids[0]].whole:
            assert ids == starts[ids[0]].input_ids
    for row in rows:
        firsts = [row.input_ids[a] for a in row.starts if row.input_ids[a] in starts and starts[row.input_ids[a]].whole]
        assert firsts == sorted(firsts)
    # A document is cut only where rows end: a piece that is not its document's last fills its row to the end, one
    # that is not its first opens its row.
    for row in rows:
        for a, b in zip(row.starts, [*row.starts[1:], seq_len]):
            first, last = row.input_ids[a], row.input_ids[b - 1]
            if first != -1 and first not in starts:
                assert a == 0
            if last != -1 and last + 1 not in starts and last + 1 < token:
                assert b == seq_len
    assert len(rows) <= -(-token // seq_len) * 1.1 + 1


@pytest.mark.parametrize("whole", [True, False])
def test_an_empty_document_makes_no_piece(whole):
    docs = _documents([3], whole) + [Document([], [], whole=whole)] + _documents([2], whole, first=3)
    (row,) = pack_rows(docs, seq_len=8, pad_id=-1)
    assert row.input_ids == [0, 1, 2, 3, 4, -1, -1, -1] and row.starts == [0, 3, 5]


def test_a_chat_longer_than_a_row_starts_a_row_and_goes_on_in_new_rows():
    """Its tail is cut only where rows end (it filled the older rows' room in slivers); a chat that fits then takes
    the room left."""
    docs = _documents([5], True) + _documents([20], True, first=5) + _documents([3], True, first=25)
    rows = pack_rows(docs, seq_len=8, pad_id=-1)
    assert [r.input_ids for r in rows] == [[0, 1, 2, 3, 4, 25, 26, 27], list(range(5, 13)), list(range(13, 21)),
                                           [21, 22, 23, 24, -1, -1, -1, -1]]
    assert [r.starts for r in rows] == [[0, 5], [0], [0], [0, 4]]


def test_a_text_goes_on_from_the_newest_rows_room_into_new_rows():
    """The room of older rows is left to chats that fit it: a text in a source of chats is not cut into slivers."""
    chats = _documents([6, 6], True)
    text = _documents([12], False, first=12)
    rows = pack_rows(chats + text + _documents([2], True, first=24), seq_len=8, pad_id=-1)
    assert [r.input_ids for r in rows] == [[0, 1, 2, 3, 4, 5, 24, 25], [6, 7, 8, 9, 10, 11, 12, 13],
                                           list(range(14, 22)), [22, 23, -1, -1, -1, -1, -1, -1]]


@pytest.mark.parametrize("seq_len, cut", [(8, 2), (30, 1), (200, 0)])
def test_the_summary_counts_the_chats_longer_than_a_row(tmp_path, seq_len, cut):
    """Chats (a messages record of 37 tokens, an alpaca one of 28) longer than data.seq_len are counted; a text
    of 31 tokens is not."""
    from moe_tune.engine.data.dataset import load_splits

    path, alpaca = tmp_path / "d.jsonl", tmp_path / "a.jsonl"
    chat = {"messages": [{"role": "user", "content": "a" * 10}, {"role": "assistant", "content": "b"}]}
    path.write_text(json.dumps(chat) + "\n" + json.dumps({"text": "e" * 30}) + "\n")
    alpaca.write_text(json.dumps({"instruction": "c", "output": "d"}) + "\n")
    profile = DataProfile(sources=[{"path": path}, {"path": alpaca}], seq_len=seq_len)
    assert [len(d.input_ids) for d in load_documents(profile, TOK)] == [37, 31, 28]
    train = load_splits(profile, TOK).summary.train
    assert train.cut_chats == cut
    shown = f"({cut} chat{'s' if cut > 1 else ''} longer than data.seq_len, cut)"
    assert (shown in str(train)) == bool(cut)


def test_collate_offsets_pieces_by_row():
    docs = [Document(list(range(10)), list(range(1, 11))), Document([20, 21, 22], [21, 22, 23])]
    batch = collate(pack_rows(docs, seq_len=8, pad_id=99))
    assert batch.cu_seqlens.tolist() == [0, 8, 10, 13, 16]
    assert batch.input_ids.shape == (1, 16)
    assert batch.num_label_tokens == 13


def test_micro_batches_ahead_are_the_datasets_micro_batches(monkeypatch):
    docs = [text_document(t, TOK) for t in generate_corpus(50, seed=3)]
    dataset = PackedDataset(docs, 32, TOK.pad_id, seed=1)
    built = []
    micro_batch = dataset.micro_batch
    monkeypatch.setattr(dataset, "micro_batch", lambda *args: built.append(args[0]) or micro_batch(*args))
    ahead = MicroBatchesAhead(dataset, 2, 1, 2, end=5)
    expected = [micro_batch(i, 2, 1, 2).input_ids for i in range(6)]
    assert ahead.get(0).input_ids.equal(expected[0]) and built == [0]  # not prepared: built when asked
    ahead.prepare(1)
    ahead.prepare(1)  # prepared once
    assert built == [0, 1] and ahead.get(1).input_ids.equal(expected[1]) and built == [0, 1]
    ahead.prepare(2)
    assert ahead.get(3).input_ids.equal(expected[3]) and built == [0, 1, 2, 3]  # another index: built afresh
    assert ahead.get(2).input_ids.equal(expected[2]) and built == [0, 1, 2, 3, 2]  # the prepared one is gone
    ahead.prepare(5)  # the run ends before micro-batch 5: nothing is built
    assert built == [0, 1, 2, 3, 2]


def test_micro_batch_failing_while_prepared_raises_when_asked_for(monkeypatch):
    docs = [text_document(t, TOK) for t in generate_corpus(20, seed=3)]
    dataset = PackedDataset(docs, 32, TOK.pad_id, seed=1)

    def broken(index, *args):
        raise OSError(f"row of micro-batch {index} unreadable")

    monkeypatch.setattr(dataset, "micro_batch", broken)
    ahead = MicroBatchesAhead(dataset, 2, 0, 1, end=10)
    ahead.prepare(4)
    with pytest.raises(OSError, match="micro-batch 4 unreadable"):
        ahead.get(4)


def test_batches_are_a_function_of_the_step_and_ranks_split_rows():
    docs = [text_document(t, TOK) for t in generate_corpus(50, seed=3)]
    a, b = PackedDataset(docs, 32, TOK.pad_id, seed=1), PackedDataset(docs, 32, TOK.pad_id, seed=1)
    # Reading step 7 first (as a resumed run does) gives what a run reading steps in order gets.
    late = b.micro_batch(7, rows_per_rank=2)
    for step in range(7):
        a.micro_batch(step, rows_per_rank=2)
    assert a.micro_batch(7, rows_per_rank=2).input_ids.equal(late.input_ids)
    # Two ranks of 2 rows each take exactly the 4 rows one rank of 4 takes.
    whole = a.micro_batch(3, rows_per_rank=4).input_ids
    halves = [a.micro_batch(3, rows_per_rank=2, rank=r, world_size=2).input_ids for r in range(2)]
    assert whole.equal(halves[0].new_tensor(sum((h[0].tolist() for h in halves), [])).unsqueeze(0))
    # Epochs reshuffle: far enough in, the rows differ from the first epoch's.
    first_epoch = a.rows_of_epoch(0)
    assert a.row(len(first_epoch)).input_ids == a.rows_of_epoch(1)[0].input_ids
    assert a.rows_of_epoch(1)[0].input_ids != first_epoch[0].input_ids


def test_corpus_is_deterministic():
    assert generate_corpus(5, seed=0) == generate_corpus(5, seed=0)
    assert generate_corpus(5, seed=0) != generate_corpus(5, seed=1)


def test_bad_records_name_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": 3}\n[1]\n{"messages": [{"role": "user"}]}\n')
    with pytest.raises(ProfileError) as info:
        load_documents(DataProfile(path=path, seq_len=16), TOK)
    assert info.value.problems == [
        f"{path}:1: 'text' must be a string, got int",
        f"{path}:2: a record must be a JSON object, got list",
        f"{path}:3: turn 1 (user): 'content' (left out) must be a string (null or left out only beside tool_calls)",
    ]


def test_tokenizer_directory_with_chat_template(tmp_path):
    # A tokenizer directory as a checkpoint ships it, built offline: word-level vocabulary and a chat template.
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from moe_tune.engine.data.tokenizer import load_tokenizer

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "hi", "yo", "user", "assistant"])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.chat_template = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    tok.save_pretrained(tmp_path / "tok")
    loaded = load_tokenizer(str(tmp_path / "tok"))
    assert loaded.encode("hi yo") == [3, 4]
    assert (loaded.bos_id, loaded.eos_id, loaded.vocab_size) == (1, 2, 7)
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}))
    (doc,) = load_documents(DataProfile(path=path, seq_len=16, tokenizer=str(tmp_path / "tok")), loaded)
    # user hi assistant yo </s>, as transformers renders it (no <s>: the template renders none); labels keep only
    # the assistant's turn and </s>.
    assert doc.input_ids == [5, 3, 6, 4]
    assert doc.labels == [IGNORE_INDEX, 6, 4, 2]


@pytest.mark.parametrize("adds_bos", [True, False], ids=["post-processor-adds-bos", "bos-never-added"])
def test_documents_start_as_the_tokenizer_and_the_template_start_them(tmp_path, adds_bos):
    """A text document starts as `tokenizer(text)` starts it (Llama's post-processor puts <s> first; gpt-oss's and
    Kimi's tokenizers define a <bos> they never put there), a chat as the template renders it; the prompt generate
    continues starts alike."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from moe_tune.engine.data.chat import ChatOptions
    from moe_tune.engine.data.tokenizer import load_tokenizer
    from moe_tune.engine.generate.session import prompt_ids

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "hi", "yo", "user", "assistant"])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    if adds_bos:
        core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    raw = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    raw.save_pretrained(tmp_path / "plain")
    raw.chat_template = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    raw.save_pretrained(tmp_path / "chat")
    start = [1] if adds_bos else []
    assert raw("hi yo")["input_ids"] == start + [3, 4]
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "hi yo"}) + "\n" + json.dumps(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}) + "\n")
    for name in ("plain", "chat"):
        tok = load_tokenizer(str(tmp_path / name))
        text, chat = load_documents(DataProfile(path=path, seq_len=16, tokenizer=str(tmp_path / name)), tok)
        assert text.input_ids == start + [3, 4] and prompt_ids(tok, text="hi yo") == start + [3, 4]
        messages = [{"role": "user", "content": "hi"}]
        if name == "chat":
            # The template's rendering as transformers tokenizes it: nothing put before it.
            rendered = raw.apply_chat_template(messages + [{"role": "assistant", "content": "yo"}], tokenize=True,
                                               return_dict=True)["input_ids"]
            assert chat.input_ids == rendered and prompt_ids(tok, messages) == rendered[:2]
        else:
            assert chat.input_ids[: len(start)] == start and chat.input_ids[len(start)] != 1
            assert prompt_ids(tok, messages, options=ChatOptions())[: len(start) + 1] == chat.input_ids[: len(start) + 1]


def test_a_tokenizer_without_an_eos_is_refused_before_any_record(tmp_path):
    """No token can end a document: refused in one line naming the tokenizer (documents were closed by id 0)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from moe_tune.engine.data.tokenizer import load_tokenizer

    core = Tokenizer(models.WordLevel({"<unk>": 0, "hi": 1}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>").save_pretrained(tmp_path / "tok")
    tok = load_tokenizer(str(tmp_path / "tok"))
    assert tok.eos_id is None and tok.pad_id == 0
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "hi"}) + "\n")
    with pytest.raises(ProfileError) as err:
        load_documents(DataProfile(path=path, seq_len=16, tokenizer=str(tmp_path / "tok")), tok)
    assert err.value.problems == [f"data.tokenizer ('{tmp_path / 'tok'}') defines no end-of-sequence token "
                                  "(eos_token): it ends every text document and every chat a template does not close "
                                  "itself; set eos_token in its tokenizer_config.json"]


def test_unreadable_tokenizer_directory_is_a_profile_error(tmp_path):
    from moe_tune.engine.data.tokenizer import load_tokenizer

    (tmp_path / "empty").mkdir()
    with pytest.raises(ProfileError, match=r"data.tokenizer \('.*empty'\) cannot be loaded"):
        load_tokenizer(str(tmp_path / "empty"))


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen3_next", "llama", "deepseek_v3"])
def test_a_checkpoint_folder_without_tokenizer_files_is_refused_in_one_line(tmp_path, model_type):
    # transformers builds an empty tokenizer of the model type's class from config.json alone: every text then gave
    # 0 tokens, and the data "trained nothing".
    from moe_tune.engine.data.tokenizer import load_tokenizer

    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    try:
        tokenizer = load_tokenizer(str(tmp_path))
    except ProfileError as err:
        (line,) = err.problems
        assert line.startswith(f"data.tokenizer ('{tmp_path}') ")
        assert "cannot be loaded" in line or " encodes no text (a vocabulary of " in line, line
    else:
        pytest.fail(f"a tokenizer of {tokenizer.vocab_size} tokens was read from config.json alone")


@pytest.mark.parametrize("tokenizer_json", [
    {"version": "1.0", "model": {"type": "Nope"}},  # no added_tokens: a KeyError inside the loader
    {"version": "1.0", "added_tokens": [], "model": {"type": "BPE", "vocab": [1, 2]}},
    {"version": "1.0", "added_tokens": "x", "model": None},
    [],
])  # fmt: skip
def test_a_malformed_tokenizer_json_is_one_line_naming_the_folder(tmp_path, tokenizer_json):
    from moe_tune.engine.data.tokenizer import load_tokenizer

    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    (folder / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ProfileError) as err:
        load_tokenizer(str(folder))
    (line,) = err.value.problems
    assert line.startswith(f"data.tokenizer ('{folder}') cannot be loaded: ") and "\n" not in line
