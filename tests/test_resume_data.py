"""A resume checks which data it reads (``step_N/depends.json``: ``data``): data.split,
train.seed and each source's files by content (a moved file is the same data). A change is one
error naming each changed key with what it was and is, unless train.allow_data_change (then each
change is logged); a checkpoint that does not record its data resumes with a note. An
evaluation reads weights only and is not refused for other data."""
from __future__ import annotations

import json
import os
import shutil
from types import SimpleNamespace

import numpy as np
import yaml

from dept_mega.data import identity
from dept_mega.data.identity import HASHED_BYTES, data_differences, data_fingerprint, source_identity
from dept_mega.manifest import seal
from tests.data_utils import write_docs
from tests.test_train_cli import _copy_run, _train_here, trained  # noqa: F401 - the shared finished run

CHANGED = ["data.split=50,50", "train.seed=99"]


def _prefixes(cfg_path: str) -> dict[str, str]:
    with open(cfg_path, encoding="utf-8") as f:
        return {s["name"]: s["prefix"] for s in yaml.safe_load(f)["data"]["sources"]}


def _docs(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 100, int(rng.integers(20, 60))).tolist() for _ in range(n)]


def test_identity_is_the_content_not_the_path(tmp_path):
    a = write_docs(str(tmp_path / "a"), _docs(30, 0))
    os.makedirs(tmp_path / "elsewhere")
    moved = str(tmp_path / "elsewhere" / "renamed")
    for ext in (".bin", ".idx"):
        shutil.copy(a + ext, moved + ext)
    assert source_identity(a) == source_identity(moved) and source_identity(a)["documents"] == 30
    other = write_docs(str(tmp_path / "b"), _docs(30, 1))  # same number of documents, other tokens
    assert source_identity(other)["sha256"] != source_identity(a)["sha256"]
    assert source_identity(str(tmp_path / "missing")) is None


def test_identity_reads_a_bounded_part_of_a_large_corpus(tmp_path, monkeypatch):
    """A few MB of tokens: the identity reads the header and HASHED_BYTES from each end of each
    file, not the files (a multi-TB corpus costs the same)."""
    prefix = write_docs(str(tmp_path / "big"), _docs(40_000, 2))
    assert os.path.getsize(prefix + ".bin") > 16 * HASHED_BYTES and os.path.getsize(prefix + ".idx") > 8 * HASHED_BYTES
    read = []
    real_open = open

    class Counting:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def read(self, n=-1):
            data = self.f.read(n)
            read.append(len(data))
            return data

        def seek(self, *args):
            return self.f.seek(*args)

    monkeypatch.setattr(identity, "open", lambda *a, **k: Counting(real_open(*a, **k)), raising=False)
    ident = source_identity(prefix)
    assert ident is not None and ident["documents"] == 40_000
    assert sum(read) == 4 * HASHED_BYTES, sum(read)


def test_split_is_compared_by_its_shares():
    cfg = SimpleNamespace(data=SimpleNamespace(sources=[]))

    def now(split, seed=1):
        return {"data.split": split, "train.seed": seed, "sources": {}}
    assert data_differences(now("95,5"), now("19,1"), cfg) == []
    assert data_differences(now("95,5"), now("95,5,0"), cfg) == []
    rows = data_differences(now("95,5"), now("50,50", 2), cfg)
    assert [k for k, _ in rows] == ["data.split", "train.seed"], rows
    assert "'95,5'" in rows[0][1] and "'50,50'" in rows[0][1] and "1" in rows[1][1] and "2" in rows[1][1]
    assert data_differences(None, now("95,5"), cfg) is None  # not recorded: not checked


def test_resume_on_other_data_is_refused_naming_each_change(tmp_path, trained):  # noqa: F811
    """The audit's case: source a's prefix pointed at source b's files, another split and seed:
    the launch and --check refuse, naming the three keys with the checkpoint's and this launch's
    values and how to go on knowingly; nothing is trained or written."""
    cfg, run = _copy_run(trained, tmp_path / "run")
    b = _prefixes(cfg)["b"]
    over = [run, f"data.sources.0.prefix={b}", *CHANGED, "train.steps=6"]
    check = _train_here("--config", cfg, *over, "--check", "--world-size", "1")
    launch = _train_here("--config", cfg, *over)
    step = os.path.join(str(tmp_path / "run"), "checkpoints", "step_4")
    for r in (check, launch):
        assert r.returncode == 2, (r.stdout, r.stderr)
        err = r.stderr.strip()
        assert err.startswith(f"error: 3 config keys differ from checkpoint {step}; "), err
        assert "set train.allow_data_change=true" in err.split("\n")[0], err
        lines = err.split("\n")[1:]
        assert [ln.split("'")[1] for ln in lines] == ["data.split", "train.seed", "data.sources[0].prefix"], lines
        assert "'90,10'" in lines[0] and "'50,50'" in lines[0] and "1234" in lines[1] and "99" in lines[1]
        assert "source 'a'" in lines[2] and "a_text_document" in lines[2] and "b_text_document" in lines[2], lines[2]
        assert "40 documents" in lines[2] and "other data" in lines[2], lines[2]
    assert sorted(os.listdir(os.path.join(str(tmp_path / "run"), "checkpoints"))) == ["latest", "step_4"]
    assert os.listdir(os.path.join(str(tmp_path / "run"), "configs")) == ["launch_1.yaml"]  # the refused: none


