"""Inner steps that update only the embedding rows present in the round's data
(``dept.embedding_rows: present``, GLOB).

Why it exists: the suspect for GLOB's loss at equal compute was that a group training source
k on a dense global table moves every row — through the tied softmax every logit gets a
gradient, AdamW turns small gradients into full-size steps, weight decay shrinks every row —
although only the rows of V_k (the ids occurring in k's data) carry what k teaches. With this
option a group's inner steps leave the other rows exactly at their round-start values: their
gradients are zeroed after the data-parallel reduction (so they count neither in the gradient
norm nor in AdamW's moments) and their values are restored after every optimizer step (undoing
weight decay and any momentum-driven step). The outer synchronisation is unchanged: a row
nobody trained then has a zero pseudo-gradient in every group. Measured on the sample corpus it
makes GLOB worse, not better (docs/study/glob.md): it stays as an ablation.

Memory: an fp32 copy of this rank's frozen rows, taken when the round starts.
"""
from __future__ import annotations

from typing import Sequence

import torch


def _tables(trainer) -> list[torch.nn.Parameter]:
    """The vocabulary tables of this rank's embeddings (token table, which is also the tied
    head; untied head), each once."""
    out: list[torch.nn.Parameter] = []
    seen: set[int] = set()
    for emb in trainer.embeddings():
        if emb is None:
            continue
        for mod in (emb.word_embeddings, emb.output_layer):
            if mod is not None and id(mod.weight) not in seen:
                seen.add(id(mod.weight))
                out.append(mod.weight)
    return out


def _local_rows(p: torch.nn.Parameter, pg) -> tuple[int, int]:
    """[start, end) of the global vocabulary rows this tensor rank's shard of ``p`` holds."""
    rows = p.shape[0]
    start = pg.tp_rank * rows if pg.tp_size > 1 else 0
    return start, start + rows


class PresentRowsOnly:
    """A trainer step hook (``trainer.step_hooks``) freezing every table row outside
    ``present`` (sorted global ids) until :meth:`remove`."""

    def __init__(self, trainer, present: torch.Tensor) -> None:
        if getattr(trainer.cfg.optim, "distributed", False):
            raise ValueError("dept.embedding_rows: present needs optim.distributed false (its gradients and "
                             "masters are flat shards, not rows)")
        self.trainer = trainer
        self.entries: list[tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor]] = []
        present = present.to(torch.int64).cpu()
        for p in _tables(trainer):
            start, end = _local_rows(p, trainer.pg)
            keep = torch.zeros(end - start, dtype=torch.bool)
            mine = present[(present >= start) & (present < end)] - start
            keep[mine] = True
            frozen = torch.nonzero(~keep).flatten().to(p.device)
            main = trainer.main_params([p])[0]
            self.entries.append((p, frozen, main.detach()[frozen].clone()))
        trainer.step_hooks.append(self)

    @property
    def frozen_rows(self) -> int:
        return sum(int(f.numel()) for _, f, _ in self.entries)

    @torch.no_grad()
    def after_reduce(self, trainer) -> None:
        for p, frozen, _ in self.entries:
            g = trainer.reduced_grad(p)
            if g is not None:
                g.index_fill_(0, frozen, 0.0)

    @torch.no_grad()
    def after_step(self, trainer) -> None:
        for p, frozen, values in self.entries:
            main = trainer.main_params([p])[0]
            main.index_copy_(0, frozen, values.to(main.dtype))
        trainer.refresh_model_params([p for p, _, _ in self.entries])

    def remove(self) -> None:
        if self in self.trainer.step_hooks:
            self.trainer.step_hooks.remove(self)
        self.entries = []


def present_ids(sources: Sequence, name: str) -> torch.Tensor:
    """V_k of source ``name`` from the driver's SourceInfo list (computed for
    ``dept.embedding_rows: present``)."""
    for s in sources:
        if s.name == name:
            if s.vocab_ids is None:
                raise ValueError(f"dept.embedding_rows: present: source {name!r} has no vocabulary set V_k")
            return s.vocab_ids
    raise KeyError(name)
