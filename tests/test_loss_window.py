"""The train record's ``loss_window``: the token-weighted mean loss over the logging window
(Megatron-LM's ``lm loss``, the mean over ``--log-interval`` iterations), beside ``loss``, the
logged step's own (docs/metrics.md)."""
from __future__ import annotations

import dataclasses
import io
import json
import types

import pytest
import torch

from dept_mega.loop import LossWindow, StdHooks, TrainLoop
from dept_mega.metrics import MetricsWriter, scalars_of
from dept_mega.parallel.groups import build_groups
from dept_mega.trainer import StepResult, Trainer
from tests.dept_utils import SyntheticSource
from tests.dept_utils import tiny_config as dept_config


def test_the_record_and_the_line_carry_the_windows_mean(tmp_path):
    """6 steps logged every 3: each record's loss_window is the token-weighted mean of its 3 steps
    (step 2 made a skipped step with a nan loss: left out), loss the logged step's own; the log
    line shows it, the scalars carry it."""
    run = str(tmp_path / "run")
    cfg = dept_config({"dept": {"variant": "std"}, "train": {"steps": 6, "log_interval": 3, "eval_interval": 0,
                                                              "save_interval": 0, "run_dir": run}})
    pg = build_groups(1, 1, 1)
    trainer = Trainer(cfg, pg, torch.device("cpu"), vocab_size=cfg.model.vocab_size)
    results: list[StepResult] = []
    step = trainer.train_step

    def recorded(batch):
        res = step(batch)
        if trainer.step == 2:  # as the trainer reports a step skipped for a non-finite loss
            res = dataclasses.replace(res, loss=float("nan"), skipped=True)
        results.append(res)
        return res

    trainer.train_step = recorded
    stream = io.StringIO()
    allowed = torch.arange(cfg.model.vocab_size)
    TrainLoop(cfg, pg, trainer, StdHooks(), MetricsWriter(run, stream=stream, tensorboard=False),
              lambda name: SyntheticSource(cfg, 3, allowed)).run()
    with open(f"{run}/metrics.jsonl") as f:
        train = [r for r in map(json.loads, f) if r["kind"] == "train"]
    assert [r["step"] for r in train] == [3, 6]
    losses = [r.loss for r in results]
    assert len(set(losses[3:])) == 3  # the steps' losses differ: a window mean is not any one of them
    for rec, steps in zip(train, ([0, 2], [3, 4, 5])):
        want = sum(results[i].loss * results[i].tokens for i in steps) / sum(results[i].tokens for i in steps)
        assert rec["loss_window"] == pytest.approx(want, rel=1e-12), rec
        assert rec["loss"] == pytest.approx(results[rec["step"] - 1].loss, rel=1e-12)
        assert scalars_of(rec)["train/loss_window"] == rec["loss_window"]
    lines = [ln for ln in stream.getvalue().splitlines() if ln.startswith("step ")]
    assert [ln.split(" | ")[2] for ln in lines] == [f"window loss {r['loss_window']:.4f}" for r in train]


def test_a_window_of_one_step_or_of_skipped_steps():
    w = LossWindow()
    assert w.steps == 0 and w.tokens == 0
    w.add(StepResult(loss=float("inf"), tokens=10, grad_norm=float("nan"), skipped=True, lr=0.1))
    assert (w.steps, w.tokens, w.loss_sum) == (1, 0, 0.0)  # skipped: counted as a step, not in the mean
    w.add(StepResult(loss=2.0, tokens=10, grad_norm=1.0, skipped=False, lr=0.1))
    w.add(StepResult(loss=5.0, tokens=30, grad_norm=1.0, skipped=False, lr=0.1))
    assert w.steps == 3 and w.loss_sum / w.tokens == pytest.approx((20 + 150) / 40)
    w.start()
    assert (w.steps, w.tokens, w.loss_sum) == (0, 0, 0.0)


def test_several_groups_reduce_the_windows_sums_with_the_steps_record(monkeypatch):
    """Two source groups: the window's loss sum and tokens travel in the record's one all-reduce
    (no reduction of their own), and the mean is over both groups' tokens. The other group's slots
    are added by a stand-in for the all-reduce."""
    import dept_mega.loop as loop_module
    reduces = []

    def all_reduce(v):
        reduces.append(v.numel())
        other = torch.tensor([3.0 * 20, 20, 0.5, 70.0, 40], dtype=torch.float64)  # group 1's slots
        v[5:10] += other

    monkeypatch.setattr(loop_module.dist, "all_reduce", all_reduce)
    cfg = dept_config({"dept": {"variant": "glob"}})
    loop = TrainLoop.__new__(TrainLoop)
    loop.cfg = cfg
    loop.pg = types.SimpleNamespace(num_groups=2, rank=0, group_index=0, rank_of=lambda tp, dp, pp, g: g)
    loop.trainer = types.SimpleNamespace(device=torch.device("cpu"), nonfinite_total=0, consumed_samples=8)
    loop.assignment = {0: "a", 1: "b"}
    loop.source_names = ["a", "b"]
    window = LossWindow()
    for loss, tokens in ((2.0, 10), (4.0, 10)):
        window.add(StepResult(loss=loss, tokens=tokens, grad_norm=1.0, skipped=False, lr=0.1))
    res = StepResult(loss=4.0, tokens=10, grad_norm=1.0, skipped=False, lr=0.1)
    rec = loop._train_record(res, "a", window)
    assert reduces == [10]
    assert rec["loss"] == pytest.approx((40 + 60) / 30)
    assert rec["loss_window"] == pytest.approx((20 + 40 + 70) / (20 + 40))
