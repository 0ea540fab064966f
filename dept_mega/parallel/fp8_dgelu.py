"""fc1's output-gradient cast fused into fc2's GELU backward (``fp8_fused_casts``, the ``dgelu``
producer of ``model/fused_casts.py``).

In the MLP (fc1 -> GELU -> fc2, fc2's GELU fused into its input's cast: ``fp8_prologue.py``) fc2's
backward computes ``dH = gelu_backward(dU, h)``, the gradient of fc1's output, and fc1's backward
(``fp8.linear_grads``) then casts dH to FP8 (row-major for its input-gradient GEMM, transposed for
its weight-gradient GEMM): two bandwidth-bound passes over the ``[tokens, ffn]`` gradient, back to
back. Fused (as Transformer Engine's ``LayerNormMLP`` does), fc2's backward computes dH and its FP8
copies in one pass (``fp8_casts.dgelu_cast_fp8`` with the C++ casts; with the ``torch`` casts the
same two steps as unfused, one after the other: the same math) and hands the copies to fc1's
backward. dH itself is still written: it is what autograd hands to fc1, so every consumer of the
gradient sees what it saw unfused.

The handoff is safe by construction:

* fc2's backward fuses only where fc1's cast would be one pass with a known scale: a training step
  under delayed scaling whose scale of fc1's output gradient is ready (recorded in an earlier
  step), with the ``cuda`` (bf16 / fp16) or ``torch`` casts; otherwise (current scaling, the first
  step, an evaluation, the Triton casts) it runs ``gelu_backward`` and fc1 casts as unfused.
* The fused cast records dH's amax in fc1's output-gradient slot, as fc1's cast of dH would, and
  leaves the copies, with dH itself, on fc1's ``Fp8Layer.handoff``.
* fc1's ``linear_grads`` takes them only if the gradient it receives IS that dH: the same address,
  shape, strides and version counter (nothing between the two linears changes the model's
  gradient: fc1's bias add hands it over as it is), and only for the layouts it needs; else it
  casts as usual. Either way the handoff is dropped (one use; a step's close drops any left).
  While held, dH cannot be freed, so no other tensor can have its address. Where it is not taken,
  dH's amax stays recorded beside that of the gradient fc1 casts (a larger or equal scale window:
  never the case in the model).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from . import fp8_casts, fp8_kernels
from .fp8 import _ALIGN, GRAD, Fp8Layer
from .fp8_gemm import direct_op

_GELU_BACKWARD = direct_op(torch.ops.aten.gelu_backward.default)


class Handoff:
    """The FP8 copies ``q`` / ``q_t`` (and ``1/scale`` ``inv``) of ``dh``, the 2-D output gradient
    of the layer that holds this (``Fp8Layer.handoff``), made by the producer of that gradient."""

    __slots__ = ("dh", "key", "q", "q_t", "inv")

    def __init__(self, dh: torch.Tensor, q: Optional[torch.Tensor], q_t: Optional[torch.Tensor],
                 inv: torch.Tensor) -> None:
        self.dh, self.q, self.q_t, self.inv = dh, q, q_t, inv
        self.key = (dh.data_ptr(), dh.shape, dh.stride(), dh._version)

    def take(self, g2: torch.Tensor, out_rows: int, need_dx: bool, need_dw: bool):
        """``(q, q_t, inv)`` for the cast of ``g2`` (``out_rows`` = its rows + pad) when ``g2`` is
        ``dh`` unchanged and the copies are the layouts needed; else None (the caller casts)."""
        if (g2.data_ptr(), g2.shape, g2.stride(), g2._version) != self.key:
            return None
        if (need_dx and self.q is None) or (need_dw and self.q_t is None):
            return None
        if (self.q.shape[0] if self.q is not None else self.q_t.shape[1]) != out_rows:
            return None
        return self.q, self.q_t, self.inv


@functools.lru_cache(maxsize=None)
def _op():
    """``dept_mega::dgelu_cast_fp8``'s overload, resolved once (the extension is loaded by then:
    the ``cuda`` casts were resolved)."""
    return direct_op(fp8_casts.dgelu_op())


def fused_gelu_backward(grad_u: torch.Tensor, h: torch.Tensor, up: Fp8Layer) -> Optional[torch.Tensor]:
    """``gelu_backward(grad_u, h)`` (the gradient of ``h``, the output of the FP8 linear ``up``)
    with its FP8 copies for ``up``'s backward made in the same pass and left on ``up.handoff``
    (the module docstring); None where the cast cannot be fused (then nothing was done)."""
    state = up.state
    kernels = state.kernels
    if not (state._record and up.ready[GRAD]) or kernels not in ("cuda", "torch"):
        return None
    if kernels == "cuda" and (grad_u.dtype not in fp8_kernels.INPUT_DTYPES or h.dtype != grad_u.dtype):
        return None
    flat = grad_u.dim() == 2
    g2 = grad_u if flat else grad_u.reshape(-1, grad_u.shape[-1])
    h2 = h if h.dim() == 2 else h.reshape(-1, h.shape[-1])
    rows = g2.shape[0]
    pad = (-rows) % _ALIGN
    if kernels == "cuda":  # one kernel: dh, both copies, the amax into up's slot
        col = 3 * up.index + GRAD
        up.recorded_grad = True
        dh, q, q_t = _op()(g2, h2, state.grad_dtype, pad, True, True, state.scale, col, up.grad_amax, GRAD)
        inv = state._inv_views[col]
    else:  # the reference: the unfused path's two steps, one after the other
        dh = _GELU_BACKWARD(g2, h2)
        q, q_t, inv = state.cast(dh, up.index, GRAD, state.grad_dtype, pad, rowwise=True, colwise=True)
    up.handoff = Handoff(dh, q, q_t, inv)
    return dh if flat else dh.view(grad_u.shape)
