"""dept_mega.data.workers: results in submission order whatever order the workers finish in, a
worker's exception raised in the main process, an initializer's error answering every task (the
signal handling is tested with the real tool in test_data_preprocess_kill.py)."""
from __future__ import annotations

import time

import pytest

from dept_mega.data.workers import RemoteTraceback, Workers
from tests.data_utils import in_a_fork


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


def _big_then_killed(x: int) -> bytes:
    import os
    import threading
    threading.Timer(0.3, os._exit, args=(9,)).start()  # (as the out-of-memory killer would, mid-send)
    return b"x" * (1 << 20)  # more than a pipe holds: its sending is stuck part way while nobody reads


def _mid_result(out) -> None:
    from dept_mega.data.workers import WorkerDied
    with Workers(1, _big_then_killed) as w:
        seq = w.submit(0)
        time.sleep(1.0)  # busy elsewhere: the result fills the pipe, then the worker ends
        try:
            w.result(seq)
            out.put("a result")
        except WorkerDied as exc:
            out.put(str(exc))


def test_a_worker_that_ends_part_way_through_a_result_is_an_error_not_a_hang():
    """A worker killed while it sends a result leaves half of it behind: result() raises
    WorkerDied naming it (a shared result queue's reader would wait for the rest for ever)."""
    got, = in_a_fork(_mid_result, 20, "waiting for a result from a worker that ended mid-result")
    assert got.startswith("worker process worker-0 (pid ") and got.endswith(
        ") exited with status 9 while it had work to do; the run cannot go on without its results"), got


def _unpicklable_for_one(x: int):
    return (lambda: x) if x == 1 else x * 10


def _results_around_an_unpicklable_one(out) -> None:
    with Workers(1, _unpicklable_for_one) as w:
        seqs = [w.submit(x) for x in range(3)]
        for seq in seqs:
            try:
                out.put(("ok", w.result(seq)))
            except Exception as exc:  # noqa: BLE001
                out.put(("raised", f"{type(exc).__name__}: {exc}"))


def test_a_result_that_cannot_be_pickled_is_its_error_and_the_next_ones_still_come():
    got = in_a_fork(_results_around_an_unpicklable_one, 20, "waiting for the results around one that could not be pickled")
    assert got[0] == ("ok", 0) and got[2] == ("ok", 20), got
    assert got[1][0] == "raised" and "pickle" in got[1][1], got


class _Marks:
    """In a reference cycle: its finalizer says which process ran it."""

    def __init__(self, path: str) -> None:
        self.path, self.me = path, self

    def __del__(self) -> None:
        import os
        with open(self.path, "a") as f:
            f.write(f"{os.getpid()}\n")


def _collects(x: int) -> int:
    import gc
    gc.collect()
    return x


def test_a_worker_never_collects_what_it_inherited(tmp_path):
    """A worker is forked with its parent's heap: a collection there must not finalize the
    parent's objects (a torch.distributed process group left in a cycle by an earlier test was
    destroyed in a worker and hung it for ever, waiting on threads a fork does not copy)."""
    import gc
    import os
    marks = str(tmp_path / "marks")
    gc.disable()
    try:
        _Marks(marks)  # garbage in a cycle, not yet collected when the worker is forked
        with Workers(1, _collects) as w:
            assert w.result(w.submit(3)) == 3
        assert not os.path.exists(marks), open(marks).read()  # (the worker's pid)
    finally:
        gc.enable()
        gc.collect()
    assert open(marks).read() == f"{os.getpid()}\n"  # finalized here, once
