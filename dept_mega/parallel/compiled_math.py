"""``CudaCompiled``: a small pure-tensor function run compiled on CUDA, eagerly elsewhere.

Used for the elementwise-and-reduction math on a training step's path that eager PyTorch
would run as many passes over memory (the FP8 casts' reference math, the cross entropy's
pieces, RoPE): ``torch.compile`` (``fullgraph``, dynamic shapes: one graph serves every layer
size and micro-batch) fuses each into one or two kernels. On CPU the same function runs
eagerly (the tests compare the two with inductor's CPU backend). Inside a compiled region the
plain function is returned, so Dynamo traces it into that region's graph.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch


class CudaCompiled:
    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self._compiled: Optional[Callable] = None

    @property
    def compiled(self) -> Callable:
        """``fn`` compiled once per process (on first use)."""
        if self._compiled is None:
            self._compiled = torch.compile(self.fn, fullgraph=True, dynamic=True)
        return self._compiled

    def on(self, device: torch.device) -> Callable:
        """What to call for tensors on ``device``."""
        if device.type == "cuda" and not torch.compiler.is_compiling():
            return self.compiled
        return self.fn
