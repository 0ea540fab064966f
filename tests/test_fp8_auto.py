"""The native FP8 paths' defaults: ``fp8_casts: auto``, ``fp8_gemm: auto`` and ``fp8_fused_casts:
null`` pick the fastest path measured (H200, docs/performance.md) where it can run, and say in
the run log why where they do not.

Resolution only: a CUDA device is planned for on this CPU machine (``resolve_backends(cfg,
"cuda")``, as tests/test_attention.py does), with the operators' and Triton's availability and
the GPU's compute capability stood in for.
"""
from __future__ import annotations

import pytest
import torch

from dept_mega.config import ConfigError, te_fp8_conflict
from dept_mega.model import backends as backends_module
from dept_mega.model import resolve_backends
from dept_mega.model.backends import GEMMS, BackendError
from dept_mega.model.fused_casts import AUTO, fused_cast_gemms, unfused_cast_reasons
from dept_mega.parallel import fp8_casts, fp8_gemm, fp8_kernels
from tests.trainer_utils import merge, tiny_config

FP8 = {"precision": "bf16", "fp8": "hybrid"}
TRITON_GELU = "auto: the Triton GELU cast is slower than the GELU then the cast (0.64x, H200)"
TORCH = "auto: the torch casts have no fused kernel"
NOT_GPU = "auto: not on a GPU (auto fuses for the fused kernels' GPU speed)"
CURRENT_LN = "auto: under current scaling the LayerNorm has no fused kernel (normalised, then cast)"
CURRENT_DGELU = "current scaling: the dGELU's fused cast needs a delayed scale"
TRITON_DGELU = "the Triton casts have no fused dGELU cast"


