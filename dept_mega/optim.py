"""Inner optimizer pieces: AdamW builder, cosine LR schedule with warmup, global-norm clipping.

The gradient norm is global over the model of one source group: every parameter is counted
exactly once although some are stored on several ranks —
* replicated over the tensor group (``param.tensor_parallel`` False: norms, row-parallel
  biases): counted on tensor rank 0 only;
* the last stage's copy of a tied embedding under PP > 1 (kept equal to the first stage's
  weight by the embedding-group all-reduce; the trainer passes it in ``duplicates``): not
  counted;
* data-parallel replicas: identical after the dp all-reduce, so the norm is reduced over
  ``pg.model_parallel`` (tp × pp) only.
The squared-norm reduction is bookkeeping (one float) and is not counted by ``Comm``.
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
    """AdamW: fused kernel on CUDA, the foreach (multi-tensor) path otherwise."""
    groups = param_groups(params, optim.weight_decay)
    if not groups:
        # An empty optimizer keeps the swap logic uniform (e.g. a chunk without embeddings).
        groups = [{"params": [], "weight_decay": 0.0}]
    kwargs = {"lr": optim.lr, "betas": tuple(optim.betas), "eps": optim.eps}
    if device.type == "cuda":
        kwargs["fused"] = True
    else:
        kwargs["foreach"] = True
    return torch.optim.AdamW(groups, **kwargs)


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


def global_grad_norm(params: Sequence[torch.nn.Parameter], pg: ParallelGroups,
                     duplicates: frozenset[int] = frozenset()) -> float:
    """L2 norm of all gradients of the source group's model (each parameter once);
    ``duplicates``: ids of parameters stored elsewhere too (not counted here)."""
    grads = [p.grad for p in params if p.grad is not None and counted_once(p, pg, duplicates)]
    if grads:
        norms = torch._foreach_norm([g.float() for g in grads])
        sq = torch.stack([n.double() ** 2 for n in norms]).sum()
    else:
        dev = params[0].device if params else torch.device("cpu")
        sq = torch.zeros((), dtype=torch.float64, device=dev)
    sq = sq.reshape(1)
    if pg.model_parallel is not None:
        dist.all_reduce(sq, group=pg.model_parallel)
    return float(sq.sqrt().item())


def clip_grads(params: Sequence[torch.nn.Parameter], total_norm: float, max_norm: float) -> None:
    """Scale gradients so that their global norm is at most ``max_norm`` (0 disables)."""
    if max_norm <= 0 or not math.isfinite(total_norm):
        return
    coef = max_norm / (total_norm + 1e-6)
    if coef < 1.0:
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, coef)


__all__ = ["lr_at", "param_groups", "build_adamw", "set_lr", "counted_once", "global_grad_norm",
           "clip_grads"]
