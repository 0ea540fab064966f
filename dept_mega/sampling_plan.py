"""Each source's share of a run's training under ``dept.sampling``, as the run will draw it: the
start-up log's ``sampling (...)`` line, which ``--check`` prints before a launch too, and the
warnings when the configured weighting cannot be the shares, or when this run's rounds, as drawn,
train a source in no round or far from its expected share (docs/dept_guide.md §3); under SPEC /
SPEC-OPT a source trained in no round refuses the launch unless ``dept.untrained_sources: warn``.

STD: every batch mixes the sources with the probabilities of ``data.sources.source_weights``.
DEPT: the round plans decide (``dept.rounds.RoundScheduler``): as many sources as groups means
group g trains source g every round, whatever the sampling; with more sources, each round draws
G distinct ones (``balanced``: the least trained), so a source trains at most one round in G.

The launch passes its driver's scheduler, ``--check`` the one :func:`plan_scheduler` builds for
its sampling line: the plans are drawn once for the line, the warnings and the check.
"""
from __future__ import annotations

from typing import Optional, Sequence

from .variant import variant_of

#: the round plans the start-up sampling line counts at most (a long run of short rounds would
#: draw its whole schedule at start, about 25 µs a round)
SAMPLING_LINE_ROUNDS = 10_000
#: how far (a fraction of the training) the sampler's long-run share of a source may be from its
#: weight's share under dept.sampling: weights before the pre-flight warns (an estimate from
#: SAMPLING_LINE_ROUNDS rounds is within about 0.3 points)
SHARE_TOLERANCE = 0.01
#: this run's planned rounds give a source a share far from its expected one (the sampler's
#: long-run share) when its group-rounds differ from the expected count by more than this fraction
#: of it and by more than one group-round: a short run's shares move in steps of 1/(rounds × G),
#: so a fixed tolerance such as SHARE_TOLERANCE would flag every run of a few rounds
PLANNED_SHARE_FRACTION = 0.5


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
        turn = "in turn" if scheduler.balanced else "a round"
        how = f"DEPT: each group draws one of its own sources {turn}; {rounds}"
    elif scheduler.balanced:
        how = f"DEPT: {groups} of {K} sources a round, each once before any again; {rounds}"
    else:
        how = f"DEPT: {groups} of {K} sources a round, without repeats; {rounds}"
    return sampling_line(cfg.dept.sampling, names, shares, how)


def _needs_sizes(cfg) -> bool:
    return cfg.dept.sampling in ("proportional", "temperature")


def plan_scheduler(cfg, groups: int):
    """DEPT: the round plans a launch of ``cfg`` on ``groups`` groups draws, from the data files
    (their token counts, read only where ``dept.sampling`` uses them); None under STD."""
    if not variant_of(cfg).rounds:
        return None
    from .data.summary import foreign_summaries
    from .dept.source_info import source_tokens
    # federated: another site's source's tokens are in its summary (read only where sizes are used)
    foreign = foreign_summaries(cfg) if _needs_sizes(cfg) else {}

    def size(i, s) -> float:
        if not _needs_sizes(cfg):
            return 1.0
        return float(foreign[i]["tokens"]) if i in foreign else source_tokens(s.prefix)
    sizes = [size(i, s) for i, s in enumerate(cfg.data.sources)]
    return make_scheduler(cfg, groups, sizes, [s.weight for s in cfg.data.sources])


def planned_line(cfg, groups: int, scheduler=None) -> str:
    """The ``sampling (...)`` line a launch of ``cfg`` on ``groups`` groups logs at start, from
    the data files (``scheduler``: DEPT's round plans, else :func:`plan_scheduler`'s)."""
    from .data.gpt_dataset import part_tokens
    from .data.indexed import IndexedDataset
    from .data.sources import blend_shares, sampling_line
    names = [s.name for s in cfg.data.sources]
    if not variant_of(cfg).rounds:  # STD counts the tokens of each source's train part (from the index)
        tokens = ([part_tokens(IndexedDataset(s.prefix), cfg.data.split, "train")[2] for s in cfg.data.sources]
                  if _needs_sizes(cfg) else [1.0] * len(names))
        return sampling_line(cfg.dept.sampling, names, blend_shares(cfg, names, tokens))
    return rounds_line(cfg, scheduler or plan_scheduler(cfg, groups), names, groups)


def planned_rounds(cfg, scheduler, counts: Optional[list[int]] = None) -> list[int]:
    """Each source's rounds in the run: those before the schedule's first round (a rebased
    schedule's history) and those of its plans up to the last round (at most
    :data:`SAMPLING_LINE_ROUNDS` of them counted; ``counts``: those plans' counts, when the
    caller has them)."""
    if counts is None:
        first, counted, _ = _counted_rounds(cfg, scheduler)
        counts = scheduler.counts(first, counted)
    origin = scheduler.origin()
    before = [int(n) for n in origin["rounds_before"]] if origin else [0] * scheduler.num_sources
    return [b + c for b, c in zip(before, counts)]


