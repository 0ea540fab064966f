"""tools/preprocess_data.py: output contents, workers/partitions equivalence, bad input."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from dept_mega.data.indexed import IndexedDataset
from dept_mega.data.jsonl import KINDS, SKIPPED_KINDS
from dept_mega.data.preprocess import PreprocessError, partition_ranges, preprocess
from dept_mega.data.tokenizer import load_tokenizer
from tests.data_utils import megatron_indexed, run_tool, synthetic_texts, train_tiny_tokenizer, write_jsonl



@pytest.fixture(scope="module")
def tok_model(tmp_path_factory):
    return train_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")), vocab=200)


def _read_all(prefix):
    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))], ds.document_bytes().tolist()


def test_cli_contract_and_contents(tmp_path, tok_model):
    texts = synthetic_texts(60, seed=5) + ["Ünïcödé and 日本語 text"]
    src = write_jsonl(str(tmp_path / "a.jsonl"), texts)
    out = str(tmp_path / "out")
    r = run_tool("preprocess_data.py", ["--input", src, "--json-keys", "text", "--tokenizer-type",
                                        "SentencePieceTokenizer", "--tokenizer-model", tok_model,
                                        "--output-prefix", out, "--workers", "2", "--append-eod"])
    assert r.returncode == 0, r.stderr
    assert "61 documents" in r.stderr and "tokens/s" in r.stderr
    for ext in (".bin", ".idx", ".bytes.npy"):
        assert os.path.exists(out + "_text_document" + ext)
    tok = load_tokenizer(tok_model)
    docs, nbytes = _read_all(out + "_text_document")
    assert docs == [tok.encode(t) + [tok.eos_id] for t in texts]
    assert nbytes == [len(t.encode("utf-8")) for t in texts]
    m = megatron_indexed().IndexedDataset(out + "_text_document")  # megatron reads our output
    assert [m[i].tolist() for i in range(len(m))] == docs and m.index.dtype == np.uint16


def test_workers_and_partitions_give_identical_files(tmp_path, tok_model, monkeypatch):
    import dept_mega.data.preprocess as pp

    monkeypatch.setattr(pp, "BATCH_LINES", 7)  # many small batches: exercises ordering
    texts = synthetic_texts(300, seed=6)
    src = write_jsonl(str(tmp_path / "a.jsonl"), texts)
    with open(src, "a") as f:
        f.write("not json\n")
    outs = {}
    for name, kw in {"w1": dict(workers=1), "w2": dict(workers=2), "p3": dict(workers=1, partitions=3),
                     "w2p4": dict(workers=2, partitions=4)}.items():
        st = preprocess([src], ["text"], tok_model, str(tmp_path / name), append_eod=True, log=None, **kw)
        assert st.documents == 300 and st.report.counts == {"invalid_json": 1}
        assert st.report.examples["invalid_json"] == [f"{src}:301"]
        outs[name] = {ext: open(str(tmp_path / name) + "_text_document" + ext, "rb").read()
                      for ext in (".bin", ".idx", ".bytes.npy")}
    for name in ("w2", "p3", "w2p4"):
        assert outs[name] == outs["w1"], name
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]  # the partitions directory, removed
    _check_token_range(str(tmp_path / "p3") + "_text_document", monkeypatch)


def _check_token_range(prefix, monkeypatch):
    """The preprocessing wrote the id range the start-up check reads (data/token_range.py): the
    .bin's true range, read back without a pass over the .bin; the data rewritten, the cache is
    stale and the range is computed again."""
    import dept_mega.data.token_range as tr
    tokens = np.asarray(IndexedDataset(prefix).tokens)
    want = (int(tokens.min()), int(tokens.max()))
    assert json.load(open(prefix + ".token_range.json"))["min"] == want[0]
    with monkeypatch.context() as m:
        m.setattr(tr, "IndexedDataset", lambda p: pytest.fail("the .bin was read again"))
        assert tr.token_id_range(prefix) == want
    with monkeypatch.context() as m:  # with data.cache_dir (a read-only data folder): still read beside the data
        m.setattr(tr, "IndexedDataset", lambda p: pytest.fail("the .bin was read again"))
        assert tr.token_id_range(prefix, os.path.join(os.path.dirname(prefix), "cache")) == want
    os.utime(prefix + ".bin", ns=(1, 1))  # another .bin (its modification time)
    calls = []
    real = tr.IndexedDataset
    monkeypatch.setattr(tr, "IndexedDataset", lambda p: calls.append(p) or real(p))
    assert tr.token_id_range(prefix) == want and calls == [prefix]


def test_partition_ranges_cover_input_at_line_starts(tmp_path):
    a = tmp_path / "a.jsonl"
    b = tmp_path / "b.jsonl"
    a.write_bytes(b"".join(b'{"text": "%d"}\n' % i for i in range(37)))
    b.write_bytes(b"".join(b'{"text": "b%d"}\n' % i for i in range(11)))
    parts = partition_ranges([str(a), str(b)], 5)
    assert len(parts) == 5
    lines = []
    for ranges in parts:
        for path, lo, hi in ranges:
            data = open(path, "rb").read()
            assert lo == 0 or data[lo - 1:lo] == b"\n"
            lines += data[lo:hi].splitlines()
    assert lines == a.read_bytes().splitlines() + b.read_bytes().splitlines()


def _bad_file(path):
    lines = [
        b'{"text": "good one"}\n',                      # 1 kept
        b"\xef\xbb\xbf" + b'{"text": "with bom"}\n',    # 2 bom: kept
        b'{"text": "crlf line"}\r\n',                   # 3 crlf: kept
        b'{"text": "inner\\r\\nbreak"}\n',              # 4 crlf inside text: kept, normalised
        b'{"text": "broken\n',                           # 5 invalid json
        b"[1, 2]\n",                                     # 6 not an object
        b'{"body": "no text key"}\n',                   # 7 missing key
        b'{"text": 42}\n',                              # 8 non-string
        b'{"text": null}\n',                            # 9 non-string
        b'{"text": ""}\n',                              # 10 empty
        b'{"text": "   \\n "}\n',                       # 11 empty (whitespace)
        b'{"text": "bad \xff\xfe bytes"}\n',            # 12 invalid utf-8
        b'{"text": "lone \\ud800 surrogate"}\n',        # 13 invalid utf-8 (surrogate)
        b"\n",                                           # 14 blank
        b'{"text": "last good"}',                       # 15 kept, no final newline
    ]
    with open(path, "wb") as f:
        f.write(b"".join(lines))


def test_each_bad_input_kind_is_counted_with_line_numbers(tmp_path, tok_model):
    src = str(tmp_path / "bad.jsonl")
    _bad_file(src)
    st = preprocess([src], ["text"], tok_model, str(tmp_path / "o"), append_eod=False, log=None)
    c = st.report.counts
    assert c == {"bom": 1, "crlf": 2, "invalid_json": 2, "missing_key": 1, "non_string": 2, "empty_text": 2,
                 "invalid_utf8": 2, "blank_line": 1}
    assert set(c) == set(KINDS)
    ex = st.report.examples
    assert ex["bom"] == [f"{src}:2"] and ex["crlf"] == [f"{src}:3", f"{src}:4"]
    assert [e.split(" ")[0] for e in ex["invalid_json"]] == [f"{src}:5", f"{src}:6"]
    assert ex["missing_key"][0].startswith(f"{src}:7") and "'text'" in ex["missing_key"][0]
    assert [e.split(" ")[0] for e in ex["non_string"]] == [f"{src}:8", f"{src}:9"]
    assert [e.split(" ")[0] for e in ex["empty_text"]] == [f"{src}:10", f"{src}:11"]
    assert [e.split(" ")[0] for e in ex["invalid_utf8"]] == [f"{src}:12", f"{src}:13"]
    assert ex["blank_line"] == [f"{src}:14"]
    # kept documents: every line minus the skipped ones, nothing else
    assert st.lines == 15 and st.documents == 15 - sum(c[k] for k in SKIPPED_KINDS) == 5
    tok = load_tokenizer(tok_model)
    docs, nbytes = _read_all(str(tmp_path / "o_text_document"))
    kept = ["good one", "with bom", "crlf line", "inner\nbreak", "last good"]
    assert docs == [tok.encode(t) for t in kept]
    assert nbytes == [len(t.encode()) for t in kept]


@pytest.mark.parametrize("quiet", [False, True])
def test_report_printed_by_cli_and_strict_fails_without_output(tmp_path, tok_model, quiet):
    """The report of bad input is printed (stderr) with or without --quiet: the counts, the
    first places of each kind and how many more; the record keeps the skipped counts; --strict
    says what it found and that nothing was written."""
    src = str(tmp_path / "bad.jsonl")
    _bad_file(src)
    with open(src, "ab") as f:  # 7 more invalid_json lines (16-22): 9 in all, 5 named, "and 4 more"
        f.write(b"\n" + b"not json\n" * 7)
    args = ["--input", src, "--json-keys", "text", "--tokenizer-model", tok_model,
            "--output-prefix", str(tmp_path / "o")] + (["--quiet"] if quiet else [])
    r = run_tool("preprocess_data.py", args)
    assert r.returncode == 0 and r.stdout == "" and "Traceback" not in r.stderr
    assert ("[preprocess] done" in r.stderr) is not quiet, r.stderr
    record = str(tmp_path / "o_text_document.tokenizer.json")
    assert f"input problems: 17 of 22 lines skipped (counts recorded in {record}; --strict" in r.stderr
    rows = {line.split()[0]: line for line in r.stderr.splitlines() if line.startswith("  ")}
    assert set(rows) == set(KINDS), r.stderr
    assert rows["invalid_json"].split()[1:3] == ["9", "skipped"]
    assert rows["invalid_json"].endswith(f"{src}:18, ... and 4 more"), rows["invalid_json"]
    assert rows["invalid_utf8"].split()[1:3] == ["2", "skipped"] and f"{src}:12" in rows["invalid_utf8"]
    assert rows["bom"].split()[1:4] == ["1", "kept", "(fixed)"] and "more" not in rows["missing_key"]
    assert json.load(open(record))["input"] == {
        "files": [src], "lines": 22, "skipped": 17, "skipped_by_kind": {
            "blank_line": 1, "invalid_utf8": 2, "invalid_json": 9, "missing_key": 1, "non_string": 2, "empty_text": 2}}
    os.remove(str(tmp_path / "o_text_document.bin"))
    r = run_tool("preprocess_data.py", args + ["--strict", "--workers", "2"])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    err = r.stderr.splitlines()
    if not quiet:  # the earlier run's files, removed before this one writes
        assert err.pop(0).startswith("[preprocess] removed 4 files of an earlier run"), r.stderr
    assert err[0].startswith("error: bad input and --strict given: nothing written; found in the lines read")
    rows = [line.split() for line in err[1:]]
    assert {row[0] for row in rows} == set(KINDS) and {row[2] for row in rows} == {"found"}, r.stderr
    assert "skipped" not in r.stderr and "and 4 more" in r.stderr
    assert not [f for f in os.listdir(tmp_path) if f.endswith((".bin", ".tmp", ".tokenizer.json"))]


def test_check_warns_about_sources_with_skipped_lines(tmp_path, tok_model):
    """--check (and the launch, through the same function) warns once per source whose record
    says lines were skipped; a clean source, or a record written before the field, gets nothing."""
    import yaml

    from dept_mega.config import load_config
    from dept_mega.data.checks import source_warnings
    from dept_mega.data.indexed import tokenizer_record_path
    from tests.test_train_cli import TINY_MODEL, _train_here
    bad = str(tmp_path / "bad.jsonl")
    _bad_file(bad)
    with open(bad, "a") as f:
        f.write("\n" + "".join(json.dumps({"text": t}) + "\n" for t in synthetic_texts(40, seed=9)))
    good = write_jsonl(str(tmp_path / "good.jsonl"), synthetic_texts(40, seed=10))
    for name, src in (("b", bad), ("g", good)):
        preprocess([src], ["text"], tok_model, str(tmp_path / name), append_eod=True, log=None)
    sources = [{"name": n, "prefix": str(tmp_path / f"{n}_text_document")} for n in ("b", "g")]
    cfg = {"model": TINY_MODEL, "precision": "fp32", "backend": "local", "dept": {"variant": "glob", "local_steps": 2},
           "data": {"tokenizer": tok_model, "sources": sources, "split": "80,20"},
           "train": {"steps": 4, "micro_batch_size": 2, "global_batch_size": 4, "eval_iters": 0,
                     "run_dir": str(tmp_path / "run")}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    r = _train_here("--config", str(path), "--check", "--world-size", "2")
    assert r.returncode == 0, r.stderr
    warned = [line for line in r.stderr.splitlines() if "skipped as bad input" in line]
    b = sources[0]["prefix"]
    assert warned == [
        f"warning: config key 'data.sources[0].prefix': source 'b': {b}: 10 of 55 input lines were skipped as bad "
        f"input when it was preprocessed (blank_line 1, invalid_utf8 2, invalid_json 2, missing_key 1, non_string 2, "
        f"empty_text 2; {tokenizer_record_path(b)}): this data lacks them; fix the input and preprocess again "
        f"(tools/preprocess_data.py's report names the first lines of each kind), or preprocess with --strict to "
        f"stop at bad input instead of skipping it"], r.stderr
    r = _train_here("--config", str(path), "train.steps=2")  # the launch prints the same line
    assert r.returncode == 0, r.stderr
    assert [line for line in r.stderr.splitlines() if "skipped as bad input" in line] == warned, r.stderr
    record = json.load(open(tokenizer_record_path(b)))
    del record["input"]  # a record from before the field: nothing said
    json.dump(record, open(tokenizer_record_path(b), "w"))
    assert not [w for w in source_warnings(load_config(str(path))) if "skipped" in w]
@pytest.mark.parametrize("kind,line", [("bom", b"\xef\xbb\xbf{\"text\": \"x\"}\n"),
                                       ("crlf", b'{"text": "x"}\r\n'),
                                       ("empty_text", b'{"text": ""}\n')])
def test_strict_rejects_even_kept_kinds(tmp_path, tok_model, kind, line):
    src = tmp_path / "a.jsonl"
    src.write_bytes(b'{"text": "fine"}\n' + line)
    with pytest.raises(PreprocessError, match=kind):
        preprocess([str(src)], ["text"], tok_model, str(tmp_path / "o"), strict=True, log=None)


def test_multiple_keys_stay_aligned(tmp_path, tok_model):
    src = tmp_path / "a.jsonl"
    rows = [{"text": "alpha beta", "title": "one"}, {"text": "gamma"}, {"text": "delta", "title": "two"}]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    st = preprocess([str(src)], ["text", "title"], tok_model, str(tmp_path / "o"), log=None)
    assert st.documents == 2 and st.report.counts == {"missing_key": 1}
    tok = load_tokenizer(tok_model)
    assert _read_all(str(tmp_path / "o_text_document"))[0] == [tok.encode("alpha beta"), tok.encode("delta")]
    assert _read_all(str(tmp_path / "o_title_document"))[0] == [tok.encode("one"), tok.encode("two")]


def test_clear_errors_for_missing_files(tmp_path, tok_model):
    r = run_tool("preprocess_data.py", ["--input", str(tmp_path / "none.jsonl"), "--tokenizer-model", tok_model,
                                        "--output-prefix", str(tmp_path / "o")])
    assert r.returncode == 2 and "none.jsonl" in r.stderr and "does not exist" in r.stderr
    src = write_jsonl(str(tmp_path / "a.jsonl"), ["x"])
    r = run_tool("preprocess_data.py", ["--input", src, "--tokenizer-model", str(tmp_path / "no.model"),
                                        "--output-prefix", str(tmp_path / "o")])
    assert r.returncode == 2 and "no.model" in r.stderr and "Traceback" not in r.stderr
    # an input that exists but cannot be read by offsets (a directory here; a pipe alike) is named as such
    r = run_tool("preprocess_data.py", ["--input", str(tmp_path), "--tokenizer-model", tok_model,
                                        "--output-prefix", str(tmp_path / "o")])
    assert r.returncode == 2 and "not a regular file" in r.stderr and "does not exist" not in r.stderr
    # a key given twice: refused before any tokenizing (both would write OUT_text_document), nothing written
    r = run_tool("preprocess_data.py", ["--input", src, "--json-keys", "text", "text", "--tokenizer-model",
                                        tok_model, "--output-prefix", str(tmp_path / "k")])
    assert r.returncode == 2 and "error: --json-keys: key 'text' is given more than once" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not [f for f in os.listdir(tmp_path) if f.startswith("k")]


def test_allow_empty_says_what_the_empty_dataset_is_for(tmp_path, tok_model):
    """--allow-empty writes an empty dataset for merging; its help and the run say that
    megatron-core cannot open it (it memory-maps the empty .bin)."""
    r = run_tool("preprocess_data.py", ["--help"])
    assert "megatron-core cannot open an empty .bin" in " ".join(r.stdout.split()), r.stdout
    src = tmp_path / "empty.jsonl"
    src.write_text("")
    for quiet in ([], ["--quiet"]):
        r = run_tool("preprocess_data.py", ["--input", str(src), "--tokenizer-model", tok_model, "--allow-empty",
                                            "--output-prefix", str(tmp_path / "o"), *quiet])
        assert r.returncode == 0 and os.path.exists(tmp_path / "o_text_document.idx"), r.stderr
        assert (f"note: {tmp_path / 'o_text_document.bin'} holds no token: an empty dataset is for "
                f"tools/merge_datasets.py; megatron-core cannot open it" in r.stderr), r.stderr


def test_progress_lines(tmp_path, tok_model):
    src = write_jsonl(str(tmp_path / "a.jsonl"), synthetic_texts(20, seed=8))
    r = run_tool("preprocess_data.py", ["--input", src, "--tokenizer-model", tok_model, "--output-prefix",
                                        str(tmp_path / "o"), "--log-interval", "0"])
    assert r.returncode == 0
    progress = [line for line in r.stderr.splitlines() if "docs/s" in line and "tokens/s" in line and "MB/s" in line]
    assert progress, r.stderr
