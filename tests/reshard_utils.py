"""Helpers for the resharding tests (tests/test_reshard.py, tests/test_reshard_optimizer.py).

``make_loop`` builds the real ``TrainLoop`` (real ``Trainer``, ``DeptHooks`` or ``StdHooks``,
``Checkpointer``, metrics to ``run_dir/metrics.jsonl``) on synthetic per-source data for one
layout; ``CASES`` / ``LAYOUT_CASES`` are the configurations resumed under another layout, and
``LAYOUT_SOURCES`` says which of them run 3 sources over 2 groups. ``buffer_differences``
compares the error-feedback residuals and eager estimates a resumed run holds with the full
tensors run A saved, cut independently of the loader."""
from __future__ import annotations

import io
import json
import os

import torch

from tests.dept_utils import SavingOnly, SyntheticSource, allowed_ids, source_infos, tiny_config


def make_loop(over, run_dir, rank, data, tensor=1, pipeline=1, steps=4, virtual=1, sources=None, save=True):
    """``save=False``: the loop's checkpointer loads but writes nothing (SavingOnly with no
    step): a reference run or a resumed one whose checkpoints nothing reads (~0.3 s a save);
    a tuple of steps: it writes those only (SavingOnly)."""
    from dept_mega.checkpoint import Checkpointer
    from dept_mega.dept.driver import DeptHooks
    from dept_mega.loop import StdHooks, TrainLoop
    from dept_mega.metrics import MetricsWriter
    from dept_mega.parallel.groups import build_groups
    from dept_mega.trainer import Trainer
    cfg = tiny_config({**over, "parallel": {"data": data, "tensor": tensor, "pipeline": pipeline,
                                            "virtual_pipeline": virtual},
                       "train": {"steps": steps, "save_interval": 2, "eval_interval": 0, "log_interval": 1,
                                 "run_dir": run_dir}})
    pg = build_groups(tensor, data, pipeline)
    if sources is None:
        sources = LAYOUT_SOURCES.get(json.dumps(over, sort_keys=True), 2)
    infos = source_infos(sources, trim=cfg.dept.variant == "trim")
    torch.manual_seed(cfg.train.seed)
    trainer = Trainer(cfg, pg, torch.device("cpu"), vocab_size=infos[0].vocab_size)
    std = cfg.dept.variant == "std"
    hooks = StdHooks() if std else DeptHooks(cfg, pg, trainer, torch.device("cpu"), infos)
    by_name = {s.name: s for s in infos}

    def make_iterator(name):
        info = infos[0] if std else by_name[name]
        return SyntheticSource(cfg, infos.index(info) + 1, allowed_ids(info), pg.dp_rank, pg.dp_size)

    writer = MetricsWriter(run_dir, enabled=rank == 0, stream=io.StringIO())
    return TrainLoop(cfg, pg, trainer, hooks, writer, make_iterator,
                     checkpointer=Checkpointer(run_dir) if save is True else SavingOnly(run_dir, save or ()))


def read_losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if r["kind"] == "train"}


CASES = {"std": {"dept": {"variant": "std"}},
         # TRIM: φ's row shards of the old replicas joined and cut (DeptHooks.load_state_dict_dp_joined)
         "trim": {"dept": {"variant": "trim", "local_steps": 2,
                           "outer_optimizer": {"name": "nesterov", "lr": 0.7, "momentum": 0.9}},
                  "model": {"position_embedding": "learned"}},
         "glob": {"dept": {"variant": "glob", "local_steps": 2, "outer_optimizer": {"name": "adam", "lr": 0.5}}},
         "spec": {"dept": {"variant": "spec", "local_steps": 2,
                           "outer_optimizer": {"name": "nesterov", "lr": 0.7, "momentum": 0.9}}},
         # error-feedback residuals (a chunk per replica, in the per-rank hook files) joined
         # from the old replicas' chunks and cut (DeptHooks.load_state_dict_dp_joined); blocks
         # of 2 values: the tiny model's shard sizes are even, so the D = 2 chunk boundary falls
         # on a block boundary and D = 1 and D = 2 quantise the same blocks (with near-equal
         # chunks of any size the blocks, hence the quantisation noise, depend on D)
         "glob_int8_ef": {"dept": {"variant": "glob", "local_steps": 2, "outer_comm_dtype": "int8",
                                   "outer_error_feedback": True, "outer_quant_block": 2,
                                   "outer_optimizer": {"name": "nesterov", "lr": 0.7, "momentum": 0.9}}},
         # TRIM the same: φ's row shards joined, and the residuals (the body's; the learned
         # positions' in their outer state); the trimmed rows (16 values) quantise alike
         "trim_int8_ef": {"dept": {"variant": "trim", "local_steps": 2, "outer_comm_dtype": "int8",
                                   "outer_error_feedback": True, "outer_quant_block": 2,
                                   "outer_optimizer": {"name": "nesterov", "lr": 0.7, "momentum": 0.9}},
                          "model": {"position_embedding": "learned"}}}

# resharding cases beside the data-parallel ones: GLOB with a Nesterov outer optimizer (the Adam
# one at lr 0.5 moves every weight by about ±0.5 per round, which turns the tensor-parallel sum
# order's 1e-7 differences into 1e-6 ones)
LAYOUT_CASES = dict(CASES, glob_nesterov={"dept": {"variant": "glob", "local_steps": 2, "outer_optimizer": {
    "name": "nesterov", "lr": 0.7, "momentum": 0.9}}})
# SPEC-OPT with 3 sources over 2 groups (sources wait in the store between rounds) and the
# body's AdamW state kept per source; a constant LR (min_lr = lr): the first run stops at step 4
# by lowering train.steps, which would otherwise change its LR schedule
LAYOUT_CASES["spec_opt_source"] = {"dept": {"variant": "spec_opt", "local_steps": 2, "body_optimizer_state": "source",
                                            "outer_optimizer": {"name": "nesterov", "lr": 0.7, "momentum": 0.9}},
                                   "optim": {"min_lr": 1.0e-2}}
# GLOB with int8 error feedback and the eager start (τ = 1): the residuals and estimates, saved
# per parameter and group (dept_mega.checkpoint_state), joined and cut like θ_{t-1}; blocks of
# 2 values: every shard of the tiny model splits its tensors at even offsets, so both layouts
# quantise the same pairs of values (as in CASES["glob_int8_ef"])
LAYOUT_CASES["glob_int8_ef_eager"] = {"dept": {
    "variant": "glob", "local_steps": 2, "outer_comm_dtype": "int8", "outer_error_feedback": True,
    "outer_quant_block": 2, "outer_overlap": True, "outer_delay": 1, "outer_overlap_rule": "eager",
    "outer_optimizer": {"name": "nesterov", "lr": 0.7, "momentum": 0.9}},
    "optim": {"min_lr": 1.0e-2}}  # a constant LR: run A (4 steps) and B (6) share it up to step 3
# the same with 4 layers (pipeline 2 x virtual pipeline 2 chunks of one layer each)
LAYOUT_CASES["spec_opt_source_4l"] = dict(LAYOUT_CASES["spec_opt_source"], model={"num_layers": 4})
# TRIM with an untied head (φ_head on the last stage) and learned positions
LAYOUT_CASES["trim_untied"] = dict(CASES["trim"], model={"position_embedding": "learned", "tie_embeddings": False})
# the same with 4 layers (pipeline 2 x virtual pipeline 2 chunks of one layer each)
LAYOUT_CASES["trim_untied_4l"] = dict(LAYOUT_CASES["trim_untied"], model={**LAYOUT_CASES["trim_untied"]["model"],
                                                                          "num_layers": 4})
# SPEC with int8 error feedback and the eager start (τ = 1), as glob_int8_ef_eager: the buffers
# (per parameter and group) reshard whatever holds the per-source state (hooks_dp0 files here)
LAYOUT_CASES["spec_int8_ef_eager"] = dict(LAYOUT_CASES["glob_int8_ef_eager"],
                                          dept=dict(LAYOUT_CASES["glob_int8_ef_eager"]["dept"], variant="spec"))
# SPEC-OPT with the body's AdamW state per source and int8 error feedback (blocks of 2)
LAYOUT_CASES["spec_opt_source_ef"] = dict(LAYOUT_CASES["spec_opt_source"], dept=dict(
    LAYOUT_CASES["spec_opt_source"]["dept"], outer_comm_dtype="int8", outer_error_feedback=True, outer_quant_block=2))
# GLOB with the body's AdamW state kept per source (no per-source embeddings): its per-source
# moments reshard like SPEC-OPT's; 3 sources over 2 groups, a constant LR (as spec_opt_source)
LAYOUT_CASES["glob_source"] = {"dept": {"variant": "glob", "local_steps": 2, "body_optimizer_state": "source",
                                        "outer_optimizer": {"name": "nesterov", "lr": 0.7, "momentum": 0.9}},
                               "optim": {"min_lr": 1.0e-2}}
LAYOUT_SOURCES = {json.dumps(LAYOUT_CASES[c], sort_keys=True): 3
                  for c in ("spec_opt_source", "spec_opt_source_4l", "spec_opt_source_ef", "glob_source")}
# (else 2 sources)


def buffer_differences(loop, run_dir: str, step: int, saved_tensor: int) -> dict[str, float]:
    """Per FlatSync chunk buffer (error-feedback residual, eager estimate) this run loaded: the
    largest difference, over every parameter, between what it holds right after the load
    (``group_state``: per parameter, full over dp) and the full tensor that run A saved
    (``dept/{category}/g{g}/{kind}/{name}``, read whole, a strided split's axis merged), cut
    here into this rank's shard independently of the loader."""
    from dept_mega.checkpoint_format import read_full
    if not hasattr(loop.hooks, "outer_syncs"):
        return {}
    pg = loop.trainer.pg
    g, path = pg.group_index, os.path.join(run_dir, "checkpoints", f"step_{step}")
    names = {id(p): n for st in loop.trainer.stages for n, p in st.named_parameters()}
    held = []  # (kind, parameter, the tensor this rank holds, the saved key)
    for cat, sync in sorted(loop.hooks.outer_syncs().items()):
        state = sync.group_state()
        for kind in ("residual", "eager_base"):
            held += [(kind, p, t, f"dept/{cat}/g{g}/{kind}/{names[id(p)]}")
                     for p, t in zip(sync.params, state.get(kind, ()))]
    saved = read_full(path, [key for *_, key in held]) if held else {}  # one read of the checkpoint
    out: dict[str, float] = {}
    for kind, p, t, key in held:
        full = saved[key]
        dim = getattr(p, "partition_dim", None)
        stride = int(getattr(p, "partition_stride", 1) or 1)
        if dim is not None and stride > 1:
            full = full.flatten(dim, dim + 1)
        mine = _cut_shard(full, dim, stride, pg.tp_size, pg.tp_rank)  # this rank's shard of it
        out[kind] = max(out.get(kind, 0.0), float((mine - t).abs().max()))
    return out


def _cut_shard(full, dim, stride: int, parts: int, index: int):
    """Tensor rank ``index``'s shard of ``full`` (blocks of ``stride`` interleaved)."""
    if parts == 1 or dim is None:
        return full
    return torch.cat([b.chunk(parts, dim=dim)[index] for b in full.chunk(stride, dim=dim)], dim=dim)
