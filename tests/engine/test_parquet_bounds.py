"""Parquet memory bounds against what a file decodes to, not what its metadata claims: a footer stating small
uncompressed sizes for a decompression bomb, a page header understating its page, and rows that all take one large
dictionary value. Each is refused as one line naming the file (or the row) with Arrow memory bounded; a normal file of
several row groups still reads whole."""

import os
import struct
from pathlib import Path

import pytest

from moe_tune.engine.data.dataset import load_documents
from moe_tune.engine.data.readers import ARROW_BYTES_PER_JSON_BYTE, Refused, open_records
from moe_tune.engine.data.tokenizer import ByteTokenizer
from moe_tune.profiles import ProfileError
from moe_tune.profiles.schema import DataProfile

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
TOK = ByteTokenizer()
BOMB = 2 << 20  # one byte repeated: a zstd chunk of about 100 bytes
LIMIT = 1 << 18


# Thrift's compact protocol, enough to rewrite a Parquet footer or page header: a struct is a list of
# [field id, type, value]; a list or set is ("list", item type, items); a map is ("map", key type, value type, items).
def _varint(buf, pos):
    value = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def _encode_varint(value):
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        if not value:
            return bytes(out + bytes([byte]))
        out.append(byte | 0x80)


def read_thrift(buf, pos, kind):
    if kind in (1, 2):
        return kind == 1, pos
    if kind == 3:
        return buf[pos], pos + 1
    if kind in (4, 5, 6):
        raw, pos = _varint(buf, pos)
        return (raw >> 1) ^ -(raw & 1), pos
    if kind == 7:
        return buf[pos:pos + 8], pos + 8
    if kind == 8:
        length, pos = _varint(buf, pos)
        return bytes(buf[pos:pos + length]), pos + length
    if kind in (9, 10):
        head, pos = buf[pos], pos + 1
        count, item = head >> 4, head & 0x0F
        if count == 15:
            count, pos = _varint(buf, pos)
        items = []
        for _ in range(count):
            value, pos = read_thrift(buf, pos, 3 if item in (1, 2) else item)
            items.append(value)
        return ("list", item, items), pos
    if kind == 11:
        count, pos = _varint(buf, pos)
        if not count:
            return ("map", 0, 0, []), pos
        types, pos = buf[pos], pos + 1
        items = []
        for _ in range(count):
            key, pos = read_thrift(buf, pos, types >> 4)
            value, pos = read_thrift(buf, pos, types & 0x0F)
            items.append((key, value))
        return ("map", types >> 4, types & 0x0F, items), pos
    assert kind == 12, kind
    fields, field_id = [], 0
    while True:
        head, pos = buf[pos], pos + 1
        if not head:
            return fields, pos
        if head >> 4:
            field_id += head >> 4
        else:
            raw, pos = _varint(buf, pos)
            field_id = (raw >> 1) ^ -(raw & 1)
        value, pos = read_thrift(buf, pos, head & 0x0F)
        fields.append([field_id, head & 0x0F, value])


def write_thrift(value, kind):
    if kind == 3:
        return bytes([value])
    if kind in (4, 5, 6):
        return _encode_varint((value << 1) ^ (value >> 63))
    if kind == 7:
        return value
    if kind == 8:
        return _encode_varint(len(value)) + value
    if kind in (9, 10):
        _, item, items = value
        head = bytes([len(items) << 4 | item]) if len(items) < 15 else bytes([0xF0 | item]) + _encode_varint(len(items))
        return head + b"".join(write_thrift(int(x) if item in (1, 2) else x, 3 if item in (1, 2) else item)
                               for x in items)
    if kind == 11:
        _, key_kind, value_kind, items = value
        if not items:
            return b"\x00"
        return _encode_varint(len(items)) + bytes([key_kind << 4 | value_kind]) + b"".join(
            write_thrift(k, key_kind) + write_thrift(v, value_kind) for k, v in items)
    out, last = bytearray(), 0
    for field_id, field_kind, field_value in value:
        if field_kind in (1, 2):
            field_kind = 1 if field_value else 2
        delta = field_id - last
        out += bytes([delta << 4 | field_kind]) if 0 < delta <= 15 else bytes([field_kind]) + _encode_varint(
            (field_id << 1) ^ (field_id >> 63))
        last = field_id
        if field_kind not in (1, 2):
            out += write_thrift(field_value, field_kind)
    return bytes(out) + b"\x00"


def field(struct_fields, field_id):
    return next(f for f in struct_fields if f[0] == field_id)


def column_metas(footer):
    """(row group, ColumnMetaData fields, RowGroup fields) of each column chunk of a FileMetaData."""
    for group, row_group in enumerate(field(footer, 4)[2][2]):
        for chunk in field(row_group, 1)[2][2]:
            yield group, field(chunk, 3)[2], row_group


def lie_in_footer(path, chunks):
    """Rewrite the footer: the column chunks (row group, column name) state as many uncompressed bytes as stored."""
    data = path.read_bytes()
    length = struct.unpack("<I", data[-8:-4])[0]
    footer, _ = read_thrift(data, len(data) - 8 - length, 12)
    for group, meta, row_group in column_metas(footer):
        name = ".".join(x.decode() for x in field(meta, 3)[2][2])
        if (group, name) in chunks:
            stored, size = field(meta, 7)[2], field(meta, 6)[2]
            field(meta, 6)[2] = stored
            field(row_group, 2)[2] -= size - stored
    body = write_thrift(footer, 12)
    path.write_bytes(data[:len(data) - 8 - length] + body + struct.pack("<I", len(body)) + b"PAR1")


def chunk_sizes(path):
    """{(row group, column name): (stored bytes, uncompressed bytes)} as the footer says."""
    metadata = pq.ParquetFile(path).metadata
    chunks = [(g, metadata.row_group(g).column(c)) for g in range(metadata.num_row_groups)
              for c in range(metadata.num_columns)]  # fmt: skip
    return {(g, chunk.path_in_schema): (chunk.total_compressed_size, chunk.total_uncompressed_size)
            for g, chunk in chunks}


def bomb_line(path, group, name, stored, size, limit=LIMIT):
    return (f"{path}: column '{name}' of row group {group} decompresses from {stored} to {size} bytes, more than 1000 "
            f"times (a decompression bomb?) and more than data.max_record_bytes ({limit})")


class ArrowMemory:
    """The most Arrow memory held at once while the block runs (a proxy of the default pool made the default)."""

    def __enter__(self):
        self.parent = pa.default_memory_pool()
        self.pool = pa.proxy_memory_pool(self.parent)
        pa.set_memory_pool(self.pool)
        return self

    def __exit__(self, *exc):
        pa.set_memory_pool(self.parent)
        self.peak = self.pool.max_memory()


def problems(path, **data):
    with pytest.raises(ProfileError) as err:
        load_documents(DataProfile(path=path, seq_len=512, **data), TOK)
    return err.value.problems


def records(path, limit):
    return list(open_records(Path(path), "data.path", limit))


class TestFooterStatingSmallSizes:
    """A footer is metadata a writer chooses: a chunk that states it decompresses to its stored bytes is refused from
    its pages' headers (which pyarrow holds each page to), before anything is decoded."""

    @pytest.mark.parametrize("case", ["one column", "all columns", "one row group of several"])
    def test_refused_before_it_is_decoded(self, tmp_path, case):
        path = tmp_path / "d.parquet"
        bomb, small = "a" * BOMB, "b" * 100
        if case == "one column":
            table, lies, first = pa.table({"note": ["x"], "text": [bomb]}), {(0, "text")}, (0, "text")
        elif case == "all columns":
            table, lies, first = pa.table({"note": [bomb], "text": [bomb]}), {(0, "note"), (0, "text")}, (0, "note")
        else:
            table, lies, first = pa.table({"text": [small, bomb, small]}), {(1, "text")}, (1, "text")
        pq.write_table(table, path, compression="zstd", row_group_size=1)
        sizes = chunk_sizes(path)
        lie_in_footer(path, lies)
        assert all(chunk_sizes(path)[chunk][1] == sizes[chunk][0] for chunk in lies)
        with ArrowMemory() as memory:
            lines = problems(path, max_record_bytes=LIMIT)
        assert lines == [bomb_line(path, *first, *sizes[first])]
        assert memory.peak < BOMB // 4

    def test_a_footer_stating_small_sizes_for_a_chunk_within_the_limit_reads(self, tmp_path):
        path = tmp_path / "d.parquet"
        pq.write_table(pa.table({"text": ["a" * BOMB]}), path, compression="zstd")
        lie_in_footer(path, {(0, "text")})
        (document,) = load_documents(DataProfile(path=path, seq_len=64, max_record_bytes=2 * BOMB), TOK)
        assert len(document.input_ids) == 1 + BOMB


