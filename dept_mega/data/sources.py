"""Batches for training and evaluation: one source per data-parallel rank (DEPT), a blend of
sources (STD), source weights, TRIM's vocabulary sets, and the validation iterator.

Sample order: step ``t`` of a source uses the dataset's samples
``[c, c + global_batch_size)`` where ``c`` is the number consumed before it; data-parallel
rank ``r`` of ``D`` takes the ``r``-th contiguous slice of ``global_batch_size / D`` and cuts
it into micro-batches. So the D ranks together cover the global batch, none overlap, and the
result does not depend on D (only on global_batch_size). Under DEPT the loop moves a source's
iterator to the source's position from the round plan at every round start
(:meth:`SourceBatches.seek`), so a source continues its data whichever group trains it.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, NamedTuple, Optional, Sequence

import numpy as np
import torch

from dept_mega.data.gpt_dataset import GPTDataset
from dept_mega.config import ConfigError
from dept_mega.data.indexed import IndexedFormatError
from dept_mega.data.token_counts import token_counts  # (torch-free module; vocab_set calls it by this name)

SAMPLINGS = ("uniform", "proportional", "temperature", "weights")


def source_weights(sizes: Sequence[float], sampling: str, temperature: float = 1.0,
                   weights: Optional[Sequence[float]] = None) -> np.ndarray:
    """Probabilities of picking each source. ``sizes``: the sources' token counts; ``weights``:
    their ``data.sources[i].weight`` (default 1 each). ``uniform``: alike; ``proportional``: ∝
    size × weight; ``temperature``: ∝ (size × weight)^τ (τ = 0 is uniform, τ = 1 proportional);
    ``weights``: ∝ weight alone, whatever the sizes (Megatron-LM's ``--data-path 0.3 A 0.7 B``).
    Used for STD batches and for DEPT's K > G source sampler."""
    s = np.asarray(sizes, dtype=np.float64)
    if s.ndim != 1 or len(s) == 0:
        raise ValueError(f"source_weights: need a non-empty list of sizes, got {sizes!r}")
    if np.any(~np.isfinite(s)) or np.any(s <= 0):
        raise ValueError(f"source_weights: every source size must be > 0, got {list(s)}")
    w_cfg = np.ones_like(s) if weights is None else np.asarray(weights, dtype=np.float64)
    if w_cfg.shape != s.shape or np.any(~np.isfinite(w_cfg)) or np.any(w_cfg <= 0):
        raise ValueError(f"source_weights: need one weight > 0 per source, got {weights!r} for {len(s)} sources")
    if sampling == "uniform":
        w = np.ones_like(s)
    elif sampling == "proportional":
        w = s * w_cfg
    elif sampling == "temperature":
        if temperature < 0:
            raise ValueError(f"dept.temperature must be >= 0, got {temperature}")
        # normalise first so large sizes with τ > 1 do not overflow
        sw = s * w_cfg
        w = (sw / sw.max()) ** float(temperature)
    elif sampling == "weights":
        w = w_cfg.copy()
    else:
        raise ValueError(f"dept.sampling {sampling!r} is not one of {' | '.join(SAMPLINGS)}")
    return w / w.sum()


def blend_shares(cfg, names: Sequence[str], tokens: Sequence[float]) -> np.ndarray:
    """STD: each source's probability in the batch mix: ``dept.sampling`` over the sources'
    ``tokens`` (their train parts') and ``data.sources[i].weight``."""
    scale = {s.name: s.weight for s in cfg.data.sources}
    return source_weights(tokens, cfg.dept.sampling, cfg.dept.temperature, weights=[scale.get(n, 1.0) for n in names])


def sampling_line(sampling: str, names: Sequence[str], shares: Sequence[float], how: str = "") -> str:
    """The start-up log line of each source's share of the training, e.g.
    ``sampling (proportional): en 41.2 %, fr 33.0 %, code 25.8 %``."""
    parts = ", ".join(f"{n} {100.0 * float(x):.1f} %" for n, x in zip(names, shares))
    return f"sampling ({sampling}{'; ' + how if how else ''}): {parts}"


def _check_batch(global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int) -> int:
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} out of range for dp_size {dp_size}")
    if micro_batch_size < 1 or global_batch_size % (micro_batch_size * dp_size):
        raise ValueError(f"global_batch_size {global_batch_size} is not divisible by micro_batch_size × "
                         f"dp_size = {micro_batch_size} × {dp_size}")
    return global_batch_size // dp_size


def _stack(dataset: GPTDataset, indices: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.stack([dataset[int(i)] for i in indices]))


