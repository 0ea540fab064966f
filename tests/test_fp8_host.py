"""The FP8 linear's host-side shortcuts (``parallel/fp8.py``; measured by
``benchmarks/fp8_host_bench.py``) change no byte:

* reshapes, slices, dtype conversions and autocast contexts that would change nothing are
  skipped: ``fp8_linear`` equals the composition of its pieces (casts, ``_scaled_mm``, unpad,
  reshape, dtype) bit for bit for 2-D and 3-D inputs, with and without token padding, bf16 and
  fp32 operands, under autocast and without;
* the weight gradient goes into an active gradient buffer from the backward itself (not through
  ``param.grad`` and the buffer's hook): the same ``main_grad`` bytes and counts as the hook path,
  ``param.grad`` never set; outside a training step autograd gets the gradient as before;
* ``_scaled_mm``'s cheaper checks still name a misaligned operand or scale;
* under a profiler the forward and backward are named ranges; without one no range is opened;
* the benchmark's derived table subtracts the right combinations; its ``tritonpy`` casts run
  ``cast_fp8``'s Python with no launch and leave ``fp8_kernels`` as it was; a run reports every
  combination asked for (the Triton casts only on CUDA: on the CPU it says why not) and the
  derived costs from them.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
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


BENCH = os.path.join(ROOT, "benchmarks", "fp8_host_bench.py")
_OPS_HERE = fp8_casts.op_unavailable("cpu") is None and fp8_gemm.op_unavailable("cpu") is None


def _bench_module():
    spec = importlib.util.spec_from_file_location("fp8_host_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_host_bench_derives_the_right_differences():
    """Each combination a different power of two, so every pair's difference is unique to that
    pair: the cublaslt rows are preferred, the torch GEMM's taken when they did not run."""
    bench = _bench_module()
    us = {c: float(2 ** i) for i, c in enumerate(bench.COMBOS)}
    want = {"triton_launcher": ("triton+cublaslt", "tritonpy+cublaslt"),
            "cast_fp8_python": ("tritonpy+cublaslt", "cuda+cublaslt"),
            "triton_casts": ("triton+cublaslt", "cuda+cublaslt"),
            "scaled_mm_host": ("cuda+torch", "cuda+cublaslt"),
            "gpu_path_over_bf16": ("cuda+cublaslt", "bf16"),
            "fusion_saves": ("cuda+cublaslt+unfused", "cuda+cublaslt+fused"),
            "fusion_saves_triton": ("triton+cublaslt+unfused", "triton+cublaslt+fused"),
            "direct_launch_saves": ("tritonrun+cublaslt", "triton+cublaslt")}
    assert len(bench.COMBOS) < 60  # the powers of two stay exact in a float
    got = bench.derived(us, "cuda")
    assert set(got) == set(want)
    for name, (a, b) in want.items():
        assert got[name]["us"] == us[a] - us[b] and got[name]["of"] == f"{a} - {b}", (name, got[name])
    # without the cublaslt rows: the torch GEMM's pairs; the GEMM's difference needs both GEMMs
    no_lt = bench.derived({c: v for c, v in us.items() if not c.endswith("cublaslt")}, "cuda")
    assert no_lt["triton_launcher"]["us"] == us["triton+torch"] - us["tritonpy+torch"]
    assert no_lt["cast_fp8_python"]["us"] == us["tritonpy+torch"] - us["cuda+torch"]
    assert no_lt["scaled_mm_host"]["us"] is None and no_lt["gpu_path_over_bf16"]["us"] is None
    assert no_lt["scaled_mm_host"]["of"] == "cuda+torch - cuda+cublaslt"  # the pair it would have used
    cpu = bench.derived({c: v for c, v in us.items() if not c.startswith("triton+")}, "cpu")
    assert cpu["triton_launcher"]["us"] is None and cpu["triton_casts"]["us"] is None
    assert cpu["fusion_saves_triton"]["us"] == us["tritonpy+cublaslt+unfused"] - us["tritonpy+cublaslt+fused"]
    assert "not a host figure" in cpu["scaled_mm_host"]["what"] and "not a host" not in got["scaled_mm_host"]["what"]
    assert bench.skip_reason("triton+torch", "cpu").startswith("Triton's casts need CUDA")
    assert bench.skip_reason("tritonrun+cublaslt", "cpu").startswith("Triton's casts need CUDA")
    # tritonrun: both kernel modules launch through Triton's kernel[grid](...) inside, directly after
    from dept_mega.parallel import fp8_kernels, fp8_norm_kernels, triton_launch
    with bench.launched_by_triton():
        assert fp8_kernels.launch is fp8_norm_kernels.launch is triton_launch.triton_launch
    assert fp8_kernels.launch is fp8_norm_kernels.launch is triton_launch.launch
    assert bench.skip_reason("tritonpy+torch", "cpu") is None and bench.skip_reason("bf16_unfused", "cpu") is None


