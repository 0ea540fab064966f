"""Triton kernels of the native FP8 casts (``fp8.py``): one kernel per cast.

:func:`cast_fp8` reads a 2-D bf16/fp32 tensor once and writes its FP8 copy row-major and/or
transposed (``q_t``, row-major ``[cols, rows + pad]``, the tile transposed on chip), zero rows
appended for ``pad``. It computes the same bytes as the reference math (``fp8._cast_math``):

* ``y = x·scale`` in fp32, saturated to ±FP8_MAX (NaN stays NaN), rounded to the nearest FP8
  value (ties to even) in fp32 arithmetic and then converted, which is exact. Rounding first
  makes the bytes independent of the backend's conversion instruction (Triton's interpreter
  rounds differently from the GPU; both convert an exactly representable value exactly).
* delayed scaling (``scale`` given: a slot of a tensor, scale known before the cast): one
  kernel; every program max-reduces ``|x|`` of its tile and, when ``amax_out`` is given,
  atomically maxes it into that fp32 slot (so the tensor's amax is a by-product).
* current scaling (``scale`` None): a reduction kernel writes at most ``_PARTS`` partial maxima,
  then the cast kernel reduces them in every program and computes ``scale = FP8_MAX / max(amax,
  1e-12)`` as PyTorch does (``FP8_MAX · (1/amax)``, IEEE reciprocal) and ``1/scale`` (returned
  for the GEMM). Two launches.
* ``gelu=True`` casts ``GELU(t)`` (the prologue of fc2): ``(x·0.5)·(1 + erf(x·√½))`` in fp32 as
  torch computes it, rounded to ``t``'s dtype, then cast as above; the amax (recorded, and that
  of current scaling: the reduction applies GELU too) is that of the rounded values.
  ``erf`` is the backend's (libdevice on the GPU, as torch's CUDA kernel; the interpreter's is
  Python's), so an element may differ from torch's GELU by one bf16 step (rarely; measured by
  the tests).

The LayerNorm prologue (``layernorm_cast_fp8``) is in ``fp8_norm_kernels.py`` (re-exported).

The kernels take bf16 and fp16 tensors (the operands of mixed-precision training). An fp32
tensor takes the reference math instead (``Fp8State.cast`` routes it): on an H200 (Triton 3.6,
torch 2.11) the fused transposed store of an fp32 input wrote wrong bytes in every fourth row
of ``q_t``, while bf16 inputs matched the reference bit for bit.

Triton is optional: this module imports without it (``AVAILABLE`` False) and ``fp8.py`` then
uses the reference math (compiled by inductor on CUDA). On CPU tensors the kernels run only
under Triton's interpreter (``TRITON_INTERPRET=1`` set before Triton is imported), which the
tests use to compare them with the reference bit for bit.
"""
from __future__ import annotations

from typing import Optional

import torch

from .fp8_norm_kernels import layernorm_cast_fp8  # noqa: F401  (re-exported: the LayerNorm prologue)
from .fp8_triton import (_FORMATS, _MIN_AMAX, AVAILABLE, INPUT_DTYPES, _dummy, interpreted,  # noqa: F401
                         tl, triton)
from .triton_launch import ceil_div, launch

if AVAILABLE:
    from .fp8_triton import _abs_max, _gelu, _nanmax, _store_fp8, _to_fp8_grid

_PARTS = 256  # most partial maxima of the current-scaling reduction (one per program)
_AMAX_BLOCK = 4096
_TILE = 64


