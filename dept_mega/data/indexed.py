"""Megatron-LM's indexed dataset (``.bin`` + ``.idx``), read and written byte for byte.

Layout of ``PREFIX.idx`` (little endian)::

    b"MMIDIDX\\x00\\x00"        9 bytes  magic
    version                    u64      1
    dtype code                 u8       uint8=1 int8=2 int16=3 int32=4 int64=5 float64=6
                                        float32=7 uint16=8
    sequence count  S          u64
    document count  N+1        u64      (the length of the document-index array)
    sequence lengths           S  x int32   (tokens)
    sequence pointers          S  x int64   (byte offsets into .bin)
    document indices           N+1 x int64  (first sequence of each document; starts at 0,
                                             ends at S)

``PREFIX.bin`` holds the tokens of all sequences back to back in the dtype above. Our
preprocessing writes one sequence per document. Beside them we may write
``PREFIX.bytes.npy`` (int64, one entry per document): the UTF-8 byte count of each
document's text, used for bits-per-byte. It is our addition; Megatron ignores it.
"""
from __future__ import annotations

import array
import os
import shutil
import struct
from dataclasses import dataclass
from typing import Iterable, Optional

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = 9 + 8 + 1 + 8 + 8  # 34 bytes

DTYPE_CODES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODE_OF_DTYPE: dict[type, int] = {v: k for k, v in DTYPE_CODES.items()}


class IndexedFormatError(ValueError):
    """A ``.bin``/``.idx`` pair that is not a valid Megatron indexed dataset."""


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def bytes_path(prefix: str) -> str:
    """Per-document UTF-8 byte counts (int64 ``.npy``), our addition beside the index."""
    return prefix + ".bytes.npy"


def tokenizer_record_path(prefix: str) -> str:
    """Which tokenizer made the data (JSON: type, model path, sha256 of the model file), written
    by tools/preprocess_data.py beside the index so that a config naming another tokenizer of
    the same size is caught (dept_mega/data/checks.py); older data has none."""
    return prefix + ".tokenizer.json"


