"""What launched each CUDA kernel of a torch.profiler Chrome trace: the "launched by" column of
``kernel_breakdown.py``'s kernel table. Only reads the trace.

The linkage (the Chrome trace torch.profiler / kineto writes, torch 2.x): a kernel (``cat``
``kernel``) and the CUDA runtime or driver call that launched it (``cuda_runtime`` /
``cuda_driver``: ``cudaLaunchKernel``, ``cuLaunchKernelEx``, ...) carry the same
``args.correlation``, CUPTI's id for that launch (the ``ac2g`` flow arrows a trace viewer draws
join the same pair). The call runs on the launching host thread inside the operators that made
it, so the ranges open around it on that thread (``step_timeline.nest``) say who launched the
kernel. Where the call is not in the trace (cut at the trace's start) or inside no operator, the
kernel's ``args["External id"]`` is used instead: the ``External id`` of the operator kineto
linked the launch to.

A launcher is written ``op [shapes] < top-level op < range``:

- op: the innermost operator (``cpu_op``, e.g. ``aten::copy_``) around the launch, with the
  shapes of its tensor inputs (``Input Dims``; only in traces taken with ``record_shapes``;
  0-dim tensors and non-tensor arguments left out); an input is marked ``*`` when its
  ``Input Strides`` are not the contiguous ones for its shape: a strided view (a transpose, a
  slice, an expand), which makes an elementwise kernel or a copy read memory out of order;
- top-level op: the outermost operator around it on its thread, when it is another one: the
  call Python or autograd made (``aten::contiguous``, ``aten::linear``,
  ``autograd::engine::evaluate_function: MmBackward0``) that led to the inner one;
- range: the innermost ``record_function`` range (``dept_mega::fp8_linear_forward``) or
  ``nn.Module`` range (only in traces taken with ``with_stack``) around it, the
  ``ProfilerStep#N`` ranges aside.
"""
from __future__ import annotations

import json
from collections import defaultdict

from step_timeline import Ev, Timeline, chain_of, is_step, short

RANGE_CATS = ("user_annotation", "python_function")


def _dims(x) -> str:
    return json.dumps(x, separators=(",", ":"))


def _contiguous(dims, strides) -> bool:
    """Whether a tensor of these sizes and strides is laid out row-major without gaps (size-1
    dimensions and empty tensors are contiguous whatever their strides say)."""
    if not isinstance(strides, list) or len(strides) != len(dims) or 0 in dims:
        return True
    want = 1
    for d, s in zip(reversed(dims), reversed(strides)):
        if d != 1 and s != want:
            return False
        want *= d
    return True


def shapes_of(args: dict) -> str:
    """``[4,2048,16,128] [4,2048,16,128]*``: an operator's tensor inputs with at least one
    dimension, ``*`` on a non-contiguous one; "" when the trace recorded no shapes."""
    dims = args.get("Input Dims")
    if not isinstance(dims, list):
        return ""
    strides = args.get("Input Strides")
    strides = strides if isinstance(strides, list) and len(strides) == len(dims) else [None] * len(dims)
    out = []
    for d, s in zip(dims, strides):
        if not isinstance(d, list) or not d:
            continue
        flat = all(isinstance(v, int) for v in d)  # a TensorList's entry is a list of shapes: no stride check
        out.append(_dims(d) + ("*" if flat and not _contiguous(d, s) else ""))
    return " ".join(out)


def launcher(chain: list[Ev], api: str | None) -> str:
    """The label of a launch made inside ``chain`` (its ranges, outermost first); ``api`` is the
    launching call's name when the kernel was linked through it."""
    ops = [ev for ev in chain if ev.cat == "cpu_op"]
    ranges = [ev for ev in chain if (ev.cat == "user_annotation" and not is_step(ev.name, ev.cat))
              or (ev.cat == "python_function" and ev.name.startswith("nn.Module:"))]
    if ops:
        shapes = shapes_of(ops[-1].args)
        parts = [ops[-1].name + (f" {shapes}" if shapes else "")]
        if len(ops) > 1:
            parts.append(ops[0].name)
    else:
        parts = [f"({api or 'launch'} outside any operator)"]
    if ranges:
        parts.append(ranges[-1].name)
    return " < ".join(parts)


def attribute(tl: Timeline, top: int = 3) -> dict:
    """For each kernel name of the trace, its launchers (label, calls, µs) by kernel time, the
    ``top`` largest and the rest summed as "(N other launchers)"; and how many kernels were
    linked through their launch call, through ``External id``, or not at all."""
    launch_of = tl.launch_of
    by_ext: dict = {}
    for ev in tl.host:
        ext = ev.args.get("External id")
        if ev.cat in ("cpu_op", "user_annotation") and ext is not None:
            by_ext.setdefault(ext, ev)
    rows: dict[str, dict] = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))
    linked = {"launch": 0, "external_id": 0, "none": 0}
    shapes = False
    for k in tl.gpu:
        if k.cat != "kernel":
            continue
        call = launch_of.get(k.corr) if k.corr is not None else None
        chain = chain_of(call.parent) if call is not None else []
        if call is not None and any(ev.cat == "cpu_op" for ev in chain):
            linked["launch"] += 1
        elif k.args.get("External id") in by_ext:
            chain = chain_of(by_ext[k.args["External id"]])
            linked["external_id"] += 1
        elif call is not None:
            linked["launch"] += 1  # linked, but launched outside any operator
        else:
            linked["none"] += 1
        label = launcher(chain, call.name if call is not None else None) if (chain or call) \
            else "(launch not in the trace)"
        shapes = shapes or any("Input Dims" in ev.args for ev in chain if ev.cat == "cpu_op")
        row = rows[k.name][label]
        row[0] += 1
        row[1] += k.end - k.ts
    out = {}
    for name, by_label in rows.items():
        ranked = sorted(([lab, c, us] for lab, (c, us) in by_label.items()), key=lambda r: (-r[2], -r[1], r[0]))
        rest = ranked[top:]
        other = f"({len(rest)} other launcher{'s' if len(rest) > 1 else ''})"
        out[name] = ranked[:top] + ([[other, sum(r[1] for r in rest),
                                      sum(r[2] for r in rest)]] if rest else [])
    return {"kernels": out, "linked": linked, "shapes_recorded": shapes}


def cell(launchers: list | None, width: int = 100) -> str:
    """The table cell: ``label`` ×calls per launcher, most kernel time first."""
    if not launchers:
        return "?"
    return "; ".join(f"`{short(lab, width)}` ×{calls}" for lab, calls, _ in launchers)


def summary_line(att: dict) -> str:
    li = att["linked"]
    return (f"launched by: innermost operator [input shapes, * = non-contiguous] < top-level operator < "
            f"record_function range, ×calls; kernels linked by their launch call {li['launch']}, "
            f"by External id {li['external_id']}, not linked {li['none']}"
            + ("" if att["shapes_recorded"] else "; no input shapes in this trace (profiled without record_shapes)"))
