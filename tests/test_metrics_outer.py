"""DEPT's cost records beside the train records: the ``outer`` record of every round (bytes by
category, seconds) and federated ``membership`` records reach TensorBoard / W&B as scalars, and
every outer sync has a line in the human log (docs/metrics.md)."""
from __future__ import annotations

import io
import json
import sys
import types

import torch

from dept_mega.metrics import format_bytes, outer_line, scalars_of
from tests.test_metrics_writers import _FakeWandb

OUTER = {"kind": "outer", "step": 40, "round": 3, "time": 1.0,
         "bytes": {"tp": 0, "pp": 0, "dp": 1_180_000_000, "outer_body": 45_600_000, "outer_embedding": 0,
                   "source_move": 4_400_000},
         "seconds": 0.523, "overlap_seconds": 0.0, "exposed_seconds": 0.104, "groups": [0, 2]}


def test_outer_and_membership_records_are_scalars():
    assert scalars_of(OUTER) == {
        "outer/bytes/tp": 0, "outer/bytes/pp": 0, "outer/bytes/dp": 1_180_000_000, "outer/bytes/outer_body": 45_600_000,
        "outer/bytes/outer_embedding": 0, "outer/bytes/source_move": 4_400_000, "outer/bytes_total": 1_230_000_000,
        "outer/seconds": 0.523, "outer/overlap_seconds": 0.0, "outer/exposed_seconds": 0.104, "outer/groups_count": 2}
    # a null (non-finite) field and a field of text are left out, nested dicts go one level deeper
    odd = dict(OUTER, seconds=None, note="x", bytes={"dp": 5, "by_rank": {"0": 2}})
    s = scalars_of(odd)
    assert "outer/seconds" not in s and "outer/note" not in s
    assert s["outer/bytes/by_rank/0"] == 2 and s["outer/bytes_total"] == 5
    member = {"kind": "membership", "step": 6, "round": 3, "time": 1.0, "groups": [0, 1, 3], "joined": [3], "left": [2],
              "healed": True}
    assert scalars_of(member) == {"membership/groups_count": 3, "membership/joined_count": 1,
                                  "membership/left_count": 1, "membership/healed": 1}


def test_outer_log_line():
    assert outer_line(OUTER) == ("outer sync round 3 (step 40) | sent 1.23 GB (dp 1.18 GB, outer_body 45.6 MB, "
                                 "source_move 4.40 MB) | 0.52 s | exposed 0.10 s | groups 0, 2")
    plain = {"kind": "outer", "step": 2, "round": 0, "time": 1.0, "bytes": {"dp": 0, "outer_body": 0}, "seconds": None,
             "overlap_seconds": 1.5}
    assert outer_line(plain) == "outer sync round 0 (step 2) | sent 0 B | nan s | overlapped 1.50 s"
    assert [format_bytes(n) for n in (0, 999, 1000, 12_345, 999_999_999, 4.56e12)] == \
        ["0 B", "999 B", "1.00 kB", "12.3 kB", "1000 MB", "4.56 TB"]


class _FakeSummaryWriter:
    scalars: list = []

    def __init__(self, log_dir, **kwargs):
        self.kwargs = kwargs

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))

    def flush(self):
        pass

    def close(self):
        pass


def fake_tensorboard(monkeypatch) -> list:
    """torch.utils.tensorboard with a SummaryWriter that records its scalars (the list returned)."""
    mod = types.ModuleType("torch.utils.tensorboard")
    scalars: list = []
    mod.SummaryWriter = type("SummaryWriter", (_FakeSummaryWriter,), {"scalars": scalars})
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", mod)
    return scalars


