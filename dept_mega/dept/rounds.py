"""Who trains what: the source of each group in each round (docs/dept.md, "A round").

K = G: a fixed assignment, group g trains source g every round.
K > G: a seeded sampler draws G distinct sources per round (weighted, without replacement).
Sources that belong to groups (``owners``: ``data.sources[].group``, and federation with K > G,
where a source's data stays at its site): each group draws one of its own sources, weighted
among them, and a source never moves.
``balanced`` (K > G): each round takes the G sources (with owners: each group its own source)
trained the fewest rounds so far, ties broken by a seeded shuffle: shuffled cycles without
replacement, every source trained once before any is trained again.
The draw depends only on (seed, round) and the plan history before it, so every rank computes
the same plan without any communication, and a resumed run replays the same history.

The plan history also gives every source's data position: the inner steps it has been trained
so far, by any group (:meth:`RoundScheduler.steps_trained`). The loop positions a source's
batch iterator there at every round start, so a source continues its data wherever it trains
next, and a resumed run (also one resumed inside a round) reads what the uninterrupted run
would have read.

A source that is drawn again keeps the group it last trained in when that group is free, so
sources move between groups only when they have to; a *move* is recorded when a source last
trained in group a now trains in group b (its own state then travels a -> b, see store.py).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence


@dataclass(frozen=True)
class Move:
    """Source ``source`` last trained in group ``src_group`` and trains in ``dst_group`` now."""
    source: int
    src_group: int
    dst_group: int


@dataclass(frozen=True)
class RoundPlan:
    round: int
    sources: tuple[int, ...]  # sources[g] = index of the source group g trains this round
    moves: tuple[Move, ...]
    # last_group[k] = the group source k trained in most recently *before* this round (None: never)
    last_group: tuple[Optional[int], ...]
    # rounds_before[k] = how many rounds before this one trained source k (its data position
    # at this round's start is rounds_before[k] · local_steps steps, whichever group trains it)
    rounds_before: tuple[int, ...] = ()

    def group_of(self, source: int) -> Optional[int]:
        return self.sources.index(source) if source in self.sources else None


def sampling_weights(sizes: Sequence[float], sampling: str, temperature: float,
                     weights: Optional[Sequence[float]] = None) -> list[float]:
    """Source probabilities for the K > G draw: the data package's ``source_weights`` (the
    same rule as STD's blend: uniform, ∝ size × weight, ∝ (size × weight)^τ, or ∝ weight)."""
    from ..data.sources import source_weights

    return [float(w) for w in source_weights(sizes, sampling, temperature, weights)]


def _round_rng(seed: int, round_index: int) -> random.Random:
    # Mersenne Twister seeded by an int: identical on every rank and Python version.
    return random.Random((int(seed) * 1_000_003 + 7919) * 1_000_033 + int(round_index))


def draw_without_replacement(weights: Sequence[float], count: int, rng: random.Random) -> list[int]:
    """``count`` distinct indices, each draw ∝ the remaining weights (sequential sampling)."""
    remaining = list(range(len(weights)))
    chosen: list[int] = []
    for _ in range(count):
        total = sum(weights[i] for i in remaining)
        x = rng.random() * total
        acc = 0.0
        pick = remaining[-1]
        for i in remaining:
            acc += weights[i]
            if x < acc:
                pick = i
                break
        chosen.append(pick)
        remaining.remove(pick)
    return chosen


def least_trained(candidates: Iterable[int], count: int, rounds_before: Sequence[int],
                  rng: random.Random) -> list[int]:
    """``count`` of ``candidates`` with the fewest rounds so far (``rounds_before``), ties in a
    random order from ``rng``: applied round after round, a source is taken again only once
    every candidate has been taken as often (shuffled cycles without replacement)."""
    ties = {k: rng.random() for k in candidates}
    return sorted(ties, key=lambda k: (rounds_before[k], ties[k]))[:count]


