"""Fake (meta) kernels and autograd for the operators that csrc/registration.cpp defines.

Fake kernels give output shapes without data, so the ops trace under torch.compile; the
gather's backward is the deterministic scatter-add into zeros of the table's shape. The
scatters are in-place updates of tables that hold no autograd history (TRIM's global table),
so they have no backward; remap_ids has integer outputs.
"""
from __future__ import annotations

import functools

import torch


def _fake_gather_rows(table, ids, out_dtype=None):
    torch._check(table.dim() == 2, lambda: "gather_rows: table must be 2-D")
    torch._check(ids.dim() == 1, lambda: "gather_rows: ids must be 1-D")
    return table.new_empty((ids.shape[0], table.shape[1]), dtype=out_dtype or table.dtype)


def _fake_scatter_add_rows_(out, ids, rows):
    return None


def _fake_scatter_mean_rows_(table, ids, rows, accumulate=False, alpha=1.0):
    return None


def _fake_remap_ids(ids, lookup):
    return torch.empty_like(ids, memory_format=torch.contiguous_format)


def _fake_remap_ranked(ids, words, size, stage=-1):
    return torch.empty_like(ids, memory_format=torch.contiguous_format)


def _gather_setup_context(ctx, inputs, output):
    table, ids, _ = inputs
    ctx.save_for_backward(ids)
    ctx.table_shape = table.shape
    ctx.table_dtype = table.dtype


def _gather_backward(ctx, grad):
    # the operator itself, past dept_mega.ops' checks: the forward has checked these ids
    (ids,) = ctx.saved_tensors
    grad_table = grad.new_zeros(ctx.table_shape, dtype=ctx.table_dtype)
    torch.ops.dept_mega.scatter_add_rows_(grad_table, ids, grad.contiguous())
    return grad_table, None, None


# The operators dept_mega.ops routes to the extension, with their fake kernels; an extension
# that lacks one of them was built from an older source (ops.loader refuses it).
FAKES = {
    "dept_mega::gather_rows": _fake_gather_rows,
    "dept_mega::scatter_add_rows_": _fake_scatter_add_rows_,
    "dept_mega::scatter_mean_rows_": _fake_scatter_mean_rows_,
    "dept_mega::remap_ids": _fake_remap_ids,
    "dept_mega::remap_ranked": _fake_remap_ranked,
}


@functools.lru_cache(maxsize=None)
def register() -> None:
    """Registers once per process; the extension must be loaded."""
    for op, fake in FAKES.items():
        torch.library.register_fake(op)(fake)
    torch.library.register_autograd("dept_mega::gather_rows", _gather_backward,
                                    setup_context=_gather_setup_context)
