"""GPT-style samples over one indexed source.

Rules:

* **Split by documents.** ``split = "98,2"`` (or ``"a,b,c"`` for train,valid,test) cuts the
  document list into contiguous ranges in file order (train first): valid and test each get
  ``floor(w / sum(w) * N)`` documents, at least one when their weight is positive; train takes
  the rest.
  Documents with no tokens are left out.
* **Epochs.** Epoch ``e`` visits every document of the part once, in an order shuffled by a
  generator seeded with ``(seed, e)`` (unshuffled with ``shuffle=False``). The epoch's tokens
  are one stream; sample ``j`` of the epoch is stream positions ``[j*L, j*L + L + 1)``, with
  ``L = seq_length``, so samples cross document boundaries and consecutive samples share one
  token (Megatron's layout). An epoch has ``(T - 1) // L`` samples for ``T`` tokens (the tail
  that cannot fill a sample is dropped). Within an epoch the sample order is shuffled too.
  Global sample ``i`` is sample ``i % S`` of epoch ``i // S``: the dataset never ends unless
  ``num_samples`` sizes it.
* **Index arrays** (document order, each sample's first document and offset, sample order) are
  built with numpy (``cumsum``/``searchsorted``, no loop over tokens) per epoch, and cached in
  ``cache_dir`` (default: beside the ``.idx``) as ``<name>_<part>_<hash>.<array>.npy``; the
  part's documents (their ids, first tokens and lengths) likewise, once per part. The hash
  covers every input that determines them: the documents' token lengths (the ``.idx``'s
  sequence lengths and document index), split, part, seed, seq_length, shuffle and epoch.
  Files are written to a temporary name and renamed (atomic; concurrent ranks writing the same
  file is harmless), and read memory-mapped, so the ranks of a node share one copy in the page
  cache. Arrays are int32 where the part's counts fit (int64 beyond 2**31). Which rank builds
  them at start-up: :mod:`dept_mega.data.index_build`; later, the first process that needs a
  set claims it (``<stem>.building``) and the others wait for its files.
* **Bytes** (``sample_bytes``): the UTF-8 bytes of the text behind a sample's *target* tokens
  (positions 1..L). Cumulative bytes are a piecewise-linear function of cumulative tokens: a
  document's bytes are spread evenly over its tokens (its EOD token included). A sample's bytes
  are the difference of that function at its ends, so they are exact when a sample covers whole
  documents, proportional for partial ones, and the samples of an epoch add up to the bytes of
  the text they cover.
"""
from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import dataclass
from typing import Optional

import numpy as np

from dept_mega.data.index_cache import (Launch, claim_or_wait, clear_failure, heartbeat, is_cached, load_arrays,
                                        narrow_int, record_failure, release, save_arrays)
from dept_mega.data.indexed import IndexedDataset
from dept_mega.log_lines import write_line

PARTS = ("train", "valid", "test")
CACHE_VERSION = 2  # 2: one memory-mapped .npy per array, int32 where the counts fit
PART_ARRAYS = ("doc_ids", "doc_starts", "doc_lengths")
EPOCH_ARRAYS = ("doc_order", "sample_doc", "sample_off", "sample_order")


class DatasetError(ValueError):
    """A dataset too small for the config (no documents for a part, fewer tokens than one
    sample): bad input, reported in one line naming the data prefix."""


def parse_split(split: str) -> list[float]:
    try:
        w = [float(x) for x in split.split(",")]
    except ValueError:
        raise ValueError(f"data.split {split!r} is not comma-separated weights like '98,2'") from None
    if not 1 <= len(w) <= 3 or any(x < 0 for x in w) or w[0] <= 0:
        raise ValueError(f"data.split {split!r}: need 1 to 3 non-negative weights, train > 0")
    return w


def split_bounds(num_docs: int, split: str) -> list[tuple[int, int]]:
    """Document ranges ``[lo, hi)`` of train, valid, test for ``num_docs`` documents."""
    w = parse_split(split) + [0.0] * (3 - len(parse_split(split)))
    total = sum(w)
    sizes = [0, 0, 0]
    for k in (1, 2):
        if w[k] > 0:
            sizes[k] = max(1, int(np.floor(w[k] / total * num_docs)))
    sizes[0] = num_docs - sizes[1] - sizes[2]
    if sizes[0] < 1:
        raise DatasetError(f"data.split {split!r}: {num_docs} documents are too few to give every part one")
    bounds, lo = [], 0
    for s in sizes:
        bounds.append((lo, lo + s))
        lo += s
    return bounds


