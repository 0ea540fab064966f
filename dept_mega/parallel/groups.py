"""The process-group object: every group of docs/launching.md §2, built once and passed explicitly.

world = G × D × P × T with rank order, fastest-varying first, tp, dp, pp, group:

    rank = tp + T * (dp + D * (pp + P * g))

so a source group g is the contiguous block of D·P·T ranks starting at g·D·P·T.

Groups held (``None`` when the job is a single process without ``torch.distributed``):
``tp``, ``dp``, ``pp`` (inside a source group), ``model_parallel`` (tp×pp inside a group:
gradient-norm reduction), ``source_group`` (all ranks of one group), ``embedding`` (first and
last pipeline stage of one tp/dp position, for tied embeddings), ``outer`` (same tp, dp, pp
position in every group), ``tp_dp`` (the tensor × data-parallel ranks of one pipeline stage
of one group: Transformer Engine's FP8 amax reduction group; the ``tp`` or ``dp`` handle itself
when the other size is 1) and ``world``.
"""
from __future__ import annotations

import os
from datetime import timedelta
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from .comm import Comm
from .device import check_local_rank, local_world_size, use_cuda as device_is_cuda


@dataclass(frozen=True)
class Coords:
    tp: int
    dp: int
    pp: int
    group: int


@dataclass
class ParallelGroups:
    tp_size: int
    dp_size: int
    pp_size: int
    num_groups: int
    rank: int
    coords: Coords
    tp: Optional[dist.ProcessGroup] = None
    dp: Optional[dist.ProcessGroup] = None
    pp: Optional[dist.ProcessGroup] = None
    model_parallel: Optional[dist.ProcessGroup] = None
    source_group: Optional[dist.ProcessGroup] = None
    embedding: Optional[dist.ProcessGroup] = None
    outer: Optional[dist.ProcessGroup] = None
    world: Optional[dist.ProcessGroup] = None
    tp_dp: Optional[dist.ProcessGroup] = None
    comm: Comm = field(default_factory=Comm)
    # global ranks, ordered by position inside the group
    pp_ranks: tuple[int, ...] = ()
    tp_ranks: tuple[int, ...] = ()
    dp_ranks: tuple[int, ...] = ()
    outer_ranks: tuple[int, ...] = ()
    embedding_ranks: tuple[int, ...] = ()

    # -- layout --------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.tp_size * self.dp_size * self.pp_size * self.num_groups

    @property
    def group_size(self) -> int:
        return self.tp_size * self.dp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.coords.tp

    @property
    def dp_rank(self) -> int:
        return self.coords.dp

    @property
    def pp_rank(self) -> int:
        return self.coords.pp

    @property
    def group_index(self) -> int:
        return self.coords.group

    @property
    def is_first_stage(self) -> bool:
        return self.coords.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords.pp == self.pp_size - 1

    def rank_of(self, tp: int, dp: int, pp: int, group: int) -> int:
        return rank_of(tp, dp, pp, group, self.tp_size, self.dp_size, self.pp_size)

    def describe(self) -> str:
        c = self.coords
        return (f"rank {self.rank}/{self.world_size}: group {c.group}/{self.num_groups} "
                f"tp {c.tp}/{self.tp_size} dp {c.dp}/{self.dp_size} pp {c.pp}/{self.pp_size}")


def rank_of(tp: int, dp: int, pp: int, group: int, T: int, D: int, P: int) -> int:
    return tp + T * (dp + D * (pp + P * group))


