"""The study's report: ``results.md`` (the paper's Table 3 shape), ``results.json`` and three
figures (``bpb.png``, ``curves.png``, ``bytes.png``, matplotlib)."""
from __future__ import annotations

import json
import math
import os
import shlex
from typing import Any, Optional

from .grid import Study, compute_note
from .results import CROSS_GROUP, RunResult, dept_round_steps, std_equivalent_bytes_per_round


def _fmt(x: Optional[float], digits: int = 4) -> str:
    if x is None or not math.isfinite(x):
        return "–"
    return f"{x:.{digits}f}"


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def sources_of(results: dict[str, RunResult]) -> list[str]:
    out: list[str] = []
    for r in results.values():
        for s in r.by_source:
            if s not in out:
                out.append(s)
    return out


def best_std(results: dict[str, RunResult]) -> Optional[str]:
    stds = {n: r for n, r in results.items() if r.variant == "std" and math.isfinite(r.mean_bpb)}
    return min(stds, key=lambda n: stds[n].mean_bpb) if stds else None


def gain_pct(run: RunResult, reference: Optional[RunResult]) -> Optional[float]:
    """Improvement of mean validation BPB over ``reference`` in % (positive: better)."""
    if reference is None or not math.isfinite(run.mean_bpb) or not math.isfinite(reference.mean_bpb):
        return None
    return (reference.mean_bpb - run.mean_bpb) / reference.mean_bpb * 100.0


def _read_whole(result: RunResult, source: str) -> bool:
    """Whether ``result``'s last evaluation read ``source``'s validation part whole: it read fewer
    sequences (its ``tokens`` / ``model.seq_length``) than it asked for (``train.eval_samples``,
    else ``eval_iters`` × ``global_batch_size``). False where the run's config does not say."""
    try:
        train, seq = result.config["train"], int(result.config["model"]["seq_length"])
        wanted = train.get("eval_samples")
        wanted = int(train["eval_iters"]) * int(train["global_batch_size"]) if wanted is None else int(wanted)
        return int(result.by_source[source]["tokens"]) // seq < wanted
    except (KeyError, TypeError, ValueError):
        return False


def eval_text_differs(results: dict[str, RunResult]) -> list[dict[str, Any]]:
    """The sources whose final evaluation covered different text in different runs (their
    ``bytes`` differ): the same number of sequences is other text under another tokenizer
    (SPEC-OPT's own) unless every run reads the part whole. ``cut``: the runs that did not read
    it whole (or whose config does not say)."""
    out = []
    for s in sources_of(results):
        by = {n: r.by_source[s]["bytes"] for n, r in results.items()
              if s in r.by_source and r.by_source[s].get("bytes") is not None}
        if len(set(by.values())) > 1:
            out.append({"source": s, "min_bytes": min(by.values()), "max_bytes": max(by.values()), "bytes": by,
                        "cut": [n for n in by if not _read_whole(results[n], s)]})
    return out


def eval_text_note(differs: list[dict[str, Any]]) -> Optional[str]:
    """The report's note on :func:`eval_text_differs` (None: every run evaluated the same text)."""
    if not differs:
        return None
    where = ", ".join(f"{d['source']} ({d['min_bytes']:,} to {d['max_bytes']:,} bytes)" for d in differs)
    note = (f"Not the same validation text: the runs' final evaluations of {where} cover different text, so the "
            f"BPB of those sources were measured on different text in different runs.")
    cut = sorted({n for d in differs for n in d["cut"]})
    if cut:
        note += (f" Run(s) {', '.join(cut)} read only the first train.eval_samples sequences of a part, which "
                 "under another tokenizer (SPEC-OPT's own) is other text. To compare on the same text, set "
                 "train.eval_samples (the grid's `set:`) to at least the largest validation part's sample "
                 "count, so every run reads each part whole: a run read a part whole when its eval record's "
                 "`tokens` / model.seq_length is below its train.eval_samples.")
    else:
        note += (" Every run read these parts whole: what differs is the text of each part's first token and of "
                 "its last, incomplete sequence, which each tokenizer cuts differently (at most "
                 "model.seq_length tokens per part).")
    return note


