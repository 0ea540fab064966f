"""The step loop: rounds, hooks for DEPT, logging, periodic evaluation, checkpoints.

Round r covers inner steps ``[r·L, (r+1)·L)``, ``L = dept.local_steps``. Before a round's first
step the loop calls ``hooks.round_start`` (which source each group trains, embedding swaps),
after its last step ``hooks.round_end`` (outer sync; its record is written as ``kind:
"outer"``). STD uses :class:`StdHooks` (one group, the ``"blend"`` iterator, no outer sync).
The interface is documented in docs/architecture.md ("dept_mega.loop").

Scalars for logging (the loss of every group, token counts, eval sums) are reduced with
``torch.distributed`` directly: bookkeeping, not counted by ``Comm``.
"""
from __future__ import annotations

import math
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterable, Optional, Protocol, Sequence, runtime_checkable

import torch
import torch.distributed as dist

from . import ops
from .config import Config
from .log_lines import write_line
from .metrics import MetricsWriter, ThroughputMeter, activation_fields, human_line, outer_line
from .preemption import PreemptedWait, announce_stop, stopped_by
from .parallel.groups import ParallelGroups
from .trainer import StepResult, Trainer

BLEND = "blend"


@runtime_checkable
class BatchIterator(Protocol):
    def next_step(self) -> list[Any]: ...


class RoundHooks(Protocol):
    def round_start(self, loop: "TrainLoop", round_index: int) -> dict[int, str]: ...

    def round_end(self, loop: "TrainLoop", round_index: int) -> Optional[dict[str, Any]]: ...

    def make_iterator(self, source: str) -> Optional[BatchIterator]: ...

    def eval_context(self, loop: "TrainLoop", source: str) -> ContextManager: ...

    # optional: ``eval_assignment(sources) -> {source: group} | None`` (the same answer on every
    # rank): each source is evaluated by that group alone — ``eval_context(loop, source,
    # alone=True)`` — and the sums are gathered, where that gives the numbers every group would
    # (DEPT after a round's sync, dept/eval_split.py); None or absent: every group evaluates
    # every source.

    # optional: ``before_step(loop)`` / ``after_step(loop)`` around every inner step; True from
    # either ends the round there for this group: ``round_start`` comes next (before_step:
    # the step is not trained). docs/architecture.md.

    # optional: ``can_save_now() -> bool`` (the same answer on every rank): False while state a
    # checkpoint needs is in flight (an overlapped outer sync); the loop then defers a due
    # save (periodic or preemption) to the first step where it is True. Absent: True.

    # optional: ``source_steps(source, step) -> int``, the inner steps of [0, step) in which
    # ``source`` was trained (DEPT: from the round plan). When present, the loop moves the
    # source's iterator there (``seek``) at every round start, so data positions travel with
    # sources; without it (STD) an iterator keeps its own position.


class StdHooks:
    """STD: one group trains the blend of all sources; no outer synchronisation."""

    def round_start(self, loop: "TrainLoop", round_index: int) -> dict[int, str]:
        return {0: BLEND}

    def round_end(self, loop: "TrainLoop", round_index: int) -> Optional[dict[str, Any]]:
        return None

    def make_iterator(self, source: str) -> Optional[BatchIterator]:
        return None

    def eval_context(self, loop: "TrainLoop", source: str) -> ContextManager:
        return nullcontext()

    def can_save_now(self) -> bool:
        """A checkpoint may be written after the current step (no outer sync in flight)."""
        return True


@dataclass
class EvalStep:
    """One evaluation step of one data-parallel rank: its micro-batches and the UTF-8 bytes
    behind their target tokens."""
    micro_batches: list[Any]
    nbytes: float


# make_eval_batches(source) -> the eval steps of this dp rank for that source (validation split)
EvalFactory = Callable[[str], Iterable[EvalStep]]


