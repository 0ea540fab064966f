"""The FP8 GEMM operator ``dept_mega::fp8_gemm`` (``parallel/fp8_gemm.py``; kernels in
``csrc/cpu/ops_cpu.cpp`` and ``csrc/cuda/fp8_gemm_lt.cpp``, checks in ``csrc/fp8_gemm.h``) and
``fp8_gemm: cublaslt``.

On the CPU: the bf16 output equals ``torch._scaled_mm``'s bytes (every format pair, fast
accumulation on and off, leading dimensions wider than the matrix); accumulation adds the fp32
product to ``out`` exactly (``first`` overwrites; a bf16 ``out`` is rounded once); each
argument error is named, the same by the Python checks and the operator. In the FP8 linear the
weight gradient of a training step is accumulated into ``main_grad`` by the GEMM, closer to the
exact product of the FP8 operands than the ``torch`` path's bf16 dW + add; a ``main_grad`` the
GEMM cannot write falls back to that path. A training run trains as the ``torch`` path does
within bf16 rounding. The ``gpu`` test compares the cuBLASLt kernel with ``torch._scaled_mm`` at
training shapes (UNVERIFIED until run on a GPU)."""
from __future__ import annotations

import re
from itertools import product

import pytest
import torch

from dept_mega.grad_buffer import GradBuffer, GradSync
from dept_mega.parallel import fp8 as fp8_module
from dept_mega.parallel import fp8_gemm
from dept_mega.parallel.fp8 import E4M3, E5M2, Fp8Recipe, Fp8State, _cast_math, fp8_linear
from dept_mega.parallel.groups import build_groups
from tests.trainer_utils import gpu_test_device, tiny_config, train_losses

_WHY = fp8_gemm.op_unavailable("cpu")
needs_op = pytest.mark.skipif(_WHY is not None, reason=f"dept_mega::fp8_gemm unavailable: {_WHY}")
PAIRS = [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)]


def _operands(m, k, n, da, db, g, device="cpu", lda=None, ldb=None):
    """FP8 ``a`` [m, k] row-major (leading dimension ``lda``) and ``b`` [k, n] column-major
    (leading dimension ``ldb``), values spread over the formats' ranges, and two scales; drawn on
    ``g``'s device (a CUDA generator for the training shapes: ~10^9 draws on the host would take
    seconds of the device check), then moved to ``device``."""
    lda, ldb = lda or k, ldb or k
    on = g.device
    a = (torch.randn(m, lda, generator=g, device=on) * 40).clamp(-440, 440).to(da)[:, :k]
    b = (torch.randn(n, ldb, generator=g, device=on) * 40).clamp(-440, 440).to(db)[:, :k].t()
    sa = 0.37 * torch.rand((), generator=g, device=on)
    sb = torch.tensor(1.0 / 448.0, dtype=torch.float32, device=on)
    return a.to(device), b.to(device), sa.to(device), sb.to(device)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _ref_fp32(a, b, sa, sb, fast=False):
    """``torch._scaled_mm`` with an fp32 output (oneDNN off on the CPU, as fp8._scaled_mm runs it)."""
    was = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.float32, use_fast_accum=fast)
    finally:
        torch._C._set_mkldnn_enabled(was)


@needs_op
@pytest.mark.parametrize("pair,fast", list(product(PAIRS, [False, True])))
def test_bf16_output_is_scaled_mm_bytes(pair, fast):
    g = torch.Generator().manual_seed(1)
    for m, k, n, lda, ldb in [(16, 16, 16, None, None), (48, 64, 32, None, None), (32, 16, 48, 48, 32),
                              (64, 160, 96, None, None)]:
        a, b, sa, sb = _operands(m, k, n, *pair, g, lda=lda, ldb=ldb)
        got = fp8_gemm.fp8_gemm(a, b, sa, sb, fast)
        want = fp8_module._scaled_mm(a, b, sa, sb, fast)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n) and got.is_contiguous()
        assert torch.equal(_bits(got), _bits(want)), (pair, m, k, n)
        assert got.abs().sum() > 0


@needs_op
@pytest.mark.parametrize("pair", PAIRS)
def test_accumulation_adds_the_fp32_product_exactly(pair):
    g = torch.Generator().manual_seed(2)
    a, b, sa, sb = _operands(32, 64, 48, *pair, g)
    prod = _ref_fp32(a, b, sa, sb)
    out0 = torch.randn(32, 48, generator=g)
    out = out0.clone()
    assert fp8_gemm.fp8_gemm(a, b, sa, sb, out=out) is None
    assert torch.equal(out, out0 + prod)
    assert fp8_gemm.fp8_gemm(a, b, sa, sb, out=out) is None  # again: a second micro-batch
    assert torch.equal(out, (out0 + prod) + prod)
    out.fill_(float("nan"))  # first=True overwrites: what was there does not matter
    fp8_gemm.fp8_gemm(a, b, sa, sb, out=out, first=True)
    assert torch.equal(out, prod)
    half0 = torch.randn(32, 48, generator=g).bfloat16()
    half = half0.clone()
    fp8_gemm.fp8_gemm(a, b, sa, sb, out=half)
    assert torch.equal(_bits(half), _bits((half0.float() + prod).bfloat16()))  # one rounding
    fp8_gemm.fp8_gemm(a, b, sa, sb, out=half, first=True)
    assert torch.equal(_bits(half), _bits(prod.bfloat16()))


