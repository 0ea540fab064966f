"""The pre-flight of ``python -m dept_mega.train --config C [overrides] --check --world-size N``.

Everything that can refuse a launch before the job's ranks start, run on a login node or, as
``examples/1b/common.sh`` does before ``srun``, on the job's first node: the device
``train.device`` asks for, on the machine the check runs on (``cuda`` is refused where CUDA
cannot be used: ``dept_mega.parallel.device``), the layout for N ranks, the data and tokenizer
files, the sources' token ids against their vocabulary, each source's share of the training
(the run log's ``sampling`` line, with a warning when the configured weighting cannot be the
shares: ``dept_mega.sampling_plan``), then the predicted memory per rank
(``dept_mega.dept.memory``, the largest rank) and the predicted size of one checkpoint,
with a warning when the run directory's file system has less room than the checkpoints the
run holds at once (``train.keep_checkpoints``, plus the one written beside them before the
oldest may be removed), and, when the
run directory already holds a checkpoint, the config keys that checkpoint depends on. Bad input is
one ``error:`` line naming the key and exit status 2, as at a real launch.
"""
from __future__ import annotations

import os
import shutil
import sys
from typing import Callable, Optional, Sequence

from .config import Config, te_fp8_conflict, validate
from .variant import variant_of

def _size(n: float) -> str:
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


# What a checkpoint writes besides the tensors' bytes (measured with torch 2.x's
# torch.distributed.checkpoint; a tiny model's checkpoint is mostly this): every box (a tensor,
# or a rank's shard or piece of one) is serialized with its own header in ``__N_M.distcp``
# (~1.6 KiB) and described in ``.metadata`` (~0.25 KiB); ``rng_tp{t}_pp{p}.pt`` (~12 KiB) per
# tensor x pipeline rank; ``group{g}.json`` per group; layout, depends and manifest files; the
# launch's config.yaml.
ITEM_BYTES = 2048
RNG_FILE_BYTES = 16 * 1024
GROUP_FILE_BYTES = 1024
FIXED_FILE_BYTES = 8 * 1024
SOURCE_DEPENDS_BYTES = 512  # a source's entry in depends.json's data (its prefix and content identity)


def _stored_vocabs(cfg: Config, groups: int, vocab: int, source_vocabs: Sequence[int],
                   trim_vocabs: Sequence[int]) -> list[int]:
    """The vocabularies of the sources a checkpoint writes besides the G installed ones (K − G
    of them: SPEC/SPEC-OPT/TRIM keep every source's embeddings, each written once under
    ``source/{name}/``; ``dept_mega.dept.hook_state``). Upper bound: the K − G largest."""
    stored = len(cfg.data.sources) - groups
    v = variant_of(cfg)
    if not v.source_embeddings or stored <= 0:
        return []
    sizes = list(source_vocabs) if v.own_tokenizer else list(trim_vocabs) if v.trimmed else []
    sizes = sorted(sizes, reverse=True)[:stored]
    return sizes + [max(sizes, default=vocab)] * (stored - len(sizes))