def coords_of(rank: int, T: int, D: int, P: int) -> Coords:
    tp = rank % T
    dp = (rank // T) % D
    pp = (rank // (T * D)) % P
    g = rank // (T * D * P)
    return Coords(tp=tp, dp=dp, pp=pp, group=g)


def layout_ranks(world_size: int, T: int, D: int, P: int) -> dict[str, list[list[int]]]:
    """Every group's member ranks, by kind; each list in the order of the position it varies."""
    G = world_size // (T * D * P)
    kinds: dict[str, list[list[int]]] = {k: [] for k in ("tp", "dp", "pp", "model_parallel", "source_group",
                                                          "embedding", "outer", "tp_dp")}
    for g in range(G):
        for pp in range(P):
            kinds["tp_dp"].append([rank_of(t, d, pp, g, T, D, P) for d in range(D) for t in range(T)])
            for dp in range(D):
                kinds["tp"].append([rank_of(t, dp, pp, g, T, D, P) for t in range(T)])
        for pp in range(P):
            for tp in range(T):
                kinds["dp"].append([rank_of(tp, d, pp, g, T, D, P) for d in range(D)])
        for dp in range(D):
            for tp in range(T):
                kinds["pp"].append([rank_of(tp, dp, p, g, T, D, P) for p in range(P)])
                stages = sorted({0, P - 1})
                kinds["embedding"].append([rank_of(tp, dp, p, g, T, D, P) for p in stages])
            kinds["model_parallel"].append(sorted(rank_of(t, dp, p, g, T, D, P)
                                                  for p in range(P) for t in range(T)))
        kinds["source_group"].append(list(range(g * T * D * P, (g + 1) * T * D * P)))
    for pp in range(P):
        for dp in range(D):
            for tp in range(T):
                kinds["outer"].append([rank_of(tp, dp, pp, g, T, D, P) for g in range(G)])
    return kinds


def build_groups(tensor: int = 1, data: int = 1, pipeline: int = 1, *,
                 world_size: Optional[int] = None, rank: Optional[int] = None) -> ParallelGroups:
    """Create every process group. With ``torch.distributed`` initialised every rank must call
    this (``new_group`` is collective); without it, only a single-process layout is allowed."""
    initialised = dist.is_available() and dist.is_initialized()
    if world_size is None:
        world_size = dist.get_world_size() if initialised else 1
    if rank is None:
        rank = dist.get_rank() if initialised else 0
    T, D, P = tensor, data, pipeline
    if world_size % (T * D * P):
        raise ValueError(f"world size {world_size} is not divisible by tensor×data×pipeline = {T * D * P}")
    G = world_size // (T * D * P)
    coords = coords_of(rank, T, D, P)
    pg = ParallelGroups(tp_size=T, dp_size=D, pp_size=P, num_groups=G, rank=rank, coords=coords)
    kinds = layout_ranks(world_size, T, D, P)
    for kind in ("tp", "dp", "pp", "outer", "embedding"):
        # (a middle pipeline stage, P >= 3, is in no embedding group: its embedding_ranks stay ())
        mine = next((r for r in kinds[kind] if rank in r), ())
        setattr(pg, f"{kind}_ranks", tuple(mine))
    if not initialised:
        if world_size != 1:
            raise RuntimeError("torch.distributed is not initialised but the layout has more than one rank")
        return pg
    pg.world = dist.group.WORLD
    for kind, lists in kinds.items():
        if kind == "tp_dp" and (T == 1 or D == 1):
            continue  # the same ranks as tp or dp: reuse that handle below (no extra group)
        for members in lists:
            # new_group is collective over the world: every rank creates every group, in order.
            handle = dist.new_group(members) if len(members) > 1 else None
            if rank in members:
                setattr(pg, kind, handle)
    if T == 1 or D == 1:
        pg.tp_dp = pg.dp if T == 1 else pg.tp
    return pg


def init_distributed(backend: Optional[str] = None, timeout_s: Optional[float] = None,
                     device: str = "auto") -> tuple[int, int, torch.device]:
    """Initialise ``torch.distributed`` from torchrun's environment (or a single process).

    Returns (rank, world_size, device). gloo on CPU, nccl on CUDA. ``device`` is
    ``train.device`` (:mod:`dept_mega.parallel.device`): ``cuda`` without a usable CUDA device
    raises its ``ConfigError`` here, before the process group, on every rank alike.
    ``timeout_s`` bounds the rendezvous and process-group creation (``train.init_timeout_s``);
    torch applies the same limit to later collectives on the world group (the groups made by
    ``build_groups`` keep torch's default).

    Under torchrun (``TORCHELASTIC_RESTART_COUNT`` set) the store keys get a prefix per restart:
    torchrun's agent keeps one TCPStore for the whole job (shared with the workers since
    torch 2.4), so after ``--max-restarts`` restarted the workers, the new ones would read the
    dead workers' keys (gloo peer addresses, barrier counters) and fail with "connectFullMesh
    ... Connection refused" or wait forever.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    # (LOCAL_WORLD_SIZE is read only where it matters: counting the devices train.device: cuda needs)
    use_cuda = device_is_cuda(device, local_world_size() if device == "cuda" else 1)
    where = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        if device == "auto":
            check_local_rank(local_rank)
        torch.cuda.set_device(where)
    if world_size > 1 and not dist.is_initialized():
        backend = backend or ("nccl" if use_cuda else "gloo")
        timeout = timedelta(seconds=timeout_s) if timeout_s else None
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if restart is None:
            dist.init_process_group(backend=backend, rank=rank, world_size=world_size, timeout=timeout)
        else:
            from torch.distributed.rendezvous import rendezvous
            kw = {"timeout": timeout} if timeout is not None else {}
            store, rank, world_size = next(rendezvous("env://", rank, world_size, **kw))
            if timeout is not None:
                store.set_timeout(timeout)
            store = dist.PrefixStore(f"dept_mega/restart{int(restart)}", store)
            dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size,
                                    timeout=timeout)
    return rank, world_size, where