def test_moved_data_is_the_same_data(tmp_path, trained):  # noqa: F811
    cfg, run = _copy_run(trained, tmp_path / "run")
    moved = []
    for i, (name, prefix) in enumerate(_prefixes(cfg).items()):
        dest = str(tmp_path / "moved" / f"{name}_copy")
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        for ext in (".bin", ".idx", ".bytes.npy"):
            shutil.copy(prefix + ext, dest + ext)
        moved.append(f"data.sources.{i}.prefix={dest}")
    r = _train_here("--config", cfg, run, *moved, "data.split=9,1", "train.steps=6", "--check", "--world-size", "1")
    assert r.returncode == 0, r.stderr
    assert "depends on match, and the data it read" in r.stdout and "warning: " not in r.stderr, (r.stdout, r.stderr)


def test_allow_data_change_resumes_and_logs_each_change(tmp_path, trained):  # noqa: F811
    """train.allow_data_change=true: the launch trains on, a warning per change; the next
    checkpoint records the new data, so that a later launch with it resumes without the key."""
    cfg, run = _copy_run(trained, tmp_path / "run")
    b = _prefixes(cfg)["b"]
    over = [run, f"data.sources.0.prefix={b}", "data.split=50,50", "train.steps=6"]
    r = _train_here("--config", cfg, *over, "train.allow_data_change=true")
    assert r.returncode == 0, r.stderr
    warned = [ln for ln in r.stderr.splitlines() if "resuming on changed data (train.allow_data_change=true)" in ln]
    assert [ln.split("config key '")[1].split("'")[0] for ln in warned] == ["data.split", "data.sources[0].prefix"], \
        r.stderr
    with open(os.path.join(str(tmp_path / "run"), "checkpoints", "step_6", "depends.json"), encoding="utf-8") as f:
        data = json.load(f)["data"]
    assert data["data.split"] == "50,50" and data["sources"]["a"]["identity"] == source_identity(b)
    again = _train_here("--config", cfg, *over, "train.steps=8", "--check", "--world-size", "1")
    assert again.returncode == 0 and "and the data it read" in again.stdout, again.stderr


def test_checkpoint_without_a_data_record_resumes_with_a_note(tmp_path, trained):  # noqa: F811
    """A checkpoint written before depends.json recorded the data: resumed, and the log says
    its data is not checked (here even under another split)."""
    cfg, run = _copy_run(trained, tmp_path / "run")
    step = os.path.join(str(tmp_path / "run"), "checkpoints", "step_4")
    path = os.path.join(step, "depends.json")
    with open(path, encoding="utf-8") as f:
        depends = json.load(f)
    del depends["data"]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(depends, f)
    os.remove(os.path.join(step, "manifest.json"))
    seal(step, 4)
    note = f"warning: checkpoint {step} does not record which data it read"
    check = _train_here("--config", cfg, run, "data.split=50,50", "train.steps=6", "--check", "--world-size", "1")
    assert check.returncode == 0 and note in check.stderr, check.stderr
    r = _train_here("--config", cfg, run, "data.split=50,50", "train.steps=6")
    assert r.returncode == 0 and note in r.stderr, r.stderr


def test_evaluate_is_not_refused_for_other_data(tmp_path, trained):  # noqa: F811
    """dept_mega.evaluate reads the weights only: another split is an evaluation on it, not a
    resume of the data positions."""
    from dept_mega import evaluate as evaluate_cli
    _cfg, _run = _copy_run(trained, tmp_path / "run")
    out = str(tmp_path / "eval.json")
    assert evaluate_cli.main(["--run-dir", str(tmp_path / "run"), "--out", out, "data.split=50,50"]) == 0
    assert json.load(open(out))["kind"] == "eval"


def test_fingerprint_records_split_seed_and_sources(tmp_path):
    a = write_docs(str(tmp_path / "a"), _docs(10, 0))
    cfg = SimpleNamespace(data=SimpleNamespace(split="95,5", sources=[SimpleNamespace(name="a", prefix=a)]),
                          train=SimpleNamespace(seed=7, global_batch_size=16))
    fp = data_fingerprint(cfg)
    assert fp == {"data.split": "95,5", "train.seed": 7, "train.global_batch_size": 16,
                  "sources": {"a": {"prefix": a, "identity": source_identity(a)}}}


def test_every_save_of_a_launch_records_the_data_it_opened(tmp_path, monkeypatch):
    """A source's files replaced while a launch runs (its readers keep the old mapping): the
    launch's later checkpoints still record the data it opened, so a resume on the new files is
    refused (train.allow_data_change) rather than taken for the data the positions index."""
    from dept_mega.checkpoint import Checkpointer
    a = write_docs(str(tmp_path / "a"), _docs(10, 0))
    cfg = SimpleNamespace(data=SimpleNamespace(split="95,5", sources=[SimpleNamespace(name="a", prefix=a)],
                                               tokenizer=None),
                          train=SimpleNamespace(seed=7, global_batch_size=4), dept=SimpleNamespace(variant="std"))
    monkeypatch.setattr("dept_mega.checkpoint.fingerprint",
                        lambda c, cache=None: {"config": {"x": 1}, "tokenizers": {}, "data": data_fingerprint(c)})
    ckpt = Checkpointer(str(tmp_path / "run"))
    opened = ckpt.depends(cfg)
    write_docs(a, _docs(10, 1))  # replaced in place
    assert source_identity(a) != opened["data"]["sources"]["a"]["identity"]
    assert ckpt.depends(cfg) == opened
    assert Checkpointer(str(tmp_path / "run")).depends(cfg)["data"] != opened["data"]  # the next launch: the new files


def test_another_batch_is_another_data_position_under_dept(tmp_path, trained):  # noqa: F811
    """DEPT keeps each source's data position as the steps it was trained and reads it back as
    steps × train.global_batch_size: a resume with another batch would skip (or repeat) every
    source's data silently (a review's finding: 256 -> 512 left half of it untrained). The
    launch and --check refuse it naming the key, as other data; allow_data_change goes on with
    a note. STD's blend keeps the samples it read, so another batch continues it: not refused."""
    cfg, run = _copy_run(trained, tmp_path / "run")
    over = [run, "train.global_batch_size=8", "train.steps=6"]
    for r in (_train_here("--config", cfg, *over, "--check", "--world-size", "1"), _train_here("--config", cfg, *over)):
        assert r.returncode == 2, (r.stdout, r.stderr)
        assert r.stderr.startswith("error: config key 'train.global_batch_size' differs from checkpoint "), r.stderr
        assert "trained steps × 4 sequences, this launch reads them × 8" in r.stderr, r.stderr
    r = _train_here("--config", cfg, *over, "train.allow_data_change=true", "--check", "--world-size", "1")
    assert r.returncode == 0 and "config key 'train.global_batch_size'" in r.stderr, r.stderr
    std = SimpleNamespace(dept=SimpleNamespace(variant="std"), data=SimpleNamespace(sources=[]))
    glob = SimpleNamespace(dept=SimpleNamespace(variant="glob"), data=SimpleNamespace(sources=[]))

    def rec(batch):
        return {"data.split": "95,5", "train.seed": 1, "train.global_batch_size": batch, "sources": {}}
    assert data_differences(rec(4), rec(8), std) == [] and len(data_differences(rec(4), rec(8), glob)) == 1


def test_the_round_plans_inputs_are_checked_at_a_resume(tmp_path, trained):  # noqa: F811
    """DEPT recomputes every source's data position from the round plans, which the sources'
    weights and groups draw: another weight moved past positions silently (a review's
    finding: weights 1,1,1,1 -> 1,1,1,3 moved them all); dept.body_optimizer_state decides what
    the stored sources' state holds. Each is refused naming the key, with both values."""
    cfg, run = _copy_run(trained, tmp_path / "run")
    r = _train_here("--config", cfg, run, "dept.sampling=weights", "data.sources.1.weight=3",
                    "dept.body_optimizer_state=source", "train.steps=6", "--check", "--world-size", "1")
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().split("\n")
    assert lines[0].startswith("error: 3 config keys differ from checkpoint "), r.stderr
    assert lines[1].startswith("  config key 'dept.sampling': ") and lines[2:] == [
        "  config key 'dept.body_optimizer_state': the checkpoint has 'group', this launch has 'source'",
        "  config key 'data.sources[].weight': the checkpoint has [1.0, 1.0], this launch has [1.0, 3.0]"], lines