def summary(study: Study, results: dict[str, RunResult], command: str,
            plasticity: Optional[dict[str, dict[str, Any]]] = None) -> dict[str, Any]:
    ref_name = best_std(results)
    ref = results.get(ref_name) if ref_name else None
    round_steps, round_why = dept_round_steps(results)
    runs = []
    for spec in study.runs:
        r = results.get(spec.name)
        if r is None:
            runs.append({"name": spec.name, "variant": spec.variant, "finished": False})
            continue
        runs.append({
            "name": spec.name, "variant": spec.variant, "finished": True, "settings": spec.settings,
            "nproc": spec.nproc, "command": r.command, "seconds": r.seconds,
            "by_source": r.by_source, "mean_bpb": r.mean_bpb, "mean_ppl": r.mean_ppl,
            "gain_vs_best_std_pct": gain_pct(r, ref) if r.variant != "std" else None,
            "params_per_rank": r.params_per_rank, "rounds": r.rounds, "bytes_per_round": r.bytes_per_round,
            "std_equivalent_bytes_per_round": (std_equivalent_bytes_per_round(r, study.groups, round_steps)
                                               if r.variant == "std" else None),
            "train_tokens": r.train_tokens, "eval_step": r.eval_step,
            "eval_curve": r.eval_curve, "train_curve": r.train_curve,
            "plasticity": (plasticity or {}).get(spec.name),
        })
    differs = eval_text_differs(results)
    return {"grid": study.path, "description": study.description, "command": command,
            "groups": study.groups, "group_batch": study.group_batch, "best_std": ref_name,
            "compute_note": compute_note(study), "model_differs_in": study.model_differs_in,
            "body_flops_per_token": study.body_flops,
            "eval_text_differs": differs, "eval_text_note": eval_text_note(differs),
            "std_equivalent_round_steps": round_steps, "std_equivalent_round": round_why,
            "sources": sources_of(results), "runs": runs}


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


