"""``train.log_activation_norms`` in a run (dept_mega.train's session on the sample corpus, 2 gloo
ranks): the train records carry ``act_rms`` / ``act_rms_max``, measured on the steps that log
only, pooled over the source groups; with the option off nothing is measured or recorded."""
from __future__ import annotations

import json
import math
import os

import pytest

from tests.mp_utils import run_distributed
from tests.trainer_utils import ROOT, ensure_sample_corpus, read_jsonl

LAYERS = 2  # examples/tiny's


@pytest.fixture(scope="module")
def corpus():
    ensure_sample_corpus()


def _overrides(config: str, run_dir: str, *extra: str) -> list[str]:
    from dept_mega.config import load_config
    sources = [{"name": s.name, "prefix": s.prefix} for s in load_config(os.path.join(ROOT, config)).data.sources[:2]]
    return [f"train.run_dir={run_dir}", "train.steps=3", "train.log_interval=2", "dept.local_steps=3",
            "train.micro_batch_size=1", "train.global_batch_size=2", "train.eval_interval=0",
            "train.save_interval=0", "optim.warmup_steps=1", f"data.sources={json.dumps(sources)}", *extra]


def _session_steps(rank: int, world: int, runs: list[tuple[str, list[str]]]) -> list[dict]:
    """Each run with dept_mega.train's session; per run, what every train_step was asked
    (``activation_norms``) and returned (``act_sums``), by step."""
    import torch

    from dept_mega.config import load_config
    from dept_mega.train import build_session
    os.chdir(ROOT)
    out = []
    for config, over in runs:
        torch.manual_seed(0)
        session = build_session(load_config(os.path.join(ROOT, config), over))
        trainer, seen = session.trainer, {}
        original = trainer.train_step

        def step(batch, **kw):
            res = original(batch, **kw)
            seen[trainer.step] = (kw.get("activation_norms", False), res.act_sums)
            return res

        trainer.train_step = step
        session.loop.run()
        session.writer.close()
        out.append({"steps": seen, "group": session.pg.group_index})
    return out


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_records_pool_the_groups_on_logging_steps_only(corpus, tmp_path):
    """GLOB on two groups and STD on one group of two data-parallel ranks, logging at steps 2 and
    3 (the last): only those steps measure; each record's act_rms is the RMS over every group's
    tokens (the groups' sums added), act_rms_max its largest layer. Off (GLOB): no step
    measures, no record has the fields."""
    runs = [("examples/tiny/glob.yaml", _overrides("examples/tiny/glob.yaml", str(tmp_path / "glob"),
                                                   "train.log_activation_norms=true")),
            ("examples/tiny/std.yaml", _overrides("examples/tiny/std.yaml", str(tmp_path / "std"),
                                                  "train.log_activation_norms=true", "parallel.data=2")),
            ("examples/tiny/glob.yaml", _overrides("examples/tiny/glob.yaml", str(tmp_path / "off")))]
    ranks = run_distributed(_session_steps, 2, args=(runs,), timeout=180)
    for r, name in enumerate(("glob", "std")):
        records = {rec["step"]: rec for rec in read_jsonl(str(tmp_path / name / "metrics.jsonl"))
                   if rec["kind"] == "train"}
        assert sorted(records) == [2, 3], name
        for rank in ranks:
            asked = {s: a for s, (a, _) in rank[r]["steps"].items()}
            assert asked == {1: False, 2: True, 3: True}, (name, asked)
        for step, rec in records.items():
            # the groups' sums (a group's ranks all hold its sums after the trainer's reduction)
            per_group = {rank[r]["group"]: rank[r]["steps"][step][1] for rank in ranks}
            assert len(per_group) == (2 if name == "glob" else 1), name
            sq = [sum(g[i] for g in per_group.values()) for i in range(LAYERS)]
            n = [sum(g[LAYERS + i] for g in per_group.values()) for i in range(LAYERS)]
            assert n == [2 * 64 * 64 * len(per_group)] * LAYERS  # batch × seq × hidden per group
            want = [math.sqrt(a / b) for a, b in zip(sq, n)]
            assert rec["act_rms"] == pytest.approx(want, rel=1e-12), (name, step)
            assert rec["act_rms_max"] == max(rec["act_rms"])
        if name == "glob":  # two groups that train different sources: their sums differ
            a, b = (rank[0]["steps"][2][1] for rank in ranks)
            assert a[:LAYERS] != b[:LAYERS]
    off = [rec for rec in read_jsonl(str(tmp_path / "off" / "metrics.jsonl")) if rec["kind"] == "train"]
    assert [rec["step"] for rec in off] == [2, 3]
    assert not any("act_rms" in rec or "act_rms_max" in rec for rec in off)
    for rank in ranks:
        assert all(not a and s is None for a, s in rank[2]["steps"].values())
