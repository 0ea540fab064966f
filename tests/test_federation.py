"""Federated source groups (issue 26): separate processes for the lighthouse and every group
job (CPU, gloo), joined through torchft (dept_mega/dept/federation.py)."""
from __future__ import annotations

import json
import os
import signal
import time

import pytest
import yaml

pytest.importorskip("torchft")

from tests.federation_utils import (ENV, SOURCES, Lighthouse, error_line, finish_all, is_held,  # noqa: E402
                                    launch_group, read_dumps, read_records, run_single_job, trained_steps,
                                    wait_for, wait_for_requests, write_config)
from tests.mp_utils import free_port  # noqa: E402
from tests.trainer_utils import ROOT  # noqa: E402

SAME_MATH = {  # (plain SPEC: test_more_sources_than_group_jobs_equal_the_single_job)
    # TRIM: φ's rows exchanged (counts, ids, rows: one committed exchange), per-row nesterov state;
    # a quantised outer sync (the groups' packed chunks all-gathered in group order) and the body
    # in fragments synchronised (blocking) at two points of the round
    "trim-int8-fragments-nesterov": ("dept.variant=trim", "dept.outer_comm_dtype=int8", "dept.outer_fragments=2",
                                     "dept.outer_optimizer.name=nesterov", "dept.outer_optimizer.momentum=0.9",
                                     "dept.outer_optimizer.lr=0.7"),
    # overlapped outer sync: the round-end exchange launched on the next round start's quorum,
    # committed τ = 1 step later where it is applied (the default correction rule)
    "spec-overlap": ("dept.outer_overlap=true", "dept.outer_delay=1"),
    # GLOB's tables (in parts), quantised, in fragments (one launched mid-round), overlapped, eager start
    "glob-int8-fragments-overlap-eager": ("dept.variant=glob", "dept.outer_comm_dtype=int8", "dept.outer_fragments=2",
                                          "dept.outer_overlap=true", "dept.outer_delay=1",
                                          "dept.outer_overlap_rule=eager", "dept.outer_optimizer.name=nesterov",
                                          "dept.outer_optimizer.momentum=0.9", "dept.outer_optimizer.lr=0.7"),
}


@pytest.mark.parametrize("case", list(SAME_MATH))
def test_three_group_jobs_equal_the_single_job(tmp_path, case):
    """Nothing fails: three group jobs give the single job's fp32 losses, per source, and the
    outer bytes of all three equal the single job's (the cost model's for three groups)."""
    from dept_mega.config import load_config
    from dept_mega.dept.costs import predict_outer_round_bytes
    extra = SAME_MATH[case]
    cfg = write_config(str(tmp_path))
    lh = Lighthouse(min_groups=SOURCES)
    try:
        runs = [str(tmp_path / f"g{g}") for g in range(SOURCES)]
        procs = [launch_group(cfg, runs[g], lh.addr, g, *extra) for g in range(SOURCES)]
        run_single_job(cfg, str(tmp_path / "single"), SOURCES, *extra)
        outs = finish_all(procs)
    finally:
        lh.stop()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    single = {r["step"]: r["loss_by_source"] for r in read_records(str(tmp_path / "single"), "train")}
    names = list(single[1])
    for g, run in enumerate(runs):
        mine = {r["step"]: r["loss_by_source"] for r in read_records(run, "train")}
        assert sorted(mine) == sorted(single)
        for step, by in mine.items():
            assert list(by) == [names[g]]
            assert abs(by[names[g]] - single[step][names[g]]) <= 1e-6, (g, step, by, single[step])
        member = read_records(run, "membership")
        assert member[0]["groups"] == [0, 1, 2] and member[0]["joined"] == [0, 1, 2]
    # bytes: each job's outer bytes summed over the groups that took part = the single job's
    single_outer = read_records(str(tmp_path / "single"), "outer")
    per_job = [read_records(run, "outer") for run in runs]
    from dept_mega.run_inputs import vocab_size_of
    job_cfg = load_config(os.path.join(runs[0], "config.yaml"))
    trim = None
    if job_cfg.dept.variant == "trim":  # |V_k| of each group's source, from its data (cost_vocabs)
        from dept_mega.dept.cost_vocabs import resolve_vocabs
        trim = list(resolve_vocabs(job_cfg).trim_vocabs.values())
        assert len(trim) == SOURCES
    predicted = predict_outer_round_bytes(job_cfg, SOURCES, global_vocab=vocab_size_of(job_cfg), trim_vocabs=trim)
    if "dept.outer_overlap=true" in extra:  # a round's end sync is counted in the next round's record
        for cat in ("outer_body", "outer_embedding"):
            assert (sum(rec["bytes"][cat] for job in per_job for rec in job)
                    == sum(rec["bytes"][cat] for rec in single_outer)), cat
        assert all(rec["groups"] == [0, 1, 2] for job in per_job for rec in job)
        return
    for r, rec in enumerate(single_outer):
        assert all(job[r]["groups"] == [0, 1, 2] for job in per_job)
        for cat in ("outer_body", "outer_embedding"):
            assert sum(job[r]["bytes"][cat] for job in per_job) == rec["bytes"][cat], (r, cat)
        if r < len(single_outer) - 1:  # (the run's last round re-syncs the fragments once more)
            assert rec["bytes"]["outer_body"] == predicted["outer_body"] > 0
            assert rec["bytes"]["outer_embedding"] == predicted["outer_embedding"]


