"""Native FP8 GEMMs (``backend: local`` + ``fp8``): numerics against fp32, delayed scaling, which
layers run FP8, the per-step weight cache and the GEMM operand layouts, TP2 against TP1, and a
200-step training run against bf16."""
from __future__ import annotations

import contextlib

import pytest
import torch

import dept_mega.trainer as trainer_module
from dept_mega.parallel import fp8 as fp8_module

from dept_mega.config import ConfigError
from dept_mega.model import build_model, resolve_backends
from dept_mega.parallel.fp8 import E4M3, INPUT, Fp8Recipe, Fp8State, fp8_linear, quantize
from dept_mega.parallel.groups import build_groups
from tests.model_utils import full_tensors, reduce_sequence_parallel_grads, rel_err
from tests.mp_utils import run_distributed
from tests.trainer_utils import assert_close, dp_micro_batches, global_batch, tiny_config

# Error bounds (norm-wise relative error of an FP8 GEMM against the exact fp32 product).
# Round-to-nearest into a format with m mantissa bits has unit roundoff u = 2^-(m+1): e4m3
# (m=3) u = 1/16, e5m2 (m=2) u = 1/8. The rounding error of one element is spread roughly
# uniformly over ±u·|v|, so its RMS relative size is u/√3 (e4m3 0.036, e5m2 0.072); per-tensor
# scaling keeps Gaussian-like data in the normal range, where this holds. A GEMM of two
# independently rounded operands adds the two errors in quadrature:
#   forward  e4m3·e4m3: √2·0.036 = 0.051          -> bound 0.06
#   backward e5m2·e4m3 (hybrid): √(0.072²+0.036²) = 0.081 -> bound 0.10
#   backward e4m3·e4m3 (e4m3): 0.051              -> bound 0.06
# The bf16 output adds u = 2^-9, negligible. A lower bound of 0.01 (bf16 alone gives
# ~0.003) shows the operands really went through FP8.
FWD_BOUND = 0.06
BWD_BOUND = {"hybrid": 0.10, "e4m3": 0.06}
QUANTISED = 0.01


