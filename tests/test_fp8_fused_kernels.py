"""The Triton FP8 casts fused into their producer (``fp8_kernels.cast_fp8(gelu=True)`` and
``layernorm_cast_fp8``) against the reference: torch's ``F.gelu`` / ``F.layer_norm`` followed by
``fp8._cast_math`` with the same scale.

The kernels' GELU/LN arithmetic may differ from torch's by a rounding (erf, the order of the
row sums), which can move an element of the bf16 intermediate by one step and its FP8 byte by
one step. So each check compares twice: with torch's result, where every differing byte must be
the cast of a bf16 neighbour of torch's intermediate and the differing fraction is bounded; and
with ``_cast_math`` of an fp32 recomputation that does the kernel's own arithmetic (the
backend's erf; the kernel's mean and rstd), which must give the same bytes everywhere.

As in ``test_fp8_kernels.py`` the checks run in a subprocess under Triton's interpreter
(skipped without Triton) and in-process on a CUDA GPU (``gpu`` marker); each returns its findings.
"""
from __future__ import annotations

import contextlib
import math
from itertools import product

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dept_mega.parallel import fp8_kernels as K
from dept_mega.parallel.fp8 import E4M3, E5M2, _cast_math
from tests.test_fp8_kernels import needs_cuda_triton, needs_interpreter, needs_triton
from tests.test_fp8_kernels import _interpreted as interpreted

# largest fractions of bytes differing from the reference (one FP8 step where the math is well
# conditioned; anywhere in its ill-conditioned parts). Measured in the interpreter: 0 of 232,768
# well-conditioned bytes; 56 of 122,880 GELU bytes (x < -3) and 348 of 109,888 LN bytes (the
# rows of mean 300)
MAX_MISMATCH = 1e-4
MAX_ILL_CONDITIONED = 1e-2
LAYOUTS = [(True, False), (False, True), (True, True)]


def _interpreted(check: str):
    """``check('cpu')`` of this module under Triton's interpreter (in a subprocess)."""
    return interpreted(check, "tests.test_fp8_fused_kernels")


# ----------------------------------------------------------------------------- comparison helpers


def _ordinal(q: torch.Tensor) -> torch.Tensor:
    """FP8 bytes as their position on the number line (±0 both 0): adjacent values differ by 1."""
    b = q.int()
    return torch.where(b >= 0x80, 0x80 - b, b)


def _layouts(q, q_t):
    """(name, bytes as uint8 in the row-major orientation) of each layout a cast returned."""
    out = []
    if q is not None:
        out.append(("q", q.view(torch.uint8)))
    if q_t is not None:
        out.append(("q_t", q_t.view(torch.uint8).t()))
    return out


