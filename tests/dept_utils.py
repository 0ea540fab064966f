"""Helpers for the DEPT tests: tiny configs, synthetic per-source data, a minimal round loop.

The loop here is the real ``Trainer`` driven by the real ``DeptHooks`` exactly as
``dept_mega.loop.TrainLoop`` drives them (round_start → the source's data position from
``hooks.source_steps`` → local_steps train steps → round_end), without metrics or
evaluation, so that tests can look inside after any round.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Optional, Sequence

import torch

from dept_mega.checkpoint import Checkpointer
from dept_mega.config import Config, config_from_dict
from dept_mega.dept.driver import DeptHooks, SourceInfo
from dept_mega.parallel.groups import Coords, ParallelGroups, build_groups
from dept_mega.trainer import MicroBatch, Trainer

VOCAB = 96

TINY: dict[str, Any] = {
    "model": {"num_layers": 2, "hidden_size": 16, "num_attention_heads": 2, "num_query_groups": 2,
              "ffn_hidden_size": 32, "seq_length": 8, "vocab_size": VOCAB, "position_embedding": "alibi"},
    "precision": "fp32",
    "backend": "local",
    "dept": {"variant": "spec", "local_steps": 2},
    "optim": {"lr": 1.0e-2, "min_lr": 1.0e-3, "warmup_steps": 1, "clip_grad": 1.0, "weight_decay": 0.0},
    "train": {"steps": 4, "micro_batch_size": 2, "global_batch_size": 4, "seed": 5},
}


def merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def tiny_config(over: Optional[dict] = None) -> Config:
    return config_from_dict(merge(TINY, over or {}))


def solo_groups() -> ParallelGroups:
    """A one-rank layout usable inside a distributed job (no process groups)."""
    return ParallelGroups(tp_size=1, dp_size=1, pp_size=1, num_groups=1, rank=0, coords=Coords(0, 0, 0, 0))


class SyntheticSource:
    """Deterministic batches of one source: step i of the global batch depends only on (seed, i);
    tokens are drawn from ``allowed`` (global ids) so a TRIM vocabulary set can be exact."""

    def __init__(self, cfg: Config, seed: int, allowed: torch.Tensor, dp_rank: int = 0, dp_size: int = 1,
                 repeat: bool = False) -> None:
        self.cfg, self.seed, self.allowed = cfg, seed, allowed
        self.repeat = repeat  # the same global batch every step
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.step = 0

    def global_batch(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 10_007 + step)
        t = self.cfg.train
        idx = torch.randint(0, self.allowed.numel(), (t.global_batch_size, self.cfg.model.seq_length + 1), generator=g)
        return self.allowed[idx]

    def next_step(self) -> list[MicroBatch]:
        tokens = self.global_batch(0 if self.repeat else self.step)
        self.step += 1
        per = tokens.shape[0] // self.dp_size
        mine = tokens[self.dp_rank * per:(self.dp_rank + 1) * per]
        b = self.cfg.train.micro_batch_size
        return [MicroBatch(tokens=mine[i:i + b]) for i in range(0, per, b)]

    @property
    def steps(self) -> int:
        return self.step

    def seek(self, steps: int) -> None:
        """Continue at the source's data position (DEPT: from the round plan)."""
        self.step = int(steps)

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, sd: dict) -> None:
        self.step = int(sd["step"])


class SavingOnly(Checkpointer):
    """A Checkpointer that writes only the checkpoints of ``steps`` (empty: none); the loop's
    other saves (every train.save_interval steps, at the end) are skipped. For runs of a test
    that reads only those: each save is ~0.3 s of DCP writes and collectives a rank."""

    def __init__(self, run_dir: str, steps=()) -> None:
        super().__init__(run_dir)
        self.steps = set(steps)

    def save(self, loop):
        return super().save(loop) if loop.trainer.step in self.steps else None


