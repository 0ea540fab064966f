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
embedding rows' tokens) are compared, and a difference names the key. STD only for now: the
DEPT variants keep embeddings per source or trimmed tables and per-group bodies, whose mapping
between two runs is not defined yet (refused, naming dept.variant)."""
from __future__ import annotations

import os
import re
from typing import Optional

import torch

from .config import Config, ConfigError
from .manifest import DEPENDS_FILE, CheckpointError, read_json
from .parallel.agree import is_agreed, mark_agreed
from .resume import CKPT_DIR, fingerprint, select_checkpoint, step_dir

# what the weights' shapes and meaning depend on (model.seq_length only with a learned position table)
MODEL_KEYS = ("dept.variant", "model.num_layers", "model.hidden_size", "model.num_attention_heads",
              "model.num_query_groups", "model.ffn_hidden_size", "model.activation", "model.normalization",
              "model.position_embedding", "model.tie_embeddings", "model.bias", "model.norm_bias",
              "model.vocab_size")
KEY = "train.init_from"


def source_checkpoint(path: str, device: Optional[torch.device] = None) -> str:
    """The checkpoint directory ``train.init_from`` names: ``RUN/checkpoints/step_N`` as given,
    or a run directory's newest complete, verified checkpoint. Collective when given a run
    directory (every rank: rank 0's listing decides, as for a resume)."""
    norm = os.path.normpath(path)
    m = re.fullmatch(r"step_(\d+)", os.path.basename(norm))
    if m and os.path.basename(os.path.dirname(norm)) == CKPT_DIR:
        run_dir, step = os.path.dirname(os.path.dirname(norm)), int(m.group(1))
    else:
        run_dir, step = norm, None
    if not os.path.isdir(norm):
        raise ConfigError(f"config key '{KEY}': {path!r} is not a directory (a run directory, or its "
                          f"checkpoints/step_N)")
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
    ``path`` differs from ``cfg`` (dept.variant among them: a DEPT run's checkpoint into an STD
    launch); a format-1 checkpoint is refused. (An STD launch only: config validation refuses
    the key under the DEPT variants.)"""
    from .manifest import read_manifest
    if read_manifest(path)["format"] == 1:
        raise ConfigError(f"config key '{KEY}': checkpoint {path} has format 1; convert it first: python "
                          f"tools/convert_checkpoint.py --run-dir {os.path.dirname(os.path.dirname(path))}")
    saved = read_json(path, DEPENDS_FILE)
    old, old_tok = saved.get("config", {}), saved.get("tokenizers", {})
    now = fingerprint(cfg)
    keys = MODEL_KEYS + (("model.seq_length",) if cfg.model.position_embedding == "learned" else ())
    diffs = [f"config key '{k}': the checkpoint has {old[k]!r}, this launch {now['config'][k]!r}"
             for k in keys if k in old and old[k] != now["config"][k]]
    a, b = old_tok.get("data.tokenizer"), now["tokenizers"].get("data.tokenizer")
    if (a is None) != (b is None) or (a is not None and a.get("sha256") != b.get("sha256")):
        diffs.append(f"config key 'data.tokenizer': the checkpoint was trained with "
                     f"{'no tokenizer' if a is None else repr(a.get('path'))}, this launch has "
                     f"{'none' if b is None else repr(b['path'])}"
                     + ("" if a is None or b is None else " (another file content)"))
    if diffs:
        raise ConfigError(f"{KEY}: checkpoint {path} holds another model:\n  " + "\n  ".join(diffs)
                          if len(diffs) > 1 else f"{KEY}: checkpoint {path} holds another model: {diffs[0]}")


def init_from(trainer, cfg: Config, device: torch.device) -> str:
    """Load the model weights of ``cfg.train.init_from``'s checkpoint into ``trainer`` (a fresh
    one: step 0, no optimizer state), on every rank; returns the checkpoint's path. Errors are
    agreed: every rank raises the same one."""
    from .checkpoint_format import load_entries
    from .checkpoint_state import model_entries
    from .parallel.agree import agree_errors
    from .run_inputs import input_errors
    path = source_checkpoint(cfg.train.init_from, device)
    agree_errors(lambda: check_source(cfg, path), input_errors(), device)
    agree_errors(lambda: load_entries(model_entries(trainer, optimizer=False), path), input_errors(), device)
    for opt in trainer.optimizers:
        opt.after_checkpoint_load(with_optimizer=False)  # the masters from the loaded weights
    return path