def _compare(got: tuple, u: torch.Tensor, u_k, scale, dtype, pad: int, rowwise: bool, colwise: bool,
             stats: dict, case: str, failures: list, ill: torch.Tensor = None, unknown: torch.Tensor = None) -> None:
    """Bytes of ``got`` = (q, q_t) against ``_cast_math`` of torch's intermediate ``u``: shapes,
    strides and dtypes equal; every differing byte one FP8 step from the reference's, except
    where ``ill`` (the elements where the math is ill-conditioned: counted apart); none where the
    kernel's intermediate ``u_k`` (when known, and outside ``unknown``) equals ``u``; the counts
    added to ``stats``."""
    ref = _cast_math(u, scale, dtype, pad, rowwise, colwise)[:2]
    for (a, b) in zip(got, ref):
        if (a is None) != (b is None) or (a is not None and (a.shape, a.stride(), a.dtype) != (b.shape, b.stride(),
                                                                                                b.dtype)):
            failures.append(f"{case}: layout {None if a is None else (a.shape, a.stride(), a.dtype)} != "
                            f"{None if b is None else (b.shape, b.stride(), b.dtype)}")
            return
    loose = torch.zeros(u.shape[0] + pad, u.shape[1], dtype=torch.bool, device=u.device)
    if ill is not None:
        loose[:u.shape[0]] = ill
    same = None
    if u_k is not None:  # where the intermediates are equal (pad rows: both zero)
        same = torch.ones(u.shape[0] + pad, u.shape[1], dtype=torch.bool, device=u.device)
        same[:u.shape[0]] = u_k.view(torch.int16) == u.view(torch.int16)
        if unknown is not None:
            same[:u.shape[0]] &= ~unknown
    for (name, a), (_, b) in zip(_layouts(*got), _layouts(*ref)):
        diff = a != b
        stats["elements"] += a.numel()
        stats["mismatches"] += int(diff.sum())
        far = diff & ((_ordinal(a) - _ordinal(b)).abs() > 1)
        stats["ill_conditioned_mismatches"] += int((diff & loose).sum())
        stats["far_ill_conditioned"] += int((far & loose).sum())
        far &= ~loose
        if far.any():
            i, j = (int(v) for v in far.nonzero()[0])
            failures.append(f"{case} {name}: {int(far.sum())} bytes more than one FP8 step from the reference, "
                            f"e.g. [{i}, {j}]: {int(a[i, j])} != {int(b[i, j])}")
        if same is not None and (diff & same).any():
            failures.append(f"{case} {name}: {int((diff & same).sum())} bytes differ where the intermediates are "
                            f"equal")


@contextlib.contextmanager
def _sentinel_outputs():
    """Outputs the kernels allocate (``torch.empty``) start as 0x7F, an FP8 NaN, instead of
    whatever the allocator hands out (often zeros, or the bytes of an earlier identical cast,
    which would hide an element the kernel never writes): torch fills uninitialised memory
    while deterministic algorithms are on."""
    was, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = fill
        torch.use_deterministic_algorithms(was, warn_only=warn)


def _transposes(q, q_t, case: str, failures: list) -> None:
    """With both layouts, ``q_t`` holds exactly the bytes of ``q`` transposed, whatever the
    reference says; a mismatch names the ``q_t`` rows mod 4 (a miscompiled transposed FP8 store
    on an H200 left stale bytes in the rows of one residue) and how many bytes are still the
    0x7F sentinel (never written)."""
    if q is None or q_t is None:
        return
    a, b = q.view(torch.uint8).t(), q_t.view(torch.uint8)
    diff = a != b
    if diff.any():
        rows = sorted({int(i) % 4 for i in diff.nonzero()[:, 0]})
        failures.append(f"{case}: q_t is not q transposed in {int(diff.sum())} bytes (q_t rows mod 4: {rows}; "
                        f"0x7F, the sentinel (never written) or a NaN: {int((diff & (b == 0x7F)).sum())})")


def _exact(got: tuple, u: torch.Tensor, scale, dtype, pad, rowwise, colwise, case: str, failures: list,
           unknown: torch.Tensor = None) -> None:
    """The bytes of ``got`` equal ``_cast_math`` of ``u`` (the kernel's own intermediate) everywhere
    but ``unknown`` (elements where ``u`` is not known to be the kernel's intermediate)."""
    ref = _cast_math(u, scale, dtype, pad, rowwise, colwise)[:2]
    skip = torch.zeros(u.shape[0] + pad, u.shape[1], dtype=torch.bool, device=u.device)
    if unknown is not None:
        skip[:u.shape[0]] = unknown
    for (name, a), (_, b) in zip(_layouts(*got), _layouts(*ref)):
        if not torch.equal(a[~skip], b[~skip]):  # _layouts gives q_t back in q's orientation
            failures.append(f"{case} {name}: {int(((a != b) & ~skip).sum())} bytes differ from the cast of the "
                            f"kernel's own arithmetic")


# ----------------------------------------------------------------------------- GELU


