"""``train.log_activation_norms``: the per-layer RMS of the transformer blocks' outputs
(dept_mega/model/act_norms.py) equals a forward-hook reference on a tiny model, does not change
the step, is not counted twice under recomputation, is the single process's under pipeline,
tensor and sequence parallelism, and costs nothing when off. The loop's records and the host
reads: test_act_norms_run.py and test_host_sync.py."""
from __future__ import annotations

import math

import pytest
import torch

from dept_mega.metrics import activation_fields, human_line, scalars_of
from dept_mega.model.gpt import TransformerBlock
from dept_mega.parallel.groups import build_groups
from dept_mega.trainer import Trainer
from tests.mp_utils import run_distributed
from tests.trainer_utils import dp_micro_batches, global_batch, tiny_config

LAYERS = 4  # tiny_config's


def _trainer(cfg) -> Trainer:
    torch.manual_seed(0)
    p = cfg.parallel
    return Trainer(cfg, build_groups(p.tensor, p.data, p.pipeline), torch.device("cpu"),
                   vocab_size=cfg.model.vocab_size)


def _batch(cfg, trainer, step: int):
    return dp_micro_batches(cfg, global_batch(cfg, step), trainer.pg.dp_rank, trainer.pg.dp_size)


def test_rms_equals_forward_hook_reference():
    """Each block's RMS over the step's micro-batches: sqrt(Σ out² / elements), from forward
    hooks on the blocks of the same step (float64); the sums hold the squares and the counts."""
    cfg = tiny_config()
    trainer = _trainer(cfg)
    trainer.train_step(_batch(cfg, trainer, 0))  # a trained step first: the layers differ
    outs: dict[int, list[torch.Tensor]] = {}
    handles = [m.register_forward_hook(lambda mod, args, out: outs.setdefault(mod.layer_id, []).append(
        out.detach().double())) for st in trainer.stages for m in st.modules() if isinstance(m, TransformerBlock)]
    res = trainer.train_step(_batch(cfg, trainer, 1), activation_norms=True)
    for h in handles:
        h.remove()
    assert sorted(outs) == list(range(LAYERS)) and all(len(v) == 4 for v in outs.values())  # 4 micro-batches
    squares = [sum(float(o.square().sum()) for o in outs[i]) for i in range(LAYERS)]
    counts = [sum(o.numel() for o in outs[i]) for i in range(LAYERS)]
    assert res.act_sums[LAYERS:] == counts == [8 * 16 * 32] * LAYERS  # batch × seq × hidden
    for got, want in zip(res.act_sums[:LAYERS], squares):
        assert math.isclose(got, want, rel_tol=1e-6), (got, want)
    rms = activation_fields(res.act_sums)
    assert rms["act_rms"] == pytest.approx([math.sqrt(s / n) for s, n in zip(squares, counts)], rel=1e-6)
    assert rms["act_rms_max"] == max(rms["act_rms"])
    assert len(set(rms["act_rms"])) == LAYERS  # every layer its own value


def test_measuring_leaves_the_step_unchanged_and_counts_recomputed_blocks_once():
    """The same steps with and without measuring give the same losses and norms exactly; with
    model.recompute: full (each block's forward runs again in backward; to its end, without
    torch's early stop, as a measurement in the block or a hook on it would see it) the sums are
    the same (not twice the squares and elements)."""
    from torch.utils.checkpoint import set_checkpoint_early_stop
    cfg = tiny_config()
    a, b = _trainer(cfg), _trainer(cfg)
    rec = _trainer(tiny_config({"model": {"recompute": "full"}}))
    for step in range(2):
        ra = a.train_step(_batch(cfg, a, step))
        rb = b.train_step(_batch(cfg, b, step), activation_norms=True)
        with set_checkpoint_early_stop(False):
            rr = rec.train_step(_batch(cfg, rec, step), activation_norms=True)
        assert (ra.loss, ra.grad_norm) == (rb.loss, rb.grad_norm)
        assert ra.act_sums is None
        assert rr.act_sums[LAYERS:] == rb.act_sums[LAYERS:]
        assert rr.act_sums[:LAYERS] == pytest.approx(rb.act_sums[:LAYERS], rel=1e-6)


