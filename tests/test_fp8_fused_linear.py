"""FP8 casts fused into the producer of a linear's input (``fp8_fused_casts``,
``parallel/fp8_prologue.py``): LayerNorm -> QKV / fc1, GELU -> fc2, with the ``torch`` casts on the CPU.

* fused vs unfused: the same bytes. Per-token losses and every parameter's gradient of a model
  (bf16, two FP8 steps: current-scaled, then delayed) with and without the LayerNorm's bias,
  both recipes, full recomputation; three trainer steps (losses, gradient norms, evaluation and
  the weights after them); TP 2 over gloo (fc2 fuses, QKV and fc1 do not: the layers' own rule
  too, given fused casts);
* the layers took the fused path: the fused linears (counted) are the ones the run log lists,
  through ``Fp8State.norm_cast`` / ``cast(gelu=True)``; RMSNorm and SwiGLU stay unfused;
* the kernel dispatch (Triton / C++ names of the shared spec, stood in for by the reference
  math): the LayerNorm kernel only under a ready delayed scale, with the step's scale and amax
  slots; GELU through the cast kernel's ``gelu`` flag;
* config errors name ``fp8_fused_casts``.
"""
from __future__ import annotations

import pytest
import torch

from dept_mega.config import ConfigError
from dept_mega.model import build_model, resolve_backends
from dept_mega.model.backends import GEMMS, BackendError, fused_cast_gemms, unfused_cast_reasons
from dept_mega.parallel import fp8_casts, fp8_kernels
from dept_mega.parallel import layers as layers_module
from dept_mega.parallel.fp8 import E4M3, INPUT, Fp8Recipe, Fp8State, _cast_math, fp8_weight_cache
from dept_mega.parallel.groups import build_groups
from dept_mega.parallel.fp8_prologue import GELU
from dept_mega.parallel.layers import ColumnParallelLinear, LinearGemm, RowParallelLinear
from tests.mp_utils import run_distributed
from tests.trainer_utils import VOCAB, global_batch, merge, tiny_config, train_losses

BASE = {"precision": "bf16", "fp8": "hybrid", "fp8_casts": "torch", "optim": {"lr": 1.0e-2}}


class FusedCalls:
    """Records ``(module name, prologue kind)`` of every fused call of the parallel linears."""

    def __init__(self, monkeypatch, modules) -> None:
        self.calls: list[tuple[str, str]] = []
        names = {id(m.fp8_layer): n for st in modules for n, m in st.named_modules()
                 if getattr(m, "fp8_layer", None) is not None}
        real = layers_module.fp8_prologue_linear

        def spy(x, weight, layer, prologue):
            self.calls.append((names[id(layer)], prologue.fp8_prologue))
            return real(x, weight, layer, prologue)
        monkeypatch.setattr(layers_module, "fp8_prologue_linear", spy)

    def kinds(self) -> dict[str, str]:
        """Which linear (``attention.qkv`` ...) fused which prologue, over every layer."""
        return dict(sorted({(n.split(".", 3)[-1], k) for n, k in self.calls}))


def _model_grads(over: dict, fused: bool, monkeypatch=None) -> tuple[dict, list]:
    """Per-token losses and parameter gradients of two FP8 training steps of a bf16 model
    (outside the trainer: gradients into ``param.grad``), and the fused calls."""
    cfg = tiny_config(merge(BASE, merge(over, {"fp8_fused_casts": fused})))
    stages = build_model(cfg, build_groups(), VOCAB, seed=3, dtype=torch.bfloat16)
    spy = FusedCalls(monkeypatch, stages) if monkeypatch is not None else None
    stage = stages[0]
    losses = []
    for step in range(2):
        tokens = global_batch(cfg, step)[:2]
        with fp8_weight_cache(stages):
            loss = stage(tokens[:, :-1], tokens[:, 1:])
            loss.float().sum().backward()
        losses.append(loss.detach())
    grads = {n: p.grad for n, p in stage.named_parameters()}
    return {"loss": losses, "grads": grads}, (spy.calls if spy is not None else [])


