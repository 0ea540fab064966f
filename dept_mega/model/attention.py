"""The attention core: ``softmax(QKᵀ/√d + position bias, causal)·V`` for this rank's heads.

Four implementations, chosen by ``model.attention_backend`` (``backends.py`` resolves ``auto``):

* ``flash`` — flash-attn's ``flash_attn_func`` (CUDA, fp16/bf16 inputs): causal, GQA native,
  ALiBi through ``alibi_slopes``. Dropout: yes (the kernel's Philox stream, seeded from our
  tensor-parallel stream by ``RNGTracker.fork_device_rng``).
* ``flex`` — ``torch.nn.attention.flex_attention``: the causal mask as a block mask (fully
  masked tiles are skipped), ALiBi as a ``score_mod`` (``score − slope_h·(i − j)``, fp32), GQA
  through ``enable_gqa``; compiled with ``torch.compile`` (uncompiled flex materialises the
  scores and warns; tests use it for the numerics only). Dropout: flex_attention has none —
  ``attention_dropout > 0`` with ``flex`` is a configuration error.
* ``sdpa`` — ``F.scaled_dot_product_attention(is_causal=True, enable_gqa=...)`` with no bias, so
  PyTorch may pick its flash / memory-efficient kernels: RoPE and learned positions only.
  Dropout: yes (seeded from our stream as for flash).
* ``bias`` — SDPA with a materialised additive bias ``[1, H, s, s]`` (ALiBi − and −inf above
  the diagonal; for RoPE / learned, the causal mask only) and K/V repeated per query group:
  the path of earlier versions, the last fallback (no fused kernel takes an arbitrary bias).
  Dropout: yes (as sdpa).

Under ``train.compile`` the self-attention module runs eagerly in training when attention
dropout is on (``layers.SelfAttention``), so its masks stay those of the eager run. All four compute the same function; dropout masks differ between kernels (each draws its own
way), so with ``attention_dropout > 0`` runs on different paths are not bit-comparable. Each
path is deterministic given our RNG streams, which is what recomputation needs.

Layout: inputs ``q [s, b, H, d]``, ``k, v [s, b, G, d]`` (G query groups, H = G·q_per_group);
output ``[s, b, H, d]``. The ``flex`` kernel takes ``[b, H, s, d]`` views of these and writes its
output (and the q/k/v gradients) densely in its query's memory order, i.e. as ``[s, b, H, d]``
tensors; the permutes to and from that view happen inside the compiled region (``FlexState``),
so the region's output is a contiguous ``[s, b, H, d]`` tensor. Were it the ``[b, H, s, d]``
view, AOT autograd would copy its incoming gradient to contiguous ``[b, H, s, d]`` in every
backward (torch up to 2.12: ``torch._functorch.config.guess_tangent_strides_as_outputs`` is
False, so a compiled region's output gradients are expected in contiguous memory format).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..parallel.random import RNGTracker

try:  # optional fused kernel; only used on CUDA (see backends.py)
    from flash_attn import flash_attn_func as _flash_attn_func  # type: ignore
except Exception:  # noqa: BLE001 - any import failure means "not usable"
    _flash_attn_func = None

KINDS = ("flash", "flex", "sdpa", "bias")


def flash_attn_available() -> bool:
    return _flash_attn_func is not None


class FlexState:
    """What flex_attention needs, shared by the layers of one body, all built outside any
    compiled region: the kernel when the state is made (with the model), the ALiBi
    ``score_mod`` (its slopes on the device, fp32) and the causal block mask per device and
    length by :meth:`prepare`, which runs for ``model.seq_length`` when the model is built and
    for the input's length in the body's forward, before its blocks.

    Under ``train.compile`` a compiled block therefore only reads tensors and closures made
    beforehand (no graph break, no recompile for lazily created state) and calls the plain
    ``flex_attention``, which Dynamo traces into the block's graph; outside a compiled region
    the kernel is ``torch.compile(flex_attention)`` (``compile=False``: the unfused eager
    kernel, for tests of the numerics)."""

    MAX_MASKS = 8

    def __init__(self, slopes: Optional[torch.Tensor], *, compile: bool = True) -> None:
        from torch.nn.attention.flex_attention import flex_attention
        self.slopes = slopes
        self.compile = compile
        self._plain: Callable = _sbhd(flex_attention)
        self._kernel: Callable = torch.compile(self._plain, dynamic=False) if compile else self._plain
        self._masks: dict[tuple[int, str], object] = {}
        self._score_mods: dict[str, Callable] = {}

    def __deepcopy__(self, memo) -> "FlexState":
        return self  # built once per body, shared by its layers

    def prepare(self, seq_len: int, device: torch.device | str) -> None:
        """Make the block mask for ``seq_len`` and the score_mod on ``device`` (call outside
        compiled code; a no-op when they exist)."""
        from torch.nn.attention.flex_attention import create_block_mask
        dev = _device_key(device)
        if self.slopes is not None and dev not in self._score_mods:
            self._score_mods[dev] = _alibi_score_mod(self.slopes.to(device=device, dtype=torch.float32))
        key = (int(seq_len), dev)
        if key not in self._masks:
            if len(self._masks) >= self.MAX_MASKS:
                self._masks.clear()
            self._masks[key] = create_block_mask(_causal, None, None, key[0], key[0], device=device)

    def prepared(self, seq_len: int, device: torch.device | str) -> tuple[Optional[Callable], object]:
        """(score_mod, block_mask) for ``seq_len`` on ``device``, made if needed (outside compiled
        code): what :meth:`__call__` passes to flex_attention (benchmarks/attention_bench.py
        passes the same with other kernel options)."""
        self.prepare(seq_len, device)
        dev = _device_key(device)
        return (self._score_mods[dev] if self.slopes is not None else None), self._masks[(int(seq_len), dev)]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool) -> torch.Tensor:
        """``q [s, b, H, d]``, ``k, v [s, b, G, d]`` -> ``[s, b, H, d]`` (see the module doc)."""
        key = (q.shape[0], _device_key(q.device))
        if key not in self._masks:
            if torch.compiler.is_compiling():  # Dynamo would trace the mask's construction into the block
                raise RuntimeError(f"flex_attention: nothing prepared for length {key[0]} on {key[1]}; "
                                   "FlexState.prepare must run before a compiled block (the body's forward does)")
            self.prepare(*key)
        score_mod = self._score_mods[key[1]] if self.slopes is not None else None
        # inside a compiled block the plain function (Dynamo traces it), else the compiled kernel
        fn = self._plain if torch.compiler.is_compiling() else self._kernel
        return fn(q, k, v, score_mod=score_mod, block_mask=self._masks[key], enable_gqa=enable_gqa)


def _sbhd(flex_attention: Callable) -> Callable:
    """``flex_attention`` on ``q [s, b, H, d]``, ``k, v [s, b, G, d]``, returning ``[s, b, H, d]``:
    the kernel sees ``[b, heads, s, d]`` views and lays its output out in the query's memory
    order, so the permute returned is contiguous (the point of compiling this function rather
    than ``flex_attention`` itself: see the module doc)."""

    def attend(q, k, v, score_mod, block_mask, enable_gqa):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        out = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=enable_gqa)
        return out.permute(2, 0, 1, 3)

    return attend


def _device_key(device: torch.device | str) -> str:
    """``cuda`` and ``cuda:<current>`` are one device (the model may be built with either)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _alibi_score_mod(slopes: torch.Tensor) -> Callable:
    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx)

    return alibi


