"""Pure PyTorch implementations of the dept_mega ops.

Used when the compiled extension is absent (or for a device it has no kernels for), and as
the reference the extension is tested against. The results equal the compiled kernels bit for
bit: every scatter reduces each destination row in fp32 in the fixed chunked order of
csrc/cuda/kernels.h (see `_ordered_add_`), then rounds once.
Errors (types and messages) are those of csrc/common.h.
"""
from __future__ import annotations

from typing import Optional

import torch

ROW_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Contributions per chunk of the scatters' summation order: DM_SCATTER_CHUNK of csrc/constants.h.
CHUNK = 64
ID_DTYPES = (torch.int32, torch.int64)
# Ids per word of the vocabulary ranks (dept_mega.ops.ranks): DM_RANK_BITS of csrc/constants.h.
RANK_BITS = 32


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def _check_rows_dtype(op: str, what: str, dt: torch.dtype) -> None:
    if dt not in ROW_DTYPES:
        raise TypeError(f"{op}: {what} must be float32, bfloat16 or float16, got {_dtype_name(dt)}")


def _check_ids_dtype(op: str, what: str, dt: torch.dtype) -> None:
    if dt not in ID_DTYPES:
        raise TypeError(f"{op}: {what} must be int32 or int64, got {_dtype_name(dt)}")


def _check_same_device(op: str, a: torch.Tensor, an: str, b: torch.Tensor, bn: str) -> None:
    if a.device != b.device:
        raise ValueError(f"{op}: {an} is on {a.device} but {bn} is on {b.device}")


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def check_gather_args(table: torch.Tensor, ids: torch.Tensor,
                      out_dtype: Optional[torch.dtype]) -> None:
    op = "gather_rows"
    if table.dim() != 2:
        raise ValueError(f"{op}: table must be 2-D [rows, dim], got shape {_shape(table)}")
    if ids.dim() != 1:
        raise ValueError(f"{op}: ids must be 1-D, got shape {_shape(ids)}")
    _check_rows_dtype(op, "table", table.dtype)
    _check_ids_dtype(op, "ids", ids.dtype)
    if out_dtype is not None:
        _check_rows_dtype(op, "out_dtype", out_dtype)
    _check_same_device(op, table, "table", ids, "ids")