def _assert_same(a: dict, b: dict) -> None:
    for x, y in zip(a["loss"], b["loss"]):
        assert torch.equal(x, y)
    assert a["grads"].keys() == b["grads"].keys()
    for name in a["grads"]:
        ga, gb = a["grads"][name], b["grads"][name]
        assert (ga is None) == (gb is None), name
        assert ga is None or torch.equal(ga, gb), name


@pytest.mark.parametrize("recipe,norm_bias,recompute", [("delayed", True, "none"), ("delayed", False, "full"),
                                                        ("current", True, "full"), ("current", False, "none")])
def test_fused_model_gradients_equal_unfused(recipe, norm_bias, recompute, monkeypatch):
    """Losses and every gradient (LayerNorm weight and bias included) bit for bit; every block's
    QKV and fc1 fused their LayerNorm and fc2 its GELU, in every forward (recomputed ones too)."""
    over = {"fp8_recipe": recipe, "model": {"norm_bias": norm_bias, "recompute": recompute}}
    got, calls = _model_grads(over, True, monkeypatch)
    want, none = _model_grads(over, False, monkeypatch)
    _assert_same(got, want)
    assert not none
    blocks, forwards = 4, 2 * (2 if recompute == "full" else 1)
    assert len(calls) == 3 * blocks * forwards
    assert {k for _, k in calls} == {"layernorm", "gelu"}
    assert dict(sorted({(n.split(".", 3)[-1], k) for n, k in calls})) == {
        "attention.qkv": "layernorm", "mlp.fc1": "layernorm", "mlp.fc2": "gelu"}
    assert got["grads"]["body.layers.0.input_norm.weight"].abs().sum() > 0
    if norm_bias:
        assert got["grads"]["body.layers.0.mlp_norm.bias"].abs().sum() > 0


def _train(over: dict, fused: bool, steps: int = 3) -> dict:
    return train_losses(tiny_config(merge(BASE, merge(over, {"fp8_fused_casts": fused}))), steps, weights=True)


def _assert_same_run(a: dict, b: dict, what: str) -> None:
    assert (a["loss"], a["grad_norm"], a["eval"]) == (b["loss"], b["grad_norm"], b["eval"]), what
    assert len(set(a["loss"])) == len(a["loss"]), what  # the steps trained
    for name, w in a["weights"].items():
        assert torch.equal(w, b["weights"][name]), (what, name)


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_fused_training_equals_unfused(recipe, monkeypatch):
    """Three trainer steps (gradient buffers, two micro-batches each, evaluation): the same
    losses, gradient norms, evaluation loss and weights; the run log lists the fused linears."""
    over = {"fp8_recipe": recipe}
    cfg = tiny_config(merge(BASE, {**over, "fp8_fused_casts": True}))
    apart = "run apart: the torch casts have no fused kernel"
    dgelu = (f"dgelu (fc1's output gradient, {apart})" if recipe == "delayed" else
             "not fused: dgelu (current scaling: the dGELU's fused cast needs a delayed scale)")
    assert (f"fused casts (fp8_fused_casts) [qkv (layernorm, {apart}), fc1 (layernorm, {apart}), fc2 (gelu, "
            f"{apart}), {dgelu}]") in resolve_backends(cfg, "cpu").describe()
    assert "fused casts" not in resolve_backends(tiny_config(merge(BASE, {**over, "fp8_fused_casts": False})),
                                                 "cpu").describe()
    # the default (auto) on the CPU: nothing fuses, and the log says why
    assert ("fused casts (fp8_fused_casts: null = auto) [none, not fused: qkv, fc1, fc2, dgelu (auto: not on a GPU (auto "
            "fuses for the fused kernels' GPU speed))]") in resolve_backends(tiny_config(merge(BASE, over)), "cpu").describe()
    norm_casts, gelu_casts = [], []
    real_norm, real_cast = Fp8State.norm_cast, Fp8State.cast
    monkeypatch.setattr(Fp8State, "norm_cast", lambda self, *a, **k: norm_casts.append(1) or real_norm(self, *a, **k))
    monkeypatch.setattr(Fp8State, "cast", lambda self, *a, gelu=False, **k:
                        (gelu_casts.append(1) if gelu else None) or real_cast(self, *a, gelu=gelu, **k))
    got = _train(over, True)
    # 3 steps x 4 micro-batches x 4 blocks, and the evaluation's 4 micro-batches x 4 blocks, twice (qkv, fc1)
    assert len(norm_casts) == 2 * 4 * (3 * 4 + 4) and len(gelu_casts) == 4 * (3 * 4 + 4)
    norm_casts.clear()
    _assert_same_run(got, _train(over, False), recipe)
    assert not norm_casts


