"""Every DEPT variant under TP 2 × PP 2 inside each of G = 2 groups (world 8) gives the same
losses as T = P = 1 (world 2)."""
import pytest

from tests.dept_utils import run_dept, source_infos, tiny_config
from tests.mp_utils import run_distributed

VARIANTS = ("glob", "trim", "spec", "spec_opt")


def _runs(parallel):
    runs = []
    for variant in VARIANTS:
        over = {"dept": {"variant": variant, "local_steps": 2}, "train": {"steps": 4},
                "model": {"position_embedding": "learned" if variant in ("glob", "trim") else "alibi",
                          "tie_embeddings": variant != "spec"},
                "parallel": parallel}
        runs.append(over)
    return runs


def _worker(rank, world, runs):
    out = []
    for over in runs:
        cfg = tiny_config(over)
        v = cfg.dept.variant
        # K = 3 > G = 2: sampled sources, moves between groups included
        infos = source_infos(3, trim=v == "trim", vocabs=(60, 200, 130) if v == "spec_opt" else None)
        res = run_dept(cfg, infos, 2)
        out.append({"losses": res["losses"], "assignments": res["assignments"]})
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_variants_tp2_pp2_match_single_rank_groups():
    ref = run_distributed(_worker, 2, args=(_runs({}),), timeout=300)
    big = run_distributed(_worker, 8, args=(_runs({"tensor": 2, "pipeline": 2}),), timeout=500)
    G = 2
    for i, variant in enumerate(VARIANTS):
        for g in range(G):
            a = ref[g][i]["losses"]  # rank g is group g at T = P = 1
            b = big[4 * g][i]["losses"]  # group g starts at rank 4g; losses are group-level
            assert ref[g][i]["assignments"] == big[4 * g][i]["assignments"]
            assert len(a) == len(b) == 4
            for x, y in zip(a, b):
                assert abs(x - y) <= 2e-5 * max(1.0, abs(x)), (variant, g, a, b)
