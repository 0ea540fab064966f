"""dept_mega.ops: gather / scatter-add / scatter-mean / remap against float64 references,
the compiled kernels against the PyTorch fallback (bit for bit), determinism, autograd and
tracing (the errors: tests/test_ops_errors.py). CUDA variants run when a GPU is present."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

import dept_mega.ops as ops
from dept_mega.ops import fallback
from tests.ops_utils import (DEVICES, ID_DTYPES, IMPLS, ROW_DTYPES, ext_handles, gen, lazy_check, rand_ids,
                             rand_rows, ref_chunked_add, ref_scatter_add, ref_scatter_mean, require_extension,
                             seed_of, tol)

SHAPES = [(1, 1), (7, 3), (50, 17), (33, 769), (300, 64)]  # (rows, dim), odd dims included
NS = [0, 1, 40]  # ids per call; 40 > rows for the small tables, so ids repeat


# --------------------------------------------------------------------------- gather


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("table_dtype", ROW_DTYPES)
def test_gather_matches_reference(device, impl, shape, table_dtype):
    gather = IMPLS[impl][0]
    g = gen(seed_of((shape, str(table_dtype))))
    table = rand_rows(shape, table_dtype, device, g)
    for n in NS:
        for id_dtype in ID_DTYPES:
            ids = rand_ids(n, shape[0], id_dtype, device, g)
            for out_dtype in [None] + ROW_DTYPES:
                rows = gather(table, ids, out_dtype)
                want = table.double()[ids.long()].to(out_dtype or table_dtype)
                assert rows.shape == (n, shape[1]) and rows.dtype == want.dtype
                assert rows.is_contiguous()
                # A gather is a copy (plus one rounding): exact.
                assert torch.equal(rows, want), (n, id_dtype, out_dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_gather_noncontiguous_table(device):
    g = gen(1)
    big = rand_rows((20, 34), torch.float32, device, g)
    table = big[:, ::2]
    ids = rand_ids(30, 20, torch.int64, device, g)
    for impl in IMPLS.values():
        assert torch.equal(impl[0](table, ids), table[ids])


# --------------------------------------------------------------------------- scatter-add


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("out_dtype", ROW_DTYPES)
def test_scatter_add_matches_reference(device, impl, shape, out_dtype):
    scatter = IMPLS[impl][1]
    g = gen(seed_of(("sa", shape, str(out_dtype))))
    for n in NS:
        for id_dtype in ID_DTYPES:
            for rows_dtype in (out_dtype, torch.float32):
                out = rand_rows(shape, out_dtype, device, g)
                ids = rand_ids(n, shape[0], id_dtype, device, g, dup_pool=5)
                rows = rand_rows((n, shape[1]), rows_dtype, device, g)
                want = ref_scatter_add(out, ids, rows)
                res = scatter(out, ids, rows)
                assert res is out and out.dtype == out_dtype
                rtol, atol = tol(out_dtype)
                torch.testing.assert_close(out.double(), want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("out_dtype", ROW_DTYPES)
@pytest.mark.parametrize("rows_dtype", ROW_DTYPES)
def test_scatter_extension_equals_fallback_bitwise(device, shape, out_dtype, rows_dtype):
    if not ext_handles(device):
        pytest.skip(f"no compiled kernels for {device}: {ops.extension_status().reason}")
    g = gen(seed_of(("eq", shape, str(out_dtype), str(rows_dtype))))
    n = 3 * shape[0] + 5
    for id_dtype in ID_DTYPES:
        ids = rand_ids(n, shape[0], id_dtype, device, g, dup_pool=max(1, shape[0] // 2))
        rows = rand_rows((n, shape[1]), rows_dtype, device, g)
        base = rand_rows(shape, out_dtype, device, g)
        a, b = base.clone(), base.clone()
        ops.scatter_add_rows(a, ids, rows)
        fallback.scatter_add_rows(b, ids, rows)
        assert torch.equal(a, b), "scatter_add_rows"
        for accumulate in (False, True):
            for alpha in (1.0, -1.0, 0.7):
                a, b = base.clone(), base.clone()
                ops.scatter_mean_rows(a, ids, rows, accumulate=accumulate, alpha=alpha)
                fallback.scatter_mean_rows(b, ids, rows, accumulate=accumulate, alpha=alpha)
                assert torch.equal(a, b), f"scatter_mean_rows accumulate={accumulate} {alpha}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scatter_rows_overlapping_the_table_are_read_as_before_the_call(device, impl, dtype):
    """rows that are a view of the destination table are read as they were before the call, on
    every backend: the result of the same call with a copy of them (the compiled kernels read
    rows that they had already updated)."""
    table = torch.randn(6, 4, generator=gen(7)).to(dtype).to(device)
    ids = torch.tensor([1, 0, 1, 3], device=device)
    calls = [lambda f, t, r: f[1](t, ids, r)]
    calls += [lambda f, t, r, a=a: f[2](t, ids, r, a, -0.5) for a in (False, True)]
    for k, call in enumerate(calls):
        for lo in (0, 2, 1):  # rows = table[lo:lo + 4]
            want = table.clone()
            call(IMPLS[impl], want, table[lo:lo + 4].clone())
            got = table.clone()
            call(IMPLS[impl], got, got[lo:lo + 4])
            lazy_check(device)
            assert torch.equal(got, want), (k, lo)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", list(IMPLS))
def test_in_place_scatters_are_seen_by_autograd(device, impl):
    """As PyTorch's in-place ops (the fallback's index_copy_): a scatter bumps the table's
    version counter, so a backward that saved the table (here through a detached alias) raises
    instead of using the new values; a leaf that requires grad is refused in grad mode (and
    updated under no_grad). The compiled operators did neither."""
    ids, rows = torch.tensor([1, 3, 1], device=device), torch.ones(3, 2, device=device)
    f = IMPLS[impl]
    scatters = [lambda t: f[1](t, ids, rows), lambda t: f[2](t, ids, rows),
                lambda t: f[2](t, ids, rows, True, -1.0)]
    for k, scatter in enumerate(scatters):
        t = torch.zeros(4, 2, device=device)
        v = t._version
        scatter(t)
        lazy_check(device)
        assert t._version > v, k
        y = torch.randn(4, 2, device=device, requires_grad=True) * 1.0
        z = (y * y).sum()  # saves y
        scatter(y.detach())
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            z.backward()
        leaf = torch.zeros(4, 2, device=device, requires_grad=True)
        with pytest.raises(RuntimeError, match="a leaf Variable that requires grad is being used in an in-place"):
            scatter(leaf)
        assert leaf.eq(0).all(), k  # refused before writing
        with torch.no_grad():
            scatter(leaf)
        assert leaf[[1, 3]].ne(0).all(), k


@pytest.mark.parametrize("device", DEVICES)
def test_fallback_rank_passes_equal_sequential_order(device):
    # The fallback's non-CPU method (one exact add per element per pass) must add in the same
    # order as the sequential one; checked on CPU too, where both methods run.
    g = gen(17)
    index = rand_ids(500, 23, torch.int64, device, g, dup_pool=23)
    src = rand_rows((500, 9), torch.float32, device, g) * 100
    base = rand_rows((23, 9), torch.float32, device, g)
    a, b = base.clone(), base.clone()
    fallback._ordered_add_(a, index, src, by_rank=True)
    if device == "cpu":
        fallback._ordered_add_(b, index, src, by_rank=False)
    else:
        b = b.cpu()
        for k in range(index.numel()):
            b[index[k]] += src[k].cpu()
        b = b.to(device)
    assert torch.equal(a, b)
    empty = base.clone()
    fallback._ordered_add_(empty, index[:0], src[:0], by_rank=True)
    assert torch.equal(empty, base)


def test_scatter_sort_path_for_huge_tables():
    # rows >> len(ids): the CPU kernel groups by a stable sort instead of a counting sort.
    g = gen(3)
    out = torch.zeros(1_000_003, 2)
    ids = torch.tensor([999_999, 5, 999_999, 0, 5, 1_000_002], dtype=torch.int64)
    rows = rand_rows((6, 2), torch.float32, "cpu", g)
    want = ref_scatter_add(out, ids, rows)
    for impl in IMPLS.values():
        o = out.clone()
        impl[1](o, ids, rows)
        torch.testing.assert_close(o.double(), want, rtol=1e-6, atol=1e-6)
    a, b = out.clone(), out.clone()
    ops.scatter_add_rows(a, ids, rows)
    fallback.scatter_add_rows(b, ids, rows)
    assert torch.equal(a, b)


# --------------------------------------------------------------------------- scatter-mean


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", ROW_DTYPES)
@pytest.mark.parametrize("accumulate", [False, True])
def test_scatter_mean_matches_reference(device, impl, shape, dtype, accumulate):
    scatter_mean = IMPLS[impl][2]
    g = gen(seed_of(("sm", shape, str(dtype), accumulate)))
    for n in NS:
        table = rand_rows(shape, dtype, device, g)
        # Three "sources" contribute overlapping subsets of rows, concatenated.
        parts = [rand_ids(n // 3 + 1, shape[0], torch.int64, device, g).unique() for _ in range(3)]
        ids = torch.cat(parts)[:n] if n else torch.empty(0, dtype=torch.int64, device=device)
        rows = rand_rows((ids.numel(), shape[1]), torch.float32, device, g)
        before = table.clone()
        alpha = -0.5 if n % 2 else 1.0
        want = ref_scatter_mean(table, ids, rows, accumulate, alpha)
        assert scatter_mean(table, ids, rows, accumulate=accumulate, alpha=alpha) is table
        rtol, atol = tol(dtype)
        torch.testing.assert_close(table.double(), want, rtol=rtol, atol=atol)
        untouched = torch.ones(shape[0], dtype=torch.bool, device=device)
        untouched[ids.long()] = False
        assert torch.equal(table[untouched], before[untouched])


def test_scatter_mean_trim_round_end():
    # TRIM's use: two sources hold overlapping vocabularies; each row of the global table
    # becomes the mean over the sources that hold it, other rows stay.
    table = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    ids = torch.tensor([0, 2, 3, 2, 3, 5])  # source A: {0,2,3}, source B: {2,3,5}
    rows = torch.tensor([[10., 10], [20, 20], [30, 30], [40, 40], [50, 50], [60, 60]])
    for impl in IMPLS.values():
        t = table.clone()
        impl[2](t, ids, rows)
        want = table.clone()
        want[0], want[2], want[3], want[5] = 10, 30, 40, 60
        assert torch.equal(t, want)
        d = table.clone()
        impl[2](d, ids, rows, accumulate=True, alpha=-1.0)  # table[r] -= mean delta
        want = table.clone()
        want[0] -= 10
        want[2] -= 30
        want[3] -= 40
        want[5] -= 60
        assert torch.equal(d, want)


# --------------------------------------------------------------------------- remap


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("id_dtype", ID_DTYPES)
@pytest.mark.parametrize("lookup_dtype", ID_DTYPES)
def test_remap_matches_reference(device, impl, id_dtype, lookup_dtype):
    remap = IMPLS[impl][3]
    g = gen(7)
    vocab = 1000
    local = torch.randperm(vocab, generator=g)[:300]  # this source's global ids
    lookup = torch.full((vocab,), -1, dtype=lookup_dtype)
    lookup[local] = torch.arange(300, dtype=lookup_dtype)
    lookup = lookup.to(device)
    for shape in [(0,), (5,), (3, 7), (2, 3, 4), (4, 0)]:
        n = 1
        for s in shape:
            n *= s
        pick = torch.randint(0, 300, (n,), generator=g)
        ids = local[pick].reshape(shape).to(id_dtype).to(device)
        out = remap(ids, lookup)
        assert out.shape == ids.shape and out.dtype == id_dtype and out.is_contiguous()
        assert torch.equal(out.long().cpu(), pick.reshape(shape))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", list(IMPLS))
def test_remap_errors_name_first_offending_id(device, impl):
    remap = IMPLS[impl][3]
    lookup = torch.tensor([0, -1, 1, -1, 2], device=device)
    ids = torch.tensor([[0, 2, 4], [3, 1, 0]], device=device)  # 3 is the first missing
    with pytest.raises(ValueError, match=r"global id 3 \(first at flat position 3\) is not in "
                                         r"this source's vocabulary \(lookup\[3\] = -1\)"):
        remap(ids, lookup)
        lazy_check(device)  # CUDA reports invalid ids at the next check; CPU raised
    with pytest.raises(IndexError, match=r"global id 7 at flat position 1 is out of range for "
                                         r"a lookup of 5 entries"):
        remap(torch.tensor([0, 7, 1], device=device), lookup)
        lazy_check(device)
    with pytest.raises(IndexError, match=r"global id -2 at flat position 0"):
        remap(torch.tensor([-2], device=device), lookup)
        lazy_check(device)
    with pytest.raises(IndexError, match=r"lookup of 0 entries"):
        remap(torch.tensor([0], device=device), lookup[:0])
        lazy_check(device)
    assert remap(torch.empty(0, dtype=torch.long, device=device), lookup[:0]).numel() == 0


# --------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("device", DEVICES)
def test_scatter_deterministic_across_runs_and_threads(device):
    g = gen(11)
    n, rows_, dim = 4000, 37, 65
    ids = rand_ids(n, rows_, torch.int64, device, g, dup_pool=37)  # ~100 per row
    rows = rand_rows((n, dim), torch.float32, device, g) * 1e3
    base = rand_rows((rows_, dim), torch.bfloat16, device, g)
    threads = torch.get_num_threads()
    results = []
    try:
        for nt in (1, 2, 1, 2):
            torch.set_num_threads(nt)
            a = ops.scatter_add_rows(base.clone(), ids, rows)
            m = ops.scatter_mean_rows(base.clone(), ids, rows)
            results.append((a, m))
    finally:
        torch.set_num_threads(threads)
    for a, m in results[1:]:
        assert torch.equal(a, results[0][0]) and torch.equal(m, results[0][1])
    # Order matters in fp32 at this scale (~100 rows per id, more than one chunk): the fixed
    # order is the documented chunked one.
    start = base.float()
    assert torch.equal(ops.scatter_add_rows(start.clone(), ids, rows).cpu(),
                       ref_chunked_add(start, ids, rows))
    assert torch.equal(results[0][0].cpu(), ref_chunked_add(start, ids, rows).to(torch.bfloat16))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dim", [5, 8])
def test_scatter_long_runs_fixed_chunk_order(device, dim):
    """Ids repeated more than one chunk (64) of times: every backend sums in the documented
    chunked order, bit for bit (fp32 table, so no final rounding hides the order)."""
    g = gen(seed_of(("chunks", dim)))
    counts = {3: 300, 0: 129, 7: 65, 5: 64, 1: 1}  # runs of 4.7, 2, 1+1, 1 chunks; one single
    ids = torch.cat([torch.full((c,), i) for i, c in counts.items()])
    ids = ids[torch.randperm(ids.numel(), generator=g)].to(device)
    rows = rand_rows((ids.numel(), dim), torch.float32, device, g) * 100
    start = rand_rows((9, dim), torch.float32, device, g)
    want = ref_chunked_add(start, ids, rows)
    sequential = start.float().cpu().index_add(0, ids.cpu(), rows.cpu())  # one add per row
    assert not torch.equal(want, sequential)  # the data can tell the two orders apart
    got = {"api": ops.scatter_add_rows(start.clone(), ids, rows),
           "fallback": fallback.scatter_add_rows(start.clone(), ids, rows)}
    # by_rank=False is index_add_, sequential only on CPU (atomics on CUDA, any order)
    for by_rank in (False, True) if device == "cpu" else (True,):
        acc = start.clone()
        fallback._ordered_add_(acc, ids, rows, by_rank=by_rank)
        got[f"_ordered_add_ by_rank={by_rank}"] = acc
    for name, res in got.items():
        assert torch.equal(res.cpu(), want), name
    # The means divide the same sums (from zero).
    sums = ref_chunked_add(torch.zeros_like(start), ids, rows)
    cnt = torch.zeros(9).index_add_(0, ids.cpu(), torch.ones(ids.numel())).clamp(min=1)
    for impl in IMPLS.values():
        t = start.clone()
        impl[2](t, ids, rows, accumulate=True, alpha=-0.5)
        mean = sums / cnt.unsqueeze(1) * -0.5
        exp = torch.where(torch.isin(torch.arange(9), ids.cpu()).unsqueeze(1), start.cpu() + mean,
                          start.cpu())
        assert torch.equal(t.cpu(), exp)


# --------------------------------------------------------------------------- autograd


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16])
def test_gather_backward_is_scatter_add(device, impl, out_dtype):
    g = gen(5)
    table = rand_rows((30, 17), torch.float32, device, g).requires_grad_()
    ids = rand_ids(50, 30, torch.int32, device, g, dup_pool=8)
    rows = IMPLS[impl][0](table, ids, out_dtype)
    upstream = rand_rows((50, 17), rows.dtype, device, g)
    (rows * upstream).sum().backward()
    want = torch.zeros(30, 17, dtype=torch.float64, device=device).index_add(
        0, ids.long(), upstream.double())
    assert table.grad.dtype == torch.float32
    torch.testing.assert_close(table.grad.double(), want, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- registration


def test_extension_built_when_compiler_present():
    """CI has g++: the CPU extension must have been built and loaded (no silent fallback)."""
    if os.environ.get("DEPT_MEGA_OPS", "auto") == "torch":
        pytest.skip("DEPT_MEGA_OPS=torch forces the fallback")
    if not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("no C++ compiler: the extension is not expected")
    st = ops.extension_status()
    assert st.loaded, st.reason
    assert ops.backend("cpu") == "cpp"
    assert ops.backend("cuda") == ("cuda" if st.cuda else "torch")


def test_env_switch_forces_fallback():
    code = ("import torch, dept_mega.ops as o; t = torch.ones(3, 2); "
            "print(o.backend('cpu'), o.gather_rows(t, torch.tensor([2])).tolist())")
    env = dict(os.environ, DEPT_MEGA_OPS="torch")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split()[0] == "torch"
    assert "DEPT_MEGA_OPS=torch forces the PyTorch fallback" in res.stderr


@pytest.mark.slow
def test_opcheck():
    require_extension()
    g = gen(9)
    table = rand_rows((10, 6), torch.float32, "cpu", g)
    ids = torch.tensor([3, 1, 3, 9], dtype=torch.int64)
    rows = rand_rows((4, 6), torch.float32, "cpu", g)
    lookup = torch.arange(10)
    torch.library.opcheck(torch.ops.dept_mega.gather_rows.default, (table, ids, None))
    torch.library.opcheck(torch.ops.dept_mega.gather_rows.default,
                          (table.requires_grad_(), ids, torch.bfloat16))
    torch.library.opcheck(torch.ops.dept_mega.scatter_add_rows_.default,
                          (table.detach().clone(), ids, rows))
    torch.library.opcheck(torch.ops.dept_mega.scatter_mean_rows_.default,
                          (table.detach().clone(), ids, rows, True, -0.5))
    torch.library.opcheck(torch.ops.dept_mega.remap_ids.default, (ids.view(2, 2), lookup))


def test_torch_compile_traces_ops():
    require_extension()
    g = gen(13)
    table = rand_rows((12, 5), torch.float32, "cpu", g)
    lookup = torch.full((40,), -1, dtype=torch.int64)
    lookup[torch.arange(0, 36, 3)] = torch.arange(12)
    tokens = torch.arange(0, 36, 3).reshape(3, 4)

    def step(table, tokens):
        local = ops.remap_ids(tokens, lookup)
        rows = ops.gather_rows(table, local.reshape(-1), torch.bfloat16)
        out = torch.zeros_like(table)
        ops.scatter_add_rows(out, local.reshape(-1), rows.float() * 2)
        return out

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(table, tokens), step(table, tokens))
    # in a compiled graph the CPU wrappers do not read the error record (no graph break): an
    # invalid id raises at the next check_errors("cpu"), as a CUDA kernel's does
    ops.check_errors("cpu")
    bad = tokens.clone()
    bad[1, 2] = 4  # lookup[4] = -1
    compiled(table, bad)
    with pytest.raises(ValueError, match=r"global id 4 \(first at flat position 6\)"):
        ops.check_errors("cpu")


def test_mixed_devices_are_a_value_error():
    t = torch.zeros(4, 3)
    meta_ids = torch.zeros(2, dtype=torch.long, device="meta")
    with pytest.raises(ValueError, match="gather_rows: table is on cpu but ids is on meta"):
        ops.gather_rows(t, meta_ids)
    with pytest.raises(ValueError, match="remap_ids: ids is on meta but lookup is on cpu"):
        ops.remap_ids(meta_ids, torch.arange(4))


def test_remap_quick_argument_check_agrees_with_the_full_one():
    """On CUDA remap_ids runs check_remap_args (which raises the message) only when
    _remap_args_ok fails: the two must agree on every dtype / rank."""
    dtypes = (torch.int32, torch.int64, torch.int16, torch.uint8, torch.float32, torch.bool)
    for ids_dt in dtypes:
        for lut_dt in dtypes:
            for shape in ((), (4,), (2, 2)):
                ids, lookup = torch.zeros(3, dtype=ids_dt), torch.zeros(shape, dtype=lut_dt)
                try:
                    fallback.check_remap_args(ids, lookup)
                    raises = False
                except (TypeError, ValueError):
                    raises = True
                assert ops._remap_args_ok(ids, lookup) is not raises, (ids_dt, lut_dt, shape)


def test_meta_tensors_give_shapes():
    require_extension()
    table = torch.empty(10, 7, device="meta")
    ids = torch.empty(5, dtype=torch.int32, device="meta")
    assert ops.gather_rows(table, ids, torch.bfloat16).shape == (5, 7)
    assert ops.remap_ids(ids.view(1, 5), torch.empty(10, dtype=torch.long, device="meta")).shape == (1, 5)


def test_ops_bench_small_runs_on_cpu(tmp_path):
    """benchmarks/ops_bench.py (inputs drawn on the benchmarked device) end to end, tiny sizes."""
    out = tmp_path / "ops.json"
    res = subprocess.run([sys.executable, "benchmarks/ops_bench.py", "--device", "cpu", "--small",
                          "--iters", "1", "--out", str(out)],
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    import json
    rows = json.loads(out.read_text())["results"]
    ops_run = {r["op"] for r in rows}
    assert "scatter_add_rows 2x128 tokens (dups)" in ops_run and all(r["ms"] > 0 for r in rows)
    # the remap's bandwidth rows at --remap-ids (2**13 with --small, 128 ids a row), and its
    # per-call overhead at the batch size
    for dist in ("uniform", "Zipf 1"):  # uniformly drawn ids and natural text's frequencies
        for suffix in ("", ", ranked"):  # through the lookup table and through VocabRanks
            remap = next(r for r in rows if r["op"] == f"remap_ids (64x128, {dist}{suffix})")
            assert remap["% of copy"] > 0 and remap["host_ms"] > 0
    overhead = json.loads(out.read_text())["overhead"]
    assert [r["op"] for r in overhead] == ["copy", "remap_ids", "remap_ids (ranked)", "torch lookup[ids]"]
    assert all(r["shape"] == [2, 128] and r["host_us"] > 0 and r["call_us"] > 0 for r in overhead)
    assert "| remap_ids | " in res.stdout and "target remap >= 80% of the copy" in res.stdout


def test_zipf_ranks_follow_one_over_rank():
    """The remap bench's Zipf draw: rank r comes with probability ∝ 1/(r+1), so rank 0 is
    drawn about twice as often as rank 1 and ten times as often as rank 9."""
    from benchmarks.ops_bench import zipf_ranks
    r = zipf_ranks(0, 1000, (200_000,), torch.Generator().manual_seed(0), "cpu")
    assert r.min() >= 0 and r.max() < 1000
    counts = torch.bincount(r, minlength=1000).double()
    assert abs(counts[0] / counts[1] - 2.0) < 0.15 and abs(counts[0] / counts[9] - 10.0) < 1.0
