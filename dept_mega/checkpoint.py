"""Checkpoints: ``RUN/checkpoints/step_N/`` with torch.distributed.checkpoint, atomically.

Every rank saves its own shards under keys that name their position
(``model/g{group}/tp{t}/pp{p}/c{chunk}/{param name}``; optimizer moments beside them), so
data-parallel replicas share keys and DCP writes them once (groups differ under DEPT: the
group is part of the key). The step directory is first written as
``step_N.tmp``, then renamed by global rank 0 after a barrier, and ``RUN/checkpoints/latest``
(text: N) is replaced atomically, so ``latest`` always names a complete checkpoint.
Scalars (trainer counters, data positions, loss scale) go to ``step_N/group{g}.json``, one per
source group (data positions differ between groups under DEPT).
Loading needs the same tensor, pipeline and virtual-pipeline sizes and number of groups (keys
carry the position); the data-parallel size may differ only when no per-rank hook state was
saved (STD). ``step_N/layout.json`` records the layout, so a mismatch is one ConfigError naming
the ``parallel`` key instead of a missing-key traceback from DCP. Round hooks with ``state_dict()`` / ``load_state_dict(sd)`` (DEPT: per-source
embeddings, outer optimizer state — different on every rank) are saved per rank as
``step_N/hooks_rank{r}.pt`` (torch.save) and loaded after the model weights. The dropout
streams (``RNGTracker``) go to ``step_N/rng_tp{t}_pp{p}.pt``, so a resumed run with dropout draws
the masks the uninterrupted run would have drawn.
"""
from __future__ import annotations

import json
import os
import shutil
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist

CKPT_DIR = "checkpoints"
LAYOUT_FILE = "layout.json"


def _layout(trainer, per_rank_hooks: bool) -> dict[str, Any]:
    pg, par = trainer.pg, trainer.cfg.parallel
    out = {"tensor": pg.tp_size, "pipeline": pg.pp_size, "virtual_pipeline": par.virtual_pipeline,
           "data": pg.dp_size, "groups": pg.num_groups, "per_rank_hooks": per_rank_hooks}
    if trainer.cfg.optim.distributed:  # per-rank optimizer shards: their layout must match
        out.update(optim_distributed=True, grad_bucket_size=int(trainer.cfg.optim.grad_bucket_size))
    return out


def _rng_tracker(trainer):
    """The rank's dropout streams (one tracker shared by all its model chunks), if any."""
    return getattr(trainer.stages[0], "rng", None) if trainer.stages else None


def _rng_file(pg) -> str:
    # the streams are seeded by (seed, tensor rank, pipeline rank) and advance identically on
    # every data-parallel replica and source group, so one file per (tp, pp) position
    return f"rng_tp{pg.tp_rank}_pp{pg.pp_rank}.pt"


def check_layout(trainer, path: str, optimizer: bool = True) -> None:
    """Refuse a checkpoint written under another parallel layout with one ConfigError that
    names the key to change (checkpoints are not resharded). ``optimizer``: the optimizer state
    will be loaded too (the distributed optimizer's shards need the same data-parallel size)."""
    from .config import ConfigError
    layout_path = os.path.join(path, LAYOUT_FILE)
    if not os.path.exists(layout_path):
        return
    with open(layout_path, encoding="utf-8") as f:
        saved = json.load(f)
    now = _layout(trainer, per_rank_hooks=False)
    now.setdefault("optim_distributed", False)
    sharded = bool(saved.get("optim_distributed"))  # per-rank optimizer shards (optim.distributed)
    same_dp = saved.get("per_rank_hooks") or (sharded and optimizer)
    keys = ["tensor", "pipeline", "virtual_pipeline"] + (["data"] if same_dp else [])
    wrong = [k for k in keys if saved.get(k) != now[k]]
    if wrong:
        said = ", ".join(f"parallel.{k}={saved.get(k)} (this launch: {now[k]})" for k in wrong)
        raise ConfigError(f"config key 'parallel.{wrong[0]}': checkpoint {path} was written with {said}; "
                          f"resume or evaluate it with the same layout (checkpoints are not resharded)")
    if optimizer and (sharded != now["optim_distributed"]
                      or (sharded and saved.get("grad_bucket_size") != now.get("grad_bucket_size"))):
        key = "optim.distributed" if sharded != now["optim_distributed"] else "optim.grad_bucket_size"
        raise ConfigError(f"config key '{key}': checkpoint {path} was written with optim.distributed={sharded}, "
                          f"optim.grad_bucket_size={saved.get('grad_bucket_size')} (this launch: "
                          f"{now['optim_distributed']}, {trainer.cfg.optim.grad_bucket_size}); its optimizer state loads only "
                          f"with the same settings (not resharded)")


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def latest_step(run_dir: str) -> Optional[int]:
    path = os.path.join(run_dir, CKPT_DIR, "latest")
    if not os.path.exists(path):
        return None
    text = open(path, encoding="utf-8").read().strip()
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{path}: expected a step number, got {text!r}") from None


def step_dir(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, CKPT_DIR, f"step_{step}")


def _model_state(trainer) -> dict[str, torch.Tensor]:
    pg = trainer.pg
    out: dict[str, torch.Tensor] = {}
    names: dict[int, str] = {}
    for c, st in enumerate(trainer.stages):
        for name, p in st.named_parameters():
            key = f"model/g{pg.group_index}/tp{pg.tp_rank}/pp{pg.pp_rank}/c{c}/{name}"
            out[key] = p.data
            names.setdefault(id(p), key)
    # optimizer state beside the weights: ``optim/{body|emb}/{moment}/{param key}`` (fp32
    # masters of half-precision weights under ``main_param``; the distributed optimizer's
    # per-rank shards carry ``/dp{d}of{D}:{start}-{end}``), see dept_mega.optimizer
    for opt_name, opt in (("body", trainer.body_optimizer), ("emb", trainer.embedding_optimizer)):
        for k, v in opt.checkpoint_tensors(lambda p: names.get(id(p))).items():
            out[f"optim/{opt_name}/{k}"] = v
    return out


