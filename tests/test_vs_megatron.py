"""benchmarks/vs_megatron.py on the CPU: the shape translation (the same parameter count as
megatron-core's GPTModel), both sides in the same precision, Megatron's fusions that need neither
apex nor Transformer Engine, and the record it writes (after each side; fp8 refused)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.trainer_utils import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


@pytest.mark.slow
def test_vs_megatron_same_parameters_and_our_side_on_cpu(tmp_path, capsys):
    """megatron-core's GPTModel (built on the CPU) has exactly our parameter count for a model
    with SwiGLU, RMSNorm, GQA and an untied head; our side runs; Megatron's side refuses the CPU."""
    pytest.importorskip("megatron.core")
    out = tmp_path / "vs.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "vs_megatron.py"), "--config",
           os.path.join(ROOT, "examples", "tiny", "std.yaml"), "--vocab", "300", "--steps", "1", "--warmup", "1",
           "--only", "ours", "--check-shapes", "--out", str(out), "model.activation=swiglu",
           "model.normalization=rmsnorm", "model.num_query_groups=2", "model.tie_embeddings=false"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    rec = json.loads(out.read_text())
    assert rec["shape_check"]["equal"] and rec["shape_check"]["ours_params"] == rec["ours"]["params"]
    assert rec["ours"]["tokens_per_s"] > 0 and rec["padded_vocab_size"] == 384
    assert rec["ours_position"] == "rope" and rec["megatron_position"] == "rope" and rec["same_model"]
    assert "megatron" not in rec and "ratio" not in rec
    # the refusal comes before either side is built: main in this process (a second process
    # would add only its start-up, ~4 s with megatron-core's imports)
    import vs_megatron as vm
    megatron_too = [a for a in cmd[2:] if a not in ("--only", "ours", "--check-shapes")]
    capsys.readouterr()
    assert vm.main(megatron_too) == 2 and "RoPE needs CUDA" in capsys.readouterr().err


def test_vs_megatron_runs_megatrons_fusions_that_need_neither_apex_nor_te(tmp_path):
    """Megatron's side turns on megatron-core's fused cross entropy (native), bias-dropout-add and,
    where the model has a bias to fuse (SwiGLU), bias-activation: by default on CUDA only (they are
    torch.compile'd; about 40 s to build on the CPU). The JSON records the setting and each
    side's fusions."""
    pytest.importorskip("megatron.core")
    import vs_megatron as vm
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert vm.fusions_on("auto", cuda) and not vm.fusions_on("auto", cpu) and vm.fusions_on("on", cpu)
    assert not vm.fusions_on("off", cuda)
    argv = ["--config", os.path.join(ROOT, "examples", "tiny", "std.yaml"), "--vocab", "300", "--steps", "1",
            "--warmup", "0", "--position", "config", "--out", str(tmp_path / "vs.json"),
            "model.position_embedding=learned", "model.seq_length=16", "train.micro_batch_size=2"]
    cfg = vm.bench_config(vm.parse_args(argv))
    on = vm.megatron_config(cfg, cpu, fusions=True)
    assert on.cross_entropy_loss_fusion is True and on.cross_entropy_fusion_impl == "native"
    assert on.bias_dropout_fusion is True and on.bias_activation_fusion is False  # GELU, no linear biases
    off = vm.megatron_config(cfg, cpu)  # auto on the CPU
    assert not (off.cross_entropy_loss_fusion or off.bias_dropout_fusion or off.bias_activation_fusion)
    swiglu = vm.bench_config(vm.parse_args(argv + ["model.activation=swiglu"]))
    assert vm.megatron_config(swiglu, cpu, fusions=True).bias_activation_fusion is True
    assert vm.main(argv + ["--only", "ours"]) == 0
    rec = json.loads((tmp_path / "vs.json").read_text())
    assert rec["megatron_fusions"] == {"setting": "auto", "on": False}
    ours, theirs = rec["fusions"]["ours"], rec["fusions"]["megatron"]
    assert ours["cross_entropy"] == "eager" and ours["gradient_accumulation"].startswith("grad_accum_fusion=on")
    assert theirs["cross_entropy"].startswith("unfused") and "apex" in theirs["gradient_accumulation"]
    assert vm.megatron_fusions(cfg, True)["cross_entropy"].startswith("fused (megatron-core's jit_fuser")
    from suite_summary import summary  # gpu_check's summary.md says which (vs.json as vs_megatron.json)
    (tmp_path / "vs.json").rename(tmp_path / "vs_megatron.json")
    assert "; megatron-core's fusions without apex / TE off" in summary(str(tmp_path))


def _floating_outputs(modules, seen: set) -> list:
    """Forward hooks recording (module type, dtype) of every floating tensor a module returns."""
    def hook(mod, inputs, out):
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if torch.is_tensor(t) and t.is_floating_point():
                seen.add((type(mod).__name__, t.dtype))
    return [m.register_forward_hook(hook) for m in modules]


