"""Preemption (issue 13): SIGUSR1 / SIGTERM make every rank finish its step, the job save a
checkpoint, write ``RUN/preempted.json`` and exit with status 75; the relaunched job resumes
and ends with the uninterrupted run's losses. Saves wait for ``hooks.can_save_now()``.
Retention (``train.keep_checkpoints``) and the checkpoint size in the log."""
from __future__ import annotations

import io
import json
import os
import signal

import pytest
import torch

from tests.dept_utils import tiny_config
from tests.mp_utils import run_distributed
from tests.trainer_utils import TINY_STD, ensure_sample_corpus, read_jsonl


def _loop(cfg, run_dir, hooks=None):
    from dept_mega.checkpoint import Checkpointer
    from dept_mega.loop import StdHooks, TrainLoop
    from dept_mega.metrics import MetricsWriter
    from dept_mega.parallel.groups import build_groups
    from dept_mega.trainer import Trainer
    from tests.dept_utils import SyntheticSource
    pg = build_groups(1, 1, 1)
    torch.manual_seed(cfg.train.seed)
    trainer = Trainer(cfg, pg, torch.device("cpu"), vocab_size=cfg.model.vocab_size)
    allowed = torch.arange(cfg.model.vocab_size)
    stream = io.StringIO()
    writer = MetricsWriter(run_dir, enabled=True, stream=stream)
    loop = TrainLoop(cfg, pg, trainer, hooks or StdHooks(), writer,
                     lambda name: SyntheticSource(cfg, 3, allowed), checkpointer=Checkpointer(run_dir))
    return loop, stream


def _cfg(run_dir, **train):
    t = {"steps": 6, "save_interval": 0, "eval_interval": 0, "log_interval": 1, "run_dir": run_dir}
    t.update(train)
    return tiny_config({"dept": {"variant": "std"}, "train": t})


def _signal_after_step(monkeypatch, step: int, sig) -> None:
    """``sig`` to this process right after the trainer's step ``step`` (as a batch system's signal
    that lands while step ``step`` + 1 is prepared)."""
    from dept_mega.trainer import Trainer
    orig = Trainer.train_step

    def signalled(self, batches):
        out = orig(self, batches)
        if self.step == step:
            os.kill(os.getpid(), sig)
        return out

    monkeypatch.setattr(Trainer, "train_step", signalled)


