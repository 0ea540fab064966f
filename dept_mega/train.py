"""Training entry point.

    torchrun --standalone --nproc-per-node N -m dept_mega.train --config CFG.yaml [key.sub=value ...]

Writes ``RUN/config.yaml`` (the resolved config of the launch that trains; every launch's in
``RUN/configs/launch_N.yaml``, each checkpoint's in ``step_N/config.yaml``: ``dept_mega.run_configs``),
``RUN/metrics.jsonl`` (docs/metrics.md), a log line
every ``train.log_interval`` steps, evaluation per source every ``train.eval_interval`` steps
and at the end, and checkpoints (``RUN/checkpoints/step_N`` + ``latest``) every
``train.save_interval`` steps and at the end. A run whose ``run_dir`` holds a checkpoint
resumes from ``latest`` (or, when that one is damaged, the newest verified checkpoint before
it; docs/launching.md "After a crash"). One job at a time holds a run directory
(``dept_mega.rundir``). SIGTERM / SIGUSR1 make every rank finish its step, save a checkpoint,
write ``RUN/preempted.json`` and exit with status 75 (``dept_mega.preemption``).
``train.exit_interval`` / ``train.exit_duration_mins`` stop the run cleanly the same way (checkpoint,
status 0; a relaunch continues the schedule). ``--print-config`` and ``--check --world-size N``
(``dept_mega.preflight``) look at a config without launching it.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .config import Config, ConfigError, held_here, load_config, validate
from .loop import BLEND, EvalStep, StdHooks, TrainLoop
from .megatron_flags import parse_with_hints
from .metrics import MetricsWriter, write_json_atomic
from .dept.federation_config import resolve as resolve_federation
from .parallel.agree import is_agreed
from .parallel.groups import ParallelGroups, build_groups, init_distributed
from .process_exit import report_error
from .run_inputs import describe_batch, input_errors, vocab_size_of  # noqa: F401 - re-exported
from .trainer import MicroBatch, Trainer
from .variant import variant_of


def parse_args(argv: Optional[Sequence[str]], prog: str, checks: bool = False) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="YAML config (keys: docs/config.md)")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tensor=2")
    if checks:
        ap.add_argument("--print-config", action="store_true",
                        help="print the resolved config (defaults included) as YAML and exit")
        ap.add_argument("--check", action="store_true",
                        help="run the pre-flight for --world-size ranks (layout, data, tokenizers, memory per "
                             "rank, disk space) without torchrun and without training; exit 0, or 2 naming the key")
        ap.add_argument("--world-size", type=int, default=None, help="ranks of the job that --check checks")
    args = parse_with_hints(ap, argv)
    if checks and args.check and (args.world_size is None or args.world_size < 1):
        ap.error("--check needs --world-size N (N >= 1): the number of ranks the job will start")
    return args


@dataclass
class RunData:
    """The datasets of a run and the factories the loop uses."""
    cfg: Config
    pg: ParallelGroups
    train: dict[str, Any]
    valid: dict[str, Any]

    def make_iterator(self, name: str):
        from .data.sources import BlendedBatches, SourceBatches
        t = self.cfg.train
        if name == BLEND:
            datasets = list(self.train.values())
            return BlendedBatches(datasets, self.blend_weights(), t.global_batch_size, t.micro_batch_size,
                                  self.pg.dp_rank, self.pg.dp_size, seed=t.seed)
        if name not in self.train:
            raise KeyError(f"no source named {name!r} (sources: {sorted(self.train)})")
        return SourceBatches(self.train[name], t.global_batch_size, t.micro_batch_size,
                             self.pg.dp_rank, self.pg.dp_size)

    def blend_weights(self):
        """STD: each source's probability in the batch mix (dept.sampling over the train parts'
        tokens and data.sources[i].weight, as DEPT's round sampler counts them)."""
        from .data.sources import blend_shares
        return blend_shares(self.cfg, list(self.train), [d.num_tokens for d in self.train.values()])

    def make_eval_batches(self, name: str):
        """This rank's evaluation steps of source ``name``: ``train.eval_iters`` global batches
        of ``train.global_batch_size`` validation sequences (one group's, as in training), each
        rank its share in micro-batches; the same samples under any layout (ValidationBatches)."""
        from .data.sources import ValidationBatches
        t = self.cfg.train
        vb = ValidationBatches(self.valid[name], t.global_batch_size, t.micro_batch_size, t.eval_iters,
                               self.pg.dp_rank, self.pg.dp_size, samples=t.eval_samples)
        for batch in vb:
            yield EvalStep(micro_batches=[MicroBatch(tokens, rows=rows)
                                          for tokens, rows in zip(batch.micro_batches, batch.rows)],
                           nbytes=float(batch.bytes.sum()))