def _operands(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(40, 64, generator=g)  # 40 rows: exercises the padding to 48 rows
    w = torch.randn(96, 64, generator=g) * 0.02
    gy = torch.randn(40, 96, generator=g)
    return x, w, gy


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_fp8_linear_within_fp8_error_bounds(fmt, scaling):
    state = Fp8State(Fp8Recipe(fmt, scaling, amax_history=4), "cpu")
    layer = state.new_layer()
    for step in range(3):
        x, w, gy = _operands(step)
        xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
        state.begin_step()  # delayed: step 0 current scaling, steps 1-2 the scales of the steps before
        y = fp8_linear(xa, wa, layer)
        (y.float() * gy).sum().backward()
        state.end_step()
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        yr = xr @ wr.t()
        (yr * gy).sum().backward()
        assert y.dtype == torch.bfloat16 and xa.grad.dtype == torch.float32 and wa.grad.dtype == torch.float32
        assert torch.equal(wa.detach(), w)  # the master weight is not touched
        for got, ref, bound in ((y, yr, FWD_BOUND), (xa.grad, xr.grad, BWD_BOUND[fmt]),
                                (wa.grad, wr.grad, BWD_BOUND[fmt])):
            err = rel_err(got.float(), ref)
            assert QUANTISED < err < bound, (step, err)
    if scaling == "delayed":  # one row per step (of 4 + 1), each operand's amax recorded
        assert (state.history[:3] > 0).all() and (state.history[3:] == 0).all()
    else:
        assert state.history is None


def test_quantize_saturates_and_delayed_scaling_uses_the_history():
    q, inv = quantize(torch.tensor([1.0, -2.0, 4.0]), torch.tensor(2.0), E4M3)
    assert q.float().tolist() == [224.0, -448.0, 448.0] and float(inv) == pytest.approx(2.0 / 448.0)  # 4.0 saturates
    state = Fp8State(Fp8Recipe("hybrid", "delayed", amax_history=2), "cpu")
    layer = state.new_layer()
    w = torch.eye(16)
    for value in (100.0, 1e-4):
        state.begin_step()
        y = fp8_linear(torch.full((16, 16), value), w, layer)
        state.end_step()
    # the second step's input is small, but its scale comes from the first step's amax (100):
    # 1e-4·448/100 is below half of e4m3's smallest subnormal (2^-10) and flushes to zero
    assert float(y.abs().max()) == 0.0
    y = fp8_linear(torch.full((16, 16), 1e-4), w, layer)  # outside a training step: current scaling
    assert torch.allclose(y.float(), torch.full((16, 16), 1e-4), rtol=0.07)
    assert torch.allclose(state.history[:2, INPUT], torch.tensor([100.0, 1e-4]))  # one row per step


def _delayed_step(state, layer, w, x, discard=False):
    state.begin_step()
    fp8_linear(x.clone().requires_grad_(), w, layer).float().sum().backward()
    state.end_step()
    if discard:
        state.discard_step()


def test_a_discarded_step_leaves_the_delayed_scaling_state_as_if_it_had_not_run():
    """A step the trainer skips (non-finite loss or gradient norm) usually blew up first: its
    finite amaxes (here inputs ×1e6) would set the scales of the next ``fp8_amax_history``
    steps (every normal-sized operand then flushes to zero). Discarded, the state (history,
    ring position, scales) is that of the run without the step; a discarded first step leaves
    no operand ready (the next step current-scales, as a first step does)."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(16, 32, generator=g) for _ in range(4)]
    w = (torch.randn(32, 32, generator=g) * 0.1).requires_grad_()
    states = [Fp8State(Fp8Recipe("hybrid", "delayed", amax_history=3), "cpu") for _ in range(2)]
    layers = [s.new_layer() for s in states]
    for i, x in enumerate(xs):
        if i == 2:  # only the first state sees the diverging step, and discards it
            _delayed_step(states[0], layers[0], w, x * 1e6, discard=True)
        for s, layer in zip(states, layers):
            _delayed_step(s, layer, w, x)
        a, b = states
        assert a.pos == b.pos and torch.equal(a.history, b.history) and torch.equal(a.scale, b.scale), i
    for s in states:
        s.begin_step()
    assert torch.equal(states[0].scale, states[1].scale) and layers[0].ready == (True, True, True)
    for s in states:
        s.end_step()
    first = Fp8State(Fp8Recipe("hybrid", "delayed", amax_history=3), "cpu")
    layer = first.new_layer()
    _delayed_step(first, layer, w, xs[0] * 1e6, discard=True)
    first.begin_step()
    assert layer.ready == (False, False, False) and not first.history.any()
    y = fp8_linear(xs[1], w, layer)  # current scaling: within e4m3's error, not flushed to zero
    first.end_step()
    assert rel_err(y.float(), xs[1] @ w.detach().t()) < FWD_BOUND


def test_the_trainer_discards_a_skipped_steps_amaxes(monkeypatch):
    """Three delayed-scaling steps, the second skipped (its gradient norm made NaN): the
    history holds the two steps that ran, in consecutive rows."""
    from dept_mega.trainer import Trainer
    cfg = _fp8_cfg(fp8_recipe="delayed")
    trainer = Trainer(cfg, build_groups(), torch.device("cpu"), vocab_size=cfg.model.vocab_size)
    real, calls = trainer._grad_norm_tensor, []

    def norm(params):
        calls.append(1)
        return real(params) * (float("nan") if len(calls) == 2 else 1.0)
    monkeypatch.setattr(trainer, "_grad_norm_tensor", norm)
    skipped = [trainer.train_step(dp_micro_batches(cfg, global_batch(cfg, i), 0, 1)).skipped for i in range(3)]
    assert skipped == [False, True, False]
    (state,) = {id(m.fp8_layer.state): m.fp8_layer.state for st in trainer.stages for m in st.modules()
                if getattr(m, "fp8_layer", None) is not None}.values()
    assert state.pos == 1 and (state.history[:2] > 0).all() and not state.history[2:].any()


def _fp8_cfg(**over):
    over = {"precision": "bf16", "fp8": "hybrid", "fp8_recipe": "current", **over}
    return tiny_config(over)


def test_which_layers_run_fp8_and_the_log_line():
    cfg = _fp8_cfg(fp8_first_last_layers_bf16=True)
    (stage,) = build_model(cfg, build_groups(), 100, 1)
    kinds = {i: {n: stage.body.layers[str(i)].get_submodule(n).gemm.kind
                 for n in ("attention.qkv", "attention.proj", "mlp.fc1", "mlp.fc2")} for i in range(4)}
    assert set(kinds[0].values()) == {"torch"} and set(kinds[3].values()) == {"torch"}
    assert set(kinds[1].values()) == {"fp8"} and set(kinds[2].values()) == {"fp8"}
    assert stage.embeddings.output_layer is None  # tied head: F.linear on the embedding, bf16
    line = resolve_backends(cfg).describe()
    # (between them the default fp8_fused_casts' account: nothing fuses on the CPU, and why)
    assert "fp8 GEMMs [qkv, proj, fc1, fc2] in layers 1-2; bf16 layers 0, 3 (fp8_first_last_layers_bf16); " in line
    assert ("(auto: not on a GPU (auto fuses for the fused kernels' GPU speed))]; bf16 output head and "
            "embeddings") in line, line
    # a GEMM whose per-rank size is not a multiple of 16 stays bf16 (cuBLASLt's FP8 rule), logged
    cfg = _fp8_cfg(model={"ffn_hidden_size": 72})
    b = resolve_backends(cfg)
    assert b.fp8_gemms == ("qkv", "proj") and "bf16 GEMMs [fc1, fc2] (per-rank size not a multiple of 16)" in b.describe()
    (stage,) = build_model(cfg, build_groups(), 100, 1)
    assert stage.body.layers["0"].mlp.fc1.gemm.kind == "torch" and stage.body.layers["0"].attention.qkv.gemm.kind == "fp8"
    with pytest.raises(ConfigError, match="fp8.*needs precision: bf16"):
        _fp8_cfg(precision="fp32")


def _stage_losses_grads(cfg, pg):
    """Two training steps of the FP8 state on the same batch (the second delayed-scaled under
    ``fp8_recipe: delayed``), no optimizer: the second step's losses, the summed gradients."""
    (stage,) = build_model(cfg, pg, 100, 5)
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, 100, (2, 16), generator=g)
    labels = torch.randint(0, 100, (2, 16), generator=g)
    for _ in range(2):
        with fp8_module.fp8_weight_cache([stage]):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                losses = stage(tokens, labels)
            losses.mean().backward()
    reduce_sequence_parallel_grads(stage, pg)  # what the trainer does under sequence parallelism
    return losses.detach(), full_tensors(stage, pg, grads=True)


def test_cached_weight_operands_are_reused_in_the_layouts_the_gemm_takes(monkeypatch):
    """Inside an open step the weight is cast once; every forward GEMM takes that cast's
    row-major copy (as ``q.t()``) and every input-gradient GEMM its transposed copy (as
    ``q_t.t()``), views without a copy; the weight gradient takes both token-major copies made
    by the casts. Operands in another layout are refused on CPU too (cuBLASLt's rule)."""
    calls = []
    real_mm, real_qw = fp8_module._scaled_mm, fp8_module.quantize_weight
    monkeypatch.setattr(fp8_module, "_scaled_mm", lambda a, b, *s, **k: calls.append((a, b)) or real_mm(a, b, *s, **k))
    casts = []
    monkeypatch.setattr(fp8_module, "quantize_weight", lambda *a: casts.append(real_qw(*a)) or casts[-1])
    state = Fp8State(Fp8Recipe("hybrid", "current"), "cpu")
    layer = state.new_layer()
    x, w, gy = _operands(0)
    w = w.requires_grad_()
    state.begin_step()
    for _ in range(2):  # two micro-batches
        xa = x.clone().requires_grad_()
        (fp8_linear(xa, w, layer).float() * gy).sum().backward()
    state.end_step()
    (cast,) = casts
    assert len(calls) == 6  # forward, dX, dW per micro-batch
    for i in (0, 3):
        (fa, fb), (da, db), (wa, wb) = calls[i:i + 3]
        assert fb.data_ptr() == cast.q.data_ptr() and fb.stride() == (1, 64)  # [in, out] column-major
        assert db.data_ptr() == cast.q_t.data_ptr() and db.stride() == (1, 96)  # [out, in] column-major
        assert all(t.stride(1) == 1 for t in (fa, da, wa)) and wb.stride(0) == 1
    w.grad = None
    xa = x.clone().requires_grad_()
    (fp8_linear(xa, w, layer).float() * gy).sum().backward()  # closed: a fresh cast
    assert len(casts) == 2
    state.begin_step()  # an evaluation (no grad) casts one layout; a later backward adds the transposed one
    with torch.no_grad():
        fp8_linear(x, w, layer)
    assert len(casts) == 3 and casts[-1].q_t is None
    calls.clear()
    (fp8_linear(x.clone().requires_grad_(), w, layer).float() * gy).sum().backward()
    assert len(casts) == 3 and calls[0][1].data_ptr() == casts[-1].q.data_ptr()
    assert torch.equal(calls[1][1].float(), casts[-1].q.float())  # dX's operand: W [out, in] again
    state.end_step()
    q = quantize(x[:32], torch.tensor(4.0), E4M3)[0]
    with pytest.raises(ValueError, match="row-major first and a column-major second"):
        fp8_module._scaled_mm(q, q.t().contiguous(), torch.tensor(1.0), torch.tensor(1.0))


