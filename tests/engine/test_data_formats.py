"""Data formats (text, messages, alpaca, ShareGPT), file kinds (JSONL, JSON array, Parquet, save_to_disk folders),
weighted sources and the evaluation split: each read into the same documents as its messages equivalent, each
refusal one line naming the file (and record) and the rule."""

import json
import sys

import pytest

from moe_tune.engine.data import readers
from moe_tune.engine.data.dataset import _document_key, load_documents, load_splits
from moe_tune.engine.data.tokenizer import ByteTokenizer
from moe_tune.profiles import ProfileError, load_profile
from moe_tune.profiles.schema import DataProfile

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")

TOK = ByteTokenizer()
SEQ_LEN = 256


def profile(**data) -> DataProfile:
    return DataProfile(seq_len=SEQ_LEN, **data)


def splits(**data):
    return load_splits(profile(**data), TOK)


def refusals(**data) -> list[str]:
    with pytest.raises(ProfileError) as err:
        splits(**data)
    return err.value.problems


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_json(path, records):
    path.write_text(json.dumps(records, indent=2))
    return path


def write_parquet(path, records):
    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def write_saved(path, records):
    datasets.Dataset.from_list(records).save_to_disk(str(path))
    return path


WRITERS = {"jsonl": (write_jsonl, ".jsonl"), "json": (write_json, ".json"), "parquet": (write_parquet, ".parquet"),
           "saved": (write_saved, "")}
KINDS = {"jsonl": "JSONL", "json": "JSON array", "parquet": "Parquet", "saved": "saved dataset"}
WHERE = {"jsonl": ":{line}", "json": ":[{i}]", "parquet": ":row {i}", "saved": ":row {i}"}


def write(tmp_path, kind, records, name="data"):
    writer, suffix = WRITERS[kind]
    return writer(tmp_path / f"{name}{suffix}", records)


def chat(*turns):
    return [{"role": role, "content": content} for role, content in turns]


# Each format's record and the messages it means.
ALPACA = {"instruction": "Add the numbers", "input": "2 3", "output": "5", "system": "You add."}
ALPACA_MESSAGES = chat(("system", "You add."), ("user", "Add the numbers\n2 3"), ("assistant", "5"))
SHAREGPT = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"},
                              {"from": "human", "value": "bye"}, {"from": "gpt", "value": "ciao"}],
            "system": "Be brief."}
SHAREGPT_MESSAGES = chat(("system", "Be brief."), ("user", "hi"), ("assistant", "hello"), ("user", "bye"),
                         ("assistant", "ciao"))
MESSAGES = {"messages": chat(("user", "q"), ("assistant", "a"))}
TEXT = {"text": "a plain story"}
RECORDS = {"text": (TEXT, TEXT), "messages": (MESSAGES, MESSAGES), "alpaca": (ALPACA, {"messages": ALPACA_MESSAGES}),
           "sharegpt": (SHAREGPT, {"messages": SHAREGPT_MESSAGES})}
REASONS = {"text": "first record has text", "messages": "first record has messages",
           "alpaca": "first record has instruction/output", "sharegpt": "first record has conversations"}


def documents_of(tmp_path, records, **data):
    return load_documents(profile(path=write_jsonl(tmp_path / "expected.jsonl", records), **data), TOK)


