"""Tests that need a CUDA device (``pytest -m gpu`` on the GPU machine; skipped elsewhere).

The CUDA variants of the custom ops are in tests/test_ops.py and tests/test_ops_errors.py (also marked ``gpu``). Here: a
training step on CUDA against the same step on the CPU (fp32 and bf16), the throughput and
memory fields of the train records with a profiler trace of CUDA kernels, the compiled cross
entropy on CUDA (no vocabulary-sized temporaries), fused AdamW, and tools/benchmark.py's record on a GPU.

``DEPT_MEGA_GPU_TESTS_ON_CPU=1`` runs this file on the CPU (a dry run of the test logic; the
CUDA-only assertions are skipped then, and nothing here is measured on a GPU).
"""
from __future__ import annotations

import io
import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from tests.trainer_utils import ROOT, TINY, dp_micro_batches, global_batch, merge, tiny_config

pytestmark = pytest.mark.gpu

ON_CPU = os.environ.get("DEPT_MEGA_GPU_TESTS_ON_CPU") == "1" and not torch.cuda.is_available()
DEV = torch.device("cpu" if ON_CPU else "cuda")
CUDA = DEV.type == "cuda"


def _train(cfg, device, steps=3):
    from dept_mega.parallel.groups import build_groups
    from dept_mega.trainer import Trainer
    torch.manual_seed(cfg.train.seed)
    trainer = Trainer(cfg, build_groups(), device, vocab_size=cfg.model.vocab_size)
    out = []
    for step in range(steps):
        res = trainer.train_step(dp_micro_batches(cfg, global_batch(cfg, step), 0, 1))
        out.append((res.loss, res.grad_norm))
    return out, trainer


@pytest.mark.parametrize("precision,rel_loss,rel_norm", [("fp32", 1e-4, 1e-3), ("bf16", 2e-2, 1e-1)])
def test_training_step_on_cuda_matches_cpu(precision, rel_loss, rel_norm):
    """Same init (CPU generator), same batches: three steps on the device equal the CPU's within
    the precision's tolerance (bf16: autocast kernels differ between devices)."""
    cfg = tiny_config({"precision": precision})
    ref, _ = _train(cfg, torch.device("cpu"))
    got, trainer = _train(cfg, DEV)
    for (l_ref, n_ref), (l, n) in zip(ref, got):
        assert abs(l - l_ref) <= rel_loss * abs(l_ref), (precision, got, ref)
        assert abs(n - n_ref) <= rel_norm * abs(n_ref), (precision, got, ref)
    # bf16: the model's weights are bf16 and the optimizer steps fp32 main copies (Megatron's layout)
    want = torch.float32 if precision == "fp32" else torch.bfloat16
    assert all(p.dtype == want and p.device.type == DEV.type for p in trainer.parameters())
    opt = trainer.body_optimizer
    assert all(g["params"] and all(m.dtype == torch.float32 for m in g["params"])
               for g in opt.param_groups if g["params"])
    if CUDA:
        assert opt.inner.defaults.get("fused") is True  # fused AdamW on CUDA
        assert opt.state and all(st["exp_avg"].device.type == "cuda" for st in opt.state.values())