def test_a_weight_changed_inside_an_open_step_is_an_error():
    state = Fp8State(Fp8Recipe("hybrid", "current"), "cpu")
    layer = state.new_layer()
    x, w, _ = _operands(0)
    state.begin_step()
    fp8_linear(x, w, layer)
    w.add_(1.0)
    with pytest.raises(RuntimeError, match="changed during a training step"):
        fp8_linear(x, w, layer)
    with pytest.raises(RuntimeError, match="does not nest"):
        state.begin_step()


def _train_counting_casts(cfg, steps, monkeypatch):
    """Train ``steps`` steps of 4 micro-batches; per-step losses, gradient norms, the number of
    weight casts in each step, the FP8 layers and the model's FP8 state."""
    from dept_mega.trainer import Trainer
    casts = []
    real = fp8_module.quantize_weight
    monkeypatch.setattr(fp8_module, "quantize_weight", lambda *a: casts.append(1) or real(*a))
    trainer = Trainer(cfg, build_groups(), torch.device("cpu"), vocab_size=cfg.model.vocab_size)
    layers = [m for st in trainer.stages for m in st.modules() if getattr(m, "fp8_layer", None) is not None]
    out = {"loss": [], "grad_norm": [], "casts": []}
    for i in range(steps):
        mbs = dp_micro_batches(cfg, global_batch(cfg, i), 0, 1)
        assert len(mbs) == 4
        res = trainer.train_step(mbs)
        out["loss"].append(res.loss)
        out["grad_norm"].append(res.grad_norm)
        out["casts"].append(len(casts))
        casts.clear()
    out["layers"] = len(layers)
    out["states"] = {id(m.fp8_layer.state): m.fp8_layer.state for m in layers}
    return out


