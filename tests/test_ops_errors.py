"""dept_mega.ops' errors: the same error from every backend, naming the first offending id; the
compiled kernels record invalid ids instead of throwing (dept_mega.ops raises the record); the
arguments are checked in Python before the operator. CUDA variants run when a GPU is present."""
from __future__ import annotations

import pytest
import torch

import dept_mega.ops as ops
from dept_mega.ops import fallback
from tests.ops_utils import DEVICES, IMPLS, lazy_check, require_extension


# --------------------------------------------------------------------------- errors


def _error(fn, *args, **kwargs):
    with pytest.raises(Exception) as info:
        fn(*args, **kwargs)
        ops.check_errors()  # CUDA: invalid ids are reported at the next check
    return info.type, str(info.value).splitlines()[0]


@pytest.mark.parametrize("device", DEVICES)
def test_errors_identical_across_backends(device):
    t = torch.zeros(4, 3, device=device)
    i = torch.tensor([0, 4, 1], device=device)
    r = torch.ones(3, 3, device=device)
    cases = [
        ("gather", lambda f: f[0](t, i)),
        ("gather neg", lambda f: f[0](t, torch.tensor([-1], device=device))),
        ("gather 3d", lambda f: f[0](t[None], i)),
        ("gather ids 2d", lambda f: f[0](t, i[None])),
        ("gather f64", lambda f: f[0](t.double(), i)),
        ("gather float ids", lambda f: f[0](t, i.float())),
        ("gather out_dtype", lambda f: f[0](t, i, torch.float64)),
        ("scatter", lambda f: f[1](t.clone(), i, r)),
        ("scatter shape", lambda f: f[1](t.clone(), i, r[:, :2])),
        ("scatter noncontig", lambda f: f[1](torch.zeros(3, 4, device=device).t(), i, r)),
        ("mean", lambda f: f[2](t.clone(), i, r)),
        ("remap lookup 2d", lambda f: f[3](i, i[None])),
        ("remap float", lambda f: f[3](i.float(), i)),
    ]
    for name, call in cases:
        got = {impl: _error(call, IMPLS[impl]) for impl in IMPLS}
        assert got["api"] == got["fallback"], name
    typ, msg = _error(cases[0][1], IMPLS["api"])
    assert typ is IndexError and msg == "gather_rows: ids[1] = 4 is out of range for a table of 4 rows"
    typ, msg = _error(cases[7][1], IMPLS["api"])
    assert typ is IndexError and msg.startswith("scatter_add_rows: ids[1] = 4")
    assert _error(cases[4][1], IMPLS["api"])[0] is TypeError
    assert _error(cases[2][1], IMPLS["api"])[0] is ValueError


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", list(IMPLS))
def test_scatter_error_leaves_table_unchanged(device, impl):
    t = torch.arange(8, dtype=torch.float32, device=device).reshape(4, 2)
    before = t.clone()
    ids = torch.tensor([0, 1, 9], device=device)
    with pytest.raises(IndexError):
        IMPLS[impl][1](t, ids, torch.ones(3, 2, device=device))
        lazy_check(device)
    with pytest.raises(IndexError):
        IMPLS[impl][2](t, ids, torch.ones(3, 2, device=device))
        lazy_check(device)
    assert torch.equal(t, before)


def test_error_records_raise_the_immediate_errors():
    """The CUDA ops report invalid ids through a device error record {code, position, id,
    bound, lookup value} (csrc/constants.h) that check_errors decodes: each record raises
    exactly what the CPU op raises at once. (The CUDA kernels that write the records run only
    on a GPU: the cuda variants of the tests above.)"""
    t, r = torch.zeros(4, 3), torch.ones(3, 3)
    i = torch.tensor([0, 4, 1])
    lookup = torch.tensor([0, -1, 1, -1, 2])
    cases = [  # (record, the CPU call that raises the same error)
        ([1, 1, 4, 4, 0], lambda: ops.gather_rows(t, i)),
        ([2, 1, 4, 4, 0], lambda: ops.scatter_add_rows(t.clone(), i, r)),
        ([3, 1, 4, 4, 0], lambda: ops.scatter_mean_rows(t.clone(), i, r)),
        ([4, 1, 7, 5, 0], lambda: ops.remap_ids(torch.tensor([0, 7, 1]), lookup)),
        ([5, 3, 3, 5, -1], lambda: ops.remap_ids(torch.tensor([[0, 2, 4], [3, 1, 0]]), lookup)),
    ]

    def raise_record(record):
        raise ops.recorded_error(record)
    for record, call in cases:
        assert _error(raise_record, record) == _error(call), record
    assert "unknown error record code 9" in str(ops.recorded_error([9, 0, 0, 0, 0]))
    ops.check_errors("cpu")  # the CPU calls above raised and cleared this thread's record


