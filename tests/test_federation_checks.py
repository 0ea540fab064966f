"""Federated source groups: what a group job refuses (one error naming the key, before any
training) and what it says in its log (dept_mega/dept/federation_config.py, federation_log.py)."""
from __future__ import annotations

import os
import time

import pytest

pytest.importorskip("torchft")

from tests.federation_utils import (SOURCES, error_line, federation, finish_all, write_config)  # noqa: E402
from tests.mp_utils import free_port  # noqa: E402


def test_bad_input(tmp_path, monkeypatch):
    """A group index out of range, an unreachable lighthouse, two jobs claiming one group, a
    config that differs between groups: one error naming the key, before any training. The
    first two in process, in the functions a launch's ``build_session`` calls before it
    contacts any peer (``federation_config.resolve``, ``Federation``'s constructor: a launch
    turns their ConfigError into exit status 2 and its line, as for any config error); the
    others, found at the first quorum, as group jobs: exit status 2 and the line (two-group
    federations: nothing waits for a third group at the fresh start)."""
    from types import SimpleNamespace

    import torch

    from dept_mega.config import ConfigError, load_config
    from dept_mega.dept.federation import Federation
    from dept_mega.dept.federation_config import resolve
    cfg = write_config(str(tmp_path))
    dead = f"127.0.0.1:{free_port()}"
    fed = [f"federation.lighthouse={dead}", f"federation.groups={SOURCES}"]
    with pytest.raises(ConfigError, match=r"'federation\.group': 3 is not a group index"):
        resolve(load_config(cfg, [*fed, "federation.group=3"]))
    monkeypatch.setenv("RUST_LOG", "warn")  # (Federation sets it when unset)
    job = load_config(cfg, [*fed, "federation.group=0"])
    with pytest.raises(ConfigError, match=r"'federation\.lighthouse': cannot reach 127\.0\.0\.1:"):
        Federation(job, SimpleNamespace(rank=0, group_size=1), torch.device("cpu"), *resolve(job))
    # (timeout_s bounds the quorum's process-group set-up too: 3 s failed it on a loaded machine, and
    # that job then waited for a quorum the other, gone with the error, never joined)
    two = dict(groups=2, min_groups=2, timeout_s=15)
    with federation(2) as dup, federation(2) as diff:
        procs = {
            "dup": [dup.launch(cfg, str(tmp_path / f"dup{i}"), 1, **two) for i in range(2)],
            "diff": [diff.launch(cfg, str(tmp_path / "diff0"), 0, **two),
                     diff.launch(cfg, str(tmp_path / "diff1"), 1, "dept.outer_optimizer.lr=0.5", **two)],
        }
        outs = {k: finish_all(ps) for k, ps in procs.items()}
    want = {"dup": "'federation.group': group 1 is claimed by two jobs; give each job its own index in [0, 2)",
            "diff": "'dept.outer_optimizer.lr' differs between the group jobs: group 0 has 1.0, group 1 has 0.5"}
    for case, ps in procs.items():
        for p, out in zip(ps, outs[case]):
            assert p.returncode == 2, (case, out[-3000:])
            assert want[case] in error_line(out), (case, error_line(out))  # (diff: both values, both jobs)
            assert "step 1/" not in out, case  # before any training


@pytest.mark.parametrize("override,want", [
    ("dept.variant=std", "'dept.variant': std"),
    ("dept.outer_overlap=true dept.outer_delay=4 dept.outer_fragments=2 dept.local_steps=6",
     "'dept.outer_delay': 4 lands fragment 0's overlapped sync in the next round"),
    ("federation.groups=4", "'data.sources': 3 sources for federation.groups = 4"),
    ("federation.min_groups=4", "'federation.min_groups': 4 is not in [1, 3]"),
    ("federation.quorum_give_up_s=0", "'federation.quorum_give_up_s': must be > 0 or null"),
])
def test_refused_in_federation_mode(tmp_path, override, want):
    """What federation mode does not support is one config error naming the key (in process:
    the check runs before the lighthouse is contacted)."""
    from dept_mega.config import ConfigError, load_config
    from dept_mega.dept.federation_config import resolve
    cfg = load_config(write_config(str(tmp_path)), ["federation.lighthouse=127.0.0.1:1", "federation.group=0",
                                              f"federation.groups={SOURCES}", *override.split()])
    with pytest.raises(ConfigError, match=want.replace("[", r"\[").replace("]", r"\]")):
        resolve(cfg)
    # the quantised, fragmented and overlapped outer syncs are accepted (same math: test_three_group_jobs_...)
    ok = load_config(write_config(str(tmp_path)), ["federation.lighthouse=127.0.0.1:1", "federation.group=0",
                                             f"federation.groups={SOURCES}", "dept.outer_comm_dtype=int4",
                                             "dept.outer_fragments=2", "dept.outer_overlap=true",
                                             "dept.outer_delay=1"])
    assert resolve(ok) == (0, "127.0.0.1", 1)
    # the address as the lighthouse prints it (a URL) is taken too; a bare host is refused by name
    url = load_config(write_config(str(tmp_path)), ["federation.lighthouse=http://127.0.0.1:1/", "federation.group=0",
                                              f"federation.groups={SOURCES}"])
    assert resolve(url) == (0, "127.0.0.1", 1)
    bare = load_config(write_config(str(tmp_path)), ["federation.lighthouse=127.0.0.1", "federation.group=0",
                                               f"federation.groups={SOURCES}"])
    with pytest.raises(ConfigError, match="'federation.lighthouse': '127.0.0.1' is not host:port"):
        resolve(bare)


def test_what_a_group_job_logs(monkeypatch):
    """The job's own lines (dept/federation_log.py): a membership change, a failed exchange's
    error in one line, the lighthouse's own status in the "still waiting" line, and torchft's
    noise kept out."""
    import logging

    from dept_mega.dept.federation_log import (first_line, healed_line, lighthouse_status, membership_line,
                                               quiet_torchft, quorum_wait_line)
    assert membership_line(0, [0, 1, 2], []) == "federation: round 0: groups [0, 1, 2]"
    assert healed_line(0, 3, 2, 6, [0, 1]) == "federation: group 0 healed from a live peer at round 3 (step 2 -> 6); " \
        "groups [0, 1]"
    # a job relaunched after the others, its checkpoint newer than their round: the loss is said
    back = healed_line(1, 3, 10, 6, [0, 1])
    assert back.startswith("federation: group 1 healed from a live peer at round 3 (step 10 -> 6: behind this "
                           "job's own checkpoint, whose last 4 steps are dropped;") and back.endswith("); groups [0, 1]")
    assert membership_line(14, [0, 1], [0, 1, 2]) == "federation: round 14: groups [0, 1] (left: 2)"
    assert (membership_line(27, [0, 1, 2, 3], [0, 1], healed=True)
            == "federation: round 27: groups [0, 1, 2, 3] (joined: 2, 3; this job healed from a live peer)")
    assert first_line(RuntimeError("\n  peer closed [127.0.0.1]:5\nTraceback (most recent call last):\n  x")) \
        == "peer closed [127.0.0.1]:5"
    with federation(min_groups=2) as jobs:
        addr = jobs.lh.addr
        assert "participants healthy" in lighthouse_status(addr), lighthouse_status(addr)
        assert f"waiting 31 s for a quorum of at least 2 group(s); the lighthouse {addr} says: New quorum not " \
            "ready" in quorum_wait_line(3, 31, 2, addr)
    dead = f"127.0.0.1:{free_port()}"
    assert lighthouse_status(dead) is None
    assert f"the lighthouse {dead} does not answer (if it died: restart it, then the group jobs" \
        in quorum_wait_line(3, 31, 2, dead)
    monkeypatch.setenv("RUST_LOG", "-")  # (restored to what it was after the test)
    monkeypatch.delenv("RUST_LOG")
    quiet_torchft()
    assert os.environ["RUST_LOG"] == "warn"
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("torchft.manager")
    logger.addHandler(handler)
    try:
        logger.warning("Unable to reset NCCL flight recorder recording so traces will be incorrect.")
        lines = ["[dept_group_0] got exception waiting for work Connection closed by peer",
                 "[dept_group_0] got exception in pg configure: The client socket has timed out",
                 "[dept_group_0] got exception in recovery: Connection refused"]
        for line in lines:
            try:
                raise RuntimeError(line)
            except RuntimeError:
                logger.exception(line)
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == lines and all(r.exc_info is None for r in records)


