"""Triton kernel of the LayerNorm prologue of an FP8 linear (QKV, fc1): the layer norm and the
FP8 cast of its output in one kernel, as Transformer Engine's LayerNormLinear does, so the
bf16 output is never written and read back by a separate cast (``fp8_kernels.cast_fp8``).

``y = F.layer_norm(x, (H,), weight, bias, eps)`` in fp32 from ``x``, rounded to ``x``'s dtype,
then cast as ``fp8._cast_math`` does with a delayed scale (a slot of a tensor, known before the
cast; the amax of ``y`` maxed into an fp32 slot). A program takes ``BLOCK_M`` rows and reads
them twice, a column tile at a time: pass 1 the mean and the biased variance (per tile the
mean and the sum of squared deviations, combined across tiles by Chan et al.'s pairwise
update, which does not cancel as ``E[x²] - E[x]²`` does), pass 2 the normalised, scaled and
rounded values, stored row-major and/or transposed (the tile transposed on chip; the transposed
bytes coded in integer arithmetic, see ``fp8_triton._store_fp8``: ptxas 12.8 miscompiled the
conversion shared by both stores).

The arithmetic is that of torch's CUDA kernel, ``gamma·(rstd·(x - mean)) + beta`` with ``rstd
= rsqrt(var + eps)``; the sums are in another order, so an element of ``y`` may differ from
torch's by one bf16 step, and its FP8 byte then by at most one step (rarely: the tests measure
it). Pad rows are zero, not the layer norm of a zero row.
"""
from __future__ import annotations

from typing import Optional

import torch

from .fp8_triton import _FORMATS, AVAILABLE, INPUT_DTYPES, _dummy, interpreted, tl, triton
from .triton_launch import ceil_div, launch

if AVAILABLE:
    from .fp8_triton import _nanmax, _round_to_input, _store_fp8, _to_fp8_grid

# rows, columns, warps of a program: the fastest tile measured (H200, 2026-11-28, at the 1B model's
# [8192, 2048] input: 1.41x the norm then the cast, against 1.17x at 32 x 128 with 4 warps;
# benchmarks/fp8_cast_bench.py's LN_TILES). The statistics are merged per column tile, so the tile
# may move their last bit: the bytes stay within the fused casts' rule (rare one-step differences).
_TILE = (32, 256, 8)


