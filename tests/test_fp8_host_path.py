"""The eager FP8 linear's host shortcuts (``parallel/fp8.py``; measured by
``benchmarks/fp8_host_bench.py``) change no byte and keep the dispatcher's work what it was:

* the layers' ``fp8_linear_eager`` (no graph-break wrapper; ``_Fp8Linear``'s C++ apply called
  directly), the operators called through ``OpOverload._op`` and no context entered when none
  is needed give the bytes of the public path (``fp8_linear``, ``Function.apply``, the
  overloads), for every cast and GEMM path the CPU can run: outputs, input gradients, the
  gradient buffer, the delayed-scaling state, and the gradients outside a step;
* under a functorch transform the public ``Function.apply`` runs (and refuses, as before);
* the path a GPU run with ``fp8_casts: cuda`` + ``fp8_gemm: cublaslt`` takes dispatches, per
  linear call, the cast and the GEMM forward and the cast, two GEMMs and one view backward, and
  nothing that reads a tensor's value on the host.
"""
from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from dept_mega.grad_buffer import GradBuffer, GradSync
from dept_mega.parallel import fp8 as fp8_module
from dept_mega.parallel import fp8_casts, fp8_gemm
from dept_mega.parallel import layers as layers_module
from dept_mega.parallel.fp8 import Fp8Recipe, Fp8State
from dept_mega.parallel.groups import build_groups
from dept_mega.parallel.layers import ColumnParallelLinear, LinearGemm, RowParallelLinear

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CAST_OP = fp8_casts.op_unavailable("cpu") is None
_GEMM_OP = fp8_gemm.op_unavailable("cpu") is None
COMBOS = [(c, g) for c in ("torch", "cuda") for g in ("torch", "cublaslt")
          if (c != "cuda" or _CAST_OP) and (g != "cublaslt" or _GEMM_OP)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8).clone()


def _train(casts: str, gemm: str, fused: bool = False) -> dict:
    """Two training steps (current-scaled, then delayed) through a column- and a row-parallel FP8
    layer (3-D input, 40 tokens: padded to 48). Plain: three micro-batches, then a pass outside a
    step. ``fused``: two micro-batches with a LayerNorm prologue (drawn weight and bias) before the
    column layer and the GELU prologue before the row layer, casts fused (``fp8_fused_casts``)."""
    from dept_mega.model.layers import Norm
    from dept_mega.parallel.fp8_prologue import GELU
    torch.manual_seed(0)
    state = Fp8State(Fp8Recipe("hybrid", "delayed", amax_history=4), "cpu", kernels=casts, gemm=gemm)
    kind = LinearGemm("fp8", state, fused_casts=fused)
    pg = build_groups()
    chain = [ColumnParallelLinear(64, 96, pg, name="a", seed=1, init_std=0.1, gemm=kind, dtype=torch.bfloat16),
             RowParallelLinear(96, 64, pg, name="b", seed=2, init_std=0.1, gemm=kind, dtype=torch.bfloat16)]
    ws = [m.weight for m in chain]
    norm = None
    if fused:
        norm = Norm("layernorm", 64, 1e-5, name="n", seed=3, dtype=torch.bfloat16)
        with torch.no_grad():
            norm.weight.normal_(1.0, 0.2)
            norm.bias.normal_(0.0, 0.2)
        ws += [norm.weight, norm.bias]
    micro = 2 if fused else 3
    buf = GradBuffer(ws, torch.float32, torch.device("cpu"), bucket_size=1 << 20)
    buf.adopt()
    sync = GradSync(pg, overlap=False)
    g = torch.Generator().manual_seed(5)
    out = {"y": [], "x_grad": [], "main_grad": []}
    for _ in range(2):
        sync.begin([buf], {id(w): micro for w in ws})
        state.begin_step()
        for _ in range(micro):
            x = torch.randn(2, 20, 64, generator=g).bfloat16().requires_grad_()
            y = chain[1](chain[0](x, prologue=norm), prologue=GELU if fused else None)
            y.backward(torch.randn(y.shape, generator=g).bfloat16())
            out["y"].append(_bits(y))
            out["x_grad"].append(_bits(x.grad))
        state.end_step()
        sync.finish()
        out["main_grad"] += [_bits(w.main_grad) for w in ws]
    out["history"], out["scale"] = _bits(state.history), _bits(state.scale)
    if not fused:
        x = torch.randn(16, 64, generator=g).bfloat16()
        chain[1](chain[0](x)).float().sum().backward()  # no step open: plain autograd
        out["outside"] = [_bits(w.grad) for w in ws]
    return out