def _tp2_worker(rank: int, world_size: int) -> dict:
    import pytest as _pytest
    torch.manual_seed(0)
    out = {}
    for sp in (False, True):
        for fused in (True, False):
            with _pytest.MonkeyPatch.context() as mp:
                calls = []
                real = layers_module.fp8_prologue_linear
                mp.setattr(layers_module, "fp8_prologue_linear",
                           lambda x, w, layer, p: calls.append(p.fp8_prologue) or real(x, w, layer, p))
                run = _train({"parallel": {"tensor": 2, "sequence_parallel": sp}}, fused, steps=2)
            out[(sp, fused)] = (run, calls)
    out["fuses"] = _layers_fuse(build_groups(2))
    return out


def _layers_fuse(pg) -> tuple[bool, ...]:
    """Whether a column-parallel, a row-parallel and a row-parallel layer with a full input, all
    with ``fused_casts``, fuse a GELU prologue on ``pg``'s tensor ranks."""
    gemm = LinearGemm("fp8", Fp8State(Fp8Recipe(), "cpu", kernels="torch"), fused_casts=True)
    kw = dict(seed=0, init_std=0.1, gemm=gemm)
    return (ColumnParallelLinear(32, 64, pg, name="c", **kw)._fuses(GELU),
            RowParallelLinear(64, 32, pg, name="r", **kw)._fuses(GELU),
            RowParallelLinear(64, 32, pg, name="f", input_is_parallel=False, **kw)._fuses(GELU))


@pytest.mark.timeout(120)
def test_tp2_fuses_fc2_only_and_trains_as_unfused():
    """TP 2 (gloo), with and without sequence parallelism: fc2 (row-parallel, the input is this
    rank's) fuses its GELU; QKV and fc1 (an all-gather / copy between the norm and the GEMM) do
    not; the results equal the unfused ones."""
    assert fused_cast_gemms(tiny_config(BASE).model, 2, GEMMS) == ("fc2", "dgelu")
    assert unfused_cast_reasons(tiny_config(BASE).model, 2, GEMMS) == (
        "qkv, fc1 (parallel.tensor 2: a collective sits between the norm and the GEMM)",)
    assert unfused_cast_reasons(tiny_config(BASE).model, 1, GEMMS) == ()
    assert _layers_fuse(build_groups()) == (True, True, True)
    for rank, out in enumerate(run_distributed(_tp2_worker, 2, timeout=110)):
        for sp in (False, True):
            (on, calls), (off, none) = out[(sp, True)], out[(sp, False)]
            assert set(calls) == {"gelu"} and len(calls) == 2 * 4 * 4 + 4 * 4 and not none, (rank, sp)
            _assert_same_run(on, off, f"rank {rank}, sequence parallel {sp}")
        assert out["fuses"] == (False, True, False), rank  # the layers' own rule, whatever they are given


@pytest.mark.parametrize("model,want", [({"normalization": "rmsnorm"}, {"mlp.fc2": "gelu"}),
                                        ({"activation": "swiglu"}, {"attention.qkv": "layernorm",
                                                                    "mlp.fc1": "layernorm"}),
                                        ({"normalization": "rmsnorm", "activation": "swiglu"}, {})])
