"""Merge indexed datasets preprocessed in shards into one: the engine behind ``tools/merge_datasets.py``.

A large corpus is preprocessed in parts (``tools/preprocess_data.py`` per shard of the jsonl,
e.g. a SLURM array job); merging the parts in the shards' order gives exactly the files that
preprocessing the whole input in one go writes: the ``.bin`` (tokens back to back), the
``.idx`` (lengths, pointers and document indices, offset by the parts before) and the byte
counts ``.bytes.npy``. Beside them it writes the tokenizer record ``.tokenizer.json`` (the
parts' common tokenizer, their round-trip and input counts added up, and ``merged_from``: the
parts in order) and the token id range cache ``.token_range.json``.

Every part is checked before anything is written: a valid index whose sequences are back to
back in its ``.bin`` (nothing more in the file), byte counts for each of its documents, and a
tokenizer record of the same tokenizer (type and checksum) and token dtype as the first part's,
and made the same way (:data:`HOW_FIELDS`: ``--append-eod``, the json key). Records written
before those fields existed lack them: the parts then merge only if none has them (the merged
record leaves them out: unknown), never a part that lacks them with one that has them.

Memory does not grow with the data: every file is read in chunks of :data:`CHUNK_BYTES` (never
memory-mapped as a whole), and the outputs are written as they are read. The outputs are
written under temporary names in the output directory and renamed when complete, the ``.idx``
last (no ``.idx``, no dataset); any exception (Ctrl-C, SIGTERM turned into one by the tool)
removes them.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

from dept_mega.data.atomic_file import usual_mode
from dept_mega.data.indexed import (CODE_OF_DTYPE, HEADER_SIZE, MAGIC, VERSION, IndexedFormatError, bin_path,
                                    bytes_path, idx_path, read_header, tokenizer_record_path)
from dept_mega.data.preprocess_outputs import check_output_dir
from dept_mega.data.stop_signals import raise_if_stopped
from dept_mega.data.token_range import record_token_range

#: bytes read and written at a time (the ``.bin`` copy, the ``.idx`` sections, the byte counts)
CHUNK_BYTES = 16 << 20
#: the fields of a part's tokenizer record that must agree across parts
SAME_FIELDS = ("tokenizer_type", "sha256")
#: how tools/preprocess_data.py made a part (absent in older records), with their types: must agree across parts
HOW_FIELDS = {"append_eod": bool, "json_key": str}
_ROUND_TRIP_COUNTS = ("documents", "bytes", "checked", "checked_bytes", "mismatched_documents",
                      "mismatched_bytes", "mismatched_decoded_bytes")


class MergeError(ValueError):
    """The parts cannot be merged (or an argument is wrong): nothing written."""


@dataclass(frozen=True)
class Part:
    """One input dataset, checked (:func:`check_parts`)."""
    prefix: str
    dtype: type
    sequences: int
    documents: int
    tokens: int
    bin_bytes: int
    record: dict


@dataclass
class MergeStats:
    parts: int = 0
    documents: int = 0
    sequences: int = 0
    tokens: int = 0
    bin_bytes: int = 0
    seconds: float = 0.0
    id_range: tuple[int, int] = (0, -1)
    outputs: list[str] = field(default_factory=list)


# -- checking the parts (finding them in a directory: dept_mega/data/merge_find.py)

def _read_sections(path: str, offset: int, count: int, dtype, chunk_items: int) -> Iterator[np.ndarray]:
    """``count`` items of ``dtype`` from ``path`` at byte ``offset``, in arrays of at most
    ``chunk_items`` (read, not memory-mapped: memory stays one chunk)."""
    itemsize = np.dtype(dtype).itemsize
    with open(path, "rb") as f:
        f.seek(offset)
        left = count
        while left > 0:
            n = min(left, chunk_items)
            raw = f.read(n * itemsize)
            if len(raw) != n * itemsize:
                raise IndexedFormatError(f"{path}: truncated: {len(raw)} bytes at offset {f.tell() - len(raw)}, "
                                         f"expected {n * itemsize}")
            yield np.frombuffer(raw, dtype=dtype)
            left -= n


def _chunk_items(itemsize: int) -> int:
    return max(CHUNK_BYTES // itemsize, 1)


def _check_index(prefix: str, dtype, sequences: int, docs_entries: int) -> int:
    """Token count of the part; IndexedFormatError unless its index is complete, its document
    indices run from 0 to the sequence count, its sequences lie back to back from the start of
    the ``.bin`` and the ``.bin`` holds exactly them. One chunked pass over the index."""
    ipath, bpath = idx_path(prefix), bin_path(prefix)
    need = HEADER_SIZE + 12 * sequences + 8 * docs_entries
    size = os.path.getsize(ipath)
    if size != need:
        raise IndexedFormatError(f"{ipath}: {size} bytes, but its header ({sequences} sequences, "
                                 f"{docs_entries - 1} documents) needs {need}")
    itemsize = np.dtype(dtype).itemsize
    tokens = seq = 0
    lengths_at, pointers_at = HEADER_SIZE, HEADER_SIZE + 4 * sequences
    chunk = _chunk_items(16)  # a few arrays of the chunk's length at once
    pointer_chunks = _read_sections(ipath, pointers_at, sequences, np.int64, chunk)
    for lengths in _read_sections(ipath, lengths_at, sequences, np.int32, chunk):
        if lengths.size and int(lengths.min()) < 0:
            raise IndexedFormatError(f"{ipath}: a negative sequence length")
        expected = np.empty(lengths.size, dtype=np.int64)
        expected[0] = tokens * itemsize
        np.cumsum(lengths[:-1].astype(np.int64) * itemsize, out=expected[1:])
        expected[1:] += tokens * itemsize
        pointers = next(pointer_chunks)
        if not np.array_equal(pointers, expected):
            bad = int(np.flatnonzero(pointers != expected)[0])
            raise IndexedFormatError(f"{ipath}: sequence {seq + bad} does not follow the one before "
                                     f"in the .bin (pointer {int(pointers[bad])}, expected {int(expected[bad])}): "
                                     f"a dataset with gaps or reordered sequences cannot be merged by copying")
        tokens += int(lengths.sum(dtype=np.int64))
        seq += lengths.size
    first = last = None
    for d in _read_sections(ipath, pointers_at + 8 * sequences, docs_entries, np.int64, chunk):
        if first is None:
            first = int(d[0])
        if d.size > 1 and np.any(np.diff(d) < 0):
            raise IndexedFormatError(f"{ipath}: document indices decrease")
        last = int(d[-1])
    if first != 0 or last != sequences:
        raise IndexedFormatError(f"{ipath}: document indices must run from 0 to the sequence count {sequences}, "
                                 f"got {first}..{last}")
    bin_size = os.path.getsize(bpath) if os.path.exists(bpath) else None
    if bin_size is None:
        raise IndexedFormatError(f"{bpath}: data file does not exist (index {ipath} names {sequences} sequences)")
    if bin_size != tokens * itemsize:
        raise IndexedFormatError(f"{bpath}: {bin_size} bytes, but {ipath} names {tokens} tokens of "
                                 f"{itemsize} bytes ({tokens * itemsize} bytes): the files do not belong together")
    return tokens


def _npy_header(path: str) -> tuple[int, tuple, np.dtype, bool]:
    """(data offset, shape, dtype, fortran order) of an ``.npy`` file."""
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        return f.tell(), shape, dtype, fortran


def _check_bytes(prefix: str, documents: int) -> None:
    path = bytes_path(prefix)
    if not os.path.isfile(path):
        raise MergeError(f"{path} does not exist: the part has no byte counts (bits per byte need them); write "
                         f"them with tools/add_byte_counts.py --prefix {prefix} --input SHARD.jsonl, or "
                         f"preprocess the shard again with tools/preprocess_data.py")
    try:
        _, shape, dtype, fortran = _npy_header(path)
    except (OSError, ValueError) as exc:
        raise MergeError(f"{path}: not an .npy file ({exc})") from None
    if dtype != np.dtype("<i8") or fortran or shape != (documents,):
        raise MergeError(f"{path}: {dtype} array of shape {shape}, expected int64 of shape ({documents},) "
                         f"(one byte count per document of {idx_path(prefix)})")


def _read_record(prefix: str) -> dict:
    path = tokenizer_record_path(prefix)
    if not os.path.isfile(path):
        raise MergeError(f"{path} does not exist: which tokenizer made the part is unknown, so it cannot be "
                         f"checked against the other parts; preprocess the shard with tools/preprocess_data.py, "
                         f"which writes it")
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError) as exc:
        raise MergeError(f"{path}: not a tokenizer record ({exc})") from None
    if not isinstance(record, dict):
        raise MergeError(f"{path}: not a tokenizer record (a JSON {type(record).__name__}, not an object)")
    need = {"tokenizer_type": str, "tokenizer_model": str, "sha256": str, "round_trip": dict}
    for key, kind in need.items():
        if not isinstance(record.get(key), kind):
            raise MergeError(f"{path}: field {key!r} is missing or not a {kind.__name__}: preprocess the shard again "
                             f"with tools/preprocess_data.py")
    # records written before --round-trip-every have no checked / checked_bytes / every: every
    # document was checked then (as the pre-flight reads them, dept_mega/data/checks.py)
    rt = dict(record["round_trip"])
    rt.setdefault("checked", rt.get("documents"))
    rt.setdefault("checked_bytes", rt.get("bytes"))
    rt.setdefault("every", 1)
    for key in _ROUND_TRIP_COUNTS + ("every",):
        if not _is_int(rt.get(key)):
            raise MergeError(f"{path}: field 'round_trip.{key}' is missing or not an integer")
    record["round_trip"] = rt
    for key, kind in HOW_FIELDS.items():  # absent in records written before they existed (see _check_same)
        if key in record and not isinstance(record[key], kind):
            raise MergeError(f"{path}: field {key!r} is not a {kind.__name__} ({record[key]!r})")
    src = record.get("input")
    if src is not None:  # absent in records written before it existed (see merged_record)
        if not isinstance(src, dict):
            raise MergeError(f"{path}: field 'input' is not an object")
        for key in ("lines", "skipped"):
            if not _is_int(src.get(key)):
                raise MergeError(f"{path}: field 'input.{key}' is missing or not an integer")
        if not isinstance(src.get("files"), list) or not isinstance(src.get("skipped_by_kind"), dict):
            raise MergeError(f"{path}: field 'input.files' (a list) or 'input.skipped_by_kind' (an object) is "
                             f"missing")
    return record


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _same_file(a: str, b: str) -> bool:
    """The same path (after links), or the same file under two names (a hard link)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist
        return False


