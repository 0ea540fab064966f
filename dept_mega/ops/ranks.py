"""Vocabulary ranks: the succinct form of a monotone id remap table, for ``remap_ids``.

TRIM's remap table maps a global id v to its position in a source's sorted vocabulary set V_k,
-1 elsewhere: lookup[v] is the rank of v in V_k. Ranks on a bitmap store the same thing in
ceil(V / 32) int64 words, word w = (members below 32 w) << 32 | (membership bitmap of ids
32 w .. 32 w + 31); a member v maps to (word >> 32) + popcount(bitmap & ((1 << (v % 32)) - 1)).
For V = 250,112 that is 62.5 KB against the lookup's 2 MB: the CUDA kernel keeps the words in
shared memory, so a remap streams ids in and local ids out without a random global read per id
(csrc/cuda/remap_ranked.cu). Results and errors are those of the equivalent lookup.
"""
from __future__ import annotations

from typing import Union

import torch

from dept_mega.ops import fallback

__all__ = ["VocabRanks"]


class VocabRanks:
    """The ranks of a sorted set of unique ids in [0, ``size``): ``words`` int64
    [ceil(size / 32)] (layout above; csrc/constants.h, DM_RANK_BITS) and ``size``.

    Build with :meth:`from_ids`; the constructor takes words built so (it checks their shape
    and dtype, not their contents). ``remap_ids(ids, ranks)`` equals ``remap_ids(ids,
    ranks.to_lookup())``, errors included."""

    __slots__ = ("words", "size")

    def __init__(self, words: torch.Tensor, size: int) -> None:
        size = int(size)
        fallback.check_ranks_words(words, size)
        self.words = words
        self.size = size

    @classmethod
    def from_ids(cls, ids: torch.Tensor, size: int) -> "VocabRanks":
        """The ranks of ``ids`` (1-D int32 / int64, sorted ascending, unique, each in [0, size)),
        built with torch ops on the ids' device. Invalid ids raise ValueError naming the first
        offending position (out of range first, then order)."""
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1:
            shape = list(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise ValueError(f"VocabRanks: ids must be a 1-D tensor, got {shape}")
        if ids.dtype not in fallback.ID_DTYPES:
            raise TypeError(f"VocabRanks: ids must be int32 or int64, got {str(ids.dtype).replace('torch.', '')}")
        size = int(size)
        if not 0 <= size < 2 ** 31:
            raise ValueError(f"VocabRanks: the vocabulary size must be in [0, 2^31), got {size}")
        v = ids.long()
        if v.numel():
            out = (v < 0) | (v >= size)
            if bool(out.any()):
                pos = int(out.nonzero()[0, 0])
                raise ValueError(f"VocabRanks: ids[{pos}] = {int(v[pos])} is out of range for a "
                                 f"vocabulary of {size} ids")
            step = v[1:] - v[:-1]
            bad = step <= 0
            if bool(bad.any()):
                pos = int(bad.nonzero()[0, 0]) + 1
                a, b = int(v[pos - 1]), int(v[pos])
                if a == b:
                    raise ValueError(f"VocabRanks: ids must be unique: ids[{pos}] = {b} repeats "
                                     f"ids[{pos - 1}]")
                raise ValueError(f"VocabRanks: ids must be sorted ascending: ids[{pos - 1}] = {a} "
                                 f"> ids[{pos}] = {b}")
        bits = fallback.RANK_BITS
        nwords = (size + bits - 1) // bits
        # members below id 32 w (and 32 (w + 1)): the sorted ids' insertion points; a word's
        # bitmap is the sum of its members' distinct bits, a difference of prefix sums (exact
        # int64 arithmetic: no atomics, the same on every device)
        starts = torch.arange(nwords, dtype=torch.int64, device=v.device) * bits
        below = torch.searchsorted(v, starts)
        ends = torch.searchsorted(v, starts + bits)
        prefix = torch.cat([v.new_zeros(1), torch.cumsum(torch.ones_like(v) << (v % bits), 0)])
        bitmap = prefix[ends] - prefix[below]
        return cls((below << 32) | bitmap, size)

    @property
    def device(self) -> torch.device:
        return self.words.device

    def to(self, device: Union[str, torch.device]) -> "VocabRanks":
        return VocabRanks(self.words.to(device), self.size)

    def to_lookup(self) -> torch.Tensor:
        """The equivalent int64 lookup table [size]: the rank of a member, -1 elsewhere."""
        all_ids = torch.arange(self.size, dtype=torch.int64, device=self.words.device)
        return fallback.ranked_values(all_ids, self.words, self.size)[0]

    def __repr__(self) -> str:
        return f"VocabRanks(size={self.size}, words={self.words.numel()}, device={self.device})"
