"""DEPT outer-synchronisation state in the checkpoint, keyed by parameter, saved once.

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
"""
from __future__ import annotations

from typing import Any, Callable

import torch

STEPS = "steps"
PART_STEPS = "part_steps"
REFERENCE = "reference"


def _param_keys(trainer) -> dict[int, str]:
    pg = trainer.pg
    out: dict[int, str] = {}
    for c, st in enumerate(trainer.stages):
        for name, p in st.named_parameters():
            out.setdefault(id(p), f"tp{pg.tp_rank}/pp{pg.pp_rank}/c{c}/{name}")
    return out


def _syncs(hooks) -> dict[str, Any]:
    get = getattr(hooks, "outer_syncs", None)
    return dict(get()) if get is not None else {}


def has_outer_state(hooks) -> bool:
    return bool(_syncs(hooks))


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
