"""Data files -> (where, record) pairs: JSONL, JSON arrays, Parquet, and folders written by `datasets`' save_to_disk.

`where` names the record for messages: `file:LINE` (JSONL), `file:[I]` (JSON array), `file:row I` (Parquet, saved
dataset; rows count from 0 like the array's items). A record that cannot be read (not UTF-8, larger than
data.max_record_bytes, not JSON, a key given twice in one object) comes as a `Refused` in place of the record, so the
caller reports it and reads on; a file that cannot be read at all (compressed, UTF-16, a table naming a column twice)
is a ProfileError of one line naming it.

Memory: JSONL and JSON arrays are read in blocks; one record (at most data.max_record_bytes) plus one block (1 MiB,
and its text for the JSON array's fast path) is held at a time, never the file. Parquet files and saved datasets are
read TABLE_BATCH_ROWS rows at a time (pyarrow decodes one row group's pages of the columns at once; a saved dataset's
Arrow files are memory-mapped); each row is held to the same data.max_record_bytes, counted as the bytes of its JSON
form, and a row far over it is refused from its Arrow bytes, before it becomes Python objects. A Parquet column chunk
that would decompress past MAX_PARQUET_RATIO times its stored bytes is refused unread, its size taken from its pages'
headers (which pyarrow holds each page to) as well as from the file's metadata (which a writer may state small). A
row group with dictionary pages is read in batches of fewer rows, so that rows all taking one large dictionary value
decode to at most what one row may take in Arrow memory (see _batch_rows). A nested column's row may repeat a
dictionary value without bound: that row is decoded whole before it is measured.
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
import re
import stat
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from moe_tune.profiles import ProfileError, foreign_encoding
from moe_tune.profiles.schema import file_kind

UTF8_BOM = b"\xef\xbb\xbf"
# Block size for reading past a record longer than data.max_record_bytes, and for scanning JSON arrays.
SKIP_BLOCK_BYTES = 1 << 20
# Rows of a Parquet file or saved dataset turned into records at once: small enough that a batch of records near
# data.max_record_bytes stays bounded, large enough that pyarrow's per-batch cost is amortised.
TABLE_BATCH_ROWS = 64
# state.json and dataset_dict.json of a saved dataset are a few hundred bytes; a larger one is not datasets'.
MAX_DATASET_JSON_BYTES = 1 << 20
INSTALL_HINT = "pip install 'moe-tune[data]'"
DATA_FILES = ("a data file holds one JSON record per line (JSONL), a JSON array of records ('[' first), a .parquet "
              "file or a save_to_disk folder")

# A Parquet column chunk that decompresses to more than this many times its stored bytes (and to more than
# data.max_record_bytes) is refused before it is read: text compresses 3-10x, a run of one byte under zstd 30,000x.
MAX_PARQUET_RATIO = 1000
# Bytes a value takes in Arrow memory per byte of its JSON form, at most: a number's 8 or 16 bytes for the digit
# "0", a list's or string's 4-byte offset for "[]". A row whose Arrow bytes exceed data.max_record_bytes this many
# times is refused without being turned into Python objects.
ARROW_BYTES_PER_JSON_BYTE = 16
# What a data file that is not UTF-8 text opens with, for the line that refuses it.
_MAGIC = ((b"\x1f\x8b", "gzip-compressed"), (b"\x28\xb5\x2f\xfd", "zstd-compressed"), (b"BZh", "bzip2-compressed"),
          (b"\xfd7zXZ\x00", "xz-compressed"), (b"PK\x03\x04", "a zip archive"), (b"PAR1", "a Parquet file"))

# Bytes that change a JSON array's structure outside strings, and those that end or escape inside a string.
_STRUCTURE = re.compile(rb'[\[\]{},"]')
_STRING_STOP = re.compile(rb'["\\]')
_BLANK = b" \t\r\n"
_NOT_BLANK_TEXT = re.compile(r"[^ \t\r\n]")


class _DuplicateKey(ValueError):
    """A JSON object giving one key twice: json keeps the last, so the record would hold a value its author may not
    have seen."""

    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    record = dict(pairs)
    if len(record) != len(pairs):
        seen: set[str] = set()
        raise _DuplicateKey(next(key for key, _ in pairs if key in seen or seen.add(key)))
    return record


_DECODER = json.JSONDecoder(object_pairs_hook=_unique_keys)


@dataclass(frozen=True)
class Refused:
    """A record that could not be read; `reason` completes the line `where: reason`."""

    reason: str


@dataclass
class Records:
    """The records of one data file or folder: iterate for (where, record | Refused) pairs. `columns` maps the column
    names of a table (Parquet, saved dataset) to their kind ('string', 'list', 'null' or the Arrow type); None for
    JSON files, whose records have no common schema."""

    path: Path
    kind: str  # 'JSONL', 'JSON array', 'Parquet' or 'saved dataset'
    columns: dict[str, str] | None
    pairs: Iterator[tuple[str, object]] = field(repr=False)

    def __iter__(self) -> Iterator[tuple[str, object]]:
        return self.pairs


def open_records(path: Path, field_name: str, max_record_bytes: int, allow_outside: bool = False) -> Records:
    """The records of `path` (named `field_name` in messages, e.g. data.path): a folder written by save_to_disk, a
    `.parquet` file, a JSON array (first byte that is not blank: '['), else JSONL."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError) as err:
        reason = getattr(err, "strerror", None) or err
        raise ProfileError([f"{field_name} ('{path}') cannot be read ({reason})"]) from None
    if stat.S_ISDIR(mode):
        return _saved_dataset(path, max_record_bytes, allow_outside)
    if path.suffix.lower() == ".parquet":
        return _parquet(path, field_name, max_record_bytes)
    f = open_data_file(path, field_name)
    head = f.read(8)
    f.seek(0)
    problem = _not_text(head)
    if problem is not None:
        f.close()
        raise ProfileError([f"{field_name} ('{path}') is {problem}"])
    if _first_byte(f) == b"[":
        return Records(path, "JSON array", None, json_array_records(f, path, max_record_bytes))
    f.seek(0)
    return Records(path, "JSONL", None, _jsonl_records(f, path, max_record_bytes))


