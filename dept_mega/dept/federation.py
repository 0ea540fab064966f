"""Federated source groups: each group its own job, joined through torchft (docs/launching.md,
"Federated source groups").

A group job is today's layout with one group (its world is D·P·T ranks). Every rank runs a
torchft ``Manager`` (replica ``dept_group_{g}``, its rank in the job as ``group_rank``) whose
reconfigurable process group joins the rank at the same (tp, dp, pp) position of every group
job that is in the current quorum. The seam is :class:`FederatedOuter`: it takes the place of
``pg.outer`` (the single job's cross-group process group), so the outer sync
(``outer.FlatSync``) runs unchanged, and :class:`Federation` holds the rest:

- **a round** = a quorum at its start (:meth:`Federation.round_start`, torchft's
  ``start_quorum``), the pseudo-gradient all-reduces at its end, each summed over the groups
  that take part and divided by their number (uniform weights, as in the single job: FlatSync
  divides by ``group_size(pg.outer)``, here the participants) — or, for quantised syncs, the
  all-gather of the packed chunks on the reconfigured process group (torchft wraps only the
  all-reduce; a failure is reported to the Manager) — and ``should_commit``. A
  failed exchange (a group died or is late) is redone with the survivors' quorum from the same
  pseudo-gradient; a quorum that fails once formed (it holds a group that died with its request
  pending at the lighthouse) is asked again, bounded (``federation_wait.QUORUM_TRIES``);
  a group that finds the round completed without it (healed at that quorum)
  drops its pseudo-gradient and goes on at the others' round (:class:`LeftOut`); exchanges whose sizes depend on each other
  (TRIM's counts, ids and rows) are one exchange (:meth:`Federation.atomic`).
- **overlapped sync** (``dept.outer_overlap``, torchft's streaming DiLoCo pattern): every
  exchange is launched (:class:`FederatedWork`) and committed where it is waited on; the
  round-end launch is deferred to right after the next round start's quorum
  (``OuterSchedule.launch_deferred``), so no exchange is in flight across a quorum; a group
  healed at that quorum launches it too with Δ = 0 and is left out of its mean.
- **healing**: a group that starts while others are running (a relaunched job, a new group)
  joins at their next round start and receives from a live peer what is replicated across
  groups — every outer sync's θ_{t-1} and outer optimizer state (the body, GLOB's tables),
  the strategy's own state (TRIM's φ, its rows' outer state, positions) and the round — through torchft's checkpoint transport; θ_{t-1} is written into its parameters
  and its loop jumps to that round. Its sources' own state comes from its own checkpoint.
  The same at a fresh start of jobs that resume at different rounds (the whole federation
  relaunched after one job stopped earlier): a job asks for its first quorum with torchft's
  step = the round it resumes at (:data:`RUNNING`), so those behind heal from one of the
  newest round.
- **sources**: a source belongs to the group job that holds its data
  (``config.source_groups``: ``data.sources[i].group``, null = i mod groups) and never moves;
  each round a job trains one of its own (the seeded sampler, restricted to them:
  ``rounds.RoundScheduler``'s ``owners``). A gone job's sources are not trained until it
  returns.
- **checks**: the keys that must agree (``AGREE_KEYS``) are compared at a fresh start
  (a collective over every group, the healed ones too: federation_bookkeeping.py) and by a
  group healing from a running one against its peer's; a group index
  claimed twice is refused. Each is a ConfigError naming the key (exit status 2).
What torchft does not do and this module adds: the checks, the round ↔ step mapping and the
jump of a healed group, the participants' group indices (from the ``global_ranks`` torchft's
Manager passes to the process group's ``configure``, :func:`recording`: replica ids end with
the group index) for the ``membership`` and ``outer`` records.
"""
from __future__ import annotations

import os
import socket
import time
from datetime import timedelta
from typing import Any, Optional

import torch

