"""Checkpoint format 2's boxes (dept_mega.checkpoint_format): flat ranges as boxes, and a
tensor written as tensor-parallel shards (strided, SwiGLU-like) read back as another tensor
size's distributed-optimizer pieces and as the whole tensor."""
import math

import pytest
import torch

from dept_mega.checkpoint_format import entries_of, load_entries, range_boxes, read_full, save_entries, whole
from dept_mega.manifest import CheckpointError


@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 3, 4), (3, 1, 5)])
def test_flat_ranges_are_few_boxes_in_flat_order(shape):
    n = math.prod(shape)
    full = torch.arange(n).view(shape)
    for s in range(n):
        for e in range(s + 1, n + 1):
            boxes = range_boxes(shape, s, e)
            got = torch.cat([full[tuple(slice(o, o + z) for o, z in zip(off, sz))].reshape(-1) for off, sz in boxes])
            assert torch.equal(got, torch.arange(s, e)), (shape, s, e)
            assert len(boxes) <= 2 * len(shape) - 1


def _param(rows: int, stride: int):
    p = torch.nn.Parameter(torch.zeros(rows, 3))
    p.partition_dim, p.partition_stride, p.tensor_parallel = 0, stride, True
    return p


def _shard(full, stride, parts, index):
    return torch.cat([b.chunk(parts, 0)[index] for b in full.chunk(stride, 0)], 0)


def test_strided_shards_reload_as_pieces_of_another_tensor_size(tmp_path):
    full = torch.arange(16 * 3.0).view(16, 3)
    saved = [e for t in range(2) for e in entries_of("model/w", _shard(full, 2, 2, t).clone(), _param(8, 2), t, 2)]
    save_entries(saved + [whole("steps", torch.tensor(7))], str(tmp_path))
    flat = torch.zeros(12)  # tensor rank 1 of 4, held as two flat pieces
    q = _param(4, 2)
    load_entries(entries_of("model/w", flat[:5], q, 1, 4, (0, 5)) + entries_of("model/w", flat[5:], q, 1, 4, (5, 12)),
                 str(tmp_path))
    assert torch.equal(flat.view(4, 3), _shard(full, 2, 4, 1))
    got = read_full(str(tmp_path), ["model/w", "steps"])
    assert torch.equal(got["model/w"].flatten(0, 1), full) and int(got["steps"]) == 7
    with pytest.raises(CheckpointError, match="'model/v'"):
        load_entries(entries_of("model/v", torch.zeros(4, 3), q, 1, 4), str(tmp_path))
