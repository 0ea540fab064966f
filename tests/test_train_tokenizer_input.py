"""tools/train_tokenizer.py's reading: over-long lines split (not dropped), the per-input byte
quota, progress lines (dept_mega/data/tokenizer_sample.py)."""
from __future__ import annotations

import os
import re

import pytest

from dept_mega.data.jsonl import BadInputReport
from dept_mega.data.tokenizer import load_tokenizer
from dept_mega.data.tokenizer_sample import collect_sentences, split_long
from tests.data_utils import run_tool, synthetic_texts, write_jsonl


@pytest.mark.parametrize("line,limit", [
    ("the quick brown fox jumps over the lazy dog " * 20, 37),
    ("日本語のテキストには空白がありません" * 30, 50),   # no whitespace: between characters
    ("mixed 日本語 text\twith tabs and émigré accents " * 15, 23),
    ("x" * 100, 4),
])
def test_split_long_keeps_the_text_under_the_limit(line, limit):
    pieces = split_long(line, limit)
    assert "".join(pieces) == line and len(pieces) > 1
    assert all(0 < len(p.encode("utf-8")) <= limit for p in pieces)
    if " " in line:  # cut before whitespace: every piece after the first starts with it
        assert all(p[0] in " \t" for p in pieces[1:])


def test_split_long_leaves_short_lines_whole():
    assert split_long("short line", 10) == ["short line"]
    assert split_long("äö", 4) == ["äö"]


def _long_docs(n: int, seed: int) -> list[str]:
    """Documents of one line each, 300-600 bytes: all over a 200-byte sentence limit."""
    return [" ".join(synthetic_texts(20, seed=seed + i))[:int(300 + 300 * (i % 7) / 7)] for i in range(n)]


def test_long_lines_are_split_and_reported_not_dropped(tmp_path):
    src = write_jsonl(str(tmp_path / "long.jsonl"), _long_docs(80, seed=3))
    r = run_tool("train_tokenizer.py", ["--input", src, "--vocab-size", "150", "--max-sentence-length", "200",
                                        "--no-byte-fallback", "--threads", "1", "--output-prefix", str(tmp_path / "t")])
    # SentencePiece would skip every one of these lines (each is over 200 bytes): no tokenizer at all
    assert r.returncode == 0, r.stderr
    m = re.search(r"(\d+) lines longer than --max-sentence-length 200 bytes were split into (\d+) sentences", r.stderr)
    assert m and int(m.group(1)) == 80 and int(m.group(2)) >= 160, r.stderr
    assert f"80 documents, {m.group(2)} sentences read" in r.stderr
    tok = load_tokenizer(str(tmp_path / "t.model"))
    assert tok.vocab_size == 150
    text = _long_docs(1, seed=3)[0]
    assert tok.unk_id not in tok.encode(text) and tok.decode(tok.encode(text)) == text


def test_max_bytes_per_input_caps_each_input(tmp_path):
    big = write_jsonl(str(tmp_path / "big.jsonl"), synthetic_texts(400, seed=1))
    small = write_jsonl(str(tmp_path / "small.jsonl"), synthetic_texts(10, seed=2))
    cap = 3000
    sample, st = collect_sentences([big, small], "text", BadInputReport(), normalization="identity",
                                   max_sentences=10_000, seed=0, max_sentence_length=8192, max_bytes_per_input=cap)
    with open(big, "rb") as f:
        lines = f.readlines()
    n, read = 0, 0
    while read < cap:  # whole lines, up to the first that reaches the cap
        read += len(lines[n])
        n += 1
    assert st.inputs[0].bytes == read and st.inputs[0].stopped
    assert st.inputs[1].stopped is False
    assert st.documents == n + 10 and len(sample) == n + 10
    r = run_tool("train_tokenizer.py", ["--input", big, small, "--vocab-size", "60", "--max-bytes-per-input", str(cap),
                                        "--no-byte-fallback", "--threads", "1", "--output-prefix", str(tmp_path / "t")])
    assert r.returncode == 0, r.stderr
    assert f"big.jsonl: stopped after its first {read} bytes (--max-bytes-per-input {cap}" in r.stderr
    assert "small.jsonl: stopped" not in r.stderr and f"{n + 10} documents" in r.stderr


def test_progress_lines_give_percent_and_eta(tmp_path):
    a = write_jsonl(str(tmp_path / "a.jsonl"), synthetic_texts(50, seed=1))
    b = write_jsonl(str(tmp_path / "b.jsonl"), synthetic_texts(50, seed=2))
    logs: list[str] = []
    collect_sentences([a, b], "text", BadInputReport(), normalization="identity", max_sentences=100, seed=0,
                      max_sentence_length=8192, log=logs.append, interval=0.0)
    assert len(logs) == 100
    pct = [float(re.match(r"\[train_tokenizer\]\s+([\d.]+)% \(", m).group(1)) for m in logs]
    half = 100.0 * os.path.getsize(a) / (os.path.getsize(a) + os.path.getsize(b))
    assert pct == sorted(pct) and pct[-1] == 100.0 and abs(pct[49] - half) <= 0.05  # input a read
    assert "input 2 of 2" in logs[-1] and "ETA 0:00:00" in logs[-1]


def test_bad_sentence_length_and_byte_quota_are_refused(tmp_path):
    src = write_jsonl(str(tmp_path / "a.jsonl"), synthetic_texts(5))
    for flag, value in (("--max-sentence-length", "3"), ("--max-bytes-per-input", "0")):
        r = run_tool("train_tokenizer.py", ["--input", src, "--vocab-size", "60", flag, value,
                                            "--output-prefix", str(tmp_path / "t")])
        assert r.returncode == 2 and f"error: {flag} {value} must be >=" in r.stderr
