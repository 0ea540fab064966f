"""Checkpoint format 2: every tensor saved as boxes of a global tensor, keyed by global names.

This module owns the key grammar and the boxes (docs/architecture.md, "Checkpoint format").
An owner of state declares :class:`Entry` objects: a key made of global names only, a local
tensor, the global shape and this rank's offset in it. torch.distributed.checkpoint stores
each box as a chunk of the key's global tensor (a save planner of ours declares the chunks;
DCP removes boxes written by several ranks — replicas — and checks that the boxes of each
key tile it), and a load reads whatever boxes this launch's entries need, wherever they were
written (a load planner of ours asks for the overlaps): resharding is a property of the format.

Keys (``G``: the number of source groups; the group only where the state is per group)::

    model[/g{g}]/{parameter name}                     the parameter (global layer index)
    optim/{body|emb}/{moment}/model[/g{g}]/{name}     AdamW's exp_avg / exp_avg_sq / step,
                                                      main_param (fp32 masters)
    dept/{category}/{kind}/{name}                     outer reference and moments (every group's)
    dept/{category}/steps | part_steps                the outer optimizer's counters
    dept/{category}/g{g}/{kind}/{name}                error-feedback residuals, eager estimates
    dept/{category}/g{g}/eager_known                  per part: whether the group knows a mean
    source/{source}/{model or optim key, group-free}   a stored source's state (dept/hook_state.py)
    dept/trim/{phi|phi_head}[/{state}]                TRIM's global tables and their rows' outer state
    dept/trim/positions                               TRIM's learned positions (the global value)

The group is left out where every group holds the same value when the checkpoint is written
(at a round boundary after a blocking sync: the synchronised parameters and their fp32
masters), so DCP writes it once; a load asks for ``.../g{g}/...`` and reads the group-free key
when the checkpoint has that one instead (:func:`resolve_keys`).

Boxes: a tensor-parallel shard (``partition_dim`` d) is a box of the full tensor; a strided
split (``partition_stride`` s > 1: SwiGLU's fused [gate; up]) takes an axis of size s inserted
before d (the global tensor is ``full.unflatten(d, (s, n / s))``), so that each rank's shard is
one box. A flat range of a local box (the distributed optimizer's pieces) is at most a few
boxes (:func:`range_boxes`: a partial first row, full rows, a partial last row, recursively).
"""
from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from .manifest import CheckpointError

FORMAT_NOTE = "checkpoint format 2"


@dataclass
class Entry:
    """One box: ``tensor`` (a view the load fills in place) at ``offset`` of the global
    tensor ``key`` of shape ``shape``."""
    key: str
    tensor: torch.Tensor
    shape: tuple[int, ...]
    offset: tuple[int, ...]


# --------------------------------------------------------------------------------------- keys


def param_key(name: str, group: Optional[int]) -> str:
    """The key of parameter ``name`` (``group`` None: the same in every group)."""
    return f"model/{name}" if group is None else f"model/g{group}/{name}"


def optim_key(optimizer: str, moment: str, pkey: str) -> str:
    return f"optim/{optimizer}/{moment}/{pkey}"


def outer_key(category: str, kind: str, name: Optional[str] = None, group: Optional[int] = None) -> str:
    g = "" if group is None else f"g{group}/"
    return f"dept/{category}/{g}{kind}" + ("" if name is None else f"/{name}")


def source_key(source: str, key: str) -> str:
    """The key of source ``source``'s copy of ``key`` (a group-free model or optimizer key):
    a source is held by one group at a time, so its state is keyed by its name."""
    return f"source/{source}/{key}"


def trim_key(table: str, state: Optional[str] = None) -> str:
    """TRIM's global table ``table`` (``phi``, ``phi_head``, ``positions``) or its rows' outer
    optimizer state ``state``."""
    return f"dept/trim/{table}" + ("" if state is None else f"/{state}")


def with_group(key: str, old: Optional[int], new: Optional[int]) -> str:
    """``key`` with its group ``g{old}`` (model keys; None: none) replaced by ``new``."""
    src = "model/" if old is None else f"model/g{old}/"
    dst = "model/" if new is None else f"model/g{new}/"
    if src not in key:
        raise CheckpointError(f"cannot place checkpoint entry {key!r} in another number of groups")
    return key.replace(src, dst, 1)


_GROUP = re.compile(r"(^|/)model/g\d+/")


def resolve_keys(entries: list[Entry], saved) -> list[Entry]:
    """``entries`` with each per-group model key (``.../model/g{g}/...``) that ``saved`` (the
    checkpoint's keys) lacks replaced by its group-free key when ``saved`` has that: the value
    every group held when it was written (module doc)."""
    out = []
    for e in entries:
        if e.key not in saved:
            shared = _GROUP.sub(r"\1model/", e.key, count=1)
            if shared in saved:
                e = Entry(shared, e.tensor, e.shape, e.offset)
        out.append(e)
    return out


