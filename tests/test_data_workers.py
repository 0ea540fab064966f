"""dept_mega.data.workers: results in submission order whatever order the workers finish in, a
worker's exception raised in the main process, an initializer's error answering every task (the
signal handling is tested with the real tool in test_data_preprocess_kill.py)."""
from __future__ import annotations

import time

import pytest

from dept_mega.data.workers import RemoteTraceback, Workers


def _square_late(x: int) -> int:
    time.sleep(0.05 * (x % 3))
    if x == 7:
        raise ValueError("seven")
    return x * x


def _failing_init() -> None:
    raise OSError("no tokenizer here")


def test_results_by_number_and_errors_from_the_workers():
    with Workers(3, _square_late) as w:
        seqs = [w.submit(x) for x in range(10)]
        assert seqs == list(range(10))
        assert [w.result(s) for s in seqs if s != 7] == [x * x for x in range(10) if x != 7]
        with pytest.raises(ValueError, match="seven") as got:
            w.result(7)
        assert isinstance(got.value.__cause__, RemoteTraceback) and "_square_late" in str(got.value.__cause__)
    assert all(p.exitcode == 0 for p in w._procs)  # asked to end, they ended on their own


def test_an_initializers_error_answers_every_task():
    w = Workers(2, _square_late, _failing_init)
    try:
        for s in [w.submit(1), w.submit(2)]:
            with pytest.raises(OSError, match="no tokenizer here"):
                w.result(s)
    finally:
        w.stop()
    assert all(p.exitcode is not None for p in w._procs)
