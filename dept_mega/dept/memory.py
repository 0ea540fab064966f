"""Per-rank memory of every DEPT variant, predicted from the config alone (issue 10).

:func:`predict_memory` returns, for the largest rank of a layout, the bytes of

* ``weights``: the model's parameters on the rank (its TP shard of its pipeline chunks; the
  installed embeddings), in the weight dtype (fp32, or bf16/fp16 under ``precision``). With
  ``optim.distributed`` the weights live in one flat buffer per optimizer with the gradient
  buffer's layout, padding included;
* ``grads``: the contiguous gradient buffers (``optim.grad_dtype``; buckets of
  ``optim.grad_bucket_size`` elements, each padded to a multiple of D with ``optim.distributed``,
  the tied word embedding under PP in a bucket of its own) of the body and embedding optimizers;
* ``optimizer``: AdamW's ``exp_avg`` and ``exp_avg_sq`` (fp32) and a 4-byte ``step`` per main
  tensor, plus the fp32 master weights under bf16/fp16. With ``optim.distributed`` these cover
  this rank's pieces only (the intersections of its shard of every bucket with the parameters);
  under fp32 the pieces' masters are views of the weight buffer (no bytes of their own);
* ``outer``: DEPT's outer-sync state — the body's θ_prev (one FlatSync per fragment with
  ``dept.outer_fragments``; and GLOB's embeddings', TRIM's learned positions') and the outer
  optimizer's state (fedavg none, nesterov 1, adam 2 fp32 values per element of this rank's
  chunk; with ``dept.outer_error_feedback`` one more, the residual), plus TRIM's fp32 copy of the
  learned positions. A rank's chunk is 1/D of each FlatSync (``chunk_bounds``) or, with
  ``optim.distributed`` and half-precision weights, the fp32 masters it owns
  (dept/master_shards.py, :func:`flat_sync_chunks`). ``lean`` selects the layout: ``False`` =
  θ_prev full on every data-parallel rank (the layout before issue 10), ``True`` = θ_prev for the
  rank's chunk only (what dept/outer.py does);
* ``trim_table``: TRIM's φ (and φ_head when untied): the rank's row shard (rows split over the
  stage's T·D tensor × data-parallel ranks, ``chunk_bounds``) in fp32, plus its per-row outer
  optimizer state (nesterov: one value per element; adam: two and an int64 step per row);
* ``activations_per_microbatch``: what one micro-batch leaves saved for backward on the rank
  (:func:`activation_bytes`);
* ``ce_transient``: what the cross entropy allocates beyond the tensors it saves (which the
  activations count): 0 on a CUDA device, where its math is compiled into passes that reduce
  the logits in their own dtype and write the gradient into them in place
  (parallel/cross_entropy.py); :func:`ce_transient_bytes` with ``eager=True`` gives the CPU
  (eager) path's one fp32 temporary of the logits' unpadded columns;
* ``fp8_weight_copies``, ``fp8_scaling``: native FP8 (``fp8`` with ``backend: local``): the FP8
  copies of the FP8 GEMMs' weights held during a training step and the delayed-scaling state
  (dept/memory_fp8.py, which also gives the FP8 change of the activations; 0 without FP8 and
  with Transformer Engine, which is not modelled);
* ``total``: the sum of the above with the activations of the micro-batches in flight at the
  pipeline schedule's peak (``in_flight_microbatches``).

Everything but the activations is exact: tests/test_memory.py counts the tensors a real run
holds (parameters, gradient buffers, optimizer state and masters, outer state, φ) and compares.
Not included: SPEC/SPEC-OPT/TRIM sources stored on a rank besides the installed one (K > G, or
``dept.body_optimizer_state: source``: each adds its embeddings, their optimizer state and, for
the latter, the body's moments), transient buffers of collectives and of the outer sync, the
CUDA caching allocator's fragmentation, and the framework's own workspace.

Activations (per micro-batch of b sequences of s tokens, h hidden, q = heads·head_dim,
kv = query_groups·head_dim, f = ffn, f1 = f (2f with swiglu), a = bytes of the activation
dtype, T tensor ranks; Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models", counted for this model's layers). Per transformer layer:

* *replicated* tensors (split over T only with sequence parallelism): the inputs of the two
  norms and of the QKV / fc1 GEMMs (``4·sbh·a``; with SP the QKV and fc1 layers keep their
  input's shard and all-gather it again in backward, parallel/sp_linear.py, as Megatron; with
  ``backend: transformer_engine`` they keep the gathered input whole, ``2·sbh·a``: TE's
  ``Linear`` saves the input it is given, parallel/layers.py gathers before it; ``auto`` is
  counted as ``local``), the norms' statistics (fp32 per token: LayerNorm's mean and 1/σ, RMSNorm's 1/rms), dropout
  masks after the projection and fc2 (``2·sbh·a``: parallel/random.py keeps them in the
  activation dtype, when ``hidden_dropout > 0``);
* *TP-sharded* tensors (always /T): Q, K, V (``sb(q + 2kv)·a``; with RoPE also the rotated Q
  and K, ``sb(q + kv)·a``), the projection's input (``sbq·a``) and the attention output the
  core's backward keeps — the same tensor where the reshape between them is a view (flex on
  CUDA, the CPU's SDPA kernel: ``memory_attention.attention_output_shared``), else one more
  ``sbq·a`` (flash-attn and CUDA SDPA counted as writing ``[b, s, H, d]``) —, fc1's output and
  the activation's output (``sb·f1·a + sb·f·a``; SwiGLU: plus silu(gate), ``sb·f·a``), and the
  core's softmax statistics (``4·b·heads·s`` bytes, fp32); the ``bias`` attention backend on
  CUDA is counted with the scores materialised instead (softmax ``b·heads·s²·a`` and, with
  ``attention_dropout > 0``, its mask ``b·heads·s²`` bytes). The attention kernel is the one
  the trainer picks (``model.attention_backend``, ``auto`` resolved by model/backends.py's
  ``choose_attention`` for the device and whether flash-attn is installed:
  dept/memory_attention.py). These CUDA attention rules are not yet measured on a GPU (the
  ``gpu`` test of tests/test_memory_activations.py measures them).

``recompute: selective`` drops the core's saved tensors (softmax statistics / scores, the
attention output when it is not the projection's input) and keeps the rest; ``full`` keeps only
each recomputed layer's input (``sbh·a``, /T with SP) for ``recompute_layers`` layers of each
chunk (all when unset). The stage with the output layer adds the logits of its vocabulary shard
in the activation dtype (``sb·V_pad/T·a``, which the cross entropy saves and overwrites with
their gradient), the cross entropy's per-token statistics (``21·sb`` bytes: fp32 max, target and
sum of exponentials, the label's int64 column and a flag), the final norm's input and statistics
and its output (the head's input; its shard with SP); the first stage the token ids (``8·sb``;
its output is the first layer's input), with TP the embedding's out-of-shard flags (``sb``),
with hidden dropout its mask. ``activation_bytes(..., device="cpu")`` counts the CPU kernels'
tensors instead where they differ; tests/test_memory_activations.py checks that against the
tensors a CPU run saves, exactly. Pipeline schedule: stage p of 1F1B holds ``min(P − p, m)`` micro-batches in flight,
the interleaved schedule ``min(2(P − p − 1) + (V − 1)P + 1, m·V)`` chunk-micro-batches of 1/V of
its layers each (m micro-batches per step and rank).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

from ..config import Config, ConfigError
from ..variant import VARIANT_NAMES, variant_of
from .cost_common import (PARAM_BYTES, _padded, bucket_layout, eager_start, flat_sync_chunks, grad_bytes,
                          rank_body_fragments, rank_params, shard_pieces)
from .memory_attention import attention_kind, attention_output_shared, scores_saved, statistics_bytes
from .memory_fp8 import fp8_activation_delta, fp8_scaling_bytes, fp8_weight_copy_bytes
from .outer import chunk_bounds

# The layout of FlatSync's θ_prev that dept/outer.py implements: True = the rank's 1/D chunk
# only (lean DEPT state, issue 10; tests/test_memory.py checks it against a run); False = full
# on every data-parallel rank, the layout before it (``--outer-state full`` predicts that).
FLATSYNC_THETA_CHUNK_ONLY = True

MEMORY_KEYS = ("weights", "grads", "optimizer", "outer", "trim_table", "activations_per_microbatch",
               "ce_transient", "fp8_weight_copies", "fp8_scaling", "total")
OUTER_STATE = {"fedavg": 0, "nesterov": 1, "adam": 2}  # fp32 values per element of outer optimizer state


# ----------------------------------------------------------------------------- buffers


def _optimizer_bytes(cfg: Config, numels: Sequence[int], isolate: set[int]) -> dict[str, int]:
    """weights, grads and optimizer bytes of one InnerOptimizer over ``numels`` on dp rank 0."""
    o, D = cfg.optim, cfg.parallel.data
    wb = PARAM_BYTES[cfg.precision]
    gb = grad_bytes(cfg)
    half = cfg.precision != "fp32"
    if not numels:
        return {"weights": 0, "grads": 0, "optimizer": 0}
    shards = D if o.distributed else 1
    buckets = bucket_layout(numels, o.grad_bucket_size, shards, isolate if o.distributed else set())
    buf = sum(b[0] for b in buckets)
    if o.distributed:
        mains = shard_pieces(buckets, D, 0)
        weights = buf * wb
    else:
        mains = list(numels)
        weights = sum(numels) * wb
    # exp_avg + exp_avg_sq fp32, a 4-byte step per main tensor, fp32 masters under half weights
    opt = sum(8 * n + 4 for n in mains) + (4 * sum(mains) if half else 0)
    return {"weights": weights, "grads": buf * gb, "optimizer": opt}


def _flat_sync_bytes(numel: int, D: int, name: str, lean: bool, chunk: Optional[int] = None,
                     residual: bool = False, eager: bool = False) -> int:
    """FlatSync (dept/outer.py) on dp rank 0: θ_prev (full, or the chunk when ``lean``), the
    outer optimizer's state for the chunk and, with error feedback, the residual, with the
    eager start the estimate E, fp32.
    ``chunk``: rank 0's chunk (default: the first of D near-equal chunks)."""
    if numel == 0:
        return 0
    if chunk is None:
        s, e = chunk_bounds(numel, D, 0)
        chunk = e - s
    theta = chunk if lean else numel
    return 4 * (theta + (OUTER_STATE[name] + int(residual) + int(eager)) * chunk)


