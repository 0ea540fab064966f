"""``PREFIX.bytes.npy`` for a ``.bin``/``.idx`` pair that Megatron-LM's ``tools/preprocess_data.py``
made, from the jsonl it was made from (the engine behind ``tools/add_byte_counts.py``).

What Megatron-LM's preprocessing does with each input line decides which document of the
``.idx`` a line became; this module follows it exactly and refuses what it cannot follow:

* Every line is ``json.loads``-ed (the file read as UTF-8 text, universal newlines; a
  compressed file, e.g. the ``*.gz`` Megatron's ``--partitions`` reads, decompressed): a blank
  line, invalid JSON, a missing key or invalid UTF-8 stops Megatron's preprocessing. Such a
  line here is an error naming it: the data was not made from this file as it is.
* A line whose text tokenizes to nothing (an empty text) is kept by current Megatron-LM as a
  document of no sequence (``IndexedDatasetBuilder.add_document`` with no lengths), so the
  documents are the lines, one for one. Older releases skipped such documents; the document
  count then falls short of the line count and which lines were dropped cannot be told from
  the files: an error.
* ``--split-sentences`` gives a document several sequences (one per sentence); the documents
  are still the lines. The byte count is the whole text's.
* ``--partitions P`` (without ``--keep-sequential-samples``) deals the lines round-robin over P
  partitions and concatenates the partitions' outputs: document order is lines 0, P, 2P, ...,
  then 1, P+1, ... The caller says so (``partitions``); counts alone cannot tell the order.
"""
from __future__ import annotations

import bisect
import io
import json
import os
from array import array
from dataclasses import dataclass
from typing import Callable, Collection, Iterator, Optional, Sequence

import numpy as np

from dept_mega.data.compressed import STREAM_ERRORS, CompressedInputError, damaged, open_input
from dept_mega.data.indexed import IndexedDataset, bytes_path, idx_path


class ByteCountError(ValueError):
    """The jsonl and the ``.idx`` do not correspond (or an argument is wrong): nothing written."""


@dataclass
class ByteCountResult:
    path: str  # the written PREFIX.bytes.npy
    documents: int
    sequences: int
    total_bytes: int
    empty_documents: int  # documents of no token
    checked: int  # documents whose token counts were compared with a tokenizer


class InputLines:
    """What :func:`add_byte_counts` keeps of the input lines, read once in order: each line's
    UTF-8 byte count (8 bytes a line, not its text: a corpus of any size fits), how many hold
    an empty or whitespace-only text, the texts of the lines in ``keep`` (those ``--check``
    re-tokenizes) and the lines whose text has no UTF-8 form (a lone surrogate escape)."""

    def __init__(self) -> None:
        self.nbytes = array("q")
        self.blank = 0
        self.texts: dict[int, str] = {}
        self.unencodable: list[int] = []
        self._files: list[tuple[int, str]] = []  # (index of its first line, path)

    def __len__(self) -> int:
        return len(self.nbytes)

    def where(self, i: int) -> str:
        """``file:line`` of line ``i`` (0-based over all inputs)."""
        k = bisect.bisect_right([first for first, _ in self._files], i) - 1
        first, path = self._files[k]
        return f"{path}:{i - first + 1}"


def read_lines(paths: Sequence[str], key: str, keep: Collection[int] = ()) -> InputLines:
    """Every line's byte count as Megatron-LM's preprocessing reads the lines (and the texts of
    the lines in ``keep``); any line it would have stopped on is a :class:`ByteCountError`."""
    out = InputLines()
    for path in paths:
        out._files.append((len(out), path))
        for lineno, line in _text_lines(path):
            i = len(out)
            text = _text_of(line, key, f"{path}:{lineno}")
            try:
                out.nbytes.append(len(text.encode("utf-8")))
            except UnicodeEncodeError:
                out.nbytes.append(0)
                out.unencodable.append(i)
            out.blank += not text.strip()
            if i in keep:
                out.texts[i] = text
    return out


