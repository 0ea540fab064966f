"""Inner optimizer pieces: AdamW builder, the LR schedule (warmup, then cosine, linear, constant,
inverse-square-root or WSD decay), the gradient norm.

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
    ``lr/warmup_steps`` to ``lr`` over ``warmup_steps`` updates, then ``optim.lr_decay_style``
    from ``lr`` towards ``min_lr`` over the decay window that ends at ``optim.lr_decay_steps``
    (null: ``total_steps``, i.e. train.steps).

    After warmup the styles are Megatron-LM's (``OptimizerParamScheduler.get_lr``) with its
    ``num_steps`` = ``step``, the number of updates already taken, and
    r = (step − warmup) / (decay_steps − warmup):
    cosine min + (lr − min)·½(1 + cos πr); linear min + (lr − min)(1 − r); constant lr
    (min_lr unused); inverse-square-root max(min, lr·√max(warmup, 1)/√max(step, 1));
    wsd lr until decay_steps − ``lr_wsd_decay_steps``, then ``lr_wsd_decay_style``
    over those last steps. Past decay_steps every style but constant gives ``min_lr``.
    Warmup differs from Megatron's by one step: the first update already takes
    ``lr/warmup_steps`` (Megatron's takes its init_lr, 0) and step ``warmup − 1`` takes ``lr``.
    A decay window that ends within warmup (only through the default, train.steps ≤
    warmup_steps: an explicit lr_decay_steps must exceed warmup_steps) holds ``lr``."""
    w = optim.warmup_steps
    if step < w:
        return optim.lr * (step + 1) / w
    decay_steps = total_steps if optim.lr_decay_steps is None else optim.lr_decay_steps
    if decay_steps <= w:
        return optim.lr
    style = optim.lr_decay_style
    if style == "constant":
        return optim.lr
    if style == "cosine":  # the original expression, kept as it was: the same floats as before
        progress = min(1.0, (step - w) / max(1, decay_steps - w))
        return optim.min_lr + 0.5 * (optim.lr - optim.min_lr) * (1.0 + math.cos(math.pi * progress))
    if step > decay_steps:
        return optim.min_lr
    if style == "inverse-square-root":
        return max(optim.min_lr, optim.lr * math.sqrt(max(w, 1)) / math.sqrt(max(step, 1)))
    if style == "linear":
        coeff = 1.0 - (step - w) / (decay_steps - w)
    elif style == "wsd":
        anneal_start = decay_steps - optim.lr_wsd_decay_steps
        if step <= anneal_start:
            return optim.lr
        coeff = _wsd_coeff(optim.lr_wsd_decay_style, (step - anneal_start) / optim.lr_wsd_decay_steps)
    else:
        raise ValueError(f"optim.lr_decay_style {style!r}")  # the config's choices stop it before
    return optim.min_lr + coeff * (optim.lr - optim.min_lr)


def _wsd_coeff(style: str, r: float) -> float:
    """The fraction of (lr − min_lr) left at fraction ``r`` of WSD's final decay: 1 at r = 0,
    0 at r = 1 (Megatron-LM's --lr-wsd-decay-style shapes)."""
    if style == "linear":
        return 1.0 - r
    if style == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * r))
    if style == "exponential":
        return 2.0 * 0.5 ** r - 1.0
    if style == "minus_sqrt":
        return 1.0 - math.sqrt(r)
    raise ValueError(f"optim.lr_wsd_decay_style {style!r}")


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


def norm_of(grads: Sequence[torch.Tensor], group, device: torch.device) -> torch.Tensor:
    """sqrt of the sum over ``group`` of this rank's squared L2 norms of ``grads`` (fp64 sum), as
    a one-element fp64 tensor on ``device``: nothing is read back here, so the trainer fetches it
    with the step's loss statistics in one copy. A fixed number of kernels whatever the number
    of parameters (one ``_foreach_norm``, then the squares and their sum over the stacked norms)."""
    if grads:
        norms = torch._foreach_norm([g.float() for g in grads])
        sq = torch.stack(norms).double().square().sum()
    else:
        sq = torch.zeros((), dtype=torch.float64, device=device)
    sq = sq.reshape(1)
    if group is not None:
        dist.all_reduce(sq, group=group)
    return sq.sqrt()


__all__ = ["lr_at", "param_groups", "build_adamw", "set_lr", "counted_once", "norm_of"]
