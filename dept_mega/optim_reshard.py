"""Optimizer state dicts DEPT keeps per source, redistributed between data-parallel layouts.

The optimizer states DEPT keeps per source outside the model (``DeptHooks``: a source's
embedding optimizer, the body's with ``dept.body_optimizer_state: source``) are state dicts,
the distributed optimizer's with its pieces (``"shard"``: [start, end) of the flattened
parameter shard): :func:`redistribute_state_dict` joins those of the old data-parallel ranks
and cuts this rank's. (The model's and the trainer's optimizer state reshard by the
checkpoint's format: ``dept_mega.checkpoint_format``.)
"""
from __future__ import annotations

import re
from typing import Optional, Sequence

import torch

from .manifest import CheckpointError

_PIECE = re.compile(r"^(?P<base>optim/[^/]+/[^/]+/.+)/dp(?P<d>\d+)of(?P<D>\d+):(?P<s>\d+)-(?P<e>\d+)$")


def join_pieces(pieces: Sequence[tuple[int, int, torch.Tensor]], what: str, path: Optional[str] = None) -> torch.Tensor:
    """The flattened tensor that ``pieces`` (``(start, end, values)``, any order) cover from 0
    without a gap; a gap is a :class:`CheckpointError` naming ``path`` (a ValueError without)."""
    at, parts = 0, []
    for a, b, v in sorted(pieces, key=lambda x: x[0]):
        if a != at:
            why = f"the saved pieces of {what} do not cover it ([{at}, {a}) missing)"
            raise CheckpointError(f"{path}: {why}") if path is not None else ValueError(why)
        parts.append(v.reshape(-1))
        at = b
    return torch.cat(parts)


def groups_like(saved_groups: Sequence[dict], opt) -> list[dict]:
    """``opt``'s parameter groups (its own ``params`` indices) with the hyperparameters (lr,
    betas, ...) of the saved group with the same weight decay (its own where none has)."""
    out = []
    for g in opt.inner.state_dict()["param_groups"]:
        like = [s for s in saved_groups if s.get("weight_decay") == g.get("weight_decay")]
        out.append(dict(like[0], params=g["params"]) if like else g)
    return out


_MASTER = "main_params"  # the fp32 masters' entry beside AdamW's moments (half-precision weights)


def _saved_values(saved: Sequence[dict], params, what: str) -> dict[int, dict[str, list]]:
    """parameter index -> state name -> ``[(start, end, tensor)]``: every saved piece of the
    parameters' AdamW state (and fp32 masters) in ``saved`` — one plain optimizer's state dict,
    or every data-parallel rank's of a distributed optimizer."""
    from .optimizer import state_order
    shards = [sd.get("shard") for sd in saved]
    if all(s is None for s in shards):
        saved = saved[:1]  # the plain optimizer's state is the same on every replica
    elif any(s is None for s in shards) or sorted(s["dp_rank"] for s in shards) != \
            list(range(int(shards[0]["dp_size"]))):
        got = [None if s is None else f"{s['dp_rank']} of {s['dp_size']}" for s in shards]
        raise ValueError(f"{what}: expected the distributed optimizer's state of every data-parallel rank of "
                         f"the saving layout, got the states of ranks {got}")
    values: dict[int, dict[str, list]] = {}
    for sd in saved:
        shard = sd.get("shard")
        pieces = ([tuple(int(x) for x in pc) for pc in shard["pieces"]] if shard is not None
                  else [(i, 0, p.numel()) for i, p in enumerate(params)])
        if any(not 0 <= i < len(params) for i, _, _ in pieces):
            raise ValueError(f"{what}: saved for {max(i for i, _, _ in pieces) + 1} parameters or more, this "
                             f"optimizer has {len(params)}")
        for j, (i, s, e) in enumerate(state_order(pieces, params)):
            for k, v in (sd["state"].get(j) or {}).items():
                values.setdefault(i, {}).setdefault(k, []).append((s, e, v))
        masters = sd.get(_MASTER)
        if masters is not None:
            if len(masters) != len(pieces):
                raise ValueError(f"{what}: {len(masters)} fp32 masters for {len(pieces)} pieces")
            for (i, s, e), m in zip(pieces, masters):
                values.setdefault(i, {}).setdefault(_MASTER, []).append((s, e, m))
    return values


