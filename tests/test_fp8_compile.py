"""Native FP8 under ``train.compile`` (``parallel/fp8_traced.py``): with ``fp8_recipe: current``
the FP8 linears are traced into the compiled blocks (one graph per block holding the casts and
``torch._scaled_mm``, forward and backward, no graph break) and train to the eager path's
losses and gradient norms; with delayed scaling they stay graph breaks; the run log says which.

The compiled runs use AOT autograd without inductor (``aot_eager`` or a recording backend): the
ATen graphs run as traced, so the comparison with the eager path is exact (inductor's CPU build
takes ~25 s per model here and may round bf16 intermediates differently), and with oneDNN off
(the eager ``_scaled_mm`` switches it off per call; a traced graph cannot)."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.backends.debugging import aot_eager, boxed_nop

from dept_mega.model import resolve_backends
from dept_mega.model import gpt as gpt_module
from dept_mega.parallel.fp8 import E4M3, E5M2, Fp8Recipe, Fp8State, fp8_linear
from dept_mega.parallel.fp8 import _states as fp8_states
from dept_mega.parallel.fp8_traced import fp8_linear_traced
from dept_mega.parallel.groups import build_groups
from dept_mega.trainer import Trainer
from tests.trainer_utils import dp_micro_batches, global_batch, gpu_test_device, tiny_config

FP8 = {"precision": "bf16", "fp8": "hybrid", "backend": "local", "fp8_recipe": "current"}


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


@pytest.mark.parametrize("fmt,shape", [("hybrid", (40, 64)), ("e4m3", (2, 16, 64))])
def test_traced_linear_called_eagerly_is_the_eager_fp8_linear_bit_for_bit(fmt, shape):
    """Outside a graph the traced function is the eager current-scaled FP8 linear: the same
    output and gradients, byte for byte (40 rows: the padding to 48)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(*shape, generator=g).bfloat16()
    w = (torch.randn(96, 64, generator=g) * 0.05).bfloat16()
    gy = torch.randn(*shape[:-1], 96, generator=g).bfloat16()
    recipe = Fp8Recipe(fmt, "current")
    layer = Fp8State(recipe, "cpu").new_layer()
    out = []
    for fn in (lambda a, b: fp8_linear(a, b, layer), lambda a, b: fp8_linear_traced(a, b, recipe.grad_dtype)):
        xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xa, wa)
        y.backward(gy)
        out.append((y, xa.grad, wa.grad))
    for what, got, want in zip(("y", "dX", "dW"), out[1], out[0]):
        assert _bytes_equal(got, want), what
    with torch.no_grad():  # no gradients: no transposed copies, the same output
        assert _bytes_equal(fp8_linear_traced(x, w, recipe.grad_dtype), out[0][0])


def _fp8_casts(graph, dtype) -> int:
    return sum(1 for n in graph.nodes if n.target is torch.ops.aten._to_copy.default and n.kwargs.get("dtype") == dtype)


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_the_log_says_whether_fp8_gemms_are_traced_into_the_compiled_blocks(recipe):
    """The run log's backend line says which: the FP8 GEMMs traced into the compiled blocks
    (their casts in the compiled graphs), or torch casts when the blocks are not compiled. (The
    graphs themselves: test_compiled_fp8_trains_to_the_eager_losses.)"""
    compiled = resolve_backends(tiny_config({**FP8, "fp8_recipe": recipe, "train": {"compile": True}})).describe()
    assert f"FP8 GEMMs traced into the compiled blocks ({recipe} scaling)" in compiled, compiled
    assert "casts in the compiled graphs" in compiled, compiled
    eager = resolve_backends(tiny_config({**FP8, "fp8_recipe": recipe})).describe()
    assert "compiled" not in eager and "torch casts" in eager, eager


def _input_writes(graph) -> int:
    """``copy_`` nodes into the graph's inputs (mutations AOT autograd kept in the graph)."""
    return sum(1 for n in graph.nodes if n.target is torch.ops.aten.copy_.default and n.args[0].op == "placeholder")


