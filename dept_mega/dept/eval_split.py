"""Evaluation shared out over the source groups where every group would compute the same numbers.

An evaluation reads the body each group holds and each source's embeddings as its variant
names them (docs/dept.md, "Evaluation"). In the middle of a round the groups' bodies differ
(local steps), so every group evaluates every source and the record is group 0's. After a
round's blocking outer sync — nothing in flight, every synchronised parameter fresh from it —
and after loading a checkpoint written there, every group holds the same body bit for bit (each
rank applied the same outer update, the invariant checkpoints rely on to write those
parameters once), and a source's embeddings do not depend on the group either: GLOB's tables
are synchronised with the body, TRIM's source is evaluated with its rows of φ (the same in every
group after the sync), a SPEC / SPEC-OPT source with the weights of the group that holds them
(which every other group would receive as a bit-exact copy). With the same weights, data and
layout (tensor, pipeline and data-parallel sizes are the same in every group), every group
computes the same sums; so each source is evaluated by one group only and the sums are
gathered: the records are those of today's evaluation by every group, at 1/G of its compute.

What must hold is checked, not assumed (:func:`eval_params`): every model parameter an
evaluation reads from the group is in the set its hooks know to be the same in every group
(``DeptHooks.group_replicated_params`` after a sync; the parameters a checkpoint load read from
group-free keys). Where it fails (mid-round, ``dept.outer_overlap`` with a sync in flight,
``dept.outer_fragments`` > 1 whose earlier fragments trained on after their sync, a federated
group job) every group evaluates every source as before.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch


def eval_params(trainer, source_embeddings: bool) -> list[torch.nn.Parameter]:
    """The model parameters an evaluation reads from the group's own model: all of them, but the
    installed source's embeddings where the variant evaluates a source with embeddings of its
    own taken elsewhere (``source_embeddings``: SPEC / SPEC-OPT from the holder, TRIM from φ)."""
    skip = {id(p) for p in trainer.embedding_parameters()} if source_embeddings else set()
    seen: dict[int, torch.nn.Parameter] = {}
    for st in trainer.stages:
        for p in st.parameters():
            if id(p) not in skip:
                seen.setdefault(id(p), p)
    return list(seen.values())


def balanced_assignment(names: Sequence[str], groups: int, preferred: dict[str, Optional[int]]) -> dict[str, int]:
    """Source → the group that evaluates it: ``preferred[name]`` where given (the group holding
    its embeddings), the others in order to the least loaded group (ties: the lowest index).
    A function of its arguments only, so every rank computes the same."""
    load = [0] * groups
    out: dict[str, int] = {}
    for n in names:
        g = preferred.get(n)
        if g is not None:
            if not 0 <= g < groups:
                raise ValueError(f"eval assignment: source {n!r} prefers group {g} of {groups}")
            out[n] = g
            load[g] += 1
    for n in names:
        if n not in out:
            g = min(range(groups), key=lambda i: (load[i], i))
            out[n] = g
            load[g] += 1
    return out
