"""Autograd collectives over the tensor-parallel group (Megatron-core's mapping idea).

Each function is a forward collective paired with its adjoint in the backward pass:

=====================================  ==========================  ===========================
function                               forward                     backward
=====================================  ==========================  ===========================
``copy_to_tp_region``                  identity                    all-reduce
``reduce_from_tp_region``              all-reduce                  identity
``scatter_to_tp_region``               keep own last-dim chunk     all-gather last dim
``gather_from_tp_region``              all-gather last dim         keep own last-dim chunk
``scatter_to_sequence_parallel``       keep own dim-0 chunk        all-gather dim 0
``gather_from_sequence_parallel``      all-gather dim 0            reduce-scatter dim 0 (or
                                                                   keep own chunk)
``reduce_scatter_to_sequence_parallel``reduce-scatter dim 0        all-gather dim 0
=====================================  ==========================  ===========================

Every collective goes through ``pg.comm`` with category ``tp`` so its bytes are counted. With
one tensor rank (``pg.tp`` is None) every function is the identity and counts nothing.
"""
from __future__ import annotations

import torch

from .comm import group_size

CATEGORY = "tp"


def tp_world(pg) -> int:
    return group_size(pg.tp) if pg.tp_size > 1 else 1


# ----------------------------------------------------------------------------- raw collectives


def _all_reduce(x: torch.Tensor, pg) -> torch.Tensor:
    if tp_world(pg) == 1:
        return x
    out = x.contiguous().clone()
    pg.comm.all_reduce(out, pg.tp, CATEGORY)
    return out


def _split_last(x: torch.Tensor, pg) -> torch.Tensor:
    T = tp_world(pg)
    if T == 1:
        return x
    if x.shape[-1] % T:
        raise ValueError(f"last dimension {x.shape[-1]} is not divisible by the tensor-parallel size {T}")
    return x.chunk(T, dim=-1)[pg.tp_rank].contiguous()


def _gather_last(x: torch.Tensor, pg) -> torch.Tensor:
    T = tp_world(pg)
    if T == 1:
        return x
    x = x.contiguous()
    out = torch.empty((T * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    pg.comm.all_gather_into(out, x, pg.tp, CATEGORY)
    return torch.cat(out.chunk(T, dim=0), dim=-1).contiguous()


def _split_first(x: torch.Tensor, pg) -> torch.Tensor:
    T = tp_world(pg)
    if T == 1:
        return x
    if x.shape[0] % T:
        raise ValueError(f"sequence dimension {x.shape[0]} is not divisible by the tensor-parallel size {T}")
    return x.chunk(T, dim=0)[pg.tp_rank].contiguous()


def _gather_first(x: torch.Tensor, pg) -> torch.Tensor:
    T = tp_world(pg)
    if T == 1:
        return x
    x = x.contiguous()
    out = torch.empty((T * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    pg.comm.all_gather_into(out, x, pg.tp, CATEGORY)
    return out


def _reduce_scatter_first(x: torch.Tensor, pg) -> torch.Tensor:
    T = tp_world(pg)
    if T == 1:
        return x
    if x.shape[0] % T:
        raise ValueError(f"sequence dimension {x.shape[0]} is not divisible by the tensor-parallel size {T}")
    x = x.contiguous()
    out = torch.empty((x.shape[0] // T,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    pg.comm.reduce_scatter_into(out, x, pg.tp, CATEGORY)
    return out


# ----------------------------------------------------------------------------- autograd functions


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.pg), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pg):
        return _all_reduce(x, pg)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        return _split_last(x, pg)

    @staticmethod
    def backward(ctx, g):
        return _gather_last(g, ctx.pg), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        return _gather_last(x, pg)

    @staticmethod
    def backward(ctx, g):
        return _split_last(g, ctx.pg), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        return _split_first(x, pg)

    @staticmethod
    def backward(ctx, g):
        return _gather_first(g, ctx.pg), None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pg, tensor_parallel_output_grad):
        ctx.pg = pg
        ctx.reduce = tensor_parallel_output_grad
        return _gather_first(x, pg)

    @staticmethod
    def backward(ctx, g):
        if ctx.reduce:
            return _reduce_scatter_first(g, ctx.pg), None, None
        return _split_first(g, ctx.pg), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        return _reduce_scatter_first(x, pg)

    @staticmethod
    def backward(ctx, g):
        return _gather_first(g, ctx.pg), None


def copy_to_tp_region(x: torch.Tensor, pg) -> torch.Tensor:
    """Enter a tensor-parallel region with a replicated input: backward sums the partial grads."""
    return x if tp_world(pg) == 1 else _CopyToTP.apply(x, pg)


def reduce_from_tp_region(x: torch.Tensor, pg) -> torch.Tensor:
    """Leave a tensor-parallel region by summing partial results (row-parallel output)."""
    return x if tp_world(pg) == 1 else _ReduceFromTP.apply(x, pg)


def scatter_to_tp_region(x: torch.Tensor, pg) -> torch.Tensor:
    """Keep this rank's chunk of the last dimension."""
    return x if tp_world(pg) == 1 else _ScatterToTP.apply(x, pg)


def gather_from_tp_region(x: torch.Tensor, pg) -> torch.Tensor:
    """Concatenate every rank's last-dimension chunk."""
    return x if tp_world(pg) == 1 else _GatherFromTP.apply(x, pg)


def scatter_to_sequence_parallel_region(x: torch.Tensor, pg) -> torch.Tensor:
    """Keep this rank's chunk of dim 0 (the sequence) of a replicated tensor."""
    return x if tp_world(pg) == 1 else _ScatterToSP.apply(x, pg)


def gather_from_sequence_parallel_region(x: torch.Tensor, pg,
                                         tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    """All-gather sequence shards. ``tensor_parallel_output_grad``: the consumer is a
    tensor-parallel region whose grads are partial sums, so the backward reduce-scatters;
    otherwise every rank holds the full grad and the backward just keeps its chunk."""
    return x if tp_world(pg) == 1 else _GatherFromSP.apply(x, pg, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, pg) -> torch.Tensor:
    """Sum partial results and keep this rank's sequence chunk (row-parallel output under SP)."""
    return x if tp_world(pg) == 1 else _ReduceScatterToSP.apply(x, pg)
