"""The fused prologues of the C++ FP8 cast operators (``parallel/fp8_casts.py``; kernels in
``csrc/cpu/ops_cpu.cpp``, ``csrc/cuda/fp8_cast.cu``, ``csrc/cuda/layernorm_cast.cu``):
``cast_fp8(..., gelu=True)`` and ``layernorm_cast_fp8``, against the reference, ``F.gelu`` /
``F.layer_norm`` in torch and then ``fp8._cast_math`` with the same scale (and, on the GPU,
``dgelu_cast_fp8``'s CUDA kernel: its CPU checks are ``test_fp8_dgelu_op.py``'s).

Bytes: equal, except where the intermediate (GELU or LayerNorm in fp32, rounded to bf16/fp16)
is ambiguous: where an fp32 computation within the formula's rounding error of the exact value
(float64) can round to another bf16/fp16 value (another erf, rsqrt or summation order). There the
byte may differ, but only within the FP8 values of that interval (``_interval``; LayerNorm: also
at most one FP8 step where that interval is one step wide), and the fraction of differing bytes is bounded by what was measured.
Everywhere else the intermediate is PyTorch's, and the bytes are equal.

Measured on the CPU (torch 2.13, x86; fractions of the bytes, maxima over the cases):
LayerNorm at most 6.1e-5 (bf16, e4m3; 0 elsewhere). Rows whose mean (1000 to 2000) is large next
to their spread (1 to 4): no bound on the fraction, the interval and the one-step rule are the check
there: bf16 values at 1000 to 2000 are 8 apart, a row holds a few distinct values, and where the
mean's rounding moves one across a boundary all its elements' bytes differ (measured up to 1.6e-2
on the CPU, depending on the seed). GELU: e4m3 8.9e-4, e5m2 9.8e-3 (bf16,
current scaling): all in the negative tail, where ``1 + erf(x)`` cancels and the fp32 formula's
error (an ulp of erf, ~6e-8) is a few per cent of GELU's value or all of it; PyTorch's
vectorised CPU erf and glibc's erff differ there, and the scaled values fall on e5m2's
subnormals. On CUDA PyTorch's GELU is the kernel's formula with CUDA's erff: equal bytes expected,
and a few one-rounding differences allowed (``tests/fp8_compare.py``'s ``Rule``, checked here with
stand-in kernels).
"""
from __future__ import annotations

import dataclasses
from itertools import product

import pytest
import torch
import torch.nn.functional as F

from dept_mega.parallel import fp8_casts
from dept_mega.parallel.fp8 import E4M3, E5M2, _cast_math
from dept_mega.parallel.fp8_recipe import FP8_MAX
from tests.fp8_compare import (GPU_DIFFER, Rule, _check_amax, _check_layouts, _gpu_rule, _interval, _move_ambiguous,
                               _neighbour_bytes, _ordinal, _step)
from tests.trainer_utils import gpu_test_device

_WHY = fp8_casts.op_unavailable("cpu")
needs_op = pytest.mark.skipif(_WHY is not None, reason=f"the fused cast operators are unavailable: {_WHY}")
LAYOUTS = [(True, False), (False, True), (True, True)]
PAIRS = list(product((torch.bfloat16, torch.float16), (E4M3, E5M2)))
IDS = [f"{str(a)[6:]}-{str(b)[6:]}" for a, b in PAIRS]


def _scale_used(s, ramax, fp8):
    """The scale _cast_math used: the delayed one, or current scaling's from the amax."""
    return s if s is not None else FP8_MAX[fp8] / ramax.clamp(min=1e-12)


# --- GELU -------------------------------------------------------------------------------------

def _gelu_inputs(in_dtype, g):
    """(rows, cols, pad, x): odd shapes, one row, and a training-like one, values over a range
    where GELU's negative tail, its bend and its linear part all occur."""
    out = []
    for rows, cols, pad in [(256, 512, 0), (37, 70, 5), (1, 16, 15), (64, 24, 0)]:
        x = (torch.randn(rows, cols, generator=g) * 3).to(in_dtype)
        out.append((rows, cols, pad, x))
    return out


