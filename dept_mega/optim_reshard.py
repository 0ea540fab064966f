"""Load optimizer state saved under another distributed-optimizer layout.

The distributed optimizer (``optim.distributed``) saves each rank's pieces of AdamW's moments
and of the fp32 masters under ``optim/{body|emb}/{state}/{param key}/dp{d}of{D}:{start}-{end}``
([start, end) in the flattened parameter, this tensor rank's shard of it); the plain
optimizer saves the whole shard under ``optim/{body|emb}/{state}/{param key}``. A rank that
needs a key the checkpoint does not have (another ``parallel.data``, another
``optim.grad_bucket_size``, the distributed optimizer switched on or off) gets it here: the
saved pieces of that parameter are joined into the flattened shard (they must cover it
exactly) and the part the rank holds is cut out — the whole shard, or its own piece. A
piece's ``step`` is a scalar equal on every piece of a parameter: the first is taken.

Tensor and pipeline sizes must be the same as saved (``checkpoint.check_layout``); each rank
reads the full flattened state of its own parameters (host memory for one copy of its
shard's optimizer state).
"""
from __future__ import annotations

import re
import warnings

import torch

from .manifest import CheckpointError

_PIECE = re.compile(r"^(?P<base>optim/[^/]+/[^/]+/.+)/dp(?P<d>\d+)of(?P<D>\d+):(?P<s>\d+)-(?P<e>\d+)$")


def load_redistributed(state: dict[str, torch.Tensor], path: str) -> None:
    """Fill ``state`` (this rank's checkpoint keys → tensors, loaded in place) from checkpoint
    ``path``: keys it holds as they are, optimizer keys it lacks from the saved pieces or the
    saved whole shard of the same parameter and state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    meta = FileSystemReader(path).read_metadata().state_dict_metadata
    pieces: dict[str, list[tuple[int, int, str]]] = {}
    for key in meta:
        m = _PIECE.match(key)
        if m:
            pieces.setdefault(m["base"], []).append((int(m["s"]), int(m["e"]), key))
    direct: dict[str, torch.Tensor] = {}
    wanted: dict[str, torch.Tensor] = {}
    plan = []
    for key, target in state.items():
        if key in meta:
            direct[key] = target
            continue
        m = _PIECE.match(key)
        base, (s, e) = (m["base"], (int(m["s"]), int(m["e"]))) if m else (key, (None, None))
        if base in meta:  # the plain optimizer's whole shard
            sources = [(0, None, base)]
        elif base in pieces:
            sources = sorted(pieces[base])
        else:
            raise CheckpointError(f"{path}: no saved state for {key!r} (neither {base!r} nor its pieces)")
        for _, _, k in sources:
            md = meta[k]
            wanted.setdefault(k, torch.empty(tuple(md.size), dtype=md.properties.dtype))
        plan.append((key, target, sources, s, e))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        if direct:
            dcp.load(direct, checkpoint_id=path, no_dist=True)
        if wanted:
            dcp.load(wanted, checkpoint_id=path, no_dist=True)
    for key, target, sources, s, e in plan:
        if target.dim() == 0:  # AdamW's step: the same on every piece
            target.copy_(wanted[sources[0][2]])
            continue
        if sources[0][1] is None:
            flat = wanted[sources[0][2]].reshape(-1)
        else:
            at = 0
            for a, b, k in sources:
                if a != at:
                    raise CheckpointError(f"{path}: the saved pieces of {key!r} do not cover it ([{at}, {a}) missing)")
                at = b
            flat = torch.cat([wanted[k].reshape(-1) for _, _, k in sources])
        part = flat if s is None else flat[s:e]
        if part.numel() != target.numel():
            raise CheckpointError(f"{path}: {key!r} holds {target.numel()} values here, the checkpoint "
                                  f"{part.numel()} (another model?)")
        target.copy_(part.reshape(target.shape))