def test_vs_megatron_both_sides_in_the_same_precision_on_cpu():
    """Both sides of benchmarks/vs_megatron.py, one training step each on the CPU (learned
    positions: Megatron's RoPE needs CUDA), in bf16: every parameter of both models is bf16,
    every floating activation of their transformer layers, norms, linears and attention cores
    is bf16 (only the models' loss is fp32); both use the same attention kernel and
    micro-batch."""
    pytest.importorskip("megatron.core")
    import vs_megatron as vm
    from dept_mega.parallel.groups import build_groups
    from dept_mega.trainer import MicroBatch, Trainer

    args = vm.parse_args(["--config", os.path.join(ROOT, "examples", "tiny", "std.yaml"), "--vocab", "300",
                          "--accum", "2", "--position", "config", "--out", "unused", "precision=bf16",
                          "model.position_embedding=learned", "model.seq_length=16", "train.micro_batch_size=2"])
    cfg = vm.bench_config(args)
    assert cfg.model.attention_backend == "sdpa" and cfg.train.global_batch_size == 4
    setup = vm.describe_setup(cfg)
    assert setup["precision"] == "bf16" and setup["micro_batch_size"] == 2 and "scaled_dot_product" in setup["attention"]
    device = torch.device("cpu")
    theirs = vm.build_megatron(cfg, 300, device)
    seen_theirs: set = set()
    _floating_outputs(theirs.decoder.modules(), seen_theirs)
    losses: list = []
    vm.megatron_step(cfg, theirs, 300, device, losses)(0)
    # Megatron's DDP accumulation: fp32 main_grad per weight, the bf16 .grad freed by the hook
    assert setup["grad_accumulation"] == "fp32"
    for p in theirs.parameters():
        assert p.grad is None and p.main_grad.dtype == torch.float32
    assert sum(float(p.main_grad.norm()) for p in theirs.parameters()) > 0
    ours = Trainer(cfg, build_groups(), device, vocab_size=300)
    seen_ours: set = set()
    _floating_outputs([m for st in ours.stages for m in st.modules() if m is not st], seen_ours)
    tokens = vm.synthetic(cfg, 300, 0, device)
    ours.train_step([MicroBatch(x) for x in tokens.split(2)])
    for name, params, seen in (("megatron", theirs.parameters(), seen_theirs),
                               ("ours", ours.parameters(), seen_ours)):
        assert {p.dtype for p in params} == {torch.bfloat16}, name
        kinds = {k for k, _ in seen}
        assert any("Attention" in k for k in kinds) and any("Linear" in k for k in kinds), (name, kinds)
        wrong = {(k, d) for k, d in seen if d != torch.bfloat16 and "Loss" not in k and "GPT" not in k}
        assert not wrong, (name, wrong)
    assert "SDPACoreAttention" in {k for k, _ in seen_theirs}
    assert losses and losses[0] == losses[0]  # a finite step ran


def test_vs_megatron_keeps_a_sides_figures_when_the_other_fails_and_refuses_fp8(tmp_path, monkeypatch, capsys):
    """The JSON is written after each side, so our figures survive Megatron's side failing (run
    second; a side that raised is recorded with its error, exit 1); same_model comes from the two
    models' parameter counts (null when neither side's count is known); fp8, which only our side
    would run, is refused before anything is built."""
    import vs_megatron as vm
    from suite_summary import summary
    out = tmp_path / "vs_megatron.json"
    argv = ["--config", os.path.join(ROOT, "examples", "tiny", "std.yaml"), "--vocab", "300", "--steps", "1",
            "--warmup", "0", "--position", "config", "--out", str(out), "model.position_embedding=learned",
            "model.seq_length=16", "train.micro_batch_size=2"]
    assert vm.main(argv + ["precision=bf16", "fp8=hybrid", "backend=local"]) == 2
    assert "config key 'fp8': 'hybrid' would run our side's GEMMs in FP8 while" in capsys.readouterr().err
    assert not out.exists()

    def megatron_fails(*args, **kwargs):
        assert json.loads(out.read_text())["ours"]["tokens_per_s"] > 0  # written before this side runs
        raise RuntimeError("boom")

    monkeypatch.setattr(vm, "run_megatron", megatron_fails)
    assert vm.main(argv) == 1
    rec = json.loads(out.read_text())
    assert rec["ours"]["tokens_per_s"] > 0 and rec["megatron"] == {"error": "RuntimeError: boom"}
    assert "ratio" not in rec and rec["same_model"] is None
    assert "- megatron failed: RuntimeError: boom" in summary(str(tmp_path))
    # both sides ran, with other parameter counts: not the same model (exit 1)
    monkeypatch.setattr(vm, "run_megatron", lambda *a, **k: {"step_ms_median": 1.0, "peak_mem_gb": None, "params": 1})
    assert vm.main(argv) == 1
    rec = json.loads(out.read_text())
    assert rec["same_model"] is False and rec["ratio"] > 0