def optimal_dtype(vocab_size: int) -> type:
    """Megatron's rule: uint16 when the vocabulary has fewer than 65500 ids, else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def dtype_code(dtype) -> int:
    dt = np.dtype(dtype).type
    if dt not in CODE_OF_DTYPE:
        raise ValueError(f"dtype {np.dtype(dtype)} has no Megatron indexed-dataset code")
    return CODE_OF_DTYPE[dt]


@dataclass(frozen=True)
class IndexHeader:
    dtype: type
    sequence_count: int
    document_count: int  # entries of the document-index array (= documents + 1)


def read_header(path: str) -> IndexHeader:
    """Parse and check the fixed 34-byte header of an ``.idx`` file."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_SIZE)
    except FileNotFoundError:
        raise IndexedFormatError(f"{path}: index file does not exist") from None
    if len(head) < 9 or head[:9] != MAGIC:
        if len(head) < 9 and MAGIC.startswith(head):
            raise IndexedFormatError(f"{path}: truncated index file ({len(head)} bytes, header needs {HEADER_SIZE})")
        raise IndexedFormatError(f"{path}: wrong magic {head[:9]!r}, expected {MAGIC!r} "
                                 "(not a Megatron indexed dataset)")
    if len(head) < HEADER_SIZE:
        raise IndexedFormatError(f"{path}: truncated index file ({len(head)} bytes, header needs {HEADER_SIZE})")
    (version,) = struct.unpack("<Q", head[9:17])
    if version != VERSION:
        raise IndexedFormatError(f"{path}: unsupported index version {version}, expected {VERSION}")
    code = head[17]
    if code not in DTYPE_CODES:
        raise IndexedFormatError(f"{path}: unknown dtype code {code}")
    seq_count, doc_count = struct.unpack("<QQ", head[18:34])
    return IndexHeader(DTYPE_CODES[code], seq_count, doc_count)


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class IndexedDataset:
    """Memory-mapped reader of a Megatron indexed dataset.

    ``ds[i]`` is sequence ``i`` as a numpy array (a view into the memory map); ``tokens`` is
    the whole ``.bin`` as one flat array. Document-level helpers give each document's token
    range, which is what :class:`dept_mega.data.gpt_dataset.GPTDataset` uses.
    """

    def __init__(self, prefix: str):
        self.prefix = prefix
        ipath, bpath = idx_path(prefix), bin_path(prefix)
        header = read_header(ipath)
        self.dtype = header.dtype
        self.itemsize = np.dtype(self.dtype).itemsize
        s, d = header.sequence_count, header.document_count
        if d < 1:
            raise IndexedFormatError(f"{ipath}: document count is 0; the document index needs at least one entry")
        need = HEADER_SIZE + 4 * s + 8 * s + 8 * d
        size = os.path.getsize(ipath)
        if size < need:
            raise IndexedFormatError(f"{ipath}: truncated index file: {size} bytes, the header "
                                     f"({s} sequences, {d - 1} documents) needs {need}")
        before = os.stat(ipath)
        idx_map = np.memmap(ipath, mode="r", dtype=np.uint8)
        after = os.stat(ipath)
        #: the mapped ``.idx`` file's identity (device, inode, size, mtime), or None if it was
        #: replaced while being opened: what per-file results (``gpt_dataset.data_hash``) may be kept by
        self.idx_identity = (_identity(after) if _identity(before) == _identity(after) else None)
        off = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(idx_map, dtype=np.int32, count=s, offset=off)
        off += 4 * s
        self.sequence_pointers = np.frombuffer(idx_map, dtype=np.int64, count=s, offset=off)
        off += 8 * s
        self.document_indices = np.frombuffer(idx_map, dtype=np.int64, count=d, offset=off)
        self._idx_map = idx_map
        if self.document_indices[0] != 0 or self.document_indices[-1] != s:
            raise IndexedFormatError(f"{ipath}: document indices must run from 0 to the sequence count {s}, "
                                     f"got {int(self.document_indices[0])}..{int(self.document_indices[-1])}")
        if not os.path.exists(bpath):
            raise IndexedFormatError(f"{bpath}: data file does not exist (index {ipath} names {s} sequences)")
        bin_size = os.path.getsize(bpath)
        if s:
            end = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.itemsize
        else:
            end = 0
        if bin_size < end:
            raise IndexedFormatError(f"{bpath}: data file is shorter than its index says: {bin_size} bytes, "
                                     f"index {ipath} needs {end}")
        if bin_size % self.itemsize:
            raise IndexedFormatError(f"{bpath}: size {bin_size} is not a multiple of the token size {self.itemsize}")
        self.bin_bytes = bin_size
        if bin_size:
            self.tokens = np.memmap(bpath, mode="r", dtype=self.dtype)
        else:
            self.tokens = np.zeros(0, dtype=self.dtype)

    # -- sequences
    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        if not -len(self) <= i < len(self):
            raise IndexError(f"sequence {i} out of range for {len(self)} sequences in {self.prefix}")
        start = int(self.sequence_pointers[i]) // self.itemsize
        return self.tokens[start:start + int(self.sequence_lengths[i])]

    def get(self, i: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        seq = self[i]
        end = len(seq) if length is None else offset + length
        return seq[offset:end]

    # -- documents
    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def document_token_ranges(self) -> tuple[np.ndarray, np.ndarray]:
        """(start token, length) of every document, as int64 arrays, assuming the sequences
        are back to back in the ``.bin`` (true for every file Megatron or we write)."""
        seq_start = np.zeros(len(self) + 1, dtype=np.int64)
        np.cumsum(self.sequence_lengths, out=seq_start[1:])
        starts = seq_start[self.document_indices[:-1]]
        lengths = seq_start[self.document_indices[1:]] - starts
        return starts, lengths

    def document(self, d: int) -> np.ndarray:
        s0, s1 = int(self.document_indices[d]), int(self.document_indices[d + 1])
        if s1 == s0:
            return self.tokens[0:0]
        start = int(self.sequence_pointers[s0]) // self.itemsize
        n = int(self.sequence_lengths[s0:s1].sum(dtype=np.int64))
        return self.tokens[start:start + n]

    def document_bytes(self) -> Optional[np.ndarray]:
        """Per-document UTF-8 byte counts from ``PREFIX.bytes.npy``, or None when absent."""
        path = bytes_path(self.prefix)
        if not os.path.exists(path):
            return None
        arr = np.load(path, mmap_mode="r")
        if arr.ndim != 1 or len(arr) != self.num_documents:
            raise IndexedFormatError(f"{path}: {arr.shape} byte counts for {self.num_documents} documents")
        return arr


class IndexedDatasetBuilder:
    """Writes ``PREFIX.bin``/``PREFIX.idx`` (and ``PREFIX.bytes.npy`` when byte counts are
    given), one sequence per document. Files are written under temporary names and renamed
    by :meth:`finalize`, so a crash never leaves a half-written dataset under the real name.
    Memory: 4 bytes per document (lengths) + 8 with byte counts; tokens stream to disk.
    """

    def __init__(self, prefix: str, dtype=np.uint16, with_bytes: bool = True):
        self.prefix = prefix
        self.dtype = np.dtype(dtype).type
        dtype_code(self.dtype)  # check it has a code
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        self._tmp_bin = bin_path(prefix) + ".tmp"
        self._bin = open(self._tmp_bin, "wb")
        self._lengths = array.array("i")
        self._bytes: Optional[array.array] = array.array("q") if with_bytes else None
        self._closed = False

    @property
    def num_documents(self) -> int:
        return len(self._lengths)

    def add_document(self, tokens: Iterable[int] | np.ndarray, nbytes: Optional[int] = None) -> None:
        arr = np.asarray(tokens, dtype=self.dtype)
        self._bin.write(arr.tobytes(order="C"))
        self._lengths.append(int(arr.size))
        if self._bytes is not None:
            if nbytes is None:
                raise ValueError("this builder records byte counts: pass nbytes= for every document")
            self._bytes.append(int(nbytes))

    def add_documents(self, flat_tokens: np.ndarray, lengths: np.ndarray,
                      nbytes: Optional[np.ndarray] = None) -> None:
        """Append several documents at once: their tokens back to back and their lengths."""
        flat = np.asarray(flat_tokens, dtype=self.dtype)
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != flat.size:
            raise ValueError(f"lengths add up to {int(lengths.sum())} tokens, got {flat.size}")
        self._bin.write(flat.tobytes(order="C"))
        _append(self._lengths, lengths)
        if self._bytes is not None:
            if nbytes is None or len(nbytes) != len(lengths):
                raise ValueError("this builder records byte counts: pass one per document")
            _append(self._bytes, nbytes)

    def add_index(self, prefix: str) -> None:
        """Append another indexed dataset (same dtype) — used to merge partitions."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise IndexedFormatError(f"{prefix}: dtype {np.dtype(other.dtype)} differs from the "
                                     f"builder's {np.dtype(self.dtype)}")
        _, doc_lengths = other.document_token_ranges()
        _append(self._lengths, doc_lengths)
        if self._bytes is not None:
            nb = other.document_bytes()
            if nb is None:
                raise IndexedFormatError(f"{bytes_path(prefix)}: missing byte counts needed for the merge")
            _append(self._bytes, nb)
        with open(bin_path(prefix), "rb") as f:
            shutil.copyfileobj(f, self._bin, length=16 << 20)

    def abort(self) -> None:
        """Drop everything written so far (the temporary files of a finalize cut short too)."""
        if not self._closed:
            self._bin.close()
            self._closed = True
        for p in (self._tmp_bin, idx_path(self.prefix) + ".tmp", bytes_path(self.prefix) + ".tmp"):
            if os.path.exists(p):
                os.remove(p)

    def finalize(self) -> None:
        self._bin.close()
        self._closed = True
        lengths = np.frombuffer(self._lengths, dtype=np.int32) if len(self._lengths) else np.zeros(0, np.int32)
        write_index(idx_path(self.prefix) + ".tmp", self.dtype, lengths)
        if self._bytes is not None:
            nb = np.frombuffer(self._bytes, dtype=np.int64) if len(self._bytes) else np.zeros(0, np.int64)
            tmp = bytes_path(self.prefix) + ".tmp"
            with open(tmp, "wb") as f:
                np.save(f, nb)
            os.replace(tmp, bytes_path(self.prefix))
        os.replace(self._tmp_bin, bin_path(self.prefix))
        os.replace(idx_path(self.prefix) + ".tmp", idx_path(self.prefix))


def _append(arr: array.array, values) -> None:
    """Append ``values`` to ``arr`` through their bytes, as ``arr``'s item type (``i``: int32,
    ``q``: int64): no Python int per item, so memory stays the array's 4 or 8 bytes an item."""
    items = np.ascontiguousarray(values, dtype=np.dtype(arr.typecode))
    arr.frombytes(memoryview(items).cast("B"))  # frombytes takes bytes only: the items' bytes, not copied


def write_index(path: str, dtype, lengths: np.ndarray,
                document_indices: Optional[np.ndarray] = None) -> None:
    """Write an ``.idx`` file for sequences of ``lengths`` tokens stored back to back.
    ``document_indices`` defaults to one sequence per document (0..S)."""
    lengths = np.asarray(lengths, dtype=np.int32)
    s = len(lengths)
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(s, dtype=np.int64)
    if s > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * itemsize, out=pointers[1:])
    if document_indices is None:
        document_indices = np.arange(s + 1, dtype=np.int64)
    document_indices = np.asarray(document_indices, dtype=np.int64)
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", VERSION))
        f.write(struct.pack("<B", dtype_code(dtype)))
        f.write(struct.pack("<Q", s))
        f.write(struct.pack("<Q", len(document_indices)))
        f.write(lengths.tobytes(order="C"))
        f.write(pointers.tobytes(order="C"))
        f.write(document_indices.tobytes(order="C"))
