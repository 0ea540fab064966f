"""The pipeline runner on two gloo ranks (interleaved, P = 2, V = 2): the same losses as one
process, sent activations released once sent (Megatron's deallocate_output_tensor), and the
batched point-to-point traffic counted as ``pp`` bytes."""
from __future__ import annotations

import torch

from tests.mp_utils import run_distributed
from tests.trainer_utils import assert_close, dp_micro_batches, global_batch, tiny_config, train_losses

OVERRIDES = ("parallel.pipeline=2", "parallel.virtual_pipeline=2")
STEPS = 2


def _worker(rank: int, world_size: int) -> dict:
    from dept_mega.parallel.groups import build_groups
    from dept_mega.trainer import Trainer
    cfg = tiny_config(overrides=OVERRIDES)
    pg = build_groups(1, 1, 2)
    trainer = Trainer(cfg, pg, torch.device("cpu"), vocab_size=cfg.model.vocab_size)
    sent_outputs: list[torch.Tensor] = []
    for st in trainer.stages:
        if not st.is_last:
            st.register_forward_hook(lambda mod, args, out: sent_outputs.append(out))
    losses = []
    for step in range(STEPS):
        mbs = dp_micro_batches(cfg, global_batch(cfg, step), 0, 1)
        losses.append(trainer.train_step(mbs).loss)
    released = [int(t.untyped_storage().nbytes()) for t in sent_outputs]
    n_outputs = len(sent_outputs)
    held_out = dp_micro_batches(cfg, global_batch(cfg, 10_000), 0, 1)
    before = pg.comm.snapshot()["pp"]
    loss_sum, tokens = trainer.eval_batches(held_out)
    eval_pp = pg.comm.snapshot()["pp"] - before
    return {"loss": losses, "eval": [loss_sum / tokens], "released": released,
            "n_outputs": n_outputs, "eval_pp_bytes": eval_pp, "micro_batches": len(held_out)}


def test_interleaved_pp2_matches_single_process_and_releases_sent_activations():
    cfg = tiny_config(overrides=OVERRIDES)
    ref = train_losses(tiny_config(), STEPS)
    results = run_distributed(_worker, 2, timeout=240)
    M = cfg.train.global_batch_size // cfg.train.micro_batch_size
    s, b, h = cfg.model.seq_length, cfg.train.micro_batch_size, cfg.model.hidden_size
    for rank, got in enumerate(results):
        assert_close(got["loss"], ref["loss"][:STEPS], 1e-5, f"rank {rank} loss")
        assert_close(got["eval"], ref["eval"], 1e-5, f"rank {rank} eval loss")
        # every chunk that sends its output (rank 0: both chunks, rank 1: chunk 0) released it
        assert got["n_outputs"] == STEPS * M * (2 if rank == 0 else 1)
        assert max(got["released"]) <= 4, got["released"]
        # evaluation: rank 0 sends activations of virtual stages 0 and 2, rank 1 of stage 1
        assert got["eval_pp_bytes"] == (2 if rank == 0 else 1) * got["micro_batches"] * s * b * h * 4
