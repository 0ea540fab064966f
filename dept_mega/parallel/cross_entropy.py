"""Cross entropy over vocabulary-sharded logits, without gathering the full vocabulary.

Each tensor rank holds the logits of vocabulary rows ``[rank·V/T, (rank+1)·V/T)``. The loss
``logsumexp(z) − z[label]`` needs three reductions over the tensor group: the max (for
stability; all-reduce MAX), then the target logit (owned by exactly one rank) and the sum of
exponentials (one all-reduce SUM of both). The backward is ``(softmax(z) − onehot(label))·g``
on the local shard. All arithmetic is fp32 on the logits' values; the logits stay in their own
dtype (bf16 under half precision) and no vocabulary-sized fp32 tensor is kept:

* forward: per token the max, ``Σ exp(z − max)`` and the target logit come from reductions
  that read the logits directly. Saved for backward: the logits themselves (the head's output,
  alive anyway; no copy), the max and the sum (fp32 per token) and the label's column. The
  log-sum-exp is kept as these two parts rather than as one ``lse = max + log Σ``: for
  logits of large magnitude an fp32 ``lse`` loses the low bits that ``exp(z − lse)`` needs,
  while ``exp(z − max)/Σ`` stays accurate to a few ulp.
* backward: one pass writes ``(exp(z − max)/Σ − onehot)·g`` (fp32 arithmetic) in the logits'
  dtype. With ``consume_logits`` it overwrites the saved logits (the model's loss does this:
  no new vocabulary-sized buffer; the caller's logits hold the gradient afterwards, and a
  second backward through the same graph is an error); otherwise into a new tensor.

The math runs in three functions (:func:`_max_math`, :func:`_sum_exp_math`,
:func:`_grad_math`) that are ``torch.compile``'d on CUDA (inductor fuses the cast, shift,
exponential and reduction or cast-back into one pass over the logits, with no fp32
temporary; the backward's pass reads and writes the same buffer) and run eagerly on CPU with
the same math; eagerly, the sum and the gradient each make one fp32 temporary of the logits'
unpadded columns (freed before the function returns). The entry point is
``outside_compiled_graphs`` (``compile_guard.py``): inside a compiled region (it is not in one under
``train.compile``, which compiles the transformer blocks only) it runs eagerly and calls
its own compiled functions.

Logits set to ``-inf`` (padded vocabulary rows) get zero probability and zero gradient. With
``vocab_size`` the columns of global id ``>= vocab_size`` count as ``-inf`` whatever they hold
(the model's padded head columns: no masked copy of the logits is needed for the loss), and
their gradient is zero. A label in such a column gives an infinite loss, as a ``-inf`` logit
does. Labels are global ids; a rank adds nothing for labels outside its shard.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .compiled_math import CudaCompiled
from .mappings import CATEGORY, tp_world
from ..compile_guard import outside_compiled_graphs


def _max_math(logits: torch.Tensor, valid: int) -> torch.Tensor:
    """``[N, V]`` → fp32 ``[N]``: the max of the first ``valid`` columns (exact in the logits'
    own dtype; a slice, no copy)."""
    return logits[:, :valid].amax(dim=-1).float()


def _sum_exp_math(logits: torch.Tensor, zmax: torch.Tensor, local: torch.Tensor, hit: torch.Tensor,
                  outside: torch.Tensor, valid: int) -> torch.Tensor:
    """fp32 ``[2, N]``: the shifted target logit ``z[label] − max`` (0 where the label is not on
    this rank, −inf where it is a padded column) and ``Σ exp(z − max)`` over the first
    ``valid`` columns. Compiled, one reduction reading the logits; eagerly the shifted copy
    ``z`` is the one fp32 temporary (exponentiated in place)."""
    target = torch.gather(logits, -1, local.unsqueeze(-1)).squeeze(-1).float() - zmax
    target = torch.where(hit, target, torch.where(outside, 0.0, float("-inf")))
    z = logits[:, :valid].to(torch.float32, copy=True)
    z.sub_(zmax.unsqueeze(-1))
    sum_exp = z.exp_().sum(dim=-1)
    return torch.stack([target, sum_exp])


def _grad_math(out: torch.Tensor, logits: torch.Tensor, zmax: torch.Tensor, sum_exp: torch.Tensor,
               local: torch.Tensor, hit: torch.Tensor, grad_loss: torch.Tensor, valid: int) -> None:
    """``out[:, :valid] = (exp(z − max)/Σ − onehot(label))·g`` (fp32 arithmetic, written in
    ``out``'s dtype), ``out[:, valid:] = 0``. ``out`` may be ``logits`` itself (every element
    is read before it is written, by the same thread). Compiled, one pass; eagerly ``p`` is
    the one fp32 temporary."""
    p = logits[:, :valid].to(torch.float32, copy=True)
    p.sub_(zmax.unsqueeze(-1)).exp_().div_(sum_exp.unsqueeze(-1))
    if torch.compiler.is_compiling():  # the onehot as a comparison: fused into the same pass
        cols = torch.arange(valid, device=p.device)
        p = p - ((cols == local.unsqueeze(-1)) & hit.unsqueeze(-1)).to(p.dtype)
    else:  # eagerly a scatter of N values instead of an [N, V] onehot (the same fp32 p − 1)
        p.scatter_add_(-1, local.clamp(max=valid - 1).unsqueeze(-1), -hit.to(p.dtype).unsqueeze(-1))
    p.mul_(grad_loss.unsqueeze(-1))
    out[:, :valid].copy_(p)
    if valid < out.shape[-1]:
        out[:, valid:].zero_()


# compiled on CUDA (every micro-batch and vocabulary size shares the graphs), eager elsewhere
_MATH = {name: CudaCompiled(fn) for name, fn in (("max", _max_math), ("sum_exp", _sum_exp_math),
                                                 ("grad", _grad_math))}


def _math(name: str, device: torch.device):
    """The compiled function on CUDA, the eager one elsewhere (the same math)."""
    return _MATH[name].on(device)


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, pg, vocab_size: Optional[int],
                consume: bool) -> torch.Tensor:
        T = tp_world(pg)
        shape = logits.shape
        vocab_local = shape[-1]
        start = pg.tp_rank * vocab_local if T > 1 else 0
        valid = vocab_local if vocab_size is None else max(0, min(vocab_local, vocab_size - start))
        z = logits.reshape(-1, vocab_local)  # a view for the head's contiguous output
        labels = labels.reshape(-1)
        outside = (labels < start) | (labels >= start + vocab_local)
        local = (labels - start).masked_fill(outside, 0)
        hit = ~outside & (local < valid)  # the label is a real (unpadded) column of this shard
        local = local.masked_fill(~hit, 0)

        if valid > 0:
            zmax = _math("max", z.device)(z, valid)
        else:  # the whole shard is padding (T > 1)
            zmax = torch.full((z.shape[0],), float("-inf"), device=z.device)
        if T > 1:
            pg.comm.all_reduce(zmax, pg.tp, CATEGORY, op=dist.ReduceOp.MAX)
        if valid > 0:
            both = _math("sum_exp", z.device)(z, zmax, local, hit, outside, valid)
        else:
            both = torch.stack([torch.where(outside, 0.0, float("-inf")), torch.zeros_like(zmax)])
        if T > 1:
            pg.comm.all_reduce(both, pg.tp, CATEGORY)
        target, sum_exp = both[0], both[1]
        loss = torch.log(sum_exp) - target

        ctx.save_for_backward(z, zmax, sum_exp, local, hit)
        ctx.valid, ctx.consume, ctx.shape = valid, consume, shape
        return loss.view(shape[:-1])

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        if getattr(ctx, "consumed", False):
            raise RuntimeError("vocab_parallel_cross_entropy: a second backward through the same graph; the "
                               "first one wrote the gradient into the saved logits (consume_logits=True)")
        z, zmax, sum_exp, local, hit = ctx.saved_tensors
        if ctx.consume:
            ctx.consumed = True
            out = z
        else:
            out = torch.empty_like(z)
        if ctx.valid > 0:
            g = grad_loss.reshape(-1).float()
            _math("grad", z.device)(out, z, zmax, sum_exp, local, hit, g, ctx.valid)
        else:
            out.zero_()
        return out.view(ctx.shape), None, None, None, None


@outside_compiled_graphs
def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, labels: torch.Tensor, pg, *,
                                 vocab_size: Optional[int] = None, consume_logits: bool = False) -> torch.Tensor:
    """Per-token fp32 losses from this rank's vocabulary shard of the logits.

    ``logits_shard``: ``[..., V/T]``; ``labels``: ``[...]`` global vocabulary ids.
    ``vocab_size``: columns of global id ``>= vocab_size`` are padding (treated as ``-inf``).
    ``consume_logits``: the backward writes the gradient into ``logits_shard`` (no new
    vocabulary-sized buffer; the logits must not be used after the backward, and a second
    backward is an error). Not allowed for a leaf tensor (its gradient would alias it).
    Runs eagerly inside a compiled region (the collectives and the autograd function are
    Python); its math is compiled on its own on CUDA (see the module doc).
    """
    if logits_shard.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits_shard.shape)} and labels {tuple(labels.shape)} do not match")
    if consume_logits and logits_shard.is_leaf and logits_shard.requires_grad:
        raise ValueError("vocab_parallel_cross_entropy: consume_logits=True on a leaf tensor that requires grad "
                         "(its gradient would be written into the tensor itself)")
    return _VocabParallelCE.apply(logits_shard, labels, pg, vocab_size, consume_logits)