class TestFormats:
    @pytest.mark.parametrize("name", RECORDS)
    def test_auto_detects_each_format(self, tmp_path, name):
        record, meaning = RECORDS[name]
        result = splits(path=write_jsonl(tmp_path / "d.jsonl", [record, record]))
        (source,) = result.summary.sources
        assert (source.format.name, source.format.why) == (name, REASONS[name])
        assert str(source.format) == f"{name} ({REASONS[name]})"
        assert result.train == documents_of(tmp_path, [meaning, meaning])

    @pytest.mark.parametrize("name", RECORDS)
    def test_explicit_format(self, tmp_path, name):
        record, meaning = RECORDS[name]
        result = splits(path=write_jsonl(tmp_path / "d.jsonl", [record]), format=name)
        assert str(result.summary.sources[0].format) == f"{name} (data.format)"
        assert result.train == documents_of(tmp_path, [meaning])

    @pytest.mark.parametrize("name, record", [
        ("alpaca", TEXT), ("alpaca", {"instruction": "x"}), ("sharegpt", MESSAGES), ("text", ALPACA),
        ("messages", SHAREGPT),
    ], ids=["alpaca-text", "alpaca-no-output", "sharegpt-messages", "text-alpaca", "messages-sharegpt"])
    def test_explicit_format_refuses_other_records(self, tmp_path, name, record):
        path = write_jsonl(tmp_path / "d.jsonl", [record])
        needs = {"alpaca": "an alpaca record needs 'instruction' and 'output' keys",
                 "sharegpt": "sharegpt 'conversations' must be a list", "text": "a text record needs a 'text' key",
                 "messages": "a messages record needs a 'messages' key"}[name]
        (line,) = refusals(path=path, format=name)
        assert line.startswith(f"{path}:1: {needs}")

    @pytest.mark.parametrize("first, second", [
        ("alpaca", "sharegpt"), ("sharegpt", "alpaca"), ("text", "alpaca"), ("messages", "sharegpt"),
        ("alpaca", "text"), ("sharegpt", "messages"),
    ])
    def test_mixed_formats_are_refused_naming_the_record(self, tmp_path, first, second):
        path = write_jsonl(tmp_path / "d.jsonl", [RECORDS[first][0], RECORDS[first][0], RECORDS[second][0]])
        (line,) = refusals(path=path)
        article = "an" if second == "alpaca" else "a"
        assert line.startswith(f"{path}:3: {article} {second} record (has ")
        assert f"in a source of {first} records (as {path}:1); a source holds one format" in line

    @pytest.mark.parametrize("name, others", [
        ("messages", ("text",)), ("messages", ("alpaca",)), ("messages", ("sharegpt", "alpaca", "text")),
        ("sharegpt", ("alpaca",)), ("sharegpt", ("text",)), ("alpaca", ("text",)),
    ])  # fmt: skip
    def test_a_record_with_another_formats_keys_counts_them_unread(self, tmp_path, name, others):
        """A record that holds the keys of two formats is read as the first (tatsu-lab/alpaca renders each record
        into 'text' too): the summary counts, per format's keys, the records whose other keys went unread; a
        data.format given says which is read, and nothing is counted."""
        record, meaning = RECORDS[name]
        both = dict(record)
        for other in others:
            both.update({key: value for key, value in RECORDS[other][0].items() if key not in record})
        path = write_jsonl(tmp_path / "d.jsonl", [both, record, both])
        result = splits(path=path)
        (source,) = result.summary.sources
        keys = {"text": "text", "alpaca": "instruction/output", "sharegpt": "conversations"}
        assert source.format.name == name and dict(source.unread) == {keys[o]: 2 for o in others}
        assert result.train == documents_of(tmp_path, [meaning] * 3)
        shown = ", ".join(f"2 also hold '{key}', unread" for key, _ in source.unread)
        assert f": 3 records ({shown}) -> " in source.line()
        assert splits(path=path, format=name).summary.sources[0].unread == ()

    @pytest.mark.parametrize("empty", [None, "", []])
    def test_another_formats_key_holding_nothing_is_not_counted(self, tmp_path, empty):
        for name, record in (("messages", MESSAGES), ("alpaca", ALPACA)):
            (source,) = splits(path=write_jsonl(tmp_path / f"{name}.jsonl", [dict(record, text=empty)])).summary.sources
            assert source.format.name == name and source.unread == ()

    def test_one_record_with_other_keys_is_said_in_the_singular(self, tmp_path):
        path = write_jsonl(tmp_path / "d.jsonl", [dict(ALPACA, text="### Instruction: ...")])
        assert "1 records (1 also holds 'text', unread) -> " in splits(path=path).summary.sources[0].line()

    def test_text_and_messages_may_share_a_source(self, tmp_path):
        # JSONL data always mixed them, each record read by its keys.
        result = splits(path=write_jsonl(tmp_path / "d.jsonl", [TEXT, MESSAGES]))
        assert result.train == documents_of(tmp_path, [TEXT, MESSAGES])

    def test_no_format_matches(self, tmp_path):
        path = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "only"}])
        assert refusals(path=path) == [
            f"{path}:1: a record needs a 'text' or a 'messages' key, or alpaca's 'instruction' and 'output', or "
            "sharegpt's 'conversations' (has: ['instruction'])"
        ]

    @pytest.mark.parametrize("record, user", [
        ({"instruction": "do", "input": "", "output": "ok"}, "do"),  # an empty input adds no newline
        ({"instruction": "do", "input": None, "output": "ok"}, "do"),  # Parquet's null
        ({"instruction": "do", "output": "ok"}, "do"),
        ({"instruction": "do", "input": "this", "output": "ok"}, "do\nthis"),
        ({"instruction": "do", "input": "this", "output": "ok", "system": ""}, "do\nthis"),  # empty system: none
    ], ids=["empty-input", "null-input", "no-input", "input", "empty-system"])
    def test_alpaca_prompt(self, tmp_path, record, user):
        result = splits(path=write_jsonl(tmp_path / "d.jsonl", [record]))
        assert result.train == documents_of(tmp_path, [{"messages": chat(("user", user), ("assistant", "ok"))}])

    def test_alpaca_history_comes_first(self, tmp_path):
        record = {"instruction": "and 3?", "output": "9", "history": [["2?", "4"]]}
        result = splits(path=write_jsonl(tmp_path / "d.jsonl", [record]))
        expected = chat(("user", "2?"), ("assistant", "4"), ("user", "and 3?"), ("assistant", "9"))
        assert result.train == documents_of(tmp_path, [{"messages": expected}])

    @pytest.mark.parametrize("record, rule", [
        ({"instruction": 1, "output": "x"}, "alpaca 'instruction' must be a string, got int"),
        ({"instruction": "x", "output": None}, "alpaca 'output' must be a string, got NoneType"),
        ({"instruction": "x", "output": "y", "input": ["z"]}, "alpaca 'input' must be a string or null, got list"),
        ({"instruction": "x", "output": "y", "history": [["a"]]}, "alpaca 'history' must be a list of [query, "
                                                                  "response] string pairs"),
        ({"conversations": [{"from": "human"}]}, "sharegpt 'conversations' must be a list of {\"from\": str, "
                                                  "\"value\": str}"),
        ({"conversations": "hi"}, "sharegpt 'conversations' must be a list"),
        ({"conversations": [], "system": 3}, "sharegpt 'system' must be a string or null, got int"),
    ], ids=["instruction-int", "output-null", "input-list", "history-pair", "turn-no-value", "turns-str",
            "system-int"])
    def test_malformed_records(self, tmp_path, record, rule):
        path = write_jsonl(tmp_path / "d.jsonl", [record])
        (line,) = refusals(path=path)
        assert line.startswith(f"{path}:1: {rule}")

    def test_sharegpt_roles_through_data_roles_over_the_defaults(self, tmp_path):
        record = {"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q"},
                                    {"from": "bot", "value": "a"}]}
        path = write_jsonl(tmp_path / "d.jsonl", [record])
        # data.roles extends (bot) the defaults; unmapped names are refused with the existing hint.
        (line,) = refusals(path=path)
        assert line.startswith(f"{path}:1: message role 'bot' must be one of system, user, assistant, tool; map record "
                               "roles onto them with data.roles")
        result = splits(path=path, roles={"bot": "assistant"})
        assert result.train == documents_of(tmp_path, [{"messages": chat(("system", "s"), ("user", "q"),
                                                                         ("assistant", "a"))}])
        # ... and overrides them: here gpt's turns are read as the user's.
        record = {"conversations": [{"from": "gpt", "value": "q"}, {"from": "human", "value": "a"}]}
        result = splits(path=write_jsonl(tmp_path / "e.jsonl", [record]), roles={"gpt": "user", "human": "assistant"})
        assert result.train == documents_of(tmp_path, [{"messages": chat(("user", "q"), ("assistant", "a"))}])


