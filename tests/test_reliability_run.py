"""Early, one-line errors (issue 15): token ids outside the vocabulary, empty datasets, a run
directory that is a file or whose checkpoints cannot be written, preprocessing that would write
nothing or cannot write, and a second job on a run directory that another job (or its orphaned
workers) holds."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from dept_mega import train as train_cli
from dept_mega.config import ConfigError, load_config
from tests.data_utils import run_tool, write_docs, write_jsonl
from tests.trainer_utils import ROOT, TINY_STD, ensure_sample_corpus, read_jsonl

QUICK = ["train.steps=1", "train.eval_interval=0", "train.eval_iters=1", "train.save_interval=0",
         "train.log_interval=1"]
EN_TOK = "examples/data/build/tok/en.model"  # 3000 ids; the *_global data use the 8000-id global one


@pytest.fixture(scope="module")
def corpus():
    ensure_sample_corpus()


def _one_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("warning:")]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def test_token_ids_outside_the_vocabulary(corpus, tmp_path, monkeypatch, capsys):
    """Data tokenized with the global tokenizer, a config naming the English one: one line
    naming the prefix, the tokenizer and both numbers, before the model is built."""
    monkeypatch.chdir(ROOT)
    run = str(tmp_path / "run")
    rc = train_cli.main(["--config", TINY_STD, f"train.run_dir={run}", f"data.tokenizer={EN_TOK}", *QUICK])
    line = _one_error(capsys)
    assert rc == 2
    assert "en_global_text_document.bin" in line and EN_TOK in line and "3000 ids" in line, line
    assert "data.sources[0].prefix" in line
    assert not os.path.exists(os.path.join(run, "metrics.jsonl"))


def test_padded_rows_and_the_cached_range(corpus, tmp_path, monkeypatch):
    """An id in the padded rows (3000 <= id < 3072) is outside the vocabulary too; the range
    is cached beside the data; SPEC-OPT checks each source against its own tokenizer."""
    from dept_mega.data.checks import check_sources
    monkeypatch.chdir(ROOT)
    prefix = write_docs(str(tmp_path / "d_text_document"), [[5, 6, 7] * 50, [1, 3001, 2] * 50] * 20)
    cfg = load_config(TINY_STD, [f"data.tokenizer={EN_TOK}", f"data.sources.0.prefix={prefix}"])
    cfg.data.sources = cfg.data.sources[:1]
    with pytest.raises(ConfigError, match=r"token id 3001, but tokenizer .*en.model .* 3000 ids"):
        check_sources(cfg)
    cache = str(tmp_path / "d_text_document.token_range.json")
    assert os.path.exists(cache) and '"max": 3001' in open(cache).read()
    cfg = load_config("examples/tiny/spec_opt.yaml", ["data.sources.1.prefix=examples/data/build/fr_global_text_document"])
    with pytest.raises(ConfigError, match=r"data.sources\[1\].prefix.*fr_global.*fr.model \(data.sources\[1\].tokenizer\)"):
        check_sources(cfg)


def test_empty_dataset_names_the_file(corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    prefix = write_docs(str(tmp_path / "empty_text_document"), [])
    rc = train_cli.main(["--config", TINY_STD, f"train.run_dir={tmp_path / 'run'}",
                         f"data.sources.1.prefix={prefix}", *QUICK])
    line = _one_error(capsys)
    assert rc == 2 and "empty_text_document.idx" in line and "0 documents" in line, line


def test_run_dir_problems_before_step_one(corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    a_file = tmp_path / "not_a_dir"
    a_file.write_text("x")
    assert train_cli.main(["--config", TINY_STD, f"train.run_dir={a_file}", *QUICK]) == 2
    line = _one_error(capsys)
    assert "train.run_dir" in line and "not a directory" in line, line
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").write_text("in the way")  # checkpoints cannot be written below it
    assert train_cli.main(["--config", TINY_STD, f"train.run_dir={run}", "train.steps=4", "train.save_interval=2",
                           "train.eval_interval=0", "train.eval_iters=1"]) == 2
    line = _one_error(capsys)
    assert "cannot write checkpoints" in line and "checkpoints" in line, line
    assert not (run / "metrics.jsonl").exists()  # refused before step 1


def test_init_timeout_is_a_checked_key():
    assert load_config(TINY_STD, ["train.init_timeout_s=30"]).train.init_timeout_s == 30.0
    with pytest.raises(ConfigError, match="train.init_timeout_s"):
        load_config(TINY_STD, ["train.init_timeout_s=0"])


# ------------------------------------------------------------------------ preprocessing


def _preprocess(src, out, *extra):
    return run_tool("preprocess_data.py", ["--input", src, "--json-keys", "text", "--tokenizer-model",
                                           os.path.join(ROOT, EN_TOK), "--output-prefix", out, *extra])


def test_preprocess_refuses_to_write_nothing(corpus, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"nope": 1}\nnot json\n\n')
    for src, what in ((empty, "the input is empty"), (bad, "3 lines read, 3 skipped")):
        r = _preprocess(str(src), str(tmp_path / "o"))
        assert r.returncode == 2, r.stderr
        err = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert len(err) == 1 and err[0].startswith("error: no documents") and what in err[0], r.stderr
        assert not [f for f in os.listdir(tmp_path) if f.startswith("o_")]
    r = _preprocess(str(empty), str(tmp_path / "o"), "--allow-empty")
    assert r.returncode == 0, r.stderr
    assert os.path.exists(tmp_path / "o_text_document.idx")


def test_preprocess_output_that_cannot_be_written(corpus, tmp_path):
    src = write_jsonl(str(tmp_path / "a.jsonl"), ["some text"] * 3)
    (tmp_path / "blocker").write_text("a file, not a directory")
    r = _preprocess(src, str(tmp_path / "blocker" / "out"))
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(err) == 1 and "cannot write" in err[0] and "blocker" in err[0], r.stderr
    (tmp_path / "o2_text_document.bin").mkdir()
    r = _preprocess(src, str(tmp_path / "o2"))
    assert r.returncode == 2 and "o2_text_document.bin is a directory" in r.stderr, r.stderr


# ------------------------------------------------------------------------ one job per run dir


HOLD = ("import sys, time\nfrom dept_mega.rundir import RunLock\nlock = RunLock()\n"
        "getattr(lock, sys.argv[1])(sys.argv[2])\nprint('held', flush=True)\ntime.sleep(120)\n")


def _holder(how, run):
    p = subprocess.Popen([sys.executable, "-c", HOLD, how, run], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_second_job_is_refused(corpus, tmp_path, monkeypatch, capsys):
    """A process holding the run directory (as rank 0 of a job does), then one holding only the
    workers' lock (an orphaned worker of a killed launcher): a new job is refused in one line
    before any work; once they are gone, it runs."""
    monkeypatch.chdir(ROOT)
    run = str(tmp_path / "run")
    os.makedirs(run)
    args = ["--config", TINY_STD, f"train.run_dir={run}", *QUICK]
    for how, says in (("acquire", "in use by another job"), ("join", ".lock.workers")):
        p = _holder(how, run)
        try:
            assert train_cli.main(args) == 2
            line = _one_error(capsys)
            assert says in line, line
            if how == "acquire":
                assert f"pid {p.pid}" in line, line
            else:  # a lock a dead node left on a network file system: safe to remove once no job runs
                assert "a node of that job that died" in line and \
                    f"once no job of this run is running, removing {run}/.lock.workers is safe" in line, line
            assert not os.path.exists(os.path.join(run, "metrics.jsonl"))
        finally:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
    assert train_cli.main(args) == 0
    assert [r["step"] for r in read_jsonl(os.path.join(run, "metrics.jsonl")) if r["kind"] == "train"] == [1]
