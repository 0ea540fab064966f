"""Federated source groups: one exchange across the group jobs (dept/federation.py's
``_exchange``, the launched exchanges' ``FederatedWork``) — what is committed, redone and
counted when a group fails or stalls, and what a group left out of a round does. torchft's
Manager and the quorum stand in as fakes."""
from __future__ import annotations

import time

import pytest

pytest.importorskip("torchft")


class StandInManager:
    """torchft's Manager as far as a round's exchange uses it: an error reported fails the commit."""
    error = None

    def errored(self):
        return self.error

    def report_error(self, exc):
        self.error = exc

    def should_commit(self):
        return self.error is None


def _stand_in_federation(federation_cls, manager, say, survivors):
    """A Federation at round 3 with three members, without torchft; its quorum call clears the
    manager's error and leaves ``survivors`` groups."""
    fed = object.__new__(federation_cls)
    fed.manager, fed.say, fed.dump, fed._nested, fed._loop = manager, say, None, None, None
    fed.round, fed._commits, fed._healed, fed.members, fed.participants = 3, 0, None, [0, 1, 2], 3
    fed.failed, fed.quorums = {}, 1

    def quorum(**kw):  # the survivors' quorum: the failure cleared
        fed.manager.error, fed.members, fed.participants = None, list(range(survivors)), survivors
        fed.quorums += 1
    fed._quorum = quorum
    return fed


@pytest.mark.parametrize("survivors", [1, 2])
def test_an_exchange_redone_alone_counts_no_bytes(survivors):
    """An exchange that fails (a peer gone) and is redone by the survivors' quorum counts its
    bytes once, at the commit, and none when the survivor is alone: nothing crossed, as a group
    of one skips the sync, so a round's outer bytes stay tools/dept_costs.py's for its groups
    (the walkthrough's two sites: the round a group died in was recorded with groups [0] and a
    full exchange's bytes). torchft's Manager and the quorum stand in as fakes."""
    from types import SimpleNamespace

    from dept_mega.dept.federation import Federation

    fed = _stand_in_federation(Federation, StandInManager(), None, survivors)
    tries = []

    def run():
        tries.append(fed.participants)
        if len(tries) == 1:
            raise RuntimeError("Connection closed by peer")
    counted = []
    comm = SimpleNamespace(count=lambda category, nbytes: counted.append((category, nbytes)))
    fed._exchange(run, lambda: None, comm, [("outer_body", 1000)])
    assert tries == [3, survivors] and fed._commits == 1 and fed.round_groups == list(range(survivors))
    assert counted == ([("outer_body", 1000)] if survivors > 1 else []), counted
    # the failed try (three groups) launched its bytes: apart, as an upper bound of what crossed
    assert fed.take_failed() == {"outer_body": 1000} and fed.take_failed() == {}


@pytest.mark.parametrize("survivors", [1, 2])
def test_a_launched_exchange_redone_alone_counts_no_bytes_and_says_how_long_it_waited(survivors):
    """The launched exchange (FlatSync's path, FederatedWork): a peer stalls, the wait on its
    all-reduce fails after the collective timeout (here 0.3 s) and the exchange is redone with
    the survivors. Its bytes are counted at the commit by the committed quorum, none when the
    survivor is alone (the audit's round recorded with groups [0] and a full exchange's 394496
    bytes, counted at launch), and the failure's line says how long the wait took (it said
    0.0 s while the round's record said 60 s). torchft's Manager and the quorum are fakes."""
    import re
    from types import SimpleNamespace

    import torch

    from dept_mega.dept.federation import Federation

    class Work:
        def __init__(self, fails):
            self.fails = fails

        def wait(self):
            if self.fails:
                time.sleep(0.3)
                raise RuntimeError("Timed out waiting 300ms for send operation to complete")

    class Manager(StandInManager):
        launched = 0

        def allreduce(self, t, reduce_op):
            self.launched += 1
            return Work(self.launched == 1)

    said = []
    fed = _stand_in_federation(Federation, Manager(), said.append, survivors)
    fed._launching = fed._just_healed = False
    counted = []
    comm = SimpleNamespace(count=lambda category, nbytes: counted.append((category, nbytes)))
    work = fed.all_reduce_async(torch.zeros(250), comm, "outer_body")
    assert counted == []  # nothing at launch
    assert work.wait() and fed.manager.launched == 2 and fed._commits == 1
    assert fed.round_groups == list(range(survivors)) and work.groups == survivors
    assert counted == ([("outer_body", 1000)] if survivors > 1 else []), counted
    assert fed.take_failed() == {"outer_body": 1000}  # the launched try that failed
    failed = [ln for ln in said if "the exchange failed after" in ln]
    assert len(failed) == 1 and float(re.search(r"failed after ([0-9.]+) s", failed[0]).group(1)) >= 0.3, said