MIXED = [TEXT, {"text": "another story"}, {"text": "a third"}]


class TestFileKinds:
    @pytest.mark.parametrize("kind", WRITERS)
    @pytest.mark.parametrize("name", ["text", "alpaca", "sharegpt", "messages"])
    def test_each_kind_reads_each_format(self, tmp_path, kind, name):
        record, meaning = RECORDS[name]
        other = dict(record)
        result = splits(path=write(tmp_path, kind, [record, other]))
        (source,) = result.summary.sources
        assert (source.kind, source.format.name, source.records) == (KINDS[kind], name, 2)
        assert result.train == documents_of(tmp_path, [meaning, meaning])

    @pytest.mark.parametrize("kind", WRITERS)
    def test_records_are_named_by_their_place(self, tmp_path, kind):
        path = write(tmp_path, kind, [{"text": "ok"}, {"text": "x" * 300}, {"text": "ok"}])
        (line,) = refusals(path=path, max_record_bytes=100)
        where = WHERE[kind].format(line=2, i=1)
        assert line.startswith(f"{path}{where}: the record (")
        assert line.endswith("bytes) is larger than data.max_record_bytes (100)")

    def test_dataset_dict_folder_is_refused_naming_its_splits(self, tmp_path):
        folder = tmp_path / "dd"
        datasets.DatasetDict({"train": datasets.Dataset.from_list(MIXED),
                              "test": datasets.Dataset.from_list([TEXT])}).save_to_disk(str(folder))
        assert refusals(path=folder) == [
            f"{folder}: a DatasetDict folder (splits: train, test); name one split's folder, e.g. '{folder}/train'"
        ]
        result = splits(path=folder / "train", eval_path=folder / "test")
        assert len(result.train) == 2 and len(result.eval) == 1  # TEXT is in both: left out of training

    def test_json_array_block_boundaries(self, tmp_path, monkeypatch):
        """Strings holding brackets, commas, quotes and escapes, nesting and multi-byte characters, read in blocks of
        1 to 7 bytes: every item as json.loads reads it."""
        records = [{"text": 'a "quoted" [b], {c}, \\ d \\\\" é 😀'}, {"text": "x", "meta": [[1, {"y": "]"}], []]},
                   {"text": "\\"}, {"text": ""}]
        path = tmp_path / "d.json"
        path.write_text("\ufeff \n" + json.dumps(records, ensure_ascii=False) + " \n")
        expected = [(f"{path}:[{i}]", r) for i, r in enumerate(records)]
        for block in range(1, 8):
            monkeypatch.setattr(readers, "SKIP_BLOCK_BYTES", block)
            assert list(readers.open_records(path, "data.path", 1000)) == expected

    def test_json_array_fast_path_and_byte_scan_agree(self, tmp_path, monkeypatch):
        """Whole items go through json's decoder, the rest (items cut by a block's end, bad items) through the byte
        scan: the same records and the same problems at every block size."""
        raw = ('[{"text": "a \\"q\\" [b], {c}"}, 7, "s", [1, {"y": "]"}], {"text": "é😀"}, {"a": 1} {"b": 2}, '
               '{"text": "\\\\"}, {bad}, {"text": "x"}  ,  {"text": ""}]')
        path = tmp_path / "d.json"
        path.write_text(raw)
        reads = []
        for block in [1, 2, 3, 5, 7, 16, 64, 1 << 20]:
            monkeypatch.setattr(readers, "SKIP_BLOCK_BYTES", block)
            reads.append(list(readers.open_records(path, "data.path", 1000)))
        assert all(read == reads[-1] for read in reads)
        records = [r for _, r in reads[-1]]
        assert records[:5] == [{"text": 'a "q" [b], {c}'}, 7, "s", [1, {"y": "]"}], {"text": "é😀"}]
        assert records[5] == readers.Refused("invalid JSON (Extra data at column 10)")
        assert records[6:] == [{"text": "\\"}, readers.Refused("invalid JSON (Expecting property name enclosed in "
                                                                 "double quotes at column 2)"), {"text": "x"},
                               {"text": ""}]

    def test_json_array_holds_one_record_at_a_time(self, tmp_path):
        """Items past data.max_record_bytes are counted, never kept: the scan's buffer never exceeds the limit."""
        scan_add = readers._ArrayScan.add
        largest = []

        def add(self, chunk):
            scan_add(self, chunk)
            largest.append(len(self.item) if self.item is not None else 0)

        path = tmp_path / "d.json"
        # Many small pieces (strings, commas): the item grows a little at a time.
        huge = {"text": "ok", "pad": ["x"] * 100_000}
        path.write_text(json.dumps([huge, {"text": "ok"}]))
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(readers._ArrayScan, "add", add)
            pairs = list(readers.open_records(path, "data.path", 1000))
        assert 0 < max(largest) <= 1000
        assert pairs == [(f"{path}:[0]", readers.Refused(readers.too_large(len(json.dumps(huge)), 1000))),
                         (f"{path}:[1]", {"text": "ok"})]


