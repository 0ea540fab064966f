"""The group jobs' small collectives about the federation itself (dept/federation.py), on the
quorum's process group and never counted as traffic: whether any member raises a flag, which
groups contribute to an exchange launched right after a round start's quorum, and the fresh
start's comparison of the keys every group job must agree on (:data:`COMPARED_KEYS`).

The comparison sends hashes (two int64 per key) and, only when some differ, the differing keys'
values as compact canonical JSON (a few hundred bytes), so that every job's error names each
field that differs with every group's value — the group jobs' config files are at different
sites, which the user would otherwise have to fetch and compare."""
from __future__ import annotations

import json
from typing import Optional

import torch

from ..config_diff import check_differing, differences
from ..data.summary import facts_rows
from .federation_config import COMPARED_KEYS, OWNER_KEY, SUMMARY_KEY


def _allreduce(process_group, t: torch.Tensor, op) -> torch.Tensor:
    from torch.distributed.distributed_c10d import AllreduceOptions
    opts = AllreduceOptions()
    opts.reduceOp = op
    process_group.allreduce([t], opts).wait()
    return t


def any_member(process_group, device: torch.device, flag: bool) -> bool:
    """True when ``flag`` is true in any member of the current quorum."""
    from torch.distributed import ReduceOp
    t = torch.tensor([int(flag)], dtype=torch.int64, device=device)
    return bool(_allreduce(process_group, t, ReduceOp.MAX).item())


def contributors(process_group, device: torch.device, groups: int, group: int, contributes: bool) -> list[int]:
    """The group indices (sorted) of the quorum's members whose ``contributes`` is true (its
    failure fails the exchange it belongs to)."""
    from torch.distributed import ReduceOp
    t = torch.zeros(groups, dtype=torch.int64, device=device)
    t[group] = int(contributes)
    return [g for g, v in enumerate(_allreduce(process_group, t, ReduceOp.SUM).cpu().tolist()) if v > 0]


def _gather_json(process_group, device: torch.device, value, ranks: int) -> list:
    """``value`` of every rank of the process group (rank order), sent as compact JSON bytes
    padded to the longest (JSON ignores the trailing spaces)."""
    from torch.distributed import ReduceOp
    from torch.distributed.distributed_c10d import AllgatherOptions
    data = json.dumps(value, sort_keys=True, separators=(",", ":")).encode()
    n = int(_allreduce(process_group, torch.tensor([len(data)], dtype=torch.int64, device=device), ReduceOp.MAX).item())
    mine = torch.full((n,), ord(" "), dtype=torch.uint8)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    parts = [torch.empty(n, dtype=torch.uint8, device=device) for _ in range(ranks)]
    process_group.allgather([parts], [mine.to(device)], AllgatherOptions()).wait()
    return [json.loads(bytes(p.cpu().tolist()).decode()) for p in parts]


def value_rows(keys: list[str], by_group: dict[int, list], owners: Optional[list] = None) -> list[tuple[str, str]]:
    """``(key + field, "group 0 has X, group 1 has Y")`` for every field of ``keys`` whose
    values differ between the groups (``by_group``: group → the keys' values, in ``keys``
    order); a field's value in a group that does not differ there from the lowest group is
    that group's. ``data.sources[].summary``: per source by name and field, with which group's
    summary is stale (``owners``: the agreed ``data.sources[].group`` value, None when it
    differs too; ``data/summary.py`` ``facts_rows``)."""
    order = sorted(by_group)
    ref = by_group[order[0]]
    rows = []
    for i, key in enumerate(keys):
        if key == SUMMARY_KEY:
            holders = [f"group {g}" for _, g in owners] if owners is not None else None
            facts = facts_rows({f"group {g}": by_group[g][i] for g in order}, holders)
            if facts is not None:
                rows += facts
                continue
        fields: dict[str, dict[int, object]] = {}
        for g in order[1:]:
            for where, mine, theirs in differences(ref[i], by_group[g][i]) or []:
                fields.setdefault(where, {order[0]: mine})[g] = theirs
        for where, seen in fields.items():
            said = ", ".join(f"group {g} has {seen.get(g, seen[order[0]])!r}" for g in order)
            rows.append((key + where, said))
    return rows


def check_fresh_agree(process_group, device: torch.device, hashes: list[int], values: list, order: list[int]) -> None:
    """A fresh quorum (every member at its first): the agreed keys compared over every group,
    one agreed ConfigError naming each field that differs with each group's value. ``values``:
    this job's :data:`COMPARED_KEYS` values (``federation_config.agree_values``), ``order``: the
    group of each rank of the process group. Every rank of a job holds the same config, so every
    rank raises the same error."""
    from torch.distributed import ReduceOp
    vals = torch.tensor(hashes, dtype=torch.int64)
    both = _allreduce(process_group, torch.cat([vals, -vals]).to(device), ReduceOp.MAX)
    hi, lo = both[:len(vals)].cpu(), -both[len(vals):].cpu()
    differ = [i for i in range(len(COMPARED_KEYS)) if hi[i] != lo[i]]
    if not differ:
        return
    gathered = _gather_json(process_group, device, [values[i] for i in differ], len(order))
    keys = [COMPARED_KEYS[i] for i in differ]
    by_group = dict(zip(order, gathered))
    owner = COMPARED_KEYS.index(OWNER_KEY)  # (which job holds each source: the stale summary's side)
    rows = (value_rows(keys, by_group, None if owner in differ else values[owner])
            or [(key, "") for key in keys])  # (equal values, unequal hashes: the keys)
    check_differing(rows, "between the group jobs", "federation: every group job needs the same value", agreed=True)
