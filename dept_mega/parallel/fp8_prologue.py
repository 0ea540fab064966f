"""FP8 linears that fuse the producer of their input into its FP8 cast (``fp8_fused_casts``).

In a pre-norm block the QKV and fc1 inputs are a LayerNorm's output and the fc2 input is a
GELU's output. The FP8 linear would read that bf16 tensor once more just to cast it; here the
producer and the cast are one pass, as in Transformer Engine's ``LayerNormLinear`` /
``LayerNormMLP``: :meth:`Fp8State.norm_cast` (LayerNorm, then the cast) and
:meth:`Fp8State.cast` with ``gelu=True`` (GELU, then the cast). With the Triton or C++ casts
these are single kernels (LayerNorm only under a ready delayed scale: current scaling needs the
norm's amax before its cast, so it normalises, then casts); with the ``torch`` casts they are
the reference math, bit for bit what the unfused path computes.

A *prologue* is what the layer applies to its input before the GEMM (``ColumnParallelLinear``
/ ``RowParallelLinear``'s ``forward(x, prologue)``): any callable. One is fusable when it says
so through ``fp8_prologue`` (``"layernorm"``: it has ``weight``, ``bias`` (or None) and
``eps``, as the model's ``Norm`` with LayerNorm; ``"gelu"``: :data:`GELU`); the layer decides
whether to fuse (``_GemmMixin._fuses``), and otherwise calls the prologue and runs its usual
path, so a layer without FP8, a compiled block or an RMSNorm / SwiGLU model compute exactly
what they did before. A fused prologue's module forward (and so any hook on it) does not run.

:class:`_Fp8PrologueLinear` saves the prologue's input (GELU: ``h``; LayerNorm: ``x``, ``mean``,
``rstd`` and the norm's parameters) and what ``_Fp8Linear`` saves (the input's transposed FP8
copy and the weight's FP8 operands). Its backward is ``_Fp8Linear``'s (``fp8.linear_grads``:
the dgrad GEMM gives the gradient of the prologue's output; the weight gradient goes where
``_Fp8Linear`` puts it) followed by ``aten.gelu_backward`` or
``aten.native_layer_norm_backward`` (the input's gradient and the norm's weight/bias gradients):
the ops autograd runs for the unfused prologue, on the same tensors. A GELU whose ``upstream``
linear's output-gradient cast is fused (``fp8_dgelu.py``) casts its backward's result for that
linear in the same pass, where that cast can be one pass.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from . import fp8
from .fp8 import _ALIGN, E4M3, INPUT, Fp8Layer, linear_gemm, linear_grads
from .fp8_dgelu import fused_gelu_backward
from .fp8_gemm import direct_op


class Gelu:
    """The erf GELU (``F.gelu``, ``approximate='none'``) as a linear's prologue: fc2's input
    (``model/layers.py`` ``MLP``). ``upstream``: the linear whose output the GELU reads (fc1), when
    that linear's output-gradient cast is fused into this GELU's backward (``fp8_dgelu.py``: its
    ``fp8_layer`` receives the FP8 copies), else None; :data:`GELU` is the instance without."""

    fp8_prologue = "gelu"
    __slots__ = ("upstream",)

    def __init__(self, upstream=None) -> None:
        self.upstream = upstream

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x)

    def __repr__(self) -> str:
        return "Gelu()" if self.upstream is None else "Gelu(upstream's output gradient cast fused)"


GELU = Gelu()


# the producers' backward ops, their overloads' C++ callables resolved once (fp8_gemm.direct_op)
_GELU_BACKWARD = direct_op(torch.ops.aten.gelu_backward.default)
_LN_BACKWARD = direct_op(torch.ops.aten.native_layer_norm_backward.default)


class _Fp8PrologueLinear(torch.autograd.Function):
    """``prologue(x) Wᵀ`` through the FP8 GEMMs with the prologue fused into the input's cast.
    ``eps`` None: GELU (``norm_weight``, ``norm_bias`` None; ``up``: the FP8 layer whose output
    the GELU reads when its output-gradient cast is fused into the GELU's backward, ``fp8_dgelu.py``,
    else None); otherwise LayerNorm with ``norm_weight`` and ``norm_bias`` (or None)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, norm_weight: Optional[torch.Tensor],
                norm_bias: Optional[torch.Tensor], layer: Fp8Layer, grad: bool, eps: Optional[float],
                up: Optional[Fp8Layer] = None) -> torch.Tensor:
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        rows = x2.shape[0]
        pad = (-rows) % _ALIGN
        needs = ctx.needs_input_grad
        # the dgrad GEMM whenever anything before the GEMM (x, the norm's parameters) needs a gradient
        need_dx = grad and (needs[0] or needs[2] or needs[3])
        need_dw = grad and needs[1]
        state = layer.state
        contexts = fp8._host_contexts("dept_mega::fp8_prologue_linear_forward", x.device.type)
        try:
            if eps is None:
                xq, xq_t, x_inv = state.cast(x2, layer.index, INPUT, E4M3, pad, colwise=need_dw, gelu=True)
                stats = (None, None)
            else:
                xq, xq_t, x_inv, mean, rstd = state.norm_cast(x2, norm_weight, norm_bias, eps, layer.index, pad,
                                                              colwise=need_dw)
                stats = (mean, rstd)
            y, w = linear_gemm(ctx, x, xq, x_inv, weight, layer, rows, pad, need_dx)
        finally:
            if contexts is not None:
                contexts.close()
        if grad:  # nothing saved under no_grad (evaluation)
            ctx.save_for_backward(xq_t, x_inv, w.dgrad, w.inv, x, *stats, norm_weight, norm_bias)
        ctx.eps, ctx.up = eps, up
        return y

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        xq_t, x_inv, w_dgrad, w_inv, x, mean, rstd, norm_weight, norm_bias = ctx.saved_tensors
        needs = ctx.needs_input_grad
        need_dx = needs[0] or needs[2] or needs[3]
        grad_u, grad_w = linear_grads(ctx, grad_out, xq_t, x_inv, w_dgrad, w_inv, need_dx, needs[1])
        grad_x = grad_nw = grad_nb = None
        if need_dx:
            if ctx.eps is None:  # d/dh of gelu(h), as GeluBackward0 (with up's cast of it: fp8_dgelu.py)
                grad_x = None if ctx.up is None else fused_gelu_backward(grad_u, x, ctx.up)
                if grad_x is None:
                    grad_x = _GELU_BACKWARD(grad_u, x)
            else:  # as NativeLayerNormBackward0, on the 2-D view the forward normalised
                h = x.shape[-1]
                flat = x.dim() == 2  # no reshape or view dispatched that would change nothing (host time)
                grad_x, grad_nw, grad_nb = _LN_BACKWARD(
                    grad_u if flat else grad_u.reshape(-1, h), x if flat else x.reshape(-1, h), [h], mean, rstd,
                    norm_weight, norm_bias, [needs[0], needs[2], needs[3]])
                if grad_x is not None and not flat:
                    grad_x = grad_x.view(x.shape)
        return grad_x, grad_w, grad_nw, grad_nb, None, None, None, None