def test_train_records_carry_throughput_memory_and_a_cuda_trace(tmp_path):
    from dept_mega.loop import StdHooks, TrainLoop
    from dept_mega.metrics import MetricsWriter, check_record, peak_bf16_flops
    from dept_mega.parallel.groups import build_groups
    from dept_mega.trainer import Trainer
    cfg = tiny_config({"precision": "bf16", "train": {"steps": 4, "log_interval": 2, "run_dir": str(tmp_path),
                                                      "eval_interval": 0, "profile": {"start": 1, "stop": 2}}})
    pg = build_groups()
    trainer = Trainer(cfg, pg, DEV, vocab_size=cfg.model.vocab_size)

    class Synthetic:
        step = 0

        def next_step(self):
            self.step += 1
            return dp_micro_batches(cfg, global_batch(cfg, self.step), 0, 1)

    writer = MetricsWriter(str(tmp_path), stream=io.StringIO(), tensorboard=False)
    TrainLoop(cfg, pg, trainer, StdHooks(), writer, lambda name: Synthetic()).run()
    writer.close()
    recs = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in recs] == [2, 4]
    for r in recs:
        check_record(r)
        assert r["tokens_per_s"] > 0
        if CUDA:
            assert r["tflops_per_device"] > 0
            peak = peak_bf16_flops(torch.cuda.get_device_name(DEV))
            assert (r["mfu"] is None) == (peak is None)
            assert 0 < r["mem_allocated_gb"] <= r["mem_peak_gb"]
    trace = json.load(open(tmp_path / "profile" / "rank0_steps2-2.json"))  # profile start 1, stop 2: step 2
    names = [e.get("name", "") for e in trace["traceEvents"]]
    assert "ProfilerStep#2" in names and "ProfilerStep#1" not in names
    if CUDA:
        assert any(e.get("cat") == "kernel" for e in trace["traceEvents"])  # CUDA activities recorded
    # benchmarks/kernel_breakdown.py's per-step part on this trace: one step (kineto's GPU-side
    # copy of the range is not a second one); on CUDA the GPU's union within the step, launches
    # correlated to their kernels, and the launching thread's host stack at each long gap
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from step_timeline import analyse
    [st] = analyse(trace, gap_us=20)
    assert st["step"] == "ProfilerStep#2" and st["span_us"] > 0 and st["host"]["ops"]
    if CUDA:
        assert 0 < st["gpu_active_us"] <= st["span_us"] and st["gpu_idle_us"] >= 0
        assert st["long_gaps_us"] + st["short_gaps_us"] == pytest.approx(st["gpu_idle_us"])
        la = st["host"]["launches"]
        assert la["runtime_calls"] + la["driver_calls"] > 0 and la["runtime_us"] + la["driver_us"] > 0
        assert any(kernels for _, _, _, kernels in st["host"]["api"])  # correlation ids matched
        assert all(g["cpu_at_start"] for g in st["largest_gaps"])
    else:
        assert st["gpu_active_us"] is None
    # kernel_breakdown's "launched by": each kernel linked to its launch call (correlation id) and
    # the aten operator around it, with the input shapes the trainer's profiler records
    from kernel_launchers import attribute
    from step_timeline import timeline
    att = attribute(timeline(trace))
    labels = [lab for rows in att["kernels"].values() for lab, _, _ in rows]
    if CUDA:
        li = att["linked"]
        assert li["launch"] >= 0.9 * sum(li.values()), li
        assert att["shapes_recorded"] and any(lab.startswith("aten::") and " [" in lab for lab in labels), labels
    else:
        assert labels == [] and att["linked"] == {"launch": 0, "external_id": 0, "none": 0}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cross_entropy_compiled_on_cuda(dtype):
    """The model's call (padded columns masked by ``vocab_size``, gradient into the logits) on
    CUDA, where its math is compiled: no vocabulary-sized temporary in the forward or the
    backward (peaks above the logits stay within 64 bytes per token), the gradient is the
    logits' storage, values against an fp64 reference (bf16 gradient: one bf16 rounding)."""
    from dept_mega.parallel.cross_entropy import vocab_parallel_cross_entropy
    from dept_mega.parallel.groups import build_groups
    g = torch.Generator().manual_seed(3)
    n, v, v_pad = 4096 if CUDA else 64, 50257, 50304
    src = (torch.randn(n, v_pad, generator=g) * 3).to(dtype).to(DEV)
    labels = torch.randint(0, v, (n,), generator=g).to(DEV)
    weights = torch.randn(n, generator=g).to(DEV)
    pg = build_groups()

    def run():
        leaf = src.clone().requires_grad_(True)
        logits = leaf * 1  # a non-leaf, as the head's output
        if CUDA:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated() if CUDA else 0
        loss = vocab_parallel_cross_entropy(logits, labels, pg, vocab_size=v, consume_logits=True)
        fwd = torch.cuda.max_memory_allocated() - start if CUDA else 0
        if CUDA:
            torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated() if CUDA else 0
        (grad,) = torch.autograd.grad((loss * weights).sum(), logits)
        bwd = torch.cuda.max_memory_allocated() - start if CUDA else 0
        return loss.detach(), grad, logits, fwd, bwd

    run()  # compiles
    loss, grad, logits, fwd, bwd = run()
    assert grad.data_ptr() == logits.data_ptr()
    if CUDA:
        assert fwd <= 64 * n and bwd <= 64 * n, (fwd, bwd)
    ref_logits = src[:, :v].double().requires_grad_(True)
    ref = F.cross_entropy(ref_logits, labels, reduction="none")
    (ref * weights.double()).sum().backward()
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-6, atol=1e-5)
    tol = dict(rtol=2 ** -8, atol=1e-7) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(grad[:, :v].double(), ref_logits.grad, **tol)
    assert not grad[:, v:].any()


