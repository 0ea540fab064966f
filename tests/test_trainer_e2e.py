"""End to end on the sample corpus: training learns, metrics.jsonl follows docs/metrics.md,
evaluation's BPB comes from real byte counts, `-m dept_mega.evaluate` reproduces the final
evaluation, a run resumes from `latest` exactly, data-parallel ranks read different data, and
2-rank jobs (pipeline 2, data parallel 2) match the single process."""
from __future__ import annotations

import json
import math
import os
import shutil
from types import SimpleNamespace

import pytest
import torch

from dept_mega import evaluate as evaluate_cli
from dept_mega import train as train_cli
from dept_mega.config import load_config
from dept_mega.manifest import seal
from dept_mega.metrics import check_record
from tests.mp_utils import run_distributed
from tests.trainer_utils import without_tensorboard_warning, ROOT, TINY_STD, ensure_sample_corpus, read_jsonl

COMMON = ["train.log_interval=1", "train.eval_iters=2"]
# half examples/tiny/std.yaml's batch (still 2 micro-batches a step): the runs' time is their steps'
SMALL_BATCH = ["train.micro_batch_size=4", "train.global_batch_size=8"]


@pytest.fixture(scope="module")
def corpus():
    ensure_sample_corpus()


def _train(run_dir, *overrides):
    rc = train_cli.main(["--config", TINY_STD, f"train.run_dir={run_dir}", *COMMON, *overrides])
    assert rc == 0
    return read_jsonl(os.path.join(run_dir, "metrics.jsonl"))


