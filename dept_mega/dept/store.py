"""Per-source state that persists across rounds, and its point-to-point moves between groups.

A source's own state is what the group that trains it owns only while it trains it: its
embedding modules on this rank (token table, learned positions, untied head — one
``SourceEmbeddings`` per model chunk) and their inner optimizer. The rank keeps the state of
every source its group trained last; a source that is drawn into another group later is sent
there point to point, from each rank of the old group to the rank at the same (tp, dp, pp)
position of the new group (category ``source_move``), bit for bit.

The body's inner optimizer state is *not* per source: it belongs to the group. Moving it with
a source would send the body's two Adam moments (2× the body) on every move, which is more
than the outer synchronisation itself; a group keeps adapting one body optimizer.

Wire format of a move (three phases): a one-element int64 header with the length of the
metadata, the pickled metadata as uint8 (structure, shapes, dtypes, optimizer
hyper-parameters), then every tensor in its own dtype. Each phase posts all of this rank's
sends and receives as ONE batch (``pg.comm.batch_isend_irecv``): two groups that swap sources
send to and receive from each other, and NCCL completes a large send only once the peer has
posted its receive — sends and receives issued one by one would deadlock there.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch


@dataclass
class SourceState:
    """One source's state on this rank."""
    embeddings: list  # list[SourceEmbeddings], aligned with the trainer's stages
    optimizer: Optional[torch.optim.Optimizer] = None  # inner optimizer of those embeddings
    extra: dict = field(default_factory=dict)  # e.g. the round it last trained


# ----------------------------------------------------------------------------- packing
_TENSOR = "__tensor__"


def pack(obj: Any) -> tuple[Any, list[torch.Tensor]]:
    """Replace every tensor leaf of a nested dict/list/tuple by a placeholder; return both."""
    tensors: list[torch.Tensor] = []

    def walk(x):
        if isinstance(x, torch.Tensor):
            tensors.append(x.detach())
            return (_TENSOR, len(tensors) - 1, tuple(x.shape), str(x.dtype).replace("torch.", ""))
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(walk(v) for v in x)
        return x

    return walk(obj), tensors


def _is_placeholder(x) -> bool:
    return isinstance(x, tuple) and len(x) == 4 and x[0] == _TENSOR


def unpack(meta: Any, tensors: Sequence[torch.Tensor]) -> Any:
    def walk(x):
        if _is_placeholder(x):
            return tensors[x[1]]
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(walk(v) for v in x)
        return x

    return walk(meta)


def placeholders(meta: Any) -> list[tuple]:
    out: list[tuple] = []

    def walk(x):
        if _is_placeholder(x):
            out.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(meta)
    return sorted(out, key=lambda p: p[1])


def state_payload(state: SourceState, with_optimizer: bool, with_weights: bool = True) -> dict:
    """What travels with a source: module state dicts (None for chunks without embeddings,
    or all None when ``with_weights`` is False — TRIM refills weights from φ) and the
    optimizer's state dict."""
    return {"embeddings": [e.state_dict() if (e is not None and with_weights) else None
                           for e in state.embeddings],
            "optimizer": state.optimizer.state_dict() if (with_optimizer and state.optimizer is not None) else None,
            "extra": dict(state.extra)}


def load_payload(state: SourceState, payload: dict) -> None:
    """Copy a received payload into a freshly built state of the same shapes."""
    if len(payload["embeddings"]) != len(state.embeddings):
        raise ValueError(f"moved source has {len(payload['embeddings'])} embedding chunks, "
                         f"this rank expects {len(state.embeddings)}")
    with torch.no_grad():
        for emb, sd in zip(state.embeddings, payload["embeddings"]):
            if sd is not None:
                emb.load_state_dict(sd, strict=True)
    if payload["optimizer"] is not None and state.optimizer is not None:
        state.optimizer.load_state_dict(payload["optimizer"])
    state.extra.update(payload.get("extra", {}))


# ----------------------------------------------------------------------------- p2p
@dataclass
class Transfer:
    """One point-to-point transfer of this rank: send ``payload`` to ``peer`` or receive from it."""
    peer: int
    send: bool
    payload: Optional[dict] = None  # sending side
    received: Optional[dict] = None  # receiving side, filled by exchange()
    tag: int = 0


def _wait(works) -> None:
    for w in works:
        w.wait()