def _text_lines(path: str) -> Iterator[tuple[int, str]]:
    """(1-based line number, line) of ``path`` as Megatron reads it: UTF-8 text with universal
    newlines; a compressed file (gzip, as Megatron's ``--partitions`` reads ``*.gz``; also bzip2,
    xz, zstd) decompressed as it is read (:mod:`dept_mega.data.compressed`). What cannot be read
    is a :class:`ByteCountError` naming the file (and the line)."""
    lineno = 0
    try:
        with open_input(path) as (stream, raw):
            try:
                # bytes that are not UTF-8 come as lone surrogates (which valid UTF-8 never gives),
                # so the line that holds them is named, not the start of the block read
                for lineno, line in enumerate(io.TextIOWrapper(stream, encoding="utf-8",
                                                               errors="surrogateescape"), 1):
                    if not line.isascii() and not _is_utf8(line):
                        what = "" if stream is raw else " (decompressed)"
                        raise ByteCountError(f"{path}:{lineno}: not valid UTF-8{what}: Megatron-LM's "
                                             f"preprocess_data.py stops on such a line, so the data was not made "
                                             f"from this file as it is")
                    yield lineno, line
            except ByteCountError:
                raise
            except STREAM_ERRORS as exc:
                if stream is raw:  # a plain file's read error: below
                    raise
                raise ByteCountError(str(damaged(path, lineno, exc))) from None
    except CompressedInputError as exc:  # its module is missing
        raise ByteCountError(str(exc)) from None
    except OSError as exc:
        raise ByteCountError(f"{path}: cannot read ({exc.strerror})") from None


def _is_utf8(line: str) -> bool:
    try:
        line.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _text_of(line: str, key: str, where: str) -> str:
    stop = "Megatron-LM's preprocess_data.py stops on such a line, so the data was not made from this file as it is"
    try:
        obj = json.loads(line)
    except ValueError as exc:
        what = "a blank line" if not line.strip() else f"invalid JSON ({exc})"
        raise ByteCountError(f"{where}: {what}: {stop}") from None
    if not isinstance(obj, dict) or key not in obj:
        raise ByteCountError(f"{where}: no key {key!r} (--json-key): {stop}")
    text = obj[key]
    if isinstance(text, list):
        raise ByteCountError(f"{where}: {key!r} holds a list (sentences): this is a sentence-split file (Megatron's "
                             f"*_ss.jsonl) or pre-split input, whose documents' original texts are unknown; pass "
                             f"the original jsonl")
    if not isinstance(text, str):
        raise ByteCountError(f"{where}: {key!r} holds a {type(text).__name__}, not a string: {stop}")
    return text


def _no_utf8(where: str) -> ByteCountError:
    return ByteCountError(f"{where}: the text holds a lone surrogate escape (e.g. \"\\ud800\"), which has no "
                          f"UTF-8 bytes to count")


def document_order(n: int, partitions: int, keep_sequential: bool) -> np.ndarray:
    """The input line of each output document of Megatron's preprocessing with ``partitions``."""
    if partitions < 1:
        raise ByteCountError(f"--partitions must be >= 1, got {partitions}")
    if partitions == 1 or keep_sequential:
        return np.arange(n, dtype=np.int64)
    return np.concatenate([np.arange(p, n, partitions, dtype=np.int64) for p in range(partitions)])


def add_byte_counts(prefix: str, inputs: Sequence[str], key: str = "text", *, partitions: int = 1,
                    keep_sequential: bool = False, tokenizer=None, append_eod: bool = False, check: int = 0,
                    force: bool = False) -> ByteCountResult:
    """Write ``PREFIX.bytes.npy`` (int64, one UTF-8 byte count per document) from ``inputs``.

    ``tokenizer`` (with ``check`` > 0): re-tokenize the first ``check`` documents and compare
    their token counts (+1 for the EOD when ``append_eod`` and the text has tokens, as Megatron
    appends it) with the ``.idx``. Raises :class:`ByteCountError` on any mismatch, writing nothing."""
    out = bytes_path(prefix)
    if os.path.exists(out) and not force:
        raise ByteCountError(f"{out} exists; pass --force to replace it")
    ds = IndexedDataset(prefix)
    docs = ds.num_documents
    # the lines --check re-tokenizes: the first documents' (their order as the .idx's count says;
    # a file of another line count is refused below, before any text is used)
    keep = (set(document_order(docs, partitions, keep_sequential)[:check].tolist())
            if check > 0 and partitions >= 1 else set())
    lines = read_lines(inputs, key, keep)
    if len(lines) != docs:
        raise ByteCountError(_count_message(prefix, inputs, lines, docs))
    order = document_order(len(lines), partitions, keep_sequential)
    if lines.unencodable:  # the first one in document order, as the counts are written
        position = np.empty(docs, dtype=np.int64)
        position[order] = np.arange(docs)
        raise _no_utf8(lines.where(min(lines.unencodable, key=lambda i: position[i])))
    nbytes = np.frombuffer(lines.nbytes, dtype=np.int64)[order]
    _, lengths = ds.document_token_ranges()
    checked = 0
    if check > 0:
        if tokenizer is None:
            raise ByteCountError("--check needs --tokenizer-model")
        per_doc = np.diff(np.asarray(ds.document_indices, dtype=np.int64))
        if np.any(per_doc > 1):
            raise ByteCountError(f"{idx_path(prefix)}: {len(ds)} sequences in {docs} documents (Megatron's "
                                 f"--split-sentences): each sentence was tokenized on its own after NLTK's "
                                 f"sentence splitter, which this tool does not run, so --check cannot compare "
                                 f"token counts; leave --check out")
        checked = _check_tokens(prefix, lines, order, lengths, tokenizer, append_eod, check)
    tmp = out + ".tmp"
    with open(tmp, "wb") as f:
        np.save(f, nbytes)
    os.replace(tmp, out)
    return ByteCountResult(out, docs, len(ds), int(nbytes.sum()), int(np.count_nonzero(lengths == 0)), checked)


