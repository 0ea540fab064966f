"""CPU tests for failures that only NCCL would show (gloo buffers sends and takes CPU tensors):
point-to-point exchanges where two ranks send to each other must be posted as one batch, and
no collective may be issued with a tensor that is not on the communication device."""
from __future__ import annotations

import torch

from dept_mega.dept.store import Transfer, exchange
from dept_mega.parallel.groups import build_groups


class LoopbackComm:
    """Records every batch; a receive gets the tensor this rank sent to the same peer at the
    same position (as if the peer sent the same payload). Unbatched calls are refused: on NCCL
    a send and a receive between the same two ranks issued one by one deadlock once the
    messages are too large to buffer."""

    def __init__(self) -> None:
        self.batches: list[list[tuple[bool, int]]] = []

    def batch_isend_irecv(self, ops, group, category):
        self.batches.append([(s, peer) for s, _, peer in ops])
        sent: dict[int, list[torch.Tensor]] = {}
        for s, t, peer in ops:
            if s:
                sent.setdefault(peer, []).append(t)
        for s, t, peer in ops:
            if not s:
                t.copy_(sent[peer].pop(0))
        return []

    def __getattr__(self, name):
        raise AssertionError(f"unexpected call comm.{name} (only batched p2p is expected here)")


def test_source_swap_posts_sends_and_receives_together():
    """Two groups swapping sources: each rank sends its source's state to the other group's rank
    and receives the other's (dept/store.py exchange)."""
    pg = build_groups()
    pg.comm = LoopbackComm()
    payload = {"embeddings": [{"weight": torch.randn(5, 3)}], "optimizer": {"step": torch.tensor(2.0)},
               "extra": {"round": 1}}
    send, recv = Transfer(peer=1, send=True, payload=payload), Transfer(peer=1, send=False)
    exchange(pg, [send, recv], torch.device("cpu"))
    assert len(pg.comm.batches) == 3  # header, metadata, tensors (no unbatched isend/irecv)
    for batch in pg.comm.batches:
        assert {s for s, _ in batch} == {True, False}  # every phase: sends and receives in one batch
    got = recv.received
    assert torch.equal(got["embeddings"][0]["weight"], payload["embeddings"][0]["weight"])
    assert got["optimizer"]["step"].item() == 2.0 and got["extra"] == {"round": 1}


def test_outer_sync_of_nothing_issues_no_collective(monkeypatch):
    """GLOB's embedding sync on a middle pipeline stage holds no parameters; its flat buffer is an
    empty CPU tensor, which NCCL refuses. With nothing to sync, no collective is issued (every
    member of the outer and dp groups is in the same position)."""
    import dept_mega.dept.outer as outer
    from dept_mega.dept.outer import FlatSync, OuterOptimizer
    pg = build_groups()
    pg.comm = LoopbackComm()  # any collective call fails the test
    monkeypatch.setattr(outer, "group_size", lambda group: 2)  # as if 2 groups and 2 dp replicas
    sync = FlatSync([], pg, OuterOptimizer("nesterov", momentum=0.9))
    sync.sync()
    assert sync.theta_prev.numel() == 0
