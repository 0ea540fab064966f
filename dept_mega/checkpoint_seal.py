"""Sealing a checkpoint (``dept_mega.checkpoint``): every file of ``step_N.tmp`` checksummed
into its manifest, the ranks sharing the work, before global rank 0 renames it ``step_N``.

The ranks exchange their checksums in one gather. A rank that fails (an unreadable shard, a
read error) joins that gather with an error marker instead, so that no rank waits for it and
none takes its message for checksums: every rank raises the same :class:`SealError`, naming
the lowest failing rank and its error. Rank 0 also stats every data file another rank wrote
before the gather: a manifest must not list a file that rank 0, which writes it and renames the
directory, does not see (a run directory on node-local storage: each node holds its own ranks'
shards, and every later resume would find the checkpoint incomplete).
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional

import torch.distributed as dist

from .checkpoint_space import gather_texts
from .manifest import FORMAT, MANIFEST, default_algorithm, digest_files, expected_files, write_manifest


class SealError(RuntimeError):
    """A checkpoint's seal failed: the same message on every rank. On the rank whose error it
    was, raised from that error (so ENOSPC is still recognised as a full disk)."""


def _unseen(tmp: str, names: list[str]) -> list[str]:
    """Those of ``names`` that are not in ``tmp`` as this rank sees it."""
    out = []
    for name in names:
        try:
            os.stat(os.path.join(tmp, name))
        except FileNotFoundError:
            out.append(name)
    return out


def _own_share(tmp: str, data_files: list[str], rank: int, world: int, algorithm: str) -> dict:
    """This rank's checksums: every ``world``-th data file; rank 0 also everything else in ``tmp``
    (the small files; every file, should DCP's metadata name none), after checking that it sees
    every data file."""
    mine = [f for i, f in enumerate(data_files) if i % world == rank]
    if rank == 0:
        unseen = _unseen(tmp, data_files)
        if unseen:
            shown = ", ".join(unseen[:3]) + (f" and {len(unseen) - 3} more" if len(unseen) > 3 else "")
            raise SealError(
                f"{len(unseen)} of the {len(data_files)} files the ranks wrote are not in {tmp} as rank 0 sees "
                f"it ({shown}): config key 'train.run_dir' must be the same directory on every node (a file "
                f"system shared by all nodes, not node-local storage)")
        mine += [n for n in os.listdir(tmp) if n not in data_files and n != MANIFEST]
    return digest_files(tmp, mine, algorithm, fsync=True)


def data_files(metadata: Any, tmp: str) -> list[str]:
    """The data files DCP wrote into ``tmp``, from the metadata ``dcp.save`` returned
    (``metadata``), or, where that names none, from the metadata file DCP wrote there: torch
    2.11's writer sets the files on a copy of the metadata it returns (2.13's on the metadata
    itself). A rank that cannot read that file (a run directory each node has its own of) fails
    the seal like any rank's error."""
    if metadata is None:
        return []
    storage = getattr(metadata, "storage_data", None)
    if storage is None:
        from torch.distributed.checkpoint import FileSystemReader
        storage = FileSystemReader(tmp).read_metadata().storage_data
    return sorted({getattr(info, "relative_path", None) for info in (storage or {}).values()} - {None})


def seal(tmp: str, step: int, layout: dict, metadata: Any, device, group=None) -> None:
    """Checksum every file of ``tmp`` (each rank a share, fsyncing what it reads) and write the
    manifest from rank 0, last. Collective over ``group`` (None: the world, tensors on
    ``device``); raises :class:`SealError` on every rank when it fails on any."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    algorithm = default_algorithm()
    own: Optional[BaseException] = None
    try:
        text = json.dumps({"entries": _own_share(tmp, data_files(metadata, tmp), rank, world, algorithm)})
    except Exception as exc:  # noqa: BLE001 - every rank raises it, after the gather the others wait in
        own = exc
        text = json.dumps({"error": str(exc) if isinstance(exc, SealError) else f"{type(exc).__name__}: {exc}"})
    merged: dict[str, Any] = {}
    failure = None
    for r, reply in enumerate(gather_texts(text, group, device)):
        answer = json.loads(reply)
        if "error" in answer:
            failure = failure or (r, answer["error"])
        else:
            merged.update(answer["entries"])
    if failure is not None:
        error = SealError(f"checkpoint save {tmp} failed on rank {failure[0]}: {failure[1]}")
        if own is not None:
            raise error from own
        raise error
    missing = [n for n in expected_files(FORMAT, layout) if n not in merged]
    if missing:  # the same on every rank: all of them fail the save, latest stays as it was
        raise SealError(f"checkpoint save {tmp}: {missing} were not written")
    if rank == 0:
        write_manifest(tmp, step, algorithm, merged)