def _ensure_optimizer_state(trainer) -> None:
    """Create AdamW state tensors (zeros, ``step`` on the device where the AdamW kernel keeps
    it: the parameter's for fused AdamW) so DCP can load into them in place."""
    for opt in trainer.optimizers:
        opt.ensure_state()


class Checkpointer:
    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir

    def save(self, loop) -> str:
        import torch.distributed.checkpoint as dcp
        trainer = loop.trainer
        step = trainer.step
        final = step_dir(self.run_dir, step)
        tmp = final + ".tmp"
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp, exist_ok=True)
            with open(os.path.join(tmp, LAYOUT_FILE), "w", encoding="utf-8") as f:
                json.dump(_layout(trainer, per_rank_hooks=hasattr(loop.hooks, "state_dict")), f)
        _barrier()
        state = _model_state(trainer)
        if hasattr(loop.hooks, "state_dict"):
            rank = dist.get_rank() if dist.is_initialized() else 0
            torch.save(loop.hooks.state_dict(), os.path.join(tmp, f"hooks_rank{rank}.pt"))
        with warnings.catch_warnings():  # single process: DCP warns that it saves without dist
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(state, checkpoint_id=tmp)
        pg = trainer.pg
        tracker = _rng_tracker(trainer)
        if tracker is not None and pg.dp_rank == 0 and pg.group_index == 0:
            torch.save(tracker.state_dict(), os.path.join(tmp, _rng_file(pg)))
        if pg.rank == pg.rank_of(0, 0, 0, pg.group_index):
            # positions are the same on every rank of a group, different across groups (DEPT)
            meta = {"step": step, "trainer": trainer.state_dict(),
                    "iterators": {n: it.state_dict() for n, it in loop.iterators.items()
                                  if hasattr(it, "state_dict")}}
            with open(os.path.join(tmp, f"group{pg.group_index}.json"), "w", encoding="utf-8") as f:
                json.dump(meta, f)
        _barrier()
        if rank0:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            latest = os.path.join(self.run_dir, CKPT_DIR, "latest")
            with open(latest + ".tmp", "w", encoding="utf-8") as f:
                f.write(f"{step}\n")
            os.replace(latest + ".tmp", latest)
        _barrier()
        return final

    def load(self, loop, step: Optional[int] = None) -> Optional[int]:
        """Load ``step`` (default: ``latest``) into the loop's trainer and iterators; returns
        the step loaded or None when there is no checkpoint."""
        step = latest_step(self.run_dir) if step is None else step
        if step is None:
            return None
        load_weights(loop.trainer, self.run_dir, step, hooks=loop.hooks)
        group = loop.trainer.pg.group_index
        with open(os.path.join(step_dir(self.run_dir, step), f"group{group}.json"), encoding="utf-8") as f:
            meta = json.load(f)
        loop.trainer.load_state_dict(meta["trainer"])
        for name, st in meta.get("iterators", {}).items():
            it = loop.iterator(name)
            if hasattr(it, "load_state_dict"):
                it.load_state_dict(st)
        return step


def load_weights(trainer, run_dir: str, step: int, hooks: Any = None, optimizer: bool = True) -> None:
    import torch.distributed.checkpoint as dcp
    path = step_dir(run_dir, step)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    saved_groups = len([f for f in os.listdir(path) if f.startswith("group") and f.endswith(".json")])
    pg = trainer.pg
    if saved_groups and saved_groups != pg.num_groups:
        # keys carry the group: another number of groups would silently load part of the state
        from .config import ConfigError
        per_group = pg.tp_size * pg.pp_size * pg.dp_size
        raise ConfigError(f"config key 'parallel': checkpoint {path} holds {saved_groups} source group(s), but "
                          f"world size {pg.world_size} = {pg.num_groups} group(s) × {per_group} rank(s) per group; "
                          f"launch {saved_groups * per_group} processes")
    check_layout(trainer, path, optimizer=optimizer)
    if hooks is not None and hasattr(hooks, "prepare_load"):
        hooks.prepare_load(step)  # DEPT: the embeddings (vocabulary) installed at that step
    if optimizer:
        _ensure_optimizer_state(trainer)
    state = _model_state(trainer)
    if not optimizer:
        state = {k: v for k, v in state.items() if k.startswith("model/")}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=path)
    for opt in trainer.optimizers:  # weights and fp32 masters agree (masters from the weights without optimizer)
        opt.after_checkpoint_load(with_optimizer=optimizer)
    tracker = _rng_tracker(trainer)
    rng_path = os.path.join(path, _rng_file(pg))
    if tracker is not None and os.path.exists(rng_path):  # older checkpoints have none
        tracker.load_state_dict(torch.load(rng_path, map_location="cpu", weights_only=True))
    if hooks is not None and hasattr(hooks, "load_state_dict"):
        rank = dist.get_rank() if dist.is_initialized() else 0
        hooks_path = os.path.join(path, f"hooks_rank{rank}.pt")
        if not os.path.exists(hooks_path):
            raise FileNotFoundError(f"checkpoint {path} has no round-hook state for rank {rank} ({hooks_path})")
        hooks.load_state_dict(torch.load(hooks_path, map_location=trainer.device, weights_only=False))
