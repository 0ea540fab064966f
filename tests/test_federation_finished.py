"""A group job that finished the run leaves a record at the lighthouse, and a job waiting for a
quorum that can no longer form (too many partners finished) stops, not for a requeue
(dept_mega/dept/federation_finished.py, federation_wait.py, train.py)."""
from __future__ import annotations

import os
import socket
import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("torchft")

from tests.federation_utils import Lighthouse, launch_group, write_config  # noqa: E402

CPU = torch.device("cpu")


def _page(addr: str) -> str:
    from dept_mega.dept.federation_log import status_page
    page = status_page(addr, 5.0)
    assert page is not None
    return page


def test_finished_records_at_the_lighthouse_are_told_apart_from_live_groups():
    """Records of this run's key count, a record of another key does not, nor does one whose group
    heartbeats live and newer than it (a new run of the same config) until that heartbeat is old;
    a quorum 'cannot form' once the groups not finished are fewer than its least; a lighthouse
    that is gone: announce says why, it does not raise."""
    from datetime import timedelta

    from torchft.coordination import LighthouseClient

    from dept_mega.dept.federation_finished import announce, cannot_form, finished_groups, finished_line, run_key
    key, other = run_key([1, 2, 3]), run_key([1, 2, 4])
    assert key != other and len(key) == 12
    lh = Lighthouse(min_groups=2, heartbeat_s=0.5)
    try:
        client = LighthouseClient(addr=f"http://{lh.addr}", connect_timeout=timedelta(seconds=5))
        client.heartbeat("dept_group_1:aaaa")  # group 1's job, before its record
        assert announce(lh.addr, 1, 6, key) is None
        assert announce(lh.addr, 2, 6, key) is None
        assert announce(lh.addr, 3, 6, other) is None
        time.sleep(0.05)
        client.heartbeat("dept_group_2:bbbb")  # group 2 heartbeats again, newer than its record
        assert finished_groups(_page(lh.addr), key) == {1: 6}
        time.sleep(0.7)  # every heartbeat old: group 2's record counts
        assert finished_groups(_page(lh.addr), key) == {1: 6, 2: 6}
    finally:
        lh.stop()
    # a lighthouse that is gone: a port held bound here without listening refuses every
    # connection (the stopped lighthouse's port could be taken by another test's meanwhile)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        gone = f"127.0.0.1:{held.getsockname()[1]}"
        assert announce(gone, 1, 6, key, timeout_s=1.0) is not None
    assert cannot_form({1: 6, 2: 6}, 0, 3, 2) and cannot_form({1: 6}, 0, 2, 2)
    assert not cannot_form({1: 6}, 0, 3, 2) and not cannot_form({0: 6}, 0, 2, 2)  # (itself: not a partner)
    line = finished_line({1: 6, 2: 6}, 0, 2, "h:1")
    assert line.startswith("group(s) 1, 2 finished the run (at step 6: their records at the lighthouse h:1), so no "
                           "quorum of 2 group(s) can form again; not for a requeue"), line


@pytest.mark.parametrize("preemption", [None, SimpleNamespace(signal=None)])
def test_a_wait_ends_when_the_partners_finished(preemption):
    """``ended``'s answer ends a quorum wait with PreemptedWait.finished: at a "still waiting" tick
    (final False), or when the wait is given up (final True, asked before deciding); without an
    answer the give-up is the requeue one (gave_up) as before."""
    from dept_mega.dept.federation_wait import preemptible
    from dept_mega.preemption import PreemptedWait
    asked = []

    def ended(answers):
        return lambda final: asked.append(final) or answers[final]

    t0 = time.monotonic()
    with pytest.raises(PreemptedWait) as stop:  # at the first tick
        preemptible(lambda: time.sleep(30), preemption, CPU, "w", True, say=lambda s: None, poll_s=0.02, every=0.1,
                    ended=ended({False: "done early", True: None}))
    assert stop.value.finished == "done early" and stop.value.gave_up is None and asked == [False]
    assert time.monotonic() - t0 < 5
    asked.clear()
    with pytest.raises(PreemptedWait) as stop:  # at the give-up
        preemptible(lambda: time.sleep(30), preemption, CPU, "w", True, poll_s=0.02, give_up_s=0.2,
                    ended=ended({False: None, True: "done"}))
    assert stop.value.finished == "done" and stop.value.gave_up is None and asked == [True]
    with pytest.raises(PreemptedWait) as stop:
        preemptible(lambda: time.sleep(30), preemption, CPU, "w", True, poll_s=0.02, give_up_s=0.2,
                    ended=ended({False: None, True: None}))
    assert stop.value.finished is None and stop.value.gave_up == "federation.quorum_give_up_s = 0.2 s"