class RoundScheduler:
    """Round plans for ``num_sources`` sources over ``num_groups`` groups."""

    def __init__(self, num_sources: int, num_groups: int, *, seed: int, sampling: str = "uniform",
                 temperature: float = 1.0, sizes: Optional[Sequence[float]] = None,
                 owners: Optional[Sequence[int]] = None, weights: Optional[Sequence[float]] = None) -> None:
        """``sizes``: the sources' tokens; ``weights``: their ``data.sources[i].weight``
        (:func:`sampling_weights`; ``self.weights`` holds the resulting probabilities).
        ``owners[k]``: the group that owns source k (each group then draws one of its own
        sources every round, ∝ their weights); None: any group trains any source."""
        if num_groups < 1:
            raise ValueError(f"need at least one group, got {num_groups}")
        if num_sources < num_groups:
            raise ValueError(f"{num_sources} sources cannot fill {num_groups} groups")
        self.num_sources = num_sources
        self.num_groups = num_groups
        self.seed = seed
        sizes = list(sizes) if sizes is not None else [1.0] * num_sources
        if len(sizes) != num_sources:
            raise ValueError(f"got {len(sizes)} source sizes for {num_sources} sources")
        #: balanced: fewest rounds first, ties shuffled (the weights are uniform: sizes and
        #: weights play no part)
        self.balanced = sampling == "balanced"
        self.weights = sampling_weights(sizes, "uniform" if self.balanced else sampling, temperature, weights)
        self.owners: Optional[list[int]] = None
        if owners is not None:
            self.owners = [int(g) for g in owners]
            if len(self.owners) != num_sources or any(not 0 <= g < num_groups for g in self.owners):
                raise ValueError(f"owners {self.owners}: need one group in [0, {num_groups}) per source")
            if set(self.owners) != set(range(num_groups)):
                raise ValueError(f"owners {self.owners}: every one of the {num_groups} groups needs a source")
        self._plans: list[RoundPlan] = []
        self._base = 0  # round of self._plans[0]
        self._origin: Optional[dict] = None

    def rebase(self, round_index: int, last_group: Sequence[Optional[int]], rounds_before: Sequence[int]) -> None:
        """Continue the schedule from round ``round_index`` with the given history instead of
        replaying it from round 0: ``last_group[k]`` (the group of this scheduler that holds
        source k's state at that round's start, None: never trained) and ``rounds_before[k]``
        (rounds that trained source k before it). Used when a run resumes with another number
        of groups (the old history is another scheduler's); plans before ``round_index`` are
        then unknown. :meth:`origin` gives what a checkpoint records to rebuild it."""
        K = self.num_sources
        if len(last_group) != K or len(rounds_before) != K:
            raise ValueError(f"rebase: {len(last_group)} / {len(rounds_before)} entries for {K} sources")
        if any(g is not None and not 0 <= int(g) < self.num_groups for g in last_group):
            raise ValueError(f"rebase: a group in {list(last_group)} is not one of the {self.num_groups} groups")
        self._origin = {"round": int(round_index), "last_group": [None if g is None else int(g) for g in last_group],
                        "rounds_before": [int(n) for n in rounds_before]}
        self._base = int(round_index)
        self._plans = []

    def origin(self) -> Optional[dict]:
        """The :meth:`rebase` arguments in effect (plain values), or None (history from round 0)."""
        return None if self._origin is None else {k: (list(v) if isinstance(v, list) else v)
                                                  for k, v in self._origin.items()}

    @property
    def fixed(self) -> bool:
        return self.num_sources == self.num_groups and self.owners is None

    def _draw(self, round_index: int, last_group: list[Optional[int]], before: list[int]) -> tuple[int, ...]:
        G = self.num_groups
        if self.fixed:
            return tuple(range(G))
        if self.owners is not None:  # group g: one of its own sources, ∝ their weights (or the least trained)
            rng = _round_rng(self.seed, round_index)
            out = []
            for g in range(G):
                own = [k for k, o in enumerate(self.owners) if o == g]
                if self.balanced:
                    out.append(least_trained(own, 1, before, rng)[0])
                else:
                    out.append(own[draw_without_replacement([self.weights[k] for k in own], 1, rng)[0]])
            return tuple(out)
        rng = _round_rng(self.seed, round_index)
        drawn = (least_trained(range(self.num_sources), G, before, rng) if self.balanced
                 else draw_without_replacement(self.weights, G, rng))
        slots: list[Optional[int]] = [None] * G
        rest = []
        for k in drawn:  # a source drawn again stays where it was when it can
            g = last_group[k]
            if g is not None and slots[g] is None:
                slots[g] = k
            else:
                rest.append(k)
        free = [g for g in range(G) if slots[g] is None]
        for g, k in zip(free, rest):
            slots[g] = k
        return tuple(int(k) for k in slots)  # type: ignore[arg-type]

    def plan(self, round_index: int) -> RoundPlan:
        """The plan of round ``round_index`` (rounds before it are replayed once and cached)."""
        if round_index < self._base:
            raise ValueError(f"round index must be >= {self._base}, got {round_index}"
                             + (" (the schedule was rebased there: the run changed its number of groups)"
                                if self._base else ""))
        while len(self._plans) + self._base <= round_index:
            r = len(self._plans) + self._base
            if self._plans:
                last, before = list(self._plans[-1].last_group), list(self._plans[-1].rounds_before)
            elif self._origin is not None:
                last, before = list(self._origin["last_group"]), list(self._origin["rounds_before"])
            else:
                last, before = [None] * self.num_sources, [0] * self.num_sources
            if self._plans:
                for g, k in enumerate(self._plans[-1].sources):
                    last[k] = g
                    before[k] += 1
            sources = self._draw(r, last, before)
            moves = tuple(Move(k, last[k], g) for g, k in enumerate(sources)
                          if last[k] is not None and last[k] != g)
            self._plans.append(RoundPlan(r, sources, moves, tuple(last), tuple(before)))
        return self._plans[round_index - self._base]

    def counts(self, first: int, last: int) -> list[int]:
        """Each source's rounds among the plans of rounds ``[first, last)``."""
        counts = [0] * self.num_sources
        for r in range(first, last):
            for k in self.plan(r).sources:
                counts[k] += 1
        return counts

    def shares(self, first: int, last: int) -> list[float]:
        """Each source's fraction of the group-rounds of rounds ``[first, last)``: its actual
        share of the training (a group's round is as many steps as any other's)."""
        counts = self.counts(first, last)
        total = max(sum(counts), 1)
        return [c / total for c in counts]

    def steps_trained(self, source: int, step: int, local_steps: int) -> int:
        """Inner steps of ``[0, step)`` in which some group trained ``source``: its data
        position (in steps) at inner step ``step``, identical on every rank."""
        r, into = divmod(int(step), int(local_steps))
        plan = self.plan(r)
        return plan.rounds_before[source] * local_steps + (into if source in plan.sources else 0)