def _erf32(t: torch.Tensor) -> torch.Tensor:
    """The kernel's erf of an fp32 tensor: on the GPU torch's ``erf`` (libdevice's ``erff`` is
    the kernel's; on an H200 the two differed where GELU's ``1 + erf(x)`` cancels, x < -3:
    callers treat those elements as unknown there), Python's ``math.erf`` rounded to fp32 in the
    interpreter."""
    if t.is_cuda:
        return torch.erf(t)
    return torch.from_numpy(np.vectorize(math.erf, otypes=[np.float32])(t.numpy()))


def _gelu_kernel_math(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return ((xf * 0.5) * (1.0 + _erf32(xf * 0.7071067811865476))).to(x.dtype)


def _gelu_input(rows, cols, in_dtype, device, g) -> torch.Tensor:
    """Values from the FP8 subnormal range to saturation, both signs; GELU's tail (large negative
    inputs give -0), zeros."""
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-4, 2.5, cols)
    x[0, :6] = torch.tensor([0.0, -0.0, -30.0, -6.0, 1e-6, -1e-6])[:min(6, cols)]
    return x.to(in_dtype).to(device)


def gelu_vs_reference(device: str) -> dict:
    """``cast_fp8(gelu=True)`` against ``_cast_math(F.gelu(x))`` and against ``_cast_math`` of the
    kernel's arithmetic: both formats, every layout, current and delayed scaling (the delayed scale
    saturates the top of the range), pad 0 and > 0, rows and columns not multiples of the tile,
    bf16 and fp16, the amax recorded (delayed: of the rounded GELU values; current: and 1/scale)."""
    g = torch.Generator().manual_seed(0)
    failures, stats, cases = [], {"elements": 0, "mismatches": 0, "intermediate_diff": 0, "intermediate": 0,
                                 "ill_conditioned_mismatches": 0, "far_ill_conditioned": 0}, 0
    shapes = [(40, 96, 8, (64, 64, 4), torch.bfloat16), (37, 40, 11, (16, 32, 4), torch.bfloat16),
              (24, 48, 0, (16, 32, 4), torch.float16)]
    for (rows, cols, pad, tile, in_dtype), dtype in product(shapes, (E4M3, E5M2)):
        x = _gelu_input(rows, cols, in_dtype, device, g)
        u_ref, u_k = F.gelu(x), _gelu_kernel_math(x)
        stats["intermediate"] += u_ref.numel()
        stats["intermediate_diff"] += int((u_ref.view(torch.int16) != u_k.view(torch.int16)).sum())
        amax_k = torch.linalg.vector_norm(u_k, float("inf")).float()
        for (rowwise, colwise), delayed in product(LAYOUTS, (False, True)):
            case = f"gelu {rows}x{cols}+{pad} {in_dtype}->{dtype} rowwise={rowwise} colwise={colwise} delayed={delayed}"
            cases += 1
            s = (4 * K._FORMATS[dtype][0] / amax_k).reshape(1) if delayed else None  # the top quarter saturates
            scale = torch.cat([torch.zeros(1, device=device), s]) if delayed else None
            amax = torch.zeros(3, device=device)
            with _sentinel_outputs():
                q, q_t, inv = K.cast_fp8(x, dtype, pad, rowwise, colwise, scale=scale, scale_index=1, amax_out=amax,
                                         amax_index=2, tile=tile, gelu=True)
            _transposes(q, q_t, case, failures)
            # on the GPU Triton's erf may differ from torch's by an ulp, which 1 + erf(x) (x < -3)
            # turns into another GELU value: there the kernel's own intermediate is not known
            unknown = (x < -3) if x.is_cuda else None
            _compare((q, q_t), u_ref, u_k, s[0] if delayed else None, dtype, pad, rowwise, colwise, stats, case,
                     failures, ill=x < -3, unknown=unknown)
            _exact((q, q_t), u_k, s[0] if delayed else None, dtype, pad, rowwise, colwise, case, failures, unknown)
            if not (amax[2] == amax_k and amax[0] == 0 and amax[1] == 0):
                failures.append(f"{case}: amax {amax.tolist()} != {amax_k.item()} (of the rounded GELU values)")
            if delayed and inv is not None:
                failures.append(f"{case}: a delayed cast returned 1/scale")
            if not delayed and not torch.equal(inv, _cast_math(u_k, None, dtype, pad, True, False)[2]):
                failures.append(f"{case}: 1/scale {inv.item()} is not that of the GELU values' amax")
    return {"cases": cases, "failures": failures, **stats}


