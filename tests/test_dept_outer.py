"""Outer optimizers vs plain-tensor references; FlatSync over groups and replicas (gloo)."""
import pytest
import torch

from dept_mega.dept.outer import FlatSync, OuterOptimizer, chunk_bounds
from tests.mp_utils import run_distributed


def _ref_nesterov(theta, deltas, lr, mu):
    theta = theta.clone()
    buf = None
    for d in deltas:
        buf = d.clone() if buf is None else mu * buf + d
        theta = theta - lr * (d + mu * buf)
    return theta


def _ref_adam(theta, deltas, lr, b1, b2, eps):
    theta = theta.clone()
    m = torch.zeros_like(theta)
    v = torch.zeros_like(theta)
    for t, d in enumerate(deltas, start=1):
        m = b1 * m + (1 - b1) * d
        v = b2 * v + (1 - b2) * d * d
        theta = theta - lr * (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps)
    return theta


def _deltas(n=3, size=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(size, generator=g) for _ in range(n)]


def test_nesterov_matches_reference_and_torch_sgd():
    theta0 = torch.randn(37, generator=torch.Generator().manual_seed(1))
    deltas = _deltas()
    opt = OuterOptimizer("nesterov", lr=0.7, momentum=0.9)
    theta = theta0.clone()
    for d in deltas:
        opt.step(theta, d)
    torch.testing.assert_close(theta, _ref_nesterov(theta0, deltas, 0.7, 0.9), rtol=1e-6, atol=1e-6)
    # and PyTorch's own SGD(nesterov) with Δ as the gradient
    p = torch.nn.Parameter(theta0.clone())
    sgd = torch.optim.SGD([p], lr=0.7, momentum=0.9, nesterov=True)
    for d in deltas:
        p.grad = d.clone()
        sgd.step()
    torch.testing.assert_close(theta, p.detach(), rtol=1e-6, atol=1e-6)


def test_adam_matches_reference():
    theta0 = torch.randn(37, generator=torch.Generator().manual_seed(2))
    deltas = _deltas(4)
    opt = OuterOptimizer("adam", lr=0.1, betas=(0.8, 0.99), eps=1e-6)
    theta = theta0.clone()
    for d in deltas:
        opt.step(theta, d)
    torch.testing.assert_close(theta, _ref_adam(theta0, deltas, 0.1, 0.8, 0.99, 1e-6), rtol=1e-6, atol=1e-6)


def test_fedavg_lr1_is_the_average_and_bad_name_is_an_error():
    theta = torch.zeros(5)
    OuterOptimizer("fedavg", lr=1.0).step(theta, torch.full((5,), 2.0))
    assert torch.equal(theta, torch.full((5,), -2.0))
    with pytest.raises(ValueError, match="outer_optimizer"):
        OuterOptimizer("sgd")


def test_chunk_bounds_cover():
    for n in (0, 1, 7, 10):
        for parts in (1, 2, 3):
            b = [chunk_bounds(n, parts, i) for i in range(parts)]
            assert b[0][0] == 0 and b[-1][1] == n and all(b[i][1] == b[i + 1][0] for i in range(parts - 1))


def _flat_sync_worker(rank, world, name, D, comm_dtype):
    from dept_mega.parallel.groups import build_groups
    pg = build_groups(tensor=1, data=D, pipeline=1)
    g = pg.group_index
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    start = [p.detach().clone() for p in params]
    sync = FlatSync(params, pg, OuterOptimizer(name, lr=0.7, momentum=0.9, betas=(0.9, 0.99)),
                    comm_dtype=comm_dtype)
    history = []
    for rnd in range(2):
        with torch.no_grad():  # "local training": group-dependent, identical in a group's replicas
            for i, p in enumerate(params):
                gen = torch.Generator().manual_seed(100 * rnd + 10 * g + i)
                p.add_(torch.randn(p.shape, generator=gen))
        history.append([p.detach().clone() for p in params])
        sync.sync()
    return {"start": start, "history": history, "final": [p.detach().clone() for p in params],
            "bytes": pg.comm.snapshot(), "group": g}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,D,comm_dtype", [("fedavg", 1, "fp32"), ("nesterov", 2, "fp32"),
                                               ("adam", 2, "fp32"), ("fedavg", 1, "bf16")])
