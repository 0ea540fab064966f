"""The CPU-runnable parts of the GPU benchmark scripts: the kernel breakdown of a profiler trace,
the memory comparison, the suite summary and the suite driver's syntax (benchmarks/vs_megatron.py:
tests/test_vs_megatron.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.trainer_utils import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def test_kernel_breakdown_sums_kernels_by_kind():
    from kernel_breakdown import breakdown, render
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16bf16", "ts": 0, "dur": 600},
        {"ph": "X", "cat": "kernel", "name": "flash_fwd_kernel", "ts": 600, "dur": 200},
        {"ph": "X", "cat": "kernel", "name": "vectorized_elementwise_kernel", "ts": 800, "dur": 100},
        {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16bf16", "ts": 900, "dur": 100},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "ts": 0, "dur": 2000}]}
    res = breakdown(trace)
    assert res["busy_us"] == 1000 and res["span_us"] == 2000 and res["steps"] == 1
    assert res["by_kind_us"] == {"gemm": 700, "attention": 200, "other": 100}
    assert res["kernels"][0] == ["sm90_xmma_gemm_bf16bf16", 700, 2]
    text = render(res, 2)
    assert "GPU busy 1.0 ms of 2.0 ms profiled (50.0%)" in text and "| gemm | 0.70 | 70.0% |" in text


def test_kernel_breakdown_busy_is_inside_the_steps_and_the_tail_apart():
    """The headline's busy time is the union of the GPU's work inside the steps' host ranges
    (never over 100 %); work after a step's range closed (the optimizer, launched at the step's
    end without a wait) is reported apart, and overlapping kernels count once."""
    from kernel_breakdown import breakdown, render
    trace = {"traceEvents": [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "ts": 0, "dur": 100, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_bf16", "ts": 5, "dur": 90, "pid": 0, "tid": 7},
        {"ph": "X", "cat": "kernel", "name": "elementwise_kernel", "ts": 10, "dur": 20, "pid": 0, "tid": 8},
        {"ph": "X", "cat": "kernel", "name": "multi_tensor_apply_kernel<AdamW>", "ts": 95, "dur": 35, "pid": 0,
         "tid": 7}]}
    res = breakdown(trace)
    assert (res["busy_us"], res["after_us"], res["summed_us"], res["span_us"]) == (95, 30, 145, 100)
    head = render(res, 3).splitlines()[0]
    assert "GPU busy 0.1 ms of 0.1 ms profiled (95.0%)" in head and "after the steps' ends 0.03 ms" in head, head


def test_memory_vs_model_compares_the_trainer_share():
    from memory_vs_model import compare
    costs = {"variants": {"spec_opt": {"memory": {"weights": 4e9, "grads": 4e9, "optimizer": 8e9, "outer": 4e9,
                                                  "trim_table": 0, "activations_per_microbatch": 2e9,
                                                  "total": 22e9}}}}
    res = compare({"peak_mem_gb": 19.0}, costs, "spec_opt")
    c = res["comparison"]["trainer"]
    assert c["predicted_gb"] == pytest.approx(18.0) and c["error_pct"] == pytest.approx(100 * (18 - 19) / 19)
    with pytest.raises(ValueError, match="variants.glob.memory"):
        compare({"peak_mem_gb": 1.0}, costs, "glob")
    # native FP8: its weight copies and scaling state count (held during the step)
    costs["variants"]["spec_opt"]["memory"].update(fp8_weight_copies=2e9, fp8_scaling=1e6)
    c = compare({"peak_mem_gb": 19.0}, costs, "spec_opt")["comparison"]["trainer"]
    assert c["predicted_gb"] == pytest.approx(20.001)


@pytest.mark.parametrize("quiet", [False, True])
def test_suite_summary_reads_what_the_check_wrote(tmp_path, quiet):
    """The summary of gpu_check.sh's output folder: stages with their status and the pytest
    result printed inside each, in pytest's plain (``=``-wrapped) and ``-q`` forms alike."""
    from suite_summary import pytest_results, summary
    env = tmp_path / "env.json"
    env.write_text(json.dumps({"device_name": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "cuda": "13.0",
                               "date": "2026-12-01", "megatron_core": "0.16.1"}))
    rows = [{"name": "bf16", "tokens_per_s": 50000.0, "tflops_per_device": 420.0, "mfu": 0.4247, "peak_mem_gb": 41.0,
             "step_ms": 1300.0},
            {"name": "fp8", "tokens_per_s": 70000.0, "tflops_per_device": 588.0, "mfu": 0.59, "peak_mem_gb": 38.0,
             "step_ms": 930.0},
            {"name": "bf16_compile", "error": "rc=2: error: unknown config key 'train.compile'"}]
    (tmp_path / "bench.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = "3 passed, 1 skipped in 12.0s" if quiet else "==== 3 passed, 1 skipped in 12.0s ===="
    failed = "1 failed, 2 passed, 1 warning in 61.20s (0:01:01)"
    (tmp_path / "gpu_check.log").write_text(
        "### stage tests (expected 75s, limit 225s, now)\n...s..\n" + result + "\n"
        "### stage tests finished: rc=0 in 70 s\n"
        "### stage ops_tests (expected 30s, limit 90s, now)\n" + ("" if quiet else "= ") + failed
        + (" =" if not quiet else "") + "\n### stage ops_tests finished: rc=1 in 65 s\n"
        "### stage bf16 (expected 60s, limit 180s, now)\n"
        "### stage megatron skipped: expected 100s, 40s left\n")
    (tmp_path / "kernels.txt").write_text(
        "# kernels: bf16 (rank0_steps2-3.json)\nsteps 2: GPU busy 1.0 ms\n" + "| kernel |\n" * 12
        + "\nstep ProfilerStep#3: span 5.00 ms\nGPU active 4.00 ms (union ...), idle 1.00 ms (20.0%)\n"
        "idle gaps > 20 µs: 3 = 0.90 ms; shorter gaps: 9 = 0.10 ms\n| host op (self time) |\n")
    assert pytest_results(open(tmp_path / "gpu_check.log").read()) == ["3 passed, 1 skipped in 12.0s", failed]
    text = summary(str(tmp_path), str(env), budget=420, elapsed=400,
                   planned=["tests", "ops_tests", "bf16", "fp8", "megatron"])
    assert "NVIDIA H100 80GB HBM3" in text and "400 s of the 420 s budget" in text
    # a second call's command: failed, cut off, never reached (fp8) and skipped, in the planned order
    assert "`bash benchmarks/gpu_check.sh --stages ops_tests,bf16,fp8,megatron`" in text
    assert "| tests | ok | 70 | 3 passed, 1 skipped in 12.0s |" in text
    assert f"| ops_tests | failed rc=1 | 65 | {failed} |" in text
    assert "| bf16 | running (cut off?) |" in text and "| megatron | skipped (expected 100s, 40s left) |" in text
    assert "| bf16 | 50,000 | 420.0 | 42.5% | 41.0 | 1300 |" in text
    assert "bf16 MFU >= 50%: 42.5% (NOT met)" in text and "1.40x (met)" in text
    assert "failed: rc=2" in text and "kernels: bf16 (rank0_steps2-3.json)" in text
    # the head of each kernel breakdown (12 lines), then each step's idle lines without the tables
    assert ("| kernel |\nstep ProfilerStep#3: span 5.00 ms\nGPU active 4.00 ms (union ...), idle 1.00 ms (20.0%)\n"
            "idle gaps > 20 µs: 3 = 0.90 ms; shorter gaps: 9 = 0.10 ms\n\n") in text
    assert text.count("| kernel |") == 10 and "| host op (self time) |" not in text
    # the FP8 stage's second run (PyTorch casts) when the default one failed
    rows[1] = {"name": "fp8", "error": "rc=1: triton"}
    rows.append({"name": "fp8_torch_casts", "tokens_per_s": 60000.0})
    (tmp_path / "bench.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = summary(str(tmp_path), str(env), budget=420, elapsed=400)
    assert "1.20x (NOT met) (the PyTorch casts and torch._scaled_mm: the default run failed)" in text


# backends lines as model/backends.py writes them (Backends.describe), shortened where it does not matter
_REST = (" | attention=torch-sdpa | norm=torch | grad_accum_fusion=on [torch GEMMs, not the fp8 GEMMs]: addmm_ "
         "| cross_entropy=eager")
_FP8 = ("backend=local: linear=native fp8 ({gemm}, {casts}) hybrid, delayed scaling, amax history 1024 steps, "
        "fast accumulation: {accum}: fp8 GEMMs [qkv, proj, fc1, fc2] in layers 0-1{fused}; bf16 output head and "
        "embeddings")
_TORCH_FUSED = ("; fused casts (fp8_fused_casts) [qkv (layernorm, then the cast: torch casts), fc1 (layernorm, then "
                "the cast: torch casts), fc2 (gelu, then the cast: torch casts)]")
_CPP_FUSED = ("; fused casts (fp8_fused_casts) [qkv (layernorm, one kernel once the input has a delayed scale (from "
              "the second training step)), fc1 (layernorm, one kernel once the input has a delayed scale (from the "
              "second training step)), fc2 (gelu, one kernel)]")
_LT = "cuBLASLt operator dept_mega::fp8_gemm, weight gradients accumulated into main_grad by the GEMM"
_CPP = "C++ cast operator dept_mega::cast_fp8"


def _fp8_backends(gemm="torch._scaled_mm", casts="torch casts", accum="none", fused=""):
    return _FP8.format(gemm=gemm, casts=casts, accum=accum, fused=fused) + _REST


_AUTO_FUSED = ("; fused casts (fp8_fused_casts: null = auto) [fc2 (gelu, one kernel), not fused: qkv, fc1 (auto: the C++ "
               "LayerNorm cast is not faster than the norm then the cast (0.95x, H200))]")


def test_bench_summary_compares_the_defaults_with_the_previous_and_the_all_fused_runs():
    """The gpu_check stages fp8 (the defaults), fp8_prev (the previous defaults) and fp8_all_fused
    (every producer fused): the defaults over the previous ones, the all-fused run over both and
    bf16, each described from its backends line (auto's fused casts said as such); fp8_lt_fused
    reusing fp8_all_fused's record compares as that run."""
    from suite_summary import _bench_lines

    rows = [{"name": "bf16", "tokens_per_s": 600.0, "backends": "backend=auto: linear=torch" + _REST},
            {"name": "fp8", "tokens_per_s": 780.0, "backends": _fp8_backends(_LT, _CPP, fused=_AUTO_FUSED)},
            {"name": "fp8_prev", "tokens_per_s": 700.0,
             "backends": _fp8_backends(casts="Triton cast kernels (launched directly)")},
            {"name": "fp8_all_fused", "tokens_per_s": 770.0, "backends": _fp8_backends(_LT, _CPP, fused=_CPP_FUSED)}]
    text = "\n".join(_bench_lines(rows))
    prev = "fp8_prev (_scaled_mm, Triton casts, delayed scaling, exact sums)"
    assert f"- FP8 with the defaults (fp8): 1.114x {prev} (tokens/s)" in text, text
    assert ("- FP8 with the previous defaults (fp8_casts=triton fp8_gemm=torch fp8_fused_casts=false) (fp8_prev): "
            "1.167x bf16 (bf16 GEMMs) (tokens/s)") in text, text
    assert ("(fp8_all_fused): 0.987x fp8 (cuBLASLt GEMMs, C++ casts, delayed scaling, exact sums, auto fused casts: "
            f"gelu one kernel), 1.100x {prev}, 1.283x bf16 (bf16 GEMMs) (tokens/s)") in text, text
    assert "- target FP8 >= 1.3x bf16 tokens/s: 1.30x (met)" in text


def test_bench_summary_pairs_each_variant_with_its_bases_and_lists_every_backends_line():
    """suite_summary's 1B section: every run present beside each of its bases present (RATIOS),
    with or without bf16 in the call; each base described from its own backends line; each run's
    backends line, the first in full, the others as the parts that differ."""
    from suite_summary import _bench_lines, run_gist

    rows = [{"name": "fp8", "tokens_per_s": 1000.0, "backends": _fp8_backends()},
            {"name": "fp8_fused", "tokens_per_s": 1100.0, "backends": _fp8_backends(fused=_TORCH_FUSED)}]
    text = "\n".join(_bench_lines(rows))
    # no bf16 in the call: the fused run still against the FP8 run, described from its backends line
    assert ("- FP8 with fp8_fused_casts=true (fp8_fused): 1.100x fp8 (_scaled_mm, torch casts, delayed scaling, "
            "exact sums) (tokens/s)") in text, text
    assert "bf16" not in text.replace("bf16 output head", "").replace("MFU (bf16 peak)", "")
    assert "Triton casts" not in text  # the runs' casts were torch's
    assert "  - fp8: " + _fp8_backends() in text
    assert "  - fp8_fused: " + _FP8.format(
        gemm="torch._scaled_mm", casts="torch casts", accum="none", fused=_TORCH_FUSED) + "\n" in text + "\n", text

    rows = [{"name": "bf16", "tokens_per_s": 800.0, "backends": "backend=auto: linear=torch" + _REST},
            *rows,
            {"name": "fp8_lt", "tokens_per_s": 1200.0, "backends": _fp8_backends(_LT, _CPP)},
            {"name": "fp8_lt_fused", "tokens_per_s": 1320.0, "backends": _fp8_backends(_LT, _CPP, fused=_CPP_FUSED)},
            {"name": "fp8_fast_accum", "tokens_per_s": 1050.0, "backends": _fp8_backends(accum="forward")},
            {"name": "fp8_mb8", "tokens_per_s": 1250.0, "backends": _fp8_backends()},
            {"name": "fp8_lt_mb8", "tokens_per_s": 1500.0, "backends": _fp8_backends(_LT, _CPP)},
            {"name": "bf16_nofusion", "tokens_per_s": 780.0,
             "backends": "backend=auto: linear=torch" + _REST.replace("grad_accum_fusion=on [torch GEMMs, not the fp8 "
                                                                      "GEMMs]: addmm_", "grad_accum_fusion=off")},
            {"name": "fp8_cuda", "error": "rc=1"}]
    text = "\n".join(_bench_lines(rows))
    fp8, bf16 = "fp8 (_scaled_mm, torch casts, delayed scaling, exact sums)", "bf16 (bf16 GEMMs)"
    lt = "fp8_lt (cuBLASLt GEMMs, C++ casts, delayed scaling, exact sums)"
    assert "- target FP8 >= 1.3x bf16 tokens/s: 1.25x (NOT met)" in text
    assert f"(fp8_fused): 1.100x {fp8}, 1.375x {bf16} (tokens/s)" in text, text
    assert f"(fp8_lt): 1.200x {fp8}, 1.500x {bf16} (tokens/s)" in text, text  # fp8_cuda failed: no ratio
    assert (f"(fp8_lt_fused): 1.100x {lt}, 1.200x fp8_fused (_scaled_mm, torch casts, delayed scaling, exact sums, "
            f"fused casts: layernorm apart, gelu apart), 1.320x {fp8}, 1.650x {bf16} (tokens/s)") in text, text
    assert f"(fp8_fast_accum): 1.050x {fp8}, 1.312x {bf16} (tokens/s)" in text, text
    assert f"(fp8_mb8): 1.250x {fp8}, 1.562x {bf16} (tokens/s)" in text, text
    assert f"(fp8_lt_mb8): 1.250x {lt}, 1.200x fp8_mb8 (" in text, text
    assert ("optim.grad_accum_fusion (the default run against the same run without it) (bf16): 1.026x bf16_nofusion "
            "(bf16 GEMMs, grad_accum_fusion off) (tokens/s)") in text, text
    assert "(fp8_cuda)" not in text and "fp8_cuda (" not in text
    assert run_gist(rows[4]["backends"]).endswith("fused casts: layernorm one kernel, gelu one kernel")
    dgelu = (", dgelu (fc1's output gradient, one kernel in fc2's backward once the gradient has a delayed scale "
             "(from the second training step))]")  # fp8_fused_casts: true's dGELU cast (model/fused_casts.py)
    assert run_gist(_fp8_backends(_LT, _CPP, fused=_CPP_FUSED[:-1] + dgelu)).endswith(
        "fused casts: layernorm one kernel, gelu one kernel, dgelu one kernel")
    assert run_gist(_fp8_backends(fused=_TORCH_FUSED[:-1] + ", dgelu (fc1's output gradient, run apart: the torch "
                                  "casts have no fused kernel)]")).endswith("gelu apart, dgelu apart")
    assert "fast accumulation: forward" in run_gist(rows[5]["backends"]) and run_gist(None) == "backends not recorded"
    # every run's backends line: bf16's in full, the FP8 runs' differing parts (their linear layers, wgrad)
    assert "  - bf16: backend=auto: linear=torch" + _REST.split(" | grad")[0] in text
    assert f"  - fp8_lt_fused: {_FP8.format(gemm=_LT, casts=_CPP, accum='none', fused=_CPP_FUSED)}\n" in text
    assert "  - bf16_nofusion: grad_accum_fusion=off\n" in text + "\n", text
    assert "  - fp8_mb8: backend=local: linear=native fp8 (torch._scaled_mm, torch casts)" in text
    assert "  - fp8_cuda" not in text  # failed: in the table with its error, no backends


def test_ops_summary_judges_the_targets_on_the_bandwidth_rows():
    """ops_bench.json as gpu_check's summary shows it: host-bound rows marked, the remap judged on
    its queued bandwidth row, each scatter against index_add_ on the same ids, the per-call table."""
    from suite_summary import ops_lines
    rows = [{"op": "copy (same bytes as the gather)", "dtype": "float32", "ms": 1.0, "GB/s": 3000.0, "host_ms": 0.01},
            {"op": "gather_rows (sorted ids)", "dtype": "float32", "ms": 1.05, "% of copy": 95.2, "host_ms": 0.01},
            {"op": "gather_rows (shuffled ids)", "dtype": "float32", "ms": 1.2, "% of copy": 83.3, "host_ms": 0.01},
            {"op": "scatter_add_rows (deterministic)", "dtype": "float32", "ms": 2.0, "host_ms": 0.02},
            {"op": "torch index_add_", "dtype": "float32", "ms": 3.0, "host_ms": 0.01},
            {"op": "scatter_add_rows 8x2048 tokens (dups)", "dtype": "bfloat16", "ms": 0.1, "host_ms": 0.06,
             "host-bound": True},
            {"op": "torch index_add_ 8x2048 tokens (dups)", "dtype": "bfloat16", "ms": 0.08, "host_ms": 0.01},
            {"op": "remap_ids (16384x2048)", "dtype": "int64", "ms": 0.2, "% of copy": 75.0, "host_ms": 0.03,
             "queued": True}]
    overhead = [{"op": "remap_ids", "shape": [8, 2048], "host_us": 12.0, "gpu_us": 4.0, "call_us": 30.0},
                {"op": "torch lookup[ids]", "shape": [8, 2048], "host_us": 10.0, "gpu_us": 5.0, "call_us": 28.0}]
    text = "\n".join(ops_lines({"info": {"device": "H200", "backend": "cuda"}, "results": rows, "overhead": overhead}))
    assert "| scatter_add_rows 8x2048 tokens (dups) | bfloat16 | 0.100 | n/a |  | 0.060 (host-bound) |" in text
    assert "| remap_ids | 12.00 | 4.00 | 30.00 |" in text and "(8x2048 ids)" in text
    assert "gather >= 80% of the copy: 83% at the lowest (gather_rows (shuffled ids), float32) (met)" in text
    assert "remap >= 80% of the copy: 75% (remap_ids (16384x2048), calls queued back to back) (NOT met)" in text
    assert ("scatter_add_rows (deterministic), float32 1.50x, scatter_add_rows 8x2048 tokens (dups), bfloat16 0.80x "
            "(host-bound) (NOT met)") in text
    assert "training size: host 1.20x, device 0.80x" in text
    rows[-1].update({"% of copy": 90.0, "queued": False})
    text = "\n".join(ops_lines({"results": rows}))
    assert "90% (remap_ids (16384x2048), calls queued back to back; the device waited for the host: " in text
    assert "| remap_ids (16384x2048) | int64 | 0.200 | n/a | 90 | 0.030 (device waited for the host) |" in text


def test_fp8_host_summary_renders_the_combination_table():
    """benchmarks/fp8_host_bench.py's record as gpu_check's summary shows it (a GPU-shaped record:
    the Triton rows): one table row per combination with forward, backward, their sum, the ops and
    Python calls, a skipped combination with its reason, the derived costs; a failed stage's error."""
    from suite_summary import fp8_host_lines
    row = {"fwd_ops": 2, "bwd_ops": 4, "fwd_py_calls": 20.5, "bwd_py_calls": 26.5, "fwd_syncs": 0, "bwd_syncs": 0}
    rec = {"device": "cuda", "device_name": "NVIDIA H200", "shape": [16, 64], "depth": 8, "kernels": "real",
           "scaling": "delayed", "passes": 200, "timing": "wall time between synchronisations, min over passes",
           "combos": {"bf16": {**row, "fwd_us": 10.0, "bwd_us": 20.0, "bwd_ops": 7},
                      "triton+torch": {**row, "fwd_us": 30.25, "bwd_us": 41.5, "bwd_syncs": 1}},
           "skipped": {"cuda+cublaslt": "the C++ GEMM operator cannot run: not built"},
           "derived": {"triton_launcher": {"us": 12.5, "of": "triton+cublaslt - tritonpy+cublaslt", "what": "launcher"},
                       "triton_casts": {"us": None, "of": "triton+cublaslt - cuda+cublaslt", "what": "casts"}}}
    lines = fp8_host_lines(rec)
    assert lines[0] == "## FP8: the host's cost per linear call (benchmarks/fp8_host_bench.py)"
    assert "| bf16 | 10.0 | 20.0 | 30.0 | 2 / 7 | 20.5 / 26.5 | 0 |" in lines
    assert "| triton+torch | 30.2 | 41.5 | 71.8 | 2 / 4 | 20.5 / 26.5 | 1 |" in lines
    assert "| cuda+cublaslt | skipped: the C++ GEMM operator cannot run: not built | | | | | |" in lines
    assert "- triton_launcher: 12.5 us per call = triton+cublaslt - tritonpy+cublaslt: launcher" in lines
    assert "- triton_casts: n/a us per call = triton+cublaslt - cuda+cublaslt: casts" in lines
    assert "delayed scaling, kernels real, min of 200 passes" in lines[2] and "NVIDIA H200" in lines[2]
    assert sum(line.startswith("| ---") for line in lines) == 1  # one table
    assert fp8_host_lines({"error": "rc=1: boom"})[-1] == "- failed: rc=1: boom"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
    reason="needs a CUDA GPU with FP8 (compute capability 8.9+)")])])
