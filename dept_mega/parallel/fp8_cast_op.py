"""The FP8 cast as one opaque operator, ``dept_mega::fp8_cast``, for the compiled graphs.

The traced FP8 linear (``fp8_traced.py``) writes its casts as :func:`fp8._cast_math` by
default, which inductor decomposes: a reduction kernel for the amax (recomputing the
elementwise producer, e.g. a GELU, just to take its max) and pointwise kernels for the cast
and the transposed copy, each reading the large tensor again. The Triton kernel of
``fp8_kernels.py`` does the amax, the cast and both layouts in one pass. Registered as a
functional custom operator, it is a single node of the graph (Dynamo and AOT autograd trace
it through its fake implementation; inductor calls it as an extern kernel and does not look
inside). Selected by ``fp8_casts: triton`` (``Fp8State.graph_casts``).

The operator mutates nothing: the amax is a fresh 0-d output (a zero tensor the kernel maxes
into), which the traced linear maxes into the layer's amax outside the operator, as it does
with ``_cast_math``'s. Implementations:

* CUDA: :func:`fp8_kernels.cast_fp8` for bf16/fp16 inputs (one launch for delayed scaling, two
  for current scaling: the partial maxima, then the cast; plus the zero fill of the amax and,
  under delayed scaling, the reciprocal of the scale); fp32 inputs take the reference math,
  as ``Fp8State.cast`` routes them.
* everything else (the CPU): the reference math, ``_cast_math`` itself, so the CPU results
  are those of the ``torch`` casts bit for bit.

The outputs are ``_cast_math``'s as the traced linear uses them: ``(q, q_t, inv, amax)``, with
``inv`` the reciprocal of the scale computed by ``torch.reciprocal`` in both scalings (under
delayed scaling ``cast_fp8`` returns None for it, so the CUDA implementation computes it as
``_cast_math`` does). A custom operator cannot return None: a layout that was not asked for is
an empty placeholder (``shape (0,)``, the FP8 dtype); :func:`fp8_cast` maps it back to None.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import fp8_kernels
from .fp8 import _cast_math


def _placeholder(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.new_empty((0,), dtype=dtype)


def _reference(t, scale, scale_index, dtype, pad, rowwise, colwise):
    q, q_t, inv, amax = _cast_math(t, None if scale is None else scale[scale_index], dtype, pad, rowwise, colwise)
    return (_placeholder(t, dtype) if q is None else q, _placeholder(t, dtype) if q_t is None else q_t, inv, amax)


@torch.library.custom_op("dept_mega::fp8_cast", mutates_args=())
def _fp8_cast_op(t: torch.Tensor, scale: Optional[torch.Tensor], scale_index: int, dtype: torch.dtype,
                 pad: int, rowwise: bool, colwise: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference math (every device without a kernel of its own: the CPU)."""
    return _reference(t, scale, scale_index, dtype, pad, rowwise, colwise)


@_fp8_cast_op.register_kernel("cuda")
def _fp8_cast_cuda(t, scale, scale_index, dtype, pad, rowwise, colwise):
    """The one-pass Triton cast (bf16/fp16 inputs, Triton installed), else the reference math."""
    if not fp8_kernels.AVAILABLE or t.dtype not in fp8_kernels.INPUT_DTYPES:
        return _reference(t, scale, scale_index, dtype, pad, rowwise, colwise)
    amax = torch.zeros((), dtype=torch.float32, device=t.device)
    q, q_t, inv = fp8_kernels.cast_fp8(t, dtype, pad, rowwise, colwise, scale=scale, scale_index=scale_index,
                                       amax_out=amax, amax_index=0)
    if inv is None:  # delayed scaling: the kernel returns no 1/scale (the eager caller has it)
        inv = scale[scale_index].reciprocal()
    return (_placeholder(t, dtype) if q is None else q, _placeholder(t, dtype) if q_t is None else q_t,
            inv, amax)


@_fp8_cast_op.register_fake
def _fp8_cast_fake(t, scale, scale_index, dtype, pad, rowwise, colwise):
    if t.dim() != 2:
        raise ValueError(f"dept_mega::fp8_cast takes a 2-D tensor, got shape {tuple(t.shape)}")
    rows, cols = t.shape
    q = t.new_empty((rows + pad, cols), dtype=dtype) if rowwise else _placeholder(t, dtype)
    q_t = t.new_empty((cols, rows + pad), dtype=dtype) if colwise else _placeholder(t, dtype)
    return q, q_t, t.new_empty((), dtype=torch.float32), t.new_empty((), dtype=torch.float32)


def fp8_cast(t: torch.Tensor, scale: Optional[torch.Tensor], scale_index: int, dtype: torch.dtype, pad: int,
             rowwise: bool, colwise: bool):
    """``_cast_math(t, scale[scale_index] or None, dtype, pad, rowwise, colwise)`` through the
    operator: ``(q or None, q_t or None, 1/scale, amax)``."""
    q, q_t, inv, amax = torch.ops.dept_mega.fp8_cast(t, scale, scale_index, dtype, pad, rowwise, colwise)
    return (q if rowwise else None), (q_t if colwise else None), inv, amax
