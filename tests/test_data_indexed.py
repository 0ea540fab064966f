"""Megatron indexed format: round trips, byte-level interop with megatron-core, corruption."""
from __future__ import annotations

import os
import struct

import numpy as np
import pytest
import torch

from dept_mega.data.indexed import (MAGIC, IndexedDataset, IndexedDatasetBuilder, IndexedFormatError,
                                    optimal_dtype)
from tests.data_utils import megatron_indexed, numbered_docs, write_docs



def test_round_trip_and_layout(tmp_path):
    docs = [[5, 6, 7], [1], [9, 9, 9, 9, 2], [3, 4]]
    prefix = write_docs(str(tmp_path / "d"), docs, nbytes=[10, 1, 20, 5])
    ds = IndexedDataset(prefix)
    assert len(ds) == 4 and ds.num_documents == 4 and ds.num_tokens == 11
    assert ds.dtype == np.uint16
    for i, d in enumerate(docs):
        assert ds[i].tolist() == d and ds.document(i).tolist() == d
    assert ds.document_bytes().tolist() == [10, 1, 20, 5]
    starts, lengths = ds.document_token_ranges()
    assert starts.tolist() == [0, 3, 4, 9] and lengths.tolist() == [3, 1, 5, 2]
    # the exact byte layout of the issue
    raw = open(prefix + ".idx", "rb").read()
    assert raw[:9] == MAGIC
    assert struct.unpack("<Q", raw[9:17])[0] == 1
    assert raw[17] == 8  # uint16
    assert struct.unpack("<QQ", raw[18:34]) == (4, 5)  # sequences, document-index entries
    lens = np.frombuffer(raw, np.int32, 4, 34)
    ptrs = np.frombuffer(raw, np.int64, 4, 34 + 16)
    didx = np.frombuffer(raw, np.int64, 5, 34 + 16 + 32)
    assert lens.tolist() == [3, 1, 5, 2] and ptrs.tolist() == [0, 6, 8, 18] and didx.tolist() == [0, 1, 2, 3, 4]
    assert len(raw) == 34 + 16 + 32 + 40
    assert open(prefix + ".bin", "rb").read() == np.array(sum(docs, []), np.uint16).tobytes()


def test_optimal_dtype():
    assert optimal_dtype(8000) == np.uint16 and optimal_dtype(65499) == np.uint16
    assert optimal_dtype(65500) == np.int32 and optimal_dtype(200_000) == np.int32


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_ours_equals_megatron_bytes_and_reads_both_ways(tmp_path, dtype):
    mcore = megatron_indexed()
    docs = numbered_docs(30, seed=3)
    if dtype == np.int32:
        docs = [[t + 70000 for t in d] for d in docs]  # ids beyond uint16
    ours = write_docs(str(tmp_path / "ours"), docs, dtype=dtype)
    theirs = str(tmp_path / "theirs")
    b = mcore.IndexedDatasetBuilder(theirs + ".bin", dtype=dtype)
    for d in docs:
        b.add_document(d, [len(d)])
    b.finalize(theirs + ".idx")
    for ext in (".bin", ".idx"):
        assert open(ours + ext, "rb").read() == open(theirs + ext, "rb").read(), ext
    m = mcore.IndexedDataset(ours)  # megatron reads ours
    assert len(m) == len(docs) and m.index.dtype == dtype
    for i, d in enumerate(docs):
        assert m[i].tolist() == d
    o = IndexedDataset(theirs)  # we read theirs
    for i, d in enumerate(docs):
        assert o[i].tolist() == d


def test_reads_megatron_multi_sequence_documents(tmp_path):
    mcore = megatron_indexed()
    """Megatron files may hold several sequences (sentences) per document."""
    theirs = str(tmp_path / "multi")
    b = mcore.IndexedDatasetBuilder(theirs + ".bin", dtype=np.uint16)
    b.add_document([1, 2, 3, 4, 5], [2, 3])
    b.add_document([6], [1])
    b.add_item(torch.tensor([7, 8]))
    b.add_item(torch.tensor([9]))
    b.end_document()
    b.finalize(theirs + ".idx")
    ds = IndexedDataset(theirs)
    assert len(ds) == 5 and ds.num_documents == 3
    assert [ds.document(d).tolist() for d in range(3)] == [[1, 2, 3, 4, 5], [6], [7, 8, 9]]
    assert ds[1].tolist() == [3, 4, 5]
    assert ds.document_bytes() is None


