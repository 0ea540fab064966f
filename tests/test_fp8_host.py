"""The FP8 linear's host-side shortcuts (``parallel/fp8.py``; measured by
``benchmarks/fp8_host_overhead.py``) change no byte:

* reshapes, slices, dtype conversions and autocast contexts that would change nothing are
  skipped: ``fp8_linear`` equals the composition of its pieces (casts, ``_scaled_mm``, unpad,
  reshape, dtype) bit for bit for 2-D and 3-D inputs, with and without token padding, bf16 and
  fp32 operands, under autocast and without;
* the weight gradient goes into an active gradient buffer from the backward itself (not through
  ``param.grad`` and the buffer's hook): the same ``main_grad`` bytes and counts as the hook path,
  ``param.grad`` never set; outside a training step autograd gets the gradient as before;
* ``_scaled_mm``'s cheaper checks still name a misaligned operand or scale;
* under a profiler the forward and backward are named ranges; without one no range is opened;
* the benchmark runs every mode (the real ``fp8`` one only on CUDA: on the CPU it says why
  not); its derived table subtracts the right modes; its ``fp8_op`` and ``fp8_cuda`` modes send
  the casts through the custom operators and give the same bytes as the ``torch`` casts.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from itertools import product

import pytest
import torch

from dept_mega.grad_buffer import GradBuffer, GradSync
from dept_mega.parallel import fp8 as fp8_module
from dept_mega.parallel import fp8_casts, fp8_gemm
from dept_mega.parallel.fp8 import E4M3, E5M2, Fp8Recipe, Fp8State, _cast_math, fp8_linear
from dept_mega.parallel.groups import build_groups

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def _reference(x, w, gy):
    """Current-scaled FP8 linear spelled out step by step: (y, dX, dW)."""
    lead, d_in, d_out = x.shape[:-1], x.shape[-1], w.shape[0]
    x2 = x.reshape(-1, d_in)
    rows = x2.shape[0]
    pad = (-rows) % 16
    xq, xq_t, x_inv, _ = _cast_math(x2, None, E4M3, pad, True, True)
    wq, wq_t, w_inv, _ = _cast_math(w, None, E4M3, 0, True, True)
    y = fp8_module._scaled_mm(xq, wq.t(), x_inv, w_inv)[:rows].reshape(*lead, d_out)
    gq, gq_t, g_inv, _ = _cast_math(gy.reshape(-1, d_out), None, E5M2, pad, True, True)
    dx = fp8_module._scaled_mm(gq, wq_t.t(), g_inv, w_inv)[:rows].reshape(x.shape).to(x.dtype)
    dw = fp8_module._scaled_mm(gq_t, xq_t.t(), g_inv, x_inv).to(w.dtype)
    return y, dx, dw


@pytest.mark.parametrize("shape,dtype,autocast", list(product(
    [(40, 64), (32, 64), (2, 20, 64), (2, 16, 64)], [torch.bfloat16, torch.float32], [False, True])))
def test_fp8_linear_is_its_spelled_out_composition_bit_for_bit(shape, dtype, autocast):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(*shape, generator=g).to(dtype)
    w = (torch.randn(96, 64, generator=g) * 0.05).to(dtype)
    gy = torch.randn(*shape[:-1], 96, generator=g).bfloat16()
    layer = Fp8State(Fp8Recipe("hybrid", "current"), "cpu").new_layer()
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = fp8_linear(xa, wa, layer)
    y.backward(gy)
    ry, rdx, rdw = _reference(x, w, gy)
    for what, got, want in (("y", y, ry), ("dX", xa.grad, rdx), ("dW", wa.grad, rdw)):
        assert _bytes_equal(got, want), (what, got.dtype, got.shape, want.dtype, want.shape)


def _train(route: str, monkeypatch) -> dict:
    """Two training steps (the first current-scaled, then delayed) of three micro-batches
    through two chained FP8 linears with bf16 weights; then one pass outside a step. ``route``
    of the weight gradients: ``direct`` (an fp32 gradient buffer, the backward adds into it),
    ``hook`` (the same buffer, the backward finds none: ``param.grad`` and the buffer's hook),
    ``plain`` (no buffer: each micro-batch's ``param.grad`` taken as it is)."""
    if route == "hook":
        monkeypatch.setattr(fp8_module, "grad_owner", lambda p: None)
    g = torch.Generator().manual_seed(5)
    state = Fp8State(Fp8Recipe("hybrid", "delayed", amax_history=4), "cpu")
    layers = [state.new_layer() for _ in range(2)]
    ws = [torch.nn.Parameter((torch.randn(64, 64, generator=g) * 0.1).bfloat16()) for _ in range(2)]
    if route != "plain":
        buf = GradBuffer(ws, torch.float32, torch.device("cpu"), bucket_size=1 << 20)
        buf.adopt()
        sync = GradSync(build_groups(), overlap=True)
    out = {"main_grad": [], "x_grad": [], "counts": [], "param_grad_none": [], "per_micro_batch": []}
    for _ in range(2):
        if route != "plain":
            sync.begin([buf], {id(w): 3 for w in ws})
        state.begin_step()
        for _ in range(3):
            x = torch.randn(2, 20, 64, generator=g).bfloat16().requires_grad_()
            y = fp8_linear(fp8_linear(x, ws[0], layers[0]), ws[1], layers[1])
            y.backward(torch.randn(y.shape, generator=g).bfloat16())
            out["x_grad"].append(x.grad)
            out["param_grad_none"].append(all(w.grad is None for w in ws))
            if route == "plain":
                out["per_micro_batch"].append([w.grad for w in ws])
                for w in ws:
                    w.grad = None
        state.end_step()
        if route != "plain":
            out["counts"].append([buf.counts[id(w)] for w in ws])
            sync.finish()
            out["main_grad"] += [w.main_grad.clone() for w in ws]
    x = torch.randn(16, 64, generator=g).bfloat16()
    fp8_linear(fp8_linear(x, ws[0], layers[0]), ws[1], layers[1]).sum().backward()  # no step: plain autograd
    out["outside"] = [w.grad for w in ws]
    return out


def test_weight_gradient_reaches_main_grad_as_through_the_hook(monkeypatch):
    got = _train("direct", monkeypatch)
    with monkeypatch.context() as m:
        ref = _train("hook", m)
    plain = _train("plain", monkeypatch)
    assert got["counts"] == ref["counts"] == [[3, 3]] * 2
    assert all(got["param_grad_none"]) and all(ref["param_grad_none"])
    for key in ("main_grad", "x_grad", "outside"):
        assert all(t is not None for t in got[key]), key
        assert len(got[key]) == len(ref[key]) and all(_bytes_equal(a, b) for a, b in zip(got[key], ref[key])), key
    # the buffer holds, per step, the fp32 sum of the micro-batches' bf16 gradients: the first
    # copied, the others added in order
    want = []
    for step in range(2):
        mbs = plain["per_micro_batch"][3 * step:3 * step + 3]
        for i in range(2):
            acc = mbs[0][i].float()
            for mb in mbs[1:]:
                acc = acc + mb[i]
            want.append(acc)
    assert all(_bytes_equal(a, b) for a, b in zip(got["main_grad"], want))
    assert all(t.abs().sum() > 0 for t in got["main_grad"])


def test_scaled_mm_names_a_misaligned_operand_or_scale():
    a = torch.randn(16, 32).to(E4M3)
    b = torch.randn(16, 32).to(E4M3).t()
    one = torch.ones(4)
    fp8_module._scaled_mm(a, b, one[0], one[0])  # aligned: runs
    with pytest.raises(ValueError, match=r"scale_b not 16-byte aligned"):
        fp8_module._scaled_mm(a, b, one[0], one[1])
    flat = torch.zeros(16 * 32 + 1, dtype=E4M3)
    a_off = flat[1:].view(16, 32)  # row-major, but one byte into its storage
    with pytest.raises(ValueError, match=r"FP8 GEMM: a not 16-byte aligned"):
        fp8_module._scaled_mm(a_off, b, one[0], one[0])
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8_module._scaled_mm(a[:, :24], b[:24], one[0], one[0])


def test_named_profiler_ranges_only_while_profiling(monkeypatch):
    x = torch.randn(32, 16, requires_grad=True)
    w = (torch.randn(16, 16) * 0.1).requires_grad_()

    def run():
        y = fp8_linear(x, w, Fp8State(Fp8Recipe("hybrid", "current"), "cpu").new_layer())
        y.float().sum().backward()

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    names = {e.name for e in prof.events()}
    assert {"dept_mega::fp8_linear_forward", "dept_mega::fp8_linear_backward"} <= names, sorted(names)[:40]

    def no_range(name):
        raise AssertionError(f"record_function({name!r}) opened without a profiler")
    monkeypatch.setattr(torch.profiler, "record_function", no_range)
    run()


BENCH = os.path.join(ROOT, "benchmarks", "fp8_host_overhead.py")


def _bench_module():
    spec = importlib.util.spec_from_file_location("fp8_host_overhead", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_host_overhead_benchmark_runs_every_mode(tmp_path):
    out = tmp_path / "host.json"
    res = subprocess.run([sys.executable, BENCH, "--calls", "2", "--trials", "1", "--depth", "2", "--json", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    rec = json.loads(out.read_text())
    us = rec["us_per_call"]
    # fp8_cuda: the C++ operator's CPU kernel where the extension has it (else skipped, saying why)
    op_here = fp8_casts.op_unavailable("cpu") is None
    lt_here = fp8_gemm.op_unavailable("cpu") is None  # fp8_lt: the GEMM operator's CPU kernel
    assert set(us) == {"bf16", "bf16_layer", "fp8_torch", "fp8_op", "fp8_stub", "fp8_launch_stub", "fp8_python",
                       *(["fp8_cuda"] if op_here else []), *(["fp8_lt"] if lt_here else [])}
    assert all(v > 0 for v in us.values())
    # the real path needs a GPU: skipped on the CPU, with the reason in the output and the record
    assert set(rec["skipped"]) == {"fp8", *([] if op_here else ["fp8_cuda"]), *([] if lt_here else ["fp8_lt"])}
    assert rec["skipped"]["fp8"].startswith("needs a GPU")
    assert "fp8              skipped: needs a GPU" in res.stdout
    assert rec["device"] == "cpu" and rec["timing"] == "process CPU time"
    d = rec["derived"]
    assert d["triton_launcher"]["us"] is None and "triton_launcher  n/a" in res.stdout
    assert d["cast_fp8_python"]["us"] == us["fp8_launch_stub"] - us["fp8_stub"]
    assert d["scaled_mm_host"]["us"] == us["fp8_stub"] - us["fp8_python"]
    assert d["cast_op"]["us"] == us["fp8_op"] - us["fp8_torch"] and d["cast_op"]["of"] == "fp8_op - fp8_torch"
    if op_here:
        assert d["cuda_cast"]["us"] == us["fp8_cuda"] - us["fp8_torch"]
    if lt_here:
        assert d["lt_gemm"]["us"] == us["fp8_lt"] - us["fp8_torch"]


def test_the_derived_table_subtracts_the_right_modes():
    """Each mode a different power of two, so every pair's difference is unique to that pair."""
    bench = _bench_module()
    us = {m: float(2 ** i) for i, m in enumerate(bench.MODES)}
    want = {"cuda": {"triton_launcher": ("fp8", "fp8_launch_stub"), "cast_fp8_python": ("fp8_launch_stub", "fp8_stub"),
                     "scaled_mm_host": ("fp8_stub", "fp8_python"), "cast_op": ("fp8_op", "fp8"),
                     "cuda_cast": ("fp8_cuda", "fp8"), "lt_gemm": ("fp8_lt", "fp8")},
            "cpu": {"triton_launcher": ("fp8", "fp8_launch_stub"), "cast_fp8_python": ("fp8_launch_stub", "fp8_stub"),
                    "scaled_mm_host": ("fp8_stub", "fp8_python"), "cast_op": ("fp8_op", "fp8_torch"),
                    "cuda_cast": ("fp8_cuda", "fp8_torch"), "lt_gemm": ("fp8_lt", "fp8_torch")}}
    for device, table in want.items():
        got = bench.derived(us, device)
        assert set(got) == set(table)
        for name, (a, b) in table.items():
            assert got[name]["us"] == us[a] - us[b], (device, name, got[name])
            assert got[name]["of"] == f"{a} - {b}"
    partial = bench.derived({m: v for m, v in us.items() if m != "fp8"}, "cuda")
    assert partial["triton_launcher"]["us"] is None and partial["cast_op"]["us"] is None
    assert partial["scaled_mm_host"]["us"] == us["fp8_stub"] - us["fp8_python"]
    assert bench.skip_reason("fp8", "cpu").startswith("needs a GPU") and bench.skip_reason("fp8_op", "cpu") is None


@pytest.mark.parametrize("mode,op", [("fp8_op", "dept_mega::fp8_cast"), ("fp8_cuda", "dept_mega::cast_fp8")])
def test_the_operator_mode_casts_through_the_operator_with_the_same_bytes(mode, op):
    """``fp8_op`` on the CPU (the operator's reference implementation) and ``fp8_cuda`` (the C++
    operator's CPU kernel) give the ``torch`` casts' bytes: outputs, input gradients,
    ``main_grad`` and the amax history; the operator is what ran; the module's cast path is
    restored afterwards."""
    if mode == "fp8_cuda" and fp8_casts.op_unavailable("cpu"):
        pytest.skip(f"dept_mega::cast_fp8 unavailable: {fp8_casts.op_unavailable('cpu')}")
    bench = _bench_module()
    cases = {m: bench.Case(m, 16, 32, 2) for m in ("fp8_torch", mode)}  # with a first (current-scaled) step
    outs = {}
    for mode, case in cases.items():
        case.step(1)  # a delayed-scaling step
        with bench._patched(mode), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            case.state.begin_step()
            y = case.x
            for w, layer in zip(case.ws, case.layers):
                y = fp8_linear(y, w, layer)
            y.backward(case.dy)
            case.state.end_step()
        outs[mode] = (y.detach(), case.x.grad, [w.main_grad.clone() for w in case.ws], case.state.history.clone(),
                      {e.name for e in prof.events()})
    (y0, gx0, mg0, h0, names0), (y1, gx1, mg1, h1, names1) = outs["fp8_torch"], outs[mode]
    assert op in names1 and op not in names0
    assert _bytes_equal(y0, y1) and _bytes_equal(gx0, gx1) and torch.equal(h0, h1)
    assert all(_bytes_equal(a, b) for a, b in zip(mg0, mg1))
    assert h1.abs().sum() > 0  # the operator's amaxes reached the history
    from dept_mega.parallel import fp8_kernels
    assert fp8_module.fp8_kernels is fp8_kernels and fp8_module._cast is not bench._eager_cast
