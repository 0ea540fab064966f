"""Pipeline schedules: the action lists of 1F1B and interleaved 1F1B are complete, and the
point-to-point programs the runner executes are deadlock free under rendezvous (unbuffered)
sends, feed every computation its inputs, and match send/receive orders on every stream."""
from __future__ import annotations

import pytest

from dept_mega.parallel.pipeline import (P2P, Action, Batch, Message, ScheduleError, action_recvs,
                                         action_sends, check_microbatches, eval_program, schedule_actions,
                                         simulate, simulate_programs, train_program)


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
        simulate(M, P, V, forward_only=True)


def test_programs_deadlock_free_on_a_grid():
    """Every (M, P, V) with P <= 6, V <= 4, M <= 16 that the config allows."""
    checked = 0
    for P in range(2, 7):
        for V in range(1, 5):
            for M in range(1, 17):
                if V > 1 and M % P:
                    continue
                simulate(M, P, V)
                simulate(M, P, V, forward_only=True)
                checked += 1
    assert checked == 146


def _unbatched_programs(M, P, V):
    """The scheme used before batched p2p: after each computation an ``isend`` per output
    (not waited), before each computation a blocking ``recv``; activations and gradients on
    two separate groups."""
    progs = []
    for p in range(P):
        items = []
        for a in schedule_actions(M, P, V, p):
            ch = "fwd" if a.kind == "F" else "bwd"
            items += [Batch((r,), wait=True, channel=ch) for r in action_recvs(a, P, V, p)]
            items.append(a)
            items += [Batch((s,), wait=False, channel=ch) for s in action_sends(a, P, V, p)]
        progs.append(items)
    return progs


@pytest.mark.parametrize("M,P,V", [(2, 2, 2), (4, 2, 2), (4, 2, 3)])
def test_unbatched_interleaved_pp2_deadlocks_without_buffering(M, P, V):
    """The NCCL deadlock of the old scheme: with P = 2 both ranks send to each other on one
    stream before either receives. It only worked while sends were buffered (gloo, small
    NCCL messages)."""
    progs = _unbatched_programs(M, P, V)
    simulate_programs(progs, P, V, buffered=True)
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate_programs(progs, P, V)


@pytest.mark.parametrize("M,P,V", [(4, 2, 1), (6, 3, 1), (6, 3, 2), (8, 4, 2)])
def test_unbatched_scheme_was_fine_elsewhere(M, P, V):
    # with P > 2 (or V = 1) no stream carries both directions
    simulate_programs(_unbatched_programs(M, P, V), P, V)


def test_program_batches_combine_sends_and_receives():
    """Interleaved steady state: one batch sends the forward's activation and the backward's
    gradient and receives both inputs of the next pair (Megatron's combined call)."""
    prog = train_program(4, 2, 2, 0)
    batches = [it for it in prog if isinstance(it, Batch)]
    kinds = {tuple(sorted((op.send, op.msg.kind) for op in b.ops)) for b in batches}
    assert ((False, "act"), (False, "grad"), (True, "act"), (True, "grad")) in kinds
    assert all(b.wait for b in batches)
    # plain 1F1B: a forward's send goes with the next backward's receive
    prog1 = train_program(4, 2, 1, 0)
    assert Batch((P2P(True, 1, Message("act", 1, 1)), P2P(False, 1, Message("grad", 0, 0)))) in prog1
    # evaluation: activations only
    assert all(op.msg.kind == "act" for it in eval_program(4, 2, 2, 1) if isinstance(it, Batch) for op in it.ops)


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


def _two_stage(rank0_first_recv_grad: bool):
    act, grad = Message("act", 0, 1), Message("grad", 0, 0)
    r0 = [Action("F", 0, 0), Batch((P2P(True, 1, act),)), Batch((P2P(False, 1, grad),)), Action("B", 0, 0)]
    if rank0_first_recv_grad:  # waits for the gradient before sending the activation
        r0 = [Batch((P2P(False, 1, grad),)), Action("F", 0, 0), Batch((P2P(True, 1, act),)), Action("B", 0, 0)]
    r1 = [Batch((P2P(False, 0, act),)), Action("F", 0, 0), Action("B", 0, 0), Batch((P2P(True, 0, grad),))]
    return [r0, r1]


def test_simulate_detects_deadlock_and_accepts_the_right_order():
    simulate_programs(_two_stage(False), 2, 1)
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate_programs(_two_stage(True), 2, 1)


def test_simulate_detects_wrong_matching_and_missing_inputs():
    a0, a1 = Message("act", 0, 1), Message("act", 1, 1)
    sends = [Action("F", 0, 0), Action("F", 1, 0), Batch((P2P(True, 1, a0), P2P(True, 1, a1)))]
    swapped = [Batch((P2P(False, 0, a1), P2P(False, 0, a0))), Action("F", 0, 0), Action("F", 1, 0)]
    with pytest.raises(ScheduleError, match="orders differ"):
        simulate_programs([sends, swapped], 2, 1)
    early = [Action("F", 0, 0), Batch((P2P(False, 0, a0), P2P(False, 0, a1))), Action("F", 1, 0)]
    simulate_programs([sends, [Batch((P2P(False, 0, a0), P2P(False, 0, a1))), Action("F", 0, 0),
                               Action("F", 1, 0)]], 2, 1)
    with pytest.raises(ScheduleError, match="before its input arrived"):
        simulate_programs([sends, early], 2, 1)
    with pytest.raises(ScheduleError, match="before computing it"):
        simulate_programs([[Batch((P2P(True, 1, a0),)), Action("F", 0, 0)],
                           [Batch((P2P(False, 0, a0),)), Action("F", 0, 0)]], 2, 1)


def test_check_microbatches():
    check_microbatches(4, 2, 2)
    with pytest.raises(ScheduleError):
        check_microbatches(0, 1, 1)
    with pytest.raises(ScheduleError):
        check_microbatches(3, 2, 2)