def test_fp8_cast_bench_rows_and_same_bytes(device):
    """benchmarks/fp8_cast_bench.py at small shapes: a copy row and a row per kernel for each
    shape, every kernel's bytes equal to the first kernel's (on CUDA: every Triton tile, the C++
    operator where built, inductor's casts), the copy's bytes moved counted as the cast's."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import fp8_cast_bench as bench
    rows = bench.run(torch.device(device), 256, 64, 256, iters=1)
    assert not [r for r in rows if "error" in r], rows
    per_shape = {}
    for r in rows:
        per_shape.setdefault(r["shape"], []).append(r)
    assert len(per_shape) == 4
    names = [k for k, _ in bench.kernels(torch.device(device))]
    for label, rs in per_shape.items():
        assert [r["kernel"] for r in rs] == ["copy (bf16 clone)"] + names, (label, rs)
        assert all(r["gbps"] > 0 and r["us"] > 0 for r in rs)
        assert all(r["same_bytes"] is True for r in rs[2:]), rs  # rs[1] is the reference
    if device == "cuda":
        assert sum(n.startswith("triton") for n in names) == len(bench.TRITON_TILES)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
    reason="needs a CUDA GPU with FP8 (compute capability 8.9+)")])])
def test_fp8_cast_bench_fused_rows_agree_with_unfused(device):
    """fp8_cast_bench.run_fused at small shapes: per op (LayerNorm, GELU, and the GELU backward
    where the C++ operator runs) a copy row, each path's unfused pass (producer, then the cast; the
    same bytes across paths) and the fused kernels (the C++ operator where built, the torch casts'
    GELU, Triton's on CUDA with every LayerNorm tile), each fused row's bytes within the tolerance
    of the unfused rows' and its speed-up over its path's unfused row; dgelu's pair casts to e5m2
    and counts 8 bytes an element (its copy row clones as many)."""
    import fp8_cast_bench as bench
    from dept_mega.parallel import fp8_casts
    dev = torch.device(device)
    rows = bench.run_fused(dev, 256, 64, 256, iters=1)
    assert not [r for r in rows if "error" in r], rows
    weight = torch.ones(64, dtype=torch.bfloat16, device=dev)
    cpp = fp8_casts.op_unavailable(dev) is None
    ops = [("layernorm", "layernorm [tokens, hidden]"), ("gelu", "gelu [tokens, ffn]")]
    assert cpp == any(r["op"] == "dgelu" for r in rows)
    if cpp:
        ops.append(("dgelu", "dgelu [tokens, ffn]"))
        dgelu = [r for r in rows if r["op"] == "dgelu"]
        assert [r["variant"] for r in dgelu] == ["copy", "unfused", "fused"] and {r["fp8"] for r in dgelu} == {"float8_e5m2"}
        assert dgelu[0]["gbps"] == pytest.approx(8 * 256 * 256 / (dgelu[0]["us"] * 1e3))
    for op, label in ops:
        rs = [r for r in rows if r["op"] == op]
        assert all(r["shape"] == label for r in rs)
        names = [name for _, _, name, _ in bench.fused_kernels(dev, weight)[op]]
        assert [r["kernel"] for r in rs] == ["copy (bf16 clone)"] + names, (op, rs)
        assert all(r["us"] > 0 and r["gbps"] > 0 for r in rs)
        unfused = [r for r in rs if r["variant"] == "unfused"]
        fused = [r for r in rs if r["variant"] == "fused"]
        assert unfused[0]["same_bytes"] is None and all(r["same_bytes"] is True for r in unfused[1:]), unfused
        paths = {r["path"] for r in fused}
        assert ("cuda" in paths) == cpp, paths
        assert ("torch" in paths) == (op == "gelu")  # no fused LayerNorm or dGELU in the torch casts
        for r in fused:
            assert r["differ_fraction"] <= bench.FUSED_MAX_FRACTION and r["max_steps"] <= 1, r
            assert r["speedup"] == pytest.approx(next(u["us"] for u in unfused if u["path"] == r["path"]) / r["us"])
    if device == "cuda":
        assert sum(r["kernel"].startswith("fused: triton layernorm") for r in rows) == len(bench.LN_TILES)


def test_fp8_cast_bench_ln_tiles_start_with_the_default():
    """LN_TILES: the fused LayerNorm cast's default tile first (the bench marks it "(default)"),
    the fastest measured on the H200 (32 x 256, 8 warps), then the other candidates once each, the
    previous default (32 x 128, 4 warps) among them."""
    import fp8_cast_bench as bench
    from dept_mega.parallel import fp8_norm_kernels
    assert bench.LN_TILES[0] == fp8_norm_kernels._TILE == (32, 256, 8)
    assert (32, 128, 4) in bench.LN_TILES[1:] and len(set(bench.LN_TILES)) == len(bench.LN_TILES)


def test_fp8_cast_bench_compare_bytes_counts_fp8_steps():
    """compare_bytes: the differing bytes of both layouts and their distance in FP8 steps (±0 equal
    in value, one step across zero)."""
    import fp8_cast_bench as bench
    from dept_mega.parallel.fp8_recipe import E4M3
    ref = torch.tensor([[0.5, -0.5, 0.0, 2.0]]).to(E4M3)
    got = ref.view(torch.uint8).clone()
    got[0, 0] += 1  # the next e4m3 value
    got[0, 3] += 3
    got = got.view(E4M3)
    r = bench.compare_bytes((got, got.t().contiguous()), (ref, ref.t().contiguous()))
    assert r == {"differ_bytes": 4, "differ_fraction": 0.5, "max_steps": 3}
    assert bench.compare_bytes((ref,), (ref,)) == {"differ_bytes": 0, "differ_fraction": 0.0, "max_steps": 0}
    minus_zero = torch.tensor([[-0.0, 2 ** -9]]).to(E4M3)  # -0 and the smallest subnormal
    plus_zero = torch.tensor([[0.0, -2 ** -9]]).to(E4M3)
    assert bench.compare_bytes((minus_zero,), (plus_zero,))["max_steps"] == 2


def test_fp8_cast_bench_summary_renders_fused_vs_unfused():
    """suite_summary.fused_cast_lines: one line per fused kernel beside its path's unfused µs,
    the speed-up, the differing bytes (flagged beyond the tolerance), failures, and the paths
    without a fused kernel; the plain casts' table unchanged before it."""
    from suite_summary import fp8_cast_lines
    base = {"op": "layernorm", "shape": "layernorm [tokens, hidden]"}
    fused = [{**base, "variant": "copy", "path": None, "kernel": "copy (bf16 clone)", "us": 10.0},
             {**base, "variant": "unfused", "path": "triton", "kernel": "unfused: F.layer_norm + triton cast_fp8",
              "us": 40.0, "pct_of_copy": 25.0, "host_us": 9.0, "same_bytes": None},
             {**base, "variant": "unfused", "path": "torch", "kernel": "unfused: F.layer_norm + torch cast",
              "us": 50.0, "pct_of_copy": 20.0, "host_us": 30.0, "same_bytes": True},
             {**base, "variant": "fused", "path": "triton", "kernel": "fused: triton layernorm_cast_fp8 32x128 w4 "
              "(default)", "us": 20.0, "pct_of_copy": 50.0, "host_us": 8.0, "speedup": 2.0, "differ_bytes": 3,
              "differ_fraction": 1e-5, "max_steps": 1},
             {**base, "variant": "fused", "path": "triton", "kernel": "fused: triton layernorm_cast_fp8 16x128 w4",
              "us": 16.0, "pct_of_copy": 62.5, "host_us": 8.0, "speedup": 2.5, "differ_bytes": 0,
              "differ_fraction": 0.0, "max_steps": 0},
             {"op": "gelu", "shape": "gelu [tokens, ffn]", "variant": "unfused", "path": "cuda",
              "kernel": "unfused: F.gelu + cuda cast_fp8", "us": 30.0, "host_us": 5.0, "same_bytes": None},
             {"op": "gelu", "shape": "gelu [tokens, ffn]", "variant": "fused", "path": "cuda",
              "kernel": "fused: cuda cast_fp8(gelu=True)", "us": 20.0, "pct_of_copy": 40.0, "host_us": 5.0,
              "speedup": 1.5, "differ_bytes": 500, "differ_fraction": 5e-2, "max_steps": 1},
             {"op": "gelu", "shape": "gelu [tokens, ffn]", "variant": "fused", "path": "triton",
              "kernel": "fused: triton cast_fp8(gelu=True)", "error": "RuntimeError: boom"}]
    plain = [{"shape": "input [tokens, hidden]", "kernel": "copy (bf16 clone)", "us": 10.0, "gbps": 400.0,
              "host_us": 1.0}]
    lines = fp8_cast_lines({"rows": plain, "fused": fused, "fused_max_fraction": 1e-3})
    assert "| input [tokens, hidden] | copy (bf16 clone) | 10.0 | 400 |  | 1.0 |  |" in lines
    head = lines.index("### Fused vs unfused: the producer (LayerNorm, GELU) and the FP8 cast in one kernel")
    assert lines[head + 2].startswith("| op | path | unfused us | fused kernel | fused us |")
    assert ("| layernorm | triton | 40.0 | triton layernorm_cast_fp8 32x128 w4 (default) | 20.0 | 50 | 8.0 | "
            "2.00x | 3 (1.0e-05, up to 1 FP8 steps) |") in lines
    assert ("| layernorm | triton | 40.0 | triton layernorm_cast_fp8 16x128 w4 (fastest) | 16.0 | 62 | 8.0 | "
            "2.50x | none |") in lines
    assert "| layernorm | torch | 50.0 | none (this path runs them apart) | | | | | |" in lines
    assert ("| gelu | cuda | 30.0 | cuda cast_fp8(gelu=True) (fastest) | 20.0 | 40 | 5.0 | 1.50x | "
            "500 (5.0e-02, up to 1 FP8 steps) BEYOND TOLERANCE |") in lines
    assert "| gelu | triton | | fused: triton cast_fp8(gelu=True) | failed: RuntimeError: boom | | | | |" in lines
    assert "Fused vs unfused" not in "\n".join(fp8_cast_lines({"rows": plain}))  # an older record: no section


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_attention_bench_measures_each_kernel_against_the_fp32_alibi_reference(device, tmp_path, monkeypatch):
    """benchmarks/attention_bench.py at small shapes: a timed row per kernel with its errors
    against the fp32 ALiBi reference. The ALiBi kernels agree with it; the no-ALiBi ceiling rows
    compute another function and their error shows it (the error column can fail). On CUDA every
    flex row (the model's, the first FLEX_OPTIONS entry: each compiles) runs or says why not."""
    import attention_bench as bench
    monkeypatch.setattr(bench, "FLEX_OPTIONS", bench.FLEX_OPTIONS[:1])
    out = tmp_path / "rows.json"
    assert bench.main(["--device", device, "--batch", "2", "--heads", "4", "--seq", "256", "--head-dim", "64",
                       "--iters", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    by = {r["kernel"]: r for r in rows}
    tol = 0.0 if device == "cpu" else 5e-2  # bf16 kernels against fp32
    alibi = [r for r in rows if "no ALiBi" not in r["kernel"] and "ms" in r]
    assert alibi and all(max(r["error"].values()) <= tol for r in alibi), alibi
    ceiling = [r for r in rows if "no ALiBi" in r["kernel"] and "ms" in r]
    assert ceiling and all(r["error"]["out"] > 0.1 for r in ceiling), ceiling
    assert all(r["ms"] > 0 and r["tflops"] > 0 for r in alibi + ceiling)
    if device == "cuda":
        assert "ms" in by["flex (the model's)"], by["flex (the model's)"]
        assert sum(k.startswith("flex ") for k in by) == len(bench.FLEX_OPTIONS) + 1
        assert all("ms" in r or r["failed"] for r in rows)


def test_attention_summary_marks_the_fastest_kernel_of_the_models_function():
    """suite_summary's attention section: a row per kernel; "(fastest)" on the quickest row that
    computes the model's function (ALiBi), never on the faster no-ALiBi ceiling; a kernel that
    refused the inputs says why."""
    from suite_summary import attention_lines
    err = {"out": 1e-3, "dq": 2e-3, "dk": 2e-3, "dv": 1e-3}
    rows = [{"kernel": "flex (the model's)", "ms": 1.0, "tflops": 240.0, "error": err},
            {"kernel": "flex ROWS_GUARANTEED_SAFE=True", "ms": 0.9, "tflops": 267.0, "error": err},
            {"kernel": "bias cudnn", "failed": "RuntimeError: No available kernel"},
            {"kernel": "causal flash (no ALiBi)", "ms": 0.5, "tflops": 480.0, "error": {**err, "out": 0.6}}]
    lines = attention_lines({"rows": rows, "rc": 0})
    assert "| flex ROWS_GUARANTEED_SAFE=True (fastest) | 0.900 | 267 | 1.0e-03, 2.0e-03, 2.0e-03, 1.0e-03 |" in lines
    assert "| causal flash (no ALiBi) | 0.500 | 480 | 6.0e-01, 2.0e-03, 2.0e-03, 1.0e-03 |" in lines
    assert "| bias cudnn | failed: RuntimeError: No available kernel | | |" in lines
    assert sum("(fastest)" in line for line in lines) == 1
    assert attention_lines({"error": "rc=1: boom"})[-1] == "- failed: rc=1: boom"


def test_bench_summary_reports_the_tuned_run_and_its_gemm_problems():
    """gpu_check's fp8_tuned stage (fp8_all_fused's settings with fp8_gemm_tuning=8): its tokens/s
    over fp8_all_fused's, and the record's line of the GEMM problems tuned."""
    from suite_summary import _bench_lines

    tuned_line = "fp8_gemm_tuning: 1 problems tuned; kept 0.180 ms against the heuristic's first 0.200 ms: x"
    rows = [{"name": "fp8_all_fused", "tokens_per_s": 1000.0, "backends": _fp8_backends(_LT, _CPP, fused=_CPP_FUSED)},
            {"name": "fp8_tuned", "tokens_per_s": 1030.0,
             "backends": _fp8_backends(_LT + " tuned over 8 candidates", _CPP, fused=_CPP_FUSED),
             "fp8_gemm_tuning": [{"m": 16}], "fp8_gemm_tuning_line": tuned_line}]
    text = "\n".join(_bench_lines(rows))
    assert "- FP8 with fp8_all_fused's settings and fp8_gemm_tuning=8 (fp8_tuned): 1.030x fp8_all_fused (" in text, text
    assert f"- fp8_tuned: {tuned_line}" in text, text


def test_dataset_index_memory_benchmark_runs_and_loads_without_private_memory(tmp_path):
    """benchmarks/dataset_index_memory.py on 400k documents: every step runs, and a dataset
    that loads its index from the cache adds (almost) no private memory (its arrays are
    memory-mapped; read into memory they would be ~8 MiB here)."""
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "dataset_index_memory.py"), "--docs", "400000",
           "--mean-tokens", "50", "--seq-length", "64", "--dir", str(tmp_path)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = {ln.split(":")[0].strip(): ln for ln in res.stdout.splitlines()}
    assert {"data", "open", "epoch", "warm"} <= set(lines), res.stdout
    anon = int(lines["warm"].split("RssAnon +")[1].split()[0])
    assert anon <= 2, res.stdout
