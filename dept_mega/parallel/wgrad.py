"""Gradient-accumulation fusion (``optim.grad_accum_fusion``; Megatron's
``--gradient-accumulation-fusion``, without apex).

Without it, autograd materialises every micro-batch's weight gradient ``dYᵀ·X`` of a linear
layer in ``param.grad`` (the weights' dtype) and the gradient buffer's hook then copies or adds
it into ``param.main_grad`` (``grad_buffer.py``). With it, :func:`linear` runs ``y = x Wᵀ + b``
through :class:`FusedWgradLinear`, whose backward computes that GEMM straight into
``main_grad`` (accumulating, beta = 1) and returns no weight gradient, so ``param.grad`` is
never allocated and the extra copy/add kernels disappear. The buffer is zeroed when a step
begins, so the first micro-batch's accumulation equals the copy the hook would make.

Decided in backward, per weight: only when the weight's gradient currently goes to an active
gradient buffer (``grad_owner(weight)`` with its storage allocated and a step begun: inside
``Trainer.train_step``) — then :meth:`GradBuffer.arrive` adds it and does the same
bookkeeping as the hook (count, bucket pending, data-parallel reduction launch). Otherwise
(evaluation with gradients, a model used outside the trainer, SPEC's stored sources whose
buffers are released) the weight gradient is returned to autograd as usual.

The accumulation itself (:func:`wgrad_call` picks one; the run log's ``backends:`` line says
which):

* CUDA, fp32 ``main_grad``, bf16/fp16 operands: ``torch.addmm(main_grad, a, b,
  out_dtype=torch.float32, out=main_grad)`` — one cuBLAS GEMM with fp32 output and beta = 1
  (``aten::addmm.dtype_out``, CUDA only). ``_addmm_dtype_out_cuda`` accepts an addend in
  ``out_dtype`` since pytorch/pytorch#167931 (Nov. 2025); ``out`` aliasing ``self`` is fine
  (``addmm_out_cuda_impl`` copies ``self`` into ``out`` first, a no-op on the same tensor).
  The first use on a device checks it on a small product; a torch that rejects it uses
  ``torch.mm(a, b, out_dtype=torch.float32)`` and an fp32 add instead (same math, one extra
  pass over the gradient), and says so in the log.
* ``main_grad`` in the operands' dtype (fp32 weights; bf16 weights with a bf16 buffer):
  ``main_grad.addmm_(a, b)``.
* elsewhere (CPU) with bf16/fp16 operands and an fp32 buffer (``aten::addmm.dtype`` exists only
  on CUDA): ``main_grad.addmm_(a.float(), b.float())`` — fp32 accumulation of the half-precision
  values, the same math as the fused GEMM up to summation order.

``train.compile``: the backward reads and changes Python state (is a buffer active, its counts,
the bucket's launch of a collective), which Dynamo does not re-evaluate faithfully once traced
(tried on torch 2.13 with ``aot_eager``: traced, the second step raised the buffer's "arrived
after its bucket's data-parallel reduction started" error), and a custom op cannot return "no
gradient". So inside a compiled transformer block a fused linear is left out of the graph
(:func:`_fused_outside_graph`, ``compile_guard.outside_compiled_graphs``): Dynamo breaks the block's graph
around it and the layer runs eagerly, forward and backward, while the code between the linear
layers (norms, residual adds, activation, attention) stays compiled. Whether those graph breaks
cost more than the fusion saves is measured on the device (``optim.grad_accum_fusion: false``
keeps each block one graph, with the hook path).
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Optional

import torch
import torch.nn.functional as F

from ..compile_guard import outside_compiled_graphs


def grad_owner(p: torch.nn.Parameter) -> Optional[Any]:
    """The gradient buffer (``grad_buffer.GradBuffer``) that currently receives ``p``'s
    gradients; None: plain autograd. The layers ask it in their backward; a buffer claims its
    parameters with :func:`set_grad_owner`."""
    ref = getattr(p, "_grad_owner", None)
    return ref() if ref is not None else None


def set_grad_owner(p: torch.nn.Parameter, owner: Any) -> None:
    """Make ``owner`` the destination of ``p``'s gradients (held weakly: a released buffer
    owns nothing)."""
    p._grad_owner = weakref.ref(owner)


_HALF = (torch.bfloat16, torch.float16)

PATHS = {
    "addmm_out_dtype": "torch.addmm(out_dtype=fp32, out=main_grad): one GEMM accumulating in fp32",
    "mm_out_dtype_add": "torch.mm(out_dtype=fp32) + add into main_grad (this torch's addmm.dtype_out "
                        "rejects an fp32 addend)",
    "addmm_": "main_grad.addmm_ (one GEMM)",
    "addmm_fp32_operands": "main_grad.addmm_ on fp32 copies of the half-precision operands "
                           "(aten::addmm.dtype is CUDA-only)",
}


@functools.lru_cache(maxsize=None)
def _fused_addmm_ok(device: str, dtype: torch.dtype) -> bool:
    """Whether this torch's ``addmm.dtype_out`` accumulates half-precision products into an fp32
    tensor that is both the addend and the output (checked once per device on a small product)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-3, 4, (24, 40), generator=g).to(device, dtype)
    b = torch.randint(-3, 4, (40, 16), generator=g).to(device, dtype)
    c = torch.randint(-3, 4, (24, 16), generator=g).to(device, torch.float32)
    want = c + a.float() @ b.float()
    try:
        torch.addmm(c, a, b, out_dtype=torch.float32, out=c)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return bool(torch.equal(c, want))


