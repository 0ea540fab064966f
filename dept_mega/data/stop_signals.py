"""Ctrl-C and SIGTERM for the data tools (tools/preprocess_data.py, tools/merge_datasets.py):
the first stops the work by raising in the main thread, so that the code it unwinds through
removes the partial files; any later one is ignored until that is done.

Without the ignoring, a second signal (Ctrl-C pressed twice, a batch system signalling the job
again) raises again inside an ``except`` or ``finally`` that is removing files, and leaves the
rest of them behind.

Python runs a signal's handler at whatever bytecode the main thread is at, also inside a
``__del__`` or a weakref callback (``multiprocessing``'s ``Finalize`` objects, run when the
garbage collector frees a pipe or a process object), and an exception raised there is printed
("Exception ignored in: ...") and dropped. The work loops therefore call
:func:`raise_if_stopped` at their check points (each batch, each wait of a poll): it raises the
first signal's exception again once it was raised and the work went on.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
from contextlib import contextmanager
from typing import Iterator

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Terminated(BaseException):
    """SIGTERM (a batch system's end of job, ``kill``), raised in the main thread so that the
    work unwinds like Ctrl-C's KeyboardInterrupt."""


def _ignore(signum, frame) -> None:  # noqa: ARG001
    """A signal after the first: nothing. (Not SIG_IGN: a signal that came before the first
    one's handler ran, such as Ctrl-C to the process group followed at once by the SIGTERM
    with which the tool stops its --partitions processes, is still handled after it, and
    Python reports one whose handler became SIG_IGN meanwhile with a traceback: "Signal 15
    ignored due to race condition".)"""


_stopping = [False]  # the first signal's handler has started (since the block's handlers went in)
_raised: list = [None]  # the exception class the first signal's handler raised (the same span)


def _stop(signum, frame) -> None:  # noqa: ARG001
    if _stopping[0]:
        # a second signal whose handler runs inside the first's, before that could replace it:
        # Python handles pending signals inside signal.signal() too, and a signal another thread
        # received (one sent to the process) can arrive just then. The first one's exception wins.
        return
    _stopping[0] = True
    for sig in _SIGNALS:  # first, before anything else can be interrupted
        signal.signal(sig, _ignore)
    _raised[0] = Terminated if signum == signal.SIGTERM else KeyboardInterrupt
    raise _raised[0]()


def raise_if_stopped() -> None:
    """A work loop's check point, outside any cleanup: if a signal's exception was raised within
    :func:`stop_on_signals` and the work still goes on, it was dropped (raised inside a
    finalizer: see the module's docstring) — raise it again. Nothing otherwise (one test of a list)."""
    if _raised[0] is not None:
        raise _raised[0]()


def ignore_signals() -> None:
    """From now on, SIGINT and SIGTERM do nothing in this process (one that ends, within
    :func:`stop_on_signals`: what is left to do must not be cut short)."""
    for sig in _SIGNALS:
        signal.signal(sig, _ignore)


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`Terminated` and SIGINT KeyboardInterrupt, the
    first of them only: later ones are ignored, so the cleanup is not cut short.
    The handlers from before are restored when the block is left (after the cleanup the
    exception unwound through, in the caller's ``except`` clauses if they are inside it)."""
    previous = {sig: signal.getsignal(sig) for sig in _SIGNALS}
    was = _stopping[0], _raised[0]
    _stopping[0], _raised[0] = False, None
    try:  # installed inside: a signal between the two installs restores both
        for sig in _SIGNALS:
            signal.signal(sig, _stop)
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        _stopping[0], _raised[0] = was  # (an enclosing block's handlers are back: so is its state)


_PR_SET_PDEATHSIG = 1  # prctl(2)


def die_with_parent(parent: int) -> None:
    """Linux: this process gets SIGKILL when ``parent`` (the process that forked it) ends,
    whatever ends it (strictly: when the thread that forked it ends; the data tools fork from
    their main thread); if it has already ended, this process exits now.
    Without it a child of a tool killed by SIGKILL (the out-of-memory killer, a batch system)
    would go on tokenizing its part, or sleeping in a long batch, for nobody. Elsewhere:
    nothing (the children's own checks of their parent remain)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return  # refused (a seccomp filter): the children's own checks remain
    except (OSError, AttributeError):  # no prctl in this libc: the same
        return
    if os.getppid() != parent:  # the parent ended before the prctl: no signal will come
        os._exit(1)


def close_in_children(conn) -> None:
    """``conn`` (a pipe's end) closed in every process multiprocessing starts from this one from
    now on: held only where it is used, so that its reader sees end of file when its writer ends
    (a forked child's tie to its parent, as :func:`die_with_parent`)."""
    import multiprocessing.util
    multiprocessing.util.register_after_fork(conn, type(conn).close)


@contextmanager
def signals_blocked() -> Iterator[None]:
    """SIGINT and SIGTERM blocked in this thread (a process forked meanwhile starts with them
    blocked, so that it can set up its own handling before one is delivered: see
    :func:`unblock_signals`); one that came meanwhile is handled when they are unblocked, at the end."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def unblock_signals() -> None:
    """In a process forked within :func:`signals_blocked`: SIGINT and SIGTERM delivered again (one
    that came meanwhile is handled now)."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)
