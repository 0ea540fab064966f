"""Load a checkpoint written under another tensor / pipeline / virtual-pipeline layout.

The checkpoint's keys name positions (``model/g{g}/tp{t}/pp{p}/c{chunk}/{name}``, optimizer
state ``optim/{body|emb}/{moment}/`` + that key); the parameter names inside a stage carry the
GLOBAL layer index (``body.layers.{i}``), so a parameter is found whatever pipeline stage or
chunk held it. For every tensor this rank loads, the saved tensor-parallel shards of the same
(group, name) are read (in this process: DCP without collectives), joined along the
parameter's ``partition_dim`` (with its ``partition_stride``, as the export does) and cut
into this rank's shard. A parameter held on two stages (a tied embedding's copy on the last
stage) is read from the first copy: both receive the same updates.

DEPT's outer state (``dept/{category}/tp{t}/pp{p}/c{chunk}/{name}/{kind}``, shaped like the
parameter's shard; the per-group buffers — error-feedback residuals, eager estimates — under
``dept/{category}/g{group}/tp{t}/...``, matched by (category, group, name, kind)) is joined and
cut the same way.

The distributed optimizer (``optim.distributed``) saves its state in pieces of the flattened
shard (``{key}/dp{d}of{D}:{start}-{end}``, dept_mega/optim_reshard.py): on either side. A
saved shard held in pieces is first joined from them (they must cover it), and a rank that
holds a piece takes its [start, end) of the flattened shard it cut — so the tensor and
pipeline sizes, the data-parallel size, the bucket size and the distributed optimizer on or
off may all change in one resume.

Used by :func:`dept_mega.checkpoint.load_weights` only where nothing else depends on the
layout: no per-rank hook state (STD; DEPT GLOB, whose hook state is the same at every
position) or per-source hook state that the hooks join and cut themselves with
:func:`join_shards` / :func:`cut_shard` (SPEC / SPEC-OPT: ``DeptHooks.load_state_dict_resharded``,
``DeptHooks.load_state_dict_repartitioned``); the dropout streams are not resharded but
re-seeded (``RNGTracker.reseed``). Each rank
reads the full tensors it needs: host memory for one full copy of the tensors of its own
stage.
"""
from __future__ import annotations

import math
import re
import warnings
from typing import Optional

import torch

from .manifest import CheckpointError

_KEY = re.compile(r"^(?P<prefix>(?:optim/[^/]+/[^/]+/)?)model/g(?P<g>\d+)/tp(?P<t>\d+)/pp(?P<p>\d+)/c(?P<c>\d+)/"
                  r"(?P<name>.+)$")
# DEPT outer state (dept_mega.checkpoint_state): no group (θ_{t-1}, the outer optimizer's) or
# the group (error-feedback residuals, eager estimates), the state kind last
_OUTER = re.compile(r"^dept/(?P<cat>[^/]+)/(?:g(?P<g>\d+)/)?tp(?P<t>\d+)/pp(?P<p>\d+)/c(?P<c>\d+)/(?P<name>[^/]+)/"
                    r"(?P<kind>[^/]+)$")
# a distributed-optimizer piece of a key: [start, end) of the flattened shard
_PIECE = re.compile(r"^(?P<base>.+)/dp(?P<d>\d+)of(?P<D>\d+):(?P<s>\d+)-(?P<e>\d+)$")


def _split_piece(key: str) -> tuple[str, Optional[tuple[int, int]]]:
    m = _PIECE.match(key)
    return (m["base"], (int(m["s"]), int(m["e"]))) if m else (key, None)


def _parse(key: str):
    """(identity of the full tensor, (pipeline rank, chunk), tensor rank, parameter name) of a
    checkpoint key, or None for a key that is not a parameter's shard (loaded as it is)."""
    m = _KEY.match(key)
    if m:
        return ("model", m["prefix"], int(m["g"]), m["name"]), (int(m["p"]), int(m["c"])), int(m["t"]), m["name"]
    m = _OUTER.match(key)
    if m:
        return (("dept", m["cat"], m["g"], m["name"], m["kind"]), (int(m["p"]), int(m["c"])), int(m["t"]),
                m["name"])
    return None


def join_shards(shards: list[torch.Tensor], dim: Optional[int], stride: int) -> torch.Tensor:
    """Full tensor from tensor rank t's ``shards[t]`` (blocks of ``stride`` interleaved)."""
    if len(shards) == 1 or dim is None:
        return shards[0]
    pieces = [s.chunk(stride, dim=dim) for s in shards]
    return torch.cat([torch.cat([p[b] for p in pieces], dim=dim) for b in range(stride)], dim=dim)


