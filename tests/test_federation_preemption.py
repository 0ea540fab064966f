"""A federated group job preempted (SIGTERM / SIGUSR1) while it waits for the other groups:
it stops waiting within seconds, saves what a relaunch can resume, writes RUN/preempted.json
and exits with status 75 (dept_mega/dept/federation_wait.py)."""
from __future__ import annotations

import json
import os
import signal
import time

import pytest

pytest.importorskip("torchft")

from tests.federation_utils import (ENV, federation, finish_all, is_held, read_records, run_single_job,  # noqa: E402
                                    trained_steps, wait_for, wait_for_requests, write_config)


L, STEPS = 2, 6
HEARTBEAT_S = 1.0  # the lighthouse's --heartbeat-timeout-s


def _log(p) -> str:
    with open(p.log, encoding="utf-8", errors="replace") as f:
        return f.read()


@pytest.fixture(scope="module")
def single_losses(tmp_path_factory):
    """The losses of a run never interrupted: the single job's {step: {source: loss}}, made once
    for this file's tests (the same config; their train.save_interval changes no loss)."""
    root = tmp_path_factory.mktemp("single")
    cfg = write_config(str(root), steps=STEPS, local_steps=L, sources=2)
    run_single_job(cfg, str(root / "single"), 2, checkpoints=False)
    return {r["step"]: r["loss_by_source"] for r in read_records(str(root / "single"), "train")}


def _preempt_waiting_group(tmp_path, single, hold, timeout_s, extra=()):
    """Groups 0 and 1 (a round needs both), group 1 held at ``hold`` (DEPT_FEDERATION_HOLD's
    R:WHERE) while group 0 waits for it; group 0 gets SIGTERM. Returns (runs, seconds group 0
    took to exit, its log, the log's preempted.json), group 0 relaunched and both run to the end
    with the losses of ``single`` (the single job's)."""
    cfg = write_config(str(tmp_path), steps=STEPS, local_steps=L, sources=2)
    dump, go = str(tmp_path / "dump"), str(tmp_path / "go")
    env = dict(ENV, DEPT_FEDERATION_DUMP=dump)
    runs = [str(tmp_path / f"g{g}") for g in range(2)]
    kw = dict(groups=2, min_groups=2, timeout_s=timeout_s)
    r = int(hold.split(":")[0])
    with federation(min_groups=2, heartbeat_s=HEARTBEAT_S) as jobs:
        procs = [jobs.launch(cfg, runs[0], 0, *extra, env=env, **kw),
                 jobs.launch(cfg, runs[1], 1, *extra, env=dict(env, DEPT_FEDERATION_HOLD=f"{hold}:{go}"),
                              checkpoints=False, **kw)]  # (group 0's first launch's checkpoints are read, no others)
        wait_for(lambda: is_held(dump, 1, r) or procs[1].poll() is not None, f"group 1 did not reach {hold}")
        if hold.endswith(":start"):  # group 0 at round r's quorum
            wait_for_requests(jobs.lh, 1, procs[:1], f"group 0 at round {r}'s quorum")
        else:  # group 0 in round r's exchange (its last step trained)
            wait_for(lambda: r * L + L in trained_steps(runs[0]) or procs[0].poll() is not None,
                     f"group 0 did not train round {r}")
        time.sleep(1.0)  # well inside the wait, not on its way there
        assert procs[0].poll() is None, _log(procs[0])[-3000:]
        t0 = time.monotonic()
        os.kill(procs[0].pid, signal.SIGTERM)
        try:
            procs[0].wait(timeout=timeout_s + 10)
        except Exception:  # noqa: BLE001
            raise AssertionError(f"group 0 did not stop waiting within {timeout_s + 10} s of SIGTERM:\n"
                                 + _log(procs[0])[-3000:])
        took = time.monotonic() - t0
        out = _log(procs[0])
        assert procs[0].returncode == 75, out[-3000:]
        with open(os.path.join(runs[0], "preempted.json")) as f:
            marker = json.load(f)
        # relaunched at once (a requeue), then group 1 goes on: the gone job's quorum request still
        # counts at the lighthouse until its heartbeats are HEARTBEAT_S old, so the quorum may form
        # with it; group 1 and the relaunched job then ask again (federation.py, _quorum)
        again = [jobs.launch(cfg, runs[0], 0, *extra, env=env, checkpoints=False, **kw)]
        wait_for_requests(jobs.lh, 1, again, "the relaunched group 0")
        open(go, "w").close()
        outs = finish_all([procs[1]] + again, timeout=120)
    for p, o in zip([procs[1]] + again, outs):
        assert p.returncode == 0, o[-3000:]
    assert not os.path.exists(os.path.join(runs[0], "preempted.json"))
    # the losses of a run never interrupted: the single job's, per source
    names = list(single[1])
    for g, run in enumerate(runs):
        mine = {r["step"]: r["loss_by_source"] for r in read_records(run, "train")}
        assert sorted(mine) == list(range(1, STEPS + 1)), (g, sorted(mine))
        for step, by in mine.items():
            assert abs(by[names[g]] - single[step][names[g]]) <= 1e-6, (g, step, by, single[step])
    return runs, took, out, marker