def exchange(pg, transfers: Sequence[Transfer], device: torch.device, category: str = "source_move") -> None:
    """Run every transfer of this rank in three non-blocking phases (header, metadata, tensors)."""
    if not transfers:
        return
    comm = pg.comm
    sends = [t for t in transfers if t.send]
    recvs = [t for t in transfers if not t.send]
    packed = {}
    for t in sends:
        meta, tensors = pack(t.payload)
        raw = torch.frombuffer(bytearray(pickle.dumps(meta)), dtype=torch.uint8).to(device)
        packed[id(t)] = (raw, tensors)
    # phase 1: metadata lengths
    ops, headers = [], {}
    for t in sends:
        raw = packed[id(t)][0]
        ops.append((True, torch.tensor([raw.numel()], dtype=torch.int64, device=device), t.peer))
    for t in recvs:
        headers[id(t)] = torch.zeros(1, dtype=torch.int64, device=device)
        ops.append((False, headers[id(t)], t.peer))
    _wait(comm.batch_isend_irecv(ops, None, category))
    # phase 2: metadata
    ops, metas = [], {}
    for t in sends:
        ops.append((True, packed[id(t)][0], t.peer))
    for t in recvs:
        metas[id(t)] = torch.empty(int(headers[id(t)].item()), dtype=torch.uint8, device=device)
        ops.append((False, metas[id(t)], t.peer))
    _wait(comm.batch_isend_irecv(ops, None, category))
    # phase 3: tensors, each in its own dtype
    ops, inbox = [], {}
    for t in sends:
        # on the communication device (NCCL needs CUDA tensors; AdamW's step counters live
        # on the CPU); the receiver's optimizer.load_state_dict puts state where it belongs
        for x in packed[id(t)][1]:
            ops.append((True, x.to(device).contiguous(), t.peer))
    for t in recvs:
        meta = pickle.loads(metas[id(t)].cpu().numpy().tobytes())
        bufs = []
        for _, _, shape, dtype in placeholders(meta):
            bufs.append(torch.empty(shape, dtype=getattr(torch, dtype), device=device))
        for b in bufs:
            ops.append((False, b, t.peer))
        inbox[id(t)] = (meta, bufs)
    _wait(comm.batch_isend_irecv(ops, None, category))
    for t in recvs:
        meta, bufs = inbox[id(t)]
        t.received = unpack(meta, bufs)


# ----------------------------------------------------------------------------- store
class SourceStore:
    """The per-source states this rank holds (sources its group trained last)."""

    def __init__(self) -> None:
        self.states: dict[str, SourceState] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.states

    def get(self, name: str) -> SourceState:
        return self.states[name]

    def put(self, name: str, state: SourceState) -> None:
        self.states[name] = state

    def pop(self, name: str) -> SourceState:
        return self.states.pop(name)

    def names(self) -> list[str]:
        return sorted(self.states)

    def move(self, pg, moves: Sequence[tuple[str, int, int]], build: Callable[[str], SourceState],
             device: torch.device, with_optimizer: bool = True, with_weights: bool = True) -> list[str]:
        """Carry out this round's moves ``(source, from group, to group)`` for this rank.

        The rank of the old group at this rank's (tp, dp, pp) position sends; the rank of the
        new group at the same position receives into ``build(source)`` (fresh modules of the
        right shapes) and keeps it. Returns the names received."""
        c = pg.coords
        transfers: list[tuple[str, Transfer]] = []
        for name, src_g, dst_g in moves:
            if src_g == dst_g:
                continue
            if c.group == src_g:
                if name not in self.states:
                    raise RuntimeError(f"source {name!r} should move from group {src_g} but rank {pg.rank} "
                                       "does not hold its state")
                peer = pg.rank_of(c.tp, c.dp, c.pp, dst_g)
                transfers.append((name, Transfer(peer, True, state_payload(self.states[name], with_optimizer,
                                                                         with_weights))))
            elif c.group == dst_g:
                peer = pg.rank_of(c.tp, c.dp, c.pp, src_g)
                transfers.append((name, Transfer(peer, False)))
        exchange(pg, [t for _, t in transfers], device)
        received = []
        for name, t in transfers:
            if t.send:
                del self.states[name]
            else:
                state = build(name)
                load_payload(state, t.received)
                self.states[name] = state
                received.append(name)
        return received
