import pytest

from dept_mega.parallel.groups import build_groups, coords_of, layout_ranks, rank_of
from tests.mp_utils import run_distributed


def test_rank_order_tp_fastest_then_dp_pp_group():
    T, D, P = 2, 2, 2
    seen = set()
    for r in range(16):
        c = coords_of(r, T, D, P)
        assert rank_of(c.tp, c.dp, c.pp, c.group, T, D, P) == r
        seen.add((c.tp, c.dp, c.pp, c.group))
    assert len(seen) == 16
    assert coords_of(1, T, D, P).tp == 1 and coords_of(2, T, D, P).dp == 1
    assert coords_of(4, T, D, P).pp == 1 and coords_of(8, T, D, P).group == 1


def test_layout_groups_partition_and_outer():
    kinds = layout_ranks(16, 2, 2, 2)
    for kind in ("tp", "dp", "pp", "outer", "source_group"):
        flat = sorted(r for members in kinds[kind] for r in members)
        assert flat == list(range(16)), kind
    assert [0, 1, 2, 3, 4, 5, 6, 7] in kinds["source_group"]
    assert [0, 8] in kinds["outer"]
    assert [0, 4] in kinds["pp"] and [0, 4] in kinds["embedding"]
    # tensor × data ranks of one stage of one group (never across groups)
    assert kinds["tp_dp"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]


def test_single_process_layout_needs_no_dist():
    pg = build_groups()
    assert pg.world_size == 1 and pg.tp is None and pg.is_first_stage and pg.is_last_stage


def _check_groups(rank, world_size):
    import torch
    import torch.distributed as dist
    pg = build_groups(tensor=2, data=1, pipeline=2)
    # all-reduce of the rank over each group gives the sum of its members
    out = {}
    for kind in ("tp", "pp", "outer"):
        t = torch.tensor([float(rank)])
        pg.comm.all_reduce(t, getattr(pg, kind), category="tp" if kind == "tp" else "pp")
        out[kind] = t.item()
    out["bytes"] = pg.comm.snapshot()
    out["ranks"] = (pg.tp_ranks, pg.pp_ranks, pg.outer_ranks)
    out["tp_dp_is_tp"] = pg.tp_dp is pg.tp  # data=1: the tensor group itself, no extra group
    # tensor × data of one stage (FP8 amax reductions): T=2, D=2, P=2 in one group of 8
    pg2 = build_groups(tensor=2, data=2, pipeline=2)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=pg2.tp_dp)
    out["tp_dp"] = t.item()
    dist.barrier()
    return out


@pytest.mark.timeout(120)
def test_groups_collectives_gloo_world8():
    res = run_distributed(_check_groups, 8)
    for rank, r in enumerate(res):
        tp_ranks, pp_ranks, outer_ranks = r["ranks"]
        assert r["tp"] == sum(tp_ranks) and r["pp"] == sum(pp_ranks) and r["outer"] == sum(outer_ranks)
        assert rank in tp_ranks and rank in pp_ranks and rank in outer_ranks
        assert r["bytes"]["tp"] == 4 and r["bytes"]["pp"] == 8
        assert r["tp_dp_is_tp"] and r["tp_dp"] == sum(range(4 * (rank // 4), 4 * (rank // 4) + 4))


def test_bookkeeping_reductions_live_on_the_backend_device(monkeypatch):
    """total_over_ranks (every DEPT round end) reduces a tensor on the device the backend can
    reduce: CPU under gloo, the current CUDA device under NCCL (NCCL rejects CPU tensors)."""
    import torch
    import torch.distributed as dist

    from dept_mega.parallel import comm
    assert comm.bookkeeping_device().type == "cpu"  # no process group
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert comm.bookkeeping_device().type == "cpu"
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert comm.bookkeeping_device() == torch.device("cuda", 0)


def _gather_scatter_no_warning(rank, world):
    import warnings

    import torch
    import torch.distributed as dist

    from dept_mega.parallel.comm import Comm
    comm = Comm()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # torch 2.13 deprecates the *_tensor names
        out = torch.empty(2 * world)
        comm.all_gather_into(out, torch.full((2,), float(rank)), dist.group.WORLD, category="dp")
        part = torch.empty(2)
        comm.reduce_scatter_into(part, torch.ones(2 * world), dist.group.WORLD, category="dp")
    return out.tolist(), part.tolist()


def test_flat_collectives_do_not_warn():
    res = run_distributed(_gather_scatter_no_warning, 2, timeout=120)
    for out, part in res:
        assert out == [0.0, 0.0, 1.0, 1.0] and part == [2.0, 2.0]
