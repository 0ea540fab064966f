"""Which layout a checkpoint was written under, how it differs from this launch's, and whether
(and how) it loads: :func:`check_layout` and the refusals it raises, named by config key."""
from __future__ import annotations

import os
from typing import Any, Optional

import torch

from .manifest import (LAYOUT_FILE, CheckpointError, read_json)
from .resume import (CKPT_DIR, check_depends, fingerprint, latest_step, select_checkpoint, step_dir,  # noqa: F401
                     verify_checkpoint)




def _layout(trainer, per_rank_hooks: bool) -> dict[str, Any]:
    pg, par = trainer.pg, trainer.cfg.parallel
    out = {"tensor": pg.tp_size, "pipeline": pg.pp_size, "virtual_pipeline": par.virtual_pipeline,
           "data": pg.dp_size, "groups": pg.num_groups, "per_rank_hooks": per_rank_hooks,
           "dropout_rng": _rng_tracker(trainer) is not None}
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


def _regroup_refusal(hooks, path: str, saved: dict, now: dict, step: int) -> Optional[tuple[str, str]]:
    """(config key, reason) when checkpoint ``path`` (``saved``: its layout) cannot be loaded
    by this launch's other number of source groups; None when it can (DEPT hooks that
    implement ``load_regrouped``, the same tensor / pipeline sizes or hook state that reshards
    under this launch's (``_hooks_reshardable``), one hooks file per (tp, pp,
    group), or per rank where the hooks join the old ranks' files: the distributed
    optimizer's shards, TRIM's φ rows: ``DeptHooks.dp_joined_state``; the per-rank state they
    cannot join is refused by ``DeptHooks.regroup_refusal`` naming its key)."""
    if hooks is None or not hasattr(hooks, "load_regrouped"):
        return ("parallel", "only DEPT round hooks (GLOB, SPEC, SPEC-OPT, TRIM) load another number of groups")
    wrong, _ = _layout_changes(saved, now)
    if wrong and not _hooks_reshardable(saved, now, hooks)[0]:
        return (f"parallel.{wrong[0]}", "another number of groups loads under another parallel.tensor, "
                                        "parallel.pipeline or parallel.virtual_pipeline only where the round-hook "
                                        "state reshards (see launching.md §8)")
    if saved.get("per_rank_hooks") and not saved.get("hooks_dp0") and not hasattr(hooks, "dp_joined_state"):
        return ("parallel", "the round-hook state was saved per rank and these round hooks do not join the "
                            "old ranks' files")
    return hooks.regroup_refusal(step, int(saved["groups"]), group_keys=bool(saved.get("outer_group_keys")))


def _layout_changes(saved: dict, now: dict) -> tuple[list[str], list[str]]:
    """(the model-parallel keys whose sizes differ, those of them that are a pipeline layout)."""
    changed = [k for k in ("tensor", "pipeline", "virtual_pipeline") if saved.get(k) != now[k]]
    return changed, [k for k in changed if k != "tensor"]


def _hooks_reshardable(saved: dict, now: dict, hooks) -> tuple[bool, bool]:
    """(whether the round hooks' state of a checkpoint with layout ``saved`` loads under this
    launch's tensor / pipeline layout ``now``, whether it is refused only for lack of the
    parameter names it would be joined by). Hook state: none (STD), or the same at every (tp,
    pp) position (GLOB without per-source state: round counters; its outer state is under
    dept/... keys, which dept_mega.reshard joins and cuts), or per-source state: SPEC /
    SPEC-OPT's (and GLOB's per-source body state) joined over tensor ranks and cut, under
    another pipeline layout or with the distributed optimizer on either side by the parameter
    names saved with it (hooks_param_names); saved per rank (TRIM beside φ's row shards, which
    are joined whole; per-source state with the distributed optimizer, its pieces of each
    source's AdamW state): joined over the old data ranks too
    (DeptHooks.load_state_dict_rank_resharded; D may change with it)."""
    changed, staged = _layout_changes(saved, now)
    sharded = bool(saved.get("optim_distributed"))
    per_rank = (bool(saved.get("per_rank_hooks")) and not saved.get("hooks_dp0")
                and bool(getattr(hooks, "hook_state_rank_reshardable", lambda: False)()))
    per_source = per_rank or (bool(saved.get("hooks_dp0")) and bool(getattr(hooks, "hook_state_tensor_reshardable",
                                                                            lambda: False)()))
    by_name = bool(staged) or sharded or bool(now.get("optim_distributed"))
    unnamed = per_source and bool(changed) and by_name and not saved.get("hooks_param_names")
    hooks_ok = (not saved.get("per_rank_hooks") or (per_source and not unnamed)
                or (saved.get("hooks_dp0") and bool(getattr(hooks, "hook_state_reshardable", lambda: False)())))
    return bool(hooks_ok), bool(unnamed)


