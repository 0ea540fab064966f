"""Collectives that count their bytes by category.

Every collective in dept_mega goes through a :class:`Comm`, which adds the payload this rank
puts on the wire to a per-category counter (``tp``, ``pp``, ``dp``,
``outer_body``, ``outer_embedding``, ``source_move``).

Counting convention (docs/metrics.md, `outer` records): a rank counts the bytes of the
tensor it contributes — ``all_reduce``/``reduce_scatter``: its input; ``all_gather``: its
shard; ``broadcast``: the source rank only; ``send``: the tensor; ``recv``: nothing. Summed
over the ranks of a job this is the payload of the algorithm, independent of how the backend
routes it (ring, tree), which is what the paper's Table 1 counts.

A group of size 1 (or ``None`` on a single process) makes every call a no-op that counts
nothing, so the same code runs without ``torch.distributed``.

``all_reduce``, ``reduce_scatter_into`` and ``all_gather_into`` take ``async_op=True`` (the
overlapped gradient reduction): they then return a handle with ``wait()`` (a finished one for
size-1 groups). Bytes are counted when the collective is launched, exactly as when blocking.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Optional, Sequence

import time

import torch
import torch.distributed as dist

# torch >= 2.13 names them *_single (the *_tensor names warn once per call site and rank)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

CATEGORIES = ("tp", "pp", "dp", "outer_body", "outer_embedding", "source_move")


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    if isinstance(group, CrossJob):
        return group.size()
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


class CrossJob:
    """A communicator across jobs (federated source groups, ``dept.federation.FederatedOuter``)
    that stands where a process group would: ``size()``, a summing ``all_reduce`` and an
    ``all_gather_into`` (both blocking; they count what they commit), ``atomic``, and their
    launched forms ``all_reduce_async`` / ``all_gather_async`` (counted at launch): a handle
    whose ``wait()`` commits the exchange and whose ``groups`` is the number of groups it holds."""

    def size(self) -> int:
        raise NotImplementedError

    def all_reduce(self, t: torch.Tensor, comm: "Comm", category: str) -> torch.Tensor:
        raise NotImplementedError

    def all_gather_into(self, out: torch.Tensor, shard: torch.Tensor, comm: "Comm", category: str) -> torch.Tensor:
        raise NotImplementedError

    def atomic(self, fn, comm: "Comm"):
        """Run ``fn()``, whose collectives on this communicator depend on each other, as one
        exchange (committed once, redone whole on a failure); returns its result."""
        raise NotImplementedError

    def all_reduce_async(self, t: torch.Tensor, comm: "Comm", category: str):
        raise NotImplementedError

    def all_gather_async(self, out: torch.Tensor, shard: torch.Tensor, comm: "Comm", category: str):
        raise NotImplementedError


class Done:
    """The handle of a collective that had nothing to do (size-1 group)."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class SlowWork:
    """The handle of a collective on a simulated slow link: done ``delay`` seconds after launch."""

    def __init__(self, work, ready_at: float) -> None:
        self.work, self.ready_at = work, ready_at

    def wait(self) -> bool:
        self.work.wait()
        left = self.ready_at - time.perf_counter()
        if left > 0:
            time.sleep(left)
        return True

    def is_completed(self) -> bool:
        return time.perf_counter() >= self.ready_at and self.work.is_completed()