def test_the_bytes_of_failed_exchange_tries_are_counted_apart():
    """An atomic exchange (TRIM's: several collectives) whose second collective fails in the first
    try: both collectives' bytes go to failed_bytes (the failing one was launched too), the
    committed redo counts them once in comm; a try that could not launch (the Manager already
    errored) and a try by a group alone add nothing; the round's outer record sums them over the
    job's ranks (failed_bytes, every category) and its log line says so. Fakes for torchft."""
    from types import SimpleNamespace

    import torch

    from dept_mega.dept.driver import DeptHooks
    from dept_mega.dept.federation import Federation
    from dept_mega.metrics import outer_line

    class Work:
        def wait(self):
            pass

    class Manager(StandInManager):
        calls = 0

        def allreduce(self, t, reduce_op):
            self.calls += 1
            if self.calls == 2:
                raise RuntimeError("Connection closed by peer")
            return Work()

    fed = _stand_in_federation(Federation, Manager(), None, 2)
    counted = []
    comm = SimpleNamespace(count=lambda category, nbytes: counted.append((category, nbytes)))

    def fn():
        fed.all_reduce_sum(torch.zeros(10), comm, "outer_body")
        fed.all_reduce_sum(torch.zeros(5), comm, "outer_embedding")
        return "done"
    assert fed.atomic(fn, comm) == "done" and fed.manager.calls == 4
    assert counted == [("outer_body", 40), ("outer_embedding", 20)], counted
    assert fed.failed == {"outer_body": 40, "outer_embedding": 20}
    fed.manager.error = RuntimeError("reported before")  # this try launches nothing; the redo is alone
    fed._exchange(lambda: None, lambda: None, comm, [("outer_body", 7)])
    fed.participants, fed.manager.error = 1, RuntimeError("failed alone")
    fed._quorum = lambda **kw: setattr(fed.manager, "error", None)
    fed._exchange(lambda: None, lambda: None, comm, [("outer_body", 7)], tried=0.0)
    assert fed.failed == {"outer_body": 40, "outer_embedding": 20}
    hooks = object.__new__(DeptHooks)
    hooks.device, hooks.installed, hooks.federation = torch.device("cpu"), None, fed
    hooks.trainer = SimpleNamespace(step=8)
    hooks.schedule = SimpleNamespace(round_end=lambda step: None, take_times=lambda: (0.0, 0.0))
    hooks.strategy = SimpleNamespace(sync=lambda installed: None)
    zero = {c: 0 for c in ("tp", "pp", "dp", "outer_body", "outer_embedding", "source_move")}
    hooks.pg = SimpleNamespace(comm=SimpleNamespace(snapshot=lambda: dict(zero)))
    hooks._mark, hooks._excluded, hooks.in_round = dict(zero), dict(zero), True
    fed.round_done = lambda h: [0, 1]
    rec = hooks.round_end(None, 3)
    assert rec["failed_bytes"] == dict(zero, outer_body=40, outer_embedding=20), rec
    assert fed.failed == {} and rec["groups"] == [0, 1]
    line = outer_line(dict(rec, round=3, step=8))
    assert line.endswith("| groups 0, 1 | failed tries 60 B (outer_body 40 B, outer_embedding 20 B)"), line


