"""Numeric precision of the inner steps.

* ``fp32``: everything in fp32.
* ``bf16``: parameters, gradients and optimizer state stay fp32 ("master weights"); the forward
  runs under ``torch.autocast(bfloat16)``. No loss scaling is needed.
* ``fp16``: as bf16 with float16 autocast, plus dynamic loss scaling: the loss is multiplied by
  ``scale`` before backward, gradients are divided by it before clipping; a non-finite
  gradient norm skips the step and halves the scale, ``growth_interval`` good steps in a row
  double it.
Pipeline activations travel in the autocast dtype (fp32 for fp32).
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class LossScaler:
    scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    min_scale: float = 1.0
    good_steps: int = 0

    def update(self, found_nonfinite: bool) -> None:
        if found_nonfinite:
            self.scale = max(self.min_scale, self.scale * self.backoff_factor)
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self.scale *= self.growth_factor
                self.good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])


class Precision:
    def __init__(self, name: str, device: torch.device) -> None:
        if name not in _DTYPES:
            raise ValueError(f"precision {name!r} is not one of fp32 | bf16 | fp16")
        self.name = name
        self.device = device
        self.compute_dtype = _DTYPES[name]
        self.scaler = LossScaler() if name == "fp16" else None

    @property
    def comm_dtype(self) -> torch.dtype:
        return self.compute_dtype

    def autocast(self) -> Callable[[], Any]:
        if self.name == "fp32":
            return nullcontext
        dtype, dev = self.compute_dtype, self.device.type
        return lambda: torch.autocast(device_type=dev, dtype=dtype)

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def unscale(self, params: Sequence[torch.nn.Parameter]) -> None:
        if self.scaler is None:
            return
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scaler.scale)

    def update(self, found_nonfinite: bool) -> None:
        if self.scaler is not None:
            self.scaler.update(found_nonfinite)

    def describe(self) -> str:
        if self.name == "fp32":
            return "fp32"
        extra = ", dynamic loss scaling" if self.scaler is not None else ""
        return f"{self.name} autocast with fp32 master weights{extra}"