# ``_Fp8PrologueLinear``'s C++ apply, called directly when no functorch transform is active, as
# ``fp8.fp8_linear_eager`` calls ``_Fp8Linear``'s (the same node and results, without
# ``Function.apply``'s Python wrapper); None where this torch lays ``Function.apply`` out otherwise
_APPLY = fp8.direct_apply(_Fp8PrologueLinear)


def fp8_prologue_linear(x: torch.Tensor, weight: torch.Tensor, layer: Fp8Layer, prologue) -> torch.Tensor:
    """``prologue(x) Wᵀ`` through the FP8 GEMMs, the prologue (``prologue.fp8_prologue``:
    ``"gelu"`` | ``"layernorm"``) fused into the cast of the GEMM's input (the module docstring).
    Eager only: the layers call it outside compiled graphs (never traced by Dynamo)."""
    kind = prologue.fp8_prologue
    up = None
    if kind == "gelu":
        nw = nb = eps = None
        upstream = getattr(prologue, "upstream", None)
        up = None if upstream is None else upstream.fp8_layer
    elif kind == "layernorm":
        nw, nb, eps = prologue.weight, prologue.bias, prologue.eps
    else:
        raise ValueError(f"fp8_prologue_linear: no fused cast for a {kind!r} prologue")
    grad = torch.is_grad_enabled()
    if _APPLY is None or fp8._transforms_active():
        return _Fp8PrologueLinear.apply(x, weight, nw, nb, layer, grad, eps, up)
    unwrap = fp8._unwrap_if_dead  # what Function.apply does to its tensor arguments, then its C++ apply
    return _APPLY(unwrap(x), unwrap(weight), None if nw is None else unwrap(nw), None if nb is None else unwrap(nb),
                  layer, grad, eps, up)
