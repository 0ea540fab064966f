"""The DEPT round hooks the training loop calls (``dept_mega.loop.RoundHooks``).

Round start (every rank, no communication except source moves):
  1. the round plan (rounds.py) gives each group its source;
  2. SPEC/SPEC-OPT/TRIM: the state of the source trained last round goes back to the store,
     sources that change group move point to point (store.py), and the group's source state
     is installed into the trainer (``trainer.set_embeddings``), built fresh (seeded) the
     first time a source is sampled; TRIM fills the compact rows V_k from φ.
Round end:
  3. body outer sync (``outer_body``), GLOB embeddings like the body and TRIM rows and learned
     positions (``outer_embedding``);
  4. the ``outer`` record: bytes per category sent by the whole job in this round (summed over
     ranks; evaluation traffic excluded) and the sync's seconds.
See docs/dept.md.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from ..parallel.comm import CATEGORIES, total_over_ranks
from .outer import FlatSync, OuterOptimizer
from .rounds import RoundScheduler
from .store import SourceState, SourceStore, Transfer, exchange, state_payload, load_payload
from .trim import TrimTable, exchange_rows, remap_lookup, remap_tokens
from .variants import source_seed, variant_spec


@dataclass
class SourceInfo:
    """What the hooks need to know of a source."""
    name: str
    vocab_size: int  # vocabulary of its embeddings: global (glob, trim, spec) or its own (spec_opt)
    size: float = 1.0  # for proportional / temperature sampling (tokens)
    vocab_ids: Optional[torch.Tensor] = None  # TRIM: V_k, sorted global ids


def _model_embeddings_cls():
    from ..model.embeddings import SourceEmbeddings
    return SourceEmbeddings


_TRIMMED_CLS = None


def trimmed_embeddings_class():
    """``TrimmedEmbeddings``: a compact ``SourceEmbeddings`` over V_k that takes *global* ids.
    Tokens and labels are remapped global→local on the way in, so the softmax runs over V_k
    only (the padded rows of the compact table are −inf like any padding). Built on first
    use so that importing dept_mega.dept does not import the model package."""
    global _TRIMMED_CLS
    if _TRIMMED_CLS is None:
        base = _model_embeddings_cls()

        class TrimmedEmbeddings(base):  # type: ignore[misc,valid-type]
            source: str = ""

            def embed(self, tokens):
                return super().embed(remap_tokens(tokens, self.lookup, self.source))

            def loss(self, hidden, labels):
                return super().loss(hidden, remap_tokens(labels, self.lookup, self.source))

        _TRIMMED_CLS = TrimmedEmbeddings
    return _TRIMMED_CLS


def make_trimmed_embeddings(cfg, pg, vocab_ids: torch.Tensor, global_vocab: int, source: str, seed: int,
                            has_input: bool, has_output: bool, rng, device):
    emb = trimmed_embeddings_class()(cfg.model, pg, int(vocab_ids.numel()), seed, has_input, has_output,
                                     sequence_parallel=cfg.parallel.sequence_parallel, rng=rng, device=device)
    emb.source = source
    emb.register_buffer("lookup", remap_lookup(vocab_ids.cpu(), global_vocab).to(device), persistent=False)
    return emb


class DeptHooks:
    """RoundHooks for glob / trim / spec / spec_opt."""

    def __init__(self, cfg, pg, trainer, device, sources: Sequence[SourceInfo]) -> None:
        self.cfg, self.pg, self.trainer, self.device = cfg, pg, trainer, torch.device(device)
        self.spec = variant_spec(cfg.dept.variant)
        self.sources = list(sources)
        self.names = [s.name for s in self.sources]
        self.index = {s.name: i for i, s in enumerate(self.sources)}
        if len(self.sources) < pg.num_groups:
            raise ValueError(f"data.sources: {len(self.sources)} sources cannot fill {pg.num_groups} groups")
        d = cfg.dept
        self.scheduler = RoundScheduler(len(self.sources), pg.num_groups, seed=cfg.train.seed,
                                        sampling=d.sampling, temperature=d.temperature,
                                        sizes=[s.size for s in self.sources])
        self.store = SourceStore()
        self.installed: Optional[str] = None
        self.plan = None
        self._resumed_round: Optional[int] = None
        self._mark = pg.comm.snapshot()  # counters at the last round end
        self._excluded = {c: 0 for c in CATEGORIES}  # evaluation traffic since then
        masters = dict(main_params=trainer.main_params, refresh=trainer.refresh_model_params)  # fp32 values
        self.body_sync = FlatSync(trainer.body_parameters(), pg, OuterOptimizer.from_config(d.outer_optimizer),
                                  category="outer_body", comm_dtype=d.outer_comm_dtype, **masters)
        self.embedding_sync: Optional[FlatSync] = None
        if self.spec.sync_embeddings_dense:
            self.embedding_sync = FlatSync(trainer.embedding_parameters(), pg,
                                           OuterOptimizer.from_config(d.outer_optimizer),
                                           category="outer_embedding", comm_dtype=d.outer_comm_dtype, **masters)
        self.phi: Optional[TrimTable] = None
        self.phi_head: Optional[TrimTable] = None
        self.positions: Optional[torch.nn.Parameter] = None
        self.position_sync: Optional[FlatSync] = None
        if self.spec.trimmed:
            self._init_trim()
        self._prepare_resume()

    def _prepare_resume(self) -> None:
        """When ``train.run_dir`` has a checkpoint, install the embeddings of the source this
        group trained at that step, so that the model keys of the checkpoint (saved with the
        installed source's vocabulary — SPEC-OPT, TRIM's compact tables) load in place; their
        values and optimizer state then come from :meth:`load_state_dict`."""
        if not self.spec.has_source_state:
            return
        from ..checkpoint import latest_step
        try:
            step = latest_step(self.cfg.train.run_dir)
        except (OSError, ValueError):
            return
        self.prepare_load(step)

    def prepare_load(self, step: Optional[int]) -> None:
        """Install fresh embeddings of the source this group trained at inner step ``step``, so
        that a checkpoint of that step (not necessarily ``latest``: ``evaluate --step``) loads
        in place; ``dept_mega.checkpoint.load_weights`` calls it before loading."""
        if not self.spec.has_source_state or not step:
            return
        plan = self.scheduler.plan((step - 1) // self.cfg.dept.local_steps)
        name = self.names[plan.sources[self.pg.group_index]]
        state = self._fresh_state(name)
        self.trainer.set_embeddings(state.embeddings, state.optimizer)

    # ------------------------------------------------------------------------- helpers
    @property
    def stages(self):
        return self.trainer.stages

    def _rng(self, i):
        return getattr(self.stages[i], "rng", None)

    def _build_embeddings(self, name: str) -> list:
        """Fresh embeddings of a source for this rank's chunks (None where a chunk has none)."""
        info = self.sources[self.index[name]]
        seed = source_seed(self.cfg.train.seed, self.index[name])
        out = []
        for i, st in enumerate(self.stages):
            if not (st.is_first or st.is_last):
                out.append(None)
                continue
            if self.spec.trimmed:
                out.append(make_trimmed_embeddings(self.cfg, self.pg, info.vocab_ids, self.global_vocab, name,
                                                   seed, st.is_first, st.is_last, self._rng(i), self.device))
            else:
                cls = _model_embeddings_cls()
                out.append(cls(self.cfg.model, self.pg, info.vocab_size, seed, st.is_first, st.is_last,
                               sequence_parallel=self.cfg.parallel.sequence_parallel, rng=self._rng(i),
                               device=self.device))
        return out

    def _fresh_state(self, name: str) -> SourceState:
        embs = self._build_embeddings(name)
        return SourceState(embs, self.trainer.make_embedding_optimizer(embs))

    # ------------------------------------------------------------------------- TRIM
    def _init_trim(self) -> None:
        for s in self.sources:
            if s.vocab_ids is None:
                raise ValueError(f"trim: source {s.name!r} has no vocabulary set V_k")
        self.global_vocab = self.sources[0].vocab_size
        # φ (and the untied head) from the model's init rule on the full table: a single-rank
        # layout gives the full weights (parameters are initialised full, then sliced).
        from ..parallel.groups import Coords, ParallelGroups
        solo = ParallelGroups(tp_size=1, dp_size=1, pp_size=1, num_groups=1, rank=0, coords=Coords(0, 0, 0, 0))
        full = _model_embeddings_cls()(self.cfg.model, solo, self.global_vocab, self.cfg.train.seed, True, True)
        V = self.global_vocab
        holds_table = any(st.is_first or (st.is_last and self.cfg.model.tie_embeddings) for st in self.stages)
        holds_head = any(st.is_last for st in self.stages) and not self.cfg.model.tie_embeddings
        if holds_table:
            self.phi = TrimTable(full.word_embeddings.weight[:V])
        if holds_head:
            self.phi_head = TrimTable(full.output_layer.weight[:V])
        if full.position_embeddings is not None and any(st.is_first for st in self.stages):
            self.positions = torch.nn.Parameter(full.position_embeddings.weight.detach().to(self.device).clone())
            self.position_sync = FlatSync([self.positions], self.pg,
                                          OuterOptimizer.from_config(self.cfg.dept.outer_optimizer),
                                          category="outer_embedding", comm_dtype=self.cfg.dept.outer_comm_dtype)
        del full

    def _trim_tables(self, emb):
        """(weight owner module, φ) pairs of one compact embedding on this rank."""
        out = []
        if emb.word_embeddings is not None and self.phi is not None:
            out.append((emb.word_embeddings, self.phi))
        if emb.output_layer is not None and self.phi_head is not None:
            out.append((emb.output_layer, self.phi_head))
        return out

    def _rows_of(self, owner, n_real: int) -> tuple[int, int]:
        rows = owner.weight.shape[0]
        start = self.pg.tp_rank * rows if self.pg.tp_size > 1 else 0
        return min(start, n_real), min(start + rows, n_real)

    @torch.no_grad()
    def _trim_fill(self, name: str, embs: list) -> None:
        ids = self.sources[self.index[name]].vocab_ids
        for emb in embs:
            if emb is None:
                continue
            for owner, phi in self._trim_tables(emb):
                a, b = self._rows_of(owner, ids.numel())
                w = self.trainer.main_params([owner.weight])[0]  # fp32 master of half weights
                w[: b - a].copy_(phi.gather(ids[a:b]).to(w.device, w.dtype))
                self.trainer.refresh_model_params([owner.weight])
            if emb.position_embeddings is not None and self.positions is not None:
                self.trainer.main_params([emb.position_embeddings.weight])[0].copy_(self.positions)
                self.trainer.refresh_model_params([emb.position_embeddings.weight])

    @torch.no_grad()
    def _trim_sync(self, name: str) -> None:
        ids = self.sources[self.index[name]].vocab_ids
        embs = self.trainer.embeddings()
        # one exchange per table kind on this rank (a tied table on two stages of one rank
        # with virtual pipelining is the same parameter: take it once)
        seen = set()
        for emb in embs:
            if emb is None:
                continue
            for owner, phi in self._trim_tables(emb):
                if id(owner.weight) in seen:
                    continue
                seen.add(id(owner.weight))
                a, b = self._rows_of(owner, ids.numel())
                mine = ids[a:b]
                local = self.trainer.main_params([owner.weight])[0][: b - a].to(phi.weight.device, torch.float32)
                delta = phi.gather(mine) - local
                all_ids, all_rows = exchange_rows(self.pg, mine.to(self.device), delta.to(self.device),
                                                  comm_dtype=self.cfg.dept.outer_comm_dtype)
                phi.apply(all_ids, all_rows)
            if emb.position_embeddings is not None and self.position_sync is not None:
                self.positions.data.copy_(self.trainer.main_params([emb.position_embeddings.weight])[0])
        if self.position_sync is not None:
            self.position_sync.sync()

    # ------------------------------------------------------------------------- hooks
    def round_start(self, loop, round_index: int) -> dict[int, str]:
        self.plan = self.scheduler.plan(round_index)
        mine = self.names[self.plan.sources[self.pg.group_index]]
        resumed, self._resumed_round = self._resumed_round, None
        if resumed == round_index and (mine == self.installed or not self.spec.has_source_state):
            # resumed from a checkpoint taken inside this round: everything is in place
            return {g: self.names[k] for g, k in enumerate(self.plan.sources)}
        if self.cfg.dept.reset_inner_optimizer:
            self._reset_group_optimizers()
        if self.spec.has_source_state:
            self._swap_in(mine)
        return {g: self.names[k] for g, k in enumerate(self.plan.sources)}

    def _reset_group_optimizers(self) -> None:
        """``dept.reset_inner_optimizer``: the group-owned inner state (body; GLOB's shared
        embeddings) starts every round empty (AdamW re-creates it lazily)."""
        self.trainer.body_optimizer.state.clear()
        if not self.spec.has_source_state:
            self.trainer.embedding_optimizer.state.clear()

    def _swap_in(self, mine: str) -> None:
        reset = self.cfg.dept.reset_inner_optimizer
        if self.installed is not None:
            embs, opt = self.trainer.embeddings(), self.trainer.embedding_optimizer
            self.store.put(self.installed, SourceState(list(embs), opt))
        moves = [(self.names[m.source], m.src_group, m.dst_group) for m in self.plan.moves]
        self.store.move(self.pg, moves, self._fresh_state, self.device, with_optimizer=not reset,
                        with_weights=not self.spec.trimmed)
        state = self.store.pop(mine) if mine in self.store else self._fresh_state(mine)
        if self.spec.trimmed:
            self._trim_fill(mine, state.embeddings)
        self.trainer.set_embeddings(state.embeddings, None if reset else state.optimizer)
        self.installed = mine

    def round_end(self, loop, round_index: int) -> dict[str, Any]:
        t0 = time.time()
        self.body_sync.sync()
        if self.embedding_sync is not None:
            self.embedding_sync.sync()
        if self.spec.trimmed and self.installed is not None:
            self._trim_sync(self.installed)
        seconds = time.time() - t0
        now = self.pg.comm.snapshot()
        mine = {c: now[c] - self._mark[c] - self._excluded[c] for c in CATEGORIES}
        self._mark, self._excluded = now, {c: 0 for c in CATEGORIES}
        return {"bytes": total_over_ranks(mine), "seconds": seconds}

    def make_iterator(self, source: str):
        return None  # TRIM remaps ids inside its compact embeddings (TrimmedEmbeddings)

    @contextlib.contextmanager
    def eval_context(self, loop, source: str):
        """Evaluate ``source`` with its own embeddings (SPEC), its compact rows of φ (TRIM) or
        the global ones (GLOB). Every group runs the same sequence of evaluations, so a SPEC
        source's holder can send a copy of its weights to the other groups (same (tp, dp, pp)
        position). Traffic inside is left out of the round's byte counts."""
        before = self.pg.comm.snapshot()
        restore = None
        try:
            if self.spec.has_source_state:
                embs = self._eval_embeddings(source)
                if embs is not None:
                    restore = self.trainer.set_embeddings(embs, self.trainer.embedding_optimizer)
            yield
        finally:
            if restore is not None:
                self.trainer.set_embeddings(*restore)
            after = self.pg.comm.snapshot()
            for c in CATEGORIES:
                self._excluded[c] += after[c] - before[c]

    def _eval_embeddings(self, source: str) -> Optional[list]:
        """The embeddings to evaluate ``source`` with, or None when they are installed already."""
        installed = source == self.installed
        if self.spec.trimmed:
            # compact rows from the synchronised φ. The installed tables hold this group's local
            # rows, which a mid-round evaluation must not overwrite: evaluate with a copy.
            embs = self.store.get(source).embeddings if (source in self.store and not installed) \
                else self._build_embeddings(source)
            self._trim_fill(source, embs)
            return embs
        holder = self._holder(self.index[source])
        if holder is None:  # never trained: its seeded initial embeddings, the same everywhere
            return self._build_embeddings(source)
        c = self.pg.coords
        if c.group == holder:
            embs = self.trainer.embeddings() if installed else self.store.get(source).embeddings
            payload = state_payload(SourceState(list(embs)), with_optimizer=False)
            transfers = [Transfer(self.pg.rank_of(c.tp, c.dp, c.pp, g), True, payload)
                         for g in range(self.pg.num_groups) if g != holder]
            exchange(self.pg, transfers, self.device)
            return None if installed else list(embs)
        t = Transfer(self.pg.rank_of(c.tp, c.dp, c.pp, holder), False)
        exchange(self.pg, [t], self.device)
        embs = self._build_embeddings(source)
        load_payload(SourceState(embs), t.received)
        return embs

    def _holder(self, k: int) -> Optional[int]:
        """The group that trained source k most recently (up to the current round)."""
        if self.plan is None:
            return None
        if k in self.plan.sources:
            return self.plan.sources.index(k)
        return self.plan.last_group[k]

    # ------------------------------------------------------------------------- state
    def state_dict(self) -> dict:
        """This rank's DEPT state for ``dept_mega.checkpoint`` (saved per rank): θ_{t-1} and
        outer optimizer state, φ and TRIM's positions, and every per-source state this rank
        holds — the installed source's included, so that a resumed run reinstalls it whatever
        vocabulary the trainer started with."""
        sd: dict[str, Any] = {"round": self.plan.round if self.plan is not None else None,
                              "installed": self.installed, "body_sync": self.body_sync.state_dict(),
                              "mark": dict(self._mark)}
        if self.embedding_sync is not None:
            sd["embedding_sync"] = self.embedding_sync.state_dict()
        if self.phi is not None:
            sd["phi"] = self.phi.weight.clone()
        if self.phi_head is not None:
            sd["phi_head"] = self.phi_head.weight.clone()
        if self.position_sync is not None:
            sd["positions"] = self.positions.detach().clone()
            sd["position_sync"] = self.position_sync.state_dict()
        with_opt = not self.cfg.dept.reset_inner_optimizer
        sd["store"] = {n: state_payload(self.store.get(n), with_opt) for n in self.store.names()}
        if self.spec.has_source_state and self.installed is not None:
            sd["installed_state"] = state_payload(
                SourceState(list(self.trainer.embeddings()), self.trainer.embedding_optimizer), with_opt)
        return sd

    def load_state_dict(self, sd: dict) -> None:
        self.body_sync.load_state_dict(sd["body_sync"])
        if self.embedding_sync is not None:
            self.embedding_sync.load_state_dict(sd["embedding_sync"])
        if self.phi is not None:
            self.phi.weight.copy_(sd["phi"])
        if self.phi_head is not None:
            self.phi_head.weight.copy_(sd["phi_head"])
        if self.position_sync is not None:
            self.positions.data.copy_(sd["positions"])
            self.position_sync.load_state_dict(sd["position_sync"])
        self.store = SourceStore()
        for n, payload in sd["store"].items():
            state = self._fresh_state(n)
            load_payload(state, payload)
            self.store.put(n, state)
        self.installed = sd["installed"]
        if self.spec.has_source_state and self.installed is not None:
            state = self._fresh_state(self.installed)
            load_payload(state, sd["installed_state"])
            self.trainer.set_embeddings(state.embeddings, state.optimizer)
        # a run resumed inside a round must not redo that round's moves and installs; the plan
        # also tells evaluation (evaluate.py) which group holds each source
        self._resumed_round = sd["round"]
        if sd["round"] is not None:
            self.plan = self.scheduler.plan(int(sd["round"]))
        self._mark = self.pg.comm.snapshot()