def test_the_loop_logs_and_exports_every_outer_sync(tmp_path, monkeypatch):
    """A DEPT run (one GLOB group in this process, 2 rounds): one log line per outer sync, after the
    round's last step line, and the record's scalars in TensorBoard and W&B at the round's step."""
    from dept_mega.dept.driver import DeptHooks
    from dept_mega.loop import TrainLoop
    from dept_mega.metrics import MetricsWriter
    from dept_mega.parallel.groups import build_groups
    from dept_mega.trainer import Trainer
    from tests.dept_utils import SyntheticSource, allowed_ids, source_infos, tiny_config
    tb = fake_tensorboard(monkeypatch)
    wandb = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    run = str(tmp_path / "run")
    cfg = tiny_config({"dept": {"variant": "glob", "local_steps": 2},
                       "train": {"steps": 4, "log_interval": 1, "eval_interval": 0, "save_interval": 0, "run_dir": run}})
    pg = build_groups(1, 1, 1)
    infos = source_infos(1)
    trainer = Trainer(cfg, pg, torch.device("cpu"), vocab_size=infos[0].vocab_size)
    stream = io.StringIO()
    writer = MetricsWriter(run, stream=stream, tensorboard=True, wandb="proj")
    TrainLoop(cfg, pg, trainer, DeptHooks(cfg, pg, trainer, torch.device("cpu"), infos), writer,
              lambda name: SyntheticSource(cfg, 1, allowed_ids(infos[0]))).run()
    writer.close()
    with open(f"{run}/metrics.jsonl") as f:
        outer = [r for r in map(json.loads, f) if r["kind"] == "outer"]
    assert [r["step"] for r in outer] == [2, 4]
    lines = stream.getvalue().splitlines()
    said = [ln for ln in lines if ln.startswith("outer sync")]
    assert said == [outer_line(r) for r in outer]
    assert lines.index(said[0]) == lines.index(next(ln for ln in lines if ln.startswith("step 2/4"))) + 1
    for r in outer:
        want = scalars_of(r)
        assert {"outer/seconds", "outer/exposed_seconds", "outer/bytes_total", "outer/bytes/outer_body"} <= set(want)
        assert {(t, v) for t, v, s in tb if s == r["step"] and t.startswith("outer/")} == set(want.items())
        logged = [c[1] for c in wandb.calls if c[0] == "log" and c[2] == r["step"] and "outer/seconds" in c[1]]
        assert logged == [want]


def test_outer_times_on_cuda_are_the_device_timers_not_the_host_clock(monkeypatch):
    """On CUDA + NCCL ``wait()`` does not block the host: the sync's launch, wait and outer step
    only queue work, so the host clock sees none of it. ``OuterSchedule`` times its phases with
    ``PhaseTimer`` on its device (CUDA events there), resolved at ``take_times``. Here a fake
    CUDA timer reports 1 s per phase while the host clock stands still: F = 2 fragments, τ = 1,
    one round of L = 4 steps; every launch and every apply is 1 s of exposed time, and each
    overlapped sync 1 s of overlap (its exchange seen complete after the next step)."""
    import time
    from types import SimpleNamespace

    from dept_mega.dept import streaming
    from dept_mega.dept.streaming import OuterSchedule, SyncUnit

    class FakeCudaTimer:
        def __init__(self, device):
            assert torch.device(device).type == "cuda"
            self.stopped = False

        def stop(self):
            self.stopped = True
            return self

        def seconds(self):
            assert self.stopped
            return 1.0

    monkeypatch.setattr(streaming, "PhaseTimer", FakeCudaTimer, raising=False)
    monkeypatch.setattr(time, "perf_counter", lambda: 0.0)

    class Sync:  # FlatSync's interface; the work completes at once (seen after the next step)
        def launch(self, **kw):
            return SimpleNamespace(work=SimpleNamespace(is_completed=lambda: True))

        def finish(self, pending, **kw):
            return 0.0

        def sync(self, part=None):
            pass

    sched = OuterSchedule([SyncUnit(Sync(), 2, "body0"), SyncUnit(Sync(), 4, "body1")], local_steps=4,
                          delay=1, total_steps=8, device="cuda")
    for s in range(4):
        sched.before_step(s)
        sched.after_step(s + 1)
    sched.round_end(4)
    # body0 launched before step 2, applied after step 3; body1 launched at the round end
    assert sched.take_times() == (1.0, 3.0)
    sched.after_step(5)  # body1 applied
    assert sched.take_times() == (1.0, 1.0) and sched.take_times() == (0.0, 0.0)
