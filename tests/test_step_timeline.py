"""benchmarks/step_timeline.py, kernel_breakdown's per-step part: GPU idle time as the step's span
minus the UNION of the GPU's intervals on all streams, the idle gaps with what the launching host
thread was doing when each opened, host self times from the nesting of ranges on each thread, the
CUDA API calls and launches; on a hand-made trace where every figure is known, and on real
torch.profiler traces of a CPU step."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.trainer_utils import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

MAIN, AUTOGRAD = 10, 11  # host threads of process 1; the GPU is pid 0 with streams 7 and 8


def _x(cat, name, ts, end, tid=MAIN, corr=None, pid=1):
    ev = {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": end - ts}
    if corr is not None:
        ev["args"] = {"correlation": corr}
    return ev


def _gpu(name, ts, end, stream, corr=None, cat="kernel"):
    return _x(cat, name, ts, end, tid=stream, corr=corr, pid=0)


def hand_made_trace() -> dict:
    """Step 5 [1000, 2000] µs. GPU (union 325 µs: gemm_a and add_k overlap on two streams, the
    memcpy touches the Triton kernel, the tail runs 100 µs past the step, up to step 6):
    [1050,1200] [1230,1300] [1305,1310] [1620,1710] [1990,2000 | 2120]. Gaps: 50, 30, 5, 310, 280.
    Step 6 [2100, 2400]: the tail's last 20 µs, a gap of 30, k6 [2150, 2300], a gap of 100 to the end."""
    ev = [
        _x("user_annotation", "ProfilerStep#5", 1000, 2000),
        _gpu("ProfilerStep#5", 1050, 1950, 7, cat="gpu_user_annotation"),  # kineto's GPU copy: not a step
        _x("cpu_op", "aten::linear", 1010, 1110),
        _x("cpu_op", "aten::mm", 1020, 1070),
        _x("cuda_runtime", "cudaLaunchKernel", 1030, 1040, corr=1),
        _x("cpu_op", "aten::add", 1080, 1100),
        _x("cuda_runtime", "cudaLaunchKernel", 1085, 1090, corr=2),
        _x("cpu_op", "aten::zero_", 1280, 1295),
        _x("cuda_runtime", "cudaLaunchKernel", 1285, 1290, corr=6),
        _x("cpu_op", "aten::item", 1300, 1500),
        _x("cuda_runtime", "cudaStreamSynchronize", 1310, 1490),
        _x("cpu_op", "triton_poi_fused_x", 1600, 1620),
        _x("cuda_driver", "cuLaunchKernelEx", 1605, 1615, corr=3),
        _x("python_function", "train.py(40): step", 1700, 1995),
        _x("cpu_op", "aten::empty", 1800, 1810),
        _x("cuda_runtime", "cudaLaunchKernel", 1980, 1985, corr=5),
        _x("user_annotation", "ProfilerStep#6", 2100, 2400),
        _x("cpu_op", "aten::mul", 2130, 2148),
        _x("cuda_runtime", "cudaLaunchKernel", 2140, 2145, corr=7),
        # autograd's device thread
        _x("cpu_op", "autograd::engine::evaluate_function: MmBackward0", 1200, 1260, tid=AUTOGRAD),
        _x("cpu_op", "aten::mm", 1210, 1250, tid=AUTOGRAD),
        _x("cuda_runtime", "cudaLaunchKernel", 1220, 1225, tid=AUTOGRAD, corr=4),
        _x("cpu_op", "aten::copy_", 1262, 1270, tid=AUTOGRAD),
        _x("cuda_runtime", "cudaMemcpyAsync", 1265, 1271, tid=AUTOGRAD),  # outlasts its parent by 1 µs
        # the GPU
        _gpu("gemm_a", 1050, 1200, 7, corr=1),
        _gpu("add_k", 1100, 1180, 8, corr=2),
        _gpu("mm_bwd", 1230, 1300, 7, corr=4),
        _gpu("fill", 1305, 1310, 8, corr=6),
        _gpu("triton_poi_fused_x", 1620, 1700, 7, corr=3),
        _gpu("Memcpy DtoD", 1700, 1710, 8, cat="gpu_memcpy"),
        _gpu("tail", 1990, 2120, 7, corr=5),
        _gpu("k6", 2150, 2300, 8, corr=7),
        {"ph": "s", "cat": "ac2g", "name": "ac2g", "id": 1, "pid": 1, "tid": MAIN, "ts": 1030},
    ]
    return {"traceEvents": ev}


