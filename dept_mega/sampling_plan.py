"""Each source's share of a run's training under ``dept.sampling``, as the run will draw it: the
start-up log's ``sampling (...)`` line, which ``--check`` prints before a launch too, and the
warning when the configured weighting cannot be the shares (docs/dept_guide.md §3).

STD: every batch mixes the sources with the probabilities of ``data.sources.source_weights``.
DEPT: the round plans decide (``dept.rounds.RoundScheduler``): as many sources as groups means
group g trains source g every round, whatever the sampling; with more sources, each round draws
G distinct ones, so a source trains at most one round in G.
"""
from __future__ import annotations

from typing import Optional, Sequence

#: the round plans the start-up sampling line counts at most (a long run of short rounds would
#: draw its whole schedule at start, about 25 µs a round)
SAMPLING_LINE_ROUNDS = 10_000
#: how far (a fraction of the training) the sampler's long-run share of a source may be from its
#: weight's share under dept.sampling: weights before the pre-flight warns (an estimate from
#: SAMPLING_LINE_ROUNDS rounds is within about 0.3 points)
SHARE_TOLERANCE = 0.01


def sampling_groups(cfg, world_size: int) -> int:
    """The source groups the sampling spreads over: the federation's group jobs, or the job's."""
    if cfg.federation.lighthouse is not None:
        return int(cfg.federation.groups)
    return cfg.num_groups(world_size)


def make_scheduler(cfg, groups: int, sizes: Sequence[float], weights: Sequence[float],
                   origin: Optional[dict] = None):
    """The round plans of a DEPT run with ``groups`` groups: ``sizes`` (the sources' tokens) and
    ``weights`` (``data.sources[i].weight``) under ``dept.sampling``; sources that belong to
    groups (``data.sources[].group``; federation with K > G) never move; ``origin``: rebased
    there (:meth:`~dept_mega.dept.rounds.RoundScheduler.rebase`)."""
    from .config import source_groups
    from .dept.rounds import RoundScheduler
    d = cfg.dept
    sched = RoundScheduler(len(sizes), groups, seed=cfg.train.seed, sampling=d.sampling,
                           temperature=d.temperature, sizes=list(sizes), weights=list(weights),
                           owners=source_groups(cfg, groups))
    if origin:
        sched.rebase(origin["round"], origin["last_group"], origin["rounds_before"])
    return sched


