"""Position information: ALiBi biases and rotary embeddings (learned positions live in
``embeddings.py`` because they are owned by a source's embeddings).
"""
from __future__ import annotations

import math

import torch

from ..parallel.compiled_math import CudaCompiled


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The ALiBi paper's head slopes: a geometric sequence starting at 2^(-8/n) for n a power
    of two; otherwise the slopes of the nearest lower power of two, then every other slope of
    the next power of two. Returned for ALL heads (fp32); a tensor rank takes its slice."""
    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start * start ** i for i in range(n)]

    if math.log2(num_heads).is_integer():
        slopes = power_of_two(num_heads)
    else:
        closest = 2 ** math.floor(math.log2(num_heads))
        slopes = power_of_two(closest) + alibi_slopes(2 * closest).tolist()[0::2][: num_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


def local_alibi_slopes(num_heads: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    """The global slopes of the heads this tensor rank owns (heads are split contiguously)."""
    per_rank = num_heads // tp_size
    return alibi_slopes(num_heads)[tp_rank * per_rank:(tp_rank + 1) * per_rank]


def causal_alibi_bias(slopes: torch.Tensor, seq_len: int, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
    """Additive attention bias ``[1, heads, s, s]``: ``-slope·(i − j)`` for keys j ≤ i and
    ``-inf`` above the diagonal (the causal mask is folded in)."""
    pos = torch.arange(seq_len, device=device, dtype=torch.float32)
    distance = pos.view(-1, 1) - pos.view(1, -1)  # i - j
    bias = -slopes.to(device).view(-1, 1, 1) * distance.unsqueeze(0)
    bias = bias.masked_fill(distance.unsqueeze(0) < 0, float("-inf"))
    return bias.unsqueeze(0).to(dtype)


def causal_mask_bias(seq_len: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive causal mask ``[1, 1, s, s]``: 0 for keys j ≤ i, ``-inf`` above the diagonal
    (the materialised-bias attention path for RoPE / learned positions)."""
    pos = torch.arange(seq_len, device=device)
    bias = torch.zeros(seq_len, seq_len, device=device, dtype=torch.float32)
    bias = bias.masked_fill(pos.view(1, -1) > pos.view(-1, 1), float("-inf"))
    return bias.view(1, 1, seq_len, seq_len).to(dtype)


class RotaryEmbedding:
    """Rotary position embedding (rotate-half convention, as GPT-NeoX / Megatron's default).

    Not a module: it has no parameters; the cos/sin tables are cached per (length, device).
    """

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head size, got {head_dim}")
        self.head_dim = head_dim
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        self._cache: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (seq_len, str(device))
        if key not in self._cache:
            t = torch.arange(seq_len, dtype=torch.float64)
            freqs = torch.outer(t, self.inv_freq)
            emb = torch.cat([freqs, freqs], dim=-1)  # [s, hd]
            cos = emb.cos().float().to(device).view(seq_len, 1, 1, self.head_dim)
            sin = emb.sin().float().to(device).view(seq_len, 1, 1, self.head_dim)
            self._cache[key] = (cos, sin)
        return self._cache[key]

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[s, b, heads, hd]``; positions are 0..s-1 along dim 0. On CUDA, outside a
        compiled region, the math runs compiled (one fused kernel forward and one backward,
        instead of about ten passes over an fp32 copy of ``x`` each way); inside a compiled
        block it is traced into the block's graph; on CPU it runs eagerly."""
        cos, sin = self.tables(x.shape[0], x.device)
        return _ROPE.on(x.device)(x, cos, sin)


def rope_math(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x [s, b, heads, hd]`` with ``cos``/``sin [s, 1, 1, hd]`` (fp32),
    computed in fp32 and returned in ``x``'s dtype."""
    xf = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


_ROPE = CudaCompiled(rope_math)  # query and key heads, micro-batch and sequence sizes share one graph
