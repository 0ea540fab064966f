"""Which layout a checkpoint was written under, how it differs from this launch's, and whether
(and how) it loads: :func:`check_layout` and the refusals it raises, named by config key."""
from __future__ import annotations

import os
from typing import Any, Optional

import torch

from .manifest import (LAYOUT_FILE, CheckpointError, read_json)


def _layout(trainer) -> dict[str, Any]:
    pg, par = trainer.pg, trainer.cfg.parallel
    out = {"tensor": pg.tp_size, "pipeline": pg.pp_size, "virtual_pipeline": par.virtual_pipeline,
           "data": pg.dp_size, "groups": pg.num_groups, "dropout_rng": _rng_tracker(trainer) is not None}
    if trainer.cfg.optim.distributed:  # per-rank optimizer shards: their layout must match
        out.update(optim_distributed=True, grad_bucket_size=int(trainer.cfg.optim.grad_bucket_size))
    return out


def _rng_tracker(trainer):
    """The rank's dropout streams (one tracker shared by all its model chunks), if any."""
    return getattr(trainer.stages[0], "rng", None) if trainer.stages else None


def _rng_file(pg) -> str:
    # the streams are seeded by (seed, tensor rank, pipeline rank) and advance identically on
    # every data-parallel replica and source group, so one file per (tp, pp) position
    return f"rng_tp{pg.tp_rank}_pp{pg.pp_rank}.pt"


def _layout_changes(saved: dict, now: dict) -> tuple[list[str], list[str]]:
    """(the model-parallel keys whose sizes differ, those of them that are a pipeline layout)."""
    changed = [k for k in ("tensor", "pipeline", "virtual_pipeline") if saved.get(k) != now[k]]
    return changed, [k for k in changed if k != "tensor"]


def _v1_problem(saved: dict, now: dict, optimizer: bool) -> Optional[str]:
    """What keeps format-1 checkpoint (layout ``saved``) from loading with this launch's layout
    ``now`` (format 1 keys name positions: its own layout only), or None."""
    per_rank = saved.get("per_rank_hooks") and not saved.get("hooks_dp0")
    sharded = bool(saved.get("optim_distributed"))
    keys = ["groups", "tensor", "pipeline", "virtual_pipeline"] + (["data"] if per_rank or (sharded and optimizer)
                                                                   else [])
    wrong = [f"parallel.{k}={saved.get(k)} (this launch: {now[k]})" for k in keys if saved.get(k) != now[k]]
    if optimizer and (sharded != bool(now.get("optim_distributed"))
                      or (sharded and saved.get("grad_bucket_size") != now.get("grad_bucket_size"))):
        wrong.append(f"optim.distributed={sharded}, optim.grad_bucket_size={saved.get('grad_bucket_size')} "
                     f"(this launch: {bool(now.get('optim_distributed'))}, {now.get('grad_bucket_size')})")
    return ", ".join(wrong) or None


def check_layout(trainer, path: str, optimizer: bool = True, hooks: Any = None) -> tuple[bool, bool]:
    """How checkpoint ``path`` loads with this launch's layout: (another number of source
    groups, another tensor / pipeline / virtual-pipeline layout). Format 2 reshards by its
    format (any tensor, pipeline, data-parallel and distributed-optimizer layout); another
    number of groups is DEPT's load plan, refused for a semantic reason only
    (``DeptHooks.regroup_refusal``: inside a round; not DEPT round hooks) with one ConfigError
    naming the key. Format 1 loads with its own layout only: anything else is one
    CheckpointError naming the converter."""
    from .config import ConfigError
    from .manifest import read_manifest
    saved = read_json(path, LAYOUT_FILE)
    now = _layout(trainer)
    pg = trainer.pg
    step = int(os.path.basename(os.path.normpath(path)).split("_")[-1])
    if read_manifest(path)["format"] == 1:
        problem = _v1_problem(saved, now, optimizer)
        if problem:
            run_dir = os.path.dirname(os.path.dirname(os.path.normpath(path)))
            raise CheckpointError(f"checkpoint {path} is in checkpoint format 1, which loads only with the layout it "
                                  f"was written with ({problem}); convert it first: python "
                                  f"tools/convert_checkpoint.py --run-dir {run_dir} --step {step}")
    regroup = saved.get("groups") != pg.num_groups
    if regroup:
        if hooks is None or not hasattr(hooks, "regroup_refusal"):
            refusal = ("parallel", "only DEPT round hooks (GLOB, SPEC, SPEC-OPT, TRIM) load another number of groups")
        else:
            refusal = hooks.regroup_refusal(step, int(saved["groups"]))
        if refusal is not None:
            world = 1
            for k in ("groups", "tensor", "pipeline", "data"):
                world *= int(saved.get(k, 1))
            raise ConfigError(f"config key '{refusal[0]}': checkpoint {path} holds {saved.get('groups')} source "
                              f"group(s) (layout.json), this launch {pg.num_groups}, and {refusal[1]}; launch "
                              f"{world} processes with its layout")
    return regroup, bool(_layout_changes(saved, now)[0])


def _uncounted(hooks):
    """Checkpoint traffic is not part of a DEPT round's byte counts."""
    from contextlib import nullcontext
    return hooks.uncounted() if hasattr(hooks, "uncounted") else nullcontext()


def _safe_load(path: str, map_location) -> Any:
    """``torch.load`` that only accepts tensors and plain containers (never runs code from the
    file); anything else is a :class:`CheckpointError` naming the file."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except Exception as exc:  # noqa: BLE001 - UnpicklingError, RuntimeError from a damaged zip, ...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path}: refused to load it with weights_only=True (not only tensors and plain "
                              f"containers, or damaged): {first}") from None
