"""tools/merge_datasets.py: shards merged equal one preprocessing run; checks; atomic writes."""
from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest

import dept_mega.data.merge as mg
from dept_mega.data.indexed import IndexedDataset, tokenizer_record_path
from dept_mega.data.merge import MergeError, merge, merged_record
from dept_mega.data.merge_find import find_parts, numbering_gaps
from dept_mega.data.preprocess import preprocess
from dept_mega.data.token_range import token_id_range
from tests.data_utils import (megatron_indexed, numbered_docs, run_tool, synthetic_texts, train_tiny_tokenizer,
                              write_docs)

COMPANIONS = (".bin", ".idx", ".bytes.npy")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A jsonl preprocessed in one go and in three shards (uneven, a bad line in the second):
    (one-go prefix, shard prefixes in order)."""
    d = tmp_path_factory.mktemp("sharded")
    tok = train_tiny_tokenizer(str(d / "tok"), vocab=200)
    texts = synthetic_texts(90, seed=7) + ["Ünïcödé and 日本語 text"]
    lines = [json.dumps({"text": t}, ensure_ascii=False) for t in texts]
    lines.insert(50, "not json")
    cuts = [(0, 17), (17, 61), (61, len(lines))]
    shards = []
    for i, (a, b) in enumerate(cuts):
        path = d / f"shard_{i}.jsonl"
        path.write_text("".join(x + "\n" for x in lines[a:b]), encoding="utf-8")
        shards.append(str(path))
    whole = d / "whole.jsonl"
    whole.write_text("".join(x + "\n" for x in lines), encoding="utf-8")
    preprocess([str(whole)], ["text"], tok, str(d / "one"), append_eod=True, log=None)
    parts = []
    for i, s in enumerate(shards):
        preprocess([s], ["text"], tok, str(d / f"part_{i}"), append_eod=True, log=None)
        parts.append(str(d / f"part_{i}_text_document"))
    return str(d / "one_text_document"), parts


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def _record(prefix):
    with open(tokenizer_record_path(prefix), encoding="utf-8") as f:
        return json.load(f)


def test_merged_shards_equal_one_go(sharded, tmp_path):
    one, parts = sharded
    out = str(tmp_path / "merged_text_document")
    r = run_tool("merge_datasets.py", ["--input", *parts, "--output-prefix", out])
    assert r.returncode == 0, r.stderr
    for ext in COMPANIONS:
        assert _read(out + ext) == _read(one + ext), ext
    made, want = _record(out), _record(one)
    for key in ("tokenizer_type", "tokenizer_model", "sha256", "lossless", "round_trip", "append_eod", "json_key"):
        assert made[key] == want[key], key
    assert (made["append_eod"], made["json_key"]) == (True, "text")
    assert {k: made["input"][k] for k in ("lines", "skipped", "skipped_by_kind")} == \
        {k: want["input"][k] for k in ("lines", "skipped", "skipped_by_kind")} == \
        {"lines": 92, "skipped": 1, "skipped_by_kind": {"invalid_json": 1}}
    assert [m["prefix"] for m in made["merged_from"]] == [os.path.abspath(p) for p in parts]
    assert [m["documents"] for m in made["merged_from"]] == [17, 43, 31]
    # the id range is cached for the merged files as they are (valid key), equal to the one-go range
    with open(out + ".token_range.json") as f:
        cached = json.load(f)
    assert (cached["min"], cached["max"]) == token_id_range(one)
    os.remove(out + ".token_range.json")
    assert token_id_range(out) == (cached["min"], cached["max"])
    assert "3 parts, 91 documents" in r.stderr


def test_megatron_reads_merged(sharded, tmp_path):
    mcore = megatron_indexed()
    one, parts = sharded
    out = str(tmp_path / "m")
    merge(parts, out)
    m, ours = mcore.IndexedDataset(out), IndexedDataset(one)
    assert len(m) == len(ours) == 91
    assert all(m[i].tolist() == ours[i].tolist() for i in range(len(m)))


def _part(prefix, docs, dtype=np.uint16, **record):
    """A part written directly: its documents, byte counts (10 per token) and a current record."""
    write_docs(prefix, docs, [10 * len(d) for d in docs], dtype=dtype)
    rec = {"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": "/tok/a.model", "sha256": "aa" * 32,
           "lossless": True, "round_trip": {"documents": len(docs), "bytes": 10 * sum(map(len, docs)),
                                            "checked": len(docs), "checked_bytes": 10 * sum(map(len, docs)),
                                            "mismatched_documents": 0, "mismatched_bytes": 0,
                                            "mismatched_decoded_bytes": 0, "every": 1},
           "input": {"files": [prefix + ".jsonl"], "lines": len(docs), "skipped": 0, "skipped_by_kind": {}},
           "append_eod": True, "json_key": "text"}
    for key, value in record.items():
        if isinstance(value, dict):
            rec[key] = {**rec[key], **value}
        else:
            rec[key] = value
    with open(tokenizer_record_path(prefix), "w") as f:
        json.dump(rec, f)
    return prefix


def _left(directory, out_name):
    """Files of the output (final or temporary) in ``directory``."""
    return sorted(f for f in os.listdir(directory) if f.startswith(out_name))


def test_input_dir_order_is_by_name_with_numbers(tmp_path):
    docs = numbered_docs(30, seed=3)
    d = tmp_path / "shards"
    d.mkdir()
    for n, (a, b) in zip((2, 10, 1), ((10, 20), (20, 30), (0, 10))):
        _part(str(d / f"x_{n}_text_document"), docs[a:b])
    prefixes = find_parts(str(d), "x_*_text_document", allow_gaps=True)
    assert [os.path.basename(p) for p in prefixes] == [f"x_{n}_text_document" for n in (1, 2, 10)]
    out = str(tmp_path / "all")
    r = run_tool("merge_datasets.py", ["--input-dir", str(d), "--output-prefix", out])  # 3 ... 9 missing
    assert r.returncode == 2 and "error:" in r.stderr and "miss 7 number(s)" in r.stderr, r.stderr
    assert "x_3_text_document, x_4_text_document" in r.stderr and "--allow-gaps" in r.stderr
    assert _left(tmp_path, "all") == []
    r = run_tool("merge_datasets.py", ["--input-dir", str(d), "--allow-gaps", "--output-prefix", out])
    assert r.returncode == 0, r.stderr
    assert ("3 parts from " in r.stderr and "first x_1_text_document, last x_10_text_document; in name order "
            "(digit runs as numbers): x_1_text_document, x_2_text_document, x_10" in r.stderr)
    assert "numbering: 7 missing (--allow-gaps): x_3_text_document" in r.stderr
    ds = IndexedDataset(out)
    assert [ds[i].tolist() for i in range(len(ds))] == docs
    assert ds.document_bytes().tolist() == [10 * len(x) for x in docs]


def test_input_dir_refuses_several_keys_and_half_datasets(tmp_path):
    d = tmp_path / "shards"
    d.mkdir()
    _part(str(d / "x_0_text_document"), [[1, 2]])
    _part(str(d / "x_0_title_document"), [[3]])
    with pytest.raises(MergeError, match=r"2 json keys \(text_document, title_document\).*--pattern '\*_text_"):
        find_parts(str(d))
    assert len(find_parts(str(d), "*_text_document")) == 1
    os.remove(d / "x_0_title_document.idx")
    with pytest.raises(MergeError, match=r"x_0_title_document\.bin has no x_0_title_document\.idx"):
        find_parts(str(d))
    with pytest.raises(MergeError, match="no dataset"):
        find_parts(str(d), "y*")


@pytest.mark.parametrize("leftover", ["en_001_text_document.bin.tmp", "en_001_text_document.idx.tmp",
                                      "en_001_text_document.bytes.npy.tmp", "en_001.partitions.tmp"])
def test_input_dir_refuses_unfinished_parts(tmp_path, leftover):
    """A shard still being preprocessed, or killed, has only temporary files (or its --partitions
    directory): refused, naming it, not merged without it."""
    d = tmp_path / "shards"
    d.mkdir()
    for i in (0, 2):
        _part(str(d / f"en_{i:03d}_text_document"), [[i + 1, 2]])
    if leftover.endswith(".partitions.tmp"):
        (d / leftover).mkdir()
        (d / leftover / "part0_text_document.bin.tmp").write_bytes(b"\0\0")
    else:
        (d / leftover).write_bytes(b"\0\0")
    out = str(tmp_path / "out" / "en_text_document")
    r = run_tool("merge_datasets.py", ["--input-dir", str(d), "--pattern", "en_*_text_document", "--allow-gaps",
                                       "--output-prefix", out])
    assert r.returncode == 2, r.stderr
    assert (f"error: {d / leftover}: part en_001_text_document is still being written, or its run was killed"
            in r.stderr)
    assert not os.path.exists(out + ".idx")
    with pytest.raises(MergeError, match="no dataset"):  # another pattern's leftovers are not this merge's
        find_parts(str(d), "x*")


def test_input_dir_refuses_gaps_in_the_numbering(tmp_path):
    """en_000 and en_002 without en_001 (a shard whose run failed and left nothing): refused
    unless --allow-gaps; names numbered in several places are not checked."""
    d = tmp_path / "shards"
    d.mkdir()
    for i in (0, 2, 3, 5):
        _part(str(d / f"en_{i:03d}_text_document"), [[i + 1, 2]])
    with pytest.raises(MergeError, match=r"\(en_000_text_document \.\.\. en_005_text_document\) miss 2 number\(s\) "
                                         r"of their numbering: en_001_text_document, en_004_text_document \("):
        find_parts(str(d), "en_*_text_document")
    assert len(find_parts(str(d), "en_*_text_document", allow_gaps=True)) == 4
    assert numbering_gaps(["a_1_x", "a_2_x", "a_3_x"]) == (0, [])
    assert numbering_gaps(["a_9", "a_12"], show=2) == (2, ["a_10", "a_11"])
    assert numbering_gaps(["a_1_b_1", "a_2_b_3"]) is None  # two digit runs differ
    assert numbering_gaps(["en_1", "fr_3"]) is None  # the text differs
    assert numbering_gaps(["one"]) == (0, [])


@pytest.mark.parametrize("field", ["sha256", "tokenizer_type"])
def test_refuses_another_tokenizer(tmp_path, field):
    a = _part(str(tmp_path / "a"), [[1, 2, 3]])
    other = {"sha256": "bb" * 32, "tokenizer_type": "HuggingFaceTokenizer"}[field]
    b = _part(str(tmp_path / "b"), [[4, 5]], **{field: other, "tokenizer_model": "/tok/b"})
    with pytest.raises(MergeError) as e:
        merge([a, b], str(tmp_path / "out"))
    msg = str(e.value)
    assert msg.startswith(f"{tmp_path / 'b.tokenizer.json'}: field '{field}'") and "/tok/b" in msg \
        and "different tokenizers" in msg
    assert _left(tmp_path, "out") == []


def test_refuses_shards_preprocessed_with_and_without_append_eod(sharded, tmp_path):
    """tools/preprocess_data.py records --append-eod; a shard made without it is refused by the
    tool, naming the part and the field, before anything is written."""
    _, parts = sharded
    shard = os.path.join(os.path.dirname(parts[0]), "shard_0.jsonl")
    tok = _record(parts[0])["tokenizer_model"]
    preprocess([shard], ["text"], tok, str(tmp_path / "noeod"), log=None)
    noeod = str(tmp_path / "noeod_text_document")
    assert (_record(noeod)["append_eod"], _record(noeod)["json_key"]) == (False, "text")
    r = run_tool("merge_datasets.py", ["--input", parts[0], noeod, "--output-prefix", str(tmp_path / "out")])
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(f"error: {tokenizer_record_path(noeod)}: field 'append_eod' is False, but the first "
                               f"part's ({tokenizer_record_path(parts[0])}) is True: the parts were made with and "
                               f"without --append-eod"), r.stderr
    assert _left(tmp_path, "out") == []


def _without(prefix, *keys):
    """Make ``prefix``'s record one of an older tools/preprocess_data.py, without ``keys``."""
    rec = _record(prefix)
    for key in keys:
        del rec[key]
    with open(tokenizer_record_path(prefix), "w") as f:
        json.dump(rec, f)
    return prefix