def test_a_long_quorum_wait_says_so_every_period_on_rank_0(monkeypatch):
    """The "still waiting" line comes from the polls of dept/federation_wait.preemptible: every
    WAIT_EVERY_S (30 s) while torchft's quorum blocks, with or without a preemption handler;
    nothing when it returns sooner; the quorum's result and error come through. Through
    Federation._quorum: the line is quorum_wait_line's, asked for on rank 0 only (``say`` None)."""
    from types import SimpleNamespace

    import torch

    from dept_mega.dept import federation as fed
    from dept_mega.dept.federation_wait import preemptible
    assert fed.WAIT_EVERY_S == 30
    cpu = torch.device("cpu")
    for preemption in (None, SimpleNamespace(signal=None)):  # (one process: the agreement is local)
        said = []
        assert preemptible(lambda: time.sleep(0.3) or 5, preemption, cpu, "w", True, said.append, 0.01, 0.05) == 5
        assert len(said) >= 3 and said == sorted(said) and said[0] >= 0.05, said
        said.clear()
        assert preemptible(lambda: 6, preemption, cpu, "w", True, said.append, every=5) == 6 and said == []
        with pytest.raises(KeyError, match="x"):
            preemptible(lambda: {}["x"], preemption, cpu, "w", True, said.append)
    monkeypatch.setattr(fed, "WAIT_EVERY_S", 0.05)
    asked = []
    monkeypatch.setattr(fed, "quorum_wait_line", lambda *a: asked.append(a) or f"waiting {a[1]:.2f} s")
    for said in ([], None):  # rank 0, another rank
        job = object.__new__(fed.Federation)
        job.round, job.least, job.where, job._loop, job.device = 3, 2, "127.0.0.1:1", None, cpu
        job._healed, job._rounds, job.quorums = None, 4, 0
        job.cfg = SimpleNamespace(federation=SimpleNamespace(quorum_give_up_s=None))
        job.say = said.append if said is not None else None
        job.manager = SimpleNamespace(start_quorum=lambda: time.sleep(1.2), errored=lambda: None,
                                      num_participants=lambda: 2, current_step=lambda: 0)
        job.process_group, job.pg = SimpleNamespace(quorum_ranks=[0, 1]), SimpleNamespace(group_size=1, rank=0)
        job._quorum()
        assert job.members == [0, 1]
        if said is not None:
            assert len(said) >= 2 and all(line.startswith("waiting ") for line in said), said  # (polls: 0.5 s)
            assert all(a[0] == 3 and a[2:] == (2, "127.0.0.1:1", True, None) for a in asked), asked
            asked.clear()
    assert asked == []


