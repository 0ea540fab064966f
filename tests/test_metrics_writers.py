"""The optional writers beside metrics.jsonl: Weights & Biases (``train.wandb``) and TensorBoard.
A missing package is one warning line, not silence and not a failure."""
from __future__ import annotations

import io
import os
import sys
import types

from dept_mega.metrics import MetricsWriter

TRAIN = dict(loss=2.5, lr=1e-3, grad_norm=0.7, tokens=64, sources={"0": "a"}, loss_by_source={"a": 2.5, "b": None},
             tokens_per_s=100.0, tflops_per_device=None, mfu=None, consumed_samples=8, consumed_tokens=128)


class _FakeWandb(types.ModuleType):
    """Records what the writer asks of the ``wandb`` module."""

    def __init__(self):
        super().__init__("wandb")
        self.calls = []

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))
        calls = self.calls

        class Run:
            def log(self, data, step):
                calls.append(("log", dict(data), step))

            def finish(self):
                calls.append(("finish",))
        return Run()


def test_wandb_receives_the_scalars_and_a_relaunch_continues_its_run(tmp_path, monkeypatch, capsys):
    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    run = str(tmp_path / "my.run")
    w = MetricsWriter(run, stream=io.StringIO(), tensorboard=False, wandb="proj", config={"train": {"steps": 3}})
    w.write("train", 1, 0, **TRAIN)
    w.write("eval", 1, 0, by_source={"a": {"loss": 2.0, "ppl": 7.39, "bpb": 1.1, "tokens": 10, "bytes": 30}})
    w.close()
    init = fake.calls[0]
    assert init[0] == "init" and init[1]["project"] == "proj" and init[1]["name"] == "my.run"
    assert init[1]["dir"] == run and init[1]["resume"] == "allow" and init[1]["config"] == {"train": {"steps": 3}}
    assert init[1]["id"].startswith("my-run-")
    assert fake.calls[1] == ("log", {"train/loss": 2.5, "train/lr": 1e-3, "train/grad_norm": 0.7,
                                     "train/tokens_per_s": 100.0, "train/consumed_samples": 8,
                                     "train/consumed_tokens": 128, "train_loss/a": 2.5}, 1)
    assert fake.calls[2] == ("log", {"eval_loss/a": 2.0, "eval_ppl/a": 7.39, "eval_bpb/a": 1.1}, 1)
    assert fake.calls[3] == ("finish",)
    MetricsWriter(run, stream=io.StringIO(), tensorboard=False, wandb="proj").close()
    assert fake.calls[4][1]["id"] == init[1]["id"]  # the relaunch continues the same W&B run
    assert capsys.readouterr().err == ""
    # other ranks, and train.wandb: null, start nothing
    MetricsWriter(run, enabled=False, wandb="proj").close()
    MetricsWriter(run, stream=io.StringIO(), tensorboard=False).close()
    assert len(fake.calls) == 6


def test_a_missing_package_is_one_warning_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # the package absent: import tensorboard fails
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    w = MetricsWriter(str(tmp_path / "run"), stream=io.StringIO(), wandb="proj")
    w.write("train", 1, 0, **TRAIN)
    w.close()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2, err
    assert err[0].startswith("warning: no TensorBoard events in ") and "pip install tensorboard" in err[0]
    assert err[1] == ("warning: train.wandb='proj': the wandb package is not installed (pip install wandb); "
                      "not logging to Weights & Biases")
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 1
    # train.tensorboard: null (the default) writes events where the package is, and says nothing
    # where it is not; false writes none
    for tb in (None, False):
        MetricsWriter(str(tmp_path / f"run_{tb}"), stream=io.StringIO(), tensorboard=tb).close()
        assert capsys.readouterr().err == "", tb
    # a tensorboard that is there but fails to import (too old, a broken dependency) still warns
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    MetricsWriter(str(tmp_path / "run_broken"), stream=io.StringIO(), tensorboard=None).close()
    assert capsys.readouterr().err.startswith("warning: no TensorBoard events in "), "broken package"


def test_a_resume_hides_the_replayed_steps_in_tensorboard_and_says_what_wandb_keeps(tmp_path, monkeypatch):
    """A relaunch resuming from step 3 after a crash at step 6: metrics.jsonl drops steps 4-6,
    TensorBoard gets a new event file with purge_step 4 (it hides the old events from step 4 on),
    and, W&B's steps being final, one log note says which steps keep the interrupted launch's
    values — only when this launch continues an earlier launch's W&B run."""
    from tests.test_metrics_outer import fake_tensorboard
    fake_tensorboard(monkeypatch)
    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    run = str(tmp_path / "run")
    first = MetricsWriter(run, stream=io.StringIO(), tensorboard=True, wandb="proj")
    for step in range(1, 7):
        first.write("train", step, 0, **TRAIN)
    first.close()  # (the crash)
    again = MetricsWriter(run, stream=io.StringIO(), tensorboard=True, wandb="proj")
    assert again._tb.kwargs == {}
    assert again.resume_at(3) == 3
    assert again._tb.kwargs == {"purge_step": 4}
    (note,) = again.resume_notes
    assert note.startswith("warning: W&B: this launch continues from step 3, and the W&B run already has steps 4-6 "
                           "from the interrupted launch;"), note
    again.close()
    # no note: nothing replayed (and no purge); a W&B run new to this launch; no W&B
    w = MetricsWriter(run, stream=io.StringIO(), tensorboard=True, wandb="proj")
    assert w.resume_at(3) == 0 and w.resume_notes == [] and w._tb.kwargs == {}
    w.close()
    for wandb in ("proj", None):
        crashed = MetricsWriter(run, stream=io.StringIO(), tensorboard=False)
        for step in (4, 5):
            crashed.write("train", step, 0, **TRAIN)
        crashed.close()
        os.remove(os.path.join(run, "wandb_id.txt"))
        w = MetricsWriter(run, stream=io.StringIO(), tensorboard=True, wandb=wandb)
        assert w.resume_at(3) == 2 and w._tb.kwargs == {"purge_step": 4}
        assert w.resume_notes == [], wandb
        w.close()
        open(os.path.join(run, "wandb_id.txt"), "w").close()


def test_the_pre_flight_warns_of_a_logger_package_that_is_missing(monkeypatch):
    """``--check`` says what the launch will warn about ``train.tensorboard: true`` and
    ``train.wandb`` without their packages (it said nothing: the run then trained without the
    logging asked for). Each package's absence stands in through importlib's lookup."""
    import importlib.util

    from dept_mega.config import load_config
    from dept_mega.metrics import missing_logger_packages
    from dept_mega.preflight import preflight
    from tests.trainer_utils import TINY_STD, ensure_sample_corpus
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("wandb", "tensorboard") else real(name, *a))
    wandb = ("train.wandb='proj': the wandb package is not installed (pip install wandb); not logging to "
             "Weights & Biases")  # the launch's own warning (test_a_missing_package_is_one_warning_line)
    tb = ("train.tensorboard: the tensorboard package is not installed (pip install tensorboard); the launch "
          "writes no TensorBoard events")
    assert missing_logger_packages(True, "proj") == [tb, wandb]
    assert missing_logger_packages(None, None) == [] and missing_logger_packages(False, "proj") == [wandb]
    ensure_sample_corpus()
    warnings = preflight(load_config(TINY_STD, ["train.wandb=proj", "train.tensorboard=true"]), 1)[1]
    assert tb in warnings and wandb in warnings, warnings
    monkeypatch.setattr(importlib.util, "find_spec", real)
