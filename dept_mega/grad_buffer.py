"""Contiguous gradient buffers with data-parallel buckets, reduced during backward.

Megatron's DDP idea, on plain modules: every parameter an optimizer owns gets a view
``param.main_grad`` into one flat buffer (``optim.grad_dtype``, fp32 by default). A hook that
runs after autograd has accumulated a micro-batch's gradient into ``param.grad``
(``register_post_accumulate_grad_hook``) adds it into ``main_grad`` and frees ``param.grad``,
so half-precision weights accumulate their gradients in fp32. With
``optim.grad_accum_fusion`` the weights of our linear layers skip ``param.grad`` altogether:
their weight-gradient GEMM accumulates straight into ``main_grad`` (``parallel/wgrad.py``),
and the FP8 linear's backward hands its weight gradient to :meth:`GradBuffer.add_grad` itself
(the hook's copy-then-add, ``parallel/fp8.py``; traced into a compiled block, ``fp8_traced.py``,
it returns the gradient to autograd and the hook). All paths go through
:meth:`GradBuffer.arrive`, which does the step's bookkeeping.

The buffer is laid out in reverse parameter order (roughly the order backward produces the
gradients) and cut into buckets of about ``optim.grad_bucket_size`` elements. A bucket is
*final* when each of its parameters has received its expected number of accumulations this
step (one per micro-batch for every model chunk of this rank that holds it; the trainer says
how many), that is during the last micro-batch's backward of its chunk. With
``optim.overlap_grad_reduce`` the bucket's data-parallel reduction is then launched
asynchronously (all-reduce; reduce-scatter into this rank's shard with the distributed
optimizer). Buckets are launched in one fixed order (:class:`GradSync` keeps the order over
all buffers of a step) so every data-parallel rank issues the same sequence of collectives;
a bucket that becomes final before its predecessors waits for them. ``finish()`` launches
whatever is left (everything, when overlap is off: the blocking path) and waits. Both paths
run the same collectives on the same buckets, so their results and byte counts are identical.

A gradient arriving for a bucket whose reduction has started is an error (it would be lost),
not a silent race. With the distributed optimizer every bucket is padded to a multiple of
the data-parallel size and sharded evenly; parameters listed as ``isolate`` (the tied word
embedding under pipeline parallelism) get a bucket of their own, so that the first and last
stage shard that parameter identically and can all-reduce their shards over ``pg.embedding``.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from .parallel.comm import group_size
from .parallel.wgrad import grad_owner, set_grad_owner


@dataclass
class Bucket:
    start: int  # [start, end) in the buffer, padded: (end - start) % shards == 0
    end: int
    params: list[torch.nn.Parameter]
    pending: int = 0  # accumulations still expected this step
    launched: bool = False
    work: Any = None
    shard_out: Optional[torch.Tensor] = None  # reduce-scatter output (distributed)

    @property
    def numel(self) -> int:
        return self.end - self.start

    def shard_range(self, rank: int, shards: int) -> tuple[int, int]:
        """This data-parallel rank's [start, end) of the bucket, in buffer coordinates."""
        n = self.numel // shards
        return self.start + rank * n, self.start + (rank + 1) * n


def _grad_hook(p: torch.Tensor) -> None:
    # autograd runs the hook also when a fused or FP8 linear's backward put the gradient into
    # main_grad itself and returned none: then there is nothing to move (what accumulate would
    # find too), and the owner's lookup is skipped (three Python calls per weight and micro-batch)
    if p.grad is None:
        return
    owner = grad_owner(p)
    if owner is not None:
        owner.accumulate(p)


