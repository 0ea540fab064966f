"""Helpers for the model / tensor-parallel tests (and for other parts' layout tests).

* ``tiny_config(**model)`` — a small fp32 config without dropout.
* ``full_tensors(module, pg, grads=False)`` — every parameter (or its gradient) rebuilt on its
  full shape from the tensor-parallel shards (uses the ``partition_dim``/``partition_stride``
  attributes of the parameters), keyed by parameter name.
* ``reduce_sequence_parallel_grads(module, pg)`` — what the trainer does under sequence
  parallelism: all-reduce the grads of ``sequence_parallel`` parameters over ``pg.tp``.
* ``rel_err(a, b)`` — ``‖a − b‖ / max(‖b‖, tiny)``.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dept_mega.config import Config, config_from_dict


def tiny_config(parallel: dict[str, Any] | None = None, **model: Any) -> Config:
    m = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=200,
             hidden_dropout=0.0, attention_dropout=0.0)
    m.update(model)
    p = parallel or {}
    # a micro-batch per pipeline stage (an interleaved pipeline needs a multiple of them)
    return config_from_dict({"model": m, "parallel": p, "precision": "fp32", "backend": "auto",
                             "train": {"micro_batch_size": 2,
                                       "global_batch_size": 2 * p.get("data", 1) * p.get("pipeline", 1)}})


def unshard(shards: list[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """Inverse of ``random.shard_rows``: ``shards[r]`` is rank r's shard."""
    if len(shards) == 1:
        return shards[0]
    pieces = [s.chunk(stride, dim=dim) for s in shards]
    return torch.cat([torch.cat([p[b] for p in pieces], dim=dim) for b in range(stride)], dim=dim)


def _gather_tp(t: torch.Tensor, pg) -> list[torch.Tensor]:
    if pg.tp is None:
        return [t]
    out = [torch.empty_like(t) for _ in range(pg.tp_size)]
    dist.all_gather(out, t.contiguous(), group=pg.tp)
    return out


def full_tensors(module: torch.nn.Module, pg, grads: bool = False) -> dict[str, torch.Tensor]:
    """Parameters (or grads) on their full shape; collective over ``pg.tp`` (test-only, uncounted)."""
    out = {}
    for name, p in module.named_parameters():
        t = p.grad if grads else p.data
        if t is None:
            t = torch.zeros_like(p)
        t = t.detach().clone()
        dim = getattr(p, "partition_dim", None)
        if getattr(p, "tensor_parallel", False) and dim is not None:
            t = unshard(_gather_tp(t, pg), dim, getattr(p, "partition_stride", 1))
        out[name] = t
    return out


def reduce_sequence_parallel_grads(module: torch.nn.Module, pg) -> None:
    if pg.tp is None:
        return
    for p in module.parameters():
        if getattr(p, "sequence_parallel", False) and p.grad is not None:
            dist.all_reduce(p.grad, group=pg.tp)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / max(float(b.norm()), 1e-30))


# ----------------------------------------------------------------------------- reference model


def reference_losses(cfg: Config, params: dict[str, torch.Tensor], tokens: torch.Tensor, labels: torch.Tensor,
                     vocab_size: int) -> torch.Tensor:
    """Per-token losses ``[b, s]`` of the model written out naively (batch-first, one head at a
    time, explicit softmax) from FULL weights named as in a single ``GPTStage``. Independent of
    the model code except for the weight layouts (QKV grouped by query group, fc1 = [gate; up])
    and the ALiBi slope formula, which is checked separately."""
    import math

    import torch.nn.functional as F

    from dept_mega.model.positions import alibi_slopes

    m = cfg.model
    P = {k: v.double() for k, v in params.items()}
    b, s = tokens.shape
    H, G, d = m.num_attention_heads, m.query_groups, m.head_dim
    qpg = H // G

    def norm(x, prefix):
        if m.normalization == "layernorm":
            mu = x.mean(-1, keepdim=True)
            var = ((x - mu) ** 2).mean(-1, keepdim=True)
            return (x - mu) / torch.sqrt(var + m.norm_eps) * P[f"{prefix}.weight"] + P[f"{prefix}.bias"]
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + m.norm_eps) * P[f"{prefix}.weight"]

    def linear(x, prefix):
        y = x @ P[f"{prefix}.weight"].t()
        return y + P[f"{prefix}.bias"] if f"{prefix}.bias" in P else y

    def rope(x):  # x [b, s, d]
        inv = 1.0 / (m.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        ang = torch.arange(s, dtype=torch.float64)[:, None] * inv[None, :]  # [s, d/2]
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], -1)

    x = P["embeddings.word_embeddings.weight"][tokens]
    if m.position_embedding == "learned":
        x = x + P["embeddings.position_embeddings.weight"][:s]
    slopes = alibi_slopes(H).double()
    i = torch.arange(s)
    causal = i[None, :] <= i[:, None]
    for layer in range(m.num_layers):
        pre = f"body.layers.{layer}"
        h = norm(x, f"{pre}.input_norm")
        qkv = linear(h, f"{pre}.attention.qkv").view(b, s, G, qpg + 2, d)
        heads = []
        for head in range(H):
            g = head // qpg
            q, k, v = qkv[:, :, g, head % qpg], qkv[:, :, g, qpg], qkv[:, :, g, qpg + 1]
            if m.position_embedding == "rope":
                q, k = rope(q), rope(k)
            score = q @ k.transpose(1, 2) / math.sqrt(d)
            if m.position_embedding == "alibi":
                score = score - slopes[head] * (i[:, None] - i[None, :]).double()
            score = score.masked_fill(~causal, float("-inf"))
            heads.append(torch.softmax(score, -1) @ v)
        x = x + linear(torch.cat(heads, -1), f"{pre}.attention.proj")
        h = linear(norm(x, f"{pre}.mlp_norm"), f"{pre}.mlp.fc1")
        if m.activation == "swiglu":
            gate, up = h.chunk(2, -1)
            h = gate * torch.sigmoid(gate) * up
        else:
            h = 0.5 * h * (1.0 + torch.erf(h / math.sqrt(2.0)))
        x = x + linear(h, f"{pre}.mlp.fc2")
    x = norm(x, "body.final_norm")
    head = P["embeddings.word_embeddings.weight" if m.tie_embeddings else "embeddings.output_layer.weight"]
    logits = (x @ head.t())[..., :vocab_size]  # the padded rows take no probability mass
    return F.cross_entropy(logits.reshape(-1, vocab_size), labels.reshape(-1), reduction="none").view(b, s)