def test_the_tritonpy_casts_run_cast_fp8s_python_without_a_launch(monkeypatch):
    """``tritonpy``: ``Fp8State.cast`` calls the real ``cast_fp8``, whose kernel launches reach
    the bench's no-op (no cast operator dispatched, the outputs allocated by its Python), and
    ``fp8_kernels`` is as it was afterwards."""
    from dept_mega.parallel import fp8_kernels as K
    bench = _bench_module()
    before = {n: getattr(K, n, None) for n in ("AVAILABLE", "triton", "interpreted", "_cast_kernel", "cast_fp8")}
    calls = {"cast_fp8": 0, "launch": 0}
    real_cast = K.cast_fp8

    def counted_cast(*args, **kwargs):
        calls["cast_fp8"] += 1
        return real_cast(*args, **kwargs)

    def counted_launch(*args, **kwargs):
        calls["launch"] += 1
    monkeypatch.setattr(K, "cast_fp8", counted_cast)
    monkeypatch.setattr(bench, "_no_launch", counted_launch)
    chain = bench.Chain("tritonpy+torch", 16, 32, 2)  # its first step, current-scaled: two launches per cast
    assert calls["cast_fp8"] > 0 and calls["launch"] == 2 * calls["cast_fp8"]
    calls.update(cast_fp8=0, launch=0)
    chain.timed(1)  # a delayed-scaling step: one launch per cast
    assert calls["cast_fp8"] > 0 and calls["launch"] == calls["cast_fp8"]
    counts = chain.counted()
    assert counts["fwd"]["by_op"].get("aten::new_empty", 0) > 0 and counts["fwd"]["by_op"]["aten::_scaled_mm"] == 1
    assert not any("cast_fp8" in op or "fp8_cast" in op for ph in ("fwd", "bwd") for op in counts[ph]["by_op"])
    assert chain.state.kernels == "triton"
    monkeypatch.setattr(K, "cast_fp8", real_cast)
    assert {n: getattr(K, n, None) for n in before} == before  # restored after every step


