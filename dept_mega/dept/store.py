"""Per-source state that persists across rounds, and its point-to-point moves between groups.

A source's own state is what the group that trains it owns only while it trains it: under
SPEC/SPEC-OPT/TRIM its embedding modules on this rank (token table, learned positions, untied
head — one ``SourceEmbeddings`` per model chunk) and their inner optimizer; with
``dept.body_optimizer_state: source`` (any variant) also the body's inner AdamW state. The
rank keeps the state of every source its group trained last; a source that is drawn into
another group later is sent there point to point, from each rank of the old group to the
rank at the same (tp, dp, pp) position of the new group (category ``source_move``), bit for
bit.

By default (``dept.body_optimizer_state: group``, what DiLoCo does) the body's inner
optimizer state belongs to the group: moving it with a source sends the body's two Adam
moments (2× the body) on every move, more than the outer synchronisation itself.

Wire format of a move — no pickle: a rank never unpickles what another rank sends. Three
phases: (1) a one-element int64 tensor with the byte length of the header; (2) the header,
UTF-8 JSON as uint8: ``{"version", "tensors": [[shape, dtype], ...], "tree"}`` where the tree
is the payload's structure — dicts as ``{"dict": [[key, value], ...]}`` (str or int keys),
lists and tuples as ``{"list": [...]}`` (tuples arrive as lists), tensors as ``{"tensor":
i}``, and str/int/float/bool/None as themselves; (3) every tensor in its own dtype. A header
that does not parse or does not follow this schema is a ``ValueError`` naming the peer rank.
Each phase posts all of this rank's sends and receives as ONE batch
(``pg.comm.batch_isend_irecv``): two groups that swap sources send to and receive from each
other, and NCCL completes a large send only once the peer has posted its receive — sends and
receives issued one by one would deadlock there.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

WIRE_VERSION = 1
MAX_HEADER_BYTES = 1 << 30
DTYPES = {name: getattr(torch, name) for name in
          ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")}


@dataclass
class SourceState:
    """One source's state on this rank."""
    embeddings: list  # list[SourceEmbeddings | None], aligned with the trainer's stages (GLOB: all None)
    optimizer: Optional[torch.optim.Optimizer] = None  # inner optimizer of those embeddings
    body_optimizer: Optional[dict] = None  # body_optimizer_state: source — the body AdamW's state_dict()
    extra: dict = field(default_factory=dict)  # plain values only (it crosses ranks as JSON)


# ----------------------------------------------------------------------------- header encoding
def encode(obj: Any) -> tuple[bytes, list[torch.Tensor]]:
    """The JSON header (bytes) of a nested payload and its tensors, in header order."""
    tensors: list[torch.Tensor] = []
    specs: list[list] = []

    def walk(x):
        if isinstance(x, torch.Tensor):
            name = str(x.dtype).replace("torch.", "")
            if name not in DTYPES:
                raise TypeError(f"cannot send a tensor of dtype {x.dtype}")
            tensors.append(x.detach())
            specs.append([list(x.shape), name])
            return {"tensor": len(tensors) - 1}
        if isinstance(x, dict):
            pairs = []
            for k, v in x.items():
                if not isinstance(k, (str, int)) or isinstance(k, bool):
                    raise TypeError(f"cannot send a dict key of type {type(k).__name__} ({k!r})")
                pairs.append([k, walk(v)])
            return {"dict": pairs}
        if isinstance(x, (list, tuple)):
            return {"list": [walk(v) for v in x]}
        if x is None or isinstance(x, (str, bool, int, float)):
            return x
        raise TypeError(f"cannot send a value of type {type(x).__name__} ({x!r})")

    tree = walk(obj)
    text = json.dumps({"version": WIRE_VERSION, "tensors": specs, "tree": tree}, separators=(",", ":"))
    return text.encode("utf-8"), tensors


@dataclass
class Header:
    tree: Any
    specs: list[tuple[tuple[int, ...], torch.dtype]]


