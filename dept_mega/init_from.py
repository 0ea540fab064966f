"""``train.init_from``: a fresh run starts from another run's model weights (Megatron-LM's
``--load`` of another run with ``--finetune`` / ``--no-load-optim``).

Only the weights come over: the optimizer state, the step, the consumed samples, the data
position and the dropout streams start fresh, as in a new run. The checkpoint is read with the
resharding loader (``checkpoint_format.load_entries``: each rank reads its boxes of the global
tensors), so the source run's tensor / pipeline / data layout does not matter. Under bf16 /
fp16 the fp32 master weights start from the saved weights, as Megatron's --no-load-optim.

Precedence: a run directory that already holds a checkpoint resumes from it and the key is
not used (a requeued or relaunched fine-tuning job continues itself rather than starting over
from the source); ``dept_mega.train`` says so in its log.

The source must hold the same model: the keys of :data:`MODEL_KEYS` and the tokenizer (the
embedding rows' tokens) are compared, and a difference names the key; dept.variant may differ
as :data:`STARTS_FROM` allows (the variants with one global vocabulary map their tables onto
each other). The DEPT rules (which body, which tables): ``dept_mega.init_from_dept``; TRIM's
global tables ↔ a shared table: ``dept_mega.init_from_trim``."""
from __future__ import annotations

import os
from typing import Optional

import torch

from .config import Config, ConfigError
from .config_diff import check_differing
from .manifest import DEPENDS_FILE, CheckpointError, read_json
from .parallel.agree import is_agreed, mark_agreed
from .resume import CKPT_DIR, depends_differences, fingerprint, run_and_step, select_checkpoint, step_dir
from .variant import variant_of

# what the weights' shapes and meaning depend on (model.seq_length only with a learned position table)
MODEL_KEYS = ("dept.variant", "model.num_layers", "model.hidden_size", "model.num_attention_heads",
              "model.num_query_groups", "model.ffn_hidden_size", "model.activation", "model.normalization",
              "model.position_embedding", "model.tie_embeddings", "model.bias", "model.norm_bias",
              "model.vocab_size")
KEY = "train.init_from"
RECORD = "init_from.json"  # RUN/init_from.json: the checkpoint a run started from (resumes read it again)
# this launch's dept.variant → the variants whose checkpoints it starts from. std / glob hold one
# shared table, trim its global φ (the same rows, unpadded), spec a table per source of the
# same global vocabulary (each from a shared table or φ); spec_opt's tables belong to their
# sources' own tokenizers, and a spec checkpoint holds no single table for std / glob / trim
STARTS_FROM = {"std": ("std", "glob", "trim"), "glob": ("std", "glob", "trim"), "trim": ("trim", "std", "glob"),
               "spec": ("spec", "std", "glob", "trim"), "spec_opt": ("spec_opt",)}


def source_checkpoint(path: str, device: Optional[torch.device] = None, verify: bool = True) -> str:
    """The checkpoint directory ``train.init_from`` names: ``RUN/checkpoints/step_N`` as given,
    or a run directory's newest complete, verified checkpoint. Collective when given a run
    directory (every rank: rank 0's listing decides, as for a resume). ``verify=False`` (the
    pre-flight, one process): the step ``checkpoints/latest`` names, its files not checksummed."""
    norm = os.path.normpath(path)
    run_dir, step = run_and_step(norm) or (norm, None)
    if not os.path.isdir(norm):
        raise ConfigError(f"config key '{KEY}': {path!r} is not a directory (a run directory, or its "
                          f"checkpoints/step_N)")
    if not verify:
        from .resume import latest_step
        step = step if step is not None else latest_step(run_dir)
        if step is None or not os.path.isdir(step_dir(run_dir, step)):
            raise ConfigError(f"config key '{KEY}': {path!r} holds no checkpoint ({os.path.join(run_dir, CKPT_DIR)} "
                              f"has no latest step_N)")
        return step_dir(run_dir, step)
    try:
        sel = select_checkpoint(run_dir, device, step)
    except CheckpointError as exc:
        err = ConfigError(f"config key '{KEY}': {exc}")
        raise (mark_agreed(err) if is_agreed(exc) else err) from None
    if sel.step is None:
        raise ConfigError(f"config key '{KEY}': {path!r} holds no checkpoint ({os.path.join(run_dir, CKPT_DIR)} "
                          f"has no step_N)")
    return step_dir(run_dir, sel.step)


def check_source(cfg: Config, path: str) -> None:
    """One ConfigError naming every model key (and the tokenizer) in which the checkpoint
    ``path`` differs from ``cfg`` (dept.variant among them, unless :data:`STARTS_FROM` allows
    the pair); a format-1 checkpoint is refused."""
    from .manifest import read_manifest
    if read_manifest(path)["format"] == 1:
        raise ConfigError(f"config key '{KEY}': checkpoint {path} has format 1; convert it first: python "
                          f"tools/convert_checkpoint.py --run-dir {os.path.dirname(os.path.dirname(path))}")
    keys = MODEL_KEYS + (("model.seq_length",) if cfg.model.position_embedding == "learned" else ())
    saved, now = read_json(path, DEPENDS_FILE), fingerprint(cfg)
    rows = depends_differences(saved, now, keys, ("data.tokenizer",),
                               lambda key, a, b: key == "dept.variant" and a in STARTS_FROM.get(b, ()))
    check_differing([(k, what + (_variant_note(saved["config"][k], now["config"][k]) if k == "dept.variant" else ""))
                     for k, what in rows], f"from checkpoint {path}", f"{KEY} needs a checkpoint of the same model")


