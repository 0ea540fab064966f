"""dept.sampling: balanced (dept_mega.dept.rounds): each round takes the sources trained the
fewest rounds so far, ties in a seeded random order: every source once before any again,
the same plans for every caller and seed, per group when sources belong to groups."""
from __future__ import annotations

import pytest

from dept_mega.config import ConfigError, config_from_dict
from dept_mega.dept.rounds import RoundScheduler


def _counts_after(plans, K):
    counts, out = [0] * K, []
    for p in plans:
        for k in p.sources:
            counts[k] += 1
        out.append(list(counts))
    return out


@pytest.mark.parametrize("K,G", [(5, 2), (7, 3), (4, 1), (6, 4)])
def test_every_source_once_before_any_again(K, G):
    s = RoundScheduler(K, G, seed=11, sampling="balanced")
    plans = [s.plan(r) for r in range(40)]
    for p in plans:
        assert len(set(p.sources)) == G
    for counts in _counts_after(plans, K):
        assert max(counts) - min(counts) <= 1, counts  # a source again only once all have had as many
    # every ceil(K / G) rounds from the start cover every source
    first = {k for p in plans[: -(-K // G)] for k in p.sources}
    assert first == set(range(K))


def test_the_order_is_seeded_and_replayable():
    a = RoundScheduler(5, 2, seed=3, sampling="balanced")
    b = RoundScheduler(5, 2, seed=3, sampling="balanced")
    plans = [a.plan(r).sources for r in range(30)]
    assert b.plan(29).sources == plans[29]  # another rank asking for a late round first replays the same
    assert [b.plan(r).sources for r in range(30)] == plans
    others = [[RoundScheduler(5, 2, seed=seed, sampling="balanced").plan(r).sources for r in range(30)]
              for seed in (4, 5, 6)]
    assert all(o != plans for o in others)  # shuffled: the seed decides the order
    # not one fixed cycle: the cycles' orders differ (round 0's pair is not always the same as round 5's)
    assert len({tuple(sorted(plans[r])) for r in range(0, 30, 5)}) > 1


def test_sources_tied_to_groups_cycle_within_their_group():
    owners = [0, 1, 0, 1, 0]  # group 0: sources 0, 2, 4; group 1: 1, 3
    s = RoundScheduler(5, 2, seed=9, sampling="balanced", owners=owners)
    plans = [s.plan(r) for r in range(30)]
    for p in plans:
        assert p.moves == () and all(owners[k] == g for g, k in enumerate(p.sources))
    for counts in _counts_after(plans, 5):
        assert max(counts[k] for k in (0, 2, 4)) - min(counts[k] for k in (0, 2, 4)) <= 1
        assert abs(counts[1] - counts[3]) <= 1
    assert {p.sources[0] for p in plans[:3]} == {0, 2, 4} and {p.sources[1] for p in plans[:2]} == {1, 3}


def test_a_rebased_schedule_trains_the_least_trained_first():
    """After a change of the number of groups the schedule continues from the history it is
    given: the sources with fewer rounds so far come first."""
    s = RoundScheduler(4, 2, seed=1, sampling="balanced")
    s.rebase(10, [0, 1, None, None], [3, 3, 2, 2])
    assert set(s.plan(10).sources) == {2, 3}
    assert s.plan(10).rounds_before == (3, 3, 2, 2)


def test_sizes_and_weights_play_no_part():
    a = RoundScheduler(4, 2, seed=2, sampling="balanced", sizes=[1, 1000, 3, 9])
    b = RoundScheduler(4, 2, seed=2, sampling="balanced")
    assert [a.plan(r).sources for r in range(12)] == [b.plan(r).sources for r in range(12)]


def _cfg(**dept):
    return {"dept": dept, "data": {"tokenizer": "t.model",
                                   "sources": [{"name": n, "prefix": f"/x/{n}"} for n in ("en", "fr", "code")]}}


def test_the_config_accepts_balanced_and_refuses_what_it_would_ignore():
    config_from_dict(_cfg(variant="glob", sampling="balanced"))
    with pytest.raises(ConfigError, match=r"'data.sources\[1\].weight': 2.0 has no effect under dept.sampling=balanced"):
        config_from_dict(_cfg(variant="glob", sampling="balanced"), ["data.sources.1.weight=2"])
    with pytest.raises(ConfigError, match="'dept.sampling': balanced orders DEPT's rounds"):
        config_from_dict(_cfg(variant="std", sampling="balanced"))
