"""Round plans: fixed K = G, seeded K > G sampling, moves."""
import collections

import pytest

from dept_mega.dept.rounds import RoundScheduler, draw_without_replacement, sampling_weights


def test_fixed_assignment_when_k_equals_g():
    s = RoundScheduler(3, 3, seed=1, sampling="proportional", sizes=[1, 2, 3])
    for r in range(5):
        p = s.plan(r)
        assert p.sources == (0, 1, 2) and p.moves == ()


def test_k_greater_than_g_distinct_seeded_and_replayable():
    a = RoundScheduler(5, 2, seed=7)
    b = RoundScheduler(5, 2, seed=7)
    plans_a = [a.plan(r).sources for r in range(30)]
    # another rank asking for a late round first replays the same history
    assert b.plan(29).sources == plans_a[29]
    assert [b.plan(r).sources for r in range(30)] == plans_a
    for srcs in plans_a:
        assert len(set(srcs)) == 2 and all(0 <= k < 5 for k in srcs)
    c = RoundScheduler(5, 2, seed=8)
    assert [c.plan(r).sources for r in range(30)] != plans_a


def test_moves_follow_last_group_and_sources_stay_when_they_can():
    s = RoundScheduler(4, 2, seed=3)
    last = {}
    nmoves = 0
    for r in range(40):
        p = s.plan(r)
        for k, g in enumerate(p.last_group):
            assert g == last.get(k)
        expected = {(k, last[k], g) for g, k in enumerate(p.sources) if k in last and last[k] != g}
        assert {(m.source, m.src_group, m.dst_group) for m in p.moves} == expected
        for g, k in enumerate(p.sources):
            # a drawn source whose last group is free this round is not moved
            if k in last and last[k] != g:
                other = p.sources[last[k]]
                assert last.get(other) == last[k], "moved although its last group was free"
        nmoves += len(p.moves)
        for g, k in enumerate(p.sources):
            last[k] = g
    assert nmoves > 0  # 4 sources over 2 groups must move some time in 40 rounds


def test_weights_and_sampling_frequencies():
    assert sampling_weights([1, 4], "uniform", 1.0) == [0.5, 0.5]
    assert sampling_weights([1, 4], "proportional", 1.0) == pytest.approx([0.2, 0.8], rel=1e-12)
    assert sampling_weights([1, 4], "temperature", 0.5) == pytest.approx([1 / 3, 2 / 3], rel=1e-12)
    with pytest.raises(ValueError, match="sampling"):
        sampling_weights([1, 4], "zipf", 1.0)
    import random
    rng = random.Random(0)
    counts = collections.Counter(draw_without_replacement([1.0, 3.0], 1, rng)[0] for _ in range(4000))
    assert 0.70 < counts[1] / 4000 < 0.80
    s = RoundScheduler(3, 1, seed=0, sampling="proportional", sizes=[1, 1, 8])
    freq = collections.Counter(s.plan(r).sources[0] for r in range(600))
    assert freq[2] > 3 * freq[0]


def test_bad_layouts_are_errors():
    with pytest.raises(ValueError, match="cannot fill"):
        RoundScheduler(1, 2, seed=0)
    with pytest.raises(ValueError, match="sizes"):
        RoundScheduler(3, 2, seed=0, sizes=[1, 2])


def test_sources_owned_by_groups_stay_there_and_follow_their_weights():
    """``owners`` (data.sources[].group; federation with K > G): every round each group trains
    one of its own sources, drawn ∝ their weights among them; identical for every caller
    (no communication), no source ever moves; without owners the plans are as before."""
    owners = [0, 1, 0, 1, 0]
    sizes = [1, 1, 8, 3, 1]
    a = RoundScheduler(5, 2, seed=5, sampling="proportional", sizes=sizes, owners=owners)
    b = RoundScheduler(5, 2, seed=5, sampling="proportional", sizes=sizes, owners=owners)
    plans = [a.plan(r) for r in range(600)]
    assert b.plan(599).sources == plans[599].sources  # replayed from any round
    assert [b.plan(r).sources for r in range(600)] == [p.sources for p in plans]
    freq = collections.Counter()
    for p in plans:
        assert p.moves == ()
        for g, k in enumerate(p.sources):
            assert owners[k] == g
            freq[k] += 1
    # group 0 owns sizes 1, 8, 1 (weights 0.1, 0.8, 0.1); group 1 owns 1, 3 (0.25, 0.75)
    assert 0.74 < freq[2] / 600 < 0.86 and 0.05 < freq[0] / 600 < 0.15 and 0.05 < freq[4] / 600 < 0.15
    assert 0.68 < freq[3] / 600 < 0.82
    # a single source per group is that group's every round (any order of owners)
    fixed = RoundScheduler(3, 3, seed=0, owners=[2, 0, 1])
    assert all(fixed.plan(r).sources == (1, 2, 0) for r in range(5))
    # no owners: the unrestricted sampler as before (sources move)
    free = RoundScheduler(5, 2, seed=5, sampling="proportional", sizes=sizes)
    assert any(free.plan(r).moves for r in range(50))
    with pytest.raises(ValueError, match="every one of the 2 groups"):
        RoundScheduler(3, 2, seed=0, owners=[0, 0, 0])
    with pytest.raises(ValueError, match="one group in"):
        RoundScheduler(3, 2, seed=0, owners=[0, 1, 2])
