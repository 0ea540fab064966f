"""Federated source groups: the whole federation stopped and relaunched, its group jobs resuming
from checkpoints of different rounds (docs/launching.md §12, "Stopping and resuming the whole
federation")."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("torchft")

from tests.federation_utils import (ENV, federation, finish_all, read_dumps, read_records,  # noqa: E402
                                    trained_steps, wait_for, write_config)

L, STEPS = 2, 10


def _stop_at_different_rounds(tmp_path, stops: dict) -> tuple[str, list]:
    """The group jobs ``stops`` (group -> its ``train.exit_interval``) trained together, each
    stopping after its own step (those left go on alone: a round needs 1 group). Returns the
    config and the run directories."""
    G = len(stops)
    cfg = write_config(str(tmp_path), steps=STEPS, local_steps=L, sources=G)
    runs = [str(tmp_path / f"g{g}") for g in range(G)]
    with federation(min_groups=1) as jobs:
        first = [jobs.launch(cfg, runs[g], g, f"train.exit_interval={stops[g]}", groups=G, min_groups=1,
                             timeout_s=15) for g in range(G)]
        outs = finish_all(first)
    for p, out in zip(first, outs):
        assert p.returncode == 0, out[-3000:]
    return cfg, runs


def test_jobs_resuming_at_different_rounds_heal_at_their_first_quorum(tmp_path):
    """Two group jobs train together; group 0 stops after round 0 (``train.exit_interval``),
    group 1 trains rounds 1 and 2 alone and stops after round 2. Both are relaunched together on
    a new lighthouse that needs both (--min-groups 2, federation.min_groups 2). Neither is
    refused: group 0 (checkpoint of round 1's start) heals from group 1 at their first quorum
    and says so, continues at round 3 (its data position: the run's step), and right after
    round 3's sync both hold the same body; group 1 does not heal."""
    import torch
    steps, G = STEPS, 2
    cfg, runs = _stop_at_different_rounds(tmp_path, {0: L, 1: 3 * L})
    dump = str(tmp_path / "dump")
    assert [r["groups"] for r in read_records(runs[1], "outer")] == [[0, 1], [1], [1]]
    env = dict(ENV, DEPT_FEDERATION_DUMP=dump)
    with federation(min_groups=2) as jobs:
        again = [jobs.launch(cfg, runs[g], g, env=env, groups=G, min_groups=2, timeout_s=15, checkpoints=False)
                 for g in range(G)]  # (the relaunches' checkpoints are read by nothing)
        outs = finish_all(again)
    for p, out in zip(again, outs):
        assert p.returncode == 0, out[-3000:]
    for line in ("federation: round 3: groups [0, 1] (this job healed from a live peer)",
                 "federation: group 0 healed from a live peer at round 3 (step 2 -> 6); groups [0, 1]"):
        assert line in outs[0], outs[0][-3000:]
    assert "federation: round 3: groups [0, 1]\n" in outs[1] and "healed from a live peer" not in outs[1], outs[1][-3000:]
    (joined, _), = read_dumps(dump, 0, "heal").items()
    assert joined == 3 and read_dumps(dump, 1, "heal") == {}
    healed = [(m["round"], m["step"]) for m in read_records(runs[0], "membership") if m["healed"]]
    assert healed == [(3, 3 * L)], healed
    assert trained_steps(runs[0]) == [1, 2] + list(range(3 * L + 1, steps + 1))  # rounds 1 and 2 skipped
    d = [read_dumps(dump, g) for g in range(G)]
    assert sorted(d[0]) == sorted(d[1]) == [3, 4]
    for r in (3, 4):
        assert d[0][r]["groups"] == d[1][r]["groups"] == [0, 1], r
        assert torch.equal(d[0][r]["body"], d[1][r]["body"]), r


@pytest.mark.slow
def test_a_job_healed_in_the_fresh_start_wait_passes_on_what_it_received(tmp_path):
    """Three group jobs: groups 0 and 2 stop after round 0, group 1 after round 2. Relaunched
    (a round needs 2 groups), groups 0 and 1 first: group 0 heals from group 1 at their quorum
    and waits with it for group 2 (the fresh start's wait; what it received is applied after
    it). Group 2, started then, is assigned group 0 as its source (torchft picks the first
    replica at the newest step) and gets the round 3 state group 0 received, not group 0's own
    of round 1: all three train rounds 3 and 4 with the same body."""
    import torch
    cfg, runs = _stop_at_different_rounds(tmp_path, {0: L, 1: 3 * L, 2: L})
    dump = str(tmp_path / "dump")
    env = dict(ENV, DEPT_FEDERATION_DUMP=dump)
    kw = dict(env=env, groups=3, min_groups=2, timeout_s=60, checkpoints=False)  # (the relaunches': read by nothing)
    with federation(min_groups=2) as jobs:
        early = [jobs.launch(cfg, runs[g], g, **kw) for g in (0, 1)]

        def waiting() -> bool:  # (the log is created by the job)
            if not os.path.exists(early[0].log):
                return False
            with open(early[0].log, encoding="utf-8", errors="replace") as f:
                return "federation: fresh start: groups [0, 1] of 3 are here" in f.read()
        wait_for(lambda: waiting() or early[0].poll() is not None, "groups 0 and 1 did not meet")
        late = jobs.launch(cfg, runs[2], 2, **kw)
        outs = finish_all(early + [late])
    for p, out in zip(early + [late], outs):
        assert p.returncode == 0, out[-3000:]
    for g in (0, 2):
        assert f"federation: group {g} healed from a live peer at round 3 (step 2 -> 6)" in outs[g], outs[g][-3000:]
        assert list(read_dumps(dump, g, "heal")) == [3], g
    assert "healed from a live peer" not in outs[1], outs[1][-3000:]
    d = [read_dumps(dump, g) for g in range(3)]
    for r in (3, 4):
        assert d[0][r]["groups"] == [0, 1, 2], r
        for g in (1, 2):
            assert torch.equal(d[g][r]["body"], d[0][r]["body"]), (r, g)
