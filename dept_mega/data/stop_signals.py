"""Ctrl-C and SIGTERM for the data tools (tools/preprocess_data.py, tools/merge_datasets.py):
the first stops the work by raising in the main thread, so that the code it unwinds through
removes the partial files; any later one is ignored until that is done.

Without the ignoring, a second signal (Ctrl-C pressed twice, a batch system signalling the job
again) raises again inside an ``except`` or ``finally`` that is removing files, and leaves the
rest of them behind.

Worker processes (a ``multiprocessing`` pool's, forked) must not inherit that: Ctrl-C reaches
the whole process group, and a pool replaces a worker that died of it (or of SIGTERM) by forking
a new one from the main process, whose handlers by then ignore both signals; if
``pool.terminate()``'s SIGTERM reaches that worker before its initializer set SIGTERM back to
the default, it is ignored and ``pool.join()`` waits for it for ever. So the pool is started
with both signals blocked (:func:`start_pool`; its threads, which fork the replacements, keep
that mask), and a worker's initializer first calls :func:`worker_signals`: SIGINT ignored (the
main process handles Ctrl-C and terminates the workers), SIGTERM ends the worker, then
unblocked, so a SIGTERM sent before the worker got that far ends it then.
"""
from __future__ import annotations

import signal
from contextlib import contextmanager
from typing import Callable, Iterator

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Terminated(BaseException):
    """SIGTERM (a batch system's end of job, ``kill``), raised in the main thread so that the
    work unwinds like Ctrl-C's KeyboardInterrupt."""


def _ignore(signum, frame) -> None:  # noqa: ARG001
    """A signal after the first: nothing. (Not SIG_IGN: a signal that the process received before
    the first's handler ran, a second Ctrl-C or the SIGTERM with which a parent terminates a
    partition's process, is still handled after it, and Python reports one whose handler became
    SIG_IGN meanwhile as an error: "Signal 15 ignored due to race condition".)"""


def _stop(signum, frame) -> None:  # noqa: ARG001
    for sig in _SIGNALS:  # first, before anything else can be interrupted
        signal.signal(sig, _ignore)
    if signum == signal.SIGTERM:
        raise Terminated()
    raise KeyboardInterrupt()


def start_pool(ctx, processes: int, initializer: Callable[..., None], initargs: tuple = ()):
    """``ctx.Pool(processes, initializer, initargs)`` started with SIGINT and SIGTERM blocked in
    this thread: its workers and its worker-handling threads (which fork replacements) inherit
    the mask (see the module's docstring); ``initializer`` must call :func:`worker_signals`
    first. A signal that came meanwhile raises when the mask is restored, after the pool is
    terminated again."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    try:
        pool = ctx.Pool(processes, initializer=initializer, initargs=initargs)
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
        raise
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)  # a pending signal is handled (raises) here
    except BaseException:
        pool.terminate()
        pool.join()
        raise
    return pool


def _leave(signum, frame) -> None:  # noqa: ARG001
    raise SystemExit(128 + signum)


def worker_signals() -> None:
    """First thing in a pool worker started by :func:`start_pool`: SIGINT ignored, SIGTERM ends
    the process, both unblocked (a pending SIGINT is discarded, a pending SIGTERM ends it now).

    SIGTERM ends it by raising SystemExit, not by SIG_DFL: an idle worker waits for a task
    holding the pool's task-queue lock, and one killed outright never releases it, so that the
    ``terminate()`` after a SIGTERM to the whole process group waits for that lock for ever;
    unwinding releases it (a worker busy in C code ends when that returns)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _leave)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`Terminated` and SIGINT KeyboardInterrupt, the
    first of them only: later ones are ignored, so the cleanup is not cut short.
    The handlers from before are restored when the block is left (after the cleanup the
    exception unwound through, in the caller's ``except`` clauses if they are inside it)."""
    previous = {sig: signal.getsignal(sig) for sig in _SIGNALS}
    try:  # installed inside: a signal between the two installs restores both
        for sig in _SIGNALS:
            signal.signal(sig, _stop)
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
