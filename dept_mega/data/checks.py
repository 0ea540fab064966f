"""Checks of a run's data before training: every source holds documents, and its token ids
fit the vocabulary of the tokenizer whose embeddings will read them.

Data tokenized with one tokenizer and a config naming another gives no error further on: ids
past the vocabulary become zero rows under tensor parallelism or index past the table (an
``IndexError``, a device-side assert on a GPU), and ids in the padded rows make the steps
non-finite. The largest id is computed once per data file and cached beside it
(:func:`dept_mega.data.sources.token_id_range`).
"""
from __future__ import annotations

from dept_mega.config import Config, ConfigError
from dept_mega.data.indexed import IndexedDataset, bin_path, idx_path
from dept_mega.data.sources import token_id_range


def embedding_vocabularies(cfg: Config) -> list[tuple[str, str, int]]:
    """Per source: (config key of the vocabulary, its description, vocabulary size) — the
    source's own tokenizer under spec_opt, else the global tokenizer, else model.vocab_size."""
    from dept_mega.data.tokenizer import load_tokenizer
    out = []
    sizes: dict[str, int] = {}

    def size_of(path: str) -> int:
        if path not in sizes:
            sizes[path] = load_tokenizer(path).vocab_size
        return sizes[path]

    for i, s in enumerate(cfg.data.sources):
        if cfg.dept.variant == "spec_opt" and s.tokenizer:
            out.append((f"data.sources[{i}].tokenizer", f"tokenizer {s.tokenizer}", size_of(s.tokenizer)))
        elif cfg.data.tokenizer:
            out.append(("data.tokenizer", f"tokenizer {cfg.data.tokenizer}", size_of(cfg.data.tokenizer)))
        elif cfg.model.vocab_size is not None:
            out.append(("model.vocab_size", "model.vocab_size", cfg.model.vocab_size))
        else:
            raise ConfigError(f"config key 'data.tokenizer': source '{s.name}' has no tokenizer and "
                              f"model.vocab_size is not set")
    return out


def check_sources(cfg: Config) -> None:
    """ConfigError (one line naming the key, the file and the numbers) when a source is empty
    or holds a token id outside the vocabulary that embeds it."""
    vocabs = embedding_vocabularies(cfg)
    for i, (s, (vkey, what, vocab)) in enumerate(zip(cfg.data.sources, vocabs)):
        key = f"config key 'data.sources[{i}].prefix'"
        ds = IndexedDataset(s.prefix)
        if ds.num_documents == 0 or ds.num_tokens == 0:
            raise ConfigError(f"{key}: source '{s.name}': {idx_path(s.prefix)} holds {ds.num_documents} documents "
                              f"and {ds.num_tokens} tokens: an empty dataset (was the preprocessing input empty "
                              f"or all bad lines?)")
        lo, hi = token_id_range(s.prefix, cfg.data.cache_dir)
        if lo < 0 or hi >= vocab:
            bad = lo if lo < 0 else hi
            raise ConfigError(f"{key}: source '{s.name}': {bin_path(s.prefix)} holds token id {bad}, but {what} "
                              f"({vkey}) has {vocab} ids (0..{vocab - 1}): the data was made with another "
                              f"tokenizer")
