"""``python -m dept_mega.ops``: reports the custom ops' backend and the run's backends line,
and ``--require`` fails when the compiled kernels are not what runs."""
from __future__ import annotations

import os
import subprocess
import sys

from dept_mega.config import load_config
from dept_mega.model.gpt import describe_backends
from dept_mega.ops import backend, extension_status
from dept_mega.ops.__main__ import _fp8_operators, main

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


def _fake_cuda_kernels(monkeypatch, missing_on_cuda: set):
    """The extension as built with CUDA kernels for every operator but those in ``missing_on_cuda``
    (its CPU kernels all there); fp8_gemm.op_unavailable asks the same loader."""
    from dept_mega.ops import loader

    monkeypatch.setattr(loader, "kernel_missing", lambda op, device, *a, **k: f"no kernel of {op} here"
                        if str(device) == "cuda" and op in missing_on_cuda else None)


def test_require_fp8_passes_with_every_fp8_operator(monkeypatch, capsys):
    _fake_cuda_kernels(monkeypatch, set())
    assert main(["--require", "fp8"]) == 0
    assert "error" not in capsys.readouterr().err


def test_require_fp8_names_each_missing_operator_and_what_runs_instead(monkeypatch, capsys):
    """A build with the cast kernels but without cuBLASLt (setup.py builds the GEMM only where
    cuBLASLt's headers are found): --require cuda's gather/scatter check would pass, --require fp8
    fails naming the GEMM operator, why, and the slower path auto takes; the casts are not named."""
    _fake_cuda_kernels(monkeypatch, {"dept_mega::fp8_gemm"})
    assert main(["--require", "fp8"]) == 1
    err = capsys.readouterr().err
    n = len(_fp8_operators())
    assert err.startswith(f"error: --require fp8: 1 of the extension's {n} FP8 operators has no CUDA kernel"), err
    assert ("  dept_mega::fp8_gemm: no kernel of dept_mega::fp8_gemm here; fp8_gemm auto runs torch._scaled_mm "
            "instead (fp8_gemm: cublaslt is refused)\n") in err, err
    assert "cast_fp8" not in err, err
    # an older build without the fused LayerNorm cast: the C++ casts are not taken either
    _fake_cuda_kernels(monkeypatch, {"dept_mega::layernorm_cast_fp8"})
    assert main(["--require", "fp8"]) == 1
    err = capsys.readouterr().err
    assert "  dept_mega::layernorm_cast_fp8: no kernel of dept_mega::layernorm_cast_fp8 here; fp8_casts auto runs " \
        "the Triton casts" in err and "fp8_gemm" not in err, err


def test_require_is_repeatable_and_checks_each(monkeypatch, capsys):
    """--require cpp --require fp8: both checked, each failure said. A build without CUDA kernels
    (the CPU machines') fails fp8 for real, naming every FP8 operator."""
    rc = main(["--require", "cpp", "--require", "fp8"])
    err = capsys.readouterr().err
    assert ("error: --require cpp" in err) == (backend("cpu") != "cpp"), err
    if not extension_status().cuda:
        n = len(_fp8_operators())
        assert rc == 1 and f"{n} of the extension's {n} FP8 operators have no CUDA kernel" in err, err
        for op in ("cast_fp8", "layernorm_cast_fp8", "dgelu_cast_fp8", "fp8_gemm"):
            assert f"  dept_mega::{op}: " in err, err
    _fake_cuda_kernels(monkeypatch, set())
    assert main(["--require", "fp8", "--require", "cpp"]) == (0 if backend("cpu") == "cpp" else 1)


def _fake_gpu(monkeypatch, problem):
    """One visible GPU whose torch.compile fails with ``problem`` (None: works)."""
    import torch

    from dept_mega.model import backends
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    monkeypatch.setattr(backends, "compile_problem", lambda device: problem if device == "cuda" else "not asked")


def test_require_compile_says_why_torch_compile_cannot_run_on_the_gpu(monkeypatch, capsys):
    """--require compile: what a GPU run's first step needs (inductor's Triton kernels: a C
    compiler, Python's headers, writable caches), checked on the node before a big allocation."""
    import torch
    if not torch.cuda.is_available():  # this machine as it is: no GPU to compile for
        assert main(["--require", "compile"]) == 1
        assert "error: --require compile: torch.compile cannot run on CUDA here (no CUDA device is visible)" in \
            capsys.readouterr().err
    why = "RuntimeError: Failed to find C compiler. Please specify via CC environment variable"
    _fake_gpu(monkeypatch, why)
    assert main(["--require", "compile"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: --require compile: torch.compile cannot run on CUDA here ({why}); ") and \
        "a C compiler, Python's headers and writable cache directories" in err, err
    _fake_gpu(monkeypatch, None)
    monkeypatch.setenv("TRITON_CACHE_DIR", "/local/triton")
    assert main(["--require", "compile"]) == 0
    captured = capsys.readouterr()
    assert "torch.compile on cuda: works (" in captured.out and "TRITON_CACHE_DIR=/local/triton)" in captured.out
    assert "error" not in captured.err, captured.err


def _fallback_lines(rank, world_size):
    """This rank's log lines about the fallback, from a fresh custom-ops status."""
    import logging

    from dept_mega.ops import loader
    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                lines.append(record.getMessage())

    handler = Keep()
    loader.logger.addHandler(handler)
    try:
        loader._STATUS.clear()
        loader.status()
    finally:
        loader.logger.removeHandler(handler)
    return lines


def test_the_fallback_is_said_once_per_job(monkeypatch):
    """Without the extension every rank takes the fallback, but only global rank 0 says so (as
    the backends: line, which repeats it): a 2-rank job prints the line once. A process outside
    torchrun (a tool, one process) says it too."""
    from tests.mp_utils import run_distributed
    monkeypatch.setenv("DEPT_MEGA_OPS", "torch")
    lines = run_distributed(_fallback_lines, world_size=2, timeout=120)
    assert lines[0] == ["dept_mega.ops: using the PyTorch fallback: DEPT_MEGA_OPS=torch forces the PyTorch fallback"]
    assert lines[1] == []
    from dept_mega.ops import loader
    monkeypatch.setattr(loader, "_STATUS", [])
    monkeypatch.delenv("RANK", raising=False)
    assert _fallback_lines(0, 1) == lines[0]
