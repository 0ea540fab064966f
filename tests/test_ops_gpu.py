"""The compiled CUDA ops on a GPU (``pytest -m gpu``; skipped without CUDA or without the CUDA
kernels): the parallel deterministic scatter on the benchmark's id distributions (equal to
the CPU kernel bit for bit, close to index_add_, the same bits run to run, not slower than
index_add_), and no host synchronisation inside the ops or ``fork_device_rng``, invalid ids
being reported at the next ``check_errors`` (the first failing call's lowest invalid position,
over many blocks, calls in a row and two streams); the ranked remap on both of its memory paths."""
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


def _interleaved_ms(fns, rounds=20):
    """Each of ``fns`` timed ``rounds`` times (CUDA events), the calls interleaved (one of each
    per round, the order turned every round): work of other processes on the same GPU (the
    tests run under pytest-xdist) then falls on both sides alike. Returns each one's fastest
    and median time, in ms; the fastest is the least disturbed."""
    for fn in fns:
        for _ in range(3):
            fn()
    times = [[] for _ in fns]
    for r in range(rounds):
        order = list(range(len(fns)))
        if r % 2:
            order.reverse()
        for i in order:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fns[i]()
            b.record()
            b.synchronize()
            times[i].append(a.elapsed_time(b))
    return [(min(t), sorted(t)[len(t) // 2]) for t in times]


@pytest.mark.parametrize("kind", ["zipf", "uniform", "same"])
def test_cuda_scatter_not_slower_than_index_add(kind):
    """benchmarks/ops_bench.py's token scatter (8 x 2048 ids, rows of 2048): the deterministic
    scatter must keep up with index_add_'s atomics (10% allowed for timing noise), fastest
    against fastest of interleaved calls (other tests share the GPU)."""
    _need_cuda_kernels()
    g = torch.Generator(device="cuda").manual_seed(0)
    vocab, n, dim = 32_000, 16_384, 2048
    ids = _ids(kind, n, vocab, torch.Generator().manual_seed(1)).cuda()
    rows = torch.randn(n, dim, generator=g, device="cuda")
    table = torch.zeros(vocab, dim, device="cuda")
    (ours, ours_med), (theirs, theirs_med) = _interleaved_ms([lambda: ops.scatter_add_rows(table, ids, rows),
                                                              lambda: table.index_add_(0, ids, rows)])
    print(f"{kind}: scatter_add_rows {ours:.3f} ms (median {ours_med:.3f}), "
          f"index_add_ {theirs:.3f} ms (median {theirs_med:.3f})")
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


def _id_tensor(values, dtype, dev):
    return torch.tensor(values, dtype=dtype, device=dev)


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_cuda_remap_and_gather_record_the_first_failing_call(id_dtype):
    """gather_rows / remap_ids report invalid ids in one kernel launch: a per-stream scratch
    that the kernel's last block turns into the device's error record and resets
    (csrc/cuda/kernels.cu, finish_call). Calls in a row on one stream: the first failing call
    is recorded, valid calls record nothing, before or after a failing one."""
    _need_cuda_kernels()
    dev = torch.device("cuda")
    lookup = torch.tensor([0, -1, 1, -1, 2], device=dev)
    table = torch.randn(5, 8, device=dev)

    def ids(*v):
        return _id_tensor(v, id_dtype, dev)
    ops.check_errors(dev)  # clears anything earlier
    ops.remap_ids(ids(0, 2, 3, 1), lookup)  # the first call fails
    with pytest.raises(ValueError, match=r"^remap_ids: global id 3 \(first at flat position 2\) "
                                         r"is not in this source's vocabulary "
                                         r"\(lookup\[3\] = -1\)"):
        ops.check_errors(dev)
    ops.check_errors(dev)  # cleared by the check that raised
    ops.remap_ids(ids(0, 7, 1, 3), lookup)  # two failing calls (and a failing gather)
    ops.remap_ids(ids(1, 0), lookup)
    ops.gather_rows(table, ids(9))
    with pytest.raises(IndexError, match=r"^remap_ids: global id 7 at flat position 1 is out of "
                                         r"range for a lookup of 5 entries"):
        ops.check_errors(dev)
    ops.gather_rows(table, ids(0, 6, 2, -1))  # a failing call, then valid ones
    out = ops.remap_ids(ids(4, 2, 0), lookup)
    rows = ops.gather_rows(table, ids(4, 0))
    with pytest.raises(IndexError, match=r"^gather_rows: ids\[1\] = 6 is out of range for a "
                                         r"table of 5 rows"):
        ops.check_errors(dev)
    assert out.dtype == id_dtype and out.tolist() == [2, 1, 0]
    assert torch.equal(rows, table[[4, 0]])
    # The failing calls left the stream's scratch reset: valid calls record nothing now (a stale
    # position would be recorded here) and the next failing call records its own position.
    ops.remap_ids(ids(0, 2, 4, 0, 2), lookup)
    ops.gather_rows(table, ids(1, 2, 3, 4, 0, 1))
    ops.check_errors(dev)
    ops.gather_rows(table, ids(1, 2, 3, 4, 5))
    with pytest.raises(IndexError, match=r"^gather_rows: ids\[4\] = 5 is out of range"):
        ops.check_errors(dev)


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_cuda_remap_and_gather_record_the_lowest_invalid_position_over_many_blocks(id_dtype):
    """Invalid ids in several blocks of one launch (thousands of blocks, a partial last one):
    the record names the lowest position, whichever block finishes last; calls of different
    grid sizes follow each other on one stream; the valid entries are remapped / gathered."""
    _need_cuda_kernels()
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(3)
    vocab, missing = 50_000, 777
    lookup = torch.randperm(vocab, generator=g)
    lookup[missing] = -1
    lookup = lookup.to(dev)
    n = 3_000_017  # about 2,930 blocks of 4 x 256 ids
    valid = torch.randint(0, vocab, (n,), generator=g)
    valid[valid == missing] = 0
    ops.check_errors(dev)
    cases = [  # (position: bad id); the lowest position is the expected record
        ({2_999_999: missing, 1_500_003: vocab + 5, 640_123: missing}, 640_123),
        ({n - 1: -3}, n - 1),  # only in the last, partial block
        ({2_000_000: vocab, 1_024: missing, 1_023: missing, 3: -1}, 3),
        ({2_999_000: missing, 1_111_111: vocab}, 1_111_111),
    ]
    for bad, lowest in cases:
        ids = valid.clone()
        for pos, gid in bad.items():
            ids[pos] = gid
        ids_dev = ids.to(id_dtype).to(dev)
        out = ops.remap_ids(ids_dev, lookup)
        small = ops.remap_ids(ids_dev[:5000].clone(), lookup)  # one more call, a smaller grid
        gid = bad[lowest]
        if 0 <= gid < vocab:
            expect = (ValueError, rf"^remap_ids: global id {gid} \(first at flat position "
                                  rf"{lowest}\) is not in this source's vocabulary")
        else:
            expect = (IndexError, rf"^remap_ids: global id {gid} at flat position {lowest} is "
                                  rf"out of range for a lookup of {vocab} entries")
        with pytest.raises(expect[0], match=expect[1]):
            ops.check_errors(dev)
        ok = torch.ones(n, dtype=torch.bool)
        ok[list(bad)] = False
        ref = lookup.cpu()[valid]
        assert torch.equal(out.cpu()[ok].long(), ref[ok])
        assert torch.equal(small.cpu()[ok[:5000]].long(), ref[:5000][ok[:5000]])
    assert torch.equal(ops.remap_ids(valid.to(id_dtype).to(dev), lookup).cpu().long(),
                       lookup.cpu()[valid])
    ops.check_errors(dev)  # a valid call of the same size records nothing

    rows, dim, m = 1000, 8, 300_001  # gather: 2 threads per row, about 2,350 blocks
    table = torch.randn(rows, dim, device=dev)
    gids = torch.randint(0, rows, (m,), generator=g)
    for bad, lowest in [({290_000: rows, 150_001: -1, 77_777: rows + 9}, 77_777),
                        ({m - 1: rows}, m - 1)]:
        ids = gids.clone()
        for pos, gid in bad.items():
            ids[pos] = gid
        got = ops.gather_rows(table, ids.to(id_dtype).to(dev))
        with pytest.raises(IndexError, match=rf"^gather_rows: ids\[{lowest}\] = {bad[lowest]} "
                                             rf"is out of range for a table of {rows} rows"):
            ops.check_errors(dev)
        ok = torch.ones(m, dtype=torch.bool)
        ok[list(bad)] = False
        assert torch.equal(got.cpu()[ok], table.cpu()[gids][ok])
    ops.gather_rows(table, gids.to(id_dtype).to(dev))
    ops.check_errors(dev)


def test_cuda_remap_on_two_streams_keeps_their_calls_apart():
    """Each stream has its own scratch (a shared one would mix the block counts of concurrent
    launches): failing calls on one stream interleaved with large valid calls on another record
    the failing stream's position, and both streams' later calls are reported correctly."""
    _need_cuda_kernels()
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(4)
    vocab = 50_000
    lookup = torch.randperm(vocab, generator=g).to(dev)
    lookup[11] = -1
    big = torch.randint(12, vocab, (4_000_000,), generator=g).to(dev)
    small_bad = torch.randint(12, vocab, (70_000,), generator=g)
    small_bad[[66_000, 5_000]] = 11
    small_bad = small_bad.to(dev)
    side = torch.cuda.Stream()
    ops.check_errors(dev)
    side.wait_stream(torch.cuda.current_stream())
    outs = []
    for _ in range(30):
        with torch.cuda.stream(side):
            outs.append(ops.remap_ids(big, lookup))
        ops.remap_ids(small_bad, lookup)  # on the current stream, while the side stream runs
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=r"global id 11 \(first at flat position 5000\)"):
        ops.check_errors(dev)
    ref = lookup[big]
    assert all(torch.equal(o, ref) for o in outs)
    with torch.cuda.stream(side):
        ops.remap_ids(big, lookup)
    ops.remap_ids(small_bad[:5000], lookup)
    torch.cuda.synchronize()
    ops.check_errors(dev)  # both streams' scratches were left reset
    big_bad = big.clone()
    big_bad[3_210_000] = vocab
    with torch.cuda.stream(side):
        ops.remap_ids(big_bad, lookup)
    torch.cuda.synchronize()
    with pytest.raises(IndexError, match=r"global id 50000 at flat position 3210000 is out of "
                                         r"range"):
        ops.check_errors(dev)


def test_phase_timer_measures_gpu_time_not_queuing():
    """The DEPT round-end timings: GPU work queued inside the phase is counted although the
    host returns at once."""
    from dept_mega.profiling import PhaseTimer

    torch.cuda.synchronize()
    timer = PhaseTimer("cuda")
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU cycles on an H100 (1.98 GHz)
    assert timer.stop().seconds() > 0.05


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_cuda_ranked_remap_equals_cpu_on_both_memory_paths(id_dtype):
    """remap_ids through VocabRanks on CUDA (csrc/cuda/remap_ranked.cu) equals the CPU kernel
    with the words staged in shared memory (stage=1), read from global memory (stage=0) and as
    the launcher picks (-1), on 2^20+ ids (uniform and Zipf) and a training-size batch; invalid
    ids raise the CPU's exact error at the check, with no synchronisation in the call; words
    larger than the device's shared memory fall back to global reads."""
    _need_cuda_kernels()
    from dept_mega.ops import VocabRanks, fallback
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(11)
    V = 250_112
    keep = torch.rand(V, generator=g) < 0.86
    keep[V - 1] = True
    members = keep.nonzero().flatten()
    ranks = VocabRanks.from_ids(members, V)
    ranks_dev = VocabRanks.from_ids(members.to(dev), V)  # built on the device: the same words
    assert torch.equal(ranks_dev.words.cpu(), ranks.words)
    n = 2 ** 20 + 7
    zipf = members[_ids("zipf", n, members.numel(), g)]
    uniform = members[torch.randint(0, members.numel(), (n,), generator=g)]
    batch = uniform[:8 * 2048].view(8, 2048)
    ops.check_errors(dev)
    for ids in (uniform, zipf, batch):
        cpu = ops.remap_ids(ids.to(id_dtype), ranks)
        ids_dev = ids.to(id_dtype).to(dev)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            outs = [ops._remap_ranked(ids_dev, ranks_dev, stage) for stage in (-1, 0, 1)]
        finally:
            torch.cuda.set_sync_debug_mode(0)
        for stage, out in zip((-1, 0, 1), outs):
            assert out.dtype == id_dtype and out.shape == ids.shape
            assert torch.equal(out.cpu(), cpu), stage
    ops.check_errors(dev)

    non_member = int((~keep).nonzero()[5])
    for stage in (-1, 0, 1):
        for bad in ({700_001: non_member, 900_000: V}, {n - 1: V + 9, 3: -1}, {1_000_000: V}):
            ids = uniform.clone()
            for pos, gid in bad.items():
                ids[pos] = gid
            ids = ids.to(id_dtype)
            # the reference's error (the CPU kernel raises the same, from its own error record:
            # tests/test_ops.py)
            err = _raised(lambda: fallback.remap_ranked(ids, ranks.words, ranks.size, -1))
            ops._remap_ranked(ids.to(dev), ranks_dev, stage)
            with pytest.raises(type(err)) as info:
                ops.check_errors(dev)
            assert str(info.value) == str(err), (stage, bad)

    big = VocabRanks.from_ids(torch.arange(0, 2 ** 24, 3), 2 ** 24)  # 4 MB of words
    ids = torch.randint(0, 2 ** 24, (n,), generator=g) // 3 * 3
    out = ops._remap_ranked(ids.to(id_dtype).to(dev), big.to(dev), 1)
    assert torch.equal(out.cpu(), ops.remap_ids(ids.to(id_dtype), big))
    ops.check_errors(dev)


def test_cuda_ranked_remap_past_2_to_the_31_ids():
    """More than 2^31 int32 ids in one call (the kernel's positions and grid-stride steps are
    64-bit; the global-memory path's grid is capped at 2^20 blocks, so it strides too), on each
    memory path: every local id right, and an invalid id past position 2^31 recorded with its
    exact position. About 20 GB of device memory."""
    _need_cuda_kernels()
    from dept_mega.ops import VocabRanks, fallback
    dev = torch.device("cuda")
    torch.cuda.empty_cache()
    if torch.cuda.mem_get_info(dev)[0] < 24 * 2 ** 30:
        pytest.skip("needs 24 GiB of free device memory")
    V, reps = 250_112, 2049  # members: the even ids, so member v maps to v // 2
    ranks = VocabRanks.from_ids(torch.arange(0, V, 2, device=dev), V)
    g = torch.Generator(device=dev).manual_seed(5)
    half = torch.randint(0, V // 2, (2 ** 20,), generator=g, device=dev, dtype=torch.int32)
    ids = (half * 2).repeat(reps)  # 2^31 + 2^20 ids
    assert ids.numel() > 2 ** 31
    ops.check_errors(dev)
    for stage in (-1, 0, 1):
        out = ops._remap_ranked(ids, ranks, stage)
        assert bool((out.view(reps, -1) == half).all()), stage
        out = None
        ops.check_errors(dev)
    pos = 2 ** 31 + 7
    ids[pos], ids[-1] = 1, V  # a non-member past 2^31, then an id out of range
    for stage in (-1, 0, 1):
        ops._remap_ranked(ids, ranks, stage)
        with pytest.raises(ValueError) as info:
            ops.check_errors(dev)
        assert str(info.value) == str(fallback.remap_missing(pos, 1, -1)), stage
    ids = half = None
    torch.cuda.empty_cache()


def _raised(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - returned for its type and message
        return exc
    raise AssertionError("no error raised")


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_cuda_failed_gather_and_remap_return_zeros_at_invalid_ids(id_dtype):
    """A failed CUDA gather / remap, whose error waits for check_errors, returns an output that
    is safe to read meanwhile: 0 (remap, lookup and ranked on each memory path) or a zero row
    (gather: vectorised, unvectorised and converting) at each invalid id, every valid position
    right (before: unwritten, from an empty allocation, so F.embedding of it could assert)."""
    _need_cuda_kernels()
    from dept_mega.ops import VocabRanks
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(5)
    V, n = 5000, 300_001
    ranks = VocabRanks.from_ids(torch.arange(0, V, 2), V).to(dev)
    lookup = ranks.to_lookup()
    ids = torch.randint(0, V // 2, (n,), generator=g) * 2
    bad = {3: 7, 1024: -1, 150_000: V, n - 1: 4999}  # non-members, out of range
    for pos, gid in bad.items():
        ids[pos] = gid
    want = ids // 2
    want[list(bad)] = 0
    ids_dev = ids.to(id_dtype).to(dev)
    remaps = [lambda: ops.remap_ids(ids_dev, lookup)]
    remaps += [lambda s=s: ops._remap_ranked(ids_dev, ranks, s) for s in (-1, 0, 1)]
    ops.check_errors(dev)
    for k, remap in enumerate(remaps):
        torch.full((n,), -12345, dtype=id_dtype, device=dev)  # junk in the block the output gets
        out = remap()
        assert torch.equal(out.cpu().long(), want), k  # before the check: already safe
        with pytest.raises(ValueError, match=r"global id 7 \(first at flat position 3\)"):
            ops.check_errors(dev)
    table = torch.randn(V, 16, generator=g)
    for dim, out_dtype in ((16, None), (7, None), (16, torch.bfloat16)):
        t = table[:, :dim].contiguous().to(dev)
        torch.full((n * dim,), float("nan"), device=dev, dtype=out_dtype or torch.float32)
        rows = ops.gather_rows(t, ids_dev, out_dtype).cpu()
        ref = t.cpu()[ids.clamp(0, V - 1)].to(out_dtype or torch.float32)
        ref[list(bad)[1:3]] = 0  # -1 and V: invalid; 7 and 4999 are rows of the table
        assert torch.equal(rows, ref), (dim, out_dtype)
        with pytest.raises(IndexError, match=r"gather_rows: ids\[1024\] = -1 is out of range"):
            ops.check_errors(dev)
