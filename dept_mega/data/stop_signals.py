"""Ctrl-C and SIGTERM for the data tools (tools/preprocess_data.py, tools/merge_datasets.py):
the first stops the work by raising in the main thread, so that the code it unwinds through
removes the partial files; any later one is ignored until that is done.

Without the ignoring, a second signal (Ctrl-C pressed twice, a batch system signalling the job
again) raises again inside an ``except`` or ``finally`` that is removing files, and leaves the
rest of them behind.
"""
from __future__ import annotations

import signal
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


def _stop(signum, frame) -> None:  # noqa: ARG001
    for sig in _SIGNALS:  # first, before anything else can be interrupted
        signal.signal(sig, _ignore)
    if signum == signal.SIGTERM:
        raise Terminated()
    raise KeyboardInterrupt()


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
    try:  # installed inside: a signal between the two installs restores both
        for sig in _SIGNALS:
            signal.signal(sig, _stop)
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
