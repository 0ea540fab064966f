"""Federated source groups: a group job that ran rounds alone (``federation.min_groups`` = 1 and
a lighthouse ``--min-groups 1``: the other group missed the fresh start) and a new group that
joins it later (docs/launching.md §12, "A fresh start" and "A new group")."""
from __future__ import annotations

import os
import time

import pytest

pytest.importorskip("torchft")

from tests.federation_utils import (ENV, federation, finish_all, is_held, read_dumps, read_records,  # noqa: E402
                                    wait_for, wait_for_requests, write_config)


def test_a_new_group_joins_a_group_that_ran_alone(tmp_path):
    """Group 0 misses nobody's fresh start: it waits ``timeout_s`` for group 1, then trains
    rounds 0-2 alone (no cross-group exchange: nothing to average). Group 1, started then for
    the first time, must heal from group 0 at round 3's start (it is behind: torchft's step of
    group 0 counts the rounds it committed alone) and both finish the run together — not take
    the quorum for a fresh start of both and run the fresh start's config check against group
    0's pseudo-gradient exchange (a collective mismatch that aborts group 1)."""
    L, steps, G = 2, 8, 2  # (round 3, the last, trained by both)
    cfg = write_config(str(tmp_path), steps=steps, local_steps=L, sources=G)
    dump, go = str(tmp_path / "dump"), str(tmp_path / "go")
    runs = [str(tmp_path / f"g{g}") for g in range(G)]
    kw = dict(groups=G, min_groups=1, timeout_s=3)
    env = dict(ENV, DEPT_FEDERATION_DUMP=dump)
    with federation(min_groups=1) as procs:
        first = procs.launch(cfg, runs[0], 0, env=dict(env, DEPT_FEDERATION_HOLD=f"3:start:{go}"), checkpoints=False,
                             **kw)  # (its checkpoints are read by nothing; group 1's final one is)
        wait_for(lambda: is_held(dump, 0, 3) or first.poll() is not None, "group 0 did not reach round 3's start")
        assert first.poll() is None, "group 0 ended before round 3"
        procs.launch(cfg, runs[1], 1, env=env, **kw)
        wait_for_requests(procs.lh, 1, procs[1:], "the new group 1")
        open(go, "w").close()
        outs = finish_all(procs, timeout=180)
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    outer = [{r["round"]: r for r in read_records(run, "outer")} for run in runs]
    assert [outer[0][r]["groups"] for r in range(3)] == [[0]] * 3  # alone
    (joined, heal), = read_dumps(dump, 1, "heal").items()  # group 1 healed once, into round 3
    assert joined == 3 and heal["source"] == "fr"
    for r in range(3, steps // L):
        assert outer[0][r]["groups"] == outer[1][r]["groups"] == [0, 1], r
    mine = [m for m in read_records(runs[1], "membership") if m["healed"]]
    assert [(m["round"], m["step"]) for m in mine] == [(3, 3 * L)]
    assert os.path.isdir(os.path.join(runs[1], "checkpoints", f"step_{steps}"))


def test_a_job_whose_own_min_groups_is_above_the_lighthouses_never_trains_alone(tmp_path):
    """Group 0's rounds need 2 groups (federation.min_groups = 2) on a lighthouse of --min-groups
    1, which forms it a quorum of itself at once: it must not train in it (torchft's Manager
    checks min_replica_size only when an exchange commits, and a group alone exchanges nothing)
    but ask again, saying so, until group 1, started only then, is there; every round is then
    trained by both. Before: group 0 trained the run alone after its fresh start's wait."""
    L, steps, G = 2, 4, 2
    cfg = write_config(str(tmp_path), steps=steps, local_steps=L, sources=G)
    runs = [str(tmp_path / f"g{g}") for g in range(G)]
    kw = dict(groups=G, min_groups=2, timeout_s=1, checkpoints=False)  # (no checkpoint is read)
    short = "federation: round 0: the lighthouse formed a quorum of 1 group(s), fewer than the 2 a round of this " \
            "job needs (federation.min_groups 2 > the lighthouse's --min-groups 1); asking again"

    def log(p):
        if not os.path.exists(p.log):  # (the forked job opens it)
            return ""
        with open(p.log, encoding="utf-8", errors="replace") as f:
            return f.read()

    with federation(min_groups=1) as procs:
        first = procs.launch(cfg, runs[0], 0, **kw)
        wait_for(lambda: short in log(first) or first.poll() is not None, "group 0's short quorum")
        time.sleep(1.5)  # (past its fresh start's timeout_s: before, it trained alone from here)
        assert first.poll() is None, log(first)[-3000:]
        procs.launch(cfg, runs[1], 1, **kw)
        outs = finish_all(procs, timeout=120)
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    assert "a round needs at least 2 group(s) (federation.min_groups 2 > the lighthouse's --min-groups 1)" in outs[0]
    for run in runs:
        assert [r["groups"] for r in read_records(run, "outer")] == [[0, 1]] * (steps // L), run


def test_a_quorum_too_small_is_asked_again_until_enough_or_failed():
    """federation_wait.at_least: torchft's quorum asked again while it holds fewer groups than the
    round needs, told once; it returns at the first big enough (False), or at the first that
    failed (True: a failed try, however small). least_groups: the larger minimum, and whose."""
    from types import SimpleNamespace

    import torch

    from dept_mega.dept.federation_log import least_groups
    from dept_mega.dept.federation_wait import at_least
    for plan, tries, failed in (([1, 1, 2, 3], [1, 1, 2], False), ([1, -1, 2], [1, -1], True), ([1], [1], False)):
        sizes, got, short = iter(plan), [], []
        manager = SimpleNamespace(num_participants=lambda: abs(got[-1]), errored=lambda: "x" if got[-1] < 0 else None)
        least = 1 if plan == [1] else 2
        assert at_least(lambda fn: fn(), lambda: got.append(next(sizes)), manager, least, torch.device("cpu"),
                        short.append, every=0.01) is failed
        assert got == tries and short == ([1] if least == 2 else [])
    assert least_groups(2, 1) == (2, "federation.min_groups 2 > the lighthouse's --min-groups 1")
    assert least_groups(1, 2) == (2, "the lighthouse's --min-groups 2 > federation.min_groups 1")
    assert least_groups(2, 2) == (2, "federation.min_groups 2 = the lighthouse's --min-groups")
    assert least_groups(2, None) == (2, "federation.min_groups 2; the lighthouse's --min-groups not shown")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ask_again_s", [1.0, 0.1])
def test_a_wait_for_enough_groups_given_up_asks_no_more(monkeypatch, ask_again_s):
    """Federation._quorum with quorums of 1 group where a round needs 2: the wait goes on as any
    short one (here given up after federation.quorum_give_up_s: PreemptedWait), and its helper
    thread stops asking the lighthouse once it is given up. Also when the lighthouse is asked
    again sooner than the wait polls (0.1 s < federation_wait.POLL_S): each ask then returns
    within one poll, and the give-up must still come."""
    from types import SimpleNamespace

    import torch

    from dept_mega.dept import federation as fed
    from dept_mega.dept import federation_wait
    from dept_mega.preemption import PreemptedWait
    monkeypatch.setattr(federation_wait, "ASK_AGAIN_S", ask_again_s)
    asked = []
    job = object.__new__(fed.Federation)
    job.round, job.least, job.least_why, job.where, job._loop = 3, 2, "why", "127.0.0.1:1", None
    job.device, job._healed, job._rounds, job.say = torch.device("cpu"), None, 4, None
    job.cfg = SimpleNamespace(federation=SimpleNamespace(quorum_give_up_s=0.6))
    job.manager = SimpleNamespace(start_quorum=lambda **kw: asked.append(kw), errored=lambda: None,
                                  num_participants=lambda: 1, current_step=lambda: 0)
    with pytest.raises(PreemptedWait) as stop:
        job._quorum(allow_heal=True)
    assert stop.value.gave_up == "federation.quorum_give_up_s = 0.6 s"
    n = len(asked)
    assert n >= 1 and all(kw == {"allow_heal": True} for kw in asked)
    time.sleep(1.5)  # (asked again every federation_wait.ASK_AGAIN_S while not stopped)
    assert len(asked) == n