if AVAILABLE:
    @triton.jit
    def _store_stat(ptr, v, mask):
        """Store the fp32 ``v`` as ``ptr``'s dtype (fp32, or bf16/fp16: the CPU's statistics),
        rounded in fp32 first (the interpreter's bf16 conversion truncates)."""
        if ptr.dtype.element_ty == tl.float32:
            tl.store(ptr, v, mask=mask)
        else:
            tl.store(ptr, _round_to_input(v, ptr.dtype.element_ty == tl.bfloat16).to(ptr.dtype.element_ty),
                     mask=mask)

    @triton.jit
    def _load_rows(x_ptr, r, c, cols, mask):
        """The tile (rows ``r``, columns ``c``) of the row-major ``x`` in fp32 (0 outside ``mask``):
        both passes' read."""
        return tl.load(x_ptr + r[:, None] * cols + c[None, :], mask=mask, other=0.0).to(tl.float32)

    # the slot indices change with every layer: no specialisation (and recompilation) on them
    @triton.jit(do_not_specialize=["scale_index", "amax_index"])
    def _layernorm_cast_kernel(x_ptr, w_ptr, b_ptr, q_ptr, qt_ptr, mean_ptr, rstd_ptr, scale_ptr, amax_ptr,
                               rows, cols, out_rows, eps, scale_index, amax_index,
                               FMAX: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr,
                               HAS_BIAS: tl.constexpr, RECORD: tl.constexpr, ROWWISE: tl.constexpr,
                               COLWISE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        real = r < rows  # rows in [rows, out_rows) are padding
        # pass 1: mean and sum of squared deviations per row, tile by tile
        mean = tl.zeros([BLOCK_M], dtype=tl.float32)
        m2 = tl.zeros([BLOCK_M], dtype=tl.float32)
        for start in range(0, cols, BLOCK_N):
            c = start + tl.arange(0, BLOCK_N)
            inside = c < cols
            x = _load_rows(x_ptr, r, c, cols, real[:, None] & inside[None, :])
            n_a = start * 1.0  # columns combined so far
            n_b = tl.minimum(cols - start, BLOCK_N) * 1.0  # columns of this tile
            mean_b = tl.sum(x, 1) / n_b
            d = tl.where(inside[None, :], x - mean_b[:, None], 0.0)
            n = n_a + n_b
            delta = mean_b - mean
            mean = mean + delta * (n_b / n)
            m2 = m2 + tl.sum(d * d, 1) + delta * delta * (n_a * n_b / n)
        rstd = tl.math.rsqrt(m2 / cols + eps)
        _store_stat(mean_ptr + r, mean, real)
        _store_stat(rstd_ptr + r, rstd, real)
        # pass 2: normalise, affine, round to x's dtype, cast
        scale = tl.load(scale_ptr + scale_index)
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        for start in range(0, cols, BLOCK_N):
            c = start + tl.arange(0, BLOCK_N)
            inside = c < cols
            x = _load_rows(x_ptr, r, c, cols, real[:, None] & inside[None, :])
            w = tl.load(w_ptr + c, mask=inside, other=0.0).to(tl.float32)
            y = w[None, :] * (rstd[:, None] * (x - mean[:, None]))
            if HAS_BIAS:
                y = y + tl.load(b_ptr + c, mask=inside, other=0.0).to(tl.float32)[None, :]
            y = _round_to_input(y, x_ptr.dtype.element_ty == tl.bfloat16)
            y = tl.where(real[:, None] & inside[None, :], y, 0.0)  # pad rows (and masked columns): 0
            amax = tl.maximum(amax, tl.reduce(tl.abs(y), 1, _nanmax), propagate_nan=tl.PropagateNan.ALL)
            y = _to_fp8_grid(y, scale, FMAX, MBITS, EMIN)
            _store_fp8(q_ptr, qt_ptr, y, r, c, cols, out_rows, (r[:, None] < out_rows) & inside[None, :],
                       ROWWISE, COLWISE, True, MBITS, EMIN)
        if RECORD:
            tl.atomic_max(amax_ptr + amax_index, tl.reduce(amax, 0, _nanmax))


def stats_dtype(x: torch.Tensor, weight: Optional[torch.Tensor]) -> torch.dtype:
    """The dtype of the mean and rstd that ``torch.ops.aten.native_layer_norm`` returns for
    ``x`` (and that its backward requires, checked with torch 2.11 and 2.13): fp32 on CUDA; on
    CPU ``x``'s dtype, unless the weight is fp32 while ``x`` is bf16/fp16 (the CPU kernel's
    "mixed type"), then fp32."""
    if x.is_cuda or (weight is not None and weight.dtype == torch.float32):
        return torch.float32
    return x.dtype


def layernorm_cast_fp8(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
                       dtype: torch.dtype, pad: int = 0, rowwise: bool = True, colwise: bool = False,
                       scale: Optional[torch.Tensor] = None, scale_index: int = 0,
                       amax_out: Optional[torch.Tensor] = None, amax_index: int = 0, tile: tuple = _TILE,
                       stats: Optional[torch.dtype] = None
                       ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """LayerNorm over the last dimension of the 2-D bf16/fp16 ``x`` and the FP8 cast of the
    result (see the module docstring). ``weight`` (and ``bias``, or None): ``[cols]``, ``x``'s
    dtype or fp32. ``scale``: an fp32 tensor whose element ``scale_index`` is the (delayed)
    scale, required; ``amax_out``: an fp32 tensor whose element ``amax_index`` is maxed with the
    output's amax. Returns ``(q, q_t, mean, rstd)``: ``q`` ``[rows + pad, cols]`` when
    ``rowwise``, ``q_t`` ``[cols, rows + pad]`` when ``colwise``, ``mean`` and ``rstd`` ``[rows,
    1]`` as ``native_layer_norm`` returns them (:func:`stats_dtype`), for its backward.
    ``tile``: (rows, columns, warps) of a program (powers of two; the bytes do not depend on
    it); ``stats``: another dtype for mean and rstd (the tests read them in fp32)."""
    if scale is None:
        raise ValueError("layernorm_cast_fp8 needs a delayed scale (a scale tensor): the fused LayerNorm cast "
                         "has no current scaling (cast the layer norm's output with cast_fp8 instead)")
    if x.dtype not in INPUT_DTYPES:
        raise ValueError(f"layernorm_cast_fp8 takes bf16 or fp16 tensors, got {x.dtype}")
    if x.dim() != 2 or x.numel() + pad * x.shape[1] >= 2 ** 31:
        raise ValueError(f"layernorm_cast_fp8 takes a 2-D tensor under 2^31 elements, got {tuple(x.shape)}")
    cols = x.shape[1]
    params = [("weight", weight)] + ([("bias", bias)] if bias is not None else [])
    for name, p in params:
        if p.shape != (cols,) or p.dtype not in (x.dtype, torch.float32) or p.device != x.device:
            raise ValueError(f"layernorm_cast_fp8: {name} must be [{cols}] of {x.dtype} or fp32 on {x.device}, "
                             f"got {tuple(p.shape)} {p.dtype} on {p.device}")
    if bias is not None and bias.dtype != weight.dtype:
        raise ValueError(f"layernorm_cast_fp8: weight ({weight.dtype}) and bias ({bias.dtype}) differ in dtype")
    if scale.dtype != torch.float32 or (amax_out is not None and amax_out.dtype != torch.float32):
        raise ValueError("layernorm_cast_fp8: scale and amax_out must be fp32 tensors")
    if not AVAILABLE:
        raise RuntimeError("layernorm_cast_fp8 needs Triton (not installed)")
    if x.is_cpu and not interpreted():
        raise RuntimeError("layernorm_cast_fp8 on CPU tensors needs Triton's interpreter (TRITON_INTERPRET=1)")
    fmax, mbits, emin = _FORMATS[dtype]
    x, weight = x.contiguous(), weight.contiguous()
    rows = x.shape[0]
    out_rows = rows + pad
    q = x.new_empty((out_rows, cols), dtype=dtype) if rowwise else None
    q_t = x.new_empty((cols, out_rows), dtype=dtype) if colwise else None
    sdt = stats or stats_dtype(x, weight)
    mean = x.new_empty((rows, 1), dtype=sdt)
    rstd = x.new_empty((rows, 1), dtype=sdt)
    block_m, block_n, warps = tile
    dummy = _dummy(x.device)
    launch(_layernorm_cast_kernel, (ceil_div(out_rows, block_m),),
           (x, weight, dummy if bias is None else bias.contiguous(), q if rowwise else q_t, q_t if colwise else q,
            mean, rstd, scale, dummy if amax_out is None else amax_out, rows, cols, out_rows, eps, scale_index,
            amax_index),
           {"FMAX": fmax, "MBITS": mbits, "EMIN": emin, "HAS_BIAS": bias is not None, "RECORD": amax_out is not None,
            "ROWWISE": rowwise, "COLWISE": colwise, "BLOCK_M": block_m, "BLOCK_N": block_n}, warps)
    return q, q_t, mean, rstd