@pytest.fixture
def cuda_here(monkeypatch):
    """A machine whose GPU runs FP8 GEMMs (compute capability 9.0); ``set(op=..., gemm_op=...,
    triton=...)``: whether the C++ cast operators, the GEMM operator and Triton are available."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    # the log's word on the Triton launch (its kernel object exists only where Triton imports)
    monkeypatch.setattr(fp8_kernels, "_cast_kernel", None, raising=False)
    monkeypatch.setattr(backends_module.triton_launch, "describe", lambda kernel: "launched directly")

    class Here:
        @staticmethod
        def set(op: bool = True, gemm_op: bool = True, triton: bool = True) -> None:
            monkeypatch.setattr(fp8_casts, "op_unavailable", lambda device: None if op else "no cast kernel")
            monkeypatch.setattr(fp8_gemm, "op_unavailable", lambda device: None if gemm_op else "no GEMM kernel")
            monkeypatch.setattr(fp8_kernels, "AVAILABLE", triton)
    Here.set()
    return Here


@pytest.mark.parametrize("device,op,triton,cols,want,why", [
    ("cuda", True, True, 0, "cuda", None),
    ("cuda", True, False, 0, "cuda", None),
    ("cuda", False, True, 0, "triton", "the C++ cast operator cannot run: no cast kernel"),
    ("cuda", False, False, 0, "torch", "the C++ cast operator cannot run: no cast kernel; Triton is not installed"),
    ("cuda", True, True, fp8_casts.MAX_CUDA_COLS, "cuda", None),
    ("cuda", True, True, fp8_casts.MAX_CUDA_COLS + 16, "triton", "columns is wider than its CUDA kernel's"),
    ("cpu", True, True, 0, "torch", None),
    ("cpu", False, False, 0, "torch", None)])
def test_auto_casts(cuda_here, device, op, triton, cols, want, why):
    """``fp8_casts: auto``: on CUDA the C++ operator where it runs (and takes the widest cast),
    else Triton, else torch, with the reason; on the CPU torch."""
    cuda_here.set(op=op, triton=triton)
    got, reason = fp8_casts.auto_cast_kernels(device, cols)
    assert got == want and (reason is None) == (why is None), (got, reason)
    assert why is None or why in reason, reason
    assert fp8_casts.resolve_cast_kernels("auto", device, cols) == want
    assert fp8_casts.default_cast_kernels(device) == fp8_casts.auto_cast_kernels(device)[0]


def test_explicit_cuda_casts_refuse_a_cast_wider_than_the_kernel(cuda_here):
    """An explicit ``cuda`` that would fail at the first cast is refused when the backends are
    resolved, naming the key; auto takes Triton for that model instead, and says why."""
    cols = fp8_casts.MAX_CUDA_COLS + 16
    with pytest.raises(ValueError, match=f"a cast of {cols} columns is wider than the CUDA kernel's"):
        fp8_casts.resolve_cast_kernels("cuda", "cuda", cols)
    assert fp8_casts.resolve_cast_kernels("cuda", "cuda", fp8_casts.MAX_CUDA_COLS) == "cuda"
    wide = {**FP8, "model": {"ffn_hidden_size": cols}}  # fc1's output: the gradient cast's columns
    with pytest.raises(BackendError, match="config key 'fp8_casts': FP8 cast kernels 'cuda': a cast of"):
        resolve_backends(tiny_config({**wide, "fp8_casts": "cuda"}), "cuda")
    b = resolve_backends(tiny_config(wide), "cuda")
    assert b.fp8_casts == "triton" and f"fp8_casts auto: triton (the C++ cast operator cannot run: a cast of {cols} " \
        "columns" in b.describe(), b.describe()
    assert resolve_backends(tiny_config(FP8), "cuda").fp8_casts == "cuda"


@pytest.mark.parametrize("device,op,compile_,fusion,grads,want,why", [
    ("cuda", True, False, True, "fp32", "cublaslt", None),
    ("cuda", False, False, True, "fp32", "torch", "no GEMM kernel"),
    ("cuda", True, True, True, "fp32", "torch", "train.compile traces the FP8 GEMMs"),
    ("cuda", True, False, False, "fp32", "torch", "optim.grad_accum_fusion is off"),
    ("cuda", True, False, True, "bf16", "torch", "optim.grad_dtype bf16"),
    ("cpu", True, False, True, "fp32", "torch", None)])
def test_auto_gemm(cuda_here, device, op, compile_, fusion, grads, want, why):
    """``fp8_gemm: auto``: cuBLASLt on CUDA where the operator runs, eagerly, with the gradient
    accumulation fusion on and an fp32 gradient buffer; otherwise torch, with the reason."""
    cuda_here.set(gemm_op=op)
    got, reason = fp8_gemm.auto_gemm(device, compile_, fusion, grads)
    assert got == want and (reason is None) == (why is None) and (why is None or why in reason), (got, reason)
    assert fp8_gemm.resolve_gemm("auto", device, compile_, fusion, grads) == want


@pytest.mark.parametrize("over,fusion,grads,want", [
    ({}, True, "fp32", "cublaslt"),
    ({"optim": {"grad_accum_fusion": False}}, False, "fp32", "torch"),
    ({"optim": {"grad_dtype": "bf16"}}, True, "bf16", "torch"),
    ({"train": {"compile": True}}, True, "fp32", "torch")])
def test_backends_pass_the_run_to_auto_gemm(cuda_here, over, fusion, grads, want):
    """resolve_backends hands auto the run's train.compile, grad_accum_fusion and grad_dtype, and
    the log's notes say why auto did not take cuBLASLt."""
    b = resolve_backends(tiny_config(merge(FP8, over)), "cuda")
    assert b.fp8_gemm == want
    line = b.describe()
    assert ("fp8_gemm auto: torch._scaled_mm (cuBLASLt: " in line) == (want == "torch"), line
    assert ("cuBLASLt operator dept_mega::fp8_gemm" in line) == (want == "cublaslt"), line


