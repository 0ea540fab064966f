"""Per-rank chunk buffers of the outer syncs in old checkpoints' hook files.

Checkpoints written before the FlatSyncs' error-feedback residuals and eager estimates were
saved per parameter (``dept_mega.checkpoint_state``, ``layout.json``: ``outer_group_keys``)
kept them in each rank's hook state as a chunk of that rank's flattened body shard. They are
loaded at their own tensor / pipeline layout and refused under another one, which cannot cut
them. Shared by the round driver (``driver.py``) and ``dept_mega.checkpoint``.
"""
from __future__ import annotations

# hook-state entry -> FlatSync attribute, and the config key that makes each; loaded, no longer saved
CHUNK_BUFFERS = {"outer_residuals": "residual", "outer_eager": "eager_base"}
CHUNK_BUFFER_KEYS = {"outer_residuals": "dept.outer_error_feedback", "outer_eager": "dept.outer_overlap_rule"}


class PerRankChunkBuffers(ValueError):
    """A checkpoint's hook files hold per-rank chunk buffers (:data:`CHUNK_BUFFERS`, written
    before they were saved per parameter) where the load cannot cut them: under another
    tensor / pipeline layout (``dept_mega.checkpoint`` turns it into a ConfigError naming the
    layout key)."""


def missing_chunk_buffer(entry: str, attr: str, k: str):
    """The ConfigError for a checkpoint's chunk buffer that this run does not keep."""
    from ..config import ConfigError
    return ConfigError(f"config key '{CHUNK_BUFFER_KEYS[entry]}': the checkpoint holds an outer {attr} for {k!r} "
                       f"in its hook files (written with it), this run keeps none there; resume with the setting "
                       f"the checkpoint was written with")


def refuse_chunk_buffers(sd: dict) -> None:
    """Raise :class:`PerRankChunkBuffers` when the hook state dict ``sd`` holds per-rank
    chunk buffers (checked before a load that joins state over tensor / pipeline ranks)."""
    held = [f"{CHUNK_BUFFER_KEYS[e]} ({CHUNK_BUFFERS[e]})" for e in CHUNK_BUFFERS if sd.get(e)]
    if held:
        raise PerRankChunkBuffers(f"its hook files hold {', '.join(held)} as a chunk of each rank's flattened "
                                  f"body shard (written before they were saved per parameter and group: "
                                  f"layout.json without outer_group_keys), which another tensor or pipeline "
                                  f"layout cannot cut")
