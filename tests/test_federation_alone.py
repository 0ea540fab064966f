"""Federated source groups: a group job that ran rounds alone (``federation.min_groups`` = 1 and
a lighthouse ``--min-groups 1``: the other group missed the fresh start) and a new group that
joins it later (docs/launching.md §12, "A fresh start" and "A new group")."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("torchft")

from tests.federation_utils import (ENV, Lighthouse, finish_all, is_held, launch_group, read_dumps,  # noqa: E402
                                    read_records, wait_for, wait_for_requests, write_config)


def test_a_new_group_joins_a_group_that_ran_alone(tmp_path):
    """Group 0 misses nobody's fresh start: it waits ``timeout_s`` for group 1, then trains
    rounds 0-2 alone (no cross-group exchange: nothing to average). Group 1, started then for
    the first time, must heal from group 0 at round 3's start (it is behind: torchft's step of
    group 0 counts the rounds it committed alone) and both finish the run together — not take
    the quorum for a fresh start of both and run the fresh start's config check against group
    0's pseudo-gradient exchange (a collective mismatch that aborts group 1)."""
    L, steps, G = 2, 12, 2
    cfg = write_config(str(tmp_path), steps=steps, local_steps=L, sources=G)
    dump, go = str(tmp_path / "dump"), str(tmp_path / "go")
    runs = [str(tmp_path / f"g{g}") for g in range(G)]
    lh = Lighthouse(min_groups=1)
    kw = dict(groups=G, min_groups=1, timeout_s=3)
    env = dict(ENV, DEPT_FEDERATION_DUMP=dump)
    procs = []
    try:
        procs.append(launch_group(cfg, runs[0], lh.addr, 0, env=dict(env, DEPT_FEDERATION_HOLD=f"3:start:{go}"), **kw))
        wait_for(lambda: is_held(dump, 0, 3) or procs[0].poll() is not None, "group 0 did not reach round 3's start")
        assert procs[0].poll() is None, "group 0 ended before round 3"
        procs.append(launch_group(cfg, runs[1], lh.addr, 1, env=env, **kw))
        wait_for_requests(lh, 1, procs[1:], "the new group 1")
        open(go, "w").close()
        outs = finish_all(procs, timeout=180)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        lh.stop()
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
