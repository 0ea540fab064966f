"""A checkpoint that cannot be written for lack of space (``dept_mega.checkpoint``): every
rank learns of it (the save's failures are agreed with one gather), the partial ``step_N.tmp``
is removed, and the launch ends with one line from global rank 0 — the directory, the bytes
the checkpoint needs and those free, the last complete checkpoint — and :data:`EXIT_NO_SPACE`.
"""
from __future__ import annotations

import os
import shutil
from typing import Any, Optional

import torch
import torch.distributed as dist

from .parallel.agree import all_gather_text
from .resume import CKPT_DIR, read_latest

# EX_CANTCREAT from sysexits.h: a checkpoint could not be written for lack of space
EXIT_NO_SPACE = 73


class CheckpointSpaceError(RuntimeError):
    """A checkpoint could not be written for lack of space: one line naming the directory, the
    bytes the checkpoint needs and those free, and the last complete checkpoint; ``written``:
    the checkpoint is complete but ``latest`` could not be rewritten (a resume passes it over)."""

    def __init__(self, run_dir: str, step: int, needed: int, written: bool = False) -> None:
        where = os.path.join(run_dir, CKPT_DIR)
        free = shutil.disk_usage(where).free
        latest, _ = read_latest(run_dir)
        last = f"step_{latest} ({os.path.join(where, f'step_{latest}')})" if latest is not None else "none"
        if written:  # the checkpoint is in place; ``latest`` (a few bytes) could not be rewritten
            super().__init__(
                f"checkpoint step_{step} was written to {os.path.join(where, f'step_{step}')}, but {where}/latest "
                f"could not be updated: no space left on the device ({free:,} bytes are free); latest still names "
                f"{last if latest is not None else 'no checkpoint'}, which a relaunch resumes from (step_{step} is "
                f"passed over until latest names it); free space (or lower train.keep_checkpoints) and relaunch")
            return
        super().__init__(f"checkpoint step_{step} not written: no space left on the device of {where} (the checkpoint "
                         f"needs {needed:,} bytes, {free:,} bytes are free; the partial step_{step}.tmp was removed); "
                         f"the last complete checkpoint is {last}; free space (or lower train.keep_checkpoints) and "
                         f"relaunch to resume from it")


def no_space(exc: Optional[BaseException]) -> bool:
    """Whether ``exc`` is, or wraps (causes, contexts, DCP's per-rank failures), ENOSPC / EDQUOT."""
    import errno
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        todo += [e.__cause__, e.__context__]
        todo += [f[0] if isinstance(f, tuple) else f for f in (getattr(e, "failures", None) or {}).values()]
    return False


def gather_texts(text: str, group, device) -> list[str]:
    """Every rank's ``text`` over ``group`` (None: the world, tensors on ``device``)."""
    if group is None:
        return all_gather_text(text, device)
    texts = [None] * dist.get_world_size()
    dist.all_gather_object(texts, text, group=group)
    return texts


def state_sizes(staged: dict) -> dict[str, int]:
    """Bytes of what this rank writes, by name (data-parallel replicas share DCP keys: once)."""
    out = {f"{e.key}{list(e.offset)}": e.tensor.numel() * e.tensor.element_size() for e in staged["state"]}
    if staged["rng"] is not None:
        out[staged["rng_file"]] = sum(t.numel() * t.element_size() for t in _tensors_in(staged["rng"]))
    if staged.get("fp8") is not None:
        out[staged["fp8_file"]] = sum(t.numel() * t.element_size() for t in _tensors_in(staged["fp8"]))
    return out


def _tensors_in(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors_in(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors_in(v)]
    return []