class LossWindow:
    """The token-weighted mean loss over the logging window (the steps since the previous train
    record, or since this launch began): Megatron-LM's ``lm loss``, which averages the
    iterations of its ``--log-interval``. Steps skipped for a non-finite loss or gradient norm
    are left out, as Megatron leaves its skipped iterations out. ``StepResult.loss`` is already
    a host float (the step's one device read), so adding it up costs no synchronisation; the
    record reduces the window's sums over the groups with the step's own bookkeeping reduction."""

    def __init__(self) -> None:
        self.start()

    def start(self) -> None:
        self.loss_sum, self.tokens, self.steps = 0.0, 0, 0

    def add(self, res: StepResult) -> None:
        self.steps += 1
        if not res.skipped:
            self.loss_sum += res.loss * res.tokens
            self.tokens += res.tokens


def _paused_if(meter: ThroughputMeter, pause: bool) -> ContextManager:
    """``meter.paused()`` when ``pause`` (it synchronises the device: not on every step)."""
    return meter.paused() if pause else nullcontext()


def eval_metrics(loss_sum: float, tokens: int, nbytes: float) -> dict[str, float]:
    """docs/metrics.md (eval records): mean token loss, perplexity, bits per UTF-8 byte (nats / ln 2 / bytes)."""
    loss = loss_sum / tokens if tokens else float("nan")
    return {"loss": loss, "ppl": math.exp(loss) if tokens and loss < 700 else float("nan"),
            "bpb": loss_sum / math.log(2) / nbytes if nbytes else float("nan"),
            "tokens": int(tokens), "bytes": int(round(nbytes))}


