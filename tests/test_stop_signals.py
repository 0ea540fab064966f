"""dept_mega.data.stop_signals: the data tools' Ctrl-C / SIGTERM handling (the tools themselves
are tested with real signals in test_data_preprocess_kill.py and test_merge_datasets.py)."""
from __future__ import annotations

import signal

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
