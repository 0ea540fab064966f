"""tools/preprocess_data.py --round-trip-every K: the round-trip check (decode(encode(text)) ==
text) on the documents of every K-th input line only (K=0: none), the same documents whatever
--workers and --partitions, and a report and record that say how many were checked."""
from __future__ import annotations

import json

import pytest

from dept_mega.config import load_config
from dept_mega.data import preprocess as pp
from dept_mega.data.checks import lossy_source_warnings
from dept_mega.data.indexed import tokenizer_record_path
from tests.data_utils import run_tool, synthetic_texts, train_tiny_tokenizer

BAD_LINE = 6  # 0-based input line that is not JSON: a sampled line without a document
LOSSY_LINES = {0, 1, 5, 9, 10, 12, 20, 21, 29}  # lines whose text nmt_nfkc does not give back


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("rts")
    lossy = train_tiny_tokenizer(str(d / "nfkc"), vocab=120, extra=["--normalization", "nmt_nfkc"])
    lossless = train_tiny_tokenizer(str(d / "plain"), vocab=120)
    plain = synthetic_texts(31, seed=7)
    texts = [t.replace(" ", "\n", 1).replace(" ", "  ", 1) if i in LOSSY_LINES else t for i, t in enumerate(plain)]
    src = d / "x.jsonl"
    with open(src, "w", encoding="utf-8") as f:
        for i, t in enumerate(texts):
            f.write("{not json\n" if i == BAD_LINE else json.dumps({"text": t}) + "\n")
    docs = {i: t for i, t in enumerate(texts) if i != BAD_LINE}
    return str(src), docs, lossy, lossless


def _expected(docs: dict, k: int) -> dict:
    """The round_trip record of the nmt_nfkc tokenizer under --round-trip-every k, from the
    definition: lines 0, k, 2k, ... are checked; the LOSSY_LINES among them do not come back."""
    checked = [i for i in docs if k and i % k == 0]
    bad = [i for i in checked if i in LOSSY_LINES]
    size = {i: len(t.encode()) for i, t in docs.items()}
    return {"documents": len(docs), "bytes": sum(size.values()), "checked": len(checked),
            "checked_bytes": sum(size[i] for i in checked), "mismatched_documents": len(bad),
            "mismatched_bytes": sum(size[i] for i in bad),
            "mismatched_decoded_bytes": sum(len(" ".join(docs[i].split()).encode()) for i in bad), "every": k}


def _record(prefix: str) -> dict:
    return json.load(open(tokenizer_record_path(prefix + "_text_document")))


def _warnings(prefix: str, tok: str) -> list[str]:
    cfg = load_config(None, ["dept.local_steps=10", "train.steps=20", "train.eval_iters=0", f"data.tokenizer={tok}",
                             f"data.sources=[{{name: x, prefix: {prefix}_text_document}}]"])
    return lossy_source_warnings(cfg)


def test_every_document_by_default(corpus, tmp_path):
    """K=1 (the default) checks every document, as before the flag: all 10 lossy ones found."""
    src, docs, lossy, _ = corpus
    r = run_tool("preprocess_data.py", ["--input", src, "--tokenizer-model", lossy, "--output-prefix",
                                        str(tmp_path / "d")])
    assert r.returncode == 0, r.stderr
    rec = _record(str(tmp_path / "d"))
    assert rec["lossless"] is False and rec["round_trip"] == _expected(docs, 1)
    assert rec["round_trip"]["mismatched_documents"] == len(LOSSY_LINES)
    assert f"{len(LOSSY_LINES)} of {len(docs)} documents do not round-trip" in r.stderr, r.stderr
    (w,) = _warnings(str(tmp_path / "d"), lossy)
    assert f"({len(LOSSY_LINES)} of {len(docs)} documents (" in w


@pytest.mark.parametrize("workers,partitions", [(1, 1), (2, 1), (1, 3)])
def test_every_third_line_whatever_the_workers(corpus, tmp_path, monkeypatch, workers, partitions):
    """K=3 checks exactly the documents on lines 0, 3, 6, ... (the bad line 6 has none): the same
    counts with small batches spread over 2 workers, or the input cut into 3 partitions."""
    src, docs, lossy, _ = corpus
    monkeypatch.setattr(pp, "BATCH_LINES", 4)  # several batches, not aligned with K
    st = pp.preprocess([src], ["text"], lossy, str(tmp_path / "s"), workers=workers, partitions=partitions,
                       log=None, round_trip_every=3)
    want = _expected(docs, 3)
    assert (want["checked"], want["mismatched_documents"]) == (10, 4)  # lines 0, 9, 12, 21 of 3..30 without 6
    rec = _record(str(tmp_path / "s"))
    assert rec["round_trip"] == want and rec["lossless"] is False
    assert vars(st.round_trip[0]) == {k: v for k, v in want.items() if k != "every"}
    line = pp.round_trip_line("OUT", st.round_trip[0], 3)
    assert line.startswith("[preprocess] warning: OUT: 4 of 10 checked documents of 30 (--round-trip-every 3: "
                           "the documents on input lines 1, 4, 7, ...; 20 not checked) do not round-trip"), line
    (w,) = _warnings(str(tmp_path / "s"), lossy)
    assert "(4 of 10 checked documents of 30 (" in w and "of the checked bytes) do not round-trip" in w