def check_parts(prefixes: Sequence[str], output_prefix: str) -> list[Part]:
    """Check every part (see the module docstring) and the output prefix; :class:`MergeError`
    naming the part, the file and the field at the first problem."""
    if not prefixes:
        raise MergeError("no input parts given")
    seen: dict[str, str] = {}
    for p in prefixes:
        real = os.path.realpath(idx_path(p))
        if real in seen:
            raise MergeError(f"input {p!r} is given twice (also as {seen[real]!r}): each part is merged once")
        seen[real] = p
        if any(_same_file(f(output_prefix), f(p)) for f in (idx_path, bin_path)):
            raise MergeError(f"--output-prefix {output_prefix!r} is the input part {p!r}: the merge would "
                                 f"overwrite its own input; choose another output prefix")
    parts: list[Part] = []
    for p in prefixes:
        try:
            header = read_header(idx_path(p))
            if header.document_count < 1:
                raise IndexedFormatError(f"{idx_path(p)}: document count is 0; the document index needs at least "
                                         f"one entry")
            tokens = _check_index(p, header.dtype, header.sequence_count, header.document_count)
        except (IndexedFormatError, OSError) as exc:
            raise MergeError(f"part {p!r}: {exc}") from None
        documents = header.document_count - 1
        _check_bytes(p, documents)
        record = _read_record(p)
        if record["round_trip"]["documents"] != documents:
            raise MergeError(f"{tokenizer_record_path(p)}: field 'round_trip.documents' is "
                             f"{record['round_trip']['documents']}, but {idx_path(p)} holds {documents} documents: "
                             f"the record is not this data's (written by another run into the same prefix?)")
        part = Part(p, header.dtype, header.sequence_count, documents, tokens, os.path.getsize(bin_path(p)), record)
        if parts:
            _check_same(parts[0], part)
        parts.append(part)
    return parts


