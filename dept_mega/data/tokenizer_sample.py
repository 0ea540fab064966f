"""The training sentences of ``tools/train_tokenizer.py``: read from jsonl inputs, split, sampled.

A document's lines are its sentences (see :func:`training_line`). SentencePiece skips any
sentence longer than its ``max_sentence_length`` (in UTF-8 bytes) with only a log line, which
would silently take weight away from text without line breaks (one long paragraph, minified
code, CJK text: 8192 bytes are about 2700 CJK characters). So a longer line is cut into pieces
under the limit (:func:`split_long`) at whitespace where it has some, else between
characters; the pieces keep the line's text and so its weight in the sample, and are counted.

The sample is a seeded reservoir of at most ``max_sentences`` of all the sentences read, so
each input weighs in proportion to the sentences (about: the bytes) read from it. With
``max_bytes_per_input`` N, reading an input stops after its first N bytes (decompressed,
whole lines), which caps what one large input (one big language) can take of the sample.
"""
from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from .compressed import STREAM_ERRORS, damaged, open_input
from .jsonl import BadInputReport, parse_line

_WHITESPACE = b" \t\r\f\v"


def training_line(line: str, normalization: str) -> str:
    """A training sentence from one line of a document (its "\\n" already split off; "" to
    skip it): identity keeps the line as encoding will see it (indentation, trailing spaces,
    a CRLF's "\\r"); nmt_nfkc strips it, as SentencePiece's own normalization would."""
    if normalization == "nmt_nfkc":
        return line.strip()
    return line if line.strip() else ""


def split_long(line: str, limit: int) -> list[str]:
    """``line`` cut into pieces of at most ``limit`` UTF-8 bytes, each cut just before the last
    whitespace of the piece (the whitespace starts the next piece, where SentencePiece's pieces
    carry it), or, in a stretch without whitespace, between two characters. Concatenated, the
    pieces are ``line``. A line within the limit is returned whole."""
    data = line.encode("utf-8")
    if len(data) <= limit:
        return [line]
    out = []
    pos = 0
    while len(data) - pos > limit:
        end = pos + limit
        cut = max(data.rfind(bytes([c]), pos + 1, end + 1) for c in _WHITESPACE)
        if cut <= pos:  # no whitespace: between characters (not before a UTF-8 continuation byte)
            cut = end
            while cut > pos + 1 and (data[cut] & 0xC0) == 0x80:
                cut -= 1
        out.append(data[pos:cut].decode("utf-8"))
        pos = cut
    out.append(data[pos:].decode("utf-8"))
    return out


@dataclass
class InputRead:
    """What was read of one input: ``bytes`` (decompressed, whole lines), ``position`` (on
    disk), ``size`` (on disk), and whether reading ``stopped`` at the byte cap before its end."""
    path: str
    size: int
    bytes: int = 0
    position: int = 0
    stopped: bool = False


@dataclass
class SampleStats:
    documents: int = 0
    sentences: int = 0        # all sentences read (pieces of split lines each count)
    long_lines: int = 0       # lines over the limit, split
    long_pieces: int = 0      # the pieces they were split into
    inputs: list[InputRead] = field(default_factory=list)


def _progress(inputs: Sequence[InputRead], cap: Optional[int]) -> tuple[float, float]:
    """(done, total) in bytes on disk: each input weighs its size (with a cap, at most the
    cap: the part that will be read) and counts as done the larger of its share read on disk
    and its share of the cap."""
    done = total = 0.0
    for r in inputs:
        w = float(r.size if cap is None else min(r.size, cap))
        frac = r.position / r.size if r.size else 1.0
        if cap is not None:
            frac = max(frac, r.bytes / cap)
        total += w
        done += w * min(frac, 1.0)
    return done, total


def _eta(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def collect_sentences(paths: Sequence[str], key: str, report: BadInputReport, *, normalization: str,
                      max_sentences: int, seed: int, max_sentence_length: int,
                      max_bytes_per_input: Optional[int] = None,
                      log: Optional[Callable[[str], None]] = None, interval: float = 5.0
                      ) -> tuple[list[str], SampleStats]:
    """The seeded reservoir sample of at most ``max_sentences`` training sentences of ``paths``
    (module docstring) and what was read. Bad lines go to ``report``; a damaged compressed
    stream raises CompressedInputError. ``log``: progress lines (percent and ETA) every
    ``interval`` seconds."""
    rng = random.Random(seed)
    sample: list[str] = []
    st = SampleStats(inputs=[InputRead(p, os.path.getsize(p)) for p in paths])
    t0 = last = time.time()

    def add(sentence: str) -> None:
        st.sentences += 1
        if len(sample) < max_sentences:
            sample.append(sentence)
        else:
            j = rng.randrange(st.sentences)
            if j < max_sentences:
                sample[j] = sentence

    for k, rd in enumerate(st.inputs):
        lineno = 0
        with open_input(rd.path) as (stream, raw):
            lines = iter(stream)
            while True:
                try:
                    line = next(lines, None)
                except STREAM_ERRORS as exc:
                    if stream is raw:  # a plain file's read error is not a damaged stream
                        raise
                    raise damaged(rd.path, lineno, exc) from None
                if line is None:
                    break
                if max_bytes_per_input is not None and rd.bytes >= max_bytes_per_input:
                    rd.stopped = True
                    break
                lineno += 1
                rd.bytes += len(line)
                texts = parse_line(line, (key,), f"{rd.path}:{lineno}", report)
                if texts is None:
                    continue
                st.documents += 1
                for text_line in texts[0].split("\n"):
                    sentence = training_line(text_line, normalization)
                    if not sentence:
                        continue
                    pieces = split_long(sentence, max_sentence_length)
                    if len(pieces) > 1:
                        st.long_lines += 1
                        st.long_pieces += len(pieces)
                    for piece in pieces:
                        piece = training_line(piece, normalization)
                        if piece:
                            add(piece)
                now = time.time()
                if log is not None and now - last >= interval:
                    last = now
                    rd.position = raw.tell()
                    done, total = _progress(st.inputs, max_bytes_per_input)
                    el = now - t0
                    eta = el * (total - done) / done if done else float("nan")
                    log(f"[train_tokenizer] {100.0 * done / max(total, 1.0):5.1f}% ({done / 1e6:.1f} of "
                        f"{total / 1e6:.1f} MB) | input {k + 1} of {len(st.inputs)} | {st.documents} documents, "
                        f"{st.sentences} sentences | {st.documents / max(el, 1e-9):.0f} docs/s | ETA {_eta(eta)}")
            rd.position = raw.tell()
    return sample, st
