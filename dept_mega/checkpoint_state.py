"""The entries of the trainer's and DEPT's outer state in checkpoint format 2.

Each owner declares its boxes (``dept_mega.checkpoint_format`` owns the keys):

* the model chunks: every parameter under ``model[/g{g}]/{name}`` (the group when the launch
  has several and the groups' values differ: inside a round, or a part synchronised before
  the round's end; at a round boundary the synchronised parameters are group-free);
* the inner optimizers (``optim/{body|emb}/...``): AdamW's moments and fp32 masters shaped like
  the parameter's shard, or the distributed optimizer's flat pieces as boxes of it;
* each outer synchronisation (``hooks.outer_syncs()``, :meth:`FlatSync.param_state`, full
  over the data-parallel replicas): θ_{t-1} and the outer moments under
  ``dept/{category}/{kind}/{name}`` — the same in every group and replica, so written once —
  and its counters;
* its per-group chunk buffers (:meth:`FlatSync.group_state`): error-feedback residuals and
  eager estimates under ``dept/{category}/g{g}/{kind}/{name}``, and ``eager_known`` (per part
  and per rank of the group: a rank with nothing to synchronise never learns a mean; a load
  takes, per part, whether any rank of the group knew it).

Under another number of groups (:func:`group_targets` with ``saved_groups``) the residuals are
averaged over the old groups and given to every new group — what the mean over groups has
not yet received is Σ_g r_g / G_old, and Σ_g' r' / G_new with r' = Σ_g r_g / G_old is that
same mass — and the eager estimates are reset (E = Δ̄_{t-1} − Δ_g,t-1 / G is the other groups'
share as group g saw it, meaningless for a group of another partition); both are logged.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch

from .checkpoint_format import Entry, entries_of, optim_key, outer_key, param_key, saved_keys, whole

STEPS = "steps"
PART_STEPS = "part_steps"
GROUP_BUFFERS = ("residual", "eager_base")  # FlatSync.group_state's per-parameter buffers
EAGER_KNOWN = "eager_known"
# the config key that makes each buffer (named in the notes of a load that changes one)
GROUP_BUFFER_KEYS = {"residual": "dept.outer_error_feedback", "eager_base": "dept.outer_overlap_rule"}


def _group(pg) -> Optional[int]:
    return pg.group_index if pg.num_groups > 1 else None


def _params(trainer) -> dict[int, tuple[str, torch.nn.Parameter]]:
    """id(parameter) → (its global name, the parameter): the first chunk that holds it."""
    out: dict[int, tuple[str, torch.nn.Parameter]] = {}
    for st in trainer.stages:
        for name, p in st.named_parameters():
            out.setdefault(id(p), (name, p))
    return out


def model_entries(trainer, optimizer: bool = True, replicated: frozenset = frozenset()) -> list[Entry]:
    """The parameters' boxes (a tied head's copy on another chunk too: the same key and box),
    and with ``optimizer`` the inner optimizers'. ``replicated``: the ids of the parameters
    that every group holds the same now (``DeptHooks.group_replicated_params``): they and
    their fp32 masters take group-free keys, written once (a load of another group's key
    reads them: ``checkpoint_format.resolve_keys``)."""
    pg = trainer.pg
    g = _group(pg)
    out: list[Entry] = []
    for st in trainer.stages:
        for name, p in st.named_parameters():
            out += entries_of(param_key(name, None if id(p) in replicated else g), p.data, p, pg.tp_rank, pg.tp_size)
    if optimizer:
        names = _params(trainer)
        for opt_name, opt in (("body", trainer.body_optimizer), ("emb", trainer.embedding_optimizer)):
            for moment, p, t, flat in opt.checkpoint_items():
                if id(p) not in names:
                    continue
                shared = moment == "main_param" and id(p) in replicated  # AdamW's moments stay per group
                key = optim_key(opt_name, moment, param_key(names[id(p)][0], None if shared else g))
                out += [whole(key, t)] if t.dim() == 0 else entries_of(key, t, p, pg.tp_rank, pg.tp_size, flat)
    return out


def _syncs(hooks) -> dict[str, Any]:
    """The FlatSyncs whose state is saved, by category (``DeptHooks.checkpoint_syncs``)."""
    get = getattr(hooks, "checkpoint_syncs", None) or getattr(hooks, "outer_syncs", None)
    return dict(get()) if get is not None else {}


def _names(hooks, trainer) -> dict[int, tuple[str, torch.nn.Parameter]]:
    """:func:`_params` and the synchronised tensors that are not the model's (TRIM's positions)."""
    return {**_params(trainer), **getattr(hooks, "checkpoint_params", dict)()}


def has_outer_state(hooks) -> bool:
    return bool(_syncs(hooks))


def _sync_names(category: str, sync, names: dict) -> list[str]:
    out = []
    for p in sync.params:
        if id(p) not in names:
            raise KeyError(f"dept/{category}: a synchronised parameter of shape {tuple(p.shape)} is not one of "
                           f"the model's parameters")
        out.append(names[id(p)][0])
    return out


def _outer(category: str, sync, state: dict, trainer, names: dict) -> list[Entry]:
    pg = trainer.pg
    out = [whole(outer_key(category, STEPS), torch.tensor(int(state[STEPS]), dtype=torch.int64))]
    if PART_STEPS in state:
        out.append(whole(outer_key(category, PART_STEPS),
                         torch.tensor([int(c) for c in state[PART_STEPS]], dtype=torch.int64)))
    for kind, tensors in state.items():
        if kind in (STEPS, PART_STEPS):
            continue
        for name, p, t in zip(_sync_names(category, sync, names), sync.params, tensors):
            out += entries_of(outer_key(category, kind, name), t, p, pg.tp_rank, pg.tp_size)
    return out


def outer_entries(hooks, trainer) -> list[Entry]:
    """The entries to save (a collective over ``pg.dp`` inside ``param_state``: every rank)."""
    out: list[Entry] = []
    for category, sync in sorted(_syncs(hooks).items()):
        state = sync.param_state()
        if sync.params:  # a rank without a part of this sync (another stage's fragment) never counts its steps
            out += _outer(category, sync, state, trainer, _names(hooks, trainer))
    return out


def outer_targets(hooks, trainer) -> tuple[list[Entry], Callable[[], None]]:
    """(entries to load into; a function that installs them once loaded)."""
    entries: list[Entry] = []
    pending = []
    for category, sync in sorted(_syncs(hooks).items()):
        state = sync.param_state()  # the shapes and state names this launch expects
        mine = _outer(category, sync, state, trainer, _names(hooks, trainer))
        entries += mine
        pending.append((sync, state, mine))

    def install() -> None:
        for sync, state, mine in pending:
            steps = mine[0].tensor
            rebuilt: dict[str, Any] = {STEPS: int(steps.item())}
            if PART_STEPS in state:
                rebuilt[PART_STEPS] = mine[1].tensor.tolist()
            for kind in state:
                if kind not in (STEPS, PART_STEPS):
                    rebuilt[kind] = state[kind]  # filled in place through the entries' views
            sync.load_param_state(rebuilt)

    return entries, install


def _group_buffers(hooks) -> dict[str, Any]:
    """The FlatSyncs that keep per-group chunk buffers (residuals, eager estimates), by category."""
    return {c: s for c, s in _syncs(hooks).items() if s.residual is not None or s.eager_base is not None}


def has_group_state(hooks) -> bool:
    return bool(_group_buffers(hooks))


def _known_box(trainer, group: int, category: str, known: torch.Tensor) -> Entry:
    """``eager_known`` of this rank: a column of the group's (parts × ranks of a group) table."""
    pg = trainer.pg
    n = pg.tp_size * pg.dp_size * pg.pp_size
    col = pg.tp_rank + pg.tp_size * (pg.dp_rank + pg.dp_size * pg.pp_rank)
    return Entry(outer_key(category, EAGER_KNOWN, group=group), known.view(-1, 1), (known.numel(), n), (0, col))