def load_run_data(cfg: Config, pg: ParallelGroups, eval_part: str = "valid", extra_sources: Sequence = ()) -> RunData:
    """The run's datasets: each source's train part, and the part evaluation reads (``valid``, or
    ``test`` for ``dept_mega.evaluate --part test``) of each source and of ``extra_sources``
    (``dept_mega.evaluate --extra-source``: evaluated only)."""
    from .data.sources import source_datasets
    held = held_here(cfg)  # a federated group job opens only its own sources' files
    mine = cfg.data.sources if held is None else [cfg.data.sources[i] for i in held]
    names = [s.name for s in mine]
    train = dict(zip(names, source_datasets(cfg, "train", sources=mine)))
    valid = dict(zip(names, source_datasets(cfg, eval_part, sources=mine)))
    if extra_sources:
        valid.update(zip([s.name for s in extra_sources], source_datasets(cfg, eval_part, sources=extra_sources)))
    return RunData(cfg, pg, train, valid)


def build_hooks(cfg: Config, pg: ParallelGroups, trainer: Trainer, device: torch.device):
    if not variant_of(cfg).rounds:
        return StdHooks()
    try:
        try:
            from .dept import build_round_hooks
        except ImportError:
            from .dept.driver import build_round_hooks
    except ImportError as exc:
        raise ConfigError(f"config key 'dept.variant': {cfg.dept.variant!r} needs dept_mega.dept."
                          f"build_round_hooks, which is not available ({exc})") from exc
    return build_round_hooks(cfg, pg, trainer, device)


@dataclass
class Session:
    """Everything a run (or an evaluation) needs, built the same way by train and evaluate."""
    cfg: Config
    pg: ParallelGroups
    device: torch.device
    trainer: Trainer
    loop: TrainLoop
    writer: MetricsWriter
    rank: int
    sampling: str = ""  # each source's share of the training (the start-up log's "sampling" line)


def checked_on_rank0(check, rank: int, device: torch.device) -> None:
    """Run ``check`` on global rank 0 only (e.g. a pass over the data that is cached after) and
    raise its input error as the same error on every rank (marked agreed: one line); any other
    exception of rank 0's does not leave the other ranks waiting for its verdict
    (:func:`dept_mega.parallel.agree.agree_errors`)."""
    from .parallel.agree import agree_errors
    agree_errors(check if rank == 0 else (lambda: None), input_errors(), device)


