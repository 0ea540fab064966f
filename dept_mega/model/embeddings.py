"""A source's vocabulary-owned modules: token embedding, learned positions, output head.

Everything here is per vocabulary (per source under SPEC/SPEC-OPT); the body never depends
on it. The vocabulary is padded to a multiple of 128 (Megatron's make-vocab-size-divisible-by)
so it splits evenly over the tensor group; the padded rows' logits are set to ``-inf`` so
they take no probability mass and losses do not depend on the tensor size.

Tied head under pipeline parallelism: the last stage holds its own copy of the word
embedding, initialised identically (same name, same seed); the trainer keeps the copies
equal by all-reducing their gradients over ``pg.embedding`` (see
``shared_embedding_params``).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from ..config import ModelConfig
from ..parallel.cross_entropy import vocab_parallel_cross_entropy
from ..parallel.layers import FUSED_TORCH_GEMM, ColumnParallelLinear, UsesGroups, VocabParallelEmbedding, mark
from ..parallel.mappings import (copy_to_tp_region, reduce_from_tp_region,
                                 reduce_scatter_to_sequence_parallel_region, tp_world)
from ..parallel.random import RNGTracker, dropout, init_full_then_shard
from ..parallel.sp_linear import sp_gather_linear
from ..parallel.wgrad import linear

VOCAB_MULTIPLE = 128


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """``vocab_size`` rounded up to a multiple of 128; it must split over ``tp_size`` ranks."""
    if vocab_size <= 0:
        raise ValueError(f"vocabulary size must be positive, got {vocab_size}")
    padded = -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    if padded % tp_size:
        raise ValueError(f"padded vocabulary size {padded} (vocabulary {vocab_size}) is not divisible by "
                         f"parallel.tensor={tp_size}")
    return padded


class SourceEmbeddings(UsesGroups, nn.Module):
    """One vocabulary's embeddings for one pipeline chunk.

    ``has_input``: word embedding (+ learned positions); ``has_output``: the head (untied:
    ``output_layer``; tied: ``word_embeddings`` — the same parameter as the input when the
    chunk has both, else an identically initialised copy). Parameter names (under the stage's
    ``embeddings.``): ``word_embeddings.weight``, ``position_embeddings.weight``,
    ``output_layer.weight``. Init names are ``embeddings.<param>`` seeded by ``seed``.

    ``fuse_wgrad`` (``optim.grad_accum_fusion``): the head's weight gradient accumulates
    straight into the gradient buffer (``parallel/wgrad.py``) — the untied head, and the tied
    one only where this chunk has no input side (else the same weight also gets the lookup's
    gradient through autograd in the same backward, and the two paths would each count it).

    Attributes: ``vocab_size`` (true), ``padded_vocab_size``.
    """

    def __init__(self, cfg: ModelConfig, pg, vocab_size: int, seed: int, has_input: bool, has_output: bool, *,
                 sequence_parallel: bool = False, rng: Optional[RNGTracker] = None,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 fuse_wgrad: bool = False) -> None:
        super().__init__()
        if not (has_input or has_output):
            raise ValueError("SourceEmbeddings needs has_input or has_output")
        T = tp_world(pg)
        self.cfg = cfg
        self.pg = pg
        self.seed = seed
        self.has_input = has_input
        self.has_output = has_output
        self.tied = cfg.tie_embeddings
        self.sequence_parallel = sequence_parallel and T > 1
        self.rng = rng
        self.fuse_tied_head = fuse_wgrad and self.tied and not has_input
        self.vocab_size = int(vocab_size)
        self.padded_vocab_size = padded_vocab_size(self.vocab_size, T)
        std = cfg.init_method_std
        h = cfg.hidden_size
        if has_input or (has_output and self.tied):
            self.word_embeddings = VocabParallelEmbedding(self.padded_vocab_size, h, pg,
                                                          name="embeddings.word_embeddings", seed=seed,
                                                          init_std=std, device=device, dtype=dtype)
        else:
            self.word_embeddings = None
        if has_input and cfg.position_embedding == "learned":
            self.position_embeddings = nn.Embedding(cfg.seq_length, h, device=device, dtype=dtype)
            with torch.no_grad():
                self.position_embeddings.weight.copy_(init_full_then_shard(
                    "embeddings.position_embeddings.weight", (cfg.seq_length, h), seed, std=std,
                    device=device, dtype=dtype))
            mark(self.position_embeddings.weight, tensor_parallel=False, sequence_parallel=self.sequence_parallel)
        else:
            self.position_embeddings = None
        if has_output and not self.tied:
            self.output_layer = ColumnParallelLinear(h, self.padded_vocab_size, pg, name="embeddings.output_layer",
                                                     seed=seed, init_std=std, bias=False,
                                                     sequence_parallel=sequence_parallel,
                                                     gemm=FUSED_TORCH_GEMM if fuse_wgrad else None,
                                                     device=device, dtype=dtype)
        else:
            self.output_layer = None
        if has_output:
            rows = self.padded_vocab_size // T
            ids = torch.arange(pg.tp_rank * rows if T > 1 else 0, (pg.tp_rank + 1) * rows if T > 1 else rows,
                               device=device)
            self.register_buffer("padding_mask", ids >= self.vocab_size, persistent=False)
        else:
            self.padding_mask = None

    # -- input side --------------------------------------------------------------------------
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens [b, s]`` → hidden ``[s, b, h]`` (``[s/T, b, h]`` under sequence parallelism)."""
        if not self.has_input:
            raise RuntimeError("these embeddings have no input side (not the first pipeline chunk)")
        s = tokens.shape[1]
        if self.position_embeddings is not None and s > self.cfg.seq_length:
            raise ValueError(f"sequence of {s} tokens is longer than model.seq_length={self.cfg.seq_length} "
                             f"(learned positions)")
        e = self.word_embeddings(tokens.t().contiguous(), partial=True)  # [s, b, h], partial over TP
        if self.sequence_parallel:
            e = reduce_scatter_to_sequence_parallel_region(e, self.pg)
        else:
            e = reduce_from_tp_region(e, self.pg)
        if self.position_embeddings is not None:
            start, n = 0, s
            if self.sequence_parallel:
                n = s // tp_world(self.pg)
                start = self.pg.tp_rank * n
            pos = self.position_embeddings.weight[start:start + n]
            e = e + pos.unsqueeze(1)
        return dropout(e, self.cfg.hidden_dropout, self.training, self.rng, tensor_parallel=self.sequence_parallel)

    # -- output side -------------------------------------------------------------------------
    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [s(/T), b, h]`` → the output layer's ``[s, b, V_pad/T]`` (padded columns
        not masked)."""
        if not self.has_output:
            raise RuntimeError("these embeddings have no output head (not the last pipeline chunk)")
        if self.output_layer is not None:
            return self.output_layer(hidden)
        if self.sequence_parallel:  # keeps the shard for backward, as the column-parallel layers (sp_linear.py)
            return sp_gather_linear(hidden, self.word_embeddings.weight, None, self.pg, self.fuse_tied_head)
        hidden = copy_to_tp_region(hidden, self.pg)
        return linear(hidden, self.word_embeddings.weight, None, self.fuse_tied_head)

    def logits_shard(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [s(/T), b, h]`` → this rank's vocabulary columns ``[s, b, V_pad/T]``;
        padded columns are ``-inf``."""
        logits = self._head(hidden)
        if self.vocab_size != self.padded_vocab_size:
            logits = logits.masked_fill(self.padding_mask, float("-inf"))
        return logits

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Batch-first vocabulary-shard logits ``[b, s, V_pad/T]``."""
        return self.logits_shard(hidden).transpose(0, 1)

    def loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-token fp32 losses ``[b, s]`` for ``labels [b, s]``. The cross entropy treats the
        padded columns as ``-inf`` itself (no masked copy of the logits) and writes its gradient
        into the head's output, which nothing else holds (parallel/cross_entropy.py)."""
        logits = self._head(hidden)
        return vocab_parallel_cross_entropy(logits, labels.t(), self.pg, vocab_size=self.vocab_size,
                                            consume_logits=True).t()

    def shared_embedding_params(self) -> list[nn.Parameter]:
        """Parameters whose gradients the trainer all-reduces over ``pg.embedding``: the tied
        word embedding when the input and the head sit on different pipeline stages."""
        if self.tied and self.pg.pp_size > 1 and self.word_embeddings is not None:
            return [self.word_embeddings.weight]
        return []

    def extra_repr(self) -> str:
        return (f"vocab={self.vocab_size} (padded {self.padded_vocab_size}), input={self.has_input}, "
                f"output={self.has_output}, tied={self.tied}")