def test_a_page_header_understating_its_page_is_unreadable(tmp_path):
    """pyarrow decompresses a page into a buffer of its header's size and refuses a page that does not fill it: the
    header cannot make a page decode to more (here the footer states small sizes too, and the header's size is within
    data.max_record_bytes)."""
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["a" * BOMB]}), path, compression="zstd", use_dictionary=False)
    lie_in_footer(path, {(0, "text")})
    data = bytearray(path.read_bytes())
    start = pq.ParquetFile(path).metadata.row_group(0).column(0).data_page_offset
    header, end = read_thrift(data, start, 12)
    field(header, 2)[2] //= 2
    patched = write_thrift(header, 12)
    assert len(patched) == end - start
    data[start:end] = patched
    path.write_bytes(bytes(data))
    with ArrowMemory() as memory:
        (line,) = problems(path, max_record_bytes=2 * BOMB)
    assert line.startswith(f"{path}:row 0: unreadable (")
    assert memory.peak < BOMB


class TestOneDictionaryValueInEveryRow:
    """Rows of a dictionary-encoded column all taking one large value: a batch's rows decode to at most what one row
    may take in Arrow memory (or to one row), never TABLE_BATCH_ROWS times the value."""

    @staticmethod
    def write(tmp_path, value_bytes, rows=64):
        path = tmp_path / "d.parquet"
        value = os.urandom(value_bytes // 2).hex()
        pq.write_table(pa.table({"text": [value] * rows + ["ok"]}), path)
        assert pq.ParquetFile(path).metadata.row_group(0).column(0).has_dictionary_page
        assert os.path.getsize(path) < 2 * value_bytes
        return path, value

    @pytest.mark.parametrize("over", [1, 100], ids=["just-over", "far-over"])
    def test_rows_over_the_limit_are_refused_with_memory_bounded(self, tmp_path, over):
        path, value = self.write(tmp_path, 256 << 10)
        json_bytes = len(value) + len('{"text": ""}')
        limit = json_bytes - 1 if over == 1 else json_bytes // over
        with ArrowMemory() as memory:
            read = records(path, limit)
        assert [isinstance(record, Refused) for _, record in read] == [True] * 64 + [False]
        assert read[-1] == (f"{path}:row 64", {"text": "ok"})
        assert memory.peak <= 2 * ARROW_BYTES_PER_JSON_BYTE * limit + 4 * len(value)  # builders double capacity

    def test_rows_at_the_limit_are_read(self, tmp_path):
        path, value = self.write(tmp_path, 256 << 10)
        limit = len(value) + len('{"text": ""}')
        with ArrowMemory() as memory:
            read = records(path, limit)
        assert [record for _, record in read] == [{"text": value}] * 64 + [{"text": "ok"}]
        assert memory.peak <= 2 * ARROW_BYTES_PER_JSON_BYTE * limit + 4 * len(value)  # builders double capacity


def test_a_normal_file_of_several_row_groups_reads_whole(tmp_path):
    """Rows count on across row groups, dictionary-encoded and plain columns alike."""
    path = tmp_path / "d.parquet"
    texts = [f"text {i} " + "word " * (i % 50) for i in range(3000)]
    roles = ["user", "assistant"] * 1500
    pq.write_table(pa.table({"text": texts, "role": roles, "n": list(range(3000))}), path, row_group_size=700)
    assert pq.ParquetFile(path).metadata.num_row_groups == 5
    read = records(path, 1 << 16)
    assert [where for where, _ in read] == [f"{path}:row {i}" for i in range(3000)]
    assert [record for _, record in read] == [{"text": t, "role": r, "n": n} for t, r, n in zip(texts, roles,
                                                                                             range(3000))]


@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize("checksums", [True, False])
def test_a_page_whose_checksum_no_longer_matches_is_refused(tmp_path, compression, checksums):
    """Bytes changed inside a page (bit rot, a torn copy) that the writer stored a checksum of: the row is refused,
    not trained as altered text; a file written without checksums, untouched, reads as written."""
    path = tmp_path / "d.parquet"
    rows = [f"row {i} hello world" for i in range(100)]
    pq.write_table(pa.table({"text": rows}), path, compression=compression, use_dictionary=False,
                   write_page_checksum=checksums, write_statistics=False)  # fmt: skip
    documents = load_documents(DataProfile(path=path, seq_len=64), TOK)
    assert [bytes(d.input_ids[1:]).decode() for d in documents] == rows
    if not checksums:
        return
    data = bytearray(path.read_bytes())
    start = pq.ParquetFile(path).metadata.row_group(0).column(0).data_page_offset
    # The page's last stored byte (a value's byte, or zstd's frame checksum): what the page checksum covers.
    end = start + pq.ParquetFile(path).metadata.row_group(0).column(0).total_compressed_size
    data[end - 1] ^= 0x20
    path.write_bytes(bytes(data))
    (line,) = problems(path)
    assert line == (f"{path}:row 0: unreadable (OSError: could not verify page integrity, CRC checksum verification "
                    "failed for page_ordinal 0)")
