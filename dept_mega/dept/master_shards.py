"""Where a FlatSync finds the fp32 values of its parameters when no rank holds all of them.

With ``optim.distributed`` and half-precision weights (``precision: bf16 | fp16``) the fp32
master weights of a group are sharded over its D data-parallel ranks by the distributed
optimizer (dept_mega/distributed_optimizer.py): rank d holds the masters of shard d of every
gradient bucket, nothing else. The outer sync then works on exactly those shards (what
Megatron-LM users know from the distributed optimizer, applied to DiLoCo's reference):

* this rank's *chunk* of a FlatSync is the concatenation of the masters it owns of the
  FlatSync's parameters (one piece per parameter at most, in the FlatSync's parameter order),
  so Δ, θ_{t-1}, the outer optimizer state and the error-feedback residual are all kept for
  the rank's own masters and read / written in place — no rank ever builds a full fp32 copy;
* after the outer step every rank's updated pieces, cast to the weights' dtype, are
  all-gathered over ``pg.dp`` (category ``dp``; equal parts of the longest chunk) into the
  model weights of every replica.

The chunks are the distributed optimizer's shards, so they differ in length between ranks (the
bucket padding sits at each bucket's end); ``costs.predict_outer_sync`` and the memory model
compute them from the same bucket layout.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..grad_buffer import grad_owner


class ShardedMasters:
    """The pieces of ``params`` (flattened one after another) whose fp32 masters each
    data-parallel rank holds: ``rank_ranges[d]`` = [(start, end), ...] in that flat order, and
    this rank's masters (1-D fp32 tensors, aligned with ``rank_ranges[pg.dp_rank]``)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], pg) -> None:
        self.params = list(params)
        D = pg.dp_size
        self.rank_ranges: list[list[tuple[int, int]]] = [[] for _ in range(D)]
        self.mains: list[torch.Tensor] = []
        offset = 0
        for p in self.params:
            buf = grad_owner(p)
            opt = buf.optimizer if buf is not None else None
            if opt is None or not getattr(opt, "distributed", False) or not opt.half:
                raise RuntimeError(f"ShardedMasters: a parameter of shape {tuple(p.shape)} is not owned by a "
                                   f"distributed optimizer with half-precision weights")
            for d in range(D):
                r = opt.owned_range(p, d)
                if r is not None:
                    self.rank_ranges[d].append((offset + r[0], offset + r[1]))
            main = opt.owned_main(p)
            if main is not None:
                self.mains.append(main)
            offset += p.numel()
        if len(self.mains) != len(self.rank_ranges[pg.dp_rank]):
            raise RuntimeError("ShardedMasters: the optimizer's pieces do not match its bucket layout")
        self._own = self.rank_ranges[pg.dp_rank]
        self.weight_dtype = self.params[0].dtype if self.params else torch.float32

    @torch.no_grad()
    def read(self, device: torch.device) -> torch.Tensor:
        """This rank's chunk of fp32 values (a new tensor)."""
        if not self.mains:
            return torch.zeros(0, dtype=torch.float32, device=device)
        return torch.cat([m.reshape(-1) for m in self.mains]).to(device, torch.float32)

    @torch.no_grad()
    def write(self, chunk: torch.Tensor, add: bool, at: int = 0) -> None:
        """Masters ← ``chunk`` (``add``: masters += ``chunk``), piece by piece; ``chunk`` holds
        the values from element ``at`` of this rank's chunk on (a part, FlatSync.use_parts)."""
        o, end = 0, at + chunk.numel()
        for m in self.mains:
            n = m.numel()
            lo, hi = max(o, at), min(o + n, end)
            if lo < hi:
                dst = m.view(-1)[lo - o:hi - o]
                src = chunk[lo - at:hi - at].to(m.device, m.dtype)
                dst.add_(src) if add else dst.copy_(src)
            o += n

    def send_buffer(self) -> torch.Tensor:
        """This rank's updated masters in the weights' dtype (what the dp all-gather carries)."""
        if not self.mains:
            return torch.zeros(0, dtype=self.weight_dtype)
        return torch.cat([m.reshape(-1) for m in self.mains]).to(self.weight_dtype)

    @torch.no_grad()
    def write_prefix(self, values: torch.Tensor) -> None:
        """The first ``values.numel()`` values of the flattened parameters (one parameter in
        practice: TRIM's rows) ← ``values``: this rank's masters where it owns them and the
        weights everywhere (every replica writes the same values, so no exchange is needed)."""
        values = values.reshape(-1)
        n = values.numel()
        for (a, b), m in zip(self.ranges, self.mains):
            lo, hi = a, min(b, n)
            if lo < hi:
                m[:hi - lo].copy_(values[lo:hi].to(m.device, m.dtype))
        offset = 0
        for p in self.params:
            k = min(p.numel(), max(0, n - offset))
            if k:
                p.data.view(-1)[:k].copy_(values[offset:offset + k].to(p.device, p.dtype))
            offset += p.numel()

    @torch.no_grad()
    def gather_full(self, pg, device: torch.device) -> torch.Tensor:
        """The full fp32 values of the parameters (flattened), gathered from every replica's
        masters over ``pg.dp`` (category ``dp``; a transient copy, e.g. of TRIM's compact table)."""
        full = torch.empty(sum(p.numel() for p in self.params), dtype=torch.float32, device=device)
        for a, b, src in gather_ranges(pg, self.rank_ranges, self.read(device), device, torch.float32):
            full[a:b].copy_(src)
        return full

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return self._own

    @torch.no_grad()
    def write_weights(self, pieces) -> None:
        """The model weights from every rank's gathered pieces ``[(start, end, values)]``."""
        offset = 0
        for p in self.params:
            n = p.numel()
            flat = p.data.view(-1)
            for a, b, src in pieces:
                lo, hi = max(a, offset), min(b, offset + n)
                if lo < hi:
                    flat[lo - offset:hi - offset].copy_(src[lo - a:hi - a])
            offset += n


