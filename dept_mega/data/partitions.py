"""Cutting ``tools/preprocess_data.py``'s input into ``--partitions`` parts, and running the
parts side by side in child processes.

A part is a list of byte ranges of plain input files, cut at line starts; the parts cover
the concatenated inputs in order. The line numbers a part needs at its start (for its bad
lines' ``file:line`` and for ``--round-trip-every``'s line index over the whole input) are
counted before the parts start, in one pass over the bytes before the last cut
(:func:`part_starts`). :func:`run_in_processes` runs one child process per part, at most a
given number at once, passes their messages to the caller and, on any error or interrupt,
terminates them all (SIGTERM: a child unwinds and removes its partial files; one still there
:data:`STOP_WAIT` seconds later is killed, and the caller's log says so). A child also dies when
the process that started it does, whatever kills that (:func:`die_with_parent`).
"""
from __future__ import annotations

import gc
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import sys
import time
from typing import Any, Callable, Optional, Sequence

from dept_mega.data.stop_signals import (Terminated, close_in_children, die_with_parent, raise_if_stopped,
                                         signals_blocked, unblock_signals)

STOP_WAIT = 10.0  # seconds the children get, all together, to end after SIGTERM before SIGKILL


def count_newlines(path: str, start: int, end: int) -> int:
    """The newlines in bytes [start, end) of ``path``."""
    n = 0
    with open(path, "rb") as f:
        f.seek(start)
        left = end - start
        while left > 0:
            chunk = f.read(min(left, 16 << 20))
            if not chunk:
                break
            n += chunk.count(b"\n")
            left -= len(chunk)
    return n


def line_start_at_or_after(path: str, offset: int) -> int:
    """The offset of the first line starting at or after ``offset``."""
    if offset == 0:
        return 0
    with open(path, "rb") as f:
        f.seek(offset - 1)
        if f.read(1) == b"\n":
            return offset
        f.readline()
        return f.tell()


Range = tuple[str, int, int]  # (path, start byte, end byte)


def partition_ranges(inputs: Sequence[str], partitions: int) -> list[list[Range]]:
    """Cut the concatenated inputs into ``partitions`` contiguous pieces at line starts."""
    sizes = [os.path.getsize(p) for p in inputs]
    total = sum(sizes)
    # global cut points, aligned to line starts inside their file
    cuts: list[tuple[int, int]] = []  # (file index, offset)
    for k in range(1, partitions):
        target = total * k // partitions
        acc = 0
        for i, size in enumerate(sizes):
            if target < acc + size:
                cuts.append((i, line_start_at_or_after(inputs[i], target - acc)))
                break
            acc += size
        else:
            cuts.append((len(sizes) - 1, sizes[-1]))
    points = [(0, 0)] + cuts + [(len(sizes) - 1, sizes[-1])]
    parts: list[list[Range]] = []
    for (fa, oa), (fb, ob) in zip(points[:-1], points[1:]):
        ranges: list[Range] = []
        for i in range(fa, fb + 1):
            start = oa if i == fa else 0
            end = ob if i == fb else sizes[i]
            if end > start:
                ranges.append((inputs[i], start, end))
        parts.append(ranges)
    return parts


def part_starts(parts: Sequence[Sequence[Range]]) -> list[tuple[dict[str, tuple[int, int]], int]]:
    """Per part: ``({path: (offset, lines of the file before it)}`` for its first range,
    ``the 0-based index of its first line in the whole input)``. Newlines are counted once,
    over the ranges of every part but the last (a file's last line without a newline counts
    as a line, as the reader reads it)."""
    out = []
    file_lines: dict[str, int] = {}
    total = 0
    for pi, ranges in enumerate(parts):
        first = {ranges[0][0]: (ranges[0][1], file_lines.get(ranges[0][0], 0))} if ranges else {}
        out.append((first, total))
        if pi == len(parts) - 1:
            break
        for path, start, end in ranges:
            n = count_newlines(path, start, end)
            if end == os.path.getsize(path) and end > start:
                with open(path, "rb") as f:
                    f.seek(end - 1)
                    n += f.read(1) != b"\n"
            file_lines[path] = file_lines.get(path, 0) + n
            total += n
    return out


class _Reports:
    """A child's end of its own pipe to the parent: ``put(message)`` sends it there.

    One pipe per child, not one queue for all: a child that ends part way through a message
    (SIGKILL, or ``os._exit`` on a signal, while a queue's feeder thread was writing) would
    leave a shared queue holding half a message, and the parent's read of the rest would wait
    for ever (it holds the queue's write end itself, so no end of file comes). A child's own
    pipe ends at its end: the parent reads end of file, having read every whole message first.
    A send is synchronous (no feeder thread), so a message put before an exit is delivered."""

    def __init__(self, conn) -> None:
        self._conn = conn

    def put(self, message: Any) -> None:
        self._conn.send(message)


