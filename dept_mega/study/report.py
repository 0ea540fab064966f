"""The study's numbers: :func:`summary` (what ``results.json`` holds and ``results.md`` and the
figures are made from, dept_mega/study/markdown.py and figures.py) and :func:`write_json`."""
from __future__ import annotations

import json
import math
import os
from typing import Any, Optional

from ..variant import variant_of
from .grid import Study, compute_note
from .results import CROSS_GROUP, RunResult, std_equivalent_bytes_per_step
from .rows import best_std_row, eval_text_differs, gain_pct, gain_se_pct, seed_rows, text_vs


def sources_of(results: dict[str, RunResult]) -> list[str]:
    return list(dict.fromkeys(s for r in results.values() for s in r.by_source))


def eval_text_note(differs: list[dict[str, Any]], rows: list[dict[str, Any]], ref: Optional[str]) -> Optional[str]:
    """The report's note on :func:`rows.eval_text_differs` (None: every run evaluated the same
    text): per source, which runs read how many bytes and which did not evaluate it; which rows'
    gains are left out (other sources, or other text than the reference's) or marked † (the
    whole parts, but the edges differ); and, where rows evaluated other sources, which sources
    each row's mean averages."""
    if not differs:
        return None
    per = []
    for d in differs:
        groups = [f"{', '.join(names)} {b:,} bytes" for b, names in d["by_bytes"].items()]
        if d.get("missing"):
            groups.append(f"not evaluated by {', '.join(d['missing'])}")
        per.append(f"{d['source']}: " + "; ".join(groups))
    note = ("Not the same validation text: the runs' final evaluations covered different bytes of "
            + " — ".join(per) + ".")
    unevaluated = [r for r in rows if r.get("eval_text") == "other" and r.get("eval_sources_missing")]
    other = [r["label"] for r in rows if r.get("eval_text") == "other" and not r.get("eval_sources_missing")]
    edges = [r["label"] for r in rows if r.get("eval_text") == "edges"]
    if unevaluated:
        differing = "; ".join(f"{r['label']}: {', '.join(r['eval_sources_missing'])}" for r in unevaluated)
        note += (f" {', '.join(r['label'] for r in unevaluated)} did not evaluate the same sources as the reference "
                 f"({ref}) (evaluated by only one of the two — {differing}), so their gain is left out (–): give "
                 "every run the same `data.sources`.")
    own = {r["label"]: list(r["by_source"]) for r in rows}
    if len({tuple(v) for v in own.values()}) > 1:
        note += (" The mean column averages each row's own sources: "
                 + "; ".join(f"{label}: {', '.join(v)}" for label, v in own.items()) + ".")
    if other:
        note += (f" {', '.join(other)} read other text than the reference ({ref}): a run reads the first "
                 "train.eval_samples sequences of a part, which under another tokenizer (SPEC-OPT's own) is other "
                 "text, so their gain is left out (–). To compare every run on the same text, set `eval_whole: "
                 "true` in the grid: every run then reads every validation part whole.")
    if edges:
        gap = max(differs, key=lambda d: (d["max_bytes"] - d["min_bytes"]) / d["max_bytes"])
        note += (f" † {', '.join(edges)}: every run concerned read these parts whole; what differs is each part's "
                 "first token and last, incomplete sequence, which each tokenizer cuts differently (at most "
                 f"model.seq_length tokens per part; here at most {gap['max_bytes'] - gap['min_bytes']:,} bytes, "
                 f"{(gap['max_bytes'] - gap['min_bytes']) / gap['max_bytes'] * 100:.2f} % of {gap['source']}'s text).")
    return note


