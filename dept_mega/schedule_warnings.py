"""Warnings about how a DEPT run's intervals line up with its rounds, for ``--check``, the
start-up log and the study tool's listing (docs/dept.md, "Evaluation"; docs/launching.md,
"Changing the layout between launches")."""
from __future__ import annotations

from typing import Optional

from .variant import variant_of


def _inside_a_round(cfg, interval: Optional[int]) -> bool:
    """Whether steps that are multiples of ``interval`` (a train.*_interval) fall inside a DEPT
    round before the last step: a variant with rounds, an interval set, not a multiple of
    ``dept.local_steps`` and below ``train.steps``."""
    L = cfg.dept.local_steps
    return bool(variant_of(cfg).rounds and interval and interval % L and interval < cfg.train.steps)


def eval_interval_warning(cfg) -> Optional[str]:
    """Under a DEPT variant, an evaluation at a step that is not a multiple of
    ``dept.local_steps`` runs in the middle of a round, before its outer sync: the record (rank
    0's, so group 0's) is of group 0's locally trained body with each source's embeddings as the
    variant holds them then (SPEC / SPEC-OPT, TRIM: as trained so far by the group that trains
    the source this round), a combination no group trained and no checkpoint holds. None when
    every evaluation before the last step falls on a round's end (``train.eval_interval`` a
    multiple of ``dept.local_steps``, 0, or not below ``train.steps``)."""
    d, t = cfg.dept, cfg.train
    E, L = t.eval_interval, d.local_steps
    v = variant_of(cfg)
    if not _inside_a_round(cfg, E):
        return None
    if v.source_embeddings:
        embs = ("and each source's embeddings copied from the group that trains it this round (as trained so far; "
                "a source no group trains: its last stored ones)" if not v.trimmed else
                "and, for a source some group trains this round, that group's compact table as trained so far")
        what = f"group 0's body {embs}: a body and embeddings that never trained together"
    else:
        what = "group 0's body and embeddings, trained this round on group 0's source only"
    return (f"config key 'train.eval_interval': {E} is not a multiple of dept.local_steps={L}: the evaluations at "
            f"steps such as {E} fall inside a round, before its outer sync, so their numbers are those of {what}, "
            f"not of the synchronised model (only evaluations at round ends, steps that are multiples of {L}, and the "
            f"final one evaluate that); set train.eval_interval to a multiple of {L} to compare evaluations across "
            f"a run (docs/dept.md, Evaluation)")


def save_interval_warning(cfg) -> Optional[str]:
    """Under a DEPT variant, a periodic checkpoint at a step that is not a multiple of
    ``dept.local_steps`` is taken inside a round, where the groups hold different bodies: it
    resumes exactly, but only with the same number of source groups, it cannot start a
    ``train.init_from`` run, and the export takes one group's body from it (GLOB: refused).
    None when every periodic checkpoint falls on a round's end (``train.save_interval`` a
    multiple of ``dept.local_steps``, 0, or not below ``train.steps``: then only the final
    checkpoint is written, at a round's end, ``train.steps`` being a multiple of it)."""
    d, t = cfg.dept, cfg.train
    S, L = t.save_interval, d.local_steps
    if not _inside_a_round(cfg, S):
        return None
    export = ("tools/convert_to_hf.py refuses them" if not variant_of(cfg).source_embeddings else
              "tools/convert_to_hf.py exports from them the body of the group training the source then")
    return (f"config key 'train.save_interval': {S} is not a multiple of dept.local_steps={L}: the checkpoints at "
            f"steps such as {S} fall inside a round, where the groups' bodies differ (only those at multiples of "
            f"{L} and the final one are at round ends): such a checkpoint resumes only with the same number of "
            f"source groups, cannot start a train.init_from run, and {export}; set train.save_interval to a "
            f"multiple of {L} (docs/launching.md, Changing the layout between launches, and train.init_from)")


def exit_interval_warning(cfg) -> Optional[str]:
    """Under a DEPT variant, ``train.exit_interval`` not a multiple of ``dept.local_steps`` stops
    the run inside a round: the checkpoint written on the way out is a mid-round one (see
    :func:`save_interval_warning`), so the next launch must keep the number of source groups.
    None when the stop falls on a round's end, or never comes before ``train.steps``."""
    d, t = cfg.dept, cfg.train
    X, L = t.exit_interval, d.local_steps
    if not _inside_a_round(cfg, X):
        return None
    return (f"config key 'train.exit_interval': {X} is not a multiple of dept.local_steps={L}: the run stops at step "
            f"{X}, inside a round, and the checkpoint it writes on the way out is a mid-round one: the next launch "
            f"resumes exactly only with the same number of source groups, and it cannot start a train.init_from "
            f"run; set train.exit_interval to a multiple of {L} to stop at a round's end")


def schedule_warnings(cfg) -> list[str]:
    """Every warning above that applies to ``cfg``."""
    return [w for w in (eval_interval_warning(cfg), save_interval_warning(cfg), exit_interval_warning(cfg))
            if w is not None]