def _child(parent: int, target: Callable, conn, *args) -> None:
    """A child's life: forked with SIGINT and SIGTERM blocked (a signal to the process group
    while multiprocessing's start-up code ran would raise there, with a traceback, before
    ``target`` could handle it), unblocked once the stop is this function's."""
    try:
        gc.freeze()  # the inherited heap is the parent's (see the tokenizer workers' _worker)
        die_with_parent(parent)
        close_in_children(conn)  # (target's own processes, its tokenizer workers: its end is its alone)
        unblock_signals()
        target(_Reports(conn), *args)
    except (Terminated, KeyboardInterrupt):  # (the tool's handler) before target's own handling began
        os._exit(1)


def _drain(pipes: dict, on_message: Callable[[Any], None], most: int = 1000) -> None:
    """The messages already waiting in ``pipes`` (at most ``most`` from each) to ``on_message``."""
    for conn in list(pipes.values()):
        for _ in range(most):
            try:
                if not conn.poll(0):
                    break
                msg = conn.recv()
            except (EOFError, OSError):
                break
            on_message(msg)


def run_in_processes(tasks: Sequence[tuple], target: Callable, concurrency: int,
                     on_message: Callable[[Any], None], poll: float = 0.2,
                     log: Optional[Callable[[str], None]] = None, stop_wait: float = STOP_WAIT) -> None:
    """Run ``target(reports, *task)`` for each task in its own child process, at most
    ``concurrency`` at once, in order. A child reports with ``reports.put(message)``; its last
    message must be ``("done", index)`` (``index``: its task's position) after which it exits
    0. Each message goes to ``on_message`` (in the caller's process), which may raise to stop
    everything. A child that ends without "done" raises RuntimeError naming its exit code, once
    every message it sent has been passed on.
    On return or any exception every child still running is terminated and joined; those
    still there ``stop_wait`` seconds after (all together) are killed, each named to ``log``."""
    ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    running: dict[int, Any] = {}
    pipes: dict[int, Any] = {}  # the parent's end of each running child's pipe, until its end of file
    nxt = 0
    try:
        while nxt < len(tasks) or running:
            raise_if_stopped()  # a signal whose exception a finalizer dropped (stop_signals)
            while nxt < len(tasks) and len(running) < max(1, concurrency):
                # listed before it starts: a signal that raises inside start() (handled by another
                # thread's delivery despite the block) still finds it in the finally, once forked
                ours, theirs = ctx.Pipe(duplex=False)
                pipes[nxt] = ours
                close_in_children(ours)
                running[nxt] = ctx.Process(target=_child, args=(os.getpid(), target, theirs, *tasks[nxt]), daemon=False)
                try:
                    with signals_blocked():  # a signal meanwhile: raised at the end of the block
                        running[nxt].start()
                finally:
                    theirs.close()  # the child's alone: its end makes ours read end of file
                nxt += 1
            by_conn = {conn: i for i, conn in pipes.items()}
            ready = mp_connection.wait(list(by_conn), timeout=poll)
            for conn in ready:
                i = by_conn[conn]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):  # the child ended (OSError: part way through a message)
                    pipes.pop(i).close()
                    continue
                on_message(msg)
                if isinstance(msg, tuple) and msg and msg[0] == "done":
                    pipes.pop(i).close()
                    running.pop(i).join()
            for i, proc in list(running.items()):
                if i not in pipes:
                    proc.join(timeout=poll)  # its pipe has ended: so has it, or it is about to
                # ended, and every message it sent read (a process it forked may hold the pipe open)
                if proc.exitcode is not None and (i not in pipes or not pipes[i].poll(0)):
                    _drain(pipes, on_message)  # what the others sent first: an error there says more
                    raise RuntimeError(f"the process of partition {i} ended (exit code {proc.exitcode}) "
                                       f"before finishing")
    finally:
        started = {i: proc for i, proc in running.items() if proc.pid is not None}
        for proc in started.values():
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + stop_wait
        for proc in started.values():
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for i, proc in started.items():
            if proc.is_alive():
                proc.kill()
                proc.join()
                if log is not None:
                    log(f"[preprocess] the process of partition {i} (pid {proc.pid}) had not ended "
                        f"{stop_wait:g} s after SIGTERM: killed")
        for conn in pipes.values():
            conn.close()
