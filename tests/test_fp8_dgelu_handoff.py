"""fc1's output-gradient cast fused into fc2's GELU backward (``fp8_fused_casts``' ``dgelu``,
``parallel/fp8_dgelu.py``): the FP8 copies fc2's backward makes are handed to fc1's backward.

* taken: in every backward of a training step whose scale of fc1's output gradient is ready (not
  the first step), once per block and micro-batch, with and without recomputation, under pipeline
  and tensor parallelism; the results equal the unfused path's bit for bit with the ``torch`` casts,
  and up to the kernel's rare roundings with the C++ casts (their CPU kernels);
* not taken when fc1's backward receives another tensor than the dH that was cast (a copy, or dH
  changed in place): it casts what it receives, and the results still equal the unfused path's;
* not fused under current scaling, nor before the scale is ready; a handoff is used once and a
  step's close drops one left over.
"""
from __future__ import annotations

import pytest
import torch

from dept_mega.model import resolve_backends
from dept_mega.parallel import fp8_casts, fp8_dgelu, fp8_prologue
from dept_mega.parallel.fp8 import Fp8Recipe, Fp8State, fp8_weight_cache
from dept_mega.parallel.fp8_prologue import GELU, Gelu
from dept_mega.parallel.groups import build_groups
from dept_mega.parallel.layers import ColumnParallelLinear, LinearGemm, RowParallelLinear
from tests.mp_utils import run_distributed
from tests.test_fp8_fused_linear import BASE, _assert_same, _assert_same_run, _kernel_model_grads, _model_grads
from tests.trainer_utils import merge, tiny_config, train_losses


class Handoffs:
    """Spies: ``fused`` records each fused GELU backward (True: it cast fc1's gradient, False: it
    could not: no ready scale), ``taken`` each handoff's fate in fc1's backward."""

    def __init__(self, monkeypatch) -> None:
        self.fused: list[bool] = []
        self.taken: list[bool] = []
        real_take, real_fused = fp8_dgelu.Handoff.take, fp8_prologue.fused_gelu_backward

        def take(hand, *a):
            out = real_take(hand, *a)
            self.taken.append(out is not None)
            return out

        def fused(grad_u, h, up):
            out = real_fused(grad_u, h, up)
            self.fused.append(out is not None)
            return out
        monkeypatch.setattr(fp8_dgelu.Handoff, "take", take)
        monkeypatch.setattr(fp8_prologue, "fused_gelu_backward", fused)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_handoff_taken_and_gradients_equal_unfused(recompute, monkeypatch):
    """A model with the torch casts, two steps: in the first (no scale of fc1's gradient yet) every
    block's GELU backward runs unfused, in the second each casts fc1's gradient and fc1 takes it;
    losses and every gradient equal the unfused model's (fp8_fused_casts false) bit for bit."""
    over = {"model": {"recompute": recompute}}
    spy = Handoffs(monkeypatch)
    got, _ = _model_grads(over, True)
    assert spy.fused == [False] * 4 + [True] * 4 and spy.taken == [True] * 4
    spy.fused.clear()
    spy.taken.clear()
    want, _ = _model_grads(over, False)
    assert not spy.fused and not spy.taken  # unfused: nothing fused, nothing handed over
    _assert_same(got, want)


def test_cpp_kernel_handoff_trains_as_unfused(monkeypatch):
    """With the C++ operators (their CPU kernels, fp8_casts: cuda) the second step runs
    dgelu_cast_fp8 in every block and fc1 takes its copies; the same losses and gradients as
    unfused up to the kernels' rare roundings (the rule of test_fused_kernels_train_as_unfused)."""
    if fp8_casts.op_unavailable("cpu") is not None:
        pytest.skip(f"the C++ cast operators are unavailable: {fp8_casts.op_unavailable('cpu')}")
    calls = []
    real = fp8_dgelu._op()
    monkeypatch.setattr(fp8_dgelu, "_op", lambda: lambda *a: calls.append(a[7]) or real(*a))
    spy = Handoffs(monkeypatch)
    got = _kernel_model_grads(True)
    assert spy.taken == [True] * 4 and len(calls) == 4
    want = _kernel_model_grads(False)
    for a, b in zip(got["loss"], want["loss"]):
        assert torch.allclose(a.float(), b.float(), rtol=1e-3, atol=1e-3)
    for name, g in want["grads"].items():
        rel = (got["grads"][name].float() - g.float()).norm() / g.float().norm().clamp(min=1e-12)
        assert rel < 2e-2, (name, rel.item())


def _mlp(scaling: str, fused: bool, hook=None, steps: int = 3):
    """fc1 -> GELU -> fc2 as the MLP wires them (fc2's GELU fused; with ``fused`` fc1's gradient
    cast too), ``hook`` on the gradient of fc1's output; ``steps`` training steps of one micro-batch:
    (the input's and the weights' gradients of the last step, fc1's layer)."""
    state = Fp8State(Fp8Recipe("hybrid", scaling, amax_history=4), "cpu", kernels="torch")
    kw = dict(seed=0, init_std=0.1, dtype=torch.bfloat16)
    fc1 = ColumnParallelLinear(32, 64, build_groups(), name="fc1",
                               gemm=LinearGemm("fp8", state, fused_dgelu=fused), **kw)
    fc2 = RowParallelLinear(64, 32, build_groups(), name="fc2", gemm=LinearGemm("fp8", state, fused_casts=True), **kw)
    gelu = Gelu(fc1) if fused else GELU
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(40, 32, generator=g).bfloat16().requires_grad_()
        for p in (*fc1.parameters(), *fc2.parameters()):
            p.grad = None
        with fp8_weight_cache([fc1, fc2]):
            h = fc1(x)
            if hook is not None:
                h.register_hook(hook)
            fc2(h, prologue=gelu).float().square().sum().backward()
    return [x.grad, fc1.weight.grad, fc2.weight.grad], fc1.fp8_layer