def test_rmsnorm_and_swiglu_stay_unfused(model, want, monkeypatch):
    """RMSNorm and SwiGLU have no fused cast: those linears run the prologue and the usual path
    (the same bytes); the others still fuse, as the run log says."""
    got, calls = _model_grads({"model": model}, True, monkeypatch)
    assert dict(sorted({(n.split(".", 3)[-1], k) for n, k in calls})) == want
    _assert_same(got, _model_grads({"model": model}, False)[0])
    names = {"attention.qkv": "qkv", "mlp.fc1": "fc1", "mlp.fc2": "fc2"}
    cfg = tiny_config(merge(BASE, {"model": model, "fp8_fused_casts": True}))
    backends = resolve_backends(cfg, "cpu")
    fused = tuple(g for g in GEMMS if g in {names[k] for k in want})
    assert backends.fp8_fused_casts == fused + (("dgelu",) if "fc2" in fused else ())  # fc1's gradient with fc2
    line = backends.describe()
    if not want:  # on, but nothing to fuse: the log says so
        assert "fused casts (fp8_fused_casts) [none, not fused: " in line, line
    if model.get("normalization") == "rmsnorm":  # and why the others do not fuse
        assert "qkv, fc1 (rmsnorm has no fused cast)" in line, line
    if model.get("activation") == "swiglu":
        assert "fc2, dgelu (swiglu has no fused cast)" in line, line


def _reference_kernels(monkeypatch, log: list) -> None:
    """Stand-ins for the spec's kernels (Triton and C++ names), computing the reference math and
    recording their calls."""
    def cast(t, dtype, pad=0, rowwise=True, colwise=False, scale=None, scale_index=0, amax_out=None,
             amax_index=0, gelu=False):
        log.append(("cast", gelu, scale is not None))
        q, q_t, inv, amax = _cast_math(t, None if scale is None else scale[scale_index], dtype, pad, rowwise,
                                       colwise, gelu)
        if amax_out is not None:
            amax_out[amax_index] = torch.maximum(amax_out[amax_index], amax)
        return q, q_t, (inv if scale is None else None)

    def layernorm_cast(x, weight, bias, eps, dtype, pad=0, rowwise=True, colwise=False, *, scale,
                       scale_index=0, amax_out=None, amax_index=0):
        log.append(("layernorm", scale_index, amax_index, amax_out))
        y, mean, rstd = torch.native_layer_norm(x, (x.shape[1],), weight, bias, eps)
        q, q_t, _ = cast(y, dtype, pad, rowwise, colwise, scale, scale_index, amax_out, amax_index)
        log.pop()
        return q, q_t, mean, rstd

    monkeypatch.setattr(fp8_kernels, "cast_fp8", cast)
    monkeypatch.setattr(fp8_kernels, "layernorm_cast_fp8", layernorm_cast, raising=False)
    monkeypatch.setattr(fp8_casts, "layernorm_cast_fp8", layernorm_cast, raising=False)


@pytest.mark.parametrize("kernels", ["triton", "cuda"])
def test_kernel_dispatch_of_the_fused_casts(kernels, monkeypatch):
    """``Fp8State.norm_cast`` calls the LayerNorm kernel only under a ready delayed scale (a
    first step, an evaluation and the current recipe normalise, then cast), with the step's scale
    and the layer's amax slot, and gives the reference's bytes; ``cast(gelu=True)`` reaches the
    cast kernel's ``gelu`` flag (the C++ operator's last positional argument)."""
    log = []
    _reference_kernels(monkeypatch, log)
    recipe = Fp8Recipe("hybrid", "delayed", amax_history=4)
    state, ref = Fp8State(recipe, "cpu", kernels="torch"), Fp8State(recipe, "cpu", kernels="torch")

    def use_kernels(s: Fp8State) -> None:
        s.kernels = kernels
        if kernels == "cuda":  # the operator: (t, dtype, pad, rowwise, colwise, scale, ..., amax_index[, gelu])
            def op(*a):
                log.append(("op", a[9:] == (True,), a[5] is not None))
                return fp8_kernels.cast_fp8(*a[:9], gelu=len(a) > 9 and a[9])
            s._cast_op = op
    use_kernels(state)
    layers, refs = [state.new_layer() for _ in range(2)], [ref.new_layer() for _ in range(2)]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 64, generator=g).bfloat16() * 3
    w, b = (torch.randn(64, generator=g).bfloat16() for _ in range(2))
    for step, train in enumerate((True, True, False)):
        for s in (state, ref):
            s.begin_step(train)
        log.clear()
        got = state.norm_cast(x, w, b, 1e-5, layers[1].index, 8, colwise=True)
        want = ref.norm_cast(x, w, b, 1e-5, refs[1].index, 8, colwise=True)
        gq = state.cast(x, layers[0].index, INPUT, E4M3, 8, colwise=True, gelu=True)
        wq = ref.cast(x, refs[0].index, INPUT, E4M3, 8, colwise=True, gelu=True)
        for a, c in zip(got + gq, want + wq):
            assert torch.equal(a.view(torch.uint8) if a.dtype == E4M3 else a, c.view(torch.uint8)
                               if c.dtype == E4M3 else c), step
        fused = [e for e in log if e[0] == "layernorm"]
        if step == 1:  # the second training step: the input's scale is ready
            assert len(fused) == 1 and fused[0][1:3] == (3 * layers[1].index + INPUT, INPUT)
            assert fused[0][3] is layers[1].amax
        else:
            assert not fused
        assert ("cast", True, step == 1) in log or ("op", True, step == 1) in log
        if train:
            assert torch.equal(layers[1].amax, refs[1].amax) and layers[1].recorded_fwd
        for s in (state, ref):
            s.end_step()
    assert torch.equal(state.history, ref.history)
    current = Fp8State(Fp8Recipe("hybrid", "current"), "cpu", kernels="torch")
    use_kernels(current)
    layer = current.new_layer()
    for _ in range(2):
        current.begin_step()
        log.clear()
        current.norm_cast(x, w, None, 1e-5, layer.index, 8)
        assert not [e for e in log if e[0] == "layernorm"]
        current.end_step()


