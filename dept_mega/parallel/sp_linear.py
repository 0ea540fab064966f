"""The linear layer after a sequence-parallel all-gather that keeps only this rank's shard for
backward (Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication`` with
``sequence_parallel``).

``y = all_gather(x_shard) Wᵀ + b``, where ``x_shard [s/T, b, in]`` is this rank's sequence
shard. Written as ``gather_from_sequence_parallel_region`` followed by ``F.linear``, autograd
would keep the gathered ``[s, b, in]`` input for the weight gradient; here the backward
all-gathers the shard again instead, so (T − 1)/T of that tensor is not held between a
micro-batch's forward and its backward (the QKV and fc1 inputs of every block, and the head's).
The price is one more all-gather of the shard per layer and micro-batch in the backward, counted
in ``tp`` like every collective (``pg.comm``). It is launched before the input-gradient GEMM and
waited for after it (the reduce-scatter of the input gradient then runs beside the
weight-gradient GEMM), as in Megatron.

The math is that of the two-step version, operation for operation: the forward's GEMM is the same
``F.linear`` on the same gathered tensor; the backward computes ``dX = dY·W`` (then reduce-scatters
it), ``dW = dYᵀ·X`` and ``db = Σ dY`` with the GEMMs autograd uses for ``F.linear``
(tests/test_sp_linear.py: bit-identical losses and gradients under TP 2 + SP). With ``fuse_wgrad``
``dW`` accumulates into the gradient buffer as in ``wgrad.FusedWgradLinear``.

For the ``torch`` GEMMs only (``layers.LinearGemm``): the native FP8 linears keep a 1-byte copy
of the gathered input (one byte per element, against the bf16 shard's 2/T: they already hold no
bf16 input, and re-gathering would need the cast again), and Transformer Engine's ``Linear``
saves what it saves itself. Inside a compiled block the layer runs outside the graph (a graph
break, as the fused weight-gradient linear: its backward launches counted collectives).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..compile_guard import outside_compiled_graphs
from .mappings import CATEGORY, tp_world
from .wgrad import accumulate_or_return_wgrad


def _gather_shard(x: torch.Tensor, pg, async_op: bool = False):
    """``[T·n, ...]`` all-gathered from every rank's ``x [n, ...]`` (and, with ``async_op``, the
    handle to wait on)."""
    T = tp_world(pg)
    x = x.contiguous()
    out = torch.empty((T * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    work = pg.comm.all_gather_into(out, x, pg.tp, CATEGORY, async_op=async_op)
    return (out, work) if async_op else out


class SPGatherLinear(torch.autograd.Function):
    """See the module doc. ``fuse_wgrad``: ``dW`` into the weight's active gradient buffer."""

    @staticmethod
    def forward(ctx, x_shard: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], pg,
                fuse_wgrad: bool) -> torch.Tensor:
        full = _gather_shard(x_shard, pg)
        ctx.pg = pg
        ctx.fuse = fuse_wgrad
        ctx.param = weight  # the parameter itself: under recomputation the saved one is a detached copy
        kind = x_shard.device.type
        ctx.in_dtype = x_shard.dtype
        if torch.is_autocast_enabled(kind):
            # what F.linear does under autocast (it casts every operand), done here because the
            # backward does not run under autocast: it then sees the operands the GEMM used
            dt = torch.get_autocast_dtype(kind)
            x_shard, weight, full = x_shard.to(dt), weight.to(dt), full.to(dt)
            bias = bias.to(dt) if bias is not None else None
            with torch.autocast(kind, enabled=False):
                y = F.linear(full, weight, bias)
        else:
            y = F.linear(full, weight, bias)
        ctx.save_for_backward(x_shard, weight)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x_shard, weight = ctx.saved_tensors
        pg = ctx.pg
        T = tp_world(pg)
        need_x, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        full = work = None
        if need_w:  # the re-gather runs while the input gradient is computed
            full, work = _gather_shard(x_shard, pg, async_op=True)
        dx = dw = db = None
        rs = None
        if need_x:
            # reduce-scattered in the input's dtype (under autocast: after the cast back, as autograd would)
            dx_full = grad.matmul(weight).to(ctx.in_dtype).contiguous()
            dx = torch.empty((dx_full.shape[0] // T,) + tuple(dx_full.shape[1:]), dtype=dx_full.dtype,
                             device=dx_full.device)
            rs = pg.comm.reduce_scatter_into(dx, dx_full, pg.tp, CATEGORY, async_op=True)
        if need_b:
            db = grad.reshape(-1, grad.shape[-1]).sum(0)
        if need_w:
            work.wait()
            g2 = grad.reshape(-1, grad.shape[-1])
            x2 = full.reshape(-1, full.shape[-1])
            dw = accumulate_or_return_wgrad(ctx.param, g2, x2) if ctx.fuse else g2.t().mm(x2)
        if rs is not None:
            rs.wait()
        return dx, dw, db, None, None


def sp_gather_linear(x_shard: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], pg,
                     fuse_wgrad: bool = False) -> torch.Tensor:
    """``F.linear(all_gather(x_shard), weight, bias)`` keeping only ``x_shard`` for backward (the
    module doc); needs more than one tensor rank."""
    if tp_world(pg) == 1:
        raise ValueError("sp_gather_linear: sequence parallelism needs more than one tensor rank")
    if torch.compiler.is_compiling():
        return _outside_graph(x_shard, weight, bias, pg, fuse_wgrad)
    return SPGatherLinear.apply(x_shard, weight, bias, pg, fuse_wgrad)


@outside_compiled_graphs
def _outside_graph(x_shard, weight, bias, pg, fuse_wgrad):
    """:class:`SPGatherLinear` called from compiled code: a graph break, run eagerly."""
    return SPGatherLinear.apply(x_shard, weight, bias, pg, fuse_wgrad)
