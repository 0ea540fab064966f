"""The reference math of the native FP8 linears (``fp8.py``): the cast of one operand
(``_cast_math``, optionally of the GELU of the operand: the fused prologue of fc2, see
``fp8_prologue.py``) and the FP8 GEMM through ``torch._scaled_mm`` (``_scaled_mm``).
``fp8.py`` re-exports both; they live here to keep that file to the scaling state and the
linear's autograd function."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .compiled_math import CudaCompiled
from .fp8_gemm import check_layout
from .fp8_recipe import FP8_MAX

_MIN_AMAX = 1e-12  # an all-zero tensor gets a finite scale (its FP8 copy is zero anyway)


def _cast_math(t: torch.Tensor, scale: Optional[torch.Tensor], dtype: torch.dtype, pad: int,
               rowwise: bool, colwise: bool, gelu: bool = False):
    """Scale and cast of one 2-D operand: the reference math of every FP8 cast (the ``torch``
    casts: eager on CPU, compiled on CUDA; the Triton kernels give the same bytes).

    ``scale``: a 0-d fp32 tensor (delayed scaling), or None: current scaling, ``FP8_MAX /
    max(amax, 1e-12)`` from the tensor's own amax. ``pad`` zero rows are appended (they change
    neither the amax nor a product). Returns ``(q, q_t, 1/scale, amax)``: ``q`` the row-major
    FP8 copy (when ``rowwise``), ``q_t`` the FP8 copy of the transpose, row-major (when
    ``colwise``), which the GEMMs that contract over the rows need, and the tensor's amax.
    ``gelu``: cast ``F.gelu(t)`` (the erf form, rounded to ``t``'s dtype) instead of ``t``; the
    amax is that tensor's. Eagerly it holds one fp32 temporary (the amax is ``vector_norm(∞)``:
    allocates nothing) and, with ``gelu``, the GELU's output. An empty tensor (0 rows or 0
    columns) has amax 0, as in the C++ casts (``vector_norm(∞)`` refuses 0 elements)."""
    if gelu:
        t = F.gelu(t)
    fmax = FP8_MAX[dtype]
    if t.numel() == 0:
        current = torch.zeros((), dtype=torch.float32, device=t.device)
    else:
        current = torch.linalg.vector_norm(t, float("inf")).float()
    if scale is None:
        scale = fmax / current.clamp(min=_MIN_AMAX)
    rows = t.shape[0]
    scaled = t.new_empty((rows + pad, t.shape[1]), dtype=torch.float32)
    scaled[:rows].copy_(t)
    if pad:
        scaled[rows:].zero_()
    q = scaled.mul_(scale).clamp_(-fmax, fmax).to(dtype)
    q_t = q.t().contiguous() if colwise else None
    return (q if rowwise else None), q_t, scale.reciprocal(), current


# compiled on CUDA: one graph per (dtype, layouts, scaling) combination, whatever the layer sizes
_CAST = CudaCompiled(_cast_math)


def _cast(t, scale, dtype, pad=0, rowwise=True, colwise=False, gelu=False):
    """``_cast_math`` compiled on CUDA. ``gelu``: the GELU runs eagerly, then the compiled cast:
    traced into one graph with the cast, inductor drops the GELU's rounding to ``t``'s dtype (its
    ``emulate_precision_casts`` is off) and casts the unrounded values, other bytes than the
    unfused path's (seen with inductor on the CPU: 7727 of 524,288 bytes).

    ``t`` goes in detached: the cast is never differentiated (the FP8 linear is an autograd
    ``Function``), and a tensor that requires grad, or a view (``x.reshape``), would be guarded
    on and compiled as graphs of its own."""
    if gelu:
        t = F.gelu(t)
    return _CAST.on(t.device)(t.detach(), scale, dtype, pad, rowwise, colwise)


def _scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
               fast: bool = False) -> torch.Tensor:
    """``torch._scaled_mm`` with a bf16 output (``fast``: its ``use_fast_accum``, see
    ``fp8_recipe``), after the layout rule of cuBLASLt's FP8 GEMM (``fp8_gemm.check_layout``,
    on every device). On CPU it runs PyTorch's own kernel with oneDNN switched off for the call:
    oneDNN's FP8 GEMM took ~10 ms per call at our test sizes (~200× the reference kernel; torch
    2.13, project VM). ``fp8_gemm: cublaslt`` calls ``fp8_gemm.lt_mm`` instead."""
    check_layout(a, b, scale_a, scale_b)
    if a.device.type != "cpu":
        return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16,
                                use_fast_accum=fast)
    was = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16,
                                use_fast_accum=fast)
    finally:
        torch._C._set_mkldnn_enabled(was)
