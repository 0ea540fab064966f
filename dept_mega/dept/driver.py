"""The DEPT round driver: the ``RoundHooks`` the training loop calls (``dept_mega.loop``).

The driver sequences one round and owns what every variant shares; what differs between
variants lives in one strategy object per variant (strategy.py; glob / trim / spec).

Round start (every rank, no communication except source moves):
  1. the round plan (rounds.py) gives each group its source;
  2. when sources own state (SPEC/SPEC-OPT/TRIM embeddings; with
     ``dept.body_optimizer_state: source`` also the body's AdamW state): the state of the
     source trained last round goes back to the store, sources that change group move point
     to point (store.py), and the group's source state is installed — built fresh (seeded)
     the first time a source is sampled; the strategy prepares it first (TRIM: rows of φ);
  3. the loop puts the source's batch iterator at the source's data position
     (:meth:`DeptHooks.source_steps`, from the plan history), whichever group read it before.
Inner steps (``before_step`` / ``after_step``): with ``dept.outer_fragments`` > 1 the body's
fragments are synchronised at their points of the round, and with ``dept.outer_overlap`` the
launched syncs are applied τ steps later (streaming.py).
Round end:
  4. body outer sync (``outer_body``; with fragments: the last one), the strategy's synced
     embedding state (GLOB's tables and positions: ``outer_embedding``; with fragments: its
     last part, the others went with their fragments) — launched only, with overlap — then
     the strategy's own sync (TRIM's rows and positions, blocking);
  5. the ``outer`` record: bytes per category sent by the whole job in this round (summed over
     ranks; evaluation traffic excluded), the sync's seconds, and ``overlap_seconds`` /
     ``exposed_seconds`` (streaming.py).
See docs/dept.md.
"""
from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from ..parallel.comm import CATEGORIES, total_over_ranks
from ..profiling import PhaseTimer
from .master_shards import value_access
from .memory import eager_start
from .outer import FlatSync, OuterOptimizer, sync_options
from .streaming import OuterSchedule, body_fragments, sync_units
from .rounds import RoundScheduler
from .store import SourceState, SourceStore, load_payload, state_payload
from .strategy import RoundView, StrategyContext
from .variants import make_strategy

BODY_OPTIMIZER_STATES = ("group", "source")
# per-rank chunk buffers of the FlatSyncs that checkpoints written before they were saved per
# parameter (dept_mega.checkpoint_state, layout.json: outer_group_keys) kept in the hook state
# (hook-state entry -> attribute), and the config key that makes each; loaded, no longer saved
CHUNK_BUFFERS = {"outer_residuals": "residual", "outer_eager": "eager_base"}
CHUNK_BUFFER_KEYS = {"outer_residuals": "dept.outer_error_feedback", "outer_eager": "dept.outer_overlap_rule"}


class PerRankChunkBuffers(ValueError):
    """A checkpoint's hook files hold per-rank chunk buffers (:data:`CHUNK_BUFFERS`, written
    before they were saved per parameter) where the load cannot cut them: under another
    tensor / pipeline layout (``dept_mega.checkpoint`` turns it into a ConfigError naming the
    layout key)."""


def _missing_chunk_buffer(entry: str, attr: str, k: str):
    """The ConfigError for a checkpoint's chunk buffer that this run does not keep."""
    from ..config import ConfigError
    return ConfigError(f"config key '{CHUNK_BUFFER_KEYS[entry]}': the checkpoint holds an outer {attr} for {k!r} "
                       f"in its hook files (written with it), this run keeps none there; resume with the setting "
                       f"the checkpoint was written with")


class _AtStage(Mapping):
    """``sds[(tp, dp)]`` of one pipeline stage seen as ``[(tp, dp, pp)]`` (the keys of
    ``VariantStrategy.joined_state``); values read on access."""

    def __init__(self, sds: Mapping, pp: int) -> None:
        self._sds, self._pp = sds, pp

    def __getitem__(self, key):
        t, d, p = key
        if p != self._pp:
            raise KeyError(key)
        return self._sds[(t, d)]

    def __iter__(self):
        return ((t, d, self._pp) for t, d in self._sds)

    def __len__(self) -> int:
        return len(self._sds)


def refuse_chunk_buffers(sd: dict) -> None:
    """Raise :class:`PerRankChunkBuffers` when the hook state dict ``sd`` holds per-rank
    chunk buffers (checked before a load that joins state over tensor / pipeline ranks)."""
    held = [f"{CHUNK_BUFFER_KEYS[e]} ({CHUNK_BUFFERS[e]})" for e in CHUNK_BUFFERS if sd.get(e)]
    if held:
        raise PerRankChunkBuffers(f"its hook files hold {', '.join(held)} as a chunk of each rank's flattened "
                                  f"body shard (written before they were saved per parameter and group: "
                                  f"layout.json without outer_group_keys), which another tensor or pipeline "
                                  f"layout cannot cut")


@dataclass
class SourceInfo:
    """What the hooks need to know of a source."""
    name: str
    vocab_size: int  # vocabulary of its embeddings: global (glob, trim, spec) or its own (spec_opt)
    size: float = 1.0  # for proportional / temperature sampling (tokens)
    vocab_ids: Optional[torch.Tensor] = None  # TRIM: V_k, sorted global ids