def test_refuses_parts_made_differently_and_unknown_with_known(tmp_path):
    a = _part(str(tmp_path / "a"), [[1, 2, 3]])
    out = str(tmp_path / "out")
    b = _part(str(tmp_path / "b"), [[4, 5]], json_key="title")
    with pytest.raises(MergeError, match=r"b\.tokenizer\.json: field 'json_key' is 'title', but the first part's "
                                         r"\(.*a\.tokenizer\.json\) is 'text': the parts were made from different "
                                         r"--json-keys"):
        merge([a, b], out)
    bad = _part(str(tmp_path / "bad"), [[4]], append_eod="yes")
    with pytest.raises(MergeError, match=r"bad\.tokenizer\.json: field 'append_eod' is not a bool \('yes'\)"):
        merge([a, bad], out)
    # older records (neither field): unknown, merged only among themselves; the merged record leaves them out
    old1 = _without(_part(str(tmp_path / "old1"), [[6]]), "append_eod", "json_key")
    old2 = _without(_part(str(tmp_path / "old2"), [[7, 8]]), "append_eod", "json_key")
    merge([old1, old2], out)
    assert "append_eod" not in _record(out) and "json_key" not in _record(out)
    for order in ([a, old1], [old1, a]):  # a part lacking the field is named, whichever comes first
        with pytest.raises(MergeError, match=r"old1\.tokenizer\.json: field 'append_eod' is missing \(a record "
                                             r"of an older tools/preprocess_data\.py\), but .*a\.tokenizer\.json "
                                             r"has it \(True\)"):
            merge(order, str(tmp_path / "out2"))
    assert _left(tmp_path, "out2") == []
    c = _part(str(tmp_path / "c"), [[9]])
    merge([a, c], out, force=True)
    assert (_record(out)["append_eod"], _record(out)["json_key"]) == (True, "text")


