"""TRIM: sparse per-row means equal the dense reference; only trimmed rows cross groups."""
import pytest
import torch

from dept_mega.dept.outer import chunk_bounds
from dept_mega.dept.trim import (TrimTable, exchange_rows, remap_ranks, remap_tokens, row_mean_update,
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
    ranks = remap_ranks(ids, 10)
    # the ranks stand for the lookup TRIM used before them: position in V_k, -1 elsewhere
    lookup = torch.full((10,), -1, dtype=torch.int64)
    lookup[ids] = torch.arange(3)
    assert torch.equal(ranks.to_lookup(), lookup)
    assert torch.equal(remap_tokens(torch.tensor([[7, 1, 4]]), ranks), torch.tensor([[2, 0, 1]]))
    for table in (ranks, lookup):  # one message through either form
        with pytest.raises(ValueError, match=r"source 'en': .* not in its vocabulary set V_k \(remap_ids: global id 3 "
                                             r"\(first at flat position 0\) .*\(lookup\[3\] = -1\)\)"):
            remap_tokens(torch.tensor([3]), table, "en")
        # every other error of the remap names the source too
        with pytest.raises(IndexError, match=r"^TRIM: source 'en': a token id is outside the global vocabulary "
                                             r"\(remap_ids: global id 10 at flat position 1 is out of range"):
            remap_tokens(torch.tensor([[7, 10]]), table, "en")
        with pytest.raises(IndexError, match=r"^TRIM: source 'en': .*global id -2 at flat position 0"):
            remap_tokens(torch.tensor([-2]), table, "en")
        with pytest.raises(TypeError, match=r"^TRIM: source 'en': remap \(remap_ids: ids must be int32 or int64"):
            remap_tokens(torch.tensor([1.0]), table, "en")


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


def _dense_outer_reference(table, rounds, name, lr, momentum=0.0, betas=(0.9, 0.999), eps=1e-8):
    """Plain dense tensors: every round, the mean Δ of each held row is its pseudo-gradient;
    rows held by no group keep their values and their state."""
    V, d = table.shape
    theta = table.clone()
    b, m, v = torch.zeros(V, d), torch.zeros(V, d), torch.zeros(V, d)
    t = torch.zeros(V, dtype=torch.int64)
    b1, b2 = betas
    for contributions in rounds:
        sums, counts = torch.zeros(V, d), torch.zeros(V)
        for ids, delta in contributions:
            sums.index_add_(0, ids, delta)
            counts.index_add_(0, ids, torch.ones(ids.numel()))
        held = counts > 0
        mean = sums[held] / counts[held][:, None]
        if name == "fedavg":
            theta[held] = theta[held] - lr * mean
        elif name == "nesterov":
            b[held] = momentum * b[held] + mean
            theta[held] = theta[held] - lr * (mean + momentum * b[held])
        else:
            t[held] += 1
            m[held] = b1 * m[held] + (1 - b1) * mean
            v[held] = b2 * v[held] + (1 - b2) * mean * mean
            steps = t[held].double()[:, None]
            m_hat = m[held] / (1 - b1 ** steps).float()
            v_hat = v[held] / (1 - b2 ** steps).float()
            theta[held] = theta[held] - lr * m_hat / (v_hat.sqrt() + eps)
    return theta, {"momentum": b, "exp_avg": m, "exp_avg_sq": v, "steps": t}


@pytest.mark.parametrize("name,kw", [("fedavg", {"lr": 0.7}), ("nesterov", {"lr": 0.7, "momentum": 0.9}),
                                     ("adam", {"lr": 0.05, "betas": (0.8, 0.99), "eps": 1e-6})])
def test_row_outer_optimizer_matches_dense_reference(name, kw):
    """TRIM rows take the configured outer optimizer, with state per row of φ, touched only
    where some group held the row this round (G = 3 groups, 4 rounds, some rows never held,
    some held in some rounds only)."""
    from dept_mega.dept.trim import RowOuterOptimizer
    gen = torch.Generator().manual_seed(11)
    V, d, G = 40, 5, 3
    table0 = torch.randn(V, d, generator=gen)
    rounds = []
    for r in range(4):
        sets = [torch.nonzero(torch.rand(V, generator=gen) < 0.3).flatten() for _ in range(G)]
        sets = [s[s % 7 != 0] for s in sets]  # rows 0, 7, 14, ... are never held
        rounds.append([(s, torch.randn(s.numel(), d, generator=gen)) for s in sets])
    tab = TrimTable(table0, optimizer=RowOuterOptimizer(name, **kw))
    states_after = []
    for contributions in rounds:
        tab.apply(torch.cat([c[0] for c in contributions]), torch.cat([c[1] for c in contributions]))
        states_after.append({k: v.clone() for k, v in tab.optimizer.state.items()})
    ref, ref_state = _dense_outer_reference(table0, rounds, name, **kw)
    torch.testing.assert_close(tab.weight, ref, rtol=1e-6, atol=1e-6)
    for k, v in tab.optimizer.state.items():
        torch.testing.assert_close(v, ref_state[k], rtol=1e-6, atol=1e-6, msg=k)
    never = torch.arange(0, V, 7)
    assert torch.equal(tab.weight[never], table0[never])
    # rows nobody held in the last round keep the state they had after the round before
    held_last = torch.zeros(V, dtype=torch.bool)
    for ids, _ in rounds[-1]:
        held_last[ids] = True
    for k, v in tab.optimizer.state.items():
        assert torch.equal(v[~held_last], states_after[-2][k][~held_last]), k
        assert not v[never].any(), k
    assert (name == "fedavg") == (not tab.optimizer.state)  # fedavg keeps no state


def test_row_fedavg_lr1_is_the_plain_row_mean_bit_for_bit():
    gen = torch.Generator().manual_seed(5)
    table = torch.randn(30, 4, generator=gen)
    ids = torch.cat([torch.randperm(30, generator=gen)[:12] for _ in range(3)])
    deltas = torch.randn(ids.numel(), 4, generator=gen)
    tab = TrimTable(table)  # default: fedavg, lr 1
    tab.apply(ids, deltas)
    plain = table.clone()
    row_mean_update(plain, ids, deltas)
    assert torch.equal(tab.weight, plain)


def test_row_state_round_trips_and_refuses_another_optimizer():
    from dept_mega.dept.trim import RowOuterOptimizer
    gen = torch.Generator().manual_seed(2)
    a = TrimTable(torch.randn(10, 3, generator=gen), optimizer=RowOuterOptimizer("adam", lr=0.1))
    a.apply(torch.tensor([1, 4, 4]), torch.randn(3, 3, generator=gen))
    b = TrimTable(torch.zeros(10, 3), optimizer=RowOuterOptimizer("adam", lr=0.1))
    b.load_state_dict(a.state_dict())
    ids, rows = torch.tensor([4, 5]), torch.randn(2, 3, generator=gen)
    a.apply(ids, rows)
    b.apply(ids, rows)
    assert torch.equal(a.weight, b.weight) and torch.equal(a.optimizer.state["steps"], b.optimizer.state["steps"])
    assert a.optimizer.state["steps"].tolist() == [0, 1, 0, 0, 2, 1, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="dept.outer_optimizer.name"):
        TrimTable(torch.zeros(10, 3), optimizer=RowOuterOptimizer("nesterov")).load_state_dict(a.state_dict())