def test_idle_gaps_self_times_and_launches_of_a_hand_made_step():
    from kernel_breakdown import breakdown
    from step_timeline import analyse, render
    trace = hand_made_trace()
    old = breakdown(trace)
    assert old["steps"] == 2 and old["span_us"] == 1300  # the gpu_user_annotation copy is not a step
    assert old["summed_us"] == 150 + 80 + 70 + 5 + 80 + 130 + 150  # summed kernels (overlaps counted twice)
    # the headline: the union inside the steps (step 5's 325 below; step 6: the tail's last 20 µs and
    # k6), and the tail after step 5's end, up to step 6's start, apart
    assert old["busy_us"] == 325 + 20 + 150 and old["after_us"] == 100
    st, st6 = analyse(trace, gap_us=20, top_gaps=3, top=20)
    assert st["step"] == "ProfilerStep#5" and st["span_us"] == 1000
    assert (st["gpu_events"], st["gpu_streams"]) == (7, 2)
    assert st["gpu_active_us"] == 150 + 70 + 5 + 90 + 10 and st["gpu_idle_us"] == 675
    assert (st["long_gaps"], st["long_gaps_us"], st["short_gaps"], st["short_gaps_us"]) == (4, 670, 1, 5)
    assert st["gpu_after_step_end_us"] == 100  # the tail, up to the next step's start
    assert [(g["us"], g["start_ms_into_step"], g["thread"]) for g in st["largest_gaps"]] == [
        (310, 0.31, MAIN), (280, 0.71, MAIN), (50, 0.0, MAIN)]
    sync, late, first = st["largest_gaps"]
    assert sync["cpu_at_start"] == "ProfilerStep#5 > aten::item > cudaStreamSynchronize"
    assert sync["op_at_start"] == "aten::item [cudaStreamSynchronize]"
    assert sync["next_gpu"] == "triton_poi_fused_x" and sync["next_launch_after_gap_start_us"] == 295
    assert sync["next_launched_in"] == "ProfilerStep#5 > triton_poi_fused_x"
    assert late["op_at_start"] == "train.py(40): step" and late["next_launch_after_gap_start_us"] == 270
    assert first["op_at_start"] == "ProfilerStep#5" and first["next_launched_in"] == "ProfilerStep#5 > aten::linear > aten::mm"
    # the 30 µs gap before mm_bwd: launched from autograd's thread, where the backward node had just begun
    assert st["idle_by_op_at_gap_start"] == [["aten::item [cudaStreamSynchronize]", 1, 310],
                                             ["train.py(40): step", 1, 280], ["ProfilerStep#5", 1, 50],
                                             ["autograd::engine::evaluate_function: MmBackward0", 1, 30]]
    h = st["host"]
    assert h["ops"] == [
        ["ProfilerStep#5", 1, 370, 1000], ["train.py(40): step", 1, 280, 295], ["aten::mm", 2, 75, 90],
        ["aten::linear", 1, 30, 100], ["aten::item", 1, 20, 200],
        ["autograd::engine::evaluate_function: MmBackward0", 1, 20, 60], ["aten::add", 1, 15, 20],
        ["aten::empty", 1, 10, 10], ["aten::zero_", 1, 10, 15], ["triton_poi_fused_x", 1, 10, 20],
        ["aten::copy_", 1, 3, 8]]
    assert h["api"] == [["cudaStreamSynchronize", 1, 180, []],
                        ["cudaLaunchKernel", 5, 30, [("add_k", 1), ("fill", 1), ("gemm_a", 1)]],
                        ["cuLaunchKernelEx", 1, 10, [("triton_poi_fused_x", 1)]], ["cudaMemcpyAsync", 1, 6, []]]
    assert h["launches"] == {"runtime_calls": 5, "runtime_us": 30, "driver_calls": 1, "driver_us": 10}
    assert h["threads"] == [{"thread": MAIN, "step_thread": True, "events": 15, "ops_us": 630, "api_us": 215},
                            {"thread": AUTOGRAD, "step_thread": False, "events": 5, "ops_us": 68, "api_us": 11}]
    # step 6: a leading gap after the tail, a trailing one after k6 (nothing launched after it)
    assert (st6["span_us"], st6["gpu_active_us"], st6["gpu_idle_us"], st6["long_gaps"], st6["short_gaps"]) == (
        300, 20 + 150, 130, 2, 0)
    trailing, leading = st6["largest_gaps"]
    assert (trailing["us"], trailing["next_gpu"], trailing["next_launch_after_gap_start_us"]) == (100, None, None)
    assert trailing["op_at_start"] == "ProfilerStep#6" and trailing["cpu_at_start"] == "ProfilerStep#6"
    assert (leading["us"], leading["next_gpu"], leading["next_launch_after_gap_start_us"]) == (30, "k6", 20)
    assert st6["host"]["ops"] == [["ProfilerStep#6", 1, 282, 300], ["aten::mul", 1, 13, 18]]
    assert st6["host"]["launches"]["runtime_calls"] == 1 and st6["gpu_after_step_end_us"] == 0
    text = render([st])
    assert "GPU active 0.33 ms (union of 7 kernels / copies on 2 streams), idle 0.68 ms (67.5%)" in text
    assert "idle gaps > 20 µs: 4 = 0.67 ms; shorter gaps: 1 = 0.01 ms; GPU work after the step's end: 0.10 ms" in text
    assert "| 0.310 | 310.0 | `ProfilerStep#5 > aten::item > cudaStreamSynchronize` | `triton_poi_fused_x` | +295.0 |" in text
    assert "| `ProfilerStep#5` | 1 | 0.37 | 1.00 |" in text
    assert "launches: runtime (cudaLaunch*) 5 calls, 0.03 ms; driver (cuLaunch*: Triton's, some cuBLAS) 1 calls" in text


