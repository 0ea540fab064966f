"""A full disk is a message, not a traceback: a checkpoint that fails with ENOSPC (injected into
torch.distributed.checkpoint's file writer; no small file system is at hand) ends the launch
with one line — the directory, the bytes needed and free, the last complete checkpoint —, the
partial ``step_N.tmp`` removed, ``latest`` untouched and exit status 73, on every rank, also
when only one rank's disk is full and when a thread writes the checkpoint (train.async_save)."""
from __future__ import annotations

import errno
import io
import os

import pytest
import torch

from tests.mp_utils import run_distributed
from tests.test_train_cli import _setup


def _fail_writes(monkeypatch, when):
    """DCP's file writer raises ENOSPC when ``when()`` is true (after writing a few bytes)."""
    import torch.distributed.checkpoint.filesystem as fs
    real = fs._write_item

    def write_item(*args, **kwargs):
        if when():
            stream = next(a for a in args if hasattr(a, "write"))
            stream.write(b"\0" * 64)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*args, **kwargs)

    monkeypatch.setattr(fs, "_write_item", write_item)


@pytest.mark.parametrize("where", ["data", "latest"])
def test_full_disk_is_one_line_and_exit_73(tmp_path, monkeypatch, capsys, where):
    """``where``: the disk fills while DCP writes step_4's data, or after step_4 is complete and
    in place, while ``latest`` is rewritten (then step_4 stays, latest names step_2)."""
    from dept_mega import checkpoint
    from dept_mega import train as train_cli
    from dept_mega.checkpoint import dir_bytes
    from dept_mega.checkpoint_space import EXIT_NO_SPACE
    from dept_mega.resume import read_latest
    cfg = _setup(tmp_path, variant="std")
    run = str(tmp_path / "run")
    ck = os.path.join(run, "checkpoints")
    monkeypatch.setenv("DEPT_MEGA_DEVICE", "cpu")
    if where == "data":
        _fail_writes(monkeypatch, lambda: os.path.exists(os.path.join(ck, "step_4.tmp")))
    else:
        real = checkpoint.replace_durable

        def replace_latest(path, data):
            if data == b"4\n":
                with open(path + ".tmp", "wb") as f:
                    f.write(data[:1])
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(path, data)
        monkeypatch.setattr(checkpoint, "replace_durable", replace_latest)
    rc = train_cli.main(["--config", cfg, f"train.run_dir={run}", "train.steps=4", "train.save_interval=2",
                         "train.eval_interval=0", "train.log_interval=1", "model.hidden_size=128", "model.ffn_hidden_size=512"])
    err = capsys.readouterr().err
    assert rc == EXIT_NO_SPACE == 73, err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    line = lines[0]
    if where == "latest":
        assert (f"checkpoint step_4 was written to {ck}/step_4, but {ck}/latest could not be updated: no space "
                f"left on the device") in line, line
        assert f"latest still names step_2 ({ck}/step_2), which a relaunch resumes from" in line, line
        assert "removed" not in line and "bytes are free" in line, line
        assert sorted(os.listdir(ck)) == ["latest", "step_2", "step_4"] and read_latest(run) == (2, None)
        return
    assert f"no space left on the device of {ck}" in line
    assert f"the last complete checkpoint is step_2 ({ck}/step_2)" in line
    needed = int(line.split("needs ")[1].split(" bytes")[0].replace(",", ""))
    # the same state one step earlier, plus small files and DCP's per-tensor serialisation
    real = dir_bytes(os.path.join(ck, "step_2"))
    assert 0.9 * real <= needed <= real, (needed, real)
    assert "bytes are free" in line
    assert sorted(os.listdir(ck)) == ["latest", "step_2"] and read_latest(run) == (2, None)


def _worker(rank, world, run, async_save, fail_after=False):
    from dept_mega.checkpoint import Checkpointer
    from dept_mega.checkpoint_space import CheckpointSpaceError
    from dept_mega.loop import StdHooks, TrainLoop
    from dept_mega.metrics import MetricsWriter
    from dept_mega.parallel.groups import build_groups
    from dept_mega.trainer import Trainer
    from tests.dept_utils import SyntheticSource, tiny_config

    class Patch:
        def setattr(self, obj, name, value):
            setattr(obj, name, value)

    pg = build_groups(1, 2, 1)
    cfg = tiny_config({"dept": {"variant": "std"}, "parallel": {"data": 2},
                       "train": {"steps": 4, "save_interval": 2, "eval_interval": 0, "run_dir": run,
                                 "async_save": async_save}})
    trainer = Trainer(cfg, pg, torch.device("cpu"), vocab_size=cfg.model.vocab_size)
    loop = TrainLoop(cfg, pg, trainer, StdHooks(), MetricsWriter(run, enabled=rank == 0, stream=io.StringIO()),
                     lambda n: SyntheticSource(cfg, 3, torch.arange(cfg.model.vocab_size), pg.dp_rank, pg.dp_size),
                     checkpointer=Checkpointer(run))
    if fail_after:  # rank 0 alone fails after checkpoint step_4 is complete (its log line)
        def log_saved(step, *rest):
            if step == 4:
                raise OSError(errno.EIO, "the log file's disk went away")
        if rank == 0:
            loop._log_saved = log_saved
        try:
            loop.run()
            return None
        except Exception as exc:  # noqa: BLE001
            return f"{type(exc).__name__}: {exc}", sorted(os.listdir(os.path.join(run, "checkpoints")))
    # only rank 1's disk, only checkpoint step_4
    _fail_writes(Patch(), lambda: rank == 1 and os.path.exists(os.path.join(run, "checkpoints", "step_4.tmp")))
    try:
        loop.run()
        return None
    except CheckpointSpaceError as exc:
        return str(exc), sorted(os.listdir(os.path.join(run, "checkpoints")))


@pytest.mark.timeout(200)
@pytest.mark.parametrize("async_save", [False, True])
def test_every_rank_stops_when_one_rank_has_no_space(tmp_path, async_save):
    res = run_distributed(_worker, 2, args=(str(tmp_path / "run"), async_save), timeout=180)
    import re
    assert res[0] is not None and res[1] is not None
    (text, listing), (text1, listing1) = res
    free = re.compile(r"[\d,]+ bytes are free")  # read by each rank at its own moment
    assert free.sub("", text) == free.sub("", text1) and listing == listing1
    assert "checkpoint step_4 not written: no space left" in text and "last complete checkpoint is step_2" in text
    assert listing == ["latest", "step_2"]


@pytest.mark.timeout(200)
def test_a_failure_on_rank_0_after_a_complete_save_stops_every_rank(tmp_path):
    """What follows a complete save runs on rank 0 alone (its size, retention, the log line): a
    failure there is raised on every rank at once, not left to the other ranks' barrier timeout
    (train.async_save: raised at the end of the run, where the writer is waited for)."""
    res = run_distributed(_worker, 2, args=(str(tmp_path / "run"), True, True), timeout=120)
    (text0, listing0), (text1, listing1) = res
    assert text0 == "RuntimeError: asynchronous checkpoint save failed: [Errno 5] the log file's disk went away", text0
    assert text1 == ("RuntimeError: asynchronous checkpoint save failed: checkpoint step_4 was saved, then rank 0 "
                     "failed: OSError: [Errno 5] the log file's disk went away"), text1
    assert listing0 == listing1 == ["latest", "step_2", "step_4"]
