"""The compiled CUDA ops on a GPU (``pytest -m gpu``; skipped without CUDA or without the CUDA
kernels): the parallel deterministic scatter on the benchmark's id distributions (equal to
the CPU kernel bit for bit, close to index_add_, the same bits run to run, not slower than
index_add_), and no host synchronisation inside the ops or ``fork_device_rng``, invalid ids
being reported at the next ``check_errors``."""
from __future__ import annotations

import pytest
import torch

import dept_mega.ops as ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _need_cuda_kernels():
    if ops.backend("cuda") != "cuda":
        pytest.skip(f"no compiled CUDA kernels: {ops.extension_status().reason}")


def _ids(kind: str, n: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    if kind == "zipf":  # as benchmarks/ops_bench.py: about 57% of the tokens on id 0
        u = torch.rand(n, generator=g, dtype=torch.float64)
        return (u.pow(-1.0 / 1.2).floor().long() - 1).clamp(0, vocab - 1)
    if kind == "uniform":
        return torch.randint(0, vocab, (n,), generator=g)
    if kind == "distinct":
        return torch.randperm(vocab, generator=g)[:n]
    return torch.full((n,), 3, dtype=torch.long)  # all the same


@pytest.mark.parametrize("kind", ["zipf", "uniform", "distinct", "same"])
@pytest.mark.parametrize("rows_dtype", [torch.float32, torch.bfloat16])
def test_cuda_scatter_equals_cpu_kernel_and_is_deterministic(kind, rows_dtype):
    _need_cuda_kernels()
    g = torch.Generator().manual_seed(0)
    vocab, n, dim = 5000, 4096 if kind == "distinct" else 16384, 132  # 132: 4 | dim, 2 tiles
    ids = _ids(kind, n, vocab, g)
    rows = torch.randn(n, dim, generator=g).to(rows_dtype)
    start = torch.randn(vocab, dim, generator=g)
    cpu = ops.scatter_add_rows(start.clone(), ids, rows)
    runs = [ops.scatter_add_rows(start.cuda(), ids.cuda(), rows.cuda()) for _ in range(2)]
    assert torch.equal(runs[0], runs[1]), "run to run"
    assert torch.equal(runs[0].cpu(), cpu), "CUDA kernel vs CPU kernel (same fixed order)"
    ref = start.double().index_add(0, ids, rows.double())
    torch.testing.assert_close(runs[0].double().cpu(), ref, rtol=1e-5, atol=1e-2)
    for dim_odd in (7,):  # the unvectorised path
        r7, s7 = rows[:, :dim_odd].contiguous(), start[:, :dim_odd].contiguous()
        assert torch.equal(ops.scatter_add_rows(s7.cuda(), ids.cuda(), r7.cuda()).cpu(),
                           ops.scatter_add_rows(s7.clone(), ids, r7))
    for accumulate in (False, True):
        a = ops.scatter_mean_rows(start.cuda(), ids.cuda(), rows.cuda(), accumulate, -0.5)
        b = ops.scatter_mean_rows(start.clone(), ids, rows, accumulate, -0.5)
        assert torch.equal(a.cpu(), b), f"scatter_mean_rows accumulate={accumulate}"


def _median_ms(fn, iters=10):
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


@pytest.mark.parametrize("kind", ["zipf", "uniform", "same"])
def test_cuda_scatter_not_slower_than_index_add(kind):
    """benchmarks/ops_bench.py's token scatter (8 x 2048 ids, rows of 2048): the deterministic
    scatter must keep up with index_add_'s atomics (10% allowed for timing noise)."""
    _need_cuda_kernels()
    g = torch.Generator(device="cuda").manual_seed(0)
    vocab, n, dim = 32_000, 16_384, 2048
    ids = _ids(kind, n, vocab, torch.Generator().manual_seed(1)).cuda()
    rows = torch.randn(n, dim, generator=g, device="cuda")
    table = torch.zeros(vocab, dim, device="cuda")
    ours = _median_ms(lambda: ops.scatter_add_rows(table, ids, rows))
    theirs = _median_ms(lambda: table.index_add_(0, ids, rows))
    print(f"{kind}: scatter_add_rows {ours:.3f} ms, index_add_ {theirs:.3f} ms")
    assert ours <= 1.1 * theirs, (ours, theirs)


def test_cuda_ops_do_not_synchronise_and_report_invalid_ids_at_the_check():
    _need_cuda_kernels()
    from dept_mega.parallel.random import RNGTracker
    dev = torch.device("cuda")
    table = torch.randn(10, 8, device=dev)
    lookup = torch.tensor([0, -1, 1, -1, 2], device=dev)
    good, bad = torch.tensor([1, 3, 3], device=dev), torch.tensor([1, 12, 3], device=dev)
    rows = torch.ones(3, 8, device=dev)
    ok_tokens = torch.tensor([0, 2], device=dev)  # made before the sync check (a copy waits)
    tracker = RNGTracker(5, device=dev)
    ops.check_errors(dev)  # creates the record, clears anything earlier
    torch.cuda.synchronize()
    before = table.clone()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.gather_rows(table, good)
        ops.scatter_add_rows(table, good, rows)
        ops.scatter_mean_rows(table, good, rows, True, -1.0)
        ops.remap_ids(ok_tokens, lookup)
        with tracker.fork_device_rng(tensor_parallel=True):
            torch.nn.functional.dropout(table, 0.5)
        # invalid ids: no error (and no sync) inside the call
        ops.scatter_add_rows(table, bad, rows)
        ops.gather_rows(table, bad)  # a later error does not replace the first
    finally:
        torch.cuda.set_sync_debug_mode(0)
    ops.scatter_add_rows(before, good, rows)
    ops.scatter_mean_rows(before, good, rows, True, -1.0)
    assert torch.equal(table, before), "the failed scatter wrote nothing"
    with pytest.raises(IndexError, match=r"^scatter_add_rows: ids\[1\] = 12 is out of range for "
                                         r"a table of 10 rows"):
        ops.check_errors(dev)
    ops.check_errors(dev)  # cleared by the check that raised
    ops.remap_ids(torch.tensor([[0, 2, 4], [3, 1, 0]], device=dev), lookup)
    with pytest.raises(ValueError, match=r"remap_ids: global id 3 \(first at flat position 3\)"):
        ops.check_errors(dev)


def test_phase_timer_measures_gpu_time_not_queuing():
    """The DEPT round-end timings: GPU work queued inside the phase is counted although the
    host returns at once."""
    from dept_mega.profiling import PhaseTimer

    torch.cuda.synchronize()
    timer = PhaseTimer("cuda")
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU cycles on an H100 (1.98 GHz)
    assert timer.stop().seconds() > 0.05