def check_scatter_args(op: str, out: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> None:
    if out.dim() != 2:
        raise ValueError(f"{op}: table must be 2-D [rows, dim], got shape {_shape(out)}")
    if ids.dim() != 1:
        raise ValueError(f"{op}: ids must be 1-D, got shape {_shape(ids)}")
    if rows.dim() != 2 or rows.shape[0] != ids.shape[0] or rows.shape[1] != out.shape[1]:
        raise ValueError(f"{op}: rows must have shape [{ids.shape[0]}, {out.shape[1]}] "
                         f"(len(ids), table dim), got {_shape(rows)}")
    _check_rows_dtype(op, "table", out.dtype)
    _check_rows_dtype(op, "rows", rows.dtype)
    _check_ids_dtype(op, "ids", ids.dtype)
    if not out.is_contiguous():
        raise ValueError(f"{op}: the destination table is updated in place and must be contiguous")
    _check_same_device(op, out, "table", ids, "ids")
    _check_same_device(op, out, "table", rows, "rows")


def check_remap_args(ids: torch.Tensor, lookup: torch.Tensor) -> None:
    op = "remap_ids"
    if lookup.dim() != 1:
        raise ValueError(f"{op}: lookup must be 1-D, got shape {_shape(lookup)}")
    _check_ids_dtype(op, "ids", ids.dtype)
    _check_ids_dtype(op, "lookup", lookup.dtype)
    _check_same_device(op, ids, "ids", lookup, "lookup")


def check_ranks_words(words: torch.Tensor, size: int) -> None:
    """The vocabulary ranks' own invariants that the operators check: the size's range, the
    words' shape and dtype (their contents: dept_mega.ops.VocabRanks.from_ids)."""
    op = "remap_ids"
    if not 0 <= size < 2 ** 31:
        raise ValueError(f"{op}: the ranks' vocabulary size must be in [0, 2^31), got {size}")
    nwords = (size + RANK_BITS - 1) // RANK_BITS
    if words.dim() != 1 or words.shape[0] != nwords:
        raise ValueError(f"{op}: ranks words must have shape [{nwords}] for a vocabulary of {size} "
                         f"ids, got {_shape(words)}")
    if words.dtype != torch.int64:
        raise TypeError(f"{op}: ranks words must be int64, got {_dtype_name(words.dtype)}")


def check_remap_ranked_args(ids: torch.Tensor, words: torch.Tensor, size: int, stage: int = -1) -> None:
    """The checks of the remap_ranked operator, in its order (csrc/common.h)."""
    check_ranks_words(words, size)
    if stage not in (-1, 0, 1):
        raise ValueError(f"remap_ids: stage must be -1 (auto), 0 (global memory) or 1 (shared "
                         f"memory), got {stage}")
    _check_ids_dtype("remap_ids", "ids", ids.dtype)
    _check_same_device("remap_ids", ids, "ids", words, "ranks")


def id_out_of_range(op: str, pos: int, gid: int, num_rows: int) -> IndexError:
    return IndexError(f"{op}: ids[{pos}] = {gid} is out of range for a table of {num_rows} rows")


def remap_out_of_range(pos: int, gid: int, size: int) -> IndexError:
    return IndexError(f"remap_ids: global id {gid} at flat position {pos} is out of range "
                      f"for a lookup of {size} entries")


def remap_missing(pos: int, gid: int, value: int) -> ValueError:
    return ValueError(f"remap_ids: global id {gid} (first at flat position {pos}) is not in "
                      f"this source's vocabulary (lookup[{gid}] = {value})")


def check_ids_in_range(op: str, ids: torch.Tensor, num_rows: int) -> None:
    """IndexError naming the first id outside [0, num_rows)."""
    if ids.numel() == 0:
        return
    bad = (ids < 0) | (ids >= num_rows)
    if bool(bad.any()):
        pos = int(bad.nonzero()[0, 0])
        raise id_out_of_range(op, pos, int(ids[pos]), num_rows)


def _gather(table: torch.Tensor, ids: torch.Tensor, out_dtype: Optional[torch.dtype]) -> torch.Tensor:
    check_gather_args(table, ids, out_dtype)
    check_ids_in_range("gather_rows", ids, table.shape[0])
    rows = table.index_select(0, ids)
    if out_dtype is not None and out_dtype != table.dtype:
        rows = rows.to(out_dtype)
    return rows.contiguous()


class _GatherRows(torch.autograd.Function):
    """Gather whose backward is the deterministic scatter-add (not index_select's backward,
    which uses atomics on CUDA)."""

    @staticmethod
    def forward(ctx, table, ids, out_dtype):
        ctx.save_for_backward(ids)
        ctx.table_shape = table.shape
        ctx.table_dtype = table.dtype
        return _gather(table, ids, out_dtype)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        grad_table = grad.new_zeros(ctx.table_shape, dtype=ctx.table_dtype)
        scatter_add_rows(grad_table, ids, grad.contiguous())
        return grad_table, None, None


def gather_rows(table: torch.Tensor, ids: torch.Tensor,
                out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    return _GatherRows.apply(table, ids, out_dtype)


def _ranks(index: torch.Tensor):
    """(sorted index, the positions in that order, rows per destination, each sorted row's
    rank among its destination's rows); a stable sort, so ranks follow ascending position."""
    sorted_idx, order = torch.sort(index, stable=True)
    _, counts = torch.unique_consecutive(sorted_idx, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(index.numel(), device=index.device) - torch.repeat_interleave(starts, counts)
    return sorted_idx, order, counts, rank


def _sequential_add_(acc: torch.Tensor, index: torch.Tensor, src: torch.Tensor,
                     by_rank: Optional[bool] = None) -> None:
    """acc[index[i]] += src[i], each destination adding its rows in ascending i.

    On CPU ``index_add_`` does exactly that (one sequential loop over i). Elsewhere (CUDA)
    index_add_ uses atomics and index_put_ reduces duplicates in a tree, so the rows are
    added by rank instead: pass r adds, for every destination, its r-th row (ascending i);
    inside a pass the destinations are distinct, so each element gets one exact add. That
    takes max-multiplicity passes. ``by_rank`` forces a method (tests)."""
    if by_rank is None:
        by_rank = acc.device.type != "cpu"
    if not by_rank:
        acc.index_add_(0, index, src)
        return
    if index.numel() == 0:
        return
    sorted_idx, order, counts, rank = _ranks(index)
    for r in range(int(counts.max())):
        sel = rank == r
        acc.index_add_(0, sorted_idx[sel], src.index_select(0, order[sel]))


def _ordered_add_(acc: torch.Tensor, index: torch.Tensor, src: torch.Tensor,
                  by_rank: Optional[bool] = None) -> None:
    """acc[d] += the rows i with index[i] == d, in the compiled kernels' fixed order: in
    ascending i, cut into chunks of ``CHUNK`` rows; chunk 0 is added to acc[d] row by row,
    every later chunk is summed from zero (row by row) and its sum added to acc[d], in chunk
    order. Rows of a destination with at most CHUNK rows are therefore added one by one in
    ascending i. ``by_rank``: see `_sequential_add_` (at most CHUNK + chunks-per-row passes)."""
    if index.numel() == 0:
        return
    sorted_idx, order, _, rank = _ranks(index)
    head = rank < CHUNK
    _sequential_add_(acc, sorted_idx[head], src.index_select(0, order[head]), by_rank)
    if bool(head.all()):
        return
    tail = ~head
    dest, chunk = sorted_idx[tail], rank[tail] // CHUNK
    # One partial sum per (destination, chunk >= 1), numbered in (destination, chunk) order,
    # which is the sorted order of the tail.
    key = dest * (int(chunk.max()) + 1) + chunk
    _, part_of, part_rows = torch.unique_consecutive(key, return_inverse=True, return_counts=True)
    parts = torch.zeros(part_rows.numel(), acc.shape[1], dtype=acc.dtype, device=acc.device)
    _sequential_add_(parts, part_of, src.index_select(0, order[tail]), by_rank)
    part_dest = dest[torch.cumsum(part_rows, 0) - part_rows]
    _sequential_add_(acc, part_dest, parts, by_rank)


def _group(op: str, out: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor):
    check_scatter_args(op, out, ids, rows)
    if ids.numel() == 0:
        return None
    check_ids_in_range(op, ids, out.shape[0])
    return torch.unique(ids.long(), sorted=True, return_inverse=True, return_counts=True)


def scatter_add_rows(out: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    groups = _group("scatter_add_rows", out, ids, rows)
    if groups is None:
        return out
    uniq, inv, _ = groups
    acc = out.index_select(0, uniq).float()
    _ordered_add_(acc, inv, rows.float())
    out.index_copy_(0, uniq, acc.to(out.dtype))
    return out


def scatter_mean_rows(table: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor,
                      accumulate: bool = False, alpha: float = 1.0) -> torch.Tensor:
    groups = _group("scatter_mean_rows", table, ids, rows)
    if groups is None:
        return table
    uniq, inv, counts = groups
    acc = torch.zeros(uniq.numel(), table.shape[1], dtype=torch.float32, device=table.device)
    _ordered_add_(acc, inv, rows.float())
    mean = acc / counts.to(torch.float32).unsqueeze(1)
    if alpha != 1.0:
        # Round alpha to fp32 first, as the compiled kernels receive it.
        mean = mean * torch.tensor(float(alpha), dtype=torch.float32).item()
    if accumulate:
        mean = table.index_select(0, uniq).float() + mean
    table.index_copy_(0, uniq, mean.to(table.dtype))
    return table


def remap_ids(ids: torch.Tensor, lookup: torch.Tensor) -> torch.Tensor:
    check_remap_args(ids, lookup)
    if ids.numel() == 0:
        return torch.empty_like(ids, memory_format=torch.contiguous_format)
    flat = ids.reshape(-1).long()
    size = lookup.numel()
    in_range = (flat >= 0) & (flat < size)
    if size > 0:
        vals = lookup.long()[flat.clamp(0, size - 1)]
    else:
        vals = torch.full_like(flat, -1)
    return _remapped(ids, flat, vals, in_range, size)


def _remapped(ids: torch.Tensor, flat: torch.Tensor, vals: torch.Tensor, in_range: torch.Tensor,
              size: int) -> torch.Tensor:
    """``vals`` (the lookup's value at each in-range id) in the ids' dtype and shape, or the
    error of the first id out of range or with a value < 0."""
    bad = ~in_range | (vals < 0)
    if bool(bad.any()):
        pos = int(bad.nonzero()[0, 0])
        gid = int(flat[pos])
        if not bool(in_range[pos]):
            raise remap_out_of_range(pos, gid, size)
        raise remap_missing(pos, gid, int(vals[pos]))
    return vals.to(ids.dtype).reshape(ids.shape).contiguous()


def popcount32(x: torch.Tensor) -> torch.Tensor:
    """Set bits of each int64 in [0, 2^32) (SWAR: torch has no popcount)."""
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return ((x * 0x01010101) & 0xFFFFFFFF) >> 24


def ranked_values(flat: torch.Tensor, words: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the equivalent lookup's values at int64 ids ``flat``: a member's rank, -1 for a non-member
    or an id out of range; which ids are in [0, size))."""
    in_range = (flat >= 0) & (flat < size)
    if size == 0:
        return torch.full_like(flat, -1), in_range
    safe = flat.clamp(0, size - 1)
    word = words[safe >> 5]  # RANK_BITS = 2^5 ids a word
    bit = safe & (RANK_BITS - 1)
    bits = word & 0xFFFFFFFF
    member = in_range & (((bits >> bit) & 1) == 1)
    below = popcount32(bits & ((torch.ones_like(bit) << bit) - 1))
    return torch.where(member, (word >> 32) + below, torch.full_like(flat, -1)), in_range


def remap_ranked(ids: torch.Tensor, words: torch.Tensor, size: int, stage: int = -1) -> torch.Tensor:
    """remap_ids through vocabulary ranks (dept_mega.ops.VocabRanks): the result and errors of
    remap_ids with the equivalent lookup. ``stage`` is the CUDA kernel's (checked, no effect)."""
    check_remap_ranked_args(ids, words, size, stage)
    if ids.numel() == 0:
        return torch.empty_like(ids, memory_format=torch.contiguous_format)
    flat = ids.reshape(-1).long()
    vals, in_range = ranked_values(flat, words, size)
    return _remapped(ids, flat, vals, in_range, size)
