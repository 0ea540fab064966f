"""The round driver's state in checkpoint format 2 (``dept_mega.checkpoint_format`` owns the keys).

What :class:`~dept_mega.dept.driver.DeptHooks` keeps besides its outer synchronisations
(``dept_mega.checkpoint_state``):

* the round position — ``round``, ``in_round``, the ``installed`` source and the sources in
  the store — plain values in the group's ``group{g}.json`` under ``dept`` (:func:`meta`);
* each stored source's state as boxes of global tensors under ``source/{name}/...``
  (:func:`entries`): its embeddings (``source/{name}/model/embeddings.{...}``), their inner
  optimizer's moments and fp32 masters (``source/{name}/optim/emb/{moment}/model/...``) and,
  with ``dept.body_optimizer_state: source``, the body's AdamW moments
  (``source/{name}/optim/body/{moment}/model/body...``). A source is held by one group at a
  time, so the key names the source, not the group; the boxes are those of the model's
  tensors, so any tensor / pipeline / data-parallel / distributed-optimizer layout reads them.
  The installed source's state is the model's (``model[/g{g}]/embeddings...``, ``optim/...``)
  and is not written twice;
* TRIM's global tables φ / φ_head (``dept/trim/{phi|phi_head}``, each rank's row shard a box
  of rows), their rows' outer optimizer state (``dept/trim/{table}/{state}``) and the learned
  positions (``dept/trim/positions``; their outer synchronisation is ``trim_positions`` in
  ``checkpoint_state``). They are the same in every group and written once.

The load plan (:func:`targets`): at the same number of groups, the group's stored sources by
name (the installed one is the model's). Under another number of groups (a round boundary)
every source the new group holds comes from where the old groups held it: a stored source by
its name, one installed in old group g from old group g's model and optimizer keys.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..checkpoint_format import Entry, entries_of, optim_key, param_key, source_key, trim_key, whole, with_group
from ..checkpoint_state import _params
from ..optimizer import empty_adamw_state
from .store import SourceState, SourceStore

MASTER = "main_param"


def _emb_params(state: SourceState) -> list[tuple[str, torch.nn.Parameter]]:
    """(global name, parameter) of a source's embeddings on this rank (a tied head's copy on
    another chunk too: the same key and box)."""
    out, seen = [], set()
    for e in state.embeddings:
        for n, p in (e.named_parameters() if e is not None else ()):
            if id(p) not in seen:
                seen.add(id(p))
                out.append((f"embeddings.{n}", p))
    return out


def _dict_items(opt, sd: dict) -> list[tuple[str, torch.nn.Parameter, torch.Tensor, Optional[tuple[int, int]]]]:
    """:meth:`InnerOptimizer.checkpoint_items` of the state dict ``sd`` of ``opt`` (a source's
    body moments, ``dept.body_optimizer_state: source``): AdamW's state index i is the i-th
    main parameter of ``opt``'s parameter groups (a distributed optimizer's piece: its range)."""
    mains = [m for g in opt.inner.param_groups for m in g["params"]]
    model_of = opt._model_of_main()
    ranges = {id(pc.main): (pc.start, pc.end) for pc in getattr(opt, "pieces", ())}
    out = []
    for i, m in enumerate(mains):
        for k, v in (sd["state"].get(i) or {}).items():
            if torch.is_tensor(v):
                out.append((k, model_of[id(m)], v, None if v.dim() == 0 else ranges.get(id(m))))
    return out


def _body_target(opt) -> dict:
    """A state dict of ``opt`` (its moments only, zeros) for a load to fill in place."""
    state, i = {}, 0
    for group in opt.inner.param_groups:
        for m in group["params"]:
            state[i] = empty_adamw_state(opt.inner, group, m)
            i += 1
    out = {"state": state, "param_groups": opt.inner.state_dict()["param_groups"]}
    if hasattr(opt, "shard"):
        out["shard"] = opt.shard()
    return out


def _optim(key_of: Callable[[str], str], kind: str, items, names: dict, pg) -> list[Entry]:
    out = []
    for moment, p, t, flat in items:
        key = key_of(optim_key(kind, moment, param_key(names[id(p)], None)))
        out += [whole(key, t)] if t.dim() == 0 else entries_of(key, t, p, pg.tp_rank, pg.tp_size, flat)
    return out


def _source(key_of: Callable[[str], str], state: SourceState, trainer, moments: bool) -> list[Entry]:
    """The entries of one source's state (``key_of``: its key of a group-free model or optimizer key)."""
    pg = trainer.pg
    out = []
    for name, p in _emb_params(state):
        out += entries_of(key_of(param_key(name, None)), p.data, p, pg.tp_rank, pg.tp_size)
    opt = state.optimizer
    if opt is not None:
        items = [x for x in opt.checkpoint_items() if moments or x[0] == MASTER]
        out += _optim(key_of, "emb", items, opt.names, pg)
    if state.body_optimizer is not None:
        names = {k: v[0] for k, v in _params(trainer).items()}
        out += _optim(key_of, "body", _dict_items(trainer.body_optimizer, state.body_optimizer), names, pg)
    return out