class TrainLoop:
    def __init__(self, cfg: Config, pg: ParallelGroups, trainer: Trainer, hooks: RoundHooks,
                 writer: MetricsWriter, make_iterator: Callable[[str], BatchIterator],
                 eval_sources: Sequence[str] = (), make_eval_batches: Optional[EvalFactory] = None,
                 source_names: Sequence[str] = (), checkpointer: Optional[Any] = None) -> None:
        self.cfg = cfg
        self.pg = pg
        self.trainer = trainer
        self.hooks = hooks
        self.writer = writer
        self._make_iterator = make_iterator
        self.iterators: dict[str, BatchIterator] = {}
        # no evaluation at all when it would read no sequence (train.eval_iters / eval_samples 0),
        # rather than records of 0 tokens and NaN losses
        self.eval_sources = list(eval_sources) if cfg.train.eval_sequences() > 0 else []
        self.make_eval_batches = make_eval_batches
        self.source_names = list(source_names) or [s.name for s in cfg.data.sources]
        self.checkpointer = checkpointer
        # dept_mega.preemption.Preemption (set by dept_mega.train): asked after every step
        self.preemption: Optional[Any] = None
        self.preempted_at: Optional[int] = None  # the step saved before a preemption exit
        # a preemption in a wait of the hooks (PreemptedWait): the wait, and whether the
        # checkpoint preempted_at is of this step (else the last one before: None = none)
        self.preempted_wait: Optional[PreemptedWait] = None
        # the step of the last checkpoint this run wrote or resumed from (None: none), the same
        # on every rank (a file read could differ between nodes on a shared file system)
        self.saved_step: Optional[int] = None
        self.saved_in_wait = False
        # train.exit_interval / exit_duration_mins: why and after which step the loop stopped early
        self.exit_reason: Optional[str] = None
        self.exited_at: Optional[int] = None
        self.launched_at = time.time()  # the launch's start (dept_mega.train sets it): exit_duration_mins
        self._save_pending = False
        self._deferred_since: Optional[int] = None
        self.assignment: Optional[dict[int, str]] = None
        self.last_result: Optional[StepResult] = None
        self.eval_history: list[dict[str, Any]] = []

    # -- data ----------------------------------------------------------------------------
    def iterator(self, name: str) -> BatchIterator:
        """The batch iterator of a source, created once and kept by name."""
        if name not in self.iterators:
            it = self.hooks.make_iterator(name) if hasattr(self.hooks, "make_iterator") else None
            self.iterators[name] = it if it is not None else self._make_iterator(name)
        return self.iterators[name]

    def _position_iterator(self, source: str) -> None:
        """DEPT: put ``source``'s iterator at the source's data position from the round plan
        (the steps any group trained it so far), whichever group read them. Only the iterator
        of the source this group trains is kept — the others' positions come from the plan
        when they are trained next — so a checkpoint saves positions that agree with the plan."""
        steps_of = getattr(self.hooks, "source_steps", None)
        if steps_of is None:
            return
        for name in [n for n in self.iterators if n != source]:
            del self.iterators[name]
        it = self.iterator(source)
        if not hasattr(it, "seek"):
            raise TypeError(f"the batch iterator of source {source!r} ({type(it).__name__}) has no seek(steps); "
                            "DEPT positions every source's data from the round plan")
        it.seek(int(steps_of(source, self.trainer.step)))

    def check_data_positions(self, where: str) -> None:
        """After a resume (``dept_mega.checkpoint``): every data position the checkpoint gave
        an iterator must be the one the round plan gives at this step; otherwise the plan's
        inputs changed since the checkpoint was written, and the run would silently read
        other samples than the interrupted one. A ConfigError naming the keys."""
        steps_of = getattr(self.hooks, "source_steps", None)
        if steps_of is None:
            return
        from .config import ConfigError
        for name, it in self.iterators.items():
            had = getattr(it, "steps", None)
            plan = int(steps_of(name, self.trainer.step))
            if had is not None and int(had) != plan:
                raise ConfigError(f"{where}: source {name!r} has read {had} steps, the round plan of this launch "
                                  f"gives {plan} at step {self.trainer.step} (train.seed, dept.sampling, "
                                  "dept.temperature or data.sources differ from the run that wrote it)")

    @property
    def local_steps(self) -> int:
        return self.cfg.dept.local_steps

    def round_of(self, step: int) -> int:
        return step // self.local_steps

    # -- the loop ------------------------------------------------------------------------
    def vocab_in_use(self) -> Optional[int]:
        """The vocabulary of this rank's installed embeddings when it embeds (first pipeline
        stage), for the FLOPs of the throughput record; None elsewhere."""
        stages = getattr(self.trainer, "stages", None)
        if not stages:
            return None
        st = stages[0]
        emb = getattr(st, "embeddings", None)
        return emb.vocab_size if getattr(st, "is_first", False) and emb is not None else None

    def run(self) -> None:
        from .profiling import StepProfiler
        profiler = StepProfiler(self.cfg.train.profile, self.cfg.train.run_dir, self.pg.rank, self.trainer.device,
                                log=lambda m: write_line(m, sys.stdout))
        if self.trainer.step > 0:
            self.saved_step = self.trainer.step  # resumed from its checkpoint
        try:
            try:
                self._run(profiler)
            except PreemptedWait as stop:
                # from any wait of the hooks: a round's start or end, or the streamed outer
                # sync's exchange finished in before_step / after_step (dept/streaming.py)
                self._preempted_in_wait(stop)
            if hasattr(self.checkpointer, "wait"):
                self.checkpointer.wait()  # train.async_save: the last save is complete on return
        finally:
            profiler.close(self.trainer.step)

    def _log_gemm_tuning(self) -> None:
        """With ``fp8_gemm_tuning``: the algorithms the first step timed and kept (the cuBLASLt
        FP8 GEMMs on a GPU; nothing is tuned elsewhere), once."""
        if self.cfg.fp8 is not None and self.cfg.fp8_gemm_tuning > 1:
            from .parallel.fp8_gemm import describe_tuning, tuning_log
            if rows := tuning_log(clear=True):
                self.writer.log(describe_tuning(rows))

    def _run(self, profiler) -> None:
        cfg, tr = self.cfg, self.trainer
        total = cfg.train.steps
        L = self.local_steps
        log_every = cfg.train.log_interval
        G = self.pg.num_groups
        t_start = time.time()
        meter = ThroughputMeter(cfg.model, self.pg, tr.device)
        # the ETA's rate: the time since the first step this process trained over the steps it
        # trained — not tr.step - its start, which a federated group that healed jumps forward
        # without training the steps in between, and not counting the first round start's wait
        # (a federated fresh start waits for the other group jobs, a rejoining one heals)
        trained, t_first = 0, None
        window = LossWindow()  # the loss over the logging window (Megatron's lm loss), host floats
        evaluated_at = -1
        # optional hooks (DEPT's streamed / overlapped outer sync, dept/streaming.py)
        before_step = getattr(self.hooks, "before_step", None)
        after_step = getattr(self.hooks, "after_step", None)
        while tr.step < total:
            r = self.round_of(tr.step)
            if self.assignment is None or tr.step % L == 0:
                # the process's first round start is not training throughput (a federated fresh
                # start waits for the other group jobs, a relaunched job heals); later ones are
                with _paused_if(meter, trained == 0):
                    self.assignment = self.hooks.round_start(self, r)
                if self.pg.group_index not in self.assignment:
                    raise RuntimeError(f"round {r}: hooks.round_start gave no source for group "
                                       f"{self.pg.group_index}: {self.assignment}")
                self._position_iterator(self.assignment[self.pg.group_index])
            source = self.assignment[self.pg.group_index]
            if before_step is not None and before_step(self):
                self.assignment = None  # the round ended here for this group: the next round start now
                continue
            with _paused_if(meter, profiler.starts_or_stops(tr.step, before=True)):
                profiler.before_step(tr.step)
            if t_first is None:
                t_first = time.time()
            batch = self.iterator(source).next_step()
            if cfg.train.log_activation_norms and ((tr.step + 1) % log_every == 0 or tr.step + 1 == total):
                res = tr.train_step(batch, activation_norms=True)  # a step that logs: measure them
            else:
                res = tr.train_step(batch)
            with _paused_if(meter, profiler.starts_or_stops(tr.step, before=False)):  # writing the trace
                profiler.after_step(tr.step)
            left = after_step is not None and after_step(self)
            self.last_result = res
            trained += 1
            if trained == 1:
                self._log_gemm_tuning()
            meter.add_step(res.tokens, self.vocab_in_use())
            window.add(res)
            if left:  # (as before_step's)
                self.assignment = None
                continue
            step = tr.step
            if step % log_every == 0 or step == total:
                ops.check_errors(tr.device)  # the CUDA ops' invalid ids (no sync inside a step)
                rec = self._train_record(res, source, window)
                rec.update(meter.window())
                now = time.time()
                self.writer.write("train", step, self.round_of(step - 1), **rec)
                elapsed = now - t_start
                eta_rate = (now - t_first) / trained
                self.writer.log(human_line(step, total, rec["loss"], rec["lr"], rec["tokens_per_s"], elapsed,
                                           eta_rate * (total - step), tr.nonfinite_total,
                                           rec["tflops_per_device"], rec["mfu"], rec.get("mem_peak_gb"),
                                           grad_norm=rec["grad_norm"],
                                           consumed=(rec["consumed_samples"], rec["consumed_tokens"], G),
                                           loss_window=rec["loss_window"] if window.steps > 1 else None,
                                           act_rms_max=rec.get("act_rms_max")))
                window.start()
            if step % L == 0 or step == total:
                t0 = time.time()
                outer = self.hooks.round_end(self, self.round_of(step - 1))
                if outer is not None:
                    outer.setdefault("seconds", time.time() - t0)
                    written = self.writer.write("outer", step, self.round_of(step - 1), **outer)
                    if written is not None:  # global rank 0
                        self.writer.log(outer_line(written))
            stopping = self._stop_agreed()  # before an evaluation: a stop's time goes to its save
            if cfg.train.eval_interval and step % cfg.train.eval_interval == 0 and step < total:
                if not stopping:
                    with meter.paused():  # evaluation and checkpoints are not training throughput
                        self.evaluate()
                    evaluated_at = step
                    stopping = self._stop_agreed()  # a signal during the evaluation
                elif self.eval_sources:
                    self.writer.log(f"eval step {step} skipped: {stopped_by(self.preemption)}, the time goes to "
                                    f"the checkpoint")
            if self.checkpointer is not None and cfg.train.save_interval and step % cfg.train.save_interval == 0 \
                    and step < total:
                self._save_pending = True
            if not stopping and self.exit_reason is None and step < total:
                self.exit_reason = self._exit_due(step)
            if (stopping or self.exit_reason) and step < total:
                self._save_pending = True
                if self.checkpointer is None:
                    self._stopped(step, stopping)
                    return
            if self._save_pending and step < total and self._can_save(step):
                with meter.paused():
                    self.save()
                if not (stopping or self.exit_reason):  # a signal during this save: stop at it, no second save
                    stopping = self._stop_agreed(announce=bool(cfg.train.async_save))
                if stopping or self.exit_reason:
                    self._stopped(step, stopping)
                    return
        if self.eval_sources and evaluated_at != tr.step:
            self.evaluate()
        if self.checkpointer is not None:
            self.save()
        ops.check_errors(tr.device)  # the last steps' (and evaluation's) invalid ids

    # -- stopping early ------------------------------------------------------------------
    def _exit_due(self, step: int) -> Optional[str]:
        """Why the run stops cleanly after ``step`` (None: it goes on); the same on every rank:
        the interval is arithmetic, the wall time is agreed with one all-reduce (MAX) per step."""
        t = self.cfg.train
        if t.exit_interval and step % t.exit_interval == 0:
            return f"train.exit_interval={t.exit_interval}"
        if t.exit_duration_mins is None:
            return None
        minutes = (time.time() - self.launched_at) / 60.0
        from .parallel.agree import world_max
        if world_max([minutes > t.exit_duration_mins], self.trainer.device)[0]:
            return f"train.exit_duration_mins={t.exit_duration_mins:g} ({minutes:.1f} min since launch)"
        return None

    def _stop_agreed(self, announce: bool = True) -> bool:
        """:meth:`Preemption.agreed` (collective: every rank at the same point); the first time
        it says stop before the last step, global rank 0 announces it in ``RUN/preempted.json``
        before the save (preemption.announce_stop; not for a Ctrl-C, which is not requeued; at
        the last step the run finishes as usual). ``announce`` False: after a save that is
        complete (dept_mega.train writes the marker next)."""
        p = self.preemption
        if p is None:
            return False
        new = p.stop_signal is None
        if not p.agreed(self.trainer.device):
            return False
        if new and announce and self.checkpointer is not None and self.pg.rank == 0 and not p.interrupted \
                and self.trainer.step < self.cfg.train.steps:
            announce_stop(self.cfg.train.run_dir, p.signal_name)
        return True

    def _preempted_in_wait(self, stop: PreemptedWait) -> None:
        """A preemption agreed while the hooks waited for others (a federated group job at
        torchft's quorum): a checkpoint of this step when ``stop.synced`` (a round start: the
        state a periodic save after the previous round's end holds) and none was written at it;
        otherwise — inside a round's end, its outer sync not done — nothing is saved: the
        checkpoint format holds a round boundary as after its sync, and a resume there would
        skip the pending one, so the relaunch resumes from the last checkpoint, as after a kill
        (a federated group then heals from the live groups). ``preempted_at``: the step a
        relaunch resumes from (None: no checkpoint, it starts anew)."""
        self.preempted_wait = stop
        step = self.trainer.step
        if self.checkpointer is None:
            self.preempted_at = None
            return
        if hasattr(self.checkpointer, "wait"):
            self.checkpointer.wait()
        last = self.saved_step
        can = getattr(self.hooks, "can_save_now", None)
        if stop.synced and step > 0 and last != step and (can is None or can()):
            p = self.preemption
            if self.pg.rank == 0 and not stop.finished and p is not None and not p.interrupted:
                # (as _stop_agreed: before the save)
                announce_stop(self.cfg.train.run_dir, "quorum_give_up" if stop.gave_up else p.signal_name)
            self.save()
            if hasattr(self.checkpointer, "wait"):
                self.checkpointer.wait()
            self.saved_in_wait, last = True, step
        self.preempted_at = last

    def _stopped(self, step: int, preempted: bool) -> None:
        if preempted:
            self.preempted_at = step
        else:
            self.exited_at = step

    # -- checkpoints ---------------------------------------------------------------------
    def _can_save(self, step: int) -> bool:
        can = getattr(self.hooks, "can_save_now", None)
        if can is None or can():
            if self._deferred_since is not None:
                self.writer.log(f"checkpoint: deferred since step {self._deferred_since} (outer sync in flight), "
                                f"saving at step {step}")
                self._deferred_since = None
            return True
        if self._deferred_since is None:
            self._deferred_since = step
            self.writer.log(f"checkpoint: due at step {step}, deferred while an outer sync is in flight")
        return False

    def save(self) -> str:
        """Write a checkpoint of this step (``train.async_save``: start writing it) and log its
        size once complete (and what retention removed)."""
        # an invalid id met by the compiled ops since the last log step (their errors are raised
        # at checks, not inside a step) is raised before its results can be saved
        ops.check_errors(self.trainer.device)
        if hasattr(self.checkpointer, "on_saved"):
            self.checkpointer.on_saved = self._log_saved
        path = self.checkpointer.save(self)
        self._save_pending = False
        self.saved_step = self.trainer.step
        return path

    def _log_saved(self, step: int, size: int, removed: Sequence[int], seconds: float) -> None:
        how = " (written in the background)" if self.cfg.train.async_save else ""
        line = f"checkpoint step {step}: {size:,} bytes ({size / 2**30:.3f} GiB) in {seconds:.1f} s{how}"
        if removed:
            line += (f"; removed step(s) {', '.join(map(str, sorted(removed)))} "
                     f"(train.keep_checkpoints={self.cfg.train.keep_checkpoints})")
        self.writer.log(line)

    # -- records -------------------------------------------------------------------------
    def _train_record(self, res: StepResult, source: str, window: LossWindow) -> dict[str, Any]:
        G = self.pg.num_groups
        act = res.act_sums  # the group's activation sums (train.log_activation_norms), or None
        if G == 1:
            losses = [res.loss]
            tokens = [res.tokens]
            norms = [res.grad_norm]
            win_sum, win_tokens = window.loss_sum, window.tokens
        else:
            # Five slots per group, filled by the group's first rank (bookkeeping reduction); the
            # logging window's sums ride along (no reduction of their own), and so do the
            # activation sums when measured (the same step on every rank)
            w = 5 + (len(act) if act is not None else 0)  # slots per group
            v = torch.zeros(w * G, dtype=torch.float64, device=self.trainer.device)  # NCCL: on the GPU
            if self.pg.rank == self.pg.rank_of(0, 0, 0, self.pg.group_index):
                g = self.pg.group_index
                v[w * g:w * g + w] = torch.tensor([res.loss * res.tokens, res.tokens, res.grad_norm,
                                                   window.loss_sum, window.tokens, *(act or [])], dtype=torch.float64)
            dist.all_reduce(v)
            vals = v.cpu().tolist()
            tokens = [int(vals[w * g + 1]) for g in range(G)]
            losses = [vals[w * g] / max(tokens[g], 1) for g in range(G)]
            norms = [vals[w * g + 2] for g in range(G)]
            win_sum, win_tokens = sum(vals[3::w]), sum(vals[4::w])
            if act is not None:  # pooled over the groups: every group's tokens
                act = [sum(vals[w * g + 5 + i] for g in range(G)) for i in range(len(act))]
        total_tokens = sum(tokens)
        loss = sum(l * t for l, t in zip(losses, tokens)) / max(total_tokens, 1)
        assignment = self.assignment or {0: source}
        if set(assignment.values()) == {BLEND}:
            names = self.source_names
            by_source = {names[k] if k < len(names) else str(k): res.loss_sum_by_source[k] / t
                         for k, t in res.tokens_by_source.items() if t > 0}
        else:
            sums: dict[str, list[float]] = {}
            for g in range(G):
                name = assignment[g]
                acc = sums.setdefault(name, [0.0, 0.0])
                acc[0] += losses[g] * tokens[g]
                acc[1] += tokens[g]
            by_source = {n: s / t for n, (s, t) in sums.items() if t > 0}
        return {"loss": loss, "loss_window": win_sum / win_tokens if win_tokens else float("nan"),
                "lr": res.lr, "grad_norm": sum(norms) / len(norms), "tokens": total_tokens,
                "sources": {str(g): s for g, s in sorted(assignment.items())}, "loss_by_source": by_source,
                "skipped": int(self.trainer.nonfinite_total),
                "consumed_samples": self.trainer.consumed_samples,
                "consumed_tokens": self.trainer.consumed_samples * self.cfg.model.seq_length,
                **(activation_fields(act) if act is not None else {})}

    # -- evaluation ----------------------------------------------------------------------
    def evaluate(self) -> dict[str, dict[str, float]]:
        """Evaluate every source on its validation split; writes a ``kind: "eval"`` record.
        Where the hooks share the sources out over the groups (``eval_assignment``: after a
        round's sync every group would compute the same numbers, dept/eval_split.py) each
        group evaluates its share and the sums are gathered; otherwise every group evaluates
        every source and the record is global rank 0's (group 0's)."""
        if self.make_eval_batches is None or not self.eval_sources:
            return {}
        share = getattr(self.hooks, "eval_assignment", None)
        owners = share(self.eval_sources) if share is not None else None
        sums: dict[str, tuple[float, int, float]] = {}
        for name in self.eval_sources:
            if owners is not None and owners[name] != self.pg.group_index:
                continue
            if owners is not None:
                ctx = self.hooks.eval_context(self, name, alone=True)
            else:
                ctx = self.hooks.eval_context(self, name) if hasattr(self.hooks, "eval_context") else nullcontext()
            with ctx:
                loss_sum, tokens, nbytes = 0.0, 0, 0.0
                for batch in self.make_eval_batches(name):
                    s, t = self.trainer.eval_batches(batch.micro_batches)
                    loss_sum += s
                    tokens += t
                    nbytes += float(batch.nbytes)
            sums[name] = (loss_sum, tokens, self._sum_over_dp(nbytes))
        if owners is not None:
            sums = self._gather_sums(sums, owners)
        by_source = {name: eval_metrics(*sums[name]) for name in self.eval_sources}
        step = self.trainer.step
        self.writer.write("eval", step, self.round_of(max(step - 1, 0)), by_source=by_source)
        parts = " | ".join(f"{n}: loss {v['loss']:.4f} bpb {v['bpb']:.4f}" for n, v in by_source.items())
        self.writer.log(f"eval step {step} | {parts}")
        self.eval_history.append({"step": step, "by_source": by_source})
        return by_source

    def _gather_sums(self, sums: dict[str, tuple[float, int, float]],
                     owners: dict[str, int]) -> dict[str, tuple[float, int, float]]:
        """Every source's (loss sum, tokens, bytes) on every rank, from the first rank (tp, dp,
        pp = 0) of the group that evaluated it (``owners``; group 0's is global rank 0, the rank
        that writes the record when every group evaluates everything): one float64 all-reduce
        (bookkeeping, not counted) in which the other ranks add zeros, so each value arrives bit
        for bit (x + 0.0 = x; token counts are exact in float64 below 2^53)."""
        names = self.eval_sources
        v = torch.zeros(3 * len(names), dtype=torch.float64, device=self.trainer.device)  # NCCL: on the GPU
        for i, n in enumerate(names):
            if self.pg.rank == self.pg.rank_of(0, 0, 0, owners[n]):
                loss_sum, tokens, nbytes = sums[n]
                v[3 * i:3 * i + 3] = torch.tensor([loss_sum, float(tokens), nbytes], dtype=torch.float64)
        dist.all_reduce(v)
        vals = v.cpu().tolist()
        return {n: (vals[3 * i], int(vals[3 * i + 1]), vals[3 * i + 2]) for i, n in enumerate(names)}

    def _sum_over_dp(self, x: float) -> float:
        if self.pg.dp is None:
            return x
        t = torch.tensor([x], dtype=torch.float64, device=self.trainer.device)
        dist.all_reduce(t, group=self.pg.dp)  # bookkeeping, not counted
        return float(t.item())
