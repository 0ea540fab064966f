"""Pipeline schedules: 1F1B and interleaved 1F1B over this rank's stage chunks.

Layout: with P pipeline ranks and V chunks per rank (``parallel.virtual_pipeline``), chunk c
of pipeline rank p is virtual stage ``v = c·P + p`` (layer block v of P·V). Virtual stage 0
embeds tokens, virtual stage P·V−1 returns per-token losses.

Order of work (Megatron's schedules): a rank first runs ``warmup`` forwards, then alternates
one forward and one backward, then drains the remaining backwards. Forward number k (0-based)
of a rank runs chunk ``(k // P) % V`` on micro-batch ``(k // (P·V))·P + k % P``; backward
number k runs chunk ``V − 1 − (k // P) % V`` on the same micro-batch. With V = 1 this is plain
1F1B with ``warmup = P − p − 1``; with V > 1, ``warmup = 2(P − p − 1) + (V − 1)·P`` and the
number of micro-batches must be a multiple of P.

Communication (:func:`p2p_program`): between two consecutive computations a rank issues ONE
batch of point-to-point operations — the sends of the computation just done together with the
receives of the next one — through ``torch.distributed.batch_isend_irecv`` (``pg.comm``,
category ``pp``) and waits for the batch before computing. These are Megatron-core's combined
calls (``send_forward_recv_backward``, ``send_backward_recv_forward``,
``send_forward_recv_forward``, ...). NCCL does not buffer large messages: a send completes only
when the peer has posted the matching receive, and individual sends/receives between the same
two ranks run in order on one stream, so the earlier scheme (``isend`` after each computation,
blocking ``recv`` before the next) deadlocked on NCCL for the interleaved schedule with
``parallel.pipeline: 2`` (both ranks send to each other before either receives). A batch
posts its operations together, so a send and a receive in one batch never wait for each other.
All messages travel on one process group per pipeline group (:class:`PipeChannels`;
``batch_isend_irecv`` needs one group); messages between two ranks in one direction are
matched first-in first-out, so the send order of every (sender, receiver) pair must equal the
receive order — shapes are known in advance (``[s, b, h]``, ``[s/T, b, h]`` under sequence
parallelism), so nothing but the payload is exchanged.

:func:`simulate` replays the programs of all ranks with rendezvous (unbuffered) sends and
proves the order is free of deadlock, that every computation has its inputs and that the
FIFO matching pairs the right messages (used by tests for a grid of layouts).

Memory (Megatron's ``deallocate_output_tensor``): once a chunk's output activation has been
sent, its storage is released — the backward needs only its autograd node, not its values —
and the backward is started from the node's gradient edge. Received inputs are kept: their
gradient is what the backward sends back.
"""
from __future__ import annotations

from collections import defaultdict
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from .groups import ParallelGroups, layout_ranks


class ScheduleError(ValueError):
    """The micro-batch count does not fit the pipeline layout."""


# --------------------------------------------------------------------------- action lists


@dataclass(frozen=True)
class Action:
    kind: str  # "F" or "B"
    microbatch: int
    chunk: int