class SourceBatches:
    """One source's micro-batches for one data-parallel rank, step after step.
    ``next_step()`` returns ``global_batch_size / (dp_size · micro_batch_size)`` LongTensors
    of shape ``[micro_batch_size, seq_length + 1]``."""

    def __init__(self, dataset: GPTDataset, global_batch_size: int, micro_batch_size: int,
                 dp_rank: int = 0, dp_size: int = 1):
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.per_rank = _check_batch(global_batch_size, micro_batch_size, dp_rank, dp_size)
        self.consumed_samples = 0
        self.steps = 0

    def step_indices(self) -> np.ndarray:
        """Dataset indices this rank reads at the next step."""
        base = self.consumed_samples + self.dp_rank * self.per_rank
        return np.arange(base, base + self.per_rank, dtype=np.int64)

    def next_step(self) -> list[torch.Tensor]:
        idx = self.step_indices()
        if self.dataset.num_samples is not None and idx[-1] >= self.dataset.num_samples:
            raise IndexError(f"source {self.dataset.prefix} has no samples left "
                                f"({self.dataset.num_samples} requested)")
        tokens = _stack(self.dataset, idx)
        self.consumed_samples += self.global_batch_size
        self.steps += 1
        return list(tokens.split(self.micro_batch_size))

    def seek(self, steps: int) -> None:
        """Continue as if ``steps`` steps had been read (DEPT: a source's position comes from
        the round plan, so that it continues wherever it trains next)."""
        if steps < 0:
            raise ValueError(f"seek: steps must be >= 0, got {steps}")
        self.consumed_samples = int(steps) * self.global_batch_size
        self.steps = int(steps)

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples, "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.consumed_samples = int(state["consumed_samples"])
        self.steps = int(state["steps"])


class BlendedStep(NamedTuple):
    micro_batches: list[torch.Tensor]  # [micro_batch_size, seq_length + 1] int64
    source_ids: list[torch.Tensor]  # [micro_batch_size] int64: index of each sequence's source