def part_tokens(indexed: IndexedDataset, split: str, which: str) -> tuple[int, int, int]:
    """``(lo, hi, tokens)`` of part ``which`` of ``split`` in ``indexed``: its document range and
    its tokens (what :class:`GPTDataset` counts as ``num_tokens``), from the index alone."""
    lo, hi = split_bounds(indexed.num_documents, split)[PARTS.index(which)]
    return lo, hi, int(indexed.document_token_ranges()[1][lo:hi].sum())


#: data_hash of each ``.idx`` this process hashed, by the file's identity (IndexedDataset.idx_identity):
#: a start-up opens every source's index several times (the index walk, each part's dataset), and
#: hashing a large one reads hundreds of MB; a rewritten file is a new identity
_HASHED: dict[tuple, str] = {}


def data_hash(indexed: IndexedDataset) -> str:
    """sha256 of what the documents' token lengths follow from: the ``.idx``'s sequence lengths
    and document index, hashed from the memory map (no copy); once per file and process."""
    key = getattr(indexed, "idx_identity", None)
    if key is not None and key in _HASHED:
        return _HASHED[key]
    h = hashlib.sha256()
    for arr in (indexed.sequence_lengths, indexed.document_indices):
        h.update(f"{arr.dtype.str}:{len(arr)};".encode())  # where one array ends and the next begins
        h.update(memoryview(np.ascontiguousarray(arr)).cast("B"))
    digest = h.hexdigest()
    if key is not None:
        _HASHED[key] = digest
    return digest


def _key(**fields) -> str:
    return hashlib.sha256(json.dumps({"v": CACHE_VERSION, **fields}, sort_keys=True).encode()).hexdigest()[:20]


def default_cache_dir(prefix: str, cache_dir: Optional[str]) -> str:
    return cache_dir or os.path.dirname(os.path.abspath(prefix))


def part_stem(prefix: str, cache_dir: str, digest: str, split: str, which: str) -> str:
    """Stem of a part's cached per-document arrays (they depend on the documents' lengths,
    whose hash is ``digest``, the split and the part only)."""
    key = _key(data=digest, split=split, which=which, part=True)
    return os.path.join(cache_dir, f"{os.path.basename(prefix)}_{which}_{key}")


def epoch_stem(prefix: str, cache_dir: str, digest: str, split: str, which: str, seed: int, seq_length: int,
               shuffle: bool, epoch: int) -> str:
    """Stem of one epoch's cached sample arrays: ``<stem>.<array>.npy``."""
    key = _key(data=digest, split=split, which=which, seed=seed, seq_length=seq_length, shuffle=shuffle,
               epoch=epoch)
    return os.path.join(cache_dir, f"{os.path.basename(prefix)}_{which}_{key}")


@dataclass
class EpochIndex:
    doc_order: np.ndarray  # [n] positions into the part's document list, shuffled
    sample_doc: np.ndarray  # [S]: position in doc_order of each sample's first token
    sample_off: np.ndarray  # [S]: offset of that token inside the document
    sample_order: np.ndarray  # [S]: permutation of samples
    # int64 [n+1] stream position where each document starts, and float64 [n+1] bytes before
    # each document: computed when first asked for (sample_documents, sample_bytes), so a
    # training part that never asks holds no private per-document array
    cum_tokens: Optional[np.ndarray] = None
    cum_bytes: Optional[np.ndarray] = None


