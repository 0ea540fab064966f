"""The fused GELU backward + FP8 cast operator ``dept_mega::dgelu_cast_fp8``
(``parallel/fp8_casts.py``; kernels in ``csrc/cpu/dgelu_cast_cpu.cpp``, ``csrc/cuda/dgelu_cast.cu``)
against the reference: ``aten.gelu_backward(grad, x)`` in torch, then ``fp8._cast_math`` of it with
the same scale, under the rule of ``test_fp8_fused_op.py``.

* dh: equal to ``gelu_backward``'s except where the fp32 formula's result is ambiguous (within
  its rounding error of the exact value, float64, another bf16/fp16 value is possible: another
  erf or exp); there dh lies in that interval, and the fraction of differing elements is bounded
  by what was measured.
* q / q_t: exactly ``_cast_math`` of the kernel's own dh (the cast part has no ambiguity); against
  the reference's bytes: within the FP8 values of the interval, the fraction bounded.

Measured on the CPU (torch 2.13, x86; maxima over the cases, ``_FRACTIONS``): all in GELU's negative
tail, where ``cdf + x * pdf`` cancels (PyTorch's vectorised CPU erf / exp against glibc's erff /
expf): dh bf16 6.3e-2 (1 of the 16 values of the one-row case), fp16 6.5e-3; bytes (±0 counted
equal) e4m3 2.7e-3, e5m2 1.3e-2 (bf16, scale 2^14: e5m2's subnormals). On CUDA PyTorch's kernel has
the formula and CUDA's erff / expf: equal expected, a few one-rounding differences allowed
(``tests/fp8_compare.py``'s ``Rule``, checked here with stand-in kernels).

The CUDA kernel runs here through the host emulation of CUDA (``tools/cuda_emu.py``): with the host's
arithmetic (no FMA, glibc) its bytes, dh and amax equal the CPU kernel's bit for bit, in each of its
paths (vectorised and scalar, every layout, both formats and dtypes). On a GPU the kernel itself
is checked by ``test_fp8_fused_op.py::test_cuda_dgelu_cast_matches_the_reference`` (that file's
gpu tests run where the extension is built).
"""
from __future__ import annotations

from itertools import product

import pytest
import torch

from dept_mega.parallel import fp8_casts
from dept_mega.parallel.fp8 import E4M3, E5M2, _cast_math
from tests.ops_utils import emulation
from tests.fp8_compare import (GPU_DIFFER, Rule, _check_amax, _check_differing, _check_layouts, _differences,
                               _gpu_rule, _interval, _move_ambiguous, _neighbour_bytes, _ordinal)
from tests.test_fp8_fused_op import IDS, LAYOUTS, PAIRS, _at, _cast_bad_args
from tools import cuda_emu

_WHY = fp8_casts.op_unavailable("cpu")
needs_op = pytest.mark.skipif(_WHY is not None, reason=f"the fused cast operators are unavailable: {_WHY}")
BF16, FP16 = torch.bfloat16, torch.float16
# (rows, cols, pad): odd shapes, one row, pad rows, a tile edge that is not a multiple of 64
SHAPES = [(128, 256, 0), (37, 70, 5), (1, 16, 15), (64, 24, 0), (90, 776, 6)]
# measured maxima (the docstring), about doubled
_DH_BOUND = {BF16: 0.15, FP16: 1.5e-2}
_BYTE_BOUND = {E4M3: 8e-3, E5M2: 3e-2}


def _inputs(rows, cols, dtype, g):
    """x over GELU's negative tail, its bend and its linear part; the gradient of either sign."""
    x = (torch.randn(rows, cols, generator=g) * 3).to(dtype)
    dy = (torch.randn(rows, cols, generator=g) * 2).to(dtype)
    return dy, x


def _dgelu_exact(dy, x):
    """The GELU backward in float64 and the error bound of the fp32 formula: erf's, the products'
    and the sum's (absolute, of the cdf's scale: in the negative tail cdf + x * pdf cancels), exp's
    magnified by its argument (x^2 / 2), and the final rounding's (of the value)."""
    x64, dy64 = x.double(), dy.double()
    xpdf = x64 * torch.exp(-x64 * x64 / 2) / (2 * torch.pi) ** 0.5
    exact = dy64 * (0.5 * (1 + torch.erf(x64 / 2 ** 0.5)) + xpdf)
    err = dy64.abs() * (2.0 ** -20 + xpdf.abs() * (x64 * x64 / 2 + 4) * 2.0 ** -22) + exact.abs() * 2.0 ** -20
    return exact, err


