"""Real processes under torchrun (issue 15): a rank killed with SIGKILL after a checkpoint,
`--max-restarts 1` restarts the job in place and it ends with the uninterrupted run's losses;
workers orphaned by a killed torchrun hold a second job off their run directory."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from dept_mega.rundir import LOCK_FILE
from tests.federation_utils import children
from tests.mp_utils import free_port
from tests.trainer_utils import ROOT, TINY_STD, ensure_sample_corpus, read_jsonl

ENV = dict(os.environ, OMP_NUM_THREADS="1", DEPT_MEGA_DEVICE="cpu")
ARGS = ["train.log_interval=1", "train.eval_interval=0", "train.eval_iters=1", "parallel.data=2",
        "train.init_timeout_s=120"]
REFERENCE_STEPS = 16  # the uninterrupted run's steps (the conftest fixture dp2_reference); the steps after the
# kill (step 6 here, step 3 in tests/test_preemption.py) are the margin for it to come before the end


def _torchrun(run, steps, *extra, nproc=2):
    """The job as the command ``torchrun`` (each process imports torch afresh)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "-m", "dept_mega.train",
           "--config", TINY_STD, f"train.run_dir={run}", f"train.steps={steps}", *ARGS, *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _forked(run, steps, *extra) -> str:
    """The job of :func:`_torchrun` (2 ranks, the same config and overrides) run to its end on
    ranks forked from this process's forkserver with the environment torchrun gives them
    (tests/federation_utils.py's run_single_job): for the runs where torchrun is not what is
    tested, without its start and a fresh import of torch per rank (~3 s of CPU each).
    Returns rank 0's output."""
    from tests.federation_utils import run_single_job
    cwd = os.getcwd()
    os.chdir(ROOT)  # where _torchrun runs it (the config's data paths are relative)
    try:
        run_single_job(TINY_STD, run, 2, f"train.steps={steps}", *ARGS, *extra)
    finally:
        os.chdir(cwd)
    with open(os.path.join(run, "single_out.0"), encoding="utf-8") as f:
        return f.read()


def _local_rank(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(x.split(b"=", 1) for x in f.read().split(b"\0") if b"=" in x)
        return int(env.get(b"LOCAL_RANK", b"-1"))
    except OSError:
        return -1


def _train_steps(run):
    path = os.path.join(run, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    try:
        return [r["step"] for r in read_jsonl(path) if r["kind"] == "train"]
    except ValueError:  # a line being written
        return []


def _wait(cond, timeout, proc):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.05)
    return False


def _stop(p, workers=()):
    """End a torchrun that is still running and its workers (they live in their own sessions
    and would outlive it)."""
    if p.poll() is None:
        workers = list(workers) + children(p.pid)
        p.kill()
        p.wait()
    for w in workers:
        try:
            os.kill(w, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_killed_rank_restarts_in_place_with_the_same_losses(tmp_path, dp2_reference):
    """SIGKILL to rank 1 after the step-4 checkpoint: torchrun restarts both workers (they
    used to fail in gloo's connectFullMesh with "Connection refused", or hang, on the stale
    keys of torchrun's shared store), they resume from the checkpoint, metrics.jsonl holds each
    step once and the losses equal an uninterrupted run's (dp2_reference). torchrun's own
    launcher with ``--max-restarts 1``, forked with its workers (first and restarted) from the
    tests' forkserver (tests/federation_utils.py's TorchrunJob: no fresh import of torch in
    each of its five processes)."""
    import json

    from tests.federation_utils import TorchrunJob
    ensure_sample_corpus()
    steps = REFERENCE_STEPS
    want = dp2_reference
    run, log = str(tmp_path / "run"), str(tmp_path / "torchrun.log")
    p = TorchrunJob(["--config", TINY_STD, f"train.run_dir={run}", f"train.steps={steps}", *ARGS,
                     "train.save_interval=4"], ENV, log, nproc=2, launcher=("--max-restarts", "1"))
    try:
        assert _wait(lambda: os.path.exists(os.path.join(run, "checkpoints", "latest"))
                     and max(_train_steps(run), default=0) >= 6, 240, p), "the run ended before the kill"
        # (forked workers: their /proc environ is the launcher's; rank 0 is the run lock's holder)
        with open(os.path.join(run, LOCK_FILE), encoding="utf-8") as f:
            rank0 = json.load(f)["pid"]
        workers = children(p.pid)
        victim = [c for c in workers if c != rank0]
        assert len(workers) == 2 and len(victim) == 1, (workers, rank0)
        os.kill(victim[0], signal.SIGKILL)
        killed_after = max(_train_steps(run))
        p.wait(timeout=300)
    finally:
        _stop(p)
    out = open(log, encoding="utf-8", errors="replace").read()
    assert p.returncode == 0, out[-4000:]
    assert "resumed from" in out and killed_after < steps, out[-4000:]
    got = [r for r in read_jsonl(os.path.join(run, "metrics.jsonl")) if r["kind"] == "train"]
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    for r in got:
        assert r["loss"] == pytest.approx(want[r["step"]], rel=1e-9), r["step"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_orphaned_workers_hold_off_a_second_job(tmp_path, monkeypatch, capsys):
    """torchrun killed with SIGKILL leaves its workers running (they live in their own
    sessions): a second job on the run directory is refused in one line naming the old rank 0.
    (One worker: rank 0 holds the run directory. The second job is dept_mega.train's main in
    this process: its refusal comes from the run directory's locks, whichever process asks.)"""
    from dept_mega.train import main
    ensure_sample_corpus()
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("DEPT_MEGA_DEVICE", "cpu")
    run = str(tmp_path / "run")
    p = _torchrun(run, 100000, "train.save_interval=0", "parallel.data=1", nproc=1)
    workers = []
    try:
        assert _wait(lambda: len(_train_steps(run)) >= 2, 240, p), "the job did not start"
        workers = children(p.pid)
        rank0 = [w for w in workers if _local_rank(w) == 0]
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        time.sleep(0.5)
        assert all(os.path.exists(f"/proc/{w}") for w in workers), "the workers did not outlive torchrun"
        capsys.readouterr()
        rc = main(["--config", TINY_STD, f"train.run_dir={run}", "train.steps=1", *ARGS[:-2]])
        said = capsys.readouterr()
        err = [ln for ln in said.err.splitlines() if ln.strip()]
        assert rc == 2 and len(err) == 1, said.err
        assert "in use by another job" in err[0] and f"pid {rank0[0]}" in err[0], err[0]
    finally:
        _stop(p, workers)
