#!/usr/bin/env python3
"""Run a reproduction study: a grid of runs at equal compute, then the paper's Table 3.

    python tools/study.py --grid STUDY.yaml --out DIR [--parallel N] [--dry-run] [--report-only] [--rerun-changed]

Run it from the repository root (configs and data paths in the grid are relative to it).
The grid (see dept_mega/study/grid.py and examples/study/sample.yaml) lists variants ×
outer optimizers × any dotted overrides; every run is ``torchrun --standalone
--nproc-per-node N -m dept_mega.train`` with ``train.run_dir=DIR/runs/NAME``. Runs already
finished are skipped, so a stopped study continues where it was; a run directory made with
other settings than the grid now asks for (an edited grid or base config) is refused, naming
the run and the keys, unless ``--rerun-changed`` moves it to ``DIR/replaced/`` and makes it
again (the same for adaptations). ``--parallel N`` runs several runs at once within a budget
of N processes (default: one run at a time).

Writes ``DIR/results.md`` (whether the runs make equal compute or differ in the model, a note
on any source whose evaluated text differs between runs, per-source validation BPB and
perplexity with runs that differ only in their seed as one row (mean ± sd, n), each DEPT row's
gain over the best STD row's mean, parameters per rank, cross-group bytes per inner step and in
total, the command lines), ``DIR/results.json`` (the same numbers and the curves) and the
figures ``DIR/bpb.png``, ``DIR/curves.png``, ``DIR/bytes.png``. With ``plasticity:`` in the
grid, every run's body is then adapted to a held-out source (``python -m dept_mega.adapt``,
results in ``DIR/plasticity/NAME/``) and results.md gains a plasticity table.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from dept_mega.study.grid import GridError, describe, load_study  # noqa: E402
from dept_mega.study.figures import plot  # noqa: E402
from dept_mega.study.markdown import render_markdown  # noqa: E402
from dept_mega.study.report import summary, write_json  # noqa: E402
from dept_mega.study.results import RunReadError, read_run  # noqa: E402
from dept_mega.study.runner import (StaleRunError, find_stale, is_finished, replace_stale, run_all,  # noqa: E402
                                    run_dir_of, run_plasticity, stale_message)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grid", required=True, help="study grid (YAML)")
    ap.add_argument("--out", required=True, help="output directory (runs, results.md, figures)")
    ap.add_argument("--parallel", type=int, default=0,
                    help="budget of processes running at once (default: one run at a time)")
    ap.add_argument("--dry-run", action="store_true", help="print the runs and their commands, run nothing")
    ap.add_argument("--report-only", action="store_true", help="write the report from the finished runs only")
    ap.add_argument("--rerun-changed", action="store_true",
                    help="runs (and adaptations) in DIR made with other settings than the grid now asks for: move "
                         "them to DIR/replaced/ and make them again (default: refuse)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    # the command that runs (or resumes) the study: a report made with --report-only names it too
    command = "python tools/study.py " + shlex.join(
        [a for a in (argv if argv is not None else sys.argv[1:])
         if a not in ("--report-only", "--dry-run", "--rerun-changed")])
    try:
        study = load_study(args.grid)
    except GridError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.parallel < 0:
        print("error: --parallel must be >= 0", file=sys.stderr)
        return 2
    if args.rerun_changed and (args.report_only or args.dry_run):
        print("error: --rerun-changed makes runs again; it does not go with --report-only or --dry-run",
              file=sys.stderr)
        return 2
    print(describe(study), flush=True)
    from dept_mega.config import load_config
    steps = load_config(study.runs[0].config, study.runs[0].overrides).train.steps
    stale = find_stale(study, args.out)
    if args.dry_run:
        from dept_mega.study.runner import full_command
        for r in study.runs:
            print(shlex.join(full_command(args.out, r, "python")))
        if stale:
            print(f"warning: {stale_message(stale, args.out)}")
        return 0
    if stale and not args.rerun_changed:
        print(f"error: {stale_message(stale, args.out)}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    failed = []
    if not args.report_only:
        for cmd in study.prepare:
            cmd = [sys.executable if c == "python" else c for c in cmd]
            print(f"[study] prepare: {shlex.join(cmd)}", flush=True)
            rc = subprocess.run(cmd).returncode
            if rc:
                print(f"error: prepare command {shlex.join(cmd)} exited {rc}", file=sys.stderr)
                return 1
        replace_stale(stale, args.out)
        outcomes = run_all(study, args.out, steps, parallel=args.parallel)
        failed = [o.run.name for o in outcomes if o.returncode != 0]
    results = {}
    for r in study.runs:
        if not is_finished(args.out, r, steps):
            continue
        try:
            results[r.name] = read_run(run_dir_of(args.out, r))
        except RunReadError as exc:
            print(f"error: run {r.name}: {exc}", file=sys.stderr)
            failed.append(r.name)
    if not results:
        print("error: no finished run to report on", file=sys.stderr)
        return 1
    try:
        plasticity = (run_plasticity(study, args.out, steps, execute=not args.report_only)
                      if study.plasticity is not None else None)
    except StaleRunError as exc:  # (a config file changed while the runs trained)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if study.plasticity is not None:
        wanted = [r.name for r in study.runs if r.name in results
                  and (study.plasticity.runs is None or r.name in study.plasticity.runs)]
        failed += [n for n in wanted if n not in plasticity]
    data = summary(study, results, command, plasticity)
    write_json(os.path.join(args.out, "results.json"), data)
    with open(os.path.join(args.out, "results.md"), "w", encoding="utf-8") as f:
        f.write(render_markdown(data))
    figures = plot(data, args.out)
    print(render_markdown(data))
    print(f"[study] wrote {os.path.join(args.out, 'results.md')}, results.json, "
          + ", ".join(os.path.basename(p) for p in figures), flush=True)
    if failed:
        print(f"error: run(s) not finished: {', '.join(sorted(set(failed)))}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from dept_mega.process_exit import exit_after
    exit_after(main)
