"""When each part of the model is synchronised across groups: fragments, overlap, delay.

``dept.outer_fragments: F`` splits the body into F fragments of consecutive layers (layer i
belongs to fragment ⌊i·F/N⌋, the final norm to fragment F−1), each a :class:`FlatSync` with
its own θ_{t-1} and outer optimizer state. Fragment f is launched after inner step
``(f+1)·⌊L/F⌋`` of each round (``L = dept.local_steps``; the last at the round's end), so at
most one fragment's pseudo-gradient is launched at a time (Streaming DiLoCo, Douillard et al.
2025, arXiv:2501.18512). Synchronised embedding state (GLOB's tables and learned positions)
is spread over the fragments the same way: its FlatSync goes in F parts
(``FlatSync.use_parts``; part f = the f-th 1/F slice of every replica's chunk), part f
launched with fragment f, so each point of the round carries 1/F of the body and 1/F of the
tables. (Sending the tables with one fragment instead — they are 2.6× the body in the sample
study — both piles most of the bytes on one step and leaves the tables unsynchronised with τ
steps of drift kept as a correction; docs/study/outer_sync.md measures it.) TRIM's rows and
positions are synchronised at the round's end, blocking, after the body (the installed
compact table belongs to the round's source).

``dept.outer_overlap`` with ``dept.outer_delay: τ > 0``: a launched fragment is applied τ
inner steps later with the correction θ ← θ_local_now + (θ_t − θ_local_at_launch)
(``FlatSync.finish(correct=True)``); meanwhile its exchange runs behind the training
steps. τ = 0 is the blocking sync (F = 1, τ = 0: exactly the sync without this module's
options). ``dept.outer_overlap_rule: eager`` (``OuterSchedule(eager=True)``) starts those τ
steps from an estimate of θ_t instead of θ_local (outer.py, "Eager start") and corrects
with θ ← θ_local_now + (θ_t − θ_eager); ``mix`` (``OuterSchedule(mix=α)``) lands a sync as
α·θ_local_now + (1 − α)·θ_t; the default ``correction`` is the rule above. The
run's last step applies every pending sync, syncs the last fragment blocking and then every
other fragment once more (blocking), so that the final weights are the same in
every group (the last round's record therefore carries F − 1 extra fragment syncs).

Where things happen, with ``s`` = inner steps done:

* ``before_step(s)``: fragments with offset ``s mod L`` (≠ 0) are launched (blocking: synced);
* ``after_step(s)``: pending syncs due at ``s`` are applied;
* ``round_end(s)``: the last fragment and the embedding syncs are launched (blocking when
  τ = 0 or on the last step, which also applies everything pending); under federation
  (``defer_round_end``) an overlapped launch waits for the next round start's quorum
  (:meth:`OuterSchedule.launch_deferred`, nothing trains in between: the same Δ).

Launching in ``before_step`` (not after the previous step) leaves, after every
``after_step``, a point where the fragment due then has been applied and the next one is not
launched yet — :meth:`OuterSchedule.idle` — where checkpoints are taken.

Timing (the ``outer`` record): ``exposed_seconds`` = time the training loop spent inside
the sync (launching, waiting, the outer step, the re-gather and the writes); ``overlap_seconds``
= for each applied overlapped sync, the time from its launch until its exchange was seen
complete (``is_completed()``, polled after every inner step) or until the wait began,
whichever came first: the part of the exchange hidden behind compute. Both are measured with
``profiling.PhaseTimer`` on the schedule's device: on CUDA, events on the current stream,
i.e. GPU time (NCCL's ``wait()`` does not block the host, so host time would only count the
queuing), resolved by :meth:`OuterSchedule.take_times` at the round end; elsewhere wall clock.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..profiling import PhaseTimer
from .outer import FlatSync, PendingSync


@dataclass
class SyncUnit:
    sync: FlatSync
    offset: int  # launched after inner step ``offset`` of a round (1..L; L = at the round end)
    name: str
    part: Optional[int] = None  # the part of ``sync`` (FlatSync.use_parts), None: all of it


@dataclass
class _Pending:
    unit: SyncUnit
    pending: PendingSync
    due: int  # inner step after which it is applied
    hidden: Optional[PhaseTimer] = None  # from the launch; stopped when seen complete or at the wait


def fragment_of(name: str, fragments: int, num_layers: int) -> int:
    """The fragment of a body parameter by its name (``body.layers.<i>.…``, ``body.final_norm.…``)."""
    parts = name.split(".")
    if len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit():
        return int(parts[2]) * fragments // num_layers
    return fragments - 1


def body_fragments(stages: Sequence[torch.nn.Module], fragments: int, num_layers: int) -> list[list]:
    """This rank's body parameters split by fragment, each list in ``Trainer.body_parameters``
    order (F = 1: that list itself)."""
    out: list[list] = [[] for _ in range(fragments)]
    seen: set[int] = set()
    for st in stages:
        for n, p in st.named_parameters():
            if not n.startswith("body.") or id(p) in seen:
                continue
            seen.add(id(p))
            out[fragment_of(n, fragments, num_layers)].append(p)
    return out


def fragment_offsets(local_steps: int, fragments: int) -> list[int]:
    return [(f + 1) * (local_steps // fragments) if f < fragments - 1 else local_steps for f in range(fragments)]


def sync_units(body_syncs: Sequence[FlatSync], embedding_syncs: Sequence[FlatSync], local_steps: int) -> list[SyncUnit]:
    """The schedule's units: body fragment f at its offset, and every embedding FlatSync in
    F parts, part f with fragment f (F = 1: whole, at the round's end)."""
    F = len(body_syncs)
    offsets = fragment_offsets(local_steps, F)
    units = [SyncUnit(s, o, f"body{f}") for f, (s, o) in enumerate(zip(body_syncs, offsets))]
    for i, s in enumerate(embedding_syncs):
        if F == 1:
            units.append(SyncUnit(s, local_steps, f"embedding{i}"))
            continue
        s.use_parts(F)
        units += [SyncUnit(s, o, f"embedding{i}.{f}", part=f) for f, o in enumerate(offsets)]
    return units


class OuterSchedule:
    def __init__(self, units: Sequence[SyncUnit], local_steps: int, delay: int, total_steps: int,
                 eager: bool = False, mix: Optional[float] = None, defer_round_end: bool = False,
                 device: torch.device | str = "cpu") -> None:
        self.units = list(units)
        self.device = torch.device(device)  # where the timing runs (PhaseTimer)
        # federation (dept/federation.py): an overlapped round-end launch waits for the next
        # round start's quorum (launch_deferred), so that it runs on that quorum's process group
        self.defer_round_end = bool(defer_round_end) and delay > 0
        self.deferred_step: Optional[int] = None  # the step of the round end whose launch waits
        self.L, self.delay, self.total = int(local_steps), int(delay), int(total_steps)
        if eager and mix is not None:
            raise ValueError("OuterSchedule: eager and mix are two different overlap rules")
        # the merge rule (outer.py): an overlapped sync lands as α·θ_local_now + (1 − α)·θ_t
        self.mix = None if mix is None else float(mix)
        # the eager start (outer.py): every unit's FlatSync keeps its estimate buffer
        self.eager = bool(eager) and self.delay > 0
        if self.eager:
            for u in self.units:
                u.sync.enable_eager()
        self.pending: list[_Pending] = []
        self.synced_at: dict[int, int] = {}  # unit index -> the step of its last blocking sync
        self.exposed: list[PhaseTimer] = []  # stopped timers, resolved by take_times
        self.overlap: list[PhaseTimer] = []

    @property
    def idle(self) -> bool:
        """No sync is in flight or waiting to be launched (a checkpoint may be taken)."""
        return not self.pending and self.deferred_step is None

    def synced_now(self, step: int) -> list[FlatSync]:
        """The FlatSyncs every part of which was synchronised blocking after inner step
        ``step`` with nothing applied since: their parameters are the same in every group now
        (an overlapped sync lands on each group's own local weights, and a fragment synchronised
        earlier in the round has trained locally since)."""
        if self.pending:
            return []
        fresh: dict[int, bool] = {}
        for i, u in enumerate(self.units):
            fresh[id(u.sync)] = fresh.get(id(u.sync), True) and self.synced_at.get(i) == step
        return [u.sync for u in self.units if fresh.pop(id(u.sync), False)]

    def take_times(self) -> tuple[float, float]:
        """(overlap_seconds, exposed_seconds) since the last call. On CUDA this waits for the
        last timed phase's end event (call it where the host waits anyway: the round end)."""
        out = (sum(t.seconds() for t in self.overlap), sum(t.seconds() for t in self.exposed))
        self.overlap, self.exposed = [], []
        return out

    def _launch(self, unit: SyncUnit, step: int, blocking: bool) -> None:
        timer = PhaseTimer(self.device)
        if blocking:
            unit.sync.sync(part=unit.part)
            self.synced_at[self.units.index(unit)] = step
        else:
            p = unit.sync.launch(keep_launch=self.mix is None, part=unit.part, eager=self.eager)
            if p is not None:
                self.pending.append(_Pending(unit, p, step + self.delay, PhaseTimer(self.device)))
        self.exposed.append(timer.stop())

    def _apply(self, item: _Pending) -> None:
        timer = PhaseTimer(self.device)
        if item.hidden is not None:
            self.overlap.append(item.hidden if item.hidden.stopped else item.hidden.stop())
        item.unit.sync.finish(item.pending, correct=self.mix is None, mix=self.mix)
        self.exposed.append(timer.stop())

    def before_step(self, step: int) -> None:
        into = step % self.L
        if step <= 0 or into == 0:
            return
        for u in self.units:
            if u.offset == into:
                self._launch(u, step, blocking=self.delay == 0)

    def after_step(self, step: int) -> None:
        for item in self.pending:
            if (item.hidden is not None and not item.hidden.stopped and item.pending.work is not None
                    and item.pending.work.is_completed()):
                item.hidden.stop()
        due = [item for item in self.pending if item.due <= step]
        self.pending = [item for item in self.pending if item.due > step]
        for item in due:
            self._apply(item)

    def round_end(self, step: int) -> None:
        last = step >= self.total
        if self.defer_round_end and not last:
            self.deferred_step = step
            return
        for u in self.units:
            if u.offset == self.L:
                self._launch(u, step, blocking=self.delay == 0 or last)
        if last:
            self.flush()
            # the final weights are the same in every group: the other fragments, which have
            # trained locally since their last sync, are synchronised once more (blocking)
            for u in self.units:
                if u.offset != self.L:
                    self._launch(u, step, blocking=True)

    def launch_deferred(self, step: int) -> None:
        """Launch the round-end units whose launch :meth:`round_end` deferred (at ``step``, the
        next round's start; the same step as the round end: a group healed there launches them
        too, from the state it received)."""
        self.deferred_step = None
        for u in self.units:
            if u.offset == self.L:
                self._launch(u, step, blocking=False)

    def drop(self) -> None:
        """Forget every sync in flight or waiting to be launched (a federated group left out of
        the round: the peers' state has been written over what they would land)."""
        self.pending, self.deferred_step = [], None

    def flush(self) -> None:
        """Apply every pending sync now (in launch order)."""
        items, self.pending = self.pending, []
        for item in items:
            self._apply(item)
