"""TRIM: the global table φ (and φ_head when untied, each row-sharded over a stage's tp × dp
ranks) lives outside the groups' models; a group
trains a compact table over its source's vocabulary V_k, filled from φ at install; at the
round end only the trimmed rows' pseudo-gradients cross groups and the configured outer
optimizer updates the held rows of φ (trim.py). Learned positions are synchronised like the
body. A source owns its compact tables' inner optimizer state (weights are refilled from φ,
so a move sends the optimizer state only).

Evaluation: a source that some group trains in the current round is evaluated, in the middle
of the round, with that group's compact table as it is now (copied to the other groups, like
SPEC); otherwise — and after the round's synchronisation — with its rows of φ.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..model.embeddings import SourceEmbeddings
from ..parallel.groups import Coords, ParallelGroups
from .master_shards import ShardedMasters, sharded_owner
from .outer import FlatSync, OuterOptimizer, sync_options
from .spec_strategy import build_embeddings
from .strategy import RoundView, StrategyContext, VariantStrategy, embeddings_from_holder
from ..ops import VocabRanks
from .trim import RowOuterOptimizer, TrimTable, exchange_rows, remap_ranks, remap_tokens


class TrimmedEmbeddings(SourceEmbeddings):
    """A compact ``SourceEmbeddings`` over V_k that takes *global* ids: tokens and labels are
    remapped global→local on the way in, so the softmax runs over V_k only (the padded rows
    of the compact table are −inf like any padding)."""

    def __init__(self, cfg, pg, vocab_ids: torch.Tensor, global_vocab: int, source: str, seed: int,
                 has_input: bool, has_output: bool, *, sequence_parallel: bool = False, rng=None,
                 device: torch.device | str = "cpu", fuse_wgrad: bool = False) -> None:
        super().__init__(cfg, pg, int(vocab_ids.numel()), seed, has_input, has_output,
                         sequence_parallel=sequence_parallel, rng=rng, device=device, fuse_wgrad=fuse_wgrad)
        self.source = source
        # V_k's ranks (the global→local map): their words are a buffer, so they follow the
        # module's device; not persistent (rebuilt from V_k, never in a checkpoint)
        self.global_vocab = int(global_vocab)
        self.register_buffer("rank_words", remap_ranks(vocab_ids.cpu(), global_vocab).words.to(device),
                             persistent=False)

    @property
    def ranks(self) -> VocabRanks:
        return VocabRanks(self.rank_words, self.global_vocab)

    def embed(self, tokens):
        return super().embed(remap_tokens(tokens, self.ranks, self.source))

    def loss(self, hidden, labels):
        return super().loss(hidden, remap_tokens(labels, self.ranks, self.source))


class TrimStrategy(VariantStrategy):
    name = "trim"
    source_embeddings = True
    move_weights = False  # refilled from φ at install
    shard_table = True  # φ row-sharded over the stage's tp × dp ranks (False: whole on every rank; tests)

    def __init__(self, ctx: StrategyContext) -> None:
        super().__init__(ctx)
        cfg = ctx.cfg
        for s in ctx.sources:
            if s.vocab_ids is None and s.held:  # another group job's source is never installed here
                raise ValueError(f"trim: source {s.name!r} has no vocabulary set V_k")
        self.global_vocab = V = ctx.sources[0].vocab_size
        # φ (and the untied head) from the model's init rule on the full table: a single-rank
        # layout gives the full weights (parameters are initialised full, then sliced).
        solo = ParallelGroups(tp_size=1, dp_size=1, pp_size=1, num_groups=1, rank=0, coords=Coords(0, 0, 0, 0))
        full = SourceEmbeddings(cfg.model, solo, V, cfg.train.seed, True, True)
        tied = cfg.model.tie_embeddings
        holds_table = any(st.is_first or (st.is_last and tied) for st in ctx.stages)
        holds_head = any(st.is_last for st in ctx.stages) and not tied
        oc = cfg.dept.outer_optimizer
        self.phi: Optional[TrimTable] = None
        self.phi_head: Optional[TrimTable] = None
        # φ's rows are sharded over this stage's tensor × data-parallel ranks (TrimTable)
        pg = ctx.pg
        shard = dict(pg=pg, group=pg.tp_dp, index=pg.dp_rank * pg.tp_size + pg.tp_rank,
                     parts=pg.tp_size * pg.dp_size) if self.shard_table else {}
        if holds_table:
            self.phi = TrimTable(full.word_embeddings.weight[:V], optimizer=RowOuterOptimizer.from_config(oc),
                                 **shard)
        if holds_head:
            self.phi_head = TrimTable(full.output_layer.weight[:V], optimizer=RowOuterOptimizer.from_config(oc),
                                      **shard)
        self.positions: Optional[torch.nn.Parameter] = None
        self.position_sync: Optional[FlatSync] = None
        if full.position_embeddings is not None and any(st.is_first for st in ctx.stages):
            self.positions = torch.nn.Parameter(full.position_embeddings.weight.detach().to(ctx.device).clone())
            self.position_sync = FlatSync([self.positions], ctx.pg, OuterOptimizer.from_config(oc),
                                          category="outer_embedding", **sync_options(cfg.dept))
        del full

    # ------------------------------------------------------------------------- building
    def build(self, name: str) -> list:
        ctx = self.ctx
        ids = ctx.sources[ctx.index[name]].vocab_ids
        return build_embeddings(ctx, name, lambda st, i, seed: TrimmedEmbeddings(
            ctx.cfg.model, ctx.pg, ids, self.global_vocab, name, seed, st.is_first, st.is_last,
            sequence_parallel=ctx.cfg.parallel.sequence_parallel, rng=ctx.rng(i), device=ctx.device,
            fuse_wgrad=ctx.cfg.optim.grad_accum_fusion))

    def _tables(self, emb):
        """(weight owner module, φ) pairs of one compact embedding on this rank."""
        out = []
        if emb.word_embeddings is not None and self.phi is not None:
            out.append((emb.word_embeddings, self.phi))
        if emb.output_layer is not None and self.phi_head is not None:
            out.append((emb.output_layer, self.phi_head))
        return out

    def _rows_of(self, owner, n_real: int) -> tuple[int, int]:
        pg = self.ctx.pg
        rows = owner.weight.shape[0]
        start = pg.tp_rank * rows if pg.tp_size > 1 else 0
        return min(start, n_real), min(start + rows, n_real)

    @torch.no_grad()
    def install(self, name: str, embs: list) -> None:
        """Fill the compact tables with φ's rows V_k (and the synchronised positions)."""
        ids = self.ctx.sources[self.ctx.index[name]].vocab_ids
        for emb in embs:
            if emb is None:
                continue
            for owner, phi in self._tables(emb):
                a, b = self._rows_of(owner, ids.numel())
                # every rank of the stage asks for all of V_k (a collective on a sharded φ)
                self._write_rows(owner.weight, phi.gather(ids)[a:b])
            if emb.position_embeddings is not None and self.positions is not None:
                self._write_rows(emb.position_embeddings.weight, self.positions.detach())

    def _write_rows(self, p: torch.Tensor, rows: torch.Tensor) -> None:
        """The first ``rows.shape[0]`` rows of ``p``'s fp32 values ← ``rows``, then its weights.
        The values are its master when the trainer owns it (half-precision weights), ``p``
        itself otherwise (fp32, or an evaluation copy no optimizer owns); with the distributed
        optimizer and half weights this rank's pieces of the master (master_shards.py)."""
        if sharded_owner(p):
            ShardedMasters([p], self.ctx.pg).write_prefix(rows)
            return
        w = self.ctx.trainer.main_params([p])[0]
        w[: rows.shape[0]].copy_(rows.to(w.device, w.dtype))
        self.ctx.trainer.refresh_model_params([p])

    def _values(self, p: torch.Tensor) -> torch.Tensor:
        """``p``'s fp32 values (see :meth:`_write_rows`); with sharded masters gathered from the
        group's data-parallel replicas (a transient full copy, ``dp`` bytes)."""
        if sharded_owner(p):
            return ShardedMasters([p], self.ctx.pg).gather_full(self.ctx.pg, p.device).view(p.shape)
        return self.ctx.trainer.main_params([p])[0]

    # ------------------------------------------------------------------------- round end
    @torch.no_grad()
    def sync(self, installed: Optional[str]) -> None:
        if installed is None:
            return
        ctx = self.ctx
        ids = ctx.sources[ctx.index[installed]].vocab_ids
        # one exchange per table kind on this rank (a tied table on two stages of one rank
        # with virtual pipelining is the same parameter: take it once)
        seen = set()
        for emb in ctx.trainer.embeddings():
            if emb is None:
                continue
            for owner, phi in self._tables(emb):
                if id(owner.weight) in seen:
                    continue
                seen.add(id(owner.weight))
                a, b = self._rows_of(owner, ids.numel())
                mine = ids[a:b]
                local = self._values(owner.weight)[: b - a].to(phi.weight.device, torch.float32)
                delta = phi.gather(ids)[a:b] - local  # all of V_k: collective on a sharded φ
                all_ids, all_rows = exchange_rows(ctx.pg, mine.to(ctx.device), delta.to(ctx.device),
                                                  comm_dtype=ctx.cfg.dept.outer_comm_dtype,
                                                  quant_block=ctx.cfg.dept.outer_quant_block)
                phi.apply(all_ids, all_rows)
            if emb.position_embeddings is not None and self.position_sync is not None:
                self.positions.data.copy_(self._values(emb.position_embeddings.weight))
        if self.position_sync is not None:
            self.position_sync.sync()

    # ------------------------------------------------------------------------- evaluation
    def eval_embeddings(self, source: str, view: RoundView) -> Optional[list]:
        ctx = self.ctx
        k = ctx.index[source]
        group = ctx.pg.coords.group
        holder = view.training(k)
        if view.in_round and holder is not None:
            if view.alone:  # (DeptHooks.eval_assignment shares sources out only after a round's sync)
                raise RuntimeError(f"trim: source {source!r} is trained by group {holder} in this round; every "
                                   f"group evaluates it with a copy of that group's table")
            # what the training group holds now: its compact table, copied to the other groups
            mine = ctx.trainer.embeddings() if group == holder else None
            embs = embeddings_from_holder(ctx, holder, mine, lambda: self.build(source))
            return None if group == holder else embs
        # rows of φ; the installed tables may hold this group's pre-sync local rows, which an
        # evaluation must not overwrite: evaluate with a copy
        installed = source == view.installed
        embs = view.store.get(source).embeddings if (source in view.store and not installed) else self.build(source)
        self.install(source, embs)
        return embs

    # ------------------------------------------------------------------------- state
    def full_table(self, key: str = "phi") -> Optional[torch.Tensor]:
        """The whole φ (``key`` ``phi``) or φ_head (``phi_head``) gathered from its row shards;
        collective over the stage's tensor × data-parallel ranks. None where this rank holds
        no such table."""
        table = {"phi": self.phi, "phi_head": self.phi_head}[key]
        return None if table is None else table.full_table()

    def checkpoint_syncs(self) -> dict:
        return {} if self.position_sync is None else {"trim_positions": self.position_sync}

    def checkpoint_params(self) -> dict:
        return {} if self.positions is None else {id(self.positions): ("positions", self.positions)}

    def replicated_state(self) -> dict:
        """``phi`` / ``phi_head``: this rank's rows of the tables (fp32) with ``*_rows`` = [first
        row, end row, |V|] and ``*_optimizer``, their rows' outer optimizer state; the learned
        positions and their sync. The same on the rank at this position of every group after a
        round's sync."""
        sd: dict = {}
        for key, table in (("phi", self.phi), ("phi_head", self.phi_head)):
            if table is not None:
                tsd = table.state_dict()
                sd[key], sd[f"{key}_rows"], sd[f"{key}_optimizer"] = tsd["weight"], tsd["rows"], tsd["optimizer"]
        if self.position_sync is not None:
            sd["positions"] = self.positions.detach().clone()
            sd["position_sync"] = self.position_sync.replicated_state()
        return sd

    def load_state_dict(self, sd: dict) -> None:
        for key, table in (("phi", self.phi), ("phi_head", self.phi_head)):
            if table is None:
                continue
            opt = sd.get(f"{key}_optimizer")
            if opt is None:  # written before φ's rows had outer optimizer state
                if table.optimizer.name != "fedavg":
                    raise ValueError(f"dept.outer_optimizer.name: the checkpoint's TRIM table has no row state "
                                     f"for {table.optimizer.name!r} (it was written when rows took the plain mean)")
                opt = {"name": "fedavg", "state": {}}
            table.load_state_dict({"weight": sd[key], "optimizer": opt, "rows": sd.get(f"{key}_rows")})
        if self.position_sync is not None:
            self.positions.data.copy_(sd["positions"])
            self.position_sync.load_state_dict(sd["position_sync"])
