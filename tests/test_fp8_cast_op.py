"""The ``dept_mega::fp8_cast`` operator (``parallel/fp8_cast_op.py``) in the traced FP8 linear
(``fp8_traced.py``, ``casts="triton"``): on the CPU its implementation is the reference math,
so the traced linear through it gives the ``_cast_math`` traced path's and the eager path's
bytes, called eagerly and compiled (AOT autograd without inductor, ``fullgraph``), with one
operator node per cast in the graphs. The GPU test checks that inductor runs it as the eager
path's Triton kernel (the same bytes)."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.backends.common import aot_autograd
from torch._subclasses.fake_tensor import FakeTensorMode

from dept_mega.model import resolve_backends
from dept_mega.parallel import fp8_kernels
from dept_mega.parallel.fp8 import E4M3, E5M2, Fp8Recipe, Fp8State, _cast_math, fp8_linear
from dept_mega.parallel.fp8_cast_op import fp8_cast
from dept_mega.parallel.fp8_traced import fp8_linear_traced
from tests.trainer_utils import gpu_test_device, tiny_config

OP = torch.ops.dept_mega.fp8_cast.default


def _bytes_equal(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return (a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def _data(seed: int, dev: str = "cpu"):
    """Four micro-batches of inputs and output gradients at different scales (40 rows per
    micro-batch: padded to 48), one weight."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(2, 20, 64, generator=g).mul(s).bfloat16().to(dev) for s in (1.0, 3.0, 0.5, 2.0)]
    w = (torch.randn(96, 64, generator=g) * 0.05).bfloat16().to(dev)
    gys = [torch.randn(2, 20, 96, generator=g).mul(s).bfloat16().to(dev) for s in (1e-3, 4e-3, 2e-3, 1e-3)]
    return xs, w, gys


def _run(fn, layer, recipe, xs, w, gys):
    """Two training steps of two micro-batches (one step of four under current scaling, which
    keeps no state): per micro-batch ``(y, dX, dW)``, and the state's history and scales after
    each step (None under current scaling)."""
    outs, states = [], []
    for step in range(2):
        layer.state.begin_step()
        wa = w.clone().requires_grad_()  # one weight per step (the eager path caches its cast)
        for x, gy in zip(xs[2 * step:2 * step + 2], gys[2 * step:2 * step + 2]):
            xa = x.clone().requires_grad_()
            wa.grad = None
            y = fn(xa, wa)
            y.backward(gy)
            outs.append((y.detach(), xa.grad, wa.grad))
        layer.state.end_step()
        st = layer.state
        states.append(None if st.history is None else (st.history.clone(), st.scale.clone()))
    return outs, states