def _resume_from_copy(run, run2, step):
    """Make ``run2`` a fresh run dir whose ``latest`` is a copy of ``run``'s step ``step``."""
    os.makedirs(os.path.join(run2, "checkpoints"))
    shutil.copytree(os.path.join(run, "checkpoints", f"step_{step}"),
                    os.path.join(run2, "checkpoints", f"step_{step}"))
    with open(os.path.join(run2, "checkpoints", "latest"), "w") as f:
        f.write(f"{step}\n")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_learns_writes_metrics_evaluates_and_resumes(corpus, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    torch.set_num_threads(1)
    run = str(tmp_path / "run")
    # evaluations at 14, 28 and 30 (the last step), checkpoints at 28 and 30: the resume below
    # trains the last 2 steps again (steps both before and after the checkpoint, as resuming
    # needs), from a checkpoint written after an evaluation
    over = ["train.steps=30", "train.eval_interval=14", "train.save_interval=28", *SMALL_BATCH]
    recs = _train(run, *over)
    for r in recs:
        check_record(r)
    train = [r for r in recs if r["kind"] == "train"]
    evals = [r for r in recs if r["kind"] == "eval"]
    assert [r["step"] for r in train] == list(range(1, 31))
    assert [r["step"] for r in evals] == [14, 28, 30]
    # learning: ln(8000) ≈ 9.0 at the start; well below after 30 steps (the last 5 average
    # about 7.1: 20 warm-up steps, then the decay)
    first, last = train[0]["loss"], sum(r["loss"] for r in train[-5:]) / 5
    assert first > 8.5 and last < first - 1.5, (first, last)
    assert evals[-1]["by_source"]["en"]["loss"] < evals[0]["by_source"]["en"]["loss"]
    names = {"en", "fr", "ja", "ru", "code"}
    for r in train:
        assert r["sources"] == {"0": "blend"} and set(r["loss_by_source"]) <= names
        assert r["tokens"] == 8 * 64 and r["round"] == (r["step"] - 1) // 100
    assert set(evals[-1]["by_source"]) == names
    for v in evals[-1]["by_source"].values():
        assert v["ppl"] == pytest.approx(math.exp(v["loss"]))
        assert v["bpb"] == pytest.approx(v["loss"] * v["tokens"] / math.log(2) / v["bytes"], rel=1e-3)
    cfg = load_config(os.path.join(run, "config.yaml"))
    assert cfg.train.steps == 30 and cfg.train.run_dir == run
    assert open(os.path.join(run, "checkpoints", "latest")).read().strip() == "30"

    # evaluate the saved weights: same numbers as the run's final evaluation
    out = str(tmp_path / "eval.json")
    assert evaluate_cli.main(["--run-dir", run, "--out", out]) == 0
    res = json.load(open(out))
    check_record(res)
    assert res["step"] == 30
    for name, v in evals[-1]["by_source"].items():
        assert res["by_source"][name]["loss"] == pytest.approx(v["loss"], rel=1e-9)
        assert res["by_source"][name]["bytes"] == v["bytes"]

    # resume: a copy of the step-28 checkpoint continues exactly like the original run
    run2 = str(tmp_path / "run2")
    _resume_from_copy(run, run2, 28)
    recs2 = _train(run2, *over)
    train2 = [r for r in recs2 if r["kind"] == "train"]
    assert [r["step"] for r in train2] == [29, 30]
    for a, b in zip(train2, train[28:]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-9), a["step"]

    # a checkpoint of another layout is refused with one error naming the key, and the
    # refused launch leaves the run's config.yaml as it was
    layout_path = os.path.join(run2, "checkpoints", "step_28", "layout.json")
    with open(layout_path) as f:
        layout = json.load(f)
    assert layout["tensor"] == 1 and layout["pipeline"] == 1 and layout["groups"] == 1
    step28 = os.path.join(run2, "checkpoints", "step_28")
    with open(layout_path, "w") as f:
        # (an STD checkpoint loads under another tensor / pipeline size, dept_mega.reshard, also
        # with dropout; not under another number of source groups)
        json.dump(dict(layout, groups=2), f)
    shutil.copy(os.path.join(step28, "group0.json"), os.path.join(step28, "group1.json"))
    seal(step28, 28)
    with open(os.path.join(run2, "checkpoints", "latest"), "w") as f:
        f.write("28\n")  # the resumed run above saved step 30 and moved latest there
    before = open(os.path.join(run2, "config.yaml")).read()
    rc = train_cli.main(["--config", TINY_STD, f"train.run_dir={run2}", *COMMON, *over, "train.steps=40"])
    assert rc == 2
    err = without_tensorboard_warning(capsys.readouterr().err)
    assert err.startswith("error: config key 'parallel'") and "2 source group(s)" in err, err
    assert open(os.path.join(run2, "config.yaml")).read() == before

    # as if written by 2 pipeline stages (each stage's files: this one's), resumed with dropout:
    # it loads, and the launch says that the dropout streams were re-seeded, not restored
    os.remove(os.path.join(step28, "group1.json"))
    with open(layout_path, "w") as f:
        json.dump(dict(layout, pipeline=2), f)
    shutil.copy(os.path.join(step28, "rng_tp0_pp0.pt"), os.path.join(step28, "rng_tp0_pp1.pt"))
    seal(step28, 28)
    rc = train_cli.main(["--config", TINY_STD, f"train.run_dir={run2}", *COMMON, *over, "train.steps=29",
                         "model.hidden_dropout=0.1"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "warning: model.hidden_dropout / model.attention_dropout" in err and "re-seeded" in err, err


def test_eval_bpb_uses_real_bytes(corpus, monkeypatch):
    """BPB = summed nats / ln 2 / the UTF-8 bytes behind the evaluated targets."""
    monkeypatch.chdir(ROOT)
    from dept_mega.data.sources import source_datasets
    from dept_mega.loop import eval_metrics
    cfg = load_config(TINY_STD, ["train.eval_iters=2"])
    pg = SimpleNamespace(dp_rank=0, dp_size=1)
    data = train_cli.RunData(cfg, pg, {}, dict(zip(["en"], source_datasets(cfg, "valid")[:1])))
    steps = list(data.make_eval_batches("en"))
    ds = data.valid["en"]
    gbs = cfg.train.global_batch_size  # train.eval_iters counts global batches
    assert ds.samples_per_epoch >= 2 * gbs
    want = sum(ds.sample_bytes(i) for i in range(2 * gbs))
    got = sum(s.nbytes for s in steps)
    assert got == pytest.approx(want) and got > 0
    tokens = 2 * gbs * cfg.model.seq_length
    assert abs(got - tokens) > 10  # bytes are not token counts
    m = eval_metrics(loss_sum=tokens * 2.0, tokens=tokens, nbytes=got)
    assert m["bpb"] == pytest.approx(tokens * 2.0 / math.log(2) / got)


def test_data_parallel_ranks_read_different_data(corpus, monkeypatch):
    monkeypatch.chdir(ROOT)
    from dept_mega.data.sources import source_datasets
    cfg = load_config(TINY_STD)
    train = dict(zip([s.name for s in cfg.data.sources], source_datasets(cfg, "train")))

    def first_step(dp_rank, dp_size):
        data = train_cli.RunData(cfg, SimpleNamespace(dp_rank=dp_rank, dp_size=dp_size), train, {})
        step = data.make_iterator("blend").next_step()
        return torch.cat(step.micro_batches), torch.cat(step.source_ids)

    t0, s0 = first_step(0, 2)
    t1, s1 = first_step(1, 2)
    full, sfull = first_step(0, 1)
    assert not torch.equal(t0, t1)
    assert torch.equal(torch.cat([t0, t1]), full) and torch.equal(torch.cat([s0, s1]), sfull)
    # a single source (DEPT) too
    per_rank = [torch.cat(train_cli.RunData(cfg, SimpleNamespace(dp_rank=r, dp_size=2), train, {})
                          .make_iterator("en").next_step()) for r in (0, 1)]
    assert not torch.equal(per_rank[0], per_rank[1])


def _evaluate_rank(rank: int, world: int, argv: list) -> int:
    return evaluate_cli.main(argv)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_ranks_match_single_process(corpus, tmp_path, monkeypatch):
    """The CLI's job of 2 ranks: pipeline 2 gives the single process's losses, and so does data
    parallel 2. Both jobs are ``torchrun --nproc-per-node 2 -m dept_mega.train ...``'s main on
    ranks forked from this process's forkserver with the environment torchrun gives them
    (federation_utils.run_single_job): launched by torchrun, each would cost torchrun and each rank
    a fresh import of torch (~4 s of CPU each); the CLI under a real torchrun is
    tests/test_restart.py's and tests/test_preemption.py's (2 ranks, restarts, preemption). The
    single process runs in this one. ``dept_mega.evaluate`` of the pipeline-2 run on 2 forked
    ranks reproduces its final evaluation."""
    from tests.federation_utils import run_single_job
    steps = ["train.steps=4", "train.eval_interval=0", "train.eval_iters=1", "train.save_interval=0"]
    monkeypatch.chdir(ROOT)
    torch.set_num_threads(1)
    losses = {"single": [r["loss"] for r in _train(str(tmp_path / "single"), *steps) if r["kind"] == "train"]}
    for name, extra in (("pp2", "parallel.pipeline=2"), ("dp2", "parallel.data=2")):
        run_single_job(TINY_STD, str(tmp_path / name), 2, "train.log_interval=1", *steps, extra)
        # the step lines of the launch's output (the ranks' stdout and stderr)
        out = "".join((tmp_path / name / f"single_out.{r}").read_text() for r in range(2))
        assert "step 4/4" in out, (name, out[-3000:])
    for name in ("dp2", "pp2"):
        recs = read_jsonl(os.path.join(str(tmp_path / name), "metrics.jsonl"))
        losses[name] = [r["loss"] for r in recs if r["kind"] == "train"]
    assert len(losses["single"]) == 4
    for name in ("dp2", "pp2"):
        for a, b in zip(losses[name], losses["single"]):
            assert a == pytest.approx(b, rel=1e-5), name
    # evaluate on 2 ranks (pipeline 2) reproduces the run's final evaluation (its ranks forked
    # with torchrun's environment: evaluate starts its ranks as train does)
    run = str(tmp_path / "pp2")
    out = str(tmp_path / "pp2_eval.json")
    assert run_distributed(_evaluate_rank, 2, args=(["--run-dir", run, "--out", out],), timeout=120) == [0, 0]
    final = [r for r in read_jsonl(os.path.join(run, "metrics.jsonl")) if r["kind"] == "eval"][-1]
    got = json.load(open(out))
    assert got["step"] == 4 and set(got["by_source"]) == set(final["by_source"])
    for name, v in final["by_source"].items():
        assert got["by_source"][name]["loss"] == pytest.approx(v["loss"], rel=1e-9)


def test_cli_errors_name_the_problem(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert train_cli.main(["--config", TINY_STD, "train.nope=1"]) == 2
    assert "train.nope" in capsys.readouterr().err
    assert evaluate_cli.main(["--run-dir", str(tmp_path), "--out", str(tmp_path / "x.json")]) == 2
    assert "config.yaml" in capsys.readouterr().err
    shutil.copy(TINY_STD, tmp_path / "config.yaml")
    assert evaluate_cli.main(["--run-dir", str(tmp_path), "--out", str(tmp_path / "x.json")]) == 2
    assert "checkpoints/latest" in capsys.readouterr().err


def test_cli_corrupt_data_file_is_one_error_line(tmp_path, capsys, monkeypatch):
    """A data file that exists but is not a Megatron index is bad input: one ``error:`` line
    naming the file and exit status 2, not a traceback."""
    monkeypatch.chdir(ROOT)
    (tmp_path / "x.bin").write_bytes(b"")
    (tmp_path / "x.idx").write_bytes(b"garbage\n")
    prefix = str(tmp_path / "x")
    assert train_cli.main(["--config", TINY_STD, f"data.sources.0.prefix={prefix}",
                           f"train.run_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "x.idx" in err and "Traceback" not in err


@pytest.mark.timeout(300)
def test_resume_with_dropout_continues_exactly(corpus, tmp_path, monkeypatch):
    """The dropout streams (RNGTracker) are saved with the checkpoint, so a resumed run with
    dropout draws the same masks as the uninterrupted one."""
    monkeypatch.chdir(ROOT)
    torch.set_num_threads(1)
    drop = ["model.hidden_dropout=0.1", "model.attention_dropout=0.1", "train.steps=6",
            "train.save_interval=3", "train.eval_interval=0", *SMALL_BATCH]
    run = str(tmp_path / "run")
    train = [r for r in _train(run, *drop) if r["kind"] == "train"]
    run2 = str(tmp_path / "run2")
    _resume_from_copy(run, run2, 3)
    train2 = [r for r in _train(run2, *drop) if r["kind"] == "train"]
    assert [r["step"] for r in train2] == [4, 5, 6]
    for a, b in zip(train2, train[3:]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-9), a["step"]
