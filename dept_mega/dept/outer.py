"""The synchronisation of a flat parameter buffer across groups (:class:`FlatSync`); the
outer optimizers it steps (pseudo-gradient Δ = θ_{t-1} − θ_local, averaged over the G groups)
are in outer_optimizer.py.

All state and the update are fp32. The parameters a :class:`FlatSync` owns (this rank's TP/PP
shard, in order, flattened) are split into D near-equal chunks, one per data-parallel replica
of the group (the D replicas hold identical parameters). **Lean state**: a rank keeps θ_{t-1}
and the outer optimizer's state for *its chunk only* (1/D of the shard), on the parameters'
device or, with ``dept.outer_state_device: cpu``, in CPU memory (pinned when CUDA is
available). At a round's end (:meth:`FlatSync.sync` = :meth:`launch` + :meth:`finish`):

1. Δ = θ_{t-1} − θ_local of this rank's chunk (fp32; θ_local read chunk-wise from the
   parameters);
2. across groups, over ``pg.outer`` (category ``outer_body`` / ``outer_embedding``):
   fp32 / bf16: all-reduce of the chunk in that dtype, divided by G; fp8 / int8 / int4
   (quant.py): every rank quantises its chunk block-wise, the G packed chunks (payload +
   scales) are **all-gathered**, and every rank dequantises and sums them in fp32 in group
   order, divided by G — partial sums are never re-quantised; with
   ``dept.outer_error_feedback`` each rank adds its last quantisation residual to Δ before
   quantising and keeps the new residual (chunk-sized, fp32);
3. the outer optimizer updates the chunk of θ in place (θ_{t-1} becomes θ_t), slice by slice
   so that its temporaries stay small;
4. all-gather of the updated chunks over ``pg.dp`` (fp32, category ``dp``; equal parts, so a
   chunk one value shorter than the longest is padded) into one buffer of the shard, copied
   into the parameters (the only full-shard temporary of the sync).

Overlapped sync (Streaming DiLoCo, Douillard et al. 2025, arXiv:2501.18512, §2.3): step 2 is
launched asynchronously and the group keeps training; when the result is applied τ inner
steps later, the parameters become θ_t + (θ_local_now − θ_local_at_launch), computed as
θ_local_now + (θ_t − θ_local_at_launch) (``finish(correct=True)``); θ_t stays the reference
θ_{t-1} of the next round. A sync with ``correct=False`` writes θ_t exactly (the blocking
sync, bit-identical to applying it at once).

Eager start (``dept.outer_overlap_rule: eager``, :meth:`FlatSync.enable_eager`; after the
eager updates of Kale et al. 2025, arXiv:2502.12996): the τ overlapped inner steps start not
from θ_local but from an estimate of θ_t made at launch without waiting. The mean Δ̄_t is
estimated by this group's fresh share plus the other groups' shares of the previous sync,
Δ̂_t = Δ_g,t / G + E with E = Δ̄_{t-1} − Δ_g,t-1 / G (kept per chunk, fp32), and θ_eager =
the outer step of θ_{t-1} with Δ̂ (:meth:`OuterOptimizer.peek`: the optimizer state does not
change). A sync with no previous mean known — the first of its part, or the first after
loading a checkpoint without E — has no estimate: it starts from θ_local (the correction
rule) and only records E. θ_eager is written into the parameters at launch (a dp
re-gather, counted as ``dp``) and takes θ_local_at_launch's place in the correction:
θ ← θ_local_now + (θ_t − θ_eager). The reference θ_t and the outer state still come from
the true mean Δ̄_t only, so they stay the same in every group; Kale et al. instead step the
outer optimizer with the estimate itself.

Merge (``dept.outer_overlap_rule: mix``, ``finish(mix=α)``, α = ``dept.outer_mix_alpha``): the
τ overlapped steps start from θ_local like the correction rule, but on arrival the weights
become α·θ_local_now + (1 − α)·θ_t — Streaming DiLoCo's merge of the local and the globally
updated fragment (Douillard et al. 2025, arXiv:2501.18512; torchft's ``fragment_update_alpha``,
where α = 0 lets θ_t replace the τ local steps). Unlike the correction, which keeps all of
this group's τ steps on top of θ_t, the merge keeps the fraction α of the group's whole
departure from θ_t. Nothing is kept from the launch (no θ_local_at_launch copy).

With half-precision weights the fp32 values to read and write are the optimizer's master
copies: a FlatSync built with ``main_params`` / ``refresh`` (``Trainer.main_params`` and
``Trainer.refresh_model_params``) reads θ_local from and writes θ_t into those, then refreshes
the model's weights; without them it works on the parameters themselves (fp32 weights).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from ..parallel.comm import group_size
from .outer_optimizer import STATE_NAMES, OuterOptimizer  # noqa: F401  (importable from here too)
from .quant import QUANT_FORMATS, decode, encode, packed_nbytes

COMM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
OUTER_COMM_DTYPES = ("fp32", "bf16") + QUANT_FORMATS
STATE_DEVICES = ("device", "cpu")


def flatten_fp32(params: Sequence[torch.Tensor]) -> torch.Tensor:
    if not params:
        return torch.zeros(0, dtype=torch.float32)
    return torch.cat([p.detach().reshape(-1).to(torch.float32) for p in params])


def chunk_bounds(n: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of chunk ``index`` when n elements are split into ``parts`` near-equal chunks."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def join_flat_sync_chunks(sds: Sequence[dict]) -> dict:
    """One :meth:`FlatSync.state_dict` of the whole shard from those of the D replicas of a
    group (their near-equal chunks in data-parallel order): the full form that
    :meth:`FlatSync.load_state_dict` cuts into the chunk of a rank under another D."""
    at = 0
    for sd in sds:
        start, end, numel = sd["chunk"]
        if isinstance(start, list) or start != at:
            raise ValueError("outer state: the saved chunks are not consecutive near-equal chunks")
        at = end
    if at != sds[0]["chunk"][2]:
        raise ValueError(f"outer state: the saved chunks end at {at} of {sds[0]['chunk'][2]}")
    opt = dict(sds[0]["optimizer"])
    opt["state"] = {k: torch.cat([sd["optimizer"]["state"][k] for sd in sds]) for k in opt.get("state", {})}
    out = {"theta_prev": torch.cat([sd["theta_prev"] for sd in sds]), "optimizer": opt}
    for key in ("residual", "eager_base"):
        if key in sds[0]:
            out[key] = torch.cat([sd[key] for sd in sds])
    if "eager_known" in sds[0]:
        out["eager_known"] = list(sds[0]["eager_known"])
    return out


def sync_options(dept_cfg) -> dict:
    """FlatSync keyword arguments from the ``dept`` config section."""
    return dict(comm_dtype=dept_cfg.outer_comm_dtype, state_device=dept_cfg.outer_state_device,
                quant_block=dept_cfg.outer_quant_block, error_feedback=dept_cfg.outer_error_feedback)


def _pin(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cpu" and torch.cuda.is_available():
        return t.pin_memory()
    return t


@dataclass
class PendingSync:
    """One launched synchronisation of a :class:`FlatSync` (see :meth:`FlatSync.launch`)."""
    work: Any  # the collective's handle (``wait()``)
    wire: Optional[torch.Tensor]  # fp32/bf16: the all-reduced chunk; quantised: the G packed chunks
    delta: torch.Tensor  # fp32 Δ of this rank's chunk (fp32 wire: the same tensor)
    launch: Optional[torch.Tensor]  # θ at launch (θ_local, or θ_eager; for the correction)
    part: Optional[int] = None  # the part of the chunk (FlatSync.use_parts), None: all of it
    own: Optional[torch.Tensor] = None  # eager start: this group's own Δ (fp32, before quantising)


class FlatSync:
    """Outer synchronisation of a list of parameters held by this rank (see module doc)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], pg, optimizer: OuterOptimizer,
                 category: str = "outer_body", comm_dtype: str = "fp32",
                 main_params: Optional[Callable[[Sequence[torch.nn.Parameter]], list[torch.Tensor]]] = None,
                 refresh: Optional[Callable[[Sequence[torch.nn.Parameter]], None]] = None, *,
                 state_device: str = "device", quant_block: int = 256, error_feedback: bool = False,
                 shards=None) -> None:
        self.params = list(params)
        self._main_params = main_params
        self._refresh = refresh
        # master_shards.ShardedMasters: the fp32 masters are the distributed optimizer's shards
        self.shards = shards
        self.pg = pg
        self.category = category
        if comm_dtype not in OUTER_COMM_DTYPES:
            raise ValueError(f"dept.outer_comm_dtype: {comm_dtype!r} is not one of {' | '.join(OUTER_COMM_DTYPES)}")
        if state_device not in STATE_DEVICES:
            raise ValueError(f"dept.outer_state_device: {state_device!r} is not one of {' | '.join(STATE_DEVICES)}")
        if quant_block < 1:
            raise ValueError(f"dept.outer_quant_block: must be > 0, got {quant_block}")
        if error_feedback and comm_dtype not in QUANT_FORMATS:
            raise ValueError(f"dept.outer_error_feedback: needs a quantised dept.outer_comm_dtype "
                             f"({' | '.join(QUANT_FORMATS)}), got {comm_dtype!r}")
        self.comm_format = comm_dtype
        self.comm_dtype = COMM_DTYPES.get(comm_dtype)  # None: block-quantised
        self.quant_block = int(quant_block)
        self.error_feedback = bool(error_feedback)
        self.optimizer = optimizer
        self.numel = sum(p.numel() for p in self.params)
        D = pg.dp_size
        if shards is not None:
            if [id(p) for p in shards.params] != [id(p) for p in self.params]:
                raise ValueError("FlatSync: the sharded masters describe other parameters")
            # each rank's chunk: the pieces of the fp32 masters it holds (master_shards.py)
            self.rank_ranges = [list(r) for r in shards.rank_ranges]
        else:
            self.rank_ranges = [[chunk_bounds(self.numel, D, d)] for d in range(D)]
        self.ranges = self.rank_ranges[pg.dp_rank]
        self.bounds = [(r[0][0], r[-1][1]) if r else (0, 0) for r in self.rank_ranges]  # the span of each chunk
        self.start, self.end = self.bounds[pg.dp_rank]
        self.parts = 1  # see use_parts
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.state_device = torch.device("cpu") if state_device == "cpu" else self.device
        # θ_{t-1} of this rank's chunk only (fp32)
        self.theta_prev = _pin(self._read_chunk().to(self.state_device))
        self.optimizer.ensure_state(self.theta_prev)
        if self.state_device.type == "cpu":
            self.optimizer.state = {k: _pin(v) for k, v in self.optimizer.state.items()}
        # error feedback: this rank's last quantisation residual (chunk, fp32)
        self.residual = torch.zeros_like(self.theta_prev) if self.error_feedback else None
        # eager start (enable_eager): E = Δ̄_{t-1} − Δ_g,t-1 / G of the chunk (fp32), and per
        # part whether it holds a previous mean yet
        self.eager_base: Optional[torch.Tensor] = None
        self.eager_known: list[bool] = []

    def enable_eager(self) -> None:
        """Start overlapped syncs from an estimate of θ_t (module doc, "Eager start"):
        ``launch(eager=True)`` then needs E, allocated here (zeros until the first sync)."""
        if self.eager_base is None:
            self.eager_base = _pin(torch.zeros_like(self.theta_prev))
            self.eager_known = [False] * self.parts

    @property
    def chunk_numel(self) -> int:
        return sum(b - a for a, b in self.ranges)

    # ------------------------------------------------------------------------- parts
    def use_parts(self, parts: int) -> None:
        """Synchronise in ``parts`` parts, one at a time (``launch(part=f)``; GLOB's tables
        spread over the body's fragments, streaming.py): every rank's chunk is cut into
        ``parts`` near-equal consecutive slices, and part f is the f-th slice of every chunk, so
        each replica carries 1/parts of its share at every launch. Each part keeps its own
        outer step count (Adam's bias correction); the state stays one buffer per chunk."""
        if parts < 1:
            raise ValueError(f"FlatSync.use_parts: parts must be >= 1, got {parts}")
        if self.eager_base is not None:
            raise RuntimeError("FlatSync.use_parts: call it before enable_eager()")
        self.parts = int(parts)
        self.optimizer.part_steps = [self.optimizer.steps] * parts if parts > 1 else []

    def part_slice(self, part: Optional[int], dp_rank: Optional[int] = None) -> tuple[int, int]:
        """[start, end) of ``part`` in the chunk of replica ``dp_rank`` (this rank's by
        default), in chunk coordinates; None: the whole chunk."""
        ranges = self.ranges if dp_rank is None else self.rank_ranges[dp_rank]
        n = sum(b - a for a, b in ranges)
        return (0, n) if part is None else chunk_bounds(n, self.parts, part)

    def _part_rank_ranges(self, part: Optional[int]) -> list[list[tuple[int, int]]]:
        """Every replica's flat [start, end) ranges of ``part`` (all of them for None)."""
        if part is None:
            return self.rank_ranges
        out = []
        for d, ranges in enumerate(self.rank_ranges):
            c0, c1 = self.part_slice(part, d)
            mine, o = [], 0
            for a, b in ranges:
                lo, hi = max(c0, o), min(c1, o + b - a)
                if lo < hi:
                    mine.append((a + lo - o, a + hi - o))
                o += b - a
            out.append(mine)
        return out

    def values(self) -> list[torch.Tensor]:
        """The fp32 tensors holding the parameters' values (the masters of half weights)."""
        return self._main_params(self.params) if self._main_params is not None else self.params

    def _read_chunk(self, values: Optional[list[torch.Tensor]] = None) -> torch.Tensor:
        """θ_local of this rank's chunk (fp32, on the parameters' device), read parameter by
        parameter (sharded masters: the rank's own pieces)."""
        if self.shards is not None:
            return self.shards.read(self.device)
        values = self.values() if values is None else values
        out = torch.empty(self.chunk_numel, dtype=torch.float32, device=self.device)
        for v, (lo, hi, dst) in self._segments(values, self._own_pieces(out)):
            dst.copy_(v.detach().reshape(-1)[lo:hi])
        return out

    def _own_pieces(self, chunk: torch.Tensor) -> list[tuple[int, int, torch.Tensor]]:
        """``[(start, end, view of chunk)]`` for this rank's ranges."""
        out, o = [], 0
        for a, b in self.ranges:
            out.append((a, b, chunk[o:o + b - a]))
            o += b - a
        return out

    def wire_nbytes(self, part: Optional[int] = None) -> int:
        """Bytes this rank puts on the outer group per sync (of ``part``; 0 when G = 1 or
        nothing to sync)."""
        if self.numel == 0 or group_size(self.pg.outer) == 1:
            return 0
        c0, c1 = self.part_slice(part)
        n = c1 - c0
        if self.comm_dtype is None:
            return packed_nbytes(n, self.comm_format, self.quant_block)
        return n * torch.tensor([], dtype=self.comm_dtype).element_size()

    # ------------------------------------------------------------------------- the sync
    @torch.no_grad()
    def sync(self, part: Optional[int] = None) -> None:
        """The blocking sync (of ``part``, see :meth:`use_parts`): θ_t written into the parameters."""
        pending = self.launch(part=part)
        if pending is not None:
            self.finish(pending, correct=False)

    @torch.no_grad()
    def launch(self, keep_launch: bool = False, part: Optional[int] = None,
               eager: bool = False) -> Optional[PendingSync]:
        """Steps 1–2: Δ of this rank's chunk (of its slice ``part``, see :meth:`use_parts`),
        and its exchange across groups started asynchronously. ``keep_launch``: keep θ_local
        for :meth:`finish`'s correction (overlapped sync); ``eager`` (needs ``keep_launch`` and
        :meth:`enable_eager`): write θ_eager into the parameters now and keep it instead
        (module doc, "Eager start"). None when there is nothing to
        synchronise (e.g. GLOB embeddings on a middle pipeline stage: every member of this
        rank's outer and dp groups has the same empty share, so nobody communicates)."""
        if self.numel == 0:
            return None
        if part is not None and not 0 <= part < self.parts:
            raise ValueError(f"FlatSync.launch: part {part} of {self.parts}")
        pg = self.pg
        c0, c1 = self.part_slice(part)
        local = self._read_chunk()
        if part is not None:
            local = local[c0:c1].clone()
        if eager and (not keep_launch or self.eager_base is None):
            raise RuntimeError("FlatSync.launch(eager=True) needs keep_launch=True and enable_eager()")
        # with no previous mean known there is no estimate: θ_local, and E recorded at finish
        start_eager = eager and self.eager_known[part or 0]
        launch = local.clone() if keep_launch and not start_eager else None
        delta = torch.sub(self.theta_prev[c0:c1].to(self.device, non_blocking=True), local, out=local)
        own = delta.clone() if eager else None  # before error feedback, quantisation and the all-reduce
        residual = self.residual[c0:c1] if self.residual is not None else None
        G = group_size(pg.outer)
        wire, work = None, None
        if G > 1:
            if self.comm_dtype is not None:
                wire = delta if self.comm_dtype == torch.float32 else delta.to(self.comm_dtype)
                work = pg.comm.all_reduce(wire, pg.outer, category=self.category, async_op=True)
            else:
                if residual is not None:
                    delta.add_(residual.to(self.device, non_blocking=True))
                packed = encode(delta, self.comm_format, self.quant_block)
                if residual is not None:
                    sent = decode(packed, delta.numel(), self.comm_format, self.quant_block)
                    residual.copy_(torch.sub(delta, sent, out=sent))
                    del sent
                wire = torch.empty(G * packed.numel(), dtype=torch.uint8, device=self.device)
                work = pg.comm.all_gather_into(wire, packed, pg.outer, category=self.category, async_op=True)
        if start_eager:  # while the exchange runs
            launch = self._eager_theta(own, part, G)
            self._write(launch, part, add=False)
        return PendingSync(work, wire, delta, launch, part, own)

    def _eager_theta(self, own: torch.Tensor, part: Optional[int], G: int) -> torch.Tensor:
        """θ_eager of the chunk (part): the outer step of θ_{t-1} with Δ̂ = Δ_g / G + E."""
        c0, c1 = self.part_slice(part)
        estimate = torch.add(self.eager_base[c0:c1].to(self.device, non_blocking=True), own, alpha=1.0 / G)
        theta = self.optimizer.peek(self.theta_prev[c0:c1], estimate.to(self.state_device), at=c0, part=part)
        return theta.to(self.device)

    @torch.no_grad()
    def finish(self, pending: PendingSync, correct: bool = False, mix: Optional[float] = None) -> float:
        """Steps 2–4 once the exchange is done: the mean Δ, the outer step, the dp re-gather
        and the write into the parameters — θ_t (``correct=False``), θ_local_now +
        (θ_t − θ_local_at_launch) (``correct=True``, needs ``launch(keep_launch=True)``) or
        α·θ_local_now + (1 − α)·θ_t (``mix=α``, the merge rule, module doc).
        Returns the seconds spent waiting for the exchange."""
        if correct and mix is not None:
            raise ValueError("FlatSync.finish: correct=True and mix are two different rules")
        pg = self.pg
        G = group_size(pg.outer)
        t0 = time.perf_counter()
        if pending.work is not None:
            pending.work.wait()
            # a cross-job exchange (federation) says how many groups its committed sum holds
            G = getattr(pending.work, "groups", G)
        waited = time.perf_counter() - t0
        delta = pending.delta
        if G > 1:
            if self.comm_dtype is None:
                n, size = delta.numel(), pending.wire.numel() // G
                delta.zero_()
                for g in range(G):  # fp32 accumulation in group order: identical on every rank
                    delta.add_(decode(pending.wire[g * size:(g + 1) * size], n, self.comm_format, self.quant_block))
            elif self.comm_dtype != torch.float32:
                delta.copy_(pending.wire)
            delta.div_(G)
        pending.wire = None
        part = pending.part
        c0, c1 = self.part_slice(part)
        if pending.own is not None:  # eager start: E = Δ̄_t − Δ_g,t / G for the next sync
            self.eager_base[c0:c1].copy_(torch.sub(delta, pending.own, alpha=1.0 / G).to(self.state_device))
            self.eager_known[part or 0] = True
            pending.own = None
        # (a device → CPU copy must be blocking: the CPU step reads it at once)
        if part is None:
            self.optimizer.step(self.theta_prev, delta.to(self.state_device))
        else:
            self.optimizer.step(self.theta_prev[c0:c1], delta.to(self.state_device), at=c0, part=part)
        pending.delta = delta = None
        theta = self.theta_prev[c0:c1].to(self.device, non_blocking=True)  # θ_t of the chunk (part)
        if mix is not None:  # α·θ_local_now + (1 − α)·θ_t
            local = self._read_chunk()[c0:c1]
            theta = torch.lerp(theta, local, float(mix))
        elif correct:
            if pending.launch is None:
                raise RuntimeError("FlatSync.finish(correct=True) needs launch(keep_launch=True)")
            theta = torch.sub(theta, pending.launch, out=pending.launch)  # θ_t − θ_local_at_launch
        pending.launch = None
        self._write(theta, part, add=correct)
        return waited

    @torch.no_grad()
    def reset_reference(self) -> None:
        """θ_{t-1} := this rank's chunk of the current values (weights loaded after the sync
        was built: ``train.init_from``). No communication."""
        self.theta_prev.copy_(self._read_chunk().to(self.state_device))

    @torch.no_grad()
    def write_reference(self) -> None:
        """Write θ_{t-1} into the parameters (a federated group that healed from a peer's
        state: dept/federation.py). Collective over ``pg.dp``."""
        if self.numel:
            self._write(self.theta_prev.to(self.device), None, add=False)

    def _write(self, theta: torch.Tensor, part: Optional[int], add: bool) -> None:
        """This rank's chunk (``part``) of fp32 values written (``add``: added) into every
        replica's parameters: re-gathered over ``pg.dp`` (counted as ``dp``)."""
        c0, c1 = self.part_slice(part)
        if self.shards is not None:
            # the rank's own masters, then every rank's pieces into the weights (master_shards.py)
            self.shards.write(theta, add=add, at=c0)
            del theta
            send = self.shards.send_buffer()[c0:c1]
            self.shards.write_weights(self._gather_pieces(send.to(self.device), dtype=self.shards.weight_dtype,
                                                          part=part))
            return
        pieces = self._gather_pieces(theta, part=part)
        for v, (a, b, src) in self._segments(self.values(), pieces):
            flat = v.data.view(-1)
            if add:
                flat[a:b].add_(src.to(v.dtype))
            else:
                flat[a:b].copy_(src.to(v.dtype))
        if self._refresh is not None:
            self._refresh(self.params)

    # ------------------------------------------------------------------------- state
    def replicated_state(self) -> dict:
        """This rank's chunk of what every group holds the same after a sync: θ_{t-1} and the
        outer optimizer state (``chunk``: its [start, end) and the shard's size). What a group
        healing from a live peer loads (dept/federation.py); not the residual or the eager
        estimate, which are the group's own (:meth:`group_state`)."""
        return {"theta_prev": self.theta_prev.detach().cpu().clone(), "chunk": self._chunk_signature(),
                "optimizer": self.optimizer.state_dict()}

    def state_dict(self) -> dict:
        """:meth:`replicated_state`, the residual (error feedback) and the estimate (eager start)."""
        sd = self.replicated_state()
        if self.residual is not None:
            sd["residual"] = self.residual.detach().cpu().clone()
        if self.eager_base is not None:
            sd["eager_base"] = self.eager_base.detach().cpu().clone()
            sd["eager_known"] = list(self.eager_known)
        return sd

    def load_state_dict(self, sd: dict) -> None:
        """Loads :meth:`state_dict`'s chunk, or a full θ_{t-1} of the shard (the format before
        the lean state: this rank keeps its chunk). A group's own buffer that ``sd`` lacks (a
        peer's :meth:`replicated_state`) is left as it is (a new sync's: zeros, none known)."""
        t = sd["theta_prev"]
        if "chunk" in sd:
            if list(sd["chunk"]) != self._chunk_signature():
                raise ValueError(f"outer state holds chunk {list(sd['chunk'])}, this rank syncs "
                                 f"{self._chunk_signature()} (another data-parallel layout)")
        else:
            if t.numel() != self.numel:
                raise ValueError(f"outer state holds {t.numel()} values, expected {self.numel}")
            t = self.cut_chunk(t)
        self.theta_prev = _pin(t.to(self.state_device, torch.float32).clone())
        self.optimizer.load_state_dict(sd["optimizer"])
        for k, v in list(self.optimizer.state.items()):  # the chunk's, or the whole shard's (join_flat_sync_chunks)
            v = self._cut(v) if "chunk" not in sd else v
            self.optimizer.state[k] = _pin(v.to(self.state_device, torch.float32).clone())
        if self.residual is not None and sd.get("residual") is not None:
            self.residual = self._loaded_chunk(sd, "residual")
        if self.eager_base is not None and sd.get("eager_base") is not None:
            self.eager_base = self._loaded_chunk(sd, "eager_base")
            self.load_eager_known(sd.get("eager_known"))

    def load_eager_known(self, known: Optional[Sequence[bool]]) -> None:
        """Which parts' E hold a previous mean (None: none does)."""
        known = [False] * self.parts if known is None else [bool(k) for k in known]
        if len(known) != self.parts:
            raise ValueError(f"outer state: the checkpoint's eager estimate has {len(known)} parts, this run's "
                             f"sync {self.parts} (another dept.outer_fragments)")
        self.eager_known = known

    def _loaded_chunk(self, sd: dict, key: str) -> torch.Tensor:
        """A per-chunk buffer of :meth:`state_dict` (the chunk's, or the whole shard's: cut)."""
        r = sd[key]
        r = self._cut(r) if "chunk" not in sd else r
        return _pin(r.to(self.state_device, torch.float32).clone())

    def cut_chunk(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of a flat tensor of the whole shard's values."""
        flat = full.reshape(-1)
        if flat.numel() != self.numel:
            raise ValueError(f"FlatSync.cut_chunk: {flat.numel()} values for a shard of {self.numel}")
        return torch.cat([flat[a:b] for a, b in self.ranges]) if self.ranges else flat[:0]

    def _cut(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of a tensor of the whole shard's values (one already the chunk's
        size is returned as it is: the state before the lean state kept it so)."""
        flat = full.reshape(-1)
        if flat.numel() == self.chunk_numel or flat.numel() != self.numel:
            return full
        return self.cut_chunk(flat)

    def _chunk_signature(self) -> list:
        """[start, end, numel] of this rank's chunk; with sharded masters [[start, end], ..., numel]."""
        if self.shards is None:
            return [self.start, self.end, self.numel]
        return [[a, b] for a, b in self.ranges] + [self.numel]

    def _gather_pieces(self, chunk: torch.Tensor, dtype: torch.dtype = torch.float32,
                       part: Optional[int] = None) -> list[tuple[int, int, torch.Tensor]]:
        """Every replica's chunk (or its slice ``part``), gathered over ``pg.dp`` (``dtype``,
        fp32 unless said; category ``dp``): ``[(start, end, values)]`` covering the shard (the
        part). One all-gather of equal parts (gloo and NCCL need them): chunks shorter than the
        longest are padded, and the padding is counted. The receive buffer is the only
        full-shard temporary of the sync."""
        from .master_shards import gather_ranges
        return gather_ranges(self.pg, self._part_rank_ranges(part), chunk, self.device, dtype)

    @staticmethod
    def _segments(values, pieces):
        """(tensor, [a, b) of its flat view, source values) for every overlap of a tensor of
        ``values`` (laid out one after another) with a piece."""
        offset = 0
        for v in values:
            n = v.numel()
            for a, b, src in pieces:
                lo, hi = max(a, offset), min(b, offset + n)
                if lo < hi:
                    yield v, (lo - offset, hi - offset, src[lo - a:hi - a])
            offset += n

    def _gather_full(self, chunk: torch.Tensor) -> torch.Tensor:
        """The shard's full fp32 vector from every replica's chunk (over ``pg.dp``, counted as dp)."""
        full = torch.empty(self.numel, dtype=torch.float32, device=self.device)
        for a, b, src in self._gather_pieces(chunk):
            full[a:b].copy_(src)
        return full.cpu()

    def _per_param(self, full: torch.Tensor) -> list[torch.Tensor]:
        out, offset = [], 0
        for p in self.params:
            out.append(full[offset:offset + p.numel()].view(p.shape).clone())
            offset += p.numel()
        return out

    def param_state(self) -> dict:
        """Layout-free state: ``{"steps", "reference": [fp32 tensor per parameter, shaped like
        it, full over DP], and one such list per outer-optimizer state name}``, plus
        ``"part_steps"`` (one count per part) when synchronised in parts (collective over
        ``pg.dp``: every replica must call it)."""
        self.optimizer.ensure_state(self.theta_prev)
        out: dict[str, Any] = {"steps": int(self.optimizer.steps),
                               "reference": self._per_param(self._gather_full(self.theta_prev))}
        for name in self.optimizer.state_names:
            out[name] = self._per_param(self._gather_full(self.optimizer.state[name]))
        if self.optimizer.part_steps:
            out["part_steps"] = list(self.optimizer.part_steps)
        return out

    def group_state(self) -> dict:
        """This group's per-chunk buffers, layout-free (collective over ``pg.dp``: every
        replica must call it): ``{"residual": [fp32 tensor per parameter, shaped like it, full
        over DP]}`` with error feedback, ``{"eager_base": [...], "eager_known": [bool per
        part]}`` with the eager start; {} with neither. Each replica's chunk is a distinct
        slice of the group's flattened shard, so the union over the replicas is one value per
        parameter element, like θ_{t-1} in :meth:`param_state`; unlike θ_{t-1} the values
        differ between groups (the residual of the group's own quantisation; the other groups'
        share of the last mean as this group sees it), so their checkpoint keys carry the
        group (``dept_mega.checkpoint_state``)."""
        out: dict[str, Any] = {}
        if self.residual is not None:
            out["residual"] = self._per_param(self._gather_full(self.residual))
        if self.eager_base is not None:
            out["eager_base"] = self._per_param(self._gather_full(self.eager_base))
            out["eager_known"] = list(self.eager_known)
        return out

    def load_group_state(self, state: dict) -> None:
        """:meth:`group_state`'s structure (any subset: a buffer this sync keeps but ``state``
        lacks is left as it is); this rank keeps its chunk."""
        if self.residual is not None and "residual" in state:
            self.residual = self._chunk_of(state["residual"], "residual")
        if self.eager_base is not None and "eager_base" in state:
            self.eager_base = self._chunk_of(state["eager_base"], "eager_base")
        if self.eager_base is not None and "eager_known" in state:
            self.load_eager_known(state["eager_known"])

    def _chunk_of(self, tensors: Sequence[torch.Tensor], what: str) -> torch.Tensor:
        """This rank's chunk (fp32, on the state device) of one full tensor per parameter."""
        if len(tensors) != len(self.params):
            raise ValueError(f"outer state {what!r}: {len(tensors)} tensors for {len(self.params)} parameters")
        for t, p in zip(tensors, self.params):
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"outer state {what!r}: a tensor of shape {tuple(t.shape)} for a parameter "
                                 f"of shape {tuple(p.shape)}")
        return _pin(self.cut_chunk(flatten_fp32(list(tensors))).to(self.state_device).clone())

    def load_param_state(self, state: dict) -> None:
        """:meth:`param_state`'s structure; this rank keeps its chunk."""
        chunk = self._chunk_of
        self.theta_prev = chunk(state["reference"], "reference")
        self.optimizer.steps = int(state["steps"])
        self.optimizer.load_part_steps(state.get("part_steps"))
        self.optimizer.state = {name: chunk(state[name], name) for name in self.optimizer.state_names}