@pytest.mark.skipif(not _OPS_HERE, reason="the dept_mega.ops FP8 operators are not built")
def test_the_host_bench_reports_combinations_and_derived_costs(tmp_path, capsys):
    """The bench's command line, its main in this process (the operators are loaded here already;
    a fresh interpreter would spend most of the test importing torch)."""
    out = tmp_path / "host.json"
    combos = "bf16,bf16_unfused,cuda+torch,cuda+cublaslt,tritonpy+cublaslt,triton+cublaslt"
    _bench_module().main(["--kernels", "real", "--depth", "2", "--repeats", "4", "--per-step", "2",
                          "--scaling", "current", "--combos", combos, "--json", str(out)])
    stdout = capsys.readouterr().out
    rec = json.loads(out.read_text())
    assert rec["device"] == "cpu" and rec["scaling"] == "current" and rec["passes"] == 4
    assert list(rec["combos"]) == combos.split(",")[:-1]
    assert set(rec["skipped"]) == {"triton+cublaslt"} and re.search(r"\n  triton\+cublaslt +skipped: Triton", stdout)
    total = {c: x["fwd_us"] + x["bwd_us"] for c, x in rec["combos"].items()}
    assert all(v > 0 for v in total.values())
    d = rec["derived"]
    assert d["cast_fp8_python"]["us"] == total["tritonpy+cublaslt"] - total["cuda+cublaslt"]
    assert d["scaled_mm_host"]["us"] == total["cuda+torch"] - total["cuda+cublaslt"]
    assert d["gpu_path_over_bf16"]["us"] == total["cuda+cublaslt"] - total["bf16"]
    assert d["triton_launcher"]["us"] is None and d["triton_casts"]["us"] is None
    assert "  triton_launcher          n/a  = triton+cublaslt - tritonpy+cublaslt" in stdout
    # current scaling: cast_fp8 allocates both layouts, 1/scale and the amax's partial maxima (delayed: the two layouts)
    assert rec["combos"]["tritonpy+cublaslt"]["fwd_by_op"] == {"aten::new_empty": 4, "dept_mega::fp8_gemm": 1}
    assert rec["combos"]["cuda+cublaslt"]["fwd_by_op"] == {"dept_mega::cast_fp8": 1, "dept_mega::fp8_gemm": 1}


@pytest.mark.skipif(not _OPS_HERE, reason="the dept_mega.ops FP8 operators are not built")
def test_the_host_bench_compares_fused_prologues_with_their_producers(tmp_path):
    """The ``+fused`` / ``+unfused`` rows: the chain with a LayerNorm before each column layer and
    the GELU before each row layer, fused into the casts (one LayerNorm cast operator, the cast
    operator for GELU; under ``tritonpy`` no launch reaches a kernel) or called before the
    plain linear; ``fusion_saves`` is their difference."""
    out = tmp_path / "host.json"
    combos = "cuda+cublaslt+fused,cuda+cublaslt+unfused,tritonpy+cublaslt+fused,tritonpy+cublaslt+unfused"
    _bench_module().main(["--kernels", "real", "--depth", "2", "--repeats", "4", "--per-step", "2",
                          "--combos", combos, "--json", str(out)])
    rec = json.loads(out.read_text())
    c = rec["combos"]
    assert list(c) == combos.split(",")
    # per call (a column and a row layer): forward the fused LayerNorm cast or the GELU cast, and the GEMM
    assert c["cuda+cublaslt+fused"]["fwd_by_op"] == {"dept_mega::cast_fp8": 0.5, "dept_mega::fp8_gemm": 1,
                                                    "dept_mega::layernorm_cast_fp8": 0.5}
    assert c["cuda+cublaslt+unfused"]["fwd_by_op"] == {"aten::gelu": 0.5, "aten::native_layer_norm": 0.5,
                                                      "dept_mega::cast_fp8": 1, "dept_mega::fp8_gemm": 1}
    assert c["tritonpy+cublaslt+fused"]["fwd_by_op"] == {"aten::new_empty": 3, "dept_mega::fp8_gemm": 1}
    for combo in c:  # the producers' backward in both (the norms' parameters get their gradients)
        assert c[combo]["bwd_by_op"]["aten::native_layer_norm_backward"] == 0.5, combo
        assert c[combo]["bwd_by_op"]["aten::gelu_backward"] == 0.5, combo
        assert c[combo]["fwd_syncs"] == c[combo]["bwd_syncs"] == 0
    total = {k: x["fwd_us"] + x["bwd_us"] for k, x in c.items()}
    d = rec["derived"]
    assert d["fusion_saves"]["us"] == total["cuda+cublaslt+unfused"] - total["cuda+cublaslt+fused"]
    assert d["fusion_saves_triton"]["us"] == total["tritonpy+cublaslt+unfused"] - total["tritonpy+cublaslt+fused"]
    from dept_mega.parallel import fp8_norm_kernels, fp8_triton
    # the launches' stubs restored after each step (fp8_norm_kernels as fp8_kernels)
    assert fp8_norm_kernels.AVAILABLE == fp8_triton.AVAILABLE and fp8_norm_kernels.interpreted is fp8_triton.interpreted
