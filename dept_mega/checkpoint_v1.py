"""Checkpoint format 1 (written by releases before format 2), read at its own layout only.

Format 1 keyed every tensor by its position (``model/g{g}/tp{t}/pp{p}/c{chunk}/{name}``,
optimizer state ``optim/{body|emb}/{moment}/`` + that key, distributed-optimizer pieces with
``/dp{d}of{D}:{start}-{end}``, the DEPT outer state as below). A launch with the layout it
was written with loads it with these keys (``dept_mega.checkpoint.load_weights``); under
another layout it is refused: resumed once with its own layout, its next checkpoint is format 2.

DEPT outer-synchronisation state in format 1, keyed by parameter, saved once.

Round hooks that expose ``outer_syncs() -> {category: FlatSync}`` (DeptHooks: the body's
``outer_body``) have that state saved through torch.distributed.checkpoint beside the model
weights, from :meth:`FlatSync.param_state` — per parameter, full over the data-parallel
replicas — under keys

    dept/{category}/tp{t}/pp{p}/c{chunk}/{parameter name}/{reference|momentum|exp_avg|exp_avg_sq}
    dept/{category}/steps
    dept/{category}/part_steps        (int64, one per part: GLOB's tables synchronised in parts)

The reference θ_{t-1} and the outer optimizer state are the same in every source group and
every data-parallel replica (they change only at the outer sync, from the averaged
pseudo-gradient), so these keys carry neither group nor data-parallel rank: DCP writes each
tensor once per checkpoint, where a per-rank ``torch.save`` wrote G·D copies of every shard.
The format depends only on ``param_state`` / ``load_param_state``, not on how a FlatSync holds
its state internally.

The per-group chunk buffers — error-feedback residuals (``dept.outer_error_feedback``) and the
eager start's estimates (``dept.outer_overlap_rule: eager``) — are saved the same way from
:meth:`FlatSync.group_state`, but under keys that carry the group (their values differ between
groups; a group's replicas hold distinct chunks of them, whose union is one value per
parameter element):

    dept/{category}/g{group}/tp{t}/pp{p}/c{chunk}/{parameter name}/{residual|eager_base}
    dept/{category}/g{group}/tp{t}/pp{p}/eager_known   (int64 0/1, one per part)

so another tensor / pipeline / data-parallel layout joins and cuts them like θ_{t-1}
(``dept_mega.reshard``: the group is part of a tensor's identity), ``layout.json``:
``outer_group_keys``. ``eager_known`` is saved per (tp, pp) position because a position with
nothing to synchronise (numel 0) never learns a mean; a load takes, per part, whether any saved
position of the group knew it. Under another number of groups (:func:`group_state_targets`
with ``saved_groups``) the residuals are averaged over the old groups and given to every new
group — what the mean over groups has not yet received is Σ_g r_g / G_old, and
Σ_g' r' / G_new with r' = Σ_g r_g / G_old is that same mass — and the eager estimates are
dropped (E = Δ̄_{t-1} − Δ_g,t-1 / G is the other groups' share as group g saw it, which has no
meaning for a group of another partition): every part starts as after a first launch, from
the local weights, and records a new E. Both are logged (the ``notes`` returned).
Checkpoints written before these keys (``outer_group_keys`` absent) keep the buffers in the
per-rank hook files (``DeptHooks.load_state_dict``).
"""
from __future__ import annotations

import re
import warnings
from typing import Any, Callable, Optional

import torch

from .checkpoint_state import (EAGER_KNOWN, GROUP_BUFFERS, PART_STEPS, STEPS,
                               missing_buffer_note, unused_buffer_notes, zero_group_buffer)
from .manifest import CheckpointError

# hook-file entries of checkpoints older still, which kept the chunk buffers per rank there
CHUNK_BUFFERS = {"outer_residuals": "residual", "outer_eager": "eager_base"}


def _syncs(hooks) -> dict[str, Any]:
    """Format 1 saved the driver's outer syncs only (TRIM's positions were in the hook files)."""
    return dict(hooks.outer_syncs()) if hasattr(hooks, "outer_syncs") else {}


def _group_buffers(hooks) -> dict[str, Any]:
    return {c: s for c, s in _syncs(hooks).items() if s.residual is not None or s.eager_base is not None}

