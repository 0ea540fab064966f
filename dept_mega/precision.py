"""Numeric precision of the inner steps (Megatron's mixed precision).

* ``fp32``: weights, activations, gradients and optimizer state in fp32.
* ``bf16`` / ``fp16``: the model's weights are stored in the half type, so every activation
  (the residual stream, norm outputs, what the TP/SP and pipeline collectives move) is half
  precision on every pipeline stage alike; no autocast. Each micro-batch's half-precision
  gradient is added into an fp32 buffer (``param.main_grad``, :mod:`dept_mega.grad_buffer`;
  ``optim.grad_dtype: bf16`` keeps that buffer in bf16), and the optimizer updates fp32
  master weights (``param.main_param``, or a 1/D shard of them with the distributed
  optimizer) and copies them back into the half weights. The cross entropy runs in fp32.
* ``fp16`` adds dynamic loss scaling: the loss is multiplied by ``scale`` before backward,
  gradients are divided by it before clipping; a non-finite gradient norm skips the step and
  halves the scale, ``growth_interval`` good steps in a row double it.
Pipeline activations travel in the weights' dtype.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable

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


def dtype_of(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"precision {name!r} is not one of fp32 | bf16 | fp16")
    return _DTYPES[name]


class Precision:
    def __init__(self, name: str, device: torch.device, grad_dtype: str = "fp32") -> None:
        self.name = name
        self.device = device
        self.param_dtype = dtype_of(name)  # model weights and activations
        self.grad_dtype = dtype_of(grad_dtype)  # gradient buffer (main_grad)
        if self.grad_dtype == torch.bfloat16 and self.param_dtype != torch.bfloat16:
            raise ValueError(f"optim.grad_dtype bf16 needs precision bf16, got {name}")
        self.scaler = LossScaler() if name == "fp16" else None

    @property
    def half(self) -> bool:
        """Half-precision weights: the optimizer keeps fp32 master copies."""
        return self.param_dtype != torch.float32

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.param_dtype

    @property
    def comm_dtype(self) -> torch.dtype:
        return self.param_dtype

    def autocast(self) -> Callable[[], Any]:
        """No autocast: the weights carry the dtype (kept for callers that pass a context)."""
        return nullcontext

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def update(self, found_nonfinite: bool) -> None:
        if self.scaler is not None:
            self.scaler.update(found_nonfinite)

    def describe(self) -> str:
        if self.name == "fp32":
            return "fp32"
        grads = "bf16" if self.grad_dtype == torch.bfloat16 else "fp32"
        extra = ", dynamic loss scaling" if self.scaler is not None else ""
        return f"{self.name} weights and activations, {grads} gradient buffer, fp32 master weights{extra}"
