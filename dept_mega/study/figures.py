"""The study's figures (matplotlib) from :func:`report.summary`'s numbers: ``bpb.png`` (one bar
per row, ± sd over its seeds; hatched where the row read other validation text than the
reference), ``curves.png`` (one line per run; evaluations inside a round as
unjoined × marks) and ``bytes.png`` (cross-group bytes per inner step)."""
from __future__ import annotations

import math
import os
from typing import Any

from .results import CROSS_GROUP


def _nan(x: Any) -> float:
    return float("nan") if x is None or not math.isfinite(x) else float(x)


def _save(plt, fig, out_dir: str, name: str) -> str:
    """``fig`` laid out and written as ``out_dir/name``, then closed; returns the path."""
    fig.tight_layout()
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot(data: dict[str, Any], out_dir: str) -> list[str]:
    """Write bpb.png, curves.png and bytes.png; returns their paths."""
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError("the study's figures need matplotlib (installed by tools/setup_env.sh with the "
                           "test extras; pip install matplotlib)") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter

    runs = [r for r in data["runs"] if r["finished"]]
    rows = data.get("rows", [])
    sources = data["sources"]
    paths = []

    # grouped bars: validation BPB per source (and the mean), one bar per row, ± sd over seeds
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * (len(sources) + 1) + 0.3 * len(rows)), 4.2))
    cats = sources + ["mean"]
    width = 0.8 / max(1, len(rows))
    for i, r in enumerate(rows):
        vals = [_nan(r["by_source"].get(s, {}).get("bpb")) for s in sources] + [_nan(r["mean_bpb"])]
        sds = [r["by_source"].get(s, {}).get("bpb_sd") or 0.0 for s in sources] + [r["mean_bpb_sd"] or 0.0]
        other = r.get("eval_text") == "other"  # not the reference's validation text (results.md's note)
        ax.bar([c + (i - (len(rows) - 1) / 2) * width for c in range(len(cats))], vals, width,
               yerr=sds if r["n"] > 1 else None, capsize=2, hatch="xx" if other else None,
               label=f"{r['label']} (n={r['n']}" + ("; other text" if other else "") + ")")
    ax.set_xticks(range(len(cats)), cats)
    ax.set_ylabel("validation bits per byte")
    ax.set_title("Validation BPB per source (lower is better; bars: ± sd over seeds)")
    ax.legend(fontsize=7, ncol=2)
    paths.append(_save(plt, fig, out_dir, "bpb.png"))

    # curves against tokens; an evaluation inside a round is not the synchronised model: × marks
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    marked = False
    for r in runs:
        tps = r["train_tokens"] / max(1, r["eval_step"])
        mid = set(r.get("mid_round_eval_steps") or ())
        ends = [(s, v) for s, v in r["eval_curve"] if s not in mid]
        (line,) = a1.plot([s * tps for s, _ in ends], [v for _, v in ends], marker="o", label=r["name"])
        if mid:
            pts = [(s, v) for s, v in r["eval_curve"] if s in mid]
            a1.plot([s * tps for s, _ in pts], [v for _, v in pts], linestyle="none", marker="x",
                    color=line.get_color(), label=None if marked else "inside a round (not synchronised)")
            marked = True
        a2.plot([s * tps for s, _ in r["train_curve"]], [v for _, v in r["train_curve"]], label=r["name"])
    for a in (a1, a2):  # 200k, 400k, ... instead of digits that run into each other
        a.xaxis.set_major_formatter(EngFormatter(sep=""))
    a1.set_xlabel("training tokens")
    a1.set_ylabel("mean validation BPB")
    a1.set_title("Validation BPB")
    a2.set_xlabel("training tokens")
    a2.set_ylabel("training loss (nats per token of the run's tokenizer)")
    a2.set_title("Training loss")
    a1.legend(fontsize=7)
    paths.append(_save(plt, fig, out_dir, "curves.png"))

    # cross-group bytes per inner step, log scale
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(runs) + 2), 4.2))
    cats = list(CROSS_GROUP) + ["std (data-parallel equivalent)"]
    width = 0.8 / len(cats)
    for j, c in enumerate(cats):
        vals = []
        for r in runs:
            if c in CROSS_GROUP:
                v = (r.get("bytes_per_step") or {}).get(c, 0.0) if r["rounds"] else 0.0
            else:
                v = r.get("std_equivalent_bytes_per_step") or 0.0
            vals.append(v if v > 0 else float("nan"))
        ax.bar([i + (j - (len(cats) - 1) / 2) * width for i in range(len(runs))], vals, width, label=c,
               hatch="//" if c not in CROSS_GROUP else None)
    ax.set_yscale("log")
    ax.set_xticks(range(len(runs)), [r["name"] for r in runs], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("bytes per inner step (all ranks)")
    ax.set_title("Cross-group bytes per inner step by category")
    ax.legend(fontsize=7)
    paths.append(_save(plt, fig, out_dir, "bytes.png"))
    return paths
