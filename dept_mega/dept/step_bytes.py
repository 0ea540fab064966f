"""The bytes of one inner training step of a source group, by category (``dp``, ``tp``, ``pp``),
from the config alone: what dept_mega/parallel/comm.py counts for the collectives of
``Trainer.train_step``, summed over the group's T·D·P ranks (the counting convention of
docs/metrics.md: all-reduce and reduce-scatter count their input, all-gather its shard, send its
tensor). With :func:`predict_outer_sync` (costs.py) a round record's ``dp`` / ``tp`` / ``pp`` are
predictable in full: ``local_steps`` × the sum over the groups of this, plus the outer
synchronisation's share.

Notation: one micro-batch of b sequences of s tokens (``train.micro_batch_size``,
``model.seq_length``), hidden size h, M = ``global_batch_size`` / (b·D) micro-batches per
data-parallel rank, ``a`` bytes per activation (the weights' dtype: there is no autocast),
``g`` bytes per gradient (``optim.grad_dtype``), ``w`` bytes per weight. x = s·b·h·a is one
replicated activation, x/T its sequence shard.

* ``dp`` (grad_buffer.py, distributed_optimizer.py; only when D > 1): every rank reduces each
  bucket of its two gradient buffers (body, embeddings; buckets of :func:`bucket_layout`, padded
  to a multiple of D with ``optim.distributed``) — an all-reduce of the bucket, or with
  ``optim.distributed`` a reduce-scatter of the padded bucket (g bytes each) and, after the
  optimizer step, the all-gather of its 1/D of the updated weights (w bytes each).
* ``tp`` (parallel/mappings.py, cross_entropy.py; only when T > 1), per rank and micro-batch:
  without sequence parallelism x for the embedding's all-reduce (forward), 4x per transformer
  block (the forward all-reduces of proj and fc2, the backward all-reduces before qkv and fc1),
  x for the head's backward all-reduce; with it, every one of those becomes a reduce-scatter of
  x paired with an all-gather of x/T in the other direction (2(x + x/T) per block each way,
  x + x/T for the embedding and for the head), and the QKV, fc1 and head layers with torch
  GEMMs all-gather their input shard again in backward for the weight gradient (x/T each,
  parallel/sp_linear.py; not the native FP8 GEMMs of the FP8 blocks, nor Transformer Engine's). The vocabulary-parallel cross entropy
  all-reduces the max and the (target, Σexp) pair, 12 fp32 bytes per token. A block recomputed
  in backward (``model.recompute: full``, the first ``recompute_layers`` of each chunk) repeats
  its forward collectives up to its last operation that saves a tensor for backward
  (``torch.utils.checkpoint``'s early stop, on by default): all of them with
  ``model.hidden_dropout`` > 0 (the dropout after fc2 saves its mask), else all but fc2's output
  reduction (x). With sequence parallelism the gradients of the tensor-replicated
  parameters (norms, row-parallel biases, learned positions) are all-reduced over tp once per
  step (g bytes; with ``optim.distributed`` each dp rank reduces its own shard of them, so the
  group reduces each once, not D times).
* ``pp`` (parallel/pipeline.py; only when P > 1): every micro-batch crosses the P·V − 1
  boundaries between virtual stages forward (activation) and backward (its gradient), one
  [s, b, h] tensor in the weights' dtype per tensor and data rank ([s/T, b, h] under sequence
  parallelism); with tied embeddings the first and the last stage all-reduce the token table's
  gradient over ``pg.embedding`` once per step (g bytes; with ``optim.distributed`` each dp rank
  its shard).

Not counted (they go around ``comm``): the loss bookkeeping and the gradient norm's reductions
(``torch.distributed`` directly), evaluation. What is data-dependent and so not predicted: a
step skipped for a non-finite loss or gradient norm (e.g. fp16 loss scaling's overflow steps)
makes no optimizer step and therefore no ``optim.distributed`` weight all-gather — the
prediction assumes every step updates. TRIM and SPEC-OPT train a table of the group's own
vocabulary (|V_k| rows of the source it holds), so their ``dp`` depends on which source a
group trains in a round: pass that vocabulary. The prediction is for our own linear layers'
collectives, which every linear backend uses (dept_mega/model/backends.py); FP8 amax reductions are not
in ``comm``.
"""
from __future__ import annotations