def group_entries(hooks, trainer) -> list[Entry]:
    """The entries of this group's chunk buffers (a collective over ``pg.dp`` inside
    ``group_state``: every rank)."""
    pg, names = trainer.pg, _names(hooks, trainer)
    g = pg.group_index
    out: list[Entry] = []
    for category, sync in sorted(_group_buffers(hooks).items()):
        state = sync.group_state()
        if EAGER_KNOWN in state:
            out.append(_known_box(trainer, g, category, torch.tensor([int(bool(k)) for k in state[EAGER_KNOWN]],
                                                                     dtype=torch.int64)))
        for kind in GROUP_BUFFERS:
            for name, p, t in zip(_sync_names(category, sync, names), sync.params, state.get(kind, ())):
                out += entries_of(outer_key(category, kind, name, group=g), t, p, pg.tp_rank, pg.tp_size)
    return out


def _saved_group_kinds(path: str) -> dict[tuple[str, int, str], tuple[int, ...]]:
    """(category, group, kind) → a shape, of the per-group keys of checkpoint ``path``."""
    out: dict[tuple[str, int, str], tuple[int, ...]] = {}
    for key, shape in saved_keys(path).items():
        parts = key.split("/")
        if len(parts) >= 4 and parts[0] == "dept" and parts[2][:1] == "g" and parts[2][1:].isdigit():
            out.setdefault((parts[1], int(parts[2][1:]), parts[3]), shape)
    return out


