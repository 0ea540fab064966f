"""Cross entropy over vocabulary-sharded logits, without gathering the full vocabulary.

Each tensor rank holds the logits of vocabulary rows ``[rank·V/T, (rank+1)·V/T)``. The loss
``logsumexp(z) − z[label]`` needs three reductions over the tensor group: the max (for
stability), the target logit (owned by exactly one rank) and the sum of exponentials. The
backward is ``softmax(z) − onehot(label)`` on the local shard, scaled by the incoming grad,
computed in place in the saved softmax (Megatron does the same): the backward allocates no
second vocabulary-sized buffer (for fp32 logits the returned gradient IS that buffer). The
saved softmax is consumed, so a second backward through the same graph is an error.
All arithmetic is fp32. Logits set to ``-inf`` (padded vocabulary rows) get zero probability
and zero gradient.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .mappings import CATEGORY, tp_world


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, pg) -> torch.Tensor:
        T = tp_world(pg)
        vocab_local = logits.shape[-1]
        start = pg.tp_rank * vocab_local if T > 1 else 0

        # the max of half-precision values is exact in their own dtype: no fp32 copy for it
        zmax = logits.max(dim=-1).values.float()
        if T > 1:
            pg.comm.all_reduce(zmax, pg.tp, CATEGORY, op=dist.ReduceOp.MAX)
        # The one vocabulary-sized fp32 buffer of this function: an fp32 copy of the caller's
        # logits (always a copy: the caller's logits stay untouched), shifted, exponentiated,
        # normalised and, in backward, turned into the gradient, all in place. (Not
        # ``torch.sub(logits, zmax)``: on CPU a mixed-dtype op casts its half input into a
        # temporary of its own, a second fp32 buffer.) While the copy is written the caller's
        # logits are alive too: that transient is dept/memory.py's ``ce_transient``.
        z = logits.to(torch.float32, copy=True)
        z.sub_(zmax.unsqueeze(-1))

        outside = (labels < start) | (labels >= start + vocab_local)
        local = (labels - start).masked_fill(outside, 0)
        target = torch.gather(z, -1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)

        exp = torch.exp(z, out=z)  # reuse the buffer: only softmax is needed for backward
        sum_exp = exp.sum(dim=-1)
        if T > 1:
            both = torch.stack([target, sum_exp])
            pg.comm.all_reduce(both, pg.tp, CATEGORY)
            target, sum_exp = both[0], both[1]
        loss = torch.log(sum_exp) - target

        exp.div_(sum_exp.unsqueeze(-1))  # softmax over the full vocabulary, local columns
        ctx.save_for_backward(exp, local, outside)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        if getattr(ctx, "consumed", False):
            raise RuntimeError("vocab_parallel_cross_entropy: a second backward through the same graph; the "
                               "first one turned the saved softmax into the gradient in place")
        ctx.consumed = True
        softmax, local, outside = ctx.saved_tensors
        grad = softmax  # in place: the softmax is not needed after this backward
        onehot = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local.unsqueeze(-1), -onehot.unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, labels: torch.Tensor, pg) -> torch.Tensor:
    """Per-token fp32 losses from this rank's vocabulary shard of the logits.

    ``logits_shard``: ``[..., V/T]``; ``labels``: ``[...]`` global vocabulary ids.
    """
    if logits_shard.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits_shard.shape)} and labels {tuple(labels.shape)} do not match")
    return _VocabParallelCE.apply(logits_shard, labels, pg)