def test_a_quorum_wait_says_what_to_do_after_a_lighthouse_restart_and_gives_up(monkeypatch):
    """A lighthouse that restarted forgets the quorum requests it held and torchft does not send
    them again: its page shows no participant (or no quorum ever formed while this job has been
    in quorums). The "still waiting" line then says so and what to do (the audit's jobs waited
    with '[2 heartbeating]' and no hint), and after federation.quorum_give_up_s the wait ends
    as a preemption's does (PreemptedWait, its gave_up set: a checkpoint at a round start, exit
    status 75). Pages as torchft's lighthouse writes them."""
    from types import SimpleNamespace

    import torch

    from dept_mega.dept import federation_log as fl
    from dept_mega.dept.federation_wait import preemptible
    from dept_mega.preemption import PreemptedWait

    def page(quorum_id, participants):
        return (f"Current quorum_id: {quorum_id} <br>\nNext quorum status: New quorum not ready, only have "
                f"{participants} participants, need min_replicas 2 [{participants}/{participants} participants "
                "healthy][2 heartbeating][shrink_only=false]\n<h3>Previous Quorum</h3>")
    assert fl.forgot_requests(page(0, 0), False) and fl.forgot_requests(page(7, 0), True)
    assert fl.forgot_requests(page(0, 1), True)  # (the other job relaunched and asked; this one's request is lost)
    assert not fl.forgot_requests(page(0, 1), False) and not fl.forgot_requests(page(7, 1), True)
    hint = "it restarted and forgot the quorum, and this job's request is not sent again: restart the group jobs"
    for shown, was_in, seconds, want in ((page(0, 0), True, 31, hint), (page(7, 1), True, 31, None),
                                         (page(7, 1), True, 601, "if the lighthouse restarted during this wait")):
        monkeypatch.setattr(fl, "_status_page", lambda where, timeout, shown=shown: shown)
        line = fl.quorum_wait_line(3, seconds, 2, "h:1", was_in, 3600)
        assert "the lighthouse h:1 says: New quorum not ready" in line, line
        assert (want in line) if want else ("restart the group jobs" not in line), line
        assert line.endswith("this job gives up after federation.quorum_give_up_s = 3600 s (a checkpoint at a "
                             "round start, exit status 75)"), line
    cpu = torch.device("cpu")
    for preemption in (None, SimpleNamespace(signal=None)):
        t0 = time.monotonic()
        with pytest.raises(PreemptedWait) as stop:
            preemptible(lambda: time.sleep(30), preemption, cpu, "waiting for a quorum at round 2", True,
                        poll_s=0.05, give_up_s=0.3)
        assert 0.3 <= time.monotonic() - t0 < 5 and stop.value.synced
        assert stop.value.gave_up == "federation.quorum_give_up_s = 0.3 s", stop.value.gave_up
        assert preemptible(lambda: 5, preemption, cpu, "w", True, poll_s=0.05, give_up_s=0.3) == 5


def test_a_joining_group_is_told_every_field_that_differs(tmp_path):
    """A healing group's agreed keys against its peer's: one ConfigError, one line per field
    with both values, in AGREE_KEYS order and the fields sorted within a key (one field: one
    line); a peer that sends only hashes: how many keys differ and each key."""
    from dept_mega.config import ConfigError, load_config
    from dept_mega.dept.federation_config import agree_hashes, agree_values, check_agree
    fed = ["federation.lighthouse=127.0.0.1:1", "federation.group=0", f"federation.groups={SOURCES}"]
    r = running = load_config(write_config(str(tmp_path)), fed)
    peer = {"agree": agree_hashes(running), "agree_values": agree_values(running)}
    check_agree(load_config(write_config(str(tmp_path)), [fed[0], "federation.group=2", fed[2]]), peer)  # the same keys
    rule = "; federation: every group job needs the same value"
    with pytest.raises(ConfigError) as exc:
        check_agree(load_config(write_config(str(tmp_path)), [*fed, "optim.lr=0.001"]), peer)
    assert str(exc.value) == f"config key 'optim.lr' differs from the running groups': this job has 0.001, the " \
        f"running groups have {r.optim.lr}{rule}"
    # federation.min_groups and dept.outer_overlap are compared (MEET_KEYS) but are not the run's identity
    from dept_mega.dept.federation_finished import run_key
    for key, value, mine, theirs in [("federation.min_groups", 2, 2, 1), ("dept.outer_overlap", "true", True, False)]:
        other = load_config(write_config(str(tmp_path)), [*fed, f"{key}={value}"])
        with pytest.raises(ConfigError) as exc:
            check_agree(other, peer)
        assert str(exc.value) == f"config key '{key}' differs from the running groups': this job has {mine}, " \
            f"the running groups have {theirs}{rule}"
        assert run_key(agree_hashes(other)) == run_key(peer["agree"])
    assert run_key(agree_hashes(load_config(write_config(str(tmp_path)), [*fed, "train.seed=7"]))) != run_key(peer["agree"])
    joining = load_config(write_config(str(tmp_path)), [*fed, "train.seed=7", "optim.lr=0.001",
                                                        "dept.local_steps=3", "optim.min_lr=0.0001"])
    with pytest.raises(ConfigError) as exc:
        check_agree(joining, peer)
    assert str(exc.value).split("\n") == [
        f"4 config keys differ from the running groups'{rule}:",
        f"  config key 'dept.local_steps': this job has 3, the running groups have {r.dept.local_steps}",
        f"  config key 'train.seed': this job has 7, the running groups have {r.train.seed}",
        f"  config key 'optim.lr': this job has 0.001, the running groups have {r.optim.lr}",
        f"  config key 'optim.min_lr': this job has 0.0001, the running groups have {r.optim.min_lr}"]
    with pytest.raises(ConfigError) as exc:
        check_agree(joining, {"agree": agree_hashes(running)})
    assert str(exc.value).split("\n") == [f"3 config keys differ from the running groups'{rule}:",
                                          "  config key 'dept.local_steps'", "  config key 'train.seed'",
                                          "  config key 'optim'"]