class GradBuffer:
    """``main_grad`` storage for ``params`` (see module doc). ``shards``: the data-parallel
    size when the buckets are reduce-scattered (distributed optimizer), else 1."""

    def __init__(self, params: Sequence[torch.nn.Parameter], dtype: torch.dtype, device: torch.device,
                 bucket_size: int, shards: int = 1, isolate: frozenset[int] = frozenset(),
                 names: Optional[dict[int, str]] = None) -> None:
        self.params = list(params)
        self.dtype = dtype
        self.device = torch.device(device)
        self.shards = max(1, int(shards))
        self.names = names or {}
        self.ranges: dict[int, tuple[int, int]] = {}
        self.bucket_of: dict[int, Bucket] = {}
        self.buckets: list[Bucket] = []
        self._optimizer: Optional[weakref.ref] = None
        offset = 0
        current: list[torch.nn.Parameter] = []
        start = 0

        def close() -> None:
            nonlocal current, start, offset
            if not current:
                return
            pad = (-(offset - start)) % self.shards
            offset += pad
            b = Bucket(start, offset, current)
            self.buckets.append(b)
            for q in current:
                self.bucket_of[id(q)] = b
            current, start = [], offset

        for p in reversed(self.params):
            n = p.numel()
            alone = id(p) in isolate
            if current and (alone or offset - start + n > bucket_size):
                close()
            self.ranges[id(p)] = (offset, offset + n)
            current.append(p)
            offset += n
            if alone:
                close()
        close()
        self.numel = offset
        self.data: Optional[torch.Tensor] = None
        self.counts: dict[int, int] = {}
        self.sync: Optional["GradSync"] = None

    # -- ownership and storage ------------------------------------------------------------
    # Parameters and the buffer refer to each other only through weak references, so that a
    # trainer is freed as soon as it is dropped: kept alive by a reference cycle until the
    # interpreter shuts down, its process groups would be torn down at exit (gloo aborts).
    @property
    def optimizer(self):
        return self._optimizer() if self._optimizer is not None else None

    @optimizer.setter
    def optimizer(self, opt) -> None:
        self._optimizer = weakref.ref(opt)

    def adopt(self) -> None:
        """Make this buffer the destination of its parameters' gradients (a parameter has one
        owner at a time: a newer optimizer over the same parameters takes them over)."""
        for p in self.params:
            set_grad_owner(p, self)
            if not getattr(p, "_grad_hook_registered", False):
                p.register_post_accumulate_grad_hook(_grad_hook)
                p._grad_hook_registered = True

    def owns(self, p: torch.nn.Parameter) -> bool:
        return grad_owner(p) is self

    def allocate(self) -> None:
        if self.data is None:
            self.data = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
            for p in self.params:
                s, e = self.ranges[id(p)]
                p.main_grad = self.data[s:e].view_as(p)
        else:
            self.data.zero_()

    def release(self) -> None:
        """Free the storage (an optimizer that is not installed: SPEC's stored sources)."""
        self.data = None
        for p in self.params:
            if self.owns(p) and hasattr(p, "main_grad"):
                del p.main_grad

    def view(self, start: int, end: int) -> torch.Tensor:
        return self.data[start:end]

    # -- one step ---------------------------------------------------------------------------
    def begin(self, expected: dict[int, int], sync: Optional["GradSync"]) -> None:
        self.allocate()
        self.sync = sync
        self.counts = {id(p): 0 for p in self.params}
        for b in self.buckets:
            b.pending = sum(expected.get(id(p), 0) for p in b.params)
            b.launched, b.work, b.shard_out = False, None, None

    @property
    def active(self) -> bool:
        """Inside a training step: the storage is allocated and a :class:`GradSync` has begun."""
        return self.data is not None and self.sync is not None

    def accumulate(self, p: torch.nn.Parameter) -> None:
        """The post-accumulate-grad hook's path: move autograd's ``p.grad`` into ``main_grad``."""
        if not self.active:
            return  # outside a training step: autograd's plain ``param.grad`` is left as it is
        g = p.grad
        if g is None:
            return  # autograd runs the hook also when a fused linear's backward returned no gradient
        self.add_grad(p, g)
        p.grad = None

    def add_grad(self, p: torch.nn.Parameter, g: torch.Tensor) -> None:
        """One micro-batch's gradient ``g`` of ``p`` into ``main_grad``: the step's first is
        copied (exactly its gradient, as autograd keeps it), the others added. The hook's path,
        and the FP8 linear's backward, which hands its weight gradient here itself
        (``parallel/fp8.py``) rather than through ``p.grad`` and the hook: the same operations
        on the same tensors, less host work."""
        first = self.counts[id(p)] == 0
        self.arrive(p, (lambda mg: mg.copy_(g)) if first else (lambda mg: mg.add_(g)))

    def is_first(self, p: torch.nn.Parameter) -> bool:
        """Whether ``p``'s next gradient is the step's first: ``main_grad`` then holds the zeros of
        :meth:`begin`, which a GEMM may overwrite (beta = 0, ``parallel/fp8_gemm.py``) rather than add to."""
        return self.counts[id(p)] == 0

    def arrive(self, p: torch.nn.Parameter, add: Callable[[torch.Tensor], Any]) -> None:
        """One micro-batch's gradient of ``p`` arrives: ``add(p.main_grad)`` adds it into the
        buffer (the hook's copy/add, or a linear layer's weight-gradient GEMM accumulating in
        place, ``parallel/wgrad.py``), then the step's bookkeeping: the count, the bucket's
        pending accumulations and, when the bucket is final, :meth:`GradSync.bucket_final`
        (which may launch its data-parallel reduction). Call only while :attr:`active`.
        ``add`` runs without autograd recording: backward passes run with gradients off (a
        ``no_grad`` context only where they are on, ``create_graph``: entering one costs ~2 µs
        of host time per call)."""
        b = self.bucket_of[id(p)]
        if b.launched:
            raise RuntimeError(f"gradient of {self.names.get(id(p), 'a parameter')} arrived after its bucket's "
                               f"data-parallel reduction started: the parameter received more gradient "
                               f"accumulations this step than the trainer expected")
        if torch.is_grad_enabled():
            with torch.no_grad():
                add(p.main_grad)
        else:
            add(p.main_grad)
        self.counts[id(p)] += 1
        b.pending -= 1
        if b.pending == 0:
            self.sync.bucket_final(self, b)

    def launch(self, b: Bucket, pg) -> None:
        flat = self.data[b.start:b.end]
        if self.shards > 1:
            a, e = b.shard_range(pg.dp_rank, self.shards)
            b.shard_out = torch.empty(e - a, dtype=flat.dtype, device=flat.device)
            b.work = pg.comm.reduce_scatter_into(b.shard_out, flat, pg.dp, "dp", async_op=True)
        else:
            b.work = pg.comm.all_reduce(flat, pg.dp, "dp", async_op=True)
        b.launched = True

    def complete(self, b: Bucket, pg) -> None:
        b.work.wait()
        if b.shard_out is not None:
            a, e = b.shard_range(pg.dp_rank, self.shards)
            self.data[a:e].copy_(b.shard_out)
        b.work, b.shard_out = None, None


