"""dept_mega.data.stop_signals: the data tools' Ctrl-C / SIGTERM handling (the tools themselves
are tested with real signals in test_data_preprocess_kill.py and test_merge_datasets.py)."""
from __future__ import annotations

import signal
import sys
import threading
import time

import pytest

import dept_mega.data.stop_signals as ss


@pytest.mark.parametrize("first", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_the_handlers_are_installed_restores_both(monkeypatch, first):
    """The signal arrives right after the first of the two handlers is installed (its handler
    runs there): it raises, and both signals get their handlers from before back, not the
    "ignore" the handler set."""
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    real = signal.signal

    def install(sig, handler):
        old = real(sig, handler)
        if handler is ss._stop:
            ss._stop(int(first), None)
        return old

    monkeypatch.setattr(ss.signal, "signal", install)
    try:
        with pytest.raises(ss.Terminated if first == signal.SIGTERM else KeyboardInterrupt):
            with ss.stop_on_signals():
                pytest.fail("the block ran")
        after = {s: signal.getsignal(s) for s in before}
    finally:  # the test process's own handlers back, whatever happened
        for s, handler in before.items():
            real(s, handler)
    assert after == before


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="needs pthread_sigmask")
def test_a_signal_that_came_before_the_first_ones_handler_ran_is_ignored_quietly(monkeypatch):
    """Ctrl-C to the process group and, at once, the SIGTERM with which the tool stops its
    --partitions processes: both pending when the first one's handler runs. The second is
    ignored without Python's "Signal 15 ignored due to race condition" traceback."""
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    both = [signal.SIGINT, signal.SIGTERM]
    with pytest.raises(KeyboardInterrupt):
        with ss.stop_on_signals():
            old = signal.pthread_sigmask(signal.SIG_BLOCK, both)
            try:  # (to this thread: a signal sent to the process may go to another thread, unblocked there)
                signal.pthread_kill(threading.get_ident(), signal.SIGINT)
                signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, old)  # both handled: SIGINT's raises
            pytest.fail("no KeyboardInterrupt")
    for _ in range(3):  # the pending SIGTERM's turn (Python handles it at the next check)
        time.sleep(0.01)
    assert [str(u.exc_value) for u in unraisable] == []


def test_a_second_signal_handled_inside_the_first_ones_handler_does_not_win(monkeypatch):
    """The second signal's handler can run inside the first one's, before that has replaced the
    handlers: Python handles pending signals inside ``signal.signal()`` too, and a signal sent to
    the process can reach another thread just then (seen in the suite: SIGTERM's Terminated came
    out of Ctrl-C's handler). The first signal's exception is what the tool sees, and both
    handlers end ignoring."""
    real = signal.signal
    nested = []

    def signal_with_a_pending_sigterm(sig, handler):
        if not nested:  # the first call, from inside SIGINT's handler: SIGTERM's handler runs
            nested.append(sig)
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
        return real(sig, handler)
    with pytest.raises(KeyboardInterrupt):
        with ss.stop_on_signals():
            monkeypatch.setattr(signal, "signal", signal_with_a_pending_sigterm)
            try:
                signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
            finally:
                monkeypatch.setattr(signal, "signal", real)
                assert all(signal.getsignal(s) is ss._ignore for s in (signal.SIGINT, signal.SIGTERM))
    assert nested


def test_a_block_whose_inner_block_stopped_still_stops():
    """A block inside another whose signal was handled (its exception caught inside the outer
    block): the outer block's handlers are back, and its first signal still raises."""
    with pytest.raises(KeyboardInterrupt):
        with ss.stop_on_signals():
            with pytest.raises(ss.Terminated):
                with ss.stop_on_signals():
                    signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
            signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
            pytest.fail("the outer block's first signal did not raise")


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs pthread_kill")
def test_a_signal_whose_exception_a_finalizer_dropped_is_raised_at_the_next_check(monkeypatch):
    """SIGTERM handled while a finalizer runs (multiprocessing's Finalize when a pipe or a process
    object is freed): Python prints its exception and drops it. The work loops' check
    (``raise_if_stopped``) raises it again; outside the block, or with no signal, it does nothing."""
    import multiprocessing.util

    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)

    def signalled():
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
        for _ in range(3):  # the handler runs at the next bytecode check, here: inside the finalizer
            time.sleep(0.01)

    class Pipe:
        pass

    with ss.stop_on_signals():
        ss.raise_if_stopped()  # no signal: nothing
        pipe = Pipe()
        multiprocessing.util.Finalize(pipe, signalled)
        del pipe  # the finalizer runs (a weakref callback): its exception is dropped
        assert [type(u.exc_value) for u in unraisable] == [ss.Terminated]
        with pytest.raises(ss.Terminated):
            ss.raise_if_stopped()
    ss.raise_if_stopped()  # the block's state is gone with it