def _train(cfg, steps: int, graphs: list) -> dict:
    """``train_losses`` with the model's FP8 state after each step (amax history, scales, ring
    position, operands with a recorded amax) and the number of graphs compiled so far
    (``len(graphs)``) after each step and after the evaluation."""
    pg = build_groups(1, 1, 1)
    trainer = Trainer(cfg, pg, torch.device("cpu"), vocab_size=cfg.model.vocab_size)
    out = {"loss": [], "grad_norm": [], "state": [], "graphs": []}
    for step in range(steps):
        res = trainer.train_step(dp_micro_batches(cfg, global_batch(cfg, step), 0, 1))
        out["loss"].append(res.loss)
        out["grad_norm"].append(res.grad_norm)
        out["graphs"].append(len(graphs))
        (state,) = fp8_states(trainer.stages)
        out["state"].append(None if state.history is None else
                            (state.history.clone(), state.scale.clone(), state.inv.clone(), state.pos,
                             sorted(state.recorded_columns())))
    loss_sum, tokens = trainer.eval_batches(dp_micro_batches(cfg, global_batch(cfg, 10_000), 0, 1))
    out["eval"] = loss_sum / tokens
    out["graphs"].append(len(graphs))
    (state,) = fp8_states(trainer.stages)
    out["after_eval"] = None if state.history is None else (state.history.clone(), state.scale.clone())
    return out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return _bytes_equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("fmt,recipe,dropout", [("hybrid", "current", 0.0), ("e4m3", "current", 0.0),
                                                ("hybrid", "delayed", 0.0), ("hybrid", "delayed", 0.2)])
@pytest.mark.slow
def test_compiled_fp8_trains_to_the_eager_losses(fmt, recipe, dropout, monkeypatch):
    """Three training steps of four micro-batches through the trainer (bf16 weights, fp32
    gradient buffer: the traced weight gradients reach ``main_grad`` through ``param.grad`` and
    the buffer's hook, the eager ones through ``add_grad``), then an evaluation: the compiled
    blocks give the eager FP8 losses, gradient norms and evaluation loss exactly; under
    delayed scaling also the same amax history, scales and ready operands after every step
    (the input and weight amaxes recorded in the forward graphs, the output gradient's in the
    backward graphs), with no graph break and one compile per block kind for the first step
    (the attention's bias made before the blocks run), one more under delayed scaling when its
    operands turn ready (their casts take the step's scales; not per step), and one for the
    evaluation: both blocks and every micro-batch on the same graphs. Without dropout each
    training graph holds a block's four FP8 GEMMs (eight in the backward, whose output-gradient
    casts are the recipe's gradient format), the evaluation's its four; under delayed scaling
    each backward graph writes the four output gradients' amaxes into graph inputs (the
    layers' ``grad_amax``). With dropout the attention module (and its two FP8 linears) runs
    eagerly inside the compiled blocks while the MLP's are traced: both record into the same
    state."""
    model = {"num_layers": 2, "hidden_dropout": dropout, "attention_dropout": dropout}
    over = {**FP8, "fp8": fmt, "fp8_recipe": recipe, "model": model, "train": {"steps": 3}}
    graphs, forward, backward = [], [], []

    def recorder(kept):  # aot_eager's graphs, kept
        def compiler(gm, example_inputs):
            kept.append(gm)
            return boxed_nop(gm, example_inputs)
        return compiler

    def backend(gm, example_inputs):  # aot_eager, counting the graphs Dynamo hands it
        graphs.append(gm)
        return aot_eager(gm, example_inputs, fw_compiler=recorder(forward), bw_compiler=recorder(backward))

    with torch.backends.mkldnn.flags(enabled=False):
        eager = _train(tiny_config(over), 3, graphs)
        compile_block = torch.nn.Module.compile
        monkeypatch.setattr(gpt_module.TransformerBlock, "compile", lambda self: compile_block(self, backend=backend))
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        compiled = _train(tiny_config({**over, "train": {"steps": 3, "compile": True}}), 3, graphs)
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    assert bool(breaks) == (dropout > 0), breaks  # the traced path ran (with dropout: the attention's break)
    n = compiled["graphs"]
    if not dropout:
        assert n == [1, 1 + (recipe == "delayed"), n[1], n[1] + 1], n
        # training: a forward and a backward graph per compile; the evaluation: one forward
        assert len(forward) == n[3] and len(backward) == n[2], (len(forward), len(backward), n)
        mms = [sum(1 for node in gm.graph.nodes if node.target is torch.ops.aten._scaled_mm.default)
               for gm in forward + backward]
        assert mms == [4] * n[3] + [8] * n[2], mms
        # (E4M3, E5M2) casts: the inputs' and weights' in the forward, the output gradients' (the
        # recipe's gradient format) in the backward
        grads = (0, 4) if fmt == "hybrid" else (4, 0)
        casts = [(_fp8_casts(gm.graph, E4M3), _fp8_casts(gm.graph, E5M2)) for gm in forward + backward]
        assert casts == [(2 * 4, 0)] * n[3] + [grads] * n[2], casts
        writes = [_input_writes(gm.graph) for gm in backward]
        assert writes == [0 if recipe == "current" else 4] * n[2], writes
    for key in ("loss", "grad_norm", "eval"):
        assert compiled[key] == eager[key], key
    if recipe == "delayed":  # 8 FP8 linears, all operands recorded, one history row per step
        assert eager["state"][2][3] == 2 and len(eager["state"][2][4]) == 3 * 8
        assert (eager["state"][2][0][:3] > 0).all() and (eager["state"][2][0][3:] == 0).all()
    for k, (got, want) in enumerate(zip(compiled["state"], eager["state"])):
        assert _same(got, want), f"FP8 state after step {k}"
    assert _same(compiled["after_eval"], eager["after_eval"])  # the evaluation records nothing