def redistribute_state_dict(saved: Sequence[dict], opt, what: str = "optimizer state") -> dict:
    """``opt``'s state dict (this rank's inner optimizer, plain or distributed) from
    ``saved``: the state dicts of the same parameters written by one plain optimizer
    (replicated: the first is taken) or by every data-parallel rank of a distributed optimizer
    (each with its ``"shard"``), in another data-parallel size or bucket layout. Each moment
    (and fp32 master) is joined from the saved pieces into the flattened parameter and this
    rank's part is cut from it — the whole parameter for the plain optimizer, its pieces for
    the distributed one; ``step`` is the first piece's (the same on all). The hyperparameters
    are the saved ones. With the plain optimizer on both sides the first state dict as it is."""
    shards = [sd.get("shard") for sd in saved]
    if not getattr(opt, "distributed", False) and all(s is None for s in shards):
        return saved[0]
    params = opt.params
    values = _saved_values(saved, params, what)
    from .optimizer import state_order

    def cut(i: int, s: int, e: int, name: str, parts: list) -> torch.Tensor:
        if parts[0][2].dim() == 0:  # AdamW's step
            return parts[0][2].clone()
        flat = join_pieces(parts, f"{what} {name} of parameter {i}")
        if flat.numel() != params[i].numel():
            raise ValueError(f"{what}: the saved {name} of parameter {i} holds {flat.numel()} values, the "
                             f"parameter {params[i].numel()}")
        part = flat[s:e].clone()
        return part if opt.distributed else part.view(params[i].shape)

    mine = opt.pieces_signature()
    state = {}
    for j, (i, s, e) in enumerate(state_order(mine, params)):
        entry = {k: cut(i, s, e, k, parts) for k, parts in values.get(i, {}).items() if k != _MASTER}
        if entry:
            state[j] = entry
    out = {"state": state, "param_groups": groups_like(saved[0]["param_groups"], opt)}
    if opt.distributed:
        out["shard"] = opt.shard()
    if all(sd.get(_MASTER) is not None for sd in saved):
        out[_MASTER] = [cut(i, s, e, "fp32 master", values[i][_MASTER]) for i, s, e in mine]
    return out


def join_named_pieces(saved: Sequence[dict], names: Sequence[dict], what: str = "optimizer state") -> tuple[dict, dict]:
    """One optimizer's state in the plain optimizer's form, from ``saved``: the state dicts of
    every data-parallel rank of a distributed optimizer (each with its ``"shard"``), and
    ``names``: beside each, the global parameter names of its state indices and pieces
    (``{"state": [...], "params": [...]}``, ``DeptHooks.state_dict``'s ``param_names``). Used
    where this launch does not hold the saving layout's parameters (another tensor / pipeline
    size): the pieces are matched by name, not by parameter index. Returns ``(state dict,
    names)``: state index j and ``main_params[j]`` are parameter ``names["state"][j]``
    (= ``names["params"][j]``), each moment and master the parameter's whole flattened shard
    (1-D: its shape is the caller's, ``DeptHooks._reshard_to``), ``step`` the first piece's."""
    shards = [sd.get("shard") for sd in saved]
    if any(s is None for s in shards) or sorted(int(s["dp_rank"]) for s in shards) != \
            list(range(int(shards[0]["dp_size"]))):
        got = [None if s is None else f"{s['dp_rank']} of {s['dp_size']}" for s in shards]
        raise ValueError(f"{what}: expected the distributed optimizer's state of every data-parallel rank of "
                         f"the saving layout, got the states of ranks {got}")
    values: dict[str, dict[str, list]] = {}
    order: list[str] = []
    for sd, nm in zip(saved, names):
        pieces = [tuple(int(x) for x in pc) for pc in sd["shard"]["pieces"]]
        if len(nm["params"]) != len(pieces):
            raise ValueError(f"{what}: {len(nm['params'])} parameter names for {len(pieces)} pieces")
        at = {n: (s, e) for n, (_, s, e) in zip(nm["params"], pieces)}  # one piece per parameter and rank
        for j, n in enumerate(nm["state"]):
            for k, v in (sd["state"].get(j) or {}).items():
                values.setdefault(n, {}).setdefault(k, []).append((*at[n], v))
        for n, (_, s, e), m in zip(nm["params"], pieces, sd.get(_MASTER) or []):
            values.setdefault(n, {}).setdefault(_MASTER, []).append((s, e, m))
        order += [n for n in nm["params"] if n not in order]

    def joined(n: str, k: str) -> torch.Tensor:
        parts = values[n][k]
        return parts[0][2].clone() if parts[0][2].dim() == 0 else join_pieces(parts, f"{what} {k} of {n}")

    state = {j: {k: joined(n, k) for k in values.get(n, {}) if k != _MASTER} for j, n in enumerate(order)}
    out = {"state": {j: st for j, st in state.items() if st}, "param_groups": saved[0]["param_groups"]}
    if all(sd.get(_MASTER) is not None for sd in saved):
        out[_MASTER] = [joined(n, _MASTER) for n in order]
    return out, {"state": list(order), "params": list(order)}
