"""Sequence parallelism keeps only the sequence shard of a column-parallel linear's input for
backward and all-gathers it again there (dept_mega/parallel/sp_linear.py, as Megatron-LM).

On 2 gloo ranks (TP 2 + SP), against the previous formulation (``gather_from_sequence_parallel_region``
then the linear, so that autograd keeps the gathered input; :func:`_old_sp_gather_linear`,
patched in for the column-parallel layers and the tied head):

* one layer (also fp32 under bf16 autocast, and called from a compiled function): the output, the input, weight and bias gradients
  are bit-identical; the layer saves
  the shard (not the gathered input) for backward; its ``tp`` bytes grow by one all-gather of the
  shard in the backward;
* training (Trainer, several micro-batches): losses, gradient norms, evaluation loss and the
  final weights are bit-identical, fp32 and bf16, with and without gradient-accumulation fusion,
  tied and untied head (with biases), with full recomputation.

Sabotages tried: the backward gathering this rank's shard T times instead of every rank's
(weight gradients wrong: the training comparison fails), and the forward saving the gathered
input (the saved-bytes check fails)."""
from __future__ import annotations

import pytest
import torch

from tests.mp_utils import run_distributed
from tests.trainer_utils import tiny_config, train_losses

# one training step: the new and the old formulation of the same stateless op compared on the
# step's forward (loss), backward (gradient norm) and update (evaluation loss and weights after
# it); a second step would run the same code again on other values
STEPS = 1


def _old_sp_gather_linear(x, weight, bias, pg, fuse_wgrad=False):
    """The formulation before sp_linear.py: autograd keeps the gathered input."""
    from dept_mega.parallel.mappings import gather_from_sequence_parallel_region
    from dept_mega.parallel.wgrad import linear

    return linear(gather_from_sequence_parallel_region(x, pg, tensor_parallel_output_grad=True), weight, bias,
                  fuse_wgrad)


class OldFormulation:
    """Patch the previous formulation into the column-parallel layers and the tied head."""

    def __enter__(self):
        import dept_mega.model.embeddings as emb
        import dept_mega.parallel.layers as layers

        self._saved = (layers.sp_gather_linear, emb.sp_gather_linear)
        layers.sp_gather_linear = emb.sp_gather_linear = _old_sp_gather_linear
        return self

    def __exit__(self, *exc):
        import dept_mega.model.embeddings as emb
        import dept_mega.parallel.layers as layers

        layers.sp_gather_linear, emb.sp_gather_linear = self._saved


def _layer(pg, old: bool, dtype, amp: bool = False, compiled: bool = False) -> dict:
    from dept_mega.parallel.layers import ColumnParallelLinear

    s, b, h, out = 8, 3, 16, 12
    T = 2
    g = torch.Generator().manual_seed(3)
    x_full = torch.randn(s, b, h, generator=g).to(dtype)
    dy = torch.randn(s, b, out // T, generator=g).to(dtype)
    col = ColumnParallelLinear(h, out, pg, name="c", seed=5, init_std=0.3, bias=True, sequence_parallel=True,
                               dtype=dtype)
    x = x_full.chunk(T, 0)[pg.tp_rank].clone().requires_grad_()
    saved: list[torch.Tensor] = []
    before = pg.comm.snapshot()["tp"]
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        if old:
            with OldFormulation():
                y = col(x)
        elif compiled:
            y = torch.compile(col, backend="eager")(x)
        else:
            y = col(x)
    y.backward(dy)
    params = {col.weight.data_ptr()}
    inputs = {t.untyped_storage().data_ptr(): t.numel() for t in saved if t.data_ptr() not in params}
    return {"y": y.detach(), "dx": x.grad, "dw": col.weight.grad, "db": col.bias.grad,
            "tp": pg.comm.snapshot()["tp"] - before, "saved": sum(inputs.values()),
            "shard_bytes": x.numel() * x.element_size()}


RUNS = {
    "fp32 tied": ({}, ()),
    "bf16 fused untied bias": ({"precision": "bf16", "model": {"tie_embeddings": False, "bias": True},
                                "optim": {"grad_accum_fusion": True}}, ()),
    "fp32 fused tied recompute": ({"model": {"recompute": "full"}, "optim": {"grad_accum_fusion": True}}, ()),
    "bf16 untied swiglu": ({"precision": "bf16", "model": {"tie_embeddings": False, "activation": "swiglu"},
                            "optim": {"grad_accum_fusion": False}}, ()),
}


def _train(over: dict, overrides: tuple[str, ...]) -> dict:
    cfg = tiny_config(over, overrides + ("parallel.tensor=2", "parallel.sequence_parallel=true"))
    return train_losses(cfg, STEPS, weights=True)


def _worker(rank: int, world: int) -> dict:
    from dept_mega.parallel.groups import build_groups

    torch.set_num_threads(1)
    pg = build_groups(2, 1, 1)
    out = {"layer": {(dt, old): _layer(pg, old, dt) for dt in (torch.float32, torch.bfloat16)
                     for old in (False, True)}}
    out["autocast"] = {old: _layer(pg, old, torch.float32, amp=True) for old in (False, True)}
    out["compiled"] = _layer(pg, False, torch.float32, compiled=True)
    for name, (over, extra) in RUNS.items():
        torch.manual_seed(0)
        new = _train(over, extra)
        torch.manual_seed(0)
        with OldFormulation():
            old = _train(over, extra)
        out[name] = (new, old)
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 2, timeout=200)


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_layer_is_bit_identical_saves_the_shard_and_regathers(results):
    for rank, res in enumerate(results):
        for dt in (torch.float32, torch.bfloat16):
            new, old = res["layer"][(dt, False)], res["layer"][(dt, True)]
            for k in ("y", "dx", "dw", "db"):
                assert torch.equal(new[k], old[k]), (rank, dt, k)
            # the input kept for backward: the shard [s/T, b, h] now, the gathered [s, b, h] before
            assert new["saved"] == 4 * 3 * 16 and old["saved"] == 8 * 3 * 16, (new["saved"], old["saved"])
            assert new["tp"] == old["tp"] + new["shard_bytes"], (rank, dt)
        # called from compiled code (train.compile): outside the graph, the same results and bytes
        new, comp = res["layer"][(torch.float32, False)], res["compiled"]
        for k in ("y", "dx", "dw", "db", "tp", "saved"):
            assert (torch.equal(new[k], comp[k]) if torch.is_tensor(new[k]) else new[k] == comp[k]), (rank, k)
        # fp32 weights under bf16 autocast (as tests/test_fp8.py runs): the operands F.linear would cast
        new, old = res["autocast"][False], res["autocast"][True]
        assert new["y"].dtype == torch.bfloat16
        for k in ("y", "dx", "dw", "db"):
            assert torch.equal(new[k], old[k]), (rank, "autocast", k)


@pytest.mark.timeout(240)
def test_tp2_sp_training_is_bit_identical(results):
    for rank, res in enumerate(results):
        for name in RUNS:
            new, old = res[name]
            assert new["loss"] == old["loss"] and new["grad_norm"] == old["grad_norm"], (rank, name, new, old)
            assert new["eval"] == old["eval"], (rank, name)
            assert len(new["weights"]) == len(old["weights"])
            for a, b in zip(new["weights"].values(), old["weights"].values()):
                assert torch.equal(a, b), (rank, name)
