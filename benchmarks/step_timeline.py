"""Per profiled step of a torch.profiler Chrome trace: when the GPU sat idle, what the host was
doing then, and where the host's time went. ``kernel_breakdown.py`` prints this after its kernel
tables; the functions here only read the trace.

Definitions (all times in µs, from the trace's complete ``X`` events):

- step: a ``ProfilerStep#N`` range on the host (``user_annotation``; kineto's copy of the same
  range on the GPU timeline, ``gpu_user_annotation``, is not a step).
- GPU activity: kernels, memcpys and memsets on every stream of the trace. ``active`` is the
  length of the UNION of their intervals inside the step: kernels on different streams overlap,
  so their summed durations (kernel_breakdown's ``busy``) can exceed the time the GPU was busy.
  ``idle`` = the step's span − active. A gap is a stretch of the step with no GPU activity,
  including the one from the step's start to its first kernel and from its last to the step's end.
- the launching thread of a gap: the host thread that launched the GPU work ending the gap (its
  CUDA runtime / driver call carries the same ``correlation`` as the kernel); without it the one
  that launched the work before the gap; else the step's own thread. The "CPU op at its start"
  is the stack of host ranges (operators, annotations, Python functions when the trace has them,
  CUDA API calls) open on that thread when the gap opened, innermost last.
- self time of a host range: its duration minus the time inside its direct children on the same
  thread (complete events on one thread nest). A range's self time is host work the trace does
  not break down further: Python between operators when the profile was taken without
  ``with_stack`` (``ProfilerStep#N``'s own self time), or, on the step's thread during the
  backward, waiting for autograd's device thread, which runs the backward's operators.
- ``launched +µs`` of a gap: when the call that launched the work ending the gap began, from the
  gap's start. Positive: the host issued that work only after the GPU ran dry (the host was
  late). Negative: it was queued in time and the GPU waited for something else (a dependency
  between streams, a synchronisation, the launch latency).
"""
from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
OP_CATS = ("cpu_op", "user_annotation", "python_function")
API_CATS = ("cuda_runtime", "cuda_driver")
HOST_CATS = OP_CATS + API_CATS
LAUNCH_PREFIXES = ("cudaLaunch", "cuLaunch", "cudaGraphLaunch", "cuGraphLaunch")


class Ev:
    """One complete event; ``parent`` and ``self_us`` are filled by ``nest`` (host events only);
    ``args`` is the event's own ``args`` (shapes, ``External id``: ``kernel_launchers`` reads them)."""
    __slots__ = ("name", "cat", "tid", "ts", "end", "corr", "args", "parent", "self_us")

    def __init__(self, name: str, cat: str, tid, ts: float, end: float, corr, args: dict | None = None) -> None:
        self.name, self.cat, self.tid, self.ts, self.end, self.corr = name, cat, tid, ts, end, corr
        self.args = args or {}
        self.parent: Ev | None = None
        self.self_us = end - ts


def is_step(name: str, cat) -> bool:
    return name.startswith("ProfilerStep#") and cat != "gpu_user_annotation"


def collect(trace) -> tuple[list[Ev], list[Ev], list[Ev]]:
    """The trace's GPU activities, host ranges and steps (sorted by start)."""
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    gpu, host, steps = [], [], []
    for e in events:
        if e.get("ph") != "X":
            continue
        cat, name = e.get("cat"), str(e.get("name", ""))
        if cat not in GPU_CATS and cat not in HOST_CATS and not is_step(name, cat):
            continue
        ts = float(e["ts"])
        args = e.get("args") or {}
        ev = Ev(name, cat, (e.get("pid"), e.get("tid")), ts, ts + float(e.get("dur", 0.0)), args.get("correlation"), args)
        if cat in GPU_CATS:
            gpu.append(ev)
        else:
            host.append(ev)
            if is_step(name, cat):
                steps.append(ev)
    return gpu, host, sorted(steps, key=lambda s: s.ts)


def nest(host: list[Ev]) -> dict:
    """Sets each host event's parent (the innermost range open on its thread when it began: the
    latest-started one) and self time: the time in which it is the innermost open range. With
    proper nesting that is its duration minus its children's; where ranges overlap without nesting
    (a ``record_function`` range begins inside the Python call that enters it and ends inside the
    one that exits it), each moment still counts once, so a thread's self times add up to the
    union of its ranges. Returns each thread's events sorted by start, outer before inner."""
    threads: dict = defaultdict(list)
    for ev in host:
        threads[ev.tid].append(ev)
    for evs in threads.values():
        evs.sort(key=lambda v: (v.ts, -v.end))
        stack: list[Ev] = []
        now = float("-inf")

        def advance(to: float) -> None:  # credit [now, to) to the innermost open range
            nonlocal now
            while stack and now < to:
                top = stack[-1]
                if top.end <= now:
                    stack.pop()
                    continue
                upto = min(top.end, to)
                top.self_us += upto - now
                now = upto
            now = max(now, to)

        for ev in evs:
            ev.self_us = 0.0
            advance(ev.ts)
            while stack and stack[-1].end <= ev.ts:
                stack.pop()
            ev.parent = stack[-1] if stack else None
            stack.append(ev)
        advance(float("inf"))
    return threads