def _started(run_dir, ago: float) -> str:
    """``run_dir`` whose run started ``ago`` seconds ago (RUN/run_start.json, as its first launch writes it)."""
    import json

    from dept_mega.run_configs import RUN_START_FILE
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, RUN_START_FILE), "w", encoding="utf-8") as f:
        json.dump({"time": time.time() - ago}, f)
    return str(run_dir)


def _li(rid: str, ago: float, old: bool) -> str:
    return f'<li class="heartbeat\n    {"old" if old else ""}\n  ">\n    {rid}: seen {ago}s ago\n  </li>'


def test_records_of_an_earlier_run_of_the_config_do_not_count(monkeypatch, tmp_path):
    """A new run of the same config on a lighthouse that served an earlier one (which keeps its
    records for ever): at round 3 group 1 is preempted (its heartbeat old, newer than its earlier
    run's record); at round 0 group 1 is still queued (no heartbeat of this run): neither stops
    group 0's wait, and group 1 back does not stop on group 0's earlier record. A record written
    during this run counts though its group's launch heartbeated (old) before it, and a last
    heartbeat crossing it by under BEAT_MARGIN_S does not void it."""
    from dept_mega.dept import federation as fed
    from dept_mega.dept import federation_log as fl
    from dept_mega.dept.federation_finished import partners_finished, record_id, run_key
    from dept_mega.run_configs import record_launch, run_start
    key = run_key([5, 6])
    job = object.__new__(fed.Federation)
    job.group, job.groups, job.least, job.where, job.hashes, job.round = 0, 2, 2, "h:1", [5, 6], 3
    job.run_dir = _started(tmp_path / "g0", 3600.0)  # this run began an hour ago
    earlier = _li(record_id(0, 1000, key), 90000.0, True) + _li(record_id(1, 1000, key), 90001.0, True)
    page = {"p": earlier + _li("dept_group_0:new", 0.2, False) + _li("dept_group_1:new", 40.0, True)}
    monkeypatch.setattr(fl, "_status_page", lambda where, timeout: page["p"])
    assert partners_finished(job, False) is None and partners_finished(job, True) is None
    job.group = 1  # group 1 back: group 0's earlier record
    assert partners_finished(job, False) is None
    job.group, job.run_dir = 0, str(tmp_path / "no_start")  # (a run without run_start.json: the heartbeats alone)
    assert partners_finished(job, False) is None
    job.run_dir = _started(tmp_path / "g0", 3600.0)
    job.group, job.round, page["p"] = 0, 0, earlier + _li("dept_group_0:new", 0.2, False)  # group 1 queued
    assert partners_finished(job, True) is None
    # this run's group 1 finished 30 s ago (after its launch's last heartbeat, or 1 s before it)
    for last in (35.0, 29.0):
        page["p"] = earlier + _li("dept_group_1:new", last, True) + _li(record_id(1, 8, key), 30.0, True)
        assert partners_finished(job, True).startswith("group(s) 1 finished the run (at step 8"), last
        job.round = 3
        assert partners_finished(job, False).startswith("group(s) 1 finished the run (at step 8"), last
    # written once, at the run's first launch: a later launch (a requeue) keeps it
    from dept_mega.config import load_config
    from tests.federation_utils import write_config
    cfg = load_config(write_config(str(tmp_path), steps=4, local_steps=2, sources=2))
    run = str(tmp_path / "run")
    record_launch(cfg, run, 0, True, None)
    first = run_start(run)
    assert first is not None and abs(first - time.time()) < 60
    record_launch(cfg, run, 2, True, 2)
    assert run_start(run) == first


