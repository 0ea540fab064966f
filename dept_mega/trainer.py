"""Inner training steps inside one source group (Megatron-style TP × PP × DP).

One step: the pipeline schedule runs the forwards/backwards of the step's micro-batches. Each
micro-batch's gradient is added into the optimizers' contiguous gradient buffers
(``param.main_grad``, fp32 unless ``optim.grad_dtype: bf16``; :mod:`dept_mega.grad_buffer`),
and with ``optim.overlap_grad_reduce`` each bucket's sum over ``pg.dp`` starts as soon as its
gradients are final, during backward (reduce-scatter with ``optim.distributed``). The loss of
every micro-batch is already divided by the number of target tokens of the *global* batch, so
the sum over the data-parallel ranks is the mean loss's gradient, whatever the layout. Then
1. the data-parallel reductions are waited for;
2. tied-embedding gradients are all-reduced over ``pg.embedding`` (PP > 1), sequence-parallel
   replicated-parameter gradients (norms, row-parallel biases) over ``pg.tp``;
3. fp16 gradients are unscaled, the global norm is computed (each parameter once) and clipped;
4. a non-finite loss or norm skips the update; otherwise the body and embedding optimizers step
   (fp32 main parameters; half-precision weights copied from them, :mod:`dept_mega.optimizer`).

The body and the current embeddings have separate optimizers so that DEPT can swap a source's
embeddings together with their optimizer state (:meth:`Trainer.set_embeddings`). Under
``precision: bf16 | fp16`` the model's weights are half precision and the fp32 masters live in
the optimizers; DEPT reads and writes weights through :meth:`Trainer.main_params` and
:meth:`Trainer.refresh_model_params`.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from .config import Config
from .grad_buffer import GradSync, grad_owner
from .distributed_optimizer import build_optimizer
from .optim import counted_once, lr_at, norm_of, set_lr
from .optimizer import InnerOptimizer, keep_masters_on_load, main_param, refresh_model_params, to_model_dtype
from .optimizer import unique_params as _unique
from .parallel.fp8 import fp8_discard_step, fp8_weight_cache
from .parallel.groups import ParallelGroups
from .parallel.pipeline import PipeChannels, ScheduleSpec, check_microbatches, run_forward_backward, \
    run_forward_only
from .precision import Precision

if TYPE_CHECKING:
    from .model.act_norms import ActivationSums

BUCKET_ELEMENTS = 25_000_000  # elements per all-reduce bucket of the tied / sequence-parallel gradients


class NonFiniteLossError(RuntimeError):
    """Too many steps in a row had a non-finite loss or gradient norm."""


@dataclass
class MicroBatch:
    """``tokens`` [b, s+1] int64: inputs ``tokens[:, :-1]``, labels ``tokens[:, 1:]``.
    ``source_ids`` [b]: index of each sequence's source in ``cfg.data.sources`` (or None).
    ``rows``: evaluation only, the first ``rows`` sequences count and the others only fill a
    short share to the micro-batch shape (``dept_mega.data.sources.ValidationBatches``); None: all."""
    tokens: torch.Tensor
    source_ids: Optional[torch.Tensor] = None
    rows: Optional[int] = None

    @property
    def num_targets(self) -> int:
        return self.tokens.shape[0] * (self.tokens.shape[1] - 1)


@dataclass
class StepResult:
    loss: float  # mean per-token loss of the group's global batch
    tokens: int  # target tokens of the group's global batch
    grad_norm: float  # before clipping (nan when skipped for a non-finite loss)
    skipped: bool
    lr: float
    loss_sum_by_source: dict[int, float] = field(default_factory=dict)
    tokens_by_source: dict[int, int] = field(default_factory=dict)
    #: with ``activation_norms``: the group's per-layer sums of squares of the blocks' outputs,
    #: then their element counts (``model/act_norms.py``; ``rms_of`` gives the RMS); else None
    act_sums: Optional[list[float]] = None


def as_micro_batch(x: Any) -> MicroBatch:
    """Accept MicroBatch, a tensor [b, s+1], or a mapping/object with ``tokens`` (and optionally
    ``source_ids``) — the shapes the data package hands out."""
    if isinstance(x, MicroBatch):
        return x
    if isinstance(x, torch.Tensor):
        return MicroBatch(tokens=x)
    if isinstance(x, dict):
        return MicroBatch(tokens=torch.as_tensor(x["tokens"]), source_ids=_opt_tensor(x.get("source_ids")))
    if hasattr(x, "tokens"):
        return MicroBatch(tokens=torch.as_tensor(x.tokens), source_ids=_opt_tensor(getattr(x, "source_ids", None)))
    raise TypeError(f"cannot use {type(x).__name__} as a micro-batch (need tokens [b, s+1])")


def step_micro_batches(step: Any) -> list[MicroBatch]:
    """One step's micro-batches from what a batch iterator returns: a list of micro-batches,
    or a blended step with ``micro_batches`` and per-micro-batch ``source_ids``."""
    if hasattr(step, "micro_batches") and hasattr(step, "source_ids"):
        return [MicroBatch(tokens=torch.as_tensor(t), source_ids=_opt_tensor(s))
                for t, s in zip(step.micro_batches, step.source_ids)]
    return [as_micro_batch(x) for x in step]


def _opt_tensor(x: Any) -> Optional[torch.Tensor]:
    return None if x is None else torch.as_tensor(x)


class Trainer:
    def __init__(self, cfg: Config, pg: ParallelGroups, device: torch.device, vocab_size: Optional[int] = None,
                 stages: Optional[list[torch.nn.Module]] = None, num_sources: Optional[int] = None) -> None:
        self.cfg = cfg
        self.pg = pg
        self.device = device
        if stages is None:
            from .model import build_model
            if vocab_size is None:
                raise ValueError("Trainer needs vocab_size to build the model")
            # built in fp32: the initial values are the fp32 masters, the optimizers cast the weights
            stages = build_model(cfg, pg, vocab_size, cfg.train.seed, device)
        self.stages = list(stages)
        if len(self.stages) != cfg.parallel.virtual_pipeline:
            raise ValueError(f"{len(self.stages)} model chunks on this rank, expected "
                             f"parallel.virtual_pipeline={cfg.parallel.virtual_pipeline}")
        self.num_sources = num_sources or max(1, len(cfg.data.sources))
        self.precision = Precision(cfg.precision, device, cfg.optim.grad_dtype)
        self.channels = PipeChannels(pg)
        self.body_optimizer = build_optimizer(self.body_parameters(), cfg.optim, pg, device, self.precision,
                                              names=self._names())
        self.embedding_optimizer = self.make_embedding_optimizer(self.embeddings())
        for st in self.stages:
            keep_masters_on_load(st)
        self._cast_unowned(self.parameters())
        self.grad_sync = GradSync(pg, overlap=cfg.optim.overlap_grad_reduce)
        self.step = 0  # inner steps done
        # (step, samples consumed by then): consumed_samples counts on from here (resume sets it)
        self._samples_since = (0, 0)
        self.body_lr_scale = 1.0  # the body's LR relative to the schedule (see set_lr)
        # objects with after_reduce(trainer) (gradients reduced over dp, before the norm) and
        # after_step(trainer) (after the optimizers stepped); e.g. dept.row_mask.PresentRowsOnly
        self.step_hooks: list[Any] = []
        self.nonfinite_total = 0
        self.nonfinite_in_a_row = 0

    # -- parameters ----------------------------------------------------------------------
    def body_parameters(self) -> list[torch.nn.Parameter]:
        return _unique([p for st in self.stages for n, p in st.named_parameters() if n.startswith("body.")])

    def embedding_parameters(self) -> list[torch.nn.Parameter]:
        return _unique([p for st in self.stages for n, p in st.named_parameters() if n.startswith("embeddings.")])

    def parameters(self) -> list[torch.nn.Parameter]:
        return _unique([p for st in self.stages for p in st.parameters()])

    def _names(self) -> dict[int, str]:
        out: dict[int, str] = {}
        for c, st in enumerate(self.stages):
            for n, p in st.named_parameters():
                out.setdefault(id(p), f"chunk {c} {n}")
        return out

    def embeddings(self) -> list[Any]:
        return [getattr(st, "embeddings", None) for st in self.stages]

    def make_embedding_optimizer(self, embs: Sequence[Any]) -> InnerOptimizer:
        """The inner optimizer of one vocabulary's embeddings (casts them to the model dtype,
        keeping fp32 masters)."""
        present = [e for e in embs if e is not None]
        params = _unique([p for e in present for p in e.parameters()])
        shared = _unique([p for e in present for p in e.shared_embedding_params()])
        names = {id(p): f"embeddings.{n}" for e in present for n, p in e.named_parameters()}
        for e in present:
            keep_masters_on_load(e)
        return build_optimizer(params, self.cfg.optim, self.pg, self.device, self.precision, shared=shared,
                               names=names)

    def set_embeddings(self, embs: Sequence[Any], optimizer: Optional[InnerOptimizer] = None):
        """Install one vocabulary's embeddings (one object per chunk, aligned with ``stages``)
        and their optimizer; returns the previous ``(embeddings, optimizer)``. Embeddings that
        the given optimizer does not own (evaluation copies) are cast to the model dtype."""
        if len(embs) != len(self.stages):
            raise ValueError(f"set_embeddings: got {len(embs)} embeddings for {len(self.stages)} chunks")
        old = (self.embeddings(), self.embedding_optimizer)
        for st, e in zip(self.stages, embs):
            st.set_embeddings(e)
        new = optimizer if optimizer is not None else self.make_embedding_optimizer(embs)
        if new is not old[1]:
            old[1].release_grads()
        new.adopt()
        self.embedding_optimizer = new
        self._cast_unowned([p for e in embs if e is not None for p in e.parameters()])
        return old

    def _cast_unowned(self, params: Sequence[torch.nn.Parameter]) -> None:
        dtype = self.precision.param_dtype
        loose = [p for p in params if p.dtype != dtype and grad_owner(p) is None]
        to_model_dtype(loose, dtype, keep_master=False)

    @property
    def optimizers(self) -> list[InnerOptimizer]:
        return [self.body_optimizer, self.embedding_optimizer]

    # -- fp32 main parameters (DEPT's outer sync, TRIM's rows) ------------------------------------
    def main_params(self, params: Sequence[torch.nn.Parameter]) -> list[torch.Tensor]:
        """The fp32 tensors that hold ``params``' values: the parameters themselves under
        precision fp32, their fp32 master copies under bf16/fp16. Code outside the optimizer
        that reads weights reads these; code that writes them writes these and then calls
        :meth:`refresh_model_params`. Raises with the distributed optimizer and half-precision
        weights (no rank holds full masters)."""
        return [main_param(p) for p in params]

    def refresh_model_params(self, params: Sequence[torch.nn.Parameter]) -> None:
        """After writing :meth:`main_params`: copy them into the (half-precision) weights."""
        refresh_model_params(params)

    def lr(self, step: Optional[int] = None) -> float:
        return lr_at(self.step if step is None else step, self.cfg.optim, self.cfg.train.steps)

    def set_lr(self, step: Optional[int] = None) -> float:
        """Apply the schedule's LR at ``step`` (default: now); the body's optimizer takes it times
        ``body_lr_scale`` (1 in training; ``dept_mega.adapt`` gives a trainable body its own LR).
        Returns the schedule's LR."""
        lr = self.lr(step)
        set_lr([self.embedding_optimizer.inner], lr)
        set_lr([self.body_optimizer.inner], lr * self.body_lr_scale)
        return lr

    # -- one step -------------------------------------------------------------------------
    def _spec(self, mbs: Sequence[MicroBatch]) -> ScheduleSpec:
        """Shapes between pipeline stages, from the micro-batches (identical on every rank of
        a pipeline group, so nothing is exchanged): ``[s, b, h]``, ``[s/T, b, h]`` under SP."""
        b, s1 = mbs[0].tokens.shape
        for mb in mbs:
            if tuple(mb.tokens.shape) != (b, s1):
                raise ValueError(f"micro-batches of one step must have one shape, got {tuple(mb.tokens.shape)} "
                                 f"and {(b, s1)}")
        s = s1 - 1
        T = self.pg.tp_size
        if self.cfg.parallel.sequence_parallel and T > 1:
            if s % T:
                raise ValueError(f"sequence length {s} is not divisible by parallel.tensor={T} "
                                 f"(sequence parallelism)")
            s //= T
        return ScheduleSpec(activation_shape=(s, b, self.cfg.model.hidden_size),
                            comm_dtype=self.precision.comm_dtype, device=self.device)

    def _stage_input(self, mb: MicroBatch) -> torch.Tensor:
        return mb.tokens[:, :-1].to(self.device, non_blocking=True)

    def _stage_labels(self, mb: MicroBatch) -> torch.Tensor:
        return mb.tokens[:, 1:].to(self.device, non_blocking=True)

    def _contributes(self) -> bool:
        """Loss bookkeeping comes from tensor rank 0 of the last pipeline stage."""
        return self.pg.is_last_stage and self.pg.tp_rank == 0

    def train_step(self, micro_batches: Any, activation_norms: bool = False) -> StepResult:
        """One inner step of the group. ``activation_norms``: also measure the per-layer RMS of
        the blocks' outputs (``StepResult.act_sums``), read with the loss statistics in the
        step's one read of the device (the loop asks on the steps that log, with
        ``train.log_activation_norms``)."""
        mbs = step_micro_batches(micro_batches)
        P, V = self.pg.pp_size, len(self.stages)
        check_microbatches(len(mbs), P, V)
        if any(mb.rows is not None for mb in mbs):
            raise ValueError("train_step: micro-batches with filler rows (MicroBatch.rows) are for evaluation only")
        for st in self.stages:
            st.train()
        global_tokens = sum(mb.num_targets for mb in mbs) * self.pg.dp_size
        if global_tokens == 0:  # (the data loaders never make one: sequences of seq_length + 1 tokens)
            raise ValueError(f"train_step: the micro-batches have no target tokens (token shapes "
                             f"{[tuple(mb.tokens.shape) for mb in mbs]}): a sequence needs at least 2 tokens")
        scale = self.precision.loss_scale / global_tokens
        K = self.num_sources
        L = self.cfg.model.num_layers if activation_norms else 0
        # [loss sum, tokens, loss sums by source, tokens by source, (activation sums)]
        stats = torch.zeros(2 + 2 * K + 2 * L, dtype=torch.float64, device=self.device)
        act = None
        if activation_norms:
            from .model.act_norms import ActivationSums
            act = ActivationSums(stats[2 + 2 * K:], L)

        def loss_fn(per_token: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
            per_token = per_token.float()
            with torch.no_grad():
                seq = per_token.detach().sum(dim=1).double()
                stats[0] += seq.sum()
                stats[1] += per_token.numel()
                if mb.source_ids is not None:
                    ids = mb.source_ids.to(self.device)
                    stats[2:2 + K].index_add_(0, ids, seq)
                    stats[2 + K:].index_add_(0, ids, torch.full_like(seq, per_token.shape[1]))
            return per_token.sum() * scale

        # one walk of the modules per step (host time the GPU may wait for): each chunk's parameters
        stage_params = [list(st.parameters()) for st in self.stages]
        params = _unique([p for ps in stage_params for p in ps])  # as parameters()
        self._begin_grads(len(mbs), stage_params, params)
        with fp8_weight_cache(self.stages), self._measuring(act):  # native FP8: the step's scales; each weight cast once
            run_forward_backward(self.stages, mbs, self.pg, self.channels, self._spec(mbs),
                                 stage_input=self._stage_input, stage_labels=self._stage_labels, loss_fn=loss_fn)
        if not self._contributes():
            stats[:2 + 2 * K].zero_()  # the activation sums: every rank's own layers and shards
        if self.pg.source_group is not None:
            dist.all_reduce(stats, group=self.pg.source_group)  # bookkeeping, not counted

        self.reduce_gradients(params)
        for hook in self.step_hooks:
            hook.after_reduce(self)
        if self.precision.scaler is not None:
            for opt in self.optimizers:
                opt.scale_grads(1.0 / self.precision.scaler.scale)
        # the step's one read of the device: the loss statistics and the gradient norm in one
        # copy, after every kernel of the step up to the optimizer has been launched
        host = torch.cat([stats, self._grad_norm_tensor(params)]).cpu().tolist()
        stats, norm = host[:2 + 2 * K], host[-1]
        act_sums = host[2 + 2 * K:-1] if activation_norms else None
        loss_sum, tokens = stats[0], int(stats[1])
        loss = loss_sum / max(tokens, 1)
        by_src = {k: stats[2 + k] for k in range(K) if stats[2 + K + k] > 0}
        tok_src = {k: int(stats[2 + K + k]) for k in range(K) if stats[2 + K + k] > 0}
        grad_norm = norm if math.isfinite(loss) else float("nan")
        lr = self.set_lr()
        skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
        if skipped:
            fp8_discard_step(self.stages)  # delayed FP8 scaling: the step's amaxes leave the history
            self.nonfinite_total += 1
            self.nonfinite_in_a_row += 1
        else:
            self.nonfinite_in_a_row = 0
            clip = self.cfg.optim.clip_grad
            if clip > 0:
                coef = clip / (grad_norm + 1e-6)
                if coef < 1.0:
                    for opt in self.optimizers:
                        opt.scale_grads(coef)
            for opt in self.optimizers:
                opt.step()
            for hook in self.step_hooks:
                hook.after_step(self)
        self.precision.update(skipped)
        self.step += 1
        if self.nonfinite_in_a_row >= self.cfg.optim.max_consecutive_nonfinite:
            raise NonFiniteLossError(
                f"{self.nonfinite_in_a_row} steps in a row had a non-finite loss or gradient norm "
                f"(optim.max_consecutive_nonfinite={self.cfg.optim.max_consecutive_nonfinite}); "
                f"last at step {self.step}, loss {loss}")
        return StepResult(loss=loss, tokens=tokens, grad_norm=grad_norm, skipped=skipped, lr=lr,
                          loss_sum_by_source=by_src, tokens_by_source=tok_src, act_sums=act_sums)

    @contextlib.contextmanager
    def _measuring(self, act: Optional[ActivationSums]) -> Iterator[None]:
        """Every chunk's body adds its blocks' outputs to ``act`` inside (nothing when None)."""
        if act is None:
            yield
            return
        bodies = [st.body for st in self.stages]
        for body in bodies:
            body.act_sums = act
        try:
            yield
        finally:
            for body in bodies:
                body.act_sums = None

    def _tied_duplicates(self) -> frozenset[int]:
        """The last stage's copy of a tied word embedding (PP > 1) is counted on the first stage."""
        return frozenset(id(p) for st in self.stages if not st.is_first for p in st.shared_embedding_params())

    # -- gradients ------------------------------------------------------------------------
    def _begin_grads(self, num_micro_batches: int, stage_params: Sequence[Sequence[torch.nn.Parameter]],
                     params: Sequence[torch.nn.Parameter]) -> None:
        """Set up the step's gradient buffers: each parameter expects one accumulation per
        micro-batch for every chunk of this rank that holds it; a bucket's data-parallel
        reduction starts when all of its accumulations have arrived. ``stage_params``: each
        chunk's parameters; ``params``: :meth:`parameters`."""
        expected: dict[int, int] = {}
        for ps in stage_params:
            for p in ps:
                expected[id(p)] = expected.get(id(p), 0) + num_micro_batches
        buffers = [opt.buffer for opt in self.optimizers]
        for p in params:
            if p.requires_grad and not any(b.owns(p) for b in buffers):
                raise RuntimeError(f"parameter {self._names().get(id(p), tuple(p.shape))} is not owned by the "
                                   f"installed optimizers: set_embeddings(embs, optimizer) needs the optimizer "
                                   f"of those embeddings")
            p.grad = None
        self.grad_sync.begin(buffers, expected)

    def _owner(self, p: torch.nn.Parameter) -> InnerOptimizer:
        return grad_owner(p).optimizer

    def reduced_grad(self, p: torch.nn.Parameter) -> Optional[torch.Tensor]:
        """After the step's reduction: the gradient of ``p`` this rank holds (all of it; a flat
        shard with the distributed optimizer), or None when ``p`` got none."""
        if not p.requires_grad:
            return None
        opt = self._owner(p)
        return opt.grad_view(p) if opt.received(p) else None

    def _reduced(self, params: Sequence[torch.nn.Parameter]) -> list[torch.Tensor]:
        """The reduced gradient (or this rank's shard of it) of each parameter that got one
        (frozen parameters, ``requires_grad`` False, get none: ``dept_mega.adapt``)."""
        out = []
        for p in params:
            if not p.requires_grad:
                continue
            opt = self._owner(p)
            if opt.received(p):
                g = opt.grad_view(p)
                if g is not None:
                    out.append(g)
        return out

    def reduce_gradients(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Wait for the data-parallel reduction (started during backward with
        ``optim.overlap_grad_reduce``), then all-reduce tied-embedding gradients over
        ``pg.embedding`` and sequence-parallel ones over ``pg.tp``. ``params``: :meth:`parameters`."""
        self.grad_sync.finish()
        if self.pg.embedding is not None and self.pg.pp_size > 1:
            shared = {id(p) for st in self.stages for p in st.shared_embedding_params()}
            tied = self._reduced([p for p in params if id(p) in shared])
            if tied:
                _bucketed_all_reduce(tied, self.pg, self.pg.embedding, "pp")
        if self.pg.tp is not None and self.cfg.parallel.sequence_parallel:
            sp = self._reduced([p for p in params if getattr(p, "sequence_parallel", False)])
            if sp:
                _bucketed_all_reduce(sp, self.pg, self.pg.tp, "tp")

    def _grad_norm_tensor(self, params: Sequence[torch.nn.Parameter]) -> torch.Tensor:
        """L2 norm of the group's gradient over ``params`` (:meth:`parameters`), each parameter
        counted once (``optim.counted_once``); with the distributed optimizer each rank sums its
        shards and the sum runs over the whole source group. A one-element fp64 tensor on the
        device, not read back (``train_step`` fetches it with the loss statistics)."""
        dups = self._tied_duplicates()
        grads = self._reduced([p for p in params if counted_once(p, self.pg, dups)])
        group = self.pg.source_group if self.cfg.optim.distributed else self.pg.model_parallel
        return norm_of(grads, group, self.device)

    # -- evaluation ----------------------------------------------------------------------
    @torch.no_grad()
    def eval_batches(self, micro_batches: Any) -> tuple[float, int]:
        """Forward only; returns the group's (sum of token losses, number of target tokens)
        over these micro-batches on every data-parallel rank together: of each micro-batch's
        first ``rows`` sequences where it says (``MicroBatch.rows``). The losses are summed in
        float64, so the sum itself does not depend on how the sequences were cut into micro-batches
        (the per-token losses may, with the GEMM shapes or a current-scaled FP8 cast's amax, up to
        the model's numerics)."""
        mbs = step_micro_batches(micro_batches)
        for st in self.stages:
            st.eval()
        acc = torch.zeros(2, dtype=torch.float64, device=self.device)

        def loss_fn(per_token: torch.Tensor, mb: MicroBatch) -> None:
            counted = per_token if mb.rows is None else per_token[:mb.rows]  # [b, s]: sequences first
            acc[0] += counted.double().sum()
            acc[1] += counted.numel()

        if mbs:
            with fp8_weight_cache(self.stages, train=False):  # current scaling; the amax history untouched
                run_forward_only(self.stages, mbs, self.pg, self.channels, self._spec(mbs),
                                 stage_input=self._stage_input, stage_labels=self._stage_labels, loss_fn=loss_fn)
        if not self._contributes():
            acc.zero_()
        if self.pg.source_group is not None:
            dist.all_reduce(acc, group=self.pg.source_group)  # bookkeeping, not counted
        loss_sum, tokens = acc.cpu().tolist()
        return loss_sum, int(tokens)

    @property
    def consumed_samples(self) -> int:
        """Sequences this source group has trained on so far (skipped steps included: their
        batch was read, as Megatron-LM counts): train.global_batch_size per step since the
        last resume, on top of the checkpoint's count, so a launch with another batch size
        continues the count. Steps jumped without training (a federated group healing) count
        as trained with this launch's batch, as the live groups trained them."""
        since, samples = self._samples_since
        return samples + (self.step - since) * self.cfg.train.global_batch_size

    # -- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "nonfinite_total": self.nonfinite_total,
                "consumed_samples": self.consumed_samples,
                "scaler": self.precision.scaler.state_dict() if self.precision.scaler else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        # a checkpoint written before the count was kept: as if its steps had this launch's batch
        self._samples_since = (self.step, int(state.get("consumed_samples",
                                                        self.step * self.cfg.train.global_batch_size)))
        self.nonfinite_total = int(state.get("nonfinite_total", 0))
        if self.precision.scaler is not None and state.get("scaler"):
            self.precision.scaler.load_state_dict(state["scaler"])


def _bucketed_all_reduce(grads: list[torch.Tensor], pg: ParallelGroups, group, category: str,
                         bucket_elements: int = BUCKET_ELEMENTS) -> None:
    """Sum ``grads`` over ``group`` through ``pg.comm``, flattened into a few buckets."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for g in grads:
        if not buckets or size + g.numel() > bucket_elements or buckets[-1][0].dtype != g.dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(g)
        size += g.numel()
    for bucket in buckets:
        flat = torch.cat([g.reshape(-1) for g in bucket])
        pg.comm.all_reduce(flat, group, category)
        offset = 0
        for g in bucket:
            n = g.numel()
            g.copy_(flat[offset:offset + n].view_as(g))
            offset += n