def _gelu_exact(x: torch.Tensor):
    """GELU in float64 and the error bound of the fp32 formula: erf's (a few ulp of 1, times
    |x| / 2: in the negative tail 1 + erf(x) cancels, and this is most of GELU's value there) and
    the products' (of the value)."""
    x64 = x.double()
    exact = x64 * 0.5 * (1 + torch.erf(x64 / 2 ** 0.5))
    return exact, x64.abs() * 2.0 ** -21 + exact.abs() * 2.0 ** -20


def _run_gelu(device, cast, in_dtype, fp8, rule: Rule) -> list[float]:
    g = torch.Generator().manual_seed(1)
    fracs = []
    for rows, cols, pad, x in _gelu_inputs(in_dtype, g):
        x = x.to(device)
        u = F.gelu(x)
        exact, err = _gelu_exact(x)
        for s, (rowwise, colwise) in product((None, 2.5, 2.0 ** 7), LAYOUTS):
            scale = None if s is None else torch.tensor([0.0, s], device=device)
            rq, _, rinv, ramax = _cast_math(u, None if s is None else scale[1], fp8, pad, True, False)
            amax = torch.tensor([0.5, 0.0, 0.0], device=device)
            q, q_t, inv = cast(x, fp8, pad, rowwise, colwise, scale, 1, amax, 2, gelu=True)
            what = f"gelu {x.dtype} {rows}x{cols}+{pad} {fp8} scale={s} rowwise={rowwise} colwise={colwise}"
            used = _scale_used(None if s is None else scale[1], ramax, fp8)
            interval = _interval(exact, err, x.dtype, used, fp8)
            nb = _neighbour_bytes(u, used, fp8, pad) if rule.one_step else None
            fracs.append(_check_layouts(q, q_t, rq, rowwise, colwise, interval, rows, rule, None, what, [("x", x)],
                                        nb))
            # the amax recorded is that of the rounded GELU values, maxed into the slot
            assert amax[:2].tolist() == [0.5, 0.0], what
            _check_amax(amax[2].item(), max(0.0, ramax.item()), rule, what)
            if s is None:
                assert inv is not None, what
                _check_amax(inv.item(), rinv.item(), rule, f"{what}: 1/scale")
            else:
                assert inv is None, what
            if s == 2.0 ** 7 and rowwise and fp8 == E4M3 and rows > 1:  # the saturation is exercised
                assert (q.view(torch.uint8) & 0x7F == 0x7E).any(), what
    return fracs


def _gelu_stand_in(moves: int, steps: int):
    """cast_fp8(gelu=True) as the reference computes it (F.gelu, then _cast_math), with GELU values
    moved as :func:`_move_ambiguous` says, only where the bytes can tell: the moved value's byte
    is not the reference's (nor, ``steps`` > 1, a one-step neighbour's)."""
    def cast(x, fp8, pad, rowwise, colwise, scale, si, amax, ai, gelu):
        assert gelu
        u = F.gelu(x)
        exact, err = _gelu_exact(x)
        s = None if scale is None else scale[si]
        used = _scale_used(s, _cast_math(u, s, fp8, 0, True, False)[3], fp8)

        def visible(moved, sign):
            byte = _ordinal(_cast_math(moved, used, fp8, 0, True, False)[0])
            return torch.stack([byte != _ordinal(_cast_math(_step(u, k), used, fp8, 0, True, False)[0])
                                for k in ((-1, 0, 1) if steps > 1 else (0,))]).all(0)
        u = _move_ambiguous(u, exact, err, moves, steps, visible)
        q, q_t, inv, am = _cast_math(u, s, fp8, pad, rowwise, colwise)
        amax[ai] = torch.maximum(amax[ai], am)
        return q, q_t, (inv if s is None else None)
    return cast


