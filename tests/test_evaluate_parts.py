"""``python -m dept_mega.evaluate --part test`` (the third weight of ``data.split``) and
``--extra-source NAME=PREFIX`` (held-out data tokenized with the run's global tokenizer, for the
variants with one global table: std, glob, trim; refused for spec / spec_opt with a pointer to
dept_mega.adapt). One-process runs of two tiny sources (tests/test_train_cli.py's setup)."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from dept_mega import evaluate as evaluate_cli
from dept_mega.config import ConfigError, load_config
from dept_mega.data.indexed import tokenizer_record_path
from dept_mega.eval_sources import not_the_runs_config
from tests.data_utils import write_docs
from tests.test_train_cli import _setup, _train_here

SPLIT = "80,10,10"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A finished STD, GLOB and TRIM run (4 steps) under data.split 80,10,10, and extra data: ``a2`` a
    copy of source a's files, ``c`` other documents with ids that a and b never hold (< the
    tokenizer's 120), ``big`` ids past the vocabulary."""
    tmp = tmp_path_factory.mktemp("parts")
    cfg = _setup(tmp, variant="std")
    out = {"cfg": cfg, "tmp": tmp}
    for variant in ("std", "glob", "trim"):
        run = str(tmp / variant)
        res = _train_here("--config", cfg, f"dept.variant={variant}", f"data.split={SPLIT}", f"train.run_dir={run}")
        assert res.returncode == 0, res.stderr
        out[variant] = run
    a = str(tmp / "a_text_document")
    out["a2"] = str(tmp / "a2_text_document")
    for ext in (".bin", ".idx", ".bytes.npy"):
        shutil.copy(a + ext, out["a2"] + ext)
    rng = np.random.default_rng(5)
    for name, hi in (("c", 115), ("big", 130)):
        docs = [rng.integers(3, hi, int(rng.integers(20, 60))).tolist() for _ in range(40)]
        out[name] = write_docs(str(tmp / f"{name}_text_document"), docs, nbytes=[3 * len(d) for d in docs])
    return out


def _evaluate(capsys, run, *args):
    """(status, the record or None, stderr) of ``dept_mega.evaluate`` in this process."""
    out = os.path.join(run, "e.json")
    if os.path.exists(out):
        os.remove(out)
    capsys.readouterr()
    status = evaluate_cli.main(["--run-dir", run, "--out", out, *args])
    err = capsys.readouterr().err
    return status, (json.load(open(out)) if status == 0 else None), err