def checkpoint_bytes(cfg: Config, world_size: int, mem: dict, vocab: Optional[int] = None,
                     source_vocabs: Sequence[int] = (), trim_vocabs: Sequence[int] = ()) -> int:
    """Predicted bytes of one checkpoint, an upper bound, from the per-rank memory model ``mem``
    (:func:`dept_mega.dept.memory.predict_memory` with the same vocabularies): every group
    writes its weights and optimizer state once per (pipeline, tensor) shard — data-parallel
    replicas share keys, the distributed optimizer's pieces do not — and DEPT's outer state and
    TRIM's table once per parameter (each rank holds a 1/D chunk). The largest rank stands for
    every pipeline stage, less the last stage's copy of a tied word table, which has the first
    stage's key and is written once (:func:`_tied_copy`). Besides the installed sources, SPEC/SPEC-OPT/TRIM write the K − G
    stored sources' embeddings, their fp32 masters (bf16/fp16) and, unless
    ``dept.reset_inner_optimizer``, their moments; with ``dept.body_optimizer_state: source``
    every stored source also carries the body's moments (:func:`_stored_vocabs`; ``vocab``: the
    global vocabulary, the default of a source without a known size). Plus the files' own
    overhead (:data:`ITEM_BYTES` per box and the small files)."""
    from .dept.cost_common import eager_start, rank_params
    from .dept.memory import OUTER_STATE, trim_shards, variant_vocab
    p, d, variant = cfg.parallel, cfg.dept, variant_of(cfg)
    groups = cfg.num_groups(world_size)
    P, T, D = p.pipeline, p.tensor, p.data
    S = D if cfg.optim.distributed else 1  # the optimizer's pieces of a tensor
    half = cfg.precision != "fp32"
    wb = 2 if half else 4
    optimizer = mem["optimizer"] * S
    per_shard = mem["weights"] + optimizer
    shared = (mem["outer"] + mem["trim_table"]) * D
    total = groups * P * T * per_shard + P * T * shared
    # boxes: per parameter the weight, two moments and the masters per piece, a step
    vocab = vocab or cfg.model.vocab_size or 0
    stages = [rank_params(cfg, vocab, pp) for pp in range(P)]  # each pipeline stage's parameters
    n_body, n_emb = max((len(r.body), len(r.emb)) for r in stages)

    def inner_items(n: int, moments: bool = True) -> int:  # the inner optimizer's boxes of n tensors
        return n * ((2 * S + 1 if moments else 0) + (S if half else 0))

    items = groups * P * T * (n_body + n_emb + inner_items(n_body + n_emb))
    if variant.rounds:  # θ_prev, the outer optimizer's state, residual, estimate: chunks over D
        per = 1 + OUTER_STATE[d.outer_optimizer.name] + int(d.outer_error_feedback) + int(eager_start(cfg))
        synced = n_body + (n_emb if variant.synced_table else 0)
        items += P * T * (synced + D) * per + 1
    if variant.trimmed:
        items += 2 * trim_shards(cfg) * (1 + OUTER_STATE[d.outer_optimizer.name]) + 2
    moments = not d.reset_inner_optimizer
    if d.body_optimizer_state == "source":  # every stored source: the body's fp32 moments and steps
        body_moments = sum(8 * sum(r.body) + 4 * n_body for r in stages) * T
        stored_count = max(len(cfg.data.sources) - groups, 0)
        total += stored_count * body_moments
        items += stored_count * P * T * n_body * (2 * S + 1)
    stored = _stored_vocabs(cfg, groups, vocab, source_vocabs, trim_vocabs)
    per_elem = wb + (4 if half else 0) + (8 if moments else 0)
    for v in stored:
        for pp in range(P):
            rp = rank_params(cfg, v, pp)
            copies = _tied_copies(cfg, rp, pp)
            emb = [n for i, n in enumerate(rp.emb) if i not in rp.emb_isolate or not copies]
            total += T * (per_elem * sum(emb) + (4 * len(emb) if moments else 0))
            items += T * (len(emb) + inner_items(len(emb), moments))
    own, shared_copy, outer_items = _tied_copy(cfg, variant_vocab(d.variant, vocab, source_vocabs, trim_vocabs),
                                               vocab)
    if own:  # the tied table's copy on the last stage: its key is the first stage's, written once
        total -= groups * T * own + T * shared_copy
        items -= groups * T * (1 + inner_items(1)) + T * outer_items
    from .run_configs import config_text
    files = (RNG_FILE_BYTES * P * T + GROUP_FILE_BYTES * groups + FIXED_FILE_BYTES
             + SOURCE_DEPENDS_BYTES * len(cfg.data.sources) + len(config_text(cfg).encode("utf-8")))
    return int(total + ITEM_BYTES * items + files)


def _tied_copies(cfg: Config, rp, pp: int) -> list[int]:
    """The numels of stage ``pp``'s tied-table copies whose key the first stage writes too
    (``rp``: its :func:`~dept_mega.dept.cost_common.rank_params`): the last stage's isolated
    word table under ``model.tie_embeddings`` and pipeline > 1; [] elsewhere."""
    if not cfg.model.tie_embeddings or cfg.parallel.pipeline == 1 or pp != cfg.parallel.pipeline - 1:
        return []
    return [rp.emb[i] for i in sorted(rp.emb_isolate)]