def _counted_rounds(cfg, scheduler) -> tuple[int, int, int]:
    """(first, counted, last): the schedule's rounds [first, last), of which [first, counted) are
    counted for the log line (at most :data:`SAMPLING_LINE_ROUNDS`)."""
    first = (scheduler.origin() or {}).get("round", 0)
    last = max(-(-cfg.train.steps // cfg.dept.local_steps), first + 1)
    return first, min(last, first + SAMPLING_LINE_ROUNDS), last


def rounds_line(cfg, scheduler, names: Sequence[str], groups: int) -> str:
    """DEPT: each source's share of the run's group-rounds from its round plans (from the round
    the schedule starts at to the last), for the start-up log."""
    from .data.sources import sampling_line
    first, counted, last = _counted_rounds(cfg, scheduler)
    shares = scheduler.shares(first, counted)
    K = len(names)
    rounds = f"shares of rounds {first}-{counted - 1}" + (f" of {first}-{last - 1}" if counted < last else "")
    if scheduler.fixed:
        how = f"DEPT: {K} sources on {groups} groups, each every round"
    elif scheduler.owners is not None:
        how = f"DEPT: each group draws one of its own sources a round; {rounds}"
    else:
        how = f"DEPT: {groups} of {K} sources a round, without repeats; {rounds}"
    return sampling_line(cfg.dept.sampling, names, shares, how)


def _needs_sizes(cfg) -> bool:
    return cfg.dept.sampling in ("proportional", "temperature")


def planned_line(cfg, groups: int) -> str:
    """The ``sampling (...)`` line a launch of ``cfg`` on ``groups`` groups logs at start, from
    the data files (their token counts, read only where ``dept.sampling`` uses them)."""
    from .data.gpt_dataset import part_tokens
    from .data.indexed import IndexedDataset
    from .data.sources import blend_shares, sampling_line
    names = [s.name for s in cfg.data.sources]
    if cfg.dept.variant == "std":  # STD counts the tokens of each source's train part (from the index)
        tokens = ([part_tokens(IndexedDataset(s.prefix), cfg.data.split, "train")[2] for s in cfg.data.sources]
                  if _needs_sizes(cfg) else [1.0] * len(names))
        return sampling_line(cfg.dept.sampling, names, blend_shares(cfg, names, tokens))
    from .dept.source_info import source_tokens
    sizes = [source_tokens(s.prefix) if _needs_sizes(cfg) else 1.0 for s in cfg.data.sources]
    sched = make_scheduler(cfg, groups, sizes, [s.weight for s in cfg.data.sources])
    return rounds_line(cfg, sched, names, groups)


def sampling_warning(cfg, groups: int) -> Optional[str]:
    """Why the configured weighting cannot be the sources' shares, or None. Under DEPT with as
    many sources as groups every source trains every round: ``dept.sampling`` and the weights
    change nothing. Under ``dept.sampling: weights`` with more sources than groups (G > 1):
    drawn without repeats, a source trains at most 1/G of the rounds and a heavy source less
    than its weight (the sampler's long-run shares, :data:`SAMPLING_LINE_ROUNDS` rounds, more
    than :data:`SHARE_TOLERANCE` from a weight); with sources tied to groups, a group's sources
    share 1/G whatever their weights. Says what the shares will be and what gives the weights'
    mix (docs/dept_guide.md §3)."""
    d, sources = cfg.dept, cfg.data.sources
    K, G = len(sources), groups
    if d.variant == "std" or d.sampling == "uniform" or K <= 1 or G < 1:
        return None
    weighted = any(s.weight != 1.0 for s in sources)
    asked = f"dept.sampling: {d.sampling}" + (" and data.sources[].weight" if weighted else "")
    if K == G:
        return (f"config key 'dept.sampling': {asked} change nothing here: with {K} sources on {G} groups, group g "
                f"trains source g every round, so each source gets 1/{G} ({100.0 / G:.1f} %) of the training; for a "
                f"weighted mix use dept.variant: std (the weights set every batch's mix) or more sources than "
                f"groups (each round then draws {G} of them, a source at most 1/{G} of the rounds) "
                f"(docs/dept_guide.md §3)")
    if d.sampling != "weights" or G == 1:
        return None
    from .config import source_groups
    total = sum(s.weight for s in sources)
    p = [s.weight / total for s in sources]
    sched = make_scheduler(cfg, G, [1.0] * K, [s.weight for s in sources])
    owners = source_groups(cfg, G)
    if owners is None:
        long_run = sched.shares(0, SAMPLING_LINE_ROUNDS)
        if max(abs(x - w) for x, w in zip(long_run, p)) <= SHARE_TOLERANCE:
            return None
        why = (f"each round draws {G} distinct sources, so a source trains at most 1/{G} ({100.0 / G:.1f} %) of the "
               f"rounds and a heavy source less than its weight (weights: {_percent(sources, p)})")
    else:
        totals = [sum(w for w, o in zip(p, owners) if o == g) for g in range(G)]
        if all(abs(t - 1.0 / G) <= 1e-9 for t in totals):
            return None
        why = (f"every group trains one of its own sources each round (data.sources[].group), so each group's "
               f"sources share 1/{G} ({100.0 / G:.1f} %) of the training whatever their weights (theirs add up to "
               f"{', '.join(f'group {g} {100.0 * t:.1f} %' for g, t in enumerate(totals))})")
    first, counted, _ = _counted_rounds(cfg, sched)
    return (f"config key 'dept.sampling': the weights cannot be the shares here: {why}; this run's round plans "
            f"give {_percent(sources, sched.shares(first, counted))}; the weights are the exact shares under "
            f"dept.variant: std or with one group (docs/dept_guide.md §3)")


def _percent(sources, values: Sequence[float]) -> str:
    return ", ".join(f"{s.name} {100.0 * x:.1f} %" for s, x in zip(sources, values))
