"""Leaving a launched process cleanly (``python -m dept_mega.train`` and the other entry points).

``dist.destroy_process_group()`` takes the process groups out of torch's registry, but the
C++ gloo process groups live on while anything still refers to them — our ``ProcessGroups``
object, the communicator, pending work handles — and those references sit in reference
cycles (trainer ↔ loop ↔ hooks) that Python frees only by its cycle collector. Left to the
interpreter's shutdown, a group's worker threads are torn down after the interpreter has
begun finalising, and about one launch in ten died there with SIGABRT ("terminate called
without an active exception") after it had finished its work and written its checkpoint,
which torchrun and SLURM report as a failed job. Collecting the cycles once ``main`` has
returned destroys the groups while the interpreter is whole.

After that the process leaves the way the interpreter would — non-daemon threads joined
(``threading._shutdown``), ``atexit`` handlers run, standard streams flushed — and then ends with
``os._exit``, skipping the interpreter's own teardown: freeing every module of torch and the C++
static destructors of its libraries takes about 0.5 s per process (measured on the 2-core CPU
machine: ``import torch, dept_mega.train`` then exit, 1.9 s against 1.4 s), which every rank of
every launch paid after its work was done. Nothing of ours relies on it: files, writers and
process groups are closed explicitly before ``main`` returns. (A tool that reports only after
the interpreter's teardown, such as ``python -m cProfile -m dept_mega.train``, gets nothing
then: set ``DEPT_MEGA_FULL_EXIT=1`` for the interpreter's full exit.)

A closed standard output (``... --check | head``) ends the process quietly, as it ends the
standard command-line tools: no ``BrokenPipeError`` traceback, exit status 141 (128 + SIGPIPE,
what a shell reports for a tool that SIGPIPE stopped).

:func:`report_error` prints an entry point's ``error:`` line once for a job of several ranks
when they all fail alike, and with the rank's number when it may be one rank's own.
"""
from __future__ import annotations

import gc
import os
import sys
from typing import Callable, NoReturn, Optional, TextIO

from .log_lines import write_line


EXIT_BROKEN_PIPE = 128 + 13  # 128 + SIGPIPE


def exit_after(main: Callable[[], int]) -> NoReturn:
    """Run ``main``, free what it left in reference cycles, and exit with its status; a reader
    that closed our standard output early (``| head``) ends it quietly (:data:`EXIT_BROKEN_PIPE`)."""
    try:
        status = main()
        sys.stdout.flush()  # here, not at the interpreter's exit, where the error would be a traceback
    except BrokenPipeError:
        if not _stdout_gone():
            raise  # another pipe or socket (a worker, a peer): a real error, not a reader that left
        # what is still buffered cannot be written: point stdout at /dev/null so that the
        # interpreter's own flush at exit does not fail again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(EXIT_BROKEN_PIPE)
    gc.collect()
    leave(status)


def leave(status, join_threads: bool = True) -> NoReturn:
    """End the process with ``status`` (``sys.exit``'s meaning: None 0, an int that int) as the
    interpreter would end it, without its teardown (module docstring): non-daemon threads joined
    and ``threading``'s own exit callbacks run (what ``threading._shutdown`` does at exit, in
    CPython's order: before ``atexit``), ``atexit`` handlers run, standard streams flushed, then
    ``os._exit``. ``DEPT_MEGA_FULL_EXIT=1``, or a status that is not None or an int: ``sys.exit``.
    ``join_threads=False`` (a thread known to be blocked for good, e.g. torchft's quorum worker
    after an abandoned wait): no thread is waited for, nor are atexit handlers run (they may wait
    for it too); the process ends at once, its output flushed, with ``status`` whatever the
    environment says."""
    import threading
    shutdown = getattr(threading, "_shutdown", None)
    if join_threads and (os.environ.get("DEPT_MEGA_FULL_EXIT") == "1" or shutdown is None
                         or not (status is None or isinstance(status, int))):
        sys.exit(status)  # the interpreter's own exit (asked for, or another interpreter than CPython's)
    if join_threads:
        import atexit
        shutdown()
        atexit._run_exitfuncs()
    _flush_all()
    os._exit(0 if status is None else int(status) & 0xFF)


def _flush_all() -> None:
    """Python's standard streams, then C's stdio buffers (what libraries such as NCCL print
    through C ``stdout`` sits there while it is a file or a pipe, and ``os._exit`` drops it)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass  # a reader that left or a closed stream: nothing more can be written
    try:
        import ctypes
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass  # no C library to ask (not a POSIX system)


def _stdout_gone() -> bool:
    """Whether our standard output is a pipe or socket whose reader has gone (poll reports an
    error or hang-up on it), i.e. whether a BrokenPipeError can be that reader's ``| head``;
    True where it cannot be told (no poll, no file descriptor), the quiet exit as before."""
    try:
        import select
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except (AttributeError, OSError, ValueError):
        return True


def _env_int(name: str) -> Optional[int]:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def report_error(message: str, agreed: bool = False, file: Optional[TextIO] = None) -> None:
    """Print ``error: MESSAGE`` (to stderr) the way a job of several ranks should: once, not once
    per rank, when every rank has it; with ``[rank R]`` when it may be one rank's alone.

    * One process (``WORLD_SIZE`` unset or 1): always, as it is.
    * ``agreed`` (the error came out of an agreement, ``dept_mega.parallel.agree.is_agreed``:
      every rank raises the same one): global rank 0 only.
    * Before the process group exists (config parsing and checks): every rank computed it from
      the same files and arguments, so global rank 0 prints it; the first rank of each other
      node (``LOCAL_RANK`` 0) prints it too, as ``error: [rank R] ...``, because another node
      may see other files (a node-local disk) and its own error must not be lost.
    * After (not agreed): every rank that has it, rank 0 included, as ``error: [rank R] ...``:
      nothing a single rank meets is hidden.

    A rank that prints nothing still exits with the caller's status."""
    import torch.distributed as dist
    out = file if file is not None else sys.stderr
    world = _env_int("WORLD_SIZE") or 1
    started = dist.is_available() and dist.is_initialized()
    if started:
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank = _env_int("RANK") or 0
    if world <= 1:
        line = f"error: {message}"
    elif agreed or not started:
        if rank == 0:
            line = f"error: {message}"
        elif agreed or _env_int("LOCAL_RANK") != 0:
            return  # rank 0 (or the node's first rank) says it
        else:
            line = f"error: [rank {rank}] {message}"
    else:
        line = f"error: [rank {rank}] {message}"
    write_line(line, out)  # one write: the other ranks' lines go to the same stderr