def test_the_gpu_rule_allows_a_few_bytes_one_rounding_off_and_no_more():
    """The rule test_cuda_fused_operators_match_the_reference applies to the GELU cast on the GPU,
    here with stand-in kernels: GPU_DIFFER GELU values one step off where their rounding is
    ambiguous pass (their bytes: the adjacent FP8 code, or further where a scaled fp16 subnormal
    step is coarser than FP8's); one more fails, naming the count; a GELU value two steps off
    whose byte is no one-step neighbour's fails, naming the element (index, x, ours, the
    reference's); an amax two roundings off fails."""
    for in_dtype, fp8 in PAIRS:
        rule = _gpu_rule(in_dtype)
        assert max(_run_gelu("cpu", _gelu_stand_in(0, 1), in_dtype, fp8, rule)) == 0
        assert max(_run_gelu("cpu", _gelu_stand_in(GPU_DIFFER, 1), in_dtype, fp8, rule)) > 0
        with pytest.raises(AssertionError, match=rf": {GPU_DIFFER + 1} of \d+ elements differ .*: \[\d+, \d+\] x "):
            _run_gelu("cpu", _gelu_stand_in(GPU_DIFFER + 1, 1), in_dtype, fp8, rule)
        with pytest.raises(AssertionError, match=r": \d+ elements more than one step from the reference's intermediate: "
                                                 r"\[\d+, \d+\] x -?[\d.e+-]+: ours .*, reference .* steps\)"):
            _run_gelu("cpu", _gelu_stand_in(1, 2), in_dtype, fp8, rule)
        # the amax: within one rounding of the input dtype, no more
        _check_amax(1.0 + rule.amax_rtol, 1.0, rule, "amax")
        with pytest.raises(AssertionError, match="amax: amax 1.0"):
            _check_amax(1.0 + 2 * rule.amax_rtol, 1.0, rule, "amax")


# measured maxima over the cases (see the docstring): e4m3 8.9e-4, e5m2 9.8e-3 (bf16, current scaling)
_GELU_BOUND = {E4M3: 2e-3, E5M2: 2e-2}


@needs_op
@pytest.mark.parametrize("in_dtype,fp8", PAIRS, ids=IDS)
def test_cpu_gelu_cast_gives_the_reference_bytes(in_dtype, fp8):
    """cast_fp8(gelu=True) on the CPU: both scalings (current: the amax and 1/scale of GELU(x)),
    every layout, pad rows, odd shapes, saturation, the amax slot."""
    fracs = _run_gelu("cpu", fp8_casts.cast_fp8, in_dtype, fp8, Rule(fraction=_GELU_BOUND[fp8]))
    assert len(fracs) == 36


@needs_op
def test_gelu_false_is_the_plain_cast():
    """gelu=False (the default) is the cast of x itself; gelu=True is not."""
    x = (torch.randn(48, 40, generator=torch.Generator().manual_seed(2)) * 3).to(torch.bfloat16)
    plain = fp8_casts.cast_fp8(x, E4M3)[0].view(torch.uint8)
    assert torch.equal(plain, _cast_math(x, None, E4M3, 0, True, False)[0].view(torch.uint8))
    assert torch.equal(plain, fp8_casts.cast_fp8(x, E4M3, gelu=False)[0].view(torch.uint8))
    assert not torch.equal(plain, fp8_casts.cast_fp8(x, E4M3, gelu=True)[0].view(torch.uint8))


# --- LayerNorm --------------------------------------------------------------------------------

def _ln_input(rows, cols, in_dtype, g, offset=0.0):
    """Rows with their own offsets and spreads (a nonzero mean), one constant row (variance 0);
    ``offset``: rows with means between offset and 2 * offset and spreads 1 to 4 (a mean large
    next to the spread: the statistics must not cancel, as a sum of squares would)."""
    if offset:  # spreads 1 to 4
        x = torch.randn(rows, cols, generator=g) * (1 + 3 * torch.rand(rows, 1, generator=g))
        x = x + offset * (1 + torch.rand(rows, 1, generator=g))
    else:
        x = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g) * 4
        x = x + torch.randn(rows, 1, generator=g) * 3
    if rows > 2:
        x[2] = 1.5
    return x.to(in_dtype)


def _at(t: torch.Tensor, at: int) -> torch.Tensor:
    """``t`` (contiguous) copied ``at`` elements into a buffer: ``at`` not a multiple of 8 gives
    a contiguous tensor whose address is not 16-byte aligned (the kernels' scalar loads)."""
    if not at:
        return t
    buf = torch.empty(t.numel() + at, dtype=t.dtype, device=t.device)
    out = buf[at:].view(t.shape)
    out.copy_(t)
    return out