def flash_takes(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether flash attention runs on inputs of ``device`` and ``dtype`` (fp16 / bf16 CUDA
    tensors); other inputs take the plan's fallback."""
    return torch.device(device).type == "cuda" and dtype in (torch.float16, torch.bfloat16)


class CoreAttention(nn.Module):
    """One of the implementations above (``kind``); ``fallback``: the kind used when ``flash``
    was chosen by ``auto`` but the inputs are not fp16/bf16 CUDA tensors. ``positions`` is the
    body's ``PositionState`` (ALiBi slopes, bias cache, ``flex`` state)."""

    def __init__(self, kind: str, positions, *, q_per_group: int, dropout_p: float,
                 rng: Optional[RNGTracker], fallback: Optional[str] = None) -> None:
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"unknown attention kind {kind!r}")
        if kind == "flash" and _flash_attn_func is None:
            raise ValueError("attention kind flash needs the flash_attn package")
        if kind == "flex" and dropout_p > 0:
            raise ValueError("flex_attention cannot apply attention dropout")
        if kind == "flex" or fallback == "flex":
            if positions.flex is None:
                raise ValueError("attention kind flex needs a PositionState made with flex=True")
        if kind == "sdpa" and positions.slopes is not None:
            raise ValueError("the sdpa attention kind takes no ALiBi bias; use flash, flex or bias")
        self.kind = kind
        self.fallback = fallback
        self.positions = positions
        self.q_per_group = q_per_group
        self.dropout_p = dropout_p
        self.rng = rng

    def extra_repr(self) -> str:
        return f"{self.kind}" + (f" (fallback {self.fallback})" if self.fallback else "")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p = self.dropout_p if self.training else 0.0
        if p > 0.0 and self.rng is None:
            raise ValueError("attention dropout > 0 needs an RNGTracker")
        kind = self.kind
        if kind == "flash" and not flash_takes(q.device, q.dtype):
            if self.fallback is None:
                raise RuntimeError(f"model.attention_backend: flash needs fp16/bf16 CUDA inputs, got {q.dtype} "
                                   f"on {q.device}")
            kind = self.fallback
        if kind == "flash":
            return self._flash(q, k, v, p)
        if kind == "flex":  # [s, b, H, d] in and out; FlexState permutes inside its compiled region
            return self.positions.flex(q, k, v, enable_gqa=self.q_per_group > 1)
        # [s, b, H, d] -> [b, H, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        if kind == "sdpa":
            out = self._dropout_wrap(p, lambda: F.scaled_dot_product_attention(
                q, k, v, dropout_p=p, is_causal=True, enable_gqa=self.q_per_group > 1))
        else:
            out = self._bias(q, k, v, p)
        return out.permute(2, 0, 1, 3)  # [s, b, H, d]

    def _dropout_wrap(self, p: float, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        if p > 0.0:
            with self.rng.fork_device_rng(tensor_parallel=True):
                return fn()
        return fn()

    def _bias(self, q, k, v, p: float) -> torch.Tensor:
        if self.q_per_group > 1:
            k = k.repeat_interleave(self.q_per_group, dim=1)
            v = v.repeat_interleave(self.q_per_group, dim=1)
        bias = self.positions.attention_bias(q.shape[2], q.dtype, q.device)
        return self._dropout_wrap(p, lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=p))

    def _flash(self, q, k, v, p: float) -> torch.Tensor:  # pragma: no cover - CUDA + flash-attn only
        # flash-attn layout [b, s, H, d]; GQA and ALiBi slopes are native.
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        slopes = self.positions.slopes.to(q.device) if self.positions.slopes is not None else None
        out = self._dropout_wrap(p, lambda: _flash_attn_func(q, k, v, dropout_p=p, causal=True, alibi_slopes=slopes))
        return out.transpose(0, 1)
