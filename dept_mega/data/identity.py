"""Which data a run reads, identified by content (``step_N/depends.json``: ``data``).

A checkpoint's data positions (each source's position in its shuffled sample order, DEPT's
round plans) only mean the same tokens under the same ``data.split``, ``train.seed`` and the
same ``.bin`` / ``.idx`` files. :func:`data_fingerprint` records them; :func:`data_differences`
names what a resume changes. A source is identified by its files' content, never by their path
(a corpus moved to another file system is the same data), and cheaply whatever the corpus
size: the ``.idx`` header's counts, both files' sizes, and a sha256 over the first and last
:data:`HASHED_BYTES` of each file (the ``.idx`` starts with the documents' token lengths and
ends with the document index, so a corpus with other documents shows there; one that differs
only in tokens in the middle of the ``.bin`` with the same lengths does not).
"""
from __future__ import annotations

import hashlib
import os
from typing import Any, Optional

from .gpt_dataset import parse_split
from .indexed import IndexedFormatError, bin_path, idx_path, read_header

#: bytes hashed from each end of each file (``.idx`` and ``.bin``): 128 KiB read per source
HASHED_BYTES = 32 << 10
#: DEPT keeps a source's data position as the steps it was trained (the round plan's), read
#: back as steps × this batch: another batch moves every position
BATCH_KEY = "train.global_batch_size"
#: the keys of ``depends.json``'s ``data`` beside its ``sources``
DATA_KEYS = ("data.split", "train.seed", BATCH_KEY)


def _ends(path: str, size: int) -> bytes:
    """The first and last :data:`HASHED_BYTES` of ``path`` (the whole file when smaller)."""
    with open(path, "rb") as f:
        if size <= 2 * HASHED_BYTES:
            return f.read()
        head = f.read(HASHED_BYTES)
        f.seek(size - HASHED_BYTES)
        return head + f.read(HASHED_BYTES)


def source_identity(prefix: str, cache: Optional[dict] = None) -> Optional[dict[str, Any]]:
    """What identifies the data of ``prefix``: ``{"documents", "sequences", "idx_bytes",
    "bin_bytes", "sha256"}`` (``sha256``: of both files' ends, :data:`HASHED_BYTES`), or None
    where the files cannot be read. ``cache`` ({(paths, sizes, mtimes): identity}) spares
    reading files again that have not changed (every checkpoint records the identity)."""
    ipath, bpath = idx_path(prefix), bin_path(prefix)
    try:
        ist, bst = os.stat(ipath), os.stat(bpath)
        key = ("data", os.path.abspath(ipath), ist.st_size, ist.st_mtime_ns, bst.st_size, bst.st_mtime_ns)
        if cache is not None and key in cache:
            return dict(cache[key])
        header = read_header(ipath)
        h = hashlib.sha256()
        for path, size in ((ipath, ist.st_size), (bpath, bst.st_size)):
            h.update(size.to_bytes(8, "little"))
            h.update(_ends(path, size))
    except (OSError, IndexedFormatError):
        return None
    out = {"documents": max(header.document_count - 1, 0), "sequences": header.sequence_count,
           "idx_bytes": ist.st_size, "bin_bytes": bst.st_size, "sha256": h.hexdigest()}
    if cache is not None:
        cache[key] = dict(out)
    return out


def data_fingerprint(cfg, cache: Optional[dict] = None, given: Optional[dict] = None) -> dict[str, Any]:
    """``depends.json``'s ``data``: the :data:`DATA_KEYS` and, per source name, its prefix (for
    the messages; not compared) and :func:`source_identity`; ``given``: {name: identity} of
    sources whose files this job does not read (a federated group job: the other sites'
    sources, from their summaries, :func:`dept_mega.data.summary.foreign_summaries`)."""
    given = given or {}
    return {"data.split": cfg.data.split, "train.seed": cfg.train.seed, BATCH_KEY: cfg.train.global_batch_size,
            "sources": {s.name: {"prefix": s.prefix, "identity": (dict(given[s.name]) if s.name in given
                                                                  else source_identity(s.prefix, cache))}
                        for s in cfg.data.sources}}


def _split_weights(split: Any) -> Optional[list[float]]:
    """``data.split`` as normalised train, valid, test weights ("95,5" = "19,1"); None where
    :func:`~dept_mega.data.gpt_dataset.parse_split` refuses it."""
    try:
        w = parse_split(str(split))
    except ValueError:
        return None
    w += [0.0] * (3 - len(w))
    total = sum(w)
    return [x / total for x in w]


def same_split(a: Any, b: Any) -> bool:
    """Whether two data.split values give the same shares ("95,5" is "19,1", "90,10" is "90,10,0")."""
    wa, wb = _split_weights(a), _split_weights(b)
    if wa is None or wb is None:
        return a == b
    return all(abs(x - y) < 1e-12 for x, y in zip(wa, wb))


def _describe(prefix: Any, ident: Optional[dict]) -> str:
    if not isinstance(ident, dict):
        return f"{prefix!r} (unreadable)"
    return (f"{prefix!r} ({ident.get('documents', '?'):,} documents, .idx {ident.get('idx_bytes', '?'):,} bytes, "
            f".bin {ident.get('bin_bytes', '?'):,} bytes, sha256 of its ends {str(ident.get('sha256'))[:12]})")


def _positions_in_steps(cfg) -> bool:
    """Whether the run keeps its sources' data positions in steps (DEPT's round plans; STD's
    blend keeps each source's samples read, which another batch continues from)."""
    from ..variant import variant_of
    return variant_of(cfg).rounds


def data_differences(saved: Any, now: dict, cfg) -> Optional[list[tuple[str, str]]]:
    """(key, what) for each of :data:`DATA_KEYS` and each source (by name, present in both)
    whose data ``now`` (this launch's :func:`data_fingerprint`) changes against ``saved``
    (``depends.json``'s ``data``); None when the checkpoint does not record its data
    (written before dept_mega recorded it). ``cfg``: this launch's config (a source's index)."""
    if not isinstance(saved, dict):
        return None
    rows = []
    for key in DATA_KEYS:
        if key not in saved:
            continue
        old, new = saved[key], now[key]
        if key == BATCH_KEY:
            if old != new and _positions_in_steps(cfg):
                rows.append((key, f"the checkpoint's data positions are each source's trained steps × {old} "
                                  f"sequences, this launch reads them × {new}: every source's position would "
                                  f"move (data skipped or read twice)"))
        elif (key == "data.split" and not same_split(old, new)) or (key != "data.split" and old != new):
            rows.append((key, f"the checkpoint read its data under {old!r}, this launch has {new!r}"))
    old_sources = saved.get("sources") if isinstance(saved.get("sources"), dict) else {}
    for i, s in enumerate(cfg.data.sources):
        old, new = old_sources.get(s.name), now["sources"].get(s.name)
        if not isinstance(old, dict) or new is None:
            continue
        a, b = old.get("identity"), new["identity"]
        if a != b:
            rows.append((f"data.sources[{i}].prefix",
                         f"source '{s.name}': the checkpoint read {_describe(old.get('prefix'), a)}, this launch "
                         f"gives {_describe(new['prefix'], b)}: other data"))
    return rows