def render_markdown(data: dict[str, Any]) -> str:
    sources = data["sources"]
    runs = [r for r in data["runs"] if r["finished"]]
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
    if missing:
        lines.append(f"**Not finished:** {', '.join(missing)}.")
    lines += ["", "## Validation bits per UTF-8 byte (lower is better)", ""]
    ref = data["best_std"]
    head = ["run", *sources, "mean", f"gain vs {ref}" if ref else "gain vs best STD"]
    lines += ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    for r in runs:
        g = r["gain_vs_best_std_pct"]
        cells = [r["name"], *[_fmt(r["by_source"].get(s, {}).get("bpb")) for s in sources], _fmt(r["mean_bpb"]),
                 "(best STD)" if r["name"] == ref else ("–" if g is None else f"{g:+.1f} %")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Gain = (mean BPB of the best STD run − mean BPB of the run) / mean BPB of the best STD run."]
    if data.get("eval_text_note"):
        lines += ["", f"**{data['eval_text_note']}**"]
    lines += ["",
              "## Validation perplexity (per token of each run's own tokenizer: comparable only between runs "
              "that share a tokenizer; SPEC-OPT's are not comparable with the others)", ""]
    head = ["run", *sources, "mean"]
    lines += ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    for r in runs:
        cells = [r["name"], *[_fmt(r["by_source"].get(s, {}).get("ppl"), 2) for s in sources],
                 _fmt(r["mean_ppl"], 2)]
        lines.append("| " + " | ".join(cells) + " |")
    if any(r.get("plasticity") for r in runs):
        lines += ["", "## Plasticity (a fresh embedding for a held-out source, trained on the run's body)", "",
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
                  "that adaptation (`random_reference` in results.json names the run whose adaptation made "
                  "it).",
                  "", "```bash"] + [shlex.join(r["plasticity"]["command"]) for r in runs
                                    if r.get("plasticity") and r["plasticity"].get("command")] + ["```"]
    lines += ["", "## Cost", "",
              "Parameters held by the largest rank; bytes per round summed over all ranks (measured, "
              "`outer` records). STD runs in one group, so nothing crosses groups; its column shows what "
              f"it would send in {data['std_equivalent_round']} if its batch were split over {G} data-parallel "
              "workers (fp32 gradients all-reduced every step).", "",
              "| run | params/rank body | params/rank embeddings | outer_body/round | outer_embedding/round | "
              "source_move/round | STD data-parallel equivalent/round | wall time |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        b = r["bytes_per_round"]
        p = r["params_per_rank"]
        eq = r["std_equivalent_bytes_per_round"]
        cells = [r["name"], f"{p.get('body', 0):,}", f"{p.get('embeddings', 0):,}",
                 *[(_fmt_bytes(b.get(c, 0.0)) if r["rounds"] else "–") for c in CROSS_GROUP],
                 _fmt_bytes(eq) if eq is not None else "–",
                 f"{r['seconds']:.0f} s" if r.get("seconds") else "–"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Figures: `bpb.png` (validation BPB per source), `curves.png` (validation BPB and training "
              "loss against tokens), `bytes.png` (cross-group bytes per round, log scale).", "",
              "## Commands", "", "```bash"]
    for r in runs:
        if r.get("command"):
            lines.append(shlex.join(r["command"]))
    lines += ["```", ""]
    return "\n".join(lines)


def plot(data: dict[str, Any], out_dir: str) -> list[str]:
    """Write bpb.png, curves.png and bytes.png; returns their paths."""
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError("the study's figures need matplotlib (installed by tools/setup_env.sh with the "
                           "test extras; pip install matplotlib)") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in data["runs"] if r["finished"]]
    sources = data["sources"]
    names = [r["name"] for r in runs]
    paths = []

    # grouped bars: validation BPB per source (and the mean), one bar per run
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * (len(sources) + 1) + 0.3 * len(runs)), 4.2))
    cats = sources + ["mean"]
    width = 0.8 / max(1, len(runs))
    for i, r in enumerate(runs):
        vals = [r["by_source"].get(s, {}).get("bpb") or float("nan") for s in sources] + [r["mean_bpb"]]
        ax.bar([c + (i - (len(runs) - 1) / 2) * width for c in range(len(cats))], vals, width, label=r["name"])
    ax.set_xticks(range(len(cats)), cats)
    ax.set_ylabel("validation bits per byte")
    ax.set_title("Validation BPB per source (lower is better)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "bpb.png"))
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    # curves against tokens
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in runs:
        tps = r["train_tokens"] / max(1, r["eval_step"])
        xs = [s * tps for s, _ in r["eval_curve"]]
        a1.plot(xs, [v for _, v in r["eval_curve"]], marker="o", label=r["name"])
        a2.plot([s * tps for s, _ in r["train_curve"]], [v for _, v in r["train_curve"]], label=r["name"])
    from matplotlib.ticker import EngFormatter
    for a in (a1, a2):  # 200k, 400k, ... instead of digits that run into each other
        a.xaxis.set_major_formatter(EngFormatter(sep=""))
    a1.set_xlabel("training tokens")
    a1.set_ylabel("mean validation BPB")
    a1.set_title("Validation BPB")
    a2.set_xlabel("training tokens")
    a2.set_ylabel("training loss (nats per token of the run's tokenizer)")
    a2.set_title("Training loss")
    a1.legend(fontsize=7)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "curves.png"))
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    # cross-group bytes per round, log scale
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(runs) + 2), 4.2))
    cats = list(CROSS_GROUP) + ["std (data-parallel equivalent)"]
    width = 0.8 / len(cats)
    for j, c in enumerate(cats):
        vals = []
        for r in runs:
            if c in CROSS_GROUP:
                v = r["bytes_per_round"].get(c, 0.0) if r["rounds"] else 0.0
            else:
                v = r["std_equivalent_bytes_per_round"] or 0.0
            vals.append(v if v > 0 else float("nan"))
        ax.bar([i + (j - (len(cats) - 1) / 2) * width for i in range(len(runs))], vals, width, label=c,
               hatch="//" if c not in CROSS_GROUP else None)
    ax.set_yscale("log")
    ax.set_xticks(range(len(runs)), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("bytes per round (all ranks)")
    ax.set_title("Cross-group bytes per round by category")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "bytes.png"))
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths
