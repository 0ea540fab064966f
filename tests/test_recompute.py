"""Activation recomputation (``model.recompute``): the same losses and gradients as without it,
bit for bit in fp32 on CPU, with hidden and attention dropout on (the dropout streams replay),
on one process and under TP2 (+SP) and PP2 with gloo; FP8 delayed scaling casts a recomputed
forward as the original one."""
from __future__ import annotations

import contextlib

import pytest
import torch

from dept_mega.config import ConfigError, config_from_dict
from dept_mega.model import build_model
from dept_mega.parallel.fp8 import fp8_weight_cache
from dept_mega.parallel.groups import build_groups
from tests.model_utils import full_tensors
from tests.model_utils import tiny_config as model_config
from tests.mp_utils import run_distributed
from tests.trainer_utils import layouts_worker

DROPOUT = dict(hidden_dropout=0.2, attention_dropout=0.2)
MODES = [("none", None), ("selective", None), ("full", None), ("full", 1)]


def _losses_grads(cfg, micro_batches=2, steps=1):
    """Two micro-batches (forward, forward, backward, backward: the second forward advances the
    streams before the first backward recomputes), per-token losses and full gradients; with
    ``steps`` > 1 each is a training step of the FP8 layers (``fp8_weight_cache``; the
    gradients accumulate, the weights do not change) and the FP8 state's history and scales
    come back too."""
    (stage,) = build_model(cfg, build_groups(), 200, 3)
    calls = {"block": 0, "core": 0}  # pre-hooks: a recomputation stops early, after its last needed op
    stage.body.layers["0"].register_forward_pre_hook(lambda *a: calls.__setitem__("block", calls["block"] + 1))
    stage.body.layers["0"].attention.core.register_forward_pre_hook(
        lambda *a: calls.__setitem__("core", calls["core"] + 1))
    g = torch.Generator().manual_seed(4)
    for _ in range(steps):
        outs = []
        with fp8_weight_cache([stage]) if steps > 1 else contextlib.nullcontext():
            for _ in range(micro_batches):
                tokens = torch.randint(0, 200, (2, 16), generator=g)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.precision == "bf16"):
                    outs.append(stage(tokens, torch.randint(0, 200, (2, 16), generator=g)))
            for out in outs:
                out.mean().backward()
    fp8 = {}
    if steps > 1:
        state = stage.body.layers["0"].mlp.fc1.fp8_layer.state
        fp8 = {"history": state.history.clone(), "scale": state.scale.clone()}
    return torch.stack([o.detach() for o in outs]), full_tensors(stage, build_groups(), grads=True), calls, \
        stage.rng.get_states(), fp8


@pytest.mark.parametrize("position", ["alibi", "rope"])
def test_recompute_gives_identical_losses_and_grads_with_dropout(position):
    ref = _losses_grads(model_config(position_embedding=position, num_query_groups=2, **DROPOUT))
    assert ref[2] == {"block": 2, "core": 2}
    for mode, n in MODES:
        cfg = model_config(position_embedding=position, num_query_groups=2, recompute=mode, recompute_layers=n,
                           **DROPOUT)
        losses, grads, calls, rng_state, _ = _losses_grads(cfg)
        assert torch.equal(losses, ref[0]), mode
        for k, g in ref[1].items():
            assert torch.equal(grads[k], g), (mode, n, k)
        for k, s in ref[3].items():  # the streams end where the plain run leaves them
            assert torch.equal(rng_state[k], s)
        # the recomputation really ran: layer 0's block (full) or attention core (selective) twice
        expect = {"none": (2, 2), "selective": (2, 4), "full": (4, 4)}[mode]
        assert (calls["block"], calls["core"]) == expect, (mode, calls)
    # the masks are live: without dropout the losses differ
    assert not torch.equal(_losses_grads(model_config(position_embedding=position, num_query_groups=2))[0], ref[0])


def test_recompute_with_fp8_delayed_scaling_casts_as_the_original_forward():
    """Three training steps (the first current-scaled, the others with the scales of the steps
    before): full recomputation gives the losses, gradients, amax history and scales of no
    recomputation, bit for bit (a recomputed cast uses the step's fixed scale and maxes the
    same amax into the history)."""
    def cfg(recompute):
        m = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=200,
                 recompute=recompute, **DROPOUT)
        return config_from_dict({"model": m, "precision": "bf16", "fp8": "hybrid", "fp8_recipe": "delayed"})

    ref = _losses_grads(cfg("none"), steps=3)
    got = _losses_grads(cfg("full"), steps=3)
    assert got[2]["block"] == 12
    assert torch.equal(got[0], ref[0])
    for k, g in ref[1].items():
        assert torch.equal(got[1][k], g), k
    history = ref[4]["history"]
    assert (history[:3] > 0).all() and (history[3:] == 0).all()  # one row per step
    assert (ref[4]["scale"] != 1.0).all()  # every operand's scale came from the history
    for k in ("history", "scale"):
        assert torch.equal(got[4][k], ref[4][k]), k


def test_recompute_config_errors():
    with pytest.raises(ConfigError, match="model.recompute_layers.*only applies to model.recompute: full"):
        model_config(recompute="selective", recompute_layers=1)
    with pytest.raises(ConfigError, match="model.recompute_layers.*more than the 2 layers"):
        model_config(recompute="full", recompute_layers=3)
    with pytest.raises(ConfigError, match="model.recompute"):
        model_config(recompute="block")


@pytest.mark.slow
def test_recompute_under_tp2_sp_and_pp2_matches_no_recompute():
    """Two training steps (4 micro-batches each; under PP2 the 1F1B schedule runs later
    micro-batches' forwards before earlier backwards; the second step's forward and recomputation
    run on the updated weights and continue the dropout streams of the first) with hidden and
    attention dropout: every recompute mode gives the losses, gradient norms and evaluation loss
    of no recomputation, bit for bit."""
    layouts = [{"parallel": {"tensor": 2}}, {"parallel": {"tensor": 2, "sequence_parallel": True}},
               {"parallel": {"pipeline": 2}}]
    runs = []
    for layout in layouts:
        for mode, n in [("none", None), ("selective", None), ("full", None), ("full", 1)]:
            runs.append(({**layout, "model": {**DROPOUT, "recompute": mode, "recompute_layers": n}}, ()))
    results = run_distributed(layouts_worker, 2, (runs, 2), timeout=240)[-1]
    for i in range(len(layouts)):
        ref = results[4 * i]
        assert len(set(ref["loss"])) == 2
        for j in range(1, 4):
            got = results[4 * i + j]
            assert got["loss"] == ref["loss"], (layouts[i], runs[4 * i + j][0]["model"])
            assert got["grad_norm"] == ref["grad_norm"]
            assert got["eval"] == ref["eval"]
