"""What the cost model's two halves share (``costs.py``: parameters and communication;
``memory.py``: memory per rank): the vocabulary padding, and where one rank's
parameters lie — their numels in each optimizer's order, their outer-sync fragments, the
FlatSyncs' chunks per data-parallel rank and the distributed optimizer's buckets and pieces.
Arithmetic on the config only, like both of them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..config import Config, ConfigError
from .outer import chunk_bounds

VOCAB_PAD_MULTIPLE = 128
PARAM_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def grad_bytes(cfg: Config) -> int:
    """Bytes per element of the gradient buffers (``optim.grad_dtype``)."""
    return PARAM_BYTES[cfg.optim.grad_dtype]


def _padded(vocab: int, tensor: int) -> int:
    padded = -(-vocab // VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE
    if padded % tensor:
        raise ConfigError(f"padded vocabulary size {padded} (vocabulary {vocab}) is not divisible by "
                          f"parallel.tensor={tensor}")
    return padded


# ----------------------------------------------------------------------------- parameters of one rank


@dataclass
class RankParams:
    """The numels of one rank's parameters in the optimizers' order (``Trainer.body_parameters``,
    ``make_embedding_optimizer``), and which embedding parameter is the tied table shared over
    pipeline stages (isolated in its own gradient bucket by the distributed optimizer)."""
    body: list[int]
    emb: list[int]
    emb_isolate: set[int]  # indices into ``emb``
    first: bool  # holds the input embeddings (token table, positions)
    last: bool  # holds the head


def _layer_numels(cfg: Config) -> list[int]:
    """One block's parameters on one tensor rank, in registration order (gpt.TransformerBlock)."""
    m, T = cfg.model, cfg.parallel.tensor
    h, f = m.hidden_size, m.ffn_size
    q, kv = m.num_attention_heads * m.head_dim, m.query_groups * m.head_dim
    f1 = 2 * f if m.activation == "swiglu" else f
    norm = [h, h] if m.normalization == "layernorm" and m.norm_bias else [h]

    def linear(n_in: int, n_out: int, column: bool) -> list[int]:
        w = n_in * n_out // T
        if not m.bias:
            return [w]
        return [w, n_out // T if column else n_out]

    return (norm + linear(h, q + 2 * kv, True) + linear(q, h, False) + norm
            + linear(h, f1, True) + linear(f, h, False))


def rank_params(cfg: Config, vocab: int, pp_rank: int) -> RankParams:
    """The parameters of a rank of pipeline stage ``pp_rank`` (every TP/DP rank of a stage holds
    the same numels) with ``vocab`` tokens in its embeddings."""
    from ..model.gpt import chunk_layout

    m, p = cfg.model, cfg.parallel
    P, V, T = p.pipeline, p.virtual_pipeline, p.tensor
    h = m.hidden_size
    layer = _layer_numels(cfg)
    body: list[int] = []
    chunks = chunk_layout(m.num_layers, P, V, pp_rank)
    roles = [(pp_rank == 0 and c == 0, pp_rank == P - 1 and c == V - 1) for c in range(V)]
    for (first, last), ids in zip(roles, chunks):
        for _ in ids:
            body += layer
        if last:  # the final norm
            body += [h, h] if m.normalization == "layernorm" and m.norm_bias else [h]
    emb: list[int] = []
    isolate: set[int] = set()
    table = _padded(vocab, T) // T * h
    tied = m.tie_embeddings
    word_seen = False
    for first, last in roles:
        if not (first or last):
            continue
        if first or (last and tied):
            if not word_seen or P > 1:
                # P = 1: one chunk holds both ends and the tied table is one parameter
                if tied and P > 1:
                    isolate.add(len(emb))
                emb.append(table)
                word_seen = True
        if first and m.position_embedding == "learned":
            emb.append(m.seq_length * h)
        if last and not tied:
            emb.append(table)
    return RankParams(body, emb, isolate, any(r[0] for r in roles), any(r[1] for r in roles))


def rank_body_fragments(cfg: Config, pp_rank: int) -> list[int]:
    """The outer-sync fragment (dept/streaming.py ``fragment_of``: layer i in ⌊i·F/N⌋, the
    final norm in F − 1) of every body parameter of :func:`rank_params`, in the same order."""
    from ..model.gpt import chunk_layout

    m, p = cfg.model, cfg.parallel
    F, N = cfg.dept.outer_fragments, m.num_layers
    per_layer = len(_layer_numels(cfg))
    out: list[int] = []
    chunks = chunk_layout(N, p.pipeline, p.virtual_pipeline, pp_rank)
    for c, ids in enumerate(chunks):
        for i in ids:
            out += [i * F // N] * per_layer
        if pp_rank == p.pipeline - 1 and c == p.virtual_pipeline - 1:
            out += [F - 1] * (2 if m.normalization == "layernorm" and m.norm_bias else 1)
    return out


def sharded_masters(cfg: Config) -> bool:
    """True when the outer sync works on the distributed optimizer's master shards
    (dept/master_shards.py): ``optim.distributed`` with half-precision weights."""
    return cfg.optim.distributed and cfg.precision != "fp32"


def flat_sync_chunks(cfg: Config, numels: Sequence[int], labels: Sequence[int],
                     isolate: set[int] = frozenset()) -> dict[int, list[int]]:
    """The chunk lengths of data-parallel ranks 0..D−1 of the FlatSync of each label (the
    parameters ``numels`` of one optimizer, in its order, labelled by the FlatSync that syncs
    them): D near-equal chunks of the FlatSync's values (``chunk_bounds``), or with sharded
    masters the pieces of the distributed optimizer's shards (:func:`bucket_layout`)."""
    D = cfg.parallel.data
    if not sharded_masters(cfg):
        totals: dict[int, int] = {}
        for n, lab in zip(numels, labels):
            totals[lab] = totals.get(lab, 0) + n
        return {lab: [(lambda se: se[1] - se[0])(chunk_bounds(t, D, d)) for d in range(D)]
                for lab, t in totals.items()}
    buckets = bucket_layout(numels, cfg.optim.grad_bucket_size, D, isolate)
    out = {lab: [0] * D for lab in labels}
    for d in range(D):
        for padded, params in buckets:
            n = padded // D
            ss, se = d * n, (d + 1) * n
            offset = 0
            for i, numel in params:
                a, e = max(offset, ss), min(offset + numel, se)
                if a < e:
                    out[labels[i]][d] += e - a
                offset += numel
    return out


# ----------------------------------------------------------------------------- buffers


def bucket_layout(numels: Sequence[int], bucket_size: int, shards: int,
                  isolate: set[int] = frozenset()) -> list[tuple[int, list[tuple[int, int]]]]:
    """The gradient buffer's buckets (grad_buffer.GradBuffer): parameters in reverse order,
    a new bucket when the next parameter would overflow ``bucket_size`` (or is isolated),
    each bucket padded to a multiple of ``shards``. Returns ``[(padded numel, [(param index,
    numel), ...])]``."""
    buckets: list[tuple[int, list[tuple[int, int]]]] = []
    current: list[tuple[int, int]] = []
    size = 0

    def close() -> None:
        nonlocal current, size
        if current:
            buckets.append((size + (-size) % shards, current))
        current, size = [], 0

    for i in reversed(range(len(numels))):
        n = numels[i]
        alone = i in isolate
        if current and (alone or size + n > bucket_size):
            close()
        current.append((i, n))
        size += n
        if alone:
            close()
    close()
    return buckets


def shard_pieces(buckets, shards: int, rank: int) -> list[int]:
    """Numels of the pieces data-parallel rank ``rank`` owns (distributed_optimizer.Piece)."""
    out = []
    for padded, params in buckets:
        n = padded // shards
        ss, se = rank * n, (rank + 1) * n
        offset = 0
        for _, numel in params:
            a, e = max(offset, ss), min(offset + numel, se)
            if a < e:
                out.append(e - a)
            offset += numel
    return out


def eager_start(cfg: Config) -> bool:
    """The overlapped syncs start from an estimate of θ_t (dept.outer_overlap_rule: eager;
    dept/outer.py "Eager start"): the body's and GLOB's tables' FlatSyncs keep E."""
    d = cfg.dept
    return d.outer_overlap_rule == "eager" and d.outer_overlap and d.outer_delay > 0