def _ln_exact(x, w, b, eps):
    """LayerNorm in float64 and the error bound of an fp32 computation."""
    x64, w64 = x.double(), w.double()
    mean = x64.mean(1, keepdim=True)
    var = x64.var(1, unbiased=False, keepdim=True)
    rstd = (var + eps).rsqrt()
    exact = (x64 - mean) * rstd * w64 + (0 if b is None else b.double())
    # fp32 statistics (summation order, rsqrt) and the fp32 products: relative errors of ~2^-20
    # of the terms
    scale = rstd * w64.abs() * ((x64 - mean).abs() + mean.abs() + var.sqrt())
    return exact, scale * 2.0 ** -18 + exact.abs() * 2.0 ** -20


def _native_layer_norm(x, w, b, eps):
    """torch.native_layer_norm; where the device takes no fp32 weight with a bf16/fp16 input, the
    same fp32 LayerNorm on x in fp32, rounded to x's dtype (the statistics are fp32 there)."""
    try:
        return torch.native_layer_norm(x, (x.shape[1],), w, b, eps)
    except RuntimeError:
        y, mean, rstd = torch.native_layer_norm(x.float(), (x.shape[1],), w.float(),
                                                None if b is None else b.float(), eps)
        return y.to(x.dtype), mean, rstd


def _ln_case(shape):
    """A shape of the LayerNorm tests, ``(rows, cols, pad[, offset[, (x_at, w_at)]])``, with its
    defaults: ``offset`` of the rows' means (:func:`_ln_input`) 0; ``x_at`` / ``w_at``, the
    element offsets of x and of weight and bias in their buffers (:func:`_at`), 0."""
    rows, cols, pad, *rest = shape
    offset = rest[0] if rest else 0.0
    x_at, w_at = rest[1] if len(rest) > 1 else (0, 0)
    return rows, cols, pad, offset, x_at, w_at


def _run_layernorm(device, in_dtype, fp8, rule: Rule, shapes) -> list[float]:
    g = torch.Generator().manual_seed(3)
    fracs = []
    eps = 1e-5
    for shape in shapes:
        rows, cols, pad, offset, x_at, w_at = _ln_case(shape)
        x = _at(_ln_input(rows, cols, in_dtype, g, offset).to(device), x_at)
        for w_dtype, with_bias in product((in_dtype, torch.float32), (True, False)):
            w = _at((1 + 0.5 * torch.randn(cols, generator=g)).to(w_dtype).to(device), w_at)
            b = _at((0.3 * torch.randn(cols, generator=g)).to(w_dtype).to(device), w_at) if with_bias else None
            y, rmean, rrstd = _native_layer_norm(x, w, b, eps)
            exact, err = _ln_exact(x, w, b, eps)
            if x.is_cuda:
                # a constant row's LayerNorm is the bias, exactly, and our CUDA kernel (x - mean
                # first) gives it; torch's CUDA kernel leaves its mean off there (Welford merges),
                # which rstd = 1/sqrt(eps) magnifies (an H200, 776 columns: 0.0098 for 0), so the
                # exact value is that row's reference. (On the CPU ours and torch's agree.)
                constant = x.double().var(1, unbiased=False) == 0
                y = torch.where(constant[:, None], exact.to(y.dtype), y)
            # a large mean: no fraction (the docstring)
            case_rule = Rule(fraction=1.0, amax_rtol=rule.amax_rtol) if offset else rule
            for s, (rowwise, colwise) in product((2.5, 2.0 ** 8), LAYOUTS):
                scale = torch.tensor([0.0, s], device=device)
                rq, _, _, ramax = _cast_math(y, scale[1], fp8, pad, True, False)
                amax = torch.tensor([0.0, 0.0, 0.5], device=device)
                q, q_t, mean, rstd = fp8_casts.layernorm_cast_fp8(x, w, b, eps, fp8, pad, rowwise, colwise,
                                                                  scale, 1, amax, 2)
                what = (f"layernorm {x.dtype} w {w_dtype} bias {with_bias} {rows}x{cols}+{pad} {fp8} "
                        f"scale={s} rowwise={rowwise} colwise={colwise}")
                interval = _interval(exact, err, x.dtype, scale[1], fp8)
                fracs.append(_check_layouts(q, q_t, rq, rowwise, colwise, interval, rows, case_rule, 1, what,
                                            [("x", x)]))
                assert amax[:2].tolist() == [0.0, 0.0], what
                _check_amax(amax[2].item(), max(0.5, ramax.item()), rule, what)
                # mean / rstd: native_layer_norm's form on this device, its values up to a rounding
                for got, ref in ((mean, rmean), (rstd, rrstd)):
                    assert got.dtype == ref.dtype and got.shape == ref.shape, f"{what}: {got.dtype} {got.shape}"
                    torch.testing.assert_close(got.float(), ref.float(), rtol=2 ** -7, atol=1e-6, msg=what)
                if s == 2.0 ** 8 and rowwise and fp8 == E4M3 and cols >= 64:
                    assert (q.view(torch.uint8) & 0x7F == 0x7E).any(), f"{what}: no saturation"
        # the backward takes the statistics (with the reference's y)
        gy = torch.randn_like(x)
        w = torch.ones(cols, dtype=in_dtype, device=device)
        _, _, mean, rstd = fp8_casts.layernorm_cast_fp8(x, w, None, eps, fp8, 0, True, False,
                                                        torch.ones(1, device=device))
        dx, _, _ = torch.ops.aten.native_layer_norm_backward(gy, x, (cols,), mean, rstd, w, None,
                                                             [True, True, False])
        rdx, _, _ = torch.ops.aten.native_layer_norm_backward(gy, x, (cols,), *torch.native_layer_norm(
            x, (cols,), w, None, eps)[1:], w, None, [True, True, False])
        torch.testing.assert_close(dx.float(), rdx.float(), rtol=2 ** -6, atol=2 ** -6)
    return fracs


