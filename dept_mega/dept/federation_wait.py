"""A federated group job's wait for the other groups (torchft's quorum), preemptible, and how
often a quorum that fails once formed is asked again (:data:`QUORUM_TRIES`, dept/federation.py).

torchft's ``Manager.start_quorum`` blocks until the lighthouse forms a quorum — with fewer
than ``min_groups`` live groups, for as long as that lasts. A SIGTERM / SIGUSR1 arriving then
is only recorded by the handler (``dept_mega.preemption``); the loop's check after each step
comes after the wait, so on SLURM the job would be killed after ``KillWait`` with nothing
saved. Here the blocking call runs on a helper thread while the job's main thread looks every
:data:`POLL_S` seconds whether it returned and whether a rank of the job was signalled: one
all-reduce (MAX) of (signalled, still waiting) over the job's world, so every rank stops
waiting at the same poll, or every rank goes on. The quorum is called at the same points on
every rank of the job (torchft's quorum is a collective of the replica group), so the polls
match. A preemption agreed while some rank still waits raises
:class:`~dept_mega.preemption.PreemptedWait`; the helper thread is left blocked (a daemon: it
ends with the process), and the other groups see this one as gone when its heartbeats stop, as
after any kill. The same polls print the "still waiting for a quorum" line (rank 0, every
:data:`~dept_mega.dept.federation_log.WAIT_EVERY_S` seconds), with or without a preemption handler,
and end a wait that lasts longer than ``federation.quorum_give_up_s`` the same way as a
preemption (a checkpoint at a round start, status 75): a wait that long is a lighthouse that
restarted (it forgot the quorum requests it held, and torchft does not send them again) or
groups that are gone for good, and a job that waits forever holds its allocation idle. Groups
that have *finished* the run are not gone for a while but for good: when the lighthouse's
records show that too few groups are left for a quorum (``ended``:
dept/federation_finished.py), the wait ends as a preemption's does too, but the job exits not
for a requeue (``PreemptedWait.finished``).
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

import torch

from ..parallel.agree import world_max
from ..preemption import PreemptedWait
from .federation_log import WAIT_EVERY_S

#: seconds between the preemption checks of a wait (a quorum that forms at once costs one check)
POLL_S = 0.5

#: quorums a job asks for in a row when each one fails after it formed (its process group cannot
#: be configured, or healing fails: a member that is gone). A group that died with its quorum
#: request pending at the lighthouse is in at most the first of them: the lighthouse consumed
#: the request, and its next quorum waits until the dead group's heartbeats time out. Each
#: failed try ends within ``federation.timeout_s`` (torchft's store and process group timeouts).
QUORUM_TRIES = 3

#: seconds between a job's quorum requests while the quorums it gets are smaller than its
#: round's minimum (``Federation.least``): a lighthouse whose ``--min-groups`` is below the
#: job's ``federation.min_groups`` forms them, at once when nobody else asks
ASK_AGAIN_S = 1.0


def at_least(wait: Callable[[Callable[[], Any]], Any], ask: Callable[[], Any], manager, least: int,
             device: torch.device, short: Optional[Callable[[int], None]] = None,
             every: Optional[float] = None) -> bool:
    """One try of a job's quorum: torchft's (``ask()``: ``manager.start_quorum``, run by ``wait``:
    :func:`preemptible` on its helper thread) asked again, ``every`` seconds later, while the
    quorum it formed holds fewer than ``least`` groups (``manager.num_participants()``) and did
    not fail. Returns whether it failed (``manager.errored()``) on any rank of the job. torchft's
    lighthouse forms quorums of its own ``--min-groups`` and torchft's Manager checks its
    ``min_replica_size`` only when an exchange commits, which a group alone never does: without
    this, a job whose ``federation.min_groups`` is above the lighthouse's would train rounds alone.
    Each quorum's verdict is agreed over the job's ranks on its main thread (one all-reduce MAX),
    so every rank asks again or stops alike; a short quorum that failed (its process group, or a
    heal from it, failed on some rank) ends the try like any failed quorum: torchft's
    ``start_quorum`` clears the Manager's error, so asking again would drop it, and with it the
    caller's undoing of what the failed try changed (a heal, torchft's step).
    ``short(n)``: told of the first quorum of ``n`` groups too few. ``every``: :data:`ASK_AGAIN_S`."""
    every = ASK_AGAIN_S if every is None else every
    again, stop = False, threading.Event()  # (set once this try ends: an abandoned wait asks no more)
    try:
        while True:
            wait(lambda later=again: None if later and stop.wait(every) else ask())
            failed, small = world_max([manager.errored() is not None, manager.num_participants() < least], device)
            if failed or not small:
                return bool(failed)
            if short is not None and not again:
                short(manager.num_participants())
            again = True
    finally:
        stop.set()


def preemptible(fn: Callable[[], Any], preemption, device: torch.device, what: str, synced: bool,
                say: Optional[Callable[[float], None]] = None, poll_s: float = POLL_S,
                every: float = WAIT_EVERY_S, give_up_s: Optional[float] = None,
                ended: Optional[Callable[[bool], Optional[str]]] = None, since: Optional[float] = None) -> Any:
    """``fn()`` (blocking), abandoned when a preemption is agreed over the job's ranks while
    any of them still waits: then :class:`PreemptedWait` (``what``, ``synced``) on every rank;
    the same, its ``gave_up`` set, once the wait has lasted ``give_up_s`` seconds on any rank
    (``federation.quorum_give_up_s``; None: no limit). ``say(seconds)`` every ``every``
    seconds while any rank of the job still waits (without a preemption handler: while this
    rank waits; the "still waiting" line; nothing when every ``fn`` returns sooner).
    ``preemption`` None: no agreement (each rank alone decides; without ``say`` and
    ``give_up_s``, ``fn()`` as it is). ``fn``'s exception is raised here. ``ended(final)`` (on
    the rank that reads the lighthouse, rank 0): why no quorum can form again (the other groups
    finished the run), else None; asked every ``every`` seconds (``final`` False) and once the
    wait is given up (True, before the give-up is decided): its answer ends the wait with
    :class:`PreemptedWait`'s ``finished`` set on every rank. ``since``: the wait began then
    (``time.monotonic()``; a quorum asked again: its give-up and its lines go on from the first ask)."""
    if preemption is None and say is None and give_up_s is None:
        return fn()
    agree = (lambda flags: flags) if preemption is None else (lambda flags: world_max(flags, device))
    why: Optional[str] = None  # ended()'s answer, agreed at the next poll
    result: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            if device.type == "cuda":
                # the current CUDA device is per thread, and a new thread's is device 0: torchft's
                # quorum records the caller's device for its process group and streams
                torch.cuda.set_device(device)
            result["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - raised in the waiting thread
            result["error"] = exc
        finally:
            done.set()

    threading.Thread(target=run, name="federation-quorum", daemon=True).start()
    now = time.monotonic()
    t0 = now if since is None else since
    said = t0 + every * ((now - t0) // every)
    while True:
        finished = done.wait(poll_s)
        late = give_up_s is not None and time.monotonic() - t0 >= give_up_s
        signal, waiting, late, over = agree([0 if preemption is None else preemption.signal or 0, not finished,
                                             late, why is not None])
        # every rank's call returned: the loop's own check after the step follows; but a wait asked
        # again (``since``: at_least's next ask, which may return within one poll) past its give-up
        # is given up here, or it would never be
        if not waiting and not (late and since is not None):
            break
        if signal:
            preemption.agree_flag(signal)
            raise PreemptedWait(what, synced)
        if late and not over:  # (the last look at the lighthouse's records, agreed before giving up)
            why = ended(True) if ended is not None else None
            over = agree([why is not None])[0]
        if over:
            raise PreemptedWait(what, synced, finished=why or "the other group jobs finished the run (rank 0 says "
                                                              "which)")
        if late:
            raise PreemptedWait(what, synced, gave_up=f"federation.quorum_give_up_s = {give_up_s:g} s")
        if say is not None and time.monotonic() - said >= every:
            said += every
            say(time.monotonic() - t0)
            why = ended(False) if ended is not None else None
    if "error" in result:
        raise result["error"]
    return result.get("value")


def preemption_of(loop: Optional[Any]) -> Optional[Any]:
    """The loop's ``Preemption`` (set by dept_mega.train), None without one."""
    return getattr(loop, "preemption", None) if loop is not None else None
