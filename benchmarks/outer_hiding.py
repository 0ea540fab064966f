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
import socket
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

ROUNDS, L = 3, 4  # rounds and inner steps per round


def hiding_worker(rank, world, delays, step_s, tau):
    """One rank's records: ``{(overlap, delay): [(hidden_s, exposed_s) per counted sync]}``.
    Needs ``torch.distributed`` initialised (two ranks)."""
    from dept_mega.dept.outer import FlatSync, OuterOptimizer
    from dept_mega.dept.streaming import OuterSchedule, SyncUnit
    from dept_mega.parallel.groups import build_groups
    pg = build_groups(tensor=1, data=1, pipeline=1)
    out = {}
    for overlap in (False, True):
        for delay in delays:
            pg.comm.simulate_slow_link(pg.outer, latency_s=delay)
            params = [torch.nn.Parameter(torch.randn(64))]
            sync = FlatSync(params, pg, OuterOptimizer("fedavg"))
            sched = OuterSchedule([SyncUnit(sync, L, "body")], L, tau if overlap else 0, ROUNDS * L)
            exposed = []
            for s in range(ROUNDS * L):
                sched.before_step(s)
                time.sleep(step_s)  # the inner step's compute
                with torch.no_grad():
                    params[0].add_(0.01)
                sched.after_step(s + 1)
                if (s + 1) % L == 0 and s + 1 < ROUNDS * L:  # the last step flushes: not counted
                    sched.round_end(s + 1)
                    exposed.append(sched.take_times())
            sched.round_end(ROUNDS * L)
            out[(overlap, delay)] = exposed
            pg.comm.simulate_slow_link(None)
    return out


def hiding_rows(records, delays):
    """``(delay, blocking exposed s/sync, overlapped exposed s/sync, overlapped hidden s/sync)``
    per delay, from rank 0's :func:`hiding_worker` records. Rounds 1 and 2 are counted (the last
    step's flush is left out): the blocking run applied 2 syncs there, the overlapped one 1
    (round 1's, τ steps into round 2; round 2's is flushed)."""
    rows = []
    for d in delays:
        blk = sum(e for _, e in records[(False, d)]) / 2
        ovl = sum(e for _, e in records[(True, d)]) / 1
        hid = sum(o for o, _ in records[(True, d)]) / 1
        rows.append((d, blk, ovl, hid))
    return rows


def _rank_main(rank, port, out_path, delays, step_s, tau):
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "DEPT_MEGA_DEVICE": "cpu"})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    records = hiding_worker(rank, 2, delays, step_s, tau)
    if rank == 0:
        torch.save(records, out_path)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--step-s", type=float, default=0.1)
    ap.add_argument("--tau", type=int, default=3)
    ap.add_argument("--delays", type=float, nargs="+", default=[0.0, 0.05, 0.1, 0.2])
    args = ap.parse_args()
    delays = tuple(args.delays)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "records.pt")
        mp.spawn(_rank_main, args=(port, path, delays, args.step_s, args.tau), nprocs=2)
        records = torch.load(path)
    print("| link delay (s) | blocking: exposed s/sync | overlapped τ=%d: exposed s/sync | overlapped: hidden s/sync |"
          % args.tau)
    print("|---|---|---|---|")
    for d, blk, ovl, hid in hiding_rows(records, delays):
        print(f"| {d:.2f} | {blk:.3f} | {ovl:.3f} | {hid:.3f} |")


if __name__ == "__main__":
    main()