class Comm:
    """Byte-counting wrappers around ``torch.distributed`` collectives."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self._slow: Optional[tuple] = None  # (group, latency_s, bytes_per_s): test-only

    # -- a simulated slow link (tests) ---------------------------------------------------
    def simulate_slow_link(self, group, latency_s: float = 0.0, bytes_per_s: Optional[float] = None) -> None:
        """Test-only: collectives over ``group`` finish ``latency_s + bytes / bytes_per_s`` seconds
        after launch (blocking calls sleep, async handles are not done before). ``group=None``
        switches it off."""
        self._slow = None if group is None else (group, float(latency_s), bytes_per_s)

    def _slowed(self, group, nbytes: int, work, async_op: bool):
        if self._slow is None or group is not self._slow[0]:
            return work
        _, latency, bw = self._slow
        ready = time.perf_counter() + latency + (nbytes / bw if bw else 0.0)
        slow = SlowWork(work if async_op else Done(), ready)
        if not async_op:
            slow.wait()
        return slow

    # -- accounting ----------------------------------------------------------------------
    def count(self, category: str, nbytes: int) -> None:
        if category not in CATEGORIES:
            raise ValueError(f"unknown communication category {category!r}; expected one of {CATEGORIES}")
        self.bytes[category] += int(nbytes)
        self.calls[category] += 1

    def snapshot(self) -> dict[str, int]:
        return {c: int(self.bytes.get(c, 0)) for c in CATEGORIES}

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    @staticmethod
    def _nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    # -- collectives ---------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, group, category: str, op=dist.ReduceOp.SUM, async_op: bool = False):
        """In place; returns ``t`` (with ``async_op``: a handle to ``wait()`` on)."""
        if group_size(group) == 1:
            return Done() if async_op else t
        if isinstance(group, CrossJob):  # blocking, counts what it commits; async: committed at wait()
            if op != dist.ReduceOp.SUM:
                raise ValueError("a cross-job all_reduce sums")
            if async_op:
                return group.all_reduce_async(t, self, category)
            group.all_reduce(t, self, category)
            return t
        self.count(category, self._nbytes(t))
        work = dist.all_reduce(t, op=op, group=group, async_op=async_op)
        work = self._slowed(group, self._nbytes(t), work, async_op)
        return work if async_op else t

    def all_gather_into(self, out: torch.Tensor, shard: torch.Tensor, group, category: str,
                        async_op: bool = False):
        """``out`` = the shards of every rank concatenated along dim 0 (with ``async_op``: a
        handle to ``wait()`` on; ``shard`` must not be modified before)."""
        if group_size(group) == 1:
            out.copy_(shard)
            return Done() if async_op else out
        if isinstance(group, CrossJob):  # blocking, counts what it commits; async: committed at wait()
            if async_op:
                return group.all_gather_async(out, shard, self, category)
            group.all_gather_into(out, shard, self, category)
            return out
        self.count(category, self._nbytes(shard))
        work = _all_gather_single(out, shard.contiguous(), group=group, async_op=async_op)
        work = self._slowed(group, self._nbytes(out), work, async_op)
        return work if async_op else out

    def all_gather_list(self, shards: list[torch.Tensor], shard: torch.Tensor, group, category: str) -> list[torch.Tensor]:
        """Gather tensors that may differ in size along dim 0 (``shards`` preallocated)."""
        if group_size(group) == 1:
            shards[0].copy_(shard)
            return shards
        self.count(category, self._nbytes(shard))
        dist.all_gather(shards, shard.contiguous(), group=group)
        return shards

    def reduce_scatter_into(self, out: torch.Tensor, full: torch.Tensor, group, category: str,
                            op=dist.ReduceOp.SUM, async_op: bool = False):
        """``out`` = this rank's dim-0 chunk of the sum of every rank's ``full`` (with
        ``async_op``: a handle to ``wait()`` on)."""
        if group_size(group) == 1:
            out.copy_(full)
            return Done() if async_op else out
        self.count(category, self._nbytes(full))
        work = _reduce_scatter_single(out, full.contiguous(), op=op, group=group, async_op=async_op)
        return work if async_op else out

    def broadcast(self, t: torch.Tensor, src: int, group, category: str) -> torch.Tensor:
        """``src`` is a global rank."""
        if group_size(group) == 1:
            return t
        if dist.get_rank() == src:
            self.count(category, self._nbytes(t))
        dist.broadcast(t, src=src, group=group)
        return t

    def send(self, t: torch.Tensor, dst: int, category: str, group=None) -> None:
        self.count(category, self._nbytes(t))
        dist.send(t.contiguous(), dst=dst, group=group)

    def recv(self, t: torch.Tensor, src: int, group=None) -> torch.Tensor:
        dist.recv(t, src=src, group=group)
        return t

    def isend(self, t: torch.Tensor, dst: int, category: str, group=None):
        self.count(category, self._nbytes(t))
        return dist.isend(t.contiguous(), dst=dst, group=group)

    def irecv(self, t: torch.Tensor, src: int, group=None):
        return dist.irecv(t, src=src, group=group)

    def batch_isend_irecv(self, ops: Sequence[tuple[bool, torch.Tensor, int]], group, category: str) -> list:
        """Post ``ops`` = ``[(is_send, tensor, global peer rank), ...]`` as one batch
        (``torch.distributed.batch_isend_irecv``: one NCCL group call, so a send and a receive
        of the batch never wait for each other) and return the works to wait on. Sends count
        their tensor's bytes; receives count nothing. Tensors must be contiguous and stay alive
        until the works are waited on. Between two ranks, messages in one direction are
        matched first-in first-out, in list order within a batch."""
        p2p = []
        for is_send, t, peer in ops:
            if not t.is_contiguous():
                raise ValueError("batch_isend_irecv: tensors must be contiguous")
            if is_send:
                self.count(category, self._nbytes(t))
            p2p.append(dist.P2POp(dist.isend if is_send else dist.irecv, t, peer, group))
        return dist.batch_isend_irecv(p2p) if p2p else []


def bookkeeping_device(group=None) -> torch.device:
    """Where a bookkeeping tensor must live to be reduced over ``group``: NCCL reduces CUDA
    tensors only (the current device, set by ``init_distributed``), gloo CPU tensors."""
    if dist.is_initialized() and "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def total_over_ranks(counts: dict[str, int], group=None) -> dict[str, int]:
    """Sum per-category counters over the ranks of ``group`` (all ranks when None).

    The reduction itself is bookkeeping and is not counted.
    """
    values = torch.tensor([counts.get(c, 0) for c in CATEGORIES], dtype=torch.float64,
                          device=bookkeeping_device(group))
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(values, group=group)
    return {c: int(v) for c, v in zip(CATEGORIES, values.tolist())}