def test_preempted_while_waiting_for_a_quorum_saves_and_resumes(tmp_path, single_losses):
    """Group 1 holds before round 2's quorum; group 0 has synchronised round 1 and waits
    there. SIGTERM to group 0: it exits with 75 within seconds, with a checkpoint of step 4
    (no periodic saves: the preemption wrote it) and preempted.json; relaunched, it joins
    group 1 at round 2, and both groups' losses equal the single job's."""
    runs, took, out, marker = _preempt_waiting_group(tmp_path, single_losses, "2:start", timeout_s=20)
    assert took < 10, took
    assert marker == {"step": 2 * L, "signal": "SIGTERM", "exit_code": 75}
    assert "preempted (SIGTERM) while waiting for a quorum at round 2: stopped waiting; checkpoint of step 4 " \
           "written" in out, out[-3000:]


@pytest.mark.slow
def test_preempted_in_a_round_end_exchange_resumes_from_the_last_checkpoint(tmp_path, single_losses):
    """Group 1 holds before round 2's exchange; group 0 has trained round 2 and waits in it.
    SIGTERM to group 0: it stops once the exchange fails (after federation.timeout_s) at the
    redo quorum, saves nothing (a checkpoint cannot hold a round whose outer sync is pending),
    preempted.json names the periodic checkpoint of step 4; relaunched, it retrains round 2,
    group 1 redoes the exchange with it, and the losses equal the single job's."""
    timeout_s = 4
    runs, took, out, marker = _preempt_waiting_group(tmp_path, single_losses, "2:exchange", timeout_s,
                                                     extra=(f"train.save_interval={L}",))
    assert took < timeout_s + 6, took
    assert marker == {"step": 2 * L, "signal": "SIGTERM", "exit_code": 75}
    assert "preempted (SIGTERM) while waiting for a quorum to redo round 2's exchange: stopped waiting; no " \
           "checkpoint of step 6" in out, out[-3000:]
    assert "a relaunch resumes from step 4" in out



@pytest.mark.slow
def test_a_quorum_wait_longer_than_quorum_give_up_s_saves_and_exits_75(tmp_path):
    """Group 1 holds before round 2's quorum for good (as jobs wait forever on a lighthouse that
    restarted); group 0, federation.quorum_give_up_s = 4, gives up its wait there after 4 s:
    a checkpoint of step 4 (no periodic saves), preempted.json, exit status 75 (a requeue
    relaunches it) and one line saying why."""
    cfg = write_config(str(tmp_path), steps=STEPS, local_steps=L, sources=2)
    dump = str(tmp_path / "dump")
    runs = [str(tmp_path / f"g{g}") for g in range(2)]
    kw = dict(groups=2, min_groups=2, timeout_s=20)
    with federation(min_groups=2, heartbeat_s=HEARTBEAT_S) as jobs:
        held = jobs.launch(cfg, runs[1], 1, env=dict(ENV, DEPT_FEDERATION_DUMP=dump,
                                                       DEPT_FEDERATION_HOLD=f"2:start:{tmp_path / 'never'}"),
                           checkpoints=False, **kw)
        wait_for_requests(jobs.lh, 1, [held], "group 1's first quorum request")  # (group 0's first wait: short)
        p = jobs.launch(cfg, runs[0], 0, "federation.quorum_give_up_s=4", env=ENV, **kw)
        p.wait(timeout=120)
        out = _log(p)
    assert p.returncode == 75, out[-3000:]
    with open(os.path.join(runs[0], "preempted.json")) as f:
        assert json.load(f) == {"step": 2 * L, "signal": "quorum_give_up", "exit_code": 75}
    assert os.path.isdir(os.path.join(runs[0], "checkpoints", f"step_{2 * L}"))
    assert "gave up (federation.quorum_give_up_s = 4 s) while waiting for a quorum at round 2: stopped waiting; " \
           "checkpoint of step 4 written; exiting with status 75" in out, out[-3000:]