@needs_op
def test_argument_errors_are_named():
    g = torch.Generator().manual_seed(3)
    a, b, sa, sb = _operands(32, 64, 48, E4M3, E4M3, g)
    out = torch.zeros(32, 48)
    big = torch.zeros(32 * 48 + 4)
    vec = torch.ones(8)
    bad = [
        ((a[0], b, sa, sb, None, False), ValueError, r"a and b must be 2-D, got shapes \[64\] and \[64, 48\]"),
        ((a.float(), b, sa, sb, None, False), TypeError, "a and b must be float8_e4m3fn or float8_e5m2, got float32"),
        ((a.to(E5M2), b.to(E5M2), sa, sb, None, False), TypeError, "float8_e5m2 x float8_e5m2 has no FP8 GEMM"),
        ((a, b[:32], sa, sb, None, False), ValueError, r"a \[32, 64\] and b \[32, 48\] cannot be multiplied"),
        ((a[:24], b, sa, sb, None, False), ValueError, "m, k, n must be multiples of 16, got 24, 64, 48"),
        ((a.t().contiguous().t(), b, sa, sb, None, False), ValueError, r"a must be row-major .* got strides \[1, 32\]"),
        ((a, b.contiguous(), sa, sb, None, False), ValueError, r"b must be column-major .* got strides \[48, 1\]"),
        ((a, b, sa.double(), sb, None, False), TypeError, "scale_a must be float32, got float64"),
        ((a, b, sa, vec[:2], None, False), ValueError, r"scale_b must have one element .* got shape \[2\]"),
        ((a, b, sa, sb, None, True), ValueError, "first=True .* needs an out tensor"),
        ((a, b, sa, sb, out.half(), False), TypeError, "out must be float32 or bfloat16, got float16"),
        ((a, b, sa, sb, out[:16], False), ValueError, r"out must have shape \[32, 48\], got \[16, 48\]"),
        ((a, b, sa, sb, torch.zeros(48, 32).t(), False), ValueError, "out must be contiguous"),
        ((a, b, sa, sb, big[1:1 + 32 * 48].view(32, 48), False), ValueError, "out is not 16-byte aligned"),
        ((a, b, vec[1], sb, None, False), ValueError, "scale_a is not 16-byte aligned"),
        ((torch.cat([a.reshape(-1), a.reshape(-1)])[8:8 + 32 * 64].view(32, 64), b, sa, sb, None, False), ValueError,
         "a is not 16-byte aligned"),
    ]
    for (ta, tb, tsa, tsb, tout, first), exc, msg in bad:
        with pytest.raises(exc, match=msg):
            fp8_gemm.check_args(ta, tb, tsa, tsb, tout, first)
        with pytest.raises(exc, match=msg):  # the operator itself (its C++ checks), the same message
            fp8_gemm.op()(ta, tb, tsa, tsb, False, tout, first)
    with pytest.raises(ValueError, match=re.escape("'cuda' is not one of auto | torch | cublaslt")):
        fp8_gemm.resolve_gemm("cuda", "cpu")