def sources_from_config(cfg, global_vocab: Optional[int]) -> list[SourceInfo]:
    """SourceInfo for every ``data.sources`` entry: sizes (tokens in the data), vocabularies
    (SPEC-OPT: each source's tokenizer) and TRIM's V_k (``vocab_set``)."""
    from ..data.indexed import IndexedDataset
    out = []
    for i, s in enumerate(cfg.data.sources):
        size = float(len(IndexedDataset(s.prefix).tokens)) * float(s.weight)
        if cfg.dept.variant == "spec_opt":
            from ..data.tokenizer import load_tokenizer
            vocab = load_tokenizer(s.tokenizer).vocab_size
        else:
            if global_vocab is None:
                from ..config import ConfigError
                raise ConfigError("config key 'data.tokenizer': a global vocabulary size is needed")
            vocab = int(global_vocab)
        ids = None
        if cfg.dept.variant == "trim":
            from ..data.sources import vocab_set
            ids = torch.as_tensor(vocab_set(s.prefix, cfg.data.cache_dir), dtype=torch.int64)
            if ids.numel() and int(ids.max()) >= vocab:
                from ..config import ConfigError
                raise ConfigError(f"config key 'data.sources[{i}].prefix': token id {int(ids.max())} of source "
                                 f"{s.name!r} is outside the global vocabulary of {vocab}")
        out.append(SourceInfo(s.name, vocab, size, ids))
    return out


def build_round_hooks(cfg, pg, trainer, device, sources: Optional[Sequence[SourceInfo]] = None) -> DeptHooks:
    """The RoundHooks of ``dept.variant`` (glob | trim | spec | spec_opt)."""
    if sources is None:
        global_vocab = None
        for st in trainer.stages:
            if getattr(st, "embeddings", None) is not None:
                global_vocab = st.embeddings.vocab_size
                break
        if global_vocab is None:
            global_vocab = cfg.model.vocab_size
        if global_vocab is None and cfg.data.tokenizer:
            from ..data.tokenizer import load_tokenizer
            global_vocab = load_tokenizer(cfg.data.tokenizer).vocab_size
        sources = sources_from_config(cfg, global_vocab)
    return DeptHooks(cfg, pg, trainer, device, sources)