class TestHostileFiles:
    @pytest.mark.parametrize("content, where, rule", [
        ("[]", "", "data.path ('{path}') holds no records (an empty JSON array)"),
        (" [ \n ] ", "", "data.path ('{path}') holds no records (an empty JSON array)"),
        ('[{"text": "a"}, {"text": "b"', ":[1]", "the file ends inside the JSON array (no closing ']': the file is "
                                                 "truncated)"),
        ('[{"text": "a"},', "", "the file ends inside the JSON array (no closing ']': the file is truncated)"),
        ('[{"text": "a"}, {"text": "b"}] [', "", "data after the JSON array's closing ']' (byte offset 31); a JSON "
                                                 "data file holds one array of records"),
        ('[{"text": "a"},]', ":[1]", "invalid JSON (no record before the ']' at byte offset 15)"),
        ('[{"text": "a"},, {"text": "b"}]', ":[1]", "invalid JSON (no record before the ',' at byte offset 15)"),
        ('[{"text": "a"} {"text": "b"}]', ":[0]", "invalid JSON (Extra data at column 15)"),
        ('[{"text": "a"}, {"text": "\xff"}]'.encode("latin-1"), ":[1]",
         "not UTF-8 (invalid start byte: byte 0xff at byte offset 10 of the record, 26 of the file)"),
        ('{\n  "records": [{"text": "a"}]\n}', ":1", "invalid JSON (Expecting property name enclosed in double "
                                                    "quotes at column 2); a data file holds one JSON record per line "
                                                    "(JSONL), a JSON array of records ('[' first), a .parquet file or "
                                                    "a save_to_disk folder"),
        ('{"records": [{"text": "a"}]}', ":1", "a record needs a 'text' or a 'messages' key, or alpaca's "
                                               "'instruction' and 'output', or sharegpt's 'conversations' (has: "
                                               "['records'])"),
        ("[1, [2]]", ":[0]", "a record must be a JSON object, got int"),
        ('[{"text": "a", "n": ' + "7" * 5000 + "}]", ":[0]", "a number of 5000 digits, longer than JSON numbers are "
                                                            "read (4300 digits at most)"),
    ], ids=["empty", "empty-spaced", "truncated-in-record", "truncated-after-comma", "after-close", "trailing-comma",
            "double-comma", "missing-comma", "not-utf8", "object-pretty", "object-one-line", "not-objects",
            "huge-number"])
    def test_json_files(self, tmp_path, content, where, rule):
        path = tmp_path / "d.json"
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        found = refusals(path=path)
        expected = rule.format(path=path) if rule.startswith("data.") else f"{path}{where}: {rule}"
        assert found[0] == expected

    def test_parquet_with_a_mistyped_column(self, tmp_path):
        path = write_parquet(tmp_path / "d.parquet", [{"text": 1}, {"text": 2}])
        assert refusals(path=path, format="text") == [
            f"{path}: column 'text' holds int64 values; text records read it as a string"]
        # Under auto the first record says text: the same one line, not one per row.
        assert refusals(path=path) == [f"{path}: column 'text' holds int64 values; text records read it as a string"]
        path = write_parquet(tmp_path / "a.parquet", [{"instruction": "x", "output": "y", "input": 3.5}])
        assert refusals(path=path) == [
            f"{path}: column 'input' holds double values; alpaca records read it as a string"]

    def test_table_without_the_formats_column(self, tmp_path):
        path = write_parquet(tmp_path / "d.parquet", [{"prompt": "x", "answer": "y"}])
        assert refusals(path=path, format="alpaca") == [
            f"{path}: has no column 'instruction', which alpaca records need (columns: prompt, answer)",
            f"{path}: has no column 'output', which alpaca records need (columns: prompt, answer)",
        ]

    @pytest.mark.parametrize("content", [b"", b"PAR1", b'{"text": "a"}\n', b"PAR1" + b"\0" * 64 + b"PAR1"],
                             ids=["empty", "magic-only", "jsonl", "no-footer"])
    def test_a_file_named_parquet_that_is_not(self, tmp_path, content):
        path = tmp_path / "d.parquet"
        path.write_bytes(content)
        line = load_refusal(path)
        if content:
            assert line.startswith(f"{path}: not a readable Parquet file (")
        else:
            assert line == f"data.path ('{path}') must hold at least one record (the file is empty)"

    @pytest.mark.parametrize("setup, rule", [
        (lambda d: None, "data.path ('{d}') must be a regular file or a folder written by datasets' save_to_disk "
                         "(this directory has no state.json or dataset_dict.json)"),
        (lambda d: (d / "state.json").write_text("{not json"), "{d}/state.json: invalid JSON (Expecting property "
                                                               "name enclosed in double quotes at column 2); {d} is "
                                                               "not a save_to_disk folder"),
        (lambda d: (d / "state.json").write_text("{}"), "{d}/state.json: must list the dataset's Arrow files "
                                                       "(_data_files), as save_to_disk writes it"),
        (lambda d: (d / "state.json").write_text('{"_data_files": [{"filename": "../outside.arrow"}]}'),
         "{d}/state.json: data file '../outside.arrow' lies outside the dataset folder (set "
         "data.allow_paths_outside: true to allow)"),
        (lambda d: (d / "state.json").write_text('{"_data_files": [{"filename": "gone.arrow"}]}'),
         "{d}/state.json: data file 'gone.arrow' is missing or not a regular file"),
        (lambda d: ((d / "state.json").write_text('{"_data_files": [{"filename": "x.arrow"}]}'),
                    (d / "x.arrow").write_bytes(b"not arrow")), "{d}: not a readable save_to_disk folder ("),
        (lambda d: (d / "dataset_dict.json").write_text("[1]"), "{d}: a DatasetDict folder (splits: none listed); "
                                                               "name one split's folder, e.g. '{d}/train'"),
    ], ids=["plain-folder", "state-not-json", "state-no-files", "file-outside", "file-missing", "file-not-arrow",
            "dict-no-splits"])
    def test_folders_that_are_not_saved_datasets(self, tmp_path, setup, rule):
        folder = tmp_path / "ds"
        folder.mkdir()
        (tmp_path / "outside.arrow").write_bytes(b"")
        setup(folder)
        line = load_refusal(folder)
        assert line.startswith(rule.format(d=folder))

    @pytest.mark.parametrize("module, kind", [("pyarrow", "parquet"), ("pyarrow.parquet", "parquet"),
                                              ("datasets", "saved")])
    def test_a_missing_extra_names_the_pip_extra(self, tmp_path, monkeypatch, module, kind):
        path = write(tmp_path, kind, MIXED)
        monkeypatch.setitem(sys.modules, module, None)
        if module == "pyarrow":
            monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
        reading = "a Parquet file" if kind == "parquet" else "a save_to_disk folder"
        assert refusals(path=path) == [
            f"{path}: reading {reading} needs the '{module.split('.')[0]}' library: pip install 'moe-tune[data]'"]


