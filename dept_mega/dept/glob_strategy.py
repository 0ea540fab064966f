"""GLOB: the embeddings (token table, learned positions, untied head) belong to the group and
are synchronised like the body at every round end (``outer_embedding``); sources own nothing.
With ``dept.embedding_rows: present`` a group's inner steps update only the table rows of its
round's source vocabulary (row_mask.py; docs/study/glob.md says why)."""
from __future__ import annotations

from typing import Optional

from .master_shards import value_access
from .outer import FlatSync, OuterOptimizer, sync_options
from .row_mask import PresentRowsOnly, present_ids
from .strategy import RoundView, StrategyContext, VariantStrategy


class GlobStrategy(VariantStrategy):
    name = "glob"

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        d = ctx.cfg.dept
        params = ctx.trainer.embedding_parameters()
        self.embedding_sync = FlatSync(params, ctx.pg, OuterOptimizer.from_config(d.outer_optimizer),
                                       category="outer_embedding", **sync_options(d),
                                       **value_access(ctx.trainer, params, ctx.pg))  # fp32 values
        self.mask: Optional[PresentRowsOnly] = None

    def reset_group_optimizer(self) -> None:
        self.ctx.trainer.embedding_optimizer.state.clear()

    def begin_round(self, source: str) -> None:
        """``dept.embedding_rows: present``: this round's inner steps update only the rows of
        ``source``'s vocabulary set V_k (row_mask.py); ``all``: every row (plain GLOB)."""
        if self.ctx.cfg.dept.embedding_rows == "present":
            self._end_mask()
            self.mask = PresentRowsOnly(self.ctx.trainer, present_ids(self.ctx.sources, source))

    def _end_mask(self) -> None:
        if self.mask is not None:
            self.mask.remove()
            self.mask = None

    def outer_syncs(self) -> list:
        # synchronised by the driver with the body's last fragment; saved per parameter by the
        # checkpoint (dept_mega.checkpoint_state), not in state_dict
        return [self.embedding_sync]

    def sync(self, installed: Optional[str]) -> None:
        self._end_mask()

    def eval_embeddings(self, source: str, view: RoundView) -> Optional[list]:
        return None  # the group's own (global) embeddings, as they are now

    def load_state_dict(self, sd: dict) -> None:
        if "embedding_sync" in sd:  # checkpoints written before the outer state moved to DCP keys
            self.embedding_sync.load_state_dict(sd["embedding_sync"])