def _cpu_direct_cases():
    """(name, a torch.ops.dept_mega call with an invalid id, the public call with the same
    arguments, the table it must leave unchanged or None): every data error of the CPU kernels."""
    t, r = torch.arange(12, dtype=torch.float32).reshape(4, 3), torch.ones(3, 3)
    i = torch.tensor([0, 4, 1])
    lookup = torch.tensor([0, -1, 1, -1, 2])
    ranks = ops.VocabRanks.from_ids(torch.tensor([0, 2, 4]), 5)
    O = torch.ops.dept_mega
    return [
        ("gather", lambda: O.gather_rows(t, i, None), lambda: ops.gather_rows(t, i), None),
        ("scatter_add", lambda: O.scatter_add_rows_(t, i, r), lambda: ops.scatter_add_rows(t, i, r), t),
        ("scatter_mean", lambda: O.scatter_mean_rows_(t, i, r, True, -1.0),
         lambda: ops.scatter_mean_rows(t, i, r, True, -1.0), t),
        ("remap range", lambda: O.remap_ids(torch.tensor([0, 7, 1]), lookup),
         lambda: ops.remap_ids(torch.tensor([0, 7, 1]), lookup), None),
        ("remap missing", lambda: O.remap_ids(torch.tensor([[0, 2, 4], [3, 1, 0]]), lookup),
         lambda: ops.remap_ids(torch.tensor([[0, 2, 4], [3, 1, 0]]), lookup), None),
        ("ranked range", lambda: O.remap_ranked(torch.tensor([0, 7, 1]), ranks.words, 5, -1),
         lambda: ops.remap_ids(torch.tensor([0, 7, 1]), ranks), None),
        ("ranked missing", lambda: O.remap_ranked(torch.tensor([[0, 2, 4], [3, 1, 0]]), ranks.words, 5, -1),
         lambda: ops.remap_ids(torch.tensor([[0, 2, 4], [3, 1, 0]]), ranks), None),
    ]


def test_cpu_kernels_record_invalid_ids_instead_of_throwing():
    """The CPU kernels throw no C++ exception for an invalid id (a throw crashed the GPU
    machine's build): they write the calling thread's error record and return, a scatter without
    touching the table. The operator called directly raises nothing; the next check_errors("cpu")
    raises exactly what the public call raises at once, and clears the record. The record keeps
    the first error since the last check, as the CUDA record does."""
    require_extension()
    ops.check_errors("cpu")  # nothing left from an earlier test
    for name, direct, public, table in _cpu_direct_cases():
        before = None if table is None else table.clone()
        direct()  # no exception
        if table is not None:
            assert torch.equal(table, before), name
        want = _error(public)  # raised at the call (and the record cleared by it)
        direct()
        assert _error(ops.check_errors, "cpu") == want, name
        ops.check_errors("cpu")  # cleared by the check that raised
    cases = _cpu_direct_cases()
    cases[0][1](), cases[3][1]()  # two errors: the first is kept
    assert _error(ops.check_errors, "cpu") == _error(cases[0][2])


@pytest.mark.parametrize("scatter", ["add", "mean"])
def test_an_earlier_recorded_error_is_raised_before_an_in_place_scatter_writes(scatter):
    """A record left by a direct operator call (or a compiled graph) is raised by the next
    wrapped CPU call; an in-place scatter raises it before writing, so that "on error the table
    is unchanged" holds for the call that raises."""
    require_extension()
    ops.check_errors("cpu")
    table, ids, rows = torch.zeros(4, 3), torch.tensor([0, 1]), torch.ones(2, 3)
    bad = torch.tensor([0, 9])
    torch.ops.dept_mega.remap_ids(bad, torch.arange(4))  # records, raises nothing
    want = _error(ops.remap_ids, bad, torch.arange(4))
    torch.ops.dept_mega.remap_ids(bad, torch.arange(4))
    call = ops.scatter_add_rows if scatter == "add" else ops.scatter_mean_rows
    assert _error(call, table, ids, rows) == want
    assert torch.equal(table, torch.zeros(4, 3))
    call(table, ids, rows)  # the record was cleared: this one runs
    assert table[:2].eq(1).all()


def test_cpu_arguments_are_checked_in_python_before_the_operator(monkeypatch):
    """The public API runs the fallback's argument checks before a CPU operator (as before a
    CUDA one), so no C++ argument check throws through it: each check, replaced by one that
    raises a marker, raises it for arguments the C++ check would refuse."""
    require_extension()

    class Marker(Exception):
        pass

    def refuse(*args):
        raise Marker()
    for name in ("check_gather_args", "check_scatter_args", "check_remap_args", "check_remap_ranked_args"):
        monkeypatch.setattr(fallback, name, refuse)
    t, i, r = torch.zeros(4, 3), torch.tensor([0, 1]), torch.ones(2, 3)
    ranks = ops.VocabRanks.from_ids(torch.tensor([0, 2]), 5)
    for call in (lambda: ops.gather_rows(t[0], i), lambda: ops.scatter_add_rows(t, i, r[:, :2]),
                 lambda: ops.scatter_mean_rows(t.t(), i, r), lambda: ops.remap_ids(i.float(), i),
                 lambda: ops.remap_ids(i.float(), ranks)):
        with pytest.raises(Marker):
            call()


def test_an_extension_without_the_cpu_error_record_is_not_used(monkeypatch):
    """An extension built before the CPU kernels recorded their errors (no CPU kernel of
    error_record: its kernels threw) is reported and left for the fallback."""
    from dept_mega.ops import loader
    require_extension()
    real = loader._has_kernel
    monkeypatch.setattr(loader, "_has_kernel",
                        lambda op, key: not (op == "dept_mega::error_record" and key == "CPU") and real(op, key))
    st = loader._load()
    assert not st.loaded and "older than this source (no error_record operator)" in st.reason


def test_cpu_error_record_is_per_thread():
    """Two Python threads never see each other's CPU errors: an invalid id met by one thread's
    direct call is not raised by another thread's calls or checks, and is raised by its own."""
    import threading
    require_extension()
    ops.check_errors("cpu")
    caught = []
    bad = threading.Event()
    checked = threading.Event()

    def worker():
        torch.ops.dept_mega.remap_ids(torch.tensor([0, 9]), torch.arange(4))
        bad.set()
        checked.wait(60)
        try:
            ops.check_errors("cpu")
        except IndexError as exc:
            caught.append(str(exc))

    th = threading.Thread(target=worker)
    th.start()
    assert bad.wait(60)
    assert ops.remap_ids(torch.tensor([1, 2]), torch.arange(4)).tolist() == [1, 2]  # no raise here
    ops.check_errors("cpu")  # nor here
    checked.set()
    th.join(60)
    assert caught == ["remap_ids: global id 9 at flat position 1 is out of range for a lookup of 4 entries"]


def _dirty(numel, dtype):
    """Frees a block filled with junk, which the next allocation of its size gets back (the
    outputs below start from it; zeros would hide an unwritten position)."""
    torch.full((numel,), -12345, dtype=dtype)


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_a_failed_cpu_gather_or_remap_returns_zeros_at_invalid_ids(id_dtype):
    """An output returned while its error is deferred (a direct operator call or a compiled
    graph on CPU; every CUDA call) is safe to read: 0 (a remap) or a zero row (a gather) at each
    invalid id, every valid position right (the remap used to stop writing its 16384-id chunk at
    the first invalid id, the gather to write nothing), and check_errors still raises the error."""
    require_extension()
    ops.check_errors("cpu")
    O = torch.ops.dept_mega
    ranks = ops.VocabRanks.from_ids(torch.arange(0, 200, 2), 200)
    remaps = {"ranked": lambda t: O.remap_ranked(t, ranks.words, ranks.size, -1),
              "lookup": lambda t: O.remap_ids(t, ranks.to_lookup().to(id_dtype))}
    tok = torch.arange(0, 64, 2).reshape(4, 8)
    tok[0, 3], tok[2, 5] = 7, 200  # a non-member, then an id out of range
    big = torch.arange(40_000) * 2 % 200  # chunks of 16384 ids, invalid ids in three of them
    bad = [5, 9, 20_000, 39_999]
    big[bad] = torch.tensor([7, -4, 301, 9])
    for name, remap in remaps.items():
        for ids, first in ((tok, r"global id 7 \(first at flat position 3\)"),
                           (big, r"global id 7 \(first at flat position 5\)")):
            want = ids // 2
            want[(ids % 2 == 1) | (ids < 0) | (ids >= 200)] = 0
            _dirty(ids.numel(), id_dtype)
            out = remap(ids.to(id_dtype))
            with pytest.raises(ValueError, match=first):
                ops.check_errors("cpu")
            assert out.dtype == id_dtype and torch.equal(out.long(), want), name
    table = torch.arange(1, 13, dtype=torch.float32).reshape(4, 3)
    ids = torch.tensor([2, 9, 0, -1, 3], dtype=id_dtype)
    for out_dtype in (None, torch.bfloat16):
        want = table[[2, 0, 0, 0, 3]].to(out_dtype or table.dtype)
        want[[1, 3]] = 0
        _dirty(15, out_dtype or table.dtype)
        out = O.gather_rows(table, ids, out_dtype)
        with pytest.raises(IndexError, match=r"gather_rows: ids\[1\] = 9 is out of range"):
            ops.check_errors("cpu")
        assert torch.equal(out, want), out_dtype