def test_config_errors_name_the_key(monkeypatch):
    """``fp8_fused_casts`` without fp8, with train.compile or with Transformer Engine's linears is
    an error naming the key; a non-FP8 GEMM cannot take fused casts."""
    with pytest.raises(ConfigError, match="config key 'fp8_fused_casts': true fuses casts into the native FP8 "
                                          "linears, but fp8 is off"):
        tiny_config({"fp8_fused_casts": True})
    with pytest.raises(ConfigError, match="config key 'fp8_fused_casts': the fused casts run in the eager FP8 "
                                          "linears; under train.compile"):
        tiny_config(merge(BASE, {"fp8_fused_casts": True, "train": {"compile": True}}))
    with pytest.raises(ConfigError, match="config key 'fp8_fused_casts': true applies to the native FP8 linears"):
        tiny_config(merge(BASE, {"fp8_fused_casts": True, "backend": "transformer_engine"}))
    from dept_mega.model import backends as backends_module
    monkeypatch.setattr(backends_module, "_resolve_linear", lambda cfg, device: ("transformer_engine", []))
    with pytest.raises(BackendError, match="config key 'fp8_fused_casts': true applies to the native FP8 linears"):
        resolve_backends(tiny_config(merge(BASE, {"fp8_fused_casts": True})), "cpu")
    with pytest.raises(ValueError, match="fused FP8 casts are for fp8 GEMMs, not 'torch'"):
        LinearGemm(fused_casts=True)


def test_torch_casts_round_the_gelu_when_compiled(monkeypatch):
    """The ``torch`` casts' GELU (``fp8_math._cast``) gives the unfused path's bytes when its cast
    runs compiled, as on CUDA (here inductor on the CPU): inside one graph inductor would drop the
    GELU's rounding to bf16 and cast the fp32 values (thousands of bytes apart at this size)."""
    from dept_mega.parallel import fp8_math

    monkeypatch.setattr(fp8_math._CAST, "on", lambda device: fp8_math._CAST.compiled)
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(1024, 128, generator=g) * 3).bfloat16()
    scale = torch.tensor(37.0)
    got = fp8_math._cast(h, scale, E4M3, 0, True, True, gelu=True)
    want = _cast_math(torch.nn.functional.gelu(h), scale, E4M3, 0, True, True)
    for a, b in zip(got, want):
        assert torch.equal(a.view(torch.uint8) if a.dtype == E4M3 else a, b.view(torch.uint8) if b.dtype == E4M3 else b)


