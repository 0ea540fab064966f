"""remap_ids through vocabulary ranks (dept_mega.ops.VocabRanks) against the lookup path: the
same local ids and the same errors, on the CPU kernel and the PyTorch fallback, for random
vocabulary sets (and the CUDA record of a ranked error decodes to the CPU's error). The CUDA
kernel: tests/test_ops_gpu.py."""
from __future__ import annotations

import pytest
import torch

import dept_mega.ops as ops
from dept_mega.ops import VocabRanks, fallback
from tests.ops_utils import DEVICES, ID_DTYPES, gen, lazy_check, seed_of

# (vocabulary size, which members): sizes below, at and off multiples of 32
CASES = [(1, "full"), (1, "empty"), (5, "random"), (31, "random"), (32, "full"), (33, "last"),
         (64, "empty"), (100, "random"), (257, "last"), (1000, "sparse"), (4099, "random"),
         (4099, "full")]
SHAPES = [(0,), (1,), (17,), (3, 40), (2, 0, 5), "transposed"]


def _error(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the type and message are what is compared
        return type(exc), str(exc)
    return None


def _members(V: int, kind: str, g: torch.Generator) -> torch.Tensor:
    """Sorted unique ids in [0, V)."""
    if kind == "full":
        return torch.arange(V)
    if kind == "empty":
        return torch.empty(0, dtype=torch.int64)
    density = 0.05 if kind == "sparse" else 0.5
    keep = torch.rand(V, generator=g) < density
    if kind == "last":
        keep[V - 1] = True
    return keep.nonzero().flatten()


def _words_by_hand(members: list[int], V: int) -> list[int]:
    """The documented word layout, one id at a time (independent of VocabRanks.from_ids)."""
    words = []
    for w in range((V + 31) // 32):
        below = sum(1 for m in members if m < 32 * w)
        bits = sum(1 << (m - 32 * w) for m in members if 32 * w <= m < 32 * w + 32)
        words.append(below << 32 | bits)
    return words


def _tokens(shape, members, V, g) -> torch.Tensor:
    """Valid ids (members) of ``shape``; "transposed": a non-contiguous [40, 3] view."""
    if shape == "transposed":
        t = _tokens((3, 40), members, V, g)
        return None if t is None else t.t()
    n = 1
    for s in shape:
        n *= s
    if members.numel() == 0:
        return torch.empty(shape, dtype=torch.int64) if n == 0 else None
    return members[torch.randint(0, members.numel(), (n,), generator=g)].reshape(shape)


IMPLS = {  # (remap through ranks, remap through the equivalent lookup)
    "api": (lambda ids, r: ops.remap_ids(ids, r), lambda ids, lut: ops.remap_ids(ids, lut)),
    "fallback": (lambda ids, r: fallback.remap_ranked(ids, r.words, r.size),
                 lambda ids, lut: fallback.remap_ids(ids, lut)),
}


@pytest.mark.parametrize("V,kind", CASES)
@pytest.mark.parametrize("id_dtype", ID_DTYPES)
def test_ranked_remap_equals_the_lookup_path(V, kind, id_dtype):
    g = gen(seed_of("ranks", V, kind, id_dtype))
    members = _members(V, kind, g)
    ranks = VocabRanks.from_ids(members.to(id_dtype), V)
    lookup = torch.full((V,), -1, dtype=torch.int64)  # TRIM's lookup: position in V_k, -1 elsewhere
    lookup[members] = torch.arange(members.numel())
    assert ranks.words.tolist() == _words_by_hand(members.tolist(), V)
    assert torch.equal(ranks.to_lookup(), lookup)
    non_members = (lookup < 0).nonzero().flatten()

    for shape in SHAPES:
        toks = _tokens(shape, members, V, g)
        if toks is None:  # no member to draw from: every id is an error (below)
            continue
        ids = toks.to(id_dtype)
        expect = lookup[ids.long()].to(id_dtype)
        for name, (ranked, looked_up) in IMPLS.items():
            for out in (ranked(ids, ranks), looked_up(ids, lookup)):
                assert out.dtype == id_dtype and out.shape == ids.shape and out.is_contiguous()
                assert torch.equal(out, expect), (name, shape)

    # errors: the first invalid id in row-major order, out of range or not a member, with a
    # second invalid id after it; every path raises the lookup path's exact error
    base = _tokens((3, 40), members, V, g)
    bads = [V, -1, V + 40] + ([int(non_members[torch.randint(0, non_members.numel(), (1,), generator=g)])]
                              if non_members.numel() else [])
    for bad in bads:
        ids = base.clone() if base is not None else non_members[torch.arange(120) % non_members.numel()].view(3, 40)
        pos = int(torch.randint(0, 100, (1,), generator=g))
        ids.view(-1)[pos] = bad
        ids.view(-1)[pos + 7] = V + 3
        ids = ids.to(id_dtype)
        first = 0 if base is None else pos
        gid = int(ids.view(-1)[first])
        if 0 <= gid < V:
            want = (ValueError, f"remap_ids: global id {gid} (first at flat position {first}) is not in "
                                f"this source's vocabulary (lookup[{gid}] = -1)")
        else:
            want = (IndexError, f"remap_ids: global id {gid} at flat position {first} is out of range "
                                f"for a lookup of {V} entries")
        for name, (ranked, looked_up) in IMPLS.items():
            assert _error(lambda: ranked(ids, ranks)) == want, (name, bad)
            assert _error(lambda: looked_up(ids, lookup)) == want, (name, bad)
        # the CUDA kernel's record of that error (code 5 with value -1, or code 4) decodes to it
        code, value = (5, -1) if want[0] is ValueError else (4, 0)
        assert _error(lambda: (_ for _ in ()).throw(ops.recorded_error([code, first, gid, V, value]))) == want


def _outcome(call, device: torch.device):
    """(the result, None) or (None, (type, message)) of a remap on ``device``: a CUDA kernel's
    invalid id raises at the next check_errors (run here), a CPU kernel's at the call (no check:
    a CPU call that does not raise at once has no error)."""
    try:
        out = call()
        lazy_check(device)
    except Exception as exc:  # noqa: BLE001 - the type and message are what is compared
        return None, (type(exc), str(exc))
    return out, None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("id_dtype", ID_DTYPES)
def test_compiled_ranked_remap_equals_the_cpu_lookup_path(device, id_dtype):
    """The compiled ranked remap on ``device`` (on CUDA, csrc/cuda/remap_ranked.cu, each memory
    path: the words staged in shared memory, read from global memory, the launcher's choice)
    against the CPU lookup path, on the vocabulary cases above and the 1B model's 50,257 (a
    partial last word; 1,571 words, not a multiple of the block's threads): every member in
    order (bit 0 and bit 31 of each full word), random members (a non-contiguous view, an empty
    shape), and one invalid id among valid ones, then a second one: a non-member, ids of the last
    word past the size, the size, the first id past the words, -1 and the dtype's extremes."""
    dev = torch.device(device)
    if ops.backend(dev) == "torch":
        pytest.skip(f"no compiled kernels for {device}: {ops.extension_status().reason}")
    stages = (-1, 0, 1) if dev.type == "cuda" else (-1,)  # the CPU kernel ignores the stage
    info = torch.iinfo(id_dtype)
    g = gen(seed_of("ranks on a device", device, id_dtype))
    ops.check_errors(dev)  # nothing left from an earlier test
    for V, kind in CASES + [(50_257, "random")]:
        members = _members(V, kind, g)
        ranks = VocabRanks.from_ids(members, V)
        ranks_dev, lookup = ranks.to(dev), ranks.to_lookup()
        non_members = (lookup < 0).nonzero().flatten()
        span = 32 * ((V + 31) // 32)  # the ids the words cover
        valid = [torch.empty(2, 0, 5, dtype=torch.int64)]
        if members.numel():
            drawn = members[torch.randint(0, members.numel(), (4800,), generator=g)]
            valid += [members, drawn, drawn.view(40, 120).t()]
        base = drawn if members.numel() else non_members[torch.arange(4800) % non_members.numel()]
        bads = [V, V + 1, span - 1, span, -1, info.min, info.max]
        if non_members.numel():
            bads.append(int(non_members[torch.randint(0, non_members.numel(), (1,), generator=g)]))
        invalid = []
        for bad in bads:
            ids = base.clone()
            pos = int(torch.randint(0, 4790, (1,), generator=g))
            ids[pos], ids[pos + 7] = bad, V + 3
            invalid.append(ids)
        for ids in valid + invalid:
            ids = ids.to(id_dtype)
            want, want_err = _outcome(lambda: ops.remap_ids(ids, lookup), torch.device("cpu"))
            for stage in stages:
                got, err = _outcome(lambda: ops._remap_ranked(ids.to(dev), ranks_dev, stage), dev)
                assert err == want_err, (V, kind, stage)
                if want is not None:
                    assert got.device == dev and got.dtype == id_dtype and got.is_contiguous()
                    assert got.shape == ids.shape and torch.equal(got.cpu(), want), (V, kind, stage)


def test_vocab_ranks_constructor_errors():
    ok = torch.tensor([1, 4, 7])
    cases = [
        (lambda: VocabRanks.from_ids(torch.tensor([1, 7, 4]), 10),
         (ValueError, "VocabRanks: ids must be sorted ascending: ids[1] = 7 > ids[2] = 4")),
        (lambda: VocabRanks.from_ids(torch.tensor([1, 4, 4, 6]), 10),
         (ValueError, "VocabRanks: ids must be unique: ids[2] = 4 repeats ids[1]")),
        (lambda: VocabRanks.from_ids(torch.tensor([1, 4, 10]), 10),
         (ValueError, "VocabRanks: ids[2] = 10 is out of range for a vocabulary of 10 ids")),
        (lambda: VocabRanks.from_ids(torch.tensor([-2, 4]), 10),
         (ValueError, "VocabRanks: ids[0] = -2 is out of range for a vocabulary of 10 ids")),
        (lambda: VocabRanks.from_ids(ok.view(1, 3), 10), (ValueError, "VocabRanks: ids must be a 1-D tensor, got [1, 3]")),
        (lambda: VocabRanks.from_ids(ok.float(), 10), (TypeError, "VocabRanks: ids must be int32 or int64, got float32")),
        (lambda: VocabRanks.from_ids(ok, -1), (ValueError, "VocabRanks: the vocabulary size must be in [0, 2^31), got -1")),
        (lambda: VocabRanks(torch.zeros(2, dtype=torch.int64), 10),
         (ValueError, "remap_ids: ranks words must have shape [1] for a vocabulary of 10 ids, got [2]")),
        (lambda: VocabRanks(torch.zeros(1, dtype=torch.int32), 10),
         (TypeError, "remap_ids: ranks words must be int64, got int32")),
    ]
    for call, want in cases:
        assert _error(call) == want
    assert VocabRanks.from_ids(torch.empty(0, dtype=torch.int32), 0).words.numel() == 0


def test_ranked_operator_arguments_match_the_fallback():
    """The C++ operator's argument checks raise what the fallback raises (CPU; the CUDA path
    runs the fallback's checks first, dept_mega.ops._remap_ranked)."""
    if ops.backend("cpu") != "cpp":
        pytest.skip(f"no compiled extension: {ops.extension_status().reason}")
    r = VocabRanks.from_ids(torch.tensor([0, 3, 40]), 50)
    op = torch.ops.dept_mega.remap_ranked
    cases = [(torch.tensor([3]), r.words, 50, 2), (torch.tensor([3.0]), r.words, 50, -1),
             (torch.tensor([3]), r.words[:1], 50, -1), (torch.tensor([3]), r.words.int(), 50, -1),
             (torch.tensor([3]), r.words, 2 ** 31, -1)]
    for args in cases:
        want = _error(lambda: fallback.check_remap_ranked_args(*args))
        assert want is not None and _error(lambda: op(*args)) == want, args
    for stage in (-1, 0, 1):  # CUDA's choice of memory: no effect on CPU
        assert op(torch.tensor([[40, 0], [3, 40]]), r.words, 50, stage).tolist() == [[2, 0], [1, 2]]
    meta_ids = torch.zeros(2, dtype=torch.long, device="meta")
    assert _error(lambda: ops.remap_ids(meta_ids, r)) == (
        ValueError, "remap_ids: ids is on meta but ranks is on cpu")
    assert ops.remap_ids(meta_ids, r.to("meta")).shape == (2,)
    torch.library.opcheck(op.default, (torch.tensor([[40, 0], [3, 40]]), r.words, 50, -1))

    def step(tokens):
        return ops.remap_ids(tokens, r) * 2
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    toks = torch.tensor([[0, 40, 3]])
    assert torch.equal(compiled(toks), step(toks))


def test_an_extension_without_the_ranked_operator_is_not_used(monkeypatch):
    """An extension built from an older source (no remap_ranked) is reported and left for the
    fallback, rather than failing at the first ranked remap."""
    from dept_mega.ops import loader
    if ops.backend("cpu") != "cpp":
        pytest.skip(f"no compiled extension: {ops.extension_status().reason}")
    assert loader._load().loaded
    real = loader._has_kernel
    monkeypatch.setattr(loader, "_has_kernel", lambda op, key: op != "dept_mega::remap_ranked" and real(op, key))
    st = loader._load()
    assert not st.loaded and "older than this source (no remap_ranked operator)" in st.reason