def _hooks_redistribute(hooks) -> bool:
    """The hooks join per-rank per-source optimizer states over the old data-parallel ranks
    and cut them for this rank's optimizers (``DeptHooks.hook_state_redistributable``)."""
    return hasattr(hooks, "dp_joined_state") and bool(getattr(hooks, "hook_state_redistributable", lambda: False)())


def check_layout(trainer, path: str, optimizer: bool = True, hooks: Any = None) -> str:
    """Refuse a checkpoint written under another parallel layout that cannot be loaded here
    with one ConfigError that names the key to change. ``optimizer``: the optimizer state
    will be loaded too (the distributed optimizer's shards need the same data-parallel size).
    Returns how to load it: ``"same"`` (keys as saved), ``"reshard"`` (``dept_mega.reshard``:
    another tensor / pipeline / virtual-pipeline size where nothing else depends on the layout:
    hook state the same at every position (STD: none; GLOB without per-source state),
    SPEC / SPEC-OPT's per-source state saved once per (tp, pp, group)
    (``DeptHooks.load_state_dict_resharded``) or saved per rank — TRIM's (φ's row shards
    joined from every old rank of the stage that held them), SPEC / SPEC-OPT's with the
    distributed optimizer (its pieces of each source's AdamW states) —, whose per-source
    state is joined over the old data ranks by parameter name
    (``DeptHooks.load_state_dict_rank_resharded``; D and the distributed optimizer may
    change with it); GLOB's per-source body state (``dept.body_optimizer_state: source``) like
    SPEC's; error-feedback residuals and eager estimates saved per parameter and group
    (``outer_group_keys``) reshard like θ_{t-1} for every variant, older checkpoints kept them
    in per-rank hook files and are refused (``dept.chunk_buffers.refuse_chunk_buffers``, a ConfigError
    naming the layout key) — under another pipeline / virtual-pipeline size or
    with the distributed optimizer on either side only with the parameter names saved with
    the per-source state (``hooks_param_names``: ``DeptHooks.load_state_dict_repartitioned``;
    refused naming ``parallel.tensor`` / ``parallel.pipeline`` without them) —; with dropout
    the streams are re-seeded, not loaded (``load_weights``);
    the distributed optimizer's pieces on either side are joined and cut too, so D, the
    bucket size and the optimizer may change with it) or
    ``"regroup"`` (another number of source groups, DEPT at a round boundary:
    ``DeptHooks.regroup_refusal`` says when; ``hooks``: the run's round hooks) or
    ``"regroup_reshard"`` (another number of groups and another tensor / pipeline /
    virtual-pipeline layout at once, where the hooks reshard as for ``"reshard"``: each old
    group's hook state resharded for this rank, ``_resharded_hook_state``, then regrouped; the
    model and the outer state through ``dept_mega.reshard``) or
    ``"redistribute"`` (``dept_mega.optim_reshard``: the distributed optimizer's state under
    another data-parallel or bucket size, or the distributed optimizer switched on or off;
    same tensor / pipeline layout; hook state: none, or loaded by
    ``DeptHooks.load_state_dict_dp_joined``, which cuts SPEC / SPEC-OPT's per-source optimizer
    states (and the body's with ``dept.body_optimizer_state: source``) for this rank's
    optimizers — joined from the old replicas' pieces where the distributed optimizer saved
    them per rank —, also joins error-feedback residuals and TRIM's φ rows) or
    ``"join_dp"`` (per-rank hook state under another data-parallel size that the hooks join:
    ``DeptHooks.load_state_dict_dp_joined``: TRIM, error-feedback residuals, SPEC / SPEC-OPT's
    per-source state with the distributed optimizer's shards when its own state is not
    loaded). Another number of groups (``"regroup"``) works with the distributed optimizer on
    either side, also under another data-parallel or bucket size (its keys through
    ``dept_mega.optim_reshard``, the per-source states through ``DeptHooks.dp_joined_state``)."""
    from .config import ConfigError
    saved = read_json(path, LAYOUT_FILE)
    now = _layout(trainer, per_rank_hooks=False)
    pg = trainer.pg
    if saved.get("groups") != pg.num_groups:
        try:
            step = int(os.path.basename(os.path.normpath(path)).split("_")[-1])
            refusal = _regroup_refusal(hooks, path, saved, now, step)
        except (KeyError, TypeError, ValueError) as exc:
            refusal = ("parallel", f"its layout.json cannot be read ({exc})")
        if refusal is None:
            if (saved.get("optim_distributed") or now.get("optim_distributed")) and not _hooks_redistribute(hooks):
                raise ConfigError(f"config key 'optim.distributed': checkpoint {path} holds {saved.get('groups')} "
                                  f"source group(s), this launch {pg.num_groups}; these round hooks do not "
                                  f"redistribute the distributed optimizer's per-source state")
            changed, _ = _layout_changes(saved, now)
            if changed:  # and another tensor / pipeline layout at the same time
                _refuse_per_rank_chunk_buffers(path, saved, changed, trainer.device)
                return "regroup_reshard"
            return "regroup"
        # keys carry the group: another number of groups would silently load part of the state
        per_group = pg.tp_size * pg.pp_size * pg.dp_size
        saved_world = None
        try:
            saved_world = int(saved["groups"]) * int(saved["tensor"]) * int(saved["pipeline"]) * int(saved["data"])
        except (KeyError, TypeError, ValueError):
            pass
        raise ConfigError(f"config key '{refusal[0]}': checkpoint {path} holds {saved.get('groups')} source group(s) "
                          f"(layout.json), but world size {pg.world_size} = {pg.num_groups} group(s) × {per_group} "
                          f"rank(s) per group, and {refusal[1]}; launch {saved_world} processes with its layout")
    now.setdefault("optim_distributed", False)
    sharded = bool(saved.get("optim_distributed"))  # per-rank optimizer shards (optim.distributed)
    # per-rank hook state needs the same data-parallel size unless it was saved once per
    # (tp, pp, group) because the replicas hold the same (hooks_dp0)
    same_dp = (saved.get("per_rank_hooks") and not saved.get("hooks_dp0")) or (sharded and optimizer)
    keys = ["tensor", "pipeline", "virtual_pipeline"] + (["data"] if same_dp else [])
    wrong = [k for k in keys if saved.get(k) != now[k]]
    changed, staged = _layout_changes(saved, now)
    hooks_ok, unnamed = _hooks_reshardable(saved, now, hooks)
    # (the distributed optimizer's pieces are joined and cut too: dept_mega.reshard)
    # (dropout: its streams are re-seeded for the new ranks by load_weights)
    reshardable = hooks_ok
    # the distributed optimizer's pieces under another data-parallel size or bucket size, or
    # it switched on or off (dept_mega.optim_reshard), same tensor / pipeline layout; hook
    # state saved once per (tp, pp, group) or none
    optimizer_moved = optimizer and (sharded or now["optim_distributed"]) and (
        sharded != now["optim_distributed"] or saved.get("data") != now["data"]
        or (sharded and saved.get("grad_bucket_size") != now.get("grad_bucket_size")))
    # hook state whose per-source optimizer states follow such a change: none, or hooks that
    # join the old replicas' pieces and cut this rank's (DeptHooks.dp_joined_state)
    hooks_follow = (not saved.get("per_rank_hooks") or not (sharded or now["optim_distributed"])
                    or _hooks_redistribute(hooks))
    # per-rank hook state that the hooks join over the old replicas (TRIM's φ rows,
    # error-feedback residuals, the distributed optimizer's per-source shards)
    joinable = (saved.get("per_rank_hooks") and not saved.get("hooks_dp0") and hooks_follow
                and bool(getattr(hooks, "hook_state_dp_joinable", lambda: False)()))
    if optimizer_moved and not changed and hooks_follow and (saved.get("hooks_dp0") or not saved.get("per_rank_hooks")
                                                            or joinable):
        return "redistribute"
    # per-rank hook state under another data-parallel size (the optimizer's keys as saved)
    if wrong == ["data"] and joinable:
        return "join_dp"
    # another tensor / pipeline layout; with the distributed optimizer on either side also another
    # data-parallel size, bucket size or the optimizer switched (hooks_ok: no per-rank hook state)
    if changed and reshardable:
        _refuse_per_rank_chunk_buffers(path, saved, changed, trainer.device)
        return "reshard"
    if wrong:
        said = ", ".join(f"parallel.{k}={saved.get(k)} (this launch: {now[k]})" for k in wrong)
        if saved.get("per_rank_hooks") and unnamed:
            key = f"parallel.{staged[0]}" if staged else "parallel.tensor"
            held = ("is held per pipeline stage" if staged else
                    "is held in the distributed optimizer's pieces (optim.distributed) on one side")
            raise ConfigError(f"config key '{key}': checkpoint {path} was written with {said}; "
                              f"resume or evaluate it with its parallel.tensor, parallel.pipeline and "
                              f"parallel.virtual_pipeline (not resharded: its per-source state (SPEC/SPEC-OPT "
                              f"embeddings or TRIM's compact tables and their AdamW state, the body's with "
                              f"dept.body_optimizer_state: source) {held}, and this checkpoint saved no parameter "
                              f"names with it (layout.json has no hooks_param_names: written before they were "
                              f"saved) to join it by)")
        why = ("its DEPT round-hook state is saved per rank in a form these round hooks do not reshard: a "
               "checkpoint written before the outer buffers were saved per parameter and group (layout.json "
               "without outer_group_keys) keeps the error-feedback residuals or the eager start's estimates "
               "(dept.outer_error_feedback, dept.outer_overlap_rule: eager) as a chunk of each rank's flattened "
               "body shard there"
               if saved.get("per_rank_hooks") and not hooks_ok else
               "the distributed optimizer's shards are per rank" if sharded or now["optim_distributed"] else
               "the data-parallel size is fixed by its per-rank state")
        raise ConfigError(f"config key 'parallel.{wrong[0]}': checkpoint {path} was written with {said}; "
                          f"resume or evaluate it with the same layout (not resharded: {why})")
    if optimizer and (sharded != now["optim_distributed"]
                      or (sharded and saved.get("grad_bucket_size") != now.get("grad_bucket_size"))):
        key = "optim.distributed" if sharded != now["optim_distributed"] else "optim.grad_bucket_size"
        raise ConfigError(f"config key '{key}': checkpoint {path} was written with optim.distributed={sharded}, "
                          f"optim.grad_bucket_size={saved.get('grad_bucket_size')} (this launch: "
                          f"{now['optim_distributed']}, {trainer.cfg.optim.grad_bucket_size}); its optimizer state loads only "
                          f"with the same settings (not resharded)")
    return "same"


