"""Federated source groups: a group that dies, is slow, stops or comes back while the others
go on (docs/launching.md §12: "A round", "Coming back", "A slow group")."""
from __future__ import annotations

import json
import os
import signal
import time
from contextlib import ExitStack

import pytest
import yaml

pytest.importorskip("torchft")

from tests.federation_utils import (ENV, FAIL_CONFIGURE_ENV, federation, finish_all, is_held, read_dumps, read_records,  # noqa: E402
                                    trained_steps, wait_for, wait_for_requests, write_config)
from tests.netns_sites import sites  # noqa: E402


@pytest.mark.slow
def test_group_dies_rejoins_and_a_new_group_joins(tmp_path):
    """Four groups expected, three start. Group 2 is killed with SIGKILL in round 2: groups 0
    and 1 go on, each round without it averaged over the two (its mean pseudo-gradient = the
    two survivors' recorded pseudo-gradients averaged), their wait bounded by timeout_s.
    Group 2 relaunched and group 3 started for the first time both join at a round start by
    healing: right after their first sync their body equals the others' exactly, group 2's
    source holds its last checkpoint's embeddings and optimizer state when it rejoins, and
    group 3 is counted (weight 1/4, ``groups``) from then on. Every round's outer bytes over
    the jobs that took part = tools/dept_costs.py's prediction for that many groups."""
    import torch

    from dept_mega.config import load_config
    from dept_mega.dept.costs import predict_outer_round_bytes
    from dept_mega.export.checkpoint_reader import read_full_weights
    # timeout_s also bounds the fresh start's wait for group 3 (not there until relaunch time)
    L, steps, timeout_s, G = 2, 12, 7, 4  # (6 rounds: the late groups join by round 4, held there)
    cfg = write_config(str(tmp_path), steps=steps, local_steps=L, sources=G)
    dump = str(tmp_path / "dump")
    runs = [str(tmp_path / f"g{g}") for g in range(G)]
    # group 2's periodic checkpoints (its last one is what it resumes from); the other jobs
    # write only the run's final one (read below), no checkpoint a round that nothing reads
    saves = {2: (f"train.save_interval={L}",)}
    env = dict(ENV, DEPT_FEDERATION_DUMP=dump)
    kw = dict(groups=G, min_groups=2, timeout_s=timeout_s)
    go = str(tmp_path / "go")
    # test hooks (federation_dump.py), instead of racing the jobs' progress: group 2 stops before
    # round 2's exchange (killed there); groups 0 and 1 wait at round 4's start until the
    # lighthouse holds both late groups' quorum requests, so they join before the run ends
    hold = {0: f"4:start:{go}", 1: f"4:start:{go}", 2: f"2:exchange:{tmp_path / 'never'}"}
    with federation(min_groups=2) as jobs:
        procs = [jobs.launch(cfg, runs[g], g, *saves.get(g, ()),
                             env=dict(env, DEPT_FEDERATION_HOLD=hold[g]) if g in hold else env, **kw)
                 for g in range(3)]
        wait_for(lambda: os.path.exists(os.path.join(dump, "g2_rank0_held2")) or procs[2].poll() is not None,
                  "group 2 did not reach round 2's exchange")
        assert procs[2].poll() is None, "group 2 ended before round 2's exchange"
        os.kill(procs[2].pid, signal.SIGKILL)
        procs[2].wait()
        ckpts = sorted(int(d.split("_")[1]) for d in os.listdir(os.path.join(runs[2], "checkpoints"))
                       if d.startswith("step_"))
        # relaunch once the survivors completed round 2 without it (as a requeue would, minutes
        # later): a join request arriving while they redo the failed exchange is another case
        wait_for(lambda: os.path.exists(os.path.join(dump, "g0_rank0_round2.pt")),
                  "groups 0 and 1 did not complete round 2 without group 2")
        late = [jobs.launch(cfg, runs[g], g, env=env, **kw) for g in (2, 3)]
        wait_for(lambda: all(is_held(dump, g, 4) or procs[g].poll() is not None for g in (0, 1)),
                  "groups 0 and 1 did not reach round 4's start")
        assert procs[0].poll() is None and procs[1].poll() is None, "group 0 or 1 ended before round 4"
        # (the late groups' requests: to join, or, joined at an earlier round start, round 4's)
        wait_for_requests(jobs.lh, 2, late, "the late groups 2 and 3")
        open(go, "w").close()
        outs = finish_all(procs[:2] + late, timeout=240)
    for p, out in zip(procs[:2] + late, outs):
        assert p.returncode == 0, out[-3000:]
    outer = [{r["round"]: r for r in read_records(run, "outer")} for run in runs]
    assert outer[0].keys() == outer[1].keys() and len(outer[0]) == steps // L
    for r, rec in outer[0].items():
        assert rec["groups"] == outer[1][r]["groups"]
    two = [r for r, rec in outer[0].items() if rec["groups"] == [0, 1]]
    assert two and min(two) == 2 and outer[0][1]["groups"] == [0, 1, 2], "round 2 was not completed by the two alone"
    assert max(rec["seconds"] for rec in outer[0].values()) < timeout_s + 5  # the wait is bounded
    # the average of every round is over the groups that took part, from their own pseudo-gradients
    dumps = [read_dumps(dump, g) for g in range(G)]
    assert sorted(dumps[0]) == sorted(outer[0])
    for r, d in dumps[0].items():
        assert d["groups"] == outer[0][r]["groups"]
        sent = [dumps[g][r]["sent"] for g in d["groups"]]
        for i, (name, mean) in enumerate(d["means"]):
            ref = sum(s[i][1] for s in sent) / len(sent)
            assert torch.allclose(mean, ref, rtol=1e-5, atol=1e-8), (r, name, (mean - ref).abs().max())
            for g in d["groups"]:  # every group stepped with the same mean
                assert torch.equal(dumps[g][r]["means"][i][1], mean), (r, g)
    # both late groups healed at a round start and are counted from then on
    names = [s["name"] for s in yaml.safe_load(open(cfg))["data"]["sources"]]
    for g in (2, 3):
        heals = read_dumps(dump, g, "heal")
        assert len(heals) == 1, (g, sorted(heals))
        (joined, heal), = heals.items()
        assert joined > 2 and heal["source"] == names[g]
        assert sorted(r for r in dumps[g] if r >= joined) == list(range(joined, steps // L))
        for r in range(joined, steps // L):
            assert g in outer[0][r]["groups"], (g, r, outer[0][r]["groups"])
        assert joined * L + 1 in trained_steps(runs[g])  # trains from that round's start
        mine = [m for m in read_records(runs[g], "membership") if m["healed"]]
        assert [(m["round"], m["step"]) for m in mine] == [(joined, joined * L)]  # the step it trains from
        first = dumps[g][joined]  # right after its first sync: the body equals the others' exactly
        for other in first["groups"]:
            assert torch.equal(dumps[other][joined]["body"], first["body"]), (g, other)
    assert outer[0][steps // L - 1]["groups"] == [0, 1, 2, 3]
    # group 2's source state when it rejoined = its last checkpoint's
    heal = read_dumps(dump, 2, "heal")
    (joined, heal), = heal.items()
    saved = read_full_weights(runs[2], ckpts[-1], names[2])
    embs = {k: v for k, v in saved.items() if not k.startswith("body.")}
    assert embs and len(embs) == len(heal["embeddings"])
    for k, v in embs.items():
        mine = [t for n, t in heal["embeddings"].items() if n.split(".", 1)[1] == k.split(".", 1)[1]]
        assert len(mine) == 1 and torch.equal(mine[0], v), k
    from dept_mega.checkpoint_format import read_full, saved_keys
    step_path = os.path.join(runs[2], "checkpoints", f"step_{ckpts[-1]}")
    with open(os.path.join(step_path, "group0.json")) as f:
        assert json.load(f)["dept"]["installed"] == names[2]
    saved_opt = read_full(step_path, [k for k in saved_keys(step_path) if k.startswith("optim/emb/")])
    want = heal["optimizer"]["state"]
    assert want and len(saved_opt) == sum(torch.is_tensor(v) for st in want.values() for v in st.values())
    for i, st in want.items():  # the installed source's optimizer state: the model's keys
        for k, v in st.items():
            assert any(key.split("/")[2] == k and torch.equal(t, v) for key, t in saved_opt.items()), (i, k)
    # bytes: every round's outer bytes summed over the jobs that took part = the cost model's
    job_cfg = load_config(os.path.join(runs[0], "config.yaml"))
    for r, rec in outer[0].items():
        n = len(rec["groups"])
        measured = sum(outer[g][r]["bytes"]["outer_body"] for g in rec["groups"])
        assert measured == predict_outer_round_bytes(job_cfg, n)["outer_body"] > 0, (r, rec["groups"])
    membership = read_records(runs[0], "membership")
    assert [m["left"] for m in membership if m["left"]] == [[2]]
    joins = [m["joined"] for m in membership if m["joined"]]
    assert joins[0] == [0, 1, 2] and sorted(sum(joins[1:], [])) == [2, 3]
    bodies = [read_full_weights(run, steps, names[g]) for g, run in enumerate(runs)]
    keys = [k for k in bodies[0] if k.startswith("body.")]
    assert keys
    for w in bodies[1:]:
        for k in keys:
            assert (w[k] == bodies[0][k]).all(), k


def test_trim_group_leaves_and_rejoins(tmp_path):
    """TRIM, two groups, three sources (group 1 holds sources 0 and 2, data.sources[].group):
    group 1 stops after round 1 (``train.exit_interval``, a checkpoint),
    group 0 trains rounds 2 and 3 alone (its φ moves on; only its own source, none of group
    1's) and holds at round 4's start (a test hook); group 1 is relaunched then, and group 0
    is let go once the lighthouse holds group 1's quorum request, so that round 4's quorum
    has both (no race on timing: wait_for_requests). Group 1 heals at a round start:
    it receives φ and its rows' outer state from group 0 — not its checkpoint's, which is
    older — while its source's compact table's AdamW state is its checkpoint's (installed
    there or stored); right after its first
    sync its φ and body equal group 0's, and both finish with the same φ and body."""
    import torch
    L, steps, G = 2, 12, 2  # (rounds 4 and 5 trained by both after the heal)
    owners = [1, 0, 1]
    cfg = write_config(str(tmp_path), steps=steps, local_steps=L, sources=len(owners), owners=owners)
    dump, go = str(tmp_path / "dump"), str(tmp_path / "go")
    # (no periodic checkpoints: group 1's of step 2L is written at its exit_interval stop)
    trim = ("dept.variant=trim", "dept.outer_optimizer.name=nesterov", "dept.outer_optimizer.momentum=0.9",
            "dept.outer_optimizer.lr=0.7")
    kw = dict(groups=G, min_groups=1, timeout_s=15)
    runs = [str(tmp_path / f"g{g}") for g in range(G)]
    with federation(min_groups=1) as jobs:
        # (group 1's checkpoint of its stop is read; the jobs' others by nothing: not written)
        procs = [jobs.launch(cfg, runs[0], 0, *trim, env=dict(ENV, DEPT_FEDERATION_DUMP=dump,
                                                                 DEPT_FEDERATION_HOLD=f"4:start:{go}"),
                             checkpoints=False, **kw),
                 jobs.launch(cfg, runs[1], 1, *trim, f"train.exit_interval={2 * L}",
                        env=dict(ENV, DEPT_FEDERATION_DUMP=dump), **kw)]
        first = finish_all(procs[1:])[0]
        assert procs[1].returncode == 0, first[-3000:]
        # relaunched only once group 0 waits at round 4's start: rounds 2 and 3 are its alone
        wait_for(lambda: is_held(dump, 0, 4) or procs[0].poll() is not None, "group 0 did not reach round 4's start")
        assert procs[0].poll() is None, "group 0 ended before round 4's start"
        again = jobs.launch(cfg, runs[1], 1, *trim, env=dict(ENV, DEPT_FEDERATION_DUMP=dump), checkpoints=False, **kw)
        wait_for_requests(jobs.lh, 1, [again], "the relaunched group 1")
        open(go, "w").close()
        outs = finish_all([procs[0], again], timeout=240)
    for p, out in zip([procs[0], again], outs):
        assert p.returncode == 0, out[-3000:]
    outer = {r["round"]: r["groups"] for r in read_records(runs[0], "outer")}
    assert sorted(outer) == list(range(steps // L))
    assert outer[0] == outer[1] == [0, 1] and outer[2] == outer[3] == [0]
    (joined, heal), = read_dumps(dump, 1, "heal").items()
    assert joined == 4 and all(outer[r] == [0, 1] for r in range(joined, steps // L)), (joined, outer)
    d0, d1 = read_dumps(dump, 0), read_dumps(dump, 1)
    # φ from the peer (as group 0 left round joined - 1), not from group 1's own older state
    assert torch.equal(heal["phi"], d0[joined - 1]["phi"])
    assert not torch.equal(heal["phi"], d1[1]["phi"])
    # only group 1 trained its sources, and not while it was away
    names = [s["name"] for s in yaml.safe_load(open(cfg))["data"]["sources"]]
    for g, run in enumerate(runs):
        for rec in read_records(run, "train"):
            assert all(owners[names.index(n)] == g for n in rec["loss_by_source"]), (g, rec["step"])
    gone = [rec["step"] for rec in read_records(runs[1], "train") if 2 * L < rec["step"] <= joined * L]
    assert gone == [], gone
    # its compact table's inner optimizer state is its checkpoint's (step 2L): the model's keys
    # when the source was installed there, else the stored source's (format 2)
    from dept_mega.checkpoint_format import read_full, saved_keys
    assert owners[names.index(heal["source"])] == 1
    step_path = os.path.join(runs[1], "checkpoints", f"step_{2 * L}")
    with open(os.path.join(step_path, "group0.json")) as f:
        installed = json.load(f)["dept"]["installed"]
    prefix = "optim/emb/" if installed == heal["source"] else f"source/{heal['source']}/optim/emb/"
    saved_opt = read_full(step_path, [k for k in saved_keys(step_path) if k.startswith(prefix)])
    want = heal["optimizer"]["state"]
    assert want and len(saved_opt) == sum(torch.is_tensor(v) for st in want.values() for v in st.values())
    for i, st in want.items():
        for k, v in st.items():
            if torch.is_tensor(v):
                assert any(key[len(prefix):].split("/")[0] == k and torch.equal(t, v)
                           for key, t in saved_opt.items()), (i, k)
    for r in range(joined, steps // L):  # the same φ and body from its first sync on
        assert torch.equal(d1[r]["phi"], d0[r]["phi"]), r
        assert torch.equal(d1[r]["body"], d0[r]["body"]), r


@pytest.mark.slow
def test_slow_group_is_left_out_and_rejoins(tmp_path):
    """Three groups, timeout_s = 3, the lighthouse's join timeout 3 s (wide enough for the
    groups' spread at a round start on a loaded machine). Group 2 is alive (it heartbeats) but
    held before round 1's exchange until groups 0 and 1 have completed rounds 1 and 2 without
    it and wait at round 3's start: they did not wait for it, and their round 1 took at most
    timeout_s + the join timeout (+ a margin), averaged over the two. Group 2, let go, finds
    the round completed without it, drops out of it and rejoins at the next round start by
    healing: right after its first sync its body equals the others'; all three exit 0 and
    finish with the same body."""
    import torch
    L, steps, timeout_s, join_s, G = 2, 10, 3, 3.0, 3
    cfg = write_config(str(tmp_path), steps=steps, local_steps=L, sources=G)
    dump, go = str(tmp_path / "dump"), str(tmp_path / "go")
    env = dict(ENV, DEPT_FEDERATION_DUMP=dump)
    runs = [str(tmp_path / f"g{g}") for g in range(G)]
    # (the lighthouse command itself, --join-timeout-s among its options)
    with federation(min_groups=2, join_s=join_s, process=True) as jobs:
        # groups 0 and 1 wait at round 3's start until group 2 is let go and has asked for a
        # quorum, so that the run is not over before group 2 comes back
        hold = {0: f"3:start:{go}", 1: f"3:start:{go}", 2: f"1:exchange:{go}2"}
        procs = [jobs.launch(cfg, runs[g], g, env=dict(env, DEPT_FEDERATION_HOLD=hold[g]) if g in hold else env,
                             groups=G, min_groups=2, timeout_s=timeout_s, checkpoints=False)  # (read by nothing)
                 for g in range(G)]
        wait_for(lambda: os.path.exists(os.path.join(dump, "g2_rank0_held1")) or procs[2].poll() is not None,
                  "group 2 did not reach round 1's exchange")
        # rounds 1 and 2 completed by groups 0 and 1 while group 2 is held (not waiting for it)
        wait_for(lambda: all(is_held(dump, g, 3) or procs[g].poll() is not None for g in (0, 1)),
                 "groups 0 and 1 did not complete rounds 1 and 2 without the held group 2")
        assert all(p.poll() is None for p in procs), "a group ended before round 3's start"
        open(go + "2", "w").close()
        wait_for_requests(jobs.lh, 1, [procs[2]], "the left-out group 2")
        open(go, "w").close()
        outs = finish_all(procs, timeout=120)
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    outer = [{r["round"]: r for r in read_records(run, "outer")} for run in runs]
    assert sorted(outer[0]) == list(range(steps // L))
    assert outer[0][0]["groups"] == [0, 1, 2] and outer[0][1]["groups"] == [0, 1]
    bound = timeout_s + join_s + 4  # the wait is bounded
    assert outer[0][1]["seconds"] < bound, outer[0][1]["seconds"]
    d = [read_dumps(dump, g) for g in range(G)]
    assert 1 not in d[2]  # it took no part in the round completed without it
    (joined, _), = read_dumps(dump, 2, "heal").items()
    assert joined == 3 and outer[0][2]["groups"] == [0, 1], (joined, outer[0][2])
    # its heal is recorded at the step it trains from (summarize_runs: r3+2h, its tokens from there)
    mine = [m for m in read_records(runs[2], "membership") if m["healed"]]
    assert [(m["round"], m["step"], m["joined"]) for m in mine] == [(joined, joined * L, [2])], mine
    for r in range(joined, steps // L):
        assert 2 in outer[0][r]["groups"], (r, outer[0][r]["groups"])
        assert torch.equal(d[2][r]["body"], d[0][r]["body"]), r  # from its first sync on
    for run in runs:
        assert read_records(run, "outer")[-1]["groups"] == [0, 1, 2]


def test_group_dies_during_an_overlapped_exchange(tmp_path):
    """dept.outer_overlap: round 1's end exchange is launched right after round 2's start
    quorum (the hook ``2:launch`` holds group 2 in it, after the count of contributing groups,
    before its all-reduce) and group 2 is killed with SIGKILL while groups 0 and 1 have the
    all-reduce in flight (training round 2's first step). Their wait fails, they redo
    it blocking with the survivors: both exit 0, the rounds from 2 on count groups [0, 1],
    the redone update is the mean of the two survivors' pseudo-gradients (what they sent
    at launch), their θ_t stay equal every round and their bodies after the last sync."""
    import torch
    L, steps, G = 2, 8, 3
    cfg = write_config(str(tmp_path), steps=steps, local_steps=L, sources=G)
    dump = str(tmp_path / "dump")
    env = dict(ENV, DEPT_FEDERATION_DUMP=dump)
    runs = [str(tmp_path / f"g{g}") for g in range(G)]
    with federation(min_groups=2) as jobs:
        procs = [jobs.launch(cfg, runs[g], g, "dept.outer_overlap=true", "dept.outer_delay=1",
                        env=dict(env, DEPT_FEDERATION_HOLD=f"2:launch:{tmp_path / 'never'}") if g == 2 else env,
                        groups=G, min_groups=2, timeout_s=10, checkpoints=False) for g in range(G)]  # (read by nothing)
        wait_for(lambda: os.path.exists(os.path.join(dump, "g2_rank0_held2")) or procs[2].poll() is not None,
                  "group 2 did not reach round 2's launch")
        assert procs[2].poll() is None, "group 2 ended before round 2's launch"
        os.kill(procs[2].pid, signal.SIGKILL)
        procs[2].wait()
        outs = finish_all(procs[:2], timeout=120)
    for p, out in zip(procs[:2], outs):
        assert p.returncode == 0, out[-3000:]
    outer = [{r["round"]: r for r in read_records(run, "outer")} for run in runs[:2]]
    assert sorted(outer[0]) == sorted(outer[1]) == list(range(steps // L))
    assert [outer[0][r]["groups"] for r in range(steps // L)] == [[0, 1, 2], [0, 1, 2], [0, 1], [0, 1]]
    # the launched try that failed is in round 2's failed_bytes (apart from bytes), no other round's
    for job in outer:
        assert [r for r, rec in job.items() if any(rec["failed_bytes"].values())] == [2], job
        assert 0 < job[2]["failed_bytes"]["outer_body"] <= job[2]["bytes"]["outer_body"], job[2]
    d = [read_dumps(dump, g) for g in range(2)]
    # round 2's record holds round 1's exchange (launched at round 2's start), redone by the two
    sent = [d[g][2]["sent"] for g in range(2)]
    assert d[0][2]["groups"] == [0, 1] and d[0][2]["means"]
    for i, (name, mean) in enumerate(d[0][2]["means"]):
        ref = (sent[0][i][1] + sent[1][i][1]) / 2
        assert torch.allclose(mean, ref, rtol=1e-5, atol=1e-8), (name, (mean - ref).abs().max())
        assert torch.equal(d[1][2]["means"][i][1], mean)
    for r in range(steps // L):  # the replicated θ_t every round; the bodies after the last (blocking) sync
        for k, theta in d[0][r]["theta"].items():
            assert torch.equal(d[1][r]["theta"][k], theta), (r, k)
    assert torch.equal(d[0][steps // L - 1]["body"], d[1][steps // L - 1]["body"])


@pytest.mark.parametrize("least", [1, 2])
@pytest.mark.parametrize("how", ["stopped", "network"])
@pytest.mark.slow
def test_a_group_cut_off_and_back_goes_on_without_a_relaunch(tmp_path, least, how):
    """A group cut off past the lighthouse's heartbeat timeout, then back, not relaunched; both
    jobs exit 0. (Where in its round the cut comes is left to chance, as a cut's moment is.)
    ``how``: ``stopped``: group 1's process stopped (SIGSTOP: no heartbeat, no reply to a
    collective), then let go (SIGCONT). ``network``: the jobs at two sites (network namespaces,
    tests/netns_sites.py; the lighthouse at group 0's, each job advertising its address with
    ``federation.advertise_host: route``) and the network between them cut: packets vanish in
    both directions, every connection between the sites stays open, half-open, while both jobs
    run on; then the network is back.
    - Rounds need 1 group: group 0 goes on alone once the lighthouse stops hearing group 1 (up
      to round 10's start, where it waits until group 1, back, has asked for a quorum: a run
      that group 0 finished alone before would leave group 1 to train alone, as after a death;
      a restored link brings group 1 back only after TCP's retransmission backoff, seconds);
      group 1 finds the round it was in completed without it and heals from group 0 at the next
      round start: it takes no part in the rounds group 0 completed alone, and takes part in
      every round from its heal on with its body equal to group 0's after each sync.
    - Rounds need 2: group 0 waits (its exchange or its quorum) until group 1 is back; every
      round is both groups', their bodies equal after each sync, and nobody heals."""
    import torch
    L, steps, G = 2, 32 if least == 1 else 12, 2
    cfg = write_config(str(tmp_path), steps=steps, local_steps=L, sources=G)
    dump, go = str(tmp_path / "dump"), str(tmp_path / "go")
    env = dict(ENV, DEPT_FEDERATION_DUMP=dump)
    runs = [str(tmp_path / f"g{g}") for g in range(G)]

    def alone():
        try:
            return [r["round"] for r in read_records(runs[0], "outer") if r["groups"] == [0]]
        except (OSError, ValueError):  # (not there yet, a line being written)
            return []
    with ExitStack() as stack:
        envs, extra, lighthouse = [env] * G, (), {}
        if least == 1:  # (a test hook, federation_dump.py)
            envs = [dict(env, DEPT_FEDERATION_HOLD=f"10:start:{go}"), env]
        if how == "network":
            net = stack.enter_context(sites())
            envs = [net.env("A", envs[0]), net.env("B", envs[1])]
            extra = ("federation.advertise_host=route",)
            lighthouse = dict(process=True, env=net.env("A", ENV), host=net.addr["A"])
        jobs = stack.enter_context(federation(min_groups=least, heartbeat_s=1.0, **lighthouse))
        procs = [jobs.launch(cfg, runs[g], g, *extra, env=envs[g], groups=G, min_groups=least, timeout_s=3,
                             checkpoints=False) for g in range(G)]
        wait_for(lambda: max(trained_steps(runs[1]), default=0) >= 5 or procs[1].poll() is not None,
                 "group 1 did not train 5 steps")
        if how == "network":
            cut, back = net.cut, net.restore
        else:
            cut, back = (lambda: os.kill(procs[1].pid, signal.SIGSTOP)), (lambda: os.kill(procs[1].pid, signal.SIGCONT))
        cut()
        try:
            at = max(trained_steps(runs[1]))
            if least == 1:
                wait_for(lambda: len(alone()) >= 2 or procs[0].poll() is not None,
                         "group 0 did not complete two rounds without the cut-off group 1")
            else:  # past timeout_s and the heartbeat timeout: group 0 waits
                time.sleep(5)
                # (it finishes the round group 1 was cut in, at most, and the next one's local steps)
                assert max(trained_steps(runs[0])) <= (at // L + 2) * L, (at, trained_steps(runs[0]))
        finally:
            back()
        if least == 1:
            wait_for_requests(jobs.lh, 1, [procs[1]], "group 1, back")
            open(go, "w").close()
        assert procs[0].poll() is None, "group 0 ended before group 1 came back"
        outs = finish_all(procs, timeout=120)
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    outer = [{r["round"]: r for r in read_records(run, "outer")} for run in runs]
    rounds, without = list(range(steps // L)), set(alone())
    assert sorted(outer[0]) == rounds
    d = [read_dumps(dump, g) for g in range(G)]
    if least == 1:
        assert len(without) >= 2
        assert sorted(outer[1]) == sorted(set(rounds) - without), (sorted(outer[1]), sorted(without))
        (joined, _), = read_dumps(dump, 1, "heal").items()
        assert joined == max(without) + 1, (joined, sorted(without))
        assert f"federation: group 1 healed from a live peer at round {joined}" in outs[1], outs[1][-3000:]
    else:
        assert not without and sorted(outer[1]) == rounds and read_dumps(dump, 1, "heal") == {}
        joined = 0
    for r in range(joined, steps // L):
        assert outer[0][r]["groups"] == outer[1][r]["groups"] == [0, 1], r
        assert torch.equal(d[1][r]["body"], d[0][r]["body"]), r  # (after a heal: from its first sync on)


def test_a_quorum_whose_process_group_failed_is_configured_again(tmp_path):
    """Both jobs' first configure of the quorum's process group fails (as when the groups
    cannot reach each other's address): they ask the lighthouse again and get a quorum of the
    same groups, which has the same quorum id (the lighthouse changes it only when the groups
    change), and the process group is made again for it — torchft by itself would take that id
    as configured and use a process group that was never made. Both jobs then train every
    round together and exit 0."""
    L, steps, G = 2, 4, 2
    cfg = write_config(str(tmp_path), steps=steps, local_steps=L, sources=G)
    runs = [str(tmp_path / f"g{g}") for g in range(G)]
    with federation(min_groups=G) as jobs:
        procs = [jobs.launch(cfg, runs[g], g, env=dict(ENV, **{FAIL_CONFIGURE_ENV: "1"}), groups=G, min_groups=G,
                             timeout_s=5, checkpoints=False) for g in range(G)]
        outs = finish_all(procs, timeout=120)
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
        assert "federation: round 0: the quorum of groups [0, 1] failed (injected: " in out, out[-3000:]
    for run in runs:
        assert [r["groups"] for r in read_records(run, "outer")] == [[0, 1]] * (steps // L)
