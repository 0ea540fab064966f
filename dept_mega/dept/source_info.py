"""What the DEPT round driver and the variants' strategies know of a source
(:class:`SourceInfo`, the seed of its own embeddings), and how a run's ``data.sources`` give it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..variant import variant_of


@dataclass
class SourceInfo:
    """What the hooks need to know of a source."""
    name: str
    vocab_size: int  # vocabulary of its embeddings: global (glob, trim, spec) or its own (spec_opt)
    size: float = 1.0  # for proportional / temperature sampling (tokens)
    vocab_ids: Optional[torch.Tensor] = None  # TRIM: V_k, sorted global ids
    weight: float = 1.0  # data.sources[i].weight
    held: bool = True  # False: another group job's source (federation), known by its summary: no V_k


def source_seed(seed: int, source_index: int) -> int:
    """The init seed of source k's own embeddings (SPEC/SPEC-OPT/TRIM's compact tables):
    reproducible per source, different between sources, independent of the group that first
    samples it."""
    return int(seed) + 1_000_003 * (int(source_index) + 1)


def source_tokens(prefix: str) -> float:
    """A source's size for proportional / temperature sampling: the tokens of its ``.bin``."""
    from ..data.indexed import IndexedDataset
    return float(len(IndexedDataset(prefix).tokens))


def sources_from_config(cfg, global_vocab: Optional[int]) -> list[SourceInfo]:
    """SourceInfo for every ``data.sources`` entry: sizes (tokens in the data), vocabularies
    (SPEC-OPT: each source's tokenizer) and TRIM's V_k (``vocab_set``)."""
    from ..data.summary import foreign_summaries
    foreign = foreign_summaries(cfg)  # federated: another site's sources are known by their summaries
    out = []
    for i, s in enumerate(cfg.data.sources):
        if i in foreign:
            summary = foreign[i]
            vocab = summary["tokenizer"]["vocab_size"] if variant_of(cfg).own_tokenizer else global_vocab
            if vocab is None:
                from ..config import ConfigError
                raise ConfigError("config key 'data.tokenizer': a global vocabulary size is needed")
            out.append(SourceInfo(s.name, int(vocab), float(summary["tokens"]), None, weight=float(s.weight),
                                  held=False))
            continue
        size = source_tokens(s.prefix)
        if variant_of(cfg).own_tokenizer:
            from ..data.tokenizer import load_tokenizer
            vocab = load_tokenizer(s.tokenizer, f"data.sources[{i}].tokenizer").vocab_size
        else:
            if global_vocab is None:
                from ..config import ConfigError
                raise ConfigError("config key 'data.tokenizer': a global vocabulary size is needed")
            vocab = int(global_vocab)
        ids = None
        if variant_of(cfg).trimmed or cfg.dept.embedding_rows == "present":
            from ..data.sources import vocab_set
            ids = torch.as_tensor(vocab_set(s.prefix, cfg.data.cache_dir), dtype=torch.int64)
            if ids.numel() and int(ids.max()) >= vocab:
                from ..config import ConfigError
                raise ConfigError(f"config key 'data.sources[{i}].prefix': token id {int(ids.max())} of source "
                                 f"{s.name!r} is outside the global vocabulary of {vocab}")
        out.append(SourceInfo(s.name, vocab, size, ids, weight=float(s.weight)))
    return out