def _check_same(first: Part, part: Part) -> None:
    for key in SAME_FIELDS:
        a, b = first.record[key], part.record[key]
        if a != b:
            raise MergeError(f"{tokenizer_record_path(part.prefix)}: field {key!r} is {b!r} "
                             f"({part.record['tokenizer_model']}), but the first part's "
                             f"({tokenizer_record_path(first.prefix)}) is {a!r} ({first.record['tokenizer_model']}): "
                             f"the parts were made with different tokenizers; merge only parts made with one")
    for key in HOW_FIELDS:
        has = [p for p in (first, part) if key in p.record]
        if len(has) == 1:
            lacking = part if has[0] is first else first
            raise MergeError(f"{tokenizer_record_path(lacking.prefix)}: field {key!r} is missing (a record of an "
                             f"older tools/preprocess_data.py), but {tokenizer_record_path(has[0].prefix)} has it "
                             f"({has[0].record[key]!r}): whether the parts were made alike is unknown; preprocess "
                             f"the older parts again")
        if len(has) == 2 and first.record[key] != part.record[key]:
            what = ("with and without --append-eod (an EOS id ending each document)" if key == "append_eod"
                    else "from different --json-keys")
            raise MergeError(f"{tokenizer_record_path(part.prefix)}: field {key!r} is {part.record[key]!r}, but the "
                             f"first part's ({tokenizer_record_path(first.prefix)}) is {first.record[key]!r}: the "
                             f"parts were made {what}; merge only parts made alike")
    if part.dtype != first.dtype:
        raise MergeError(f"{idx_path(part.prefix)}: token dtype {np.dtype(part.dtype)}, but the first part's "
                         f"({idx_path(first.prefix)}) is {np.dtype(first.dtype)}: the parts cannot be merged")