def expected_shares(scheduler, first: int = 0) -> list[float]:
    """Each source's share of the group-rounds in the long run: exact where the draw makes it so
    (fixed, one group, sources tied to groups, equal weights, balanced), else the share of
    :data:`SAMPLING_LINE_ROUNDS` planned rounds from ``first`` (G distinct draws a round: a
    source's chance to be in a round is not G times its weight)."""
    K, G, w = scheduler.num_sources, scheduler.num_groups, scheduler.weights
    if scheduler.fixed:
        return [1.0 / G] * K
    if scheduler.owners is not None:
        totals = [sum(w[k] for k in range(K) if scheduler.owners[k] == g) for g in range(G)]
        return [w[k] / totals[scheduler.owners[k]] / G for k in range(K)]
    if G == 1:
        return list(w)
    if scheduler.balanced or max(w) - min(w) <= 1e-12 * max(w):
        return [1.0 / K] * K
    return scheduler.shares(first, first + SAMPLING_LINE_ROUNDS)


def untrained_sources(cfg, scheduler, counts: Optional[list[int]] = None) -> list[str]:
    """The sources this run's round plans train in no round: past the log line's
    :data:`SAMPLING_LINE_ROUNDS` plans, the rest are drawn while a source has none (one first
    drawn in a long run's later rounds is trained). ``counts``: the counted plans' counts, when
    the caller has them (:func:`planned_rounds`)."""
    _, counted, last = _counted_rounds(cfg, scheduler)
    rounds = planned_rounds(cfg, scheduler, counts)
    while counted < last and 0 in rounds:
        upto = min(last, counted + SAMPLING_LINE_ROUNDS)
        rounds = [n + c for n, c in zip(rounds, scheduler.counts(counted, upto))]
        counted = upto
    return [s.name for s, n in zip(cfg.data.sources, rounds) if n == 0]


def _rounds_phrase(cfg, scheduler, every: bool = False) -> str:
    """``every``: of a verdict on all the run's rounds (:func:`untrained_sources`), not only
    those counted for the log line."""
    first, counted, last = _counted_rounds(cfg, scheduler)
    d, t = cfg.dept, cfg.train
    rounds = (f"{last} rounds = train.steps {t.steps} / dept.local_steps {d.local_steps}" if first == 0
              else f"rounds {first}-{last - 1} after its resume")
    if counted < last and not every:
        rounds += f", the first {counted - first:,} counted"
    return f"this run's round plans ({rounds}, drawn with train.seed {t.seed})"


def check_untrained(cfg, scheduler) -> None:
    """SPEC / SPEC-OPT: refuse a run whose round plans train a source in no round (its own
    embeddings would keep their initial values, and ``tools/convert_to_hf.py --source`` finds no
    trained embeddings of it after the run), unless ``dept.untrained_sources: warn``. A
    :class:`~dept_mega.config.ConfigError`; nothing under the other variants, which only warn
    (:func:`sampling_warnings`), as a source there shares its embeddings with the others."""
    from .config import ConfigError
    d = cfg.dept
    if scheduler is None or not variant_of(cfg).own_embeddings or d.untrained_sources != "error":
        return
    missing = untrained_sources(cfg, scheduler)
    if not missing:
        return
    raise ConfigError(f"config key 'dept.untrained_sources': {_rounds_phrase(cfg, scheduler, every=True)} train "
                      f"{', '.join(missing)} in no round: under {d.variant} its own embeddings would keep their "
                      f"initial values and tools/convert_to_hf.py --source {missing[0]} would find no trained "
                      f"embeddings; {_remedy(cfg, scheduler, len(missing))}; or set dept.untrained_sources: warn "
                      f"to launch anyway (docs/dept_guide.md §3)")