class DeptHooks:
    """RoundHooks for glob / trim / spec / spec_opt: the round driver."""

    def __init__(self, cfg, pg, trainer, device, sources: Sequence[SourceInfo]) -> None:
        self.cfg, self.pg, self.trainer, self.device = cfg, pg, trainer, torch.device(device)
        self.sources = list(sources)
        self.names = [s.name for s in self.sources]
        # federated source groups (dept/federation.py): this job is group ``group_index`` of
        # ``num_groups`` group jobs; pg is the job's own layout with one group
        self.federation = getattr(pg.outer, "federation", None)
        fed = self.federation
        self.group_index = fed.group if fed is not None else pg.group_index
        self.num_groups = fed.groups if fed is not None else pg.num_groups
        self.index = {s.name: i for i, s in enumerate(self.sources)}
        if len(self.sources) < pg.num_groups:
            raise ValueError(f"data.sources: {len(self.sources)} sources cannot fill {pg.num_groups} groups")
        d = cfg.dept
        mode = d.body_optimizer_state
        if mode not in BODY_OPTIMIZER_STATES:
            raise ValueError(f"dept.body_optimizer_state: {mode!r} is not one of {' | '.join(BODY_OPTIMIZER_STATES)}")
        self.body_per_source = mode == "source"
        if self.body_per_source and d.reset_inner_optimizer:
            raise ValueError("dept.body_optimizer_state: source keeps the body's inner optimizer state per source, "
                             "but dept.reset_inner_optimizer: true clears it every round")
        self.scheduler = self._make_scheduler(self.num_groups)
        self.store = SourceStore()
        self.installed: Optional[str] = None  # the source whose state is installed in the trainer
        self.plan = None
        self.in_round = False  # between round_start and round_end
        self._resumed_round: Optional[int] = None
        self._mark = pg.comm.snapshot()  # counters at the last round end
        self._excluded = {c: 0 for c in CATEGORIES}  # evaluation traffic since then
        F = d.outer_fragments
        parts = [trainer.body_parameters()] if F == 1 else body_fragments(trainer.stages, F, cfg.model.num_layers)
        # the fp32 values: full masters, or the distributed optimizer's shards (master_shards.py)
        self.body_syncs = [FlatSync(ps, pg, OuterOptimizer.from_config(d.outer_optimizer), category="outer_body",
                                    **sync_options(d), **value_access(trainer, ps, pg)) for ps in parts]
        self.strategy = make_strategy(d.variant, StrategyContext(cfg, pg, trainer, self.device, self.sources))
        units = sync_units(self.body_syncs, self.strategy.outer_syncs(), d.local_steps)
        self.schedule = OuterSchedule(units, d.local_steps, d.outer_delay if d.outer_overlap else 0,
                                      cfg.train.steps, eager=eager_start(cfg),
                                      mix=d.outer_mix_alpha if d.outer_overlap_rule == "mix" else None)
        # sources carry state of their own between rounds (moved with the source)
        self.per_source = self.strategy.source_embeddings or self.body_per_source
        self._prepare_resume()

    def _make_scheduler(self, groups: int, origin: Optional[dict] = None) -> RoundScheduler:
        """The round plans of a run with ``groups`` groups (``origin``: rebased there, see
        :meth:`RoundScheduler.rebase`)."""
        d = self.cfg.dept
        sched = RoundScheduler(len(self.sources), groups, seed=self.cfg.train.seed, sampling=d.sampling,
                               temperature=d.temperature, sizes=[s.size for s in self.sources])
        if origin:
            sched.rebase(origin["round"], origin["last_group"], origin["rounds_before"])
        return sched

    def schedule_state(self) -> Optional[dict]:
        """Where this run's schedule was rebased (after a resume with another number of
        groups), for the checkpoint's ``layout.json`` (``dept_schedule``); None: from round 0."""
        return self.scheduler.origin()

    def _use_schedule(self, layout: Optional[dict]) -> None:
        """Take the schedule a checkpoint of this number of groups recorded (a rebased one)."""
        if layout is None or int(layout.get("groups", self.pg.num_groups)) != self.pg.num_groups:
            return
        origin = layout.get("dept_schedule")
        if origin != self.scheduler.origin():
            self.scheduler = self._make_scheduler(self.num_groups, origin)

    def _plan_of(self, round_index: int):
        """The plan of ``round_index``; the round just before a rebased schedule's first one is
        represented by its history only (no sources trained, ``last_group`` = who holds what)."""
        origin = self.scheduler.origin()
        if origin is not None and round_index == origin["round"] - 1:
            from .rounds import RoundPlan
            return RoundPlan(round_index, (), (), tuple(origin["last_group"]), tuple(origin["rounds_before"]))
        return self.scheduler.plan(round_index)

    def _first_held(self, last_group) -> Optional[str]:
        """The source a group installs after a change of the number of groups: the first (by
        index) whose state it holds, None when it holds none."""
        mine = [k for k, g in enumerate(last_group) if g == self.group_index]
        return self.names[mine[0]] if mine else None

    @property
    def body_sync(self) -> FlatSync:
        """The body's FlatSync (``dept.outer_fragments: 1``; else see ``body_syncs``)."""
        if len(self.body_syncs) != 1:
            raise AttributeError("body_sync: the body is synchronised in fragments (body_syncs)")
        return self.body_syncs[0]

    @property
    def phi(self):
        """TRIM's global table φ on this rank (None for other variants or ranks without one)."""
        return getattr(self.strategy, "phi", None)

    def _prepare_resume(self) -> None:
        """When ``train.run_dir`` has a checkpoint, install the embeddings of the source this
        group trained at that step, so that the model keys of the checkpoint (saved with the
        installed source's vocabulary — SPEC-OPT, TRIM's compact tables) load in place; their
        values and optimizer state then come from :meth:`load_state_dict`."""
        if not self.strategy.source_embeddings:
            return
        from ..checkpoint import latest_step
        from ..manifest import LAYOUT_FILE, CheckpointError, read_json
        from ..resume import step_dir
        try:
            step = latest_step(self.cfg.train.run_dir)
            layout = read_json(step_dir(self.cfg.train.run_dir, step), LAYOUT_FILE) if step else None
        except (OSError, ValueError, CheckpointError):
            return  # no or a damaged checkpoint: the resume's verification reports it (and load_weights installs)
        self.prepare_load(step, layout)

    def prepare_load(self, step: Optional[int], layout: Optional[dict] = None) -> None:
        """Install fresh embeddings of the source this group trained at inner step ``step``, so
        that a checkpoint of that step (not necessarily ``latest``: ``evaluate --step``) loads
        in place; ``dept_mega.checkpoint.load_weights`` calls it before loading. ``layout``: the
        checkpoint's ``layout.json`` (its schedule, when rebased; another number of groups:
        nothing to install, :meth:`load_regrouped` installs the sources)."""
        if layout is not None and int(layout.get("groups", self.pg.num_groups)) != self.pg.num_groups:
            return
        self._use_schedule(layout)
        if not self.strategy.source_embeddings or not step:
            return
        plan = self._plan_of((step - 1) // self.cfg.dept.local_steps)
        if plan.sources:
            name = self.names[plan.sources[self.group_index]]
        else:  # saved just after a change of the number of groups (see load_regrouped)
            name = self._first_held(plan.last_group)
            if name is None:
                return
        state = self._fresh_state(name)
        self.trainer.set_embeddings(state.embeddings, state.optimizer)

    # ------------------------------------------------------------------------- data
    def source_steps(self, source: str, step: int) -> int:
        """Inner steps of ``[0, step)`` in which any group trained ``source``: where its data
        continues (the loop seeks its iterator there at every round start)."""
        return self.scheduler.steps_trained(self.index[source], step, self.cfg.dept.local_steps)

    # ------------------------------------------------------------------------- source state
    def _fresh_state(self, name: str) -> SourceState:
        if not self.strategy.source_embeddings:
            return SourceState([None] * len(self.trainer.stages))
        embs = self.strategy.build(name)
        return SourceState(embs, self.trainer.make_embedding_optimizer(embs))

    def _current_state(self, with_body: bool = True) -> SourceState:
        """The installed source's state as it is in the trainer now (not copied)."""
        tr = self.trainer
        if self.strategy.source_embeddings:
            state = SourceState(list(tr.embeddings()), tr.embedding_optimizer)
        else:
            state = SourceState([None] * len(tr.stages))
        if with_body and self.body_per_source:
            # the moments only: the body's weights (and their fp32 masters) are the group's
            state.body_optimizer = tr.body_optimizer.moments_state_dict()
        return state

    def _install(self, name: str, state: SourceState) -> None:
        reset = self.cfg.dept.reset_inner_optimizer
        if self.strategy.source_embeddings:
            self.strategy.install(name, state.embeddings)
            if reset and state.optimizer is not None:
                # AdamW's state goes; the optimizer (with the fp32 masters of the source's
                # embeddings under bf16/fp16) stays: a new one would start from the rounded weights
                state.optimizer.state.clear()
            self.trainer.set_embeddings(state.embeddings, state.optimizer)
        if self.body_per_source:
            opt = self.trainer.body_optimizer
            if state.body_optimizer is None:  # never trained: a fresh AdamW state
                opt.state.clear()
            else:
                opt.load_state_dict(state.body_optimizer, with_masters=False)
        self.installed = name

    # ------------------------------------------------------------------------- hooks
    def round_start(self, loop, round_index: int) -> dict[int, str]:
        if self.federation is not None:  # the round's quorum; a healed group continues at its peers' round
            round_index = self.federation.join_round(self, loop, round_index)
        self.plan = self.scheduler.plan(round_index)
        mine = self.names[self.plan.sources[self.group_index]]
        assignment = {g: self.names[k] for g, k in enumerate(self.plan.sources)}
        if self.federation is not None:
            assignment = {self.pg.group_index: mine}  # the loop's key: this job's only group
        resumed, self._resumed_round = self._resumed_round, None
        self.in_round = True
        if resumed == round_index and (mine == self.installed or not self.per_source):
            # resumed from a checkpoint taken inside this round: everything is in place
            self.strategy.begin_round(mine)
            return assignment
        if self.cfg.dept.reset_inner_optimizer:
            self._reset_group_optimizers()
        if self.per_source:
            self._swap_in(mine)
        self.strategy.begin_round(mine)
        return assignment

    def _reset_group_optimizers(self) -> None:
        """``dept.reset_inner_optimizer``: the group-owned inner state (body; GLOB's shared
        embeddings) starts every round empty (AdamW re-creates it lazily)."""
        self.trainer.body_optimizer.state.clear()
        self.strategy.reset_group_optimizer()

    def _swap_in(self, mine: str) -> None:
        reset = self.cfg.dept.reset_inner_optimizer
        if self.installed is not None:
            self.store.put(self.installed, self._current_state())
        moves = [(self.names[m.source], m.src_group, m.dst_group) for m in self.plan.moves]
        self.store.move(self.pg, moves, self._fresh_state, self.device, with_optimizer=not reset,
                        with_weights=self.strategy.move_weights)
        state = self.store.pop(mine) if mine in self.store else self._fresh_state(mine)
        self._install(mine, state)

    def before_step(self, loop) -> None:
        """Before an inner step: fragments due now are launched (streaming.py)."""
        self.schedule.before_step(self.trainer.step)

    def after_step(self, loop) -> None:
        """After an inner step: overlapped syncs due now are applied."""
        self.schedule.after_step(self.trainer.step)

    def can_save_now(self) -> bool:
        """True when no outer sync is in flight: checkpoints are taken only then."""
        return self.schedule.idle

    def round_end(self, loop, round_index: int) -> dict[str, Any]:
        whole = PhaseTimer(self.device)  # GPU time on CUDA (host time would only see queuing)
        self.schedule.round_end(self.trainer.step)
        strategy = PhaseTimer(self.device)
        self.strategy.sync(self.installed)
        strategy.stop()
        whole.stop()
        self.in_round = False
        seconds, strategy_seconds = whole.seconds(), strategy.seconds()
        overlap, exposed = self.schedule.take_times()
        now = self.pg.comm.snapshot()
        mine = {c: now[c] - self._mark[c] - self._excluded[c] for c in CATEGORIES}
        self._mark, self._excluded = now, {c: 0 for c in CATEGORIES}
        out = {"bytes": total_over_ranks(mine), "seconds": seconds, "overlap_seconds": overlap,
               "exposed_seconds": exposed + strategy_seconds}
        if self.federation is not None:
            out["groups"] = self.federation.round_groups  # the groups whose pseudo-gradients were averaged
        return out

    def state_replicated_over_dp(self) -> bool:
        """True when :meth:`state_dict` is the same on the D data-parallel replicas of a group
        (per-source embeddings and their AdamW state are replicated; the distributed
        optimizer's shards and TRIM's row state are not): the checkpoint then stores it once
        per (tp, pp, group) and it loads under another ``parallel.data``."""
        # (with the distributed optimizer the optimizer states kept per source are its per-rank
        # shards; the error-feedback residuals and the eager start's estimates, a chunk per rank,
        # are not in this state: dept_mega.checkpoint_state saves them per parameter and group)
        sharded_sources = self.cfg.optim.distributed and (self.strategy.source_embeddings or self.body_per_source)
        return self.strategy.name != "trim" and not sharded_sources

    def hook_state_dp_joinable(self) -> bool:
        """True when per-rank hook state saved under another ``parallel.data`` (same tensor and
        pipeline layout) can be joined by :meth:`load_state_dict_dp_joined`: TRIM, whose φ is
        row-sharded over the stage's tensor × data-parallel ranks, every variant's
        error-feedback residuals and the eager start's estimates in checkpoints that kept them
        in the hook files (``dept.outer_error_feedback``, ``dept.outer_overlap_rule: eager``: a
        chunk of each FlatSync per replica; later ones save them per parameter) and the
        distributed optimizer's shards in the per-source optimizer states
        (:meth:`hook_state_redistributable`)."""
        return True

    def hook_state_redistributable(self) -> bool:
        """True when the per-source optimizer states of :meth:`state_dict` (a source's embedding
        optimizer; the body's with ``dept.body_optimizer_state: source``) load under another
        distributed-optimizer layout — another data-parallel or bucket size, the distributed
        optimizer switched on or off — through :meth:`load_state_dict_dp_joined` (and
        :meth:`dp_joined_state` for :meth:`load_regrouped`): the old data-parallel ranks' pieces
        are joined and this rank's cut (``optim_reshard.redistribute_state_dict``); TRIM's φ
        rows are joined beside them (``VariantStrategy.joined_state``)."""
        return True

    def load_state_dict_dp_joined(self, sds: dict) -> None:
        """:meth:`load_state_dict` from ``sds[(tp, dp)]``, the hook states saved by every rank of
        this rank's (pipeline stage, group) under another data-parallel size (or, saved once
        per (tp, pp, group), data-parallel rank 0's only): TRIM's row-sharded φ and chunked
        outer state joined (``VariantStrategy.joined_state``) and cut here, and the rest as
        :meth:`dp_joined_state` says."""
        self.load_state_dict(self.dp_joined_state(sds))

    def dp_joined_state(self, sds: dict, strategy_state: bool = True) -> dict:
        """This rank's :meth:`state_dict` from ``sds[(tp, dp)]``, the hook states saved by the
        data-parallel ranks at this rank's tensor position (and pipeline stage) of one group
        under another data-parallel size or distributed-optimizer layout: the replicated part
        from data rank 0's (TRIM's φ joined from every (tp, dp) file of the stage), the
        error-feedback residuals and eager estimates (CHUNK_BUFFERS) joined from the old
        replicas' chunks (near-equal, in data-parallel order) and cut into this rank's chunk,
        every per-source optimizer state joined from the old replicas' pieces and cut for this
        rank's optimizers (:meth:`hook_state_redistributable`). ``strategy_state=False``: the
        strategy's own state (TRIM's φ, ``STATE_KEYS``) is left out, and ``sds`` needs only
        this rank's tensor position (:meth:`load_regrouped` takes it from old group 0 alone)."""
        tp = self.pg.tp_rank
        mine = sds[(tp, 0)]
        old = sorted(d for t, d in sds if t == tp)
        if not strategy_state:
            sd = {k: v for k, v in mine.items() if k not in self.strategy.STATE_KEYS}
        else:  # the strategy's own state whole (TRIM: φ's row shards, the positions' chunked outer state)
            sd = dict(mine)
            sd.update(self.strategy.joined_state(_AtStage(sds, self.pg.pp_rank)))
        if self.per_source:
            replicas = [sds[(tp, d)] for d in old]
            self._same_sources(replicas)
            sd["store"] = {n: self._redistributed(n, [x["store"][n] for x in replicas]) for n in mine["store"]}
            if mine.get("installed_state") is not None:
                sd["installed_state"] = self._redistributed(mine["installed"], [x["installed_state"] for x in replicas])
        syncs = self.outer_syncs()
        for entry, attr in CHUNK_BUFFERS.items():
            joined = {}
            for k in mine.get(entry) or {}:
                if k not in syncs or getattr(syncs[k], attr) is None:
                    raise _missing_chunk_buffer(entry, attr, k)
                full = torch.cat([sds[(tp, d)][entry][k].reshape(-1) for d in old])
                if full.numel() != syncs[k].numel:
                    raise ValueError(f"outer {attr} {k!r}: the old replicas' chunks hold {full.numel()} values, "
                                     f"the shard {syncs[k].numel}")
                joined[k] = syncs[k].cut_chunk(full)
            if joined:
                sd[entry] = joined
        return sd

    def _redistributed(self, name: str, payloads: list[dict]) -> dict:
        """Source ``name``'s state payload (:func:`~dept_mega.dept.store.state_payload`) for this
        rank from ``payloads``, the old data-parallel replicas' (in data-parallel order): the
        weights as data rank 0 saved them, the embedding optimizer's and the body optimizer's
        state joined and cut for this rank's (``optim_reshard.redistribute_state_dict``)."""
        from ..optim_reshard import redistribute_state_dict
        first = payloads[0]
        sharded = any(isinstance(p.get(k), dict) and "shard" in p[k] for p in payloads
                      for k in ("optimizer", "body_optimizer"))
        if not sharded and not self.cfg.optim.distributed:
            return first  # the plain optimizer on both sides: the replicas' states are the same
        out = {k: v for k, v in first.items() if k != "param_names"}  # the names are the old pieces'
        if first.get("optimizer") is not None:
            opt = self._fresh_state(name).optimizer
            out["optimizer"] = redistribute_state_dict([p["optimizer"] for p in payloads], opt,
                                                       f"source {name!r}: embedding optimizer")
        if first.get("body_optimizer") is not None:
            out["body_optimizer"] = redistribute_state_dict([p["body_optimizer"] for p in payloads],
                                                            self.trainer.body_optimizer,
                                                            f"source {name!r}: body optimizer")
        return out

    def hook_state_reshardable(self) -> bool:
        """True when :meth:`state_dict` is the same at every (tp, pp) position, so that a
        checkpoint loads under another tensor / pipeline size (``dept_mega.reshard``): no
        per-source state (GLOB with the body's optimizer state per group; the outer state is
        under ``dept/...`` keys) and replicated over data parallelism."""
        return not self.per_source and self.strategy.name != "trim" and self.state_replicated_over_dp()

    def hook_state_tensor_reshardable(self) -> bool:
        """True when the per-source hook state saved once per (tp, pp, group) (``hooks_dp0``:
        the plain optimizer) loads under another tensor-parallel size
        (:meth:`load_state_dict_resharded`, same pipeline layout) and, from a checkpoint that
        saved the parameter names of its optimizer states (``layout.json``:
        ``hooks_param_names``), under another pipeline / virtual-pipeline size or into the
        distributed optimizer (:meth:`load_state_dict_repartitioned`, which cuts this rank's
        pieces): SPEC / SPEC-OPT, whose per-source embeddings and AdamW states are found by
        name whatever stage held them, and GLOB with ``dept.body_optimizer_state: source`` (the
        body's AdamW moments per source, no per-source embeddings). Error-feedback residuals
        and eager estimates are not in this state: saved per parameter and group
        (``outer_group_keys``), they reshard like θ_{t-1}; ``check_layout`` refuses older
        checkpoints that kept them in the hook files."""
        return self.strategy.name in ("spec", "spec_opt") or (self.strategy.name == "glob" and self.body_per_source)

    def hook_state_param_names(self) -> bool:
        """True when :meth:`state_dict` saves, with every per-source optimizer state, the
        global parameter names of its entries (``param_names``; ``layout.json``:
        ``hooks_param_names``)."""
        return self.per_source

    def _global_names(self) -> dict[int, str]:
        """Parameter id → its name in the model chunk (global: ``body.layers.{i}`` carries the
        global layer index), the first chunk's where a parameter is in two."""
        out: dict[int, str] = {}
        for st in self.trainer.stages:
            for n, p in st.named_parameters():
                out.setdefault(id(p), n)
        return out

    def _with_param_names(self, payload: dict, state: SourceState) -> dict:
        """``payload`` with the global names of its optimizer states' entries: per optimizer
        ``{"state": [name of state index i], "params": [name of main_params[j]]}``."""
        def named(opt, names: Optional[dict[int, str]]) -> dict:
            names = opt.names if names is None else names
            return {"state": [n for n, _ in opt.indexed_params(names)],
                    "params": [names[id(opt.params[i])] for i, _, _ in opt.pieces_signature()]}

        out = {}
        if payload.get("optimizer") is not None and state.optimizer is not None:
            out["optimizer"] = named(state.optimizer, None)  # "embeddings.{name}" (Trainer.make_embedding_optimizer)
        if payload.get("body_optimizer") is not None:
            out["body_optimizer"] = named(self.trainer.body_optimizer, self._global_names())
        return dict(payload, param_names=out)

    def _reshard_to(self, parts: list, param, what: str = "") -> torch.Tensor:
        """The saved tensor shards ``parts`` (old tensor ranks 0..T'-1) of a per-source tensor
        joined along ``param``'s partition dimension and cut into this rank's shard
        (``dept_mega.reshard``); scalars, non-tensors and tensors without a parameter as saved."""
        from ..reshard import cut_shard, join_shards
        if not torch.is_tensor(parts[0]) or parts[0].dim() == 0 or param is None:
            return parts[0]
        dim = getattr(param, "partition_dim", None)
        stride = int(getattr(param, "partition_stride", 1) or 1)
        if parts[0].dim() == 1 and param.dim() > 1:  # flattened (joined distributed-optimizer pieces)
            shape = list(param.shape)
            if dim is not None:
                shape[dim] = -1  # the old shard's extent along the partition dimension
            parts = [x.reshape(shape) for x in parts]
        out = cut_shard(join_shards(list(parts), dim, stride), dim, stride, self.pg.tp_size, self.pg.tp_rank)
        if tuple(out.shape) != tuple(param.shape):
            raise ValueError(f"{what + ': ' if what else ''}resharded to {tuple(out.shape)}, this launch holds "
                             f"{tuple(param.shape)}")
        return out.clone()

    def load_state_dict_repartitioned(self, sds: dict) -> None:
        """:meth:`load_state_dict` of :meth:`repartitioned_state`."""
        self.load_state_dict(self.repartitioned_state(sds))

    def repartitioned_state(self, sds: dict) -> dict:
        """This rank's :meth:`state_dict` from ``sds[(tp, pp)]``, the state dicts saved at every
        (tensor rank, pipeline rank) of this rank's group under another tensor, pipeline and / or
        virtual-pipeline layout (each with the ``param_names`` of :meth:`state_dict`). Per
        source: every embedding tensor this rank's chunks hold is taken from the first old
        (stage, chunk) that held one of that name (a tied head's copy on the last stage
        receives the updates of the first stage's table), its AdamW state and the body's
        (``dept.body_optimizer_state: source``) by the parameter names saved with them; each
        joined over the old tensor ranks along its parameter's partition dimension and cut
        into this rank's shard (``dept_mega.reshard``). ``sds`` may hold only this rank's
        stage (the same pipeline layout). The optimizer states come out for this rank's
        optimizers: the distributed optimizer's pieces are cut from the resharded whole
        (``optim_reshard.redistribute_state_dict``)."""
        for x in sds.values():
            refuse_chunk_buffers(x)
        from ..optim_reshard import groups_like, redistribute_state_dict
        from ..optimizer import state_order
        T = 1 + max(t for t, _ in sds)
        stages = sorted({p for _, p in sds})
        if sorted(sds) != [(t, p) for t in range(T) for p in stages]:
            raise ValueError(f"expected the hook state of every tensor rank of {T} at stages {stages}, "
                             f"got {sorted(sds)}")
        s0 = stages[0]
        first = sds[(0, s0)]

        def holders(parts: dict, kind: str, field: str) -> dict[str, tuple[int, dict]]:
            """name -> (old pipeline rank that held it first, {tensor rank: index there})."""
            out: dict[str, tuple[int, dict]] = {}
            for p in stages:
                for t in range(T):
                    names = (parts[(t, p)].get("param_names") or {}).get(kind)
                    if names is None:
                        raise ValueError(f"the saved {kind} state at tensor rank {t}, pipeline rank {p} has no "
                                         f"parameter names")
                    for i, n in enumerate(names[field]):
                        if n not in out or out[n][0] == p:
                            out.setdefault(n, (p, {}))[1].setdefault(t, i)
            return out

        def optimizer_sd(parts: dict, kind: str, opt, names: Optional[dict[int, str]], source: str) -> Optional[dict]:
            saved = {k: v.get(kind) for k, v in parts.items()}
            if all(v is None for v in saved.values()):
                return None
            if any(v is None for v in saved.values()):
                raise ValueError(f"source {source!r}: its {kind} state was saved at some stages only")
            by_state, by_param = holders(parts, kind, "state"), holders(parts, kind, "params")
            names_of = opt.names if names is None else names
            # the plain optimizer's order of this rank's parameters (the distributed one: cut below)
            plain = [(names_of[id(opt.params[i])], opt.params[i])
                     for i, _, _ in state_order([(i, 0, 0) for i in range(len(opt.params))], opt.params)]
            state = {}
            for j, (n, param) in enumerate(plain):
                if n not in by_state:
                    raise ValueError(f"source {source!r}: no saved stage holds the {kind} state of {n}")
                p, index = by_state[n]
                entries = [saved[(t, p)]["state"].get(index[t]) for t in range(T)]
                if entries[0] is None:
                    continue  # saved without state (never stepped)
                state[j] = {k: self._reshard_to([e[k] for e in entries], param, f"source {source!r}: {kind} {k} of {n}")
                            for k in entries[0]}
            # the hyperparameters (lr, betas, ...) of the saved group with the same weight decay
            groups = groups_like([g for p in stages for g in saved[(0, p)]["param_groups"]], opt)
            out = {k: v for k, v in saved[(0, s0)].items() if k not in ("state", "param_groups", "main_params")}
            out.update(state=state, param_groups=groups)
            if "main_params" in saved[(0, s0)]:
                mains = []
                for param in opt.params:
                    n = names_of[id(param)]
                    if n not in by_param:
                        raise ValueError(f"source {source!r}: no saved stage holds the {kind} master of {n}")
                    p, index = by_param[n]
                    mains.append(self._reshard_to([saved[(t, p)]["main_params"][index[t]] for t in range(T)], param,
                                         f"source {source!r}: {kind} master of {n}"))
                out["main_params"] = mains
            if getattr(opt, "distributed", False):
                out = redistribute_state_dict([out], opt, f"source {source!r}: {kind}")
            return out

        def payload(name: str, parts: dict) -> dict:
            fresh = self._fresh_state(name)
            embs = []
            for c, e in enumerate(fresh.embeddings):
                if e is None:
                    embs.append(None)
                    continue
                held = e.state_dict(keep_vars=True)
                sd = {}
                for k, v in held.items():
                    at = [(p, c0) for p in stages for c0, x in enumerate(parts[(0, p)]["embeddings"])
                          if x is not None and k in x]
                    if not at:
                        raise ValueError(f"source {name!r}: no saved stage holds its embeddings' {k}")
                    p, c0 = at[0]
                    sd[k] = self._reshard_to([parts[(t, p)]["embeddings"][c0][k] for t in range(T)], v,
                                    f"source {name!r}: embeddings' {k}")
                embs.append(sd)
            return {"embeddings": embs,
                    "optimizer": optimizer_sd(parts, "optimizer", fresh.optimizer, None, name)
                    if fresh.optimizer is not None else None,
                    "body_optimizer": optimizer_sd(parts, "body_optimizer", self.trainer.body_optimizer,
                                                   self._global_names(), name),
                    "extra": dict(parts[(0, s0)].get("extra", {}))}

        names = sorted(first["store"])
        for k, x in sds.items():
            if sorted(x["store"]) != names or x.get("installed") != first.get("installed"):
                raise ValueError(f"the hook state at (tensor, pipeline) rank {k} holds other sources "
                                 f"({sorted(x['store'])}, installed {x.get('installed')!r}) than at (0, {s0}) "
                                 f"({names}, installed {first.get('installed')!r})")
        sd = dict(first)
        sd["store"] = {n: payload(n, {k: x["store"][n] for k, x in sds.items()}) for n in names}
        if first.get("installed_state") is not None:
            sd["installed_state"] = payload(first["installed"], {k: x["installed_state"] for k, x in sds.items()})
        return sd

    def load_state_dict_resharded(self, sds: list[dict]) -> None:
        """:meth:`load_state_dict` of :meth:`resharded_state`."""
        self.load_state_dict(self.resharded_state(sds))

    def resharded_state(self, sds: list[dict]) -> dict:
        """This rank's :meth:`state_dict` from the state dicts saved by tensor ranks 0..T'-1 of this
        rank's (pipeline rank, group) under another tensor size T': every per-source tensor
        (embedding weights, their AdamW moments, the body's AdamW moments when kept per source)
        is joined along its parameter's partition dimension and cut into this rank's shard
        (``dept_mega.reshard``)."""

        for x in sds:
            refuse_chunk_buffers(x)

        def optimizer_sd(parts: list[Optional[dict]], opt) -> Optional[dict]:
            if parts[0] is None:
                return None
            mains = {id(opt._main_of(p)): p for p in opt.params}
            order = [mains[id(m)] for g in opt.inner.param_groups for m in g["params"]]
            out = dict(parts[0], state={})
            for i, st in parts[0]["state"].items():
                out["state"][i] = {k: self._reshard_to([sd["state"][i][k] for sd in parts], order[int(i)]) for k in st}
            if "main_params" in parts[0]:
                out["main_params"] = [self._reshard_to([sd["main_params"][j] for sd in parts], p)
                                      for j, p in enumerate(opt.params)]
            return out

        def payload(name: str, parts: list[dict]) -> dict:
            fresh = self._fresh_state(name)
            embs = []
            for c, e in enumerate(fresh.embeddings):
                if parts[0]["embeddings"][c] is None or e is None:
                    embs.append(None)
                    continue
                held = e.state_dict(keep_vars=True)
                embs.append({k: self._reshard_to([p["embeddings"][c][k] for p in parts], held[k])
                             for k in parts[0]["embeddings"][c]})
            return {"embeddings": embs,
                    "optimizer": optimizer_sd([p["optimizer"] for p in parts], fresh.optimizer)
                    if fresh.optimizer is not None else None,
                    "body_optimizer": optimizer_sd([p.get("body_optimizer") for p in parts], self.trainer.body_optimizer),
                    "extra": dict(parts[0].get("extra", {}))}

        sd = dict(sds[0])
        sd["store"] = {n: payload(n, [x["store"][n] for x in sds]) for n in sds[0]["store"]}
        if sds[0].get("installed_state") is not None:
            sd["installed_state"] = payload(sds[0]["installed"], [x["installed_state"] for x in sds])
        return sd

    def hook_state_rank_reshardable(self) -> bool:
        """True when the hook state saved per rank (not once per (tp, pp, group)) loads under
        another tensor, pipeline or virtual-pipeline size, the data-parallel size changing with
        them or not (:meth:`load_state_dict_rank_resharded`): TRIM, whose φ is row-sharded
        over a stage's tp × dp ranks and whose per-source state is replicated over data
        parallelism, and SPEC / SPEC-OPT saved with the distributed optimizer (each source's
        embeddings replicated, its AdamW states and the body's with
        ``dept.body_optimizer_state: source`` in per-rank pieces), the distributed optimizer
        on either side (the per-source pieces joined over the old data-parallel ranks by
        parameter name and cut for this rank's optimizers); GLOB with
        ``dept.body_optimizer_state: source`` and the distributed optimizer (the body's
        per-source pieces) the same. Error-feedback residuals and eager estimates: as
        :meth:`hook_state_tensor_reshardable` says."""
        return self.strategy.name in ("trim", "spec", "spec_opt") or (self.strategy.name == "glob"
                                                                      and self.body_per_source)

    def load_state_dict_rank_resharded(self, sds, staged: bool) -> None:
        """:meth:`load_state_dict` of :meth:`rank_resharded_state`."""
        self.load_state_dict(self.rank_resharded_state(sds, staged))

    def rank_resharded_state(self, sds, staged: bool, strategy_state: bool = True) -> dict:
        """:meth:`load_state_dict` (TRIM; SPEC / SPEC-OPT saved with the distributed optimizer)
        from ``sds[(tp, dp, pp)]``, the state dicts saved by the old ranks of this rank's group
        under another tensor / pipeline / virtual-pipeline (and maybe data-parallel) layout:
        every old rank of every stage when ``staged`` (another pipeline or virtual-pipeline
        size), else of this rank's stage (a mapping that may read its files lazily). The
        per-source state (SPEC's embeddings or TRIM's compact tables, their AdamW state, the
        body's with ``dept.body_optimizer_state: source``) comes from the old data rank 0 files
        and is joined and cut by :meth:`repartitioned_state` by parameter name when
        ``staged``, else :meth:`resharded_state`. With the distributed optimizer on either
        side the per-source optimizer states are joined by parameter name from the pieces of
        every old data rank (:meth:`_plain_payloads`; all files of the stages read), resharded
        by name (:meth:`repartitioned_state`) and cut into this rank's pieces. The strategy's
        own state (``STATE_KEYS``; TRIM: φ, φ_head, their per-row outer state and the learned
        positions' outer state) is joined whole (``joined_state``; SPEC / SPEC-OPT: none) and
        :meth:`load_state_dict` cuts this rank's rows and chunk."""
        T = 1 + max(t for t, _, _ in sds)
        D = 1 + max(d for _, d, _ in sds)
        stages = sorted({p for _, _, p in sds})
        refuse_chunk_buffers(sds[(0, 0, stages[0])])  # every old rank's file holds its chunk, if any
        if self.cfg.optim.distributed or self._has_pieces(sds[(0, 0, stages[0])]):
            sd = self.repartitioned_state({(t, p): self._plain_payloads([sds[(t, d, p)] for d in range(D)])
                                            for t in range(T) for p in stages})
        elif staged:
            sd = self.repartitioned_state({(t, p): sds[(t, 0, p)] for t in range(T) for p in stages})
        else:
            if stages != [self.pg.pp_rank]:
                raise ValueError(f"expected the hook state of pipeline rank {self.pg.pp_rank}, got stages {stages}")
            sd = self.resharded_state([sds[(t, 0, self.pg.pp_rank)] for t in range(T)])
        own = self.strategy.STATE_KEYS
        sd = {k: v for k, v in sd.items() if k not in own}
        if strategy_state:  # (load_regrouped takes it from old group 0's only)
            sd.update(self.strategy.joined_state(sds))
        return sd

    @staticmethod
    def _payloads_of(sd: dict) -> list[dict]:
        """The per-source payloads of a hook state dict (the store's and the installed one's)."""
        return list(sd["store"].values()) + ([sd["installed_state"]] if sd.get("installed_state") else [])

    @staticmethod
    def _has_pieces(sd: dict) -> bool:
        """True when a hook state dict's per-source optimizer states are the distributed
        optimizer's pieces (``"shard"``)."""
        return any(isinstance(p.get(k), dict) and "shard" in p[k] for p in DeptHooks._payloads_of(sd)
                   for k in ("optimizer", "body_optimizer"))

    @staticmethod
    def _same_sources(replicas: list[dict]) -> None:
        """The data-parallel replicas' hook states (data rank 0's first) hold the same sources."""
        first = replicas[0]
        for x in replicas:
            if sorted(x["store"]) != sorted(first["store"]) or x.get("installed") != first.get("installed"):
                raise ValueError(f"the data-parallel replicas' hook states hold other sources "
                                 f"({sorted(x['store'])}, installed {x.get('installed')!r}) than data rank 0's "
                                 f"({sorted(first['store'])}, installed {first.get('installed')!r})")

    def _plain_payloads(self, replicas: list[dict]) -> dict:
        """The hook state dict of the old data rank 0 of one (tensor, pipeline) position with
        every per-source optimizer state that the distributed optimizer saved in pieces joined
        from ``replicas`` (every old data rank's state dict there, in data-parallel order)
        into the plain optimizer's form, named by parameter
        (``optim_reshard.join_named_pieces``), for :meth:`repartitioned_state`."""
        from ..optim_reshard import join_named_pieces
        first = replicas[0]
        self._same_sources(replicas)

        def plain(name: str, payloads: list[dict]) -> dict:
            out = dict(payloads[0])
            for kind in ("optimizer", "body_optimizer"):
                if isinstance(out.get(kind), dict) and "shard" in out[kind]:
                    out[kind], names = join_named_pieces([p[kind] for p in payloads],
                                                         [p["param_names"][kind] for p in payloads],
                                                         f"source {name!r}: {kind}")
                    out["param_names"] = dict(out["param_names"], **{kind: names})
            return out

        sd = dict(first)
        sd["store"] = {n: plain(n, [x["store"][n] for x in replicas]) for n in first["store"]}
        if first.get("installed_state") is not None:
            sd["installed_state"] = plain(first["installed"], [x["installed_state"] for x in replicas])
        return sd

    def outer_syncs(self) -> dict[str, FlatSync]:
        """Every FlatSync the schedule drives, by the name its state has in checkpoints
        (dept_mega.checkpoint_state): ``outer_body`` (``outer_body_f{i}`` per fragment with
        ``dept.outer_fragments`` > 1) and the strategy's (GLOB's tables: ``outer_embedding``)."""
        body = self.body_syncs
        out = {"outer_body": body[0]} if len(body) == 1 else {f"outer_body_f{i}": s for i, s in enumerate(body)}
        own = self.strategy.outer_syncs()
        out.update({"outer_embedding": own[0]} if len(own) == 1
                   else {f"outer_embedding_{i}": s for i, s in enumerate(own)})
        return out

    @contextlib.contextmanager
    def uncounted(self):
        """Traffic inside (evaluation, checkpoint gathers) is left out of the round's byte counts."""
        before = self.pg.comm.snapshot()
        try:
            yield
        finally:
            after = self.pg.comm.snapshot()
            for c in CATEGORIES:
                self._excluded[c] += after[c] - before[c]

    def make_iterator(self, source: str):
        return None  # TRIM remaps ids inside its compact embeddings (TrimmedEmbeddings)

    @contextlib.contextmanager
    def eval_context(self, loop, source: str):
        """Evaluate ``source`` with the embeddings its variant's strategy names (docs/dept.md,
        "Evaluation"). Every group runs the same sequence of evaluations, so the group holding
        a source's weights can send a copy to the other groups (same (tp, dp, pp) position).
        Traffic inside is left out of the round's byte counts."""
        restore = None
        with self.uncounted():
            try:
                view = RoundView(self.plan, self.installed, self.store, self.in_round)
                # federated: a group job evaluates only its own source, with what it trains
                embs = None if self.federation is not None else self.strategy.eval_embeddings(source, view)
                if embs is not None:
                    restore = self.trainer.set_embeddings(embs, self.trainer.embedding_optimizer)
                yield
            finally:
                if restore is not None:
                    self.trainer.set_embeddings(*restore)

    # ------------------------------------------------------------------------- state
    def state_dict(self) -> dict:
        """This rank's DEPT state for ``dept_mega.checkpoint`` (saved per rank): θ_{t-1} and
        outer optimizer state, the variant's own state (GLOB's embedding sync; TRIM's φ with
        its row state and positions), and every per-source state this rank holds — the
        installed source's included, so that a resumed run reinstalls it whatever vocabulary
        the trainer started with (its body optimizer state, if per source, is the trainer's
        and saved with the model). Plain dicts, lists, numbers, strings and tensors only:
        loadable with ``torch.load(..., weights_only=True)``."""
        if not self.schedule.idle:
            raise RuntimeError("DeptHooks.state_dict: an outer sync is in flight; checkpoints are taken only where "
                               "can_save_now() is true")
        # the outer state of every FlatSync is not here: dept_mega.checkpoint saves it per parameter
        # from outer_syncs() (dept_mega.checkpoint_state): θ_{t-1} and the outer optimizer's once,
        # the error-feedback residuals and eager estimates (chunk buffers) once per group
        sd: dict[str, Any] = {"round": self.plan.round if self.plan is not None else None,
                              "installed": self.installed, "in_round": self.in_round,
                              "mark": dict(self._mark)}
        sd.update(self.strategy.state_dict())
        with_opt = not self.cfg.dept.reset_inner_optimizer
        # with the global parameter names of their optimizer states (load_state_dict_repartitioned)
        sd["store"] = {n: self._with_param_names(state_payload(self.store.get(n), with_opt), self.store.get(n))
                       for n in self.store.names()}
        if self.strategy.source_embeddings and self.installed is not None:
            current = self._current_state(with_body=False)
            sd["installed_state"] = self._with_param_names(state_payload(current, with_opt), current)
        return sd

    def load_state_dict(self, sd: dict) -> None:
        if "body_sync" in sd:  # checkpoints written before the outer state moved to DCP keys
            body = sd["body_sync"]
            parts = body["fragments"] if "fragments" in body else [body]
            if len(parts) != len(self.body_syncs):
                raise ValueError(f"dept.outer_fragments: the checkpoint's body state has {len(parts)} fragments, "
                                 f"this run {len(self.body_syncs)}")
            for s, part in zip(self.body_syncs, parts):
                s.load_state_dict(part)
        syncs = self.outer_syncs()
        # checkpoints that kept the chunk buffers here (CHUNK_BUFFERS); later ones have none here and
        # dept_mega.checkpoint loads them from their per-parameter keys after this
        for entry, attr in CHUNK_BUFFERS.items():
            for k, r in (sd.get(entry) or {}).items():
                if k not in syncs or getattr(syncs[k], attr) is None:
                    raise _missing_chunk_buffer(entry, attr, k)
                getattr(syncs[k], attr).copy_(r.to(getattr(syncs[k], attr).device, torch.float32))
        for k, s in syncs.items():  # the eager start's estimate: none in the checkpoint, none known
            if s.eager_base is not None:
                if k not in (sd.get("outer_eager") or {}):
                    s.eager_base.zero_()
                s.load_eager_known((sd.get("outer_eager_known") or {}).get(k))
        self.strategy.load_state_dict(sd)
        self.store = SourceStore()
        for n, payload in sd["store"].items():
            state = self._fresh_state(n)
            load_payload(state, payload)
            self.store.put(n, state)
        self.installed = sd["installed"]
        if self.strategy.source_embeddings and self.installed is not None:
            state = self._fresh_state(self.installed)
            load_payload(state, sd["installed_state"])
            self.trainer.set_embeddings(state.embeddings, state.optimizer)
        # a run resumed inside a round must not redo that round's moves and installs; the plan
        # also tells evaluation (evaluate.py) which group holds each source
        self._resumed_round = sd["round"]
        self.in_round = bool(sd.get("in_round", False))
        if sd["round"] is not None:
            self.plan = self._plan_of(int(sd["round"]))
        self._mark = self.pg.comm.snapshot()

    # ------------------------------------------------------------------------- another number of groups
    def regroup_refusal(self, step: int, saved_groups: int, group_keys: bool = False) -> Optional[tuple[str, str]]:
        """Why a checkpoint of step ``step`` written by ``saved_groups`` groups cannot be
        loaded by this launch's number of groups: (config key, reason), or None when it can
        (:meth:`load_regrouped`). It can at a round boundary, where everything a group owns
        is the same in every group (the body and GLOB's embeddings are synchronised, the outer
        state is the same everywhere), is keyed by source, or is the inner optimizer state a
        group owns (:meth:`group_owned_inner_state`), which new group g takes from old group
        g mod G_old, as a replica that joins a DiLoCo job (torchft) receives a live peer's: for
        GLOB, SPEC, SPEC-OPT and TRIM (its φ, φ_head, their per-row outer state and the learned
        positions' are the same in every group after a round's sync: joined from old group 0's
        row shards and cut), with the distributed optimizer too (also under another
        ``parallel.data`` or bucket size: each source's optimizer state is joined from its old
        group's data-parallel ranks, :meth:`dp_joined_state`). With error feedback or the eager
        start only when the checkpoint saved their buffers per parameter and group
        (``group_keys``; layout.json: ``outer_group_keys``; TRIM's are its body's): the residuals
        are then averaged over the old groups and the estimates reset
        (``dept_mega.checkpoint_state``, logged); older checkpoints kept them in per-rank hook
        files, which are refused."""
        d = self.cfg.dept
        L = int(d.local_steps)
        if self.cfg.dept.outer_error_feedback and not group_keys:
            return ("dept.outer_error_feedback",
                    "the checkpoint has no error-feedback residuals saved per parameter and group (layout.json "
                    "without outer_group_keys: written before they were, which kept them in per-rank hook files, "
                    "or written without error feedback)")
        if self.schedule.eager and not group_keys:
            return ("dept.outer_overlap_rule",
                    "the checkpoint has no eager-start estimates saved per parameter and group (layout.json "
                    "without outer_group_keys: written before they were, which kept them in per-rank hook files, "
                    "or written without the eager start)")
        if step % L:
            return ("parallel", f"step {step} is inside a round (dept.local_steps={L}), where the groups hold "
                                f"different bodies; only a checkpoint at a round boundary (a multiple of {L}) "
                                f"loads with another number of groups")
        return None

    def group_owned_inner_state(self) -> list[str]:
        """What of the inner optimizer state belongs to a source group, not to a source (kept
        across rounds by the group that trains with it: ``dept.reset_inner_optimizer: false``):
        the body's with ``dept.body_optimizer_state: group``, GLOB's shared embeddings'. Under
        another number of groups new group g takes old group g mod G_old's
        (``dept_mega.checkpoint``: ``_regroup_keys``)."""
        if self.cfg.dept.reset_inner_optimizer:
            return []
        return ((["GLOB's embeddings"] if not self.strategy.source_embeddings else [])
                + (["the body"] if not self.body_per_source else []))

    def load_regrouped(self, step: int, saved: dict[int, dict], saved_groups: int,
                       saved_origin: Optional[dict], read_body_optimizer=None, group_keys: bool = False) -> None:
        """Load the hook state of a round-boundary checkpoint written by ``saved_groups``
        groups (``saved[g]``: the state dict of group g's rank at this rank's (tp, pp)
        position, with the distributed optimizer joined from group g's data-parallel ranks
        and cut for this rank, TRIM's φ joined from the stage's row shards:
        :meth:`dp_joined_state`) into this launch's groups. The
        schedule continues from the checkpoint's history: every source keeps its data
        position (rounds trained so far) and its own state, which the new group ``old group
        mod G`` holds (``last_group``); the plans from round ``step / local_steps`` on are this
        launch's (``RoundScheduler.rebase``), recorded in later checkpoints' ``layout.json``.
        Each group then installs the first source it holds (or none).
        ``read_body_optimizer(g)``: the body optimizer's state dict that old group g saved with
        its model (``dept.body_optimizer_state: source``: the state of the source installed
        there, which its hooks file leaves out). ``group_keys``: the checkpoint saved the
        error-feedback residuals and eager estimates per parameter and group (loaded after
        this by ``dept_mega.checkpoint``, :func:`~dept_mega.checkpoint_state.group_state_targets`)."""
        refusal = self.regroup_refusal(step, saved_groups, group_keys)
        if refusal is not None:
            raise ValueError(f"{refusal[0]}: {refusal[1]}")
        L = int(self.cfg.dept.local_steps)
        r0 = step // L
        old = self._make_scheduler(saved_groups, saved_origin)
        before = old.plan(r0)  # its last_group / rounds_before: the history at round r0's start
        G = self.pg.num_groups
        last = [None if g is None else int(g) % G for g in before.last_group]
        self.scheduler = self._make_scheduler(G)
        self.scheduler.rebase(r0, last, before.rounds_before)
        # GLOB: nothing (its outer state is under dept/... keys); TRIM: φ (the same in every group
        # at a round boundary) from old group 0 (the other groups' states may leave it out:
        # dp_joined_state(strategy_state=False)), before the first held source is filled from it
        self.strategy.load_state_dict(saved[0])
        payloads: dict[str, tuple[int, dict, bool]] = {}
        for g, sd in sorted(saved.items()):
            held = {n: (p, False) for n, p in sd["store"].items()}
            if sd.get("installed") is not None and "installed_state" in sd:
                held[sd["installed"]] = (sd["installed_state"], True)
            for name, (payload, installed) in held.items():
                if name in payloads:
                    raise ValueError(f"source {name!r}: the checkpoint holds its state in groups {payloads[name][0]} "
                                     f"and {g}")
                payloads[name] = (g, payload, installed)
        self.store = SourceStore()
        self.installed = None
        for name, (g, payload, installed) in sorted(payloads.items()):
            if last[self.index[name]] != self.pg.group_index:
                continue
            if before.last_group[self.index[name]] != g:
                raise ValueError(f"source {name!r}: the checkpoint holds its state in group {g}, its round plan "
                                 f"says group {before.last_group[self.index[name]]}")
            if installed and self.body_per_source and read_body_optimizer is not None:
                payload = dict(payload, body_optimizer=read_body_optimizer(g))
            state = self._fresh_state(name)
            load_payload(state, payload)
            self.store.put(name, state)
        missing = [self.names[k] for k, g in enumerate(last) if g == self.pg.group_index and self.per_source
                   and self.names[k] not in self.store]
        if missing:
            raise ValueError(f"sources {missing}: trained before step {step} but their state is not in the checkpoint")
        first = self._first_held(last) if self.per_source else None
        if first is not None:
            self._install(first, self.store.pop(first))
        self.plan = self._plan_of(r0 - 1) if r0 > 0 else None
        self.in_round = False
        self._resumed_round = None
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
        if cfg.dept.variant == "trim" or cfg.dept.embedding_rows == "present":
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