@pytest.mark.parametrize("recipe,over", [
    ("current", {}),
    ("current", {"optim": {"distributed": True}, "model": {"recompute": "full"}}),
    ("delayed", {"model": {"recompute": "selective"}}),
], ids=["current", "current-distributed-full-recompute", "delayed-selective-recompute"])
def test_weights_cast_once_per_step_and_recast_after_every_optimizer_step(recipe, over, monkeypatch):
    """Four micro-batches a step: each FP8 weight is cast once per step (also when blocks are
    recomputed in backward), and the step after an optimizer update casts the updated weight.
    Reference: the same run with every use casting the weight afresh (the trainer's cache
    scope removed), which is how FP8 ran before the cache. Current scaling gives the same
    numbers bit for bit (a cache not emptied after the step gives others). Delayed scaling
    needs the step scope: without it every cast is current-scaled, so the reference differs
    from the second step on (losses within 1e-3) and equals it in the first step (current
    scaling in both). The one state of the model holds one history row per step, every
    operand of every layer recorded. Both stay within 1 % of bf16 (the loss of this tiny model
    moves far less)."""
    steps = 3
    cfg = _fp8_cfg(fp8_recipe=recipe, optim={"lr": 1.0e-2, **over.get("optim", {})},
                   model=over.get("model", {}))
    got = _train_counting_casts(cfg, steps, monkeypatch)
    assert got["layers"] == 16 and got["casts"] == [16] * steps
    with monkeypatch.context() as m:
        m.setattr(trainer_module, "fp8_weight_cache", lambda stages, **kw: contextlib.nullcontext())
        ref = _train_counting_casts(cfg, steps, monkeypatch)
    per_use = 16 * 4 * (2 if over.get("model", {}).get("recompute") == "full" else 1)
    assert ref["casts"] == [per_use] * steps
    assert len(set(got["loss"])) == steps
    if recipe == "current":
        assert got["loss"] == ref["loss"] and got["grad_norm"] == ref["grad_norm"]
    else:
        assert_close(got["loss"], ref["loss"], rel=1e-3, what="loss")
        assert got["loss"][0] == ref["loss"][0] and got["loss"][1:] != ref["loss"][1:]
        (state,) = got["states"].values()
        assert state.history.shape == (cfg.fp8_amax_history + 1, 3 * 16)
        assert (state.history[:steps] > 0).all() and (state.history[steps:] == 0).all()
        (ref_state,) = ref["states"].values()
        assert ref_state.history is None  # no training step opened: nothing recorded
    bf16 = _train_counting_casts(tiny_config({"precision": "bf16", "optim": {"lr": 1.0e-2}}), steps, monkeypatch)
    assert got["loss"] != bf16["loss"]
    assert_close(got["loss"], bf16["loss"], rel=0.01, what="fp8 loss against bf16")


def _pp_cache_worker(rank, world, layouts):
    """Per layout: (cached run, cast-at-every-use run) as (losses, gradient norms, casts)."""
    from tests.trainer_utils import train_losses
    real_qw, real_scope = fp8_module.quantize_weight, trainer_module.fp8_weight_cache
    casts = []
    fp8_module.quantize_weight = lambda *a: casts.append(1) or real_qw(*a)
    out = []
    try:
        for parallel in layouts:
            cfg = _fp8_cfg(parallel=parallel, optim={"lr": 1.0e-2}, model={"recompute": "full"})
            runs = []
            for scope in (real_scope, lambda stages, **kw: contextlib.nullcontext()):
                trainer_module.fp8_weight_cache = scope
                casts.clear()
                r = train_losses(cfg, 3)
                runs.append((r["loss"], r["grad_norm"], len(casts)))
            out.append(runs)
    finally:
        fp8_module.quantize_weight, trainer_module.fp8_weight_cache = real_qw, real_scope
    return out


@pytest.mark.slow
def test_weight_cache_under_pipeline_schedules():
    """PP2 (1F1B) and PP2 × VP2 (interleaved), full recomputation, 4 micro-batches a step:
    later forwards run before earlier backwards and backward recomputes forwards; the cached
    run equals the run that casts at every use, with 8 casts a step on each rank (its 8 FP8
    GEMMs) instead of 8 × 4 × 2; the evaluation after the steps casts once too."""
    layouts = [{"pipeline": 2}, {"pipeline": 2, "virtual_pipeline": 2}]
    for rank_out in run_distributed(_pp_cache_worker, 2, (layouts,), timeout=240):
        for (cached, ref) in rank_out:
            assert cached[:2] == ref[:2] and len(set(cached[0])) == 3
            assert cached[2] == 8 * (3 + 1) and ref[2] == 8 * 4 * (2 * 3 + 1)  # + the evaluation's forwards