# ----------------------------------------------------------------------------- LayerNorm


def _ln_reference(x, w, b, eps):
    """torch's layer norm in fp32 from ``x``, rounded to ``x``'s dtype (with fp32 parameters
    through torch's fp32 kernel, the same arithmetic), and the mean and rstd that
    ``native_layer_norm`` returns for ``x`` with these parameters (on CUDA always fp32, which
    does not depend on the parameters' dtype: cast to ``x``'s, CUDA's kernel takes no mix)."""
    y = torch.native_layer_norm(x if w.dtype == x.dtype else x.float(), (x.shape[1],), w, b, eps)[0]
    if x.is_cuda:
        w, b = w.to(x.dtype), None if b is None else b.to(x.dtype)
    return y.to(x.dtype), torch.native_layer_norm(x, (x.shape[1],), w, b, eps)[1:]


def _ln_kernel_math(x, w, b, mean, rstd):
    """The kernel's second pass from its own fp32 mean and rstd: ``w·(rstd·(x - mean)) (+ b)``."""
    y = w.float() * (rstd * (x.float() - mean))
    if b is not None:
        y = y + b.float()
    return y.to(x.dtype)


def layernorm_vs_reference(device: str) -> dict:
    """``layernorm_cast_fp8`` against ``_cast_math(F.layer_norm(x))`` and against ``_cast_math``
    of the kernel's arithmetic from its mean and rstd (exact where it can be recomputed: the
    interpreter; on CUDA only without bias, whose add the kernel fuses into an FMA): both formats,
    every layout, pad 0 and > 0, bias None and present, bf16/fp32 parameters, fp16 input, rows and
    columns not multiples of the tile (several column tiles), rows of a large mean (a variance by
    E[x²] - E[x]² would fail), a scale that saturates, the amax recorded; mean and rstd in the
    dtype and shape of ``native_layer_norm`` and close to its values."""
    g = torch.Generator().manual_seed(1)
    failures, stats, cases = [], {"elements": 0, "mismatches": 0, "intermediate_diff": 0, "intermediate": 0,
                                 "ill_conditioned_mismatches": 0, "far_ill_conditioned": 0, "mean_err": 0.0,
                                 "rstd_err": 0.0}, 0
    shapes = [(40, 96, 8, (16, 32, 4), torch.bfloat16, 0.0), (37, 200, 0, (16, 64, 4), torch.bfloat16, 300.0),
              (19, 72, 5, (32, 128, 4), torch.float16, 2.0)]
    eps = 1e-5
    for n, ((rows, cols, pad, tile, in_dtype, offset), dtype, (rowwise, colwise)) in enumerate(
            product(shapes, (E4M3, E5M2), LAYOUTS)):
        with_bias, wdt = n % 2 == 0, (in_dtype if n % 3 else torch.float32)
        x = (torch.randn(rows, cols, generator=g) * torch.linspace(0.5, 8, rows)[:, None] + offset).to(in_dtype)
        w = (1 + torch.randn(cols, generator=g)).to(wdt)
        b = torch.randn(cols, generator=g).to(wdt) if with_bias else None
        x, w, b = x.to(device), w.to(device), None if b is None else b.to(device)
        case = (f"ln {rows}x{cols}+{pad} {in_dtype} params {wdt} bias={with_bias} ->{dtype} "
                f"rowwise={rowwise} colwise={colwise}")
        cases += 1
        y_ref, (mean_ref, rstd_ref) = _ln_reference(x, w, b, eps)
        s = 2 * K._FORMATS[dtype][0] / torch.linalg.vector_norm(y_ref, float("inf")).float()  # top half saturates
        scale = torch.stack([torch.zeros((), device=device), s])
        amax = torch.zeros(3, device=device)
        with _sentinel_outputs():
            q, q_t, mean, rstd = K.layernorm_cast_fp8(x, w, b, eps, dtype, pad, rowwise, colwise, scale=scale,
                                                      scale_index=1, amax_out=amax, amax_index=2, tile=tile)
            # the kernel's own arithmetic, from its fp32 statistics
            q2, q2_t, m32, r32 = K.layernorm_cast_fp8(x, w, b, eps, dtype, pad, rowwise, colwise, scale=scale,
                                                      scale_index=1, tile=tile, stats=torch.float32)
        _transposes(q, q_t, case, failures)
        y_k = _ln_kernel_math(x, w, b, m32, r32)
        stats["intermediate"] += y_k.numel()
        stats["intermediate_diff"] += int((y_k.view(torch.int16) != y_ref.view(torch.int16)).sum())
        known = device == "cpu" or b is None  # the kernel's intermediate is y_k
        ill = torch.full_like(x, offset > 10 * float(x.float().std(1).min()), dtype=torch.bool)
        _compare((q, q_t), y_ref, y_k if known else None, s, dtype, pad, rowwise, colwise, stats, case, failures, ill)
        if known:
            _exact((q, q_t), y_k, s, dtype, pad, rowwise, colwise, case, failures)
        amax_k = torch.linalg.vector_norm(y_k, float("inf")).float()
        if not (amax[0] == 0 and amax[1] == 0 and (amax[2] == amax_k or (device != "cpu" and b is not None
                                                                        and torch.isclose(amax[2], amax_k, 2 ** -7)))):
            failures.append(f"{case}: amax {amax.tolist()} != {amax_k.item()} (of the rounded output)")
        if not (torch.equal(q2.view(torch.uint8) if q2 is not None else q2_t, q.view(torch.uint8) if q is not None
                            else q_t)):
            failures.append(f"{case}: the statistics' dtype changed the FP8 bytes")
        # a mean's rounding error scales with its row's values, not with the mean (near 0 for
        # centred rows: an fp32 mean 6e-8 from torch's on an H200 failed a purely relative test)
        mean_atol = 2 ** -22 * float(x.float().abs().max()) if mean.dtype == torch.float32 else 0.0
        for name, got, ref, atol in (("mean", mean, mean_ref, mean_atol), ("rstd", rstd, rstd_ref, 0.0)):
            if (got.dtype, got.shape) != (ref.dtype, ref.shape):
                failures.append(f"{case}: {name} {got.dtype} {tuple(got.shape)} != native_layer_norm's "
                                f"{ref.dtype} {tuple(ref.shape)}")
            elif not torch.allclose(got.float(), ref.float(), rtol=2 ** -7 if got.dtype != torch.float32 else 1e-5,
                                    atol=atol):
                failures.append(f"{case}: {name} not close to native_layer_norm's "
                                f"(max diff {(got.float() - ref.float()).abs().max().item()})")
        # the fp32 statistics against the exact ones (fp64): as close as torch's own, or closer
        xd = x.double()
        m64, r64 = xd.mean(1, keepdim=True), (xd.var(1, unbiased=False, keepdim=True) + eps).rsqrt()
        mean_err, rstd_err = ((m32 - m64).abs() / xd.abs().amax(1, keepdim=True)).max().item(), \
            ((r32 - r64) / r64).abs().max().item()
        stats["mean_err"], stats["rstd_err"] = max(stats["mean_err"], mean_err), max(stats["rstd_err"], rstd_err)
        if mean_err > 2 ** -22 or rstd_err > 2 ** -19:  # measured: 8e-8, 8e-7 (torch's rstd: 3.5e-6)
            failures.append(f"{case}: fp32 mean/rstd off: mean by {mean_err} of max|x|, rstd by {rstd_err} (relative)")
    with pytest.raises(ValueError, match="needs a delayed scale"):
        K.layernorm_cast_fp8(x, w, b, eps, E4M3)
    return {"cases": cases, "failures": failures, **stats}