from ..config import ConfigError
from ..parallel.agree import agree_errors
from . import federation_dump
from .federation_bookkeeping import any_member, check_fresh_agree, contributors
from .federation_config import agree_hashes, agree_values, check_agree, lighthouse_reachable, own_sources
from .federation_finished import announce, partners_finished, run_key
from .federation_host import advertise_line, advertised_host, bound_to, check_literal, manager_kwargs, store_host
from .federation_log import (RUNNING, WAIT_EVERY_S, first_line, healed_line, least_groups, membership_line,
                             quiet_checkpoint_server, quiet_torchft, quorum_wait_line)
from .federation_wait import QUORUM_TRIES, at_least, preemptible, preemption_of
from .federation_outer import (FederatedOuter, FederatedWork, LeftOut, Offline,  # noqa: F401  (importable from here)
                               reconfigure_next, recording, stop_checkpoint_server)

REPLICA_PREFIX = "dept_group_"


class Federation:
    """This job's torchft Manager and what DEPT needs around it (module docstring)."""

    def __init__(self, cfg, pg, device: torch.device, group: int, host: str, port: int, log=print) -> None:
        quiet_torchft()  # before torchft starts logging (federation_log.py)
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL
        f = cfg.federation
        self.cfg, self.pg, self.device, self.log = cfg, pg, device, log
        self.say = log if pg.rank == 0 else None  # the job's progress lines: once per job
        self.where = f"{host}:{port}"
        self.run_dir = cfg.train.run_dir  # (its RUN/run_start.json: which partners' records count)
        self.group, self.groups = group, f.groups
        self.agreed = agree_values(cfg)  # sent to a healing peer (and at a fresh start), to name a field that differs
        self.hashes = agree_hashes(cfg)
        check_literal(f.advertise_host, pg.group_size)  # (a literal names one node: federation_host.py)
        lighthouse_min = lighthouse_reachable(host, port, f.timeout_s, f.groups, device)
        timeout = timedelta(seconds=f.timeout_s)
        self._own_store = None
        if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
            store_addr, store_port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        else:  # a single process without torchrun: a store of its own
            # (the quorum's process group meets at one group's store: the other group jobs,
            # possibly on other hosts, connect to it by this name, as to torchft's own servers)
            from torch.distributed import TCPStore
            store_addr = socket.gethostname()
            self._own_store = TCPStore(store_addr, 0, is_master=True, wait_for_workers=False)
            store_port = self._own_store.port
        self.participants = 1
        self.members: list[int] = [group]  # group indices in the current quorum
        self.order: list[int] = [group]  # ... in the order of the process group's ranks
        self.round_groups: list[int] = [group]  # those of the last committed exchange
        self._healed: Optional[dict] = None
        self._rounds = 0  # round starts' quorums done
        self.quorums = 0  # quorums formed (an overlapped exchange launched on an earlier one is done again)
        self._commits = 0  # exchanges committed since the last round end (round_done)
        self.failed: dict[str, int] = {}  # bytes launched in exchange tries that failed (take_failed)
        self.syncs: dict[str, Any] = {}
        self.strategy = None  # the variant's strategy (attach)
        self._hooks = None  # DeptHooks (its OuterSchedule), from the first round start
        self._nested: Optional[list] = None  # inside atomic(): the (category, bytes) of its collectives
        self.round = 0
        self._just_healed = False
        self._left_out: Optional[dict] = None  # healed at an exchange's redo quorum (LeftOut)
        self._loop = None  # the training loop (its writer and step), from the first round start
        # the exchanges launched right after a round start's quorum (outer_overlap: the previous
        # round's end sync, deferred to that quorum): a group healed at it contributes nothing
        self._launching = False
        self._peers_deferred = False  # (healed) the peers had such exchanges to launch
        self.dump = federation_dump.from_env(group, pg.rank)  # a test hook (federation_dump.py)
        # (federation_host.py; route: a node without a route to the lighthouse stops every rank)
        advertised = agree_errors(lambda: advertised_host(f.advertise_host, (host, port)), (ConfigError,), device)
        if advertised is not None and os.environ.get("LOCAL_RANK", "0") == "0":  # once per node
            log(advertise_line(pg.rank, advertised, f.advertise_host, nccl=device.type == "cuda"))
        store_addr = store_host(advertised, pg.rank, store_addr)
        self.process_group = recording(ProcessGroupNCCL if device.type == "cuda"
                                       else bound_to(ProcessGroupGloo, advertised))(timeout)
        self.manager = Manager(pg=self.process_group, load_state_dict=None, state_dict=None,
                               min_replica_size=f.min_groups, use_async_quorum=False, timeout=timeout,
                               quorum_timeout=timedelta(days=1), connect_timeout=timeout,
                               rank=pg.rank, world_size=pg.group_size, store_addr=store_addr, store_port=store_port,
                               lighthouse_addr=f"http://{host}:{port}", replica_id=f"{REPLICA_PREFIX}{group}",
                               init_sync=False, **manager_kwargs(advertised, timeout))
        quiet_checkpoint_server(getattr(self.manager, "_checkpoint_transport", None))
        self.manager.register_state_dict_fn("dept", self._load_healed, self._replicated_state)
        # a quorum needs both: the lighthouse's --min-groups and this job's federation.min_groups
        self.least, self.least_why = least_groups(f.min_groups, lighthouse_min)
        self._say(f"federation: group {group} of {f.groups} (sources: {', '.join(own_sources(cfg))}), lighthouse "
                  f"{self.where}; a round needs at least {self.least} group(s) ({self.least_why})")

    def _short(self, n: int) -> None:
        """(federation_wait.at_least) A quorum of ``n`` groups, fewer than the round needs, was formed."""
        self._say(f"federation: round {self.round}: the lighthouse formed a quorum of {n} group(s), fewer than the "
                  f"{self.least} a round of this job needs ({self.least_why}); asking again until enough are there")

    def _say(self, line: str) -> None:
        if self.say is not None:
            self.say(line)

    # ------------------------------------------------------------------ healing state
    def attach(self, syncs: dict, strategy=None) -> None:
        """The FlatSyncs whose state is replicated across groups (``DeptHooks.outer_syncs()``)
        and the variant's strategy, whose own state (``replicated_state``: TRIM's φ and φ_head
        with their rows' outer optimizer state, its learned positions and their sync) every
        group holds the same at a round start."""
        self.syncs = dict(syncs)
        self.strategy = strategy
        if self.dump is not None:
            self.dump.watch(self.syncs)

    def _replicated_state(self) -> dict:
        """What a healing group receives from this one (called on torchft's quorum thread
        while this job's main thread waits for the quorum). A job that healed in its fresh start's
        wait for the other groups (not applied yet: ``round_start``) is at the newest round's
        step and may be asked in the next try: it sends what it received."""
        if self._healed is not None and not self._healed.get("applied"):
            return self._healed
        own = self.strategy.replicated_state() if self.strategy is not None else {}
        deferred = self._hooks is not None and self._hooks.schedule.deferred_step is not None
        return {"round": self.round, "agree": self.hashes, "agree_values": self.agreed,
                "deferred": deferred,
                "syncs": {k: s.replicated_state() for k, s in self.syncs.items()}, "strategy": own}

    def _load_healed(self, sd: dict) -> None:
        """torchft's call with a live peer's state (checked where it is used: at a fresh start
        after every job's keys are compared together, ``round_start``)."""
        self._healed = sd

    def _check_healed(self, sd: dict) -> None:
        """A peer's state against this job's: the agreed keys, the outer syncs."""
        check_agree(self.cfg, sd)
        if set(sd["syncs"]) != set(self.syncs):
            raise ConfigError(f"config key 'dept.variant': the running groups synchronise {sorted(sd['syncs'])}, "
                              f"this job {sorted(self.syncs)}")

    def _set_step(self, step: int) -> None:
        self.manager.load_state_dict({"step": step, "batches_committed": self.manager.batches_committed()})

    def _fresh_quorum(self) -> bool:
        """After a quorum: every member is at its first (torchft's step below :data:`RUNNING`;
        a member healed at it holds the step of the newest, which is then below too)."""
        return self.manager.current_step() < RUNNING

    # ------------------------------------------------------------------ rounds
    def _quorum(self, synced: bool = True, **kw) -> None:
        """torchft's quorum, abandoned on a preemption (federation_wait.py: PreemptedWait;
        ``synced``: at a round start, after the previous round's outer sync; False: inside a
        round's end, its exchange failed and redone)."""
        what = (f"waiting for a quorum at round {self.round}" if synced else
                f"waiting for a quorum to redo round {self.round}'s exchange")
        for attempt in range(1, QUORUM_TRIES + 1):
            step, healed = self.manager.current_step(), self._healed  # what a failed try puts back
            give_up = self.cfg.federation.quorum_give_up_s
            say = (lambda s: self.say(quorum_wait_line(self.round, s, self.least, self.where, self._rounds > 0,
                                                       give_up))) if self.say else None
            t0 = time.monotonic()  # (a quorum too small is asked again: at_least; one wait, one give-up)
            failed_any = at_least(lambda fn: preemptible(
                fn, preemption_of(self._loop), self.device, what, synced, say, every=WAIT_EVERY_S, give_up_s=give_up,
                ended=(lambda final: partners_finished(self, final)) if self.say else None, since=t0),
                lambda: self.manager.start_quorum(**kw), self.manager, self.least, self.device, self._short)
            # a quorum formed with a group that is gone (it died with its request pending at the
            # lighthouse, which counts it until its heartbeats time out): this job's process group
            # could not be configured with it, or healing from it failed. Every rank of the job
            # asks again (one rank alone would wait for the others' requests), and the
            # lighthouse's next quorum leaves the dead group out once its heartbeats are old.
            failed = self.manager.errored()
            if not failed_any:
                break
            if attempt == QUORUM_TRIES:  # not a group gone: something persistent (a store, a network)
                raise RuntimeError(f"federation: quorum failed {QUORUM_TRIES} times in a row at round {self.round}: "
                                   f"{failed if failed is not None else 'on another rank of this job'}")
            # a state received in the failed try's recovery (torchft applies it before the step
            # fails) is not this round's: the next quorum heals again or not at all. torchft also
            # moved its step to the peer's: both back to what they were before the try (a heal of
            # an earlier, successful try of a fresh start's wait stays), or the next quorum would
            # take this job, its state unchanged, for one of the newest round
            self._healed = healed
            self._set_step(step)
            reconfigure_next(self.manager)  # (also for the same groups: federation_outer.py)
            ranks, W = self.process_group.quorum_ranks, self.pg.group_size
            of = f" of groups {sorted((r - self.pg.rank) // W for r in ranks)}" if ranks else ""
            why = first_line(failed) if failed is not None else "on another rank of this job"
            self._say(f"federation: round {self.round}: the quorum{of} failed ({why}); asking the lighthouse again "
                      f"(try {attempt + 1} of {QUORUM_TRIES}: a group that is gone is left out once its heartbeats "
                      "time out)")
        ranks = self.process_group.quorum_ranks
        if ranks is None:
            raise RuntimeError("federation: torchft's Manager configured the process group without global_ranks "
                               "(torchft changed: dept_mega/dept/federation.py, recording())")
        W = self.pg.group_size
        self.order = [(r - self.pg.rank) // W for r in ranks]  # group index of each rank of the process group
        self.members = sorted(self.order)
        self.participants = self.manager.num_participants()
        self.quorums += 1

    def finished(self, step: int) -> None:
        """The run is complete in this job (rank 0, after :meth:`shutdown`): its record at the
        lighthouse, which the other groups' waits read (federation_finished.py)."""
        why = announce(self.where, self.group, step, run_key(self.hashes))
        if why is not None:
            self._say(f"federation: could not leave this group's 'finished' record at the lighthouse {self.where} "
                      f"({why}); a group job that waits for this one gives up after federation.quorum_give_up_s")

    def round_start(self, round_index: int, writer=None, step: int = 0) -> tuple[int, bool]:
        """The quorum at the start of round ``round_index``. Returns (the round to train,
        healed): a healed group continues at its peers' round with their θ_{t-1} written into
        its parameters."""
        fresh = self._rounds == 0
        before = list(self.members) if not fresh else []
        self.round = round_index
        if fresh:  # (RUNNING): a job that resumes at an older round heals from one at the newest
            self._set_step(round_index)
        if self._left_out is None:
            self._quorum(allow_heal=True)
        else:  # healed at the redo quorum of a round completed without this group: that quorum is this round's
            self._healed, self._left_out = self._left_out, None
        # a fresh run (every member at its first quorum, those that resume at an older round
        # healed) waits up to timeout_s for every expected group: the lighthouse forms a quorum
        # without those not heartbeating yet
        t0 = time.monotonic()
        deadline, said = t0 + self.cfg.federation.timeout_s, None
        # (the members of a quorum decide together when to stop waiting: a bookkeeping MAX)
        while (self._fresh_quorum() and len(self.members) < self.groups
               and not any_member(self.process_group, self.device, time.monotonic() >= deadline)):
            if said is None or time.monotonic() - said >= WAIT_EVERY_S:
                said = time.monotonic()
                self._say(f"federation: fresh start: groups {self.members} of {self.groups} are here; waiting for the "
                          f"others up to federation.timeout_s = {self.cfg.federation.timeout_s:g} s "
                          f"({said - t0:.0f} s so far; those that miss it join later by healing)")
            time.sleep(0.2)
            self._quorum(allow_heal=True)
        self._rounds += 1
        self.round_groups = list(self.members)  # until an exchange of this round commits
        healed, self._healed = self._healed, None
        dup = sorted({g for g in self.members if self.members.count(g) > 1})
        first = self._fresh_quorum()
        if dup and (healed is not None or first):
            raise ConfigError(f"config key 'federation.group': group {dup[0]} is claimed by two jobs; give each job "
                              f"its own index in [0, {self.groups}) (federation.group, or DEPT_GROUP when it is null)")
        if first:  # every member, healed or not, compares the keys (one error, in every job)
            check_fresh_agree(self.process_group, self.device, self.hashes, self.agreed, self.order)
            self._set_step(self.manager.current_step() + RUNNING)
        if healed is not None:
            self._check_healed(healed)
            if not healed.get("applied"):
                self._apply(healed)
            round_index = self.round = int(healed["round"])
            self._peers_deferred = bool(healed.get("deferred"))
        # (a healed job's record: at the step it trains from, its peers' round start)
        at = round_index * self.cfg.dept.local_steps if healed is not None else step
        self._members_changed(before, round_index, writer, at, healed is not None)
        return round_index, healed is not None

    def _members_changed(self, before: list, round_index: int, writer, step: int, healed: bool = False) -> None:
        """When the groups taking part differ from ``before``: the job's log line; then or when
        this job ``healed`` (also a group left out of rounds completed without it, healed back
        into the same groups: ``joined`` names itself), with a ``writer``, the ``membership``
        record at ``step`` (healed at its first quorum, a relaunched job: ``joined`` is only
        itself, the others never left)."""
        if self.members == before and not healed:
            return
        if self.members != before:
            self._say(membership_line(round_index, self.members, before, healed))
        if writer is not None:
            new = set(self.members) - set(before) if before or not healed else set()
            writer.write("membership", step, round_index, groups=self.members,
                         joined=sorted(new | ({self.group} if healed else set())),
                         left=sorted(set(before) - set(self.members)), healed=healed)

    def _apply(self, healed: dict) -> None:
        """Write a live peer's replicated state (θ_{t-1}, outer optimizer state, the strategy's)."""
        for k, s in self.syncs.items():
            s.load_state_dict(healed["syncs"][k])
            s.write_reference()
        if healed["strategy"]:  # TRIM's φ: the next install fills the source's compact table from it
            self.strategy.load_state_dict(healed["strategy"])
        healed["applied"] = True

    def join_round(self, hooks, loop, round_index: int) -> int:
        """``DeptHooks.round_start``'s call: the quorum of round ``round_index``; after a heal
        the loop's step moves to the start of the peers' round (the LR schedule and the data
        position follow the run's step). Returns the round to train."""
        if not self.syncs:
            self.attach(hooks.outer_syncs(), hooks.strategy)
        tr, self._loop, self._hooks = loop.trainer, loop, hooks
        if self.dump is not None:
            self.dump.hold(round_index, "start")
        r, healed = self.round_start(round_index, loop.writer, tr.step)
        self._just_healed = healed
        if healed:
            was = tr.step
            tr.step = r * self.cfg.dept.local_steps
            self._say(healed_line(self.group, r, was, tr.step, self.members))
        # dept.outer_overlap: the previous round's end sync is launched now, on this quorum (a
        # group healed here launches it too, from θ_{t-1}: Δ = 0, left out of the mean)
        schedule = hooks.schedule
        if schedule.deferred_step is not None or (healed and self._peers_deferred):
            self._launching = True
            try:
                schedule.launch_deferred(tr.step)
            finally:
                self._launching = False
        self._peers_deferred = False
        return r

    def round_begun(self, hooks) -> None:
        """``DeptHooks.round_start``'s last call, this round's source installed."""
        if self._just_healed and self.dump is not None:
            self.dump.healed(self.round, hooks.installed, hooks.trainer, hooks.strategy)
        self._just_healed = False

    def round_done(self, hooks) -> list[int]:
        """``DeptHooks.round_end``'s call: the groups whose pseudo-gradients were averaged."""
        if self._commits == 0 and self.participants == 1:
            # alone, the outer sync exchanged nothing (a group of one skips it), so no commit
            # moved torchft's step: commit the round here, so that the step grows every round
            # (a group left out of a round completed without it is behind the others' step)
            self.manager.should_commit()
        self._commits = 0
        if self.dump is not None:
            self.dump.round_end(self.round, self.round_groups, self.syncs, hooks.trainer, hooks.strategy)
        return self.round_groups

    def left_round(self) -> None:
        """``DeptHooks``' call after :class:`LeftOut`: the round ended here for this group (no
        :meth:`round_done`)."""
        self._commits = 0

    def take_failed(self) -> dict[str, int]:
        """The bytes, by category, this rank launched in exchange tries that failed since the
        last call (the ``outer`` record's ``failed_bytes``; :meth:`_exchange`)."""
        failed, self.failed = self.failed, {}
        return failed

    def count_failed(self, counts) -> None:
        """A failed try's (category, bytes) to :attr:`failed` (``counts``: them, or a function giving them)."""
        for category, nbytes in counts() if callable(counts) else counts:
            self.failed[category] = self.failed.get(category, 0) + int(nbytes)

    def all_reduce_sum(self, t: torch.Tensor, comm, category: str) -> torch.Tensor:
        from torch.distributed import ReduceOp
        saved = t.clone()
        if self.dump is not None:
            self.dump.sent(category, saved)

        def run() -> None:
            self.manager.allreduce(t, reduce_op=ReduceOp.SUM).wait()

        self._exchange(run, lambda: t.copy_(saved), comm, [(category, t.numel() * t.element_size())])
        return t

    def all_gather_into(self, out: torch.Tensor, shard: torch.Tensor, comm, category: str) -> torch.Tensor:
        """``out`` = the participating groups' ``shard`` concatenated along dim 0 **in group
        order** (as ``pg.outer``'s rank order in the single job). torchft's Manager only wraps
        all-reduce: this is the reconfigured process group's allgather, its failure reported
        to the Manager (``report_error``) so that ``should_commit`` fails everywhere. Redone
        with the survivors on failure; ``out`` (sized for the participants at launch, a
        tensor of its own) is then resized in place to the survivors' number."""
        from torch.distributed.distributed_c10d import AllgatherOptions
        shard = shard.contiguous()
        if self.dump is not None:
            self.dump.sent(category, shard)

        def run() -> None:
            n = self.participants
            if out.shape[0] != n * shard.shape[0]:
                out.resize_((n * shard.shape[0],) + tuple(shard.shape[1:]))
            parts = [torch.empty_like(shard) for _ in range(n)]
            self.process_group.allgather([parts], [shard], AllgatherOptions()).wait()
            for part, g in zip(parts, self.order):
                out.narrow(0, self.members.index(g) * shard.shape[0], shard.shape[0]).copy_(part)

        self._exchange(run, lambda: None, comm, [(category, shard.numel() * shard.element_size())])
        return out

    def _contributors(self, launching: bool, contributes: bool) -> list[int]:
        """The group indices (sorted) whose values count in an exchange: the quorum's members,
        or, for the exchanges launched right after a round start's quorum (``launching``), those
        not healed at it (a bookkeeping all-reduce, not counted; its failure fails the exchange)."""
        if not launching:
            return list(self.members)
        return contributors(self.process_group, self.device, self.groups, self.group, contributes)

    def _launched(self, state: dict, launch, after, restore, comm, counts) -> FederatedWork:
        """``launch()`` now (its failure reported to the Manager: the commit at ``wait()`` then
        fails and the exchange is redone blocking: ``launch``, wait, ``after``)."""
        if self.dump is not None:
            self.dump.hold(self.round, "exchange")
        state["quorum"] = self.quorums
        try:
            state["sent"] = self.manager.errored() is None
            if state["sent"]:
                launch()
        except Exception as exc:  # noqa: BLE001
            self.manager.report_error(exc)
            state["work"] = None

        def run() -> None:
            launch()
            state["work"].wait()
            after()

        # (counted at the commit, by the committed quorum: a launch that fails and is redone
        # alone sent nothing that counts, :meth:`_exchange`)
        return FederatedWork(self, state, after, run, restore, comm, counts)

    def all_reduce_async(self, t: torch.Tensor, comm, category: str) -> FederatedWork:
        """:meth:`all_reduce_sum` launched now on this quorum, committed at ``wait()`` (the
        handle's ``groups``: the number of groups summed; a group healed at this round start
        adds zeros to the exchanges launched right after it)."""
        from torch.distributed import ReduceOp
        launching, contributes = self._launching, not (self._launching and self._just_healed)
        if not contributes:
            t.zero_()
        saved = t.clone()
        if self.dump is not None:
            self.dump.sent(category, saved)
        state: dict = {"work": None, "keep": list(self.members)}

        def launch() -> None:
            state["keep"] = self._contributors(launching, contributes)
            if self.dump is not None:
                self.dump.hold(self.round, "launch")
            state["work"] = self.manager.allreduce(t, reduce_op=ReduceOp.SUM)

        return self._launched(state, launch, lambda: None, lambda: t.copy_(saved), comm,
                              [(category, t.numel() * t.element_size())])

    def all_gather_async(self, out: torch.Tensor, shard: torch.Tensor, comm, category: str) -> FederatedWork:
        """:meth:`all_gather_into` launched now, committed at ``wait()``: ``out`` then holds
        the counted groups' shards in group order (resized to their number)."""
        from torch.distributed.distributed_c10d import AllgatherOptions
        shard = shard.contiguous()
        launching, contributes = self._launching, not (self._launching and self._just_healed)
        if self.dump is not None:
            self.dump.sent(category, shard)
        state: dict = {"work": None, "keep": list(self.members), "order": [], "parts": []}

        def launch() -> None:
            state["keep"] = self._contributors(launching, contributes)
            if self.dump is not None:
                self.dump.hold(self.round, "launch")
            state["order"] = list(self.order)
            state["parts"] = [torch.empty_like(shard) for _ in range(self.participants)]
            state["work"] = self.process_group.allgather([state["parts"]], [shard], AllgatherOptions())

        def after() -> None:
            keep, n = state["keep"], shard.shape[0]
            if out.shape[0] != len(keep) * n:
                out.resize_((len(keep) * n,) + tuple(shard.shape[1:]))
            for part, g in zip(state["parts"], state["order"]):
                if g in keep:
                    out.narrow(0, keep.index(g) * n, n).copy_(part)
            state["parts"] = []

        return self._launched(state, launch, after, lambda: None, comm,
                              [(category, shard.numel() * shard.element_size())])

    def atomic(self, fn, comm):
        """``fn()``, whose collectives on :class:`FederatedOuter` depend on each other (TRIM's
        row exchange: counts, then ids, then rows sized by the counts), as **one** exchange:
        committed once, and on a failure redone whole with the survivors (a group dying
        between two of them would otherwise leave sizes of one quorum and rows of another).
        Returns what ``fn`` returned in the committed try."""
        result: list = []

        def run() -> None:
            result.clear()
            self._nested = []
            try:
                result.append(fn())
            finally:
                counts, self._nested = self._nested, None
                result.append(counts)

        self._exchange(run, lambda: None, comm, lambda: result[-1] if result else [])
        return result[0]

    def _exchange(self, run, restore, comm, counts, tried: Optional[float] = None) -> None:
        """One exchange across the groups, committed when every participant saw it succeed
        (``should_commit``); else ``restore()`` and again with the survivors' quorum.
        ``counts``: the (category, bytes) it sends (or a function giving them after ``run``),
        counted once, when committed, and only when the committed quorum has several groups. A
        failed try's traffic is not in ``comm`` (how much of it crossed is unknown): the bytes of
        every collective it launched with several groups go to :attr:`failed` (the record's
        ``failed_bytes``, an upper bound). ``tried``: an overlapped exchange's first try was
        launched on this quorum and waited on since that time (monotonic). Inside :meth:`atomic` the
        collective runs at once (listed first: a failing one was launched too) and its failure
        is raised to :meth:`atomic`'s exchange."""
        if self._nested is not None:
            self._nested.extend(counts)
            run()
            return
        if self.dump is not None and tried is None:
            self.dump.hold(self.round, "exchange")
        waited = time.monotonic() if tried is None else tried  # this try's start
        while True:
            if tried is not None:  # (an overlapped exchange: its first try was launched and waited on)
                tried, sent = None, True
            else:
                sent = self.manager.errored() is None
                try:
                    if sent:
                        run()
                except Exception as exc:  # noqa: BLE001 - a peer gone mid-exchange: reported, not raised
                    self.manager.report_error(exc)
            if self.manager.should_commit():
                self._commits += 1
                # redone alone (the others gone): nothing crossed, as a group of one skips the
                # sync (FlatSync), so the round's bytes stay tools/dept_costs.py's for one group
                for category, nbytes in (counts() if callable(counts) else counts) if self.participants > 1 else ():
                    comm.count(category, nbytes)
                self.round_groups = list(self.members)
                return
            if sent and self.participants > 1:  # (launched with other groups: some of it may have crossed)
                self.count_failed(counts)
            gone = time.monotonic() - waited
            self._say(f"federation: round {self.round}: the exchange failed after {gone:.1f} s "
                      f"({first_line(self.manager.errored())}); again with the groups still there")
            restore()
            before = list(self.members)
            # not shrink_only: a group left out of a quorum (slow beyond timeout_s while the others
            # completed the round) is never let back into a shrink_only quorum by torchft's lighthouse;
            # allow_heal: such a group heals here at the others' next round start (LeftOut)
            self._quorum(synced=False, allow_heal=True)
            waited = time.monotonic()
            if self._healed is not None:
                self._left_out, self._healed = self._healed, None
                self._check_healed(self._left_out)
                self._apply(self._left_out)
                if self.dump is not None:
                    self.dump.dropped()
                self._say(f"federation: group {self.group}: round {self.round} was completed without it; "
                          f"it rejoins at round {self._left_out['round']} (healed from a live peer)")
                raise LeftOut(self.round)
            loop = self._loop  # a group left mid-round: said, and recorded at the step it left
            self._members_changed(before, self.round, loop.writer if loop is not None else None,
                                  loop.trainer.step if loop is not None else 0)

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)
        stop_checkpoint_server(getattr(self.manager, "_checkpoint_transport", None))
        self._own_store = None  # (a one-process job's: its server ends with the last reference)