def _tied_copy(cfg: Config, vocab: int, global_vocab: int) -> tuple[int, int, int]:
    """What the P × largest-rank count holds twice under a tied head (``model.tie_embeddings``,
    pipeline > 1): the last stage's copy of the word table has the first stage's key (the same
    parameter name, kept equal by the embedding all-reduce), so a save writes it once. Returns
    its weights and optimizer bytes on a tensor shard of one group, its outer state and TRIM
    table over the D ranks, and its outer boxes; zeros without a copy. (Measured: a tied pipeline-2
    checkpoint is the pipeline-1 one plus the second stage's RNG file.)"""
    from .dept.cost_common import eager_start, rank_params
    from .dept.memory import (FLATSYNC_THETA_CHUNK_ONLY, OUTER_STATE, _optimizer_bytes, _outer_bytes,
                              _trim_table_bytes)
    p, d = cfg.parallel, cfg.dept
    copies = _tied_copies(cfg, rank_params(cfg, vocab, p.pipeline - 1), p.pipeline - 1)
    if not copies:
        return 0, 0, 0
    table = sum(copies)
    inner = _optimizer_bytes(cfg, [table], {0})
    own = inner["weights"] + inner["optimizer"] * (p.data if cfg.optim.distributed else 1)
    shared = items = 0
    if variant_of(cfg).synced_table:  # its outer state, chunked over D
        shared += _outer_bytes(cfg, [table], [0], {0}, FLATSYNC_THETA_CHUNK_ONLY) * p.data
        items += 1 + OUTER_STATE[d.outer_optimizer.name] + int(d.outer_error_feedback) + int(eager_start(cfg))
    if variant_of(cfg).trimmed:
        shared += _trim_table_bytes(cfg, global_vocab) * p.data
    return own, shared, items


def resume_line(cfg: Config, warnings: Optional[list] = None) -> Optional[str]:
    """When ``train.run_dir`` already holds a checkpoint, the launch will resume from it: check
    now, as the launch will, that the config keeps what the checkpoint depends on (model shape,
    DEPT variant and rounds, sources, tokenizers, the data its positions index:
    ``resume.check_depends``; a ConfigError naming the key), so that a changed key is not first
    seen on the allocated nodes. Not checked here: the checkpoint files' checksums and a change of
    layout (both at launch). ``warnings`` receives what the launch will log about the data: each
    change accepted under ``train.allow_data_change``, or that the checkpoint does not record it."""
    from .manifest import DEPENDS_FILE
    from .resume import check_depends, read_latest, step_dir
    step, _ = read_latest(cfg.train.run_dir)
    if step is None:
        return None
    path = step_dir(cfg.train.run_dir, step)
    if not os.path.isfile(os.path.join(path, DEPENDS_FILE)):
        return f"resume: from {path} (its config keys could not be checked here: no {DEPENDS_FILE})"
    notes = check_depends(cfg, path)
    if warnings is not None:
        warnings.extend(notes)
    return (f"resume: from {path}; the model, DEPT, source and tokenizer keys it depends on match"
            + (", and the data it read" if not notes else " (the data: see the warnings)"))


def init_from_line(cfg: Config, vocab_of: dict[str, int]) -> Optional[str]:
    """With ``train.init_from`` on a run directory without a checkpoint: check now, as the
    launch will, that it names a checkpoint of the same model (``init_from.check_source``) and,
    with tables per source, one that holds each source's table for its tokenizer
    (``init_from_dept.source_tables``), so that the mistake is not first seen on the allocated
    nodes. ``vocab_of``: each source's embedding vocabulary. Not checked here: the checkpoint
    files' checksums (at launch)."""
    if cfg.train.init_from is None:
        return None
    from types import SimpleNamespace

    from .init_from import check_source, source_checkpoint
    from .init_from_dept import source_tables
    from .resume import read_latest
    if read_latest(cfg.train.run_dir)[0] is not None:
        return f"init_from: not used: {cfg.train.run_dir} holds a checkpoint, which the launch resumes from"
    path = source_checkpoint(cfg.train.init_from, verify=False)
    check_source(cfg, path)
    if variant_of(cfg).own_embeddings:
        source_tables(cfg, path, None, [SimpleNamespace(name=n, vocab_size=v) for n, v in vocab_of.items()])
    return f"init_from: the model weights of {path} (the same model keys; its files are checked at launch)"


