"""Pipeline schedules: the action lists of 1F1B and interleaved 1F1B are complete, deadlock
free under blocking receives, and send/receive orders match on every stream."""
from __future__ import annotations

import pytest

from dept_mega.parallel.pipeline import (Action, ScheduleError, check_microbatches, schedule_actions,
                                         simulate)


@pytest.mark.parametrize("P,V", [(1, 1), (2, 1), (3, 1), (4, 1), (2, 2), (2, 3), (3, 2), (4, 2)])
def test_schedules_complete_and_deadlock_free(P, V):
    for M in range(1, 13):
        if V > 1 and M % P:
            with pytest.raises(ScheduleError, match="multiple of parallel.pipeline"):
                schedule_actions(M, P, V, 0)
            continue
        for p in range(P):
            acts = schedule_actions(M, P, V, p)
            fwd = [(a.microbatch, a.chunk) for a in acts if a.kind == "F"]
            bwd = [(a.microbatch, a.chunk) for a in acts if a.kind == "B"]
            want = {(m, c) for m in range(M) for c in range(V)}
            assert set(fwd) == want and len(fwd) == M * V
            assert set(bwd) == want and len(bwd) == M * V
            # a backward never precedes its forward on the same rank
            seen = set()
            for a in acts:
                if a.kind == "F":
                    seen.add((a.microbatch, a.chunk))
                else:
                    assert (a.microbatch, a.chunk) in seen
        simulate(M, P, V)


def test_1f1b_bounds_activation_memory():
    """In 1F1B, rank p holds at most P - p micro-batches' activations at a time (not M)."""
    P, M = 4, 12
    for p in range(P):
        live = peak = 0
        for a in schedule_actions(M, P, 1, p):
            live += 1 if a.kind == "F" else -1
            peak = max(peak, live)
        assert peak == min(P - p, M)


def test_last_stage_alternates_from_the_start():
    acts = schedule_actions(4, 2, 1, 1)
    assert acts[:4] == [Action("F", 0, 0), Action("B", 0, 0), Action("F", 1, 0), Action("B", 1, 0)]


def test_simulate_detects_deadlock(monkeypatch):
    import dept_mega.parallel.pipeline as pl

    def backwards_first(M, P, V, p):  # a rank that waits for gradients before any forward
        return [Action("B", m, 0) for m in range(M)] + [Action("F", m, 0) for m in range(M)]

    monkeypatch.setattr(pl, "schedule_actions", backwards_first)
    with pytest.raises(ScheduleError, match="deadlock"):
        pl.simulate(2, 2, 1)


def test_check_microbatches():
    check_microbatches(4, 2, 2)
    with pytest.raises(ScheduleError):
        check_microbatches(0, 1, 1)
    with pytest.raises(ScheduleError):
        check_microbatches(3, 2, 2)
