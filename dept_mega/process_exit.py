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

A closed standard output (``... --check | head``) ends the process quietly, as it ends the
standard command-line tools: no ``BrokenPipeError`` traceback, exit status 141 (128 + SIGPIPE,
what a shell reports for a tool that SIGPIPE stopped).
"""
from __future__ import annotations

import gc
import os
import sys
from typing import Callable, NoReturn


EXIT_BROKEN_PIPE = 128 + 13  # 128 + SIGPIPE


def exit_after(main: Callable[[], int]) -> NoReturn:
    """Run ``main``, free what it left in reference cycles, and exit with its status; a reader
    that closed our standard output early (``| head``) ends it quietly (:data:`EXIT_BROKEN_PIPE`)."""
    try:
        status = main()
        sys.stdout.flush()  # here, not at the interpreter's exit, where the error would be a traceback
    except BrokenPipeError:
        # what is still buffered cannot be written: point stdout at /dev/null so that the
        # interpreter's own flush at exit does not fail again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(EXIT_BROKEN_PIPE)
    gc.collect()
    sys.exit(status)