@dataclass
class GradSync:
    """The buckets of one step over several buffers, launched in one fixed order."""
    pg: Any
    overlap: bool
    order: list[tuple[GradBuffer, Bucket]] = field(default_factory=list)
    next: int = 0
    final: set[int] = field(default_factory=set)
    active: bool = False
    buffers: list[GradBuffer] = field(default_factory=list)
    reduce: bool = False
    launched_during_backward: int = 0  # buckets launched before finish() this step (overlap at work)

    def begin(self, buffers: Sequence[GradBuffer], expected: dict[int, int]) -> None:
        self.buffers = list(buffers)
        self.order = [(buf, b) for buf in buffers for b in buf.buckets]
        self.next = 0
        self.final = set()
        self.launched_during_backward = 0
        self.reduce = group_size(self.pg.dp) > 1
        for buf in buffers:
            buf.begin(expected, self)
        self.active = True
        for buf, b in self.order:  # buckets that expect nothing this step (e.g. no gradient at all)
            if b.pending == 0:
                self.bucket_final(buf, b)

    def bucket_final(self, buf: GradBuffer, b: Bucket) -> None:
        self.final.add(id(b))
        if self.overlap:
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self.next < len(self.order) and id(self.order[self.next][1]) in self.final:
            self._launch(*self.order[self.next])
            self.launched_during_backward += 1

    def _launch(self, buf: GradBuffer, b: Bucket) -> None:
        if self.reduce:
            buf.launch(b, self.pg)
        else:
            b.launched = True
        self.next += 1

    def finish(self) -> None:
        """Launch what is left (in order) and wait for every bucket."""
        if not self.active:
            raise RuntimeError("GradSync.finish() without begin()")
        while self.next < len(self.order):
            self._launch(*self.order[self.next])
        for buf, b in self.order:
            if b.work is not None:
                buf.complete(b, self.pg)
        for buf in self.buffers:
            buf.sync = None
        self.active = False