def _train_layer(gemm: str, main_grad_offset: int = 0):
    """One training step of three micro-batches through one FP8 linear (current scaling, bf16
    weight [96, 64], fp32 gradient buffer), then one call outside a step. ``main_grad_offset``:
    a parameter of that many elements before the weight in the buffer (an odd count puts the
    weight's main_grad off 16-byte alignment). Returns the weight's ``main_grad``, the exact
    accumulated product of the FP8 operands (float64), the input gradients, the gradient
    outside the step and how often the operator ran."""
    g = torch.Generator().manual_seed(11)
    state = Fp8State(Fp8Recipe("hybrid", "current"), "cpu", kernels="torch", gemm=gemm)
    layer = state.new_layer()
    w = torch.nn.Parameter((torch.randn(96, 64, generator=g) * 0.1).bfloat16())
    params = [w] + ([torch.nn.Parameter(torch.zeros(main_grad_offset))] if main_grad_offset else [])
    buf = GradBuffer(params, torch.float32, torch.device("cpu"), bucket_size=1 << 20)  # laid out in reverse
    buf.adopt()
    sync = GradSync(build_groups(), overlap=False)
    sync.begin([buf], {id(p): 3 for p in params})
    w.main_grad.fill_(float("nan"))  # the first micro-batch overwrites (beta = 0), so this must vanish
    exact = torch.zeros(96, 64, dtype=torch.float64)
    x_grads = []
    state.begin_step()
    for _ in range(3):
        x = torch.randn(40, 64, generator=g).bfloat16().requires_grad_()
        gy = torch.randn(40, 96, generator=g).bfloat16()
        fp8_linear(x, w, layer).backward(gy)
        x_grads.append(x.grad)
        # the FP8 operands of this micro-batch's weight-gradient GEMM (the same casts: current scaling)
        _, xq_t, x_inv, _ = _cast_math(x.detach(), None, E4M3, 8, False, True)
        _, gq_t, g_inv, _ = _cast_math(gy, None, E5M2, 8, False, True)
        exact += (gq_t.double() @ xq_t.double().t()) * (g_inv.double() * x_inv.double())
    state.end_step()
    assert buf.counts[id(w)] == 3 and w.grad is None
    sync.finish()
    main_grad = w.main_grad.clone()
    x = torch.randn(32, 64, generator=g).bfloat16()
    fp8_linear(x, w, layer).sum().backward()  # no step open: plain autograd, a bf16 dW
    return main_grad, exact, x_grads, w.grad


@needs_op
def test_weight_gradient_accumulates_in_fp32_inside_the_gemm(monkeypatch):
    calls = []
    real = fp8_gemm.op

    def counting():
        op = real()
        return lambda *a: calls.append(len(a) > 5 and a[5] is not None) or op(*a)

    monkeypatch.setattr(fp8_gemm, "op", counting)
    lt, exact, lt_dx, lt_outside = _train_layer("cublaslt")
    # per micro-batch: forward, dX (bf16 outputs) and dW into main_grad; outside the step the forward
    # and a bf16 dW (the input needs no gradient there)
    assert calls == [False, False, True] * 3 + [False, False]
    monkeypatch.setattr(fp8_gemm, "op", real)
    ref, exact_ref, ref_dx, ref_outside = _train_layer("torch")
    assert torch.equal(exact, exact_ref)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(lt_dx, ref_dx))  # the same bf16 GEMMs
    assert torch.equal(_bits(lt_outside), _bits(ref_outside))
    assert torch.isfinite(lt).all() and lt.abs().sum() > 0
    err_lt = (lt.double() - exact).abs().max().item()
    err_ref = (ref.double() - exact).abs().max().item()
    # cublaslt: fp32 products summed in fp32 (one GEMM's rounding per micro-batch, then two adds);
    # torch: each micro-batch's product rounded to bf16 (relative 2^-9) before the fp32 adds
    scale = exact.abs().max().item()
    assert err_lt <= 2.0 ** -20 * scale, (err_lt, scale)
    assert err_lt < err_ref and err_ref > 2.0 ** -12 * scale, (err_lt, err_ref, scale)


@needs_op
def test_a_main_grad_the_gemm_cannot_write_takes_the_bf16_path():
    """A 3-element parameter before the weight puts its main_grad 12 bytes off 16-byte alignment:
    cuBLASLt would reject it, so the weight gradient goes through a bf16 dW and the add (the
    ``torch`` path's numbers exactly), with a warning."""
    with pytest.warns(UserWarning, match="main_grad that is float32, contiguous, at an address 12 bytes past"):
        lt = _train_layer("cublaslt", main_grad_offset=3)[0]
    ref = _train_layer("torch", main_grad_offset=3)[0]
    assert torch.equal(lt, ref)


@needs_op
def test_fp8_gemm_cublaslt_trains_as_torch_within_bf16_rounding():
    """Three steps, four micro-batches each. The first step's forward is the same bytes (the same
    loss); its weight gradients differ by the torch path's bf16 rounding of dW (relative 2^-9 per
    element, summed into fp32), so its gradient norm is held to 2^-8 relative (twice bf16's unit
    roundoff) and must differ (the paths are not the same). The later losses and the evaluation
    are held to 2^-8 relative too (the losses come from bf16 activations, resolved to about 2^-8).
    Not the later gradient norms: Adam's first updates are about lr·sign(g), so an element whose
    gradient is near zero may move by up to 2·lr differently, which changes the next gradients
    more than the losses (observed: 2% on the third step's norm, 5e-4 on its loss)."""
    from dept_mega.model import resolve_backends
    over = {"precision": "bf16", "fp8": "hybrid", "optim": {"lr": 1.0e-2}}
    cfg = tiny_config({**over, "fp8_gemm": "cublaslt"})
    line = resolve_backends(cfg, "cpu").describe()
    assert "cuBLASLt operator dept_mega::fp8_gemm" in line and "fp8 GEMMs accumulating in fp32 themselves" in line
    got = train_losses(cfg, 3)
    ref = train_losses(tiny_config({**over, "fp8_gemm": "torch"}), 3)
    assert got["loss"][0] == ref["loss"][0]
    a, b = got["grad_norm"][0], ref["grad_norm"][0]
    assert a != b and abs(a - b) <= 2.0 ** -8 * b, (got["grad_norm"], ref["grad_norm"])
    for a, b in zip(got["loss"] + got["eval"], ref["loss"] + ref["eval"]):
        assert abs(a - b) <= 2.0 ** -8 * abs(b), (got, ref)