def test_refuses_another_dtype(tmp_path):
    a = _part(str(tmp_path / "a"), [[1, 2, 3]])
    b = _part(str(tmp_path / "b"), [[4, 5]], dtype=np.int32)
    with pytest.raises(MergeError, match=r"b\.idx: token dtype int32, but the first part's .*a\.idx\) is uint16"):
        merge([a, b], str(tmp_path / "out"))
    assert _left(tmp_path, "out") == []


def test_refuses_output_among_inputs_and_duplicates(tmp_path):
    a = _part(str(tmp_path / "a"), [[1, 2, 3]])
    b = _part(str(tmp_path / "b"), [[4]])
    before = _read(a + ".bin")
    for out in (b, str(tmp_path / "." / "b")):
        with pytest.raises(MergeError, match="is the input part"):
            merge([a, b], out, force=True)
    os.link(a + ".idx", tmp_path / "hard.idx")  # another name of the same file
    with pytest.raises(MergeError, match="is the input part"):
        merge([a, b], str(tmp_path / "hard"), force=True)
    with pytest.raises(MergeError, match="given twice"):
        merge([a, b, str(tmp_path / "." / "a")], str(tmp_path / "out"))
    assert _read(a + ".bin") == before


def test_refuses_parts_without_companions_or_inconsistent(tmp_path):
    a = _part(str(tmp_path / "a"), [[1, 2, 3]])
    out = str(tmp_path / "out")
    b = _part(str(tmp_path / "b"), [[4, 5]], round_trip={"documents": 3})
    with pytest.raises(MergeError, match=r"b\.tokenizer\.json: field 'round_trip\.documents' is 3, but .*holds 1 documents"):
        merge([a, b], out)
    c = _part(str(tmp_path / "c"), [[6]])
    os.remove(c + ".bytes.npy")
    with pytest.raises(MergeError, match=r"c\.bytes\.npy does not exist.*add_byte_counts"):
        merge([a, c], out)
    np.save(c + ".bytes.npy", np.array([1, 2], dtype=np.int64))
    with pytest.raises(MergeError, match=r"c\.bytes\.npy: int64 array of shape \(2,\), expected .*\(1,\)"):
        merge([a, c], out)
    e = _part(str(tmp_path / "e"), [[7]])
    os.remove(tokenizer_record_path(e))
    with pytest.raises(MergeError, match=r"e\.tokenizer\.json does not exist"):
        merge([a, e], out)
    f = _part(str(tmp_path / "f"), [[8, 9]])
    with open(f + ".bin", "ab") as fh:
        fh.write(b"\0\0")
    with pytest.raises(MergeError, match=r"f\.bin: 6 bytes, but .*names 2 tokens"):
        merge([a, f], out)
    with pytest.raises(MergeError, match=r"part .*nope.*index file does not exist"):
        merge([a, str(tmp_path / "nope")], out)
    assert _left(tmp_path, "out") == []