def test_sampled_without_mismatch_is_not_called_lossless(corpus, tmp_path):
    src, docs, _, lossless = corpus
    r = run_tool("preprocess_data.py", ["--input", src, "--tokenizer-model", lossless, "--round-trip-every", "3",
                                        "--output-prefix", str(tmp_path / "g")])
    assert r.returncode == 0, r.stderr
    rec = _record(str(tmp_path / "g"))
    assert rec["lossless"] is None and rec["round_trip"]["checked"] == 10
    assert rec["round_trip"]["mismatched_documents"] == 0 and rec["round_trip"]["every"] == 3
    assert "no mismatch in 10 checked documents of 30 (--round-trip-every 3" in r.stderr, r.stderr
    assert "lossless" not in r.stderr
    assert _warnings(str(tmp_path / "g"), lossless) == []


def test_no_check_is_recorded_as_unchecked(corpus, tmp_path):
    """K=0 decodes nothing: the record says so (lossless null, 0 checked) and the pre-flight
    notes it instead of treating the data as lossless or lossy."""
    src, docs, lossy, _ = corpus
    r = run_tool("preprocess_data.py", ["--input", src, "--tokenizer-model", lossy, "--round-trip-every", "0",
                                        "--output-prefix", str(tmp_path / "n")])
    assert r.returncode == 0, r.stderr
    rec = _record(str(tmp_path / "n"))
    assert rec["lossless"] is None and rec["round_trip"] == _expected(docs, 0)
    assert "round trip not checked (--round-trip-every 0)" in r.stderr, r.stderr
    (w,) = _warnings(str(tmp_path / "n"), lossy)
    assert "the round trip was not checked (tools/preprocess_data.py --round-trip-every 0)" in w, w
    # a sampled run (K > 0) whose sampled lines held no valid document: the note names that K
    path = tokenizer_record_path(str(tmp_path / "n") + "_text_document")
    rec["round_trip"]["every"] = 5
    with open(path, "w") as f:
        json.dump(rec, f)
    (w,) = _warnings(str(tmp_path / "n"), lossy)
    assert "(tools/preprocess_data.py --round-trip-every 5: no valid document on the sampled lines)" in w, w


def test_old_records_read_as_before(corpus, tmp_path):
    """A record written before the flag (no checked, checked_bytes, every): every document was
    checked; a lossy one warns with the same counts."""
    src, docs, lossy, _ = corpus
    pp.preprocess([src], ["text"], lossy, str(tmp_path / "o"), log=None)
    path = tokenizer_record_path(str(tmp_path / "o_text_document"))
    rec = json.load(open(path))
    for k in ("checked", "checked_bytes", "every"):
        rec["round_trip"].pop(k)
    json.dump(rec, open(path, "w"))
    (w,) = _warnings(str(tmp_path / "o"), lossy)
    share = 100.0 * _expected(docs, 1)["mismatched_bytes"] / _expected(docs, 1)["bytes"]
    assert f"({len(LOSSY_LINES)} of {len(docs)} documents ({share:.1f} % of the bytes) do not round-trip" in w, w


@pytest.mark.parametrize("value,says", [("-1", "-1 is negative"), ("2.5", "'2.5' is not an integer"),
                                        ("x", "'x' is not an integer")])
def test_bad_values_are_usage_errors(value, says, capsys):
    import tools.preprocess_data as cli
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(["--input", "a", "--tokenizer-model", "m", "--output-prefix", "o", "--round-trip-every", value])
    assert exc.value.code == 2
    assert f"argument --round-trip-every: {says}" in capsys.readouterr().err
    with pytest.raises(pp.PreprocessError, match=r"--round-trip-every \(-2\) must be an integer >= 0"):
        pp.preprocess([__file__], ["text"], "m", "o", round_trip_every=-2)