def load_refusal(path) -> str:
    """The first problem of the tiny profile with `path` as data.path, from the schema or else the reader."""
    try:
        job = load_profile("tiny", [f"data.path={path}"])
    except ProfileError as err:
        return err.problems[0]
    with pytest.raises(ProfileError) as err:
        load_splits(job.data, TOK)
    return err.value.problems[0]


def many(n, tag):
    return [{"text": f"{tag} record {i}"} for i in range(n)]


class TestSources:
    def test_weights_give_exact_document_counts(self, tmp_path):
        paths = [write_jsonl(tmp_path / f"{tag}.jsonl", many(n, tag)) for tag, n in (("a", 10), ("b", 10),
                                                                                   ("c", 10), ("d", 5), ("e", 4))]
        weights = [1, 2, 0.5, 0.5, 2.5]
        result = splits(sources=[{"path": p, "weight": w} for p, w in zip(paths, weights)])
        counts = [s.train.documents for s in result.summary.sources]
        # floor(w) * n + round half up((w - floor(w)) * n): 2.5 rounds to 3 (Python's round would give 2)
        assert counts == [10, 20, 5, 3, 10]
        assert len(result.train) == sum(counts)
        # Weight 1 keeps each record once; 2 twice; 0.5 distinct records.
        docs = {tag: load_documents(profile(path=tmp_path / f"{tag}.jsonl"), TOK) for tag in "abcde"}
        assert result.train[:10] == docs["a"]
        assert result.train[10:30] == docs["b"] * 2
        half = result.train[30:35]
        assert len({_document_key(d) for d in half}) == 5 and all(d in docs["c"] for d in half)
        e = result.train[38:]
        assert e[:8] == docs["e"] * 2 and len({_document_key(d) for d in e[8:]}) == 2 and all(d in docs["e"] for d in e)

    def test_the_fractional_part_is_chosen_with_the_seed(self, tmp_path):
        path = write_jsonl(tmp_path / "a.jsonl", many(40, "a"))

        def half(seed):
            return [_document_key(d) for d in splits(sources=[{"path": path, "weight": 0.5}], seed=seed).train]

        assert half(0) == half(0)
        assert half(0) != half(1)
        assert len(set(half(0)) | set(half(1))) > 20

    def test_a_weight_that_leaves_nothing(self, tmp_path):
        path = write_jsonl(tmp_path / "a.jsonl", many(3, "a"))
        other = write_jsonl(tmp_path / "b.jsonl", many(3, "b"))
        assert refusals(sources=[{"path": other}, {"path": path, "weight": 0.1}]) == [
            f"data.sources.1.weight (0.1) leaves none of the 3 documents of {path}: raise it "
            "(round((weight - floor(weight)) * n) are kept)"]

    def test_each_source_its_own_format_and_kind(self, tmp_path):
        result = splits(sources=[{"path": write_parquet(tmp_path / "a.parquet", [ALPACA])},
                                 {"path": write_json(tmp_path / "s.json", [SHAREGPT]), "format": "sharegpt"}])
        assert [str(s.format) for s in result.summary.sources] == [
            "alpaca (first record has instruction/output)", "sharegpt (data.sources.1.format)"]
        assert result.train == documents_of(tmp_path, [{"messages": ALPACA_MESSAGES}, {"messages": SHAREGPT_MESSAGES}])

    @pytest.mark.parametrize("override, rule", [
        ("data.sources=[{path: MISSING}]", "data.sources.0.path ('MISSING') must be an existing file"),
        ("data.sources=[{path: A}, {path: A, weight: 0}]", "data.sources.1.weight (0): input should be greater "
                                                           "than 0"),
        ("data.sources=[{path: A, weight: 101}]", "data.sources.0.weight (101): input should be less than or equal "
                                                  "to 100"),
        ("data.sources=[{path: A, format: csv}]", "data.sources.0.format ('csv'): input should be 'auto', 'text', "
                                                  "'messages', 'alpaca' or 'sharegpt'"),
        ("data.sources=[]", "data.sources ([]): list should have at least 1 item after validation, not 0"),
        ("data.sources=[{path: A, wieght: 2}]", "data.sources.0.wieght (2): unknown key"),
        ("data.path=A", "data.path and data.sources are two ways to name the data: give one of them"),
        ("data.eval_fraction=0.5", "data.eval_path and data.eval_fraction (0.5) are two ways to choose the evaluation "
                                   "records: give at most one of them"),
    ], ids=["missing", "weight-0", "weight-101", "format", "empty", "typo", "path-and-sources", "eval-both"])
    def test_schema_names_the_source(self, tmp_path, override, rule):
        a = write_jsonl(tmp_path / "a.jsonl", MIXED)
        base = [] if "data.sources" in override else [f"data.sources=[{{path: {a}}}]"]
        if override.startswith("data.eval_fraction"):
            base.append(f"data.eval_path={a}")
        overrides = base + [override.replace("MISSING", str(tmp_path / "no.jsonl")).replace("A", str(a))]
        with pytest.raises(ProfileError) as err:
            load_profile("tiny", overrides)
        expected = rule.replace("MISSING", str(tmp_path / "no.jsonl")).replace("'A'", f"'{a}'")
        assert any(line.startswith(expected) for line in err.value.problems), err.value.problems


