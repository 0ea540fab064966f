"""Worker processes for tools/preprocess_data.py's ``--workers``: a fixed set of processes that
run one function on tasks, whose results the main process takes in the order it submitted
them, and which the main process can always stop without waiting for ever.

Why not ``multiprocessing.Pool``: Ctrl-C reaches the whole process group. A pool replaces a
worker that died of it by forking a new one from the main process, whose handlers by then
ignore SIGINT and SIGTERM (dept_mega/data/stop_signals.py), so ``terminate()``'s SIGTERM
could be ignored and ``join()`` wait for that worker for ever; and ``terminate()`` takes the
task queue's lock, which a worker killed while waiting for a task (SIGTERM to the group)
never releases. Ending the workers by an exception instead (SystemExit on SIGTERM) can leave
that lock held too, from inside the semaphore's acquire, and hung ordinary runs.

Here, nothing the main process does to stop the workers depends on them:

- each worker ignores SIGINT (the main process handles Ctrl-C and stops them) and dies of
  SIGTERM (its default action), set before anything else: the workers are forked with both
  signals blocked, so one sent meanwhile waits until then;
- a worker is never replaced; one that ends while the main process waits for a result is an
  error (:class:`WorkerDied`), found within :data:`POLL` seconds: a result is waited for with
  timeouts, never for ever. Each worker sends its results through a pipe of its own (not one
  queue for all): a worker killed part way through sending one (the out-of-memory killer
  picks the largest process) would leave half a message in a shared queue, and the main
  process's read of the rest would wait for ever; its own pipe ends with it instead;
- :meth:`Workers.stop` sends SIGTERM, then SIGKILL to any worker still there after
  :data:`GRACE` seconds, and joins them (``waitpid``: no lock, no queue), and never waits
  for the task queue's feeder thread (which may be stuck writing to a pipe nobody reads);
  after a finished run it first asks them to end (one ``None`` task each).

A worker also ends when the main process is gone (killed with SIGKILL alone): on Linux it is
killed with it (:func:`~dept_mega.data.stop_signals.die_with_parent`), elsewhere it checks its
parent whenever it has waited a second for a task.
"""
from __future__ import annotations

import gc
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import pickle
import queue as queue_mod
import signal
import sys
import threading
import time
import traceback
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Optional

from dept_mega.data.stop_signals import (close_in_children, die_with_parent, raise_if_stopped, signals_blocked,
                                         unblock_signals)

POLL = 0.2  # seconds: how often a wait for a result checks that every worker is alive
GRACE = 1.0  # seconds from SIGTERM to SIGKILL in stop()
CLOSE_WAIT = 10.0  # seconds the workers of a finished run get to end on their own in stop()
_ORPHAN_CHECK = 1.0  # seconds a worker waits for a task before it checks that its parent is alive


def _join_all(procs, seconds: float) -> None:
    """Joins every process in ``procs`` within ``seconds`` in all (one deadline, not one each)."""
    deadline = time.monotonic() + seconds
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))


class WorkerDied(RuntimeError):
    """A worker process ended while the main process waited for a result."""


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker (the ``__cause__`` of the exception
    :meth:`Workers.result` raises), as ``multiprocessing.Pool`` gives it."""

    def __str__(self) -> str:
        return self.args[0]


def _portable(exc: Exception) -> tuple[Exception, str]:
    """``exc`` (or, if it cannot be pickled, a RuntimeError saying what it was) and its traceback."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - any pickling failure: send what it said
        exc = RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc, text


class _Sender:
    """A worker's results, sent through its own pipe by a thread in the order given, so that the
    worker takes its next task while a large result is still being written (as a queue's feeder
    thread would let it)."""

    def __init__(self, conn) -> None:
        self._conn = conn
        self._items: queue_mod.SimpleQueue = queue_mod.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="result-sender", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (data := self._items.get()) is not None:
            try:
                self._conn.send_bytes(data)
            except OSError:  # the main process closed its end (it stopped): nobody reads
                return

    def put(self, result: tuple) -> None:
        """``result`` pickled here, in the worker's own thread (one that cannot be pickled is
        answered by its pickling error, and the thread goes on with the next)."""
        try:
            data = ForkingPickler.dumps(result)
        except Exception as exc:  # noqa: BLE001 - raised in the main process by result()
            data = ForkingPickler.dumps((result[0], False, _portable(exc)))
        self._items.put(data)

    def close(self) -> None:
        """Every result put so far sent; then the pipe closed."""
        self._items.put(None)
        self._thread.join()
        self._conn.close()