def test_merge_add_index(tmp_path):
    a = write_docs(str(tmp_path / "a"), [[1, 2], [3]], nbytes=[4, 2])
    b = write_docs(str(tmp_path / "b"), [[4, 5, 6]], nbytes=[7])
    m = IndexedDatasetBuilder(str(tmp_path / "m"), np.uint16)
    m.add_index(a)
    m.add_index(b)
    m.finalize()
    ds = IndexedDataset(str(tmp_path / "m"))
    assert [ds[i].tolist() for i in range(3)] == [[1, 2], [3], [4, 5, 6]]
    assert ds.document_bytes().tolist() == [4, 2, 7]
    with pytest.raises(IndexedFormatError, match="dtype"):
        IndexedDatasetBuilder(str(tmp_path / "x"), np.int32).add_index(a)


def test_add_index_and_add_documents_append_exactly_without_python_ints(tmp_path):
    """The lengths and byte counts appended through their bytes (no Python int per document):
    exact values, byte counts past 2**31 included; a part of 2M documents peaks far below the
    ~70 bytes a document that lists of Python ints took (the 16 MB copy buffer is ~8 of it)."""
    import tracemalloc
    from dept_mega.data.indexed import bytes_path, write_index
    big = [2**31 + 5, 2**40, 0]
    a = write_docs(str(tmp_path / "a"), [[1, 2], [3], []], nbytes=big)
    m = IndexedDatasetBuilder(str(tmp_path / "m"), np.uint16)
    m.add_index(a)
    m.add_documents(np.array([7, 8, 9], np.uint16), np.array([2, 0, 1]), np.array([3, 2**33, 1]))
    m.add_index(a)
    m.finalize()
    ds = IndexedDataset(str(tmp_path / "m"))
    assert [ds.document(i).tolist() for i in range(ds.num_documents)] == [[1, 2], [3], [], [7, 8], [], [9],
                                                                         [1, 2], [3], []]
    assert ds.document_bytes().tolist() == big + [3, 2**33, 1] + big
    n = 2_000_000
    part = str(tmp_path / "part")
    write_index(part + ".idx", np.uint16, np.zeros(n, np.int32))
    open(part + ".bin", "wb").close()
    np.save(bytes_path(part), np.arange(10**6, 10**6 + n, dtype=np.int64))
    b = IndexedDatasetBuilder(str(tmp_path / "big"), np.uint16)
    tracemalloc.start()
    try:
        b.add_index(part)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        b.abort()
    assert peak / n < 50, f"{peak / n:.1f} bytes a document"


def _corrupt(prefix, fn):
    raw = bytearray(open(prefix + ".idx", "rb").read())
    out = fn(raw)
    open(prefix + ".idx", "wb").write(bytes(out))


@pytest.mark.parametrize("case,match", [
    ("magic", "wrong magic"),
    ("version", "version 2"),
    ("dtype", "dtype code 99"),
    ("truncated_header", "truncated"),
    ("truncated_arrays", "truncated"),
    ("short_bin", "shorter than its index"),
    ("missing_bin", "does not exist"),
    ("missing_idx", "does not exist"),
    ("bad_doc_index", "document indices"),
])
def test_header_corruption_errors_name_the_file(tmp_path, case, match):
    prefix = write_docs(str(tmp_path / "c"), [[1, 2, 3], [4, 5]])
    if case == "magic":
        _corrupt(prefix, lambda r: b"NOTMEGA\x00\x00" + r[9:])
    elif case == "version":
        _corrupt(prefix, lambda r: r[:9] + struct.pack("<Q", 2) + r[17:])
    elif case == "dtype":
        _corrupt(prefix, lambda r: r[:17] + bytes([99]) + r[18:])
    elif case == "truncated_header":
        _corrupt(prefix, lambda r: r[:20])
    elif case == "truncated_arrays":
        _corrupt(prefix, lambda r: r[:-5])
    elif case == "short_bin":
        with open(prefix + ".bin", "r+b") as f:
            f.truncate(6)
    elif case == "missing_bin":
        os.remove(prefix + ".bin")
    elif case == "missing_idx":
        os.remove(prefix + ".idx")
    elif case == "bad_doc_index":
        _corrupt(prefix, lambda r: r[:-8] + struct.pack("<q", 5))
    with pytest.raises(IndexedFormatError, match=match) as exc:
        IndexedDataset(prefix)
    assert str(tmp_path / "c") in str(exc.value)


def test_bytes_file_mismatch_is_an_error(tmp_path):
    prefix = write_docs(str(tmp_path / "d"), [[1], [2]], nbytes=[1, 1])
    np.save(prefix + ".bytes.npy", np.array([1, 2, 3], np.int64))
    with pytest.raises(IndexedFormatError, match="bytes.npy"):
        IndexedDataset(prefix).document_bytes()


def test_builder_abort_leaves_nothing(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "z"), np.uint16)
    b.add_document([1, 2], 3)
    b.abort()
    assert os.listdir(tmp_path) == []
