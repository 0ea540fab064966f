"""Helpers for the Hugging Face export tests: tiny runs on the sample corpus, trained with the real
``dept_mega.train`` session (in this process or on gloo ranks), and the reference logits of OUR
model for each source, computed by the training code itself (``eval_context`` installs the
source's embeddings as evaluation does; tensor shards gathered, pipeline stages chained)."""
from __future__ import annotations

import json
import os
from typing import Any, Optional

import torch
import torch.distributed as dist

from tests.trainer_utils import ROOT

TINY_MODEL = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2,
              "ffn_hidden_size": 64, "seq_length": 32, "activation": "swiglu", "normalization": "rmsnorm",
              "position_embedding": "rope", "tie_embeddings": True, "bias": False, "rope_theta": 5000.0}


def config_overrides(run_dir: str, model: Optional[dict] = None, **top: Any) -> list[str]:
    """Dotted overrides that shrink an examples/tiny config to a few steps of a tiny model."""
    m = dict(TINY_MODEL, **(model or {}))
    out = [f"model.{k}={json.dumps(v)}" for k, v in m.items()]
    base = {"train.run_dir": run_dir, "train.steps": 4, "train.micro_batch_size": 2, "train.global_batch_size": 4,
            "train.log_interval": 100, "train.eval_interval": 0, "train.save_interval": 0,
            "dept.local_steps": 2, "optim.warmup_steps": 1}
    base.update(top)
    out += [f"{k}={json.dumps(v)}" for k, v in base.items()]
    return out


def source_text(name: str, index: int = 0) -> str:
    with open(os.path.join(ROOT, "examples", "data", f"{name}.jsonl"), encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i == index:
                return json.loads(line)["text"]
    raise IndexError(index)


def full_logits(trainer, pg, tokens: torch.Tensor) -> Optional[torch.Tensor]:
    """Our model's logits ``[b, s, V_pad]`` for ``tokens`` (no virtual pipeline): each pipeline
    stage passes its hidden states on, the last one gathers the vocabulary shards over TP.
    Returned on the ranks of the last stage, None elsewhere."""
    from dept_mega.model.gpt import activation_shape
    stage = trainer.stages[0]
    stage.eval()
    P = pg.pp_size
    with torch.no_grad():
        x = tokens
        if pg.pp_rank > 0:
            x = torch.empty(activation_shape(trainer.cfg, pg, tokens.shape[0], tokens.shape[1]))
            dist.recv(x, src=pg.pp_ranks[pg.pp_rank - 1])
        out = stage(x)
        if pg.pp_rank < P - 1:
            dist.send(out.contiguous(), dst=pg.pp_ranks[pg.pp_rank + 1])
            return None
        if pg.tp_size > 1:
            parts = [torch.empty_like(out) for _ in range(pg.tp_size)]
            dist.all_gather(parts, out.contiguous(), group=pg.tp)
            out = torch.cat(parts, dim=-1)
    return out


def reference_tokens(cfg, source: str, length: int) -> torch.Tensor:
    """``[1, length]`` ids of the source's first document under the tokenizer the run uses for it."""
    from dept_mega.data.tokenizer import load_tokenizer
    from dept_mega.export.convert import tokenizer_path
    tok = load_tokenizer(tokenizer_path(cfg, source))
    ids = tok.encode(source_text(source))[:length]
    return torch.tensor([ids], dtype=torch.int64)


def train_and_reference(rank: int, world: int, config: str, overrides: list[str]) -> Optional[dict[str, Any]]:
    """Train a run with ``dept_mega.train``'s session (the run's config.yaml written as train
    does), then compute our logits for every source; the last stage's rank 0 of group 0
    returns ``{source: (tokens, logits)}``, the others None."""
    from dept_mega.config import load_config, save_config
    from dept_mega.train import build_session
    torch.manual_seed(0)
    cfg = load_config(os.path.join(ROOT, config), overrides)
    session = build_session(cfg)
    if session.rank == 0:
        os.makedirs(cfg.train.run_dir, exist_ok=True)
        save_config(cfg, os.path.join(cfg.train.run_dir, "config.yaml"))
    session.loop.run()
    pg, loop = session.pg, session.loop
    refs = {}
    for s in cfg.data.sources:
        tokens = reference_tokens(cfg, s.name, cfg.model.seq_length)
        with loop.hooks.eval_context(loop, s.name):
            logits = full_logits(session.trainer, pg, tokens)
        refs[s.name] = (tokens, logits)
    if dist.is_initialized():
        dist.barrier()
    mine = pg.pp_rank == pg.pp_size - 1 and pg.tp_rank == 0 and pg.dp_rank == 0 and pg.group_index == 0
    return refs if mine else None


def reference_at(run_dir: str, step: int) -> dict[str, Any]:
    """Our logits ``{source: (tokens, logits)}`` of checkpoint ``step`` of a single-process run,
    as ``dept_mega.evaluate`` computes them: the run's config, the step's weights loaded into a
    fresh session (with the round hooks' state: inside a round the installed source's tables
    are the group's), each source's embeddings installed by ``eval_context``."""
    from dept_mega.checkpoint import load_weights
    from dept_mega.run_paths import load_run_config
    from dept_mega.train import build_session
    cfg, _ = load_run_config(run_dir)
    session = build_session(cfg, metrics=False, federate=False)
    load_weights(session.trainer, run_dir, step, hooks=session.loop.hooks, optimizer=False, check_data=False)
    session.trainer.step = step
    refs = {}
    for s in cfg.data.sources:
        tokens = reference_tokens(cfg, s.name, cfg.model.seq_length)
        with session.loop.hooks.eval_context(session.loop, s.name):
            refs[s.name] = (tokens, full_logits(session.trainer, session.pg, tokens))
    return refs


def hf_logits(model_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())