# ----------------------------------------------------------------------------- tests


def _check(res: dict, cases: int) -> None:
    assert res["cases"] == cases and not res["failures"], res["failures"][:20]
    assert res["mismatches"] - res["ill_conditioned_mismatches"] <= MAX_MISMATCH * res["elements"], res
    assert res["ill_conditioned_mismatches"] <= MAX_ILL_CONDITIONED * res["elements"], res


@needs_triton
@needs_interpreter
def test_fused_gelu_cast_in_the_interpreter_matches_the_reference():
    _check(_interpreted("gelu_vs_reference"), 3 * 2 * 6)


@needs_triton
@needs_interpreter
def test_fused_layernorm_cast_in_the_interpreter_matches_the_reference():
    _check(_interpreted("layernorm_vs_reference"), 3 * 2 * 3)


@needs_triton
@needs_interpreter
def test_fp8_code_in_the_interpreter_matches_torch():
    res = interpreted("fp8_code_roundtrip", "tests.fp8_code_check")
    assert not res["failures"], res["failures"]


@pytest.mark.gpu
@needs_cuda_triton
def test_fused_casts_on_cuda_match_the_reference():
    from tests.fp8_code_check import fp8_code_roundtrip
    res = fp8_code_roundtrip("cuda")
    assert not res["failures"], res["failures"]
    _check(gelu_vs_reference("cuda"), 3 * 2 * 6)
    _check(layernorm_vs_reference("cuda"), 3 * 2 * 3)