@pytest.mark.slow
def test_the_cast_compiles_to_the_eager_result():
    """On CUDA the cast runs compiled (one graph, dynamic shapes); inductor's CPU backend here
    checks that it traces without a break and gives the eager bytes, layouts included."""
    compiled = torch.compile(fp8_module._cast_math, fullgraph=True, dynamic=True)
    g = torch.Generator().manual_seed(0)
    for rows, pad, dtype, scale, rowwise in [(40, 8, E4M3, torch.tensor(150.0), True),
                                            (48, 0, fp8_module.E5M2, None, False)]:
        x = torch.randn(rows, 64, generator=g).bfloat16()
        for a, b in zip(fp8_module._cast_math(x, scale, dtype, pad, rowwise, True),
                        compiled(x, scale, dtype, pad, rowwise, True)):
            assert (a is None) == (b is None)
            if a is not None:
                assert a.dtype == b.dtype and a.stride() == b.stride() and torch.equal(a.float(), b.float())


def _tp_worker(rank, world, cases):
    pg = build_groups(tensor=2)
    return [_stage_losses_grads(_fp8_cfg(parallel={"tensor": 2, "sequence_parallel": sp}, **over), pg)
            for sp, over in cases]


@pytest.mark.slow
def test_triton_casts_take_half_precision_and_send_fp32_to_the_reference(monkeypatch):
    """The Triton casts run for bf16/fp16 operands only; an fp32 operand takes the reference
    math with the same scaling state (the kernel's transposed fp32 store was wrong on an H200)."""
    from dept_mega.parallel import fp8_kernels
    calls = []

    def fake_kernel(t, dtype, pad=0, rowwise=True, colwise=False, scale=None, scale_index=0,
                    amax_out=None, amax_index=0):  # the reference bytes, recording the input dtype
        calls.append(t.dtype)
        q, q_t, inv, current = fp8_module._cast_math(t, None if scale is None else scale[scale_index],
                                                     dtype, pad, rowwise, colwise)
        if amax_out is not None:
            amax_out.view(-1)[amax_index] = torch.maximum(amax_out.view(-1)[amax_index], current)
        return q, q_t, (inv if scale is None else None)

    monkeypatch.setattr(fp8_kernels, "AVAILABLE", True)
    monkeypatch.setattr(fp8_kernels, "interpreted", lambda: True)
    monkeypatch.setattr(fp8_kernels, "cast_fp8", fake_kernel)
    x, w, gy = _operands(3)
    # per step: input, weight and (bf16, as the GEMM's output) output gradient; fp32: the gradient only
    for dtype, kernel_calls in ((torch.bfloat16, 3), (torch.float32, 1)):
        outs = []
        for kernels in ("triton", "torch"):
            calls.clear()
            state = Fp8State(Fp8Recipe("hybrid", "delayed", amax_history=2), "cpu", kernels=kernels)
            layer = state.new_layer()
            xa, wa = x.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()
            for _ in range(2):  # a current-scaled first step, then a delayed one
                state.begin_step()
                y = fp8_linear(xa, wa, layer)
                grads = torch.autograd.grad(y, (xa, wa), gy.to(dtype))
                state.end_step()
            outs.append([y, *grads, state.history])
            assert len(calls) == (2 * kernel_calls if kernels == "triton" else 0), (dtype, kernels, calls)
            assert set(calls) <= {torch.bfloat16}, calls
        for a, b in zip(*outs):
            assert torch.equal(a, b)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="bf16 or fp16"):
        fp8_kernels.cast_fp8(torch.zeros(16, 16), E4M3)


def test_tp2_fp8_matches_tp1_fp8():
    """TP2 quantises each weight shard with its own amax (per-tensor scaling of the local
    tensor; delayed scaling: each rank's own history), TP1 the full weight, so the two differ
    by FP8 rounding only: per-token losses
    within 2 % (the loss of a 4-layer tiny model moves far less than its GEMM outputs) and
    every gradient within 2 × the backward bound (each is within one bound of the exact value).
    With sequence parallelism the column-parallel GEMMs see the all-gathered sequence."""
    cases = [(False, {}), (False, {"fp8_recipe": "delayed"}), (True, {})]
    r0, r1 = run_distributed(_tp_worker, 2, (cases,), timeout=180)
    for i, (sp, over) in enumerate(cases):
        ref_losses, ref_grads = _stage_losses_grads(_fp8_cfg(**over), build_groups())
        losses, grads = r0[i]
        assert torch.equal(losses, r1[i][0])
        assert rel_err(losses, ref_losses) < 0.02
        for k, ref in ref_grads.items():
            assert rel_err(grads[k], ref) < 2 * BWD_BOUND["hybrid"], (sp, over, k, rel_err(grads[k], ref))