def build_session(cfg: Config, metrics: bool = True,
                  prepare_stages: Optional[Callable[[list, ParallelGroups, torch.device], None]] = None,
                  federate: bool = True, eval_part: str = "valid", extra_sources: Sequence = ()) -> Session:
    """Everything a run needs. ``prepare_stages(stages, pg, device)``, when given, sees the
    freshly built fp32 model chunks before the trainer takes them (``dept_mega.adapt``: load a
    trained body, freeze it). ``federate=False``: a federated group job's session without its
    lighthouse and peers (``dept_mega.evaluate`` of its checkpoint after the run).
    ``eval_part``: the part of ``data.split`` evaluation reads (``valid``; ``test``).
    ``extra_sources``: ``SourceConfig``s evaluated after the run's own sources with the run's
    global vocabulary, never trained (``dept_mega.evaluate --extra-source``, dept_mega.eval_sources)."""
    from .data.checks import check_sources
    from .parallel.agree import agree_errors
    rank, world, device = init_distributed(timeout_s=cfg.train.init_timeout_s, device=cfg.train.device)
    # checks each rank makes itself (no collective inside) raise one agreed error on every rank:
    # the job prints it once (dept_mega.process_exit.report_error)
    agree_errors(lambda: validate(cfg, world), input_errors(), device)
    from .model.backends import resolve_backends  # a backend this machine lacks (Transformer Engine): one line
    agree_errors(lambda: resolve_backends(cfg, device), input_errors(), device)
    # the data first (empty sources, token ids outside the vocabulary): before any heavy work
    checked_on_rank0(lambda: check_sources(cfg, eval_part), rank, device)
    if extra_sources:
        from .eval_sources import check_extra_sources
        checked_on_rank0(lambda: check_extra_sources(cfg, extra_sources, eval_part), rank, device)
    p = cfg.parallel
    pg = build_groups(p.tensor, p.data, p.pipeline)
    eval_only = None
    federated = agree_errors(lambda: resolve_federation(cfg), input_errors(), device)
    if federated is not None:  # this job is one group of several (dept/federation.py)
        from .dept.federation import FederatedOuter, Federation, Offline
        from .dept.federation_config import own_sources
        group = federated[0]
        pg.outer = FederatedOuter(Federation(cfg, pg, device, *federated) if federate
                                  else Offline(group, cfg.federation.groups))
        eval_only = own_sources(cfg)  # the others' embeddings are in other jobs
    from .data.index_build import prepare_indexes
    prepare_indexes(cfg, rank, device, eval_part, extra_sources)  # the ranks build missing indexes between them
    data, vocab = agree_errors(lambda: (load_run_data(cfg, pg, eval_part, extra_sources), vocab_size_of(cfg)),
                               input_errors(), device)
    torch.manual_seed(cfg.train.seed)
    stages = None
    if prepare_stages is not None:
        from .model import build_model
        stages = build_model(cfg, pg, vocab, cfg.train.seed, device)
        prepare_stages(stages, pg, device)
    trainer = Trainer(cfg, pg, device, vocab_size=vocab, stages=stages)
    hooks = build_hooks(cfg, pg, trainer, device)
    if extra_sources:
        from .eval_sources import register_extra_sources
        agree_errors(lambda: register_extra_sources(cfg, hooks, extra_sources, vocab), input_errors(), device)
    writer = MetricsWriter(cfg.train.run_dir if metrics else None, enabled=(rank == 0) and metrics,
                           tensorboard=cfg.train.tensorboard, wandb=cfg.train.wandb, config=cfg.to_dict())
    from .checkpoint import Checkpointer
    loop = TrainLoop(cfg, pg, trainer, hooks, writer, data.make_iterator,
                     eval_sources=[n for n in data.valid if eval_only is None or n in eval_only
                                   or n in {s.name for s in extra_sources}],
                     make_eval_batches=data.make_eval_batches,
                     checkpointer=Checkpointer(cfg.train.run_dir))
    return Session(cfg, pg, device, trainer, loop, writer, rank, sampling_of(cfg, hooks, data))


def sampling_of(cfg: Config, hooks, data: RunData) -> str:
    """The start-up log line of each source's actual share under dept.sampling: STD's blend
    probabilities, or DEPT's share of the run's group-rounds from its round plans."""
    if hasattr(hooks, "sampling_line"):
        return hooks.sampling_line()
    from .data.sources import sampling_line
    return sampling_line(cfg.dept.sampling, list(data.train), data.blend_weights())


