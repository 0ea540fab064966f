"""One rank builds the sample indexes; the others wait, then memory-map its files.

Without this every rank of a job missed the cache at its first step, built the same arrays
and wrote its own copy (64 ranks x 8 sources of duplicate work and writes). At start-up,
before the datasets are opened, :func:`prepare_indexes`:

1. global rank 0 opens every source part the job reads and builds what the cache lacks (the
   part's document arrays and epoch 0's sample arrays, :mod:`dept_mega.data.gpt_dataset`);
   the other ranks wait for it in :func:`~dept_mega.parallel.agree.agree_errors`, which also
   makes its failure every rank's (no rank waits for a builder that gave up);
2. every rank then looks for the files. ``data.cache_dir`` may be node-local (a local disk):
   when any rank cannot see them, local rank 0 (``LOCAL_RANK``) of each node that cannot
   builds them there, the others waiting as in 1. Where rank 0 itself could not write them
   (a read-only directory), no rank tries: each builds its arrays in memory at open.

After that the ranks only load. Later epochs (and the epoch a resumed run starts in) are built
on first access, by the first rank that needs them; a rank that needs them meanwhile waits for
its files (:func:`~dept_mega.data.index_cache.claim_or_wait`). One process (no process group):
it builds what is missing itself.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from dept_mega.data.gpt_dataset import (EPOCH_ARRAYS, PART_ARRAYS, GPTDataset, data_hash, default_cache_dir,
                                        epoch_stem, part_stem)
from dept_mega.data.index_cache import is_cached
from dept_mega.data.indexed import IndexedDataset
from dept_mega.data.sources import naming_source


@dataclass(frozen=True)
class IndexSpec:
    """One source part a job reads: what :class:`GPTDataset` is opened with, and the source's
    place in ``data.sources`` (for errors that name the config key)."""
    index: int
    name: str
    prefix: str
    which: str
    seq_length: int
    split: str
    seed: int
    cache_dir: Optional[str]
    shuffle: bool

    def open(self) -> GPTDataset:
        with naming_source(self.index, self.name):
            return GPTDataset(self.prefix, self.seq_length, self.split, self.which, self.seed, self.cache_dir,
                              shuffle=self.shuffle)


def run_index_specs(cfg, eval_part: str = "valid", extra_sources: Sequence = ()) -> list[IndexSpec]:
    """The source parts ``dept_mega.train.load_run_data`` opens: each held source's train part
    and evaluation part (``eval_part``), and ``extra_sources``' evaluation parts."""
    from dept_mega.config import held_here
    held = held_here(cfg)
    mine = list(enumerate(cfg.data.sources)) if held is None else [(i, cfg.data.sources[i]) for i in held]
    d, t, L = cfg.data, cfg.train, cfg.model.seq_length
    specs = [IndexSpec(i, s.name, s.prefix, which, L, d.split, t.seed, d.cache_dir, which == "train")
             for which in ("train", eval_part) for i, s in mine]
    specs += [IndexSpec(i, s.name, s.prefix, eval_part, L, d.split, t.seed, d.cache_dir, False)
              for i, s in enumerate(extra_sources)]
    return specs


def spec_cached(spec: IndexSpec, digests: Optional[dict[str, str]] = None) -> bool:
    """Whether this rank sees the part's arrays and epoch 0's in the cache (reads the ``.idx``
    to hash it, once per prefix in ``digests``; builds nothing)."""
    digests = {} if digests is None else digests
    if spec.prefix not in digests:
        with naming_source(spec.index, spec.name):
            digests[spec.prefix] = data_hash(IndexedDataset(spec.prefix))
    digest = digests[spec.prefix]
    cache_dir = default_cache_dir(spec.prefix, spec.cache_dir)
    return (is_cached(part_stem(spec.prefix, cache_dir, digest, spec.split, spec.which), PART_ARRAYS)
            and is_cached(epoch_stem(spec.prefix, cache_dir, digest, spec.split, spec.which, spec.seed,
                                     spec.seq_length, spec.shuffle, 0), EPOCH_ARRAYS))


def build_missing(specs: Sequence[IndexSpec], log=None, log_after_s: float = 1.0) -> int:
    """Open every part of ``specs`` and build the arrays the cache lacks (part and epoch 0);
    returns how many parts needed building. ``log`` gets a line for each build that took
    ``log_after_s`` seconds or more (the other ranks waited that long)."""
    built = 0
    for spec in specs:
        t0 = time.perf_counter()
        ds = spec.open()
        ds.epoch_index(0)
        if ds.cache_misses or not ds.part_cached:
            built += 1
            if log is not None and time.perf_counter() - t0 >= log_after_s:
                log(f"data: built the sample index of source '{spec.name}' part {spec.which} "
                    f"({len(ds.doc_ids)} documents, {ds.samples_per_epoch} samples an epoch) in "
                    f"{time.perf_counter() - t0:.1f} s")
    return built


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def ensure_indexes(specs: Sequence[IndexSpec], rank: int, local_rank: int,
                   device: Optional[torch.device] = None, log=_stderr, log_after_s: float = 1.0) -> int:
    """Steps 1 and 2 of the module doc on every rank of the job (a collective: every rank
    calls it, with its own view of ``specs``). Returns how many parts this rank built.
    Bad input found by the builder (a source too small for the split, a damaged file) is
    raised on every rank as the same agreed error; any other failure of the builder makes the
    other ranks raise a RuntimeError naming it."""
    from dept_mega.parallel.agree import agree_errors, world_max
    from dept_mega.run_inputs import input_errors
    errors = input_errors()
    built = agree_errors(lambda: build_missing(specs, log, log_after_s) if rank == 0 else 0, errors, device)
    digests: dict[str, str] = {}
    missing = agree_errors(lambda: not all(spec_cached(s, digests) for s in specs), errors, device)
    if world_max([int(rank == 0 and missing)], device)[0]:
        # rank 0 could not write the cache (a read-only data directory and no data.cache_dir; the
        # builder warned): no node can, so every rank builds its arrays in memory when it opens a
        # part, once, as without a cache
        return built
    if world_max([int(missing)], device)[0]:  # a node-local cache_dir: each such node builds its own
        builder = missing and local_rank == 0
        built += agree_errors(lambda: build_missing(specs, log, log_after_s) if builder else 0, errors, device)
    return built


def prepare_indexes(cfg, rank: int, device: Optional[torch.device] = None, eval_part: str = "valid",
                    extra_sources: Sequence = ()) -> int:
    """:func:`ensure_indexes` for the parts a run reads (:func:`run_index_specs`); local rank
    from torchrun's ``LOCAL_RANK``."""
    from dept_mega.parallel.agree import agree_errors
    from dept_mega.run_inputs import input_errors
    specs = agree_errors(lambda: run_index_specs(cfg, eval_part, extra_sources), input_errors(), device)
    return ensure_indexes(specs, rank, int(os.environ.get("LOCAL_RANK", "0")), device)