_DGELU_CUDA = ("dgelu (fc1's output gradient, one kernel in fc2's backward once the gradient has a delayed scale "
               "(from the second training step))")


@pytest.mark.parametrize("casts,recipe,ln,gelu,dgelu", [
    ("cuda", "delayed", "one kernel once the input has a delayed scale (from the second training step)", "one kernel",
     ", " + _DGELU_CUDA),
    ("cuda", "current", "normalised, then cast: current scaling", "one kernel",
     ", not fused: dgelu (current scaling: the dGELU's fused cast needs a delayed scale)"),
    ("torch", "delayed", "run apart: the torch casts have no fused kernel",
     "run apart: the torch casts have no fused kernel",
     ", dgelu (fc1's output gradient, run apart: the torch casts have no fused kernel)")])
def test_run_log_says_how_the_fused_casts_run(casts, recipe, ln, gelu, dgelu):
    """The run log does not claim one kernel where the path runs the producer, then the cast
    (the torch casts; the LayerNorm under current scaling), and names apex's LayerNorm replaced."""
    import dataclasses

    if casts == "cuda" and fp8_casts.op_unavailable("cpu") is not None:
        pytest.skip(f"the C++ cast operator is unavailable: {fp8_casts.op_unavailable('cpu')}")
    cfg = tiny_config(merge(BASE, {"fp8_casts": casts, "fp8_recipe": recipe, "fp8_fused_casts": True}))
    backends = resolve_backends(cfg, "cpu")
    want = f"[qkv (layernorm, {ln}), fc1 (layernorm, {ln}), fc2 (gelu, {gelu}){dgelu}]"
    assert f"fused casts (fp8_fused_casts) {want}" in backends.describe()
    assert "not apex" not in backends.describe()
    assert "(those LayerNorms are computed by the fused path, not apex)" in dataclasses.replace(
        backends, norm="apex").describe()
    # nothing fuses and no reason applies (e.g. those GEMMs stay bf16 for their shapes): the line says why
    assert "fused casts (fp8_fused_casts) [none: no FP8 linear reads a LayerNorm or GELU output]" in \
        dataclasses.replace(backends, fp8_fused_casts=(), fp8_unfused=()).describe()



def _kernel_model_grads(fused: bool) -> dict:
    """``_model_grads`` with the C++ operators' CPU kernels and the norms' weights and biases
    drawn at random (their initial ones and zeros would hide a dropped bias or weight)."""
    cfg = tiny_config(merge(BASE, {"fp8_casts": "cuda", "fp8_fused_casts": fused, "model": {"norm_bias": True}}))
    stages = build_model(cfg, build_groups(), VOCAB, seed=3, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in stages[0].named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g) if name.endswith("weight")
                        else 0.5 * torch.randn(p.shape, generator=g))
    losses = []
    for step in range(2):
        tokens = global_batch(cfg, step)[:2]
        with fp8_weight_cache(stages):
            loss = stages[0](tokens[:, :-1], tokens[:, 1:])
            loss.float().sum().backward()
        losses.append(loss.detach())
    return {"loss": losses, "grads": {n: p.grad for n, p in stages[0].named_parameters()}}


def test_fused_kernels_train_as_unfused():
    """A model with the real fused kernels (the C++ operators' CPU kernels, ``fp8_casts: cuda``)
    against the same model unfused: the same losses up to the kernels' rare rounding differences,
    and gradients within 2 % (the LayerNorm statistics' rounding passes through the FP8 gradient
    casts; the rest of the math is the unfused path's). The second step runs the LayerNorm kernel
    (its input's delayed scale is ready)."""
    if fp8_casts.op_unavailable("cpu") is not None:
        pytest.skip(f"the C++ cast operators are unavailable: {fp8_casts.op_unavailable('cpu')}")
    got, want = _kernel_model_grads(True), _kernel_model_grads(False)
    for a, b in zip(got["loss"], want["loss"]):
        assert torch.allclose(a.float(), b.float(), rtol=1e-3, atol=1e-3)
    for name, g in want["grads"].items():
        rel = (got["grads"][name].float() - g.float()).norm() / g.float().norm().clamp(min=1e-12)
        assert rel < 2e-2, (name, rel.item())
