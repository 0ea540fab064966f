"""Evaluate a run's saved weights per source (docs/metrics.md, eval records).

    torchrun ... -m dept_mega.evaluate --run-dir RUN [--step S] --out RESULT.json [--part valid|test]
        [--extra-source NAME=PREFIX ...] [key=value ...]

Reads ``RUN/config.yaml`` (its relative paths from the directory the run was launched from,
dept_mega.run_paths; then the ``key=value`` overrides, whose paths are read from here), rebuilds
the model in the run's layout (same tensor and pipeline sizes, any number of groups and
data-parallel size; overrides such as ``parallel.pipeline=1 parallel.tensor=1`` evaluate in
another one, e.g. in one process: the checkpoint loads under any tensor, pipeline and
data-parallel size, and under another number of source groups unless its step is inside a
round, its sources belong to groups or it has outer fragments, docs/launching.md section 10), loads
``RUN/checkpoints/step_S`` (default: ``latest``, or the newest verified checkpoint before it
when that one is damaged) and writes ``RESULT.json``: one ``eval``
record (``kind, step, round, time, part, by_source: {source: {loss, ppl, bpb, tokens, bytes}}``),
computed exactly as the run's periodic evaluation (``train.eval_iters`` global batches of
``train.global_batch_size`` sequences of each source's validation part, or
``train.eval_samples`` sequences when the run sets it, unless ``--eval-iters`` says otherwise:
the same sequences in any layout, dept_mega.data.sources.ValidationBatches). ``--part test``
reads each source's test part instead (the third weight of ``data.split``, which training
never reads). ``--extra-source NAME=PREFIX`` (repeatable) also evaluates data the run never
trained on, tokenized with its global tokenizer, under the name given (std, glob, trim; the
variants whose sources own their embeddings are refused with a pointer to dept_mega.adapt:
dept_mega.eval_sources). A federated group job's run (``federation.lighthouse`` set) is
evaluated on its own sources, without the lighthouse or the other group jobs (which may be gone
by then).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

import torch.distributed as dist

from .checkpoint import load_weights
from .config import Config, ConfigError
from .data.checks import check_eval_part
from .eval_sources import never_updated_notes, not_the_runs_config, parse_extra_sources
from .megatron_flags import parse_with_hints
from .metrics import make_record, write_json_atomic
from .parallel.agree import is_agreed
from .process_exit import report_error
from .run_paths import load_run_config


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dept_mega.evaluate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    ap.add_argument("--out", required=True, help="where to write the JSON result")
    ap.add_argument("--part", choices=("valid", "test"), default="valid",
                    help="the part of data.split to evaluate: valid (as the run's periodic evaluation) or test "
                         "(the third weight of data.split, never trained on)")
    ap.add_argument("--extra-source", action="append", default=[], metavar="NAME=PREFIX",
                    help="also evaluate the indexed data PREFIX.bin/.idx (tokenized with the run's data.tokenizer) "
                         "as source NAME; repeatable; std, glob, trim only (docs/launching.md section 13)")
    ap.add_argument("--eval-iters", type=int, default=None,
                    help="global batches (train.global_batch_size sequences) per source, in place of the run's "
                         "train.eval_iters and train.eval_samples")
    ap.add_argument("overrides", nargs="*", metavar="key=value",
                    help="overrides of the run's config.yaml, e.g. parallel.pipeline=1 parallel.tensor=1 "
                         "to evaluate in another layout. Any tensor, pipeline and data-parallel size loads; "
                         "another number of source groups (processes / tensor × pipeline × data) only from a "
                         "checkpoint at a round boundary (a step that is a multiple of dept.local_steps) and "
                         "not when data.sources[].group ties sources to groups or dept.outer_fragments > 1: "
                         "launch those with the run's number of groups (docs/launching.md section 10)")
    args = parse_with_hints(ap, argv)
    cfg_path = os.path.join(args.run_dir, "config.yaml")
    overrides = [*args.overrides, f"train.run_dir={args.run_dir}"]
    if args.eval_iters is not None:
        overrides += [f"train.eval_iters={args.eval_iters}", "train.eval_samples=null"]
    paths = None
    try:
        cfg, paths = load_run_config(args.run_dir, overrides)
        check_eval_part(cfg, args.part)
        extra = parse_extra_sources(args.extra_source, cfg)
    except ConfigError as exc:
        report_error(str(exc) + (paths.hint(str(exc)) if paths is not None else ""))
        return 2
    note = paths.note()
    if note is not None and os.environ.get("RANK", "0") == "0":
        print(note, file=sys.stderr, flush=True)
    p = cfg.parallel
    per_group, world = p.tensor * p.pipeline * p.data, int(os.environ.get("WORLD_SIZE", "1"))
    if world % per_group:
        report_error(f"config key 'parallel': the run's tensor × pipeline × data = {p.tensor}×{p.pipeline}×{p.data} "
                     f"= {per_group} does not divide the {world} process(es) of this launch: start a multiple of "
                     f"{per_group} with torchrun --nproc-per-node, or evaluate in another layout with overrides, e.g. "
                     f"parallel.tensor=1 parallel.pipeline=1 parallel.data=1 (another number of source groups "
                     f"only from a checkpoint at a round boundary: docs/launching.md section 10)")
        return 2
    from .resume import read_latest, select_checkpoint, step_dirs
    if args.step is None and read_latest(args.run_dir) == (None, None) and not step_dirs(args.run_dir):
        report_error(f"{args.run_dir}/checkpoints/latest does not exist (no checkpoint to evaluate)")
        return 2
    from .run_inputs import input_errors
    from .train import build_session
    try:
        # a group job's: without the lighthouse
        session = build_session(cfg, metrics=False, federate=False, eval_part=args.part, extra_sources=extra)
        sel = select_checkpoint(args.run_dir, session.device, args.step)
        if sel.step is None:
            # (rank 0's view of the directory decided: the same on every rank)
            report_error(f"no checkpoint to evaluate in {args.run_dir}/checkpoints", agreed=True)
            return 2
        if session.rank == 0:
            for note in sel.notes + _split_notes(args.run_dir, sel.step, cfg) + never_updated_notes(cfg, extra):
                print(f"warning: {note}", file=sys.stderr)
        step = sel.step
        load_weights(session.trainer, args.run_dir, step, hooks=session.loop.hooks, optimizer=False,
                     verified=True, remedy=not_the_runs_config(_run_variant(cfg_path, cfg)), check_data=False)
    except (*input_errors(), FileNotFoundError) as exc:
        report_error(str(exc) + paths.hint(str(exc)), agreed=is_agreed(exc))
        return 2
    session.trainer.step = step
    by_source = session.loop.evaluate()
    if session.rank == 0:
        rec = make_record("eval", step, session.loop.round_of(max(step - 1, 0)), part=args.part, by_source=by_source)
        write_json_atomic(args.out, rec)
        print(json.dumps(rec))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


def _split_notes(run_dir: str, step: int, cfg: Config) -> list[str]:
    """A warning when ``data.split`` differs from the split the checkpoint was trained under
    (``depends.json``): the parts evaluated then hold other documents than the run's, possibly
    documents it trained on. (Not an error: evaluating another cut is sometimes the point.)"""
    from .data.identity import same_split
    from .manifest import DEPENDS_FILE, CheckpointError, read_json
    from .resume import step_dir
    try:
        saved = read_json(step_dir(run_dir, step), DEPENDS_FILE)["data"]["data.split"]
    except (CheckpointError, KeyError, TypeError):
        return []  # a checkpoint that does not record its data
    if same_split(saved, cfg.data.split):
        return []
    return [f"config key 'data.split': {cfg.data.split!r} is not the split the checkpoint was trained under "
            f"({saved!r}): the evaluated parts hold other documents than the run's validation (and test) parts, "
            f"possibly documents it trained on"]


def _run_variant(cfg_path: str, cfg: Config) -> str:
    """The variant ``RUN/config.yaml`` names (the run's, whatever the overrides say: the advice
    for an override of the sources depends on it), else this launch's."""
    import yaml
    try:
        with open(cfg_path, encoding="utf-8") as f:
            variant = (yaml.safe_load(f) or {}).get("dept", {}).get("variant")
    except (OSError, ValueError, AttributeError):
        variant = None
    return variant if isinstance(variant, str) else cfg.dept.variant


if __name__ == "__main__":
    from dept_mega.process_exit import exit_after
    exit_after(main)