@pytest.mark.parametrize("with_stack", [False, True])
def test_a_real_cpu_profile_through_the_command(tmp_path, with_stack):
    """A torch.profiler trace of two CPU training steps of a small MLP (the profiler's own nesting
    of operators, annotations and, with ``with_stack``, Python functions, which overlap the
    annotations they enter without nesting): the command's text keeps its first part, the JSON
    carries each step, and the step thread's self times add up to the step's span (plus at most
    the overhang of ranges that began in the step and end after it)."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters())
    acts = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=acts, with_stack=with_stack) as prof:
        for step in (1, 2):
            with torch.profiler.record_function(f"ProfilerStep#{step}"):
                model(torch.randn(8, 32)).square().mean().backward()
                opt.step()
                opt.zero_grad()
    whole = tmp_path / "whole.json"
    prof.export_chrome_trace(str(whole))
    # Only the step thread's ranges: the profiler traces the Python of every thread of this
    # process, and a thread another test left polling would add its own self times to the sums
    # checked below (the hand-made trace above covers a second thread).
    events = json.loads(whole.read_text())["traceEvents"]
    step_thread = {(e["pid"], e["tid"]) for e in events if e.get("cat") == "user_annotation"}
    assert len(step_thread) == 1, step_thread
    trace = tmp_path / "trace.json"
    events = [e for e in events if (e.get("pid"), e.get("tid")) in step_thread]
    trace.write_text(json.dumps({"traceEvents": events}))
    out = tmp_path / "res.json"
    res = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "kernel_breakdown.py"), str(trace),
                          "--category", "cpu_op", "--top", "5", "--top-host", "1000", "--json", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    # a CPU trace's operators nest: their sum is no GPU busy time and no share of the span
    assert lines[0].startswith("steps 2: host operators ") and "GPU" not in lines[0] and "%" not in lines[0]
    assert lines[1] == "| kind | ms | share of summed |"
    assert "step ProfilerStep#2: span " in res.stdout and "a CPU profile): no idle gaps" in res.stdout
    data = json.loads(out.read_text())
    assert [st["step"] for st in data["per_step"]] == ["ProfilerStep#1", "ProfilerStep#2"]
    for st in data["per_step"]:
        assert st["gpu_active_us"] is None and st["largest_gaps"] == []
        ops = {name: (calls, self_us, total) for name, calls, self_us, total in st["host"]["ops"]}
        assert ops["aten::addmm"][0] == 2 and ops["aten::gelu"][0] == 1
        assert all(0 <= s <= t + 1e-6 for _, s, t in ops.values())
        assert any(n.startswith("autograd::engine::evaluate_function") for n in ops)
        assert any(".py(" in n for n in ops) == with_stack  # Python functions only with with_stack
        step = next(e for e in events if e.get("name") == st["step"] and e.get("cat") == "user_annotation")
        a, b = step["ts"], step["ts"] + step["dur"]
        overhang = max([e["ts"] + e["dur"] - b for e in events if e.get("ph") == "X" and a <= e["ts"] < b] + [0])
        total_self = sum(s for _, s, _ in ops.values())
        assert st["span_us"] - 1e-3 <= total_self <= st["span_us"] + overhang + 1e-3, (total_self, st["span_us"])
        if not with_stack:  # operators nest properly: exactly the span
            assert total_self == pytest.approx(st["span_us"], abs=1e-3)
        [th] = st["host"]["threads"]
        assert th["step_thread"] and 0 < th["ops_us"] <= st["span_us"] + overhang