def _noisy_pattern_batch(cfg, step):
    """[global_batch, s+1] tokens where each next token is (7·prev + 3) mod V with probability
    1/2 and uniform otherwise: learnable, with an entropy floor (~2.6 nats for V=100), so the
    final losses are far from 0 and a 2 % comparison is meaningful."""
    V, s = cfg.model.vocab_size, cfg.model.seq_length
    g = torch.Generator().manual_seed(1000 + step)
    rows = [torch.randint(0, V, (cfg.train.global_batch_size,), generator=g)]
    for _ in range(s):
        follow = (rows[-1] * 7 + 3) % V
        noise = torch.randint(0, V, follow.shape, generator=g)
        keep = torch.rand(follow.shape, generator=g) < 0.5
        rows.append(torch.where(keep, follow, noise))
    return torch.stack(rows, dim=1)


def _train(cfg, steps):
    from dept_mega.trainer import Trainer
    from tests.trainer_utils import dp_micro_batches
    trainer = Trainer(cfg, build_groups(), torch.device("cpu"), vocab_size=cfg.model.vocab_size)
    return [trainer.train_step(dp_micro_batches(cfg, _noisy_pattern_batch(cfg, i), 0, 1)).loss
            for i in range(steps)]


@pytest.mark.slow
def test_fp8_training_final_loss_within_two_percent_of_bf16():
    over = {"train": {"steps": 200, "global_batch_size": 8, "micro_batch_size": 8},
            "optim": {"lr": 1.0e-2, "min_lr": 1.0e-3, "warmup_steps": 10}}
    bf16 = _train(tiny_config({"precision": "bf16", **over}), 200)
    fp8 = _train(_fp8_cfg(**over), 200)
    assert bf16[-1] < 0.75 * bf16[0], (bf16[0], bf16[-1])  # it learned the pattern
    assert fp8 != bf16  # the FP8 path really ran
    assert abs(fp8[-1] - bf16[-1]) <= 0.02 * bf16[-1], (fp8[-1], bf16[-1])


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
                    reason="needs a CUDA GPU with FP8 (compute capability 8.9+)")
def test_fp8_linear_on_cuda_matches_cpu():
    """cuBLASLt's FP8 GEMM against PyTorch's CPU kernel on the same FP8 operands: the same
    products, accumulated in fp32 in another order (bf16 outputs agree to ~1 bf16 ulp)."""
    recipe = Fp8Recipe("hybrid", "current")
    x, w, gy = _operands(0)
    outs = []
    for dev in ("cpu", "cuda"):
        # detached copies: leaves on each device (x itself becomes a leaf that requires grad on the CPU)
        xa, wa = x.detach().to(dev).requires_grad_(), w.detach().to(dev).requires_grad_()
        y = fp8_linear(xa, wa, Fp8State(recipe, dev).new_layer())
        (y.float() * gy.to(dev)).sum().backward()
        outs.append([t.detach().float().cpu() for t in (y, xa.grad, wa.grad)])
    for a, b in zip(*outs):
        assert rel_err(a, b) < 1e-2


