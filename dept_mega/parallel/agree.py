"""Small bookkeeping collectives that make every rank take the same decision: gather a short
text from every rank (a checkpoint problem, a start-up error) without pickling anything.

Like the loop's scalar reductions these use ``torch.distributed`` directly and are not counted
by :class:`~dept_mega.parallel.comm.Comm`: a few bytes at start-up or per checkpoint, no part of
the algorithm's traffic. Without ``torch.distributed`` (one process) they are local.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_max(values: list[int], device: Optional[torch.device] = None) -> list[int]:
    """Each of ``values`` maxed over every rank (one all-reduce MAX of int64s on ``device``, the
    rank's CUDA device under NCCL): a flag any rank raised (a signal, a deadline passed, a failed
    quorum) becomes every rank's, so that all take the same branch. Local in one process."""
    if not _distributed():
        return [int(v) for v in values]
    t = torch.tensor([int(v) for v in values], dtype=torch.int64, device=device or torch.device("cpu"))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [int(v) for v in t.tolist()]


def all_gather_text(text: str, device: Optional[torch.device] = None) -> list[str]:
    """Every rank's ``text``, in rank order, on every rank (UTF-8 bytes in uint8 tensors; the
    tensors live on ``device``, which must be the rank's CUDA device under NCCL)."""
    if not _distributed():
        return [text]
    device = device or torch.device("cpu")
    world = dist.get_world_size()
    data = torch.tensor(list(text.encode("utf-8")), dtype=torch.uint8)
    n = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(lengths, n)
    sizes = [int(x.item()) for x in lengths]
    width = max(max(sizes), 1)
    mine = torch.zeros(width, dtype=torch.uint8, device=device)
    mine[:data.numel()] = data.to(device)
    out = [torch.zeros(width, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(out, mine)
    return [bytes(t[:k].cpu().tolist()).decode("utf-8") for t, k in zip(out, sizes)]


def first_problem(problem: Optional[str], device: Optional[torch.device] = None) -> Optional[str]:
    """The first non-empty ``problem`` in rank order, the same on every rank (None: no rank
    had one)."""
    for text in all_gather_text(problem or "", device):
        if text:
            return text
    return None


# ------------------------------------------------------------------ errors every rank shares

def mark_agreed(exc: BaseException) -> BaseException:
    """Mark ``exc`` as the same error on every rank of the job (it came out of an agreement such
    as :func:`first_problem`): the entry point prints its ``error:`` line once, on rank 0
    (:func:`dept_mega.process_exit.report_error`). Returns ``exc``: ``raise mark_agreed(E(...))``."""
    exc.dept_mega_agreed = True
    return exc


def is_agreed(exc: BaseException) -> bool:
    return bool(getattr(exc, "dept_mega_agreed", False))


def agree_errors(fn: Callable[[], Any], errors: tuple[type[BaseException], ...],
                 device: Optional[torch.device] = None) -> Any:
    """Run ``fn`` on every rank (it must make no collective call) and return its result; when
    any rank raised one of ``errors`` (each built from one message), every rank raises the lowest
    such rank's error, of its type, marked :func:`mark_agreed`: one ``error:`` line for the job
    whether the problem is every rank's (a config check) or one rank's (a file only its node
    lacks). One small gather; nothing without ``torch.distributed``.

    Any other exception (a bug, an unreadable file's ``OSError``) still takes part in the
    gather, so that no rank waits in it for one that left: that rank raises its own, unmarked
    (its traceback, its ``[rank R]`` line); a rank without one of its own whose lowest failing
    rank had such an error raises a ``RuntimeError`` naming that rank and its error."""
    own, problem = None, ""
    try:
        result = fn()
    except errors as exc:
        own, result = exc, None
        kind = next(i for i, e in enumerate(errors) if isinstance(exc, e))
        problem = f"{kind}:{exc}"
    except Exception as exc:  # noqa: BLE001 - raised below, after the gather the other ranks wait in
        own, result = exc, None
        problem = f"-1:{type(exc).__name__}: {exc}"
    texts = all_gather_text(problem, device)
    if own is not None and not isinstance(own, errors):
        raise own
    failed = next((r for r, t in enumerate(texts) if t), None)
    if failed is None:
        return result
    first = texts[failed]
    if first == problem:
        raise mark_agreed(own)
    kind, _, message = first.partition(":")
    if int(kind) < 0:
        raise RuntimeError(f"rank {failed} failed where every rank checks the same inputs: {message} "
                           f"(its traceback is in rank {failed}'s output)")
    raise mark_agreed(errors[int(kind)](message))
