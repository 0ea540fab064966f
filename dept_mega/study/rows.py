"""The report's rows: runs that differ only in ``train.seed`` make one row (mean ± sd over the
seeds, and n), the reference is the best STD row's *mean*, and a gain is shown only where the
run and the reference read the same validation text.

Runs are grouped by what the grid asks of them (variant, base config and every override but
``train.seed``; the tool refuses run directories made from anything else, runner.find_stale), so
runs seeded in separate grid entries group as well as a grid over ``train.seed``.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Optional

from .grid import SEED_KEY, RunSpec, Study
from .results import RunResult


@dataclass
class Row:
    """Runs that differ only in their seed (n = 1: one run)."""
    label: str
    variant: str
    runs: list[str]
    seeds: list[Any]
    by_source: dict[str, tuple[float, Optional[float]]]  # source -> (mean BPB, sd; None for n = 1)
    mean_bpb: tuple[float, Optional[float]]  # the runs' mean-over-sources BPB: (mean, sd)
    mean_ppl: tuple[float, Optional[float]]
    ppl_by_source: dict[str, tuple[float, Optional[float]]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.runs)


def _stats(values: list[Optional[float]]) -> tuple[float, Optional[float]]:
    """(mean, sample sd) of finite values; nan when any is missing; sd None for one value."""
    if not values or any(v is None or not math.isfinite(v) for v in values):
        return float("nan"), None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def _key(run: RunSpec) -> str:
    return json.dumps([run.variant, run.config, sorted(o for o in run.overrides
                                                       if not o.startswith(SEED_KEY + "="))])


def seed_rows(study: Study, results: dict[str, RunResult]) -> list[Row]:
    """One row per set of finished runs that differ only in ``train.seed``, in the grid's order
    (a row where its first run is). Its label: the runs' shared name with the seed as ``*``
    (``glob_s*``; the grid names it), else the one run's name, else the names joined by ``+``."""
    spec = {r.name: r for r in study.runs}
    by_key: dict[str, list[str]] = {}
    for r in study.runs:
        if r.name in results:
            by_key.setdefault(_key(r), []).append(r.name)
    rows = []
    for names in by_key.values():
        labels = {spec[n].seed_label for n in names}
        label = (labels.pop() if len(labels) == 1 and None not in labels and len(names) > 1
                 else names[0] if len(names) == 1 else "+".join(names))
        rs = [results[n] for n in names]
        sources = list(dict.fromkeys(s for r in rs for s in r.by_source))
        rows.append(Row(label, rs[0].variant, names,
                        [(r.config.get("train") or {}).get("seed") for r in rs],
                        {s: _stats([r.by_source.get(s, {}).get("bpb") for r in rs]) for s in sources},
                        _stats([r.mean_bpb for r in rs]), _stats([r.mean_ppl for r in rs]),
                        {s: _stats([r.by_source.get(s, {}).get("ppl") for r in rs]) for s in sources}))
    return rows


def best_std_row(rows: list[Row]) -> Optional[Row]:
    """The STD row of the lowest *mean* BPB (over its seeds)."""
    stds = [r for r in rows if r.variant == "std" and math.isfinite(r.mean_bpb[0])]
    return min(stds, key=lambda r: r.mean_bpb[0]) if stds else None


def gain_pct(mean: float, reference: float) -> Optional[float]:
    """Improvement of mean validation BPB over ``reference`` in % (positive: better)."""
    if not (math.isfinite(mean) and math.isfinite(reference)) or not reference:
        return None
    return (reference - mean) / reference * 100.0


def gain_se_pct(row: Row, ref: Row) -> Optional[float]:
    """Standard error of the gain in % where both rows have n ≥ 2 (sd of each mean, combined)."""
    (_, sa), (rm, sb) = row.mean_bpb, ref.mean_bpb
    if sa is None or sb is None or not math.isfinite(rm) or not rm:
        return None
    return math.sqrt(sa ** 2 / row.n + sb ** 2 / ref.n) / rm * 100.0


# ----------------------------------------------------------------------------- evaluated text

def read_whole(result: RunResult, source: str) -> bool:
    """Whether ``result``'s last evaluation read ``source``'s validation part whole
    (:func:`read_part_whole`)."""
    return read_part_whole(result.config, result.by_source.get(source, {}))


def read_part_whole(config: dict, entry: dict) -> bool:
    """Whether an evaluation of a run with ``config`` (its config.yaml) read a validation part
    whole, from the part's entry of an ``eval`` record's ``by_source``: it read fewer sequences
    (its ``tokens`` / ``model.seq_length``) than it asked for (``train.eval_samples``, else
    ``eval_iters`` × ``global_batch_size``). False where the run's config does not say."""
    try:
        train, seq = config["train"], int(config["model"]["seq_length"])
        wanted = train.get("eval_samples")
        wanted = int(train["eval_iters"]) * int(train["global_batch_size"]) if wanted is None else int(wanted)
        return int(entry["tokens"]) // seq < wanted
    except (KeyError, TypeError, ValueError):
        return False


def _bytes(result: RunResult, source: str) -> Optional[int]:
    v = result.by_source.get(source, {}).get("bytes")
    return None if v is None else int(v)


def text_vs(results: dict[str, RunResult], names: list[str], ref_names: list[str]) -> dict[str, Any]:
    """How the evaluated text of runs ``names`` compares with the reference runs': ``same``
    (every source's evaluated bytes equal), ``edges`` (bytes differ, but every run concerned
    read those parts whole: only each tokenizer's first token and last, incomplete sequence of a
    part differ) or ``other`` (a run read only the first sequences of a part, which under
    another tokenizer is other text, or did not evaluate the part at all); ``sources``: where the
    bytes differ; ``missing``: the sources some of these runs did not evaluate."""
    differ, whole = [], True
    sources = list(dict.fromkeys(s for n in names + ref_names for s in results[n].by_source))
    for s in sources:
        if len({_bytes(results[n], s) for n in names + ref_names}) > 1:
            differ.append(s)
            whole = whole and all(read_whole(results[n], s) for n in names + ref_names)
    missing = [s for s in sources if any(s not in results[n].by_source for n in names + ref_names)]
    return {"text": "same" if not differ else "edges" if whole else "other", "sources": differ, "missing": missing}


def eval_text_differs(results: dict[str, RunResult]) -> list[dict[str, Any]]:
    """The sources whose final evaluation covered different text in different runs, or that
    some runs did not evaluate: per source the runs grouped by the bytes they read
    (``by_bytes``: {bytes: [runs]}), the runs that did not evaluate it (``missing``), and which
    runs read the part whole (``whole``)."""
    out = []
    sources = list(dict.fromkeys(s for r in results.values() for s in r.by_source))
    for s in sources:
        by: dict[int, list[str]] = {}
        for n, r in results.items():
            b = _bytes(r, s)
            if b is not None:
                by.setdefault(b, []).append(n)
        missing = [n for n, r in results.items() if s not in r.by_source]
        if len(by) > 1 or (by and missing):
            out.append({"source": s, "min_bytes": min(by), "max_bytes": max(by),
                        "by_bytes": {b: by[b] for b in sorted(by)}, "missing": missing,
                        "whole": [n for n in results if s in results[n].by_source and read_whole(results[n], s)]})
    return out