def _count_message(prefix: str, inputs: Sequence[str], lines: InputLines, docs: int) -> str:
    blank = lines.blank
    head = (f"{', '.join(inputs)} has {len(lines)} lines but {idx_path(prefix)} holds {docs} documents: "
            f"Megatron-LM's preprocessing makes one document of every line")
    if len(lines) > docs:
        return (f"{head}; {blank} lines hold an empty or whitespace-only text, and older Megatron-LM releases "
                f"skipped documents that tokenize to nothing (current ones keep them as documents of no "
                f"sequence). Which lines were dropped cannot be told from the files, so no byte counts are "
                f"written: is this the file the data was made from (several files: in the order preprocessing "
                f"read them)? Otherwise tokenize it again with tools/preprocess_data.py, which writes the byte "
                f"counts")
    return (f"{head}: the data was made from more input than this (another file, or several files: pass them "
            f"all, in the order preprocessing read them)")


def _check_tokens(prefix: str, lines: InputLines, order: np.ndarray, lengths: np.ndarray, tokenizer,
                  append_eod: bool, check: int) -> int:
    n = min(check, len(order))
    texts = [lines.texts[int(order[d])] for d in range(n)]
    ids = tokenizer.encode_batch(texts)
    for d, (t, x) in enumerate(zip(texts, ids)):
        want = len(x) + (1 if append_eod and len(x) else 0)
        if want != int(lengths[d]):
            hint = ""
            if int(lengths[d]) - want == 1 and not append_eod:
                hint = " (one more: was Megatron's preprocessing run with --append-eod? then pass it)"
            elif want - int(lengths[d]) == 1 and append_eod:
                hint = " (one fewer: was it run without --append-eod? then leave it out)"
            raise ByteCountError(f"{idx_path(prefix)}: document {d} holds {int(lengths[d])} tokens, but "
                                 f"{lines.where(int(order[d]))} tokenizes to {want}{hint}: not the tokenizer, "
                                 f"file, line order (--partitions) or --append-eod the data was made with; "
                                 f"nothing written")
    return n


def summary(res: ByteCountResult, log: Callable[[str], None], prefix: str) -> None:
    log(f"[add_byte_counts] wrote {res.path}: {res.documents} documents, {res.total_bytes} UTF-8 bytes "
        f"(matched to {idx_path(prefix)} line by line)")
    if res.sequences != res.documents:
        log(f"[add_byte_counts] note: {res.sequences} sequences in {res.documents} documents (--split-sentences): "
            f"byte counts are per document, of the whole text, including any whitespace the sentence splitter "
            f"left out of the tokens")
    if res.empty_documents:
        log(f"[add_byte_counts] note: {res.empty_documents} documents hold no token (empty texts)")
    if res.checked:
        log(f"[add_byte_counts] checked: the first {res.checked} documents re-tokenize to the .idx's token counts")
    else:
        log("[add_byte_counts] token counts not checked (--tokenizer-model with --check N compares them)")


def open_for_check(tokenizer_type: Optional[str], model: Optional[str]):
    if model is None:
        return None
    from dept_mega.data.tokenizer import TokenizerError, open_tokenizer
    try:
        return open_tokenizer(tokenizer_type or "SentencePieceTokenizer", model)
    except (TokenizerError, OSError) as exc:
        raise ByteCountError(f"--tokenizer-model {model}: {exc}") from None