def _remedy(cfg, scheduler, missing: int) -> str:
    """What trains every source: more rounds when this run has too few group-rounds for them,
    else ``dept.sampling: balanced`` (or another seed)."""
    first, counted, _ = _counted_rounds(cfg, scheduler)
    rounds, G, K = counted - first, scheduler.num_groups, scheduler.num_sources
    owners = scheduler.owners
    need = max(owners.count(g) for g in range(G)) if owners is not None else -(-K // G)
    if missing and rounds < need:
        return (f"{rounds} round(s) cannot train all {K} sources (" + (f"a group owns up to {need} of them"
                if owners is not None else f"{G} a round") + f"): raise train.steps or lower dept.local_steps to "
                f"at least {need} rounds")
    if scheduler.balanced:
        return "raise train.steps or lower dept.local_steps"
    ignores = ", ignoring the sizes and weights" if cfg.dept.sampling != "uniform" else ""
    return (f"set dept.sampling: balanced (every source trained once before any again{ignores}), another "
            f"train.seed or another number of rounds")


def coverage_warning(cfg, scheduler) -> Optional[str]:
    """DEPT with K > G: this run's round plans (as the scheduler draws them with this seed) train
    a source in no round, or give one a share far from its expected share
    (:data:`PLANNED_SHARE_FRACTION`); None when neither."""
    if scheduler is None or scheduler.fixed:
        return None
    names = [s.name for s in cfg.data.sources]
    first, counted, _ = _counted_rounds(cfg, scheduler)
    counts = scheduler.counts(first, counted)
    missing = untrained_sources(cfg, scheduler, counts)
    slots = (counted - first) * scheduler.num_groups
    expected = expected_shares(scheduler, first)
    far = [(n, c / slots, e) for n, c, e in zip(names, counts, expected)
           if n not in missing and abs(c - e * slots) > max(1.0, PLANNED_SHARE_FRACTION * e * slots)]
    if not missing and not far:
        return None
    parts = []
    if missing:
        what = ("its own embeddings keep their initial values" if variant_of(cfg).own_embeddings
                else "no step reads its data")
        parts.append(f"train {', '.join(missing)} in no round ({what})")
    if far:
        parts.append("give " + ", ".join(f"{n} {100 * x:.1f} % (expected {100 * e:.1f} %)" for n, x, e in far)
                     + " of the training")
    return (f"config key 'dept.sampling': {_rounds_phrase(cfg, scheduler, every=not far)} {' and '.join(parts)}; "
            f"{_remedy(cfg, scheduler, len(missing))} (docs/dept_guide.md §3)")


def sampling_warnings(cfg, groups: int, scheduler=None) -> list[str]:
    """The sampling's warnings for the start-up log and ``--check``: :func:`sampling_warning`
    and :func:`coverage_warning` (``scheduler``: the run's round plans; None: built from the data
    files by :func:`plan_scheduler`)."""
    if not variant_of(cfg).rounds or not cfg.data.sources:
        return []
    if scheduler is None:
        scheduler = plan_scheduler(cfg, groups)
    return [w for w in (sampling_warning(cfg, groups, scheduler), coverage_warning(cfg, scheduler)) if w]


def sampling_warning(cfg, groups: int, scheduler=None) -> Optional[str]:
    """Why the configured weighting cannot be the sources' shares, or None. Under DEPT with as
    many sources as groups every source trains every round: ``dept.sampling`` and the weights
    change nothing. Under ``dept.sampling: weights`` with more sources than groups (G > 1):
    drawn without repeats, a source trains at most 1/G of the rounds and a heavy source less
    than its weight (the sampler's long-run shares, :data:`SAMPLING_LINE_ROUNDS` rounds, more
    than :data:`SHARE_TOLERANCE` from a weight); with sources tied to groups, a group's sources
    share 1/G whatever their weights. Says what the shares will be and what gives the weights'
    mix (docs/dept_guide.md §3). ``scheduler``: the run's round plans (None: built here; the
    sizes play no part under ``weights``)."""
    d, sources = cfg.dept, cfg.data.sources
    K, G = len(sources), groups
    if not variant_of(cfg).rounds or d.sampling in ("uniform", "balanced") or K <= 1 or G < 1:
        return None
    weighted = any(s.weight != 1.0 for s in sources)
    asked = f"dept.sampling: {d.sampling}" + (" and data.sources[].weight" if weighted else "")
    if K == G:
        return (f"config key 'dept.sampling': {asked} {'change' if weighted else 'changes'} nothing here: with {K} sources on {G} groups, group g "
                f"trains source g every round, so each source gets 1/{G} ({100.0 / G:.1f} %) of the training; for a "
                f"weighted mix use dept.variant: std (the weights set every batch's mix) or more sources than "
                f"groups (each round then draws {G} of them, a source at most 1/{G} of the rounds) "
                f"(docs/dept_guide.md §3)")
    if d.sampling != "weights" or G == 1:
        return None
    total = sum(s.weight for s in sources)
    p = [s.weight / total for s in sources]
    sched = scheduler or make_scheduler(cfg, G, [1.0] * K, [s.weight for s in sources])
    first, counted, _ = _counted_rounds(cfg, sched)
    if sched.owners is None:
        if max(abs(x - w) for x, w in zip(expected_shares(sched, first), p)) <= SHARE_TOLERANCE:
            return None
        why = (f"each round draws {G} distinct sources, so a source trains at most 1/{G} ({100.0 / G:.1f} %) of the "
               f"rounds and a heavy source less than its weight (weights: {_percent(sources, p)})")
    else:
        totals = [sum(w for w, o in zip(p, sched.owners) if o == g) for g in range(G)]
        if all(abs(t - 1.0 / G) <= 1e-9 for t in totals):
            return None
        why = (f"every group trains one of its own sources each round (data.sources[].group), so each group's "
               f"sources share 1/{G} ({100.0 / G:.1f} %) of the training whatever their weights (theirs add up to "
               f"{', '.join(f'group {g} {100.0 * t:.1f} %' for g, t in enumerate(totals))})")
    return (f"config key 'dept.sampling': the weights cannot be the shares here: {why}; this run's round plans "
            f"give {_percent(sources, sched.shares(first, counted))}; the weights are the exact shares under "
            f"dept.variant: std or with one group (docs/dept_guide.md §3)")


def _percent(sources, values: Sequence[float]) -> str:
    return ", ".join(f"{s.name} {100.0 * x:.1f} %" for s, x in zip(sources, values))
