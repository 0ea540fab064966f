"""The analytic counts of dept_mega/dept/costs.py equal the real model's ``sum(p.numel())``.

The model pads each vocabulary to a multiple of 128: the real count is compared with the
``padded=True`` figures, and the true-vocabulary figures differ by exactly the padded rows.
Under TP 2 × PP 2 the parameters summed over ranks are what the outer-round byte prediction
assumes (sharded + T·replicated for the body; the vocab-parallel table once over TP).
"""
from __future__ import annotations

import pytest
import torch

from dept_mega.config import config_from_dict
from dept_mega.dept.costs import (body_params, body_split, embedding_params, model_params, padded_vocab,
                                  position_params)
from dept_mega.model.gpt import build_model
from dept_mega.parallel.groups import build_groups

from .mp_utils import run_distributed

OPTIONS = [
    {},
    {"normalization": "rmsnorm"},
    {"activation": "swiglu"},
    {"position_embedding": "learned"},
    {"position_embedding": "rope"},
    {"num_query_groups": 2},
    {"tie_embeddings": False},
    {"bias": True},
    {"norm_bias": False},
    {"norm_bias": False, "normalization": "rmsnorm"},
    {"bias": True, "activation": "swiglu", "normalization": "rmsnorm", "tie_embeddings": False,
     "position_embedding": "learned", "num_query_groups": 1, "ffn_hidden_size": 48},
]


def _cfg(opts, tensor=1, pipeline=1):
    return config_from_dict({"model": {"num_layers": 4, "hidden_size": 32, "num_attention_heads": 4,
                                       "seq_length": 16, **opts},
                             "parallel": {"tensor": tensor, "pipeline": pipeline},
                             "precision": "fp32", "backend": "local"})


def _count(stages) -> tuple[int, int]:
    seen, body, emb = set(), 0, 0
    for stage in stages:
        for name, p in stage.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            if name.startswith("body."):
                body += p.numel()
            elif name.startswith("embeddings."):
                emb += p.numel()
            else:
                raise AssertionError(f"parameter {name} is neither body nor embeddings")
    return body, emb


@pytest.mark.parametrize("vocab", [100, 256])
@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_analytic_count_equals_model(opts, vocab):
    cfg = _cfg(opts)
    torch.manual_seed(0)
    stages = build_model(cfg, build_groups(1, 1, 1), vocab, seed=1)
    body, emb = _count(stages)
    assert body == body_params(cfg.model)
    assert emb == embedding_params(cfg.model, padded_vocab(vocab))
    assert body + emb == model_params(cfg.model, vocab, padded=True)
    tables = 1 if cfg.model.tie_embeddings else 2
    assert model_params(cfg.model, vocab, padded=True) - model_params(cfg.model, vocab) == \
        tables * (padded_vocab(vocab) - vocab) * cfg.model.hidden_size


def _shard_counts(rank, world_size, opts, vocab):
    torch.set_num_threads(1)
    cfg = _cfg(opts, tensor=2, pipeline=2)
    pg = build_groups(2, 1, 2)
    stages = build_model(cfg, pg, vocab, seed=1)
    body, emb = _count(stages)
    replicated = sum(p.numel() for s in stages for p in s.body.parameters()
                     if getattr(p, "tensor_parallel", True) is False)
    return {"body": body, "emb": emb, "replicated": replicated, "tp": pg.tp_rank, "pp": pg.pp_rank}


@pytest.mark.slow
def test_tp2_pp2_shards_sum_to_the_prediction():
    opts = {"bias": True, "position_embedding": "learned", "tie_embeddings": True}
    vocab = 100
    res = run_distributed(_shard_counts, world_size=4, args=(opts, vocab), timeout=240)
    m = _cfg(opts).model
    split = body_split(m)
    T, h, vp = 2, m.hidden_size, padded_vocab(vocab)
    assert sum(r["body"] for r in res) == split.sharded + T * split.replicated
    assert sum(r["replicated"] for r in res) == T * split.replicated
    # tied under PP 2: the last stage holds a copy of the (vocab-parallel) word table;
    # learned positions are replicated over TP on the first stage
    assert sum(r["emb"] for r in res) == 2 * vp * h + T * position_params(m)