def _outer_bytes(cfg: Config, numels: Sequence[int], labels: Sequence[int], isolate: set[int], lean: bool) -> int:
    """The outer state of the FlatSyncs over one optimizer's parameters (one per label)."""
    d = cfg.dept
    totals: dict[int, int] = {}
    for n, lab in zip(numels, labels):
        totals[lab] = totals.get(lab, 0) + n
    chunks = flat_sync_chunks(cfg, numels, labels, isolate)
    ef, eager = d.outer_error_feedback, eager_start(cfg)
    return sum(_flat_sync_bytes(totals[lab], cfg.parallel.data, d.outer_optimizer.name, lean, chunks[lab][0], ef,
                                eager) for lab in totals)


def trim_shards(cfg: Config) -> int:
    """The ranks φ's rows are split over: the stage's tensor × data-parallel ranks."""
    return cfg.parallel.tensor * cfg.parallel.data


def _trim_table_bytes(cfg: Config, vocab: int) -> int:
    """One φ table's shard on the largest rank (row shard 0) and its per-row outer state."""
    S = trim_shards(cfg)
    a, b = chunk_bounds(vocab, S, 0)
    rows = b - a
    h = cfg.model.hidden_size
    name = cfg.dept.outer_optimizer.name
    return 4 * rows * h * (1 + OUTER_STATE[name]) + (8 * rows if name == "adam" else 0)