def cut_shard(full: torch.Tensor, dim: Optional[int], stride: int, parts: int, index: int) -> torch.Tensor:
    """Tensor rank ``index``'s shard of ``full`` (inverse of :func:`join_shards`)."""
    if parts == 1 or dim is None:
        return full
    blocks = full.chunk(stride, dim=dim)
    return torch.cat([b.chunk(parts, dim=dim)[index] for b in blocks], dim=dim)


def _saved_shard(sources: list[tuple[Optional[int], Optional[int], str]], wanted: dict[str, torch.Tensor],
                 shape: tuple[int, ...], path: str, what: str) -> torch.Tensor:
    """One saved tensor-parallel shard: its whole key, or its pieces joined (shaped ``shape``)."""
    if sources[0][0] is None:
        return wanted[sources[0][2]]
    from .optim_reshard import join_pieces
    flat = join_pieces([(a, b, wanted[k]) for a, b, k in sources], what, path)
    if flat.numel() != math.prod(shape):
        raise CheckpointError(f"{path}: the saved pieces of {what} hold {flat.numel()} values, its shard "
                              f"{math.prod(shape)} (another model?)")
    return flat.view(shape)


def load_resharded(state: dict[str, torch.Tensor], params: dict[str, torch.nn.Parameter], path: str,
                   saved_tensor: int, tp_size: int, tp_rank: int) -> None:
    """Fill ``state`` (this rank's checkpoint keys → tensors, loaded in place) from checkpoint
    ``path`` written with ``saved_tensor`` tensor ranks; ``params``: ``tp{t}/pp{p}/c{c}/{name}``
    of this rank → parameter (for its partitioning). Model and optimizer keys
    (``model/g{g}/...``) are matched by (group, name); DEPT outer-state keys
    (``dept/{category}/[g{g}/].../{name}/{kind}``) by (category, group, name, kind); other keys (the outer
    optimizer's step count) load as saved. Distributed-optimizer pieces on either side: see
    the module doc."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    meta = FileSystemReader(path).read_metadata().state_dict_metadata
    # identity -> (pipeline rank, chunk) -> tensor rank -> [(start, end, key)] (whole: None, None)
    index: dict[tuple, dict[tuple[int, int], dict[int, list]]] = {}
    for key in meta:
        base, piece = _split_piece(key)
        parsed = _parse(base)
        if parsed:
            ident, pc, t, _ = parsed
            index.setdefault(ident, {}).setdefault(pc, {}).setdefault(t, []).append(
                (piece[0], piece[1], key) if piece else (None, None, key))
    plan = []
    wanted: dict[str, torch.Tensor] = {}
    for key, target in state.items():
        base, piece = _split_piece(key)
        parsed = _parse(base)
        if parsed is None:
            if key not in meta:
                raise CheckpointError(f"{path}: cannot place {key!r} in another layout (not in the checkpoint)")
            wanted[key] = target  # loaded in place, as saved
            continue
        ident, (p, c), t, name = parsed
        positions = index.get(ident, {})
        complete = sorted(pc for pc, shards in positions.items() if sorted(shards) == list(range(saved_tensor)))
        if not complete:
            raise CheckpointError(f"{path}: no complete set of {saved_tensor} tensor shards of "
                                  f"{'/'.join(str(x) for x in ident[1:] if x is not None)}")
        shards = [sorted(positions[complete[0]][s], key=lambda x: -1 if x[0] is None else x[0])
                  for s in range(saved_tensor)]
        for sources in shards:
            for _, _, k in sources[:1] if target.dim() == 0 else sources:
                md = meta[k]
                wanted.setdefault(k, torch.empty(tuple(md.size), dtype=md.properties.dtype))
        plan.append((key, target, shards, piece, params[f"tp{t}/pp{p}/c{c}/{name}"]))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(wanted, checkpoint_id=path, no_dist=True)
    for key, target, shards, piece, param in plan:
        if target.dim() == 0:  # a step count: the same in every shard and piece
            target.copy_(wanted[shards[0][0][2]])
            continue
        dim = getattr(param, "partition_dim", None)
        stride = int(getattr(param, "partition_stride", 1) or 1)
        shape = list(param.shape)
        if dim is not None and saved_tensor != tp_size:
            shape[dim] = shape[dim] * tp_size // saved_tensor
        full = join_shards([_saved_shard(src, wanted, tuple(shape), path, key) for src in shards], dim, stride)
        local = cut_shard(full, dim, stride, tp_size, tp_rank)
        if piece is not None:
            local = local.reshape(-1)[piece[0]:piece[1]]
        if local.numel() != target.numel() or (piece is None and tuple(local.shape) != tuple(target.shape)):
            raise CheckpointError(f"{path}: {key} resharded to shape {tuple(local.shape)}, this launch holds "
                                  f"{tuple(target.shape)}")
        target.copy_(local.reshape(target.shape))