# the last: rows with a large mean (numerics of the statistics: a sum of squares would cancel)
_LN_SHAPES = [(64, 256, 0), (37, 70, 5), (1, 16, 15), (40, 1, 0), (64, 256, 0, 1000.0)]
# the CUDA kernel's paths (layernorm_cast.cu): vectorised (16-byte aligned x, cols % 8 == 0,
# rows + pad % 16 == 0) at the 1B model's width, with pad rows in the last block, with 776
# columns (lane 0 merges 4 chunks of 8, the others 3: the unrolled loop, its tail and merges of
# unequal counts), with a large mean, with weight / bias one element off 16-byte alignment (their
# scalar loads); scalar: x 3 elements off alignment (and the odd shapes above)
_LN_GPU_SHAPES = _LN_SHAPES + [(2048, 2048, 0), (1000, 1024, 24), (90, 776, 6), (256, 2048, 0, 1000.0),
                               (48, 264, 0, 0.0, (0, 1)), (64, 512, 0, 0.0, (3, 0))]


@needs_op
@pytest.mark.parametrize("in_dtype,fp8", PAIRS, ids=IDS)
def test_cpu_layernorm_cast_gives_the_reference_bytes(in_dtype, fp8):
    """layernorm_cast_fp8 on the CPU: weight in x's dtype and fp32, bias None or not, odd shapes
    (one column: every y is the bias), pad rows (zero FP8, not the LayerNorm of a zero row), a
    constant row, saturation, every layout, the amax slot, mean / rstd as native_layer_norm's."""
    fracs = _run_layernorm("cpu", in_dtype, fp8, Rule(fraction=2e-4), _LN_SHAPES)  # measured: at most 6.1e-5
    assert len(fracs) == len(_LN_SHAPES) * 4 * 6


# --- arguments, stale builds ------------------------------------------------------------------

def _cast_bad_args(s):
    """The bad arguments of the FP8 output that the fused operators share (delayed scale ``s``, 3
    elements, required): (override, exception, message)."""
    return [
        (dict(scale=None), ValueError, "needs a delayed scale"),
        (dict(dtype=torch.float16), TypeError, "float8_e4m3fn or float8_e5m2, got float16"),
        (dict(pad=-1), ValueError, "pad must be >= 0"),
        (dict(scale_index=3), ValueError, "scale index 3 is out of range for 3 elements"),
        (dict(scale=s.double()), TypeError, "scale must be float32"),
        (dict(amax_out=torch.ones(4, 2).t()), ValueError, "amax_out must be contiguous"),
    ]


