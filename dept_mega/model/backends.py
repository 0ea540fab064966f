"""Which implementation each part of the model uses, and the one-line description for the log.

* attention: flash-attn (``flash_attn_func``, native ALiBi slopes and GQA) when it is
  installed, the device is CUDA and the inputs are fp16/bf16; otherwise PyTorch's
  ``scaled_dot_product_attention`` (ALiBi as an additive float bias).
* norms: apex's fused LayerNorm / RMSNorm when apex is installed and the device is CUDA;
  otherwise ``torch.nn.functional.layer_norm`` / ``rms_norm``.
* linear layers: our tensor-parallel layers over ``torch.nn.functional.linear``.

``backend: transformer_engine`` and ``fp8`` need Transformer Engine; without it they are a
clear error, never a silent fallback. (The Transformer Engine code path itself is not
implemented in this version: requesting it with TE installed is also a clear error.)
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from ..config import ConfigError


class BackendError(ConfigError):
    """The requested backend / precision cannot be provided on this machine."""


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


@dataclass(frozen=True)
class Backends:
    requested: str
    attention: str  # "flash-attn" | "torch-sdpa"
    norm: str  # "apex" | "torch"
    linear: str  # "torch"
    notes: tuple[str, ...] = ()

    def describe(self) -> str:
        note = f" ({'; '.join(self.notes)})" if self.notes else ""
        return (f"backend={self.requested}: attention={self.attention}, norm={self.norm}, "
                f"linear={self.linear}{note}")


def resolve_backends(backend: str = "auto", fp8: str | None = None,
                     device: torch.device | str = "cpu") -> Backends:
    device = torch.device(device)
    te = _installed("transformer_engine")
    if backend not in ("auto", "local", "transformer_engine"):
        raise BackendError(f"config key 'backend': {backend!r} is not one of auto | local | transformer_engine")
    if backend == "transformer_engine" and not te:
        raise BackendError("config key 'backend': transformer_engine was requested but the "
                           "transformer_engine package is not installed")
    if fp8 is not None and not te:
        raise BackendError(f"config key 'fp8': {fp8!r} needs Transformer Engine, which is not installed "
                           f"(set fp8: null)")
    if backend == "transformer_engine" or fp8 is not None:
        raise BackendError("config key 'backend'/'fp8': the Transformer Engine code path is not "
                           "implemented in this version of dept_mega; use backend: auto|local and fp8: null")
    notes = []
    cuda = device.type == "cuda"
    if _installed("flash_attn") and cuda:
        attention = "flash-attn"
        notes.append("flash-attn for fp16/bf16 inputs, sdpa otherwise")
    else:
        attention = "torch-sdpa"
        notes.append("flash-attn " + ("not used on CPU" if _installed("flash_attn") else "not installed"))
    if _installed("apex") and cuda:
        norm = "apex"
    else:
        norm = "torch"
        notes.append("apex " + ("not used on CPU" if _installed("apex") else "not installed"))
    if te:
        notes.append("transformer_engine installed but not used")
    return Backends(requested=backend, attention=attention, norm=norm, linear="torch", notes=tuple(notes))
