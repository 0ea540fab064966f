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
from typing import Any, Optional, Sequence

import torch

from ..parallel.agree import world_max
from ..parallel.comm import CATEGORIES, total_over_ranks
from ..profiling import PhaseTimer
from ..sampling_plan import make_scheduler, rounds_line
from . import hook_state
from .federation import LeftOut
from .master_shards import value_access
from .memory import eager_start
from .outer import FlatSync, OuterOptimizer, sync_options
from .eval_split import balanced_assignment, eval_params
from .streaming import OuterSchedule, body_fragments, sync_units
from .rounds import RoundScheduler
from .source_info import SourceInfo, sources_from_config  # noqa: F401  (SourceInfo: importable from here too)
from .store import SourceState, SourceStore
from .strategy import RoundView, StrategyContext
from .variants import make_strategy

BODY_OPTIMIZER_STATES = ("group", "source")


class DeptHooks:
    """RoundHooks for glob / trim / spec / spec_opt: the round driver. Its checkpoint state:
    ``dept.hook_state``."""

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
                                      mix=d.outer_mix_alpha if d.outer_overlap_rule == "mix" else None,
                                      defer_round_end=fed is not None, device=self.device)
        # sources carry state of their own between rounds (moved with the source)
        self.per_source = self.strategy.source_embeddings or self.body_per_source
        # (step, ids): the parameters a checkpoint load of that step read from group-free keys
        self._loaded_same: Optional[tuple[int, frozenset]] = None
        self._prepare_resume()

    def _make_scheduler(self, groups: int, origin: Optional[dict] = None) -> RoundScheduler:
        """The round plans of a run with ``groups`` groups (``origin``: rebased there, see
        :meth:`RoundScheduler.rebase`; ``dept_mega.sampling_plan.make_scheduler``)."""
        return make_scheduler(self.cfg, groups, [s.size for s in self.sources], [s.weight for s in self.sources],
                              origin)

    def sampling_line(self) -> str:
        """Each source's share of the run's group-rounds from its round plans, for the start-up
        log (``dept_mega.sampling_plan.rounds_line``)."""
        return rounds_line(self.cfg, self.scheduler, [s.name for s in self.sources], self.num_groups)

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
        from ..manifest import LAYOUT_FILE, CheckpointError, read_json
        from ..resume import latest_step, step_dir
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
        nothing to install, :meth:`resume_regrouped` installs the sources)."""
        if layout is not None and int(layout.get("groups", self.pg.num_groups)) != self.pg.num_groups:
            return
        self._use_schedule(layout)
        if not self.strategy.source_embeddings or not step:
            return
        plan = self._plan_of((step - 1) // self.cfg.dept.local_steps)
        if plan.sources:
            name = self.names[plan.sources[self.group_index]]
        else:  # saved just after a change of the number of groups (see rebase_groups)
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
    def _fresh_state(self, name: str, initial: bool = False) -> SourceState:
        """Fresh state of ``name`` (``initial``: its first installation, from
        ``strategy.initial``; else modules to load or receive into)."""
        if not self.strategy.source_embeddings:
            return SourceState([None] * len(self.trainer.stages))
        embs = self.strategy.initial(name) if initial else self.strategy.build(name)
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
        self._loaded_same = None  # training goes on: the loaded values change
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
            if self.federation is not None:
                self.federation.round_begun(self)
            return assignment
        if self.cfg.dept.reset_inner_optimizer:
            self._reset_group_optimizers()
        if self.per_source:
            self._swap_in(mine)
        self.strategy.begin_round(mine)
        if self.federation is not None:
            self.federation.round_begun(self)
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
        if moves and self.federation is not None:  # sources belong to their group job (config.source_groups)
            raise RuntimeError(f"federation: round {self.plan.round} would move sources {moves} between group jobs")
        self.store.move(self.pg, moves, self._fresh_state, self.device, with_optimizer=not reset,
                        with_weights=self.strategy.move_weights)
        state = self.store.pop(mine) if mine in self.store else self._fresh_state(mine, initial=True)
        self._install(mine, state)

    def before_step(self, loop) -> bool:
        """Before an inner step: fragments due now are launched (streaming.py). True: the
        other groups completed this round without this one (:meth:`_left_out`); the loop goes
        to the next round start without training the step."""
        self._loaded_same = None
        try:
            self.schedule.before_step(self.trainer.step)
        except LeftOut:
            return self._left_out()
        return False

    def after_step(self, loop) -> bool:
        """After an inner step: overlapped syncs due now are applied. True: as :meth:`before_step`."""
        try:
            self.schedule.after_step(self.trainer.step)
        except LeftOut:
            return self._left_out()
        return False

    def _left_out(self) -> bool:
        """Federation: an exchange of this round found it completed by the other groups without
        this one (``LeftOut``, at a fragment's, an overlapped sync's or the round end's exchange;
        the peers' state is written). Nothing of the round stays pending; the next round start
        takes the peers' round. The round has no ``outer`` record: its traffic is in the next one."""
        self.schedule.drop()
        self.in_round = False
        self.federation.left_round()
        return True

    def can_save_now(self) -> bool:
        """True when no outer sync is in flight: checkpoints are taken only then."""
        return self.schedule.idle

    def group_replicated_params(self) -> frozenset:
        """The ids of the parameters every group holds the same now: after a round's blocking
        outer sync (not inside a round) those it synchronised — the checkpoint writes them once
        (``checkpoint_state.model_entries``)."""
        if self.in_round or self.pg.num_groups < 2:
            return frozenset()
        return frozenset(id(p) for s in self.schedule.synced_now(self.trainer.step) for p in s.params)

    def round_end(self, loop, round_index: int) -> dict[str, Any]:
        whole = PhaseTimer(self.device)  # GPU time on CUDA (host time would only see queuing)
        try:
            self.schedule.round_end(self.trainer.step)
            strategy = PhaseTimer(self.device)
            self.strategy.sync(self.installed)
        except LeftOut:  # federation: the round was completed without this group (no record of it)
            self._left_out()
            return None
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
            out["groups"] = self.federation.round_done(self)  # the groups whose pseudo-gradients were averaged
            # bytes launched in exchange tries that failed (a group died or stalled), apart from "bytes"
            failed = self.federation.take_failed()
            out["failed_bytes"] = total_over_ranks({c: failed.get(c, 0) for c in CATEGORIES})
        return out

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
    def eval_context(self, loop, source: str, alone: bool = False):
        """Evaluate ``source`` with the embeddings its variant's strategy names (docs/dept.md,
        "Evaluation"). Every group runs the same sequence of evaluations, so the group holding
        a source's weights can send a copy to the other groups (same (tp, dp, pp) position);
        ``alone``: this group alone evaluates it (:meth:`eval_assignment`), and nothing crosses
        groups. Traffic inside is left out of the round's byte counts."""
        restore = None
        with self.uncounted():
            try:
                view = RoundView(self.plan, self.installed, self.store, self.in_round, alone=alone)
                # federated: a group job evaluates only its own sources, all of whose state it holds
                embs = (self._own_eval_embeddings(source) if self.federation is not None
                        else self.strategy.eval_embeddings(source, view))
                if embs is not None:
                    restore = self.trainer.set_embeddings(embs, self.trainer.embedding_optimizer)
                yield
            finally:
                if restore is not None:
                    self.trainer.set_embeddings(*restore)

    def add_eval_sources(self, infos: Sequence[SourceInfo]) -> None:
        """Sources evaluated only, never trained (``dept_mega.evaluate --extra-source``;
        GLOB, TRIM: ``strategy.add_eval_sources``)."""
        self.strategy.add_eval_sources(infos)

    def loaded_replicated(self, step: int, ids: frozenset) -> None:
        """A checkpoint of inner step ``step`` was just loaded; ``ids``: the parameters it read
        from group-free keys (the value every group held when it was written), which every group
        holds the same until training goes on (:meth:`eval_assignment`)."""
        self._loaded_same = (int(step), frozenset(ids))

    def eval_assignment(self, names: Sequence[str]) -> Optional[dict[str, int]]:
        """Source → the one group that evaluates it, where that gives the numbers every group
        would (eval_split.py); None: every group evaluates every source (in the middle of a
        round, with a sync in flight, a fragment trained on since its sync, federation, one
        group). The same answer on every rank (plans and sync positions are)."""
        if self.pg.num_groups < 2 or self.federation is not None or self.in_round or not self.schedule.idle:
            return None
        if self._group_dependent_math():
            return None
        same = set(self.group_replicated_params())
        if self._loaded_same is not None and self._loaded_same[0] == self.trainer.step:
            same |= self._loaded_same[1]
        differs = any(id(p) not in same for p in eval_params(self.trainer, self.strategy.source_embeddings))
        # each rank sees its own stage's parameters (a fragment synchronised earlier in the round
        # may sit on another stage): one rank's doubt is every rank's (bookkeeping, not counted)
        if world_max([differs], self.device)[0]:
            return None
        view = RoundView(self.plan, self.installed, self.store, self.in_round)
        return balanced_assignment(names, self.pg.num_groups, {n: self.strategy.eval_group(n, view) for n in names})

    def _group_dependent_math(self) -> bool:
        """Whether the same parameters give other numbers in another group: Transformer Engine's
        FP8 scales its evaluation with the group's own amax history; ``fp8_gemm_tuning`` lets
        each rank time and keep its own cuBLASLt algorithms (another summation order)."""
        from ..model.backends import resolve_backends
        if self.cfg.fp8 is None:
            return False
        b = resolve_backends(self.cfg, self.device)
        return b.linear == "transformer_engine" or b.fp8_gemm_tuning > 1

    def _own_eval_embeddings(self, source: str) -> Optional[list]:
        """Federation: the embeddings this group job evaluates its own ``source`` with — the
        installed ones (None) or, for another of its sources, the stored state (SPEC /
        SPEC-OPT; TRIM: its rows of φ), seeded fresh if never trained. No other job takes
        part: the view has no plan, so no strategy asks another group for a copy."""
        if source == self.installed or not self.strategy.source_embeddings:
            return None
        return self.strategy.eval_embeddings(source, RoundView(None, self.installed, self.store, False))

    # ------------------------------------------------------------------------- checkpoints
    def checkpoint_syncs(self) -> dict[str, FlatSync]:
        """:meth:`outer_syncs` and the strategy's own (TRIM's learned positions: ``trim_positions``),
        whose state ``dept_mega.checkpoint_state`` saves per parameter."""
        return {**self.outer_syncs(), **self.strategy.checkpoint_syncs()}

    def checkpoint_params(self) -> dict[int, tuple[str, torch.nn.Parameter]]:
        """The synchronised tensors that are not the model's (TRIM's positions), by id: (name, tensor)."""
        return self.strategy.checkpoint_params()

    def checkpoint_meta(self) -> dict[str, Any]:
        """The round position for ``group{g}.json`` (``dept.hook_state.meta``)."""
        if not self.schedule.idle:
            raise RuntimeError("DeptHooks: an outer sync is in flight; checkpoints are taken only where "
                               "can_save_now() is true")
        return hook_state.meta(self)

    def checkpoint_entries(self) -> list:
        """The stored sources' state and TRIM's tables as checkpoint entries (``dept.hook_state``)."""
        return hook_state.entries(self, self.trainer)

    def checkpoint_targets(self, metas: dict[int, dict], saved_groups: Optional[int], step: int,
                           origin: Optional[dict], optimizer: bool):
        """(entries to load, install) of a checkpoint (``dept.hook_state.targets``)."""
        return hook_state.targets(self, self.trainer, metas, saved_groups, step, origin, optimizer)

    def resume_at(self, meta: dict, store: SourceStore) -> None:
        """Continue from a checkpoint of this number of groups: its round position ``meta`` and
        the sources ``store`` held by this group (the installed one is loaded with the model)."""
        self.store = store
        self.installed = meta["installed"]
        # a run resumed inside a round must not redo that round's moves and installs; the plan
        # also tells evaluation (evaluate.py) which group holds each source
        self._resumed_round = meta["round"]
        self.in_round = bool(meta.get("in_round", False))
        if meta["round"] is not None:
            self.plan = self._plan_of(int(meta["round"]))
        self._mark = self.pg.comm.snapshot()

    # ------------------------------------------------------------------------- another number of groups
    def regroup_refusal(self, step: int, saved_groups: int) -> Optional[tuple[str, str]]:
        """Why a checkpoint of step ``step`` written by ``saved_groups`` groups cannot be
        loaded by this launch's number of groups: (config key, reason), or None when it can.
        It can at a round boundary (without fragments), where everything a group owns is the
        same in every group (the body and GLOB's embeddings are synchronised, the outer state
        and TRIM's tables are the same everywhere), is keyed by source, or is the inner
        optimizer state a group owns (:meth:`group_owned_inner_state`), which new group g takes from old group
        g mod G_old, as a replica that joins a DiLoCo job (torchft) receives a live peer's.
        The error-feedback residuals are averaged over the old groups and the eager
        estimates reset (``dept_mega.checkpoint_state``, logged)."""
        L = int(self.cfg.dept.local_steps)
        if self.scheduler.owners is not None:
            return ("data.sources[].group",
                    f"the sources belong to groups (each group trains only its own), so a run keeps its number "
                    f"of groups: the checkpoint has {saved_groups}, this launch {self.num_groups}")
        if step % L:
            return ("parallel", f"step {step} is inside a round (dept.local_steps={L}), where the groups hold "
                                f"different bodies; only a checkpoint at a round boundary (a multiple of {L}) "
                                f"loads with another number of groups")
        F = int(self.cfg.dept.outer_fragments)
        if F > 1:  # (the fragments synchronised inside the round have trained on in each group since)
            return ("dept.outer_fragments",
                    f"with {F} fragments the groups' bodies differ even at a round boundary (the fragments "
                    f"synchronised earlier in the round, and GLOB's tables' parts, have trained on in each group "
                    f"since), so a run keeps its number of groups: the checkpoint has {saved_groups}, this "
                    f"launch {self.num_groups}")
        return None

    def group_owned_inner_state(self) -> list[str]:
        """What of the inner optimizer state belongs to a source group, not to a source (kept
        across rounds by the group that trains with it: ``dept.reset_inner_optimizer: false``):
        the body's with ``dept.body_optimizer_state: group``, GLOB's shared embeddings'. Under
        another number of groups new group g takes old group g mod G_old's
        (``dept_mega.checkpoint``: ``_regroup_plan``)."""
        if self.cfg.dept.reset_inner_optimizer:
            return []
        return ((["GLOB's embeddings"] if not self.strategy.source_embeddings else [])
                + (["the body"] if not self.body_per_source else []))

    def rebase_groups(self, step: int, saved_groups: int, saved_origin: Optional[dict]):
        """The schedule of a round-boundary checkpoint of step ``step`` written by
        ``saved_groups`` groups continued by this launch's groups: every source keeps its data
        position (rounds trained so far) and its own state, which new group ``old group mod G``
        holds; the plans from round ``step / local_steps`` on are this launch's
        (``RoundScheduler.rebase``), recorded in later checkpoints' ``layout.json``. Returns
        (the old schedule's plan of that round: ``last_group`` says where each source's state
        is, each source's new group)."""
        refusal = self.regroup_refusal(step, saved_groups)
        if refusal is not None:
            raise ValueError(f"{refusal[0]}: {refusal[1]}")
        r0 = step // int(self.cfg.dept.local_steps)
        before = self._make_scheduler(saved_groups, saved_origin).plan(r0)
        G = self.pg.num_groups
        last = [None if g is None else int(g) % G for g in before.last_group]
        self.scheduler = self._make_scheduler(G)
        self.scheduler.rebase(r0, last, before.rounds_before)
        return before, last

    def resume_regrouped(self, step: int, last: list, store: SourceStore) -> None:
        """After :meth:`rebase_groups`: this group holds the sources ``store`` and installs the
        first of them (or none)."""
        self.store = store
        self.installed = None
        first = self._first_held(last) if self.per_source else None
        if first is not None:
            self._install(first, self.store.pop(first))
        r0 = step // int(self.cfg.dept.local_steps)
        self.plan = self._plan_of(r0 - 1) if r0 > 0 else None
        self.in_round = False
        self._resumed_round = None
        self._mark = self.pg.comm.snapshot()


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
            global_vocab = load_tokenizer(cfg.data.tokenizer, "data.tokenizer").vocab_size
        sources = sources_from_config(cfg, global_vocab)
    return DeptHooks(cfg, pg, trainer, device, sources)
