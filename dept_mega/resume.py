"""What a resume checks, and which checkpoint it takes.

* :func:`select_checkpoint`: the newest complete, verified checkpoint of a run. ``latest``
  names the newest step; when it is garbage, names a step that does not exist, or that step
  fails verification (``dept_mega.manifest``: missing, truncated or corrupted file, bad
  manifest), the reason is reported in one line naming the file and the next older step
  directory is tried. When no checkpoint is usable: :class:`CheckpointError` (one line).
  Every rank takes the same decision: rank 0's view of the directory is shared, each rank
  checks a share of the files, and the first problem in rank order counts everywhere.
* ``step_N/depends.json`` (:func:`fingerprint`, :func:`check_depends`): the config values the
  checkpoint's tensors and data positions depend on (model shape, DEPT variant and rounds,
  sources), the checksums of the tokenizers in use, and which data its positions index
  (``data``: ``data.split``, ``train.seed``, each source's files by content;
  :mod:`dept_mega.data.identity`). A resume whose config differs in one of them is one
  :class:`ConfigError` naming every such key, before DCP loads anything; a change of data only
  with ``train.allow_data_change`` (then logged). A checkpoint that does not record its data
  (written before dept_mega recorded it) resumes with a note saying its data is not checked.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .config import Config
from .config_diff import both, check_differing
from .data.identity import data_differences, data_fingerprint
from .manifest import STEP_DIR, CheckpointError, local_problem, read_json, DEPENDS_FILE
from .parallel.agree import all_gather_text, first_problem, mark_agreed
from .variant import variant_of

CKPT_DIR = "checkpoints"

# config values a checkpoint depends on (resolved: None defaults filled in)
DEPENDS_KEYS = ("model.num_layers", "model.hidden_size", "model.num_attention_heads", "model.num_query_groups",
                "model.ffn_hidden_size", "model.activation", "model.normalization", "model.position_embedding",
                "model.seq_length", "model.tie_embeddings", "model.bias", "model.norm_bias", "model.vocab_size",
                "dept.variant", "dept.local_steps", "dept.sampling", "dept.temperature",
                "dept.outer_optimizer.name", "dept.reset_inner_optimizer", "dept.outer_fragments",
                "dept.body_optimizer_state", "data.sources", "data.sources[].weight", "data.sources[].group")


def step_dir(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, CKPT_DIR, f"step_{step}")


def run_and_step(path: str) -> Optional[tuple[str, int]]:
    """``(RUN, N)`` when ``path`` names a checkpoint directory ``RUN/checkpoints/step_N`` (the
    inverse of :func:`step_dir`), else None."""
    norm = os.path.normpath(path)
    m = STEP_DIR.match(os.path.basename(norm))
    if m is None or os.path.basename(os.path.dirname(norm)) != CKPT_DIR:
        return None
    return os.path.dirname(os.path.dirname(norm)), int(m.group(1))


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def read_latest(run_dir: str) -> tuple[Optional[int], Optional[str]]:
    """(step named by ``checkpoints/latest`` or None, problem with the file or None)."""
    path = os.path.join(run_dir, CKPT_DIR, "latest")
    try:
        with open(path, "rb") as f:
            raw = f.read(256)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"{path} is unreadable ({exc.strerror})"
    text = raw.decode("utf-8", errors="replace").strip()
    if not text.isdigit():
        return None, f"{path} does not hold a step number (it holds {text[:40]!r})"
    return int(text), None


def latest_step(run_dir: str) -> Optional[int]:
    """The step ``checkpoints/latest`` names (unverified; :func:`select_checkpoint` verifies)."""
    path = os.path.join(run_dir, CKPT_DIR, "latest")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read().strip()
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{path}: expected a step number, got {text!r}") from None


def step_dirs(run_dir: str) -> list[int]:
    """Steps with a ``step_N`` directory (complete saves; ``step_N.tmp`` are not), newest first."""
    try:
        names = os.listdir(os.path.join(run_dir, CKPT_DIR))
    except (FileNotFoundError, NotADirectoryError):
        return []
    steps = [int(m.group(1)) for n in names if (m := STEP_DIR.match(n))
             and os.path.isdir(os.path.join(run_dir, CKPT_DIR, n))]
    return sorted(steps, reverse=True)


def verify_checkpoint(path: str, device: Optional[torch.device] = None) -> Optional[str]:
    """Why ``path`` must not be loaded (the same answer on every rank), or None."""
    rank, world = _rank_world()
    return first_problem(local_problem(path, rank, world), device)


@dataclass
class Selection:
    step: Optional[int]
    notes: list[str] = field(default_factory=list)  # one line per checkpoint passed over


def _plan(run_dir: str) -> dict[str, Any]:
    latest, problem = read_latest(run_dir)
    steps = step_dirs(run_dir)
    ckdir = os.path.join(run_dir, CKPT_DIR)
    notes = [problem] if problem else []
    if latest is not None:
        if latest not in steps:
            notes.append(f"{ckdir}/latest names step {latest}, but {step_dir(run_dir, latest)} does not exist")
        candidates = [s for s in steps if s <= latest]
    else:
        candidates = steps
        if steps and problem is None:
            notes.append(f"{ckdir}/latest is missing; trying the step directories")
    return {"candidates": candidates, "notes": notes, "any": latest is not None or problem is not None
            or bool(steps)}


def select_checkpoint(run_dir: str, device: Optional[torch.device] = None,
                      step: Optional[int] = None) -> Selection:
    """The checkpoint to resume from (see the module doc). ``step`` given: that one or a
    :class:`CheckpointError`. Nothing saved yet: ``Selection(None)``."""
    if step is not None:
        path = step_dir(run_dir, step)
        problem = verify_checkpoint(path, device)
        if problem:
            raise mark_agreed(CheckpointError(f"checkpoint {path} is not usable: {problem}"))
        return Selection(step)
    # rank 0's view of the directory decides for everyone (a network file system may show
    # another node a directory listing a moment late)
    plan = json.loads(all_gather_text(json.dumps(_plan(run_dir)), device)[0])
    notes = list(plan["notes"])
    for s in plan["candidates"]:
        path = step_dir(run_dir, s)
        problem = verify_checkpoint(path, device)
        if problem is None:
            return Selection(s, notes)
        notes.append(f"checkpoint {path} is not usable: {problem}")
    if not plan["any"]:
        return Selection(None)
    ckdir = os.path.join(run_dir, CKPT_DIR)
    # (rank 0's plan, every rank's verification: the same error on every rank)
    raise mark_agreed(CheckpointError(f"no complete, verified checkpoint in {ckdir} to resume from: "
                                      + "; ".join(notes) + f" (move {ckdir} away to start the run from scratch)"))


# ------------------------------------------------------------------------- depends.json


def _file_sha256(path: str, cache: Optional[dict] = None) -> Optional[str]:
    """The tokenizer's digest (``data.tokenizer.model_sha256``), None where it cannot be read."""
    from .data.tokenizer import model_sha256
    try:
        return model_sha256(path, cache)
    except OSError:
        return None