def test_merged_record_adds_up(tmp_path):
    a = _part(str(tmp_path / "a"), [[1, 2, 3]] * 4, lossless=None,
              round_trip={"checked": 1, "checked_bytes": 30, "every": 4})
    b = _part(str(tmp_path / "b"), [[4, 5]] * 2, lossless=False,
              round_trip={"mismatched_documents": 1, "mismatched_bytes": 20, "mismatched_decoded_bytes": 18},
              input={"skipped": 2, "lines": 4, "skipped_by_kind": {"invalid_json": 1, "empty_text": 1}})
    c = _part(str(tmp_path / "c"), [[6]], input={"skipped": 1, "lines": 2, "skipped_by_kind": {"invalid_json": 1}})
    rec = merged_record(mg.check_parts([a, b, c], str(tmp_path / "out")))
    assert rec["lossless"] is False
    assert rec["round_trip"] == {"documents": 7, "bytes": 170, "checked": 4, "checked_bytes": 80,
                                 "mismatched_documents": 1, "mismatched_bytes": 20, "mismatched_decoded_bytes": 18,
                                 "every": None}
    assert rec["input"] == {"files": [a + ".jsonl", b + ".jsonl", c + ".jsonl"], "lines": 10, "skipped": 3,
                            "skipped_by_kind": {"invalid_json": 2, "empty_text": 1}}
    assert [m["round_trip_every"] for m in rec["merged_from"]] == [4, 1, 1]
    assert merged_record(mg.check_parts([a, c], str(tmp_path / "out")))["lossless"] is None  # a sample
    assert merged_record(mg.check_parts([b, c], str(tmp_path / "out")))["round_trip"]["every"] == 1
    old = _part(str(tmp_path / "old"), [[7]])  # a record older than the input field
    rec_old = _record(old)
    del rec_old["input"]
    with open(tokenizer_record_path(old), "w") as f:
        json.dump(rec_old, f)
    with pytest.raises(MergeError, match=r"old\.tokenizer\.json: field 'input' is missing"):
        merged_record(mg.check_parts([a, old], str(tmp_path / "out")))


