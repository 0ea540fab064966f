"""Analytic parameter, memory and communication costs of every DEPT variant (paper Table 1).

Everything here is arithmetic on the ``model`` section of a :class:`~dept_mega.config.Config`;
nothing is built or communicated. ``tools/dept_costs.py`` prints it; the DEPT tests compare
the bytes a real run measures with :func:`predict_outer_round_bytes`.

Parameter counting (must equal ``sum(p.numel())`` of the real model, see tests/test_costs*.py):

* per block: input norm, QKV projection ``h × (q + 2·kv)`` (q = heads·head_dim,
  kv = query_groups·head_dim), output projection ``q × h``, pre-MLP norm, MLP
  ``h × ffn`` and ``ffn × h`` (swiglu: the first is ``h × 2·ffn``); biases on every linear
  layer when ``model.bias``; a layernorm has weight + bias (weight only with
  ``model.norm_bias: false``), an rmsnorm a weight only;
* body = blocks + final norm;
* embeddings = token table ``V × h`` + learned positions ``L × h`` (only with
  ``position_embedding: learned``) + output head ``V × h`` (only when untied; no bias).

Vocabulary: the paper (and every ``*_params`` figure below) counts the *true* vocabulary.
The real model pads its table to a multiple of 128 (Megatron's make-vocab-size-divisible-by,
so any TP size divides it and losses do not depend on T); the padded rows are real
parameters of the model but carry no token. ``padded_*`` fields report that count, which is
what ``sum(p.numel())`` returns and what GLOB actually synchronises.

"Per-step communication" follows the paper's Table 1: what crosses source groups per inner
step, in parameters. STD all-reduces its gradients every step (M); GLOB synchronises the
whole model once per round (M / N_local); TRIM the body, positions and the trimmed rows
(M − (|V| − |V̄_k|)·h, twice the rows when untied) / N_local; SPEC and SPEC-OPT the body only
(M − (|V| + L)·h for a tied model) / N_local.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

from ..config import Config, ConfigError, ModelConfig
from ..variant import VARIANT_NAMES as VARIANTS, variant_of  # noqa: F401 (VARIANTS: importable from here)
from .cost_common import (PARAM_BYTES, VOCAB_PAD_MULTIPLE, eager_start, flat_sync_chunks, rank_body_fragments, rank_params, sharded_masters)
# the vocabulary sizes (cost_vocabs.py), importable from here too
from .cost_vocabs import Vocabs, _mean, resolve_vocabs, tokenizer_vocab_size  # noqa: F401
# the per-rank memory model (memory.py), importable from here too
from .memory import (MEMORY_KEYS, activation_bytes, held_bytes, predict_memory,  # noqa: F401
                     predict_memory_variants)

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


# ----------------------------------------------------------------------------- parameters


def padded_vocab(vocab: int, multiple: int = VOCAB_PAD_MULTIPLE) -> int:
    """The table size the model allocates for ``vocab`` tokens."""
    return int(math.ceil(vocab / multiple) * multiple)


def _norm_params(m: ModelConfig) -> int:
    return 2 * m.hidden_size if m.normalization == "layernorm" and m.norm_bias else m.hidden_size


@dataclass(frozen=True)
class LayerSplit:
    """A block's parameters split by how tensor parallelism stores them.

    ``sharded``: split over the T tensor ranks (QKV, fc1 and their biases, projection and
    fc2 weights); ``replicated``: held whole by every tensor rank (norms, biases of the
    row-parallel layers). Summed over the T ranks a block holds sharded + T·replicated.
    """

    sharded: int
    replicated: int

    @property
    def total(self) -> int:
        return self.sharded + self.replicated


def layer_split(m: ModelConfig) -> LayerSplit:
    h, ffn = m.hidden_size, m.ffn_size
    q = m.num_attention_heads * m.head_dim
    kv = m.query_groups * m.head_dim
    fc1_out = 2 * ffn if m.activation == "swiglu" else ffn
    sharded = h * (q + 2 * kv) + q * h + h * fc1_out + ffn * h
    replicated = 2 * _norm_params(m)
    if m.bias:
        sharded += (q + 2 * kv) + fc1_out  # column-parallel biases are split with their rows
        replicated += h + h  # row-parallel biases (attention output, fc2) are replicated
    return LayerSplit(sharded, replicated)


def layer_params(m: ModelConfig) -> int:
    """Parameters of one transformer block."""
    return layer_split(m).total


def body_split(m: ModelConfig) -> LayerSplit:
    """The whole body (blocks + final norm) split as :class:`LayerSplit`."""
    one = layer_split(m)
    return LayerSplit(m.num_layers * one.sharded, m.num_layers * one.replicated + _norm_params(m))


def body_params(m: ModelConfig) -> int:
    """The shared transformer body θ: every block plus the final norm."""
    return body_split(m).total


def position_params(m: ModelConfig) -> int:
    return m.seq_length * m.hidden_size if m.position_embedding == "learned" else 0


def embedding_params(m: ModelConfig, vocab: int) -> int:
    """Vocabulary-owned parameters (everything the model keeps under ``embeddings.``):
    token table, learned positions, untied head."""
    tables = 1 if m.tie_embeddings else 2
    return tables * vocab * m.hidden_size + position_params(m)


def model_params(m: ModelConfig, vocab: int, padded: bool = False) -> int:
    """Body + embeddings for one vocabulary (``padded``: the allocated table size)."""
    v = padded_vocab(vocab) if padded else vocab
    return body_params(m) + embedding_params(m, v)


# ----------------------------------------------------------------------------- variants


@dataclass
class VariantCosts:
    """One variant's figures for one source group's working model (true vocabulary).

    ``vocab``: rows of the token table a group trains with (the mean over sources where it
    differs per source). ``per_step_comm_params``: what crosses groups per inner step, in
    parameters (paper Table 1); ``per_round_comm_params`` the same per round.
    """

    vocab: float
    body_params: int
    embedding_params: float
    total_params: float
    per_step_comm_params: float
    per_round_comm_params: float
    padded_vocab: float
    padded_total_params: float
    note: str = ""


def predict_costs(cfg: Config, global_vocab: Optional[int], source_vocabs: Optional[Sequence[int] | dict] = None,
                  trim_vocabs: Optional[Sequence[int] | dict] = None) -> dict[str, dict]:
    """Table 1 for ``cfg.model`` and ``cfg.dept.local_steps``: ``{variant: VariantCosts dict}``.

    ``global_vocab`` is required. ``source_vocabs`` (SPEC-OPT's per-source tokenizers) and
    ``trim_vocabs`` (TRIM's |V_k|) may be lists or ``{source: size}``; their mean is used.
    Without ``source_vocabs`` SPEC-OPT raises; without ``trim_vocabs`` TRIM is reported
    untrimmed (|V_k| = |V|, an upper bound) with a note saying so.
    """
    if global_vocab is None:
        raise ConfigError("no global vocabulary size: set data.tokenizer (or model.vocab_size) "
                          "or pass --global-vocab N")
    m, n_local = cfg.model, cfg.dept.local_steps
    h = m.hidden_size
    tables = 1 if m.tie_embeddings else 2
    body = body_params(m)
    pos = position_params(m)
    full = model_params(m, global_vocab)  # M of Table 1

    def mean(x) -> Optional[float]:
        if x is None:
            return None
        return _mean(x.values() if isinstance(x, dict) else x)

    def sizes(x) -> list[int]:
        return list(x.values() if isinstance(x, dict) else x) if x else []

    src_mean, trim_mean = mean(source_vocabs), mean(trim_vocabs)
    if src_mean is None:
        raise ConfigError("no per-source vocabulary size for spec_opt: set data.sources[i].tokenizer "
                          "or pass --source-vocab N")
    trim_note = ""
    if trim_mean is None:
        trim_mean = float(global_vocab)
        trim_note = "mean |V_k| unknown: reported untrimmed (|V_k| = |V|, an upper bound); pass --trim-vocab N"
    if trim_mean > global_vocab:
        raise ConfigError(f"mean TRIM vocabulary {trim_mean} exceeds the global vocabulary {global_vocab}")

    def entry(vocab: float, per_step: float, per_round: float, padded_sizes: list[int], note: str = "") -> dict:
        emb = tables * vocab * h + pos
        padded = _mean([padded_vocab(v) for v in padded_sizes])
        padded_total = body + tables * padded * h + pos
        return asdict(VariantCosts(vocab=_num(vocab), body_params=body, embedding_params=_num(emb),
                                   total_params=_num(body + emb), per_step_comm_params=_num(per_step),
                                   per_round_comm_params=_num(per_round), padded_vocab=_num(padded),
                                   padded_total_params=_num(padded_total), note=note))

    trimmed = body + tables * trim_mean * h + pos  # what TRIM synchronises per round
    gv = [global_vocab]
    return {
        "std": entry(global_vocab, full, full * n_local, gv,
                     "per-step data-parallel gradient all-reduce of the whole model"),
        "glob": entry(global_vocab, full / n_local, full, gv),
        "trim": entry(trim_mean, trimmed / n_local, trimmed, sizes(trim_vocabs) or gv, trim_note),
        "spec": entry(global_vocab, body / n_local, body, gv,
                      "one full global-vocabulary table per source (never averaged)"),
        "spec_opt": entry(src_mean, body / n_local, body, sizes(source_vocabs)),
    }


def _num(x: float) -> float | int:
    """Integers stay integers in the JSON; fractions are kept exact as floats."""
    return int(x) if float(x).is_integer() else float(x)


# ----------------------------------------------------------------------------- bytes


def trim_row_counts(n_real: int, tensor: int, data: int) -> list[list[int]]:
    """Rows of a compact TRIM table of ``n_real`` real rows that rank (tp t, dp d) sends:
    ``counts[t][d]``. The table is padded to 128 and split over TP in equal slices (the
    padded rows carry no id and are never sent); the D replicas split a slice's real rows
    into near-equal chunks (dept/outer.py ``chunk_bounds``)."""
    padded = padded_vocab(n_real) if n_real else 0
    per = padded // tensor
    counts = []
    for t in range(tensor):
        real = max(0, min((t + 1) * per, n_real) - min(t * per, n_real))
        base, extra = divmod(real, data)
        counts.append([base + (1 if d < extra else 0) for d in range(data)])
    return counts


def trim_exchange_bytes(trim_vocabs: Sequence[int], hidden: int, tensor: int, data: int,
                        wire_bytes: int | str, quant_block: int = 256) -> dict[str, int]:
    """Bytes of one TRIM table's row exchange (dept/trim.py ``exchange_rows``), summed over ranks.

    Each gather is an all-gather of equal-size parts (gloo and NCCL need them): first one
    int64 count per rank, then every rank's (ids int64, rows) padded to the largest part in
    its group — the padding is sent and counted. Over the outer group (G = len(trim_vocabs)
    ranks at one (tp, dp) position) the rows travel in ``wire_bytes`` per value; the
    re-gathers inside a group, over dp then tp, are fp32 and carry what was received.
    ``wire_bytes`` may name a block-quantised format (fp8 | int8 | int4): a part's rows then
    travel as one packed buffer (payload + a scale per ``quant_block`` values).
    """
    def rows_bytes(rows: int) -> int:
        if isinstance(wire_bytes, str):
            return _wire_bytes(rows * hidden, wire_bytes, quant_block)
        return rows * hidden * wire_bytes

    G = len(trim_vocabs)
    fp32 = DTYPE_BYTES["fp32"]
    counts = [trim_row_counts(v, tensor, data) for v in trim_vocabs]  # [k][t][d]
    out = {"outer_embedding": 0, "dp": 0, "tp": 0}
    for t in range(tensor):
        # over the outer group at (t, d): G parts of the largest count
        if G > 1:
            for d in range(data):
                largest = max(counts[k][t][d] for k in range(G))
                out["outer_embedding"] += G * (8 + largest * 8 + rows_bytes(largest))
        # over dp at tp t (same content in every group): each replica sends what it received
        if data > 1:
            received = [sum(counts[k][t][d] for k in range(G)) for d in range(data)]
            out["dp"] += G * data * (8 + max(received) * (8 + hidden * fp32))
    if tensor > 1:
        # over tp: each rank sends the whole slice of every group's rows
        slice_rows = [sum(sum(counts[k][t]) for k in range(G)) for t in range(tensor)]
        out["tp"] += G * data * tensor * (8 + max(slice_rows) * (8 + hidden * fp32))
    return out


def trim_shard_gather_bytes(trim_vocabs: Sequence[int], hidden: int, tensor: int, data: int) -> int:
    """Bytes of reading φ's rows V_k from its row shards (dept/trim.py ``TrimTable.gather``),
    summed over ranks, per table and round: twice per round (the round start's fill of the
    compact table, the round end's pseudo-gradient) every one of a stage's S = T·D ranks
    all-reduces |V_k|·d fp32 values (int32 bit patterns) in ``dp``; nothing when S = 1."""
    S = tensor * data
    if S == 1:
        return 0
    return sum(2 * S * v * hidden * DTYPE_BYTES["fp32"] for v in trim_vocabs)


def predict_outer_round_bytes(cfg: Config, groups: int, dtype: Optional[str] = None,
                              global_vocab: Optional[int] = None,
                              trim_vocabs: Optional[Sequence[int]] = None) -> dict[str, int]:
    """Bytes one outer synchronisation puts on the wire, by category, summed over all ranks.

    Counting convention (dept_mega/parallel/comm.py): every rank counts the payload it
    contributes — all_reduce / reduce_scatter its input, all_gather its shard (its own part,
    not what it receives), broadcast the source only, send the tensor — and the job's figure
    is the sum over ranks (``comm.total_over_ranks``); a size-1 group counts nothing.
    ``groups`` = G. ``dtype`` (what crosses groups) defaults to ``cfg.dept.outer_comm_dtype``.

    The algorithm counted is the one of dept_mega/dept/outer.py and trim.py, with T, D from
    ``cfg.parallel`` (P only moves parameters between stages, it adds none):

    * body (``FlatSync``, per fragment with ``dept.outer_fragments``): each rank takes its 1/D
      chunk of its own TP/PP shard's Δ (chunks of near-equal size that add up to the shard
      exactly) and all-reduces it over the outer group (``outer_body``, in ``dtype``; only
      when G > 1) — or, for fp8 | int8 | int4, all-gathers it packed (payload + one fp32 scale
      per block of the chunk). Summed over a group's ranks that is the body with its
      TP-replicated parameters (norms, row-parallel biases) counted T times. With D > 1 the
      replicas then all-gather the updated chunks over dp in fp32 as D equal parts of the
      longest chunk (``dp``, also when G = 1). With ``optim.distributed`` and bf16/fp16
      weights a rank's chunk is the fp32 masters it owns (:func:`unit_chunks`) and the
      re-gather carries the weights' dtype.
    * "Tables" below are the embedding tables on this job's ranks: the token table on the
      first stage plus, on the last stage, the untied head or — tied with P > 1 — the last
      stage's copy of the token table (each is synchronised by the ranks holding it), so 1
      table for tied with P = 1, else 2.
    * GLOB: the tables (vocab-parallel, padded to 128: counted once over TP) and learned
      positions (replicated: T times) go through the same FlatSync as ``outer_embedding``
      (+ ``dp`` re-gather).
    * TRIM: learned positions as in GLOB; per table every rank holding a TP slice of the
      compact table sends its 1/D share of the group's real rows as (ids int64, rows
      ``dtype``) over the outer group, after one int64 count, padded to the largest share
      in the outer group (:func:`trim_exchange_bytes`): about Σ_k |V_k|·(8 + h·b) when the
      |V_k| are close (only when G > 1). Every rank then re-gathers what it received inside
      its group in fp32, also when G = 1: over dp when D > 1 and over tp when T > 1; the
      ``dp``/``tp`` figures include these. φ is row-sharded over a stage's T·D ranks, so the
      round start's fill and the round end's Δ read V_k's rows from the shards
      (:func:`trim_shard_gather_bytes`, in ``dp``).
    * SPEC / SPEC-OPT: nothing but the body. STD: no outer round, all zero.

    Returns ``{"outer_body", "outer_embedding", "dp", "tp"}`` in bytes (``tp`` is only
    TRIM's re-gather; the other variants' sync sends nothing over tp).
    """
    return predict_outer_sync(cfg, groups, dtype, global_vocab, trim_vocabs)["round"]


OUTER_FORMATS = ("fp32", "bf16", "fp8", "int8", "int4")


def _wire_bytes(n: int, dtype: str, block: int) -> int:
    """Bytes one rank sends for a chunk of n values (dept/outer.py, dept/quant.py)."""
    if dtype in ("fp32", "bf16"):
        return n * DTYPE_BYTES[dtype]
    blocks = -(-n // block) if n else 0
    return 4 * blocks + ((n + 1) // 2 if dtype == "int4" else n)


def _rank_layers(num_layers: int, P: int, V: int, p: int) -> list[int]:
    """Global layer ids on pipeline rank p (model/gpt.py ``chunk_layout``: chunk c holds block
    c·P + p of P·V equal blocks)."""
    per = num_layers // (P * V)
    return [i for c in range(V) for i in range((c * P + p) * per, (c * P + p + 1) * per)]


def sync_units(cfg: Config, global_vocab: Optional[int] = None) -> list[tuple[int, int, int, str]]:
    """The FlatSyncs of one group's ranks, as ``(pp rank, offset in the round, values on one
    tensor rank, category)``: the body's fragments (dept/streaming.py: layer i in fragment
    ⌊i·F/N⌋, the final norm in F − 1, fragment f launched after inner step (f+1)·⌊L/F⌋, the
    last at L) and the dense embedding state (GLOB's tables and positions, TRIM's positions),
    launched with the last fragment. Every tensor rank holds the same number of values."""
    m, p, d, variant = cfg.model, cfg.parallel, cfg.dept, variant_of(cfg)
    T, P, V, F, L = p.tensor, p.pipeline, p.virtual_pipeline, d.outer_fragments, d.local_steps
    one = layer_split(m)
    per_layer = one.sharded // T + one.replicated
    offsets = [(f + 1) * (L // F) if f < F - 1 else L for f in range(F)]
    units = []
    for pp in range(P):
        counts = [0] * F
        for i in _rank_layers(m.num_layers, P, V, pp):
            counts[i * F // m.num_layers] += per_layer
        if pp == P - 1:
            counts[F - 1] += _norm_params(m)
        units += [(pp, offsets[f], n, "outer_body") for f, n in enumerate(counts)]
        emb = 0
        if variant.synced_table:
            if global_vocab is None:
                raise ConfigError("predict_outer_round_bytes: glob needs global_vocab")
            table = padded_vocab(global_vocab) // T * m.hidden_size
            if pp == 0:
                emb += table + position_params(m)
            if pp == P - 1 and (not m.tie_embeddings or P > 1):
                emb += table  # the untied head, or the last stage's copy of the tied table
        elif variant.trimmed and pp == 0:
            emb += position_params(m)
        if emb:
            units.append((pp, L, emb, "outer_embedding"))
    return units


def unit_chunks(cfg: Config, global_vocab: Optional[int] = None) -> list[tuple[int, int, str, list[int]]]:
    """:func:`sync_units` with each unit's chunk lengths on data-parallel ranks 0..D−1: ``(pp
    rank, offset, category, chunks)``. D near-equal chunks (dept/outer.py ``chunk_bounds``), or
    with ``optim.distributed`` and half-precision weights the fp32 masters each rank owns
    (dept/master_shards.py: the distributed optimizer's bucket shards)."""
    D = cfg.parallel.data
    units = sync_units(cfg, global_vocab)
    if not sharded_masters(cfg):
        return _in_parts(cfg, [(pp, off, cat, [chunk_bounds_len(n, D, i) for i in range(D)])
                               for pp, off, n, cat in units])
    out = []
    for pp in range(cfg.parallel.pipeline):
        rp = rank_params(cfg, global_vocab if variant_of(cfg).synced_table else 1, pp)
        body = flat_sync_chunks(cfg, rp.body, rank_body_fragments(cfg, pp))
        mine = [u for u in units if u[0] == pp]
        for f, (_, off, n, cat) in enumerate(u for u in mine if u[3] == "outer_body"):
            chunks = body.get(f, [0] * D)
            assert sum(chunks) == n, (f, chunks, n)
            out.append((pp, off, cat, chunks))
        for _, off, n, cat in (u for u in mine if u[3] == "outer_embedding"):
            if variant_of(cfg).trimmed:  # its positions' FlatSync holds an fp32 copy: D chunks
                chunks = [chunk_bounds_len(n, D, i) for i in range(D)]
            else:
                chunks = flat_sync_chunks(cfg, rp.emb, [0] * len(rp.emb), rp.emb_isolate)[0]
            assert sum(chunks) == n, (chunks, n)
            out.append((pp, off, cat, chunks))
    return _in_parts(cfg, out)


def _in_parts(cfg: Config, units: list) -> list:
    """GLOB's embedding units with ``dept.outer_fragments: F`` > 1 go in F parts (dept/outer.py
    ``use_parts``): part f = the f-th of F near-equal slices of every replica's chunk,
    launched with body fragment f."""
    d = cfg.dept
    F = d.outer_fragments
    if not variant_of(cfg).synced_table or F == 1:
        return units
    offsets = [(f + 1) * (d.local_steps // F) if f < F - 1 else d.local_steps for f in range(F)]
    out = []
    for pp, off, cat, chunks in units:
        if cat != "outer_embedding":
            out.append((pp, off, cat, chunks))
            continue
        out += [(pp, offsets[f], cat, [chunk_bounds_len(c, F, f) for c in chunks]) for f in range(F)]
    return out


def trim_master_gather_bytes(cfg: Config, trim_vocabs: Sequence[int]) -> int:
    """With sharded masters (``optim.distributed`` and bf16/fp16 weights) TRIM reads the fp32
    values of each compact embedding parameter at the round's end (its Δ rows; the learned
    positions) by all-gathering the group's master pieces over dp in fp32
    (dept/trim_strategy.py ``_values``): D equal parts of the longest piece per parameter,
    summed over all ranks of the job (group k's compact vocabulary |V_k|). 0 otherwise."""
    p = cfg.parallel
    if not sharded_masters(cfg) or p.data == 1:
        return 0
    total = 0
    for vocab in trim_vocabs:
        for pp in range(p.pipeline):
            rp = rank_params(cfg, vocab, pp)
            pieces = flat_sync_chunks(cfg, rp.emb, list(range(len(rp.emb))), rp.emb_isolate)
            total += p.tensor * sum(p.data * max(c) * DTYPE_BYTES["fp32"] for c in pieces.values())
    return total


def predict_outer_sync(cfg: Config, groups: int, dtype: Optional[str] = None,
                       global_vocab: Optional[int] = None,
                       trim_vocabs: Optional[Sequence[int]] = None) -> dict:
    """The bytes of one round of outer synchronisation (see :func:`predict_outer_round_bytes`)
    and when they go on the wire: ``{"round": {category: bytes}, "outer_per_step": [bytes
    across groups launched after inner step 1 … L of a round], "peak_step_bytes": max of
    those}``, summed over all ranks of the job. Every ``dept.outer_*`` key counts:
    ``outer_comm_dtype`` (fp32 | bf16 all-reduced; fp8 | int8 | int4 all-gathered as packed
    chunks: payload plus one fp32 scale per ``outer_quant_block`` values of each rank's
    chunk), ``outer_fragments`` (each fragment's chunks are split and quantised separately;
    fragment f's bytes land on its step; GLOB's tables go in F parts, part f with fragment f),
    ``outer_overlap`` / ``outer_delay`` (they move when a sync is applied, not what it sends;
    with ``outer_overlap_rule: eager`` every overlapped launch also writes θ_eager, one more
    ``dp`` re-gather, which the last step's blocking syncs and each unit's first launch — no
    estimate yet — do not do).
    TRIM's rows go at the round's end. ``final_extra``: {category: bytes} the run's last step
    sends on top of a round's — every unit launched before the round's end is synchronised
    once more there (dept/streaming.py), so the last round's record carries
    ``round + final_extra``. ``first_extra``: {category: bytes} added to the first round's
    record (the eager start's re-gathers it does not make: negative ``dp``, else zeros)."""
    m, p = cfg.model, cfg.parallel
    v = variant_of(cfg)
    dtype = dtype or cfg.dept.outer_comm_dtype
    block = cfg.dept.outer_quant_block
    if dtype not in OUTER_FORMATS:
        raise ConfigError(f"config key 'dept.outer_comm_dtype': {dtype!r} is not one of {' | '.join(OUTER_FORMATS)}")
    if groups < 1:
        raise ConfigError(f"predict_outer_round_bytes: groups must be >= 1, got {groups}")
    L = cfg.dept.local_steps
    out = {"outer_body": 0, "outer_embedding": 0, "dp": 0, "tp": 0}
    extra = {"outer_body": 0, "outer_embedding": 0, "dp": 0, "tp": 0}
    first = dict(extra)
    per_step = [0] * L
    if not v.rounds:
        return {"round": out, "outer_per_step": per_step, "peak_step_bytes": 0, "final_extra": extra,
                "first_extra": first}
    T, D = p.tensor, p.data
    # the re-gather: fp32 values, or with sharded masters the updated pieces in the weights' dtype
    regather = PARAM_BYTES[cfg.precision] if sharded_masters(cfg) else DTYPE_BYTES["fp32"]
    eager = eager_start(cfg)
    one_round = cfg.train.steps <= L
    for _, offset, category, chunks in unit_chunks(cfg, global_vocab):
        n = sum(chunks)
        again = extra if offset != L else {}  # synchronised once more at the last step
        if groups > 1 and n:
            sent = groups * T * sum(_wire_bytes(c, dtype, block) for c in chunks)
            out[category] += sent
            per_step[offset - 1] += sent
            if again:
                again[category] += sent
        if D > 1 and n:  # equal parts of the longest chunk (dept/outer.py)
            gather = groups * T * D * max(chunks) * regather
            out["dp"] += gather * (2 if eager else 1)
            if again:
                again["dp"] += gather
            elif eager:  # launched blocking at the last step: no θ_eager
                extra["dp"] -= gather
            if eager and (again or not one_round):  # a unit's first overlapped launch: no estimate yet
                first["dp"] -= gather
    if v.trimmed:
        if trim_vocabs is None or len(trim_vocabs) != groups:
            raise ConfigError(f"predict_outer_round_bytes: trim needs one |V_k| per group ({groups}), "
                              f"got {trim_vocabs!r}")
        tables = 1 if (m.tie_embeddings and p.pipeline == 1) else 2
        trim = trim_exchange_bytes(trim_vocabs, m.hidden_size, T, D, DTYPE_BYTES.get(dtype, dtype), block)
        out["outer_embedding"] += tables * trim["outer_embedding"]
        per_step[L - 1] += tables * trim["outer_embedding"]
        # φ is row-sharded over the group's tp×dp ranks: two reads of V_k's rows per round (dept/trim.py)
        out["dp"] += tables * (trim["dp"] + trim_shard_gather_bytes(trim_vocabs, m.hidden_size, T, D))
        out["dp"] += trim_master_gather_bytes(cfg, trim_vocabs)
        out["tp"] += tables * trim["tp"]
    return {"round": out, "outer_per_step": per_step, "peak_step_bytes": max(per_step) if per_step else 0,
            "final_extra": extra, "first_extra": first}


def chunk_bounds_len(n: int, parts: int, index: int) -> int:
    """Length of chunk ``index`` of n values split into ``parts`` near-equal chunks
    (dept/outer.py ``chunk_bounds``)."""
    base, extra = divmod(n, parts)
    return base + (1 if index < extra else 0)