def _double_in_place(g):
    g.mul_(2)


@pytest.mark.parametrize("hook,taken", [(None, True), (lambda g: g.clone(), False), (_double_in_place, False)],
                         ids=["same-tensor", "a-copy", "changed-in-place"])
def test_handoff_taken_only_for_the_tensor_it_cast(hook, taken, monkeypatch):
    """fc1 takes the copies only when the gradient it receives is the dH fc2's backward cast (the
    same storage, shape, strides and version): a hook that hands over a copy, or one that changes
    dH in place, makes it cast what it receives; the gradients equal the unfused path's with the
    same hook either way; the handoff is gone after the backward."""
    spy = Handoffs(monkeypatch)
    got, layer = _mlp("delayed", True, hook)
    assert spy.fused == [False, True, True] and spy.taken == [taken, taken]
    assert layer.handoff is None
    want, _ = _mlp("delayed", False, hook)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_not_fused_under_current_scaling_and_a_left_handoff_is_dropped(monkeypatch):
    """Current scaling: the GELU backward never fuses (the cast's scale is not known before dH is);
    a handoff left (fc1's backward never ran) is dropped when the step closes."""
    spy = Handoffs(monkeypatch)
    got, _ = _mlp("current", True)
    assert spy.fused == [False] * 3 and not spy.taken
    for a, b in zip(got, _mlp("current", False)[0]):
        assert torch.equal(a, b)
    state = Fp8State(Fp8Recipe("hybrid", "delayed"), "cpu", kernels="torch")
    up = state.new_layer()
    for _ in range(2):
        state.begin_step()
        dh = fp8_dgelu.fused_gelu_backward(torch.ones(16, 32).bfloat16(), torch.ones(16, 32).bfloat16(), up)
        assert (dh is None) == (up.handoff is None)
        up.recorded_grad = True  # as fc1's own cast would in the first step
        state.end_step()
        assert up.handoff is None
    assert dh is not None


def test_run_log_lists_the_dgelu_cast():
    """fp8_fused_casts true lists it (delayed scaling), or says why not (current scaling, the Triton
    casts, SwiGLU); null (auto) fuses it on a GPU with the C++ casts (measured faster), not under
    current scaling."""
    from dept_mega.model.fused_casts import fused_cast_gemms, unfused_cast_reasons

    m = tiny_config(BASE).model
    gemms = ("qkv", "proj", "fc1", "fc2")
    assert fused_cast_gemms(m, 1, gemms) == ("qkv", "fc1", "fc2", "dgelu")
    assert fused_cast_gemms(m, 1, gemms, None, "cuda", gpu=True) == ("qkv", "fc1", "fc2", "dgelu")
    assert unfused_cast_reasons(m, 1, gemms, None, "cuda", gpu=True) == ()
    assert unfused_cast_reasons(m, 1, gemms, None, "cuda", "current", gpu=True)[-1] == (
        "dgelu (current scaling: the dGELU's fused cast needs a delayed scale)")
    assert unfused_cast_reasons(m, 1, gemms, True, "triton") == ("dgelu (the Triton casts have no fused dGELU cast)",)
    assert unfused_cast_reasons(m, 1, gemms, True, "cuda", "current") == (
        "dgelu (current scaling: the dGELU's fused cast needs a delayed scale)",)
    assert "dgelu" not in fused_cast_gemms(m, 1, ("qkv", "proj", "fc2"))  # fc1 stays bf16: nothing to hand over
    line = resolve_backends(tiny_config(merge(BASE, {"fp8_fused_casts": True})), "cpu").describe()
    assert "dgelu (fc1's output gradient, run apart: the torch casts have no fused kernel)]" in line, line


def _layouts_worker(rank: int, world_size: int) -> dict:
    import pytest as _pytest
    torch.manual_seed(0)
    out = {}
    for layout in ({"pipeline": 2}, {"tensor": 2, "sequence_parallel": True}):
        for fused in (True, False):
            with _pytest.MonkeyPatch.context() as mp:
                spy = Handoffs(mp)
                run = train_losses(tiny_config(merge(BASE, {"parallel": layout, "fp8_fused_casts": fused})), 2,
                                   weights=True)
            out[(str(layout), fused)] = (run, spy.taken)
    return out


@pytest.mark.timeout(200)
def test_pipeline_and_tensor_parallel_take_the_handoff_and_train_as_unfused():
    """PP 2 and TP 2 with sequence parallelism (gloo), two steps of 4 micro-batches: every block's
    fc1 takes the handoff in the second step (PP: the rank's 2 blocks; TP: 4), and the losses,
    gradient norms, evaluation and weights equal the unfused run's."""
    for rank, out in enumerate(run_distributed(_layouts_worker, 2, timeout=190)):
        for layout, blocks in (("{'pipeline': 2}", 2), ("{'tensor': 2, 'sequence_parallel': True}", 4)):
            (on, taken), (off, none) = out[(layout, True)], out[(layout, False)]
            assert taken == [True] * 4 * blocks and not none, (rank, layout, taken)
            _assert_same_run(on, off, f"rank {rank}, {layout}")
