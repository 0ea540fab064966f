"""One strategy object per DEPT variant: what the variant does at each point of a round.

The round driver (``driver.DeptHooks``) owns what every variant shares — the round plan, the
body's outer synchronisation, the per-source store and its moves, the body optimizer state
per source, data positions, byte accounting — and sequences the variant's strategy:

================  ==========================================================================
``build``         fresh embeddings of a source on this rank (variants whose sources own
                  embeddings: SPEC, SPEC-OPT, TRIM's compact tables)
``install``       prepare a source's embeddings just before they are installed (TRIM: rows of φ)
``reset_group_optimizer``  ``dept.reset_inner_optimizer``: clear group-owned embedding state (GLOB)
``begin_round``   the group trains this source until ``sync`` (GLOB: ``dept.embedding_rows``)
``outer_syncs``   FlatSyncs synchronised like the body's last fragment (GLOB's tables and
                  positions; overlapped with ``dept.outer_overlap``)
``sync``          the round end, after the body: TRIM's rows and positions (blocking)
``eval_embeddings``  the embeddings a source is evaluated with (None: the installed ones)
``eval_group``    the group that should evaluate a source when each source is evaluated by one
                  group (SPEC: the one holding its embeddings; None: any)
``add_eval_sources``  sources evaluated only (``dept_mega.evaluate --extra-source``)
``state_dict`` / ``load_state_dict``  the variant's own checkpoint state (plain values and tensors)
================  ==========================================================================

Class attributes: ``source_embeddings`` (a source owns embeddings that are installed per round
and move with it) and ``move_weights`` (a move sends those weights; TRIM refills them from φ).
The concrete strategies live in ``glob_strategy.py``, ``spec_strategy.py`` and
``trim_strategy.py``; ``variants.make_strategy`` picks one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from .rounds import RoundPlan
from .source_info import SourceInfo
from .store import SourceState, SourceStore, Transfer, exchange, load_payload, state_payload


@dataclass
class StrategyContext:
    """What a strategy may use: the run's config, groups, trainer, device and sources."""
    cfg: Any
    pg: Any
    trainer: Any
    device: torch.device
    sources: Sequence[SourceInfo]
    index: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.index = {s.name: i for i, s in enumerate(self.sources)}

    @property
    def stages(self):
        return self.trainer.stages

    def rng(self, i: int):
        return getattr(self.stages[i], "rng", None)


@dataclass
class RoundView:
    """What the driver knows of the current round, for evaluation."""
    plan: Optional[RoundPlan]
    installed: Optional[str]  # the source this group's embeddings / body state belong to
    store: SourceStore
    in_round: bool  # between round_start and round_end: groups hold locally trained parameters
    # this group alone evaluates the source (DeptHooks.eval_assignment): no copy crosses groups
    alone: bool = False

    def holder(self, k: int) -> Optional[int]:
        """The group that trains source k in this round, else the one that trained it last."""
        if self.plan is None:
            return None
        if k in self.plan.sources:
            return self.plan.sources.index(k)
        return self.plan.last_group[k]

    def training(self, k: int) -> Optional[int]:
        """The group training source k in this round (None: no group)."""
        if self.plan is None or k not in self.plan.sources:
            return None
        return self.plan.sources.index(k)


class VariantStrategy:
    """Base: a variant whose sources own nothing and that synchronises nothing but the body."""
    name = ""
    source_embeddings = False
    move_weights = True
    initial_tables = None  # train.init_from (SPEC / SPEC-OPT): fills a source's first embeddings

    def __init__(self, ctx: StrategyContext) -> None:
        self.ctx = ctx

    def build(self, name: str) -> list:
        raise NotImplementedError(f"{self.name}: sources own no embeddings")

    def initial(self, name: str) -> list:
        """The embeddings a source starts from the first time it is trained or evaluated:
        :meth:`build`, then ``initial_tables`` (``train.init_from``: the checkpoint's table)."""
        embs = self.build(name)
        if self.initial_tables is not None:
            self.initial_tables(name, embs)
        return embs

    def install(self, name: str, embs: list) -> None:
        pass

    def reset_group_optimizer(self) -> None:
        pass

    def begin_round(self, source: str) -> None:
        """The group trains ``source`` from now until :meth:`sync` (also called when a run
        resumes inside a round)."""

    def outer_syncs(self) -> list:
        """FlatSyncs the driver schedules with the body's last fragment (streaming.py)."""
        return []

    def sync(self, installed: Optional[str]) -> None:
        pass

    def eval_embeddings(self, source: str, view: RoundView) -> Optional[list]:
        return None

    def eval_group(self, source: str, view: RoundView) -> Optional[int]:
        """The group that evaluates ``source`` when the groups share the sources out
        (``DeptHooks.eval_assignment``); None: any group gives the same numbers."""
        return None

    def add_eval_sources(self, infos: Sequence[SourceInfo]) -> None:
        """Sources that are evaluated, never trained (``dept_mega.eval_sources``): known by
        name to :meth:`eval_embeddings`, not to the round driver's plans (a new list: the
        driver's stays as it is)."""
        self.ctx.sources = [*self.ctx.sources, *infos]
        self.ctx.index = {s.name: i for i, s in enumerate(self.ctx.sources)}

    def checkpoint_syncs(self) -> dict:
        """FlatSyncs of the strategy's own that the driver does not schedule, by checkpoint
        category (``dept_mega.checkpoint_state``; TRIM's learned positions)."""
        return {}

    def checkpoint_params(self) -> dict:
        """id → (name, tensor) of the tensors those syncs synchronise that are not the model's."""
        return {}

    def replicated_state(self) -> dict:
        """This rank's part of the strategy's own state that every group holds the same at a
        round start, for federation to heal a joining group with (``dept.federation``;
        :meth:`load_state_dict` takes it): none here; TRIM's tables and positions."""
        return {}

    def load_state_dict(self, sd: dict) -> None:
        """The strategy's part of a format-1 hook file (``dept_mega.checkpoint_v1``), or a
        live peer's :meth:`replicated_state`."""


def embeddings_from_holder(ctx: StrategyContext, holder: int, mine: Optional[list],
                           build: Callable[[], list]) -> list:
    """Every group evaluates the same source at the same time: the ranks of group ``holder``
    send ``mine`` (their embeddings of that source) to the rank at the same (tp, dp, pp)
    position of every other group, which loads them into ``build()``. Returns the embeddings
    this rank evaluates with (``mine`` on the holder)."""
    pg, c = ctx.pg, ctx.pg.coords
    if c.group == holder:
        payload = state_payload(SourceState(list(mine)), with_optimizer=False)
        transfers = [Transfer(pg.rank_of(c.tp, c.dp, c.pp, g), True, payload)
                     for g in range(pg.num_groups) if g != holder]
        exchange(pg, transfers, ctx.device)
        return list(mine)
    t = Transfer(pg.rank_of(c.tp, c.dp, c.pp, holder), False)
    exchange(pg, [t], ctx.device)
    embs = build()
    load_payload(SourceState(embs), t.received)
    return embs
