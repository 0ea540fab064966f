"""benchmarks/kernel_launchers.py, the "launched by" column of kernel_breakdown's kernel table: each
kernel linked to its launch call by CUPTI's correlation id, the launcher being the innermost host
operator around that call (with its input shapes, a non-contiguous input marked), its top-level
operator and record_function range; the External id where the call is missing; on a hand-made
trace where one kernel name is launched by several operators, and through the command on a real
CPU profile written by the trainer's StepProfiler (no kernels: nothing to attribute)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from tests.trainer_utils import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

MAIN, AUTOGRAD = 10, 11  # host threads of process 1; the GPU is pid 0, stream 7
EW = "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<copy>>"


def _x(cat, name, ts, end, tid=MAIN, pid=1, **args):
    ev = {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": end - ts}
    if args:
        ev["args"] = {k.replace("_", " "): v for k, v in args.items()}
    return ev


def _op(name, ts, end, ext, dims=None, strides=None, tid=MAIN):
    args = {"External_id": ext}
    if dims is not None:
        args.update(Input_Dims=dims, Input_Strides=strides, Input_type=["c10::BFloat16"] * len(dims))
    return _x("cpu_op", name, ts, end, tid=tid, **args)


def _launch(ts, corr, ext, tid=MAIN, name="cudaLaunchKernel", cat="cuda_runtime"):
    return [_x(cat, name, ts, ts + 5, tid=tid, correlation=corr, External_id=ext),
            {"ph": "s", "cat": "ac2g", "name": "ac2g", "id": corr, "pid": 1, "tid": tid, "ts": ts}]


def _kernel(name, ts, end, corr, ext):
    return [_x("kernel", name, ts, end, tid=7, pid=0, correlation=corr, External_id=ext, stream=7),
            {"ph": "f", "cat": "ac2g", "name": "ac2g", "id": corr, "pid": 0, "tid": 7, "ts": ts, "bp": "e"}]


def hand_made_trace() -> dict:
    """One step. EW (one kernel name) is launched by a strided aten::copy_ inside aten::contiguous
    in a record_function range (twice), by a contiguous aten::copy_ in the same range, by aten::add
    (a scalar argument and a 0-dim tensor left out of the shapes) and by aten::mul on autograd's
    thread. A GEMM inside an nn.Module range (a with_stack trace) whose launch call is missing (the
    trace cut it) is found through its External id; a Triton kernel came through the driver; one
    kernel was launched outside any operator and one has neither a launch call nor a known
    External id."""
    t = [4096, 32, 512, 1]  # strides of a [4, 16, 8, 32] view of a contiguous [4, 8, 16, 32] tensor
    ev = [_x("user_annotation", "ProfilerStep#3", 0, 2000, External_id=1),
          _x("user_annotation", "dept_mega::attention", 10, 800, External_id=2)]
    for k, a in enumerate((20, 220)):  # two strided copies
        ev += [_op("aten::contiguous", a, a + 100, 10 + 3 * k, [[4, 16, 8, 32]], [t]),
               _op("aten::clone", a + 5, a + 95, 11 + 3 * k, [[4, 16, 8, 32]], [t]),
               _op("aten::copy_", a + 10, a + 90, 12 + 3 * k, [[4, 16, 8, 32], [4, 16, 8, 32], []],
                   [[4096, 256, 32, 1], t, []]),
               *_launch(a + 20, 100 + k, 12 + 3 * k), *_kernel(EW, 1000 + 50 * k, 1040 + 50 * k, 100 + k, 12 + 3 * k)]
    ev += [_op("aten::copy_", 420, 450, 20, [[64, 32], [64, 32]], [[32, 1], [32, 1]]),  # contiguous
           *_launch(425, 102, 20), *_kernel(EW, 1100, 1110, 102, 20),
           _op("aten::add", 500, 550, 21, [[64, 32], [64, 32], [], []], [[32, 1], [0, 1], [], []]),  # a broadcast
           *_launch(510, 103, 21), *_kernel(EW, 1120, 1125, 103, 21),
           _op("triton_poi_fused_gelu_0", 600, 650, 22),
           *_launch(610, 104, 22, name="cuLaunchKernelEx", cat="cuda_driver"),
           *_kernel("triton_poi_fused_gelu_0", 1130, 1150, 104, 22),
           # a with_stack trace: the nn.Module range names the module, other Python functions do not count
           _x("python_function", "nn.Module: Linear_0", 880, 1010),
           _x("python_function", "torch/nn/modules/linear.py(125): forward", 890, 1005),
           _op("aten::linear", 900, 1000, 30, [[8, 32], [64, 32]], [[32, 1], [32, 1]]),
           _op("aten::mm", 910, 990, 31, [[8, 32], [32, 64]], [[32, 1], [1, 32]]),
           *_kernel("nvjet_gemm", 1200, 1300, 105, 31),  # its cudaLaunchKernel is not in the trace
           *_launch(1500, 106, 0), *_kernel("fill_kernel", 1510, 1520, 106, 0),  # outside any operator
           *_kernel("orphan_kernel", 1600, 1601, 999, 0),
           # autograd's thread: the same kernel name from the backward
           _op("autograd::engine::evaluate_function: CloneBackward0", 1700, 1800, 40, tid=AUTOGRAD),
           _op("aten::mul", 1710, 1790, 41, [[64, 32], []], [[32, 1], []], tid=AUTOGRAD),
           *_launch(1720, 107, 41, tid=AUTOGRAD), *_kernel(EW, 1850, 1852, 107, 41)]
    return {"traceEvents": ev}


def test_each_kernel_names_the_operators_that_launched_it():
    from kernel_breakdown import breakdown, render
    from kernel_launchers import attribute, cell
    from step_timeline import timeline
    trace = hand_made_trace()
    att = attribute(timeline(trace), top=3)
    strided = "aten::copy_ [4,16,8,32] [4,16,8,32]* < aten::contiguous < dept_mega::attention"
    assert att["kernels"][EW] == [
        [strided, 2, 80], ["aten::copy_ [64,32] [64,32] < dept_mega::attention", 1, 10],
        ["aten::add [64,32] [64,32]* < dept_mega::attention", 1, 5],
        ["(1 other launcher)", 1, 2]]
    assert attribute(timeline(trace), top=4)["kernels"][EW][3] == [
        "aten::mul [64,32] < autograd::engine::evaluate_function: CloneBackward0", 1, 2]
    assert att["kernels"]["triton_poi_fused_gelu_0"] == [["triton_poi_fused_gelu_0 < dept_mega::attention", 1, 20]]
    assert att["kernels"]["nvjet_gemm"] == [["aten::mm [8,32] [32,64]* < aten::linear < nn.Module: Linear_0", 1, 100]]
    assert att["kernels"]["fill_kernel"] == [["(cudaLaunchKernel outside any operator)", 1, 10]]
    assert att["kernels"]["orphan_kernel"] == [["(launch not in the trace)", 1, 1]]
    assert att["linked"] == {"launch": 7, "external_id": 1, "none": 1} and att["shapes_recorded"]
    res = breakdown(trace)
    res["launchers"] = att
    text = render(res, top=10)
    assert ("kernels linked by their launch call 7, by External id 1, not linked 1" in text
            and "no input shapes" not in text)
    row = next(line for line in text.splitlines() if line.startswith("| `void at::native::elementwise_kernel"))
    assert row.endswith(f"| 5 | 0.10 | 42.5% | `{strided}` ×2; `aten::copy_ [64,32] [64,32] < dept_mega::attention` ×1; "
                        "`aten::add [64,32] [64,32]* < dept_mega::attention` ×1; `(1 other launcher)` ×1 |"), row
    assert cell([[strided, 2, 80.0]], width=40) == f"`{strided[:37]}...` ×2"  # long labels cut at the end


def test_without_shapes_the_launchers_are_named_and_the_gap_said():
    from kernel_breakdown import breakdown, render
    from kernel_launchers import attribute
    from step_timeline import timeline
    trace = hand_made_trace()
    for e in trace["traceEvents"]:
        for key in ("Input Dims", "Input Strides", "Input type"):
            (e.get("args") or {}).pop(key, None)
    att = attribute(timeline(trace))
    assert att["kernels"][EW][0] == ["aten::copy_ < aten::contiguous < dept_mega::attention", 2, 80]
    res = breakdown(trace)
    res["launchers"] = att
    assert "no input shapes in this trace (profiled without record_shapes)" in render(res, 3)


def test_a_cpu_profile_of_the_step_profiler_has_shapes_and_nothing_to_attribute(tmp_path):
    """The trainer's profiler records input shapes; its CPU trace has no kernels, so the command
    (as gpu_check.sh's dry run calls it) says there is nothing to attribute, and with the default
    category it still fails with the same clear error."""
    from dept_mega.config import ProfileConfig
    from dept_mega.profiling import StepProfiler
    prof = StepProfiler(ProfileConfig(start=0, stop=1, ranks=[0]), str(tmp_path), 0, "cpu", log=lambda s: None)
    lin = torch.nn.Linear(32, 16)
    prof.before_step(0)
    lin(torch.randn(8, 32)).sum().backward()
    prof.after_step(1)
    [path] = prof.paths
    events = json.load(open(path))["traceEvents"]
    addmm = next(e for e in events if e.get("name") == "aten::addmm")
    assert addmm["args"]["Input Dims"] == [[16], [8, 32], [32, 16], [], []]
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "kernel_breakdown.py"), path, "--top", "5"]
    res = subprocess.run(cmd + ["--category", "cpu_op"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "launched by: nothing to attribute: no CUDA kernels in this trace (a CPU profile)" in res.stdout
    assert "| kernel | calls | ms | share |" in res.stdout and "launched by |" not in res.stdout
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "has no kernel events (profiled on a CPU? --category cpu_op)" in res.stderr