def kept_checkpoints(cfg: Config) -> int:
    """The most checkpoints the run holds at once: its saves (each ``train.save_interval`` steps
    before the last, and the last), or ``train.keep_checkpoints`` of them plus the one being
    written beside them before retention removes the oldest."""
    t = cfg.train
    saves = (t.steps - 1) // t.save_interval + 1 if t.save_interval else 1
    return min(t.keep_checkpoints + 1, saves) if t.keep_checkpoints else saves


def save_rate_words(ckpt: int, env=os.environ) -> str:
    """The write rate a preemption's save of ``ckpt`` bytes needs to finish within torchrun's
    shutdown timeout (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else torchrun's 30 s): the number to
    compare with the file system's, to size the lead time (docs/launching.md §9)."""
    given = env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "")
    try:
        seconds = max(float(given), 1.0)
    except ValueError:
        seconds = 30.0
    rate = ckpt / seconds
    unit, scale = ("GB/s", 1e9) if rate >= 1e9 else ("MB/s", 1e6)
    v = rate / scale
    amount = f"{v:.0f}" if v >= 10 else f"{v:.2g}"
    return (f"a preemption's save in {seconds:g} s (TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
            f"{'' if given.strip() else ' unset: torchrun default'}) needs ~{amount} {unit}")


def free_bytes(path: str, disk_usage: Callable = shutil.disk_usage) -> tuple[str, int]:
    """Free bytes of the file system that will hold ``path`` (its nearest existing ancestor)."""
    here = os.path.abspath(path)
    while not os.path.exists(here) and os.path.dirname(here) != here:
        here = os.path.dirname(here)
    return here, int(disk_usage(here).free)