@pytest.mark.parametrize("fast_accum", ["forward", "none", "all"])
def test_fast_accumulation_reaches_each_gemm(monkeypatch, fast_accum):
    """``fp8_fast_accum`` is ``torch._scaled_mm``'s ``use_fast_accum`` of the forward, input-
    gradient and weight-gradient GEMMs (in that order of the calls), eagerly and in the traced
    linear; the CPU kernel ignores it, so the flag is read off the calls."""
    from dept_mega.parallel.fp8_traced import fp8_linear_traced
    recipe = Fp8Recipe("hybrid", "current", fast_accum=fast_accum)
    want = {"forward": [True, False, False], "none": [False] * 3, "all": [True] * 3}[fast_accum]
    assert list(recipe.fast_gemms) == want
    seen, real = [], torch._scaled_mm

    def spy(*args, **kwargs):
        seen.append(kwargs.get("use_fast_accum", False))
        return real(*args, **kwargs)
    monkeypatch.setattr(torch, "_scaled_mm", spy)
    layer = Fp8State(recipe, "cpu").new_layer()
    x, w, gy = _operands(0)
    for fn in (lambda a, b: fp8_linear(a, b, layer),
               lambda a, b: fp8_linear_traced(a, b, recipe.grad_dtype, layer)):
        seen.clear()
        xa, wa = x.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
        (fn(xa, wa).float() * gy).sum().backward()
        assert seen == want
    with pytest.raises(ValueError, match="fast accumulation 'some'"):
        Fp8Recipe(fast_accum="some")


@pytest.mark.parametrize("key,value,why", [("fp8_gemm", "cublaslt", "Transformer Engine runs its own"),
                                           ("fp8_fast_accum", "none", "Transformer Engine's accumulate")])
def test_native_gemm_settings_are_refused_with_transformer_engine(monkeypatch, key, value, why):
    """``fp8_gemm`` and ``fp8_fast_accum`` are settings of the native FP8 GEMMs: with Transformer
    Engine's linears (resolved here without TE installed, by standing in for the linear choice)
    anything but what TE does is an error naming the key, not a setting silently ignored."""
    from dept_mega.model import backends as backends_module
    from dept_mega.model.backends import BackendError
    monkeypatch.setattr(backends_module, "_resolve_linear", lambda cfg, device: ("transformer_engine", []))
    resolve_backends(_fp8_cfg(), "cpu")  # TE's own settings pass
    with pytest.raises(BackendError, match=rf"config key '{key}': {value} applies to the native FP8 linears "
                                           rf"\(backend: local\); {why}"):
        resolve_backends(_fp8_cfg(**{key: value}), "cpu")
    # backend: auto chose Transformer Engine: the message says so and what to set
    with pytest.raises(BackendError, match=r"\(backend: auto chose it: set backend: local\)"):
        resolve_backends(_fp8_cfg(**{key: value, "backend": "auto"}), "cpu")
    # an explicit backend: transformer_engine is refused with the config (--check reports it)
    from dept_mega.config import ConfigError
    with pytest.raises(ConfigError, match=rf"config key '{key}': {value} applies to the native FP8 linears"):
        _fp8_cfg(**{key: value, "backend": "transformer_engine"})


@pytest.mark.parametrize("setting,want", [(None, "none"), ("auto", "none"), ("forward", "forward"), ("all", "all")])
def test_fast_accumulation_default_is_the_exact_sums(setting, want):
    """``fp8_fast_accum: auto`` (the default) gives the native FP8 GEMMs fp32-promoted sums
    (``none``): on an H200 the forward GEMM's fast accumulation was no faster (docs/performance.md);
    an explicit value reaches the recipe as it is."""
    cfg = _fp8_cfg() if setting is None else _fp8_cfg(fp8_fast_accum=setting)
    assert resolve_backends(cfg, "cpu").fp8.fast_accum == want


def test_transformer_engine_fp8_describes_itself(monkeypatch):
    """With Transformer Engine's linears (stood in for here) the start-up backends line is
    built without the native casts' settings, and the default ``fp8_fast_accum: auto`` reads as
    what TE does (``forward``), not as the native GEMMs' exact sums."""
    from dept_mega.model import backends as backends_module
    monkeypatch.setattr(backends_module, "_resolve_linear", lambda cfg, device: ("transformer_engine", []))
    b = resolve_backends(_fp8_cfg(), "cpu")
    assert b.fp8.fast_accum == "forward"
    line = b.describe()
    assert "linear=transformer_engine fp8" in line and "fast accumulation: forward" in line, line
