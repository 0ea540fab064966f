"""SPEC / SPEC-OPT: each source owns its embeddings (token table, learned positions, untied
head; SPEC-OPT with its own tokenizer's vocabulary) and their inner optimizer state. They are
never averaged; they move with the source (weights + optimizer state)."""
from __future__ import annotations

from typing import Optional

from ..model.embeddings import SourceEmbeddings
from .strategy import RoundView, StrategyContext, VariantStrategy, embeddings_from_holder
from .source_info import source_seed


def build_embeddings(ctx: StrategyContext, name: str, make) -> list:
    """One embedding module per chunk of this rank that has the input or the head (None
    elsewhere): ``make(stage, chunk index, seed)``, seeded per source."""
    seed = source_seed(ctx.cfg.train.seed, ctx.index[name])
    return [make(st, i, seed) if (st.is_first or st.is_last) else None for i, st in enumerate(ctx.stages)]


class SpecStrategy(VariantStrategy):
    source_embeddings = True
    move_weights = True

    def __init__(self, ctx: StrategyContext, name: str = "spec") -> None:
        super().__init__(ctx)
        self.name = name

    def build(self, name: str) -> list:
        ctx = self.ctx
        vocab = ctx.sources[ctx.index[name]].vocab_size
        return build_embeddings(ctx, name, lambda st, i, seed: SourceEmbeddings(
            ctx.cfg.model, ctx.pg, vocab, seed, st.is_first, st.is_last,
            sequence_parallel=ctx.cfg.parallel.sequence_parallel, rng=ctx.rng(i), device=ctx.device,
            fuse_wgrad=ctx.cfg.optim.grad_accum_fusion))

    def eval_embeddings(self, source: str, view: RoundView) -> Optional[list]:
        """The weights of the group that trains the source now (or trained it last), copied to
        every other group — or, when that group alone evaluates it (``view.alone``: the groups
        share the sources out, :meth:`eval_group`), its own; a never-trained source uses its
        initial embeddings (seeded, or ``train.init_from``'s table)."""
        holder = view.holder(self.ctx.index[source])
        if holder is None:  # no plan (a federated job's own source: the stored state), or never trained
            return view.store.get(source).embeddings if source in view.store else self.initial(source)
        installed = source == view.installed
        if view.alone:
            if holder != self.ctx.pg.coords.group:
                raise RuntimeError(f"{self.name}: source {source!r} is held by group {holder}, but group "
                                   f"{self.ctx.pg.coords.group} was to evaluate it alone")
            return None if installed else view.store.get(source).embeddings
        mine = None
        if self.ctx.pg.coords.group == holder:
            mine = self.ctx.trainer.embeddings() if installed else view.store.get(source).embeddings
        embs = embeddings_from_holder(self.ctx, holder, mine, lambda: self.build(source))
        return None if (installed and self.ctx.pg.coords.group == holder) else embs

    def eval_group(self, source: str, view: RoundView) -> Optional[int]:
        """The group holding the source's embeddings (none cross groups); None: never trained."""
        return view.holder(self.ctx.index[source])

    def add_eval_sources(self, infos) -> None:
        raise ValueError(f"{self.name}: each source owns its embeddings; a source the run never trained has "
                         f"none to evaluate with (dept_mega.adapt trains them)")
