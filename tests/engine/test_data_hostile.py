"""Hostile and careless data: bytes that are not UTF-8, records too large or nested too deeply, files that are not
regular files, decompression bombs, images that vanish mid-run, and image paths that leave the data folder. Each
ends as one line naming the file (and line), never a traceback, a hang or a memory blow-up."""

import io
import json
import os
import struct
import subprocess
import sys
import threading
import zlib

import numpy as np
import pytest
import torch

from moe_tune.engine.data.dataset import (
    SKIP_BLOCK_BYTES,
    PackedDataset,
    VisionInput,
    jsonl_lines,
    load_documents,
)
from moe_tune.engine.data.images import MAX_IMAGE_PIXELS, ImageError, ImageSettings, load_image
from moe_tune.engine.data.multimodal import VisionTokens, resolve_image_path
from moe_tune.engine.data.tokenizer import ByteTokenizer
from moe_tune.profiles import ProfileError, load_profile
from moe_tune.profiles.schema import DataProfile

PIL = pytest.importorskip("PIL.Image")
TOKENS = VisionTokens(image=300, start=301, end=302)
SETTINGS = ImageSettings(patch_size=4, merge_size=2, min_pixels=16 * 16, max_pixels=32 * 32)
VISION = VisionInput(SETTINGS, TOKENS)
TOK = ByteTokenizer()
NO_FORMAT = ("a record needs a 'text' or a 'messages' key, or alpaca's 'instruction' and 'output', or sharegpt's "
             "'conversations' (has: ['txt'])")


def problems(path, **data):
    with pytest.raises(ProfileError) as err:
        load_documents(DataProfile(path=path, seq_len=512, **data), TOK, VISION)
    return err.value.problems


def write_image(path, height=16, width=16):
    PIL.fromarray(np.random.default_rng(0).integers(0, 255, (height, width, 3), dtype=np.uint8)).save(path)
    return path


def image_record(name):
    return {"messages": [{"role": "user", "content": "<image>what?"}, {"role": "assistant", "content": "ok"}],
            "images": [name]}