def test_the_defaults_on_cuda_are_the_fast_path(cuda_here):
    """Every operator available: the C++ casts, the cuBLASLt GEMM and every C++ fused cast (the
    LayerNorm before QKV and fc1, the GELU before fc2, the GELU backward into fc1's output
    gradient: each measured faster than its unfused pair), no note of a fallback; on the CPU the
    torch casts and torch._scaled_mm, nothing fused."""
    b = resolve_backends(tiny_config(FP8), "cuda")
    assert (b.fp8_casts, b.fp8_gemm, b.fp8_fused_casts) == ("cuda", "cublaslt", ("qkv", "fc1", "fc2", "dgelu"))
    line = b.describe()
    assert "fused casts (fp8_fused_casts: null = auto) [qkv (layernorm, one kernel" in line, line
    assert "fc2 (gelu, one kernel), dgelu (fc1's output gradient, one kernel" in line and "not fused" not in line, line
    assert "fp8_casts auto" not in line and "fp8_gemm auto" not in line, line
    cpu = resolve_backends(tiny_config(FP8), "cpu")
    assert (cpu.fp8_casts, cpu.fp8_gemm, cpu.fp8_fused_casts) == ("torch", "torch", ())


@pytest.mark.parametrize("casts,scaling,compile_,fused,reasons", [
    ("cuda", "delayed", False, ("qkv", "fc1", "fc2", "dgelu"), ()),
    ("cuda", "current", False, ("fc2",), (f"qkv, fc1 ({CURRENT_LN})", f"dgelu ({CURRENT_DGELU})")),
    ("triton", "delayed", False, ("qkv", "fc1"), (f"fc2 ({TRITON_GELU})", f"dgelu ({TRITON_DGELU})")),
    ("triton", "current", False, (), (f"qkv, fc1 ({CURRENT_LN})", f"fc2 ({TRITON_GELU})", f"dgelu ({TRITON_DGELU})")),
    ("torch", "delayed", False, (), (f"qkv, fc1, fc2, dgelu ({TORCH})",)),
    ("cuda", "delayed", True, (), ("qkv, fc1, fc2, dgelu (auto: train.compile traces the norms, GELUs and casts "
                                   "into the compiled blocks)",)),
    ("cuda", "delayed", "cpu", (), (f"qkv, fc1, fc2, dgelu ({NOT_GPU})",)),
    ("triton", "delayed", "cpu", (), (f"qkv, fc1, fc2, dgelu ({NOT_GPU})",))])
def test_auto_fused_casts_table(casts, scaling, compile_, fused, reasons):
    """``fp8_fused_casts: null``: per cast path the producers whose fused kernel was measured
    faster (the AUTO table), each other FP8 linear with its reason; true fuses every one that
    can, false none, whatever the path (true's dgelu: not with the Triton casts, nor under
    current scaling)."""
    m = tiny_config(FP8).model
    how = dict(casts=casts, scaling=scaling, compile=compile_ is True, gpu=compile_ != "cpu")
    assert fused_cast_gemms(m, 1, GEMMS, None, **how) == fused
    assert unfused_cast_reasons(m, 1, GEMMS, None, **how) == reasons
    dgelu = TRITON_DGELU if casts == "triton" else CURRENT_DGELU if scaling == "current" else None
    assert fused_cast_gemms(m, 1, GEMMS, True, **how) == ("qkv", "fc1", "fc2") + (() if dgelu else ("dgelu",))
    assert unfused_cast_reasons(m, 1, GEMMS, True, **how) == ((f"dgelu ({dgelu})",) if dgelu else ())
    assert fused_cast_gemms(m, 1, GEMMS, False, **how) == () == unfused_cast_reasons(m, 1, GEMMS, False, **how)


def test_auto_fused_casts_keep_the_structural_reasons():
    """What cannot fuse (RMSNorm, SwiGLU, a collective before QKV / fc1) is said as before, and
    auto's reasons apply to the rest only."""
    m = tiny_config(merge(FP8, {"model": {"normalization": "rmsnorm"}})).model
    assert fused_cast_gemms(m, 1, GEMMS, None, "cuda") == ("fc2", "dgelu")
    assert unfused_cast_reasons(m, 1, GEMMS, None, "cuda") == ("qkv, fc1 (rmsnorm has no fused cast)",)
    m = tiny_config(FP8).model
    assert unfused_cast_reasons(m, 2, GEMMS, None, "triton") == (
        "qkv, fc1 (parallel.tensor 2: a collective sits between the norm and the GEMM)", f"fc2 ({TRITON_GELU})",
        f"dgelu ({TRITON_DGELU})")
    assert set(AUTO) == set(fp8_casts.CAST_KERNELS[1:])  # one entry per path auto may resolve to


