"""Checkpoints: ``RUN/checkpoints/step_N/`` with torch.distributed.checkpoint, atomically.

Every rank saves its own shards under keys that name their position
(``model/tp{t}/pp{p}/c{chunk}/{param name}``; optimizer moments beside them), so data-parallel
replicas share keys and DCP writes them once. The step directory is first written as
``step_N.tmp``, then renamed by global rank 0 after a barrier, and ``RUN/checkpoints/latest``
(text: N) is replaced atomically, so ``latest`` always names a complete checkpoint.
Scalars (trainer counters, data positions, loss scale) go to ``step_N/state.json``.
Loading needs the same tensor and pipeline sizes (keys carry the position); data-parallel
size may differ. DEPT state (per-source embeddings, outer optimizer) is included when the
hooks provide ``checkpoint_state() -> dict[str, Tensor]`` / ``load_checkpoint_state(dict)``.
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
            key = f"model/tp{pg.tp_rank}/pp{pg.pp_rank}/c{c}/{name}"
            out[key] = p.data
            names.setdefault(id(p), key)
    for opt_name, opt in (("body", trainer.body_optimizer), ("emb", trainer.embedding_optimizer)):
        for group in opt.param_groups:
            for p in group["params"]:
                state = opt.state.get(p)
                if not state or id(p) not in names:
                    continue
                for k, v in state.items():
                    if torch.is_tensor(v):
                        out[f"optim/{opt_name}/{k}/{names[id(p)]}"] = v
    return out


def _ensure_optimizer_state(trainer) -> None:
    """Create AdamW state tensors (zeros) so DCP can load into them in place."""
    for opt in trainer.optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                if p not in opt.state or not opt.state[p]:
                    opt.state[p] = {"step": torch.zeros((), dtype=torch.float32),
                                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}


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
        _barrier()
        state = _model_state(trainer)
        hooks_state = getattr(loop.hooks, "checkpoint_state", None)
        if hooks_state is not None:
            state.update({f"dept/{k}": v for k, v in hooks_state().items()})
        with warnings.catch_warnings():  # single process: DCP warns that it saves without dist
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(state, checkpoint_id=tmp)
        if rank0:
            meta = {"step": step, "trainer": trainer.state_dict(),
                    "iterators": {n: it.state_dict() for n, it in loop.iterators.items()
                                  if hasattr(it, "state_dict")}}
            with open(os.path.join(tmp, "state.json"), "w", encoding="utf-8") as f:
                json.dump(meta, f)
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
        with open(os.path.join(step_dir(self.run_dir, step), "state.json"), encoding="utf-8") as f:
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
    if optimizer:
        _ensure_optimizer_state(trainer)
    state = _model_state(trainer)
    if not optimizer:
        state = {k: v for k, v in state.items() if k.startswith("model/")}
    hooks_state = getattr(hooks, "checkpoint_state", None) if hooks is not None else None
    extra = {}
    if hooks_state is not None:
        extra = {f"dept/{k}": v for k, v in hooks_state().items()}
        state.update(extra)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=path)
    if extra and hasattr(hooks, "load_checkpoint_state"):
        hooks.load_checkpoint_state({k[len("dept/"):]: v for k, v in extra.items()})