def _check_dh(dh, ref, exact, err, rule: Rule, what, inputs=()) -> float:
    """dh equal to the reference's except inside the rounding interval of the exact value, where
    ``rule`` holds (its fraction / count of differing values, one step each); returns the
    fraction that differs."""
    assert dh.dtype == ref.dtype and dh.shape == ref.shape, what
    lo, hi = (exact - err).to(ref.dtype), (exact + err).to(ref.dtype)
    diff = dh != ref
    outside = diff & ((dh < lo) | (dh > hi))
    assert not outside.any(), (f"{what}: {int(outside.sum())} dh values outside the fp32 rounding interval: "
                               f"{_differences(outside, dh, ref, inputs)}")
    return _check_differing(dh, ref, diff, rule, what + " dh", inputs)


def _run(device, op, in_dtype, fp8, dh_rule: Rule, byte_rule: Rule, shapes=SHAPES) -> list[tuple[float, float]]:
    g = torch.Generator().manual_seed(7)
    fracs = []
    for rows, cols, pad in shapes:
        dy, x = (t.to(device) for t in _inputs(rows, cols, in_dtype, g))
        ref = torch.ops.aten.gelu_backward(dy, x)
        exact, err = _dgelu_exact(dy.cpu(), x.cpu())
        exact, err = exact.to(device), err.to(device)
        for s, (rowwise, colwise) in product((2.5, 2.0 ** 7, 2.0 ** 14), LAYOUTS):
            scale = torch.tensor([0.0, s], device=device)
            amax = torch.tensor([0.5, 0.0, 0.0], device=device)
            what = f"dgelu {in_dtype} {rows}x{cols}+{pad} {fp8} scale={s} rowwise={rowwise} colwise={colwise}"
            dh, q, q_t = op(dy, x, fp8, pad, rowwise, colwise, scale, 1, amax, 2)
            inputs = [("x", x), ("dy", dy)]
            f_dh = _check_dh(dh, ref, exact, err, dh_rule, what, inputs)
            # the cast of the kernel's own dh: exact
            own, _, _, own_amax = _cast_math(dh, scale[1], fp8, pad, True, False)
            if rowwise:
                assert torch.equal(q.view(torch.uint8), own.view(torch.uint8)), what
            if colwise:
                assert torch.equal(q_t.t().view(torch.uint8), own.view(torch.uint8)), what
            # against the reference's bytes: within the interval, rarely
            rq, _, _, ramax = _cast_math(ref, scale[1], fp8, pad, True, False)
            interval = _interval(exact, err, in_dtype, scale[1], fp8)
            nb = _neighbour_bytes(ref, scale[1], fp8, pad) if byte_rule.one_step else None
            f_q = _check_layouts(q, q_t, rq, rowwise, colwise, interval, rows, byte_rule, None, what, inputs, nb)
            # the amax recorded is the rounded dh's, maxed into the slot (the reference's: the
            # differences are in the tail, far below the amax)
            assert amax.tolist() == [0.5, 0.0, max(0.0, own_amax.item())], what
            _check_amax(own_amax.item(), ramax.item(), dh_rule, what)
            if s == 2.0 ** 7 and rowwise and fp8 == E4M3 and rows > 1:  # the saturation is exercised
                assert (q.view(torch.uint8) & 0x7F == 0x7E).any(), what
            fracs.append((f_dh, f_q))
    return fracs


@needs_op
@pytest.mark.parametrize("in_dtype,fp8", PAIRS, ids=IDS)
def test_cpu_dgelu_cast_gives_the_reference_bytes(in_dtype, fp8):
    """dgelu_cast_fp8 on the CPU: dh, both layouts' bytes, pad rows zero, odd shapes, saturation,
    e5m2's subnormals (scale 2^14), the amax slot."""
    fracs = _run("cpu", fp8_casts.dgelu_cast_fp8, in_dtype, fp8, Rule(fraction=_DH_BOUND[in_dtype]),
                 Rule(fraction=_BYTE_BOUND[fp8]))
    assert len(fracs) == len(SHAPES) * 9
    assert max(f for f, _ in fracs) > 0  # the tail's ambiguity is exercised (the checks can see a difference)