# ----------------------------------------------------------------------------- activations


def activation_bytes(cfg: Config, vocab: int, pp_rank: int, device: str = "cuda",
                     flash_installed: Optional[bool] = None) -> int:
    """Bytes one micro-batch leaves saved for backward on a rank of stage ``pp_rank`` (formula
    in the module doc; native FP8: plus :func:`memory_fp8.fp8_activation_delta` for the same
    attention kernel). ``device``: the kernels whose saved tensors are counted,
    ``cuda`` (the prediction) or ``cpu`` (where they differ: the norms' statistics in the
    activation dtype, the CPU SDPA kernel's output shared with the projection's input and, for
    the ``bias`` backend, its log-sum-exp instead of the scores; tests/test_memory_activations.py
    measures it). The attention kernel is the trainer's choice on ``device``
    (:func:`memory_attention.attention_kind`; ``flash_installed``: None = whether flash-attn
    imports here)."""
    from ..model.gpt import chunk_layout

    m, p = cfg.model, cfg.parallel
    T, P, V = p.tensor, p.pipeline, p.virtual_pipeline
    sp = p.sequence_parallel and T > 1
    a = PARAM_BYTES[cfg.precision] if cfg.precision != "fp32" else 4
    b, s, h = cfg.train.micro_batch_size, m.seq_length, m.hidden_size
    f = m.ffn_size
    f1 = 2 * f if m.activation == "swiglu" else f
    q, kv = m.num_attention_heads * m.head_dim, m.query_groups * m.head_dim
    heads = m.num_attention_heads
    sbh = s * b * h
    rep = sbh // T if sp else sbh  # a replicated [s, b, h] tensor on one rank
    tokens = s * b // T if sp else s * b  # the rows of one
    drop = m.hidden_dropout > 0
    # a norm keeps its input (counted with the replicated tensors) and its statistics: LayerNorm
    # mean and 1/σ, RMSNorm 1/rms, one per token, fp32 on CUDA (the CPU's LayerNorm: activation dtype)
    stat = 4 if device == "cuda" or a == 4 else a
    norm_stats = (2 if m.normalization == "layernorm" else 1) * tokens * stat
    # dropout (parallel/random.py) keeps its mask in the activation dtype
    per_layer_rep = 4 * rep * a + 2 * norm_stats + (2 * rep * a if drop else 0)
    if sp and cfg.backend == "transformer_engine":  # TE's QKV and fc1 keep the gathered input, not its shard
        per_layer_rep += 2 * (sbh - rep) * a
    qkv = s * b * (q + 2 * kv) // T * a
    if m.position_embedding == "rope":  # the attention keeps the rotated Q and K, new tensors
        qkv += s * b * (q + kv) // T * a
    proj_in = s * b * q // T * a
    mlp = (s * b * f1 // T + s * b * f // T) * a  # fc1's output, the activation's output
    if m.activation == "swiglu":  # silu(gate), a new tensor the product keeps
        mlp += s * b * f // T * a
    kind = attention_kind(cfg, device, flash_installed)
    if scores_saved(kind, device, m.attention_dropout):
        core = b * heads // T * s * s * a + (b * heads // T * s * s if m.attention_dropout > 0 else 0)
    else:  # the fused kernels' log-sum-exp (the CPU SDPA kernel takes the bias without materialising the scores)
        core = statistics_bytes(kind, device, cfg.precision, b * heads // T, s)
    # the core's output, saved by its backward; the same tensor as the projection's input when
    # the reshape between them is a view (flex on CUDA, the CPU kernels: attention_output_shared)
    shared = attention_output_shared(kind, device)
    core_out = 0 if shared else s * b * q // T * a
    full_layer = per_layer_rep + qkv + proj_in + mlp + core + core_out
    if m.recompute == "selective":
        full_layer -= core + core_out
    total = 0
    chunks = chunk_layout(m.num_layers, P, V, pp_rank)
    for c, ids in enumerate(chunks):
        n = len(ids)
        if m.recompute == "full":
            k = min(m.recompute_layers if m.recompute_layers is not None else n, n)
            total += k * rep * a + (n - k) * full_layer
        else:
            total += n * full_layer
        first = pp_rank == 0 and c == 0
        last = pp_rank == P - 1 and c == V - 1
        if first:  # the token ids (the embedding's output is the first layer's input), its dropout
            # mask; a vocabulary-parallel table also keeps which ids are outside its rows (bool)
            total += 8 * s * b + (s * b if T > 1 else 0) + (rep * a if drop else 0)
        if last:  # the final norm's input and statistics, the head's input (its shard with SP), the logits
            total += 2 * rep * a + norm_stats + _logits_elems(cfg, vocab) * a + CE_TOKEN_BYTES * s * b
    return total + fp8_activation_delta(cfg, pp_rank, shared)


# Saved by the cross entropy per token: the fp32 max, the fp32 [target, Σexp] pair, the label's
# int64 column and a bool flag (parallel/cross_entropy.py)
CE_TOKEN_BYTES = 4 + 8 + 8 + 1


def _logits_elems(cfg: Config, vocab: int) -> int:
    """Elements of one micro-batch's logits on a tensor rank (its vocabulary shard)."""
    return cfg.train.micro_batch_size * cfg.model.seq_length * (_padded(vocab, cfg.parallel.tensor)
                                                                // cfg.parallel.tensor)


def ce_transient_bytes(cfg: Config, vocab: int, pp_rank: int, eager: bool = False) -> int:
    """The cross entropy's peak beyond the tensors it saves (counted in the activations) on a
    rank of stage ``pp_rank``. Compiled (CUDA): 0 — its passes read the logits in their own
    dtype and write the gradient into them. ``eager`` (CPU): one fp32 copy of the rank's
    unpadded columns, made in the forward (for the sum of exponentials) and again in the
    backward (for the gradient), freed before each returns. 0 without the output layer."""
    if pp_rank != cfg.parallel.pipeline - 1 or not eager:
        return 0
    T = cfg.parallel.tensor
    columns = min(_padded(vocab, T) // T, vocab)  # the first rank's unpadded columns: the most
    return cfg.train.micro_batch_size * cfg.model.seq_length * columns * 4


def in_flight_microbatches(cfg: Config, pp_rank: int = 0) -> float:
    """Micro-batches whose activations a rank of stage ``pp_rank`` holds at the schedule's peak
    (fractional with virtual pipelining: a chunk-micro-batch is 1/V of the rank's layers)."""
    p, t = cfg.parallel, cfg.train
    P, V = p.pipeline, p.virtual_pipeline
    m = max(1, t.global_batch_size // (t.micro_batch_size * p.data))
    if V == 1:
        return float(min(P - pp_rank, m))
    return min(2 * (P - pp_rank - 1) + (V - 1) * P + 1, m * V) / V


# ----------------------------------------------------------------------------- variants


def variant_vocab(variant: str, global_vocab: int, source_vocabs: Sequence[int],
                  trim_vocabs: Sequence[int]) -> int:
    """The token table a group trains with; the largest where it differs per source."""
    v = variant_of(variant)
    if v.own_tokenizer:
        if not source_vocabs:
            raise ConfigError("no per-source vocabulary size for spec_opt: set data.sources[i].tokenizer "
                              "or pass --source-vocab N")
        return max(source_vocabs)
    if v.trimmed:
        return max(trim_vocabs) if trim_vocabs else global_vocab
    return global_vocab


def predict_memory(cfg: Config, global_vocab: int, source_vocabs: Sequence[int] = (),
                   trim_vocabs: Sequence[int] = (), lean_outer: Optional[bool] = None,
                   stage: Optional[int] = None) -> dict[str, int]:
    """Bytes per rank (the largest rank, or pipeline stage ``stage``'s) of ``cfg.dept.variant``
    (see the module doc); the keys of :data:`MEMORY_KEYS` plus ``in_flight_microbatches``.
    ``lean_outer``: θ_prev for the rank's 1/D chunk only (None: what this code base does,
    :data:`FLATSYNC_THETA_CHUNK_ONLY`)."""
    if lean_outer is None:
        lean_outer = FLATSYNC_THETA_CHUNK_ONLY
    m, p, d = cfg.model, cfg.parallel, cfg.dept
    v = variant_of(cfg)
    vocab = variant_vocab(d.variant, global_vocab, source_vocabs, trim_vocabs)
    best: Optional[dict] = None
    for pp in range(p.pipeline) if stage is None else (stage,):
        rp = rank_params(cfg, vocab, pp)
        body = _optimizer_bytes(cfg, rp.body, set())
        emb = _optimizer_bytes(cfg, rp.emb, rp.emb_isolate)
        out = {k: body[k] + emb[k] for k in ("weights", "grads", "optimizer")}
        name, D = d.outer_optimizer.name, p.data
        outer = trim = 0
        if v.rounds:  # one FlatSync per fragment of the body
            outer += _outer_bytes(cfg, rp.body, rank_body_fragments(cfg, pp), set(), lean_outer)
        if v.synced_table:
            outer += _outer_bytes(cfg, rp.emb, [0] * len(rp.emb), rp.emb_isolate, lean_outer)
        if v.trimmed:
            if rp.first and m.position_embedding == "learned":
                pos = m.seq_length * m.hidden_size
                outer += 4 * pos + _flat_sync_bytes(pos, D, name, lean_outer,  # positions copy + its sync
                                                     residual=d.outer_error_feedback)
            tables = 0
            if rp.first or (rp.last and m.tie_embeddings):
                tables += 1
            if rp.last and not m.tie_embeddings:
                tables += 1
            trim = tables * _trim_table_bytes(cfg, global_vocab)
        out["outer"] = outer
        out["trim_table"] = trim
        act = activation_bytes(cfg, vocab, pp)
        flight = in_flight_microbatches(cfg, pp)
        out["activations_per_microbatch"] = act
        out["ce_transient"] = ce_transient_bytes(cfg, vocab, pp)
        out["fp8_weight_copies"] = fp8_weight_copy_bytes(cfg, pp)
        out["fp8_scaling"] = fp8_scaling_bytes(cfg, pp)
        held = ("weights", "grads", "optimizer", "outer", "trim_table", "ce_transient", "fp8_weight_copies",
                "fp8_scaling")
        out["total"] = sum(out[k] for k in held) + int(math.ceil(flight * act))
        out["in_flight_microbatches"] = flight
        if best is None or out["total"] > best["total"]:
            best = out
    return best


def predict_memory_variants(cfg: Config, global_vocab: int, source_vocabs: Sequence[int] = (),
                            trim_vocabs: Sequence[int] = (), lean_outer: Optional[bool] = None) -> dict[str, dict]:
    """:func:`predict_memory` for every variant (``cfg.dept.variant`` replaced)."""
    out = {}
    for name in VARIANT_NAMES:
        one = dataclasses.replace(cfg, dept=dataclasses.replace(cfg.dept, variant=name))
        if variant_of(name).own_tokenizer and not source_vocabs:
            continue
        out[name] = predict_memory(one, global_vocab, source_vocabs, trim_vocabs, lean_outer)
    return out


# ----------------------------------------------------------------------------- measurement


def held_bytes(trainer, hooks=None) -> dict[str, int]:
    """The bytes of the tensors a live trainer (and DEPT round hooks) hold, by the categories
    of :func:`predict_memory` (no activations): counted from the objects, each storage once
    (the first category that reaches it wins: weights, grads, optimizer, outer, trim_table)."""
    import torch

    seen: set[int] = set()
    out = {k: 0 for k in ("weights", "grads", "optimizer", "outer", "trim_table")}

    def add(cat: str, t) -> None:
        if not torch.is_tensor(t):
            return
        st = t.untyped_storage()
        key = st.data_ptr()
        if key in seen or st.nbytes() == 0:
            return
        seen.add(key)
        out[cat] += st.nbytes()

    for p in trainer.parameters():
        add("weights", p)
    for opt in trainer.optimizers:
        if opt.buffer.data is not None:
            add("grads", opt.buffer.data)
    for p in trainer.parameters():
        add("grads", p.grad)
    for opt in trainer.optimizers:
        for state in opt.inner.state.values():
            for v in state.values():
                add("optimizer", v)
        if opt.distributed:
            for pc in opt.pieces:
                add("optimizer", pc.main)
        else:
            for p in opt.params:
                add("optimizer", getattr(p, "main_param", None))
    if hooks is None:
        return out
    strategy = hooks.strategy

    def add_sync(sync) -> None:
        if sync is None:
            return
        add("outer", sync.theta_prev)
        for v in sync.optimizer.state.values():
            add("outer", v)
        add("outer", sync.residual)  # error feedback (None without)
        add("outer", sync.eager_base)  # the eager start (None without)

    for sync in hooks.outer_syncs().values():  # the body's (per fragment) and GLOB's tables
        add_sync(sync)
    add_sync(getattr(strategy, "position_sync", None))
    add("outer", getattr(strategy, "positions", None))
    for table in (getattr(strategy, "phi", None), getattr(strategy, "phi_head", None)):
        if table is not None:
            add("trim_table", table.weight)
            for v in table.optimizer.state.values():
                add("trim_table", v)
    return out