@functools.lru_cache(maxsize=None)
def wgrad_call(device: torch.device, operands: torch.dtype, main: torch.dtype) -> str:
    """The accumulation of ``operands``-dtype weight-gradient GEMMs into a ``main``-dtype buffer
    on ``device``: a key of :data:`PATHS`."""
    device = torch.device(device)
    if operands == main:
        return "addmm_"
    if main == torch.float32 and operands in _HALF:
        if device.type == "cuda":
            return "addmm_out_dtype" if _fused_addmm_ok(str(device), operands) else "mm_out_dtype_add"
        return "addmm_fp32_operands"
    raise ValueError(f"optim.grad_accum_fusion: no accumulation of {operands} weight gradients into a {main} "
                     f"gradient buffer")


def add_wgrad(main_grad: torch.Tensor, grad_out: torch.Tensor, inp: torch.Tensor) -> None:
    """``main_grad [out, in] += grad_outᵀ · inp`` for ``grad_out [n, out]``, ``inp [n, in]``."""
    a, b = grad_out.t(), inp
    kind = wgrad_call(main_grad.device, a.dtype, main_grad.dtype)
    if kind == "addmm_out_dtype":
        torch.addmm(main_grad, a, b, out_dtype=torch.float32, out=main_grad)
    elif kind == "addmm_":
        main_grad.addmm_(a, b)
    elif kind == "mm_out_dtype_add":
        main_grad.add_(torch.mm(a, b, out_dtype=torch.float32))
    else:
        main_grad.addmm_(a.float(), b.float())


def accumulate_or_return_wgrad(param: torch.nn.Parameter, g2: torch.Tensor, x2: torch.Tensor) -> Optional[torch.Tensor]:
    """The weight gradient ``g2ᵀ · x2`` of ``param``: added into its active gradient buffer
    (returns None), else returned for autograd (see the module doc)."""
    owner = grad_owner(param)
    if owner is not None and owner.active:
        owner.arrive(param, lambda main: add_wgrad(main, g2, x2))
        return None
    return g2.t().mm(x2)


class FusedWgradLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` whose backward accumulates the weight gradient into the
    weight's active gradient buffer (see module doc); dX and the bias gradient as usual."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        # the parameter itself (its gradient buffer): under activation recomputation the saved
        # tensors come back as detached copies, without the parameter's attributes
        ctx.param = weight
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = grad.matmul(weight)
        if ctx.needs_input_grad[2]:
            db = grad.reshape(-1, grad.shape[-1]).sum(0)
        if ctx.needs_input_grad[1]:
            dw = accumulate_or_return_wgrad(ctx.param, grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1]))
        return dx, dw, db


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           fuse_wgrad: bool = False) -> torch.Tensor:
    """``F.linear``; with ``fuse_wgrad`` through :class:`FusedWgradLinear` (inside a compiled
    region, outside its graph: see the module doc)."""
    if fuse_wgrad and weight.requires_grad and torch.is_grad_enabled():
        if torch.compiler.is_compiling():
            return _fused_outside_graph(x, weight, bias)
        return FusedWgradLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


@outside_compiled_graphs
def _fused_outside_graph(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """:class:`FusedWgradLinear` called from compiled code: a graph break, run eagerly."""
    return FusedWgradLinear.apply(x, weight, bias)


def describe(device: torch.device | str, weights: torch.dtype, grads: torch.dtype) -> str:
    """The accumulation path for the log, e.g. ``main_grad.addmm_ (one GEMM)``. Planning for a
    CUDA device on a machine without one (``resolve_backends(cfg, "cuda")`` on a CPU) names the
    fused GEMM without probing it: the probe runs on the device at first use."""
    device = torch.device(device)
    if (device.type == "cuda" and not torch.cuda.is_available() and grads == torch.float32
            and weights in _HALF):
        return PATHS["addmm_out_dtype"] + " (to be checked on the device at first use)"
    return PATHS[wgrad_call(device, weights, grads)]