def _stand_in(moves: int, steps: int):
    """dgelu_cast_fp8 as the reference computes it (aten.gelu_backward, then _cast_math of that dh),
    with dh values moved as :func:`_move_ambiguous` says."""
    def op(dy, x, fp8, pad, rowwise, colwise, scale, si, amax, ai):
        dh = _move_ambiguous(torch.ops.aten.gelu_backward(dy, x), *_dgelu_exact(dy, x), moves, steps)
        q, q_t, _, am = _cast_math(dh, scale[si], fp8, pad, rowwise, colwise)
        if amax is not None:
            amax[ai] = torch.maximum(amax[ai], am)
        return dh, q, q_t
    return op


def test_the_gpu_rule_allows_a_few_values_one_step_off_and_no_more():
    """The rule the GPU test (test_fp8_fused_op.py::test_cuda_dgelu_cast_matches_the_reference)
    applies, here with stand-in kernels: GPU_DIFFER dh values one step off where the rounding is
    ambiguous pass (with the bytes cast from them: at most as many one FP8 step off); one more
    fails, naming the count; a value two steps off inside its interval fails, naming the element
    (index, x, dy, ours, the reference's, the steps)."""
    shapes = [(37, 70, 5), (1, 16, 15)]
    for dt, fp8 in ((BF16, E4M3), (FP16, E5M2)):
        rule = _gpu_rule(dt)
        exact = _run("cpu", _stand_in(0, 1), dt, fp8, rule, rule, shapes)
        assert max(f for f, _ in exact) == 0 and max(f for _, f in exact) == 0
        fracs = _run("cpu", _stand_in(GPU_DIFFER, 1), dt, fp8, rule, rule, shapes)
        assert {f for f, _ in fracs[:9]} == {GPU_DIFFER / (37 * 70)}  # the first shape's 9 cases: the rule saw them
        with pytest.raises(AssertionError, match=rf" dh: {GPU_DIFFER + 1} of 2590 elements differ .*: \[\d+, \d+\] x "):
            _run("cpu", _stand_in(GPU_DIFFER + 1, 1), dt, fp8, rule, rule, shapes)
        with pytest.raises(AssertionError, match=r" dh: 1 elements more than one step from the reference: "
                                                 r"\[\d+, \d+\] x -?[\d.e+-]+, dy -?[\d.e+-]+: ours .*, reference "
                                                 r".* \([+-]2 steps\)"):
            _run("cpu", _stand_in(1, 2), dt, fp8, rule, rule, shapes)


@needs_op
def test_dgelu_without_amax_or_copies():
    """No amax slot: nothing recorded; no copy asked for: dh only (None, None)."""
    dy, x = _inputs(32, 48, BF16, torch.Generator().manual_seed(1))
    scale = torch.tensor([3.0])
    dh, q, q_t = fp8_casts.dgelu_cast_fp8(dy, x, E5M2, 0, False, False, scale)
    assert q is None and q_t is None
    assert torch.equal(dh, fp8_casts.dgelu_cast_fp8(dy, x, E5M2, 0, True, False, scale)[0])


def _bad_args():
    g, x, s = torch.zeros(4, 16, dtype=BF16), torch.zeros(4, 16, dtype=BF16), torch.ones(3)
    base = dict(grad=g, x=x, dtype=E5M2, pad=0, scale=s, scale_index=0, amax_out=None, amax_index=0)
    cases = [
        (dict(grad=torch.zeros(2, 4, 16, dtype=BF16)), ValueError, "dgelu_cast_fp8: takes a 2-D tensor"),
        (dict(grad=g.float(), x=x.float()), TypeError, "bfloat16 or float16 tensor, got float32"),
        (dict(x=torch.zeros(4, 8, dtype=BF16)), ValueError, r"x must have grad's shape \[4, 16\], got \[4, 8\]"),
        (dict(x=x.half()), TypeError, r"x must have grad's dtype \(bfloat16\), got float16"),
    ]
    return [({**base, **over}, exc, msg) for over, exc, msg in cases + _cast_bad_args(s)]


