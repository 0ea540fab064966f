"""``train.keep_checkpoints``: which complete checkpoints a run keeps once a new one is in
place, and the leftovers of interrupted saves and removals it clears (called by global rank 0
after a save, ``checkpoint.Checkpointer``)."""
from __future__ import annotations

import os
import re
import shutil
import sys

from .log_lines import write_line
from .manifest import CheckpointError, fsync_dir, read_manifest, step_problem
from .resume import CKPT_DIR, read_latest, step_dir, step_dirs

#: what an interrupted save (``step_N.tmp``) or removal (``step_N.removing``) leaves behind
_LEFTOVER = re.compile(r"step_\d+\.(tmp|removing)")


def dir_bytes(path: str) -> int:
    """Bytes of the files in a checkpoint directory (what the log reports per checkpoint)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


def usable(path: str) -> bool:
    """A cheap check that ``path`` can be a resume's fallback: its manifest reads and records
    the directory's step (the full check, checksums, is the resume's: ``resume.verify_checkpoint``)."""
    try:
        return step_problem(path, read_manifest(path)) is None
    except CheckpointError:
        return False


def apply_retention(run_dir: str, keep: int, newest: int) -> list[int]:
    """Once checkpoint ``newest`` is complete and ``latest`` names it: first remove what
    interrupted saves and removals left (``step_N.tmp``, ``step_N.removing``: never loaded, each
    up to a checkpoint's size, a long preemptible run collects them); then, with ``keep`` > 0,
    keep ``newest`` and the ``keep`` − 1 newest usable ``step_N`` below it (:func:`usable`) and
    remove the other ``step_N`` below it, unusable ones too (they would not be a fallback).
    Steps above ``newest`` (left by a run that fell back to an older checkpoint) and the one
    ``latest`` names are not touched. Returns the steps removed; one that cannot be is a
    warning line, not an error (the save is complete, and only global rank 0 gets here)."""
    ckdir = os.path.join(run_dir, CKPT_DIR)
    try:
        leftovers = [n for n in os.listdir(ckdir) if _LEFTOVER.fullmatch(n)]
    except FileNotFoundError:
        leftovers = []
    for name in leftovers:
        shutil.rmtree(os.path.join(ckdir, name), ignore_errors=True)
    if keep <= 0:
        return []
    latest, _ = read_latest(run_dir)
    kept, removed = 0, []
    for s in [s for s in step_dirs(run_dir) if s < newest and s != latest]:  # newest first
        if kept < keep - 1 and usable(step_dir(run_dir, s)):
            kept += 1
        else:
            removed.append(s)
    done = []
    for s in removed:
        path = step_dir(run_dir, s)
        # rename first, so that a crash halfway through never leaves a damaged step_N behind
        # that a later resume would have to pass over
        doomed = path + ".removing"
        try:
            os.replace(path, doomed)
        except OSError as exc:  # (rank 0 alone: raising would leave the other ranks at the save's barrier)
            write_line(f"warning: train.keep_checkpoints: could not remove {path} ({exc}); it stays", sys.stderr)
            continue
        shutil.rmtree(doomed, ignore_errors=True)
        done.append(s)
    if done or leftovers:
        fsync_dir(ckdir)
    return done