def test_only_a_job_past_round_0_stops_before_giving_up(monkeypatch, tmp_path):
    """partners_finished (a Federation's wait) reads the lighthouse's records: at round 0 (more
    likely a new run on a lighthouse that served one of this config) only when the wait is given
    up; a quorum that can still form (enough groups not finished) is no reason to stop."""
    from dept_mega.dept import federation as fed
    from dept_mega.dept import federation_log as fl
    from dept_mega.dept.federation_finished import partners_finished, record_id, run_key
    job = object.__new__(fed.Federation)
    job.group, job.groups, job.least, job.where, job.hashes = 0, 3, 2, "h:1", [5, 6]
    job.run_dir = _started(tmp_path, 600.0)
    beats = "".join(f'<li class="heartbeat\n    old\n  ">\n    {record_id(g, 6, run_key([5, 6]))}: seen 12.5s ago\n'
                    f'  </li>' for g in (1, 2))
    monkeypatch.setattr(fl, "_status_page", lambda where, timeout: beats)
    job.round = 0
    assert partners_finished(job, False) is None
    assert partners_finished(job, True).startswith("group(s) 1, 2 finished the run (at step 6")
    job.round = 2
    assert partners_finished(job, False).startswith("group(s) 1, 2 finished the run")
    job.groups = 4  # groups 0 and 3 can still form a quorum of 2
    assert partners_finished(job, True) is None


def test_a_group_job_that_finishes_the_run_leaves_its_record(tmp_path):
    """Group 1 trains the run alone (a round needs 1 group): once complete, its record is at the
    lighthouse, with its final step and the run key of its config's agreed keys."""
    from dept_mega.config import load_config
    from dept_mega.dept.federation_config import agree_hashes
    from dept_mega.dept.federation_finished import finished_groups, run_key
    cfg = write_config(str(tmp_path), steps=4, local_steps=2, sources=2)
    lh = Lighthouse(min_groups=1)
    try:
        alone = launch_group(cfg, str(tmp_path / "g1"), lh.addr, 1, groups=2, min_groups=1, timeout_s=1)
        assert alone.wait(timeout=120) == 0
        page = _page(lh.addr)
    finally:
        lh.stop()
    key = run_key(agree_hashes(load_config(cfg, ["federation.groups=2"])))
    assert finished_groups(page, key) == {1: 4}, page


def test_a_job_whose_partners_finished_stops_not_for_a_requeue(tmp_path):
    """Group 1 has finished the run (its record at the lighthouse, as the test above leaves it);
    group 0, whose rounds need 2 groups, gives up its wait at round 0 after
    federation.quorum_give_up_s = 2 s, finds group 1's record and exits with status 3 and no
    preempted.json (the sbatch scripts do not requeue it), naming group 1."""
    from dept_mega.config import load_config
    from dept_mega.dept.federation_config import agree_hashes
    from dept_mega.dept.federation_finished import announce, run_key
    cfg = write_config(str(tmp_path), steps=4, local_steps=2, sources=2)
    # group 0's run began before group 1 finished (a job requeued after it: its first launch
    # wrote RUN/run_start.json); a record older than the run's start would be an earlier run's
    run = _started(tmp_path / "g0", 120.0)
    lh = Lighthouse(min_groups=2)
    try:
        assert announce(lh.addr, 1, 4, run_key(agree_hashes(load_config(cfg, ["federation.groups=2"])))) is None
        p = launch_group(cfg, run, lh.addr, 0, "federation.quorum_give_up_s=2", groups=2, min_groups=2, timeout_s=20)
        p.wait(timeout=120)
        with open(p.log, encoding="utf-8", errors="replace") as f:
            out = f.read()
    finally:
        lh.stop()
    assert p.returncode == 3, out[-3000:]
    assert not os.path.exists(os.path.join(run, "preempted.json"))
    assert ("federation: group(s) 1 finished the run (at step 4: their records at the lighthouse "
            f"{lh.addr}), so no quorum of 2 group(s) can form again; not for a requeue") in out, out[-3000:]
    assert ": stopped waiting for a quorum at round 0; no checkpoint of step 0 (nothing trained); a relaunch " \
           "resumes from the start; exiting with status 3" in out, out[-3000:]