def union(gpu: list[Ev]) -> list[list]:
    """The union of the GPU intervals: [start, end, first event, last-ending event] each, sorted."""
    merged: list[list] = []
    for ev in sorted(gpu, key=lambda v: (v.ts, v.end)):
        if merged and ev.ts <= merged[-1][1]:
            if ev.end > merged[-1][1]:
                merged[-1][1], merged[-1][3] = ev.end, ev
        else:
            merged.append([ev.ts, ev.end, ev, ev])
    return merged


def gaps_in(merged: list[list], a: float, b: float) -> tuple[float, list[tuple]]:
    """GPU-active time in [a, b] and the gaps there: (start, end, GPU event before, after)."""
    active, cur, prev, gaps = 0.0, a, None, []
    for s, e, first, last in merged:
        if e <= a or s >= b:
            continue
        s, e = max(s, a), min(e, b)
        active += e - s
        if s > cur:
            gaps.append((cur, s, prev, first))
        cur, prev = e, last
    if b > cur:
        gaps.append((cur, b, prev, None))
    return active, gaps


def active_after(merged: list[list], b: float, until: float) -> float:
    """GPU-active time in [b, until): a step's work that ran after its host range closed at ``b``
    (the optimizer's kernels, launched at its end without a wait), up to the next step's start."""
    return sum(min(e, until) - max(s, b) for s, e, _, _ in merged if e > b and s < until)


def stacks_at(evs: list[Ev], times: list[float]) -> dict:
    """For each time, the host ranges of one thread (``evs`` as ``nest`` sorted them) open then,
    earliest-started (outermost) first: one sweep over the thread's events."""
    out, stack, i = {}, [], 0
    for t in sorted(set(times)):
        while i < len(evs) and evs[i].ts <= t:
            while stack and stack[-1].end <= evs[i].ts:
                stack.pop()
            stack.append(evs[i])
            i += 1
        out[t] = [ev for ev in stack if ev.end > t]  # ranges that ended inside a longer-open one, left
    return out


def chain_of(ev: Ev | None) -> list[Ev]:
    """An event and the ranges it is inside, outermost first."""
    out = []
    while ev is not None:
        out.append(ev)
        ev = ev.parent
    return out[::-1]


def innermost_op(stack: list[Ev]) -> str:
    """The innermost operator / annotation / Python function of a stack, with the CUDA API call
    it was in when the stack ends in one (a synchronisation says more than its caller alone)."""
    ops = [ev.name for ev in stack if ev.cat in OP_CATS]
    name = ops[-1] if ops else "(outside any range)"
    if stack and stack[-1].cat in API_CATS:
        name += f" [{stack[-1].name}]"
    return name


def short_chain(stack: list[Ev], depth: int = 3) -> str:
    names = [ev.name for ev in stack]
    return (" > ".join(names[-depth:]) if names else "(outside any range)")


def _gap_row(gap: tuple, tid, stack: list[Ev], launch: Ev | None, a: float) -> dict:
    s, e, _, nxt = gap
    return {"start_ms_into_step": (s - a) / 1e3, "us": e - s, "thread": tid[1],
            "cpu_at_start": short_chain(stack), "op_at_start": innermost_op(stack),
            "next_gpu": nxt.name if nxt is not None else None,
            "next_launch_after_gap_start_us": (launch.ts - s) if launch is not None else None,
            "next_launched_in": short_chain([v for v in chain_of(launch.parent) if v.cat in OP_CATS])
            if launch is not None else None}


