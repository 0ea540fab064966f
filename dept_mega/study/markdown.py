"""``results.md``: the paper's Table 3 shape from :func:`report.summary`'s numbers."""
from __future__ import annotations

import math
import shlex
from typing import Any, Optional

from ..metrics import format_bytes
from .results import CROSS_GROUP


def _fmt(x: Optional[float], digits: int = 4) -> str:
    if x is None or not math.isfinite(x):
        return "–"
    return f"{x:.{digits}f}"


def _pm(mean: Optional[float], sd: Optional[float], digits: int = 4) -> str:
    """``2.3271`` or, over several seeds, ``2.3271 ± 0.0012``."""
    return _fmt(mean, digits) + (f" ± {sd:.{digits}f}" if sd is not None and mean is not None
                                 and math.isfinite(mean) else "")


def _gain(row: dict[str, Any], ref: Optional[str]) -> str:
    if row["label"] == ref:
        return "(best STD)"
    g = row["gain_vs_best_std_pct"]
    if g is None:
        return "–"
    se = row.get("gain_se_pct")
    return f"{g:+.1f}" + (f" ± {se:.1f}" if se is not None else "") + " %" + (
        " †" if row.get("eval_text") == "edges" else "")


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"] + [
        "| " + " | ".join(r) + " |" for r in rows]


def render_markdown(data: dict[str, Any]) -> str:
    sources = data["sources"]
    runs = [r for r in data["runs"] if r["finished"]]
    rows = data.get("rows", [])
    missing = [r["name"] for r in data["runs"] if not r["finished"]]
    G, B = data["groups"], data["group_batch"]
    lines = [f"# Study: {data['description'] or data['grid']}", ""]
    note = data.get("compute_note")
    lines.append(f"Made by `{data['command']}` from `{data['grid']}`. "
                 + (f"**{note[0].upper() + note[1:]}.** Every" if note else "Equal compute: every")
                 + f" DEPT run has {G} source groups of {B} sequences per inner step, every STD run one group of "
                 f"{G * B}; all runs make the same number of inner steps.")
    if runs:
        lines.append(f"Training tokens per run: {runs[0]['train_tokens']:,}.")
    lines.append("Every run read every validation part whole (`eval_whole: true`)." if data.get("eval_whole") else
                 "Every run read the same number of validation sequences per source (train.eval_samples).")
    if missing:
        lines.append(f"**Not finished:** {', '.join(missing)}.")
    for name, warning in (data.get("schedule_warnings") or {}).items():
        lines += ["", f"**Warning, run {name}:** {warning}"]
    several = any(r["n"] > 1 for r in rows)
    ref = data["best_std"]
    ref_n = next((r["n"] for r in rows if r["label"] == ref), None)
    lines += ["", "## Validation bits per UTF-8 byte (lower is better)", ""]
    head = ["run", "n", *sources, "mean", f"gain vs {ref} (n={ref_n})" if ref else "gain vs best STD"]
    lines += _table(head, [[r["label"], str(r["n"]),
                            *[_pm(r["by_source"].get(s, {}).get("bpb"), r["by_source"].get(s, {}).get("bpb_sd"))
                              for s in sources],
                            _pm(r["mean_bpb"], r["mean_bpb_sd"]), _gain(r, ref)] for r in rows])
    lines += ["", "n: runs in the row, which differ only in train.seed; a value over several runs is their mean ± "
              "sample standard deviation. Gain = (mean BPB of the best STD row − mean BPB of the row) / mean BPB of "
              "the best STD row, each the mean over its row's runs; its ± (where both rows have n ≥ 2) is the "
              "standard error of that difference. A gain within a few standard errors of 0 is no evidence either "
              "way, and a single run (n = 1) says nothing of the spread over seeds."]
    if several:
        lines += ["", "Rows of several runs:", ""]
        lines += [f"- {r['label']}: " + ", ".join(f"{n} (seed {s})" for n, s in zip(r["runs"], r["seeds"]))
                  for r in rows if r["n"] > 1]
    if data.get("eval_text_note"):
        lines += ["", f"**{data['eval_text_note']}**"]
    lines += ["",
              "## Validation perplexity (per token of each run's own tokenizer: comparable only between runs "
              "that share a tokenizer; SPEC-OPT's are not comparable with the others)", ""]
    lines += _table(["run", "n", *sources, "mean"],
                    [[r["label"], str(r["n"]),
                      *[_pm(r["by_source"].get(s, {}).get("ppl"), r["by_source"].get(s, {}).get("ppl_sd"), 2)
                        for s in sources], _pm(r["mean_ppl"], r["mean_ppl_sd"], 2)] for r in rows])
    if several:
        lines += ["", "## Every run", ""]
        lines += _table(["run", "row", "seed", *sources, "mean", f"gain vs {ref} mean" if ref else "gain"],
                        [[r["name"], r["row"], str(r["seed"]),
                          *[_fmt(r["by_source"].get(s, {}).get("bpb")) for s in sources], _fmt(r["mean_bpb"]),
                          "–" if r["gain_vs_best_std_pct"] is None else f"{r['gain_vs_best_std_pct']:+.1f} %"]
                         for r in runs])
    lines += _plasticity(runs)
    lines += _cost(data, runs)
    mid = {r["name"]: r["mid_round_eval_steps"] for r in runs if r.get("mid_round_eval_steps")}
    lines += ["", "Figures: `bpb.png` (validation BPB per source, mean over each row's seeds with ± sd bars), "
              "`curves.png` (validation BPB and training loss against tokens, one line per run), `bytes.png` "
              "(cross-group bytes per inner step by category, log scale)."]
    if mid:
        lines.append("In `curves.png`, evaluations inside a round (before its outer sync: group 0's unsynchronised "
                     "model, not comparable with the round-end points) are drawn as unjoined × marks: "
                     + "; ".join(f"{n} steps {', '.join(map(str, s))}" for n, s in mid.items()) + ".")
    lines += ["", "## Commands", "", "```bash"]
    lines += [shlex.join(r["command"]) for r in runs if r.get("command")]
    lines += ["```", ""]
    return "\n".join(lines)


