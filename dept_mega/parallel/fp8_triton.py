"""What the Triton FP8 cast kernels share (``fp8_kernels.py``: the plain and GELU casts;
``fp8_norm_kernels.py``: the LayerNorm cast): Triton's optional import, the formats, and the
``@triton.jit`` helpers for the element math, so that every kernel rounds the same way.

Every rounding is done in fp32 (or integer) arithmetic, whose result is exactly representable
in the target type, before any conversion: Triton's interpreter converts fp32 to bf16 by
truncation and to FP8 differently from the GPU, while both convert an exactly representable
value exactly, so the bytes do not depend on the backend.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU test environment need not have Triton
    triton = None
    tl = None

AVAILABLE = triton is not None
_MIN_AMAX = 1e-12  # as fp8._MIN_AMAX
INPUT_DTYPES = (torch.bfloat16, torch.float16)  # what the kernels take (see fp8_kernels' docstring)
# (FP8 max, mantissa bits, smallest normal exponent) of each format
_FORMATS = {torch.float8_e4m3fn: (448.0, 3, -6), torch.float8_e5m2: (57344.0, 2, -14)}

_DUMMIES: dict[torch.device, torch.Tensor] = {}


def _dummy(device: torch.device) -> torch.Tensor:
    """A 0-d fp32 tensor on ``device`` for the pointer arguments a launch does not use (a
    current-scaled cast's scale, an unrecorded cast's amax slot): one per device, never read
    or written, rather than an allocation per cast."""
    d = _DUMMIES.get(device)
    if d is None:
        d = _DUMMIES[device] = torch.empty((), dtype=torch.float32, device=device)
    return d


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (CPU tensors) in this process."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


if AVAILABLE:
    @triton.jit
    def _nanmax(a, b):
        return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @triton.jit
    def _abs_max(x):
        """max |x| over a 2-D block (NaN if any element is NaN), a 0-d fp32."""
        return tl.reduce(tl.reduce(tl.abs(x), 1, _nanmax), 0, _nanmax)

    @triton.jit
    def _round_to_input(y, IS_BF16: tl.constexpr):
        """fp32 ``y`` rounded (to nearest, ties to even) to bf16 (``IS_BF16``) or fp16 and
        back: what torch's kernels store. bf16 in integer arithmetic: the standard
        ``bits + 0x7FFF + lsb`` carry, which also overflows to ±inf and rounds subnormals as
        the conversion does (NaN kept apart: the carry could turn one into inf). fp16 by the
        conversion itself, which the interpreter does with numpy (IEEE)."""
        if IS_BF16:
            bits = y.to(tl.int32, bitcast=True)
            r = ((bits + (0x7FFF + ((bits >> 16) & 1))) & -65536).to(tl.float32, bitcast=True)
            return tl.where(y != y, y, r)
        else:
            return y.to(tl.float16).to(tl.float32)

    @triton.jit
    def _gelu(x, IS_BF16: tl.constexpr):
        """torch's erf GELU of a bf16/fp16 tensor: ``(x·0.5)·(1 + erf(x·√½))`` in fp32 (the
        ``0.5`` and ``√½`` fp32 constants, as torch's CPU and CUDA kernels), rounded to the
        input's dtype."""
        return _round_to_input((x * 0.5) * (1.0 + tl.math.erf(x * 0.7071067811865476)), IS_BF16)

    @triton.jit
    def _to_fp8_grid(x, scale, FMAX: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr):
        """``x·scale`` in fp32, saturated to ±FMAX (NaN stays NaN) and rounded to the nearest
        FP8 value (ties to even), as fp32: converting it to the format is exact."""
        y = x * scale
        y = tl.minimum(tl.maximum(y, -FMAX, propagate_nan=tl.PropagateNan.ALL), FMAX,
                       propagate_nan=tl.PropagateNan.ALL)
        # y + 1.5·2^(23+k) rounds y to a multiple of 2^k in fp32, k = max(exponent(y), EMIN) -
        # MBITS; subtracting is exact
        bits = y.to(tl.int32, bitcast=True)
        e = tl.maximum(((bits >> 23) & 0xFF) - 127, EMIN)
        magic = (((e - MBITS + 23 + 127) << 23) | 0x400000).to(tl.float32, bitcast=True)
        rounded = (y + magic) - magic
        # keep the sign of y (a negative value that rounds to zero is -0, as the reference gives)
        return (rounded.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)

    @triton.jit
    def _fp8_code(y, MBITS: tl.constexpr, EMIN: tl.constexpr):
        """The FP8 byte, as an int32 in [0, 255], of the fp32 ``y`` on the FP8 grid (what
        :func:`_to_fp8_grid` returns: saturated, or NaN, coded 0x7F with ``y``'s sign), in integer
        arithmetic: no conversion instruction (see :func:`_store_fp8`)."""
        bits = y.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80
        a = bits & 0x7FFFFFFF
        # normal: the exponent rebiased (bias 1 - EMIN) and the top MBITS of the mantissa; below
        # 2^EMIN the subnormal's integer multiple of 2^(EMIN - MBITS), exact in fp32
        normal = (a - ((126 + EMIN) << 23)) >> (23 - MBITS)
        sub = (a.to(tl.float32, bitcast=True) * (1 << (MBITS - EMIN))).to(tl.int32)
        code = tl.where(a >= ((127 + EMIN) << 23), normal, sub)
        return tl.where(a > 0x7F800000, 0x7F, code) | sign

    @triton.jit
    def _store_fp8(q_ptr, qt_ptr, y, r, c, cols, out_rows, out, ROWWISE: tl.constexpr, COLWISE: tl.constexpr,
                   CODED_T: tl.constexpr = False, MBITS: tl.constexpr = 3, EMIN: tl.constexpr = -6):
        """Store the tile ``y`` (rows ``r``, columns ``c``, on the FP8 grid) of a ``[out_rows,
        cols]`` tensor row-major into ``q`` and/or transposed (``[cols, out_rows]``) into ``q_t``,
        where ``out``.

        ``CODED_T``: the transposed bytes come from :func:`_fp8_code` (for the format of ``MBITS``
        and ``EMIN``), stored as uint8, instead of from the FP8 conversion the row-major store
        uses. Why: where both stores take the same converted tile and the compiler moves the
        transposed one through shared memory byte by byte (the LayerNorm cast's column loop),
        Triton 3.6's bundled ptxas (CUDA 12.8) split the packed conversion results wrongly: one
        byte in four was read from a register before the instruction that sets it (the previous
        column tile's byte; uninitialised in the first tile), so one ``q_t`` row in four held
        stale bytes on an H200 (``tests/sass_stores.py`` finds it in the SASS; Triton issue
        #11111 reports the same symptom). The integer bytes share no register with the
        conversion; the bytes are the same."""
        if ROWWISE:
            tl.store(q_ptr + r[:, None] * cols + c[None, :], y.to(q_ptr.dtype.element_ty), mask=out)
        if COLWISE:
            if CODED_T:
                tl.store(qt_ptr.to(tl.pointer_type(tl.uint8), bitcast=True) + c[:, None] * out_rows + r[None, :],
                         tl.trans(_fp8_code(y, MBITS, EMIN)).to(tl.uint8), mask=tl.trans(out))
            else:
                tl.store(qt_ptr + c[:, None] * out_rows + r[None, :], tl.trans(y).to(qt_ptr.dtype.element_ty),
                         mask=tl.trans(out))