def test_backends_refuse_what_cublaslt_cannot_run():
    from dept_mega.config import ConfigError
    from dept_mega.model import resolve_backends
    from dept_mega.model.backends import BackendError
    over = {"precision": "bf16", "fp8": "hybrid", "fp8_gemm": "cublaslt"}
    # refused with the config (so --check and the launchers' pre-flight report it)
    with pytest.raises(ConfigError, match="'fp8_gemm': cublaslt runs in the eager FP8 linears"):
        tiny_config({**over, "train": {"compile": True}})
    assert "torch._scaled_mm" in resolve_backends(tiny_config({**over, "fp8_gemm": "torch"}), "cpu").describe()
    if _WHY is not None:
        with pytest.raises(BackendError, match="config key 'fp8_gemm'"):
            resolve_backends(tiny_config(over), "cpu")


def _bound(a, b, sa, sb, k):
    """fp32 summation in another order: at most 2·k·2^-24 of Σ|a_i b_i| (scaled) apart."""
    mag = (a.float().abs() @ b.float().abs()) * (sa * sb)
    return 2 * k * 2.0 ** -24 * mag


@pytest.mark.gpu
def test_cuda_operator_matches_scaled_mm_on_training_shapes():
    """cuBLASLt through the operator against ``torch._scaled_mm`` on the 1B model's GEMM shapes
    (8192 tokens; hidden 2048, fc1 8192, qkv 6144): bf16 outputs within one bf16 ulp plus the fp32
    summation-order bound; accumulation into fp32 within that bound of out + ``_scaled_mm``'s fp32
    product; first=True overwrites; a second call (the cached algorithm) gives the same bytes.
    Without a GPU (DEPT_MEGA_GPU_TESTS_ON_CPU=1) it rehearses on small shapes with the CPU kernel."""
    device = gpu_test_device(fp8=True)
    if device == "cuda" and fp8_gemm.op_unavailable(device):
        pytest.fail(f"the CUDA kernel of dept_mega::fp8_gemm is not built: {fp8_gemm.op_unavailable(device)}")
    shapes = ([(8192, 2048, 6144), (8192, 8192, 2048), (2048, 8192, 8192), (6144, 8192, 2048)] if device == "cuda"
              else [(64, 128, 96), (96, 64, 128)])
    g = torch.Generator(device=device).manual_seed(5)
    for (m, k, n), (da, db) in product(shapes, PAIRS):
        a, b, sa, sb = _operands(m, k, n, da, db, g, device)
        what = f"{m}x{k}x{n} {da}x{db}"
        bound = _bound(a, b, sa, sb, k)
        for fast in (False, True):
            want = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=fast) \
                if device == "cuda" else fp8_module._scaled_mm(a, b, sa, sb, fast)
            got = fp8_gemm.fp8_gemm(a, b, sa, sb, fast)
            again = fp8_gemm.fp8_gemm(a, b, sa, sb, fast)
            assert torch.equal(_bits(got), _bits(again)), what
            ulp = torch.finfo(torch.bfloat16).eps * want.float().abs()
            # fast accumulation (Hopper's narrower running sums) has no published bound: 2^-7 of Σ|ab| for it
            tol = ulp + (bound if not fast else 2.0 ** -7 * bound / (2 * k * 2.0 ** -24))
            assert ((got.float() - want.float()).abs() <= tol).all(), (what, fast)
        prod = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.float32) if device == "cuda" \
            else _ref_fp32(a, b, sa, sb)
        out0 = torch.randn(m, n, generator=g, device=device)
        out = out0.clone()
        fp8_gemm.fp8_gemm(a, b, sa, sb, out=out)
        tol = bound + 2.0 ** -24 * (out0 + prod).abs() * 2
        assert ((out - (out0 + prod)).abs() <= tol).all(), what
        out.fill_(float("nan"))
        fp8_gemm.fp8_gemm(a, b, sa, sb, out=out, first=True)
        assert ((out - prod).abs() <= bound).all(), what