def _ln_bad_args():
    x = torch.zeros(4, 16, dtype=torch.bfloat16)
    w, s = torch.ones(16), torch.ones(3)
    base = dict(x=x, weight=w, bias=None, dtype=E4M3, pad=0, scale=s, scale_index=0, amax_out=None, amax_index=0)
    cases = [
        (dict(x=torch.zeros(2, 4, 16, dtype=torch.bfloat16)), ValueError, "layernorm_cast_fp8: takes a 2-D tensor"),
        (dict(x=x.float()), TypeError, "bfloat16 or float16 tensor, got float32"),
        (dict(x=x[:, :0]), ValueError, "at least one column"),
        (dict(weight=torch.ones(15)), ValueError, r"weight must have shape \[16\], got \[15\]"),
        (dict(weight=torch.ones(16, dtype=torch.float64)), TypeError, "weight must be float32 or the input's dtype"),
        (dict(bias=torch.ones(16, dtype=torch.bfloat16)), TypeError, r"bias must have weight's dtype \(float32\)"),
        (dict(bias=torch.ones(2, 8)), ValueError, r"bias must have shape \[16\]"),
    ]
    return [({**base, **over}, exc, msg) for over, exc, msg in cases + _cast_bad_args(s)]


@needs_op
def test_layernorm_argument_errors_are_raised_in_python_as_the_operator_does(monkeypatch):
    """Each bad argument: the wrapper raises before the operator is called (a C++ throw from a CUDA
    op once crashed the process), with the operator's own exception type and message."""
    for a, exc, msg in _ln_bad_args():
        with pytest.raises(exc, match=msg):
            torch.ops.dept_mega.layernorm_cast_fp8(a["x"], a["weight"], a["bias"], 1e-5, a["dtype"], a["pad"],
                                                   True, False, a["scale"], a["scale_index"], a["amax_out"],
                                                   a["amax_index"])
    monkeypatch.setattr(fp8_casts, "layernorm_op", lambda: pytest.fail("the operator was reached"))
    for a, exc, msg in _ln_bad_args():
        with pytest.raises(exc, match=msg):
            fp8_casts.layernorm_cast_fp8(a["x"], a["weight"], a["bias"], 1e-5, a["dtype"], a["pad"], True, False,
                                         a["scale"], a["scale_index"], a["amax_out"], a["amax_index"])


@needs_op
def test_a_build_without_the_fused_operators_is_refused(monkeypatch):
    """op_unavailable names what an extension built from an older csrc/ lacks: an argument of
    cast_fp8's schema (gelu) or an operator (layernorm_cast_fp8), so fp8_casts: cuda is refused."""
    from dept_mega.ops import loader
    assert fp8_casts.op_unavailable("cpu") is None
    assert loader.kernel_missing("dept_mega::cast_fp8", "cpu", args=("gelu",)) is None
    monkeypatch.setitem(fp8_casts.OPS, "dept_mega::cast_fp8", ("gelu", "newer_arg"))
    why = fp8_casts.op_unavailable("cpu")
    assert why is not None and "older than this source" in why and "newer_arg" in why
    monkeypatch.setitem(fp8_casts.OPS, "dept_mega::cast_fp8", ("gelu",))
    monkeypatch.setitem(fp8_casts.OPS, "dept_mega::layernorm_cast_fp9", ())
    why = fp8_casts.op_unavailable("cpu")
    assert why is not None and "layernorm_cast_fp9" in why
    with pytest.raises(ValueError, match="cannot run on cpu"):
        fp8_casts.resolve_cast_kernels("cuda", "cpu")


# --- the GPU ----------------------------------------------------------------------------------

