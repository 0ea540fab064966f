"""Block-wise quantisation of the outer pseudo-gradient (``dept.outer_comm_dtype``).

A 1-D fp32 tensor of n values is cut into blocks of ``block`` consecutive values (the last
one may be shorter); each block gets one fp32 scale ``amax(|x|) / qmax`` and its values are
stored as ``x / scale`` in the target format:

========  =====================================  =========================================
format    payload                                error bound per value (``a`` = block amax)
========  =====================================  =========================================
``int8``  round-to-nearest int8 in [-127, 127]   ``a / 254``
``int4``  round-to-nearest in [-7, 7], two per   ``a / 14``
          byte (low nibble first, offset 8)
``fp8``   float8 e4m3 (``x / scale`` in ±448)    ``|x| / 16 + a / 448 · 2**-9`` (3 mantissa
                                                 bits; subnormals near 0)
========  =====================================  =========================================

The wire buffer of one shard is a single uint8 tensor ``[scales (4·nblocks bytes) | payload]``
so that one collective moves both and the byte counters see both (:func:`packed_nbytes`).
A block of zeros has scale 0 and decodes to zeros.
"""
from __future__ import annotations

import math

import torch

QUANT_FORMATS = ("fp8", "int8", "int4")
QMAX = {"int8": 127.0, "int4": 7.0, "fp8": 448.0}


def num_blocks(n: int, block: int) -> int:
    return int(math.ceil(n / block)) if n else 0


def payload_nbytes(n: int, fmt: str) -> int:
    return (n + 1) // 2 if fmt == "int4" else n


def packed_nbytes(n: int, fmt: str, block: int) -> int:
    """Bytes of the wire buffer of ``n`` values: fp32 scales + payload."""
    if fmt not in QUANT_FORMATS:
        raise ValueError(f"dept.outer_comm_dtype: {fmt!r} is not a block-quantised format {QUANT_FORMATS}")
    return 4 * num_blocks(n, block) + payload_nbytes(n, fmt)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    nb = num_blocks(x.numel(), block)
    pad = nb * block - x.numel()
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    return x.view(nb, block)


@torch.no_grad()
def encode(x: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
    """``x`` (1-D fp32) -> the packed uint8 wire buffer."""
    if x.dtype != torch.float32 or x.dim() != 1:
        raise TypeError("encode: expected a 1-D fp32 tensor")
    n = x.numel()
    xb = _blocks(x, block)
    scale = xb.abs().amax(dim=1) / QMAX[fmt]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = (xb / safe[:, None]).reshape(-1)[:n]
    if fmt == "fp8":
        payload = y.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    elif fmt == "int8":
        payload = y.round_().clamp_(-127, 127).to(torch.int8).view(torch.uint8)
    else:  # int4: offset to [1, 15], two nibbles per byte
        q = y.round_().clamp_(-7, 7).to(torch.int16).add_(8)
        if n % 2:
            q = torch.cat([q, q.new_full((1,), 8)])
        q = q.view(-1, 2)
        payload = (q[:, 0] | (q[:, 1] << 4)).to(torch.uint8)
    out = torch.empty(packed_nbytes(n, fmt, block), dtype=torch.uint8, device=x.device)
    ns = 4 * scale.numel()
    out[:ns].copy_(scale.contiguous().view(torch.uint8))
    out[ns:].copy_(payload)
    return out


@torch.no_grad()
def decode(buf: torch.Tensor, n: int, fmt: str, block: int) -> torch.Tensor:
    """The packed buffer of :func:`encode` -> ``n`` fp32 values."""
    nb = num_blocks(n, block)
    if buf.numel() != packed_nbytes(n, fmt, block):
        raise ValueError(f"decode: buffer of {buf.numel()} bytes, expected {packed_nbytes(n, fmt, block)}")
    scale = buf[:4 * nb].clone().view(torch.float32)
    payload = buf[4 * nb:]
    if fmt == "fp8":
        y = payload.clone().view(torch.float8_e4m3fn).to(torch.float32)
    elif fmt == "int8":
        y = payload.clone().view(torch.int8).to(torch.float32)
    else:
        p = payload.to(torch.int16)
        y = torch.stack([p & 15, p >> 4], dim=1).reshape(-1)[:n].to(torch.float32).sub_(8.0)
    yb = _blocks(y, block)
    return (yb * scale[:, None]).reshape(-1)[:n]


def error_bound(x: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
    """The per-value bound of the table above (for tests and docs)."""
    a = _blocks(x.abs(), block).amax(dim=1, keepdim=True).expand(-1, block).reshape(-1)[:x.numel()]
    if fmt == "int8":
        return a / 254.0
    if fmt == "int4":
        return a / 14.0
    return x.abs() / 16.0 + a / 448.0 * 2.0 ** -9
