"""How often each token id occurs in an indexed dataset (``PREFIX.bin``), cached beside the data
as ``<name>.token_counts.npz``: TRIM's vocabulary sets (``data/sources.py``'s ``vocab_set``)
and the per-source summaries read it. Torch-free (``tools/prepare_sample.py`` imports it
without torch)."""
from __future__ import annotations

import os
import warnings
from typing import Callable, Optional

import numpy as np

from dept_mega.data.atomic_file import atomic_file
from dept_mega.data.indexed import IndexedDataset, bin_path
from dept_mega.data.token_range import cache_file, data_key as _data_key


def token_counts(prefix: str, cache_dir: Optional[str] = None, chunk_tokens: int = 1 << 24,
                 progress: Optional[Callable[[int, int], None]] = None) -> np.ndarray:
    """How often each token id occurs in ``PREFIX.bin`` (bincount in chunks, so memory stays
    bounded). Cached as ``<name>.token_counts.npz`` beside the data (or in ``cache_dir`` as
    ``<name>.<hash of the prefix's absolute path>.token_counts.npz``: ``token_range.cache_file``),
    keyed by the ``.bin``/``.idx`` sizes and modification times. ``progress(done, total)``:
    called with the tokens counted after each chunk (not when the cache is used)."""
    ds = IndexedDataset(prefix)
    path = cache_file(prefix, cache_dir, ".token_counts.npz")
    cache_dir = os.path.dirname(path)
    key = _data_key(prefix)
    if os.path.exists(path):
        try:
            with np.load(path) as z:
                if str(z["key"]) == key:
                    return z["counts"]
        except (OSError, ValueError, KeyError):
            pass  # unreadable: recompute
    counts = np.zeros(0, dtype=np.int64)
    tokens = ds.tokens
    for lo in range(0, len(tokens), chunk_tokens):
        chunk = np.asarray(tokens[lo:lo + chunk_tokens])
        if chunk.size and chunk.min() < 0:
            raise ValueError(f"{bin_path(prefix)}: negative token id {int(chunk.min())}")
        c = np.bincount(chunk.astype(np.int64, copy=False))
        if len(c) > len(counts):
            c[:len(counts)] += counts
            counts = c
        else:
            counts[:len(c)] += c
        if progress is not None:
            progress(min(lo + chunk_tokens, len(tokens)), len(tokens))
    try:
        os.makedirs(cache_dir, exist_ok=True)
        with atomic_file(path) as f:  # (readable by other users' jobs)
            np.savez(f, counts=counts, key=np.array(key))
    except OSError as exc:
        warnings.warn(f"could not cache token counts at {path}: {exc}")
    return counts