# -- the merged record

def merged_record(parts: Sequence[Part]) -> dict:
    """The output's ``.tokenizer.json``: the first part's tokenizer (type, model path, checksum;
    the parts agree on type and checksum), the round-trip counts and input counts added up
    (``round_trip.every``: the parts' common K, else null; each part's is in ``merged_from``),
    ``lossless`` as tools/preprocess_data.py defines it over the sums, ``append_eod`` and
    ``json_key`` (the parts', when they have them: :data:`HOW_FIELDS`), and ``merged_from``:
    each part's prefix (absolute), documents, tokens and tokenizer path, in merge order. ``input``
    (files, lines, skipped lines by kind) is added up when every part's record has it, left out
    when none has (records older than the field), and a mixture is a :class:`MergeError`."""
    first = parts[0].record
    rt = {k: sum(p.record["round_trip"][k] for p in parts) for k in _ROUND_TRIP_COUNTS}
    everys = {p.record["round_trip"]["every"] for p in parts}
    every = everys.pop() if len(everys) == 1 else None
    if rt["mismatched_documents"]:
        lossless: Optional[bool] = False
    elif every == 0 or rt["checked"] != rt["documents"]:
        lossless = None
    else:
        lossless = True
    with_input = [p for p in parts if "input" in p.record]
    if with_input and len(with_input) != len(parts):
        lacking = next(p for p in parts if "input" not in p.record)
        raise MergeError(f"{tokenizer_record_path(lacking.prefix)}: field 'input' is missing (a record of an older "
                         f"tools/preprocess_data.py), but {tokenizer_record_path(with_input[0].prefix)} has it: the "
                         f"merged record could not count the input lines; preprocess the older parts again")
    by_kind: dict[str, int] = {}
    for p in with_input:
        for kind, n in p.record["input"]["skipped_by_kind"].items():
            by_kind[kind] = by_kind.get(kind, 0) + int(n)
    out = {"tokenizer_type": first["tokenizer_type"], "tokenizer_model": first["tokenizer_model"],
           "sha256": first["sha256"], "lossless": lossless, "round_trip": {**rt, "every": every}}
    out.update({key: first[key] for key in HOW_FIELDS if key in first})  # the parts agree (_check_same)
    if with_input:
        out["input"] = {"files": [f for p in parts for f in p.record["input"]["files"]],
                        "lines": sum(p.record["input"]["lines"] for p in parts),
                        "skipped": sum(p.record["input"]["skipped"] for p in parts),
                        "skipped_by_kind": by_kind}
    out["merged_from"] = [{"prefix": os.path.abspath(p.prefix), "documents": p.documents, "tokens": p.tokens,
                           "tokenizer_model": p.record["tokenizer_model"],
                           "round_trip_every": p.record["round_trip"]["every"]} for p in parts]
    return out


# -- writing

