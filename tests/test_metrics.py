"""Throughput fields of the train records (docs/metrics.md): tokens/s over the logging window,
TFLOP/s per device, MFU from the device's peak, paused time, the log line."""
from __future__ import annotations

import pytest

from dept_mega.metrics import ThroughputMeter, human_line, peak_bf16_flops, train_flops_per_token
from dept_mega.parallel.groups import build_groups
from tests.trainer_utils import tiny_config


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_peak_flops_by_device_name():
    assert peak_bf16_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_bf16_flops("NVIDIA H200") == 989e12
    assert peak_bf16_flops("NVIDIA H100 PCIe") is None  # another peak: not guessed
    assert peak_bf16_flops("NVIDIA H100 NVL") is None
    assert peak_bf16_flops("NVIDIA H200 NVL") is None  # 835 TFLOP/s dense, not the SXM part's 989
    assert peak_bf16_flops("NVIDIA GH200 480GB") == 989e12
    assert peak_bf16_flops("NVIDIA A100-SXM4-80GB") is None


def test_meter_window_tokens_flops_mfu_and_pauses():
    cfg = tiny_config()
    clock = FakeClock()
    m = ThroughputMeter(cfg.model, build_groups(), "cpu", report_flops=True, peak_flops=1e9, clock=clock)
    fpt = train_flops_per_token(cfg.model, 100)
    m.add_step(1000, 100)
    clock.t += 2.0
    with m.paused():  # e.g. an evaluation: not counted
        clock.t += 5.0
    m.add_step(1000, 100)
    clock.t += 2.0
    w = m.window()
    assert w["tokens_per_s"] == pytest.approx(2000 / 4.0)
    assert w["tflops_per_device"] == pytest.approx(2000 * fpt / 4.0 / 1e12)
    assert w["mfu"] == pytest.approx(2000 * fpt / 4.0 / 1e9)
    assert "mem_peak_gb" not in w  # CUDA only
    clock.t += 1.0
    m.add_step(10, None)  # a rank without embeddings: tokens, no FLOPs
    w2 = m.window()
    assert w2["tokens_per_s"] == pytest.approx(10.0) and w2["tflops_per_device"] is None and w2["mfu"] is None


def test_meter_on_cpu_reports_tokens_only():
    m = ThroughputMeter(tiny_config().model, build_groups(), "cpu")
    m.add_step(64, 100)
    w = m.window()
    assert w["tokens_per_s"] > 0 and w["tflops_per_device"] is None and w["mfu"] is None


def test_human_line_shows_what_is_known():
    line = human_line(20, 100, 5.1234, 3e-4, 12345.0, 62.0, 248.0)
    assert "12,345 tok/s" in line and "TFLOP" not in line and "MFU" not in line and "window" not in line
    line = human_line(20, 100, 5.1234, 3e-4, 12345.0, 62.0, 248.0, loss_window=5.20114)
    assert line.startswith("step 20/100 | loss 5.1234 | window loss 5.2011 | lr 3.000e-04 |")
    line = human_line(20, 100, 5.1234, 3e-4, 12345.0, 62.0, 248.0, tflops_per_device=402.12, mfu=0.4066,
                      mem_peak_gb=61.23)
    assert "402.1 TFLOP/s/device" in line and "MFU 40.7%" in line and "mem peak 61.2 GB" in line
    assert "grad norm" not in line
    line = human_line(20, 100, 5.1234, 3e-4, 12345.0, 62.0, 248.0, grad_norm=0.51234)
    assert "| lr 3.000e-04 | grad norm 0.512 | 12,345 tok/s" in line
    assert "grad norm nan" in human_line(20, 100, 5.1234, 3e-4, 1.0, 62.0, 248.0, grad_norm=float("nan"))
    assert "consumed" not in line
    line = human_line(20, 100, 5.1234, 3e-4, 12345.0, 62.0, 248.0, grad_norm=0.5, consumed=(5120, 20971520, 1))
    assert "| grad norm 0.500 | consumed 5,120 samples 20,971,520 tokens | 12,345 tok/s" in line
    line = human_line(20, 100, 5.1234, 3e-4, 12345.0, 62.0, 248.0, consumed=(80, 1280, 2))
    assert "| consumed 80 samples 1,280 tokens per group | 12,345 tok/s" in line