@pytest.mark.parametrize("casts,gemm", COMBOS)
def test_the_fast_host_path_gives_the_public_paths_bytes(casts, gemm, monkeypatch):
    applied = []
    real_apply = fp8_module._APPLY
    assert real_apply is not None  # this torch has the layout the shortcut expects
    with monkeypatch.context() as m:
        m.setattr(fp8_module, "_APPLY", lambda *a: applied.append(1) or real_apply(*a))
        fast = _train(casts, gemm)
    assert len(applied) == 2 * 2 * 3 + 2  # every call of the layers took the C++ apply
    opened = []
    with monkeypatch.context() as m:  # the public path: wrapper, Function.apply, overloads, contexts
        m.setattr(layers_module, "fp8_linear_eager", fp8_module.fp8_linear)
        m.setattr(fp8_module, "_APPLY", None)
        m.setattr(fp8_module, "direct_op", lambda fn: fn)
        real_contexts = fp8_module._host_contexts

        def always(name, device_type):  # a context entered on every call, as before
            opened.append(name)
            return real_contexts(name, device_type) or __import__("contextlib").ExitStack()
        m.setattr(fp8_module, "_host_contexts", always)
        public = _train(casts, gemm)
    assert len(opened) == 2 * (2 * 2 * 3 + 2)
    assert fast.keys() == public.keys()
    for key in fast:
        a, b = fast[key], public[key]
        pairs = zip(a, b) if isinstance(a, list) else [(a, b)]
        assert all(torch.equal(p, q) for p, q in pairs), key
        assert not isinstance(a, list) or len(a) == len(b), key


def test_a_functorch_transform_takes_the_public_apply():
    layer = Fp8State(Fp8Recipe("hybrid", "current"), "cpu").new_layer()
    w = (torch.randn(32, 32) * 0.1).bfloat16().requires_grad_()
    x = torch.randn(16, 32).bfloat16()
    # Function.apply under a transform wants setup_context, which _Fp8Linear does not define
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda t: fp8_module.fp8_linear_eager(t, w, layer).float().sum())(x)
    # the fused linear (fp8_prologue.py) takes the same public path under a transform
    from dept_mega.parallel.fp8_prologue import GELU, fp8_prologue_linear
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda t: fp8_prologue_linear(t, w, layer, GELU).float().sum())(x)


def _bench_module():
    path = os.path.join(ROOT, "benchmarks", "fp8_host_bench.py")
    spec = importlib.util.spec_from_file_location("fp8_host_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(not (_CAST_OP and _GEMM_OP), reason="the dept_mega.ops FP8 operators are not built")
def test_the_gpu_paths_dispatcher_ops_per_linear_call():
    bench = _bench_module()
    counted = bench.Chain(bench.GPU_PATH, 16, 64, 4).counted()  # the real CPU kernels: only counting
    assert counted["fwd"]["by_op"] == {"dept_mega::cast_fp8": 1, "dept_mega::fp8_gemm": 1}
    assert counted["bwd"]["by_op"] == {"dept_mega::cast_fp8": 1, "dept_mega::fp8_gemm": 2, "aten::t": 1}
    assert counted["fwd"]["syncs"] == counted["bwd"]["syncs"] == 0
    bf16 = bench.Chain("bf16", 16, 64, 4).counted()
    assert bf16["fwd"]["by_op"] == {"aten::t": 1, "aten::mm": 1}


@pytest.mark.skipif(not (_CAST_OP and _GEMM_OP), reason="the dept_mega.ops FP8 operators are not built")
def test_the_host_bench_runs_and_reports_every_combination(tmp_path, capsys):
    """The bench's command line, its main in this process (the operators are loaded here already;
    a fresh interpreter would spend most of the test importing torch)."""
    out = tmp_path / "bench.json"
    _bench_module().main(["--kernels", "real", "--depth", "2", "--repeats", "4", "--per-step", "2",
                          "--combos", "bf16,cuda+cublaslt,triton+torch", "--json", str(out)])
    assert "cuda+cublaslt" in capsys.readouterr().out
    res = json.loads(out.read_text())
    assert list(res["combos"]) == ["bf16", "cuda+cublaslt"] and "Triton" in res["skipped"]["triton+torch"]
    lt = res["combos"]["cuda+cublaslt"]
    assert lt["fwd_ops"] == 2 and lt["bwd_ops"] == 4 and lt["fwd_syncs"] == lt["bwd_syncs"] == 0
    assert all(v["fwd_us"] > 0 and v["bwd_us"] > 0 for v in res["combos"].values())


@pytest.mark.parametrize("casts,gemm", COMBOS)
def test_the_fused_linears_direct_apply_gives_the_public_applys_bytes(casts, gemm, monkeypatch):
    """``fp8_prologue_linear`` calls ``_Fp8PrologueLinear``'s C++ apply directly (as the plain
    linear's): every fused call takes it, with the bytes of ``Function.apply``."""
    from dept_mega.parallel import fp8_prologue
    applied = []
    real_apply = fp8_prologue._APPLY
    assert real_apply is not None
    with monkeypatch.context() as m:
        m.setattr(fp8_prologue, "_APPLY", lambda *a: applied.append(a[6]) or real_apply(*a))  # eps
        fast = _train(casts, gemm, fused=True)
    assert len(applied) == 2 * 2 * 2 and applied.count(None) == 4  # per pass: LayerNorm (eps), GELU (None)
    with monkeypatch.context() as m:
        m.setattr(fp8_prologue, "_APPLY", None)
        public = _train(casts, gemm, fused=True)
    for key in fast:
        a, b = fast[key], public[key]
        pairs = zip(a, b) if isinstance(a, list) else [(a, b)]
        assert all(torch.equal(p, q) for p, q in pairs), key