from typing import Sequence

from ..config import Config, ConfigError
from .cost_common import PARAM_BYTES, bucket_layout, grad_bytes, rank_params

CE_BYTES_PER_TOKEN = 12  # fp32 max (4) + fp32 (target, Σexp) pair (8), all-reduced over tp


def _microbatches(cfg: Config) -> int:
    t, D = cfg.train, cfg.parallel.data
    if t.global_batch_size % (t.micro_batch_size * D):
        raise ConfigError(f"config key 'train.global_batch_size': {t.global_batch_size} is not a multiple of "
                          f"train.micro_batch_size × parallel.data = {t.micro_batch_size * D}")
    return t.global_batch_size // (t.micro_batch_size * D)


def _sp_numel(cfg: Config, pp_rank: int) -> int:
    """Numel of one rank's tensor-replicated parameters on stage ``pp_rank`` (marked
    ``sequence_parallel``: norms, row-parallel biases, the final norm, learned positions)."""
    from ..model.gpt import chunk_layout

    m, p = cfg.model, cfg.parallel
    h = m.hidden_size
    norm = h * (2 if m.normalization == "layernorm" and m.norm_bias else 1)
    layer = 2 * norm + (2 * h if m.bias else 0)
    chunks = chunk_layout(m.num_layers, p.pipeline, p.virtual_pipeline, pp_rank)
    n = layer * sum(len(ids) for ids in chunks)
    if pp_rank == p.pipeline - 1:
        n += norm
    if pp_rank == 0 and m.position_embedding == "learned":
        n += m.seq_length * h
    return n


def _dp_bytes(cfg: Config, vocab: int) -> int:
    p, o = cfg.parallel, cfg.optim
    T, D, P = p.tensor, p.data, p.pipeline
    if D == 1:
        return 0
    g = grad_bytes(cfg)
    w = PARAM_BYTES[cfg.precision]
    shards = D if o.distributed else 1
    total = 0
    for pp in range(P):
        rp = rank_params(cfg, vocab, pp)
        for numels, isolate in ((rp.body, set()), (rp.emb, rp.emb_isolate)):
            if not numels:
                continue
            padded = sum(b[0] for b in bucket_layout(numels, o.grad_bucket_size, shards,
                                                     isolate if o.distributed else set()))
            total += T * D * padded * g  # every dp rank reduces (all-reduce / reduce-scatter) the buckets
            if o.distributed:
                total += T * padded * w  # D ranks all-gather 1/D of each padded bucket
    return total


def _fp8_column_layers(cfg: Config) -> int:
    """How many of the blocks' QKV and fc1 layers do not run torch GEMMs (so keep their own copy
    of the gathered input instead of all-gathering it again in backward, parallel/sp_linear.py):
    all with Transformer Engine, the FP8 ones with native FP8 (dept/memory_fp8.py)."""
    from .memory_fp8 import fp8_layer_ids, gemm_shapes, native_fp8

    if cfg.backend == "transformer_engine":
        return 2 * cfg.model.num_layers
    if not native_fp8(cfg):
        return 0
    return len(fp8_layer_ids(cfg)) * sum(1 for g in ("qkv", "fc1") if g in gemm_shapes(cfg))