@needs_op
def test_argument_errors_are_raised_in_python_as_the_operator_does(monkeypatch):
    """Each bad argument: the wrapper raises before the operator is called, with the operator's own
    exception type and message."""
    keys = ("grad", "x", "dtype", "pad")
    for a, exc, msg in _bad_args():
        with pytest.raises(exc, match=msg):
            torch.ops.dept_mega.dgelu_cast_fp8(*(a[k] for k in keys), True, False, a["scale"], a["scale_index"],
                                               a["amax_out"], a["amax_index"])
    monkeypatch.setattr(fp8_casts, "dgelu_op", lambda: pytest.fail("the operator was reached"))
    for a, exc, msg in _bad_args():
        with pytest.raises(exc, match=msg):
            fp8_casts.dgelu_cast_fp8(*(a[k] for k in keys), True, False, a["scale"], a["scale_index"],
                                     a["amax_out"], a["amax_index"])


# --- the CUDA kernel, emulated on the CPU ---------------------------------------------------------

# (rows, cols, pad, element offset of grad and x in their buffers (_at), dtype, fp8, rowwise,
#  colwise, amax slot?, the vectorised path?)
EMULATED = [
    (90, 776, 6, (0, 0), BF16, E4M3, True, True, True, True),  # pad rows, a partial column tile
    (64, 128, 0, (0, 0), BF16, E5M2, False, True, True, True),  # q_t only
    (16, 64, 0, (0, 0), FP16, E4M3, True, False, False, True),  # q only, no amax slot
    (64, 128, 0, (0, 0), BF16, E4M3, True, True, False, True),  # q_t without an amax slot (its own barrier)
    (37, 70, 5, (0, 0), FP16, E5M2, True, True, True, False),  # odd shape
    (48, 264, 0, (3, 0), BF16, E5M2, True, True, True, False),  # grad misaligned
    (48, 264, 0, (0, 1), FP16, E4M3, True, True, True, False),  # x misaligned
]


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    return cuda_emu.DgeluCast(emulation(tmp_path_factory, cuda_emu.DGELU))


@needs_op
@pytest.mark.parametrize("case", EMULATED, ids=[f"{c[0]}x{c[1]}+{c[2]}" + ("-vec" if c[-1] else "-scalar")
                                                for c in EMULATED])
def test_emulated_cuda_kernel_equals_the_cpu_kernel(emulated, case):
    """The CUDA kernel through tools/cuda_emu.py: its path is the one the case is for, and dh, the
    bytes (pad rows included) and the amax equal the CPU kernel's bit for bit (the same host
    arithmetic: the CPU kernel is checked against the reference above)."""
    rows, cols, pad, (g_at, x_at), dt, fp8, rowwise, colwise, with_amax, vec = case
    dy, x = _inputs(rows, cols, dt, torch.Generator().manual_seed(11))
    dy, x = _at(dy, g_at), _at(x, x_at)
    scale = torch.tensor([0.0, 2.0 ** 7])
    amax = torch.tensor([0.0, 0.0, 0.5]) if with_amax else None
    dh, q, q_t, took_vec = emulated(dy, x, fp8, pad, rowwise, colwise, scale, 1, amax, 2)
    assert took_vec == vec
    ramax = torch.tensor([0.0, 0.0, 0.5]) if with_amax else None
    rdh, rq, rq_t = fp8_casts.dgelu_cast_fp8(dy, x, fp8, pad, rowwise, colwise, scale, 1, ramax, 2)
    assert torch.equal(dh, rdh)
    for got, want in ((q, rq), (q_t, rq_t)):
        assert (got is None) == (want is None)
        assert got is None or torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    if with_amax:
        assert torch.equal(amax, ramax) and amax[2] > 0.5
    # and the bytes are those of the reference's dh where dh is the reference's (the tail aside)
    ref = torch.ops.aten.gelu_backward(dy, x)
    rows_ok = (dh == ref).all(1)
    if rowwise:
        want = _cast_math(ref, scale[1], fp8, pad, True, False)[0]
        assert torch.equal(_ordinal(q[:rows][rows_ok]), _ordinal(want[:rows][rows_ok]))