def test_off_adds_nothing(monkeypatch):
    """Without ``activation_norms`` no body holds activation sums during the step and none is
    added (zero cost when off)."""
    from dept_mega.model import act_norms
    cfg = tiny_config()
    trainer = _trainer(cfg)
    seen = []
    monkeypatch.setattr(act_norms.ActivationSums, "add", lambda self, i, h: seen.append(i))
    bodies = [st.body for st in trainer.stages]
    original = bodies[0].forward

    def forward(hidden):
        seen.extend(("held", i) for i, b in enumerate(bodies) if b.act_sums is not None)
        return original(hidden)

    monkeypatch.setattr(bodies[0], "forward", forward)
    res = trainer.train_step(_batch(cfg, trainer, 0))
    assert res.act_sums is None and seen == []
    trainer.train_step(_batch(cfg, trainer, 1), activation_norms=True)
    assert seen[:1] == [("held", 0)] and seen.count(0) == 4  # (the patch sees a measured step)
    assert all(b.act_sums is None for b in bodies)  # released after the step


LAYOUTS = [("pp2", ("parallel.pipeline=2",)),
           ("tp2", ("parallel.tensor=2",)),
           ("tp2_sp", ("parallel.tensor=2", "parallel.sequence_parallel=true")),
           ("tp2_pp2_sp", ("parallel.tensor=2", "parallel.pipeline=2", "parallel.sequence_parallel=true")),
           ("dp2_pp2_vp2", ("parallel.data=2", "parallel.pipeline=2", "parallel.virtual_pipeline=2"))]


def _rms_worker(rank: int, world: int, layouts) -> list[list[float]]:
    out = []
    for _, overrides in layouts:
        cfg = tiny_config(overrides=overrides)
        trainer = _trainer(cfg)
        trainer.train_step(_batch(cfg, trainer, 0))
        res = trainer.train_step(_batch(cfg, trainer, 1), activation_norms=True)
        out.append(activation_fields(res.act_sums)["act_rms"])
    return out


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_layouts_match_single_process():
    """PP 2 (layers on the other stage), TP 2 with and without sequence parallelism (RMS over
    the full hidden size, the sequence shards of both tensor ranks), TP 2 × PP 2 and DP 2 × PP 2
    interleaved: every rank's act_rms equals the single process's (gloo, 4 ranks)."""
    single = _rms_worker(0, 1, [("single", ())])[0]
    results = run_distributed(_rms_worker, 4, args=(LAYOUTS,), timeout=180)
    for rank, per_rank in enumerate(results):
        for (name, _), got in zip(LAYOUTS, per_rank):
            assert got == pytest.approx(single, rel=1e-5), (name, rank, got, single)


def test_record_fields_scalars_and_line():
    """act_rms per layer and act_rms_max in the record; TensorBoard / W&B tags train/act_rms/I and
    train/act_rms_max; the log line's ``act rms max``; nothing of it without the fields."""
    fields = activation_fields([4.0, 9.0, 1.0, 1.0])
    assert fields == {"act_rms": [2.0, 3.0], "act_rms_max": 3.0}
    rec = {"kind": "train", "loss_by_source": {}, "loss": 1.0, **fields}
    sc = scalars_of(rec)
    assert sc["train/act_rms/0"] == 2.0 and sc["train/act_rms/1"] == 3.0 and sc["train/act_rms_max"] == 3.0
    assert not any("act" in k for k in scalars_of({"kind": "train", "loss_by_source": {}, "loss": 1.0}))
    line = human_line(2, 4, 1.0, 1e-3, 100.0, 1.0, 1.0, grad_norm=0.5, act_rms_max=3.0)
    assert "| grad norm 0.500 | act rms max 3.000 |" in line
    assert "act rms" not in human_line(2, 4, 1.0, 1e-3, 100.0, 1.0, 1.0, grad_norm=0.5)
    inf = activation_fields([float("inf"), 9.0, 1.0, 1.0])
    assert inf["act_rms"][0] == float("inf") and inf["act_rms_max"] is None