def _trim(strategy) -> list[Entry]:
    """TRIM's global tables (row boxes) and learned positions on this rank."""
    out = []
    for key in ("phi", "phi_head"):
        table = getattr(strategy, key, None)
        if table is None or table.row_end == table.row_start:
            continue
        for state, t in [(None, table.weight)] + sorted(table.optimizer.state.items()):
            shape = (table.rows_total,) + tuple(t.shape[1:])
            out.append(Entry(trim_key(key, state), t, shape, (table.row_start,) + (0,) * (t.dim() - 1)))
    positions = getattr(strategy, "positions", None)
    if positions is not None:
        out.append(whole(trim_key("positions"), positions.data))
    return out


def meta(hooks) -> dict[str, Any]:
    """The round position (plain values, ``group{g}.json``: ``dept``)."""
    moments = not hooks.cfg.dept.reset_inner_optimizer
    store = {}
    for n in hooks.store.names():
        st = hooks.store.get(n)
        opt = st.optimizer
        store[n] = {"optimizer": bool(moments and opt is not None
                                      and any(k != MASTER for k, *_ in opt.checkpoint_items())),
                    "body_optimizer": st.body_optimizer is not None}
    return {"round": hooks.plan.round if hooks.plan is not None else None, "in_round": bool(hooks.in_round),
            "installed": hooks.installed, "store": store}


def entries(hooks, trainer) -> list[Entry]:
    """The entries a checkpoint writes: the stored sources' state and TRIM's tables."""
    moments = not hooks.cfg.dept.reset_inner_optimizer
    out = []
    for n in hooks.store.names():
        out += _source(lambda k, n=n: source_key(n, k), hooks.store.get(n), trainer, moments)
    return out + _trim(hooks.strategy)


def _held_sources(hooks, metas: dict[int, dict], saved_groups: Optional[int], step: int, origin: Optional[dict]
                  ) -> tuple[dict[str, tuple[int, bool, dict]], Optional[list]]:
    """source → (old group, installed there, its meta) of the sources this rank's group holds
    after the load, and (another number of groups) the sources' new groups."""
    if saved_groups is None:
        m = metas[hooks.pg.group_index]
        return {n: (hooks.pg.group_index, False, flags) for n, flags in m["store"].items()}, None
    before, last = hooks.rebase_groups(step, saved_groups, origin)
    out = {}
    for k, name in enumerate(hooks.names):
        g = before.last_group[k]
        if last[k] != hooks.pg.group_index or not hooks.per_source or g is None:
            continue
        m = metas[int(g)]
        installed = m["installed"] == name
        if not installed and name not in m["store"]:
            raise ValueError(f"source {name!r}: trained before step {step} (last in old group {g}) but its state is "
                             f"not in the checkpoint")
        out[name] = (int(g), installed, None if installed else m["store"][name])
    return out, last


def targets(hooks, trainer, metas: dict[int, dict], saved_groups: Optional[int], step: int,
            origin: Optional[dict], optimizer: bool) -> tuple[list[Entry], Callable[[], None]]:
    """(entries to load into; a function that installs them once loaded). ``metas``: the
    checkpoint's :func:`meta` by old group; ``saved_groups``: None at the same number of
    groups, else the checkpoint's (a round boundary; ``origin``: its schedule's rebase)."""
    held, last = _held_sources(hooks, metas, saved_groups, step, origin)
    moments = optimizer and not hooks.cfg.dept.reset_inner_optimizer
    out: list[Entry] = []
    states: dict[str, SourceState] = {}
    for name, (g, installed, flags) in sorted(held.items()):
        state = states[name] = hooks._fresh_state(name)
        mine = moments and (installed or flags["optimizer"])
        if state.optimizer is not None and mine:
            state.optimizer.ensure_state()
        if hooks.body_per_source and optimizer and (installed or flags["body_optimizer"]):
            state.body_optimizer = _body_target(trainer.body_optimizer)
        if installed:  # old group g's model and optimizer keys
            at = g if saved_groups > 1 else None
            out += _source(lambda k, at=at: with_group(k, None, at), state, trainer, mine)
        else:
            out += _source(lambda k, n=name: source_key(n, k), state, trainer, mine)
    out += _trim(hooks.strategy)

    def install() -> None:
        store = SourceStore()
        for name, state in states.items():
            store.put(name, state)
        if saved_groups is None:
            hooks.resume_at(metas[hooks.pg.group_index], store)
        else:
            hooks.resume_regrouped(step, last, store)

    return out, install
