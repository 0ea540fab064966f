#!/usr/bin/env python3
"""Where the GPU time of a profiled step goes: sums the CUDA kernels of a torch.profiler Chrome
trace (``train.profile`` writes them to RUN/profile/) by kernel and by kind.

    python benchmarks/kernel_breakdown.py RUN/profile/rank0_steps2-3.json [--top 25] [--json OUT]

Kinds (by kernel name, a heuristic): gemm (cuBLAS / CUTLASS / nvjet matrix kernels), attention
(flash / fused attention), nccl, optimizer (fused AdamW, foreach), copy (memcpy / memset), other
(elementwise, norms, reductions, ...). The headline's ``busy`` is the time the GPU was active
inside the steps: the union of the kernels, memcpys and memsets on all streams, clipped to the
ProfilerStep host ranges (``span``, their summed wall time), so busy / span is at most 1 and below
1 means the GPU sat idle (launch gaps, host syncs, waiting for the CPU). GPU work that ran after
a step's host range closed (the optimizer's kernels: the step returns without waiting for them),
up to the next step's start, is given apart (``after``), as is the kernels' summed time (the
denominator of the tables' shares; kernels on concurrent streams overlap, so it can exceed the
union). Each kernel of the table says what launched it (``kernel_launchers.py``):
the host operator around its launch call, with its input shapes, top-level operator and
``record_function`` range, up to three launchers with their calls.

After the kernel tables, for each profiled step (``step_timeline.py`` defines each figure): the
GPU's idle time (the step's span minus the union of its kernels / copies on all streams), its idle
gaps longer than ``--gap-us`` with what the launching host thread was doing when each opened, the
host operators by self time, the CUDA runtime / driver calls and kernel launches, and the host
threads. ``--json`` writes the same under ``"per_step"``.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

from kernel_launchers import attribute, cell, summary_line
from step_timeline import (GPU_CATS, Ev, active_after, analyse, gaps_in, is_step, render as render_steps, short,
                           timeline, union)

KINDS = (
    ("nccl", ("nccl",)),
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn_generated_fort_native_sdpa")),
    ("gemm", ("gemm", "cutlass", "nvjet", "xmma", "sm90_", "cublas", "ampere_", "hopper")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("copy", ("memcpy", "memset", "copy_kernel")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def inside_and_after(gpu: list[Ev], steps: list[tuple[float, float]]) -> tuple[float, float]:
    """GPU-active time (the union of the ``gpu`` events, step_timeline's) inside the ``steps``'
    ranges, and after each step's end up to the next step's start (after the last one: to the
    trace's end)."""
    merged = union(gpu)
    inside = after = 0.0
    for k, (a, b) in enumerate(steps):
        inside += gaps_in(merged, a, b)[0]
        after += active_after(merged, b, steps[k + 1][0] if k + 1 < len(steps) else float("inf"))
    return inside, after


def breakdown(trace: dict, category: str = "kernel") -> dict:
    """Sums the complete events of ``category`` ("kernel": CUDA kernels; "cpu_op": the host's
    operators, nested ones counted in each parent too — for a CPU rehearsal only) by name and
    kind (``summed_us``); for kernels, ``busy_us`` and ``after_us`` (:func:`inside_and_after` of
    the GPU's kernels, memcpys and memsets) against ``span_us``, the steps' summed ranges."""
    events = trace.get("traceEvents", trace if isinstance(trace, list) else [])
    by_name: dict[str, list] = defaultdict(lambda: [0.0, 0])
    by_kind: dict[str, float] = defaultdict(float)
    steps, gpu = [], []
    for e in events:
        if e.get("ph") != "X":
            continue
        if e.get("cat") in GPU_CATS:
            ts = float(e["ts"])
            gpu.append(Ev(str(e.get("name", "")), e["cat"], None, ts, ts + float(e.get("dur", 0.0)), None))
        if e.get("cat") == category:
            d = float(e.get("dur", 0.0))
            by_name[e["name"]][0] += d
            by_name[e["name"]][1] += 1
            by_kind[kind_of(e["name"])] += d
        elif is_step(str(e.get("name", "")), e.get("cat")):  # not kineto's GPU-side copy of the range
            steps.append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))))
    steps.sort()
    summed = sum(v[0] for v in by_name.values())
    span = sum(b - a for a, b in steps)
    busy, after = inside_and_after(gpu, steps) if category == "kernel" else (None, None)
    return {"category": category, "summed_us": summed, "busy_us": busy, "after_us": after, "span_us": span,
            "steps": len(steps), "by_kind_us": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
            "kernels": sorted(([n, v[0], v[1]] for n, v in by_name.items()), key=lambda r: -r[1])}


