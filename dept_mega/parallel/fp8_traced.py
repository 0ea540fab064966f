"""FP8 linears traced into ``train.compile``'s compiled blocks (both ``fp8_recipe`` values).

The native FP8 linear of ``fp8.py`` (:func:`fp8.fp8_linear`) reads and writes Python state:
the delayed-scaling history and its ring position, the set of operands with a recorded amax,
the per-step weight cache, Triton launches, pointer checks, the gradient buffer. Dynamo cannot
trace that: inside a compiled block each call would be a graph break and run eagerly (four
per block).

Under ``torch.compile`` the layers call :func:`fp8_linear_traced` instead
(``layers._GemmMixin._matmul``): the same FP8 linear written with tensor operations only (and
a few Python facts Dynamo guards on or replays), so that each compiled block is one graph
holding the casts and the ``torch._scaled_mm`` calls. Inductor can then fuse the amax
reductions and the casts with the elementwise work around them, and the host launches one
graph per block instead of a few dozen operations per linear.

Current scaling needs no state: each cast takes the amax of the tensor it casts. Delayed
scaling (inside a training step; evaluations and calls outside a step use current scaling, as
eagerly) keeps its state in tensors fixed for the step and in Python facts that change at
most once:

* the scales: the layer's view of ``Fp8State.scale`` (computed when the step opens), read by
  the casts of the operands that have a history. Which those are (``Fp8Layer.ready``) is a
  Python fact the graph is specialised on (Dynamo guards on it): it flips after the first
  training step, so each block compiles once more then, and not again.
* the amaxes: the forward maxes the input's and the weight's into the layer's ``amax``, the
  backward the output gradient's into its ``grad_amax`` (a tensor of its own, which the
  forward does not touch: AOT autograd keeps a data mutation of such a graph input in the
  backward graph). ``Fp8State.end_step`` writes both into the history row, so the graphs do
  not depend on the ring position.
* the host bookkeeping (which operands were recorded this step): the layer's flags
  ``recorded_fwd`` and ``recorded_grad``, the ones the eager casts set, set here by the traced
  call: an attribute write is a side effect Dynamo replays after each run of the graph (adding
  to a set inside the graph would not be replayed the same way). The gradient's is set in the
  forward (a backward's Python side effects are not replayed): inside a training step every
  forward that builds a graph is followed by its backward.

The math is the eager path's: the casts are :func:`fp8._cast_math` itself (amax, ``scale =
FP8_MAX / max(amax, 1e-12)``, scaled in fp32, saturated, cast; the token dimension zero-padded
to a multiple of 16; the transposed copy where a GEMM contracts over the tokens) and the GEMMs
take the operand layouts of ``fp8._Fp8Linear`` (e4m3 forward, the recipe's gradient format in
the backward, bf16 outputs, gradients returned in the dtypes of ``x`` and the weight). With
``fp8_casts: triton`` (``Fp8State.graph_casts``) each cast is instead one opaque node, the
``dept_mega::fp8_cast`` operator (``fp8_cast_op.py``: the one-pass Triton kernel on CUDA, the
same bytes; ``_cast_math`` itself on the CPU), which inductor calls rather than splits. Called
eagerly, and in graphs that run without inductor (AOT autograd alone), it gives the eager
path's bytes (``tests/test_fp8_compile.py``); inductor's fused kernels need not be bit for
bit. What differs from the eager path:

* The weight is cast on every call (no per-step cache: that is Python state). Weights do not
  change within a training step, so every call of a step casts the same bytes the cache would
  hold (and maxes the same amax into the step's); the cost is one extra read of the weight
  per micro-batch.
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

from typing import Optional

import torch

from .fp8 import _ALIGN, E4M3, GRAD, INPUT, WEIGHT, Fp8Layer, _cast_math
from .fp8_cast_op import fp8_cast
from .fp8_recipe import Fp8Recipe

_DEFAULT_FAST = Fp8Recipe().fast_gemms  # a call without a layer: the default recipe's GEMMs


def _cast(op: bool, t: torch.Tensor, scale: Optional[torch.Tensor], operand: int, ready: bool, dtype: torch.dtype,
          pad: int, rowwise: bool, colwise: bool):
    """One cast of ``operand``: ``(q, q_t, 1/scale, amax)``; the step's ``scale[operand]`` when
    ``ready``, else current scaling. ``op``: through the ``dept_mega::fp8_cast`` operator (one
    opaque node: the Triton kernel on CUDA), else ``_cast_math`` (inductor's own kernels)."""
    if op:
        return fp8_cast(t, scale if ready else None, operand, dtype, pad, rowwise, colwise)
    return _cast_math(t, scale[operand] if ready else None, dtype, pad, rowwise, colwise)


def _gemm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
          fast: bool) -> torch.Tensor:
    """``torch._scaled_mm`` with a bf16 output (``fast``: ``use_fast_accum``); the operand layouts cuBLASLt needs are checked
    on the (fake) tensors of the trace, so a wrong layout fails when the graph is built."""
    if a.stride(1) != 1 or b.stride(0) != 1:
        raise ValueError(f"traced FP8 GEMM operands {tuple(a.shape)} strides {a.stride()} × {tuple(b.shape)} "
                         f"strides {b.stride()}: need a row-major first and a column-major second operand")
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16, use_fast_accum=fast)