@pytest.mark.gpu
def test_inductor_compiles_the_traced_fp8_linear_to_the_eager_results():
    """The traced linear under inductor (``fullgraph``: no graph break) against the eager FP8
    linear with current scaling (Triton casts on CUDA), forward and both gradients: inductor's
    own cast kernels and its ``_scaled_mm`` call with the column-major operands. The FP8 bytes
    may differ where inductor computes a scale one ulp apart, so the results agree to FP8
    precision, not bit for bit."""
    dev = gpu_test_device(fp8=True)
    if dev == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a CUDA GPU with FP8 (compute capability 8.9+)")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 250, 256, generator=g).bfloat16().to(dev)  # 1000 tokens: padded to 1008
    w = (torch.randn(512, 256, generator=g) * 0.05).bfloat16().to(dev)
    gy = torch.randn(4, 250, 512, generator=g).bfloat16().to(dev)
    recipe = Fp8Recipe("hybrid", "current")
    layer = Fp8State(recipe, dev).new_layer()
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b: fp8_linear_traced(a, b, recipe.grad_dtype), fullgraph=True)
    outs = []
    for fn in (lambda a, b: fp8_linear(a, b, layer), compiled):
        xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xa, wa)
        y.backward(gy)
        outs.append([t.detach().float() for t in (y, xa.grad, wa.grad)])
    for what, got, want in zip(("y", "dX", "dW"), outs[1], outs[0]):
        err = ((got - want).norm() / want.norm()).item()
        assert err < 2e-2, (what, err)


@pytest.mark.gpu
def test_inductor_compiles_the_delayed_scaled_traced_fp8_linear():
    """Delayed scaling under inductor (``fullgraph``): two training steps of two micro-batches
    (the first current-scaled, the second on the scales from the first's amaxes) against the
    eager FP8 linear (Triton casts on CUDA): the same amax history and scales (an amax is exact
    whoever computes it; the output gradients are given), the results to FP8 precision. Checks
    that inductor keeps the forward's amax writes and the backward's write of the gradient's
    amax into the layer's tensors."""
    dev = gpu_test_device(fp8=True)
    if dev == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a CUDA GPU with FP8 (compute capability 8.9+)")
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(4, 250, 256, generator=g).mul(s).bfloat16().to(dev) for s in (1.0, 3.0, 0.5, 2.0)]
    w = (torch.randn(512, 256, generator=g) * 0.05).bfloat16().to(dev)
    gys = [torch.randn(4, 250, 512, generator=g).mul(s).bfloat16().to(dev) for s in (1e-3, 4e-3, 2e-3, 1e-3)]
    recipe = Fp8Recipe("hybrid", "delayed", amax_history=4)
    layers = [Fp8State(recipe, dev).new_layer() for _ in range(2)]
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b: fp8_linear_traced(a, b, recipe.grad_dtype, layers[1]), fullgraph=True)
    outs = [[], []]
    for step in range(2):
        for i, (layer, fn) in enumerate(zip(layers, (lambda a, b: fp8_linear(a, b, layers[0]), compiled))):
            layer.state.begin_step()
            wa = w.clone().requires_grad_()  # one weight for the step (the eager path caches its cast)
            for x, gy in zip(xs[2 * step:2 * step + 2], gys[2 * step:2 * step + 2]):
                xa = x.clone().requires_grad_()
                wa.grad = None
                y = fn(xa, wa)
                y.backward(gy)
                outs[i].append([t.detach().float() for t in (y, xa.grad, wa.grad)])
            layer.state.end_step()
        eager_state, traced_state = (layer.state for layer in layers)
        assert torch.equal(traced_state.history, eager_state.history), step
        assert torch.equal(traced_state.scale, eager_state.scale), step
    assert (eager_state.history[:2] > 0).all() and layers[1].ready == (True, True, True)
    for k, (got, want) in enumerate(zip(outs[1], outs[0])):
        for what, a, b in zip(("y", "dX", "dW"), got, want):
            err = ((a - b).norm() / b.norm()).item()
            assert err < 2e-2, (k, what, err)