def _variant_note(old: str, new: str) -> str:
    """Why checkpoints of dept.variant ``old`` do not start a ``new`` run, and which do."""
    why = (" (SPEC-OPT's tables belong to each source's own tokenizer)" if new == "spec_opt" else
           " (its tables belong to its sources' own tokenizers)" if old == "spec_opt" else
           " (it holds a table per source, no shared one)")
    return f"; a {new} run starts from a {' / '.join(STARTS_FROM[new])} checkpoint{why}"


def init_from(trainer, cfg: Config, device: torch.device, hooks=None) -> str:
    """Load the model weights of ``cfg.train.init_from``'s checkpoint into ``trainer`` (a fresh
    one: step 0, no optimizer state), on every rank; returns the checkpoint's path. ``hooks``:
    the DEPT round driver (its outer references follow the loaded weights; SPEC / SPEC-OPT:
    the sources' tables, read at their first installation; TRIM: its global tables, loaded
    here). Errors are agreed: every rank raises the same one."""
    from .checkpoint_format import load_entries
    from .init_from_dept import attach, reset_references, weight_entries
    from .init_from_trim import saved_variant, trim_entries
    from .parallel.agree import agree_errors
    from .run_inputs import input_errors
    path = source_checkpoint(cfg.train.init_from, device)
    agree_errors(lambda: check_source(cfg, path), input_errors(), device)
    new, old = cfg.dept.variant, saved_variant(path)
    per_source = variant_of(new).own_embeddings
    tables = source_tables_of(hooks, cfg, path, device) if per_source else None

    def entries() -> list:
        out = weight_entries(trainer, path, new, old)
        if variant_of(new).trimmed:  # φ, φ_head, positions: the compact tables are filled from φ at installation
            out += trim_entries(hooks.strategy, path, old)
        return out

    agree_errors(lambda: load_entries(entries(), path), input_errors(), device)
    for opt in trainer.optimizers:
        opt.after_checkpoint_load(with_optimizer=False)  # the masters from the loaded weights
    if hooks is not None and hasattr(hooks, "checkpoint_syncs"):
        reset_references(hooks)
        if per_source:
            attach(hooks, tables)
    _record(cfg, path)
    return path


def _record(cfg: Config, path: str) -> None:
    """``RUN/init_from.json`` (global rank 0): the checkpoint directory the run started from, so
    that a resume reads the same one even where ``train.init_from`` names a run directory that
    has saved newer checkpoints since (or removed this one)."""
    import torch.distributed as dist

    from .metrics import write_json_atomic
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    write_json_atomic(os.path.join(cfg.train.run_dir, RECORD),
                      {"init_from": cfg.train.init_from, "checkpoint": os.path.abspath(path)})


def _recorded(cfg: Config) -> Optional[str]:
    """The checkpoint directory ``RUN/init_from.json`` names (None: no record, a run started
    before it was written); a ConfigError when that checkpoint is gone."""
    rec = os.path.join(cfg.train.run_dir, RECORD)
    if not os.path.isfile(rec):
        return None
    path = read_json(cfg.train.run_dir, RECORD)["checkpoint"]
    if not os.path.isdir(path):
        raise ConfigError(f"config key '{KEY}': this run started from checkpoint {path} ({rec}), which is gone: "
                          f"the sources it has not trained yet take their tables from it; restore it")
    return path


def source_tables_of(hooks, cfg: Config, path: str, device: torch.device):
    """SPEC / SPEC-OPT: the checked :class:`~dept_mega.init_from_dept.SourceTables` of ``path``
    for ``hooks``' sources (agreed errors)."""
    from .init_from_dept import source_tables
    from .parallel.agree import agree_errors
    from .run_inputs import input_errors
    return agree_errors(lambda: source_tables(cfg, path, hooks.pg, hooks.sources), input_errors(), device)


def resume_sources(hooks, cfg: Config, device: torch.device) -> Optional[str]:
    """A SPEC / SPEC-OPT run started with ``train.init_from`` that resumed from its own
    checkpoint: a source it has not trained yet still starts from the checkpoint's table, as
    in an uninterrupted run. Returns the checkpoint's path (None: nothing to attach)."""
    from .init_from_dept import attach
    if cfg.train.init_from is None or not variant_of(cfg).own_embeddings or hooks is None:
        return None
    # the recorded checkpoint verified again (its files may have changed since the run started)
    path = source_checkpoint(_recorded(cfg) or cfg.train.init_from, device)
    attach(hooks, source_tables_of(hooks, cfg, path, device))
    return path