def test_benchmark_tool_on_cuda(tmp_path):
    import importlib.util

    import yaml
    cfg_path = tmp_path / "tiny.yaml"
    cfg_path.write_text(yaml.safe_dump(merge(TINY, {"precision": "bf16", "train": {"steps": 10}})))
    spec = importlib.util.spec_from_file_location("bench_tool", os.path.join(ROOT, "tools", "benchmark.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "bench.json"
    env = {"DEPT_MEGA_DEVICE": "cpu"} if ON_CPU else {}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        assert mod.main(["--config", str(cfg_path), "--steps", "3", "--warmup", "1", "--out", str(out)]) == 0
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    rec = json.loads(out.read_text())
    assert rec["tokens_per_s"] > 0 and rec["peak_mem_gb"] > 0
    if CUDA:
        assert rec["device"].startswith("cuda") and rec["tflops_per_device"] > 0
        assert rec["device_name"] == torch.cuda.get_device_name()
        assert rec["peak_reserved_gb"] >= rec["peak_mem_gb"] > 0  # reserved: allocated plus the cache


def test_grad_accum_fusion_bf16_gradients_at_least_as_close_to_fp32():
    """One bf16 step (4 micro-batches) with optim.grad_accum_fusion on and off: the fp32 gradient
    buffers of the fused weights (block GEMMs, untied head) are within bf16 tolerance of an fp32
    run's, and the fused one — every micro-batch's GEMM accumulated in fp32 — is closer
    as the unfused one, which rounds each micro-batch's gradient to bf16 first. On CUDA the
    accumulation is the one fused GEMM (addmm with out_dtype=fp32 into main_grad)."""
    from dept_mega.parallel.wgrad import wgrad_call
    fused = ("qkv.weight", "proj.weight", "fc1.weight", "fc2.weight", "output_layer.weight")

    def grads(precision, fuse):
        cfg = tiny_config({"precision": precision, "model": {"tie_embeddings": False},
                           "optim": {"clip_grad": 0.0, "grad_accum_fusion": fuse}})
        _, trainer = _train(cfg, DEV, steps=1)
        return {n: p.main_grad.double().cpu() for st in trainer.stages for n, p in st.named_parameters()
                if n.endswith(fused)}

    ref = grads("fp32", False)
    assert len(ref) == 4 * 4 + 1
    norm = sum(float(r.square().sum()) for r in ref.values()) ** 0.5

    def err(g):
        return sum(float((g[n] - ref[n]).square().sum()) for n in ref) ** 0.5 / norm

    on, off = err(grads("bf16", True)), err(grads("bf16", False))
    assert on <= 2e-2 and off <= 2e-2, (on, off)
    assert on < off, (on, off)  # strictly: the unfused rounding is gone
    if CUDA:
        assert wgrad_call(DEV, torch.bfloat16, torch.float32) == "addmm_out_dtype"
