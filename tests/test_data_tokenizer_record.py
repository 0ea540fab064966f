"""PREFIX.tokenizer.json: tools/preprocess_data.py records which tokenizer made the data, and the
pre-flight refuses a config naming another one even when its vocabulary is as large (the id-range
check cannot see that: the ids fit, the text they stand for is another)."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from dept_mega.config import ConfigError, load_config
from dept_mega.data.checks import check_sources, lossy_source_warnings
from dept_mega.data.indexed import tokenizer_record_path
from dept_mega.data.preprocess import preprocess
from dept_mega.data.tokenizer import model_sha256
from tests.data_utils import run_tool, synthetic_texts, train_tiny_tokenizer, write_jsonl


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Data made with tokenizer A; B has the same vocabulary size (another model type)."""
    d = tmp_path_factory.mktemp("rec")
    a = train_tiny_tokenizer(str(d / "a"), vocab=200)
    b = train_tiny_tokenizer(str(d / "b"), vocab=200, model_type="bpe")
    src = write_jsonl(str(d / "x.jsonl"), synthetic_texts(40, seed=3))
    preprocess([src], ["text"], a, str(d / "x"), append_eod=True, log=None)
    return str(d / "x_text_document"), a, b


def _cfg(variant, prefix, tok):
    common = ["dept.local_steps=10", "train.steps=20", f"dept.variant={variant}", "train.eval_iters=0"]
    if variant == "spec_opt":
        return load_config(None, common + [f"data.sources=[{{name: x, prefix: {prefix}, tokenizer: {tok}}}]"])
    return load_config(None, common + [f"data.tokenizer={tok}", f"data.sources=[{{name: x, prefix: {prefix}}}]"])


def test_preprocess_records_the_tokenizer(made):
    prefix, a, _ = made
    rec = json.load(open(tokenizer_record_path(prefix)))
    nbytes = sum(len(t.encode()) for t in synthetic_texts(40, seed=3))
    assert rec == {"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": os.path.abspath(a),
                   "sha256": model_sha256(a), "lossless": True,
                   "round_trip": {"documents": 40, "bytes": nbytes, "checked": 40, "checked_bytes": nbytes,
                                  "mismatched_documents": 0, "mismatched_bytes": 0,
                                  "mismatched_decoded_bytes": 0, "every": 1},
                   "append_eod": True, "json_key": "text",
                   "input": {"files": [os.path.join(os.path.dirname(prefix), "x.jsonl")], "lines": 40, "skipped": 0,
                             "skipped_by_kind": {}}}


def test_another_tokenizer_of_the_same_size_is_refused(made, tmp_path):
    prefix, a, b = made
    check_sources(_cfg("glob", prefix, a))  # the one that made it
    moved = str(tmp_path / "elsewhere.model")
    shutil.copy(a, moved)
    check_sources(_cfg("glob", prefix, moved))  # moved or renamed: the same model
    with pytest.raises(ConfigError) as exc:
        check_sources(_cfg("glob", prefix, b))
    msg = str(exc.value)
    assert msg.startswith("config key 'data.tokenizer': source 'x': ") and f"tokenized with {a}" in msg
    assert f"but data.tokenizer is {b}, another tokenizer" in msg
    with pytest.raises(ConfigError, match=r"^config key 'data.sources\[0\].tokenizer': .*tokenized with"):
        check_sources(_cfg("spec_opt", prefix, b))


def test_without_a_record_or_with_a_broken_one(made, tmp_path):
    prefix, a, b = made
    for ext in (".bin", ".idx", ".bytes.npy"):
        shutil.copy(prefix + ext, str(tmp_path / "old_text_document") + ext)
    old = str(tmp_path / "old_text_document")
    check_sources(_cfg("glob", old, b))  # data made before the record existed: the id range only
    with open(tokenizer_record_path(old), "w") as f:
        f.write("{not json")
    with pytest.raises(ConfigError, match=r"old_text_document.tokenizer.json is not a tokenizer record"):
        check_sources(_cfg("glob", old, a))
    os.remove(tokenizer_record_path(old))