def _tp_bytes(cfg: Config) -> int:
    from ..model.gpt import chunk_layout

    m, p, o = cfg.model, cfg.parallel, cfg.optim
    T, D, P, V = p.tensor, p.data, p.pipeline, p.virtual_pipeline
    if T == 1:
        return 0
    sp = p.sequence_parallel
    a = PARAM_BYTES[cfg.precision]
    b, s, h = cfg.train.micro_batch_size, m.seq_length, m.hidden_size
    x = s * b * h * a
    fwd_block = 2 * (x + x // T) if sp else 2 * x  # qkv / fc1 gathers + proj / fc2 reductions
    bwd_block = fwd_block
    ends = 2 * (x + x // T) if sp else 2 * x  # embedding and head, forward + backward
    regathers = 0  # sequence parallelism: torch-GEMM column-parallel layers all-gather their input again in backward
    if sp:
        regathers = m.num_layers * 2 - _fp8_column_layers(cfg)
        ends += x // T  # the head (untied: a column-parallel layer; tied: the same function)
    recomputed = 0
    if m.recompute == "full":
        for pp in range(P):
            for ids in chunk_layout(m.num_layers, P, V, pp):
                k = m.recompute_layers if m.recompute_layers is not None else len(ids)
                recomputed += min(k, len(ids))
    # torch.utils.checkpoint (non-reentrant, early stop: torch's default) ends a block's
    # recomputation at its last op that saves a tensor for backward: fc2's GEMM, unless hidden
    # dropout follows (its mask is saved), so fc2's output reduction (x) is repeated only then
    again = fwd_block if m.hidden_dropout > 0 else fwd_block - x
    per_rank_mb = (m.num_layers * (fwd_block + bwd_block) + regathers * (x // T) + recomputed * again + ends
                   + CE_BYTES_PER_TOKEN * s * b)
    total = T * D * _microbatches(cfg) * per_rank_mb
    if sp:
        g = grad_bytes(cfg)
        copies = 1 if o.distributed else D  # distributed: the D shards of each parameter add up to one
        total += T * copies * g * sum(_sp_numel(cfg, pp) for pp in range(P))
    return total


def _pp_bytes(cfg: Config, vocab: int) -> int:
    m, p, o = cfg.model, cfg.parallel, cfg.optim
    T, D, P, V = p.tensor, p.data, p.pipeline, p.virtual_pipeline
    if P == 1:
        return 0
    a = PARAM_BYTES[cfg.precision]
    s = m.seq_length // T if p.sequence_parallel and T > 1 else m.seq_length
    act = s * cfg.train.micro_batch_size * m.hidden_size * a
    total = T * D * _microbatches(cfg) * 2 * (P * V - 1) * act
    if m.tie_embeddings:
        g = grad_bytes(cfg)
        table = rank_params(cfg, vocab, 0).emb[0]  # the token table's TP shard
        copies = 1 if o.distributed else D
        total += 2 * T * copies * table * g  # first and last stage
    return total


def predict_inner_step_bytes(cfg: Config, vocab: int) -> dict[str, int]:
    """``{"dp", "tp", "pp"}``: the bytes one inner step of one source group counts, summed over
    its ranks, for a token table of ``vocab`` rows (the group's: the global vocabulary, TRIM's
    |V_k|, SPEC-OPT's source vocabulary). See the module doc for the terms."""
    if vocab < 1:
        raise ConfigError(f"predict_inner_step_bytes: vocabulary size must be >= 1, got {vocab}")
    return {"dp": _dp_bytes(cfg, vocab), "tp": _tp_bytes(cfg), "pp": _pp_bytes(cfg, vocab)}


def predict_inner_round_bytes(cfg: Config, vocabs: Sequence[int]) -> dict[str, int]:
    """The inner steps' share of a round record: ``dept.local_steps`` steps of every group,
    ``vocabs`` = each group's table size this round (one entry per group)."""
    if not vocabs:
        raise ConfigError("predict_inner_round_bytes: need one vocabulary size per group")
    out = {"dp": 0, "tp": 0, "pp": 0}
    for v in vocabs:
        for k, n in predict_inner_step_bytes(cfg, v).items():
            out[k] += cfg.dept.local_steps * n
    return out
