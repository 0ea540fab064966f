"""The FP8 recipe of the native FP8 GEMMs (``fp8.py``): formats, scaling and accumulation.

Which GEMMs accumulate in the tensor cores' fast mode (``fast_accum``): Hopper's FP8 MMA keeps
its running sums in a narrower accumulator, and cuBLASLt's default promotes them to fp32 at
intervals, which costs time. Transformer Engine's recipe runs the forward GEMM (fprop) with
fast accumulation and the two gradient GEMMs (dgrad, wgrad: long reductions of small values)
with the promotion; ``forward`` does the same, ``none`` (the default: on an H200 forward was no
faster, docs/performance.md) promotes everywhere, ``all`` accumulates fast everywhere. It is ``torch._scaled_mm``'s ``use_fast_accum``: the CPU
kernel computes in fp32 either way, so it changes GPU results only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
FAST_ACCUM = ("none", "forward", "all")


@dataclass(frozen=True)
class Fp8Recipe:
    """``fmt``: hybrid (e4m3 forward, e5m2 gradients) | e4m3 (e4m3 everywhere);
    ``scaling``: current | delayed; ``amax_history``: delayed scaling's window;
    ``fast_accum``: forward | none | all (see the module docstring)."""
    fmt: str = "hybrid"
    scaling: str = "delayed"
    amax_history: int = 1024
    fast_accum: str = "none"

    def __post_init__(self) -> None:
        if self.fmt not in ("hybrid", "e4m3"):
            raise ValueError(f"fp8 format {self.fmt!r} is not one of hybrid | e4m3")
        if self.scaling not in ("current", "delayed"):
            raise ValueError(f"fp8 scaling {self.scaling!r} is not one of current | delayed")
        if self.amax_history < 1:
            raise ValueError(f"fp8 amax history must be >= 1, got {self.amax_history}")
        if self.fast_accum not in FAST_ACCUM:
            raise ValueError(f"fp8 fast accumulation {self.fast_accum!r} is not one of {' | '.join(FAST_ACCUM)}")

    @property
    def grad_dtype(self) -> torch.dtype:
        return E5M2 if self.fmt == "hybrid" else E4M3

    @property
    def fast_gemms(self) -> tuple[bool, bool, bool]:
        """``use_fast_accum`` of the (forward, input-gradient, weight-gradient) GEMMs."""
        every = self.fast_accum == "all"
        return (self.fast_accum != "none", every, every)

    def describe(self) -> str:
        extra = f", amax history {self.amax_history} steps" if self.scaling == "delayed" else ""
        return f"{self.fmt}, {self.scaling} scaling{extra}, fast accumulation: {self.fast_accum}"