def _config_values(cfg: Config) -> dict[str, Any]:
    m, d, rounds = cfg.model, cfg.dept, variant_of(cfg).rounds
    return {"model.num_layers": m.num_layers, "model.hidden_size": m.hidden_size,
            "model.num_attention_heads": m.num_attention_heads, "model.num_query_groups": m.query_groups,
            "model.ffn_hidden_size": m.ffn_size, "model.activation": m.activation,
            "model.normalization": m.normalization, "model.position_embedding": m.position_embedding,
            "model.seq_length": m.seq_length, "model.tie_embeddings": m.tie_embeddings, "model.bias": m.bias,
            "model.norm_bias": m.norm_bias,
            "model.vocab_size": m.vocab_size, "dept.variant": d.variant, "dept.local_steps": d.local_steps,
            "dept.sampling": d.sampling, "dept.temperature": d.temperature,
            "dept.outer_optimizer.name": d.outer_optimizer.name,
            "dept.reset_inner_optimizer": d.reset_inner_optimizer, "dept.outer_fragments": d.outer_fragments,
            "dept.body_optimizer_state": d.body_optimizer_state, "data.sources": [s.name for s in cfg.data.sources],
            # DEPT's round plans, from which every source's data position is recomputed (STD's
            # blend keeps the samples each source gave: another weight only mixes on from there)
            "data.sources[].weight": [s.weight for s in cfg.data.sources] if rounds else None,
            "data.sources[].group": [s.group for s in cfg.data.sources] if rounds else None}


def _tokenizers(cfg: Config) -> dict[str, str]:
    """{config key: tokenizer path} of the tokenizers whose vocabularies the model embeds."""
    if variant_of(cfg).own_tokenizer:
        return {f"data.sources[{i}].tokenizer": s.tokenizer for i, s in enumerate(cfg.data.sources) if s.tokenizer}
    return {"data.tokenizer": cfg.data.tokenizer} if cfg.data.tokenizer else {}


def fingerprint(cfg: Config, cache: Optional[dict] = None) -> dict[str, Any]:
    """The content of ``step_N/depends.json``."""
    from .data.summary import foreign_summaries
    foreign = foreign_summaries(cfg)  # a federated group job: the other sites' sources by their summaries
    return {"config": _config_values(cfg), "tokenizers": tokenizer_fingerprint(cfg, cache, foreign),
            "data": data_fingerprint(cfg, cache, {cfg.data.sources[i].name: f["identity"] for i, f in foreign.items()})}


