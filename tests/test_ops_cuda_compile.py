"""CI has nvcc but no GPU: compile the CUDA kernels for sm_90 (and syntax-check the
torch-facing CUDA operators) so that a CUDA compile error fails the suite, with the C++ standard
the torch in use builds extensions with."""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _nvcc():
    for cand in (os.environ.get("NVCC"), shutil.which("nvcc"),
                 os.path.join(os.environ.get("CUDA_HOME", "/nonexistent"), "bin", "nvcc"),
                 "/usr/local/cuda/bin/nvcc"):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


def _python():
    return os.environ.get("PYTHON", sys.executable)


@pytest.fixture(scope="module")
def compile_check():
    """One run of tools/check_cuda_compile.sh for the tests of this module."""
    # PYTHON: the torch whose headers check ops_cuda.cpp (the script's default, .venv/bin/python
    # else python3, has none in a worktree without its own .venv). cublasLt.h for fp8_gemm_lt.cpp:
    # the script looks in CUBLASLT_INCLUDE, the toolkit and the nvidia packages of PYTHON and
    # CUDA_PYTHON (passed through from the environment).
    env = dict(os.environ, NVCC=_nvcc(), CUDA_ARCH="sm_90", PYTHON=_python())
    env.pop("CXX_STD", None)
    return subprocess.run(["bash", str(ROOT / "tools" / "check_cuda_compile.sh")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found (no CUDA toolkit): the .cu sources "
                                            "cannot be compile-checked on this machine")
def test_cuda_sources_compile_for_sm90(compile_check):
    res = compile_check
    assert res.returncode == 0, f"CUDA compile check failed:\n{res.stdout}\n{res.stderr}"
    assert "check_cuda_compile: OK" in res.stdout
    # every compile with the standard the torch of PYTHON builds extensions with (torch 2.11:
    # c++17; later: c++20), said first
    if _python() == sys.executable:  # this process's torch: asked here (a Python start with torch less)
        spec = importlib.util.spec_from_file_location("torch_cxx_std", ROOT / "tools" / "torch_cxx_std.py")
        tool = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tool)
        std = tool.build_ext_std()
    else:
        std = subprocess.run([_python(), str(ROOT / "tools" / "torch_cxx_std.py")], capture_output=True, text=True,
                             timeout=120).stdout.strip()
    assert re.fullmatch(r"-std=c\+\+\d\d", std), std
    assert f"check_cuda_compile: {std}: what the torch of " in res.stdout, res.stdout
    assert f"nvcc -arch=sm_90 {std} -c " in res.stdout and f"g++ {std} -fsyntax-only csrc/cuda/ops_cuda.cpp" in res.stdout
    assert res.stdout.count("-std=") == res.stdout.count(std), res.stdout


@pytest.mark.slow
@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found (no CUDA toolkit)")
def test_the_cublaslt_gemm_compiles_where_cublaslt_h_is_found(compile_check):
    """csrc/cuda/fp8_gemm_lt.cpp needs cublasLt.h, which a toolkit without cuBLAS lacks (NVIDIA's
    pip wheels have it: point CUDA_PYTHON at the python of a CUDA torch, or CUBLASLT_INCLUDE at
    the folder)."""
    res = compile_check
    if "cublasLt.h not found" in res.stdout:
        pytest.skip("cublasLt.h not found " + res.stdout.split("cublasLt.h not found", 1)[1].splitlines()[0].strip())
    assert res.returncode == 0, f"CUDA compile check failed:\n{res.stdout}\n{res.stderr}"
    assert "-fsyntax-only csrc/cuda/fp8_gemm_lt.cpp" in res.stdout