def test_record_path_is_absolute_and_a_failed_rerun_leaves_none(tmp_path, monkeypatch):
    """A tokenizer given relative to the preprocessing's working directory is recorded by its
    absolute path (the pre-flight reads the record from elsewhere); a rerun into the same prefix
    that fails leaves no record of the earlier run beside its data."""
    a = train_tiny_tokenizer(str(tmp_path / "a"), vocab=200)
    src = write_jsonl(str(tmp_path / "x.jsonl"), synthetic_texts(20, seed=1))
    monkeypatch.chdir(tmp_path)
    preprocess([src], ["text"], os.path.relpath(a), "x", log=None)
    record = tokenizer_record_path(str(tmp_path / "x_text_document"))
    assert json.load(open(record))["tokenizer_model"] == a
    bad = tmp_path / "bad.jsonl"
    bad.write_text(open(src).read() + "not json\n")
    with pytest.raises(Exception, match="--strict"):  # the bad line stops the run midway
        preprocess([str(bad)], ["text"], a, "x", log=None, strict=True)
    assert not os.path.exists(record)


def test_round_trip_is_counted_reported_recorded_and_warned(tmp_path, capsys):
    """A lossy tokenizer (SentencePiece's nmt_nfkc: whitespace collapsed, newlines lost) on text
    with newlines and double spaces: preprocess_data.py counts the documents that do not come
    back, prints it, records it, and the pre-flight warns once for that source."""
    lossy = train_tiny_tokenizer(str(tmp_path / "nfkc"), vocab=120, extra=["--normalization", "nmt_nfkc"])
    plain = synthetic_texts(30, seed=5)
    texts = [t if i % 3 else t.replace(" ", "\n", 1).replace(" ", "  ", 1) for i, t in enumerate(plain)]
    src = write_jsonl(str(tmp_path / "x.jsonl"), texts)
    r = run_tool("preprocess_data.py", ["--input", src, "--tokenizer-model", lossy, "--append-eod",
                                        "--output-prefix", str(tmp_path / "x")])
    assert r.returncode == 0, r.stderr
    bad = texts[::3]
    nbytes, bad_bytes = sum(len(t.encode()) for t in texts), sum(len(t.encode()) for t in bad)
    decoded = sum(len(" ".join(t.split()).encode()) for t in bad)  # what nmt_nfkc gives back
    assert (f"warning: {tmp_path}/x_text_document: 10 of 30 documents do not round-trip" in r.stderr
            and f"decode to {decoded} bytes for their {bad_bytes}" in r.stderr
            and "bits per byte are measured against the original bytes" in r.stderr), r.stderr
    prefix = str(tmp_path / "x_text_document")
    rec = json.load(open(tokenizer_record_path(prefix)))
    assert rec["lossless"] is False and rec["round_trip"] == {
        "documents": 30, "bytes": nbytes, "checked": 30, "checked_bytes": nbytes, "mismatched_documents": 10,
        "mismatched_bytes": bad_bytes, "mismatched_decoded_bytes": decoded, "every": 1}
    cfg = _cfg("glob", prefix, lossy)
    (w,) = lossy_source_warnings(cfg)
    assert w.startswith(f"config key 'data.sources[0].prefix': source 'x': {tokenizer_record_path(prefix)}: "
                        f"the tokenizer is lossy on this data (10 of 30 documents")
    # a lossless record, or an older one without the field: no warning
    good = write_jsonl(str(tmp_path / "g.jsonl"), plain)
    r = run_tool("preprocess_data.py", ["--input", good, "--tokenizer-model", lossy, "--append-eod",
                                        "--output-prefix", str(tmp_path / "g")])
    assert "all 30 documents round-trip" in r.stderr, r.stderr
    assert lossy_source_warnings(_cfg("glob", str(tmp_path / "g_text_document"), lossy)) == []
    rec.pop("lossless")
    rec.pop("round_trip")
    json.dump(rec, open(tokenizer_record_path(prefix), "w"))
    assert lossy_source_warnings(cfg) == []