def _worker(tasks, conn, parent: int, func: Callable, initializer: Optional[Callable], initargs: tuple) -> None:
    """A worker's life: its signals (see the module's docstring), ``initializer(*initargs)``,
    then ``(seq, args)`` tasks until ``None``, each answered through ``conn`` ``(seq, True,
    func(*args))`` or ``(seq, False, (exception, traceback))``; an initializer's error answers
    every task."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # the inherited heap is the parent's: never collected here, so no finalizer of its objects runs in
    # this process (a torch.distributed process group left in a cycle by the process that forked
    # us was destroyed here by a collection, and waited for ever on its threads, which a fork
    # does not copy)
    gc.freeze()
    die_with_parent(parent)  # also while it runs a task (the check below only runs between tasks)
    unblock_signals()  # a SIGTERM sent meanwhile ends it here
    results = _Sender(conn)
    failed = None
    try:
        if initializer is not None:
            initializer(*initargs)
    except Exception as exc:  # noqa: BLE001 - the answer to every task
        failed = _portable(exc)
    while True:
        try:
            task = tasks.get(timeout=_ORPHAN_CHECK)
        except queue_mod.Empty:
            if os.getppid() != parent:  # the main process is gone: nobody reads the results
                os._exit(1)
            continue
        if task is None:
            results.close()
            return
        seq, args = task
        if failed is not None:
            results.put((seq, False, failed))
            continue
        try:
            out = (seq, True, func(*args))
        except Exception as exc:  # noqa: BLE001 - raised in the main process by result()
            out = (seq, False, _portable(exc))
        results.put(out)


def _ended(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        oom = " (the kernel's out-of-memory killer sends it)" if -code == signal.SIGKILL else ""
        return f"was killed by {name}{oom}"
    return f"exited with status {code}"


class Workers:
    """``processes`` worker processes that run ``func`` on the arguments given to
    :meth:`submit`; :meth:`result` returns (or raises) what it gave, in any order the caller
    likes. ``initializer(*initargs)`` runs first in each worker. Use as a context manager, or
    call :meth:`stop` (also after an error: it never waits for ever). Forked on Linux, else
    spawned (``func`` and ``initializer`` must then be importable)."""

    def __init__(self, processes: int, func: Callable, initializer: Optional[Callable] = None,
                 initargs: tuple = (), name: str = "worker"):
        ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
        self.processes = processes
        self._tasks = ctx.Queue()
        self._procs: list = []
        self._pipes: dict = {}  # worker index -> the main process's end of its result pipe, until it ends
        self._done: dict[int, tuple[bool, Any]] = {}  # results that came before they were asked for
        self._seq = 0
        self._asked = self._closed = False  # stop(): the workers asked to end; the queues closed
        try:
            with signals_blocked():  # a signal meanwhile raises at the end, with every started one listed
                for i in range(processes):
                    ours, theirs = ctx.Pipe(duplex=False)
                    self._pipes[i] = ours
                    # held by the main process only: a worker's send fails once it is closed
                    close_in_children(ours)
                    # listed before it starts: found by stop() even if a signal raises inside start()
                    self._procs.append(ctx.Process(target=_worker, name=f"{name}-{i}", daemon=True,
                                                   args=(self._tasks, theirs, os.getpid(), func, initializer,
                                                         initargs)))
                    try:
                        self._procs[-1].start()
                    finally:
                        theirs.close()  # the worker's alone (the next ones are not forked with it)
        except BaseException:
            self.stop(finished=False)
            raise

    def __enter__(self) -> "Workers":
        return self

    def __exit__(self, kind, value, tb) -> None:
        self.stop(finished=kind is None)

    def submit(self, *args) -> int:
        """Queue ``func(*args)`` for the next free worker; returns its number for :meth:`result`
        (0, 1, 2, ... in the order of submission). Never blocks."""
        seq, self._seq = self._seq, self._seq + 1
        self._tasks.put((seq, args))
        return seq

    def result(self, seq: int) -> Any:
        """What ``func`` returned for task ``seq``, waiting for it; its exception if it raised
        (with the worker's traceback as ``__cause__``); :class:`WorkerDied` if a worker ended
        meanwhile (its task is lost: the run cannot go on)."""
        while seq not in self._done:
            raise_if_stopped()  # a signal whose exception a finalizer dropped (stop_signals)
            by_conn = {conn: i for i, conn in self._pipes.items()}
            ready = mp_connection.wait(list(by_conn), timeout=POLL)
            for conn in ready:
                try:
                    got, ok, value = conn.recv()
                except (EOFError, OSError):  # the worker ended (OSError: part way through a result)
                    i = by_conn[conn]
                    self._pipes.pop(i).close()
                    self._procs[i].join(POLL)  # (for its exit status)
                    continue
                self._done[got] = (ok, value)
            if ready:
                continue
            for i, proc in enumerate(self._procs):  # every result a dead one sent is read by now
                if proc.exitcode is not None or i not in self._pipes:
                    how = _ended(proc.exitcode) if proc.exitcode is not None else "closed its result pipe"
                    raise WorkerDied(f"worker process {proc.name} (pid {proc.pid}) {how} "
                                     f"while it had work to do; the run cannot go on without its results")
        ok, value = self._done.pop(seq)
        if ok:
            return value
        exc, text = value
        raise exc from RemoteTraceback(text)

    def stop(self, finished: bool = False) -> None:
        """End every worker and join it. ``finished`` (every result taken): each is first asked
        to end and given :data:`CLOSE_WAIT` seconds; then (at once when not ``finished``)
        SIGTERM, and SIGKILL after :data:`GRACE` seconds. Can be called again, also after one
        cut short (by a signal): it finishes the job."""
        self._tasks.cancel_join_thread()  # exit must not wait for a feeder stuck on a full pipe
        procs = [proc for proc in self._procs if proc.pid is not None]  # (started)
        if finished and not self._asked and not self._closed:
            self._asked = True
            for _ in procs:
                self._tasks.put(None)
            _join_all(procs, CLOSE_WAIT)
        for proc in procs:
            if proc.exitcode is None:
                proc.terminate()
        _join_all(procs, GRACE)
        for proc in procs:
            if proc.exitcode is None:
                proc.kill()
                proc.join()
        if not self._closed:
            self._closed = True
            self._tasks.close()
            for conn in self._pipes.values():
                conn.close()