def describe(session: Session, label: Optional[str] = None) -> str:
    """The launch's summary lines; ``label`` replaces the first words (``dept_mega: VARIANT``:
    ``dept_mega.adapt`` says what it trains instead)."""
    from .export.hf_mapping import export_line
    from .model.gpt import describe_backends
    from .ops import describe as describe_ops
    from .parallel.device import describe_device
    cfg, pg = session.cfg, session.pg
    n_body = sum(p.numel() for p in session.trainer.body_parameters())
    n_emb = sum(p.numel() for p in session.trainer.embedding_parameters())
    head = label if label is not None else f"dept_mega: {cfg.dept.variant}"
    return (f"{head} | world {pg.world_size} = groups {pg.num_groups} × data {pg.dp_size} × "
            f"pipeline {pg.pp_size} (virtual {cfg.parallel.virtual_pipeline}) × tensor {pg.tp_size}"
            f"{' + sequence parallel' if cfg.parallel.sequence_parallel else ''}\n"
            f"backends: {describe_backends(cfg, session.device)} | {describe_ops(session.device)} | precision: "
            f"{session.trainer.precision.describe()} | {describe_device(cfg.train.device, session.device)}\n"
            f"rank 0 parameters: body {n_body:,}, embeddings {n_emb:,}\n{describe_batch(cfg, pg.num_groups)}\n"
            f"{export_line(cfg.model)}"
            + (f"\n{session.sampling}" if session.sampling else ""))


def write_params(session: Session) -> None:
    """``RUN/params.json``: the parameters each rank holds at the end of the run (body and the
    installed source's embeddings), gathered with a bookkeeping collective (not counted), and
    where the rank ran: its host and torchrun's node index (``GROUP_RANK``) and local rank, which
    show how ranks, groups and nodes lined up (docs/launching.md section 2)."""
    import socket
    pg, tr = session.pg, session.trainer
    loop = session.loop
    mine = {"rank": pg.rank, "host": socket.gethostname(), "node": int(os.environ.get("GROUP_RANK", "0")),
            "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
            "group": pg.group_index, "tp": pg.tp_rank, "dp": pg.dp_rank, "pp": pg.pp_rank,
            "source": (loop.assignment or {}).get(pg.group_index),
            "body": sum(p.numel() for p in tr.body_parameters()),
            "embeddings": sum(p.numel() for p in tr.embedding_parameters())}
    ranks = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
    if session.rank == 0:
        write_json_atomic(os.path.join(session.cfg.train.run_dir, "params.json"), {"ranks": ranks})