class _TracedFp8Linear(torch.autograd.Function):
    """``y = xq · wq.t()``; ``dX = gq · wq_t.t()``; ``dW = gq_t · xq_t.t()`` (see ``fp8._Fp8Linear``).
    ``need_dx`` / ``need_dw``: which gradients the backward computes, so the forward makes only
    the transposed copies those GEMMs take (none under ``no_grad``).

    Delayed scaling (``scale``, ``amax`` the layer's ``scale`` and ``grad_amax``, ``ready``
    which operands take the step's scale; None and current scaling otherwise): the casts of
    ready operands use ``scale[operand]``, the others
    their own amax. The forward returns the input's and the weight's amaxes (recorded by the
    caller into the layer's ``amax``, outside this function); the backward maxes the output
    gradient's amax into ``amax[GRAD]`` itself (a data mutation of a forward input that needs no
    gradient and that the forward leaves alone, which AOT autograd keeps in the backward graph)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, grad_dtype: torch.dtype, need_dx: bool,
                need_dw: bool, op: bool, fast: tuple, scale=None, amax=None, ready=(False, False, False)):
        out_features, in_features = weight.shape
        x2 = x.reshape(-1, in_features)
        rows = x2.shape[0]
        pad = (-rows) % _ALIGN
        xq, xq_t, x_inv, x_amax = _cast(op, x2, scale, INPUT, ready[INPUT], E4M3, pad, True, need_dw)
        wq, wq_t, w_inv, w_amax = _cast(op, weight, scale, WEIGHT, ready[WEIGHT], E4M3, 0, True, need_dx)
        y = _gemm(xq, wq.t(), x_inv, w_inv, fast[0])
        ctx.save_for_backward(xq_t, x_inv, wq_t, w_inv)
        ctx.meta = (rows, pad, grad_dtype, x.dtype, weight.dtype, need_dx, need_dw, ready[GRAD], op, fast)
        ctx.delayed = (scale, amax) if amax is not None else None
        if pad:
            y = y[:rows]
        y = y.reshape(*x.shape[:-1], out_features)
        if amax is None:
            return y
        ctx.mark_non_differentiable(x_amax, w_amax)
        return y, x_amax, w_amax

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor, *amax_grads):
        xq_t, x_inv, wq_t, w_inv = ctx.saved_tensors
        rows, pad, grad_dtype, x_dtype, w_dtype, need_dx, need_dw, g_ready, op, fast = ctx.meta
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        scale = ctx.delayed[0] if ctx.delayed is not None else None
        gq, gq_t, g_inv, g_amax = _cast(op, g2, scale, GRAD, scale is not None and g_ready, grad_dtype, pad,
                                        need_dx, need_dw)
        if ctx.delayed is not None:  # the gradient's amax, recorded where it exists: here
            amax = ctx.delayed[1]
            amax[GRAD].copy_(torch.maximum(amax[GRAD], g_amax))
        grad_x = grad_w = None
        if need_dx:  # dX [M, in] = dY [M, out] · W [out, in]
            grad_x = _gemm(gq, wq_t.t(), g_inv, w_inv, fast[1])
            if pad:
                grad_x = grad_x[:rows]
            grad_x = grad_x.reshape(*grad_out.shape[:-1], wq_t.shape[0]).to(x_dtype)
        if need_dw:  # dW [out, in] = dYᵀ [out, M] · X [M, in]
            grad_w = _gemm(gq_t, xq_t.t(), g_inv, x_inv, fast[2]).to(w_dtype)
        return grad_x, grad_w, None, None, None, None, None, None, None, None


def fp8_linear_traced(x: torch.Tensor, weight: torch.Tensor, grad_dtype: torch.dtype,
                      layer: Optional[Fp8Layer] = None, casts: Optional[str] = None) -> torch.Tensor:
    """``x Wᵀ`` through FP8 GEMMs, written to be traced by ``torch.compile`` (see the module
    docstring); bf16 output ``[..., out]``. ``grad_dtype``: the output gradient's FP8 format
    (``Fp8Recipe.grad_dtype``: e5m2 for ``hybrid``). ``layer``: the layer's :class:`Fp8Layer`;
    inside a delayed-scaling training step its state's scales are used and its amaxes recorded,
    otherwise (or without it) current scaling; the GEMMs' fast accumulation is its recipe's
    (without it the default recipe's). ``casts``: ``triton`` (the casts as the
    ``dept_mega::fp8_cast`` operator, ``fp8_cast_op.py``) | ``torch`` (``_cast_math``, decomposed
    by the compiler); None: the state's ``graph_casts`` (``torch`` without a layer)."""
    grad = torch.is_grad_enabled()
    need_dx, need_dw = grad and x.requires_grad, grad and weight.requires_grad
    state = layer.state if layer is not None else None
    if casts is None:
        casts = state.graph_casts if state is not None else "torch"
    if casts not in ("triton", "torch"):
        raise ValueError(f"traced FP8 casts {casts!r} are not one of triton | torch")
    op = casts == "triton"
    fast = state.fast_gemms if state is not None else _DEFAULT_FAST
    if state is None or not state._record:
        return _TracedFp8Linear.apply(x, weight, grad_dtype, need_dx, need_dw, op, fast)
    y, x_amax, w_amax = _TracedFp8Linear.apply(x, weight, grad_dtype, need_dx, need_dw, op, fast, layer.scale,
                                               layer.grad_amax, layer.ready)
    amax = layer.amax
    with torch.no_grad():  # the forward operands' amaxes into the step's (as the eager casts do)
        amax[INPUT].copy_(torch.maximum(amax[INPUT], x_amax))
        amax[WEIGHT].copy_(torch.maximum(amax[WEIGHT], w_amax))
    layer.recorded_fwd = True  # host bookkeeping, replayed by Dynamo after each run of the graph
    if y.requires_grad:
        layer.recorded_grad = True  # a training step's backward follows (its amax is recorded there)
    return y
