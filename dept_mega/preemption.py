"""Preemption: SIGTERM / SIGUSR1 make the job save a checkpoint and exit with a known code;
SIGINT (Ctrl-C, which torchrun passes on to its workers) saves the same way but exits with
:data:`EXIT_INTERRUPTED` and no ``preempted.json`` (the user stopped it: nothing requeues it),
and a second Ctrl-C stops the process at once, unsaved (``KeyboardInterrupt``: a second SIGINT,
or the SIGTERM with which torchrun escalates a second Ctrl-C).

SLURM sends ``SIGUSR1`` shortly before the time limit when the job asks for it
(``#SBATCH --signal=USR1@120``) and ``SIGTERM`` on ``scancel`` or preemption. The handler only
records the signal; the training loop asks :meth:`Preemption.agreed` at the end of every step,
a one-element all-reduce (MAX) over the world, so that every rank stops after the same step
even when the signal reached only some of them (or reached them during different steps). The
loop then skips an evaluation due at that step, global rank 0 writes ``RUN/preempted.json``
naming the last complete checkpoint (:func:`announce_stop`: a save cut off by torchrun's
shutdown timeout still leaves the job requeued), the loop writes a checkpoint (deferred while
an outer synchronisation is in flight: ``hooks.can_save_now()``), ``dept_mega.train`` rewrites
``RUN/preempted.json`` naming it and every rank exits with :data:`EXIT_PREEMPTED`. The sbatch scripts (``examples/1b/common.sh``) requeue the
job when they find that file; the requeued job resumes from the checkpoint
(docs/launching.md, "Preemption and requeue").

The collective is bookkeeping (not counted by ``Comm``), like the loop's logging reductions.
"""
from __future__ import annotations

import json
import os
import signal
from typing import Any, Optional

import torch

# EX_TEMPFAIL from sysexits.h: "temporary failure, the user is invited to retry"
EXIT_PREEMPTED = 75
PREEMPTED_FILE = "preempted.json"
#: a federated group job whose partners finished the run while it waited for them (not requeued)
EXIT_PARTNERS_FINISHED = 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a command stopped by Ctrl-C
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class PreemptedWait(Exception):
    """A preemption agreed while the job waited for others outside its own world (a federated
    group job at torchft's quorum: dept/federation_wait.py): the wait is abandoned. ``what``:
    the wait, for the log; ``synced``: the job's state is the one a checkpoint of its current
    step holds (a round start, after the previous round's outer sync), so the loop saves it;
    False inside a round's end (its outer sync not done: a checkpoint cannot hold a round whose
    sync is pending, see TrainLoop._preempted_in_wait), where the relaunch resumes from the last
    checkpoint. ``gave_up``: not a signal but the wait's own limit (its words for the log,
    e.g. ``federation.quorum_give_up_s = 3600 s``); the job stops the same way, with status
    :data:`EXIT_PREEMPTED` and ``preempted.json``, so that a requeue relaunches it.
    ``finished``: the other group jobs finished the run, so no quorum can form again (its words
    for the log, dept/federation_finished.py); the job stops the same way but exits with
    :data:`EXIT_PARTNERS_FINISHED` and no ``preempted.json``: a requeue would only wait again."""

    def __init__(self, what: str, synced: bool, gave_up: Optional[str] = None,
                 finished: Optional[str] = None) -> None:
        super().__init__(what)
        self.what, self.synced, self.gave_up, self.finished = what, synced, gave_up, finished