class BlendedBatches:
    """STD: each sequence of a global batch comes from a source drawn with ``weights`` by a
    generator seeded with ``(seed, step)``, the same on every rank (no communication). Each
    source is read in its own order (its samples consumed so far), so a source's sequence
    stream does not depend on the others."""

    def __init__(self, datasets: Sequence[GPTDataset], weights: Sequence[float], global_batch_size: int,
                 micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1, seed: int = 1234):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        w = np.asarray(weights, dtype=np.float64)
        if np.any(w < 0) or w.sum() <= 0:
            raise ValueError(f"weights must be >= 0 with a positive sum, got {list(w)}")
        self.datasets = list(datasets)
        self.weights = w / w.sum()
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.per_rank = _check_batch(global_batch_size, micro_batch_size, dp_rank, dp_size)
        self.seed = seed
        self.consumed = np.zeros(len(datasets), dtype=np.int64)
        self.steps = 0

    def step_plan(self) -> tuple[np.ndarray, np.ndarray]:
        """(source, sample index in that source) of every sequence of the next global batch."""
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, self.steps, 7])))
        choice = rng.choice(len(self.datasets), size=self.global_batch_size, p=self.weights)
        sample = np.empty(self.global_batch_size, dtype=np.int64)
        for k in range(len(self.datasets)):
            where = np.flatnonzero(choice == k)
            sample[where] = self.consumed[k] + np.arange(len(where))
        return choice.astype(np.int64), sample

    def next_step(self) -> BlendedStep:
        choice, sample = self.step_plan()
        lo = self.dp_rank * self.per_rank
        mine_src, mine_idx = choice[lo:lo + self.per_rank], sample[lo:lo + self.per_rank]
        tokens = torch.from_numpy(np.stack([self.datasets[int(s)][int(i)] for s, i in zip(mine_src, mine_idx)]))
        src = torch.from_numpy(mine_src.copy())
        self.consumed += np.bincount(choice, minlength=len(self.datasets))
        self.steps += 1
        mb = self.micro_batch_size
        return BlendedStep(list(tokens.split(mb)), list(src.split(mb)))

    def state_dict(self) -> dict:
        return {"consumed": self.consumed.tolist(), "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        consumed = np.asarray(state["consumed"], dtype=np.int64)
        if consumed.shape != self.consumed.shape:
            raise ValueError(f"state has {len(consumed)} sources, this blend has {len(self.consumed)}")
        self.consumed = consumed
        self.steps = int(state["steps"])


class EvalBatch(NamedTuple):
    """One evaluation iteration of one data-parallel rank: its share of the global batch."""
    micro_batches: list[torch.Tensor]  # each [micro_batch_size, seq_length + 1] int64
    rows: list[int]  # the rows of each micro-batch that count (the first ones; the rest fill a short share)
    samples: np.ndarray  # the validation samples of the share (dataset indices), in order
    bytes: torch.Tensor  # [len(samples)] float64: UTF-8 bytes behind each sample's targets


class ValidationBatches:
    """Fixed-order evaluation over one source's validation part, the same samples whatever the
    layout (data-parallel size, micro-batch size, tensor and pipeline sizes); ``eval_iters``
    counts global batches, as Megatron-LM's ``--eval-iters`` does.

    The evaluated samples are the first ``min(eval_iters × global_batch_size, samples in the
    part)`` of the dataset (``samples``, ``train.eval_samples``, in place of the product when
    given): at most ``eval_iters`` global batches and never more than one pass
    (no sample counted twice). A part smaller than that is evaluated whole, its last batch
    holding the ``m`` samples left (also when ``m`` < global_batch_size: a small part is not
    refused or cut to a layout-dependent size). Iteration ``k`` covers samples
    ``[k·GBS, k·GBS + m_k)`` (``m_k`` = GBS but in such a last batch); rank ``r`` of ``D``
    takes the ``r``-th contiguous share of ``ceil(m_k / D)`` samples (GBS / D in a full batch)
    and runs it in micro-batches of ``micro_batch_size``. Every rank runs the same number of
    micro-batches of the same shape in every iteration (their collectives pair up): where a
    share is short (only in a partial last batch) the micro-batches are filled by repeating a
    sample of the batch, and ``rows`` says how many rows of each count. So the loss sums, token
    counts and bytes summed over the ranks cover the same samples under any layout. Cost:
    ``eval_iters × global_batch_size`` sequences per source and evaluation. Use a dataset built
    with ``which="valid", shuffle=False``."""

    def __init__(self, dataset: GPTDataset, global_batch_size: int, micro_batch_size: int, eval_iters: int,
                 dp_rank: int = 0, dp_size: int = 1, samples: Optional[int] = None):
        _check_batch(global_batch_size, micro_batch_size, dp_rank, dp_size)
        if eval_iters < 0 or (samples is not None and samples < 0):
            raise ValueError(f"eval_iters and samples must be >= 0, got {eval_iters} and {samples}")
        self.dataset = dataset
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        wanted = eval_iters * global_batch_size if samples is None else samples  # train.eval_samples
        self.num_samples = min(wanted, dataset.samples_per_epoch)
        self.num_batches = -(-self.num_samples // global_batch_size)

    def __len__(self) -> int:
        return self.num_batches

    def share(self, k: int) -> tuple[np.ndarray, int]:
        """(this rank's samples of iteration ``k``, the share size every rank pads to)."""
        lo = k * self.global_batch_size
        m = min(self.global_batch_size, self.num_samples - lo)
        per = -(-m // self.dp_size)
        a, b = (min(lo + j * per, lo + m) for j in (self.dp_rank, self.dp_rank + 1))
        return np.arange(a, b, dtype=np.int64), per

    def __iter__(self) -> Iterator[EvalBatch]:
        mbs = self.micro_batch_size
        for k in range(self.num_batches):
            idx, per = self.share(k)
            n_micro = -(-per // mbs)
            fill = int(idx[-1]) if len(idx) else k * self.global_batch_size  # a sample of this batch
            padded = np.concatenate([idx, np.full(n_micro * mbs - len(idx), fill, dtype=np.int64)])
            tokens = _stack(self.dataset, padded)
            rows = [min(max(len(idx) - j * mbs, 0), mbs) for j in range(n_micro)]
            nbytes = torch.tensor([self.dataset.sample_bytes(int(i)) for i in idx], dtype=torch.float64)
            yield EvalBatch(list(tokens.split(mbs)), rows, idx, nbytes)


# ---------------------------------------------------------------------------- vocabulary sets


def vocab_set(prefix: str, cache_dir: Optional[str] = None,
              progress: Optional[Callable[[int, int], None]] = None) -> np.ndarray:
    """TRIM's V_k: the sorted token ids (int64) that occur in ``PREFIX.bin`` (cached;
    ``progress``: :func:`token_counts`'s)."""
    return np.flatnonzero(token_counts(prefix, cache_dir, progress=progress)).astype(np.int64)


@contextmanager
def naming_source(index: int, name: str):
    """Re-raise a damaged file's :class:`IndexedFormatError` (which names only the file) of
    source ``data.sources[index]`` as a ConfigError naming the source and the config key."""
    try:
        yield
    except IndexedFormatError as exc:
        raise ConfigError(f"config key 'data.sources[{index}].prefix': source '{name}': {exc}") from exc


def source_datasets(cfg, which: str = "train", shuffle: Optional[bool] = None,
                    sources: Optional[Sequence] = None) -> list[GPTDataset]:
    """One :class:`GPTDataset` per ``cfg.data.sources`` entry (or per entry of ``sources``:
    ``dept_mega.evaluate --extra-source``), part ``which`` of ``data.split`` (train shuffled,
    valid/test not, unless ``shuffle`` says otherwise)."""
    shuffle = (which == "train") if shuffle is None else shuffle
    out = []
    for i, s in enumerate(cfg.data.sources if sources is None else sources):
        with naming_source(i, s.name):
            out.append(GPTDataset(s.prefix, cfg.model.seq_length, cfg.data.split, which, cfg.train.seed,
                                  cfg.data.cache_dir, shuffle=shuffle))
    return out
