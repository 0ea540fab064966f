"""Helpers for the gradient-buffer / distributed-optimizer / mixed-precision tests: train a
tiny config in the current process and return losses, norms, bytes by category and how many
gradient buckets were reduced while backward was still running."""
from __future__ import annotations

import torch

from dept_mega.parallel.groups import build_groups
from dept_mega.trainer import Trainer
from tests.trainer_utils import dp_micro_batches, global_batch, tiny_config


def train_record(over: dict, overrides: tuple[str, ...], steps: int) -> dict:
    cfg = tiny_config(over, overrides)
    p = cfg.parallel
    pg = build_groups(p.tensor, p.data, p.pipeline)
    trainer = Trainer(cfg, pg, torch.device("cpu"), vocab_size=cfg.model.vocab_size)
    before = pg.comm.snapshot()
    losses, norms, early = [], [], []
    for step in range(steps):
        res = trainer.train_step(dp_micro_batches(cfg, global_batch(cfg, step), pg.dp_rank, pg.dp_size))
        losses.append(res.loss)
        norms.append(res.grad_norm)
        early.append(trainer.grad_sync.launched_during_backward)
    after = pg.comm.snapshot()
    held_out = dp_micro_batches(cfg, global_batch(cfg, 10_000), pg.dp_rank, pg.dp_size)
    loss_sum, tokens = trainer.eval_batches(held_out)
    return {"loss": losses, "grad_norm": norms, "eval": [loss_sum / tokens], "early": early,
            "bytes": {k: after[k] - before[k] for k in after},
            "buckets": sum(len(o.buffer.buckets) for o in trainer.optimizers),
            "grad_numel": sum(o.buffer.numel for o in trainer.optimizers), "dp_size": pg.dp_size}


def records_worker(rank: int, world_size: int, runs: list[tuple[dict, tuple[str, ...]]], steps: int) -> list[dict]:
    torch.manual_seed(0)
    return [train_record(over, o, steps) for over, o in runs]


def dept_record(over: dict, steps_per_round: int, rounds: int) -> dict:
    """A DEPT run (tests/dept_utils, 2 sources) on this rank: per-step losses and the body."""
    from tests.dept_utils import body_vector, run_dept, source_infos
    from tests.dept_utils import tiny_config as dept_config
    cfg = dept_config(over)
    out = run_dept(cfg, source_infos(2, trim=cfg.dept.variant == "trim"), rounds)
    tr = out["trainer"]
    sharded = cfg.optim.distributed and cfg.precision != "fp32"  # no rank holds the full masters
    return {"loss": out["losses"], "body": body_vector(tr),
            "main": None if sharded else torch.cat([m.reshape(-1) for m in tr.main_params(tr.body_parameters())])}


def mixed_worker(rank: int, world_size: int, runs: list[tuple], steps: int) -> list[dict]:
    """``runs``: ("train", over, overrides) or ("dept", over, rounds)."""
    torch.manual_seed(0)
    out = []
    for kind, over, extra in runs:
        if kind == "train":
            out.append(train_record(over, extra, steps))
        else:
            out.append(dept_record(over, steps, extra))
    return out