def render(res: dict, top: int) -> str:
    summed, span = res["summed_us"], res["span_us"]
    if res.get("category") == "cpu_op":  # nested operators overlap: no share of the span
        lines = [f"steps {res['steps']}: host operators {summed / 1e3:.1f} ms summed (each nested one in its "
                 f"parent too) in {span / 1e3:.1f} ms profiled"]
        share = "share of summed"
    else:
        busy = res["busy_us"]
        lines = [f"steps {res['steps']}: GPU busy {busy / 1e3:.1f} ms of {span / 1e3:.1f} ms profiled"
                 + (f" ({100 * busy / span:.1f}%)" if span else "")
                 + f" (the union of its kernels and copies inside the steps); GPU work after the steps' ends "
                 f"{res['after_us'] / 1e3:.2f} ms; kernels summed {summed / 1e3:.1f} ms"]
        share = "share of kernel time"
    lines.append(f"| kind | ms | {share} |")
    lines.append("| --- | ---: | ---: |")
    for k, v in res["by_kind_us"].items():
        lines.append(f"| {k} | {v / 1e3:.2f} | {100 * v / max(summed, 1e-9):.1f}% |")
    lines.append("")
    att = res.get("launchers")
    if att is not None:
        lines.append(summary_line(att))
        lines.append("")
        lines.append("| kernel | calls | ms | share | launched by |")
        lines.append("| --- | ---: | ---: | ---: | --- |")
    else:
        lines.append("| kernel | calls | ms | share |")
        lines.append("| --- | ---: | ---: | ---: |")
    for name, us, calls in res["kernels"][:top]:
        row = f"| `{short(name, 90)}` | {calls} | {us / 1e3:.2f} | {100 * us / max(summed, 1e-9):.1f}% |"
        lines.append(row + (f" {cell(att['kernels'].get(name))} |" if att is not None else ""))
    if res.get("launchers_note"):
        lines.append(res["launchers_note"])
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", default=None, help="also write the breakdown as JSON here")
    ap.add_argument("--gap-us", type=float, default=20.0, help="GPU idle gaps longer than this are listed")
    ap.add_argument("--gaps", type=int, default=8, help="the longest gaps listed per step")
    ap.add_argument("--top-host", type=int, default=20, help="rows of the host tables per step")
    ap.add_argument("--category", choices=("kernel", "cpu_op"), default="kernel",
                    help="kernel: CUDA kernels; cpu_op: host operators (a CPU trace; nested ones overlap)")
    args = ap.parse_args(argv)
    with open(args.trace, encoding="utf-8") as f:
        trace = json.load(f)
    res = breakdown(trace, args.category)
    if not res["kernels"]:
        print(f"error: {args.trace} has no {args.category} events"
              + (" (profiled on a CPU? --category cpu_op)" if args.category == "kernel" else ""), file=sys.stderr)
        return 1
    tl = timeline(trace)
    if args.category == "kernel":
        res["launchers"] = attribute(tl)
    else:
        res["launchers_note"] = ("launched by: nothing to attribute: "
                                 + ("the rows are host operators (--category cpu_op)"
                                    if any(ev.cat == "kernel" for ev in tl.gpu)
                                    else "no CUDA kernels in this trace (a CPU profile)"))
    res["per_step"] = analyse(trace, args.gap_us, args.gaps, args.top_host, tl=tl)
    print(render(res, args.top))
    print(render_steps(res["per_step"]))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