@pytest.mark.gpu
def test_cuda_fused_operators_match_the_reference():
    """On the GPU: the CUDA kernels against the reference computed there (F.gelu / F.layer_norm on
    CUDA, then _cast_math) under the same rules, at odd and training-like shapes (the vectorised
    paths: 16-byte rows, rows + pad a multiple of 16; LayerNorm: _LN_GPU_SHAPES). GELU: torch's
    CUDA GELU has the kernel's formula and erff, so every byte is expected equal: at most
    GPU_DIFFER bytes per case one rounding of the GELU value off (Rule), none further; a failure
    names the first differing elements. LayerNorm (another summation order than
    torch's): at most 1e-3 of the bytes, or GPU_DIFFER in a small case, one step off where the
    rounding interval is one step wide. Amaxes within one rounding of the input dtype. Without a
    GPU under DEPT_MEGA_GPU_TESTS_ON_CPU=1 it rehearses with the CPU kernels and their rules."""
    device = gpu_test_device(fp8=True)
    if device == "cuda" and (why := fp8_casts.op_unavailable(device)) is not None:
        pytest.fail(f"the CUDA kernels of the fused cast operators are not built: {why}")
    shapes = _LN_GPU_SHAPES
    on_gpu = device == "cuda"
    report = []
    for in_dtype, fp8 in PAIRS:
        gelu_rule = _gpu_rule(in_dtype) if on_gpu else Rule(fraction=_GELU_BOUND[fp8])
        ln_rule = Rule(fraction=1e-3, count=GPU_DIFFER if on_gpu else 0,
                       amax_rtol=torch.finfo(in_dtype).eps if on_gpu else 0.0)
        report.append(max(_run_gelu(device, fp8_casts.cast_fp8, in_dtype, fp8, gelu_rule)))
        report.append(max(_run_layernorm(device, in_dtype, fp8, ln_rule, shapes)))
    print("max fractions of differing bytes (gelu, layernorm per dtype pair):", report)


@pytest.mark.gpu
def test_cuda_dgelu_cast_matches_the_reference():
    """On the GPU: dgelu_cast_fp8's CUDA kernel against aten.gelu_backward on CUDA, then
    _cast_math, under the rules of test_fp8_dgelu_op.py, at odd and training-like shapes (the
    vectorised path: 16-byte rows, rows + pad a multiple of 16; the scalar one: odd shapes).
    PyTorch's CUDA kernel has the kernel's formula, erff and expf (its `cdf + x * pdf` contracted
    into an FMA: the kernel writes it so), so every value and byte is expected equal; another
    compilation's fp32 rounding here and there is allowed (Rule): per case at most GPU_DIFFER dh
    values one bf16 / fp16 step off and GPU_DIFFER bytes one FP8 step off (in a large case 1e-5 of
    them), none further, the amax
    within one rounding of the input dtype; a failure names the first differing elements.
    Without a GPU under DEPT_MEGA_GPU_TESTS_ON_CPU=1 it rehearses with the CPU kernel (its
    measured fractions)."""
    from tests.test_fp8_dgelu_op import _BYTE_BOUND, _DH_BOUND, SHAPES, _run

    device = gpu_test_device(fp8=True)
    if device == "cuda" and (why := fp8_casts.op_unavailable(device)) is not None:
        pytest.fail(f"the CUDA kernel of dgelu_cast_fp8 is not built: {why}")
    on_gpu = device == "cuda"
    report = []
    for in_dtype, fp8 in PAIRS:
        # one fp32 rounding apart at one input value repeats wherever that value meets a dy that
        # rounds on its edge: on an H200, 20 of 2048 x 2048 dh values, all at x = -0.7421875
        gpu = dataclasses.replace(_gpu_rule(in_dtype), fraction=1e-5)
        dh_rule = gpu if on_gpu else Rule(fraction=_DH_BOUND[in_dtype])
        byte_rule = gpu if on_gpu else Rule(fraction=_BYTE_BOUND[fp8])
        fracs = _run(device, fp8_casts.dgelu_cast_fp8, in_dtype, fp8, dh_rule, byte_rule,
                     SHAPES + [(2048, 2048, 0), (1000, 1024, 24)])
        report.append((max(f for f, _ in fracs), max(f for _, f in fracs)))
    print("dgelu: max fractions of differing dh values and bytes per dtype pair:", report)