@pytest.mark.parametrize("fails_at", ["launch", "wait"])
def test_an_exchange_launched_before_another_ones_redo_is_done_again_on_the_new_quorum(fails_at):
    """Two exchanges launched together on one quorum (the overlapped round end: the body's and
    GLOB's tables'); a group dies, so the first fails — at its launch (torchft reports the error
    and returns a dummy work: the second is then not launched at all) or at its wait (the second
    was launched on the old quorum) — and is redone on the survivors' new quorum. The second must
    then be done again on that quorum too: it was committed with nothing exchanged (this group's
    own Δ taken for the sum, divided by the old quorum's three groups), or with the old quorum's
    sum and divisor (a review's finding). Each group's values stand in equal: a sum is the value
    times the groups summed."""
    from types import SimpleNamespace

    import torch

    from dept_mega.dept.federation import Federation

    class Work:
        def __init__(self, fails=False):
            self.fails = fails

        def wait(self):
            if self.fails:
                raise RuntimeError("Connection closed by peer")

    class Manager(StandInManager):
        calls = 0

        def allreduce(self, t, reduce_op):
            self.calls += 1
            if self.calls == 1 and fails_at == "launch":
                self.report_error(RuntimeError("Connection closed by peer"))  # torchft: a dummy work
                return Work()
            t.mul_(fed.participants)  # the groups' sum
            return Work(fails=self.calls == 1)

    fed = _stand_in_federation(Federation, Manager(), None, 2)
    fed._launching = fed._just_healed = False
    comm = SimpleNamespace(count=lambda category, nbytes: None)
    body, tables = torch.ones(4), torch.ones(4)
    works = [fed.all_reduce_async(body, comm, "outer_body"), fed.all_reduce_async(tables, comm, "outer_embedding")]
    assert all(w.wait() for w in works)
    assert fed.manager.calls == (3 if fails_at == "launch" else 4) and fed._commits == 2
    assert [w.groups for w in works] == [2, 2] and fed.quorums == 2
    assert torch.equal(body, torch.full((4,), 2.0)) and torch.equal(tables, torch.full((4,), 2.0)), (body, tables)
    # the tries launched on the old quorum with other groups: their bytes apart, as an upper bound
    assert fed.take_failed() == ({"outer_body": 16} if fails_at == "launch" else {"outer_body": 16,
                                                                                   "outer_embedding": 16})


@pytest.mark.parametrize("delay", [0, 1])
def test_a_group_left_out_at_a_fragments_exchange_goes_to_the_next_round_start(delay):
    """A fragment's exchange inside a round (``dept.outer_fragments`` > 1: launched blocking in
    ``before_step``, delay 0, or overlapped and applied τ steps later in ``after_step``) whose
    redo quorum finds the round completed without this group (LeftOut: healed from a peer):
    ``DeptHooks`` ends the round there for this group — nothing stays pending, torchft's commit
    count of the round is dropped — and tells the loop to go to the next round start. LeftOut
    escaped from before_step / after_step and ended the job (only round_end caught it: a
    review's finding)."""
    from types import SimpleNamespace

    import torch

    from dept_mega.dept.driver import DeptHooks
    from dept_mega.dept.federation import Federation
    from dept_mega.dept.streaming import OuterSchedule, SyncUnit

    class FailingWork:
        def wait(self):
            raise RuntimeError("Timed out waiting for recv")

        def is_completed(self):
            return True

    class Manager(StandInManager):
        def allreduce(self, t, reduce_op):
            return FailingWork()

    fed = _stand_in_federation(Federation, Manager(), None, 2)
    fed._launching = fed._just_healed = False

    def quorum(**kw):  # the redo quorum: the others completed the round; this group heals
        fed.manager.error, fed.members, fed.participants, fed._healed = None, [0, 1, 2], 3, {"round": 5}
    fed._quorum, fed._check_healed, fed._apply, fed.group = quorum, lambda sd: None, lambda sd: None, 2
    comm = SimpleNamespace(count=lambda c, n: None)

    class Sync:  # FlatSync's use of the exchange's handle
        def launch(self, **kw):
            return SimpleNamespace(work=fed.all_reduce_async(torch.ones(4), comm, "outer_body"))

        def finish(self, pending, **kw):
            pending.work.wait()

        def sync(self, part=None):
            self.finish(self.launch())

    hooks = object.__new__(DeptHooks)
    hooks.schedule = OuterSchedule([SyncUnit(Sync(), 2, "body0"), SyncUnit(Sync(), 4, "body1")], local_steps=4,
                                   delay=delay, total_steps=100)
    hooks.federation, hooks.trainer, hooks.in_round = fed, SimpleNamespace(step=2), True
    fed._commits = 1  # an exchange of this round committed before
    left = hooks.before_step(None)  # fragment 0 launched after step 2 (blocking with delay 0)
    if delay:
        assert left is False and len(hooks.schedule.pending) == 1
        hooks.trainer.step = 3
        left = hooks.after_step(None)  # applied at 2 + delay
    assert left is True and hooks.schedule.idle and not hooks.in_round
    assert fed._left_out == {"round": 5} and fed._commits == 0