# -------------------------------------------------------------------------------------- boxes


def local_box(p: torch.Tensor, like: torch.nn.Parameter, tp_rank: int, tp_size: int
              ) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(``p`` — a tensor shaped like parameter ``like``'s shard — viewed in the key's
    coordinates, the global shape, this rank's offset)."""
    dim = getattr(like, "partition_dim", None)
    stride = int(getattr(like, "partition_stride", 1) or 1)
    sharded = dim is not None and tp_size > 1 and bool(getattr(like, "tensor_parallel", False))
    view = p
    if dim is not None and stride > 1:
        view = p.unflatten(dim, (stride, p.shape[dim] // stride))
        dim += 1
    shape, offset = list(view.shape), [0] * view.dim()
    if sharded:
        offset[dim] = tp_rank * shape[dim]
        shape[dim] *= tp_size
    return view, tuple(shape), tuple(offset)


def range_boxes(shape: tuple[int, ...], start: int, end: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The boxes (offset, sizes) of row-major ``shape`` that make up its flat range
    [start, end), in flat order (each box is contiguous in that order)."""
    if start >= end:
        return []
    if len(shape) <= 1:
        return [((start,), (end - start,))] if shape else [((), ())]
    row = math.prod(shape[1:])
    r0, r1 = start // row, (end - 1) // row

    def inner(r: int, a: int, b: int):
        return [((r,) + o, (1,) + s) for o, s in range_boxes(shape[1:], a, b)]

    if r0 == r1:
        return inner(r0, start - r0 * row, end - r0 * row)
    out, first = [], r0
    if start % row:
        out += inner(r0, start % row, row)
        first = r0 + 1
    last = r1 + 1 if end % row == 0 else r1  # full rows [first, last)
    if last > first:
        out.append(((first,) + (0,) * (len(shape) - 1), (last - first,) + tuple(shape[1:])))
    if end % row:
        out += inner(r1, 0, end % row)
    return out


def entries_of(key: str, tensor: torch.Tensor, like: torch.nn.Parameter, tp_rank: int, tp_size: int,
               flat_range: Optional[tuple[int, int]] = None) -> list[Entry]:
    """The entries of ``tensor``: shaped like parameter ``like``'s shard, or (``flat_range``)
    the flat range [start, end) of it (a distributed-optimizer piece, ``tensor`` flat)."""
    if flat_range is None:
        view, shape, offset = local_box(tensor, like, tp_rank, tp_size)
        return [Entry(key, view, shape, offset)]
    view, shape, offset = local_box(torch.empty(like.shape, device="meta"), like, tp_rank, tp_size)
    start, end = flat_range
    out, at = [], 0
    for off, sizes in range_boxes(tuple(view.shape), start, end):
        n = math.prod(sizes)
        out.append(Entry(key, tensor[at:at + n].view(sizes), shape, tuple(a + b for a, b in zip(offset, off))))
        at += n
    return out


def whole(key: str, tensor: torch.Tensor) -> Entry:
    """An entry that is its whole global tensor (counters, per-group flags)."""
    return Entry(key, tensor, tuple(tensor.shape), (0,) * tensor.dim())


# ------------------------------------------------------------------------------ save and load


def _narrow(t: torch.Tensor, offsets, lengths) -> torch.Tensor:
    for d, (o, n) in enumerate(zip(offsets, lengths)):
        if o != 0 or n != t.shape[d]:
            t = t.narrow(d, o, n)
    return t


def _planners():
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import (LoadPlan, SavePlan, TensorWriteData, WriteItem,
                                                      WriteItemType)
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class SavePlanner(DefaultSavePlanner):
        """Writes the entries' boxes as chunks of their keys' global tensors."""

        def __init__(self, entries: Iterable[Entry]) -> None:
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self.boxes: dict[tuple[str, tuple], Entry] = {}
            for e in entries:  # a tensor held twice by this rank (a tied head's copy): written once
                self.boxes.setdefault((e.key, tuple(e.offset)), e)

        def create_local_plan(self):
            items = [WriteItem(index=MetadataIndex(k, torch.Size(off)), type=WriteItemType.SHARD,
                               tensor_data=TensorWriteData(
                                   chunk=ChunkStorageMetadata(offsets=torch.Size(off), sizes=e.tensor.size()),
                                   properties=TensorProperties.create_from_tensor(e.tensor),
                                   size=torch.Size(e.shape)))
                     for (k, off), e in self.boxes.items()]
            self.plan = SavePlan(items)
            return self.plan

        def resolve_data(self, write_item):
            t = self.boxes[(write_item.index.fqn, tuple(write_item.index.offset))].tensor.detach()
            # a view writes its whole storage with torch.save: write a copy of just the box
            return t if t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size() \
                else t.contiguous().clone()

    class LoadPlanner(DefaultLoadPlanner):
        """Reads, for each entry, the overlaps of its box with the saved chunks of its key."""

        def __init__(self, entries: Iterable[Entry], path: str) -> None:
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self.path = path
            self.dests: dict[tuple[str, tuple], list[Entry]] = {}
            for e in entries:
                self.dests.setdefault((e.key, tuple(e.offset)), []).append(e)

        def create_local_plan(self):
            md = self.metadata.state_dict_metadata
            items = []
            by_key: dict[str, list[Entry]] = {}
            for (key, _), es in self.dests.items():
                by_key.setdefault(key, []).append(es[0])
            for key, es in by_key.items():
                saved = md[key]  # present and of the entries' shape: checked by load_entries
                chunks = [ChunkStorageMetadata(offsets=torch.Size(e.offset), sizes=e.tensor.size()) for e in es]
                items += create_read_items_for_chunk_list(key, saved, chunks)
            self.plan = LoadPlan(items)
            return self.plan

        def resolve_tensor(self, read_item):
            idx = read_item.dest_index
            e = self.dests[(idx.fqn, tuple(idx.offset))][0]
            return _narrow(e.tensor, read_item.dest_offsets, read_item.lengths)

        def commit_tensor(self, read_item, tensor) -> None:
            idx = read_item.dest_index
            for e in self.dests[(idx.fqn, tuple(idx.offset))][1:]:
                _narrow(e.tensor, read_item.dest_offsets, read_item.lengths).copy_(tensor)

    return SavePlanner, LoadPlanner


def save_entries(entries: list[Entry], path: str, process_group=None):
    """Collective over ``process_group`` (None: the world, or a single process): write the
    entries to ``path``; returns DCP's metadata."""
    import torch.distributed.checkpoint as dcp
    save_planner, _ = _planners()
    with warnings.catch_warnings():  # single process: DCP warns that it saves without dist
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        return dcp.save({}, checkpoint_id=path, process_group=process_group, planner=save_planner(entries))


def load_entries(entries: list[Entry], path: str) -> list[Entry]:
    """Fill the entries in place from checkpoint ``path`` (by this process alone: no
    collective, each rank reads the boxes it needs). A key the checkpoint lacks, or of
    another shape, is a :class:`CheckpointError` naming it. Returns the entries with the keys
    they were read from (:func:`resolve_keys`)."""
    import torch.distributed.checkpoint as dcp
    if not entries:
        return []
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    md = FileSystemReader(path).read_metadata().state_dict_metadata
    entries = resolve_keys(entries, md)
    for e in entries:
        saved = md.get(e.key)
        if not isinstance(saved, TensorStorageMetadata):
            raise CheckpointError(f"checkpoint {path} has no tensor {e.key!r} (another model, or state this run "
                                  f"keeps that the checkpoint's run did not)")
        if tuple(saved.size) != tuple(e.shape):
            raise CheckpointError(f"checkpoint {path}: {e.key!r} has shape {tuple(saved.size)}, this launch "
                                  f"{tuple(e.shape)} (another model?)")
    _, load_planner = _planners()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({}, checkpoint_id=path, planner=load_planner(entries, path), no_dist=True)
    return entries


def saved_keys(path: str) -> dict[str, tuple[int, ...]]:
    """Key → global shape of the tensors in checkpoint ``path``."""
    from torch.distributed.checkpoint import FileSystemReader
    md = FileSystemReader(path).read_metadata().state_dict_metadata
    return {k: tuple(getattr(v, "size", ())) for k, v in md.items()}


def read_full(path: str, keys: Iterable[str], device="cpu") -> dict[str, torch.Tensor]:
    """The full global tensors ``keys`` of checkpoint ``path`` (read by this process)."""
    from torch.distributed.checkpoint import FileSystemReader
    md = FileSystemReader(path).read_metadata().state_dict_metadata
    out: dict[str, torch.Tensor] = {}
    for k in keys:
        at = resolve_keys([Entry(k, torch.empty(0), (), ())], md)[0].key
        if at not in md:
            raise CheckpointError(f"checkpoint {path} has no tensor {k!r}")
        out[k] = torch.empty(tuple(md[at].size), dtype=md[at].properties.dtype, device=device)
    load_entries([whole(k, t) for k, t in out.items()], path)
    return out


def shared_params(trainer, read: list[Entry]) -> frozenset:
    """The ids of the model parameters that a load read (``read``: its entries, with the keys it
    read them from) under their group-free keys only: the value every group held when the
    checkpoint was written (checkpoint_format's module doc), so every group holds it now."""
    keys = {e.key for e in read}
    shared: dict[int, bool] = {}
    for st in trainer.stages:
        for name, p in st.named_parameters():
            shared[id(p)] = shared.get(id(p), True) and param_key(name, None) in keys
    return frozenset(i for i, ok in shared.items() if ok)