TWO_RANK_LAYOUTS = {
    # data parallel 2, the distributed optimizer: masters and AdamW moments sharded over the
    # job's two ranks; TRIM's φ row-sharded over them, its rows' exchange split between the
    # replicas, each replica's own committed exchange
    "data2-distopt-trim": ("parallel.data=2", "optim.distributed=true", "train.global_batch_size=4",
                           "dept.variant=trim"),
    # tensor parallel 2: every body and embedding shard is its tp rank's own, the outer sync of
    # each shard meets the same tp rank of the other group (SPEC-OPT: the embeddings' vocab
    # shards and their AdamW state stay in the job)
    "tensor2-spec_opt": ("parallel.tensor=2",),
    # pipeline parallel 2: each stage syncs its own layers with the same stage of the other
    # group; GLOB's table on the first stage, its tied copy (the head) on the last
    "pipeline2-glob": ("parallel.pipeline=2", "dept.variant=glob"),
}


@pytest.mark.parametrize("layout", list(TWO_RANK_LAYOUTS))
def test_two_rank_group_jobs_equal_the_single_job(tmp_path, layout):
    """Group jobs of two ranks each (a layout of TWO_RANK_LAYOUTS inside every group job, a
    nesterov outer optimizer whose state is per rank): two group jobs give the fp32 losses of
    the single 4-rank job of the same layout, per source."""
    cfg = write_config(str(tmp_path), steps=4, sources=2, example="spec_opt" if "spec_opt" in layout else "spec")
    extra = TWO_RANK_LAYOUTS[layout] + ("dept.outer_optimizer.name=nesterov", "dept.outer_optimizer.momentum=0.9")
    lh = Lighthouse(min_groups=2)
    try:
        runs = [str(tmp_path / f"g{g}") for g in range(2)]
        # torchrun launches the pipeline layout's group jobs; the others' ranks are forked with
        # torchrun's environment (the same jobs, without a launcher and the ranks' torch imports)
        procs = [launch_group(cfg, runs[g], lh.addr, g, *extra, groups=2, min_groups=2, nproc=2,
                              torchrun=layout == "pipeline2-glob") for g in range(2)]
        # the single job while the group jobs run: its start-up fills their waits for the quorum
        run_single_job(cfg, str(tmp_path / "single"), 4, *extra)
        outs = finish_all(procs)
    finally:
        lh.stop()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    single = {r["step"]: r["loss_by_source"] for r in read_records(str(tmp_path / "single"), "train")}
    names = list(single[1])
    for g, run in enumerate(runs):
        mine = {r["step"]: r["loss_by_source"] for r in read_records(run, "train")}
        assert sorted(mine) == sorted(single) == [1, 2, 3, 4]
        for step, by in mine.items():
            assert abs(by[names[g]] - single[step][names[g]]) <= 1e-6, (g, step, by, single[step])