def preflight(cfg: Config, world_size: int, disk_usage: Callable = shutil.disk_usage) -> tuple[list[str], list[str]]:
    """The report lines and warnings of the pre-flight; raises the launch's input errors."""
    from .data.checks import check_sources, source_warnings
    from .dept.costs import resolve_vocabs
    from .dept.memory import predict_memory
    from .run_inputs import describe_batch, vocab_size_of
    from .parallel.device import preflight_line
    # first, as at a launch (init_distributed): train.device: cuda without CUDA on this machine stops here
    device_line = preflight_line(cfg.train.device)
    validate(cfg, world_size)
    if cfg.backend == "transformer_engine":  # (the launch's device: cpu, CUDA here, or not known on this machine)
        from .model.backends import BackendError, te_request_problem
        from .parallel.device import use_cuda
        here = "cpu" if cfg.train.device == "cpu" else "cuda" if use_cuda(cfg.train.device, preflight=True) else None
        if (problem := te_request_problem(here)) is not None:
            raise BackendError(problem)
    federated = None
    if cfg.federation.lighthouse is not None:  # the group index and federation.* keys, as the launch checks them
        from .dept.federation_config import own_sources, resolve
        federated = resolve(cfg)
    check_sources(cfg)
    vocab = vocab_size_of(cfg)
    p = cfg.parallel
    lines = [f"pre-flight: {cfg.dept.variant}, world {world_size} = {cfg.num_groups(world_size)} group(s) x "
             f"tensor {p.tensor} x pipeline {p.pipeline} x data {p.data}",
             describe_batch(cfg, cfg.num_groups(world_size)), device_line]
    if federated is not None:
        f = cfg.federation
        lines.append(f"federation: group job {federated[0]} of {f.groups} (sources: {', '.join(own_sources(cfg))}), "
                     f"lighthouse {f.lighthouse} (not contacted here), rounds need at least {f.min_groups} group(s)")
    from .sampling_plan import check_untrained, plan_scheduler, planned_line, sampling_groups, sampling_warnings
    from .schedule_warnings import schedule_warnings
    groups = sampling_groups(cfg, world_size)
    scheduler = plan_scheduler(cfg, groups)  # drawn once: the line, the check and the warnings
    lines.append(planned_line(cfg, groups, scheduler))
    check_untrained(cfg, scheduler)
    vocabs = resolve_vocabs(cfg)
    sources = list(vocabs.source_vocabs.values()) if variant_of(cfg).own_tokenizer else []
    if sources:  # SPEC-OPT: each source its own; the largest sizes the memory below
        per = ", ".join(f"{n} {v:,}" for n, v in vocabs.source_vocabs.items())
        lines.append(f"vocabulary: per source {per} ids (largest {max(sources):,})")
    else:
        lines.append(f"vocabulary: {vocab:,} ids")
    mem = predict_memory(cfg, vocabs.global_vocab or vocab, sources, list(vocabs.trim_vocabs.values()))
    act = mem["activations_per_microbatch"]
    lines.append(f"memory per rank (predicted, largest rank): {_size(mem['total'])} = weights {_size(mem['weights'])} + "
                 f"grads {_size(mem['grads'])} + optimizer {_size(mem['optimizer'])} + outer {_size(mem['outer'])} + "
                 f"trim table {_size(mem['trim_table'])} + activations {mem['in_flight_microbatches']:g} x {_size(act)} "
                 + (f"+ FP8 weight copies {_size(mem['fp8_weight_copies'])} + FP8 scaling {_size(mem['fp8_scaling'])} "
                    if mem["fp8_weight_copies"] else "")
                 + "(not counted: allocator fragmentation, collective buffers, the framework's workspace)")
    from .metrics import missing_logger_packages
    warnings = [*sampling_warnings(cfg, groups, scheduler), *schedule_warnings(cfg),
                *source_warnings(cfg), *missing_logger_packages(cfg.train.tensorboard, cfg.train.wandb)]
    if cfg.fp8 is not None and cfg.backend == "auto" and (why := te_fp8_conflict(cfg)) is not None:
        # refused with the config for backend: transformer_engine; auto decides on the GPU node
        warnings.append(f"config key 'backend': auto picks Transformer Engine on a node where it is installed, "
                        f"and that run would stop: {why}; set backend: local to run the native FP8 linears "
                        f"whatever is installed")
    try:
        import torch
        if cfg.train.device != "cpu" and torch.cuda.is_available():
            have = torch.cuda.get_device_properties(0).total_memory
            if mem["total"] > have:
                warnings.append(f"predicted memory per rank {_size(mem['total'])} exceeds this machine's GPU 0 "
                                f"({_size(have)}); see docs/performance.md for what lowers it")
    except Exception:  # noqa: BLE001 - a login node without a usable driver: nothing to compare
        pass
    from .export.hf_mapping import export_line
    lines.append(export_line(cfg.model))
    resume = resume_line(cfg, warnings)
    if resume:
        lines.append(resume)
    start = init_from_line(cfg, vocabs.source_vocabs if variant_of(cfg).own_tokenizer
                           else {s.name: vocabs.global_vocab or vocab for s in cfg.data.sources})
    if start:
        lines.append(start)
    ckpt = checkpoint_bytes(cfg, world_size, mem, vocabs.global_vocab or vocab, sources,
                            list(vocabs.trim_vocabs.values()))
    where, free = free_bytes(cfg.train.run_dir, disk_usage)
    lines.append(f"checkpoint: about {_size(ckpt)} ({ckpt:,} bytes) predicted; {_size(free)} free at {where}; "
                 + save_rate_words(ckpt))
    kept = kept_checkpoints(cfg)
    if free < kept * ckpt:
        warnings.append(f"config key 'train.run_dir': {where} has {free:,} bytes free, below the {kept} "
                        f"checkpoint(s) the run holds at once ({kept} x {ckpt:,} bytes predicted from the memory "
                        f"model; train.keep_checkpoints={cfg.train.keep_checkpoints}): a save may fail for lack "
                        f"of space")
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