def test_the_step_line_shows_the_records_grad_norm(tmp_path):
    """The log's step line carries the train record's grad norm (Megatron's log shows it)."""
    import io
    import json
    import os

    import torch

    from dept_mega.loop import StdHooks, TrainLoop
    from dept_mega.metrics import MetricsWriter
    from dept_mega.trainer import Trainer
    from tests.dept_utils import SyntheticSource
    from tests.dept_utils import tiny_config as dept_config
    run = str(tmp_path / "run")
    cfg = dept_config({"dept": {"variant": "std"}, "train": {"steps": 2, "log_interval": 1, "eval_interval": 0,
                                                              "save_interval": 0, "run_dir": run}})
    pg = build_groups(1, 1, 1)
    trainer = Trainer(cfg, pg, torch.device("cpu"), vocab_size=cfg.model.vocab_size)
    stream = io.StringIO()
    allowed = torch.arange(cfg.model.vocab_size)
    TrainLoop(cfg, pg, trainer, StdHooks(), MetricsWriter(run, enabled=True, stream=stream),
              lambda name: SyntheticSource(cfg, 3, allowed)).run()
    with open(os.path.join(run, "metrics.jsonl")) as f:
        norms = [r["grad_norm"] for r in map(json.loads, f) if r["kind"] == "train"]
    lines = [ln for ln in stream.getvalue().splitlines() if ln.startswith("step ")]
    assert len(lines) == len(norms) == 2
    for ln, norm in zip(lines, norms):
        assert f"| grad norm {norm:.3f} |" in ln, (ln, norm)


def test_profiler_start_and_trace_export_are_not_in_tokens_per_s(tmp_path, monkeypatch):
    """train.profile: starting the profiler and writing its trace (seconds for a large GPU trace)
    are kept out of the window's tokens/s, as evaluation and checkpoints are; the profiled steps
    themselves count. A clock that jumps 1000 s inside start and export shows it."""
    import io
    import json
    import os
    import time

    import torch

    import dept_mega.loop as loop_module
    from dept_mega.loop import StdHooks, TrainLoop
    from dept_mega.metrics import MetricsWriter
    from dept_mega.profiling import StepProfiler
    from dept_mega.trainer import Trainer
    from tests.dept_utils import SyntheticSource
    from tests.dept_utils import tiny_config as dept_config
    jump = [0.0]

    class Meter(ThroughputMeter):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, clock=lambda: time.perf_counter() + jump[0], **kwargs)

    monkeypatch.setattr(loop_module, "ThroughputMeter", Meter)
    start, finish = StepProfiler.before_step, StepProfiler._finish

    def slow_start(self, steps_done):
        if self._prof is None and self._first is None and self.cfg.start <= steps_done < self.cfg.stop:
            jump[0] += 1000.0
        start(self, steps_done)

    def slow_finish(self, steps_done):
        jump[0] += 1000.0
        finish(self, steps_done)

    monkeypatch.setattr(StepProfiler, "before_step", slow_start)
    monkeypatch.setattr(StepProfiler, "_finish", slow_finish)
    run = str(tmp_path / "run")
    cfg = dept_config({"dept": {"variant": "std"},
                       "train": {"steps": 3, "log_interval": 3, "eval_interval": 0, "save_interval": 0,
                                 "run_dir": run, "profile": {"start": 1, "stop": 2}}})
    pg = build_groups(1, 1, 1)
    trainer = Trainer(cfg, pg, torch.device("cpu"), vocab_size=cfg.model.vocab_size)
    allowed = torch.arange(cfg.model.vocab_size)
    TrainLoop(cfg, pg, trainer, StdHooks(), MetricsWriter(run, enabled=True, stream=io.StringIO()),
              lambda name: SyntheticSource(cfg, 3, allowed)).run()
    assert jump[0] == 2000.0 and os.listdir(os.path.join(run, "profile")) == ["rank0_steps2-2.json"]
    with open(os.path.join(run, "metrics.jsonl")) as f:
        (rec,) = [r for r in map(json.loads, f) if r["kind"] == "train"]
    tokens = 3 * cfg.train.global_batch_size * cfg.model.seq_length
    assert rec["tokens_per_s"] > tokens / 100.0, rec  # not tokens / 2000 s


