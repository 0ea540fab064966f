#!/usr/bin/env python3
"""Compare finished runs side by side: per-source validation BPB, cross-group bytes (per inner
step, in total and per round), parameters per rank.

    python tools/summarize_runs.py runs/main_std runs/main_spec_opt [--json OUT.json]

Reads each run's ``config.yaml`` (its relative tokenizer paths from the directory the run was
launched from: dept_mega.run_paths), ``metrics.jsonl`` (the last ``eval`` record, every
``outer`` record and, for a federated group job, every ``membership`` record; one record per
kind and step, the last when a file repeats one) and ``params.json`` (parameters held by each rank, written by
``dept_mega.train``). Bits per byte compare runs with different tokenizers; loss and
perplexity do not. They compare the same text only where the runs evaluated the same bytes of a
source: a note under the table names the sources where they did not (``eval_text_note``).

Bytes are measured (``outer`` records, summed over ranks, in the run's ``dept.outer_comm_dtype``)
and printed in decimal units (``kB`` = 1000 bytes, dept_mega.metrics.format_bytes);
``Table 1 params/step`` is the paper's prediction in *parameters* per inner step, the same for
any outer dtype.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import textwrap
from typing import Any

import yaml

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dept_mega.metrics import format_bytes  # noqa: E402
from dept_mega.study.results import CROSS_GROUP  # noqa: E402 - what crosses source groups (not dp)


class RunError(RuntimeError):
    pass


def read_run(run_dir: str) -> dict[str, Any]:
    cfg_path = os.path.join(run_dir, "config.yaml")
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    for path in (cfg_path, metrics_path):
        if not os.path.exists(path):
            raise RunError(f"{path} does not exist: is {run_dir!r} a finished run?")
    with open(cfg_path, encoding="utf-8") as f:
        cfg = yaml.safe_load(f)
    by_key: dict[tuple, dict] = {}
    records = 0
    with open(metrics_path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise RunError(f"{metrics_path}:{lineno}: not JSON ({exc})") from exc
            # (membership: a group leaving and others joining may share a step)
            extra = (tuple(rec.get("left", ())), tuple(rec.get("joined", ()))) if rec.get("kind") == "membership" else ()
            by_key[(rec.get("kind"), rec.get("step")) + extra] = rec
            records += 1
    # dept_mega rewrites metrics.jsonl on resume so that no step repeats; a file from before
    # that (or edited by hand) may repeat steps: the last record of a (kind, step) counts
    repeated = records - len(by_key)
    if repeated:
        print(f"warning: {metrics_path}: {repeated} repeated record(s) of the same kind and step (a resumed run "
              f"before dept_mega kept metrics.jsonl clean); the last of each counts", file=sys.stderr)
    evals, outers, trains, members = [], [], [], []
    for rec in sorted(by_key.values(), key=lambda r: (r.get("step") or 0)):
        {"eval": evals, "outer": outers, "train": trains, "membership": members}.get(rec.get("kind"), []).append(rec)
    if not evals:
        raise RunError(f"{metrics_path}: no eval record")
    params = None
    params_path = os.path.join(run_dir, "params.json")
    if os.path.exists(params_path):
        with open(params_path, encoding="utf-8") as f:
            params = json.load(f)
    rounds = len(outers)
    total_bytes: dict[str, float] = {}
    for rec in outers:
        for cat, n in rec["bytes"].items():
            total_bytes[cat] = total_bytes.get(cat, 0) + n
    outer_bytes = {cat: n / rounds for cat, n in total_bytes.items()}
    # inner steps trained: the last step a record reached (a finished run: train.steps)
    steps = max([int(r["step"]) for r in trains + evals + outers] or [0])
    cross = sum(total_bytes.get(c, 0) for c in CROSS_GROUP)
    tokens = trained_tokens(trains, members)
    comm = predicted_comm_per_step(run_dir, cfg["dept"]["variant"])
    # federated source groups: who left and joined when, and how many groups took part per round
    membership = [{k: m.get(k) for k in ("step", "round", "groups", "joined", "left", "healed")} for m in members]
    took_part = sorted({len(rec["groups"]) for rec in outers if "groups" in rec})
    return {"run_dir": run_dir, "variant": cfg["dept"]["variant"], "eval": evals[-1],
            "eval_read_whole": read_whole(cfg, evals[-1]),
            "federation": cfg.get("federation") if (cfg.get("federation") or {}).get("lighthouse") else None,
            "membership": membership, "groups_per_round": took_part,
            "rounds": rounds, "outer_bytes_per_round": outer_bytes, "outer_bytes_total": total_bytes,
            "steps": steps, "outer_comm_dtype": None if cfg["dept"]["variant"] == "std" else cfg["dept"].get(
                "outer_comm_dtype", "fp32"),
            "cross_group_bytes_total": cross if rounds else None,
            "cross_group_bytes_per_step": cross / steps if rounds and steps else None, "params": params,
            "train_tokens": tokens, "comm_params_per_step": comm, "final_train_loss": trains[-1]["loss"] if trains else None}


def read_whole(cfg: dict, ev: dict) -> dict[str, bool]:
    """Per source of eval record ``ev``: whether it read the validation part whole
    (dept_mega.study.rows.read_part_whole)."""
    from dept_mega.study.rows import read_part_whole
    return {s: read_part_whole(cfg, v) for s, v in ev["by_source"].items()}


def eval_text_note(runs: list[dict[str, Any]], names: list[str]) -> list[str]:
    """The sources whose final evaluation read different bytes in different runs, said under the
    BPB table: their bits per byte are then of different text (docs/dept.md, "Studies and
    plasticity"). A run reads the first N sequences of each validation part; another N, or
    another tokenizer (SPEC-OPT's own) cutting the part into sequences, is other text."""
    differ, other = [], False
    for s in dict.fromkeys(s for r in runs for s in r["eval"]["by_source"]):
        by: dict[int, list[str]] = {}
        for n, r in zip(names, runs):
            b = r["eval"]["by_source"].get(s, {}).get("bytes")
            if b is not None:
                by.setdefault(int(b), []).append(n)
        if len(by) > 1:
            differ.append(f"{s}: " + ", ".join(f"{' and '.join(ns)} {b:,} bytes" for b, ns in sorted(by.items())))
            other = other or not all(r.get("eval_read_whole", {}).get(s, False)
                                     for r in runs if s in r["eval"]["by_source"])
    if not differ:
        return []
    if other:
        why = ("A run evaluates the first train.eval_samples sequences of each validation part (default "
               "train.eval_iters × train.global_batch_size): another number of sequences, or another tokenizer "
               "(SPEC-OPT's own) cutting the part into sequences, is other text. To compare on the same text, "
               "read every part whole: set train.eval_samples above any part's sequence count in every run's "
               "config, or re-evaluate each run so (python -m dept_mega.evaluate --run-dir RUN --out R.json "
               "train.eval_samples=N), or set eval_whole: true in a tools/study.py grid.")
    else:
        why = ("Every run read these parts whole: only each tokenizer's first token and last, incomplete "
               "sequence of a part differ (at most model.seq_length tokens).")
    return (["", "note: not the same validation text: the runs' final evaluations read different bytes, so "
                 "these BPB are of different text:"]
            + [f"  {d}" for d in differ] + textwrap.wrap(why, 100, initial_indent="  ", subsequent_indent="  "))


def predicted_comm_per_step(run_dir: str, variant: str) -> float | None:
    """Paper Table 1's per-step communication (parameters crossing groups per inner step)
    for this run's config, from dept_mega.dept.costs (the same arithmetic as tools/dept_costs.py).
    The config's relative tokenizer paths are read from the run's launch directory
    (dept_mega.run_paths), which is said once when it is not the current one."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from dept_mega.config import ConfigError
    from dept_mega.dept.cost_vocabs import with_defaults
    from dept_mega.dept.costs import predict_costs, resolve_vocabs
    from dept_mega.run_paths import load_run_config

    try:
        cfg, paths = load_run_config(run_dir)
    except ConfigError as exc:
        raise RunError(str(exc)) from None
    if paths.note() is not None:
        print(paths.note(), file=sys.stderr)
    try:
        # SPEC-OPT's vocabulary = the global one, the global one = the largest source's, where
        # the config has no such tokenizer (as tools/dept_costs.py)
        v = with_defaults(resolve_vocabs(cfg), cfg)
    except ConfigError as exc:
        # the run's tokenizers are not reachable from here (a run copied elsewhere, or one that
        # does not record its launch directory read from another): leave this one figure out
        print(f"warning: {paths.config}: no Table 1 params/step ({exc}{paths.hint(str(exc))})", file=sys.stderr)
        return None
    costs = predict_costs(cfg, v.global_vocab, v.source_vocabs, v.trim_vocabs or None)
    return costs[variant]["per_step_comm_params"]


def trained_tokens(trains: list[dict], members: list[dict]) -> int:
    """Tokens this run trained: each ``train`` record's step tokens times the steps since the
    previous record (records come every ``train.log_interval`` steps; a step's tokens are the
    same between them: packed sequences). A federated group that healed jumped to its peers'
    step without training the steps in between: its ``healed`` membership record (at the step
    it trains from) starts a new count."""
    jumps = sorted(m["step"] for m in members if m.get("healed") and m.get("step") is not None)
    total, prev = 0, 0
    for rec in trains:
        step = rec["step"]
        start = max([prev] + [j for j in jumps if j < step])
        total += rec.get("tokens", 0) * max(step - start, 0)
        prev = step
    return total


def labels(runs: list[dict[str, Any]]) -> list[str]:
    """Column names: the variant, and where two runs would share one (federated group jobs
    of one run, a sweep of one variant) the shortest ending of the run directories that
    tells them apart (``SPEC g0``)."""
    names = [r["variant"].upper() for r in runs]
    if len(set(names)) == len(names):
        return names
    parts = [os.path.normpath(os.path.abspath(r["run_dir"])).split(os.sep) for r in runs]
    for k in range(1, max(len(p) for p in parts) + 1):
        tails = ["/".join(p[-k:]) for p in parts]
        if len(set(tails)) == len(tails):
            break
    return [f"{n} {t}" for n, t in zip(names, tails)]


def _event(m: dict[str, Any]) -> str:
    """A ``membership`` record in a few characters: ``r3+2,3`` (joined at round 3; ``h``:
    healed from a live peer), ``r2-2`` (left in round 2)."""
    out = f"r{m['round']}"
    if m.get("left"):
        out += "-" + ",".join(str(g) for g in m["left"])
    if m.get("joined"):
        out += "+" + ",".join(str(g) for g in m["joined"]) + ("h" if m.get("healed") else "")
    return out


def _mean_bpb(values: list) -> float:
    """The mean, or nan when a value is null or non-finite: dept_mega writes a diverged
    evaluation's BPB as null (metrics.make_record), and a mean over it means nothing."""
    if not values or any(v is None or not math.isfinite(v) for v in values):
        return float("nan")
    return sum(values) / len(values)


def _bpb_cell(v: float | None, width: int) -> str:
    return f"{'nan':>{width}}" if v is None or not math.isfinite(v) else f"{v:>{width}.4f}"


def federated_lines(runs: list[dict[str, Any]], names: list[str]) -> list[str]:
    """One line per federated run whose group jobs are given together: its sources' mean BPB
    (each group job evaluates only its own sources), and which group jobs are missing."""
    runs_of: dict[tuple, list[int]] = {}
    for i, r in enumerate(runs):
        f = r.get("federation")
        if f:
            runs_of.setdefault((r["variant"], f.get("groups")), []).append(i)
    out = []
    for (variant, groups), idx in runs_of.items():
        if len(idx) < 2:
            continue
        bpb = {s: v["bpb"] for i in idx for s, v in runs[i]["eval"]["by_source"].items()}
        have = sorted({runs[i]["federation"].get("group") for i in idx})
        missing = [g for g in range(groups or 0) if g not in have]
        steps = sorted({runs[i]["eval"]["step"] for i in idx}, reverse=True)
        out.append(f"federated {variant.upper()} ({', '.join(names[i] for i in idx)}): mean over its "
                   f"{len(bpb)} sources {_bpb_cell(_mean_bpb(list(bpb.values())), 0)}"
                   + (f" (group job(s) {', '.join(map(str, missing))} not given: their sources are missing)"
                      if missing else "")
                   + (f" (evaluated at different steps: {', '.join(map(str, steps))})" if len(steps) > 1 else ""))
    return out


def render(runs: list[dict[str, Any]]) -> str:
    names = labels(runs)
    sources: list[str] = []
    for r in runs:
        for s in r["eval"]["by_source"]:
            if s not in sources:
                sources.append(s)
    width = max(16, *(len(n) + 2 for n in names))
    out = []
    head = f"{'validation BPB':<22}" + "".join(f"{n:>{width}}" for n in names)
    out += [head, "-" * len(head)]
    for s in sources:
        row = f"{s:<22}"
        for r in runs:
            ev = r["eval"]["by_source"]
            row += _bpb_cell(ev[s].get("bpb"), width) if s in ev else f"{'-':>{width}}"
        out.append(row)
    row = f"{'mean':<22}"
    means = [_mean_bpb([v.get("bpb") for v in r["eval"]["by_source"].values()]) for r in runs]
    row += "".join(_bpb_cell(m, width) for m in means)
    out.append(row)
    if any(math.isnan(m) for m in means):
        out.append("nan: a BPB that is not finite (the run diverged; metrics.jsonl holds null), "
                   "so its mean is nan too")
    out += federated_lines(runs, names)
    out += eval_text_note(runs, names)
    out.append("")
    out.append(f"{'per run':<22}" + "".join(f"{n:>{width}}" for n in names))
    out.append("-" * len(head))

    def line(label: str, values: list[str]) -> None:
        out.append(f"{label:<22}" + "".join(f"{v:>{width}}" for v in values))

    line("Table 1 params/step", [f"{r['comm_params_per_step']:,.0f}" if r["comm_params_per_step"] else "-"
                                 for r in runs])
    line("outer dtype", [r["outer_comm_dtype"] or "-" for r in runs])
    line("cross-group/step", [format_bytes(r["cross_group_bytes_per_step"])
                              if r["cross_group_bytes_per_step"] is not None else "-" for r in runs])
    line("cross-group total", [format_bytes(r["cross_group_bytes_total"])
                               if r["cross_group_bytes_total"] is not None else "-" for r in runs])
    line("eval step", [str(r["eval"]["step"]) for r in runs])
    line("train tokens", [f"{r['train_tokens']:,}" for r in runs])
    line("outer rounds", [str(r["rounds"]) for r in runs])
    cats = ["outer_body", "outer_embedding", "source_move", "dp"]
    for cat in cats:
        line(f"{cat}/round", [format_bytes(r["outer_bytes_per_round"].get(cat, 0)) if r["rounds"] else "-"
                               for r in runs])
    if any(r["groups_per_round"] for r in runs):  # federated group jobs
        line("groups/round", [("-".join(str(n) for n in sorted({r["groups_per_round"][0], r["groups_per_round"][-1]}))
                               if r["groups_per_round"] else "-") for r in runs])
        events = [(n, " ".join(_event(m) for m in r["membership"])) for n, r in zip(names, runs) if r["membership"]]
    for key, label in (("body", "body params/rank"), ("embeddings", "emb params/rank")):
        vals = []
        for r in runs:
            ranks = (r["params"] or {}).get("ranks")
            if not ranks:
                vals.append("-")
                continue
            nums = sorted({rk[key] for rk in ranks})
            vals.append(f"{nums[0]:,}" if len(nums) == 1 else f"{nums[0]:,}-{nums[-1]:,}")
        line(label, vals)
    if any(r["groups_per_round"] for r in runs):  # one line per job: too long for a column
        out += ["", "membership (rR+G: group G joined at round R, h: by healing; rR-G: left in round R)"]
        out += [f"  {n}: {e}" for n, e in events]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dirs", nargs="+")
    ap.add_argument("--json", help="also write the summary as JSON to this file")
    args = ap.parse_args(argv)
    try:
        runs = [read_run(d) for d in args.run_dirs]
    except RunError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(render(runs))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(runs, f, indent=1, default=lambda x: None if isinstance(x, float) and math.isnan(x) else x)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from dept_mega.process_exit import exit_after
    exit_after(main)