class TestEvalSplit:
    def test_fraction_holds_out_records_never_trained(self, tmp_path):
        a = write_jsonl(tmp_path / "a.jsonl", many(20, "a"))
        b = write_jsonl(tmp_path / "b.jsonl", many(10, "b"))
        result = splits(sources=[{"path": a, "weight": 2}, {"path": b}], eval_fraction=0.25)
        # round half up: 5 of a's 20, 3 of b's 10 (2.5); weights after the split.
        assert [s.held_out for s in result.summary.sources] == [5, 3]
        assert [s.train.documents for s in result.summary.sources] == [30, 7]
        assert len(result.eval) == 8 and len(result.train) == 37
        held = {_document_key(d) for d in result.eval}
        assert len(held) == 8 and not held & {_document_key(d) for d in result.train}
        assert result.summary.eval.documents == 8 and result.summary.train.documents == 37
        again = splits(sources=[{"path": a, "weight": 2}, {"path": b}], eval_fraction=0.25)
        assert again.eval == result.eval and again.train == result.train
        other = splits(sources=[{"path": a, "weight": 2}, {"path": b}], eval_fraction=0.25, seed=7)
        assert {_document_key(d) for d in other.eval} != held

    def test_every_copy_of_a_held_out_record_is_held_out(self, tmp_path):
        records = many(4, "a") * 3  # each record three times
        result = splits(path=write_jsonl(tmp_path / "a.jsonl", records), eval_fraction=0.5)
        held = {_document_key(d) for d in result.eval}
        assert len(result.eval) == 2 and len(held) == 2
        assert len(result.train) == 6 and not held & {_document_key(d) for d in result.train}

    def test_a_record_two_sources_share_is_held_out_of_both(self, tmp_path):
        a = write_jsonl(tmp_path / "a.jsonl", many(2, "same"))
        b = write_jsonl(tmp_path / "b.jsonl", many(2, "same") + many(6, "b"))
        result = splits(sources=[{"path": a}, {"path": b}], eval_fraction=0.5)
        held = {_document_key(d) for d in result.eval}
        assert len(held) == len(result.eval)
        assert not held & {_document_key(d) for d in result.train}

    def test_eval_path(self, tmp_path):
        train = write_jsonl(tmp_path / "train.jsonl", many(6, "a"))
        evaluation = write_parquet(tmp_path / "eval.parquet", many(2, "a") + many(1, "e"))
        result = splits(path=train, eval_path=evaluation)
        # Two training records equal evaluation records: left out of training, and said so.
        assert len(result.eval) == 3 and len(result.train) == 4
        train_summary, eval_summary = result.summary.sources
        assert (train_summary.role, train_summary.dropped, eval_summary.role, eval_summary.kind) == (
            "train", 2, "eval", "Parquet")
        assert result.summary.eval_from == f"data.eval_path ('{evaluation}')"
        assert not {_document_key(d) for d in result.eval} & {_document_key(d) for d in result.train}
        assert splits(path=train).eval == []

    @pytest.mark.parametrize("n, fraction, rule", [
        (10, 0.01, "holds out 0 of 10 distinct documents: evaluation needs at least one"),
        (10, 0.04, "holds out 0 of 10 distinct documents: evaluation needs at least one"),  # 0.4 rounds down
        (10, 0.95, "holds out 10 of 10 distinct documents: training needs at least one"),  # 9.5 rounds up
        (1, 0.5, "holds out 1 of 1 distinct documents: training needs at least one"),
        (1, 0.4, "holds out 0 of 1 distinct documents: evaluation needs at least one"),
    ])
    def test_fractions_that_leave_a_side_empty(self, tmp_path, n, fraction, rule):
        path = write_jsonl(tmp_path / "a.jsonl", many(n, "a"))
        (line,) = refusals(path=path, eval_fraction=fraction)
        assert line.startswith(f"data.eval_fraction ({fraction:g}) {rule}")

    @pytest.mark.parametrize("n, fraction, held", [(10, 0.05, 1), (10, 0.94, 9), (2, 0.5, 1), (3, 0.5, 2)])
    def test_fractions_at_the_edges_that_work(self, tmp_path, n, fraction, held):
        path = write_jsonl(tmp_path / "a.jsonl", many(n, "a"))
        result = splits(path=path, eval_fraction=fraction)
        assert (len(result.eval), len(result.train)) == (held, n - held)

    @pytest.mark.parametrize("value", [0, 1, -0.5, 1.5])
    def test_fraction_out_of_range(self, value):
        with pytest.raises(ProfileError) as err:
            load_profile("tiny", [f"data.eval_fraction={value}"])
        assert err.value.problems[0].startswith(f"data.eval_fraction ({value}): input should be")

    def test_the_built_in_corpus_can_be_split(self):
        result = splits(corpus_documents=40, eval_fraction=0.1)
        assert len(result.eval) == 4 and len(result.train) == 36
        assert result.summary.sources[0].path == "built-in corpus (stories)"


def test_summary_lines(tmp_path):
    a = write_json(tmp_path / "a.json", [dict(ALPACA, output=str(i)) for i in range(4)])
    result = splits(sources=[{"path": a, "weight": 2}], eval_fraction=0.5)
    lines = result.summary.lines()
    assert lines[0].startswith(f"train {a}: JSON array, alpaca (first record has instruction/output): 4 records "
                               "(weight 2, 2 held out) -> 4 documents, ")
    assert lines[1].startswith("train: 4 documents, ")
    assert lines[2].startswith("eval: 2 documents, ") and lines[2].endswith("(data.eval_fraction (0.5) of each source, "
                                                                           "chosen with data.seed)")


def test_alpaca_and_sharegpt_records_carry_images(tmp_path):
    """Image paths of any format and file kind resolve against the source's own folder, as JSONL messages do."""
    np = pytest.importorskip("numpy")
    image = pytest.importorskip("PIL.Image")
    from moe_tune.engine.data.dataset import VisionInput
    from moe_tune.engine.data.images import ImageSettings
    from moe_tune.engine.data.multimodal import VisionTokens

    vision = VisionInput(ImageSettings(patch_size=4, merge_size=2, min_pixels=16 * 16, max_pixels=32 * 32),
                         VisionTokens(image=300, start=301, end=302))
    folder = tmp_path / "sub"
    folder.mkdir()
    image.fromarray(np.zeros((16, 16, 3), dtype=np.uint8)).save(folder / "a.png")
    records = [{"instruction": "<image>what?", "output": "dark", "images": ["a.png"]},
               {"conversations": [{"from": "human", "value": "<image>what?"}, {"from": "gpt", "value": "dark"}],
                "images": ["a.png"]}]
    expected = {"messages": chat(("user", "<image>what?"), ("assistant", "dark")), "images": ["a.png"]}
    data = [profile(sources=[{"path": write_parquet(folder / "a.parquet", records[:1])},
                             {"path": write_json(folder / "s.json", records[1:])}]),
            profile(path=write_jsonl(folder / "m.jsonl", [expected, expected]))]
    got, want = (load_documents(d, TOK, vision) for d in data)
    assert got == want and len(got[0].images) == 1
    # A record's image outside its source's folder is refused, naming it.
    outside = write_parquet(tmp_path / "b.parquet", [dict(records[0], images=["../sub/a.png"])])
    with pytest.raises(ProfileError, match=r"b\.parquet:row 0: image '\.\./sub/a\.png' resolves outside the data "
                                           r"folder"):
        load_documents(profile(path=outside), TOK, vision)


@pytest.mark.parametrize("first, expected", [
    (b"\x1f\x8b\x08\x00binary\n", "data.path ('PATH') is gzip-compressed: data files are read uncompressed; unpack it "
                                  "and name the file it holds"),
    (b"{\n", "PATH:1: invalid JSON (Expecting property name enclosed in double quotes at column 2); a data file holds "
             "one JSON record per line (JSONL), a JSON array of records ('[' first), a .parquet file or a save_to_disk "
             "folder"),
    (b"\xff\xfe{\x00\n", "data.path ('PATH') is UTF-16 (little-endian) text (it opens with that byte-order mark): save "
                        "it as UTF-8"),
], ids=["gzip", "pretty", "utf-16"])  # fmt: skip
def test_a_file_that_is_not_jsonl_is_one_line(tmp_path, first, expected):
    """A file that is not JSONL (compressed, pretty-printed, another encoding) is one line, not one per line."""
    path = tmp_path / "d.jsonl"
    path.write_bytes(first + b"garbage\n" * 50)
    assert refusals(path=path) == [expected.replace("PATH", str(path))]


@pytest.mark.parametrize("kind", ["parquet", "saved"])
def test_a_table_without_rows(tmp_path, kind):
    table = pa.table({"text": pa.array([], pa.string())})
    if kind == "parquet":
        path = tmp_path / "d.parquet"
        pq.write_table(table, path)
    else:
        path = tmp_path / "d"
        datasets.Dataset(table).save_to_disk(str(path))
    assert refusals(path=path) == [f"data.path ('{path}') holds no records (no rows)"]