def write_records(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def within(seconds, fn):
    """fn's result or exception, failing the test when it takes longer (a blocking open would hang the suite)."""
    outcome = {}

    def run():
        try:
            outcome["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - handed back to the test
            outcome["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s (blocked?)"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


class TestNotUtf8:
    OK = b'{"text": "ok"}\n'  # 15 bytes

    @pytest.mark.parametrize(
        "content, line, reason, byte, line_offset, file_offset",
        [
            (b'\xff{"text": "a"}\n', 1, "invalid start byte", 0xFF, 0, 0),
            (b'{"text": "a\xffb"}\n', 1, "invalid start byte", 0xFF, 11, 11),
            (OK + b'{"text": "\xfe"}\n', 2, "invalid start byte", 0xFE, 10, 25),
            # An overlong encoding of "/" (C0 AF): decoders that accept it let "../" past path checks.
            (OK + OK + b'{"text": "\xc0\xaf"}\n', 3, "invalid start byte", 0xC0, 10, 40),
            # A lone continuation byte; a sequence cut short; a UTF-8-encoded surrogate half.
            (b'{"text": "\x80"}\n', 1, "invalid start byte", 0x80, 10, 10),
            (b'{"text": "\xe2\x82"}\n', 1, "invalid continuation byte", 0xE2, 10, 10),
            (b'{"text": "\xed\xa0\x80"}\n', 1, "invalid continuation byte", 0xED, 10, 10),
            # Latin-1 text (a whole file in UTF-16 is refused by its byte-order mark: TestNotText).
            (OK + '{"text": "café"}\n'.encode("latin-1"), 2, "invalid continuation byte", 0xE9, 13, 28),
        ],
        ids=["first-byte", "mid-line", "second-line", "overlong", "continuation", "truncated", "surrogate", "latin-1"],
    )
    def test_named_by_line_and_offset(self, tmp_path, content, line, reason, byte, line_offset, file_offset):
        path = tmp_path / "d.jsonl"
        path.write_bytes(content)
        assert problems(path) == [f"{path}:{line}: not UTF-8 ({reason}: byte 0x{byte:02x} at byte offset "
                                  f"{line_offset} of the line, {file_offset} of the file)"]

    def test_every_bad_line_is_reported_and_the_good_ones_read(self, tmp_path):
        path = tmp_path / "d.jsonl"
        path.write_bytes(self.OK + b'{"text": "\xff"}\n' + self.OK + b'{"text": "\xfe"}\n{"txt": 1}\n')
        found = problems(path)
        assert [p.split(": ")[0] for p in found] == [f"{path}:2", f"{path}:4", f"{path}:5"]

    @pytest.mark.parametrize("ending", [b"\n", b"\r\n"], ids=["lf", "crlf"])
    def test_a_byte_order_mark_opening_the_file_is_dropped(self, tmp_path, ending):
        plain, marked = tmp_path / "plain.jsonl", tmp_path / "marked.jsonl"
        plain.write_bytes(b'{"text": "hello"}\n{"text": "x"}\n')
        marked.write_bytes(b"\xef\xbb\xbf" + b'{"text": "hello"}' + ending + b'{"text": "x"}' + ending)
        profile = DataProfile(path=marked, seq_len=64)
        assert load_documents(profile, TOK) == load_documents(DataProfile(path=plain, seq_len=64), TOK)

    def test_a_byte_order_mark_inside_the_file_is_invalid_json(self, tmp_path):
        path = tmp_path / "d.jsonl"
        path.write_bytes(self.OK + b"\xef\xbb\xbf" + self.OK)
        (line,) = problems(path)
        assert line.startswith(f"{path}:2: invalid JSON (Unexpected UTF-8 BOM")

    @pytest.mark.parametrize("escape", ["\\ud800", "\\udfff", "a\\udc00b"], ids=["high", "low", "mid-text"])
    def test_lone_surrogate_escapes_are_refused(self, tmp_path, escape):
        path = tmp_path / "d.jsonl"
        path.write_text('{"text": "ok"}\n{"text": "%s"}\n' % escape)
        (line,) = problems(path)
        assert line.startswith(f"{path}:2: the record holds '\\ud") and "not a Unicode character" in line


class TestRecordSize:
    LIMIT = 100

    @staticmethod
    def record(size):
        """A text record of exactly `size` bytes."""
        text = '{"text": "%s"}' % ("x" * (size - 12))
        assert len(text) == size
        return text.encode()

    @pytest.mark.parametrize("ending", [b"\n", b"\r\n"], ids=["lf", "crlf"])
    @pytest.mark.parametrize("size", [LIMIT - 1, LIMIT, LIMIT + 1, LIMIT + 2, 10 * LIMIT])
    def test_at_the_limit_and_around_it(self, tmp_path, size, ending):
        path = tmp_path / "d.jsonl"
        ok = self.record(20)
        # The record under test is the second; the third is read with its right line number after it.
        path.write_bytes(ok + ending + self.record(size) + ending + b'{"txt": 1}' + ending)
        found = problems(path, max_record_bytes=self.LIMIT)
        expected_last = f"{path}:3: {NO_FORMAT}"
        if size <= self.LIMIT:
            assert found == [expected_last]
        else:
            assert found == [f"{path}:2: the record ({size} bytes) is larger than data.max_record_bytes "
                             f"({self.LIMIT})", expected_last]

    @pytest.mark.parametrize("size", [LIMIT, LIMIT + 1])
    def test_last_line_without_newline(self, tmp_path, size):
        path = tmp_path / "d.jsonl"
        path.write_bytes(b'{"txt": 1}\n' + self.record(size))
        found = problems(path, max_record_bytes=self.LIMIT)
        assert found[0] == f"{path}:1: {NO_FORMAT}"
        assert found[1:] == ([] if size <= self.LIMIT else [
            f"{path}:2: the record ({size} bytes) is larger than data.max_record_bytes ({self.LIMIT})"
        ])

    def test_a_huge_line_is_never_held_whole(self):
        """Every read is bounded by the limit or the skipping block, however long the line."""

        class Reads(io.BytesIO):
            longest = 0

            def readline(self, size=-1):
                assert size > 0, "an unbounded readline"
                line = super().readline(size)
                Reads.longest = max(Reads.longest, len(line))
                return line

        huge = 5 * SKIP_BLOCK_BYTES + 7
        data = Reads(b'{"text": "a"}\n' + b"x" * huge + b"\n" + b'{"text": "b"}\n')
        lines = list(jsonl_lines(data, self.LIMIT))
        assert lines == [
            (1, '{"text": "a"}', None),
            (2, None, f"the record ({huge} bytes) is larger than data.max_record_bytes ({self.LIMIT})"),
            (3, '{"text": "b"}', None),
        ]
        assert Reads.longest <= SKIP_BLOCK_BYTES

    @pytest.mark.parametrize("limit, rule", [(0, "greater than or equal to 1"), (-1, "greater than or equal to 1"),
                                             (10**25, "less than or equal to 2147483647")])
    def test_the_limit_is_a_positive_int32(self, limit, rule):
        with pytest.raises(ProfileError) as err:
            load_profile("tiny", [f"data.max_record_bytes={limit}"])
        assert err.value.problems == [f"data.max_record_bytes ({limit}): input should be {rule}"]


class TestMalformedJson:
    @pytest.mark.parametrize("depth", [10, 200])
    def test_nesting_within_the_recursion_limit_is_read(self, tmp_path, depth):
        path = tmp_path / "d.jsonl"
        path.write_text('{"text": "ok", "meta": %s}\n' % ("[" * depth + "]" * depth))
        (doc,) = load_documents(DataProfile(path=path, seq_len=64), TOK)
        assert TOK.decode(doc.input_ids[1:]) == "ok"

    @pytest.mark.parametrize("depth", [sys.getrecursionlimit() + 1, 100_000])
    @pytest.mark.parametrize("opener", ["[", '{"a":'], ids=["arrays", "objects"])
    def test_nesting_beyond_it_is_one_line(self, tmp_path, depth, opener):
        closer = "]" if opener == "[" else "}"
        path = tmp_path / "d.jsonl"
        path.write_text('{"text": "ok"}\n{"text": "x", "meta": %s}\n' % (opener * depth + "1" + closer * depth))
        assert problems(path) == [
            f"{path}:2: JSON nested too deeply (deeper than Python's recursion limit, {sys.getrecursionlimit()} levels)"
        ]

    def test_an_integer_too_long_to_convert(self, tmp_path):
        path = tmp_path / "d.jsonl"
        path.write_text('{"text": "x", "n": %s}\n' % ("9" * 5000))
        (line,) = problems(path)
        assert line == f"{path}:1: a number of 5000 digits, longer than JSON numbers are read (4300 digits at most)"


def special_files(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "folder").mkdir()
    return {"fifo": (fifo, "a FIFO"), "dev-null": ("/dev/null", "a character device"),
            "dev-zero": ("/dev/zero", "a character device"), "directory": (tmp_path / "folder", "a directory")}


@pytest.mark.parametrize("kind", ["fifo", "dev-null", "dev-zero", "directory"])
def test_data_path_must_be_a_regular_file(tmp_path, kind):
    path, described = special_files(tmp_path)[kind]
    with pytest.raises(ProfileError) as err:
        within(10, lambda: load_profile("tiny", [f"data.path={path}"]))
    if kind == "directory":
        # A folder is data only when datasets' save_to_disk wrote it.
        assert err.value.problems == [f"data.path ('{path}') must be a regular file or a folder written by datasets' "
                                      "save_to_disk (this directory has no state.json or dataset_dict.json)"]
    else:
        assert err.value.problems == [f"data.path ('{path}') must be a regular file, not {described}"]


def bomb_png(path, width, height, valid=True):
    """A 1-bit PNG whose header declares width x height: all-zero rows compress to a few KB (valid) or a header
    with a token of data (not valid past its first rows)."""

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = (b"\0" * (1 + (width + 7) // 8)) * height if valid else b"\0" * 16
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows, 9))
                     + chunk(b"IEND", b""))
    return path


class TestImageFiles:
    @pytest.mark.parametrize("kind", ["fifo", "dev-null", "dev-zero", "directory"])
    def test_only_regular_files_are_opened(self, tmp_path, kind):
        path, described = special_files(tmp_path)[kind]
        with pytest.raises(ImageError, match=f"^{path}: not a regular file \\({described}\\); an image must be one$"):
            within(10, lambda: load_image(path))

    @pytest.mark.parametrize(
        "width, height, valid",
        [(9500, 9500, True), (10_000, 10_000, False), (20_000, 20_000, False), (1_000_000, 1_000, False),
         (2**31 - 1, 2**31 - 1, False)],
        ids=["just-over", "over", "over-pillows-error", "wide", "largest"],
    )
    def test_decompression_bombs_are_refused_before_decoding(self, tmp_path, width, height, valid):
        path = bomb_png(tmp_path / "bomb.png", width, height, valid)
        assert path.stat().st_size < 100_000
        with pytest.raises(ImageError, match=f"^{path}: .*more than the {MAX_IMAGE_PIXELS} .*an image may have"):
            within(10, lambda: load_image(path))

    def test_the_bound_holds_when_pillows_is_lifted(self, tmp_path, monkeypatch):
        monkeypatch.setattr(PIL, "MAX_IMAGE_PIXELS", None)
        path = bomb_png(tmp_path / "bomb.png", 9500, 9500)
        with pytest.raises(ImageError, match="9500 x 9500 pixels, more than the"):
            load_image(path)

    @pytest.mark.parametrize("bad_images", ["error", "skip"])
    def test_in_records_an_error_or_skipped_and_counted(self, tmp_path, bad_images):
        data = tmp_path / "data"
        data.mkdir()
        os.mkfifo(data / "fifo.png")
        os.mkdir(data / "folder.png")
        os.symlink("/dev/zero", data / "zero.png")
        bomb_png(data / "bomb.png", 20_000, 20_000, valid=False)
        write_image(data / "good.png")
        names = ["good.png", "fifo.png", "folder.png", "zero.png", "bomb.png"]
        path = write_records(data / "d.jsonl", [image_record(n) for n in names])
        expected = [
            f"{path}:2: {data / 'fifo.png'}: not a regular file (a FIFO); an image must be one",
            f"{path}:3: {data / 'folder.png'}: not a regular file (a directory); an image must be one",
            f"{path}:4: /dev/zero: not a regular file (a character device); an image must be one",
        ]
        profile = DataProfile(path=path, seq_len=512, bad_images=bad_images, allow_paths_outside=True)
        if bad_images == "error":
            with pytest.raises(ProfileError) as err:
                within(20, lambda: load_documents(profile, TOK, VISION))
            assert err.value.problems[:3] == expected and len(err.value.problems) == 4
            bomb = f"{path}:5: {data / 'bomb.png'}: 20000 x 20000 pixels, more than the"
            assert err.value.problems[3].startswith(bomb)
        else:
            skipped = []
            docs = within(20, lambda: load_documents(profile, TOK, VISION, skipped))
            assert len(docs) == 1 and skipped[:3] == expected and len(skipped) == 4


class TestImageCount:
    """A record's images are counted before any is decoded: each needs >= 3 tokens of the row (seq_len 512)."""

    @staticmethod
    def record(form, count):
        if form == "placeholders":
            return {"messages": [{"role": "user", "content": "<image>" * count}, {"role": "assistant", "content": "ok"}],
                    "images": ["a.png"] * count}
        parts = [{"type": "image", "image": "a.png"}] * count
        return {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": "ok"}]}

    @pytest.mark.parametrize("form", ["placeholders", "parts"])
    @pytest.mark.parametrize("count", [171, 100_000])
    def test_more_than_fit_are_refused_before_decoding(self, tmp_path, form, count):
        write_image(tmp_path / "a.png", 8, 8)
        path = write_records(tmp_path / "d.jsonl", [self.record(form, count)])
        found = within(10, lambda: problems(path))
        assert found == [f"{path}:1: {count} images need at least {3 * count} tokens, more than data.seq_len (512); "
                         "a document with images is never cut"]

    @pytest.mark.parametrize("form", ["placeholders", "parts"])
    @pytest.mark.parametrize("count", [100, 170])
    def test_fewer_are_decoded(self, tmp_path, form, count):
        write_image(tmp_path / "a.png", 8, 8)
        path = write_records(tmp_path / "d.jsonl", [self.record(form, count)])
        # One token per image: 3 per image in all, as the count assumes.
        vision = VisionInput(ImageSettings(patch_size=1, merge_size=1, min_pixels=1, max_pixels=1), TOKENS)
        profile = DataProfile(path=path, seq_len=512)
        if count == 100:
            (doc,) = load_documents(profile, TOK, vision)
            assert len(doc.images) == count
        else:
            # Decoded and measured: the chat's text tokens on top of the images' 510 do not fit.
            with pytest.raises(ProfileError, match=f"^{path}:1: needs 5[0-9][0-9] tokens with its images, more than"):
                load_documents(profile, TOK, vision)


class TestImageGoneMidRun:
    def dataset(self, tmp_path):
        image = write_image(tmp_path / "a.png", 16, 16)
        path = write_records(tmp_path / "d.jsonl", [image_record("a.png")])
        docs = load_documents(DataProfile(path=path, seq_len=128), TOK, VISION)
        return PackedDataset(docs, 128, TOK.pad_id, seed=0, image_settings=SETTINGS), image, path

    def test_a_vanished_image_stops_the_run_in_one_line(self, tmp_path):
        dataset, image, path = self.dataset(tmp_path)
        assert dataset.micro_batch(0, 1).pixel_values is not None
        image.unlink()
        with pytest.raises(ProfileError) as err:
            dataset.micro_batch(1, 1)
        assert err.value.problems == [f"{path}:1: {image}: no such image file, after the dataset was read; restore "
                                      "it and resume with --resume (the checkpoints written so far are kept)"]

    @pytest.mark.parametrize("replacement", ["fifo", "broken", "other-size"])
    def test_a_replaced_image_stops_the_run_in_one_line(self, tmp_path, replacement):
        dataset, image, path = self.dataset(tmp_path)
        image.unlink()
        if replacement == "fifo":
            os.mkfifo(image)
        elif replacement == "broken":
            image.write_bytes(b"not an image")
        else:
            write_image(image, 32, 16)
        with pytest.raises(ProfileError) as err:
            within(10, lambda: dataset.micro_batch(0, 1))
        (line,) = err.value.problems
        assert line.startswith(f"{path}:1: {image}: ") and "after the dataset was read" in line
        assert line.endswith("; restore it and resume with --resume (the checkpoints written so far are kept)")
        if replacement == "other-size":
            assert "(a 8 x 4 patch grid, was 4 x 4)" in line


class TestConfinement:
    """Image paths resolve inside the data file's folder unless data.allow_paths_outside."""

    @pytest.fixture
    def tree(self, tmp_path):
        data, outside = tmp_path / "data", tmp_path / "outside"
        (data / "sub").mkdir(parents=True)
        outside.mkdir()
        write_image(data / "in.png")
        write_image(outside / "secret.png")
        write_image(tmp_path / "secret.png")
        os.symlink(tmp_path / "secret.png", data / "link-out.png")
        os.symlink("../../secret.png", data / "sub" / "relative-link-out.png")
        os.symlink(outside, data / "dir-link-out")
        os.symlink(data / "in.png", data / "link-in.png")
        os.symlink("sub", data / "dir-link-in")
        write_image(data / "sub" / "deep.png")
        return tmp_path, data

    ESCAPES = ["../secret.png", "sub/../../secret.png", "./../outside/secret.png", "link-out.png",
               "sub/relative-link-out.png", "dir-link-out/secret.png", "sub/../dir-link-out/secret.png"]
    INSIDE = ["in.png", "./in.png", "sub/../in.png", "link-in.png", "dir-link-in/deep.png", "sub//deep.png"]

    @pytest.mark.parametrize("bad_images", ["error", "skip"])
    @pytest.mark.parametrize("name", ESCAPES)
    def test_escapes_are_refused_naming_the_record(self, tree, name, bad_images):
        root, data = tree
        path = write_records(data / "d.jsonl", [image_record("in.png"), image_record(name)])
        assert problems(path, bad_images=bad_images) == [
            f"{path}:2: image '{name}' resolves outside the data folder {data} (set data.allow_paths_outside: true "
            "to allow)"
        ]

    @pytest.mark.parametrize("target", ["secret.png", "data/in.png"], ids=["outside", "inside"])
    def test_absolute_paths_are_refused(self, tree, target):
        root, data = tree
        name = str(root / target)
        path = write_records(data / "d.jsonl", [image_record(name)])
        assert problems(path) == [
            f"{path}:1: image '{name}' is an absolute path; image paths are relative to the data folder {data} (set "
            "data.allow_paths_outside: true to allow)"
        ]

    def test_parts_content_is_confined_too(self, tree):
        root, data = tree
        record = {"messages": [{"role": "user", "content": [{"type": "image", "image": "../secret.png"}]},
                               {"role": "assistant", "content": "ok"}]}
        path = write_records(data / "d.jsonl", [record])
        (line,) = problems(path)
        assert line.startswith(f"{path}:1: image '../secret.png' resolves outside the data folder")

    def test_the_chat_template_path_is_confined_too(self, tree):
        class Templated(ByteTokenizer):
            has_chat_template = True

            def render_chat(self, messages, *args):
                raise AssertionError("not reached: the image is refused first")

        root, data = tree
        path = write_records(data / "d.jsonl", [image_record("../secret.png")])
        with pytest.raises(ProfileError, match="resolves outside the data folder"):
            load_documents(DataProfile(path=path, seq_len=512), Templated(), VISION)

    @pytest.mark.parametrize("name", INSIDE)
    def test_paths_inside_are_read(self, tree, name):
        root, data = tree
        path = write_records(data / "d.jsonl", [image_record(name)])
        (doc,) = load_documents(DataProfile(path=path, seq_len=512), TOK, VISION)
        (ref,) = doc.images
        assert ref.path.is_relative_to(os.path.realpath(data))

    @pytest.mark.parametrize("name", ESCAPES + ["ABSOLUTE"])
    def test_allow_paths_outside_lifts_it(self, tree, name):
        root, data = tree
        name = str(root / "secret.png") if name == "ABSOLUTE" else name
        path = write_records(data / "d.jsonl", [image_record(name)])
        (doc,) = load_documents(DataProfile(path=path, seq_len=512, allow_paths_outside=True), TOK, VISION)
        assert len(doc.images) == 1

    def test_a_relative_data_path(self, tree, monkeypatch):
        root, data = tree
        write_records(data / "d.jsonl", [image_record("in.png"), image_record("../secret.png")])
        monkeypatch.chdir(data)
        with pytest.raises(ProfileError) as err:
            load_documents(DataProfile(path="d.jsonl", seq_len=512), TOK, VISION)
        assert err.value.problems == [f"d.jsonl:2: image '../secret.png' resolves outside the data folder {data} "
                                      "(set data.allow_paths_outside: true to allow)"]

    @pytest.mark.parametrize("level", ["file", "folder", "data-folder"])
    @pytest.mark.parametrize("allow_outside", [False, True], ids=["confined", "allow-outside"])
    @pytest.mark.parametrize("name", INSIDE)
    def test_a_link_swapped_in_after_the_check_is_not_followed(self, tree, name, level, allow_outside):
        """Images are read again for every batch: the image, its folder or the data folder replaced by a link to a
        copy outside (the same pixels, so that nothing else tells) stops the run, naming the link, where following
        it would read outside the folder checked (or, allowed outside, other files than those measured)."""
        import shutil

        root, data = tree
        path = write_records(data / "d.jsonl", [image_record(name)])
        docs = load_documents(DataProfile(path=path, seq_len=128, allow_paths_outside=allow_outside), TOK, VISION)
        dataset = PackedDataset(docs, 128, TOK.pad_id, seed=0, image_settings=SETTINGS)
        first = dataset.micro_batch(0, 1).pixel_values
        real = docs[0].images[0].path
        swapped = {"file": real, "folder": real.parent, "data-folder": data}[level]
        moved, copy = root / "moved", root / "copy"
        shutil.copytree(swapped, copy, symlinks=True) if swapped.is_dir() else shutil.copy(swapped, copy)
        swapped.rename(moved)
        os.symlink(copy, swapped)
        with pytest.raises(ProfileError) as err:
            dataset.micro_batch(1, 1)
        (line,) = err.value.problems
        assert line.startswith(f"{path}:1: {real}: {swapped} is now a symbolic link, not there when the path was "
                               "resolved: not followed, after the dataset was read; ")
        os.unlink(swapped)
        moved.rename(swapped)
        assert torch.equal(dataset.micro_batch(1, 1).pixel_values, first)

    def test_a_nul_character_is_refused(self, tree):
        root, data = tree
        with pytest.raises(ProfileError, match="holds a NUL character"):
            resolve_image_path("in.png\0../../x", data, "d.jsonl:1")


def test_finetune_reports_every_bad_line_in_one_run(tmp_path, child_env):
    """As a user runs it: non-UTF-8 bytes, a record over the size limit and JSON nested too deeply, each one line,
    exit 2, no traceback."""
    data = tmp_path / "d.jsonl"
    data.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n{"text": "' + b"x" * 4000 + b'"}\n'
                     + b'{"text": "x", "m": ' + b"[" * 1100 + b"]" * 1100 + b"}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "moe_tune", "finetune", "tiny", "--set", f"data.path={data}",
         "--set", "data.max_record_bytes=3000", "--set", f"output.dir={tmp_path / 'out'}", "--quiet"],
        capture_output=True, text=True, timeout=300, env=child_env,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert [line for line in proc.stderr.splitlines() if line.startswith("error: ")] == [
        f"error: {data}:2: not UTF-8 (invalid continuation byte: byte 0xe9 at byte offset 13 of the line, 30 of the "
        "file)",
        f"error: {data}:3: the record (4012 bytes) is larger than data.max_record_bytes (3000)",
        f"error: {data}:4: JSON nested too deeply (deeper than Python's recursion limit, 1000 levels)",
    ]


class TestDuplicateKeys:
    """A JSON object giving a key twice: json kept the last, so the record trained a value its author may not have
    seen. Each such record is one line; the file reads on."""

    def test_in_jsonl_records_at_any_depth(self, tmp_path):
        path = tmp_path / "d.jsonl"
        path.write_text('{"text": "a", "text": "b"}\n{"text": "ok"}\n'
                        '{"messages": [{"role": "user", "content": "x", "content": "y"}]}\n')
        rule = "appears twice in one JSON object: an object gives each key once (json would keep the last)"
        assert problems(path) == [f"{path}:1: key 'text' {rule}", f"{path}:3: key 'content' {rule}"]

    def test_in_a_json_array(self, tmp_path):
        path = tmp_path / "d.json"
        path.write_text('[{"text": "ok"}, {"text": "a", "text": "b"}]')
        assert problems(path) == [f"{path}:[1]: key 'text' appears twice in one JSON object: an object gives each key "
                                  "once (json would keep the last)"]


class TestNotText:
    """A data file that cannot be UTF-8 JSON is one line naming what it is, not `not UTF-8` at line 1."""

    @pytest.mark.parametrize("head, what", [
        (b"\x1f\x8b\x08\x00", "is gzip-compressed: data files are read uncompressed; unpack it and name the file it "
                              "holds"),
        (b"\x28\xb5\x2f\xfd", "is zstd-compressed: data files are read uncompressed; unpack it and name the file it "
                              "holds"),
        (b"BZh91AY", "is bzip2-compressed: data files are read uncompressed; unpack it and name the file it holds"),
        (b"\xfd7zXZ\x00", "is xz-compressed: data files are read uncompressed; unpack it and name the file it holds"),
        (b"PK\x03\x04", "is a zip archive: data files are read uncompressed; unpack it and name the file it holds"),
        (b"PAR1", "is a Parquet file (it opens with PAR1): name it with the .parquet suffix"),
        ('{"text": "a"}\n'.encode("utf-16"), "is UTF-16 (little-endian) text (it opens with that byte-order mark): "
                                            "save it as UTF-8"),
        ('\ufeff{"text": "a"}\n'.encode("utf-16-be"), "is UTF-16 (big-endian) text (it opens with that byte-order "
                                                      "mark): save it as UTF-8"),
        ('{"text": "a"}\n'.encode("utf-32"), "is UTF-32 (little-endian) text (it opens with that byte-order mark): "
                                            "save it as UTF-8"),
    ], ids=["gzip", "zstd", "bzip2", "xz", "zip", "parquet", "utf-16-le", "utf-16-be", "utf-32"])  # fmt: skip
    def test_named_by_what_it_opens_with(self, tmp_path, head, what):
        path = tmp_path / "d.jsonl"
        path.write_bytes(head + b"\x00\xff" * 100)
        assert problems(path) == [f"data.path ('{path}') {what}"]

    def test_utf32_without_a_byte_order_mark_is_not_called_utf16(self, tmp_path):
        path = tmp_path / "d.jsonl"
        path.write_bytes('{"text": "a"}\n'.encode("utf-32-le"))
        (line,) = problems(path)
        assert "UTF-16" not in line

    @pytest.mark.parametrize("order", ["little", "big"])
    @pytest.mark.parametrize("suffix", [".jsonl", ".json"])
    def test_utf16_without_a_byte_order_mark_is_named(self, tmp_path, order, suffix):
        """A zero byte beside each ASCII one (UTF-8 JSON holds none): read as UTF-8 it was 'invalid JSON'."""
        path = tmp_path / f"d{suffix}"
        text = '[{"text": "a"}]' if suffix == ".json" else '{"text": "a"}\n{"text": "b"}\n'
        path.write_bytes(text.encode(f"utf-16-{order[0]}e"))
        assert problems(path) == [f"data.path ('{path}') is UTF-16 ({order}-endian) text without a byte-order mark (a "
                                  "zero byte beside each ASCII one): save it as UTF-8"]  # fmt: skip


class TestTables:
    @staticmethod
    def parquet(path, table, **options):
        pq = pytest.importorskip("pyarrow.parquet")
        pq.write_table(table, path, **options)
        return path

    def test_a_column_named_twice_is_refused(self, tmp_path):
        """Its rows as records kept the last column's value alone."""
        pa = pytest.importorskip("pyarrow")
        table = pa.Table.from_arrays([pa.array(["a"]), pa.array(["b"])], names=["text", "text"])
        path = self.parquet(tmp_path / "d.parquet", table)
        assert problems(path) == [f"{path}: column 'text' appears 2 times; a record holds each key once (the last "
                                  "would silently win)"]

    def test_a_pandas_category_column_reads_as_its_values(self, tmp_path):
        """A dictionary-encoded string column (pandas' category dtype) was refused as not a string column."""
        pa = pytest.importorskip("pyarrow")
        table = pa.table({"text": pa.array(["ab", "cd", "ab"]).dictionary_encode()})
        path = self.parquet(tmp_path / "d.parquet", table)
        plain = self.parquet(tmp_path / "plain.parquet", pa.table({"text": ["ab", "cd", "ab"]}))
        documents = load_documents(DataProfile(path=path, seq_len=64), TOK)
        assert len(documents) == 3 and documents == load_documents(DataProfile(path=plain, seq_len=64), TOK)

    def test_a_decompression_bomb_is_refused_before_it_is_read(self, tmp_path):
        """300 MB of one byte in a 10 KB file took 2.2 GB to refuse as larger than data.max_record_bytes."""
        pa = pytest.importorskip("pyarrow")
        path = self.parquet(tmp_path / "d.parquet", pa.table({"text": ["a" * (2 << 20)]}), compression="zstd")
        chunk = pytest.importorskip("pyarrow.parquet").ParquetFile(path).metadata.row_group(0).column(0)
        stored, size = chunk.total_compressed_size, chunk.total_uncompressed_size
        assert stored * 1000 < size and size > 2 << 20
        assert within(10, lambda: problems(path, max_record_bytes=1 << 18)) == [
            f"{path}: column 'text' of row group 0 decompresses from {stored} to {size} bytes, more than 1000 times (a "
            f"decompression bomb?) and more than data.max_record_bytes ({1 << 18})"]
        # Within data.max_record_bytes it is no bomb: read.
        (document,) = load_documents(DataProfile(path=path, seq_len=64, max_record_bytes=size), TOK)
        assert len(document.input_ids) == 1 + (2 << 20)  # <bos> and the text

    def test_a_row_far_over_the_limit_is_refused_from_its_arrow_bytes(self, tmp_path):
        """A row of more than 16 x data.max_record_bytes in Arrow memory is refused without being turned into Python
        objects (a gigabyte row was held three times over); the rows around it read."""
        pa = pytest.importorskip("pyarrow")
        rows = ["ok", os.urandom(4000).hex(), "x" * 150]
        path = self.parquet(tmp_path / "d.parquet", pa.table({"text": rows}), compression="none")
        assert problems(path, max_record_bytes=100) == [
            f"{path}:row 1: the record (about 8004 bytes) is larger than data.max_record_bytes (100)",
            f"{path}:row 2: the record (162 bytes) is larger than data.max_record_bytes (100)"]


class TestSavedDatasetFiles:
    """A save_to_disk folder's state.json and dataset_info.json are read only inside it, as its Arrow files are."""

    @pytest.fixture
    def folder(self, tmp_path):
        datasets = pytest.importorskip("datasets")
        datasets.Dataset.from_dict({"text": ["a", "b"]}).save_to_disk(str(tmp_path / "ds"))
        return tmp_path / "ds"

    @pytest.mark.parametrize("name", ["state.json", "dataset_info.json"])
    def test_a_file_leading_outside_is_refused(self, folder, name):
        outside = folder.parent / f"outside-{name}"
        (folder / name).rename(outside)
        (folder / name).symlink_to(outside)
        assert problems(folder) == [f"{folder / name}: leads outside the dataset folder (set "
                                    "data.allow_paths_outside: true to allow)"]
        assert len(load_documents(DataProfile(path=folder, seq_len=64, allow_paths_outside=True), TOK)) == 2


def test_a_training_set_left_empty_by_evaluation_documents_says_so(tmp_path):
    """Every training document equal to an evaluation one is left out: the line says why nothing is left."""
    train, held = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    for path in (train, held):
        path.write_text('{"text": "a"}\n{"text": "b"}\n')
    with pytest.raises(ProfileError) as err:
        load_documents(DataProfile(path=train, eval_path=held, seq_len=64), TOK)
    assert err.value.problems == [f"data.path ('{train}') must hold at least one token to train on (its 2 documents "
                                  "equal to evaluation documents are left out of training)"]


class TestImagePixels:
    def test_wide_pixels_out_of_8_bit_range_are_refused(self, tmp_path):
        """A 16-bit scan converted to 8-bit RGB (here and in transformers' loader) was clipped to white."""
        path = tmp_path / "scan.png"
        PIL.fromarray(np.array([[0, 1000], [30000, 65535]], dtype=np.uint16)).save(path)
        with pytest.raises(ImageError) as err:
            load_image(path)
        assert str(err.value) == (f"{path}: mode I;16 pixels range over 0..65535; 8-bit RGB keeps 0..255 and clips the "
                                  "rest (a 16-bit image turns white): save it as an 8-bit image")

    def test_wide_pixels_within_8_bit_range_are_read(self, tmp_path):
        path = tmp_path / "scan.png"
        PIL.fromarray(np.array([[0, 100], [200, 255]], dtype=np.uint16)).save(path)
        assert np.asarray(load_image(path))[:, :, 0].tolist() == [[0, 100], [200, 255]]

    def test_a_truncated_image_says_what_broke(self, tmp_path):
        path = write_image(tmp_path / "a.png", 64, 64)
        path.write_bytes(path.read_bytes()[:200])
        with pytest.raises(ImageError) as err:
            load_image(path)
        assert str(err.value) == f"{path}: not a readable image (OSError: image file is truncated)"