REFERENCE = "reference"
# the config key that makes each buffer (named in the notes of a load that changes one)


def model_state(trainer) -> dict[str, torch.Tensor]:
    """This rank's model and inner-optimizer tensors under their format-1 keys."""
    pg = trainer.pg
    out: dict[str, torch.Tensor] = {}
    names: dict[int, str] = {}
    for c, st in enumerate(trainer.stages):
        for name, p in st.named_parameters():
            key = f"model/g{pg.group_index}/tp{pg.tp_rank}/pp{pg.pp_rank}/c{c}/{name}"
            out[key] = p.data
            names.setdefault(id(p), key)
    for opt_name, opt in (("body", trainer.body_optimizer), ("emb", trainer.embedding_optimizer)):
        for k, v in opt.checkpoint_tensors(lambda p: names.get(id(p))).items():
            out[f"optim/{opt_name}/{k}"] = v
    return out


def _param_keys(trainer) -> dict[int, str]:
    pg = trainer.pg
    out: dict[int, str] = {}
    for c, st in enumerate(trainer.stages):
        for name, p in st.named_parameters():
            out.setdefault(id(p), f"tp{pg.tp_rank}/pp{pg.pp_rank}/c{c}/{name}")
    return out


def _flatten(category: str, sync, state: dict, keys: dict[int, str]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {f"dept/{category}/{STEPS}": torch.tensor(int(state[STEPS]), dtype=torch.int64)}
    if PART_STEPS in state:
        out[f"dept/{category}/{PART_STEPS}"] = torch.tensor([int(c) for c in state[PART_STEPS]], dtype=torch.int64)
    names = []
    for p in sync.params:
        if id(p) not in keys:
            raise KeyError(f"dept/{category}: a synchronised parameter of shape {tuple(p.shape)} is not one of "
                           f"the model's parameters")
        names.append(keys[id(p)])
    for kind, tensors in state.items():
        if kind in (STEPS, PART_STEPS):
            continue
        for name, t in zip(names, tensors):
            out[f"dept/{category}/{name}/{kind}"] = t
    return out


def outer_state_tensors(hooks, trainer) -> dict[str, torch.Tensor]:
    """The DCP entries to save (a collective over ``pg.dp`` inside ``param_state``: call on
    every rank)."""
    keys = _param_keys(trainer)
    out: dict[str, torch.Tensor] = {}
    for category, sync in sorted(_syncs(hooks).items()):
        out.update(_flatten(category, sync, sync.param_state(), keys))
    return out


def outer_state_targets(hooks, trainer) -> tuple[dict[str, torch.Tensor], Callable[[], None]]:
    """(DCP entries to load into, in place; a function that installs them once loaded)."""
    keys = _param_keys(trainer)
    entries: dict[str, torch.Tensor] = {}
    pending = []
    for category, sync in sorted(_syncs(hooks).items()):
        state = sync.param_state()  # the shapes and state names this launch expects
        flat = _flatten(category, sync, state, keys)
        entries.update(flat)
        pending.append((category, sync, state, flat))

    def install() -> None:
        for category, sync, state, flat in pending:
            rebuilt: dict[str, Any] = {STEPS: int(flat[f"dept/{category}/{STEPS}"].item())}
            if PART_STEPS in state:
                rebuilt[PART_STEPS] = flat[f"dept/{category}/{PART_STEPS}"].tolist()
            for kind in state:
                if kind not in (STEPS, PART_STEPS):
                    rebuilt[kind] = [flat[f"dept/{category}/{keys[id(p)]}/{kind}"] for p in sync.params]
            sync.load_param_state(rebuilt)

    return entries, install


def _position(trainer) -> str:
    return f"tp{trainer.pg.tp_rank}/pp{trainer.pg.pp_rank}"


def group_state_tensors(hooks, trainer) -> dict[str, torch.Tensor]:
    """The DCP entries of this group's chunk buffers (module doc; a collective over ``pg.dp``
    inside ``group_state``: call on every rank)."""
    keys, g = _param_keys(trainer), trainer.pg.group_index
    out: dict[str, torch.Tensor] = {}
    for category, sync in sorted(_group_buffers(hooks).items()):
        state = sync.group_state()
        if EAGER_KNOWN in state:
            out[f"dept/{category}/g{g}/{_position(trainer)}/{EAGER_KNOWN}"] = torch.tensor(
                [int(bool(k)) for k in state[EAGER_KNOWN]], dtype=torch.int64)
        for kind in GROUP_BUFFERS:
            for p, t in zip(sync.params, state.get(kind, ())):
                out[f"dept/{category}/g{g}/{keys[id(p)]}/{kind}"] = t
    return out


_GROUP_KEY = re.compile(r"^dept/(?P<cat>[^/]+)/g(?P<g>\d+)/tp\d+/pp\d+/(?:c\d+/[^/]+/(?P<kind>[^/]+)|eager_known)$")


def _saved_group_keys(path: str) -> dict[tuple[str, int, str], list[str]]:
    """(category, group, kind or ``eager_known``) → the checkpoint's keys of it."""
    from torch.distributed.checkpoint import FileSystemReader
    out: dict[tuple[str, int, str], list[str]] = {}
    for key in FileSystemReader(path).read_metadata().state_dict_metadata:
        m = _GROUP_KEY.match(key)
        if m:
            out.setdefault((m["cat"], int(m["g"]), m["kind"] or EAGER_KNOWN), []).append(key)
    return out


def _read_eager_known(path: str, keys: list[str], parts: int) -> list[bool]:
    """Per part: whether any saved (tp, pp) position of the group knew a previous mean (read
    by this process alone)."""
    import torch.distributed.checkpoint as dcp
    wanted = {k: torch.zeros(parts, dtype=torch.int64) for k in keys}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(wanted, checkpoint_id=path, no_dist=True)
    return [bool(any(int(t[i]) for t in wanted.values())) for i in range(parts)]


def group_state_targets(hooks, trainer, path: str) -> tuple[dict[str, torch.Tensor], Callable[[], list[str]]]:
    """(DCP entries of format-1 checkpoint ``path`` to load into, in place; a function that
    installs them once loaded and returns the lines to log): this rank's group's keys at this
    rank's position (format 1 loads only with the layout it was written with). A buffer this
    run keeps that the checkpoint lacks starts at zero (residual) or unknown (estimate), and
    is logged."""
    keys, g = _param_keys(trainer), trainer.pg.group_index
    saved = _saved_group_keys(path)
    entries: dict[str, torch.Tensor] = {}
    notes: list[str] = []
    plan = []
    for category, sync in sorted(_group_buffers(hooks).items()):
        for kind in GROUP_BUFFERS:
            if getattr(sync, kind) is None:
                continue
            if (category, g, kind) not in saved:
                notes.append(missing_buffer_note(path, category, kind))
                plan.append((category, sync, kind, None))
                continue
            plan.append((category, sync, kind, [entries.setdefault(f"dept/{category}/g{g}/{keys[id(p)]}/{kind}",
                                                                   torch.empty(p.shape, dtype=torch.float32))
                                                for p in sync.params]))

    def install() -> list[str]:
        for category, sync, kind, values in plan:
            if values is None:
                zero_group_buffer(sync, kind)
                continue
            state = {kind: values}
            if kind == "eager_base":
                state[EAGER_KNOWN] = _read_eager_known(path, saved.get((category, g, EAGER_KNOWN), []), sync.parts)
            sync.load_group_state(state)
        return notes

    return entries, install


def unused_group_buffers(hooks, path: str) -> list[str]:
    """Lines to log for the per-group buffers a format-1 checkpoint holds (``outer_group_keys``)
    and this run does not keep (``checkpoint_state.unused_buffer_notes``)."""
    return unused_buffer_notes(_syncs(hooks), path, _saved_group_keys(path))


def _dcp_load(state: dict, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=path, no_dist=True)


def load_model_v1(trainer, path: str, optimizer: bool) -> None:
    """The model (and with ``optimizer`` the inner optimizers) of format-1 checkpoint ``path``,
    written with this launch's layout."""
    state = model_state(trainer)
    if not optimizer:
        state = {k: v for k, v in state.items() if k.startswith("model/")}
    _dcp_load(state, path)


def load_outer_v1(trainer, hooks, path: str, layout: dict, notes: Optional[list]) -> None:
    """DEPT's outer state and per-group buffers of format-1 checkpoint ``path`` (this layout)."""
    if hooks is None:
        return
    if _syncs(hooks) and layout.get("outer_keys"):
        entries, install = outer_state_targets(hooks, trainer)
        _dcp_load(entries, path)
        install()
    if _group_buffers(hooks) and layout.get("outer_group_keys"):
        entries, install_groups = group_state_targets(hooks, trainer, path)
        _dcp_load(entries, path)
        lines = install_groups()
        if notes is not None:
            notes.extend(line for line in lines if line not in notes)
    if layout.get("outer_group_keys") and notes is not None:
        notes.extend(line for line in unused_group_buffers(hooks, path) if line not in notes)


def load_hooks_v1(trainer, hooks, path: str, layout: dict) -> None:
    """The round hooks' state of format-1 checkpoint ``path`` (its own layout): this rank's
    ``hooks_rank{r}.pt`` (data-parallel rank 0's of this position with ``hooks_dp0``), read
    with ``weights_only=True``."""
    import os
    import torch.distributed as dist
    from .checkpoint_layout import _safe_load
    from .parallel.groups import rank_of
    if hooks is None or not hasattr(hooks, "resume_at"):
        return
    pg = trainer.pg
    rank = dist.get_rank() if dist.is_initialized() else 0
    if layout.get("hooks_dp0"):
        rank = rank_of(pg.tp_rank, 0, pg.pp_rank, pg.group_index, int(layout["tensor"]), int(layout["data"]),
                       int(layout["pipeline"]))
    file = os.path.join(path, f"hooks_rank{rank}.pt")
    if not layout.get("per_rank_hooks"):
        raise CheckpointError(f"checkpoint {path} has no round-hook state ({file}); it was written by a run without "
                              f"DEPT round hooks")
    sd = _safe_load(file, trainer.device)
    try:
        _load_hook_dict(hooks, sd)
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{file}: its DEPT state does not load here ({type(exc).__name__}: {exc})") from None


def _load_hook_dict(hooks, sd: dict) -> None:
    """A format-1 hook file's dict: the outer state of checkpoints older than ``outer_keys``,
    the strategy's (TRIM's tables), the stored and the installed sources' payloads."""
    from .config import ConfigError
    from .dept.store import SourceStore, load_payload
    if "body_sync" in sd:  # checkpoints written before the outer state moved to DCP keys
        body = sd["body_sync"]
        parts = body["fragments"] if "fragments" in body else [body]
        if len(parts) != len(hooks.body_syncs):
            raise ValueError(f"dept.outer_fragments: the checkpoint's body state has {len(parts)} fragments, "
                             f"this run {len(hooks.body_syncs)}")
        for s, part in zip(hooks.body_syncs, parts):
            s.load_state_dict(part)
    syncs = hooks.outer_syncs()
    for entry, attr in CHUNK_BUFFERS.items():
        for k, r in (sd.get(entry) or {}).items():
            if k not in syncs or getattr(syncs[k], attr) is None:
                raise ConfigError(f"the checkpoint holds an outer {attr} for {k!r} in its hook files (written with "
                                  f"it), this run keeps none; resume with the setting it was written with")
            getattr(syncs[k], attr).copy_(r.to(getattr(syncs[k], attr).device, torch.float32))
    for k, s in syncs.items():  # the eager start's estimate: none in the file, none known (outer_group_keys: later)
        if s.eager_base is not None:
            if k not in (sd.get("outer_eager") or {}):
                s.eager_base.zero_()
            s.load_eager_known((sd.get("outer_eager_known") or {}).get(k))
    hooks.strategy.load_state_dict(sd)
    store = SourceStore()
    for n, payload in sd["store"].items():
        state = hooks._fresh_state(n)
        load_payload(state, payload)
        store.put(n, state)
    if hooks.strategy.source_embeddings and sd["installed"] is not None:
        state = hooks._fresh_state(sd["installed"])
        load_payload(state, sd["installed_state"])
        hooks.trainer.set_embeddings(state.embeddings, state.optimizer)
    hooks.resume_at(sd, store)