def _plasticity(runs: list[dict[str, Any]]) -> list[str]:
    if not any(r.get("plasticity") for r in runs):
        return []
    lines = ["", "## Plasticity (a fresh embedding for a held-out source, trained on the run's body)", "",
             "| run | held-out source | steps | body | BPB | random-body BPB | gain |",
             "|---|---|---:|---|---:|---:|---:|"]
    for r in runs:
        p = r.get("plasticity")
        if not p:
            continue
        gain = ((p["random_bpb"] - p["bpb"]) / p["random_bpb"] * 100.0
                if p.get("random_bpb") and p.get("bpb") is not None else None)
        lines.append(f"| {r['name']} | {p['source']} | {p['steps']} | {p['body']} | {_fmt(p['bpb'])} | "
                     f"{_fmt(p.get('random_bpb'))} | {'–' if gain is None else f'{gain:+.1f} %'} |")
    lines += ["", "Adaptation: a fresh embedding for the held-out source trained on each run's body "
              "(`dept_mega.adapt`); the gain is against the same procedure from a randomly initialised body. "
              "That reference is made once per distinct adaptation (the same model, seed, batch sizes and "
              "optimizer after the held-out config is merged over the run's) and shared by the runs with "
              "that adaptation (`random_reference` in results.json names the run whose adaptation made it).",
              "", "```bash"] + [shlex.join(r["plasticity"]["command"]) for r in runs
                                if r.get("plasticity") and r["plasticity"].get("command")] + ["```"]
    return lines


def _cost(data: dict[str, Any], runs: list[dict[str, Any]]) -> list[str]:
    G = data["groups"]
    lines = ["", "## Cost", "",
             "Parameters held by the largest rank. Cross-group bytes are measured (the run's `outer` records, summed "
             "over all ranks, in the outer sync's `dept.outer_comm_dtype`): per inner step (the run's total over its "
             "inner steps, so runs with other `dept.local_steps` compare) and in total over the run. STD trains in "
             "one group, so nothing crosses groups; its last two columns show what it would send if its batch were "
             f"split over {G} data-parallel workers (fp32 gradients all-reduced every inner step).", ""]
    head = ["run", "params/rank body", "params/rank embeddings", "outer dtype", "local steps × rounds",
            *[f"{c}/inner step" for c in CROSS_GROUP], "cross-group total",
            "STD data-parallel equivalent/inner step", "STD data-parallel equivalent total", "wall time"]
    body = []
    for r in runs:
        p, per = r["params_per_rank"], r.get("bytes_per_step") or {}
        dept = r["rounds"] > 0
        eq, eq_total = r.get("std_equivalent_bytes_per_step"), r.get("std_equivalent_bytes_total")
        body.append([r["name"], f"{p.get('body', 0):,}", f"{p.get('embeddings', 0):,}",
                     r.get("outer_comm_dtype") or "–",
                     f"{r['local_steps']} × {r['rounds']}" if dept else "–",
                     *[format_bytes(per.get(c, 0.0)) if dept else "–" for c in CROSS_GROUP],
                     format_bytes(r["cross_group_bytes_total"]) if dept else "–",
                     format_bytes(eq) if eq is not None else "–",
                     format_bytes(eq_total) if eq_total is not None else "–",
                     f"{r['seconds']:.0f} s" if r.get("seconds") else "–"])
    return lines + _table(head, body)