def test_a_fresh_quorum_names_every_field_that_differs_with_each_groups_value(tmp_path):
    """At a fresh start the hashes of the agreed keys are compared and, where they differ, the
    differing keys' values travel too: one agreed ConfigError, the same in both jobs, naming
    each field that differs with each group's value (it named only the keys, and the user had
    to compare config files at two sites). Two group jobs stand in as two threads, each with a
    gloo process group of the pair (an in-process store)."""
    import threading
    from datetime import timedelta

    import torch
    from torch.distributed import HashStore
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    from dept_mega.config import ConfigError, load_config
    from dept_mega.dept.federation_bookkeeping import check_fresh_agree
    from dept_mega.dept.federation_config import agree_hashes, agree_values
    from dept_mega.parallel.agree import is_agreed
    fed = ["federation.lighthouse=127.0.0.1:1", f"federation.groups={SOURCES}"]

    path = write_config(str(tmp_path))  # once: two threads writing it raced with each other's read

    def compare(overrides):
        store, errors = HashStore(), {}

        def job(g):
            cfg = load_config(path, [*fed, f"federation.group={g}", *overrides[g]])
            pg = ProcessGroupGloo(store, g, 2, timedelta(seconds=20))
            try:
                check_fresh_agree(pg, torch.device("cpu"), agree_hashes(cfg), agree_values(cfg), [0, 1])
            except ConfigError as exc:
                errors[g] = exc
        threads = [threading.Thread(target=job, args=(g,)) for g in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        return errors

    base = load_config(path, [*fed, "federation.group=0"])
    assert compare([[], []]) == {}  # the same keys (the group index is not agreed)
    errors = compare([["optim.lr=0.001"], ["train.seed=7", "model.hidden_size=32"]])
    assert sorted(errors) == [0, 1] and str(errors[0]) == str(errors[1]) and is_agreed(errors[0])
    head, *lines = str(errors[0]).split("\n")
    assert head == "3 config keys differ between the group jobs; federation: every group job needs the same value:"
    assert lines == [f"  config key 'model.hidden_size': group 0 has {base.model.hidden_size}, group 1 has 32",
                     f"  config key 'train.seed': group 0 has {base.train.seed}, group 1 has 7",
                     f"  config key 'optim.lr': group 0 has 0.001, group 1 has {base.optim.lr}"], lines
    errors = compare([[], ["federation.min_groups=2"]])
    assert sorted(errors) == [0, 1] and str(errors[0]) == str(errors[1])
    assert str(errors[0]).startswith("config key 'federation.min_groups' differs between the group jobs") \
        and "group 0 has 1, group 1 has 2" in str(errors[0]), str(errors[0])


@pytest.mark.filterwarnings("ignore:The given buffer is not writable")
@pytest.mark.parametrize("quiet", [True, False])
def test_the_healing_server_writes_no_access_lines_into_the_log(capfd, quiet):
    """torchft's healing transport serves a peer's state over http.server, which wrote one
    access line per request ('"GET /checkpoint/N/full HTTP/1.1" 200 -') into the serving job's
    log (the walkthrough's group 0). Quieted, a healing fetch leaves no line while a refused
    request's error line stays; unquieted (the sabotage) the access line is there."""
    import urllib.error
    import urllib.request
    from datetime import timedelta

    import torch
    from torchft.checkpointing import HTTPTransport

    from dept_mega.dept.federation_log import quiet_checkpoint_server
    timeout = timedelta(seconds=10)
    transport = HTTPTransport(timeout=timeout, num_chunks=0)
    try:
        if quiet:
            quiet_checkpoint_server(transport)
        transport.send_checkpoint([1], step=3, state_dict={"x": torch.arange(4.0)}, timeout=timeout)
        got = transport.recv_checkpoint(0, transport.metadata(), 3, timeout)
        assert torch.equal(got["x"], torch.arange(4.0))
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(f"{transport.metadata()}7/full", timeout=10)
    finally:
        transport.shutdown(wait=True)
    err = capfd.readouterr().err
    assert ("GET /checkpoint/3/full" in err) is not quiet, err
    assert "code 400" in err, err  # the refused request (a stale step) is still said


class _PlannedManager:
    """A stand-in for torchft's Manager whose quorum tries follow ``plan``: per try, (groups in
    the quorum, whether it fails). A failing try heals from a peer at step 9 (torchft's step
    moved, the peer's state handed over to ``fed``) and then errs; each ``start_quorum`` clears
    the error first, as torchft's does. ``ids``: the quorum id torchft holds as configured at
    each try (torchft sets it before it configures, so a failed try leaves it set)."""

    def __init__(self, fed, plan):
        self.fed, self.step, self.tries, self.plan, self.error = fed, 3, 0, plan, None
        self._quorum_id, self.ids = 5, []

    def current_step(self):
        return self.step

    def batches_committed(self):
        return 0

    def load_state_dict(self, sd):
        self.step = sd["step"]

    def start_quorum(self, **kw):
        self.error, (self.n, fails) = None, self.plan[self.tries]
        self.tries += 1
        self.ids.append(self._quorum_id)
        self._quorum_id = 6  # (the lighthouse's id for the groups of every try here)
        if fails:
            self.step = 9
            self.fed._load_healed({"round": 4})
            self.error = RuntimeError("peer gone")

    def errored(self):
        return self.error

    def num_participants(self):
        return self.n


@pytest.mark.parametrize("healed_before", [False, True])
def test_a_failed_quorum_after_healing_leaves_the_job_as_it_was(healed_before):
    """A quorum try that healed this job (torchft moved its step to the peer's and handed over
    the peer's state) and then failed elsewhere: the try's state is dropped and torchft's step
    goes back to what it was before the try, so the next try heals again instead of presenting
    this job, its own state unchanged, as one of the newest round. ``healed_before``: the job
    had healed in an earlier, successful try (a fresh start's wait asks again while groups are
    missing): that heal and its step stay. torchft's Manager stands in as a fake (_PlannedManager)."""
    from types import SimpleNamespace

    import torch

    from dept_mega.dept.federation import Federation

    fed = object.__new__(Federation)
    # the first try heals from a peer at step 9 and then fails on another rank; the second succeeds
    fed.manager, fed.say, fed._loop, fed._healed = _PlannedManager(fed, [(1, True), (1, False)]), None, None, None
    fed.quorums = 0
    fed.round, fed.device, fed._say = 3, torch.device("cpu"), lambda line: None
    fed.least = 1  # (a round of 1 group: each try asks torchft once)
    fed.cfg = SimpleNamespace(federation=SimpleNamespace(quorum_give_up_s=None))
    fed.pg = SimpleNamespace(group_size=1, rank=0)
    fed.process_group = SimpleNamespace(quorum_ranks=[0])
    earlier = {"round": 5}
    if healed_before:  # an earlier try healed this job to the newest round (step 7)
        fed._healed, fed.manager.step = earlier, 7
    fed._quorum()
    assert fed.manager.tries == 2
    assert (fed._healed, fed.manager.step) == ((earlier, 7) if healed_before else (None, 3))
    # the second try configures its process group again, though its quorum has the same id
    assert fed.manager.ids == [5, -1], fed.manager.ids


def test_a_failed_quorum_too_small_is_a_failed_try(monkeypatch):
    """A round needs 2 groups; the lighthouse forms a quorum of 1 group, in which this job heals
    (torchft's step moved to the peer's, a state handed over) and that then fails: torchft's next
    start_quorum would clear the error, so the short quorum is not just asked again: it is a
    failed try like any (said, its heal and torchft's step undone), and the next quorum of 2
    groups goes on from the job's own state. A short quorum that does not fail is asked again
    without a try counted."""
    from types import SimpleNamespace

    import torch

    from dept_mega.dept import federation_wait
    from dept_mega.dept.federation import Federation
    monkeypatch.setattr(federation_wait, "ASK_AGAIN_S", 0.01)
    fed = object.__new__(Federation)

    said = []
    fed.say, fed._loop, fed._healed, fed.least, fed.least_why, fed.quorums = None, None, None, 2, "why", 0
    fed.round, fed.device, fed._say = 3, torch.device("cpu"), said.append
    fed.cfg = SimpleNamespace(federation=SimpleNamespace(quorum_give_up_s=None))
    fed.pg = SimpleNamespace(group_size=1, rank=0)
    fed.process_group = SimpleNamespace(quorum_ranks=[0, 1])
    fed.manager = _PlannedManager(fed, [(1, True), (2, False)])
    fed._quorum(allow_heal=True)
    assert fed.manager.tries == 2 and fed.members == [0, 1]
    assert (fed._healed, fed.manager.step) == (None, 3)
    assert [line.split(": ")[1] for line in said] == ["round 3"] and "failed (peer gone)" in said[0], said
    said.clear()
    fed.manager = _PlannedManager(fed, [(1, False), (1, True), (1, False), (1, True), (2, False)])  # 2 failed tries of 3
    fed._quorum(allow_heal=True)
    assert fed.manager.tries == 5 and (fed._healed, fed.manager.step) == (None, 3)
    assert sum("failed" in line for line in said) == 2 and sum("fewer than" in line for line in said) == 2, said


def test_a_group_left_out_writes_its_healed_membership_record():
    """A group left out of rounds completed without it (stalled beyond timeout_s: the audit's
    SIGSTOP of 80 s) healed at the redo quorum of round 5's exchange (LeftOut) and trains on at
    the peers' round 20, the same groups as before: its next round start writes the
    ``membership`` record of the heal (healed, joined: itself, at the step it trains from), as
    a rejoining job does; summarize_runs counts its tokens from there (trained_tokens) and shows
    the event (``r20+0h``). It wrote none (its groups had not changed). Fakes for torchft."""
    from types import SimpleNamespace

    from dept_mega.dept.federation import RUNNING, Federation
    from tools.summarize_runs import _event

    fed = object.__new__(Federation)
    fed.cfg = SimpleNamespace(dept=SimpleNamespace(local_steps=10), federation=SimpleNamespace(timeout_s=1))
    fed.manager = SimpleNamespace(current_step=lambda: RUNNING + 19)
    fed.group, fed.groups, fed.members, fed.say, fed._rounds = 0, 2, [0, 1], None, 6
    fed._healed, fed._left_out = None, {"round": 20, "applied": True}
    fed._check_healed = lambda sd: None
    records = []
    writer = SimpleNamespace(write=lambda kind, step, round_index, **rec: records.append((kind, step, round_index, rec)))
    assert fed.round_start(6, writer, 60) == (20, True)
    assert records == [("membership", 200, 20, dict(groups=[0, 1], joined=[0], left=[], healed=True))], records
    assert _event(dict(records[0][3], round=20)) == "r20+0h"


def test_a_relaunched_job_that_healed_names_only_itself_as_joined():
    """The audit's kill -9 of site 1's job, relaunched: it healed at its first quorum into the
    running groups [0, 1]. Its record said joined [0, 1] (summarize_runs ``r140+0,1h``: "group
    0 joined"), yet group 0 never left. A job healed at its first quorum knows nothing of the
    others' history: ``joined`` names only itself. A fresh start that did not heal still names
    every group at its first record."""
    from types import SimpleNamespace

    from dept_mega.dept.federation import Federation
    from tools.summarize_runs import _event

    fed = object.__new__(Federation)
    fed.group, fed.members, fed._say = 1, [0, 1], lambda line: None
    records = []
    writer = SimpleNamespace(write=lambda kind, step, round_index, **rec: records.append(rec))
    fed._members_changed([], 140, writer, 1400, healed=True)
    assert records == [dict(groups=[0, 1], joined=[1], left=[], healed=True)], records
    assert _event(dict(records[0], round=140)) == "r140+1h"
    records.clear()
    fed._members_changed([], 0, writer, 0, healed=False)
    assert records == [dict(groups=[0, 1], joined=[0, 1], left=[], healed=False)], records
    records.clear()  # a running job that healed back into more groups than it last saw: those too
    fed.members = [0, 1, 2]
    fed._members_changed([0, 1], 9, writer, 90, healed=True)
    assert records == [dict(groups=[0, 1, 2], joined=[1, 2], left=[], healed=True)], records


def test_torchft_log_lines_are_marked_and_translated_not_hidden(capfd):
    """torchft's Python loggers had no handler: Python's last resort printed their raw text into
    the job's log (the audit's '[dept_group_0:.../0 - step 1099511627781] got exception ...
    remote worker crashing ... GLHF!', also for a peer that only stalled). Through
    quiet_torchft: one line marked torchft, the step as 2^40+K, a known failure in words
    before torchft's own text; any other warning whole, its traceback kept; nothing twice."""
    import logging

    from dept_mega.dept.federation_log import quiet_torchft
    quiet_torchft()
    quiet_torchft()  # (once per Federation: one handler)
    capfd.readouterr()
    gloo = "[pair.cc:598] Connection closed by peer [127.0.0.1]:4711 (remote worker crashing?) GLHF!"
    logging.getLogger("torchft.manager").error(f"[dept_group_1:4f2a/0 - step 1099511627781] "
                                               f"got exception waiting for work {gloo}")
    try:
        raise ValueError("a real problem")
    except ValueError:
        logging.getLogger("torchft.process_group").exception("worker errored: a real problem")
    logging.getLogger("torchft.manager").info("[dept_group_1/0 - step 3] reconfiguring")  # (below WARNING)
    err = capfd.readouterr().err
    lines = err.splitlines()
    assert lines[0] == ("torchft error: [group 1, rank 0, torchft step 2^40+5] a cross-group collective failed (a "
                        "group died, stalled longer than federation.timeout_s, or the network failed; the exchange "
                        f"is redone): {gloo}"), lines
    assert lines[1] == "torchft error: worker errored: a real problem" and "ValueError: a real problem" in err, err
    assert "reconfiguring" not in err and err.count("got exception") == 0 and err.count("GLHF") == 1, err
