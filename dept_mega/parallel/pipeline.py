"""Pipeline schedules: 1F1B and interleaved 1F1B over this rank's stage chunks.

Layout: with P pipeline ranks and V chunks per rank (``parallel.virtual_pipeline``), chunk c
of pipeline rank p is virtual stage ``v = c·P + p`` (layer block v of P·V). Virtual stage 0
embeds tokens, virtual stage P·V−1 returns per-token losses.

Communication is point-to-point through ``pg.comm`` (category ``pp``): a rank posts its sends
asynchronously (``isend``; the tensors are kept alive until the step ends) and receives with
a blocking ``recv`` right before the computation that needs the data. Activations and
gradients travel on two separate process groups with the same members as the pipeline group
(:class:`PipeChannels`), so that each (sender, receiver, direction) is a FIFO stream whose
send order equals the receive order on every backend (NCCL ignores tags). Shapes are known in
advance (``[s, b, h]``, or ``[s/T, b, h]`` under sequence parallelism), so nothing but the
payload is exchanged.

Order of work (Megatron's schedules): a rank first runs ``warmup`` forwards, then alternates
one forward and one backward, then drains the remaining backwards. Forward number k (0-based)
of a rank runs chunk ``(k // P) % V`` on micro-batch ``(k // (P·V))·P + k % P``; backward
number k runs chunk ``V − 1 − (k // P) % V`` on the same micro-batch. With V = 1 this is plain
1F1B with ``warmup = P − p − 1``; with V > 1, ``warmup = 2(P − p − 1) + (V − 1)·P`` and the
number of micro-batches must be a multiple of P. :func:`simulate` replays the action lists of
all ranks with blocking receives and proves the order is free of deadlock (used by tests).
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

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


def schedule_actions(num_microbatches: int, P: int, V: int, p: int) -> list[Action]:
    """The ordered forward/backward actions of pipeline rank ``p`` for one training step."""
    check_microbatches(num_microbatches, P, V)
    total = num_microbatches * V
    if V == 1:
        warmup = min(P - p - 1, total)
    else:
        warmup = min(2 * (P - p - 1) + (V - 1) * P, total)
    acts: list[Action] = []
    f = b = 0

    def fwd() -> None:
        nonlocal f
        mb, c = forward_position(f, P, V)
        acts.append(Action("F", mb, c))
        f += 1

    def bwd() -> None:
        nonlocal b
        mb, c = backward_position(b, P, V)
        acts.append(Action("B", mb, c))
        b += 1

    for _ in range(warmup):
        fwd()
    for _ in range(total - warmup):
        fwd()
        bwd()
    while b < total:
        bwd()
    return acts


def simulate(num_microbatches: int, P: int, V: int) -> int:
    """Replay every rank's actions with asynchronous sends and blocking receives; return the
    number of rounds needed, or raise ScheduleError on a deadlock or a wrong dependency."""
    lists = [schedule_actions(num_microbatches, P, V, p) for p in range(P)]
    pos = [0] * P
    done: set[tuple[str, int, int]] = set()  # (kind, microbatch, virtual stage)
    last = P * V - 1
    rounds = 0
    while any(pos[p] < len(lists[p]) for p in range(P)):
        progressed = False
        for p in range(P):
            if pos[p] >= len(lists[p]):
                continue
            a = lists[p][pos[p]]
            v = a.chunk * P + p
            if a.kind == "F":
                ready = v == 0 or ("F", a.microbatch, v - 1) in done
            else:
                ready = ("F", a.microbatch, v) in done and (v == last or ("B", a.microbatch, v + 1) in done)
            if ready:
                done.add((a.kind, a.microbatch, v))
                pos[p] += 1
                progressed = True
        rounds += 1
        if not progressed:
            raise ScheduleError(f"deadlock: M={num_microbatches} P={P} V={V} at positions {pos}")
    _check_fifo(lists, P, V)
    return rounds


def _check_fifo(lists: list[list[Action]], P: int, V: int) -> None:
    """On each (channel, sender, receiver) stream the send order must equal the receive order,
    since receives match messages first-in first-out."""
    last = P * V - 1
    sends: dict[tuple[str, int, int], list[tuple[int, int]]] = {}
    recvs: dict[tuple[str, int, int], list[tuple[int, int]]] = {}
    for p, acts in enumerate(lists):
        for a in acts:
            v = a.chunk * P + p
            if a.kind == "F":
                if v > 0:
                    recvs.setdefault(("F", (v - 1) % P, p), []).append((a.microbatch, v))
                if v < last:
                    sends.setdefault(("F", p, (v + 1) % P), []).append((a.microbatch, v + 1))
            else:
                if v < last:
                    recvs.setdefault(("B", (v + 1) % P, p), []).append((a.microbatch, v))
                if v > 0:
                    sends.setdefault(("B", p, (v - 1) % P), []).append((a.microbatch, v - 1))
    if sends != recvs:
        raise ScheduleError(f"send and receive orders differ for P={P} V={V}")


# --------------------------------------------------------------------------- channels


class PipeChannels:
    """Two process groups per pipeline group (activations forward, gradients backward).

    Built collectively on every rank of the world (``new_group`` is collective), once per
    trainer. With one pipeline stage nothing is created.
    """

    def __init__(self, pg: ParallelGroups) -> None:
        self.pg = pg
        self.forward: Optional[dist.ProcessGroup] = None
        self.backward: Optional[dist.ProcessGroup] = None
        if pg.pp_size == 1 or not dist.is_initialized():
            return
        kinds = layout_ranks(pg.world_size, pg.tp_size, pg.dp_size, pg.pp_size)
        for members in kinds["pp"]:
            fwd = dist.new_group(members)
            bwd = dist.new_group(members)
            if pg.rank in members:
                self.forward, self.backward = fwd, bwd


# --------------------------------------------------------------------------- execution


@dataclass
class ScheduleSpec:
    """What the schedule needs to know besides the stages."""
    activation_shape: tuple[int, ...]  # [s or s/T, micro_batch, hidden]
    comm_dtype: torch.dtype
    device: torch.device


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
        self.pending: list[tuple[Any, torch.Tensor]] = []

    # virtual-stage neighbours -----------------------------------------------------------
    def virtual(self, chunk: int) -> int:
        return chunk * self.P + self.p

    def rank_of_virtual(self, v: int) -> int:
        return self.pg.pp_ranks[v % self.P]

    def is_first(self, chunk: int) -> bool:
        return self.virtual(chunk) == 0

    def is_last(self, chunk: int) -> bool:
        return self.virtual(chunk) == self.P * self.V - 1

    # p2p ---------------------------------------------------------------------------------
    def send(self, t: torch.Tensor, v_dst: int, group) -> None:
        t = t.detach().to(self.spec.comm_dtype).contiguous()
        work = self.pg.comm.isend(t, self.rank_of_virtual(v_dst), "pp", group=group)
        self.pending.append((work, t))

    def recv(self, v_src: int, group) -> torch.Tensor:
        buf = torch.empty(self.spec.activation_shape, dtype=self.spec.comm_dtype, device=self.spec.device)
        self.pg.comm.recv(buf, self.rank_of_virtual(v_src), group=group)
        return buf

    def wait_all(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


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
    P, V = run.P, run.V
    M = len(micro_batches)
    inputs: dict[tuple[int, int], torch.Tensor] = {}
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    for a in schedule_actions(M, P, V, run.p):
        key = (a.microbatch, a.chunk)
        v = run.virtual(a.chunk)
        mb = micro_batches[a.microbatch]
        stage = run.stages[a.chunk]
        if a.kind == "F":
            if run.is_first(a.chunk):
                x = stage_input(mb)
            else:
                x = run.recv(v - 1, channels.forward).requires_grad_()
                inputs[key] = x
            with autocast():
                if run.is_last(a.chunk):
                    out = loss_fn(stage(x, stage_labels(mb)), mb)
                else:
                    out = stage(x)
            outputs[key] = out
            if not run.is_last(a.chunk):
                run.send(out, v + 1, channels.forward)
        else:
            out = outputs.pop(key)
            if run.is_last(a.chunk):
                torch.autograd.backward(out)
            else:
                grad = run.recv(v + 1, channels.backward)
                torch.autograd.backward(out, grad.to(out.dtype))
            if not run.is_first(a.chunk):
                x = inputs.pop(key)
                run.send(x.grad, v - 1, channels.backward)
    run.wait_all()


@torch.no_grad()
def run_forward_only(stages: Sequence[torch.nn.Module], micro_batches: Sequence[Any], pg: ParallelGroups,
                     channels: PipeChannels, spec: ScheduleSpec, *,
                     stage_input: Callable[[Any], torch.Tensor],
                     stage_labels: Callable[[Any], torch.Tensor],
                     loss_fn: Callable[[torch.Tensor, Any], Any],
                     autocast: Callable[[], Any] = nullcontext) -> None:
    """Forward passes only (evaluation): micro-batch by micro-batch, chunk by chunk.

    Every dependency points to an earlier (micro-batch, virtual stage) pair and sends are
    asynchronous, so this order cannot deadlock.
    """
    run = _Runner(stages, pg, channels, spec)
    for mb in micro_batches:
        for c, stage in enumerate(run.stages):
            v = run.virtual(c)
            x = stage_input(mb) if run.is_first(c) else run.recv(v - 1, channels.forward)
            with autocast():
                if run.is_last(c):
                    loss_fn(stage(x, stage_labels(mb)), mb)
                else:
                    run.send(stage(x), v + 1, channels.forward)
    run.wait_all()