def _eta(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def human_size(n: int) -> str:
    """``n`` bytes in GB, or in MB below 0.1 GB."""
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


class _Progress:
    """Progress lines every ``interval`` seconds while the ``.bin`` files are copied (the bulk
    of the work): parts done, GB copied of the total, rate and ETA."""

    def __init__(self, parts: int, total: int, log: Callable[[str], None], interval: float):
        self.parts, self.total, self.log, self.interval = parts, max(total, 1), log, interval
        self.t0 = self.last = time.time()
        self.done = 0

    def update(self, parts_done: int, nbytes: int) -> None:
        self.done += nbytes
        now = time.time()
        if now - self.last < self.interval:
            return
        self.last = now
        el = max(now - self.t0, 1e-9)
        eta = el * (self.total - self.done) / self.done if self.done else float("nan")
        self.log(f"[merge] {parts_done} of {self.parts} parts done | {human_size(self.done)} of "
                 f"{human_size(self.total)} ({100.0 * self.done / self.total:5.1f}%) | "
                 f"{self.done / el / 1e6:.0f} MB/s | ETA {_eta(eta)}")


def _copy_bin(parts: Sequence[Part], out, progress: _Progress) -> tuple[int, int]:
    """Append every part's ``.bin`` to ``out`` in chunks; the smallest and largest token id."""
    lo, hi = 0, -1
    buf = bytearray(CHUNK_BYTES)
    view = memoryview(buf)
    for i, part in enumerate(parts):
        copied = 0
        with open(bin_path(part.prefix), "rb") as f:  # buffered: readinto fills buf up to the end
            while True:
                raise_if_stopped()  # a signal whose exception a finalizer dropped (stop_signals)
                n = f.readinto(buf)
                if not n:
                    break
                out.write(view[:n])
                tokens = np.frombuffer(buf, dtype=part.dtype, count=n // np.dtype(part.dtype).itemsize)
                if tokens.size:
                    c_lo, c_hi = int(tokens.min()), int(tokens.max())
                    lo, hi = (c_lo, c_hi) if hi < lo else (min(lo, c_lo), max(hi, c_hi))
                copied += n
                progress.update(i, n)
        progress.update(i + 1, 0)
        if copied != part.bin_bytes:
            raise MergeError(f"{bin_path(part.prefix)}: {copied} bytes read, {part.bin_bytes} when checked: the "
                             f"file changed during the merge")
    return lo, hi


def _write_idx(parts: Sequence[Part], out) -> None:
    """The merged ``.idx``: the header, then the parts' sequence lengths, the pointers into the
    merged ``.bin`` (each part's offset by the bytes before it) and the document indices (offset
    by the sequences before), each section streamed part by part."""
    dtype = parts[0].dtype
    itemsize = np.dtype(dtype).itemsize
    sequences = sum(p.sequences for p in parts)
    documents = sum(p.documents for p in parts)
    out.write(MAGIC)
    out.write(struct.pack("<Q", VERSION))
    out.write(struct.pack("<B", CODE_OF_DTYPE[dtype]))
    out.write(struct.pack("<Q", sequences))
    out.write(struct.pack("<Q", documents + 1))
    chunk = _chunk_items(8)
    for p in parts:
        for lengths in _read_sections(idx_path(p.prefix), HEADER_SIZE, p.sequences, np.int32, chunk):
            out.write(lengths.tobytes())
    offset = 0  # bytes of .bin before the part
    for p in parts:
        # the part's pointers lie back to back from 0 (checked), so offsetting them gives the merged ones
        for pointers in _read_sections(idx_path(p.prefix), HEADER_SIZE + 4 * p.sequences, p.sequences, np.int64,
                                       chunk):
            out.write((pointers + offset).tobytes())
        offset += p.tokens * itemsize
    before = 0  # sequences before the part
    for p in parts:
        at = HEADER_SIZE + 12 * p.sequences
        # all but the part's last entry (its sequence count, which the next part's 0 stands for)
        for d in _read_sections(idx_path(p.prefix), at, p.documents, np.int64, chunk):
            out.write((d + before).tobytes())
        before += p.sequences
    out.write(np.asarray([before], dtype=np.int64).tobytes())


def _write_bytes(parts: Sequence[Part], out) -> None:
    """The merged ``.bytes.npy``: the header ``np.save`` writes for an int64 vector of every
    part's documents, then the parts' counts copied in chunks."""
    total = sum(p.documents for p in parts)
    np.lib.format.write_array_header_1_0(out, {"descr": np.lib.format.dtype_to_descr(np.dtype("<i8")),
                                               "fortran_order": False, "shape": (total,)})
    for p in parts:
        at, _, _, _ = _npy_header(bytes_path(p.prefix))
        for counts in _read_sections(bytes_path(p.prefix), at, p.documents, np.int64, _chunk_items(8)):
            out.write(counts.tobytes())


def _check_output(output_prefix: str, parts: Sequence[Part], force: bool) -> None:
    check_output_dir(output_prefix, MergeError)
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    finals = _finals(output_prefix)
    for path in finals:
        if os.path.isdir(path):
            raise MergeError(f"--output-prefix {output_prefix!r}: output {path} is a directory")
    existing = [p for p in finals if os.path.exists(p)]
    if existing and not force:
        raise MergeError(f"--output-prefix {output_prefix!r}: {', '.join(existing)} exist(s); pass --force to "
                         f"replace the dataset there")
    need = sum(p.bin_bytes + 20 * p.sequences + 16 * p.documents for p in parts)
    free = shutil.disk_usage(out_dir).free
    if need > free:
        raise MergeError(f"--output-prefix {output_prefix!r}: the merged files need about {need / 1e9:.2f} GB, "
                         f"{out_dir} has {free / 1e9:.2f} GB free")


def _finals(prefix: str) -> list[str]:
    """The outputs in the order they are renamed into place: the ``.idx`` last, so that a merge
    stopped part way never leaves a readable dataset (nor an old one mixed with new files)."""
    return [bin_path(prefix), bytes_path(prefix), tokenizer_record_path(prefix), idx_path(prefix)]


def merge(prefixes: Sequence[str], output_prefix: str, *, force: bool = False,
          log: Optional[Callable[[str], None]] = None, progress_interval: float = 10.0) -> MergeStats:
    """Merge the datasets ``prefixes``, in that order, into ``output_prefix`` (``.bin``, ``.idx``,
    ``.bytes.npy``, ``.tokenizer.json``, ``.token_range.json``). :class:`MergeError` before
    anything is written when a part cannot be merged (:func:`check_parts`) or the output cannot
    be written; ``force`` replaces an existing dataset at ``output_prefix``."""
    log = log or (lambda msg: None)
    t0 = time.time()
    parts = check_parts(prefixes, output_prefix)
    _check_output(output_prefix, parts, force)
    record = merged_record(parts)
    total = sum(p.bin_bytes for p in parts)
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    base = os.path.basename(output_prefix)
    finals = _finals(output_prefix)
    tmps: list[str] = []
    renamed: list[str] = []
    renaming: Optional[tuple[str, str]] = None  # (tmp, final) being renamed
    try:
        for final in finals:
            ext = final[len(output_prefix):]
            fd, tmp = tempfile.mkstemp(prefix=f"{base}{ext}.", suffix=".tmp", dir=out_dir)
            os.close(fd)
            tmps.append(tmp)
        t_bin, t_bytes, t_record, t_idx = tmps
        progress = _Progress(len(parts), total, log, progress_interval)
        with open(t_bin, "wb") as f:
            lo, hi = _copy_bin(parts, f, progress)
        with open(t_idx, "wb") as f:
            _write_idx(parts, f)
        with open(t_bytes, "wb") as f:
            _write_bytes(parts, f)
        with open(t_record, "w", encoding="utf-8") as f:
            json.dump(record, f)
        if force:  # the old dataset goes first, its .idx before the rest: never a mixture with the new one
            for old in [idx_path(output_prefix)] + finals[:-1] + [output_prefix + ".token_range.json"]:
                if os.path.isfile(old):
                    os.remove(old)
        for tmp, final in zip(tmps, finals):
            usual_mode(tmp)
            renaming = (tmp, final)
            os.replace(tmp, final)
            renamed.append(final)
    except BaseException:
        # stopped between a rename and its record (a signal): the temporary name is gone
        if renaming is not None and renaming[1] not in renamed and not os.path.exists(renaming[0]):
            renamed.append(renaming[1])
        for tmp in tmps:
            if os.path.exists(tmp):
                os.remove(tmp)
        if len(renamed) < len(finals):  # stopped before the .idx: take back what was renamed
            for final in renamed:
                if os.path.exists(final):
                    os.remove(final)
        raise
    record_token_range(output_prefix, lo, hi)
    stats = MergeStats(parts=len(parts), documents=sum(p.documents for p in parts),
                       sequences=sum(p.sequences for p in parts), tokens=sum(p.tokens for p in parts),
                       bin_bytes=total, seconds=time.time() - t0, id_range=(lo, hi),
                       outputs=finals + [output_prefix + ".token_range.json"])
    return stats