def source_infos(n: int, vocab: int = VOCAB, trim: bool = False, vocabs: Optional[Sequence[int]] = None,
                 seed: int = 0) -> list[SourceInfo]:
    """``n`` sources; with ``trim`` each gets a random V_k (overlapping; some ids in none)."""
    g = torch.Generator().manual_seed(1000 + seed)
    out = []
    for k in range(n):
        v = vocabs[k] if vocabs is not None else vocab
        ids = None
        if trim:
            mask = torch.rand(vocab, generator=g) < 0.4
            mask[k] = True  # non-empty
            ids = torch.nonzero(mask).flatten()
        out.append(SourceInfo(f"s{k}", v, float(k + 1), ids))
    return out


def allowed_ids(info: SourceInfo) -> torch.Tensor:
    return info.vocab_ids if info.vocab_ids is not None else torch.arange(info.vocab_size)


def run_dept(cfg: Config, sources: Sequence[SourceInfo], rounds: int, *, pg: Optional[ParallelGroups] = None,
             data_seed: Optional[dict[str, int]] = None,
             after_round: Optional[Callable[[int, DeptHooks, Trainer], None]] = None,
             on_install: Optional[Callable[[int, DeptHooks, Trainer], None]] = None,
             after_sync: Optional[Callable[[int, DeptHooks, Trainer], None]] = None) -> dict[str, Any]:
    """Train ``rounds`` rounds on this rank; returns per-round group losses and outer records.
    ``after_round``: before the round's end (its outer sync); ``after_sync``: after it."""
    if pg is None:
        p = cfg.parallel
        pg = build_groups(p.tensor, p.data, p.pipeline)
    torch.manual_seed(cfg.train.seed)
    trainer = Trainer(cfg, pg, torch.device("cpu"), vocab_size=sources[0].vocab_size)
    hooks = DeptHooks(cfg, pg, trainer, torch.device("cpu"), sources)
    by_name = {s.name: s for s in sources}
    losses, outer, assignments = [], [], []
    for r in range(rounds):
        assignment = hooks.round_start(None, r)
        assignments.append(assignment)
        if on_install is not None:
            on_install(r, hooks, trainer)
        name = assignment[pg.group_index]
        seed = (data_seed or {}).get(name, sources.index(by_name[name]) + 1)
        it = SyntheticSource(cfg, seed, allowed_ids(by_name[name]), pg.dp_rank, pg.dp_size)
        # the source's data position comes from the plan, as TrainLoop does it: a source
        # continues its data whichever group trained it before
        it.seek(hooks.source_steps(name, trainer.step))
        for _ in range(cfg.dept.local_steps):
            hooks.before_step(None)
            res = trainer.train_step(it.next_step())
            hooks.after_step(None)
            losses.append(res.loss)
        if after_round is not None:
            after_round(r, hooks, trainer)
        outer.append(hooks.round_end(None, r))
        if after_sync is not None:
            after_sync(r, hooks, trainer)
    return {"losses": losses, "outer": outer, "assignments": assignments, "hooks": hooks, "trainer": trainer,
            "pg": pg}


def train_plain(cfg: Config, source: SourceInfo, steps: int, seed: int, *, stages=None,
                embeddings=None) -> Trainer:
    """A single group's run without DEPT (one process, no distributed groups)."""
    torch.manual_seed(cfg.train.seed)
    pg = solo_groups()
    trainer = Trainer(cfg, pg, torch.device("cpu"), vocab_size=source.vocab_size, stages=stages)
    if embeddings is not None:
        trainer.set_embeddings(embeddings)
    it = SyntheticSource(cfg, seed, allowed_ids(source))
    for _ in range(steps):
        trainer.train_step(it.next_step())
    return trainer


def body_vector(trainer: Trainer) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in trainer.body_parameters()])


def emb_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    out = {}
    for i, e in enumerate(trainer.embeddings()):
        if e is not None:
            for k, v in e.state_dict().items():
                out[f"{i}.{k}"] = v.detach().clone()
    return out