def test_flat_sync_over_groups_matches_reference(name, D, comm_dtype):
    world = 2 * D
    res = run_distributed(_flat_sync_worker, world, args=(name, D, comm_dtype))
    G = world // D
    flat = lambda ts: torch.cat([t.reshape(-1) for t in ts])
    theta = flat(res[0]["start"])
    opt = OuterOptimizer(name, lr=0.7, momentum=0.9, betas=(0.9, 0.99))
    for rnd in range(2):
        by_group = {r["group"]: flat(r["history"][rnd]) for r in res}
        deltas = [theta - by_group[g] for g in range(G)]
        if comm_dtype == "bf16":
            mean = sum(d.to(torch.bfloat16) for d in deltas).to(torch.float32) / G
        else:
            mean = sum(deltas) / G
        theta = theta.clone()
        opt.step(theta, mean)
        if name == "fedavg" and comm_dtype == "fp32":  # lr 0.7 of the plain average
            avg = sum(by_group.values()) / G
            prev = flat(res[0]["start"]) if rnd == 0 else None
            if prev is not None:
                torch.testing.assert_close(theta, prev + 0.7 * (avg - prev), rtol=1e-5, atol=1e-5)
    for r in res:
        torch.testing.assert_close(flat(r["final"]), theta, rtol=1e-6, atol=1e-6)
        assert torch.equal(flat(r["final"]), flat(res[0]["final"]))  # every rank bit-identical
    n = 22
    # each rank sends its 1/D chunk over the outer group per round; replicas re-gather theirs
    total_outer = sum(r["bytes"]["outer_body"] for r in res)
    elem = 2 if comm_dtype == "bf16" else 4
    assert total_outer == 2 * G * n * elem
    total_dp = sum(r["bytes"]["dp"] for r in res)
    assert total_dp == (2 * G * n * 4 if D > 1 else 0)


def _param_state_worker(rank, world):
    """FlatSync.param_state (the checkpoint's view) is full over dp, per parameter; loading
    it back keeps each replica's chunk of the optimizer state."""
    from dept_mega.parallel.groups import build_groups
    pg = build_groups(tensor=1, data=2, pipeline=1)  # one group of 2 replicas (world 2)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    sync = FlatSync(params, pg, OuterOptimizer("adam", lr=0.7, betas=(0.9, 0.99)))
    with torch.no_grad():
        for p in params:
            p.add_(1.0)
    sync.sync()
    st = sync.param_state()
    # a fresh FlatSync on the same ranks: loads, keeps its chunk, saves the same view back
    other = FlatSync(params, pg, OuterOptimizer("adam", lr=0.7, betas=(0.9, 0.99)))
    other.load_param_state(st)
    again = other.param_state()
    return st, again, {k: v.clone() for k, v in other.optimizer.state.items()}, other.bounds[pg.dp_rank]


@pytest.mark.timeout(120)
def test_param_state_is_full_over_dp_and_round_trips():
    res = run_distributed(_param_state_worker, 2)
    (st0, again0, chunk0, (a0, b0)), (st1, again1, chunk1, (a1, b1)) = res
    assert st0["steps"] == 1 and sorted(st0) == ["exp_avg", "exp_avg_sq", "reference", "steps"]
    assert [tuple(t.shape) for t in st0["reference"]] == [(5, 3), (7,)]
    for k in ("reference", "exp_avg", "exp_avg_sq"):
        for x, y, z in zip(st0[k], st1[k], again0[k]):
            assert torch.equal(x, y) and torch.equal(x, z), k  # both replicas: the full state
    full = torch.cat([t.reshape(-1) for t in st0["exp_avg"]])
    assert torch.count_nonzero(full) == full.numel()  # both chunks gathered, not zeros
    assert torch.equal(chunk0["exp_avg"], full[a0:b0]) and torch.equal(chunk1["exp_avg"], full[a1:b1])