def main(argv: Optional[Sequence[str]] = None) -> int:
    import time
    launched_at = time.time()  # train.exit_duration_mins counts from here
    args = parse_args(argv, "python -m dept_mega.train", checks=True)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        report_error(str(exc))  # before the process group: rank 0's line speaks for all
        return 2
    if args.print_config:
        import yaml
        sys.stdout.write(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        return 0
    if args.check:
        from .preflight import run_check
        return run_check(cfg, args.world_size)
    from .preemption import Preemption
    from .rundir import take_run_dir
    run_dir = cfg.train.run_dir
    lock = None
    # from the start: a signal during start-up stops the run after its first step, saved
    preemption = Preemption().install()
    try:
        try:
            rank, world, device = init_distributed(timeout_s=cfg.train.init_timeout_s, device=cfg.train.device)
            # before any heavy work: the run directory is usable and no other job holds it
            lock = take_run_dir(run_dir, rank, device, check=lambda: validate(cfg, world))
            from .resume import CKPT_DIR
            if (variant_of(cfg).own_embeddings and cfg.dept.untrained_sources == "error"
                    and not os.path.exists(os.path.join(run_dir, CKPT_DIR, "latest"))):
                # a fresh run whose plans leave a SPEC source untrained: refused before the session
                # (its metrics writer starts tb/ and a W&B run); a resume is checked after its load,
                # against the schedule it continues (rebased on another number of groups)
                from .parallel.agree import agree_errors
                from .sampling_plan import check_untrained, plan_scheduler, sampling_groups
                agree_errors(lambda: check_untrained(cfg, plan_scheduler(cfg, sampling_groups(cfg, world))),
                             (ConfigError,), device)
            session = build_session(cfg)
            loop = session.loop
            loop.launched_at = launched_at
            resumed = loop.checkpointer.load(loop)
            initialised = None
            hooks = getattr(loop, "hooks", None)
            if getattr(hooks, "scheduler", None) is not None:  # after the resume: the schedule it continues
                from .parallel.agree import agree_errors
                from .sampling_plan import check_untrained
                agree_errors(lambda: check_untrained(cfg, hooks.scheduler), (ConfigError,), session.device)
            if resumed is None and cfg.train.init_from is not None:
                from .init_from import init_from
                initialised = init_from(session.trainer, cfg, session.device, hooks)
            elif resumed is not None:  # SPEC / SPEC-OPT: sources not trained yet still start from it
                from .init_from import resume_sources
                resume_sources(hooks, cfg, session.device)
        except input_errors() as exc:
            report_error(str(exc), agreed=is_agreed(exc))
            return 2
        from .checkpoint_space import EXIT_NO_SPACE, CheckpointSpaceError
        try:
            return _train(session, resumed, preemption, initialised)
        except CheckpointSpaceError as exc:  # every rank; one line for the job
            report_error(str(exc), agreed=True)
            return EXIT_NO_SPACE
        except ConfigError as exc:  # federation: a check at the first quorum, before any training
            report_error(str(exc), agreed=is_agreed(exc))
            return 2
    finally:
        preemption.uninstall()
        if lock is not None:
            lock.release()


def _train(session: Session, resumed: Optional[int], preemption=None, initialised: Optional[str] = None) -> int:
    cfg, loop = session.cfg, session.loop
    run_dir = cfg.train.run_dir
    if session.rank == 0:
        from .data.checks import source_warnings
        from .sampling_plan import sampling_groups, sampling_warnings
        from .schedule_warnings import schedule_warnings
        # the round plans the run draws (its driver's), as the sampling line counted them
        sampling = sampling_warnings(cfg, sampling_groups(cfg, session.pg.world_size),
                                     getattr(loop.hooks, "scheduler", None))
        for note in [*loop.checkpointer.notes, *sampling, *schedule_warnings(cfg),
                     *source_warnings(cfg)]:
            print(f"warning: {note}", file=sys.stderr)
    # metrics.jsonl continues from the checkpoint: the interrupted run's later records go
    dropped = session.writer.resume_at(resumed or 0)
    complete = session.trainer.step >= cfg.train.steps
    launch_file, wrote_config = None, False
    if session.rank == 0:  # after a successful resume: a refused launch leaves the run's configs as they were
        from .run_configs import record_launch
        os.makedirs(run_dir, exist_ok=True)
        launch_file, wrote_config = record_launch(cfg, run_dir, session.trainer.step, not complete, resumed)
    session.writer.log(describe(session))
    if launch_file is not None:
        session.writer.log(f"config: {launch_file}" + ("" if wrote_config else
                           f" ({run_dir}/config.yaml left as the config of the launch that trained the run)"))
    if resumed is not None:
        session.writer.log(f"resumed from {run_dir}/checkpoints/step_{resumed}"
                           + (f" (train.init_from={cfg.train.init_from} not used: the run's own checkpoint wins)"
                              if cfg.train.init_from is not None else ""))
    if initialised is not None:
        session.writer.log(f"model weights from {initialised} (train.init_from); optimizer state, step and data "
                           f"position start fresh")
    if dropped:
        session.writer.log(f"metrics.jsonl: dropped {dropped} record(s) after step {resumed or 0}, written by the "
                           f"interrupted run after its last checkpoint")
    for note in session.writer.resume_notes:
        session.writer.log(note)
    from .preemption import EXIT_PARTNERS_FINISHED, Preemption, clear_marker, stopped_by, write_marker
    if session.rank == 0:
        clear_marker(run_dir)
    if preemption is None:
        preemption = Preemption().install()
    loop.preemption = preemption
    finished = False  # the run is complete in this job (a federated group job says so at the lighthouse)
    try:
        if complete:
            session.writer.log(f"nothing to do: the run is complete at step {session.trainer.step}")
        else:
            loop.run()
        stop = loop.preempted_wait
        if stop is not None:  # a federated group job preempted while waiting for the other groups
            at = session.trainer.step
            if loop.saved_in_wait:
                saved = f"checkpoint of step {at} written"
            elif stop.synced and loop.preempted_at == at:
                saved = f"the checkpoint of step {at} was written before"
            else:
                why = ("nothing trained" if stop.synced else
                       "round's outer sync not done: a checkpoint holds a round's end only after it")
                saved = (f"no checkpoint of step {at} ({why}); a relaunch resumes from "
                         + (f"step {loop.preempted_at}" if loop.preempted_at is not None else "the start"))
            by = f"gave up ({stop.gave_up})" if stop.gave_up else stopped_by(preemption)
            if stop.finished:  # the other groups finished the run: a requeue would only wait again
                session.writer.log(f"federation: {stop.finished}: stopped {stop.what}; {saved}; exiting with status "
                                   f"{EXIT_PARTNERS_FINISHED}")
            else:
                session.writer.log(f"{by} while {stop.what}: stopped waiting; {saved}; "
                                   f"exiting with status {preemption.exit_code} ({continue_by(preemption)})")
            if session.rank == 0 and not preemption.interrupted and not stop.finished:
                write_marker(run_dir, loop.preempted_at, "quorum_give_up" if stop.gave_up else preemption.signal_name)
        elif loop.preempted_at is not None:
            session.writer.log(f"{stopped_by(preemption)}: checkpoint of step {loop.preempted_at} "
                               f"written; exiting with status {preemption.exit_code} ({continue_by(preemption)})")
            if session.rank == 0 and not preemption.interrupted:
                write_marker(run_dir, loop.preempted_at, preemption.signal_name)
        elif loop.exited_at is not None:
            session.writer.log(f"stopped after step {loop.exited_at} of {cfg.train.steps} ({loop.exit_reason}): "
                               f"checkpoint written; relaunch to continue with the same schedule")
        elif not complete:  # a relaunch of a finished run keeps the params.json of the layout that trained it
            write_params(session)
        finished = session.trainer.step >= cfg.train.steps and stop is None and loop.preempted_at is None
        if finished and session.rank == 0:  # a stop agreed too late to be one (its save deferred to the end)
            clear_marker(run_dir)
    finally:
        preemption.uninstall()
        fed = getattr(session.pg.outer, "federation", None)
        try:
            if fed is not None:
                fed.shutdown()
                if finished and session.rank == 0:  # (after its heartbeats stopped: federation_finished.py)
                    fed.finished(session.trainer.step)
        finally:  # the log is closed (flushed) even when the federation's shutdown raises
            session.writer.close()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    if loop.preempted_wait is not None:
        # the abandoned wait's thread is torchft's quorum worker (a ThreadPoolExecutor's, which
        # the interpreter joins at exit), blocked in its call to the lighthouse for up to its
        # quorum timeout (a day): the process ends here, its output flushed (the kernel drops
        # the run directory's locks); everything else is done above
        from .process_exit import leave
        leave(EXIT_PARTNERS_FINISHED if loop.preempted_wait.finished else preemption.exit_code, join_threads=False)
    return preemption.exit_code if loop.preempted_at is not None else 0


def continue_by(preemption) -> str:
    return "relaunch to continue" if preemption.interrupted else "requeue to continue"


if __name__ == "__main__":
    from dept_mega.process_exit import exit_after
    exit_after(main)
