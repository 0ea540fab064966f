#!/usr/bin/env python
"""Exposed vs hidden outer-sync time on a simulated slow link (docs/dept.md, "Hiding").

    python benchmarks/outer_hiding.py [--step-s 0.1] [--tau 3] [--delays 0 0.05 0.1 0.2]

Two gloo ranks (two groups), a 64-value body, L = 4 inner steps of ``--step-s`` seconds of
(simulated) compute, 3 rounds; the outer group's collectives complete ``delay`` seconds after
launch (``Comm.simulate_slow_link``). Prints, per delay, the seconds exposed per sync of the
blocking sync and of the overlapped one (τ = ``--tau``), and the seconds the overlapped one
hid behind compute.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tests.test_dept_outer_sync import hiding_table  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--step-s", type=float, default=0.1)
    ap.add_argument("--tau", type=int, default=3)
    ap.add_argument("--delays", type=float, nargs="+", default=[0.0, 0.05, 0.1, 0.2])
    args = ap.parse_args()
    rows = hiding_table(tuple(args.delays), args.step_s, args.tau)
    print("| link delay (s) | blocking: exposed s/sync | overlapped τ=%d: exposed s/sync | overlapped: hidden s/sync |"
          % args.tau)
    print("|---|---|---|---|")
    for d, blk, ovl, hid in rows:
        print(f"| {d:.2f} | {blk:.3f} | {ovl:.3f} | {hid:.3f} |")


if __name__ == "__main__":
    main()
