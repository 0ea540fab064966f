"""``train.exit_interval`` / ``train.exit_duration_mins`` (Megatron's --exit-interval /
--exit-duration-in-mins): the run saves a checkpoint after the step, exits 0, and a relaunch
with the same config continues the same learning-rate schedule to the uninterrupted run's
results."""
from __future__ import annotations

import os
import time

import pytest
import torch

from tests.mp_utils import run_distributed
from tests.test_dept_checkpoint import _make
from tests.dept_utils import body_vector, emb_state, tiny_config
from tests.test_train_cli import _setup, _train
from tests.trainer_utils import read_jsonl


def _losses(run_dir):
    return {r["step"]: (r["loss"], r["lr"]) for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
            if r["kind"] == "train"}


def test_exit_interval_stops_with_status_0_and_the_relaunch_continues(tmp_path, monkeypatch, capsys):
    """The stopped run is a process of its own (its exit status); the reference and the
    relaunch run dept_mega.train's main in this process (a process each would add only its
    start-up, ~3 s)."""
    from dept_mega import train as train_cli
    cfg = _setup(tmp_path, variant="std")
    common = ["train.steps=6", "train.log_interval=1", "train.eval_interval=0", "train.save_interval=0"]
    monkeypatch.setenv("DEPT_MEGA_DEVICE", "cpu")
    monkeypatch.delenv("DEPT_GROUP", raising=False)
    ref = str(tmp_path / "ref")
    assert train_cli.main(["--config", cfg, *common, f"train.run_dir={ref}"]) == 0
    out = capsys.readouterr().out
    assert "batch: 4 sequences per group (train.global_batch_size) × 1 group(s) = 4 sequences = 64 tokens" in out
    assert "\nsampling (uniform): a 50.0 %, b 50.0 %\n" in out  # the start-up line of the shares
    run = str(tmp_path / "run")
    r = _train("--config", cfg, *common, f"train.run_dir={run}", "train.exit_interval=4")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "stopped after step 4 of 6 (train.exit_interval=4): checkpoint written" in r.stdout
    assert open(os.path.join(run, "checkpoints", "latest")).read().strip() == "4"
    assert max(_losses(run)) == 4
    assert train_cli.main(["--config", cfg, *common, f"train.run_dir={run}", "train.exit_interval=4"]) == 0
    out = capsys.readouterr().out
    assert f"resumed from {run}/checkpoints/step_4" in out and "stopped after" not in out
    assert _losses(run) == _losses(ref)  # losses and the learning rate of every step, exactly


def _worker(rank, world, over, run_dir, how):
    cfg = tiny_config(over)
    loop, _ = _make(cfg, os.path.join(run_dir, "ref"), rank)
    loop.run()
    full = {"body": body_vector(loop.trainer), "emb": emb_state(loop.trainer)}
    run = os.path.join(run_dir, "run")
    t = dict(over["train"], **({"exit_interval": 3} if how == "interval" else {"exit_duration_mins": 1.0}))
    cfg2 = tiny_config(dict(over, train=t))
    loop, _ = _make(cfg2, run, rank)
    if how == "duration" and rank == 1:
        loop.launched_at = time.time() - 61  # only rank 1 is past the limit: the ranks must agree
    loop.run()
    stopped = (loop.exited_at, loop.exit_reason, loop.trainer.step)
    loop2, ck = _make(cfg2, run, rank)
    resumed_from = ck.load(loop2)
    loop2.run()
    return full, {"body": body_vector(loop2.trainer), "emb": emb_state(loop2.trainer)}, stopped, resumed_from


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["interval", "duration"])
def test_dept_groups_stop_at_the_same_step_and_resume_exactly(tmp_path, how):
    """GLOB, 2 groups, rounds of 2 steps: exit_interval 3 stops inside round 1; a wall-time
    limit passed on one rank only stops both after step 1 (one all-reduce). Resumed, the run
    ends bit-identical to the uninterrupted one."""
    over = {"dept": {"variant": "glob", "local_steps": 2, "outer_optimizer": {"name": "nesterov", "momentum": 0.9}},
            "train": {"steps": 6, "save_interval": 0, "eval_interval": 0}}
    res = run_distributed(_worker, 2, args=(over, str(tmp_path), how), timeout=280)
    want_step = 3 if how == "interval" else 1
    for full, resumed, (exited_at, reason, step), resumed_from in res:
        assert exited_at == step == resumed_from == want_step
        assert reason.startswith("train.exit_interval=3" if how == "interval" else "train.exit_duration_mins=1")
        assert torch.equal(full["body"], resumed["body"])
        for k in full["emb"]:
            assert torch.equal(full["emb"][k], resumed["emb"][k]), k
