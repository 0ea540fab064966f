"""benchmarks/vs_torchao.py on the CPU with a tiny shape: the bf16 arm (no torchao needed), the
skip without torchao, the loss / gradient-norm sanity check failing loudly on a float8 arm that
computes something else, torchao's float8 arms where torchao imports (eager: PyTorch's CPU
``_scaled_mm``), and the device check summary's torchao section."""
from __future__ import annotations

import json
import math
import os
import sys
import types

import pytest
import torch

from tests.trainer_utils import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import vs_torchao as vt  # noqa: E402

LAYERS, HIDDEN, FFN, VOCAB = 2, 64, 256, 1000
TINY = [f"model.num_layers={LAYERS}", f"model.hidden_size={HIDDEN}", "model.num_attention_heads=4",
        "model.num_query_groups=4", f"model.ffn_hidden_size={FFN}", "model.seq_length=32"]


def _run(tmp_path, *args) -> tuple[int, dict]:
    out = tmp_path / "vs.json"
    rc = vt.main(["--config", os.path.join(ROOT, "examples", "1b", "spec_opt.yaml"), "--vocab", str(VOCAB),
                  "--micro-batch", "2", "--accum", "2", "--steps", "1", "--warmup", "1", "--no-compile",
                  "--device", "cpu", "--out", str(out), *args, *TINY])
    return rc, json.loads(out.read_text())


def _params() -> int:
    """The plain GPT's parameters at the tiny shape: padded embedding (tied head), per block two
    bias-free LayerNorms and the four linear layers, the final LayerNorm."""
    per_block = 2 * HIDDEN + HIDDEN * 3 * HIDDEN + HIDDEN * HIDDEN + 2 * HIDDEN * FFN
    return 1024 * HIDDEN + LAYERS * per_block + HIDDEN


def test_bf16_arm_runs_without_torchao(tmp_path):
    rc, rec = _run(tmp_path, "--arms", "bf16")
    assert rc == 0, rec
    arm = rec["arms"]["bf16"]
    assert arm["params"] == _params() and arm["float8_linears"] == 0 and arm["param_dtypes"] == ["torch.bfloat16"]
    assert arm["tokens_per_s"] > 0 and arm["tflops"] is None and arm["mfu"] is None  # CPU: as tools/benchmark.py
    # 2 steps of 2 x 2 sequences of random tokens: near ln(vocab) at initialisation
    assert len(arm["losses"]) == 2 and abs(arm["first_loss"] - math.log(VOCAB)) < 0.1
    assert arm["first_grad_norm"] > 0 and rec["loss_errors"] == [] and rec["ratios"] == {}
    assert rec["tokens_per_step"] == 4 * 32 and rec["model"]["padded_vocab"] == 1024 and not rec["compiled"]
    assert rec["config"]["model"]["num_layers"] == LAYERS and "positions" in rec["model"]
    from dept_mega.metrics import train_flops_per_token
    from dept_mega.config import load_config
    cfg = load_config(os.path.join(ROOT, "examples", "1b", "spec_opt.yaml"), TINY)
    assert rec["flops_per_token"] == train_flops_per_token(cfg.model, VOCAB)


