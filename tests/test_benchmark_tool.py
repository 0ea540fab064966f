"""tools/benchmark.py's bench record on the CPU (docs/metrics.md): where the profiled steps run,
what the record says about the timed steps, and the figures it carries beside tokens/s."""
from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
import yaml

from tests.trainer_utils import ROOT, TINY, merge


def _tool():
    spec = importlib.util.spec_from_file_location("bench_tool", os.path.join(ROOT, "tools", "benchmark.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _config(tmp_path, over: dict | None = None) -> str:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(merge(TINY, over or {})))
    return str(path)


def test_profiled_steps_come_after_the_timed_window(tmp_path, capsys):
    """A profiler session leaves CUPTI attached on CUDA, slowing the steps after it: the benchmark
    traces steps after its timed window, and refuses a train.profile range inside or before it (as
    gpu_check.sh's earlier settings had it: step 3 of a 4-step warm-up), saying where to put it."""
    mod = _tool()
    cfg, out, run = _config(tmp_path), tmp_path / "bench.json", tmp_path / "run"
    base = ["--config", cfg, "--warmup", "4", "--steps", "1", "--out", str(out), f"train.run_dir={run}"]
    assert mod.main(base + ["train.profile.start=2", "train.profile.stop=3"]) == 2
    err = capsys.readouterr().err
    assert "config key 'train.profile': start=2 traces step 3, not after the timed steps (5-5)" in err, err
    assert "train.profile.start=5 train.profile.stop=6" in err and not out.exists()
    assert mod.main(base + ["train.profile.start=5", "train.profile.stop=6"]) == 0
    rec = json.loads(out.read_text())
    assert rec["profiled_steps"] == [6, 6] and rec["timed_steps"] == 1 and rec["step"] == 6
    assert os.listdir(run / "profile") == ["rank0_steps6-6.json"]
    trace = json.loads((run / "profile" / "rank0_steps6-6.json").read_text())
    assert {e["name"] for e in trace["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")} == {
        "ProfilerStep#6"}


def test_timed_steps_that_skip_the_optimizer_make_the_record_invalid(tmp_path, capsys):
    """Every timed step's time, the last loss and the steps that skipped the optimizer are in the
    record; a non-finite loss (here: weights initialised at 1e30) skips it, which makes the step
    faster than a training step, so such a record is marked invalid and the tool exits 1."""
    mod = _tool()
    out = tmp_path / "bench.json"
    args = ["--config", _config(tmp_path), "--warmup", "1", "--steps", "2", "--out", str(out)]
    assert mod.main(args) == 0
    rec = json.loads(out.read_text())
    assert rec["skipped_steps"] == 0 and "invalid" not in rec and rec["last_loss"] > 0
    assert len(rec["step_ms_all"]) == 2 and all(ms > 0 for ms in rec["step_ms_all"])
    assert sum(rec["step_ms_all"]) <= rec["step_ms"] * 2 * 1.001 and rec["graphs_compiled_in_timed_steps"] == 0
    capsys.readouterr()
    assert mod.main(args + ["model.init_method_std=1e30"]) == 1
    rec = json.loads(out.read_text())
    assert rec["skipped_steps"] == 2 and rec["last_loss"] is None  # nan, written as null
    assert rec["invalid"].startswith("2 of 2 timed steps skipped the optimizer (non-finite loss or gradient norm)")
    assert "error: invalid benchmark: 2 of 2 timed steps" in capsys.readouterr().err


def test_the_record_names_the_peak_its_mfu_is_over(tmp_path):
    """MFU is over the dense bf16 peak for every precision (FP8 runs too): the bench record carries
    that peak (null on the CPU) and says so, check_record requires it, and gpu_check's summary heads
    the column with it."""
    from dept_mega.metrics import check_record
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from suite_summary import _bench_lines
    out = tmp_path / "bench.json"
    assert _tool().main(["--config", _config(tmp_path), "--warmup", "0", "--steps", "1", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    check_record(rec)
    assert rec["peak_tflops"] is None and rec["mfu"] is None  # the CPU: no peak known
    assert rec["mfu_basis"] == "dense bf16 peak of the device (for FP8 runs too)"
    with pytest.raises(ValueError, match="peak_tflops"):
        check_record({k: v for k, v in rec.items() if k != "peak_tflops"})
    assert "| run | tokens/s | TFLOP/s/device | MFU (bf16 peak) | peak GB | step ms |" in _bench_lines([rec])


def test_the_record_has_the_peak_reserved_memory(tmp_path):
    """Beside the peak allocated memory (peak_mem_gb) the record has the caching allocator's peak
    reserved memory over the timed steps (peak_reserved_gb: closer to what must fit on the card);
    null on the CPU, which has neither."""
    out = tmp_path / "bench.json"
    assert _tool().main(["--config", _config(tmp_path), "--warmup", "0", "--steps", "1", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert "peak_reserved_gb" in rec and rec["peak_reserved_gb"] is None and rec["peak_mem_gb"] > 0