def forward_position(k: int, P: int, V: int) -> tuple[int, int]:
    """(micro-batch, chunk) of a rank's k-th forward."""
    if V == 1:
        return k, 0
    return (k // (P * V)) * P + k % P, (k // P) % V


def backward_position(k: int, P: int, V: int) -> tuple[int, int]:
    """(micro-batch, chunk) of a rank's k-th backward."""
    if V == 1:
        return k, 0
    mb, c = forward_position(k, P, V)
    return mb, V - 1 - c


def check_microbatches(num_microbatches: int, P: int, V: int) -> None:
    if num_microbatches < 1:
        raise ScheduleError("a step needs at least one micro-batch")
    if V > 1 and num_microbatches % P:
        raise ScheduleError(f"interleaved pipeline (parallel.virtual_pipeline={V}) needs the number of "
                            f"micro-batches per step ({num_microbatches} = global_batch_size / "
                            f"(micro_batch_size × data)) to be a multiple of parallel.pipeline={P}")


def schedule_slots(num_microbatches: int, P: int, V: int, p: int) -> list[list[Action]]:
    """The actions of pipeline rank ``p`` for one training step, grouped into the units
    between which it communicates: each warm-up forward and each cool-down backward alone;
    in the steady phase each forward and each backward alone for plain 1F1B (Megatron's
    ``send_forward_recv_backward`` / ``send_backward_recv_forward``) and one (forward,
    backward) pair for the interleaved schedule (Megatron's
    ``send_forward_backward_recv_forward_backward`` after both computations)."""
    check_microbatches(num_microbatches, P, V)
    total = num_microbatches * V
    if V == 1:
        warmup = min(P - p - 1, total)
    else:
        warmup = min(2 * (P - p - 1) + (V - 1) * P, total)
    slots: list[list[Action]] = []
    for k in range(warmup):
        slots.append([Action("F", *forward_position(k, P, V))])
    for k in range(total - warmup):
        f = Action("F", *forward_position(warmup + k, P, V))
        b = Action("B", *backward_position(k, P, V))
        slots.extend([[f], [b]] if V == 1 else [[f, b]])
    for k in range(total - warmup, total):
        slots.append([Action("B", *backward_position(k, P, V))])
    return slots


def schedule_actions(num_microbatches: int, P: int, V: int, p: int) -> list[Action]:
    """The ordered forward/backward actions of pipeline rank ``p`` for one training step."""
    return [a for slot in schedule_slots(num_microbatches, P, V, p) for a in slot]


def forward_only_slots(num_microbatches: int, V: int) -> list[list[Action]]:
    """Evaluation order: micro-batch by micro-batch, chunk by chunk (forwards only)."""
    return [[Action("F", mb, c)] for mb in range(num_microbatches) for c in range(V)]


# --------------------------------------------------------------------------- p2p programs


@dataclass(frozen=True)
class Message:
    """One tensor between virtual stages: ``act`` (the activation virtual stage ``virtual``
    takes as input) or ``grad`` (the gradient virtual stage ``virtual`` receives for its
    output), of micro-batch ``microbatch``."""
    kind: str  # "act" | "grad"
    microbatch: int
    virtual: int


@dataclass(frozen=True)
class P2P:
    send: bool
    peer: int  # pipeline rank of the other side
    msg: Message


@dataclass(frozen=True)
class Batch:
    """Point-to-point operations posted together. ``wait``: the rank blocks until all have
    completed (``batch_isend_irecv`` + wait). ``channel`` names the process group; operations
    of one (channel, peers) stream run in posting order (NCCL's per-communicator stream)."""
    ops: tuple[P2P, ...]
    wait: bool = True
    channel: str = "p2p"


Item = Union[Action, Batch]


def action_recvs(a: Action, P: int, V: int, p: int) -> list[P2P]:
    """What computation ``a`` of pipeline rank ``p`` must receive first."""
    v, last = a.chunk * P + p, P * V - 1
    if a.kind == "F":
        return [P2P(False, (v - 1) % P, Message("act", a.microbatch, v))] if v > 0 else []
    return [P2P(False, (v + 1) % P, Message("grad", a.microbatch, v))] if v < last else []


def action_sends(a: Action, P: int, V: int, p: int) -> list[P2P]:
    """What computation ``a`` of pipeline rank ``p`` produces for another rank."""
    v, last = a.chunk * P + p, P * V - 1
    if a.kind == "F":
        return [P2P(True, (v + 1) % P, Message("act", a.microbatch, v + 1))] if v < last else []
    return [P2P(True, (v - 1) % P, Message("grad", a.microbatch, v - 1))] if v > 0 else []


def p2p_program(slots: Sequence[Sequence[Action]], P: int, V: int, p: int) -> list[Item]:
    """Interleave the computations with the batches that feed them: before each slot one
    batch with the previous slot's sends and this slot's receives (Megatron's combined
    send/receive calls); after the last slot a batch with its sends."""
    items: list[Item] = []
    pending: list[P2P] = []
    for slot in slots:
        ops = pending + [r for a in slot for r in action_recvs(a, P, V, p)]
        if ops:
            items.append(Batch(tuple(ops)))
        items.extend(slot)
        pending = [s for a in slot for s in action_sends(a, P, V, p)]
    if pending:
        items.append(Batch(tuple(pending)))
    return items


def train_program(num_microbatches: int, P: int, V: int, p: int) -> list[Item]:
    """What :func:`run_forward_backward` executes on pipeline rank ``p``."""
    return p2p_program(schedule_slots(num_microbatches, P, V, p), P, V, p)


def eval_program(num_microbatches: int, P: int, V: int, p: int) -> list[Item]:
    """What :func:`run_forward_only` executes on pipeline rank ``p``."""
    return p2p_program(forward_only_slots(num_microbatches, V), P, V, p)


def simulate(num_microbatches: int, P: int, V: int, *, forward_only: bool = False) -> int:
    """Check the programs :func:`run_forward_backward` (or, with ``forward_only``,
    :func:`run_forward_only`) executes, under rendezvous sends; see :func:`simulate_programs`."""
    make = eval_program if forward_only else train_program
    progs = [make(num_microbatches, P, V, p) for p in range(P)]
    return simulate_programs(progs, P, V, what=f"M={num_microbatches} P={P} V={V}")


def _stream(item: Batch) -> tuple:
    return (item.channel,) + tuple(sorted({op.peer for op in item.ops}))


def simulate_programs(programs: Sequence[Sequence[Item]], P: int, V: int, *, buffered: bool = False,
                      what: str = "") -> int:
    """Replay one program per pipeline rank; return the number of rounds (each rank computes at
    most one action per round) or raise :class:`ScheduleError` on a deadlock, a computation
    without its input, a send of data not computed yet, or mismatched FIFO streams.

    Model (NCCL's, the strictest of our backends): a posted batch starts once the earlier
    batches of its stream (same channel and peers) on that rank are complete; an operation
    completes when it and its partner (the n-th send of a (channel, sender, receiver) stream
    pairs with the n-th receive) have both started — sends are unbuffered (rendezvous) unless
    ``buffered``, where a send completes on its own; a batch completes with all its operations;
    ``wait`` batches block the rank until then. A rank finishes when its program is done and
    all its batches have completed.
    """
    last = P * V - 1
    tag = f" ({what})" if what else ""
    # static FIFO matching: partner of every operation
    sends: dict[tuple, list] = defaultdict(list)
    recvs: dict[tuple, list] = defaultdict(list)
    for p, prog in enumerate(programs):
        for i, item in enumerate(prog):
            if isinstance(item, Batch):
                for op in item.ops:
                    if op.peer == p:
                        raise ScheduleError(f"rank {p} sends to itself{tag}")
                    key = (item.channel, p, op.peer) if op.send else (item.channel, op.peer, p)
                    (sends if op.send else recvs)[key].append((op.msg, (p, i)))
    partner: dict[tuple, tuple[int, int]] = {}
    for key in set(sends) | set(recvs):
        s, r = sends.get(key, []), recvs.get(key, [])
        if [m for m, _ in s] != [m for m, _ in r]:
            raise ScheduleError(f"send and receive orders differ on stream {key}{tag}: "
                                f"sent {[m for m, _ in s]}, received {[m for m, _ in r]}")
        for (m, su), (_, ru) in zip(s, r):
            partner[(su, m, True)] = ru
            partner[(ru, m, False)] = su

    pc = [0] * P
    blocked: list[Optional[tuple[int, int]]] = [None] * P
    started: set[tuple[int, int]] = set()
    complete: set[tuple[int, int]] = set()
    posted: list[list[tuple[int, int]]] = [[] for _ in range(P)]  # incomplete units per rank
    computed: list[set[tuple[str, int, int]]] = [set() for _ in range(P)]  # (kind, mb, virtual)
    received: list[set[Message]] = [set() for _ in range(P)]

    def item_of(u: tuple[int, int]) -> Batch:
        return programs[u[0]][u[1]]  # type: ignore[return-value]

    def settle() -> bool:
        """Start and complete batches until nothing changes; True when anything did."""
        changed_any = False
        changed = True
        while changed:
            changed = False
            for p in range(P):
                seen_streams: set[tuple] = set()
                for u in posted[p]:
                    st = _stream(item_of(u))
                    if u not in started and st not in seen_streams:
                        started.add(u)
                        changed = True
                    seen_streams.add(st)  # a later unit of this stream waits for this one
            for p in range(P):
                for u in list(posted[p]):
                    if u not in started:
                        continue
                    ok = True
                    for op in item_of(u).ops:
                        other = partner.get((u, op.msg, op.send))
                        if other is None:
                            raise ScheduleError(f"rank {p}: {op} has no partner{tag}")
                        if not (other in started or (buffered and op.send)):
                            ok = False
                            break
                    if ok:
                        posted[p].remove(u)
                        complete.add(u)
                        for op in item_of(u).ops:
                            if not op.send:
                                received[p].add(op.msg)
                        changed = True
            changed_any |= changed
        return changed_any

    rounds = 0
    while True:
        progressed = settle()
        for p in range(P):
            if blocked[p] is not None:
                if blocked[p] not in complete:
                    continue
                blocked[p] = None
                progressed = True
            did_compute = False
            while pc[p] < len(programs[p]):
                item = programs[p][pc[p]]
                if isinstance(item, Batch):
                    for op in item.ops:
                        if op.send:
                            m = op.msg
                            src = ("F", m.microbatch, m.virtual - 1) if m.kind == "act" else \
                                ("B", m.microbatch, m.virtual + 1)
                            if src not in computed[p]:
                                raise ScheduleError(f"rank {p} sends {m} before computing it{tag}")
                    u = (p, pc[p])
                    posted[p].append(u)
                    pc[p] += 1
                    progressed = True
                    if item.wait:
                        blocked[p] = u
                        break
                    continue
                if did_compute:
                    break
                a = item
                v = a.chunk * P + p
                if a.kind == "F":
                    if v > 0 and Message("act", a.microbatch, v) not in received[p]:
                        raise ScheduleError(f"rank {p}: forward of micro-batch {a.microbatch} at virtual stage "
                                            f"{v} runs before its input arrived{tag}")
                else:
                    if ("F", a.microbatch, v) not in computed[p]:
                        raise ScheduleError(f"rank {p}: backward of micro-batch {a.microbatch} at virtual "
                                            f"stage {v} before its forward{tag}")
                    if v < last and Message("grad", a.microbatch, v) not in received[p]:
                        raise ScheduleError(f"rank {p}: backward of micro-batch {a.microbatch} at virtual "
                                            f"stage {v} runs before its output gradient arrived{tag}")
                computed[p].add((a.kind, a.microbatch, v))
                pc[p] += 1
                did_compute = True
                progressed = True
        settle()
        rounds += 1
        if all(pc[p] == len(programs[p]) and not posted[p] for p in range(P)):
            return rounds
        if not progressed:
            where = {p: (str(programs[p][pc[p] - 1]) if blocked[p] is not None else
                         (str(programs[p][pc[p]]) if pc[p] < len(programs[p]) else "end"))
                     for p in range(P)}
            raise ScheduleError(f"deadlock{tag}: ranks wait at {where}")


# --------------------------------------------------------------------------- channels


class PipeChannels:
    """One process group per pipeline group for the schedule's point-to-point messages
    (``batch_isend_irecv`` needs all operations of a batch in one group).

    Built collectively on every rank of the world (``new_group`` is collective), once per
    trainer. A one-element all-reduce over the new group follows: with NCCL, the first call on
    a group must involve all its ranks (a batch of p2p operations involves two or three), so
    the group's communicator is set up here, on every member at once. With one pipeline stage
    nothing is created.
    """

    def __init__(self, pg: ParallelGroups) -> None:
        self.pg = pg
        self.group: Optional[dist.ProcessGroup] = None
        if pg.pp_size == 1 or not dist.is_initialized():
            return
        kinds = layout_ranks(pg.world_size, pg.tp_size, pg.dp_size, pg.pp_size)
        for members in kinds["pp"]:
            grp = dist.new_group(members)
            if pg.rank in members:
                self.group = grp
        from .comm import bookkeeping_device
        warm = torch.zeros(1, device=bookkeeping_device(self.group))
        dist.all_reduce(warm, group=self.group)  # communicator set-up (bookkeeping, not counted)


# --------------------------------------------------------------------------- execution


@dataclass
class ScheduleSpec:
    """What the schedule needs to know besides the stages."""
    activation_shape: tuple[int, ...]  # [s or s/T, micro_batch, hidden]
    comm_dtype: torch.dtype
    device: torch.device


def release_storage(t: torch.Tensor) -> bool:
    """Free the values of an activation whose autograd node is all the backward needs
    (Megatron's ``deallocate_output_tensor``); the tensor keeps its ``grad_fn``. Returns False
    (and keeps it) when ``t`` is a view, whose storage belongs to another tensor."""
    if t._base is not None or t.numel() <= 1:
        return False
    t.data = torch.empty((1,), dtype=t.dtype, device=t.device)
    return True


def backward_from(out: torch.Tensor, grad: torch.Tensor) -> None:
    """Backward from ``out`` with incoming gradient ``grad``, also after ``out``'s values were
    released: through its gradient edge, whose recorded shape is the original one."""
    torch.autograd.backward(torch.autograd.graph.get_gradient_edge(out), grad_tensors=grad)


class _Runner:
    def __init__(self, stages: Sequence[torch.nn.Module], pg: ParallelGroups, channels: PipeChannels,
                 spec: ScheduleSpec) -> None:
        self.stages = list(stages)
        self.pg = pg
        self.ch = channels
        self.spec = spec
        self.P = pg.pp_size
        self.V = len(self.stages)
        self.p = pg.pp_rank
        self.outbox: dict[Message, torch.Tensor] = {}  # tensors to send, by message
        self.inbox: dict[Message, torch.Tensor] = {}  # received tensors, by message
        self.released: list[torch.Tensor] = []  # sent activations to free once the batch is done

    def virtual(self, chunk: int) -> int:
        return chunk * self.P + self.p

    def is_first(self, chunk: int) -> bool:
        return self.virtual(chunk) == 0

    def is_last(self, chunk: int) -> bool:
        return self.virtual(chunk) == self.P * self.V - 1

    def post(self, msg: Message, t: torch.Tensor, release: Optional[torch.Tensor] = None) -> None:
        """Queue ``t`` for the next batch; ``release``: free that activation once sent."""
        self.outbox[msg] = t.detach().to(self.spec.comm_dtype).contiguous()
        if release is not None:
            self.released.append(release)

    def exchange(self, batch: Batch) -> None:
        ops = []
        for op in batch.ops:
            peer = self.pg.pp_ranks[op.peer]
            if op.send:
                ops.append((True, self.outbox[op.msg], peer))
            else:
                buf = torch.empty(self.spec.activation_shape, dtype=self.spec.comm_dtype, device=self.spec.device)
                self.inbox[op.msg] = buf
                ops.append((False, buf, peer))
        for work in self.pg.comm.batch_isend_irecv(ops, self.ch.group, "pp"):
            work.wait()
        for op in batch.ops:
            if op.send:
                del self.outbox[op.msg]
        for t in self.released:
            release_storage(t)
        self.released.clear()


def run_forward_backward(stages: Sequence[torch.nn.Module], micro_batches: Sequence[Any], pg: ParallelGroups,
                         channels: PipeChannels, spec: ScheduleSpec, *,
                         stage_input: Callable[[Any], torch.Tensor],
                         stage_labels: Callable[[Any], torch.Tensor],
                         loss_fn: Callable[[torch.Tensor, Any], torch.Tensor],
                         autocast: Callable[[], Any] = nullcontext) -> None:
    """One training step's forwards and backwards (1F1B, interleaved when len(stages) > 1).

    ``loss_fn(per_token_loss [b, s], micro_batch) -> scalar`` runs on the last virtual stage and
    returns the (scaled) value to differentiate; gradients accumulate in ``param.grad``.
    """
    run = _Runner(stages, pg, channels, spec)
    P, V, p = run.P, run.V, run.p
    inputs: dict[tuple[int, int], torch.Tensor] = {}
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    for item in train_program(len(micro_batches), P, V, p):
        if isinstance(item, Batch):
            run.exchange(item)
            continue
        a = item
        key = (a.microbatch, a.chunk)
        v = run.virtual(a.chunk)
        mb = micro_batches[a.microbatch]
        stage = run.stages[a.chunk]
        if a.kind == "F":
            if run.is_first(a.chunk):
                x = stage_input(mb)
            else:
                x = run.inbox.pop(Message("act", a.microbatch, v)).requires_grad_()
                inputs[key] = x
            with autocast():
                if run.is_last(a.chunk):
                    out = loss_fn(stage(x, stage_labels(mb)), mb)
                else:
                    out = stage(x)
            outputs[key] = out
            if not run.is_last(a.chunk):
                run.post(Message("act", a.microbatch, v + 1), out, release=out)
        else:
            out = outputs.pop(key)
            if run.is_last(a.chunk):
                torch.autograd.backward(out)
            else:
                grad = run.inbox.pop(Message("grad", a.microbatch, v))
                backward_from(out, grad.to(out.dtype))
            del out
            if not run.is_first(a.chunk):
                x = inputs.pop(key)
                run.post(Message("grad", a.microbatch, v - 1), x.grad)
    if run.outbox or run.inbox:
        raise RuntimeError(f"pipeline rank {p}: messages left after the step "
                           f"(unsent {sorted(map(str, run.outbox))}, unused {sorted(map(str, run.inbox))})")


@torch.no_grad()
def run_forward_only(stages: Sequence[torch.nn.Module], micro_batches: Sequence[Any], pg: ParallelGroups,
                     channels: PipeChannels, spec: ScheduleSpec, *,
                     stage_input: Callable[[Any], torch.Tensor],
                     stage_labels: Callable[[Any], torch.Tensor],
                     loss_fn: Callable[[torch.Tensor, Any], Any],
                     autocast: Callable[[], Any] = nullcontext) -> None:
    """Forward passes only (evaluation): micro-batch by micro-batch, chunk by chunk, with the
    same batched exchanges as training (``simulate(..., forward_only=True)`` checks them)."""
    run = _Runner(stages, pg, channels, spec)
    P, V, p = run.P, run.V, run.p
    for item in eval_program(len(micro_batches), P, V, p):
        if isinstance(item, Batch):
            run.exchange(item)
            continue
        c, mb = item.chunk, micro_batches[item.microbatch]
        v = run.virtual(c)
        stage = run.stages[c]
        x = stage_input(mb) if run.is_first(c) else run.inbox.pop(Message("act", item.microbatch, v))
        with autocast():
            if run.is_last(c):
                loss_fn(stage(x, stage_labels(mb)), mb)
            else:
                run.post(Message("act", item.microbatch, v + 1), stage(x))