class Preemption:
    """Records SIGTERM / SIGUSR1 / SIGINT (once installed) and agrees across ranks on stopping."""

    def __init__(self) -> None:
        self.signal: Optional[int] = None  # the first signal this process received
        self.stop_signal: Optional[int] = None  # set once every rank agreed (the largest number seen)
        self._previous: dict[int, Any] = {}

    def install(self) -> "Preemption":
        """Take over SIGTERM, SIGUSR1 and SIGINT in this (main-thread) process."""
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def uninstall(self) -> None:
        for sig, old in self._previous.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handler(self, signum, frame) -> None:  # noqa: ARG002 - the signal module's signature
        if self.signal == signal.SIGINT and signum in (signal.SIGINT, signal.SIGTERM):
            # a second Ctrl-C: stop now, without the checkpoint (torchrun passes the first one on
            # as SIGINT and, at the second, shuts its workers down with SIGTERM)
            raise KeyboardInterrupt
        if self.signal is None:
            self.signal = int(signum)
            if signum == signal.SIGINT:  # os.write: safe wherever the handler interrupts the process
                os.write(2, b"SIGINT: stopping after this step with a checkpoint (Ctrl-C again: stop at once, "
                            b"unsaved)\n")

    def request(self, signum: int = int(signal.SIGUSR1)) -> None:
        """What the handler does (tests, and callers that learn of a preemption otherwise)."""
        self._handler(signum, None)

    def agreed(self, device: torch.device) -> bool:
        """True once any rank has received a signal; the same answer on every rank (collective:
        call it on every rank at the same point of every step). Stays True once True."""
        if self.stop_signal is not None:
            return True
        from .parallel.agree import world_max
        flag = world_max([int(self.signal or 0)], device)[0]
        if flag:
            self.stop_signal = flag
        return self.stop_signal is not None

    def agree_flag(self, flag: int) -> None:
        """A signal agreed over the world elsewhere than :meth:`agreed` (a preemptible wait's
        own collective): :meth:`agreed` is True from now on."""
        if flag and self.stop_signal is None:
            self.stop_signal = int(flag)

    @property
    def interrupted(self) -> bool:
        """The agreed stop is a Ctrl-C (SIGINT on every rank that got a signal), not a preemption."""
        return self.stop_signal == int(signal.SIGINT)

    @property
    def exit_code(self) -> int:
        return EXIT_INTERRUPTED if self.interrupted else EXIT_PREEMPTED

    @property
    def signal_name(self) -> str:
        s = self.stop_signal or self.signal
        try:
            return signal.Signals(s).name if s else "none"
        except ValueError:
            return str(s)


def stopped_by(preemption: Preemption) -> str:
    """The agreed stop in the log's words."""
    return "interrupted (SIGINT)" if preemption.interrupted else f"preempted ({preemption.signal_name})"


def write_marker(run_dir: str, step: Optional[int], signal_name: str, saving: bool = False) -> None:
    """``RUN/preempted.json`` (global rank 0): the job stopped for a preemption after saving
    checkpoint ``step`` (the checkpoint a relaunch resumes from; null: none, it starts anew);
    the sbatch scripts requeue the job when it is there. ``saving``: written before the stop's
    save (:func:`announce_stop`), with ``"save_in_progress": true``."""
    from .manifest import replace_durable
    marker = {"step": None if step is None else int(step), "signal": signal_name, "exit_code": EXIT_PREEMPTED}
    if saving:
        marker["save_in_progress"] = True
    replace_durable(os.path.join(run_dir, PREEMPTED_FILE), json.dumps(marker).encode())


def announce_stop(run_dir: str, signal_name: str) -> None:
    """``RUN/preempted.json`` as soon as the ranks agree to stop, before the stop's save: the
    save of a large checkpoint can outlast torchrun's shutdown timeout, and a job killed
    without the marker would not be requeued. It names the last complete checkpoint (what
    ``checkpoints/latest`` names, what a relaunch resumes from if the save is cut short; null:
    none) and that a save is in progress; :func:`write_marker` rewrites it once the save is done."""
    from .resume import read_latest
    write_marker(run_dir, read_latest(run_dir)[0], signal_name, saving=True)


def clear_marker(run_dir: str) -> None:
    """A new launch of the run: the previous preemption is handled."""
    try:
        os.remove(os.path.join(run_dir, PREEMPTED_FILE))
    except FileNotFoundError:
        pass
