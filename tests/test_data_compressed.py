"""Compressed jsonl input (dept_mega/data/compressed.py): tools/preprocess_data.py and
tools/train_tokenizer.py read gzip, bzip2 and xz (zstd with its module) as the plain file, by
the file's first bytes; what cannot be read here is one error naming the file and what to
install; a damaged stream is an error naming the file and the last line read, not bad lines."""
from __future__ import annotations

import bz2
import gzip
import io
import lzma
import os
import sys
import types

import pytest

import dept_mega.data.preprocess as pp
from dept_mega.data.compressed import compression_of, iter_lines
from dept_mega.data.jsonl import BadInputReport, iter_texts
from dept_mega.data.preprocess import PreprocessError, preprocess
from tests.data_utils import run_tool, synthetic_texts, train_tiny_tokenizer, write_jsonl

OPENERS = {"gz": gzip.open, "bz2": bz2.open, "xz": lzma.open}
NO_ZSTD = {"compression": None, "compression.zstd": None, "zstandard": None}  # import fails


@pytest.fixture(scope="module")
def tok_model(tmp_path_factory):
    return train_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")), vocab=200)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """300 documents and one bad line (line 301), as a plain jsonl file."""
    path = write_jsonl(str(tmp_path_factory.mktemp("plain") / "a.jsonl"), synthetic_texts(300, seed=3))
    with open(path, "a", encoding="utf-8") as f:
        f.write("not json\n")
    return path


def _compress(plain: str, dest: str, ext: str) -> str:
    with open(plain, "rb") as src, OPENERS[ext](dest, "wb") as out:
        out.write(src.read())
    return dest


def _outputs(prefix: str) -> dict[str, bytes]:
    return {ext: open(prefix + "_text_document" + ext, "rb").read() for ext in (".bin", ".idx", ".bytes.npy")}


@pytest.mark.parametrize("ext", sorted(OPENERS))
def test_compressed_input_gives_the_plain_files_output(tmp_path, tok_model, plain, monkeypatch, ext):
    monkeypatch.setattr(pp, "BATCH_LINES", 7)  # many batches: progress counted batch by batch
    packed = _compress(plain, str(tmp_path / f"a.jsonl.{ext}"), ext)
    want = preprocess([plain], ["text"], tok_model, str(tmp_path / "plain"), log=None)
    got = preprocess([packed], ["text"], tok_model, str(tmp_path / "packed"), workers=2, log=None)
    assert got.documents == want.documents == 300 and got.report.counts == {"invalid_json": 1}, got.report.counts
    assert got.report.examples["invalid_json"] == [f"{packed}:301"]  # lines of the decompressed text
    assert _outputs(str(tmp_path / "packed")) == _outputs(str(tmp_path / "plain"))
    # progress counts the bytes on disk: all of them at the end, never more
    assert got.total_bytes == got.input_bytes == os.path.getsize(packed) < os.path.getsize(plain)


def test_the_audit_case_through_the_cli(tmp_path, tok_model, plain):
    """`--input x.jsonl.gz` used to report every line as skipped (invalid_utf8); a gzip file
    named like plain jsonl is read as gzip too (the first bytes decide)."""
    packed = _compress(plain, str(tmp_path / "x.jsonl.gz"), "gz")
    disguised = _compress(plain, str(tmp_path / "y.jsonl"), "gz")
    for src in (packed, disguised):
        out = str(tmp_path / os.path.basename(src).split(".")[0])
        r = run_tool("preprocess_data.py", ["--input", src, "--tokenizer-model", tok_model, "--output-prefix", out])
        assert r.returncode == 0, r.stderr
        assert "300 documents" in r.stderr and "invalid_utf8" not in r.stderr, r.stderr
        assert "1 of 301 lines skipped" in r.stderr, r.stderr


def test_zstd_without_its_module_is_one_error_naming_the_file(tmp_path, tok_model, monkeypatch):
    src = tmp_path / "c.jsonl.zst"
    src.write_bytes(b"\x28\xb5\x2f\xfd" + b"\x00" * 64)
    assert compression_of(str(src)) == "zstd"
    skippable = tmp_path / "p.zst"  # pzstd's output starts with a skippable frame (magic 0x184D2A5?)
    for first in (0x50, 0x5F):
        skippable.write_bytes(bytes([first]) + b"\x2a\x4d\x18" + b"\x04\x00\x00\x00" + b"\x00" * 4
                              + b"\x28\xb5\x2f\xfd")
        assert compression_of(str(skippable)) == "zstd"
    skippable.write_bytes(b"\x60\x2a\x4d\x18{}")
    assert compression_of(str(skippable)) is None
    for name, value in NO_ZSTD.items():
        monkeypatch.setitem(sys.modules, name, value)
    with pytest.raises(PreprocessError) as exc:
        preprocess([str(src)], ["text"], tok_model, str(tmp_path / "o"), log=None)
    msg = str(exc.value)
    assert repr(str(src)) in msg and "zstd-compressed" in msg and "pip install zstandard" in msg, msg
    assert not [f for f in os.listdir(tmp_path) if f.startswith("o")]  # refused before any output
    from tools.train_tokenizer import main as train_tokenizer
    assert train_tokenizer(["--input", str(src), "--vocab-size", "50", "--output-prefix", str(tmp_path / "t")]) == 2


def test_zstd_reads_every_frame_with_the_zstandard_package(tmp_path, plain, monkeypatch):
    """(zstandard's stream_reader stops after the first frame unless told otherwise: a file of
    several frames, as pzstd or cat writes, would lose the rest.) A stand-in module records the
    call and decompresses its own format (magic + gzip)."""
    calls = []

    class Reader(io.RawIOBase):
        def __init__(self, raw, **kw):
            calls.append(kw)
            raw.read(4)
            self.inner = gzip.GzipFile(fileobj=raw)

        def readable(self):
            return True

        def readinto(self, b):
            data = self.inner.read(len(b))
            b[:len(data)] = data
            return len(data)

    fake = types.SimpleNamespace(ZstdDecompressor=lambda: types.SimpleNamespace(stream_reader=Reader))
    monkeypatch.setitem(sys.modules, "compression", None)
    monkeypatch.setitem(sys.modules, "compression.zstd", None)
    monkeypatch.setitem(sys.modules, "zstandard", fake)
    src = str(tmp_path / "a.jsonl.zst")
    with open(plain, "rb") as f:
        open(src, "wb").write(b"\x28\xb5\x2f\xfd" + gzip.compress(f.read()))
    with open(plain, "rb") as f:
        assert [line for _, line in iter_lines(src)] == f.readlines()
    assert calls and all(kw.get("read_across_frames") is True and kw.get("closefd") is False for kw in calls)


def test_damaged_stream_is_an_error_naming_the_file_and_line(tmp_path, tok_model, plain):
    whole = gzip.compress(open(plain, "rb").read())
    src = tmp_path / "cut.jsonl.gz"
    src.write_bytes(whole[:len(whole) // 2])
    with pytest.raises(PreprocessError, match=rf"input '{src}': the compressed stream is damaged or truncated "
                                              r"after line \d+ \(EOFError"):
        preprocess([str(src)], ["text"], tok_model, str(tmp_path / "o"), log=None)
    assert not [f for f in os.listdir(tmp_path) if f.startswith("o_")]
    from tools.train_tokenizer import main as train_tokenizer
    assert train_tokenizer(["--input", str(src), "--vocab-size", "50", "--output-prefix", str(tmp_path / "t")]) == 2
    assert not os.path.exists(str(tmp_path / "t.model"))


def test_partitions_need_a_plain_file(tmp_path, tok_model, plain):
    src = _compress(plain, str(tmp_path / "a.jsonl.gz"), "gz")
    with pytest.raises(PreprocessError, match=r"--partitions 2 cuts the input at byte offsets, which the "
                                              r"gzip-compressed input .* does not allow"):
        preprocess([src], ["text"], tok_model, str(tmp_path / "o"), partitions=2, log=None)


def test_tokenizer_training_reads_the_same_texts(tmp_path, plain):
    packed = _compress(plain, str(tmp_path / "a.jsonl.xz"), "xz")
    a, b = BadInputReport(), BadInputReport()
    assert list(iter_texts([packed], "text", a)) == list(iter_texts([plain], "text", b))
    assert a.counts == b.counts == {"invalid_json": 1}