class GPTDataset:
    """Samples of ``seq_length + 1`` int64 tokens from one source (see the module doc)."""

    def __init__(self, prefix: str, seq_length: int, split: str = "98,2", which: str = "train",
                 seed: int = 1234, cache_dir: Optional[str] = None, num_samples: Optional[int] = None,
                 shuffle: bool = True, launch: Optional[Launch] = None):
        if which not in PARTS:
            raise ValueError(f"which={which!r}: expected one of {PARTS}")
        if seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {seq_length}")
        self.prefix = prefix
        self.seq_length = seq_length
        self.split = split
        self.which = which
        self.seed = seed
        self.shuffle = shuffle
        self.launch = launch  # set in a launch's start-up walk: a failed build noted there is not retried
        self.indexed = IndexedDataset(prefix)
        try:
            self._bounds = split_bounds(self.indexed.num_documents, split)[PARTS.index(which)]
        except DatasetError as exc:
            raise DatasetError(f"{prefix}: {exc}") from None
        self.cache_dir = default_cache_dir(prefix, cache_dir)
        self.cache_hits = 0  # epochs loaded from / built into the cache (the part's arrays: part_cached)
        self.cache_misses = 0
        self.part_built = False  # whether this object built the part's arrays (not loaded them)
        self._epochs: dict[int, EpochIndex] = {}
        self._data_hash = data_hash(self.indexed)
        self.part_cached = is_cached(self.part_stem(), PART_ARRAYS)
        part = self._load_or_build(self.part_stem(), {k: None for k in PART_ARRAYS}, self._build_part, count=False)
        self.doc_ids, self.doc_starts, self.doc_lengths = (part[k] for k in PART_ARRAYS)
        self.num_tokens = int(self.doc_lengths.sum(dtype=np.int64))
        if self.num_tokens < seq_length + 1:
            raise DatasetError(f"{prefix}: part '{which}' of split {split!r} has {self.num_tokens} tokens in "
                               f"{len(self.doc_ids)} documents; one sample needs seq_length + 1 = {seq_length + 1}")
        self.samples_per_epoch = (self.num_tokens - 1) // seq_length
        self.num_samples = num_samples
        self._nbytes = self.indexed.document_bytes()  # memory-mapped; read by sample_bytes only

    # ------------------------------------------------------------------ index building
    def part_stem(self) -> str:
        return part_stem(self.prefix, self.cache_dir, self._data_hash, self.split, self.which)

    def cache_path(self, epoch: int) -> str:
        """Stem of epoch ``epoch``'s cached arrays: ``<stem>.<array>.npy``."""
        return epoch_stem(self.prefix, self.cache_dir, self._data_hash, self.split, self.which, self.seed,
                          self.seq_length, self.shuffle, epoch)

    def is_cached(self, epoch: int) -> bool:
        """Whether epoch ``epoch``'s arrays are in the cache (the part's are: they were loaded)."""
        return is_cached(self.cache_path(epoch), EPOCH_ARRAYS)

    def _build_part(self) -> dict[str, np.ndarray]:
        lo, hi = self._bounds
        starts, lengths = self.indexed.document_token_ranges()
        keep = lengths[lo:hi] > 0
        docs = np.arange(lo, hi, dtype=np.int64)[keep]
        doc_lengths = lengths[lo:hi][keep]
        doc_starts = starts[lo:hi][keep]
        return {"doc_ids": narrow_int(docs, hi),
                "doc_starts": narrow_int(doc_starts, int(doc_starts[-1]) if len(docs) else 0),
                "doc_lengths": narrow_int(doc_lengths, int(doc_lengths.max()) if len(docs) else 0)}

    def _build(self, epoch: int) -> dict[str, np.ndarray]:
        n, L, S = len(self.doc_ids), self.seq_length, self.samples_per_epoch
        if self.shuffle:
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch, 0])))
            doc_order = rng.permutation(n).astype(np.int64)
        else:
            doc_order = np.arange(n, dtype=np.int64)
        cum = self._cum_tokens(doc_order)
        first = np.arange(S, dtype=np.int64) * L
        sample_doc = np.searchsorted(cum, first, side="right").astype(np.int64) - 1
        sample_off = first - cum[sample_doc]
        del cum, first
        if self.shuffle:
            rng2 = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch, 1])))
            sample_order = rng2.permutation(S).astype(np.int64)
        else:
            sample_order = np.arange(S, dtype=np.int64)
        longest = int(self.doc_lengths.max())
        return {"doc_order": narrow_int(doc_order, n), "sample_doc": narrow_int(sample_doc, n),
                "sample_off": narrow_int(sample_off, longest), "sample_order": narrow_int(sample_order, S)}

    def _cum_tokens(self, doc_order: np.ndarray) -> np.ndarray:
        cum = np.zeros(len(doc_order) + 1, dtype=np.int64)
        np.cumsum(self.doc_lengths[doc_order], dtype=np.int64, out=cum[1:])
        return cum

    def _load_or_build(self, stem: str, lengths: dict[str, Optional[int]], build,
                       count: bool = True) -> dict[str, np.ndarray]:
        """The arrays of ``stem`` memory-mapped from the cache, or built by ``build()``, written
        to the cache and mapped back (so that the builder keeps no private copy either). One
        process builds a stem at a time; another that needs it meanwhile waits for its files
        (:func:`~dept_mega.data.index_cache.claim_or_wait`). A failed build is noted for the
        other ranks of ``self.launch`` (:func:`~dept_mega.data.index_cache.record_failure`)."""
        arrays = load_arrays(stem, lengths)
        if arrays is None:
            claim = claim_or_wait(stem, list(lengths), log=write_line, launch=self.launch)
            if claim is None:  # another process built it while this one waited
                arrays = load_arrays(stem, lengths)
            if arrays is None:
                try:
                    with heartbeat(claim):
                        arrays = self._build_and_save(stem, build, count)
                except Exception as exc:
                    record_failure(stem, claim, self.launch, exc)  # before the claim is released
                    raise
                finally:
                    release(claim)
                if claim:
                    clear_failure(stem)
                return arrays
        self.cache_hits += count
        return arrays

    def _build_and_save(self, stem: str, build, count: bool) -> dict[str, np.ndarray]:
        self.cache_misses += count
        self.part_built |= not count
        arrays = build()
        lengths = {k: len(v) for k, v in arrays.items()}
        found = load_arrays(stem, lengths)
        if found is not None:
            # a whole set written meanwhile (a process that took this one's claim over): keep
            # it; replacing files that other processes may have mapped (on NFS: ESTALE, SIGBUS)
            # gains nothing, the contents are the same
            return found
        try:
            save_arrays(stem, arrays)
        except OSError as exc:
            # e.g. a read-only data directory: the arrays are rebuilt next time (same values)
            warnings.warn(f"could not cache dataset index at {stem}.*.npy: {exc}; set data.cache_dir")
            return arrays
        return load_arrays(stem, lengths) or arrays

    def epoch_index(self, epoch: int) -> EpochIndex:
        idx = self._epochs.get(epoch)
        if idx is None:
            n, S = len(self.doc_ids), self.samples_per_epoch
            a = self._load_or_build(self.cache_path(epoch), {"doc_order": n, "sample_doc": S, "sample_off": S,
                                                               "sample_order": S}, lambda: self._build(epoch))
            idx = EpochIndex(a["doc_order"], a["sample_doc"], a["sample_off"], a["sample_order"])
            if len(self._epochs) >= 2:
                self._epochs.pop(next(iter(self._epochs)))
            self._epochs[epoch] = idx
        return idx

    def _cumulative(self, idx: EpochIndex, nbytes: bool = False) -> EpochIndex:
        if idx.cum_tokens is None:
            idx.cum_tokens = self._cum_tokens(idx.doc_order)
        if nbytes and idx.cum_bytes is None:
            doc_bytes = np.asarray(self._nbytes[self.doc_ids], dtype=np.float64)
            cum_bytes = np.zeros(len(self.doc_ids) + 1, dtype=np.float64)
            np.cumsum(doc_bytes[idx.doc_order], out=cum_bytes[1:])
            idx.cum_bytes = cum_bytes
        return idx

    # ------------------------------------------------------------------ access
    def __len__(self) -> int:
        return self.num_samples if self.num_samples is not None else self.samples_per_epoch

    def _locate(self, i: int) -> tuple[EpochIndex, int]:
        if i < 0 or (self.num_samples is not None and i >= self.num_samples):
            raise IndexError(f"sample {i} out of range for {len(self)} samples")
        epoch, j = divmod(int(i), self.samples_per_epoch)
        idx = self.epoch_index(epoch)
        return idx, int(idx.sample_order[j])

    def __getitem__(self, i: int) -> np.ndarray:
        idx, k = self._locate(i)
        need = self.seq_length + 1
        out = np.empty(need, dtype=np.int64)
        pos, off, filled = int(idx.sample_doc[k]), int(idx.sample_off[k]), 0
        tokens = self.indexed.tokens
        while filled < need:
            d = int(idx.doc_order[pos])
            start, length = int(self.doc_starts[d]), int(self.doc_lengths[d])
            take = min(need - filled, length - off)
            out[filled:filled + take] = tokens[start + off:start + off + take]
            filled += take
            pos += 1
            off = 0
        return out

    def sample_documents(self, i: int) -> np.ndarray:
        """Indices (int64, in the ``.idx``) of the documents sample ``i`` draws tokens from, in order."""
        idx, k = self._locate(i)
        self._cumulative(idx)
        first = k * self.seq_length
        last = first + self.seq_length  # inclusive position of the final token
        p0 = int(idx.sample_doc[k])
        p1 = int(np.searchsorted(idx.cum_tokens, last, side="right")) - 1
        return np.asarray(self.doc_ids[idx.doc_order[p0:p1 + 1]], dtype=np.int64)

    def sample_bytes(self, i: int) -> float:
        """UTF-8 bytes of the text behind sample ``i``'s target tokens (see the module doc)."""
        if self._nbytes is None:
            raise FileNotFoundError(f"{self.prefix}.bytes.npy is missing: byte counts are written by "
                                    "tools/preprocess_data.py; re-run it to get bits per byte")
        idx, k = self._locate(i)
        self._cumulative(idx, nbytes=True)
        a = k * self.seq_length + 1
        b = a + self.seq_length
        ends = np.interp([a, b], idx.cum_tokens, idx.cum_bytes)
        return float(ends[1] - ends[0])
