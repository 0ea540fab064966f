"""TRIM: sparse per-row means equal the dense reference; only trimmed rows cross groups."""
import pytest
import torch

from dept_mega.dept.outer import chunk_bounds
from dept_mega.dept.trim import (TrimTable, exchange_rows, remap_lookup, remap_tokens, row_mean_update,
                                 row_mean_update_dense)
from tests.mp_utils import run_distributed


def _random_sets(V, G, kind, gen):
    if kind == "disjoint":
        perm = torch.randperm(V, generator=gen)
        return [perm[g::G + 1].sort().values for g in range(G)]  # every (G+1)-th row held by no one
    sets = []
    for _ in range(G):
        mask = torch.rand(V, generator=gen) < 0.5
        sets.append(torch.nonzero(mask).flatten())
    return sets


@pytest.mark.parametrize("kind", ["overlapping", "disjoint"])
@pytest.mark.parametrize("G", [2, 3])
@pytest.mark.parametrize("ops_backend", ["default", "torch"])
def test_sparse_row_mean_equals_dense_reference(kind, G, ops_backend, monkeypatch):
    if ops_backend == "torch":  # the ops package's pure PyTorch path must give the same values
        import dept_mega.ops as ops
        monkeypatch.setattr(ops, "_use_extension", lambda device: False)
    gen = torch.Generator().manual_seed(G)
    V, d = 50, 6
    table = torch.randn(V, d, generator=gen)
    sets = _random_sets(V, G, kind, gen)
    contributions = [(ids, torch.randn(ids.numel(), d, generator=gen)) for ids in sets]
    dense = table.clone()
    row_mean_update_dense(dense, contributions)
    sparse = table.clone()
    row_mean_update(sparse, torch.cat([c[0] for c in contributions]), torch.cat([c[1] for c in contributions]))
    assert torch.equal(sparse, dense)
    held = torch.zeros(V, dtype=torch.bool)
    for ids in sets:
        held[ids] = True
    assert (~held).any() and torch.equal(sparse[~held], table[~held])  # rows held by no one unchanged
    # a row held by every group moves by the plain mean
    for r in range(V):
        holders = [c for c in contributions if (c[0] == r).any()]
        if len(holders) == G:
            mean = sum(c[1][(c[0] == r).nonzero().item()] for c in holders) / G
            torch.testing.assert_close(sparse[r], table[r] - mean)
            break


def test_table_gather_and_remap():
    t = TrimTable(torch.arange(20.0).view(10, 2))
    ids = torch.tensor([1, 4, 7])
    assert torch.equal(t.gather(ids), torch.tensor([[2.0, 3.0], [8.0, 9.0], [14.0, 15.0]]))
    lookup = remap_lookup(ids, 10)
    assert torch.equal(remap_tokens(torch.tensor([[7, 1, 4]]), lookup), torch.tensor([[2, 0, 1]]))
    with pytest.raises(ValueError, match="not in its vocabulary set"):
        remap_tokens(torch.tensor([3]), lookup, "en")


def _exchange_worker(rank, world, T, D):
    from dept_mega.parallel.groups import build_groups
    pg = build_groups(tensor=T, data=D, pipeline=1)
    g = pg.group_index
    V, d = 256, 16
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(V, d, generator=gen)
    sets = [torch.nonzero(torch.rand(V, generator=gen) < p).flatten() for p in (0.15, 0.3)]
    deltas = [torch.randn(s.numel(), d, generator=gen) for s in sets]
    # this rank owns TP slice tp of its group's compact rows (as a vocab-parallel table would)
    ids, delta = sets[g], deltas[g]
    a, b = chunk_bounds(ids.numel(), T, pg.tp_rank)
    all_ids, all_rows = exchange_rows(pg, ids[a:b], delta[a:b])
    sparse = table.clone()
    row_mean_update(sparse, all_ids, all_rows)
    dense = table.clone()
    row_mean_update_dense(dense, list(zip(sets, deltas)))
    return {"equal": torch.equal(sparse, dense), "bytes": pg.comm.snapshot(),
            "rows": [s.numel() for s in sets], "V": V, "d": d}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("T,D", [(1, 1), (2, 1), (1, 2)])
def test_exchange_sends_only_trimmed_rows(T, D):
    world = 2 * T * D
    res = run_distributed(_exchange_worker, world, args=(T, D))
    assert all(r["equal"] for r in res)
    rows, V, d = res[0]["rows"], res[0]["V"], res[0]["d"]
    outer = sum(r["bytes"]["outer_embedding"] for r in res)
    # each group's rows cross once: fp32 rows + int64 ids (every rank's part padded to the
    # largest part of its outer group), plus one int64 count per rank
    outer_ranks = 2 * T * D
    largest = max(chunk_bounds(chunk_bounds(n, T, t)[1] - chunk_bounds(n, T, t)[0], D, 0)[1]
                  for n in rows for t in range(T))
    assert outer <= outer_ranks * (largest * (d * 4 + 8) + 8)
    assert outer >= sum(rows) * (d * 4 + 8) + outer_ranks * 8
    assert outer < V * d * 4  # below even one dense |V|×d fp32 buffer (a dense sync sends G of them)