def _recorder(graphs):
    def compiler(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    return compiler


def _count(graph, target) -> int:
    return sum(1 for n in graph.nodes if n.target is target)


def _fp8_to_copies(graph) -> int:
    return sum(1 for n in graph.nodes if n.target is torch.ops.aten._to_copy.default
               and n.kwargs.get("dtype") in (E4M3, E5M2))


@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_traced_linear_through_the_cast_op_is_bit_identical(scaling):
    """The traced linear with the operator (eagerly and compiled with ``fullgraph``) gives the
    eager FP8 linear's and the ``_cast_math`` traced path's output, input and weight gradients
    and (delayed) amax history and scales byte for byte; each forward graph holds two
    ``dept_mega::fp8_cast`` nodes and each backward one (no FP8 ``_to_copy`` left), the
    ``_cast_math`` path none; no graph break."""
    recipe = Fp8Recipe("hybrid", scaling, amax_history=4)
    xs, w, gys = _data(5)
    forward, backward = [], []
    backend = aot_autograd(fw_compiler=_recorder(forward), bw_compiler=_recorder(backward))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    runs = {}
    with torch.backends.mkldnn.flags(enabled=False):
        for name in ("eager", "math", "op", "op_compiled"):
            layer = Fp8State(recipe, "cpu").new_layer()
            if name == "eager":
                fn = lambda a, b, layer=layer: fp8_linear(a, b, layer)  # noqa: E731
            else:
                casts = "torch" if name == "math" else "triton"
                fn = lambda a, b, layer=layer, casts=casts: fp8_linear_traced(  # noqa: E731
                    a, b, recipe.grad_dtype, layer, casts=casts)
                if name == "op_compiled":
                    fn = torch.compile(fn, backend=backend, fullgraph=True)
            runs[name] = _run(fn, layer, recipe, xs, w, gys)
    assert dict(torch._dynamo.utils.counters["graph_break"]) == {}
    pairs = 1 if scaling == "current" else 2  # delayed: once more when the operands turn ready
    assert len(forward) == len(backward) == pairs
    assert [_count(gm.graph, OP) for gm in forward + backward] == [2] * pairs + [1] * pairs
    assert [_fp8_to_copies(gm.graph) for gm in forward + backward] == [0] * (2 * pairs)
    want_outs, want_states = runs["eager"]
    for name in ("math", "op", "op_compiled"):
        outs, states = runs[name]
        for k, (got, want) in enumerate(zip(outs, want_outs)):
            for what, a, b in zip(("y", "dX", "dW"), got, want):
                assert _bytes_equal(a, b), (name, k, what)
        for step, (got, want) in enumerate(zip(states, want_states)):
            assert (got is None) == (want is None) == (scaling == "current"), (name, step)
            if got is not None:
                assert all(_bytes_equal(a, b) for a, b in zip(got, want)), (name, step)
    if scaling == "delayed":  # the amaxes were recorded (both steps' rows), the scales taken from them
        assert (want_states[1][0][:2] > 0).all() and (want_states[1][1] != 1).all()


@pytest.mark.parametrize("delayed", [False, True])
def test_cast_op_is_the_reference_math_with_placeholders(delayed):
    """The operator's CPU results are ``_cast_math``'s (q, q_t, 1/scale, amax), byte for byte,
    for each layout asked for; a layout not asked for is None from :func:`fp8_cast` (an empty
    placeholder from the operator itself), and the fake implementation gives the real
    outputs' shapes, dtypes and strides."""
    g = torch.Generator().manual_seed(6)
    t = torch.randn(40, 32, generator=g).bfloat16()
    scale = torch.tensor([3.0, 5.5, 7.25]) if delayed else None
    for dtype in (E4M3, E5M2):
        for rowwise, colwise in ((True, False), (False, True), (True, True)):
            got = fp8_cast(t, scale, 1, dtype, 8, rowwise, colwise)
            want = _cast_math(t, None if scale is None else scale[1], dtype, 8, rowwise, colwise)
            assert all(_bytes_equal(a, b) for a, b in zip(got, want)), (dtype, rowwise, colwise)
            raw = OP(t, scale, 1, dtype, 8, rowwise, colwise)
            assert [tuple(raw[i].shape) for i in (0, 1) if not (rowwise, colwise)[i]] in ([], [(0,)])
            with FakeTensorMode() as mode:
                fake = OP(mode.from_tensor(t), None if scale is None else mode.from_tensor(scale), 1, dtype, 8,
                          rowwise, colwise)
            for f, r in zip(fake, raw):
                assert (f.shape, f.dtype, f.stride()) == (r.shape, r.dtype, r.stride())


def test_fp8_casts_triton_selects_the_op_in_compiled_graphs():
    """``fp8_casts`` names the casts the compiled graphs hold: ``triton`` given by name the
    operator, ``auto`` and ``torch`` inductor's (the log line says which); a state made with
    ``kernels="triton"`` carries it, an ``auto`` one does not."""
    base = {"precision": "bf16", "fp8": "hybrid", "backend": "local", "train": {"compile": True}}
    for casts, graph in (("auto", "torch"), ("torch", "torch")):
        b = resolve_backends(tiny_config({**base, "fp8_casts": casts}), "cpu")
        assert b.fp8_graph_casts == graph and b.new_fp8_state("cpu").graph_casts == graph
        assert "with inductor's casts (from the torch math)" in b.describe(), b.describe()
    assert Fp8State(Fp8Recipe("hybrid", "delayed"), "cpu").graph_casts == "torch"
    if fp8_kernels.AVAILABLE and fp8_kernels.interpreted():
        b = resolve_backends(tiny_config({**base, "fp8_casts": "triton"}), "cpu")
        assert b.new_fp8_state("cpu").graph_casts == "triton"
        assert "with the Triton cast kernel as one op per cast (dept_mega::fp8_cast)" in b.describe()
    with pytest.raises(ValueError, match="traced FP8 casts 'cuda'"):
        fp8_linear_traced(torch.zeros(16, 16).bfloat16(), torch.zeros(16, 16).bfloat16(), E5M2, casts="cuda")


@pytest.mark.gpu
def test_inductor_runs_the_cast_op_as_the_eager_triton_kernel():
    """Under inductor (``fullgraph``) the operator is the eager path's Triton cast: the same
    q, q_t, 1/scale and amax bytes as ``fp8_kernels.cast_fp8`` in both scalings; and the traced
    linear through it, over two delayed-scaling training steps of two micro-batches, gives the
    eager FP8 linear's (Triton casts) outputs, gradients, amax history and scales byte for byte
    (the same FP8 operands into the same GEMM). (Rehearsed on the CPU, the operator is the
    reference math and the eager path the torch casts.)"""
    dev = gpu_test_device(fp8=True, triton=True)
    kernels = "triton" if dev == "cuda" else "torch"
    g = torch.Generator().manual_seed(7)
    t = torch.randn(1000, 256, generator=g).bfloat16().to(dev)  # 1000 rows: padded to 1008
    scale = torch.tensor([3.0, 5.5, 7.25], device=dev)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch.backends.mkldnn.flags(enabled=False):
        for s in (None, scale):
            op = torch.compile(lambda a, s=s: fp8_cast(a * 2, s, 1, E5M2, 8, True, True), fullgraph=True)
            got = op(t)
            if dev == "cuda":
                amax = torch.zeros(1, device=dev)
                q, q_t, inv = fp8_kernels.cast_fp8(t * 2, E5M2, 8, True, True, scale=s, scale_index=1,
                                                   amax_out=amax)
                want = (q, q_t, scale[1].reciprocal() if inv is None else inv, amax[0])
            else:
                want = _cast_math(t * 2, None if s is None else s[1], E5M2, 8, True, True)
            for what, a, b in zip(("q", "q_t", "inv", "amax"), got, want):
                assert _bytes_equal(a, b), (s is None, what)
        recipe = Fp8Recipe("hybrid", "delayed", amax_history=4)
        xs, w, gys = _data(8, dev)
        runs = []
        for traced in (False, True):
            layer = Fp8State(recipe, dev, kernels=kernels).new_layer()
            fn = lambda a, b, layer=layer: fp8_linear(a, b, layer)  # noqa: E731
            if traced:
                fn = torch.compile(lambda a, b, layer=layer: fp8_linear_traced(  # noqa: E731
                    a, b, recipe.grad_dtype, layer, casts="triton"), fullgraph=True)
            runs.append(_run(fn, layer, recipe, xs, w, gys))
    assert dict(torch._dynamo.utils.counters["graph_break"]) == {}
    (eager_outs, eager_states), (outs, states) = runs
    for k, (got, want) in enumerate(zip(outs, eager_outs)):
        for what, a, b in zip(("y", "dX", "dW"), got, want):
            assert _bytes_equal(a, b), (k, what)
    for step, (got, want) in enumerate(zip(states, eager_states)):
        assert all(_bytes_equal(a, b) for a, b in zip(got, want)), step
    assert (eager_states[1][0][:2] > 0).all()
