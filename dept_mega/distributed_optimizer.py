"""The distributed optimizer (``optim.distributed``; Megatron's ``--use-distributed-optimizer``,
ZeRO stage 1): each data-parallel rank of a group keeps the fp32 main parameters and the
AdamW moments of 1/D of the group's parameters only.

Layout. The gradient buffer's buckets are padded to a multiple of D and each bucket is split
into D equal shards; data-parallel rank d owns shard d of every bucket. A parameter may be
cut by shard boundaries: this rank's *pieces* are the intersections of its shards with the
parameters (``Piece``: parameter, range inside the flattened parameter, range in the buffer).
The model weights live in a parameter buffer with the gradient buffer's layout (every
``param.data`` is a view into it), so the updated shards are all-gathered in place.

A step. Backward reduce-scatters each bucket over ``pg.dp`` into this rank's shard (launched
from the backward hooks, :mod:`dept_mega.grad_buffer`); the trainer all-reduces the shards of
tied-embedding and sequence-parallel gradients (the tied word embedding has a bucket of its
own, so the first and last stage shard it identically; TP ranks share one layout) and computes
the gradient norm over the pieces of the parameters this rank counts, summed over the whole
source group (tp × dp × pp); AdamW updates the pieces' fp32 main parameters; each bucket's
shard of the weights is all-gathered over ``pg.dp`` (category ``dp``).

Main parameters. Under ``precision: fp32`` a piece's main parameter *is* the view of the
weight buffer (no copy), so code that writes ``param.data`` (DEPT's outer sync) updates the
optimizer's parameters too. Under bf16/fp16 the pieces have fp32 copies, initialised from the
fp32 weights before they are cast; full fp32 masters exist on no rank, so DEPT's outer sync
with half-precision weights reads and writes these shards (``dept/master_shards.py``).

Checkpoints: each piece's state is a box of the parameter's global tensor
(``checkpoint_items``, ``dept_mega.checkpoint_format``), so any layout reads it;
:meth:`state_dict` (a source's state moved between groups) records the rank's pieces
(``"shard"``) and loads only into the same rank, size and bucket layout.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import torch

from .config import OptimConfig
from .optimizer import InnerOptimizer
from .parallel.groups import ParallelGroups
from .precision import Precision


@dataclass
class Piece:
    param: torch.nn.Parameter
    index: int  # position of the parameter in the optimizer's list
    start: int  # [start, end) in the flattened parameter
    end: int
    buf_start: int  # [buf_start, buf_end) in the gradient / weight buffers
    buf_end: int
    main: torch.Tensor  # fp32 main parameter of the piece


class DistributedOptimizer(InnerOptimizer):
    distributed = True

    def _setup_main_params(self) -> None:
        dtype = self.precision.param_dtype
        buf = self.buffer
        pg = self.pg
        for p in self.params:
            if self.half and p.dtype != torch.float32:
                raise RuntimeError(f"optim.distributed: parameter {self.names.get(id(p), tuple(p.shape))} is "
                                   f"already {p.dtype}; its fp32 master would be the rounded weight")
        fp32 = {id(p): p.data for p in self.params}  # the values before the cast
        self.weights = torch.zeros(buf.numel, dtype=dtype, device=self.device)
        with torch.no_grad():
            for p in self.params:
                s, e = buf.ranges[id(p)]
                self.weights[s:e].copy_(p.data.reshape(-1))
                p.data = self.weights[s:e].view_as(p)
        index = {id(p): i for i, p in enumerate(self.params)}
        self.pieces: list[Piece] = []
        for b in buf.buckets:
            ss, se = b.shard_range(pg.dp_rank, buf.shards)
            for p in b.params:
                ps, pe = buf.ranges[id(p)]
                a, e = max(ps, ss), min(pe, se)
                if a >= e:
                    continue
                if self.half:
                    main = fp32[id(p)].reshape(-1)[a - ps:e - ps].to(torch.float32).clone()
                else:
                    main = self.weights[a:e]  # a view: the weights are the main parameters
                self.pieces.append(Piece(p, index[id(p)], a - ps, e - ps, a, e, main))
        self._piece_of = {id(pc.param): pc for pc in self.pieces}

    def _groups(self) -> list[dict]:
        decay = [pc.main for pc in self.pieces if pc.param.dim() >= 2]
        no_decay = [pc.main for pc in self.pieces if pc.param.dim() < 2]
        return [{"params": decay, "weight_decay": self.cfg.weight_decay},
                {"params": no_decay, "weight_decay": 0.0}]

    # -- ownership ---------------------------------------------------------------------------
    def owned_range(self, p: torch.nn.Parameter, rank: int) -> Optional[tuple[int, int]]:
        """[start, end) of flattened ``p`` whose fp32 main parameter data-parallel rank ``rank``
        holds (None: none of it). Every rank of the group can compute it for every rank: the
        buffer layout is the same on all of them."""
        b = self.buffer.bucket_of[id(p)]
        ss, se = b.shard_range(rank, self.buffer.shards)
        ps, pe = self.buffer.ranges[id(p)]
        a, e = max(ps, ss), min(pe, se)
        return (a - ps, e - ps) if a < e else None

    def owned_main(self, p: torch.nn.Parameter) -> Optional[torch.Tensor]:
        """This rank's fp32 main parameter of ``p``'s piece (1-D; :meth:`owned_range` of this
        rank), or None."""
        pc = self._piece_of.get(id(p))
        return None if pc is None else pc.main

    # -- gradients -----------------------------------------------------------------------------
    def grad_view(self, p: torch.nn.Parameter) -> Optional[torch.Tensor]:
        """This rank's reduced shard of ``p``'s gradient (None when it owns no piece of ``p``)."""
        pc = self._piece_of.get(id(p))
        return None if pc is None else self.buffer.data[pc.buf_start:pc.buf_end]

    def reduced_grads(self) -> list[torch.Tensor]:
        return [self.buffer.data[pc.buf_start:pc.buf_end] for pc in self.pieces if self.received(pc.param)]

    # -- step ----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        data = self.buffer.data
        mains = []
        for pc in self.pieces:
            if not self.received(pc.param):
                continue
            g = data[pc.buf_start:pc.buf_end]
            pc.main.grad = g if g.dtype == torch.float32 else g.to(torch.float32)
            mains.append(pc.main)
        self.inner.step()
        for m in mains:
            m.grad = None
        if self.half:
            for pc in self.pieces:
                self.weights[pc.buf_start:pc.buf_end].copy_(pc.main)
        self.gather_weights()

    @torch.no_grad()
    def gather_weights(self) -> None:
        """All-gather every bucket's updated shard over ``pg.dp`` (category ``dp``)."""
        pg = self.pg
        works = []
        for b in self.buffer.buckets:
            ss, se = b.shard_range(pg.dp_rank, self.buffer.shards)
            shard = self.weights[ss:se].clone()
            works.append((pg.comm.all_gather_into(self.weights[b.start:b.end], shard, pg.dp, "dp", async_op=True),
                          shard))
        for work, _ in works:
            work.wait()

    # -- weights written outside the optimizer ---------------------------------------------
    @torch.no_grad()
    def refresh_model_params(self) -> None:
        """This rank's pieces of the weights from the main parameters (the other ranks' pieces
        are theirs: a collective :meth:`gather_weights` would bring them)."""
        if self.half:
            for pc in self.pieces:
                self.weights[pc.buf_start:pc.buf_end].copy_(pc.main)

    @torch.no_grad()
    def copy_model_to_main(self) -> None:
        if self.half:
            for pc in self.pieces:
                pc.main.copy_(self.weights[pc.buf_start:pc.buf_end])

    # -- state -------------------------------------------------------------------------------
    def _piece_key(self, pc: Piece, key: str) -> str:
        return f"{key}/dp{self.pg.dp_rank}of{self.pg.dp_size}:{pc.start}-{pc.end}"

    def checkpoint_items(self) -> list[tuple[str, torch.nn.Parameter, torch.Tensor, Optional[tuple[int, int]]]]:
        """As :meth:`InnerOptimizer.checkpoint_items`, each piece's state flat with its range
        [start, end) of the flattened parameter shard (the step count is per piece: equal)."""
        out = []
        for pc in self.pieces:
            for k, v in (self.inner.state.get(pc.main) or {}).items():
                if torch.is_tensor(v):
                    out.append((k, pc.param, v, None if v.dim() == 0 else (pc.start, pc.end)))
            if self.half:
                out.append(("main_param", pc.param, pc.main, (pc.start, pc.end)))
        return out

    def checkpoint_tensors(self, key_of: Callable[[torch.nn.Parameter], Optional[str]]) -> dict[str, torch.Tensor]:
        """Format 1 (``dept_mega.checkpoint_v1``): ``{moment}/{param key}/dp{d}of{D}:{start}-{end}``."""
        out: dict[str, torch.Tensor] = {}
        for pc in self.pieces:
            key = key_of(pc.param)
            if key is None:
                continue
            key = self._piece_key(pc, key)
            for k, v in (self.inner.state.get(pc.main) or {}).items():
                if torch.is_tensor(v):
                    out[f"{k}/{key}"] = v
            if self.half:
                out[f"main_param/{key}"] = pc.main
        return out

    def pieces_signature(self) -> list[tuple[int, int, int]]:
        return [(pc.index, pc.start, pc.end) for pc in self.pieces]

    def _model_of_main(self) -> dict[int, torch.nn.Parameter]:
        return {id(pc.main): pc.param for pc in self.pieces}

    def shard(self) -> dict:
        """What :meth:`state_dict` records of this rank's shard (``"shard"``): its data-parallel
        rank and size and its pieces (:meth:`pieces_signature`)."""
        return {"dp_rank": self.pg.dp_rank, "dp_size": self.pg.dp_size, "pieces": self.pieces_signature()}

    def state_dict(self) -> dict:
        sd = self.inner.state_dict()
        sd["shard"] = self.shard()
        if self.half:
            sd["main_params"] = [pc.main for pc in self.pieces]
        return sd

    @torch.no_grad()
    def load_state_dict(self, sd: dict, with_masters: bool = True) -> None:
        sd = dict(sd)
        shard = sd.pop("shard", None)
        mains = sd.pop("main_params", None)
        mine = self.shard()
        if shard is None or (shard["dp_rank"], shard["dp_size"]) != (mine["dp_rank"], mine["dp_size"]) \
                or [tuple(x) for x in shard["pieces"]] != mine["pieces"]:
            got = "a non-distributed optimizer" if shard is None else \
                f"data-parallel rank {shard['dp_rank']} of {shard['dp_size']}"
            raise ValueError(f"optim.distributed: this optimizer state was saved by {got}; it loads only into "
                             f"the same data-parallel rank, size and bucket layout (rank {mine['dp_rank']} of "
                             f"{mine['dp_size']} here)")
        self.inner.load_state_dict(sd)
        if self.half and mains is not None and with_masters:
            for pc, m in zip(self.pieces, mains):
                pc.main.copy_(m)
            self.refresh_model_params()


def build_optimizer(params: Iterable[torch.nn.Parameter], optim: OptimConfig, pg: ParallelGroups,
                    device: torch.device, precision: Precision, shared: Sequence[torch.nn.Parameter] = (),
                    names: Optional[dict[int, str]] = None) -> InnerOptimizer:
    """The inner optimizer of ``optim.distributed`` over ``params``."""
    if optim.distributed:
        return DistributedOptimizer(params, optim, pg, device, precision, shared=shared, names=names)
    return InnerOptimizer(params, optim, pg, device, precision, shared=shared, names=names)
