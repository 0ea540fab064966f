"""The contexts around the native FP8 linears' forward and backward (``fp8._Fp8Linear``,
``fp8_prologue``'s fused linears): kept apart from ``fp8.py`` (the scaling state and the linear),
which re-exports :func:`_host_contexts` (tests patch it there)."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch


def _host_contexts(name: str, device_type: str) -> Optional[contextlib.ExitStack]:
    """The contexts the FP8 linear's forward or backward runs inside, entered (the caller closes
    the stack), or None (the usual case) where there are none, so that nothing is entered at
    all (even a ``nullcontext`` costs two Python calls, entered and left four times per linear
    call):

    * outside autocast: the FP8 math runs with ``torch.autocast(enabled=False)`` where autocast
      is on for ``device_type`` (the trainer uses none; entering an autocast context costs ~4 µs
      of host time per call even when it changes nothing);
    * a named range ``name`` in a ``torch.profiler`` trace (``train.profile``) while a profiler
      runs, so that the host tables of ``benchmarks/kernel_breakdown.py`` show the Python time
      of this path by name (a ``record_function`` costs ~6 µs of host time even without a
      profiler; the check ~0.04 µs)."""
    profiling = torch._C._autograd._profiler_enabled()
    autocast = torch.is_autocast_enabled(device_type)
    if not (profiling or autocast):
        return None
    stack = contextlib.ExitStack()
    if profiling:
        stack.enter_context(torch.profiler.record_function(name))
    if autocast:
        stack.enter_context(torch.autocast(device_type=device_type, enabled=False))
    return stack
