"""tools/add_byte_counts.py: PREFIX.bytes.npy for data that Megatron-LM's preprocess_data.py made,
written by megatron-core's own IndexedDatasetBuilder here (the tests skip without it)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from dept_mega.data.byte_counts import ByteCountError, add_byte_counts
from dept_mega.data.indexed import IndexedDataset, bytes_path
from dept_mega.data.tokenizer import Tokenizer
from tests.data_utils import (megatron_indexed, run_tool, synthetic_texts, train_tiny_tokenizer, write_docs,
                              write_jsonl)

# an empty text (Megatron keeps it as a document of no sequence) and multi-byte characters
TEXTS = synthetic_texts(12, seed=4)[:5] + [""] + ["river é stone — cloud 火"] + synthetic_texts(12, seed=5)[:5]


@pytest.fixture(scope="module")
def tok_model(tmp_path_factory):
    return train_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")))


def megatron_data(prefix: str, texts, model: str, append_eod: bool = True, order=None, sentences=False) -> str:
    """What Megatron-LM's encode + IndexedDatasetBuilder write for ``texts`` (in ``order``)."""
    mcore = megatron_indexed()
    tok = Tokenizer(model)
    b = mcore.IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for i in (order if order is not None else range(len(texts))):
        parts = texts[i].split(" ") if sentences else [texts[i]]  # "sentences": words
        ids, lens = [], []
        for s in parts:
            x = tok.encode(s)
            if x:
                ids.extend(x)
                lens.append(len(x))
        if ids and append_eod:
            ids.append(tok.eos_id)
            lens[-1] += 1
        b.add_document(ids, lens)
    b.finalize(prefix + ".idx")
    return prefix


def test_writes_byte_counts_megatron_data_lacked(tmp_path, tok_model):
    prefix = megatron_data(str(tmp_path / "corpus_text_document"), TEXTS, tok_model)
    src = write_jsonl(str(tmp_path / "corpus.jsonl"), TEXTS)
    r = run_tool("add_byte_counts.py", ["--prefix", prefix, "--input", src, "--tokenizer-model", tok_model,
                                        "--check", "8", "--append-eod"])
    assert r.returncode == 0, r.stderr
    got = np.load(bytes_path(prefix))
    assert got.dtype == np.int64 and got.tolist() == [len(t.encode("utf-8")) for t in TEXTS]
    assert IndexedDataset(prefix).document_bytes().tolist() == got.tolist()
    assert f"wrote {prefix}.bytes.npy: {len(TEXTS)} documents" in r.stderr
    assert "1 documents hold no token" in r.stderr and "the first 8 documents re-tokenize" in r.stderr
    assert not os.path.exists(bytes_path(prefix) + ".tmp")
    again = run_tool("add_byte_counts.py", ["--prefix", prefix, "--input", src])
    assert again.returncode == 2 and "exists; pass --force" in again.stderr