def _host_tables(host: list[Ev], gpu_by_corr: dict, a: float, b: float, step: Ev, top: int) -> dict:
    ops: dict[str, list] = defaultdict(lambda: [0, 0.0, 0.0])
    apis: dict[str, list] = defaultdict(lambda: [0, 0.0, defaultdict(int)])
    threads: dict = defaultdict(lambda: [0, 0.0, 0.0])
    for ev in host:
        if not a <= ev.ts < b:
            continue
        row = apis[ev.name] if ev.cat in API_CATS else ops[ev.name]
        row[0] += 1
        th = threads[ev.tid]
        th[0] += 1
        if ev.cat in API_CATS:
            row[1] += ev.end - ev.ts
            th[2] += ev.end - ev.ts
            launched = gpu_by_corr.get(ev.corr) if ev.corr is not None else None
            if launched is not None:
                row[2][launched.name] += 1
        else:
            row[1] += ev.self_us
            row[2] += ev.end - ev.ts
            if ev is not step and (ev.parent is None or ev.parent is step or ev.parent.ts < a):
                th[1] += ev.end - ev.ts  # a top-level range of the step (the step itself aside)
    launch = {"runtime_calls": 0, "runtime_us": 0.0, "driver_calls": 0, "driver_us": 0.0}
    for name, (calls, us, _) in apis.items():
        if name.startswith(LAUNCH_PREFIXES):
            kind = "runtime" if name.startswith("cuda") else "driver"
            launch[f"{kind}_calls"] += calls
            launch[f"{kind}_us"] += us
    return {
        "ops": sorted(([n, c, s, t] for n, (c, s, t) in ops.items()), key=lambda r: (-r[2], r[0]))[:top],
        "api": sorted(([n, c, us, sorted(k.items(), key=lambda kv: (-kv[1], kv[0]))[:3]]
                       for n, (c, us, k) in apis.items()), key=lambda r: (-r[2], r[0]))[:top],
        "launches": launch,
        "threads": [{"thread": tid[1], "step_thread": tid == step.tid, "events": n, "ops_us": o, "api_us": p}
                    for tid, (n, o, p) in sorted(threads.items(), key=lambda kv: (kv[0] != step.tid, -kv[1][1]))],
    }


class Timeline(NamedTuple):
    """A trace read once (``timeline``): what ``analyse`` and ``kernel_launchers`` share."""
    gpu: list
    host: list
    steps: list
    threads: dict
    launch_of: dict  # correlation id -> the CUDA runtime / driver call that launched that activity


def timeline(trace) -> Timeline:
    """The trace's GPU activities, host ranges (nested: parents and self times set) and steps."""
    gpu, host, steps = collect(trace)
    launch_of = {ev.corr: ev for ev in host if ev.cat in API_CATS and ev.corr is not None}
    return Timeline(gpu, host, steps, nest(host), launch_of)


def analyse(trace, gap_us: float = 20.0, top_gaps: int = 8, top: int = 20, tl: Timeline | None = None) -> list[dict]:
    """One record per profiled step: GPU idle time and gaps, what the host did at each gap's
    start, host self times, CUDA API calls and kernel launches (see the module's definitions).
    ``tl``: the trace's ``timeline`` when the caller has it already (else it is built here)."""
    gpu, host, steps, threads, launch_of = tl if tl is not None else timeline(trace)
    gpu_by_corr = {ev.corr: ev for ev in gpu if ev.corr is not None}
    merged = union(gpu)
    out = []
    for k, step in enumerate(steps):
        a, b = step.ts, step.end
        active, gaps = gaps_in(merged, a, b) if gpu else (None, [])  # a CPU profile: no GPU timeline
        big = [g for g in gaps if g[1] - g[0] > gap_us]
        small = [g for g in gaps if g[1] - g[0] <= gap_us]
        # the launching thread of each long gap, and what that thread was inside when it opened
        where = []
        for g in big:
            ln = launch_of.get(g[3].corr) if g[3] is not None else None
            lp = launch_of.get(g[2].corr) if g[2] is not None else None
            where.append(((ln or lp or step).tid, ln))
        queries: dict = defaultdict(list)
        for g, (tid, _) in zip(big, where):
            queries[tid].append(g[0])
        stacks = {tid: stacks_at(threads.get(tid, []), ts) for tid, ts in queries.items()}
        rows = [_gap_row(g, tid, stacks[tid][g[0]], ln, a) for g, (tid, ln) in zip(big, where)]
        by_op: dict[str, list] = defaultdict(lambda: [0, 0.0])
        for r in rows:
            by_op[r["op_at_start"]][0] += 1
            by_op[r["op_at_start"]][1] += r["us"]
        end_next = steps[k + 1].ts if k + 1 < len(steps) else float("inf")
        after = active_after(merged, b, end_next)
        out.append({
            "step": step.name, "span_us": b - a, "gpu_events": sum(1 for ev in gpu if ev.end > a and ev.ts < b),
            "gpu_streams": len({ev.tid for ev in gpu if ev.end > a and ev.ts < b}),
            "gpu_active_us": active, "gpu_idle_us": None if active is None else (b - a) - active,
            "gap_threshold_us": gap_us,
            "long_gaps": len(big), "long_gaps_us": sum(g[1] - g[0] for g in big),
            "short_gaps": len(small), "short_gaps_us": sum(g[1] - g[0] for g in small),
            "gpu_after_step_end_us": after,
            "largest_gaps": sorted(rows, key=lambda r: (-r["us"], r["start_ms_into_step"]))[:top_gaps],
            "idle_by_op_at_gap_start": sorted(([n, c, us] for n, (c, us) in by_op.items()),
                                              key=lambda r: (-r[2], r[0]))[:top],
            "host": _host_tables(host, gpu_by_corr, a, b, step, top),
        })
    return out


