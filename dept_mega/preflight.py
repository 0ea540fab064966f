"""The pre-flight of ``python -m dept_mega.train --config C [overrides] --check --world-size N``.

Everything that can refuse a launch without a GPU, run on a login node before the job's ranks
start (``examples/1b/common.sh`` calls it before ``srun``): the layout for N ranks, the data and
tokenizer files, the sources' token ids against their vocabulary, then the predicted memory per
rank (``dept_mega.dept.memory``, the largest rank) and the predicted size of one checkpoint,
with a warning when the run directory's file system has less than two checkpoints' room (a
checkpoint is written beside the previous one before that one may be removed), and, when the
run directory already holds a checkpoint, the config keys that checkpoint depends on. Bad input is
one ``error:`` line naming the key and exit status 2, as at a real launch.
"""
from __future__ import annotations

import os
import shutil
import sys
from typing import Callable, Optional

from .config import Config, validate

def _size(n: float) -> str:
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def checkpoint_bytes(cfg: Config, world_size: int, mem: dict) -> int:
    """Predicted bytes of one checkpoint from the per-rank memory model ``mem``
    (:func:`dept_mega.dept.memory.predict_memory`): every group writes its weights and optimizer
    state once per (pipeline, tensor) shard — data-parallel replicas share keys, the distributed
    optimizer's pieces do not — and DEPT's outer state and TRIM's table once per parameter (each
    rank holds a 1/D chunk). The largest rank stands for every pipeline stage: an upper bound."""
    p = cfg.parallel
    groups = cfg.num_groups(world_size)
    optimizer = mem["optimizer"] * (p.data if cfg.optim.distributed else 1)
    per_shard = mem["weights"] + optimizer
    shared = (mem["outer"] + mem["trim_table"]) * p.data
    return int(groups * p.pipeline * p.tensor * per_shard + p.pipeline * p.tensor * shared)


def resume_line(cfg: Config) -> Optional[str]:
    """When ``train.run_dir`` already holds a checkpoint, the launch will resume from it: check
    now, as the launch will, that the config keeps what the checkpoint depends on (model shape,
    DEPT variant and rounds, sources, tokenizers: ``resume.check_depends``; a ConfigError naming
    the key), so that a changed key is not first seen on the allocated nodes. Not checked here:
    the files' checksums and a change of layout (both at launch)."""
    from .manifest import DEPENDS_FILE
    from .resume import check_depends, read_latest, step_dir
    step, _ = read_latest(cfg.train.run_dir)
    if step is None:
        return None
    path = step_dir(cfg.train.run_dir, step)
    if not os.path.isfile(os.path.join(path, DEPENDS_FILE)):
        return f"resume: from {path} (its config keys could not be checked here: no {DEPENDS_FILE})"
    check_depends(cfg, path)
    return f"resume: from {path}; the model, DEPT, source and tokenizer keys it depends on match"


def free_bytes(path: str, disk_usage: Callable = shutil.disk_usage) -> tuple[str, int]:
    """Free bytes of the file system that will hold ``path`` (its nearest existing ancestor)."""
    here = os.path.abspath(path)
    while not os.path.exists(here) and os.path.dirname(here) != here:
        here = os.path.dirname(here)
    return here, int(disk_usage(here).free)


def preflight(cfg: Config, world_size: int, disk_usage: Callable = shutil.disk_usage) -> tuple[list[str], list[str]]:
    """The report lines and warnings of the pre-flight; raises the launch's input errors."""
    from .data.checks import check_sources
    from .dept.costs import resolve_vocabs
    from .dept.memory import predict_memory
    from .run_inputs import describe_batch, vocab_size_of
    validate(cfg, world_size)
    federated = None
    if cfg.federation.lighthouse is not None:  # the group index and federation.* keys, as the launch checks them
        from .dept.federation_config import own_sources, resolve
        federated = resolve(cfg)
    check_sources(cfg)
    vocab = vocab_size_of(cfg)
    p = cfg.parallel
    lines = [f"pre-flight: {cfg.dept.variant}, world {world_size} = {cfg.num_groups(world_size)} group(s) x "
             f"tensor {p.tensor} x pipeline {p.pipeline} x data {p.data}",
             describe_batch(cfg, cfg.num_groups(world_size))]
    if federated is not None:
        f = cfg.federation
        lines.append(f"federation: group job {federated[0]} of {f.groups} (sources: {', '.join(own_sources(cfg))}), "
                     f"lighthouse {f.lighthouse} (not contacted here), rounds need at least {f.min_groups} group(s)")
    vocabs = resolve_vocabs(cfg)
    sources = list(vocabs.source_vocabs.values()) if cfg.dept.variant == "spec_opt" else []
    lines.append(f"vocabulary: {vocab:,} ids" + (f" (per source: {', '.join(f'{n} {v:,}' for n, v in vocabs.source_vocabs.items())})"
                                                 if sources else ""))
    mem = predict_memory(cfg, vocabs.global_vocab or vocab, sources, list(vocabs.trim_vocabs.values()))
    act = mem["activations_per_microbatch"]
    lines.append(f"memory per rank (predicted, largest rank): {_size(mem['total'])} = weights {_size(mem['weights'])} + "
                 f"grads {_size(mem['grads'])} + optimizer {_size(mem['optimizer'])} + outer {_size(mem['outer'])} + "
                 f"trim table {_size(mem['trim_table'])} + activations {mem['in_flight_microbatches']:g} x {_size(act)} "
                 f"(not counted: allocator fragmentation, collective buffers, the framework's workspace)")
    warnings = []
    try:
        import torch
        if torch.cuda.is_available():
            have = torch.cuda.get_device_properties(0).total_memory
            if mem["total"] > have:
                warnings.append(f"predicted memory per rank {_size(mem['total'])} exceeds this machine's GPU 0 "
                                f"({_size(have)}); see docs/performance.md for what lowers it")
    except Exception:  # noqa: BLE001 - a login node without a usable driver: nothing to compare
        pass
    resume = resume_line(cfg)
    if resume:
        lines.append(resume)
    ckpt = checkpoint_bytes(cfg, world_size, mem)
    where, free = free_bytes(cfg.train.run_dir, disk_usage)
    lines.append(f"checkpoint: about {_size(ckpt)} ({ckpt:,} bytes) predicted; {_size(free)} free at {where}")
    if free < 2 * ckpt:
        warnings.append(f"config key 'train.run_dir': {where} has {free:,} bytes free, below two checkpoints "
                        f"(2 x {ckpt:,} bytes predicted from the memory model): a save may fail for lack of space")
    return lines, warnings


def run_check(cfg: Config, world_size: int) -> int:
    """``--check``: print the report (stdout) and warnings (stderr); 0, or 2 on bad input."""
    from .run_inputs import input_errors
    try:
        lines, warnings = preflight(cfg, world_size)
    except input_errors() as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for line in lines:
        print(line)
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    return 0