def tokenizer_fingerprint(cfg: Config, cache: Optional[dict] = None,
                          foreign: Optional[dict] = None) -> dict[str, dict[str, Any]]:
    """``depends.json``'s ``tokenizers``: ``{config key: {"path", "sha256"}}`` of the tokenizers
    whose vocabularies the model embeds. ``foreign``: a federated group job's other sites'
    summaries (default: read), whose tokenizers are known by their checksums."""
    if foreign is None:
        from .data.summary import foreign_summaries
        foreign = foreign_summaries(cfg)

    def digest(key: str, path: str) -> Optional[str]:  # another site's tokenizer: its summary's checksum
        i = int(key[len("data.sources["):].split("]")[0]) if key.startswith("data.sources[") else None
        if i in foreign:
            return foreign[i]["tokenizer"].get("sha256")
        return _file_sha256(path, cache)
    return {k: {"path": p, "sha256": digest(k, p)} for k, p in _tokenizers(cfg).items()}


#: what a refused change of data tells the user (``train.allow_data_change``)
DATA_CHANGE_REMEDY = ("to continue on the changed data knowingly, set train.allow_data_change=true (the saved data "
                      "positions then index the new data; under another data.split or train.seed, validation "
                      "documents may already have been trained on)")


def check_depends(cfg: Config, path: str, cache: Optional[dict] = None, remedy: Optional[str] = None,
                  data: bool = True) -> list[str]:
    """One ConfigError naming every key whose value differs from the checkpoint's, with both
    values (the :data:`DEPENDS_KEYS` in their order, then the tokenizer keys sorted, then the
    data): a launch that changed three keys learns all three at once, not one per relaunch.
    ``remedy``: what the message tells the user to do (default: a training launch's, resume or
    a new run directory). ``data``: also check the data the checkpoint's positions index
    (:func:`dept_mega.data.identity.data_differences`; a resume, not an evaluation): a change is
    in the error unless ``train.allow_data_change``. Returns the lines to log: each change of
    data accepted under ``train.allow_data_change``, or that the checkpoint does not record its
    data."""
    saved, now = read_json(path, DEPENDS_FILE), fingerprint(cfg, cache)
    rows = depends_differences(saved, now)
    notes: list[str] = []
    advice = remedy or "resume with the checkpoint's values, or start a new train.run_dir"
    if data:
        changed = data_differences(saved.get("data") if isinstance(saved, dict) else None, now["data"], cfg)
        if changed is None:
            notes.append(f"checkpoint {path} does not record which data it read (written before dept_mega recorded "
                         f"it): data.split, train.seed and the sources' files are not checked against it")
        elif changed and cfg.train.allow_data_change:
            notes += [f"resuming on changed data (train.allow_data_change=true): config key '{key}': {what}"
                      for key, what in changed]
        elif changed:
            rows += changed
            advice += f"; {DATA_CHANGE_REMEDY}"
    check_differing(rows, f"from checkpoint {path}", advice)
    return notes


def depends_differences(saved: Any, now: dict, keys: tuple = DEPENDS_KEYS, tokenizers: Optional[tuple] = None,
                        same: Optional[Callable[[str, Any, Any], bool]] = None) -> list[tuple[str, str]]:
    """(key, both values) for each of ``keys`` whose value in ``depends.json`` (``saved``) this
    launch's :func:`fingerprint` (``now``) changes, then for each tokenizer key (those in
    ``tokenizers``; None: all) whose file content changes. A key the checkpoint does not record
    is not compared; ``same(key, old, new)`` True: a change that does not count."""
    old_cfg = saved.get("config", {}) if isinstance(saved, dict) else {}
    old_tok = saved.get("tokenizers", {}) if isinstance(saved, dict) else {}
    out = [(key, both(old_cfg[key], now["config"][key])) for key in keys
           if key in old_cfg and old_cfg[key] != now["config"][key]
           and not (same is not None and same(key, old_cfg[key], now["config"][key]))]
    for key in sorted(k for k in set(old_tok) | set(now["tokenizers"]) if tokenizers is None or k in tokenizers):
        a, b = old_tok.get(key), now["tokenizers"].get(key)
        if a is None or b is None:
            out.append((key, f"the checkpoint was trained with {'no tokenizer' if a is None else repr(a.get('path'))}, "
                             f"this launch has {'none' if b is None else repr(b['path'])}"))
        elif a.get("sha256") != b["sha256"]:
            out.append((key, f"the checkpoint was trained with tokenizer {a.get('path')!r} (sha256 "
                             f"{str(a.get('sha256'))[:12]}), this launch gives {b['path']!r} (sha256 "
                             f"{str(b['sha256'])[:12]}): another vocabulary"))
    return out
