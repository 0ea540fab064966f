"""``CudaCompiled``: a small pure-tensor function run compiled on CUDA, eagerly elsewhere.

Used for the elementwise-and-reduction math on a training step's path that eager PyTorch
would run as many passes over memory (the FP8 casts' reference math, the cross entropy's
pieces, RoPE): ``torch.compile`` (``fullgraph``, dynamic shapes: one graph serves every layer
size and micro-batch) fuses each into one or two kernels. On CPU the same function runs
eagerly (the tests compare the two with inductor's CPU backend). Inside a compiled region the
plain function is returned, so Dynamo traces it into that region's graph.

A function still gets one graph per combination of what its guards see that dynamic shapes
do not cover (dtypes, ``None`` arguments, flags, sizes equal to each other or to 0/1): the FP8
cast of a training run with an evaluation needs more than Dynamo's default ``recompile_limit``
(8), and with ``fullgraph`` going over it is an error (``FailOnRecompileLimitHit``), not a
fallback to eager. So each function gets a limit of its own, ``RECOMPILE_LIMIT``: through
``torch.compile(recompile_limit=...)`` where torch has it; else (torch 2.11) a call that hits the
global limit is retried once under ``torch._dynamo.config.patch(recompile_limit=...)``, which
holds for that call only (the limit is read only when the function compiles), so the global
limit still applies to every other compiled region.
"""
from __future__ import annotations

import inspect
import logging
from typing import Callable, Optional

import torch

# graphs per function: above what a training run with evaluations makes (the FP8 cast: ~6 in a
# delayed-scaling run with an evaluation, 2 formats × 2 scalings × 3 layouts × pad or not at most)
RECOMPILE_LIMIT = 64

_SCOPED_LIMIT = "recompile_limit" in inspect.signature(torch.compile).parameters  # torch >= 2.13


class _OwnLimitWarnings(logging.Filter):
    """Drops Dynamo's "hit config.recompile_limit" warning for a ``CudaCompiled`` function under
    its own limit: the call is retried under that limit (torch without a per-function limit)."""

    def __init__(self) -> None:
        super().__init__()
        self.codes: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (len(args) > 2 and args[0] == "recompile_limit" and isinstance(args[1], int)
                    and args[1] < RECOMPILE_LIMIT and isinstance(args[2], str)
                    and any(args[2].startswith(code) for code in self.codes))


_FILTER = _OwnLimitWarnings()


def _compile(fn: Callable) -> Callable:
    """``fn`` compiled (fullgraph, dynamic) with at most ``RECOMPILE_LIMIT`` graphs of its own."""
    if _SCOPED_LIMIT:
        return torch.compile(fn, fullgraph=True, dynamic=True, recompile_limit=RECOMPILE_LIMIT)
    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    from torch._dynamo.exc import FailOnRecompileLimitHit
    code = fn.__code__
    _FILTER.codes.add(f"'{code.co_name}' ({code.co_filename}:{code.co_firstlineno})")
    logger = logging.getLogger("torch._dynamo.convert_frame")
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)

    def call(*args):
        try:
            return compiled(*args)
        except FailOnRecompileLimitHit:  # raised before the frame runs: nothing was done yet
            with torch._dynamo.config.patch(recompile_limit=max(torch._dynamo.config.recompile_limit,
                                                                RECOMPILE_LIMIT)):
                return compiled(*args)
    return call


class CudaCompiled:
    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self._compiled: Optional[Callable] = None

    @property
    def compiled(self) -> Callable:
        """``fn`` compiled once per process (on first use)."""
        if self._compiled is None:
            self._compiled = _compile(self.fn)
        return self._compiled

    def on(self, device: torch.device) -> Callable:
        """What to call for tensors on ``device``."""
        if device.type == "cuda" and not torch.compiler.is_compiling():
            return self.compiled
        return self.fn