def _utf16_without_mark(head: bytes) -> str | None:
    """'little-endian' or 'big-endian' when `head` reads as UTF-16 of ASCII text: every odd (or even) byte zero, the
    others not; None otherwise (UTF-8 JSON never holds a zero byte; UTF-32 holds three beside each ASCII one)."""
    head = head[: len(head) // 4 * 4]
    if not head[1::4].strip(b"\0") and not head[2::4].strip(b"\0"):
        return None  # UTF-32 of ASCII text: three zero bytes beside each ASCII one, not UTF-16
    even, odd = head[0::2], head[1::2]
    if not odd.strip(b"\0") and even.strip(b"\0"):
        return "little-endian"
    if not even.strip(b"\0") and odd.strip(b"\0"):
        return "big-endian"
    return None


def _not_text(head: bytes) -> str | None:
    """What a data file opening with `head` is when it cannot be JSON in UTF-8 (compressed, an archive, Parquet
    without its suffix, UTF-16 or UTF-32 text): the end of the line refusing it; None otherwise."""
    encoding = foreign_encoding(head)
    if encoding is not None:
        return f"{encoding} text (it opens with that byte-order mark): save it as UTF-8"
    if len(head) >= 4 and (order := _utf16_without_mark(head[:64])) is not None:
        return f"UTF-16 ({order}) text without a byte-order mark (a zero byte beside each ASCII one): save it as UTF-8"
    kind = next((name for magic, name in _MAGIC if head.startswith(magic)), None)
    if kind == "a Parquet file":
        return "a Parquet file (it opens with PAR1): name it with the .parquet suffix"
    if kind is not None:
        return f"{kind}: data files are read uncompressed; unpack it and name the file it holds"
    return None


def open_data_file(path: Path, field_name: str = "data.path"):
    """The data file, opened for reading in binary. Without blocking: a FIFO swapped in after the profile was
    checked would wait for a writer; it is refused instead."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except (OSError, ValueError) as err:
        reason = getattr(err, "strerror", None) or err
        raise ProfileError([f"{field_name} ('{path}') cannot be read ({reason})"]) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise ProfileError([f"{field_name} ('{path}') must be a regular file, not {file_kind(mode)}"])
    return os.fdopen(fd, "rb")


def _first_byte(f) -> bytes:
    """The file's first byte that is not blank (a UTF-8 byte-order mark skipped), read in blocks."""
    raw = f.read(max(SKIP_BLOCK_BYTES, len(UTF8_BOM)))
    block = raw.removeprefix(UTF8_BOM)
    while raw:
        stripped = block.lstrip(_BLANK)
        if stripped:
            return stripped[:1]
        raw = block = f.read(SKIP_BLOCK_BYTES)
    return b""


def _jsonl_records(f, path: Path, max_record_bytes: int) -> Iterator[tuple[str, object]]:
    """JSONL: one record per line; blank lines are skipped. A file whose first record is not UTF-8 or not JSON is
    not JSONL (a pretty-printed JSON object, a compressed or binary file): it stops after that one line."""
    with f:
        is_first = True
        for line_no, line, problem in jsonl_lines(f, max_record_bytes):
            if problem is None and not line.strip():
                continue
            record = Refused(problem) if problem is not None else json_record(line)
            if is_first and isinstance(record, Refused) and record.reason.startswith(("invalid JSON", "not UTF-8")):
                hint = f"; {DATA_FILES}" if record.reason.startswith("invalid JSON") else ""
                yield f"{path}:{line_no}", Refused(record.reason + hint)
                return
            is_first = False
            yield f"{path}:{line_no}", record


def jsonl_lines(f, max_record_bytes: int) -> Iterator[tuple[int, str | None, str | None]]:
    """(line number, text, None) for each line of a binary JSONL file, or (line number, None, problem) for a line
    longer than max_record_bytes (read past in blocks, never held whole) or not UTF-8 (the problem names the byte
    and its offset in the line and in the file). A UTF-8 byte-order mark opening the file is dropped."""
    offset = 0
    for line_no in itertools.count(1):
        # Two more bytes than a record may hold: the record is too long exactly when its line without "\r\n" is.
        raw = f.readline(max_record_bytes + 2)
        if not raw:
            return
        start, offset = offset, offset + len(raw)
        if line_no == 1 and raw.startswith(UTF8_BOM):
            raw, start = raw[len(UTF8_BOM):], start + len(UTF8_BOM)
        record = raw.removesuffix(b"\n").removesuffix(b"\r")
        if len(record) > max_record_bytes:
            size, tail = len(raw), raw[-2:]
            while not tail.endswith(b"\n") and (chunk := f.readline(SKIP_BLOCK_BYTES)):
                offset, size, tail = offset + len(chunk), size + len(chunk), (tail + chunk)[-2:]
            size -= len(tail) - len(tail.removesuffix(b"\n").removesuffix(b"\r"))
            yield line_no, None, too_large(size, max_record_bytes)
            continue
        try:
            text = record.decode("utf-8")
        except UnicodeDecodeError as err:
            yield line_no, None, (f"not UTF-8 ({err.reason}: byte 0x{record[err.start]:02x} at byte offset "
                                  f"{err.start} of the line, {start + err.start} of the file)")
            continue
        yield line_no, text, None


def too_large(size: int, max_record_bytes: int) -> str:
    return f"the record ({size} bytes) is larger than data.max_record_bytes ({max_record_bytes})"


def json_record(text: str) -> object:
    """One record's JSON text parsed, or Refused saying why it is not JSON, nested too deeply or gives a key twice in
    one object."""
    try:
        if text.startswith("\ufeff"):
            # As json.loads: a byte-order mark may open the file only (jsonl_lines drops that one).
            raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
        return _DECODER.decode(text)
    except json.JSONDecodeError as err:
        return Refused(f"invalid JSON ({err.msg} at column {err.colno})")
    except _DuplicateKey as err:
        return Refused(f"key {err.key!r:.60} appears twice in one JSON object: an object gives each key once (json "
                       "would keep the last)")
    except RecursionError:
        return Refused(too_deep())
    except ValueError as err:
        # An integer literal longer than Python converts (sys.set_int_max_str_digits): no number a record holds.
        digits = re.search(r"value has (\d+) digits", str(err))
        shown = f"{digits.group(1)} digits" if digits else str(err)
        return Refused(f"a number of {shown}, longer than JSON numbers are read ({sys.get_int_max_str_digits()} "
                       "digits at most)")


def too_deep() -> str:
    return f"JSON nested too deeply (deeper than Python's recursion limit, {sys.getrecursionlimit()} levels)"


class _ArrayScan:
    """The bytes of one JSON array's items, found by tracking strings and nesting; an item's bytes are kept only
    while they fit max_record_bytes (past that only counted). UTF-8 never puts an ASCII byte inside a multi-byte
    character, so scanning bytes for the ASCII structure is exact."""

    def __init__(self, max_record_bytes: int):
        self.limit = max_record_bytes
        self.item: bytearray | None = bytearray()
        self.size = 0
        self.start = 0  # file offset of the item's first byte

    def add(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.item is not None:
            if self.size > self.limit:
                self.item = None
            else:
                self.item += chunk

    def take(self) -> tuple[bytearray | None, int, int]:
        taken = self.item, self.size, self.start
        self.item, self.size = bytearray(), 0
        return taken


def json_array_records(f, path: Path, max_record_bytes: int) -> Iterator[tuple[str, object]]:
    """The items of a file holding one JSON array, named `file:[I]`, read in blocks (see the module's memory note).
    The array must close (a truncated file is refused at the item it ends in) and nothing may follow it."""
    with f:
        f.seek(0)
        scan = _ArrayScan(max_record_bytes)
        index = depth = 0
        is_open = is_closed = in_string = is_escaped = has_item = False
        offset = 0  # file offset of the block
        block = f.read(max(SKIP_BLOCK_BYTES, len(UTF8_BOM)))
        pos = len(UTF8_BOM) if block.startswith(UTF8_BOM) else 0
        while block:
            # Fast path: whole items parsed by json's C decoder from the block's text; after its first miss in a
            # block (an item cut by the block's end, a bad item) the byte scan goes on to the block's end.
            text, text_at, text_pos, is_fast = "", -1, 0, True
            while pos < len(block):
                if is_fast and is_open and not (is_closed or in_string or has_item or depth):
                    if text_at != pos:
                        text, text_at, text_pos = _valid_text(block, pos), pos, 0
                    fast = _next_item(text, text_pos, max_record_bytes)
                    if fast is not None:
                        record, chars, used, terminator = fast
                        yield f"{path}:[{index}]", record
                        index, pos, is_closed = index + 1, pos + used, terminator == "]"
                        text_at, text_pos = pos, text_pos + chars
                        continue
                    is_fast = False
                if is_closed:
                    rest = block[pos:].lstrip(_BLANK)
                    if rest:
                        at = offset + len(block) - len(rest)
                        yield str(path), Refused(f"data after the JSON array's closing ']' (byte offset {at}); a JSON "
                                                 "data file holds one array of records")
                        return
                    break
                if not is_open:
                    rest = block[pos:].lstrip(_BLANK)
                    pos = len(block) - len(rest)
                    if rest:
                        # open_records saw '[' first.
                        is_open, pos = True, pos + 1
                    continue
                if in_string:
                    if is_escaped:
                        scan.add(block[pos:pos + 1])
                        pos, is_escaped = pos + 1, False
                        continue
                    match = _STRING_STOP.search(block, pos)
                    end = match.end() if match else len(block)
                    scan.add(block[pos:end])
                    if match:
                        in_string = block[match.start()] != ord('"')
                        is_escaped = in_string
                    pos = end
                    continue
                match = _STRUCTURE.search(block, pos)
                end = match.start() if match else len(block)
                plain = block[pos:end]
                if not has_item:
                    stripped = plain.lstrip(_BLANK)
                    if stripped:
                        has_item, scan.start = True, offset + end - len(stripped)
                    plain = stripped
                scan.add(plain)
                if not match:
                    pos = end
                    continue
                char = block[end:end + 1]
                pos = end + 1
                if depth == 0 and char in (b",", b"]"):
                    if has_item:
                        yield f"{path}:[{index}]", _array_item(*scan.take(), max_record_bytes)
                        index += 1
                    elif char == b"," or index > 0:
                        yield f"{path}:[{index}]", Refused(f"invalid JSON (no record before the '{char.decode()}' at "
                                                           f"byte offset {offset + end})")
                        index += 1
                    has_item, is_closed = False, char == b"]"
                    continue
                if not has_item:
                    has_item, scan.start = True, offset + end
                scan.add(char)
                if char == b'"':
                    in_string = True
                elif char in (b"[", b"{"):
                    depth += 1
                elif char in (b"]", b"}") and depth > 0:
                    depth -= 1
            offset, pos = offset + len(block), 0
            block = f.read(SKIP_BLOCK_BYTES)
        if not is_closed:
            where = f"{path}:[{index}]" if has_item else str(path)
            yield where, Refused("the file ends inside the JSON array (no closing ']': the file is truncated)")


def _valid_text(block: bytes, start: int) -> str:
    """block[start:] as text, up to its first byte that is not UTF-8 (or a character cut by the block's end)."""
    try:
        return block[start:].decode("utf-8")
    except UnicodeDecodeError as err:
        return block[start:start + err.start].decode("utf-8")


def _next_item(text: str, start: int, max_record_bytes: int) -> tuple[object, int, int, str] | None:
    """The fast path of a JSON array's scan: (record, characters used, bytes used, ',' or ']') when text[start:]
    opens with one whole well-formed item within max_record_bytes followed by its ',' or ']'; None leaves the item to
    the byte scan, which also names its problem."""
    first = _NOT_BLANK_TEXT.search(text, start)
    if first is None or text[first.start()] in ",]":
        return None
    try:
        record, end = _DECODER.raw_decode(text, first.start())
    except (ValueError, RecursionError):
        return None
    after = _NOT_BLANK_TEXT.search(text, end)
    if after is None or text[after.start()] not in ",]":
        return None
    size = len(text[first.start():after.start()].encode("utf-8"))
    if size > max_record_bytes:
        return None
    used = after.start() + 1 - start
    return record, used, len(text[start:after.start() + 1].encode("utf-8")), text[after.start()]


def _array_item(item: bytearray | None, size: int, start: int, max_record_bytes: int) -> object:
    if item is None:
        return Refused(too_large(size, max_record_bytes))
    try:
        text = item.decode("utf-8")
    except UnicodeDecodeError as err:
        return Refused(f"not UTF-8 ({err.reason}: byte 0x{item[err.start]:02x} at byte offset {err.start} of the "
                       f"record, {start + err.start} of the file)")
    return json_record(text)


def require(module: str, reading: str, path: Path):
    """An optional library (the `data` extra), or a one-line ProfileError naming the pip extra."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ProfileError([f"{path}: reading {reading} needs the '{module.split('.')[0]}' library: "
                            f"{INSTALL_HINT}"]) from None


def column_kinds(schema) -> dict[str, str]:
    """A pyarrow schema's columns as 'string', 'list', 'null' or the Arrow type's name."""
    import pyarrow as pa

    def kind(t) -> str:
        if pa.types.is_dictionary(t):
            # A pandas category column: its rows read as the values.
            return kind(t.value_type)
        if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
            return "string"
        if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t) or \
                pa.types.is_list_view(t) or pa.types.is_large_list_view(t):
            return "list"
        if pa.types.is_null(t):
            return "null"
        return str(t)

    return {f.name: kind(f.type) for f in schema}


def _duplicate_column_problems(schema, path: Path) -> list[str]:
    """A table naming one column twice: its rows as records would keep the last column's value alone."""
    names = list(schema.names)
    twice = sorted({name for name in names if names.count(name) > 1})
    return [f"{path}: column {name!r:.60} appears {names.count(name)} times; a record holds each key once (the last "
            "would silently win)" for name in twice]


def _table_rows(batches, path: Path, max_record_bytes: int) -> Iterator[tuple[str, object]]:
    """Rows of Arrow record batches as records `file:row I`; an unreadable batch (a corrupt page) ends the file. A row
    whose Arrow bytes alone show it larger than max_record_bytes is refused without being turned into Python objects
    (a row of a gigabyte would be held three times over); the others are held to their JSON form's bytes."""
    row = 0
    try:
        for batch in batches:
            for record in _batch_records(batch, max_record_bytes):
                if not isinstance(record, Refused):
                    size = _json_size(record)
                    record = record if size <= max_record_bytes else Refused(too_large(size, max_record_bytes))
                yield f"{path}:row {row}", record
                row += 1
    except Exception as err:  # pyarrow raises ArrowException subclasses, OSError and others for corrupt pages
        yield f"{path}:row {row}", Refused(f"unreadable ({type(err).__name__}: {_first_line(err)})")


def _batch_records(batch, max_record_bytes: int) -> list[object]:
    """The batch's rows as Python records, or Refused for a row of more than ARROW_BYTES_PER_JSON_BYTE times
    max_record_bytes in Arrow memory (its JSON form is then larger than max_record_bytes)."""
    import pyarrow as pa

    bound = ARROW_BYTES_PER_JSON_BYTE * max_record_bytes
    # A slice of a dictionary column (a pandas category) counts the whole dictionary: not the row's own bytes.
    shared = sum(column.dictionary.nbytes for column in batch.columns if pa.types.is_dictionary(column.type))
    if batch.nbytes - shared <= bound:
        return batch.to_pylist()
    records: list[object] = []
    for i in range(batch.num_rows):
        row = batch.slice(i, 1)
        size = row.nbytes - shared
        records.append(Refused(f"the record (about {size} bytes) is larger than data.max_record_bytes "
                               f"({max_record_bytes})") if size > bound else row.to_pylist()[0])
    return records


def _json_size(record: object) -> int:
    try:
        return len(json.dumps(record, ensure_ascii=False, default=repr).encode("utf-8", "surrogatepass"))
    except (ValueError, RecursionError):
        return 0


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:200] if text else "no message"


def _parquet(path: Path, field_name: str, max_record_bytes: int) -> Records:
    parquet = require("pyarrow.parquet", "a Parquet file", path)
    f = open_data_file(path, field_name)
    try:
        # A page whose checksum the writer stored and its bytes no longer match (bit rot, a torn copy) is refused;
        # a file written without checksums is read unchecked.
        table = parquet.ParquetFile(f, page_checksum_verification=True)
        columns = column_kinds(table.schema_arrow)
        chunks = _chunk_pages(f, table.metadata)
        problems = _duplicate_column_problems(table.schema_arrow, path) + _bomb_problems(chunks, path,
                                                                                         max_record_bytes)
    except Exception as err:  # pyarrow's ArrowInvalid and friends for a file that is not Parquet
        f.close()
        raise ProfileError([f"{path}: not a readable Parquet file ({_first_line(err)})"]) from None
    if problems:
        f.close()
        raise ProfileError(problems)

    dictionaries = [0] * table.metadata.num_row_groups
    for chunk in chunks:
        dictionaries[chunk.group] += chunk.dictionary

    def rows():
        with f:
            batches = (batch for group, dictionary in enumerate(dictionaries)
                       for batch in table.iter_batches(row_groups=[group],
                                                       batch_size=_batch_rows(dictionary, max_record_bytes)))
            yield from _table_rows(batches, path, max_record_bytes)

    return Records(path, "Parquet", columns, rows())


@dataclass
class _Chunk:
    """One Parquet column chunk: `size` and `dictionary` are the bytes its pages' headers say they decompress to (all
    pages, headers included; its dictionary page), the larger of that and the file's metadata for `size`. pyarrow
    decompresses a page into a buffer of its header's size and refuses a page that does not fill it exactly, so a
    page header cannot understate what its page decodes to; the file's metadata can."""

    group: int
    name: str
    stored: int
    size: int
    dictionary: int


def _chunk_pages(f, metadata) -> list[_Chunk]:
    """Every column chunk of the file, its sizes read from its pages' headers as pyarrow walks them: from its first
    page, through the chunk's stored bytes, until its data pages hold the chunk's number of values."""
    chunks = []
    for group in range(metadata.num_row_groups):
        row_group = metadata.row_group(group)
        for index in range(row_group.num_columns):
            chunk = row_group.column(index)
            start = chunk.data_page_offset
            if chunk.has_dictionary_page and 0 < chunk.dictionary_page_offset < start:
                start = chunk.dictionary_page_offset
            size, dictionary = _page_sizes(f, start, chunk.total_compressed_size, chunk.num_values)
            chunks.append(_Chunk(group, chunk.path_in_schema, chunk.total_compressed_size,
                                 max(size, chunk.total_uncompressed_size), dictionary))
    return chunks


# A Parquet page header is a few dozen bytes, a few KiB with statistics; pyarrow reads none past 16 MiB.
_PAGE_HEADER_BLOCK = 1 << 12
_MAX_PAGE_HEADER_BYTES = 16 << 20
_DICTIONARY_PAGE = 2
# PageHeader's fields: type, uncompressed_page_size, compressed_page_size, data_page_header and
# data_page_header_v2 (field 1 of each: num_values).
_PAGE_TYPE, _PAGE_SIZE, _PAGE_STORED, _DATA_PAGE, _DATA_PAGE_V2 = 1, 2, 3, 5, 8


def _page_sizes(f, start: int, stored: int, num_values: int) -> tuple[int, int]:
    """(bytes all pages decompress to, headers included; bytes the dictionary page decompresses to) of the column
    chunk whose pages start at byte `start` and take `stored` bytes. The walk stops at a header that cannot be read:
    pyarrow refuses that page when it reaches it."""
    size = dictionary = seen = 0
    pos, end = start, start + stored
    block, block_at = b"", start
    while pos < end and seen < num_values:
        want = _PAGE_HEADER_BLOCK
        while True:
            if not block_at <= pos < block_at + len(block) or want > _PAGE_HEADER_BLOCK:
                f.seek(pos)
                block, block_at = f.read(min(want, end - pos)), pos
            try:
                header, used = _thrift_struct(block, pos - block_at, 0)
                break
            except IndexError:
                if want >= _MAX_PAGE_HEADER_BYTES or block_at + len(block) >= end:
                    return size, dictionary
                want *= 2
            except ValueError:
                return size, dictionary
        page_size, page_stored = header.get(_PAGE_SIZE), header.get(_PAGE_STORED)
        if not isinstance(page_size, int) or not isinstance(page_stored, int) or page_stored < 0:
            return size, dictionary
        header_bytes = block_at + used - pos
        size += header_bytes + max(page_size, 0)
        if header.get(_PAGE_TYPE) == _DICTIONARY_PAGE:
            dictionary += max(page_size, 0)
        data = header.get(_DATA_PAGE) or header.get(_DATA_PAGE_V2)
        if isinstance(data, dict) and isinstance(data.get(1), int):
            seen += max(data[1], 0)
        pos += header_bytes + page_stored
    return size, dictionary


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")


def _thrift_value(buf: bytes, pos: int, kind: int, depth: int) -> tuple[object, int]:
    """One value of Thrift's compact protocol (the encoding of Parquet's headers) of type `kind`. IndexError: the
    value runs past `buf`; ValueError: it is not the compact protocol."""
    if kind in (1, 2):  # a struct field's boolean is its type
        return kind == 1, pos
    if kind == 3:
        return buf[pos], pos + 1
    if kind in (4, 5, 6):
        value, pos = _varint(buf, pos)
        return (value >> 1) ^ -(value & 1), pos
    if kind == 7:
        if pos + 8 > len(buf):
            raise IndexError(pos)
        return None, pos + 8
    if kind == 8:
        length, pos = _varint(buf, pos)
        if pos + length > len(buf):
            raise IndexError(pos)
        return None, pos + length
    if depth > 32:
        raise ValueError("nested more than 32 levels")
    if kind in (9, 10):
        head = buf[pos]
        count, item, pos = head >> 4, head & 0x0F, pos + 1
        if count == 15:
            count, pos = _varint(buf, pos)
        if count > len(buf) - pos:  # each item takes a byte at least
            raise IndexError(pos)
        for _ in range(count):
            _, pos = _thrift_value(buf, pos, 3 if item in (1, 2) else item, depth + 1)
        return None, pos
    if kind == 11:
        count, pos = _varint(buf, pos)
        if count:
            if count > len(buf) - pos:
                raise IndexError(pos)
            types, pos = buf[pos], pos + 1
            for _ in range(count):
                _, pos = _thrift_value(buf, pos, types >> 4, depth + 1)
                _, pos = _thrift_value(buf, pos, types & 0x0F, depth + 1)
        return None, pos
    if kind == 12:
        return _thrift_struct(buf, pos, depth + 1)
    raise ValueError(f"no Thrift type {kind}")


def _thrift_struct(buf: bytes, pos: int, depth: int) -> tuple[dict[int, object], int]:
    """A compact-protocol struct at buf[pos:] as {field id: value} (integers, booleans and structs; other values as
    None), and the position after it."""
    fields: dict[int, object] = {}
    field_id = 0
    while True:
        head = buf[pos]
        pos += 1
        if head == 0:
            return fields, pos
        if head >> 4:
            field_id += head >> 4
        else:
            raw, pos = _varint(buf, pos)
            field_id = (raw >> 1) ^ -(raw & 1)
        fields[field_id], pos = _thrift_value(buf, pos, head & 0x0F, depth)


def _bomb_problems(chunks: list[_Chunk], path: Path, max_record_bytes: int) -> list[str]:
    """The first column chunk whose pages decompress to more than MAX_PARQUET_RATIO times their stored bytes and
    more than max_record_bytes, as its pages' headers or the file's metadata say: read, it would fill memory from a
    small file."""
    for chunk in chunks:
        if chunk.size > max_record_bytes and chunk.size > MAX_PARQUET_RATIO * max(chunk.stored, 1):
            return [f"{path}: column {chunk.name!r:.60} of row group {chunk.group} decompresses from {chunk.stored} "
                    f"to {chunk.size} bytes, more than {MAX_PARQUET_RATIO} times (a decompression bomb?) and more "
                    f"than data.max_record_bytes ({max_record_bytes})"]
    return []


def _batch_rows(dictionary: int, max_record_bytes: int) -> int:
    """Rows of a row group read at once, its dictionary pages decompressing to `dictionary` bytes. Each row may take
    a dictionary's largest value, which the page bounds: so many rows that their dictionary values come to at most
    what one row may take in Arrow memory (ARROW_BYTES_PER_JSON_BYTE x data.max_record_bytes), or one row, up to
    TABLE_BATCH_ROWS."""
    return max(1, min(TABLE_BATCH_ROWS, ARROW_BYTES_PER_JSON_BYTE * max_record_bytes // max(dictionary, 1)))


def _saved_dataset(path: Path, max_record_bytes: int, allow_outside: bool) -> Records:
    """A folder written by datasets' Dataset.save_to_disk, read with load_from_disk (local files only). Its Arrow
    files must lie inside the folder; a DatasetDict folder is refused naming its splits (give one split's folder)."""
    splits = _dataset_json(path / "dataset_dict.json", path, allow_outside)
    if splits is not None:
        names = splits.get("splits") if isinstance(splits, dict) else None
        listed = ", ".join(str(n) for n in names) if isinstance(names, list) and names else "none listed"
        example = f"{path}/{names[0]}" if isinstance(names, list) and names and isinstance(names[0], str) else \
            f"{path}/train"
        raise ProfileError([f"{path}: a DatasetDict folder (splits: {listed}); name one split's folder, e.g. "
                            f"'{example}'"])
    state = _dataset_json(path / "state.json", path, allow_outside)
    if state is None:
        raise ProfileError([f"{path}: a folder must be one written by datasets' save_to_disk (it has no state.json "
                            "or dataset_dict.json)"])
    files = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(files, list) or not all(
        isinstance(f, dict) and isinstance(f.get("filename"), str) for f in files
    ):
        raise ProfileError([f"{path}/state.json: must list the dataset's Arrow files (_data_files), as "
                            "save_to_disk writes it"])
    root = Path(os.path.realpath(path))
    for entry in files:
        name = entry["filename"]
        resolved = Path(os.path.realpath(path / name)) if "\0" not in name else None
        if resolved is None or not (allow_outside or resolved.is_relative_to(root)):
            raise ProfileError([f"{path}/state.json: data file {name!r} lies outside the dataset folder "
                                "(set data.allow_paths_outside: true to allow)"])
        if not resolved.is_file():
            raise ProfileError([f"{path}/state.json: data file {name!r} is missing or not a regular file"])
    info = path / "dataset_info.json"
    if not (allow_outside or _inside(info, root)):
        raise ProfileError([f"{info}: leads outside the dataset folder (set data.allow_paths_outside: true to allow)"])
    if not files:
        # datasets cannot load a dataset of no Arrow files (no rows); the caller says it holds no records.
        return Records(path, "saved dataset", None, iter(()))
    datasets = require("datasets", "a save_to_disk folder", path)
    try:
        dataset = datasets.load_from_disk(str(path), keep_in_memory=False)
        columns = column_kinds(dataset.data.schema)
    except Exception as err:  # datasets and pyarrow raise many kinds for a damaged folder
        raise ProfileError([f"{path}: not a readable save_to_disk folder ({type(err).__name__}: "
                            f"{_first_line(err)})"]) from None
    if not isinstance(dataset, datasets.Dataset):
        raise ProfileError([f"{path}: a save_to_disk folder holding a {type(dataset).__name__}, not a Dataset"])
    problems = _duplicate_column_problems(dataset.data.schema, path)
    if problems:
        raise ProfileError(problems)
    # with_format("arrow") reads the rows as saved (indices applied), images and other features undecoded.
    batches = (batch for table in dataset.with_format("arrow").iter(batch_size=TABLE_BATCH_ROWS)
               for batch in table.to_batches())
    return Records(path, "saved dataset", columns, _table_rows(batches, path, max_record_bytes))


def _inside(path: Path, root: Path) -> bool:
    """Whether `path`, links followed, lies in the folder `root` (resolved); a path that does not exist does."""
    return not os.path.lexists(path) or Path(os.path.realpath(path)).is_relative_to(root)


def _dataset_json(path: Path, folder: Path, allow_outside: bool = False) -> object | None:
    """A saved dataset's small JSON file, None when absent; ProfileError when it is not a small JSON file inside
    `folder` (links followed) unless `allow_outside`."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as err:
        raise ProfileError([f"{path}: cannot be read ({err.strerror or err})"]) from None
    if not (allow_outside or _inside(path, Path(os.path.realpath(folder)))):
        raise ProfileError([f"{path}: leads outside the dataset folder (set data.allow_paths_outside: true to allow)"])
    if not stat.S_ISREG(mode):
        raise ProfileError([f"{path}: must be a regular file, not {file_kind(mode)}"])
    with open_data_file(path, str(path)) as f:
        raw = f.read(MAX_DATASET_JSON_BYTES + 1)
    if len(raw) > MAX_DATASET_JSON_BYTES:
        raise ProfileError([f"{path}: larger than {MAX_DATASET_JSON_BYTES} bytes; {folder} is not a save_to_disk "
                            "folder"])
    record = json_record(raw.decode("utf-8", "replace"))
    if isinstance(record, Refused):
        raise ProfileError([f"{path}: {record.reason}; {folder} is not a save_to_disk folder"])
    return record