def parse_header(raw: bytes, peer: int) -> Header:
    """Parse and check a received header; any defect is a ValueError naming ``peer``."""
    def bad(why: str) -> ValueError:
        return ValueError(f"source move: malformed header from rank {peer}: {why}")

    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise bad(f"not UTF-8 JSON ({exc})") from None
    if not isinstance(doc, dict) or set(doc) != {"version", "tensors", "tree"}:
        raise bad("expected an object with keys version, tensors, tree")
    if doc["version"] != WIRE_VERSION:
        raise bad(f"wire format version {doc['version']!r}, this rank speaks {WIRE_VERSION}")
    specs = []
    if not isinstance(doc["tensors"], list):
        raise bad("'tensors' is not a list")
    for i, spec in enumerate(doc["tensors"]):
        if not (isinstance(spec, list) and len(spec) == 2 and isinstance(spec[0], list)
                and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in spec[0])
                and spec[1] in DTYPES):
            raise bad(f"tensor {i}: expected [shape, dtype] with a dtype in {sorted(DTYPES)}, got {spec!r}")
        specs.append((tuple(spec[0]), DTYPES[spec[1]]))
    seen: set[int] = set()

    def check(x, path: str):
        if isinstance(x, dict):
            if len(x) != 1:
                raise bad(f"node {path}: expected one of dict, list, tensor, got keys {sorted(x)}")
            (kind, v), = x.items()
            if kind == "tensor":
                if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < len(specs) or v in seen:
                    raise bad(f"node {path}: tensor index {v!r} is not one of the {len(specs)} tensors")
                seen.add(v)
            elif kind == "dict":
                if not isinstance(v, list) or not all(isinstance(p, list) and len(p) == 2 and
                                                      isinstance(p[0], (str, int)) for p in v):
                    raise bad(f"node {path}: a dict must be a list of [key, value] pairs")
                for k, item in v:
                    check(item, f"{path}.{k}")
            elif kind == "list":
                if not isinstance(v, list):
                    raise bad(f"node {path}: a list must be a JSON array")
                for i, item in enumerate(v):
                    check(item, f"{path}[{i}]")
            else:
                raise bad(f"node {path}: unknown kind {kind!r}")
        elif isinstance(x, list):
            raise bad(f"node {path}: a bare array (lists are sent as {{\"list\": [...]}})")

    check(doc["tree"], "tree")
    if len(seen) != len(specs):
        raise bad(f"{len(specs)} tensors announced, {len(seen)} referenced")
    return Header(doc["tree"], specs)


def unpack(tree: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """Rebuild the payload of a checked header tree with the received tensors."""
    if isinstance(tree, dict):
        (kind, v), = tree.items()
        if kind == "tensor":
            return tensors[v]
        if kind == "dict":
            return {k: unpack(item, tensors) for k, item in v}
        return [unpack(item, tensors) for item in v]
    return tree


# ----------------------------------------------------------------------------- payloads
def state_payload(state: SourceState, with_optimizer: bool, with_weights: bool = True) -> dict:
    """What travels with a source (and what a checkpoint keeps of it): module state dicts (None
    for chunks without embeddings, or all None when ``with_weights`` is False — TRIM refills
    weights from φ), the embedding optimizer's state dict, the body optimizer's state dict
    (``body_optimizer_state: source``) and ``extra``. Plain dicts, lists and tensors only.
    Without ``with_optimizer`` the embedding optimizer's fp32 masters still travel under
    half-precision weights (its state dict with AdamW's state emptied): they are the exact
    values of the source's weights, and the bf16 weights alone would round them."""
    opt = state.optimizer
    if opt is None:
        opt_sd = None
    elif with_optimizer:
        opt_sd = opt.state_dict()
    else:
        opt_sd = opt.masters_state_dict() if (with_weights and hasattr(opt, "masters_state_dict")) else None
    return {"embeddings": [dict(e.state_dict()) if (e is not None and with_weights) else None
                           for e in state.embeddings],
            "optimizer": opt_sd,
            "body_optimizer": state.body_optimizer if with_optimizer else None,
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
    state.body_optimizer = payload.get("body_optimizer")
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
    """Run every transfer of this rank in three batched phases (length, header, tensors)."""
    if not transfers:
        return
    comm = pg.comm
    sends = [t for t in transfers if t.send]
    recvs = [t for t in transfers if not t.send]
    packed = {}
    for t in sends:
        raw, tensors = encode(t.payload)
        packed[id(t)] = (torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device), tensors)
    # phase 1: header lengths
    ops, lengths = [], {}
    for t in sends:
        ops.append((True, torch.tensor([packed[id(t)][0].numel()], dtype=torch.int64, device=device), t.peer))
    for t in recvs:
        lengths[id(t)] = torch.zeros(1, dtype=torch.int64, device=device)
        ops.append((False, lengths[id(t)], t.peer))
    _wait(comm.batch_isend_irecv(ops, None, category))
    # phase 2: headers
    ops, raws = [], {}
    for t in sends:
        ops.append((True, packed[id(t)][0], t.peer))
    for t in recvs:
        n = int(lengths[id(t)].item())
        if not 0 < n <= MAX_HEADER_BYTES:
            raise ValueError(f"source move: malformed header from rank {t.peer}: length {n} "
                             f"(expected 1 to {MAX_HEADER_BYTES} bytes)")
        raws[id(t)] = torch.empty(n, dtype=torch.uint8, device=device)
        ops.append((False, raws[id(t)], t.peer))
    _wait(comm.batch_isend_irecv(ops, None, category))
    # phase 3: tensors, each in its own dtype
    ops, inbox = [], {}
    for t in sends:
        # on the communication device (NCCL needs CUDA tensors; AdamW's step counters live
        # on the CPU); the receiver's optimizer.load_state_dict puts state where it belongs
        for x in packed[id(t)][1]:
            ops.append((True, x.to(device).contiguous(), t.peer))
    for t in recvs:
        header = parse_header(raws[id(t)].cpu().numpy().tobytes(), t.peer)
        bufs = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in header.specs]
        for b in bufs:
            ops.append((False, b, t.peer))
        inbox[id(t)] = (header, bufs)
    _wait(comm.batch_isend_irecv(ops, None, category))
    for t in recvs:
        header, bufs = inbox[id(t)]
        t.received = unpack(header.tree, bufs)


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