def test_more_sources_than_group_jobs_equal_the_single_job(tmp_path):
    """K = 4 sources, G = 2 group jobs (SPEC: every source's embeddings and AdamW state are its
    own): each job holds the sources of its site (i mod 2 by default) and trains one of them
    per round, drawn by the seeded sampler among its own (proportional); the jobs' fp32
    losses equal the single 2-group job's whose data.sources[].group says the same."""
    from dept_mega.config import load_config, source_groups
    K, G, L, steps = 4, 2, 2, 10
    cfg = write_config(str(tmp_path), steps=steps, local_steps=L, sources=K)
    owned = write_config(str(tmp_path), steps=steps, local_steps=L, sources=K, owners=[0, 1, 0, 1])
    extra = ("dept.sampling=proportional",)
    lh = Lighthouse(min_groups=G)
    try:
        runs = [str(tmp_path / f"g{g}") for g in range(G)]
        procs = [launch_group(cfg, runs[g], lh.addr, g, *extra, groups=G, min_groups=G) for g in range(G)]
        # the single job while the group jobs run: its start-up fills their waits for the quorum
        run_single_job(owned, str(tmp_path / "single"), G, *extra)
        outs = finish_all(procs)
    finally:
        lh.stop()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    single = {r["step"]: r["loss_by_source"] for r in read_records(str(tmp_path / "single"), "train")}
    names = [s.name for s in load_config(cfg).data.sources]
    job = load_config(os.path.join(runs[0], "config.yaml"))
    assert source_groups(job, G) == [0, 1, 0, 1]
    rounds = {}  # per group, the source of each round
    for g, run in enumerate(runs):
        mine = {r["step"]: r["loss_by_source"] for r in read_records(run, "train")}
        assert sorted(mine) == sorted(single) == list(range(1, steps + 1))
        trained = set()
        for step, by in mine.items():
            (name,), = [list(by)]
            assert names.index(name) % G == g, (g, step, name)  # only its own sources
            assert abs(by[name] - single[step][name]) <= 1e-6, (g, step, by, single[step])
            trained.add(name)
            rounds.setdefault(g, []).append(name) if step % L == 1 else None
        assert trained == {n for k, n in enumerate(names) if k % G == g}, trained
        # the final evaluation: each job its own sources (installed or stored), as the single job
        (ev,), (ev1,) = read_records(run, "eval"), read_records(str(tmp_path / "single"), "eval")
        assert sorted(ev["by_source"]) == sorted(trained)
        for name, v in ev["by_source"].items():
            assert v == pytest.approx(ev1["by_source"][name], abs=1e-6), (g, name, v, ev1["by_source"][name])
    # some group switches source and back: a source's stored state is reinstalled, not rebuilt
    assert any(any(a != b and a in seq[i + 1:] for i, (a, b) in enumerate(zip(seq, seq[1:])))
               for seq in rounds.values()), rounds
    # the log: the job's own lines on the groups, torchft's INFO lines off (RUST_LOG unset)
    assert "federation: round 0: groups [0, 1]" in outs[0] and "federation: group 0 of 2" in outs[0], outs[0][-3000:]
    assert "[INFO] [torchft::" not in outs[0] and "flight recorder" not in outs[0], outs[0][-3000:]
    # after the run, the lighthouse gone: dept_mega.evaluate reads a group job's checkpoint
    # offline and gives the run's final evaluation of that job's own sources
    import subprocess
    import sys
    res = str(tmp_path / "eval.json")
    p = subprocess.run([sys.executable, "-m", "dept_mega.evaluate", "--run-dir", runs[1], "--out", res],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    (ev,), got = read_records(runs[1], "eval"), json.load(open(res))["by_source"]
    assert sorted(got) == sorted(ev["by_source"]) and len(got) == 2
    for name, v in ev["by_source"].items():
        assert got[name] == pytest.approx(v, abs=1e-6), name


def test_bad_input(tmp_path, monkeypatch):
    """A group index out of range, an unreachable lighthouse, two jobs claiming one group, a
    config that differs between groups: one error naming the key, before any training. The
    first two in process, in the functions a launch's ``build_session`` calls before it
    contacts any peer (``federation_config.resolve``, ``Federation``'s constructor: a launch
    turns their ConfigError into exit status 2 and its line, as for any config error); the
    others, found at the first quorum, as group jobs: exit status 2 and the line (two-group
    federations: nothing waits for a third group at the fresh start)."""
    from types import SimpleNamespace

    import torch

    from dept_mega.config import ConfigError, load_config
    from dept_mega.dept.federation import Federation
    from dept_mega.dept.federation_config import resolve
    cfg = write_config(str(tmp_path))
    dead = f"127.0.0.1:{free_port()}"
    fed = [f"federation.lighthouse={dead}", f"federation.groups={SOURCES}"]
    with pytest.raises(ConfigError, match=r"'federation\.group': 3 is not a group index"):
        resolve(load_config(cfg, [*fed, "federation.group=3"]))
    monkeypatch.setenv("RUST_LOG", "warn")  # (Federation sets it when unset)
    job = load_config(cfg, [*fed, "federation.group=0"])
    with pytest.raises(ConfigError, match=r"'federation\.lighthouse': cannot reach 127\.0\.0\.1:"):
        Federation(job, SimpleNamespace(rank=0, group_size=1), torch.device("cpu"), *resolve(job))
    lh_dup, lh_diff = Lighthouse(min_groups=2), Lighthouse(min_groups=2)
    two = dict(groups=2, min_groups=2, timeout_s=3)
    try:
        procs = {
            "dup": [launch_group(cfg, str(tmp_path / f"dup{i}"), lh_dup.addr, 1, **two) for i in range(2)],
            "diff": [launch_group(cfg, str(tmp_path / "diff0"), lh_diff.addr, 0, **two),
                     launch_group(cfg, str(tmp_path / "diff1"), lh_diff.addr, 1, "dept.outer_optimizer.lr=0.5", **two)],
        }
        outs = {k: finish_all(ps) for k, ps in procs.items()}
    finally:
        lh_dup.stop()
        lh_diff.stop()
    want = {"dup": "'federation.group': group 1 is claimed by two jobs", "diff": "'dept.outer_optimizer': differs"}
    for case, ps in procs.items():
        for p, out in zip(ps, outs[case]):
            assert p.returncode == 2, (case, out[-3000:])
            assert want[case] in error_line(out), (case, error_line(out))
            if case == "diff":  # where to see the values (only hashes are compared at a fresh start)
                assert "compare the jobs' train.run_dir/config.yaml" in error_line(out), error_line(out)
            assert "step 1/" not in out, case  # before any training


@pytest.mark.parametrize("override,want", [
    ("dept.variant=std", "'dept.variant': std"),
    ("dept.outer_overlap=true dept.outer_delay=4 dept.outer_fragments=2 dept.local_steps=6",
     "'dept.outer_delay': 4 lands fragment 0's overlapped sync in the next round"),
    ("federation.groups=4", "'data.sources': 3 sources for federation.groups = 4"),
    ("federation.min_groups=4", "'federation.min_groups': 4 is not in [1, 3]"),
])
def test_refused_in_federation_mode(tmp_path, override, want):
    """What federation mode does not support is one config error naming the key (in process:
    the check runs before the lighthouse is contacted)."""
    from dept_mega.config import ConfigError, load_config
    from dept_mega.dept.federation_config import resolve
    cfg = load_config(write_config(str(tmp_path)), ["federation.lighthouse=127.0.0.1:1", "federation.group=0",
                                              f"federation.groups={SOURCES}", *override.split()])
    with pytest.raises(ConfigError, match=want.replace("[", r"\[").replace("]", r"\]")):
        resolve(cfg)
    # the quantised, fragmented and overlapped outer syncs are accepted (same math: test_three_group_jobs_...)
    ok = load_config(write_config(str(tmp_path)), ["federation.lighthouse=127.0.0.1:1", "federation.group=0",
                                             f"federation.groups={SOURCES}", "dept.outer_comm_dtype=int4",
                                             "dept.outer_fragments=2", "dept.outer_overlap=true",
                                             "dept.outer_delay=1"])
    assert resolve(ok) == (0, "127.0.0.1", 1)
    # the address as the lighthouse prints it (a URL) is taken too; a bare host is refused by name
    url = load_config(write_config(str(tmp_path)), ["federation.lighthouse=http://127.0.0.1:1/", "federation.group=0",
                                              f"federation.groups={SOURCES}"])
    assert resolve(url) == (0, "127.0.0.1", 1)
    bare = load_config(write_config(str(tmp_path)), ["federation.lighthouse=127.0.0.1", "federation.group=0",
                                               f"federation.groups={SOURCES}"])
    with pytest.raises(ConfigError, match="'federation.lighthouse': '127.0.0.1' is not host:port"):
        resolve(bare)


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
    L, steps, timeout_s, G = 5, 40, 7, 4  # (8 rounds: the late groups join by round 6, held there)
    cfg = write_config(str(tmp_path), steps=steps, local_steps=L, sources=G)
    dump = str(tmp_path / "dump")
    lh = Lighthouse(min_groups=2)
    runs = [str(tmp_path / f"g{g}") for g in range(G)]
    extra = (f"train.save_interval={L}",)
    env = dict(ENV, DEPT_FEDERATION_DUMP=dump)
    kw = dict(groups=G, min_groups=2, timeout_s=timeout_s)
    go = str(tmp_path / "go")
    # test hooks (federation_dump.py), instead of racing the jobs' progress: group 2 stops before
    # round 2's exchange (killed there); groups 0 and 1 wait at round 6's start until the
    # lighthouse holds both late groups' quorum requests, so they join before the run ends
    hold = {0: f"6:start:{go}", 1: f"6:start:{go}", 2: f"2:exchange:{tmp_path / 'never'}"}
    procs, late = [], []
    try:
        procs = [launch_group(cfg, runs[g], lh.addr, g, *extra, env=dict(env, DEPT_FEDERATION_HOLD=hold[g]) if g in hold
                        else env, **kw) for g in range(3)]
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
        late = [launch_group(cfg, runs[g], lh.addr, g, *extra, env=env, **kw) for g in (2, 3)]
        wait_for(lambda: all(is_held(dump, g, 6) or procs[g].poll() is not None for g in (0, 1)),
                  "groups 0 and 1 did not reach round 6's start")
        assert procs[0].poll() is None and procs[1].poll() is None, "group 0 or 1 ended before round 6"
        # (the late groups' requests: to join, or, joined at an earlier round start, round 6's)
        wait_for_requests(lh, 2, late, "the late groups 2 and 3")
        open(go, "w").close()
        outs = finish_all(procs[:2] + late, timeout=240)
    finally:
        for p in procs + late:
            if p.poll() is None:
                p.kill()
        lh.stop()
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


def test_lighthouse_counts_the_quorum_requests_it_holds():
    """The rejoin tests' sync point (wait_for_requests): the lighthouse's count of groups that
    asked for a quorum not formed yet — a group that only heartbeats is not counted, and a
    quorum formed clears it (torchft's LighthouseClient playing two groups; 2 heartbeat, 1 asks:
    torchft holds the quorum, one group is not more than half of two)."""
    import threading
    from datetime import timedelta

    from torchft.coordination import LighthouseClient
    lh = Lighthouse(min_groups=1)
    stop = threading.Event()
    try:
        client = LighthouseClient(f"http://{lh.addr}", timedelta(seconds=10))

        def heartbeat():  # group 0 is alive throughout (as a job's Manager, every 100 ms)
            while not stop.is_set():
                client.heartbeat("dept_group_0")
                stop.wait(0.1)

        threading.Thread(target=heartbeat, daemon=True).start()
        client.heartbeat("dept_group_1")
        assert lh.waiting() == 0, lh.status()
        done = []

        def ask(g):
            done.append(client.quorum(f"dept_group_{g}", timedelta(seconds=60), address="a", store_address="s",
                                      step=0, world_size=1))

        t = threading.Thread(target=ask, args=(1,), daemon=True)
        t.start()
        wait_for(lambda: lh.waiting() == 1, "the lighthouse does not count group 1's request", 30)
        time.sleep(0.3)  # (a few of the lighthouse's 100 ms quorum ticks)
        assert t.is_alive() and not done and lh.waiting() == 1, lh.status()  # held: group 0 has not asked
        ask(0)
        t.join(30)
        assert len(done) == 2 and sorted(m.replica_id for m in done[0].participants) == ["dept_group_0", "dept_group_1"]
        assert lh.waiting() == 0, lh.status()
    finally:
        stop.set()
        lh.stop()


def test_quorum_ranks_from_torchft_configure():
    """Which group each rank of an exchange is comes from the ``global_ranks`` argument that
    torchft's Manager passes to the process group's ``configure`` (a public argument):
    recorded by federation.recording(); a torchft whose configure lost it fails loudly."""
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    from dept_mega.dept.federation import recording
    for cls in (ProcessGroupGloo, ProcessGroupNCCL):
        assert "global_ranks" in __import__("inspect").signature(cls.configure).parameters, cls
        recording(cls)
    # the Manager passes it by keyword or by position: both recorded
    seen = []

    class Base:
        def configure(self, store_addr, replica_id, rank, world_size, quorum_id=None, group_rank=None,
                      group_world_size=None, global_ranks=None):
            seen.append(global_ranks)

    pg = recording(Base)()
    pg.configure("a", "r", 0, 2, 1, 0, 1, [3, 1])
    assert pg.quorum_ranks == [3, 1] and seen == [[3, 1]]
    pg.configure("a", "r", 0, 2, quorum_id=2, global_ranks=[1])
    assert pg.quorum_ranks == [1]

    class Old:
        def configure(self, store_addr, replica_id, rank, world_size):
            pass

    with pytest.raises(RuntimeError, match="no global_ranks argument"):
        recording(Old)


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
    L, steps, G = 2, 16, 2
    owners = [1, 0, 1]
    cfg = write_config(str(tmp_path), steps=steps, local_steps=L, sources=len(owners), owners=owners)
    dump, go = str(tmp_path / "dump"), str(tmp_path / "go")
    trim = ("dept.variant=trim", "dept.outer_optimizer.name=nesterov", "dept.outer_optimizer.momentum=0.9",
            "dept.outer_optimizer.lr=0.7", f"train.save_interval={L}")
    kw = dict(groups=G, min_groups=1, timeout_s=15)
    runs = [str(tmp_path / f"g{g}") for g in range(G)]
    lh = Lighthouse(min_groups=1)
    procs = []
    try:
        procs = [launch_group(cfg, runs[0], lh.addr, 0, *trim, env=dict(ENV, DEPT_FEDERATION_DUMP=dump,
                                                                 DEPT_FEDERATION_HOLD=f"4:start:{go}"), **kw),
                 launch_group(cfg, runs[1], lh.addr, 1, *trim, f"train.exit_interval={2 * L}",
                        env=dict(ENV, DEPT_FEDERATION_DUMP=dump), **kw)]
        first = finish_all(procs[1:])[0]
        assert procs[1].returncode == 0, first[-3000:]
        # relaunched only once group 0 waits at round 4's start: rounds 2 and 3 are its alone
        wait_for(lambda: is_held(dump, 0, 4) or procs[0].poll() is not None, "group 0 did not reach round 4's start")
        assert procs[0].poll() is None, "group 0 ended before round 4's start"
        again = launch_group(cfg, runs[1], lh.addr, 1, *trim, env=dict(ENV, DEPT_FEDERATION_DUMP=dump), **kw)
        procs.append(again)
        wait_for_requests(lh, 1, [again], "the relaunched group 1")
        open(go, "w").close()
        outs = finish_all([procs[0], again], timeout=240)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        lh.stop()
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
    lh = Lighthouse(min_groups=2, join_s=join_s, process=True)  # (the command, --join-timeout-s among its options)
    procs = []
    try:
        # groups 0 and 1 wait at round 3's start until group 2 is let go and has asked for a
        # quorum, so that the run is not over before group 2 comes back
        hold = {0: f"3:start:{go}", 1: f"3:start:{go}", 2: f"1:exchange:{go}2"}
        procs = [launch_group(cfg, runs[g], lh.addr, g, env=dict(env, DEPT_FEDERATION_HOLD=hold[g]) if g in hold else env,
                        groups=G, min_groups=2, timeout_s=timeout_s) for g in range(G)]
        wait_for(lambda: os.path.exists(os.path.join(dump, "g2_rank0_held1")) or procs[2].poll() is not None,
                  "group 2 did not reach round 1's exchange")
        # rounds 1 and 2 completed by groups 0 and 1 while group 2 is held (not waiting for it)
        wait_for(lambda: all(is_held(dump, g, 3) or procs[g].poll() is not None for g in (0, 1)),
                 "groups 0 and 1 did not complete rounds 1 and 2 without the held group 2")
        assert all(p.poll() is None for p in procs), "a group ended before round 3's start"
        open(go + "2", "w").close()
        wait_for_requests(lh, 1, [procs[2]], "the left-out group 2")
        open(go, "w").close()
        outs = finish_all(procs, timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        lh.stop()
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
    lh = Lighthouse(min_groups=2)
    procs = []
    try:
        procs = [launch_group(cfg, runs[g], lh.addr, g, "dept.outer_overlap=true", "dept.outer_delay=1",
                        env=dict(env, DEPT_FEDERATION_HOLD=f"2:launch:{tmp_path / 'never'}") if g == 2 else env,
                        groups=G, min_groups=2, timeout_s=10) for g in range(G)]
        wait_for(lambda: os.path.exists(os.path.join(dump, "g2_rank0_held2")) or procs[2].poll() is not None,
                  "group 2 did not reach round 2's launch")
        assert procs[2].poll() is None, "group 2 ended before round 2's launch"
        os.kill(procs[2].pid, signal.SIGKILL)
        procs[2].wait()
        outs = finish_all(procs[:2], timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        lh.stop()
    for p, out in zip(procs[:2], outs):
        assert p.returncode == 0, out[-3000:]
    outer = [{r["round"]: r for r in read_records(run, "outer")} for run in runs[:2]]
    assert sorted(outer[0]) == sorted(outer[1]) == list(range(steps // L))
    assert [outer[0][r]["groups"] for r in range(steps // L)] == [[0, 1, 2], [0, 1, 2], [0, 1], [0, 1]]
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


def test_what_a_group_job_logs(monkeypatch):
    """The job's own lines (dept/federation_log.py): a membership change, a failed exchange's
    error in one line, "still waiting" lines only while a wait lasts, the lighthouse's own
    status in them, and torchft's noise kept out."""
    import logging

    from dept_mega.dept.federation_log import (Waiting, first_line, lighthouse_status, membership_line,
                                               quiet_torchft, quorum_wait_line)
    assert membership_line(0, [0, 1, 2], []) == "federation: round 0: groups [0, 1, 2]"
    assert membership_line(14, [0, 1], [0, 1, 2]) == "federation: round 14: groups [0, 1] (left: 2)"
    assert (membership_line(27, [0, 1, 2, 3], [0, 1], healed=True)
            == "federation: round 27: groups [0, 1, 2, 3] (joined: 2, 3; this job healed from a live peer)")
    assert first_line(RuntimeError("\n  peer closed [127.0.0.1]:5\nTraceback (most recent call last):\n  x")) \
        == "peer closed [127.0.0.1]:5"
    said = []
    with Waiting(said.append, lambda s: f"waited {s:.2f}", every=0.05):
        time.sleep(0.3)
    assert len(said) >= 3 and all(line.startswith("waited ") for line in said), said
    said.clear()
    with Waiting(said.append, lambda s: "never", every=5):
        pass
    assert said == []
    lh = Lighthouse(min_groups=2)
    try:
        assert "participants healthy" in lighthouse_status(lh.addr), lighthouse_status(lh.addr)
        assert f"waiting 31 s for a quorum of at least 2 group(s); the lighthouse {lh.addr} says: New quorum not " \
            "ready" in quorum_wait_line(3, 31, 2, lh.addr)
    finally:
        lh.stop()
    dead = f"127.0.0.1:{free_port()}"
    assert lighthouse_status(dead) is None
    assert f"the lighthouse {dead} does not answer (if it died: restart it, then the group jobs" \
        in quorum_wait_line(3, 31, 2, dead)
    monkeypatch.setenv("RUST_LOG", "-")  # (restored to what it was after the test)
    monkeypatch.delenv("RUST_LOG")
    quiet_torchft()
    assert os.environ["RUST_LOG"] == "warn"
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("torchft.manager")
    logger.addHandler(handler)
    try:
        logger.warning("Unable to reset NCCL flight recorder recording so traces will be incorrect.")
        lines = ["[dept_group_0] got exception waiting for work Connection closed by peer",
                 "[dept_group_0] got exception in pg configure: The client socket has timed out",
                 "[dept_group_0] got exception in recovery: Connection refused"]
        for line in lines:
            try:
                raise RuntimeError(line)
            except RuntimeError:
                logger.exception(line)
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == lines and all(r.exc_info is None for r in records)


def test_a_joining_group_with_another_config_is_told_which_field(tmp_path):
    """A healing group's agreed keys against its peer's: the first field that differs and both
    values (a peer that sends only hashes: the key)."""
    from dept_mega.config import ConfigError, load_config
    from dept_mega.dept.federation_config import agree_hashes, agree_values, check_agree
    fed = ["federation.lighthouse=127.0.0.1:1", "federation.group=0", f"federation.groups={SOURCES}"]
    running = load_config(write_config(str(tmp_path)), fed)
    joining = load_config(write_config(str(tmp_path)), [*fed, "optim.lr=0.001"])
    peer = {"agree": agree_hashes(running), "agree_values": agree_values(running)}
    check_agree(load_config(write_config(str(tmp_path)), [fed[0], "federation.group=2", fed[2]]), peer)  # the same keys
    with pytest.raises(ConfigError, match=r"config key 'optim\.lr' differs from the running groups': 0\.001 here, "
                                          r"0\.003 in the running groups"):
        check_agree(joining, peer)
    with pytest.raises(ConfigError, match=r"config key 'optim' differs from the running groups' \(federation"):
        check_agree(joining, {"agree": peer["agree"]})


def test_a_joining_group_is_told_every_field_that_differs(tmp_path):
    """Several fields differ (two inside one agreed key): one ConfigError, one line per field
    with both values, in AGREE_KEYS order and the fields sorted within a key; a peer that sends
    only hashes: how many keys differ and each key."""
    from dept_mega.config import ConfigError, load_config
    from dept_mega.dept.federation_config import agree_hashes, agree_values, check_agree
    fed = ["federation.lighthouse=127.0.0.1:1", "federation.group=0", f"federation.groups={SOURCES}"]
    running = load_config(write_config(str(tmp_path)), fed)
    joining = load_config(write_config(str(tmp_path)), [*fed, "train.seed=7", "optim.lr=0.001",
                                                        "dept.local_steps=3", "optim.min_lr=0.0001"])
    rule = "(federation: every group job needs the same value)"
    with pytest.raises(ConfigError) as exc:
        check_agree(joining, {"agree": agree_hashes(running), "agree_values": agree_values(running)})
    r = running
    assert str(exc.value).split("\n") == [
        f"4 config keys differ from the running groups' {rule}:",
        f"  config key 'dept.local_steps': 3 here, {r.dept.local_steps} in the running groups",
        f"  config key 'train.seed': 7 here, {r.train.seed} in the running groups",
        f"  config key 'optim.lr': 0.001 here, {r.optim.lr} in the running groups",
        f"  config key 'optim.min_lr': 0.0001 here, {r.optim.min_lr} in the running groups"]
    with pytest.raises(ConfigError) as exc:
        check_agree(joining, {"agree": agree_hashes(running)})
    assert str(exc.value).split("\n") == [f"3 config keys differ from the running groups' {rule}:",
                                          "  config key 'dept.local_steps'", "  config key 'train.seed'",
                                          "  config key 'optim'"]


def test_a_fresh_quorum_names_every_key_whose_hash_differs(tmp_path):
    """At a fresh start only hashes travel: one agreed ConfigError with how many keys differ
    and each key (the other group's hashes stand in through a process group that takes the
    element-wise max of both jobs' tensors, as the allreduce does)."""
    from types import SimpleNamespace

    import torch

    from dept_mega.config import ConfigError, load_config
    from dept_mega.dept.federation import Federation
    from dept_mega.dept.federation_config import agree_hashes
    from dept_mega.parallel.agree import is_agreed
    fed = ["federation.lighthouse=127.0.0.1:1", "federation.group=0", f"federation.groups={SOURCES}"]
    other = load_config(write_config(str(tmp_path)), [*fed, "train.seed=7", "optim.lr=0.001"])

    def quorum(cfg):
        def allreduce(tensors, opts):
            t = tensors[0]
            theirs = torch.tensor(agree_hashes(other) + [0], dtype=torch.int64)
            t.copy_(torch.maximum(t, torch.cat([theirs, -theirs])))
            return SimpleNamespace(wait=lambda: None)
        fake = object.__new__(Federation)
        fake.hashes, fake.device = agree_hashes(cfg), torch.device("cpu")
        fake.process_group = SimpleNamespace(allreduce=allreduce)
        return fake

    quorum(other)._check_agree(0)  # the same keys
    with pytest.raises(ConfigError) as exc:
        quorum(load_config(write_config(str(tmp_path)), fed))._check_agree(0)
    head, *lines = str(exc.value).split("\n")
    assert is_agreed(exc.value) and head.startswith("2 config keys differ between the group jobs ("), head
    assert "compare the jobs' train.run_dir/config.yaml" in head and lines == ["  config key 'train.seed'",
                                                                               "  config key 'optim'"], lines
    with pytest.raises(ConfigError, match=r"^config key 'optim': differs between the group jobs \(federation"):
        quorum(load_config(write_config(str(tmp_path)), [*fed, "train.seed=7"]))._check_agree(0)
