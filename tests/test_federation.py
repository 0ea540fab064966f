"""Federated source groups (issue 26): separate processes for the lighthouse and every group
job (CPU, gloo), joined through torchft (dept_mega/dept/federation.py): nothing fails, and the
group jobs give the single job's losses. Checks and log lines: test_federation_checks.py;
groups that die, are slow or rejoin: test_federation_rejoin.py; the lighthouse and torchft's
seams: test_federation_lighthouse.py."""
from __future__ import annotations

import json
import os

import pytest
import yaml

pytest.importorskip("torchft")

from tests.federation_utils import (ENV, SOURCES, ForkedJob, federation, finish_all, read_records,  # noqa: E402
                                    run_single_job, write_config)

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
    with federation(min_groups=SOURCES) as jobs:
        runs = [str(tmp_path / f"g{g}") for g in range(SOURCES)]
        # (their checkpoints are read by nothing: none written)
        procs = [jobs.launch(cfg, runs[g], g, *extra, checkpoints=False) for g in range(SOURCES)]
        run_single_job(cfg, str(tmp_path / "single"), SOURCES, *extra, checkpoints=False)
        outs = finish_all(procs)
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
    with federation(min_groups=2) as jobs:
        runs = [str(tmp_path / f"g{g}") for g in range(2)]
        # torchrun's launcher (torch.distributed.run.main, forked: federation_utils.TorchrunJob)
        # launches the pipeline layout's group job 0 (torchrun's store under a group job); the
        # other jobs' ranks are forked with torchrun's environment (no launcher)
        # (the checkpoints, read by nothing: written by the job under torchrun only)
        torchrun = [layout == "pipeline2-glob" and g == 0 for g in range(2)]
        procs = [jobs.launch(cfg, runs[g], g, *extra, groups=2, min_groups=2, nproc=2, torchrun=torchrun[g],
                             checkpoints=torchrun[g]) for g in range(2)]
        # the single job while the group jobs run: its start-up fills their waits for the quorum
        run_single_job(cfg, str(tmp_path / "single"), 4, *extra, checkpoints=False)
        outs = finish_all(procs)
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    for g, run in enumerate(runs):  # the run lock's job id: torchrun's run id under its agent only
        with open(os.path.join(run, ".lock")) as f:
            job = json.load(f)["job"]
        if "SLURM_JOB_ID" not in ENV:  # (else SLURM's job id)
            assert (job is not None) == (layout == "pipeline2-glob" and g == 0), (layout, g, job)
    single = {r["step"]: r["loss_by_source"] for r in read_records(str(tmp_path / "single"), "train")}
    names = list(single[1])
    for g, run in enumerate(runs):
        mine = {r["step"]: r["loss_by_source"] for r in read_records(run, "train")}
        assert sorted(mine) == sorted(single) == [1, 2, 3, 4]
        for step, by in mine.items():
            assert abs(by[names[g]] - single[step][names[g]]) <= 1e-6, (g, step, by, single[step])


def site_config(cfg: str, group: int, groups: int, tmp: str) -> str:
    """``cfg`` as group job ``group`` at its own site sees it: the other jobs' sources (i mod
    ``groups``) have no files here (their prefix does not exist), only their summaries, made at
    their site with ``python -m dept_mega.data.summary`` (its ``main`` called here: the command
    would import torch again, ~3 s of CPU a summary)."""
    from dept_mega.data.summary import main
    with open(cfg, encoding="utf-8") as f:
        c = yaml.safe_load(f)
    for i, s in enumerate(c["data"]["sources"]):
        if i % groups != group:
            summary = os.path.join(tmp, f"{s['name']}.summary.json")
            if not os.path.exists(summary):
                assert main([s["prefix"], "--name", s["name"], "--out", summary]) == 0, s
            s.update(prefix=f"/nonexistent/site{i % groups}/{s['name']}", summary=summary)
    path = os.path.join(tmp, f"site{group}.yaml")
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(c, f)
    return path


def test_more_sources_than_group_jobs_equal_the_single_job(tmp_path):
    """K = 4 sources, G = 2 group jobs (SPEC: every source's embeddings and AdamW state are its
    own): each job holds the sources of its site (i mod 2 by default) and trains one of them
    per round, drawn by the seeded sampler among its own (proportional); the jobs' fp32
    losses equal the single 2-group job's whose data.sources[].group says the same. Each job
    has only its own sources' files: the others' prefixes do not exist, their summaries stand
    for them (dept_mega.data.summary)."""
    from dept_mega.config import load_config, source_groups
    K, G, L, steps = 4, 2, 2, 10
    cfg = write_config(str(tmp_path), steps=steps, local_steps=L, sources=K)
    owned = write_config(str(tmp_path), steps=steps, local_steps=L, sources=K, owners=[0, 1, 0, 1])
    extra = ("dept.sampling=proportional",)
    # each site has only its own sources' files; the others' are known by their summaries
    site_configs = [site_config(cfg, g, G, str(tmp_path)) for g in range(G)]
    with federation(min_groups=G) as jobs:
        runs = [str(tmp_path / f"g{g}") for g in range(G)]
        # the servers and store advertised (federation.advertise_host): group 0's by its route to the
        # lighthouse (here the loopback's 127.0.0.1), group 1's as "localhost"
        procs = [jobs.launch(site_configs[g], runs[g], g, *extra, f"federation.advertise_host={('route', 'localhost')[g]}",
                             groups=G, min_groups=G, checkpoints=g == 1) for g in range(G)]  # (1's: evaluated)
        # the single job while the group jobs run: its start-up fills their waits for the quorum
        run_single_job(owned, str(tmp_path / "single"), G, *extra, checkpoints=False)
        outs = finish_all(procs)
        import urllib.request
        with urllib.request.urlopen(f"http://{jobs.lh.addr}/status", timeout=10) as r:
            page = r.read().decode("utf-8", "replace")  # the last quorum: what each job was advertised as
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    import re
    managers, stores = re.findall(r"Manager: http://([^:<\s]+):", page), re.findall(r"TCPStore: ([^:<\s]+):", page)
    assert sorted(managers) == sorted(stores) == ["127.0.0.1", "localhost"], page[:2000]
    assert ("federation: rank 0's node advertises 127.0.0.1 to the other group jobs (federation.advertise_host "
            "route): a loopback address, which only jobs on this host reach") in outs[0].splitlines(), outs[0][-3000:]
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
    # (its main in a process forked from the test's forkserver, as a group job: the command
    # line itself is tests/test_trainer_e2e.py's)
    res = str(tmp_path / "eval.json")
    p = ForkedJob(["--run-dir", runs[1], "--out", res], ENV, str(tmp_path / "eval_out.txt"), module="evaluate")
    assert p.wait(timeout=120) == 0, open(p.log).read()[-3000:]
    (ev,), got = read_records(runs[1], "eval"), json.load(open(res))["by_source"]
    assert sorted(got) == sorted(ev["by_source"]) and len(got) == 2
    for name, v in ev["by_source"].items():
        assert got[name] == pytest.approx(v, abs=1e-6), name