def test_skipped_when_torchao_does_not_import(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao -> ImportError
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    rc, rec = _run(tmp_path)
    assert rc == 0 and rec["skipped"].startswith("torchao is not importable") and "arms" not in rec


def test_unsupported_shapes_and_arms_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        _run(tmp_path, "--arms", "tensorwise,bf16")
    assert "bf16 first" in capsys.readouterr().err
    assert vt.main(["--config", os.path.join(ROOT, "examples", "1b", "spec_opt.yaml"), "--out",
                    str(tmp_path / "x.json"), "model.activation=swiglu"]) == 2
    assert "supports gelu only" in capsys.readouterr().err


def test_sanity_check_fails_loudly_on_a_float8_arm_that_computes_something_else(tmp_path, monkeypatch):
    """A stand-in for torchao whose 'conversion' doubles the first block's fc1 weight: the loss
    check or the gradient-norm check fires, the run exits 1 and the record says why; the same
    stand-in converting nothing passes."""
    def fake(scale):
        def convert(model, config=None):
            with torch.no_grad():
                model.blocks[0].fc1.weight.mul_(scale)
            return model
        return types.SimpleNamespace(convert_to_float8_training=convert,
                                     Float8LinearConfig=types.SimpleNamespace(from_recipe_name=lambda name: None))

    monkeypatch.setattr(vt, "import_torchao", lambda: (fake(1.0), []))
    rc, rec = _run(tmp_path)
    assert rc == 0 and rec["loss_errors"] == [] and rec["ratios"]["float8_tensorwise"] > 0
    monkeypatch.setattr(vt, "import_torchao", lambda: (fake(2.0), []))
    rc, rec = _run(tmp_path)
    assert rc == 1 and any(e.startswith("float8_tensorwise: first-step ") for e in rec["loss_errors"]), rec["loss_errors"]


def test_check_losses():
    base = {"losses": [6.9, 6.8], "first_loss": 6.9, "first_grad_norm": 1.0, "first_grad_norms": {"a": 0.6, "b": 0.8}}
    close = dict(base, first_loss=6.91, first_grad_norms={"a": 0.65, "b": 0.77})
    assert vt.check_losses({"bf16": base, "float8_x": close}, 0.02, 0.1) == []
    errs = vt.check_losses({"bf16": base, "float8_x": dict(base, first_loss=6.95)}, 0.02, 0.1)
    assert len(errs) == 1 and "first-step loss" in errs[0]
    errs = vt.check_losses({"bf16": base, "float8_x": dict(base, first_grad_norms={"a": 0.6, "b": 0.4})}, 0.02, 0.1)
    assert len(errs) == 1 and "norms of 1 parameter(s) differ from bf16's by more than 10%, the most b " in errs[0]
    errs = vt.check_losses({"bf16": base, "float8_x": dict(base, first_grad_norms={"a": 0.6})}, 0.02, 0.1)
    assert errs == ["float8_x: other parameters than bf16's: ['b']"]
    errs = vt.check_losses({"bf16": dict(base, losses=[6.9, float("nan")]), "float8_x": base}, 0.02, 0.1)
    assert errs == ["bf16: loss not finite at step(s) [1]"]
    assert vt.check_losses({"bf16": base, "float8_x": dict(base, first_loss=float("nan"))}, 0.02, 0.1)


def test_torchao_float8_arms_on_cpu(tmp_path):
    """torchao's own conversion (where it imports): every block linear becomes a Float8Linear and
    nothing else (the tied head stays bf16), the same parameters, losses close to bf16's."""
    pytest.importorskip("torchao.float8", reason="torchao is not installed (benchmarks/fetch_device_wheels.sh)")
    rc, rec = _run(tmp_path, "--arms", "bf16,tensorwise")
    assert rc == 0, (rec.get("arms"), rec.get("loss_errors"))
    bf, f8 = rec["arms"]["bf16"], rec["arms"]["float8_tensorwise"]
    assert f8["float8_linears"] == 4 * LAYERS and f8["params"] == bf["params"] == _params()
    assert f8["param_dtypes"] == ["torch.bfloat16"] and rec["torchao_version"]
    assert abs(f8["first_loss"] - bf["first_loss"]) < 0.01 and f8["first_loss"] != bf["first_loss"]
    assert rec["ratios"]["float8_tensorwise"] == pytest.approx(f8["tokens_per_s"] / bf["tokens_per_s"])


def test_summary_shows_the_torchao_section(tmp_path):
    from suite_summary import summary
    arms = {"bf16": {"tokens_per_s": 50000.0, "tflops": 400.0, "mfu": 0.404, "peak_mem_gb": 40.0,
                     "step_ms_median": 650.0, "first_loss": 11.0, "float8_linears": 0, "compiled_graphs": 2},
            "float8_tensorwise": {"tokens_per_s": 62500.0, "tflops": 500.0, "mfu": 0.505, "peak_mem_gb": 38.0,
                                  "step_ms_median": 520.0, "first_loss": 11.001, "float8_linears": 96,
                                  "compiled_graphs": 2}}
    rows = [{"name": "bf16_compile", "tokens_per_s": 55000.0}, {"name": "fp8_compile", "tokens_per_s": 60500.0},
            {"name": "torchao", "kind": "vs_torchao", "torchao_version": "0.17.0", "compiled": True, "arms": arms,
             "ratios": {"float8_tensorwise": 1.25}, "model": {"layers": 24}, "loss_errors": ["x: broken"]}]
    (tmp_path / "bench.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = summary(str(tmp_path))
    assert "## torchao 0.17.0 float8 against bf16 on a plain PyTorch GPT of the same shape (compiled per block)" in text
    assert "| float8_tensorwise | 62,500 | 500.0 | 50.5% | 38.0 | 520 | 11.0010 | 96 | 2 |" in text
    assert "torchao float8_tensorwise: 1.25x its bf16 tokens/s" in text
    assert "ours on the same card: 1.10x (fp8_compile / bf16_compile)" in text
    assert "SANITY CHECK FAILED: x: broken" in text
    assert "| torchao |" not in text  # not a row of the trainer's table
    rows[-1] = {"name": "torchao", "kind": "vs_torchao", "skipped": "torchao is not importable (...)"}
    (tmp_path / "bench.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert "- skipped: torchao is not importable (...)" in summary(str(tmp_path))
