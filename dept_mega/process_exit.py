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
"""
from __future__ import annotations

import gc
import sys
from typing import Callable, NoReturn


def exit_after(main: Callable[[], int]) -> NoReturn:
    """Run ``main``, free what it left in reference cycles, and exit with its status."""
    status = main()
    gc.collect()
    sys.exit(status)