def group_targets(hooks, trainer, path: str, saved_groups: Optional[int] = None
                  ) -> tuple[list[Entry], Callable[[], list[str]]]:
    """(entries of checkpoint ``path`` to load into; a function that installs them once loaded
    and returns the lines to log). ``saved_groups`` None: this rank's group's; an int: the
    checkpoint holds that many groups (another number of groups): every old group's residuals,
    averaged (module doc), eager estimates reset. A buffer this run keeps that the checkpoint
    lacks starts at zero (residual) or unknown (estimate), and is logged."""
    pg, names = trainer.pg, _names(hooks, trainer)
    saved = _saved_group_kinds(path)
    groups = [pg.group_index] if saved_groups is None else list(range(saved_groups))
    entries: list[Entry] = []
    notes: list[str] = []
    plan = []
    for category, sync in sorted(_group_buffers(hooks).items()):
        for kind in GROUP_BUFFERS:
            if getattr(sync, kind) is None:
                continue
            if kind == "eager_base" and saved_groups is not None:
                notes.append(f"{GROUP_BUFFER_KEYS[kind]}: the eager start's estimates of {category} reset (the "
                             f"checkpoint's {saved_groups} groups' shares do not carry over to "
                             f"{pg.num_groups}); each part's next sync starts from the local weights and records "
                             f"a new estimate")
                plan.append((sync, kind, None, None))
                continue
            if any((category, g, kind) not in saved for g in groups):
                notes.append(missing_buffer_note(path, category, kind))
                plan.append((sync, kind, None, None))
                continue
            per_group = []  # one temporary per old group: the load is a reduction over them
            for g in groups:
                ts = [torch.empty(p.shape, dtype=torch.float32) for p in sync.params]
                for name, p, t in zip(_sync_names(category, sync, names), sync.params, ts):
                    entries += entries_of(outer_key(category, kind, name, group=g), t, p, pg.tp_rank, pg.tp_size)
                per_group.append(ts)
            known = None
            if kind == "eager_base":
                shape = saved.get((category, groups[0], EAGER_KNOWN))
                if shape is not None:
                    known = torch.zeros(shape, dtype=torch.int64)
                    entries.append(Entry(outer_key(category, EAGER_KNOWN, group=groups[0]), known, shape,
                                         (0,) * len(shape)))
            plan.append((sync, kind, per_group, known))
        if len(groups) > 1 and sync.residual is not None and (category, 0, "residual") in saved:
            notes.append(f"dept.outer_error_feedback: the error-feedback residuals of {category} are the mean of "
                         f"the checkpoint's {saved_groups} groups' (Σ_g r_g / {saved_groups}) in each of the "
                         f"{pg.num_groups} groups: the mean over groups still receives what it had not")

    def install() -> list[str]:
        for sync, kind, per_group, known in plan:
            if per_group is None:
                zero_group_buffer(sync, kind)
                continue
            values = [torch.stack(ts).sum(0) / len(ts) if len(ts) > 1 else ts[0] for ts in zip(*per_group)]
            state = {kind: values}
            if kind == "eager_base":
                state[EAGER_KNOWN] = ([False] * sync.parts if known is None
                                      else [bool(k) for k in known.amax(dim=1).tolist()])
            sync.load_group_state(state)
        return notes

    return entries, install


def unused_buffer_notes(syncs: dict[str, Any], path: str, saved: Iterable[tuple[str, int, str]]) -> list[str]:
    """Lines to log for the per-group buffers that checkpoint ``path`` holds (``saved``: its
    (category, group, kind) keys) and ``syncs`` do not keep (error feedback or the eager start
    switched off on resume): not loaded, and the run continues without them."""
    kept = {kind for s in syncs.values() for kind in GROUP_BUFFERS if getattr(s, kind, None) is not None}
    held = sorted({(cat, kind) for cat, _, kind in saved if kind in GROUP_BUFFERS})
    return [f"{GROUP_BUFFER_KEYS[kind]}: checkpoint {path} holds the outer {kind} of {cat}, which this run does "
            f"not keep; not loaded (it continues without {'error feedback' if kind == 'residual' else 'the eager start'})"
            for cat, kind in held if kind not in kept]


def unused_group_buffers(hooks, path: str) -> list[str]:
    """:func:`unused_buffer_notes` of this run's syncs and checkpoint ``path``."""
    return unused_buffer_notes(_syncs(hooks), path, _saved_group_kinds(path))


def missing_buffer_note(path: str, category: str, kind: str) -> str:
    """The line to log for a per-group buffer this run keeps and checkpoint ``path`` lacks
    (it starts at zero: :func:`zero_group_buffer`)."""
    return (f"{GROUP_BUFFER_KEYS[kind]}: checkpoint {path} holds no outer {kind} of {category}; it starts at zero"
            + (" (estimate unknown)" if kind == "eager_base" else ""))


def zero_group_buffer(sync, kind: str) -> None:
    """A per-group buffer the checkpoint does not hold starts at zero (an eager start's
    estimates as unknown, as on a first sync)."""
    getattr(sync, kind).zero_()
    if kind == "eager_base":
        sync.load_eager_known(None)