def test_step_profiler_selected_ranks_resume_and_early_end(tmp_path):
    import json
    import os

    import torch

    from dept_mega.config import ProfileConfig
    from dept_mega.profiling import StepProfiler
    prof_cfg = ProfileConfig(start=2, stop=4, ranks=[1])
    lines: list[str] = []

    def steps(p, first, last):
        for s in range(first, last):
            p.before_step(s)
            torch.ones(8, 8) @ torch.ones(8, 8)
            p.after_step(s + 1)
        p.close(last)

    steps(StepProfiler(prof_cfg, str(tmp_path), 0, "cpu", log=lines.append), 0, 6)  # not selected
    assert not (tmp_path / "profile").exists()
    steps(StepProfiler(prof_cfg, str(tmp_path), 1, "cpu", log=lines.append), 0, 6)
    steps(StepProfiler(prof_cfg, str(tmp_path / "resumed"), 1, "cpu", log=lines.append), 3, 6)
    steps(StepProfiler(prof_cfg, str(tmp_path / "short"), 1, "cpu", log=lines.append), 0, 3)
    # the file name and the log line name the steps the trace holds (ProfilerStep#N: step N)
    assert os.listdir(tmp_path / "profile") == ["rank1_steps3-4.json"]
    assert os.listdir(tmp_path / "resumed" / "profile") == ["rank1_steps4-4.json"]
    assert os.listdir(tmp_path / "short" / "profile") == ["rank1_steps3-3.json"]  # the run ended first
    assert len(lines) == 3
    assert lines[0].endswith("rank1_steps3-4.json (steps 3-4)") and lines[1].endswith("(step 4)"), lines
    for where, held in (("", [3, 4]), ("resumed", [4]), ("short", [3])):
        (name,) = os.listdir(tmp_path / where / "profile")
        with open(tmp_path / where / "profile" / name) as f:
            traced = {e["name"] for e in json.load(f)["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")}
        assert sorted(int(n.split("#")[1]) for n in traced) == held, (where, traced)


def _megatron_flops_per_token(m, padded_vocab: int, causal_half: bool = True) -> float:
    """Megatron-LM core_v0.16.1's ``num_floating_point_operations`` (megatron/training/training.py)
    divided by batch × sequence, transcribed for a dense GPT (MHA or GQA; no MoE, MTP, MLA, linear
    attention or output gate). ``causal_half=False``: the core attention term without its ``/ 2``,
    as Megatron-LM counted it up to core_r0.11 (and torchtitan's 12·l·h·q·t does)."""
    expansion, fma = 3, 2  # forward, wgrad, dgrad; a multiply-add is 2 FLOPs
    ffn_expansion = 3 if m.activation == "swiglu" else 2
    query = m.head_dim * m.num_attention_heads
    key = value = m.head_dim * m.query_groups
    self_attn = expansion * fma * (
        m.hidden_size * (query + key + value)
        + query * m.seq_length / (2 if causal_half else 1) * 2  # QK^T and (QK^T)V
        + query * m.hidden_size)
    return (expansion * fma * m.hidden_size * m.ffn_size * ffn_expansion * m.num_layers
            + self_attn * m.num_layers
            + expansion * fma * m.hidden_size * padded_vocab)


@pytest.mark.parametrize("overrides", [[], ["model.num_query_groups=4", "model.activation=swiglu",
                                             "model.ffn_hidden_size=5504"]])
def test_flops_per_token_is_megatron_lms_formula_and_the_doc_says_so(overrides):
    """train_flops_per_token equals Megatron-LM 0.16.1's FLOPs per token (the version
    benchmarks/vs_megatron.py pins) given the same (padded) vocabulary, for the 1B model and a GQA
    + SwiGLU variant of it; docs/metrics.md's figures for the formulas that do not halve the causal
    attention term (Megatron-LM <= 0.11, torchtitan) are those of the same transcription."""
    import os

    from dept_mega.config import load_config
    from tests.trainer_utils import ROOT
    m = load_config(os.path.join(ROOT, "examples", "1b", "spec_opt.yaml"), ["model.vocab_size=50257", *overrides]).model
    assert train_flops_per_token(m, 50304) == pytest.approx(_megatron_flops_per_token(m, 50304), rel=1e-9)
    if overrides:
        return
    assert _megatron_flops_per_token(m, 50304) == pytest.approx(8.46987e9, rel=1e-6)  # 8,469,872,640
    ours = train_flops_per_token(m, 50257)
    full = _megatron_flops_per_token(m, 50257, causal_half=False)
    row = next(line for line in open(os.path.join(ROOT, "docs", "metrics.md"), encoding="utf-8")
               if line.startswith("| `tflops_per_device` |"))
    assert "Megatron-LM since core_v0.12" in row and "core_r0.11" in row, row
    assert f"{full / 1e9:.2f} GFLOP per token against our {ours / 1e9:.2f}" in row, row
    assert f"{100 * (full / ours - 1):.1f} % higher" in row, row