@pytest.mark.parametrize("case,message", [
    ("extra_line", "has 13 lines but {idx} holds 12 documents"),
    ("missing_line", "has 11 lines but {idx} holds 12 documents"),
    ("blank_line", "{src}:3: a blank line: Megatron-LM's preprocess_data.py stops"),
    ("bad_json", "{src}:3: invalid JSON"),
    ("missing_key", "{src}:3: no key 'text'"),
    ("sentence_list", "{src}:3: 'text' holds a list (sentences)"),
    ("no_eod_flag", "document 0 holds"),
    ("swapped_lines", "{idx}: document 0 holds"),
    ("lone_surrogate", "{src}:3: the text holds a lone surrogate escape"),
    ("invalid_utf8", "{src}:3: not valid UTF-8: Megatron-LM's preprocess_data.py stops"),
])
def test_mismatches_are_refused_naming_the_place_and_write_nothing(tmp_path, tok_model, case, message):
    prefix = megatron_data(str(tmp_path / "d"), TEXTS, tok_model)
    lines = [json.dumps({"text": t}, ensure_ascii=False) for t in TEXTS]
    kwargs = dict(tokenizer=Tokenizer(tok_model), check=len(TEXTS), append_eod=True)
    if case == "extra_line":
        lines.append(json.dumps({"text": "one more"}))
    elif case == "missing_line":
        lines.pop()
    elif case == "blank_line":
        lines[2] = ""
    elif case == "bad_json":
        lines[2] = lines[2][:-1]
    elif case == "missing_key":
        lines[2] = json.dumps({"content": TEXTS[2]})
    elif case == "sentence_list":
        lines[2] = json.dumps({"text": TEXTS[2].split(". ")})
    elif case == "no_eod_flag":
        kwargs["append_eod"] = False
    elif case == "swapped_lines":
        lines[0], lines[1] = lines[1], lines[0]
    elif case == "lone_surrogate":
        lines[2] = '{"text": "a \\ud800 b"}'
    src = str(tmp_path / "in.jsonl")
    with open(src, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    if case == "invalid_utf8":
        with open(src, "r+b") as f:
            data = f.read().split(b"\n")
            data[2] = data[2].replace(b'"text": "', b'"text": "\xff')
            f.seek(0)
            f.write(b"\n".join(data))
    with pytest.raises(ByteCountError) as err:
        add_byte_counts(prefix, [src], **kwargs)
    assert message.format(idx=prefix + ".idx", src=src) in str(err.value), str(err.value)
    if case == "no_eod_flag":
        assert "--append-eod" in str(err.value)
    assert not os.path.exists(bytes_path(prefix)) and not os.path.exists(bytes_path(prefix) + ".tmp")


def test_partitions_order_documents_round_robin(tmp_path, tok_model):
    """Megatron's --partitions 3 deals lines round-robin and concatenates the partitions."""
    order = [i for p in range(3) for i in range(p, len(TEXTS), 3)]
    prefix = megatron_data(str(tmp_path / "p"), TEXTS, tok_model, order=order)
    src = write_jsonl(str(tmp_path / "in.jsonl"), TEXTS)
    tok = Tokenizer(tok_model)
    with pytest.raises(ByteCountError, match="line order"):
        add_byte_counts(prefix, [src], tokenizer=tok, check=4, append_eod=True)
    add_byte_counts(prefix, [src], partitions=3, tokenizer=tok, check=len(TEXTS), append_eod=True)
    assert np.load(bytes_path(prefix)).tolist() == [len(TEXTS[i].encode("utf-8")) for i in order]


def test_sentence_split_data_gets_per_document_counts_and_refuses_check(tmp_path, tok_model):
    prefix = megatron_data(str(tmp_path / "s"), TEXTS, tok_model, sentences=True)
    ds = IndexedDataset(prefix)
    assert len(ds) > ds.num_documents  # several sequences in some documents
    src = write_jsonl(str(tmp_path / "in.jsonl"), TEXTS)
    with pytest.raises(ByteCountError, match="--split-sentences"):
        add_byte_counts(prefix, [src], tokenizer=Tokenizer(tok_model), check=3)
    res = add_byte_counts(prefix, [src])
    assert res.sequences == len(ds) and np.load(bytes_path(prefix)).tolist() == [len(t.encode()) for t in TEXTS]


def test_input_lines_keep_byte_counts_and_only_the_checked_texts(tmp_path):
    """The reader keeps a byte count per line, the texts of the lines asked for only, and names
    a line by its file and line number across several files."""
    from dept_mega.data.byte_counts import read_lines
    a = write_jsonl(str(tmp_path / "a.jsonl"), ["one", " "])
    b = write_jsonl(str(tmp_path / "b.jsonl"), ["é", "three"])
    lines = read_lines([a, b], "text", keep={0, 3})
    assert list(lines.nbytes) == [3, 1, 2, 5] and lines.blank == 1
    assert lines.texts == {0: "one", 3: "three"}
    assert lines.where(1) == f"{a}:2" and lines.where(2) == f"{b}:1" and lines.where(3) == f"{b}:2"


@pytest.mark.parametrize("kind", ["gzip", "bz2", "lzma"])
def test_compressed_input_is_read_as_megatron_reads_it(tmp_path, kind):
    """A compressed jsonl (Megatron's --partitions reads *.gz) gives the counts of its text,
    read with universal newlines (CRLF and a lone CR end lines, as in Megatron's text mode); a
    damaged stream and bad UTF-8 are errors naming the file and the line."""
    import bz2
    import gzip
    import lzma
    from dept_mega.data.byte_counts import read_lines
    module = {"gzip": gzip, "bz2": bz2, "lzma": lzma}[kind]
    texts = ["one", "é", "three", "four"]
    rows = [json.dumps({"text": t}, ensure_ascii=False) for t in texts]
    data = (rows[0] + "\r\n" + rows[1] + "\r" + rows[2] + "\n" + rows[3] + "\r\n").encode("utf-8")
    src = str(tmp_path / "c.jsonl.gz")
    with open(src, "wb") as f:
        f.write(module.compress(data))
    assert list(read_lines([src], "text").nbytes) == [3, 2, 5, 4]
    prefix = write_docs(str(tmp_path / "c_text_document"), [[5, 6]] * 4)
    r = run_tool("add_byte_counts.py", ["--prefix", prefix, "--input", src, "--partitions", "2"])
    assert r.returncode == 0, r.stderr
    assert np.load(bytes_path(prefix)).tolist() == [3, 5, 2, 4]  # lines 0, 2, then 1, 3
    with open(src, "wb") as f:
        f.write(module.compress(data)[:-12])
    with pytest.raises(ByteCountError, match=f"{src}.*damaged or truncated after line"):
        read_lines([src], "text")
    with open(src, "wb") as f:
        f.write(module.compress(data + b'{"text": "\xff"}\n'))
    with pytest.raises(ByteCountError, match=rf"{src}:5: not valid UTF-8 \(decompressed\): Megatron"):
        read_lines([src], "text")