if AVAILABLE:
    @triton.jit
    def _amax_parts_kernel(x_ptr, parts_ptr, n, nprog, BLOCK: tl.constexpr, GELU: tl.constexpr = False):
        pid = tl.program_id(0)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(pid * BLOCK, n, nprog * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
            if GELU:  # masked elements: GELU(0) = 0
                x = _gelu(x, x_ptr.dtype.element_ty == tl.bfloat16)
            acc = tl.maximum(acc, tl.abs(x), propagate_nan=tl.PropagateNan.ALL)
        tl.store(parts_ptr + pid, tl.reduce(acc, 0, _nanmax))

    # the slot indices change with every layer: no specialisation (and recompilation) on them
    @triton.jit(do_not_specialize=["nparts", "scale_index", "amax_index"])
    def _cast_kernel(x_ptr, q_ptr, qt_ptr, scale_ptr, inv_ptr, parts_ptr, amax_ptr,
                     rows, cols, out_rows, nparts, scale_index, amax_index,
                     FMAX: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, MIN_AMAX: tl.constexpr,
                     CURRENT: tl.constexpr, RECORD: tl.constexpr, ROWWISE: tl.constexpr, COLWISE: tl.constexpr,
                     PARTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     GELU: tl.constexpr = False):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        first = (pid_m == 0) & (pid_n == 0)
        if CURRENT:
            p = tl.arange(0, PARTS)
            amax = tl.reduce(tl.load(parts_ptr + p, mask=p < nparts, other=0.0), 0, _nanmax)
            # FP8_MAX / amax as PyTorch computes a number over a tensor: FP8_MAX · (1/amax)
            scale = tl.math.div_rn(1.0, tl.maximum(amax, MIN_AMAX, propagate_nan=tl.PropagateNan.ALL)) * FMAX
            if first:
                tl.store(inv_ptr, tl.math.div_rn(1.0, scale))
                if RECORD:
                    tl.atomic_max(amax_ptr + amax_index, amax)
        else:
            scale = tl.load(scale_ptr + scale_index)
        r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        c = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        x = tl.load(x_ptr + r[:, None] * cols + c[None, :], mask=(r[:, None] < rows) & (c[None, :] < cols),
                    other=0.0).to(tl.float32)
        if GELU:  # pad rows and masked columns load 0, and GELU(0) = 0
            x = _gelu(x, x_ptr.dtype.element_ty == tl.bfloat16)
        if RECORD and not CURRENT:
            tl.atomic_max(amax_ptr + amax_index, _abs_max(x))
        y = _to_fp8_grid(x, scale, FMAX, MBITS, EMIN)
        _store_fp8(q_ptr, qt_ptr, y, r, c, cols, out_rows, (r[:, None] < out_rows) & (c[None, :] < cols),
                   ROWWISE, COLWISE)


def cast_fp8(t: torch.Tensor, dtype: torch.dtype, pad: int = 0, rowwise: bool = True, colwise: bool = False,
             scale: Optional[torch.Tensor] = None, scale_index: int = 0,
             amax_out: Optional[torch.Tensor] = None, amax_index: int = 0, tile: tuple = (_TILE, _TILE, 4),
             gelu: bool = False) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Cast the 2-D ``t`` to ``dtype`` (see the module docstring). ``scale``: an fp32 tensor
    whose element ``scale_index`` is the scale (delayed scaling), or None (current scaling);
    ``amax_out``: an fp32 tensor whose element ``amax_index`` is maxed with ``t``'s amax.
    Returns ``(q, q_t, inv)``: ``q`` ``[rows + pad, cols]`` when ``rowwise``, ``q_t``
    ``[cols, rows + pad]`` when ``colwise``, ``inv`` the 0-d ``1/scale`` under current scaling
    (None when ``scale`` is given: the caller has it). ``tile``: (rows, columns, warps) of a
    program (powers of two; the bytes do not depend on it), for ``benchmarks/fp8_cast_bench.py``.
    ``gelu``: cast ``GELU(t)`` instead (torch's erf form in fp32, rounded to ``t``'s dtype; the
    amax, recorded or of current scaling, is that of the rounded values), the prologue of fc2."""
    if t.dtype not in INPUT_DTYPES:
        raise ValueError(f"cast_fp8 takes bf16 or fp16 tensors, got {t.dtype} (Fp8State.cast sends others "
                         f"to the reference math)")
    if not AVAILABLE:
        raise RuntimeError("cast_fp8 needs Triton (not installed)")
    if t.dim() != 2 or t.numel() + pad * t.shape[1] >= 2 ** 31:
        raise ValueError(f"cast_fp8 takes a 2-D tensor under 2^31 elements, got {tuple(t.shape)}")
    if t.is_cpu and not interpreted():
        raise RuntimeError("cast_fp8 on CPU tensors needs Triton's interpreter (TRITON_INTERPRET=1)")
    fmax, mbits, emin = _FORMATS[dtype]
    t = t.contiguous()
    rows, cols = t.shape
    out_rows = rows + pad
    q = t.new_empty((out_rows, cols), dtype=dtype) if rowwise else None
    q_t = t.new_empty((cols, out_rows), dtype=dtype) if colwise else None
    current = scale is None
    dummy = _dummy(t.device) if current or amax_out is None else None
    inv = t.new_empty((), dtype=torch.float32) if current else None
    parts, nparts = dummy, 0
    if current:
        n = t.numel()
        nparts = max(1, min(_PARTS, ceil_div(n, _AMAX_BLOCK)))
        parts = t.new_empty((nparts,), dtype=torch.float32)
        launch(_amax_parts_kernel, (nparts,), (t, parts, n, nparts), {"BLOCK": _AMAX_BLOCK, "GELU": gelu}, 4)
    block_m, block_n, warps = tile
    launch(_cast_kernel, (ceil_div(out_rows, block_m), ceil_div(cols, block_n)),
           (t, q if rowwise else q_t, q_t if colwise else q, dummy if current else scale,
            inv if current else dummy, parts, dummy if amax_out is None else amax_out,
            rows, cols, out_rows, nparts, scale_index, amax_index),
           {"FMAX": fmax, "MBITS": mbits, "EMIN": emin, "MIN_AMAX": _MIN_AMAX, "CURRENT": current,
            "RECORD": amax_out is not None, "ROWWISE": rowwise, "COLWISE": colwise, "PARTS": _PARTS,
            "BLOCK_M": block_m, "BLOCK_N": block_n, "GELU": gelu}, warps)
    return q, q_t, inv
