"""Shared by the memory model's CPU checks (tests/test_memory_activations.py,
tests/test_memory_fp8.py): a tiny trainer after one training step, and the storages a forward
saves for backward."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from tests.dept_utils import merge, solo_groups, tiny_config


def trained_one_step(base: dict, over: dict, pg=None, device: str = "cpu"):
    """(trainer, config, tokens [b, s + 1]): a Trainer on ``device`` of ``base`` merged with
    ``over`` after one training step on those tokens (optimizer state and, with FP8, the
    delayed-scaling history exist; the tokens stay on the CPU)."""
    from dept_mega.trainer import MicroBatch, Trainer

    cfg = tiny_config(merge(base, over))
    torch.manual_seed(0)
    tr = Trainer(cfg, pg or solo_groups(), torch.device(device), vocab_size=cfg.model.vocab_size)
    b, s = cfg.train.micro_batch_size, cfg.model.seq_length
    tokens = torch.randint(0, cfg.model.vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(1))
    tr.train_step([MicroBatch(tokens=tokens)])
    return tr, cfg, tokens


@contextmanager
def saved_storages() -> Iterator[dict[int, int]]:
    """{storage data_ptr: bytes} of every tensor autograd saves for backward inside the block
    (each storage once)."""
    saved: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved
