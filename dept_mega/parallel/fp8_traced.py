"""FP8 linears traced into ``train.compile``'s compiled blocks (``fp8_recipe: current``).

The native FP8 linear of ``fp8.py`` (:func:`fp8.fp8_linear`) reads and writes Python state:
the delayed-scaling history and its ring position, the set of operands with a recorded amax,
the per-step weight cache, Triton launches, pointer checks, the gradient buffer. Dynamo cannot
trace that, so inside a compiled block each call is a graph break and runs eagerly (four per
block).

Current scaling needs none of it: each cast takes the amax of the tensor it casts. With that
recipe, under ``torch.compile``, the layers call :func:`fp8_linear_traced` instead (the rule is
:attr:`fp8.Fp8Recipe.traced_under_compile`, applied in ``layers._GemmMixin._matmul``): the same
FP8 linear written with tensor operations only, so that each compiled block is one graph
holding the casts and the ``torch._scaled_mm`` calls. Inductor can then fuse the amax
reductions and the casts with the elementwise work around them, and the host launches one
graph per block instead of a few dozen operations per linear.

The math is the eager path's: the casts are :func:`fp8._cast_math` itself (amax, ``scale =
FP8_MAX / max(amax, 1e-12)``, scaled in fp32, saturated, cast; the token dimension zero-padded
to a multiple of 16; the transposed copy where a GEMM contracts over the tokens) and the GEMMs
take the operand layouts of ``fp8._Fp8Linear`` (e4m3 forward, the recipe's gradient format in
the backward, bf16 outputs, gradients returned in the dtypes of ``x`` and the weight). Called
eagerly, and in graphs that run without inductor (AOT autograd alone), it gives the eager
path's bytes (``tests/test_fp8_compile.py``); inductor's fused kernels need not be bit for
bit. What differs from the eager path:

* The weight is cast on every call (no per-step cache: that is Python state). Weights do not
  change within a training step, so every call of a step casts the same bytes the cache would
  hold; the cost is one extra read of the weight per micro-batch.
* The weight gradient returns through autograd: ``param.grad``, which the gradient buffer's
  post-accumulate hook copies (first micro-batch) or adds (the others) into ``main_grad``, as
  for the compiled bf16 layers; the eager path hands it to ``GradBuffer.add_grad`` itself.
* ``torch._scaled_mm``'s layout rule (first operand row-major, second column-major) is checked
  when the graph is traced, not on every call, and the pointer-alignment check is left out
  (the graph's buffers are separate allocations). On the CPU the GEMM runs with the process's
  oneDNN setting (the eager path switches oneDNN off for each call, which a graph cannot do);
  the tests run compiled CPU models under ``torch.backends.mkldnn.flags(enabled=False)``.
"""
from __future__ import annotations

import torch

from .fp8 import _ALIGN, E4M3, _cast_math


def _gemm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor) -> torch.Tensor:
    """``torch._scaled_mm`` with a bf16 output; the operand layouts cuBLASLt needs are checked
    on the (fake) tensors of the trace, so a wrong layout fails when the graph is built."""
    if a.stride(1) != 1 or b.stride(0) != 1:
        raise ValueError(f"traced FP8 GEMM operands {tuple(a.shape)} strides {a.stride()} × {tuple(b.shape)} "
                         f"strides {b.stride()}: need a row-major first and a column-major second operand")
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)


class _TracedFp8Linear(torch.autograd.Function):
    """``y = xq · wq.t()``; ``dX = gq · wq_t.t()``; ``dW = gq_t · xq_t.t()`` (see ``fp8._Fp8Linear``).
    ``need_dx`` / ``need_dw``: which gradients the backward computes, so the forward makes only
    the transposed copies those GEMMs take (none under ``no_grad``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, grad_dtype: torch.dtype, need_dx: bool,
                need_dw: bool) -> torch.Tensor:
        out_features, in_features = weight.shape
        x2 = x.reshape(-1, in_features)
        rows = x2.shape[0]
        pad = (-rows) % _ALIGN
        xq, xq_t, x_inv, _ = _cast_math(x2, None, E4M3, pad, True, need_dw)
        wq, wq_t, w_inv, _ = _cast_math(weight, None, E4M3, 0, True, need_dx)
        y = _gemm(xq, wq.t(), x_inv, w_inv)
        ctx.save_for_backward(xq_t, x_inv, wq_t, w_inv)
        ctx.meta = (rows, pad, grad_dtype, x.dtype, weight.dtype, need_dx, need_dw)
        if pad:
            y = y[:rows]
        return y.reshape(*x.shape[:-1], out_features)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        xq_t, x_inv, wq_t, w_inv = ctx.saved_tensors
        rows, pad, grad_dtype, x_dtype, w_dtype, need_dx, need_dw = ctx.meta
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        gq, gq_t, g_inv, _ = _cast_math(g2, None, grad_dtype, pad, need_dx, need_dw)
        grad_x = grad_w = None
        if need_dx:  # dX [M, in] = dY [M, out] · W [out, in]
            grad_x = _gemm(gq, wq_t.t(), g_inv, w_inv)
            if pad:
                grad_x = grad_x[:rows]
            grad_x = grad_x.reshape(*grad_out.shape[:-1], wq_t.shape[0]).to(x_dtype)
        if need_dw:  # dW [out, in] = dYᵀ [out, M] · X [M, in]
            grad_w = _gemm(gq_t, xq_t.t(), g_inv, x_inv).to(w_dtype)
        return grad_x, grad_w, None, None, None


def fp8_linear_traced(x: torch.Tensor, weight: torch.Tensor, grad_dtype: torch.dtype) -> torch.Tensor:
    """``x Wᵀ`` through current-scaled FP8 GEMMs, written to be traced by ``torch.compile``
    (see the module docstring); bf16 output ``[..., out]``. ``grad_dtype``: the output
    gradient's FP8 format (``Fp8Recipe.grad_dtype``: e5m2 for ``hybrid``)."""
    grad = torch.is_grad_enabled()
    return _TracedFp8Linear.apply(x, weight, grad_dtype, grad and x.requires_grad, grad and weight.requires_grad)
