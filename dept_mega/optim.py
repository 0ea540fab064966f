"""Inner optimizer pieces: AdamW builder, cosine LR schedule with warmup, the gradient norm.

The gradient norm is global over the model of one source group: every parameter is counted
exactly once although some are stored on several ranks —
* replicated over the tensor group (``param.tensor_parallel`` False: norms, row-parallel
  biases): counted on tensor rank 0 only;
* the last stage's copy of a tied embedding under PP > 1 (kept equal to the first stage's
  weight by the embedding-group all-reduce; the trainer passes it in ``duplicates``): not
  counted;
* data-parallel replicas: identical after the dp all-reduce, so the norm is reduced over
  ``pg.model_parallel`` (tp × pp) only — with the distributed optimizer each dp rank holds a
  different shard, and the sum runs over the whole source group.
The squared-norm reduction is bookkeeping (one float) and is not counted by ``Comm``. The
AdamW instances themselves live in :mod:`dept_mega.optimizer`.
"""
from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from .config import OptimConfig
from .parallel.groups import ParallelGroups


def lr_at(step: int, optim: OptimConfig, total_steps: int) -> float:
    """LR of the update taken at inner step ``step`` (0-based): linear warmup from
    ``lr/warmup_steps`` to ``lr`` over ``warmup_steps`` updates, then cosine to ``min_lr``
    at ``total_steps``, constant ``min_lr`` beyond."""
    w = optim.warmup_steps
    if step < w:
        return optim.lr * (step + 1) / w
    if total_steps <= w:
        return optim.lr
    progress = min(1.0, (step - w) / max(1, total_steps - w))
    return optim.min_lr + 0.5 * (optim.lr - optim.min_lr) * (1.0 + math.cos(math.pi * progress))


def param_groups(params: Iterable[torch.nn.Parameter], weight_decay: float) -> list[dict]:
    """Weight decay on matrices only (not on biases, norm weights)."""
    decay, no_decay = [], []
    for p in params:
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = []
    if decay:
        groups.append({"params": decay, "weight_decay": weight_decay})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_adamw(params: Iterable[torch.nn.Parameter], optim: OptimConfig, device: torch.device,
                ) -> torch.optim.AdamW:
    """A plain AdamW over ``params`` with the run's kernel choice (``optim.fused``): for
    reference loops (benchmarks); the trainer uses :mod:`dept_mega.optimizer`."""
    from .optimizer import new_adamw
    return new_adamw(param_groups(params, optim.weight_decay), optim, device)


def set_lr(optimizers: Sequence[torch.optim.Optimizer], lr: float) -> None:
    for opt in optimizers:
        for g in opt.param_groups:
            g["lr"] = lr


def counted_once(p: torch.nn.Parameter, pg: ParallelGroups, duplicates: frozenset[int] = frozenset()) -> bool:
    """Whether this rank counts ``p`` in the global gradient norm."""
    if id(p) in duplicates:
        return False
    if not getattr(p, "tensor_parallel", False) and pg.tp_rank != 0:
        return False
    return True


def norm_of(grads: Sequence[torch.Tensor], group, device: torch.device) -> float:
    """sqrt of the sum over ``group`` of this rank's squared L2 norms of ``grads`` (fp64 sum)."""
    if grads:
        norms = torch._foreach_norm([g.float() for g in grads])
        sq = torch.stack([n.double() ** 2 for n in norms]).sum()
    else:
        sq = torch.zeros((), dtype=torch.float64, device=device)
    sq = sq.reshape(1)
    if group is not None:
        dist.all_reduce(sq, group=group)
    return float(sq.sqrt().item())


__all__ = ["lr_at", "param_groups", "build_adamw", "set_lr", "counted_once", "norm_of"]
