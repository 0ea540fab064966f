"""Checkpoint integrity (issue 15): a damaged newest checkpoint is reported in one line naming
the file and the newest verified one before it is used; missing parts are errors; a config the
checkpoint depends on is checked; per-rank files load with weights_only=True; metrics.jsonl
continues from the checkpoint; files, directories and `latest` are fsynced."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from dept_mega import evaluate as evaluate_cli
from dept_mega import train as train_cli
from dept_mega.manifest import FORMAT, CheckpointError, seal
from tests.tool_run import run_tool
from tests.trainer_utils import without_tensorboard_warning, ROOT, TINY_STD, ensure_sample_corpus, read_jsonl

COMMON = ["train.log_interval=1", "train.eval_iters=1", "train.eval_interval=0", "train.save_interval=2",
          "train.steps=6"]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """A 6-step STD run on the sample corpus with checkpoints at steps 2, 4 and 6."""
    ensure_sample_corpus()
    run = str(tmp_path_factory.mktemp("reliability") / "base")
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        torch.set_num_threads(1)
        assert train_cli.main(["--config", TINY_STD, f"train.run_dir={run}", *COMMON]) == 0
    finally:
        os.chdir(cwd)
    return run


def _copy(base_run, tmp_path, name="run"):
    run = str(tmp_path / name)
    shutil.copytree(base_run, run)
    return run


def _step(run, step):
    return os.path.join(run, "checkpoints", f"step_{step}")


def _flip_4k(path):
    data = bytearray(open(path, "rb").read())
    mid = len(data) // 2
    for i in range(mid, min(mid + 4096, len(data))):
        data[i] ^= 0xFF
    open(path, "wb").write(bytes(data))


def _distcp(run, step):
    return os.path.join(_step(run, step), next(n for n in sorted(os.listdir(_step(run, step)))
                                               if n.endswith(".distcp")))


def _damage(run, kind):
    """Damage the newest checkpoint (step 6) or `latest`; returns (file named, step expected)."""
    s6 = _step(run, 6)
    if kind == "flip_4k_distcp":
        path = _distcp(run, 6)
        _flip_4k(path)
        return os.path.basename(path), 4
    if kind == "truncated_distcp":
        path = _distcp(run, 6)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        return os.path.basename(path), 4
    if kind == "bad_json":
        path = os.path.join(s6, "group0.json")
        n = os.path.getsize(path)
        open(path, "w").write(("{not json" + " " * n)[:n])
        return "group0.json", 4
    if kind == "missing_file":
        os.remove(os.path.join(s6, "rng_tp0_pp0.pt"))
        return "rng_tp0_pp0.pt", 4
    if kind == "missing_rng_resealed":
        # as a writer that skipped the dropout streams would leave it: consistent manifest
        os.remove(os.path.join(s6, "rng_tp0_pp0.pt"))
        seal(s6, 6)
        return "rng_tp0_pp0.pt", 4
    if kind == "unlisted_distcp":  # a data file the manifest has no checksum of
        path = _distcp(run, 6)
        man = json.load(open(os.path.join(s6, "manifest.json")))
        del man["files"][os.path.basename(path)]
        json.dump(man, open(os.path.join(s6, "manifest.json"), "w"))
        return os.path.basename(path), 4
    if kind == "no_manifest":
        os.remove(os.path.join(s6, "manifest.json"))
        return "manifest.json", 4
    if kind == "renamed_copy":  # step_4 copied by hand as step_6: its manifest records step 4
        shutil.rmtree(s6)
        shutil.copytree(_step(run, 4), s6)
        return "manifest.json", 4
    if kind == "latest_garbage":
        open(os.path.join(run, "checkpoints", "latest"), "w").write("\x00garbage\n")
        return "latest", 6
    if kind == "latest_missing_step":
        open(os.path.join(run, "checkpoints", "latest"), "w").write("8\n")
        return "step_8", 6
    raise ValueError(kind)


KINDS = ["flip_4k_distcp", "truncated_distcp", "bad_json", "missing_file", "missing_rng_resealed", "unlisted_distcp",
         "no_manifest",
         "renamed_copy", "latest_garbage", "latest_missing_step"]


@pytest.mark.parametrize("kind", KINDS)
def test_damaged_checkpoint_is_named_and_the_previous_one_is_used(base_run, tmp_path, monkeypatch, capsys, kind):
    monkeypatch.chdir(ROOT)
    run = _copy(base_run, tmp_path)
    named, want_step = _damage(run, kind)
    out = str(tmp_path / "eval.json")
    capsys.readouterr()
    assert evaluate_cli.main(["--run-dir", run, "--out", out, "--eval-iters", "1"]) == 0
    err = capsys.readouterr().err
    warnings = [ln for ln in err.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1 and named in warnings[0], err
    assert "Traceback" not in err
    assert json.load(open(out))["step"] == want_step


def test_resume_falls_back_and_continues_exactly(base_run, tmp_path, monkeypatch, capsys):
    """4 KiB flipped inside a .distcp file: the run resumes from step 4 (not the corrupted 6)
    and its steps 5 and 6 equal the uninterrupted run's."""
    monkeypatch.chdir(ROOT)
    run = _copy(base_run, tmp_path)
    _flip_4k(_distcp(run, 6))
    capsys.readouterr()
    assert train_cli.main(["--config", TINY_STD, f"train.run_dir={run}", *COMMON]) == 0
    cap = capsys.readouterr()
    assert "resumed from" in cap.out and "step_4" in cap.out, cap.out
    notes = [ln for ln in without_tensorboard_warning(cap.err).splitlines() if ln.startswith("warning:")]
    assert notes[0].count(".distcp") == 1
    base = [r for r in read_jsonl(os.path.join(base_run, "metrics.jsonl")) if r["kind"] == "train"]
    got = [r for r in read_jsonl(os.path.join(run, "metrics.jsonl")) if r["kind"] == "train"]
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(got, base):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-9), a["step"]


def test_metrics_continue_from_the_checkpoint(base_run, tmp_path, monkeypatch, capsys):
    """A crash after step 6 was logged but before its checkpoint: the resumed run writes steps
    5 and 6 again; metrics.jsonl holds each step once and summarize_runs counts tokens once."""
    monkeypatch.chdir(ROOT)
    run = _copy(base_run, tmp_path)
    shutil.rmtree(_step(run, 6))
    open(os.path.join(run, "checkpoints", "latest"), "w").write("4\n")
    with open(os.path.join(run, "metrics.jsonl"), "a") as f:
        f.write('{"kind": "train", "step": 7, "lo')  # a record cut by the crash
    assert train_cli.main(["--config", TINY_STD, f"train.run_dir={run}", *COMMON]) == 0
    assert "dropped" in capsys.readouterr().out
    recs = read_jsonl(os.path.join(run, "metrics.jsonl"))
    steps = [(r["kind"], r["step"]) for r in recs]
    assert len(steps) == len(set(steps)), steps
    assert steps == [(r["kind"], r["step"]) for r in read_jsonl(os.path.join(base_run, "metrics.jsonl"))]

    def tokens(d):
        p = run_tool("tools/summarize_runs.py", d, "--json", str(tmp_path / "s.json"), capsys=capsys,
                     monkeypatch=monkeypatch)
        assert p.returncode == 0, p.stderr
        return json.load(open(tmp_path / "s.json"))[0]["train_tokens"]

    assert tokens(run) == tokens(base_run) == 6 * 16 * 64


def test_summarize_runs_takes_the_last_record_of_a_step(base_run, tmp_path, capsys, monkeypatch):
    """A metrics.jsonl from before the fix (steps repeated after a resume): each step counts
    once, the later record wins, and the tool says so."""
    run = _copy(base_run, tmp_path)
    recs = read_jsonl(os.path.join(run, "metrics.jsonl"))
    again = [dict(r, loss=1.0) for r in recs if r["kind"] == "train" and r["step"] > 4]
    with open(os.path.join(run, "metrics.jsonl"), "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in again)
    p = run_tool("tools/summarize_runs.py", run, "--json", str(tmp_path / "s.json"), capsys=capsys,
                 monkeypatch=monkeypatch)
    assert p.returncode == 0, p.stderr
    summary = json.load(open(tmp_path / "s.json"))[0]
    assert summary["train_tokens"] == 6 * 16 * 64 and summary["final_train_loss"] == 1.0
    assert "2 repeated" in p.stderr


def test_no_usable_checkpoint_is_one_error_line(base_run, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    run = _copy(base_run, tmp_path)
    for s in (2, 4, 6):
        os.remove(os.path.join(_step(run, s), "manifest.json"))
    before = open(os.path.join(run, "metrics.jsonl")).read()
    capsys.readouterr()
    assert train_cli.main(["--config", TINY_STD, f"train.run_dir={run}", *COMMON]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "no complete, verified checkpoint" in lines[0] and "Traceback" not in err, err
    assert open(os.path.join(run, "metrics.jsonl")).read() == before
    assert evaluate_cli.main(["--run-dir", run, "--out", str(tmp_path / "e.json")]) == 2
    assert capsys.readouterr().err.startswith("error: no complete, verified checkpoint")
    # an explicit step is that step or an error
    assert evaluate_cli.main(["--run-dir", run, "--step", "4", "--out", str(tmp_path / "e.json")]) == 2
    assert "step_4/manifest.json is missing" in capsys.readouterr().err


def test_config_change_is_one_error_naming_the_key(base_run, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    run = _copy(base_run, tmp_path)
    capsys.readouterr()
    rc = train_cli.main(["--config", TINY_STD, f"train.run_dir={run}", *COMMON[:-1], "train.steps=8",
                         "model.hidden_size=128"])
    err = without_tensorboard_warning(capsys.readouterr().err)
    assert rc == 2 and err.startswith("error: config key 'model.hidden_size'") and err.count("\n") == 1, err
    assert "64" in err and "128" in err


def test_tokenizer_is_checked_by_content(base_run, tmp_path, monkeypatch):
    """The tokenizer the checkpoint was trained with: moving the file is fine, another
    tokenizer (even of the same size) is a ConfigError naming data.tokenizer."""
    from dept_mega.config import ConfigError, load_config
    from dept_mega.resume import check_depends
    monkeypatch.chdir(ROOT)
    cfg = load_config(TINY_STD, [f"train.run_dir={base_run}"])
    moved = str(tmp_path / "moved.model")
    shutil.copy(cfg.data.tokenizer, moved)
    check_depends(load_config(TINY_STD, [f"data.tokenizer={moved}"]), _step(base_run, 6))
    other = "examples/data/build/tok/en.model"
    with pytest.raises(ConfigError, match=r"^config key 'data.tokenizer' differs .*en.model"):
        check_depends(load_config(TINY_STD, [f"data.tokenizer={other}"]), _step(base_run, 6))


@pytest.mark.parametrize("overrides,want", [
    (["dept.local_steps=4", "model.hidden_size=128"],
     ["config key 'model.hidden_size': the checkpoint has 64, this launch has 128",
      "config key 'dept.local_steps': the checkpoint has 100, this launch has 4"]),
    (["data.tokenizer=examples/data/build/tok/en.model", "model.seq_length=32", "model.num_layers=3"],
     ["config key 'model.num_layers': the checkpoint has 2, this launch has 3",
      "config key 'model.seq_length': the checkpoint has 64, this launch has 32",
      "config key 'data.tokenizer': the checkpoint was trained with tokenizer "]),
])
def test_every_changed_key_is_named_at_once(base_run, monkeypatch, overrides, want):
    """Several keys changed against the checkpoint: one ConfigError, one line per key with both
    values, in depends.json's key order (the tokenizers last), whatever the order of the
    overrides."""
    from dept_mega.config import ConfigError, load_config
    from dept_mega.resume import check_depends
    monkeypatch.chdir(ROOT)
    step = _step(base_run, 6)
    with pytest.raises(ConfigError) as exc:
        check_depends(load_config(TINY_STD, overrides), step)
    head, *lines = str(exc.value).split("\n")
    assert head == (f"{len(want)} config keys differ from checkpoint {step}; resume with the checkpoint's values, "
                    "or start a new train.run_dir:"), head
    assert len(lines) == len(want) and all(ln.startswith("  " + w) for ln, w in zip(lines, want)), lines


def test_fsync_of_files_directories_and_latest(tmp_path, monkeypatch):
    """Every file of a saved checkpoint, the step directory after the rename, and `latest`
    reach stable storage (os.fsync on each)."""
    from tests.test_dept_checkpoint import _make_opt
    from tests.dept_utils import tiny_config
    synced = []
    real = os.fsync

    def spy(fd):
        synced.append(os.path.realpath(os.readlink(f"/proc/self/fd/{fd}")))
        return real(fd)

    cfg = tiny_config({"dept": {"variant": "spec", "local_steps": 1},
                       "train": {"steps": 1, "save_interval": 1, "eval_interval": 0, "run_dir": str(tmp_path)}})
    loop, _ = _make_opt(cfg, str(tmp_path))
    monkeypatch.setattr(os, "fsync", spy)
    loop.run()
    ck = os.path.realpath(tmp_path / "checkpoints")
    step = os.path.join(ck, "step_1")
    files = [os.path.join(step, n) for n in os.listdir(step)]
    assert len(files) >= 6
    missing = [f for f in files if f not in synced and f.replace("/step_1/", "/step_1.tmp/") not in synced]
    assert not missing, missing
    assert ck in synced  # the directory holding the renamed step_1 and latest
    assert open(os.path.join(ck, "latest")).read() == "1\n"
    assert os.path.join(ck, "latest.tmp") in synced


# ------------------------------------------------------------------ DEPT checkpoints (hooks)


def _dept_checkpoint(tmp_path):
    from tests.test_dept_checkpoint import _make_opt
    from tests.dept_utils import tiny_config
    cfg = tiny_config({"dept": {"variant": "spec", "local_steps": 1},
                       "train": {"steps": 1, "save_interval": 1, "eval_interval": 0, "run_dir": str(tmp_path)}})
    loop, _ = _make_opt(cfg, str(tmp_path))
    loop.run()
    return loop


class _Payload:
    """A pickle that runs a command when unpickled without weights_only."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_per_rank_files_load_safely(tmp_path):
    """A crafted rng_tp0_pp0.pt (the dropout streams; with a matching manifest, as an attacker
    would leave it) is refused without running its code; an unreadable one is one line naming
    the file."""
    from dept_mega.checkpoint import load_weights
    loop = _dept_checkpoint(tmp_path)
    step = tmp_path / "checkpoints" / "step_1"
    load_weights(loop.trainer, str(tmp_path), 1, hooks=loop.hooks)  # the real file loads with weights_only
    marker = tmp_path / "pwned"
    assert (step / "rng_tp0_pp0.pt").exists()
    torch.save({"default": _Payload(str(marker))}, step / "rng_tp0_pp0.pt")
    seal(str(step), 1)
    with pytest.raises(Exception) as exc:
        load_weights(loop.trainer, str(tmp_path), 1, hooks=loop.hooks)
    assert not marker.exists(), "the checkpoint ran code while loading"
    assert isinstance(exc.value, CheckpointError) and "rng_tp0_pp0.pt" in str(exc.value), exc.value
    (step / "rng_tp0_pp0.pt").write_bytes(b"garbage" * 100)
    seal(str(step), 1)
    with pytest.raises(CheckpointError, match="rng_tp0_pp0.pt"):
        load_weights(loop.trainer, str(tmp_path), 1, hooks=loop.hooks)


def test_missing_group_file_is_named(tmp_path):
    """A 2-group DEPT checkpoint whose group1.json is gone: the error names that file (it used
    to count the group files and advise launching 1 process, which then resumed 2 groups as
    one). Format 1 expects the file even when the manifest does not list it."""
    from dept_mega.checkpoint import load_weights
    from tests.test_dept_checkpoint import _as_if_written_by
    loop = _dept_checkpoint(tmp_path)
    step = tmp_path / "checkpoints" / "step_1"
    _as_if_written_by(step, groups=2)
    os.remove(step / "group1.json")
    for reseal in (False, True):
        if reseal:
            seal(str(step), 1)
        with pytest.raises(Exception) as exc:
            load_weights(loop.trainer, str(tmp_path), 1, hooks=loop.hooks)
        assert "group1.json" in str(exc.value) and "launch 1" not in str(exc.value), exc.value
        if reseal:
            assert f"format {FORMAT} with 2 group(s) expects it" in str(exc.value)


def _select_worker(rank, world, run):
    from dept_mega.manifest import local_problem
    from dept_mega.resume import select_checkpoint
    sel = select_checkpoint(run)
    return {"step": sel.step, "notes": sel.notes, "own": local_problem(_step(run, 6), rank, world)}


@pytest.mark.timeout(120)
def test_every_rank_takes_the_same_checkpoint(base_run, tmp_path):
    """Two ranks share the checksum work; the corrupted .distcp file is in rank 1's share
    only, yet both ranks pass over step 6 with the same line and take step 4."""
    from tests.mp_utils import run_distributed
    run = _copy(base_run, tmp_path)
    _flip_4k(_distcp(run, 6))
    res = run_distributed(_select_worker, 2, args=(run,), timeout=100)
    assert res[0]["own"] is None and ".distcp" in res[1]["own"]  # only rank 1 read the file
    assert res[0]["step"] == res[1]["step"] == 4
    assert res[0]["notes"] == res[1]["notes"] and ".distcp" in res[0]["notes"][0]


@pytest.mark.slow
def test_a_half_precision_checkpoint_resumed_in_fp32_says_it_leaves_the_masters(tmp_path, monkeypatch, capsys):
    """A bf16 run resumed with precision: fp32 continues from the saved bf16 weights, not from the
    fp32 masters the checkpoint also holds (a review's finding: silently). One warning says so;
    the same precision says nothing."""
    ensure_sample_corpus()
    monkeypatch.chdir(ROOT)
    run = str(tmp_path / "run")
    quick = [f"train.run_dir={run}", "train.log_interval=1", "train.eval_iters=1", "train.eval_interval=0",
             "train.save_interval=0"]
    assert train_cli.main(["--config", TINY_STD, *quick, "train.steps=2", "precision=bf16"]) == 0
    for precision, said in (("bf16", False), ("fp32", True)):
        capsys.readouterr()
        shutil.rmtree(os.path.join(run, "checkpoints", "step_3"), ignore_errors=True)
        with open(os.path.join(run, "checkpoints", "latest"), "w") as f:
            f.write("2\n")
        assert train_cli.main(["--config", TINY_STD, *quick, "train.steps=3", f"precision={precision}"]) == 0
        err = capsys.readouterr().err
        line = [ln for ln in err.splitlines() if ln.startswith("warning: precision: checkpoint ")]
        assert bool(line) is said, err
    assert "this launch keeps none (precision fp32) and continues from the saved half-precision weights" in line[0]