def short(name: str, n: int = 70) -> str:
    """``name`` cut to ``n`` characters, "..." marking the cut."""
    return name if len(name) <= n else name[:n - 3] + "..."


def render(steps: list[dict]) -> str:
    """The per-step part of kernel_breakdown's text output."""
    lines = []
    for st in steps:
        span = st["span_us"]
        lines += ["", f"step {st['step']}: span {span / 1e3:.2f} ms"]
        if st["gpu_active_us"] is None:
            lines.append("GPU: no kernels, memcpys or memsets in this trace (a CPU profile): no idle gaps")
        else:
            lines.append(f"GPU active {st['gpu_active_us'] / 1e3:.2f} ms (union of {st['gpu_events']} kernels / "
                         f"copies on {st['gpu_streams']} streams), idle {st['gpu_idle_us'] / 1e3:.2f} ms "
                         f"({100 * st['gpu_idle_us'] / max(span, 1e-9):.1f}%)")
            lines.append(f"idle gaps > {st['gap_threshold_us']:g} µs: {st['long_gaps']} = "
                         f"{st['long_gaps_us'] / 1e3:.2f} ms; shorter gaps: {st['short_gaps']} = "
                         f"{st['short_gaps_us'] / 1e3:.2f} ms; GPU work after the step's end: "
                         f"{st['gpu_after_step_end_us'] / 1e3:.2f} ms")
        if st["largest_gaps"]:
            lines += ["", "| gap at ms | µs | host at its start (launching thread) | next GPU work | "
                      "launched +µs | launched in |", "| ---: | ---: | --- | --- | ---: | --- |"]
            for r in st["largest_gaps"]:
                after = r["next_launch_after_gap_start_us"]
                lines.append(f"| {r['start_ms_into_step']:.3f} | {r['us']:.1f} | `{short(r['cpu_at_start'], 80)}` | "
                             f"`{short(r['next_gpu'] or '(none: the step ends)', 50)}` | "
                             + (f"{after:+.1f}" if after is not None else "?")
                             + f" | `{short(r['next_launched_in'] or '?', 60)}` |")
            lines += ["", f"| host op at the start of gaps > {st['gap_threshold_us']:g} µs | gaps | idle ms |",
                      "| --- | ---: | ---: |"]
            lines += [f"| `{short(n, 90)}` | {c} | {us / 1e3:.2f} |" for n, c, us in st["idle_by_op_at_gap_start"]]
        h = st["host"]
        lines += ["", "| host op (self time) | calls | self ms | total ms |", "| --- | ---: | ---: | ---: |"]
        lines += [f"| `{short(n, 90)}` | {c} | {s / 1e3:.2f} | {t / 1e3:.2f} |" for n, c, s, t in h["ops"]]
        la = h["launches"]
        lines += ["", f"launches: runtime (cudaLaunch*) {la['runtime_calls']} calls, {la['runtime_us'] / 1e3:.2f} ms; "
                  f"driver (cuLaunch*: Triton's, some cuBLAS) {la['driver_calls']} calls, {la['driver_us'] / 1e3:.2f} ms"]
        if h["api"]:
            lines += ["| CUDA runtime / driver call | calls | ms | kernels it launched (top 3) |",
                      "| --- | ---: | ---: | --- |"]
            lines += [f"| `{n}` | {c} | {us / 1e3:.2f} | " + ", ".join(f"`{short(k, 40)}` {m}" for k, m in ks) + " |"
                      for n, c, us, ks in h["api"]]
        lines.append("threads: " + "; ".join(
            f"{t['thread']}{' (the step)' if t['step_thread'] else ''}: {t['events']} ranges, "
            f"{t['ops_us'] / 1e3:.2f} ms in top-level ops, {t['api_us'] / 1e3:.2f} ms in CUDA calls" for t in h["threads"]))
    return "\n".join(lines)