@needs_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the gpu-marked test compiles them for the device")
def test_fused_kernels_compile_for_an_h100():
    """The interpreter does not compile: compile the GELU cast (both kernels) and the LayerNorm
    cast ahead of time for sm_90 (no GPU needed) and check the PTX has the saturating FP8
    conversion, libdevice's erf (GELU) and the amax atomic."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import triton
    target = GPUTarget("cuda", 90, 32)
    fmax, mbits, emin = K._FORMATS[E4M3]
    ptx = triton.compile(ASTSource(fn=K._amax_parts_kernel, constexprs={"BLOCK": K._AMAX_BLOCK, "GELU": True},
                                   signature={"x_ptr": "*bf16", "parts_ptr": "*fp32", "n": "i32", "nprog": "i32",
                                              "BLOCK": "constexpr", "GELU": "constexpr"}), target=target).asm["ptx"]
    assert ".entry" in ptx
    consts = dict(FMAX=fmax, MBITS=mbits, EMIN=emin, MIN_AMAX=K._MIN_AMAX, CURRENT=False, RECORD=True,
                  ROWWISE=True, COLWISE=True, PARTS=K._PARTS, BLOCK_M=K._TILE, BLOCK_N=K._TILE, GELU=True)
    sig = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "qt_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "inv_ptr": "*fp32",
           "parts_ptr": "*fp32", "amax_ptr": "*fp32", **{k: "i32" for k in (
               "rows", "cols", "out_rows", "nparts", "scale_index", "amax_index")}, **{k: "constexpr" for k in consts}}
    gelu_ptx = triton.compile(ASTSource(fn=K._cast_kernel, signature=sig, constexprs=consts), target=target).asm["ptx"]
    plain_ptx = triton.compile(ASTSource(fn=K._cast_kernel, signature=sig, constexprs={**consts, "GELU": False}),
                               target=target).asm["ptx"]
    assert "cvt.rn.satfinite.e4m3x2.f32" in gelu_ptx and "atom.global" in gelu_ptx
    assert len(gelu_ptx) > len(plain_ptx)  # erf inlined from libdevice; the plain cast has none of it
    from dept_mega.parallel import fp8_norm_kernels as N
    for fmt, dtype, x_ty in (("fp8e4nv", E4M3, "*bf16"), ("fp8e5", E5M2, "*fp16")):
        fmax, mbits, emin = K._FORMATS[dtype]
        consts = dict(FMAX=fmax, MBITS=mbits, EMIN=emin, HAS_BIAS=True, RECORD=True, ROWWISE=True, COLWISE=True,
                      BLOCK_M=N._TILE[0], BLOCK_N=N._TILE[1])
        sig = {"x_ptr": x_ty, "w_ptr": "*fp32", "b_ptr": "*fp32", "q_ptr": f"*{fmt}", "qt_ptr": f"*{fmt}",
               "mean_ptr": "*fp32", "rstd_ptr": "*fp32", "scale_ptr": "*fp32", "amax_ptr": "*fp32",
               **{k: "i32" for k in ("rows", "cols", "out_rows")}, "eps": "fp32", "scale_index": "i32",
               "amax_index": "i32", **{k: "constexpr" for k in consts}}
        ptx = triton.compile(ASTSource(fn=N._layernorm_cast_kernel, signature=sig, constexprs=consts),
                             target=target).asm["ptx"]
        assert f"cvt.rn.satfinite.{'e4m3' if dtype == E4M3 else 'e5m2'}x2.f32" in ptx and "atom.global" in ptx
        assert "rsqrt.approx" in ptx  # libdevice's rsqrtf, as torch's CUDA layer norm


@needs_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the gpu-marked test runs the kernel itself")
def test_layernorm_cast_sass_stores_no_stale_transposed_bytes(tmp_path):
    """The LayerNorm cast with both layouts, compiled for sm_90 with Triton's own ptxas (no GPU
    needed): no transposed FP8 byte comes from a register the column loop has not yet written in
    that iteration (``tests/sass_stores.py``). With the transposed bytes converted as the
    row-major ones, ptxas 12.8 produced such a byte (one ``q_t`` row in four stale on an H200) at
    the GPU test's 40 x 96 + 8 shape and at the default tile."""
    import subprocess

    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dept_mega.parallel import fp8_norm_kernels as N
    from tests.sass_stores import count_byte_stores, stale_shared_bytes
    nvdisasm = knobs.nvidia.nvdisasm.path
    div = [["tt.divisibility", 16]]
    found = []
    # (tile, cols and out_rows divisible by 16: what Triton specialises at 40 x 96 + 8 and 8192 x 2048)
    for tile, dtype, bias in product([(16, 32, 4), N._TILE], (E4M3, E5M2), (False, True)):
        fmax, mbits, emin = K._FORMATS[dtype]
        fmt = "fp8e4nv" if dtype == E4M3 else "fp8e5"
        consts = dict(FMAX=fmax, MBITS=mbits, EMIN=emin, HAS_BIAS=bias, RECORD=True, ROWWISE=True, COLWISE=True,
                      BLOCK_M=tile[0], BLOCK_N=tile[1])
        sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16" if bias else "*fp32", "q_ptr": f"*{fmt}",
               "qt_ptr": f"*{fmt}", "mean_ptr": "*fp32", "rstd_ptr": "*fp32", "scale_ptr": "*fp32",
               "amax_ptr": "*fp32", **{k: "i32" for k in ("rows", "cols", "out_rows")}, "eps": "fp32",
               "scale_index": "i32", "amax_index": "i32", **{k: "constexpr" for k in consts}}
        attrs = {(i,): div for i in (*range(9), 10, 11)}
        kernel = triton.compile(ASTSource(fn=N._layernorm_cast_kernel, signature=sig, constexprs=consts, attrs=attrs),
                                target=GPUTarget("cuda", 90, 32), options={"num_warps": tile[2]})
        cubin = tmp_path / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        sass = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
        assert count_byte_stores(sass) > 0, f"{tile}: no STS.U8 (the transposed tile no longer goes through " \
                                            f"shared memory as bytes: revisit this check)"
        found += [f"{tile} {dtype} bias={bias}: {p}" for p in stale_shared_bytes(sass)]
    assert not found, found[:4]
