"""A group job dies while its quorum request is pending at the lighthouse: torchft's lighthouse
still counts that request until the job's heartbeats are ``--heartbeat-timeout-s`` old, so the
survivors' quorum can form with the dead group in it. Configuring that quorum's process group
(or healing from the dead group) then fails on the survivors; they ask for a new quorum
without it (dept_mega/dept/federation.py, ``Federation._quorum``) and go on, instead of exiting."""
from __future__ import annotations

import os
import signal

import pytest

pytest.importorskip("torchft")

from tests.federation_utils import (ENV, federation, finish_all, is_held, read_dumps, read_records,  # noqa: E402
                                    wait_for, wait_for_requests, write_config)


@pytest.mark.slow
def test_survivors_go_on_when_a_joining_group_dies_with_its_request_pending(tmp_path):
    """Three groups expected; groups 1 and 2 start (their fresh start waits timeout_s for group
    0, then they run rounds 0 and 1 as [1, 2]) and are held before round 2's quorum. Group 0
    starts then and asks to join; its request is pending (the others have not asked) when it is
    killed with SIGKILL, and groups 1 and 2 are released at once: every group of the previous
    quorum has now asked, so torchft's lighthouse forms round 2's quorum from the three
    requests, the dead group's included (its heartbeats are younger than
    --heartbeat-timeout-s), and the survivors' process group cannot be configured with it.
    Each survivor says so in one line naming round 2, asks again, gets the quorum of the two
    and finishes with exit status 0; every round is averaged over groups [1, 2] (the mean =
    their two pseudo-gradients' average, as if group 0 had never come), with the same θ_t in
    both."""
    import torch
    L, steps, G, timeout_s = 2, 8, 3, 3
    cfg = write_config(str(tmp_path), steps=steps, local_steps=L, sources=G)
    dump, go = str(tmp_path / "dump"), str(tmp_path / "go")
    env = dict(ENV, DEPT_FEDERATION_DUMP=dump)
    runs = [str(tmp_path / f"g{g}") for g in range(G)]
    # join_s long: group 0's request stays pending until the others ask
    kw = dict(groups=G, min_groups=2, timeout_s=timeout_s, checkpoints=False)  # (no checkpoint is read)
    with federation(min_groups=2, join_s=60, heartbeat_s=2.0) as jobs:
        procs = [None] + [jobs.launch(cfg, runs[g], g, env=dict(env, DEPT_FEDERATION_HOLD=f"2:start:{go}"),
                                       **kw) for g in (1, 2)]
        wait_for(lambda: all(is_held(dump, g, 2) or procs[g].poll() is not None for g in (1, 2)),
                 "groups 1 and 2 did not reach round 2's start")
        procs[0] = jobs.launch(cfg, runs[0], 0, env=env, **kw)
        wait_for_requests(jobs.lh, 1, procs, "group 0's request to join")
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].wait()
        open(go, "w").close()  # at once: well inside group 0's heartbeat timeout
        outs = finish_all(procs[1:], timeout=120)
    for p, out in zip(procs[1:], outs):
        assert p.returncode == 0, out[-3000:]
    for out in outs:  # the race happened and was survived: one line per retry, naming the round
        retries = [ln for ln in out.splitlines()
                   if ln.startswith("federation: round 2: the quorum of groups [0, 1, 2] failed")]
        assert len(retries) == 1 and "asking the lighthouse again (try 2 of " in retries[0], out[-3000:]
    outer = [{r["round"]: r for r in read_records(run, "outer")} for run in runs[1:]]
    assert sorted(outer[0]) == sorted(outer[1]) == list(range(steps // L))
    assert all(outer[0][r]["groups"] == outer[1][r]["groups"] == [1, 2] for r in outer[0]), outer
    d = {g: read_dumps(dump, g) for g in (1, 2)}
    for r in (2, 3):
        assert d[1][r]["groups"] == d[2][r]["groups"] == [1, 2]
        assert d[1][r]["means"]
        for i, (name, mean) in enumerate(d[1][r]["means"]):
            ref = (d[1][r]["sent"][i][1] + d[2][r]["sent"][i][1]) / 2
            assert torch.allclose(mean, ref, rtol=1e-5, atol=1e-8), (r, name, (mean - ref).abs().max())
            assert torch.equal(d[2][r]["means"][i][1], mean), (r, name)
        for k, theta in d[1][r]["theta"].items():
            assert torch.equal(d[2][r]["theta"][k], theta), (r, k)