def _error(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert lines, err
    return lines[-1]


def test_test_part_is_the_documents_of_the_third_weight(runs, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    status, test, _ = _evaluate(capsys, runs["std"], "--part", "test")
    assert status == 0 and test["part"] == "test"
    _, valid, _ = _evaluate(capsys, runs["std"])
    assert valid["part"] == "valid" and set(valid["by_source"]) == set(test["by_source"]) == {"a", "b"}
    assert valid["by_source"] != test["by_source"]
    # 80,10,10's test part is its last 10 % of the documents: 90,10's validation part (another
    # split than the run's is evaluated, with a warning: the parts may hold trained documents)
    _, last, err = _evaluate(capsys, runs["std"], "data.split=90,10")
    assert last["by_source"] == test["by_source"]
    assert "warning: config key 'data.split': '90,10' is not the split the checkpoint was trained under " \
           "('80,10,10')" in err, err
    assert "warning" not in _evaluate(capsys, runs["std"], "data.split=8,1,1")[2]  # the same shares


@pytest.mark.parametrize("split", ["90,10", "90,10,0"])
def test_a_split_without_a_test_part_is_refused_naming_data_split(runs, capsys, monkeypatch, split):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    status, _, err = _evaluate(capsys, runs["std"], "--part", "test", f"data.split={split}")
    assert status == 2
    assert _error(err).startswith(f"error: config key 'data.split': '{split}' has no test part"), err


def test_a_test_part_without_a_sample_is_refused(runs):
    from dept_mega.data.checks import check_sources
    cfg = load_config(os.path.join(runs["std"], "config.yaml"), ["data.split=80,19,1", "model.seq_length=64"])
    check_sources(cfg)  # the validation part: 7 of the 40 documents of 20 to 60 tokens
    with pytest.raises(ConfigError, match=r"^config key 'data.split': source 'a': its test part \(1 of 40 "):
        check_sources(cfg, "test")


def _expected_bytes(prefix: str, which: str, samples: int) -> tuple[int, int]:
    """(tokens, bytes) of the first ``samples`` sequences of a part (ValidationBatches' order)."""
    from dept_mega.data.gpt_dataset import GPTDataset
    ds = GPTDataset(prefix, 16, SPLIT, which, shuffle=False)
    n = min(samples, ds.samples_per_epoch)
    return n * 16, int(round(sum(ds.sample_bytes(i) for i in range(n))))


@pytest.mark.parametrize("variant,part", [("std", "valid"), ("glob", "test"), ("trim", "test")])
def test_extra_sources_are_evaluated_with_the_global_table(runs, capsys, monkeypatch, variant, part):
    """A copy of a run source's data gives that source's numbers (TRIM: the softmax over the ids of
    its data, with φ's rows, as its own source); other data is read from the same part, and
    TRIM warns of its ids whose rows of φ no round updated."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    _, plain, _ = _evaluate(capsys, runs[variant], "--part", part)
    status, got, err = _evaluate(capsys, runs[variant], "--part", part, "--extra-source", f"a2={runs['a2']}",
                                 "--extra-source", f"c={runs['c']}")
    assert status == 0, err
    assert list(got["by_source"]) == ["a", "b", "a2", "c"] and got["part"] == part
    for name in ("a", "b"):
        assert got["by_source"][name] == plain["by_source"][name]
    assert got["by_source"]["a2"] == got["by_source"]["a"]
    c = got["by_source"]["c"]
    assert (c["tokens"], c["bytes"]) == _expected_bytes(runs["c"], part, 4)  # eval_iters 1 × batch 4
    assert c["loss"] != got["by_source"]["a"]["loss"]
    notes = [ln for ln in err.splitlines() if ln.startswith("warning: --extra-source")]
    if variant == "trim":
        counts = np.bincount(np.concatenate([np.fromfile(p + ".bin", dtype=np.uint16)
                                             for p in (runs["c"], str(runs["tmp"] / "a_text_document"),
                                                       str(runs["tmp"] / "b_text_document"))]))
        assert len(notes) == 1 and notes[0].startswith(f"warning: --extra-source c={runs['c']}: "), err
        fresh = len(np.flatnonzero(counts[100:]))  # a and b hold ids < 100
        assert f": {fresh} of its " in notes[0] and "initial values" in notes[0], notes
    else:
        assert notes == [], err


def test_extra_source_refusals(runs, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    run, tok = runs["std"], load_config(os.path.join(runs["std"], "config.yaml")).data.tokenizer

    def refused(*args):
        status, _, err = _evaluate(capsys, run, *args)
        assert status == 2, err
        return _error(err)

    assert refused("--extra-source", f"x={runs['big']}").startswith(
        f"error: --extra-source x={runs['big']}: {runs['big']}.bin holds token id 12"), "ids past the vocabulary"
    assert "the data was made with another tokenizer" in refused("--extra-source", f"x={runs['big']}")
    assert "is a source of the run" in refused("--extra-source", f"a={runs['c']}")
    assert "given twice" in refused("--extra-source", f"x={runs['c']}", "--extra-source", f"x={runs['a2']}")
    assert "expected NAME=PREFIX" in refused("--extra-source", runs["c"])
    assert "does not exist" in refused("--extra-source", f"x={runs['c']}_missing")
    # the tokenizer record's checksum, as a training launch checks it
    from dept_mega.data.tokenizer import model_sha256
    record = tokenizer_record_path(runs["c"])
    try:
        with open(record, "w") as f:
            json.dump({"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": "/else/other.model",
                       "sha256": "0" * 64}, f)
        err = refused("--extra-source", f"c={runs['c']}")
        assert err.startswith(f"error: --extra-source c={runs['c']}: ") and "tokenized with /else/other.model" in err
        with open(record, "w") as f:
            json.dump({"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": tok,
                       "sha256": model_sha256(tok)}, f)
        assert _evaluate(capsys, run, "--extra-source", f"c={runs['c']}")[0] == 0
    finally:
        os.remove(record)
    # sources that own their embeddings: adapt
    err = refused("dept.variant=spec", "--extra-source", f"c={runs['c']}")
    assert err.startswith("error: --extra-source: under dept.variant spec each source has its own token embeddings")
    assert "python -m dept_mega.adapt" in err


@pytest.mark.parametrize("variant", ["std", "glob", "trim", "spec", "spec_opt"])
def test_the_advice_for_other_sources_follows_the_variant(variant):
    advice = not_the_runs_config(variant)
    if variant in ("spec", "spec_opt"):
        assert "python -m dept_mega.adapt" in advice and "--extra-source" not in advice
    else:
        assert "--extra-source NAME=PREFIX" in advice and "adapt" not in advice
