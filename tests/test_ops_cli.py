"""``python -m dept_mega.ops``: reports the custom ops' backend and the run's backends line,
and ``--require`` fails when the compiled kernels are not what runs."""
from __future__ import annotations

import os
import subprocess
import sys

from dept_mega.config import load_config
from dept_mega.model.gpt import describe_backends
from dept_mega.ops import backend, extension_status
from dept_mega.ops.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = os.path.join(ROOT, "examples", "tiny", "std.yaml")


def test_report_and_require(capsys):
    rc = main(["--config", CFG, "model.position_embedding=rope", "--require", "cpp"])
    out = capsys.readouterr().out
    assert f"custom ops: {extension_status().reason}" in out
    assert f"cpu tensors: {backend('cpu')}" in out
    from dept_mega.ops import loader
    for op, label in (("cast_fp8", "FP8 cast operator"), ("layernorm_cast_fp8", "fused LayerNorm + FP8 cast operator"),
                      ("fp8_gemm", "FP8 GEMM operator")):
        here = "yes" if loader.kernel_missing(f"dept_mega::{op}", "cpu") is None else "no"
        assert f"  {label} dept_mega::{op} (" in out and f"): cpu {here}, cuda " in out, out
    want = describe_backends(load_config(CFG, ["model.position_embedding=rope"]), "cpu")
    assert f"backends (cpu): {want}" in out
    assert rc == (0 if backend("cpu") == "cpp" else 1)
    assert main(["--config", CFG, "model.activation=nope"]) == 2
    assert "model.activation" in capsys.readouterr().err


def test_listing_names_each_fp8_operator_apart(capsys, monkeypatch):
    """The fused LayerNorm and GELU-backward cast operators have their own lines (an extension may
    have cast_fp8 without them: built from an older csrc/), and cast_fp8's line says it takes the GELU."""
    from dept_mega.ops import loader

    missing = {("dept_mega::layernorm_cast_fp8", "cpu")}
    monkeypatch.setattr(loader, "kernel_missing", lambda op, device, *a, **k: "absent" if (op, str(device)) in missing
                        or str(device) == "cuda" else None)
    main([])
    out = capsys.readouterr().out
    assert ("  FP8 cast operator dept_mega::cast_fp8 (fp8_casts: cuda; gelu=True: the GELU fused into the cast, "
            "fp8_fused_casts): cpu yes, cuda no\n") in out, out
    assert ("  fused LayerNorm + FP8 cast operator dept_mega::layernorm_cast_fp8 (fp8_casts: cuda with "
            "fp8_fused_casts): cpu no, cuda no\n") in out, out
    assert ("  fused GELU backward + FP8 cast operator dept_mega::dgelu_cast_fp8 (fp8_casts: cuda with "
            "fp8_fused_casts: fc1's output gradient): cpu yes, cuda no\n") in out, out
    assert "  FP8 GEMM operator dept_mega::fp8_gemm (fp8_gemm: cublaslt): cpu yes, cuda no\n" in out, out


def test_require_fails_on_the_fallback():
    env = dict(os.environ, DEPT_MEGA_OPS="torch", PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, "-m", "dept_mega.ops", "--require", "cpp"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "cpu tensors: torch" in res.stdout
    assert "DEPT_MEGA_OPS=torch" in res.stderr


def test_run_log_says_when_the_gpu_takes_the_fallback(monkeypatch):
    """The run log's ``custom ops=`` part (dept_mega.ops.describe): an extension built without
    CUDA kernels (a login node without nvcc) on a GPU run is named with its fix, not silent."""
    from dept_mega.ops import ExtensionStatus, describe, loader

    monkeypatch.setattr(loader, "_STATUS", [ExtensionStatus(True, False, "loaded dept_mega.ops._C (CPU kernels)")])
    gpu = describe("cuda")
    assert gpu.startswith("custom ops=PyTorch fallback on the GPU") and "without CUDA kernels" in gpu
    assert "build/dept_mega_ops_build.log" in gpu and "--require cuda" in gpu
    assert describe("cpu") == "custom ops=C++ kernels"
    monkeypatch.setattr(loader, "_STATUS", [ExtensionStatus(True, True, "loaded dept_mega.ops._C (CPU + CUDA kernels)")])
    assert describe("cuda") == "custom ops=CUDA kernels"
    monkeypatch.setattr(loader, "_STATUS", [ExtensionStatus(False, False, "the extension dept_mega.ops._C is not built")])
    assert describe("cuda") == describe("cpu") == "custom ops=PyTorch fallback (the extension dept_mega.ops._C is not built)"