def gather_ranges(pg, rank_ranges: Sequence[Sequence[tuple[int, int]]], chunk: torch.Tensor,
                  device: torch.device, dtype: torch.dtype) -> list[tuple[int, int, torch.Tensor]]:
    """Every data-parallel replica's chunk — replica d holds the values of ``rank_ranges[d]``
    (flat [start, end) ranges, one after another in its chunk) — gathered over ``pg.dp`` in
    ``dtype`` (category ``dp``): ``[(start, end, values)]`` for all of them. One all-gather of
    equal parts (gloo and NCCL need them): chunks shorter than the longest are padded, and the
    padding is sent and counted."""
    from ..parallel.comm import group_size
    if group_size(pg.dp) == 1:
        out, o = [], 0
        mine = chunk.to(device, dtype)
        for a, b in rank_ranges[pg.dp_rank]:
            out.append((a, b, mine[o:o + b - a]))
            o += b - a
        return out
    lengths = [sum(b - a for a, b in r) for r in rank_ranges]
    m = max(lengths)
    send = chunk.to(device, dtype).contiguous()
    if send.numel() < m:
        send = torch.cat([send, send.new_zeros(m - send.numel())])
    buf = torch.empty(len(rank_ranges) * m, dtype=dtype, device=device)
    pg.comm.all_gather_into(buf, send, pg.dp, category="dp")
    out = []
    for d, ranges in enumerate(rank_ranges):
        o = d * m
        for a, b in ranges:
            out.append((a, b, buf[o:o + b - a]))
            o += b - a
    return out


def sharded_owner(p: torch.nn.Parameter) -> bool:
    """True when ``p``'s fp32 master is sharded: owned by a distributed optimizer with
    half-precision weights (not, e.g., an evaluation copy that no optimizer owns)."""
    buf = grad_owner(p)
    opt = buf.optimizer if buf is not None else None
    return opt is not None and getattr(opt, "distributed", False) and opt.half


def value_access(trainer, params: Sequence[torch.nn.Parameter], pg) -> dict:
    """FlatSync keyword arguments that say where the fp32 values of ``params`` are: the
    distributed optimizer's master shards (``optim.distributed`` with bf16/fp16 weights), else
    the trainer's full masters (``Trainer.main_params`` / ``refresh_model_params``)."""
    if trainer.cfg.optim.distributed and trainer.precision.half:
        return {"shards": ShardedMasters(params, pg)}
    return {"main_params": trainer.main_params, "refresh": trainer.refresh_model_params}