def test_existing_output_needs_force(tmp_path):
    a = _part(str(tmp_path / "a"), [[1, 2, 3]])
    b = _part(str(tmp_path / "b"), [[4]])
    out = str(tmp_path / "out")
    merge([a], out)
    r = run_tool("merge_datasets.py", ["--input", a, b, "--output-prefix", out])
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "out.bin" in r.stderr and "--force" in r.stderr
    assert IndexedDataset(out).num_documents == 1
    merge([a, b], out, force=True)
    assert IndexedDataset(out).num_documents == 2 and len(_record(out)["merged_from"]) == 2


def test_progress_lines(tmp_path, monkeypatch):
    monkeypatch.setattr(mg, "CHUNK_BYTES", 64)
    parts = [_part(str(tmp_path / f"p{i}"), numbered_docs(20, seed=i)) for i in range(3)]
    lines = []
    merge(parts, str(tmp_path / "out"), log=lines.append, progress_interval=0)
    assert any(line.startswith("[merge] 1 of 3 parts done |") and " MB of " in line and "ETA" in line
               for line in lines)
    assert lines[-1].startswith("[merge] 3 of 3 parts done") and "(100.0%)" in lines[-1]


def _stop_after(monkeypatch, calls: int, action):
    """Make the copy's progress call ``action`` at its ``calls``-th update (mid-copy: small chunks)."""
    monkeypatch.setattr(mg, "CHUNK_BYTES", 16)
    real, n = mg._Progress.update, [0]

    def update(self, parts_done, nbytes):
        n[0] += 1
        if n[0] == calls:
            action()
        real(self, parts_done, nbytes)

    monkeypatch.setattr(mg._Progress, "update", update)


