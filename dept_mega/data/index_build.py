"""The ranks build the sample indexes at start-up between them, outside any collective.

Without this every rank of a job missed the cache at its first step, built the same arrays
and wrote its own copy (64 ranks x 8 sources of duplicate work and writes). At start-up,
before the datasets are opened, :func:`prepare_indexes` has every rank walk every source part
the job reads (the part's document arrays and epoch 0's sample arrays,
:mod:`dept_mega.data.gpt_dataset`), rank ``r`` starting at part ``r mod n``:

1. a part already in the cache is skipped; one whose build another process has claimed
   (:func:`~dept_mega.data.index_cache.claim_holder`) is put off; any other is claimed and
   built (:func:`~dept_mega.data.index_cache.claim_or_wait`), so n ranks build n parts at once;
2. the parts put off are then opened: their files are there by now, or this rank waits for
   them (a line every 30 s naming the part and the claim's host and pid), or takes the build
   over when its builder stopped refreshing the claim (it died). A builder that failed (a
   ``MemoryError``) noted its error in ``<stem>.failed`` before releasing its claim: the
   others report that error (:class:`~dept_mega.data.index_cache.IndexBuildFailed`, naming
   its rank, host and pid) instead of building again, so a failing build is tried once in
   the job. The note carries the launch's id (rank 0's, shared in one gather before the walk):
   a later launch ignores it and a successful build removes it.

No rank waits for a build inside a collective (under NCCL a wait there beyond
``train.init_timeout_s`` ends the job with a bare timeout) while it has one to wait for in its
own walk: the walk ends on a rank when every part is in the cache it sees. Then one agreement
(:func:`~dept_mega.parallel.agree.agree_errors`) makes a failure every rank's: bad input (a
source too small for the split: every rank meets it opening that part) is the same agreed
error on every rank; any other is raised by the rank that met it, and as a RuntimeError naming
that rank on the others that had none of their own. Each rank tries each part once. The limit
left: a rank whose walk ends early waits in that agreement for the builds of ranks that see
another cache (a node-local ``data.cache_dir`` warm on one node and cold on another), a wait
bounded by ``train.init_timeout_s``: raise it for a first launch on large data.

A ``data.cache_dir`` on a node-local disk: the ranks of each node see, claim and build their
node's files (the claims are files in that directory). A cache directory nobody can write (a
read-only data directory and no ``data.cache_dir``): no rank builds at start-up; each builds
its arrays once, in memory, when it opens a part, as without a cache (a rank whose build could
not be saved builds nothing more there either).

After that the ranks only load. Later epochs (and the epoch a resumed run starts in) are built
on first access, by the first rank that needs them, under the same claims. One process (no
process group): it builds what is missing itself.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from dept_mega.data.gpt_dataset import (EPOCH_ARRAYS, PART_ARRAYS, GPTDataset, data_hash, default_cache_dir,
                                        epoch_stem, part_stem)
from dept_mega.data.index_cache import Launch, can_write, claim_holder, is_cached
from dept_mega.data.indexed import IndexedDataset
from dept_mega.log_lines import write_line
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

    def open(self, launch: Optional[Launch] = None) -> GPTDataset:
        with naming_source(self.index, self.name):
            return GPTDataset(self.prefix, self.seq_length, self.split, self.which, self.seed, self.cache_dir,
                              shuffle=self.shuffle, launch=launch)


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


def _stems(spec: IndexSpec, digests: dict[str, str]) -> tuple[str, str]:
    """The cache stems of the part's arrays and of its epoch 0 (hashing the ``.idx`` once per
    prefix in ``digests``)."""
    if spec.prefix not in digests:
        with naming_source(spec.index, spec.name):
            digests[spec.prefix] = data_hash(IndexedDataset(spec.prefix))
    digest = digests[spec.prefix]
    cache_dir = default_cache_dir(spec.prefix, spec.cache_dir)
    return (part_stem(spec.prefix, cache_dir, digest, spec.split, spec.which),
            epoch_stem(spec.prefix, cache_dir, digest, spec.split, spec.which, spec.seed, spec.seq_length,
                       spec.shuffle, 0))


def spec_cached(spec: IndexSpec, digests: Optional[dict[str, str]] = None) -> bool:
    """Whether this rank sees the part's arrays and epoch 0's in the cache (reads the ``.idx``
    to hash it, once per prefix in ``digests``; builds nothing)."""
    part, epoch0 = _stems(spec, {} if digests is None else digests)
    return is_cached(part, PART_ARRAYS) and is_cached(epoch0, EPOCH_ARRAYS)


def _open_and_build(spec: IndexSpec, log, log_after_s: float, launch: Optional[Launch]) -> bool:
    """Open the part and its epoch 0 (building under a claim, or waiting for its holder);
    whether this process built any of it."""
    t0 = time.perf_counter()
    ds = spec.open(launch)
    ds.epoch_index(0)
    built = bool(ds.cache_misses or ds.part_built)
    if built and log is not None and time.perf_counter() - t0 >= log_after_s:
        log(f"data: built the sample index of source '{spec.name}' part {spec.which} "
            f"({len(ds.doc_ids)} documents, {ds.samples_per_epoch} samples an epoch) in "
            f"{time.perf_counter() - t0:.1f} s")
    return built


def build_parts(specs: Sequence[IndexSpec], rank: int, log=None, log_after_s: float = 1.0,
                launch: Optional[Launch] = None) -> tuple[int, Optional[Exception]]:
    """Steps 1 and 2 of the module doc on this rank (no collective): returns how many parts it
    built and the first error it met (each part is tried once; the walk goes on past a failed
    one, so that this rank does not wait in the agreement while the others still build).
    ``log`` gets a line for each build that took ``log_after_s`` seconds or more. ``launch``
    (default: one of this process alone): a build that failed on another rank of the launch is
    reported, not tried again."""
    launch = launch or Launch(uuid.uuid4().hex, rank)
    n = len(specs)
    digests: dict[str, str] = {}
    writable: dict[str, bool] = {}
    built, error, later = 0, None, []
    for first in (True, False):
        for spec in ([specs[(rank + k) % n] for k in range(n)] if first else later):
            directory = default_cache_dir(spec.prefix, spec.cache_dir)
            try:
                if directory not in writable:
                    writable[directory] = can_write(directory)
                if not writable[directory] or spec_cached(spec, digests):
                    continue
                if first and any(claim_holder(stem) for stem in _stems(spec, digests)):
                    later.append(spec)
                    continue
                built += _open_and_build(spec, log, log_after_s, launch)
                if not spec_cached(spec, digests):  # could not be saved (the builder warned)
                    writable[directory] = False
            except Exception as exc:  # noqa: BLE001 - agreed on by ensure_indexes, after the walk
                error = error or exc
    return built, error


def _raise(error: Optional[Exception]) -> None:
    if error is not None:
        raise error


def ensure_indexes(specs: Sequence[IndexSpec], rank: int, local_rank: int = 0,
                   device: Optional[torch.device] = None, log=write_line, log_after_s: float = 1.0) -> int:
    """The module doc's walk on every rank of the job, then one agreement on its errors (a
    collective: every rank calls it, with the same ``specs``). Returns how many parts this rank
    built. Bad input met by any rank is raised on every rank as the same agreed error; any
    other failure makes the other ranks raise a RuntimeError naming the rank that met it.
    ``local_rank`` is unused (each node's ranks share the work on a node-local cache). Starts
    with a gather of rank 0's launch id (no build before it delays a rank)."""
    from dept_mega.parallel.agree import agree_errors, all_gather_text
    from dept_mega.run_inputs import input_errors
    # the launch's id: rank 0's, given to every rank in a gather that no build delays
    launch = Launch(all_gather_text(uuid.uuid4().hex, device)[0], rank)
    built, error = build_parts(specs, rank, log, log_after_s, launch)
    agree_errors(lambda: _raise(error), input_errors(), device)
    return built


def prepare_indexes(cfg, rank: int, device: Optional[torch.device] = None, eval_part: str = "valid",
                    extra_sources: Sequence = ()) -> int:
    """:func:`ensure_indexes` for the parts a run reads (:func:`run_index_specs`)."""
    from dept_mega.parallel.agree import agree_errors
    from dept_mega.run_inputs import input_errors
    specs = agree_errors(lambda: run_index_specs(cfg, eval_part, extra_sources), input_errors(), device)
    return ensure_indexes(specs, rank, device=device)
