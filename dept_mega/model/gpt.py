"""The GPT model as pipeline chunks: a shared body plus swappable per-vocabulary embeddings.

Parameter naming (the contract DEPT relies on): in a :class:`GPTStage`, everything under
``body.`` is the shared transformer body and everything under ``embeddings.`` belongs to one
vocabulary. Layers are keyed by their GLOBAL layer id (``body.layers.5.attention.qkv.weight``)
so names, and the deterministic init seeded by them, do not depend on the pipeline split.
"""
from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch
import torch.nn as nn

from ..config import Config, ModelConfig
from ..parallel.fp8 import Fp8State
from ..parallel.mappings import tp_world
from ..parallel.random import RNGTracker, dropout
from ..parallel.te import TEContext, make_recipe
from .backends import BackendError, Backends, compile_problem, resolve_backends
from .embeddings import SourceEmbeddings
from .layers import MLP, Norm, PositionState, SelfAttention
from .act_norms import ActivationSums
from .recompute import recompute


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + drop(attn(norm(x)))`` then ``x + drop(mlp(norm(x)))``."""

    def __init__(self, cfg: ModelConfig, pg, layer_id: int, *, seed: int, sequence_parallel: bool,
                 positions: PositionState, backends: Backends, rng: Optional[RNGTracker], device, dtype,
                 fp8_state: Optional[Fp8State] = None) -> None:
        super().__init__()
        prefix = f"body.layers.{layer_id}"
        self.layer_id = layer_id
        self.hidden_dropout = cfg.hidden_dropout
        self.sequence_parallel = sequence_parallel
        self.rng = rng
        use_apex = backends.norm == "apex"
        self.fp8 = backends.layer_fp8(layer_id)
        gemms = backends.gemms(layer_id, fp8_state)
        self.input_norm = Norm(cfg.normalization, cfg.hidden_size, cfg.norm_eps, name=f"{prefix}.input_norm",
                               seed=seed, sequence_parallel=sequence_parallel, use_apex=use_apex,
                               bias=cfg.norm_bias, device=device, dtype=dtype)
        self.attention = SelfAttention(cfg, pg, prefix=f"{prefix}.attention", seed=seed, num_layers=cfg.num_layers,
                                       sequence_parallel=sequence_parallel, positions=positions, backends=backends,
                                       rng=rng, device=device, dtype=dtype, gemms=gemms)
        self.mlp_norm = Norm(cfg.normalization, cfg.hidden_size, cfg.norm_eps, name=f"{prefix}.mlp_norm",
                             seed=seed, sequence_parallel=sequence_parallel, use_apex=use_apex,
                             bias=cfg.norm_bias, device=device, dtype=dtype)
        self.mlp = MLP(cfg, pg, prefix=f"{prefix}.mlp", seed=seed, num_layers=cfg.num_layers,
                       sequence_parallel=sequence_parallel, device=device, dtype=dtype, gemms=gemms)

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        # Replicated activations use the stream shared by the tensor ranks; sequence shards
        # (sequence parallelism) are different data on each rank and use the per-rank stream.
        return dropout(x, self.hidden_dropout, self.training, self.rng, tensor_parallel=self.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the norms are the prologues of QKV and fc1: applied by those layers (with
        # fp8_fused_casts fused into their FP8 input casts, parallel/fp8_prologue.py)
        x = x + self._drop(self.attention(x, norm=self.input_norm))
        return x + self._drop(self.mlp(x, norm=self.mlp_norm))

    def replay_states(self) -> list:
        """What a recomputation of this block must replay: the dropout streams. (Native FP8
        needs nothing: a step's scales are fixed when it opens, and a recomputed cast maxes the
        same amax into the history again.)"""
        return [self.rng] if self.rng is not None else []


class TransformerBody(nn.Module):
    """The blocks of one pipeline chunk (``layer_ids``, global ids) and, on the last chunk,
    the final norm. A pure function of the hidden states ``[s(/T), b, h]``.

    ``seed`` seeds the init (with each parameter's name); ``rng`` provides dropout streams
    (required only when a dropout is > 0 in training mode). ``backends``: the kernels (default:
    ``resolve_backends(cfg)``); ``te``: the Transformer Engine context when the linear layers
    run through TE; ``fp8_state``: the model's FP8 scaling state when the linear layers run
    native FP8 (default: one of this body's own). ``model.recompute: full`` recomputes the first ``model.recompute_layers``
    blocks of this chunk in backward (see ``recompute.py``).
    """

    def __init__(self, cfg: ModelConfig, pg, layer_ids: Sequence[int], final_norm: bool, *, seed: int = 0,
                 sequence_parallel: bool = False, rng: Optional[RNGTracker] = None,
                 backends: Optional[Backends] = None, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, te: Optional[TEContext] = None,
                 compile_flex: bool = True, fp8_state: Optional[Fp8State] = None) -> None:
        super().__init__()
        self.layer_ids = [int(i) for i in layer_ids]
        for i in self.layer_ids:
            if not 0 <= i < cfg.num_layers:
                raise ValueError(f"layer id {i} is outside model.num_layers={cfg.num_layers}")
        backends = backends or resolve_backends(cfg, device)
        if backends.linear == "transformer_engine" and te is None:
            raise ValueError("TransformerBody: the transformer_engine backend needs a TEContext (build_model makes it)")
        self.te = te
        if fp8_state is None:
            fp8_state = backends.new_fp8_state(device)
        self.fp8_state = fp8_state  # also on a chunk without FP8 layers (checkpoint_fp8.py saves every rank's)
        sp = sequence_parallel and tp_world(pg) > 1
        self.tp_size = tp_world(pg)
        self.sequence_parallel = sp
        n = cfg.recompute_layers if cfg.recompute_layers is not None else len(self.layer_ids)
        self.recompute_blocks = min(n, len(self.layer_ids)) if cfg.recompute == "full" else 0
        plan = backends.attention
        self.positions = PositionState(cfg, pg.tp_rank, tp_world(pg), compile_flex=compile_flex, device=device,
                                       flex="flex" in (plan.kind, plan.fallback),
                                       bias="always" if plan.kind == "bias" else "fallback" if plan.fallback == "bias"
                                       else "")
        self.layers = nn.ModuleDict({
            str(i): TransformerBlock(cfg, pg, i, seed=seed, sequence_parallel=sp, positions=self.positions,
                                     backends=backends, rng=rng, device=device, dtype=dtype, fp8_state=fp8_state)
            for i in self.layer_ids})
        if final_norm:
            self.final_norm = Norm(cfg.normalization, cfg.hidden_size, cfg.norm_eps, name="body.final_norm",
                                   seed=seed, sequence_parallel=sp, use_apex=backends.norm == "apex",
                                   bias=cfg.norm_bias, device=device, dtype=dtype)
        else:
            self.final_norm = None
        # set by the trainer on the steps that log activation norms (act_norms.py), else None
        self.act_sums: Optional[ActivationSums] = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        seq_len = hidden.shape[0] * (self.tp_size if self.sequence_parallel else 1)
        self.positions.prepare(seq_len, hidden.device, hidden.dtype)  # outside the (compiled) blocks
        with self.te.body() if self.te is not None else contextlib.nullcontext():
            for i, layer in enumerate(self.layers.values()):
                with self.te.block(layer.fp8) if self.te is not None else contextlib.nullcontext():
                    if i < self.recompute_blocks and self.training:
                        hidden = recompute(layer, hidden, replay=layer.replay_states())
                    else:
                        hidden = layer(hidden)
                if self.act_sums is not None:
                    self.act_sums.add(layer.layer_id, hidden)
        if self.final_norm is not None:
            hidden = self.final_norm(hidden)
        return hidden


class GPTStage(nn.Module):
    """One pipeline chunk for one vocabulary: ``body`` + ``embeddings`` (None in the middle).

    ``forward(x, labels=None)``: the first chunk takes tokens ``[b, s]``, the others hidden
    ``[s(/T), b, h]``. The last chunk returns per-token fp32 losses ``[b, s]`` when labels are
    given, otherwise this rank's vocabulary-shard logits ``[b, s, V_pad/T]`` (padded columns
    ``-inf``); the other chunks return hidden states.
    """

    def __init__(self, body: TransformerBody, embeddings: Optional[SourceEmbeddings], is_first: bool,
                 is_last: bool, rng: Optional[RNGTracker] = None) -> None:
        super().__init__()
        self.body = body
        self.is_first = is_first
        self.is_last = is_last
        self.rng = rng
        self.embeddings: Optional[SourceEmbeddings] = None
        self.set_embeddings(embeddings)

    def set_embeddings(self, emb: Optional[SourceEmbeddings]) -> Optional[SourceEmbeddings]:
        """Swap the vocabulary (DEPT SPEC/TRIM) without touching the body; returns the old one."""
        needs = self.is_first or self.is_last
        if needs and emb is None:
            raise ValueError("the first and last pipeline chunks need embeddings")
        if emb is not None:
            if self.is_first and not emb.has_input:
                raise ValueError("the first pipeline chunk needs embeddings with has_input=True")
            if self.is_last and not emb.has_output:
                raise ValueError("the last pipeline chunk needs embeddings with has_output=True")
            if emb.rng is None:
                emb.rng = self.rng
        old = self.embeddings
        self.embeddings = emb
        return old

    @property
    def vocab_size(self) -> Optional[int]:
        return self.embeddings.vocab_size if self.embeddings is not None else None

    def forward(self, x: torch.Tensor, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        hidden = self.embeddings.embed(x) if self.is_first else x
        hidden = self.body(hidden)
        if not self.is_last:
            return hidden
        if labels is None:
            return self.embeddings.logits(hidden)
        return self.embeddings.loss(hidden, labels)

    def shared_embedding_params(self) -> list[nn.Parameter]:
        """Tied word-embedding copies whose grads are all-reduced over ``pg.embedding``."""
        return self.embeddings.shared_embedding_params() if self.embeddings is not None else []

    def body_parameters(self) -> list[nn.Parameter]:
        return list(self.body.parameters())

    def embedding_parameters(self) -> list[nn.Parameter]:
        return list(self.embeddings.parameters()) if self.embeddings is not None else []


# ----------------------------------------------------------------------------- building


def chunk_layout(num_layers: int, pp_size: int, vp_size: int, pp_rank: int) -> list[list[int]]:
    """Global layer ids of each chunk this stage holds: chunk c holds block c·P + p of the
    P·V equal blocks (Megatron's interleaved order)."""
    blocks = pp_size * vp_size
    if num_layers % blocks:
        raise ValueError(f"model.num_layers={num_layers} is not divisible by pipeline × virtual_pipeline = {blocks}")
    per = num_layers // blocks
    return [list(range((c * pp_size + pp_rank) * per, (c * pp_size + pp_rank + 1) * per)) for c in range(vp_size)]


def _chunk_roles(cfg: Config, pg) -> list[tuple[bool, bool]]:
    V = cfg.parallel.virtual_pipeline
    P = pg.pp_size
    return [(pg.pp_rank == 0 and c == 0, pg.pp_rank == P - 1 and c == V - 1) for c in range(V)]


def _check_layout(cfg: Config, pg) -> None:
    p = cfg.parallel
    if (p.tensor, p.pipeline) != (pg.tp_size, pg.pp_size):
        raise ValueError(f"config parallel.tensor={p.tensor}, parallel.pipeline={p.pipeline} do not match the "
                         f"process groups (tensor {pg.tp_size}, pipeline {pg.pp_size})")


def build_source_embeddings(cfg: Config, pg, vocab_size: int, seed: int, device: torch.device | str = "cpu",
                            rng: Optional[RNGTracker] = None,
                            dtype: torch.dtype = torch.float32) -> list[Optional[SourceEmbeddings]]:
    """One entry per chunk of this rank: a vocabulary's embeddings where the chunk has the
    input or the head, None elsewhere. Same init rule as ``build_model``."""
    _check_layout(cfg, pg)
    out: list[Optional[SourceEmbeddings]] = []
    for first, last in _chunk_roles(cfg, pg):
        if first or last:
            out.append(SourceEmbeddings(cfg.model, pg, vocab_size, seed, first, last,
                                        sequence_parallel=cfg.parallel.sequence_parallel, rng=rng,
                                        device=device, dtype=dtype, fuse_wgrad=cfg.optim.grad_accum_fusion))
        else:
            out.append(None)
    return out


def build_model(cfg: Config, pg, vocab_size: int, seed: int, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> list[GPTStage]:
    """This rank's model chunks (``parallel.virtual_pipeline`` of them), parameters in ``dtype``
    (fp32 by default; the trainer passes bf16/fp16 under half precision and keeps fp32
    masters in its optimizer). With
    ``train.compile`` every transformer block is compiled with ``torch.compile`` (in place:
    parameter names do not change); a platform that cannot compile is a ``BackendError``."""
    _check_layout(cfg, pg)
    backends = resolve_backends(cfg, device)
    if cfg.train.compile:
        problem = compile_problem(str(torch.device(device)))
        if problem is not None:
            raise BackendError(f"config key 'train.compile': torch.compile cannot run on this platform "
                               f"({problem}); set train.compile: false")
    te = None
    if backends.linear == "transformer_engine":
        recipe = make_recipe(cfg.fp8, cfg.fp8_recipe, cfg.fp8_amax_history) if cfg.fp8 else None
        te = TEContext(recipe, pg.tp_dp)
    fp8_state = backends.new_fp8_state(device)  # one per model: its delayed scales, one batched op per step
    rng = RNGTracker.for_groups(seed, pg, device)
    layouts = chunk_layout(cfg.model.num_layers, pg.pp_size, cfg.parallel.virtual_pipeline, pg.pp_rank)
    embs = build_source_embeddings(cfg, pg, vocab_size, seed, device, rng=rng, dtype=dtype)
    stages = []
    for (first, last), layer_ids, emb in zip(_chunk_roles(cfg, pg), layouts, embs):
        body = TransformerBody(cfg.model, pg, layer_ids, final_norm=last, seed=seed,
                               sequence_parallel=cfg.parallel.sequence_parallel, rng=rng, backends=backends,
                               device=device, dtype=dtype, te=te, fp8_state=fp8_state)
        if cfg.train.compile:
            for block in body.layers.values():
                block.compile()  # torchtitan's per-block compile; names and state dict unchanged
        stages.append(GPTStage(body, emb, first, last, rng=rng))
    return stages


def activation_shape(cfg: Config, pg, micro_batch_size: int, seq_length: Optional[int] = None) -> tuple[int, int, int]:
    """Shape of the hidden states passed between pipeline chunks: ``[s(/T), b, h]``."""
    s = seq_length or cfg.model.seq_length
    if cfg.parallel.sequence_parallel and pg.tp_size > 1:
        s //= pg.tp_size
    return (s, micro_batch_size, cfg.model.hidden_size)


def describe_backends(cfg: Config, device: torch.device | str = "cpu") -> str:
    """The one-line backend description for the run log (kernels, which GEMMs run FP8,
    recomputation, compile)."""
    return resolve_backends(cfg, device).describe()