@pytest.mark.parametrize("where", ["before_step", "after_step"])
def test_the_loop_goes_to_the_next_round_start_when_a_hook_ends_the_round(where):
    """``before_step`` / ``after_step`` returning True (a group left out of a round the others
    completed) after step 3 of round 1 (steps 3 and 4): the loop calls ``round_start`` next —
    step 4 is not trained, and the round left has no ``round_end`` — and the round start's heal
    moves the step on (as ``Federation.join_round`` does, to the peers' round 3)."""
    import io

    import torch

    from dept_mega.loop import StdHooks, TrainLoop
    from dept_mega.metrics import MetricsWriter
    from dept_mega.parallel.groups import build_groups
    from dept_mega.trainer import Trainer
    from tests.dept_utils import SyntheticSource, tiny_config

    events = []

    class Hooks(StdHooks):
        healed = False

        def round_start(self, loop, r):
            if events and events[-1][0] == where:  # healed: the peers are at round 3
                loop.trainer.step, self.healed = 6, True
            events.append(("round_start", loop.trainer.step))
            return super().round_start(loop, r)

        def before_step(self, loop):
            events.append(("before_step", loop.trainer.step))
            return where == "before_step" and loop.trainer.step == 3 and not self.healed

        def after_step(self, loop):
            events.append(("after_step", loop.trainer.step))
            return where == "after_step" and loop.trainer.step == 3 and not self.healed

        def round_end(self, loop, r):
            events.append(("round_end", loop.trainer.step))
            return super().round_end(loop, r)

    cfg = tiny_config({"dept": {"variant": "std", "local_steps": 2},
                       "train": {"steps": 8, "eval_interval": 0, "log_interval": 100}})
    pg = build_groups(1, 1, 1)
    trainer = Trainer(cfg, pg, torch.device("cpu"), vocab_size=cfg.model.vocab_size)
    loop = TrainLoop(cfg, pg, trainer, Hooks(), MetricsWriter(None, enabled=False, stream=io.StringIO()),
                     lambda n: SyntheticSource(cfg, 3, torch.arange(cfg.model.vocab_size)))
    loop.run()
    i = events.index((where, 3))
    assert events[i + 1] == ("round_start", 6), events  # straight to the next round start: healed to step 6
    assert ("round_end", 4) not in events and trainer.step == 8, events
    assert [s for k, s in events if k == "after_step"] == [1, 2, 3, 7, 8], events  # (step 4: not trained)


def test_a_round_left_out_at_its_end_leaves_its_bytes_to_the_next_record():
    """A round whose end found it completed without this group has no ``outer`` record; what the
    job sent in it (its inner steps' traffic, an exchange committed before the one it was left
    out of) is in the next round's record, not dropped (a review's finding)."""
    from types import SimpleNamespace

    import torch

    from dept_mega.dept.driver import DeptHooks
    from dept_mega.dept.federation import LeftOut

    counters = {c: 0 for c in ("tp", "pp", "dp", "outer_body", "outer_embedding", "source_move")}
    left = [True]

    def round_end(step):
        counters["outer_body"] += 100  # the body's exchange, committed
        if left:
            left.pop()
            raise LeftOut(3)  # the tables' exchange: the round was completed without this group
    fed = SimpleNamespace(left_round=lambda: None, round_done=lambda h: [0, 1], take_failed=lambda: {})
    hooks = object.__new__(DeptHooks)
    hooks.device, hooks.installed, hooks.federation = torch.device("cpu"), None, fed
    hooks.trainer = SimpleNamespace(step=8)
    hooks.schedule = SimpleNamespace(round_end=round_end, take_times=lambda: (0.0, 0.0), drop=lambda: None)
    hooks.strategy = SimpleNamespace(sync=lambda installed: None)
    hooks.pg = SimpleNamespace(comm=SimpleNamespace(snapshot=lambda: dict(counters)))
    hooks._mark, hooks._excluded, hooks.in_round = dict(counters), {c: 0 for c in counters}, True
    counters["dp"] += 7  # the left round's inner steps
    assert hooks.round_end(None, 3) is None and not hooks.in_round
    counters["dp"] += 5
    rec = hooks.round_end(None, 5)
    assert rec["bytes"]["dp"] == 12 and rec["bytes"]["outer_body"] == 200, rec