def _losses(run_dir):
    return {r["step"]: r["loss"] for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl")) if r["kind"] == "train"}


class _Deferring:
    """StdHooks whose can_save_now() is False for the steps in ``busy`` (an outer sync in flight)."""

    def __init__(self, busy):
        from dept_mega.loop import StdHooks
        self._std, self.busy, self.loop = StdHooks(), set(busy), None

    def __getattr__(self, name):
        return getattr(self._std, name)

    def can_save_now(self):
        return self.loop.trainer.step not in self.busy


def test_retention_keeps_the_newest_and_logs_sizes(tmp_path):
    from dept_mega.resume import read_latest, step_dirs, verify_checkpoint
    run = str(tmp_path / "run")
    loop, log = _loop(_cfg(run, save_interval=1, keep_checkpoints=2), run)
    loop.run()
    assert step_dirs(run) == [6, 5]
    assert read_latest(run) == (6, None)
    assert verify_checkpoint(os.path.join(run, "checkpoints", "step_5")) is None
    lines = [ln for ln in log.getvalue().splitlines() if ln.startswith("checkpoint step")]
    assert len(lines) == 6
    size = sum(os.path.getsize(os.path.join(run, "checkpoints", "step_6", f))
               for f in os.listdir(os.path.join(run, "checkpoints", "step_6")))
    assert f"checkpoint step 6: {size:,} bytes" in lines[-1]
    assert "removed step(s) 4 (train.keep_checkpoints=2)" in lines[-1]
    # keep all (default)
    run2 = str(tmp_path / "all")
    loop, _ = _loop(_cfg(run2, save_interval=2), run2)
    loop.run()
    assert step_dirs(run2) == [6, 4, 2]


def test_retention_never_removes_latest_or_newer_steps(tmp_path):
    """A run that fell back to an older checkpoint (latest = 2) and saves step 3 keeps the
    damaged step 5 of the abandoned timeline out of its count and does not touch it."""
    from dept_mega.checkpoint import apply_retention
    from dept_mega.manifest import replace_durable
    ck = tmp_path / "checkpoints"
    for s in (1, 2, 3, 5):
        (ck / f"step_{s}").mkdir(parents=True)
    replace_durable(str(ck / "latest"), b"3\n")
    assert apply_retention(str(tmp_path), 1, 3) == [2, 1]
    assert sorted(os.listdir(ck)) == ["latest", "step_3", "step_5"]
    assert apply_retention(str(tmp_path), 0, 3) == []


@pytest.mark.parametrize("keep", [0, 2])
def test_retention_keeps_usable_fallbacks_and_clears_what_interrupted_saves_left(tmp_path, keep):
    """train.keep_checkpoints: 2 keeps the newest and one fallback that can be one: a step
    without a manifest (damaged) or whose manifest records another step (a renamed copy) is
    not counted (it was: the run was left with no usable fallback), and goes. Whatever keep,
    the step_N.tmp of a save killed halfway and the step_N.removing of a removal killed
    halfway are cleared (never loaded, each up to a checkpoint's size, they piled up)."""
    import json

    from dept_mega.checkpoint import apply_retention
    from dept_mega.manifest import FORMAT, replace_durable
    ck = tmp_path / "checkpoints"
    for s, recorded in ((1, 1), (2, 2), (3, 9), (4, None), (5, 5)):
        (ck / f"step_{s}").mkdir(parents=True)
        if recorded is not None:
            (ck / f"step_{s}" / "manifest.json").write_text(json.dumps({"format": FORMAT, "step": recorded,
                                                                         "files": {}}))
    for leftover in ("step_6.tmp", "step_2.removing"):
        (ck / leftover).mkdir()
        (ck / leftover / "x.distcp").write_bytes(b"0" * 10)
    replace_durable(str(ck / "latest"), b"5\n")
    assert apply_retention(str(tmp_path), keep, 5) == ([4, 3, 1] if keep else [])
    assert sorted(os.listdir(ck)) == (["latest", "step_2", "step_5"] if keep else
                                      ["latest", "step_1", "step_2", "step_3", "step_4", "step_5"])


def test_a_step_retention_cannot_remove_is_a_warning(tmp_path, monkeypatch, capsys):
    """Retention runs on global rank 0 alone after the save is complete: a directory it cannot
    remove is a warning line and the others are removed (an exception there left every other
    rank waiting at the save's last barrier until the timeout)."""
    from dept_mega import checkpoint_retention
    from dept_mega.checkpoint import apply_retention
    from dept_mega.manifest import replace_durable
    ck = tmp_path / "checkpoints"
    for s in (1, 2, 3):
        (ck / f"step_{s}").mkdir(parents=True)
    replace_durable(str(ck / "latest"), b"3\n")
    real = os.replace

    def replace(src, dst):
        if src.endswith("step_2"):
            raise PermissionError(13, "Permission denied", src)
        return real(src, dst)
    monkeypatch.setattr(checkpoint_retention.os, "replace", replace)
    assert apply_retention(str(tmp_path), 1, 3) == [1]
    err = capsys.readouterr().err
    assert err.startswith("warning: train.keep_checkpoints: could not remove ") and "step_2" in err, err
    assert sorted(os.listdir(ck)) == ["latest", "step_2", "step_3"]


def test_preemption_saves_after_the_step_and_resumes_exactly(tmp_path):
    """A signal recorded during step 3 stops the loop after step 3 with a checkpoint of step 3
    (no final evaluation or save); the resumed loop ends with the uninterrupted losses. A save
    due while ``can_save_now()`` is False waits for the first step where it is True. As soon
    as the stop is agreed, before that save, ``preempted.json`` names the last complete
    checkpoint (step 2) and a save in progress (a save cut off by torchrun's shutdown timeout
    still leaves the job requeued), and the evaluation due at step 3 is skipped."""
    from dept_mega.preemption import Preemption
    ref = str(tmp_path / "ref")
    loop, _ = _loop(_cfg(ref), ref)
    loop.run()
    want = _losses(ref)

    run = str(tmp_path / "run")
    hooks = _Deferring(busy={3, 4})
    loop, log = _loop(_cfg(run, save_interval=2, eval_interval=3), run, hooks)
    hooks.loop = loop
    pre = Preemption()
    loop.preemption = pre
    orig = loop.trainer.train_step
    evaluated, markers = [], {}
    loop.eval_sources = ["a"]
    loop.evaluate = lambda: evaluated.append(loop.trainer.step)
    save = loop.checkpointer.save

    def saving(lp):
        path = os.path.join(run, "preempted.json")
        markers[lp.trainer.step] = json.load(open(path)) if os.path.exists(path) else None
        return save(lp)

    def step(batches):
        if loop.trainer.step == 2:  # during step 3
            pre.request(int(signal.SIGTERM))
        return orig(batches)

    loop.trainer.train_step = step
    loop.checkpointer.save = saving
    loop.run()
    # the save due at step 4 (interval 2) and the preemption after step 3 wait for step 5
    assert loop.preempted_at == 5 and pre.signal_name == "SIGTERM"
    assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == ["latest", "step_2", "step_5"]
    assert markers == {2: None, 5: {"step": 2, "signal": "SIGTERM", "exit_code": 75, "save_in_progress": True}}
    assert evaluated == []
    text = log.getvalue()
    assert "eval step 3 skipped: preempted (SIGTERM), the time goes to the checkpoint" in text
    assert "checkpoint: due at step 3, deferred while an outer sync is in flight" in text
    assert "deferred since step 3 (outer sync in flight), saving at step 5" in text

    loop2, _ = _loop(_cfg(run), run)
    assert loop2.checkpointer.load(loop2) == 5
    loop2.writer.resume_at(5)
    loop2.run()
    got = _losses(run)
    assert sorted(got) == list(range(1, 7))
    assert got == want


def test_a_signal_during_a_periodic_save_stops_at_that_save(tmp_path):
    """A signal that arrives while the periodic checkpoint of step 4 is written stops the loop
    at step 4 with that checkpoint: no further step, no second full save (the time a
    preemption leaves goes to one save)."""
    from dept_mega.preemption import Preemption
    run = str(tmp_path / "run")
    loop, _ = _loop(_cfg(run, steps=8, save_interval=2), run)
    pre = loop.preemption = Preemption()
    save, saves = loop.checkpointer.save, []

    def saving(lp):
        saves.append(lp.trainer.step)
        path = save(lp)
        if lp.trainer.step == 4:
            pre.request(int(signal.SIGUSR1))
        return path

    loop.checkpointer.save = saving
    loop.run()
    assert saves == [2, 4] and loop.preempted_at == 4 and loop.trainer.step == 4


def test_a_stop_agreed_at_the_end_leaves_no_marker(tmp_path, monkeypatch):
    """A signal during the last step lets the run finish (its final save), and so does one whose
    save is deferred (``can_save_now()`` False) to the last step: no ``preempted.json`` is left
    to requeue a finished run (the loop announces no stop at the last step; the trainer removes
    the announcement of a stop whose save the end overtook)."""
    from dept_mega.loop import TrainLoop
    from dept_mega.preemption import Preemption
    from tests.test_train_cli import _setup, _train_here
    run = str(tmp_path / "loop")
    loop, _ = _loop(_cfg(run, save_interval=2), run)
    pre = loop.preemption = Preemption()
    orig = loop.trainer.train_step
    loop.trainer.train_step = lambda b: (pre.request() if loop.trainer.step == 5 else None) or orig(b)
    loop.run()
    assert loop.preempted_at is None and loop.trainer.step == 6
    assert not os.path.exists(os.path.join(run, "preempted.json"))

    cfg = _setup(tmp_path)
    _signal_after_step(monkeypatch, 3, signal.SIGUSR1)
    monkeypatch.setattr(TrainLoop, "_can_save", lambda self, at: at != 3)
    r = _train_here("--config", cfg, "train.steps=4")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert not os.path.exists(os.path.join(str(tmp_path / "run"), "preempted.json"))


def _agree_worker(rank, world):
    from dept_mega.preemption import Preemption
    p = Preemption()
    seen = [p.agreed(torch.device("cpu"))]
    if rank == 1:
        p.request(int(signal.SIGUSR1))
    seen += [p.agreed(torch.device("cpu")), p.agreed(torch.device("cpu"))]
    return seen, p.signal_name


def test_ranks_agree_on_a_signal_only_one_received():
    res = run_distributed(_agree_worker, 2, timeout=60)
    assert res == [([False, True, True], "SIGUSR1")] * 2


ENV = dict(os.environ, OMP_NUM_THREADS="1", DEPT_MEGA_DEVICE="cpu",
           PET_SIGNALS_TO_HANDLE="SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
           TORCHELASTIC_SIGNALS_TO_HANDLE="SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
ARGS = ["train.log_interval=1", "train.eval_interval=0", "train.eval_iters=1", "parallel.data=2",
        "train.init_timeout_s=120", "train.save_interval=0"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sigusr1_to_torchrun_saves_exits_75_and_the_relaunch_continues(tmp_path, dp2_reference):
    """What Slurm's ``--signal=USR1@120`` does: SIGUSR1 to torchrun (which passes it on to its
    workers when told to: --signals-to-handle, PET_SIGNALS_TO_HANDLE, as examples/1b/common.sh sets it); the
    workers save the step they finished and exit 75; the relaunch ends with the uninterrupted
    run's losses (dp2_reference: the same config, ranks and steps, no checkpoint) and
    removes the marker. torchrun's own launcher, forked with its workers from the tests'
    forkserver (tests/federation_utils.py's TorchrunJob: no fresh import of torch per process);
    the relaunch is the same job on forked ranks (resuming under torchrun is
    tests/test_restart.py's)."""
    from tests.federation_utils import TorchrunJob
    from tests.test_restart import REFERENCE_STEPS, _forked, _stop, _train_steps, _wait
    ensure_sample_corpus()
    steps = REFERENCE_STEPS
    want = dp2_reference

    run, log = str(tmp_path / "run"), str(tmp_path / "torchrun.log")
    p = TorchrunJob(["--config", TINY_STD, f"train.run_dir={run}", f"train.steps={steps}", *ARGS], ENV, log, nproc=2)
    try:
        assert _wait(lambda: max(_train_steps(run), default=0) >= 3, 240, p), "the run ended before the signal"
        os.kill(p.pid, signal.SIGUSR1)
        p.wait(timeout=200)
    finally:
        _stop(p)
    out = open(log, encoding="utf-8", errors="replace").read()
    assert p.returncode != 0, out[-3000:]
    # torchrun itself ends with its SignalException; the ranks' status is in their log line
    assert "written; exiting with status 75" in out, out[-3000:]
    marker = json.load(open(os.path.join(run, "preempted.json")))
    assert marker["signal"] == "SIGUSR1" and marker["exit_code"] == 75
    assert "save_in_progress" not in marker  # rewritten once the save was complete
    stopped = marker["step"]
    assert 3 <= stopped < steps
    assert open(os.path.join(run, "checkpoints", "latest")).read().strip() == str(stopped)
    assert max(_train_steps(run)) == stopped

    out = _forked(run, steps, "train.save_interval=0")
    assert f"resumed from {run}/checkpoints/step_{stopped}" in out
    assert not os.path.exists(os.path.join(run, "preempted.json"))
    got = [r for r in read_jsonl(os.path.join(run, "metrics.jsonl")) if r["kind"] == "train"]
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    for r in got:
        assert r["loss"] == pytest.approx(want[r["step"]], rel=1e-9), r["step"]


def _async_worker(rank, world, root):
    from dept_mega.checkpoint import Checkpointer
    from dept_mega.loop import StdHooks, TrainLoop
    from dept_mega.metrics import MetricsWriter
    from dept_mega.parallel.groups import build_groups
    from dept_mega.resume import verify_checkpoint
    from dept_mega.trainer import Trainer
    from tests.dept_utils import SyntheticSource
    pg = build_groups(1, 2, 1)
    out = {}

    def make(run, async_save):
        cfg = tiny_config({"dept": {"variant": "std"}, "parallel": {"data": 2},
                           "train": {"steps": 6, "save_interval": 2, "eval_interval": 0, "log_interval": 1,
                                     "run_dir": run, "async_save": async_save, "keep_checkpoints": 2}})
        torch.manual_seed(cfg.train.seed)
        trainer = Trainer(cfg, pg, torch.device("cpu"), vocab_size=cfg.model.vocab_size)
        allowed = torch.arange(cfg.model.vocab_size)
        writer = MetricsWriter(run, enabled=rank == 0, stream=io.StringIO())
        return TrainLoop(cfg, pg, trainer, StdHooks(), writer,
                         lambda n: SyntheticSource(cfg, 3, allowed, pg.dp_rank, pg.dp_size),
                         checkpointer=Checkpointer(run))

    for mode in (False, True):
        run = os.path.join(root, f"async{int(mode)}")
        loop = make(run, mode)
        loop.run()
        params = [p.detach().clone() for p in loop.trainer.parameters()]
        problems = {s: verify_checkpoint(os.path.join(run, "checkpoints", f"step_{s}")) for s in (4, 6)}
        loop2 = make(run, mode)
        loop2.checkpointer.load(loop2, step=4)
        loop2.run()
        resumed = [p.detach().clone() for p in loop2.trainer.parameters()]
        out[mode] = {"params": params, "resumed": resumed, "problems": problems,
                     "dirs": sorted(os.listdir(os.path.join(run, "checkpoints"))),
                     "log": loop.writer.stream.getvalue(), "thread_group": loop.checkpointer._group is not None}
    return out


@pytest.mark.timeout(300)
def test_async_save_gives_the_sync_results_and_verified_checkpoints(tmp_path):
    """train.async_save: true (2 data-parallel ranks, a save every 2 steps written by a thread
    on its own gloo group while training goes on): the same weights as synchronous saves, every
    checkpoint verifies against its manifest, retention applies, and a resume from one ends
    bit-identical."""
    res = run_distributed(_async_worker, 2, args=(str(tmp_path),), timeout=280)
    for r in res:
        for mode in (False, True):
            got = r[mode]
            assert got["problems"] == {4: None, 6: None}
            assert got["dirs"] == ["latest", "step_4", "step_6"]
            assert all(torch.equal(a, b) for a, b in zip(got["params"], got["resumed"]))
        assert all(torch.equal(a, b) for a, b in zip(r[False]["params"], r[True]["params"]))
        assert r[True]["thread_group"] and not r[False]["thread_group"]
    assert "checkpoint step 6:" in res[0][True]["log"] and "(written in the background)" in res[0][True]["log"]


def test_eta_counts_the_steps_trained_not_the_steps_jumped(tmp_path, monkeypatch):
    """A federated group that heals jumps its step to its peers' round without training the
    steps in between, after waiting for them (dept/federation.py): the ETA's rate is the time
    since its first trained step over the steps it trained — not over the jump (which made a
    rejoined group's ETA far too short), nor counting the wait (far too long). A clock that
    ticks 1 s per reading of the loop's and 1000 s during the first round start."""
    import types

    import dept_mega.loop as loop_module
    clock = [0.0]

    def tick():
        clock[0] += 1.0
        return clock[0]

    class Jumping(_Deferring):
        def round_start(self, loop, round_index):
            if loop.trainer.step == 0:
                loop.trainer.step = 20  # healed: the peers are at step 20, after a long wait
                clock[0] += 1000.0
            return self._std.round_start(loop, round_index)

    lines = []
    real = loop_module.human_line
    monkeypatch.setattr(loop_module, "human_line", lambda *a, **k: lines.append(a) or real(*a, **k))
    monkeypatch.setattr(loop_module, "time", types.SimpleNamespace(time=tick))
    run = str(tmp_path / "run")
    hooks = Jumping(())
    loop, _ = _loop(_cfg(run, steps=24), run, hooks)
    hooks.loop = loop
    loop.run()
    assert [a[0] for a in lines] == [21, 22, 23, 24]
    for n, (step, total, _, _, _, elapsed, eta, *_rest) in enumerate(lines, 1):
        assert elapsed > 1000  # the wait is elapsed time ...
        # ... not a step's time: a step reads the clock a few times
        assert eta == 0 if step == total else 0 < eta / (total - step) <= 10, (step, eta, elapsed)


@pytest.mark.parametrize("where,synced,saved", [
    ("round_start", True, True),    # a round start after a synced round: its state is saved
    ("after_step", False, False),   # the streamed outer sync's exchange (dept/streaming.py): mid-round
    ("round_end", False, False),    # a round end's redo quorum: its sync pending
])
def test_a_wait_abandoned_in_any_hook_stops_the_loop_cleanly(tmp_path, where, synced, saved):
    """PreemptedWait raised by any of the hooks' waits ends TrainLoop.run without an exception:
    ``preempted_wait`` set, a checkpoint of the step only where the state is a round boundary's,
    ``preempted_at`` the step a relaunch resumes from (the in-memory last save, the same on every
    rank). In-process, one rank: the hooks of a plain run raise where a federated job would wait."""
    import io

    import torch

    from dept_mega.checkpoint import Checkpointer
    from dept_mega.loop import StdHooks, TrainLoop
    from dept_mega.metrics import MetricsWriter
    from dept_mega.parallel.groups import build_groups
    from dept_mega.preemption import PreemptedWait
    from dept_mega.resume import latest_step
    from dept_mega.trainer import Trainer
    from tests.dept_utils import SyntheticSource, tiny_config

    class Hooks(StdHooks):
        """Waits at the second round (step 2, local_steps 2): a preemption arrives there."""
        def __init__(self):
            self.calls = {"round_start": 0, "after_step": 0, "round_end": 0}

        def _maybe(self, name, n):
            self.calls[name] += 1
            if name == where and self.calls[name] == n:
                raise PreemptedWait(f"waiting in {name}", synced, gave_up="a test's limit")

        def round_start(self, loop, r):
            self._maybe("round_start", 2)
            return super().round_start(loop, r)

        def after_step(self, loop):
            self._maybe("after_step", 3)

        def round_end(self, loop, r):
            self._maybe("round_end", 2)
            return super().round_end(loop, r)

    run = str(tmp_path / "run")
    cfg = tiny_config({"dept": {"variant": "std", "local_steps": 2},
                       "train": {"steps": 6, "save_interval": 1000, "eval_interval": 0, "run_dir": run}})
    pg = build_groups(1, 1, 1)
    trainer = Trainer(cfg, pg, torch.device("cpu"), vocab_size=cfg.model.vocab_size)
    loop = TrainLoop(cfg, pg, trainer, Hooks(), MetricsWriter(run, enabled=True, stream=io.StringIO()),
                     lambda n: SyntheticSource(cfg, 3, torch.arange(cfg.model.vocab_size)),
                     checkpointer=Checkpointer(run))
    from dept_mega.preemption import Preemption
    loop.preemption = Preemption()
    save, markers = loop.checkpointer.save, []
    loop.checkpointer.save = lambda lp: markers.append(json.load(open(os.path.join(run, "preempted.json")))) \
        or save(lp)  # (announced before the save, as at a signal)
    loop.run()  # no exception
    assert loop.preempted_wait is not None and loop.preempted_wait.synced is synced
    assert markers == ([{"step": None, "signal": "quorum_give_up", "exit_code": 75, "save_in_progress": True}]
                       if saved else [])
    step = trainer.step
    assert step == {"round_start": 2, "after_step": 3, "round_end": 4}[where]
    assert loop.saved_in_wait is saved
    assert loop.preempted_at == (step if saved else None)
    assert latest_step(run) == loop.preempted_at


def test_ctrl_c_saves_exits_130_without_requeue_and_a_second_stops_at_once(tmp_path, monkeypatch, capfd):
    """SIGINT (Ctrl-C; torchrun passes it on to its workers): the run stops after the step with a
    checkpoint and exits 130 without preempted.json (nothing requeues a run its user stopped); the
    relaunch resumes from it. A second SIGINT raises KeyboardInterrupt at once."""
    from dept_mega.preemption import EXIT_INTERRUPTED, Preemption
    from dept_mega.trainer import Trainer
    from tests.test_train_cli import _setup, _train_here
    cfg = _setup(tmp_path)
    run = str(tmp_path / "run")
    orig = Trainer.train_step
    _signal_after_step(monkeypatch, 2, signal.SIGINT)
    r = _train_here("--config", cfg, "train.steps=6")
    assert r.returncode == EXIT_INTERRUPTED == 130, r.stderr[-2000:]
    assert "interrupted (SIGINT): checkpoint of step 2 written; exiting with status 130 (relaunch to continue)" \
        in r.stdout, r.stdout[-2000:]
    assert "SIGINT: stopping after this step with a checkpoint" in capfd.readouterr().err  # written to fd 2
    assert os.path.isdir(os.path.join(run, "checkpoints", "step_2"))
    assert not os.path.exists(os.path.join(run, "preempted.json"))
    monkeypatch.setattr(Trainer, "train_step", orig)
    r = _train_here("--config", cfg, "train.steps=6")
    assert r.returncode == 0 and "resum" in r.stdout.lower(), r.stdout[-2000:]

    for second in (signal.SIGINT, signal.SIGTERM):  # torchrun escalates a second Ctrl-C to SIGTERM
        p = Preemption()
        p._handler(int(signal.SIGINT), None)
        assert p.signal == int(signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            p._handler(int(second), None)
    p = Preemption()  # a preemption is not a Ctrl-C: a second signal is recorded, never raised
    p._handler(int(signal.SIGTERM), None)
    p._handler(int(signal.SIGTERM), None)
    p._handler(int(signal.SIGINT), None)
    assert p.signal == int(signal.SIGTERM)