def test_auto_fuses_nothing_off_a_gpu():
    """On the CPU auto keeps every cast apart, whichever casts are named (a fused cast may round
    one element a step apart: fusing is a GPU speed choice); true still fuses there."""
    for casts in ("cuda", "torch"):
        b = resolve_backends(tiny_config({**FP8, "fp8_casts": casts}), "cpu")
        assert b.fp8_fused_casts == (), casts
        assert f"not fused: qkv, fc1, fc2, dgelu ({NOT_GPU})" in b.describe()
    on = resolve_backends(tiny_config({**FP8, "fp8_casts": "cuda", "fp8_fused_casts": True}), "cpu")
    assert on.fp8_fused_casts == ("qkv", "fc1", "fc2", "dgelu")


@pytest.mark.parametrize("casts,fused", [("cuda", ("qkv", "fc1", "fc2", "dgelu")), ("triton", ("qkv", "fc1")),
                                         ("torch", ())])
def test_backends_fuse_per_the_table(cuda_here, casts, fused):
    """The backends take the table's choice for the run's casts (explicit here) and the layers get
    it (Backends.gemms)."""
    b = resolve_backends(tiny_config({**FP8, "fp8_casts": casts}), "cuda")
    assert b.fp8_fused_casts == fused and b.fused_casts == "auto"
    line = b.describe()
    assert "fused casts (fp8_fused_casts: null = auto) [" in line, line
    assert ("not fused: " in line) == (casts != "cuda"), line
    on = resolve_backends(tiny_config({**FP8, "fp8_casts": casts, "fp8_fused_casts": True}), "cuda")
    assert on.fp8_fused_casts == ("qkv", "fc1", "fc2") + (() if casts == "triton" else ("dgelu",))
    assert "fused casts (fp8_fused_casts) [qkv" in on.describe()
    off = resolve_backends(tiny_config({**FP8, "fp8_casts": casts, "fp8_fused_casts": False}), "cuda")
    assert off.fp8_fused_casts == () and "fused casts" not in off.describe()


def test_auto_is_never_refused(cuda_here, monkeypatch):
    """train.compile and Transformer Engine refuse the explicit settings, never the defaults:
    under compile auto takes torch._scaled_mm and fuses nothing (said); with Transformer
    Engine the native keys' defaults do not conflict."""
    compiled = tiny_config({**FP8, "train": {"compile": True}})
    b = resolve_backends(compiled, "cuda")
    assert b.fp8_gemm == "torch" and b.fp8_fused_casts == ()
    with pytest.raises(ConfigError, match="'fp8_gemm': cublaslt runs in the eager FP8 linears"):
        tiny_config({**FP8, "fp8_gemm": "cublaslt", "train": {"compile": True}})
    with pytest.raises(ConfigError, match="'fp8_fused_casts': the fused casts run in the eager FP8 linears"):
        tiny_config({**FP8, "fp8_fused_casts": True, "train": {"compile": True}})
    assert te_fp8_conflict(tiny_config(FP8)) is None
    assert "fp8_gemm" in te_fp8_conflict(tiny_config({**FP8, "fp8_gemm": "cublaslt"}))
    assert "fp8_fused_casts" in te_fp8_conflict(tiny_config({**FP8, "fp8_fused_casts": True}))
    monkeypatch.setattr(backends_module, "_resolve_linear", lambda cfg, device: ("transformer_engine", []))
    te = resolve_backends(tiny_config({**FP8, "backend": "auto"}), "cuda")
    assert te.linear == "transformer_engine" and te.fp8_fused_casts == () and "fused casts" not in te.describe()
    # without fp8 the null default is nothing, where true is an error
    assert tiny_config().fp8_fused_casts is None
    with pytest.raises(ConfigError, match="'fp8_fused_casts': true fuses casts into the native FP8 linears"):
        tiny_config({"fp8_fused_casts": True})