def _refuse_per_rank_chunk_buffers(path: str, saved: dict, changed: list, device) -> None:
    """A checkpoint of the earlier format (``layout.json`` without ``outer_group_keys``) whose
    hook files keep error-feedback residuals or eager estimates as a chunk of each rank's
    flattened body shard does not load under another tensor / pipeline layout: one
    ConfigError naming the key, before anything is loaded (every old rank's file holds its
    chunk, so rank 0's tells)."""
    if not saved.get("per_rank_hooks") or saved.get("outer_group_keys"):
        return
    from .dept.chunk_buffers import PerRankChunkBuffers, refuse_chunk_buffers
    first = os.path.join(path, "hooks_rank0.pt")
    if not os.path.exists(first):
        return  # verify_checkpoint has checked the manifest; the load names a missing file
    try:
        refuse_chunk_buffers(_safe_load(first, device))
    except PerRankChunkBuffers as exc:
        raise _chunk_buffers_refusal(path, saved, changed, exc) from None


def _chunk_buffers_refusal(path: str, saved: dict, changed: list, exc: Exception):
    """The ConfigError for per-rank chunk buffers (``PerRankChunkBuffers`` ``exc``) of checkpoint
    ``path`` (``saved``: its layout) under the changed layout keys ``changed``."""
    from .config import ConfigError
    return ConfigError(f"config key 'parallel.{changed[0]}': checkpoint {path} was written with "
                       f"parallel.tensor={saved.get('tensor')}, parallel.pipeline={saved.get('pipeline')}, "
                       f"parallel.virtual_pipeline={saved.get('virtual_pipeline')}; resume it with that layout "
                       f"(not resharded: {exc})")


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