def _row_dict(row, results: dict[str, RunResult], ref) -> dict[str, Any]:
    out = {"label": row.label, "variant": row.variant, "runs": row.runs, "seeds": row.seeds, "n": row.n,
           "by_source": {s: {"bpb": m, "bpb_sd": sd, "ppl": row.ppl_by_source[s][0], "ppl_sd": row.ppl_by_source[s][1]}
                         for s, (m, sd) in row.by_source.items()},
           "mean_bpb": row.mean_bpb[0], "mean_bpb_sd": row.mean_bpb[1],
           "mean_ppl": row.mean_ppl[0], "mean_ppl_sd": row.mean_ppl[1],
           "gain_vs_best_std_pct": None, "gain_se_pct": None, "eval_text": None, "eval_text_sources": [],
           "eval_sources_missing": []}
    if ref is not None and row is not ref:
        t = text_vs(results, row.runs, ref.runs)
        out["eval_text"], out["eval_text_sources"], out["eval_sources_missing"] = t["text"], t["sources"], t["missing"]
        if row.variant != "std" and t["text"] != "other":
            out["gain_vs_best_std_pct"] = gain_pct(row.mean_bpb[0], ref.mean_bpb[0])
            out["gain_se_pct"] = gain_se_pct(row, ref)
    return out


def summary(study: Study, results: dict[str, RunResult], command: str,
            plasticity: Optional[dict[str, dict[str, Any]]] = None) -> dict[str, Any]:
    row_objs = seed_rows(study, results)
    ref = best_std_row(row_objs)
    rows = [_row_dict(r, results, ref) for r in row_objs]
    row_of = {n: d for d in rows for n in d["runs"]}
    runs = []
    for spec in study.runs:
        r = results.get(spec.name)
        if r is None:
            runs.append({"name": spec.name, "variant": spec.variant, "finished": False})
            continue
        per_step = r.bytes_per_step()
        std_step = std_equivalent_bytes_per_step(r, study.groups) if r.variant == "std" else None
        row = row_of[spec.name]
        runs.append({
            "name": spec.name, "variant": spec.variant, "finished": True, "settings": spec.settings,
            "nproc": spec.nproc, "command": r.command, "seconds": r.seconds, "row": row["label"],
            "seed": (r.config.get("train") or {}).get("seed"),
            "by_source": r.by_source, "mean_bpb": r.mean_bpb, "mean_ppl": r.mean_ppl,
            # against the best STD row's mean (over its seeds); None where this run read other text
            "gain_vs_best_std_pct": (gain_pct(r.mean_bpb, ref.mean_bpb[0])
                                     if ref is not None and r.variant != "std" and row["eval_text"] != "other"
                                     else None),
            "params_per_rank": r.params_per_rank, "local_steps": r.local_steps, "rounds": r.rounds,
            "outer_comm_dtype": r.config["dept"].get("outer_comm_dtype") if variant_of(r.variant).rounds else None,
            "bytes_per_round": r.bytes_per_round, "bytes_total": r.bytes_total, "bytes_per_step": per_step,
            "cross_group_bytes_per_step": sum(per_step.get(c, 0.0) for c in CROSS_GROUP) if r.rounds else None,
            "cross_group_bytes_total": sum(r.bytes_total.get(c, 0.0) for c in CROSS_GROUP) if r.rounds else None,
            "std_equivalent_bytes_per_step": std_step,
            "std_equivalent_bytes_total": None if std_step is None else std_step * r.eval_step,
            "train_tokens": r.train_tokens, "eval_step": r.eval_step,
            "eval_curve": r.eval_curve, "mid_round_eval_steps": r.mid_round_eval_steps(),
            "train_curve": r.train_curve, "plasticity": (plasticity or {}).get(spec.name),
        })
    differs = eval_text_differs(results)
    return {"grid": study.path, "description": study.description, "command": command,
            "groups": study.groups, "group_batch": study.group_batch,
            "best_std": ref.label if ref else None, "best_std_runs": ref.runs if ref else [],
            "compute_note": compute_note(study), "model_differs_in": study.model_differs_in,
            "body_flops_per_token": study.body_flops, "eval_whole": study.eval_whole,
            "eval_text_differs": differs, "eval_text_note": eval_text_note(differs, rows, ref.label if ref else None),
            "schedule_warnings": {n: w for n, w in study.warnings.items() if n in results},
            "sources": sources_of(results), "rows": rows, "runs": runs}


def _clean(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write_json(path: str, data: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(_clean(data), f, indent=1)
    os.replace(tmp, path)
