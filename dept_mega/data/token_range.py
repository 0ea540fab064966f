"""The smallest and largest token id of an indexed dataset (``PREFIX.bin``), the start-up check's
comparison with the tokenizer's vocabulary (``data/checks.py``), cached beside the data as
``<name>.token_range.json`` (in ``data.cache_dir``: ``<name>.<path hash>.token_range.json``,
:func:`cache_file`): written by ``tools/preprocess_data.py`` as it writes the data (from
the ids it wrote), else computed by one pass over the ``.bin`` on first use. Torch-free (the
preprocessing imports it)."""
from __future__ import annotations

import hashlib
import json
import os
import warnings
from typing import Optional

import numpy as np

from dept_mega.data.atomic_file import atomic_file
from dept_mega.data.indexed import IndexedDataset, bin_path, idx_path


def data_key(prefix: str) -> str:
    """What a cache of ``PREFIX``'s data is valid for: the ``.idx`` / ``.bin`` sizes and
    modification times."""
    parts = []
    for path in (idx_path(prefix), bin_path(prefix)):
        st = os.stat(path)
        parts.append([st.st_size, st.st_mtime_ns])
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:20]


def cache_file(prefix: str, cache_dir: Optional[str], suffix: str) -> str:
    """Where a cache of ``PREFIX``'s data is kept: beside the data as ``<name><suffix>``, or
    in a shared ``cache_dir`` as ``<name>.<hash><suffix>``, the hash of the prefix's absolute
    path, so that sources of the same name in different folders (``data/en/text_document``,
    ``data/fr/text_document``) keep a cache each instead of replacing each other's."""
    if not cache_dir:
        return os.path.abspath(prefix) + suffix
    tag = hashlib.sha256(os.path.abspath(prefix).encode()).hexdigest()[:10]
    return os.path.join(cache_dir, f"{os.path.basename(prefix)}.{tag}{suffix}")


def _range_path(prefix: str, cache_dir: Optional[str]) -> str:
    return cache_file(prefix, cache_dir, ".token_range.json")


def record_token_range(prefix: str, lo: int, hi: int, cache_dir: Optional[str] = None) -> None:
    """Caches ``(lo, hi)`` as ``PREFIX``'s token id range ((0, -1): no tokens), keyed by the data
    files as they are now; a cache that cannot be written is a warning (the range is then computed
    on first use)."""
    path = _range_path(prefix, cache_dir)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with atomic_file(path, "w", encoding="utf-8") as f:  # (readable by other users' jobs)
            json.dump({"key": data_key(prefix), "min": int(lo), "max": int(hi)}, f)
    except OSError as exc:
        warnings.warn(f"could not cache the token id range at {path}: {exc}")


def token_id_range(prefix: str, cache_dir: Optional[str] = None, chunk_tokens: int = 1 << 24) -> tuple[int, int]:
    """(smallest, largest) token id in ``PREFIX.bin`` ((0, -1) for no tokens): the cached range
    when it is valid for the data as it is now (:func:`data_key`), beside the data or in
    ``cache_dir``, else computed in chunks and cached (in ``cache_dir`` when given: the data's
    folder may be read-only)."""
    key = data_key(prefix)
    # beside the data (where the preprocessing writes it) first, then under cache_dir
    for path in dict.fromkeys((_range_path(prefix, None), _range_path(prefix, cache_dir))):
        try:
            with open(path, encoding="utf-8") as f:
                cached = json.load(f)
            if cached.get("key") == key:
                return int(cached["min"]), int(cached["max"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # missing or unreadable: the next place, or recompute
    tokens = IndexedDataset(prefix).tokens
    lo, hi = 0, -1
    for start in range(0, len(tokens), chunk_tokens):
        chunk = np.asarray(tokens[start:start + chunk_tokens])
        if chunk.size:
            c_lo, c_hi = int(chunk.min()), int(chunk.max())
            lo, hi = (c_lo, c_hi) if hi < lo else (min(lo, c_lo), max(hi, c_hi))
    record_token_range(prefix, lo, hi, cache_dir)
    return lo, hi