def test_interrupt_leaves_nothing(tmp_path, monkeypatch):
    parts = [_part(str(tmp_path / f"p{i}"), numbered_docs(10, seed=i)) for i in range(2)]

    def stop():
        raise KeyboardInterrupt

    _stop_after(monkeypatch, 5, stop)
    with pytest.raises(KeyboardInterrupt):
        merge(parts, str(tmp_path / "out"))
    assert _left(tmp_path, "out") == []


def test_sigterm_leaves_nothing(tmp_path, monkeypatch, capsys):
    import tools.merge_datasets as tool

    parts = [_part(str(tmp_path / f"p{i}"), numbered_docs(10, seed=i)) for i in range(2)]
    _stop_after(monkeypatch, 5, lambda: os.kill(os.getpid(), signal.SIGTERM))
    before = signal.getsignal(signal.SIGTERM)
    assert tool.main(["--input", *parts, "--output-prefix", str(tmp_path / "out"), "--quiet"]) == 143
    assert "terminated (SIGTERM); no output written" in capsys.readouterr().err
    assert _left(tmp_path, "out") == []
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("first,status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_second_signal_does_not_cut_the_cleanup_short(tmp_path, monkeypatch, capsys, first, status):
    """SIGTERM or Ctrl-C mid-copy, then both again while the temporary files are being removed:
    the later ones are ignored, every temporary file is removed, the handlers are restored."""
    import tools.merge_datasets as tool

    parts = [_part(str(tmp_path / f"p{i}"), numbered_docs(10, seed=i)) for i in range(2)]
    _stop_after(monkeypatch, 5, lambda: os.kill(os.getpid(), first))
    real, again = os.remove, []

    def remove(path):  # the cleanup's first removal: the signals again, before it removes anything
        if str(path).endswith(".tmp") and not again:
            again.append(path)
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)
        real(path)

    monkeypatch.setattr(mg.os, "remove", remove)
    before = [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)]
    assert tool.main(["--input", *parts, "--output-prefix", str(tmp_path / "out"), "--quiet"]) == status
    assert again and "no output written" in capsys.readouterr().err
    assert _left(tmp_path, "out") == []
    assert [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)] == before


def test_stop_while_renaming_leaves_no_dataset(tmp_path, monkeypatch):
    parts = [_part(str(tmp_path / f"p{i}"), numbered_docs(5, seed=i)) for i in range(2)]
    out = str(tmp_path / "out")
    merge(parts[:1], out)  # an older dataset at the output, replaced with --force
    real, n = os.replace, [0]

    def replace(a, b):
        n[0] += 1
        if n[0] == 3:
            raise KeyboardInterrupt
        real(a, b)

    monkeypatch.setattr(mg.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        merge(parts, out, force=True)
    # neither the new dataset nor a mixture with the old one: no .idx, no new file left
    assert _left(tmp_path, "out") == []


def test_cli_argument_errors(tmp_path):
    r = run_tool("merge_datasets.py", ["--input", "a", "--pattern", "x*", "--output-prefix", str(tmp_path / "o")])
    assert r.returncode == 2 and "--pattern needs --input-dir" in r.stderr
    r = run_tool("merge_datasets.py", ["--input", "a", "--allow-gaps", "--output-prefix", str(tmp_path / "o")])
    assert r.returncode == 2 and "--allow-gaps needs --input-dir" in r.stderr
    r = run_tool("merge_datasets.py", ["--input-dir", str(tmp_path / "none"), "--output-prefix", "o"])
    assert r.returncode == 2 and "error: --input-dir" in r.stderr and "is not a directory" in r.stderr


def test_stop_right_after_a_rename_takes_it_back(tmp_path, monkeypatch):
    """A signal between renaming an output into place and recording that (here: raised at the
    end of the rename): the renamed file is removed with the others."""
    parts = [_part(str(tmp_path / f"p{i}"), numbered_docs(5, seed=i)) for i in range(2)]
    real = os.replace

    def replace(a, b):
        real(a, b)
        raise KeyboardInterrupt

    monkeypatch.setattr(mg.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        merge(parts, str(tmp_path / "out"))
    assert _left(tmp_path, "out") == []
