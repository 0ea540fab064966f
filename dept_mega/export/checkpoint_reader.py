"""One source's full model weights out of a checkpoint, read in a single process.

This module is the only part of the export that knows how a checkpoint lies on disk; the rest
(architecture mapping, tokenizer, writing) sees a dict of FULL fp32 tensors named as in one
single-stage model (``dept_mega.model.gpt.GPTStage`` with every layer):

    body.layers.{i}.input_norm.weight|bias, body.layers.{i}.attention.qkv.weight|bias,
    body.layers.{i}.attention.proj.weight|bias, body.layers.{i}.mlp_norm.weight|bias,
    body.layers.{i}.mlp.fc1.weight|bias, body.layers.{i}.mlp.fc2.weight|bias,
    body.final_norm.weight|bias, embeddings.word_embeddings.weight,
    embeddings.output_layer.weight (untied head), embeddings.position_embeddings.weight (learned)

The token table (and untied head) has at least the vocabulary's rows: the model's tables are
padded to a multiple of 128 (the rows past the vocabulary are padding); TRIM's φ has exactly
the global vocabulary's rows.

The checkpoint formats read here. Format 2 (``dept_mega.checkpoint_format``): every tensor
read whole under its global key — the body ``model[/g{g}]/{name}``, a stored source's
embeddings ``source/{name}/model/embeddings...``, TRIM's tables ``dept/trim/{phi|phi_head|positions}``
— and each group's installed and stored sources from ``group{g}.json`` (``dept``). Format 1:

* ``step_N/`` — torch.distributed.checkpoint files; model keys
  ``model/g{group}/tp{t}/pp{p}/c{chunk}/{stage parameter name}`` (data-parallel replicas share
  keys), tensor-parallel shards split as the parameters' ``partition_dim`` /
  ``partition_stride`` say (read from the model code itself: the model is built on the meta
  device, which costs no memory);
* ``step_N/layout.json`` — tensor, pipeline, virtual_pipeline, data, groups;
* ``step_N/hooks_rank{r}.pt`` — a rank's DEPT state: ``installed`` (the source its group
  trains), ``store`` (``{source: {"embeddings": [module state dict per chunk], ...}}`` of the
  sources the group trained last), TRIM's global tables ``phi`` / ``phi_head`` and learned
  ``positions``. Loaded with ``weights_only=True`` (containers and tensors only).

Which source's embeddings and which body:

* std / glob — the embeddings in the model (the global vocabulary, shared by all sources);
* spec / spec_opt — the source's own embeddings: from the model of the group that has it
  installed, else from the store of the group that trained it last;
* trim — the global table φ (and the untied head's φ, learned positions), i.e. the global
  vocabulary: after a round's end the rows of V_k are in φ (the compact tables in the model
  are the group's working copies). Inside a round φ holds the round-start rows (it changes only
  at the round's end) while the group that has the source installed trains its compact
  tables: there φ's rows V_k (and φ_head's) are replaced by that group's compact rows, and the
  positions are that group's — the model it trains and evaluates with. The converter records
  V_k separately (see convert.py);
* the body — at a round boundary (a step that is a multiple of ``dept.local_steps``, where
  checkpoints are written by default) every group holds the same synchronised body, unless
  ``dept.outer_fragments`` > 1: the earlier fragments trained on after their own sync, so
  the groups' bodies differ there too (only the run's last step syncs them all again) and the
  body exported is that of group 0 (glob), else of the group that has the source installed
  (then spec / spec_opt: the group that stored it last; trim: group 0). A step inside a
  round holds one local body per group: the body of the group that trains the source then
  (spec / spec_opt / trim with the source installed), otherwise a clear error (with
  ``dept.outer_overlap`` and τ > 0 every boundary checkpoint is deferred into the next round,
  so glob with several groups exports the final step only).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import warnings
from typing import Any, Optional

import torch

from ..checkpoint import latest_step, step_dir
from ..config import Config
from ..run_paths import load_run_config
from ..variant import variant_of

_MODEL_KEY = re.compile(r"^model/g(\d+)/tp(\d+)/pp(\d+)/c(\d+)/(.+)$")


class CheckpointReadError(ValueError):
    """The checkpoint cannot give the requested weights (the message says why, in one line)."""


class FullWeights(dict):
    """``{full parameter name: full fp32 tensor}`` plus where they came from (``origin``)."""

    origin: str = ""
    step: int = 0


# ----------------------------------------------------------------------------- layout


def _layout(path: str) -> dict[str, int]:
    layout_path = os.path.join(path, "layout.json")
    if os.path.exists(layout_path):
        with open(layout_path, encoding="utf-8") as f:
            saved = json.load(f)
        try:
            return {k: int(saved[k]) for k in ("tensor", "pipeline", "virtual_pipeline", "data", "groups")}
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointReadError(f"{layout_path}: no valid layout ({exc!r})") from None
    raise CheckpointReadError(f"{layout_path} is missing: cannot tell the checkpoint's parallel layout")


def _rank(layout: dict[str, int], tp: int, dp: int, pp: int, group: int) -> int:
    """Global rank of a position (tp fastest, then dp, pp, group: docs/launching.md §2)."""
    T, D, P = layout["tensor"], layout["data"], layout["pipeline"]
    return tp + T * (dp + D * (pp + P * group))


def _load_hooks(path: str, rank: int) -> dict[str, Any]:
    f = os.path.join(path, f"hooks_rank{rank}.pt")
    if not os.path.exists(f):
        raise CheckpointReadError(f"{f} is missing (the DEPT state of rank {rank})")
    try:
        # mmap: only the tensors that are used are read (the file also holds optimizer state)
        return torch.load(f, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - a corrupt or foreign file: one line naming it
        raise CheckpointReadError(f"{f}: cannot be read ({type(exc).__name__}: {exc})") from None


# ----------------------------------------------------------------------------- model structure


def _structure(cfg: Config) -> dict[str, tuple[tuple[Optional[int], int], Optional[torch.Size]]]:
    """``{stage parameter name: ((partition_dim or None, partition_stride), full shape)}`` from
    the model code itself, built on the meta device (the shape only for the body: the
    vocabulary-owned tables depend on the source)."""
    from ..model.embeddings import VOCAB_MULTIPLE, SourceEmbeddings
    from ..model.gpt import TransformerBody
    from ..parallel.groups import Coords, ParallelGroups
    solo = ParallelGroups(tp_size=1, dp_size=1, pp_size=1, num_groups=1, rank=0, coords=Coords(0, 0, 0, 0))
    # the body's parameters do not depend on the position embedding; "learned" keeps the ALiBi
    # slope tables (computed with .tolist(), impossible on meta) out of the meta build
    body_cfg = dataclasses.replace(cfg.model, position_embedding="learned")
    with torch.device("meta"):
        body = TransformerBody(body_cfg, solo, range(cfg.model.num_layers), final_norm=True, seed=0,
                               device="meta")
        emb = SourceEmbeddings(cfg.model, solo, VOCAB_MULTIPLE, 0, True, True, device="meta")
    out: dict[str, tuple[tuple[Optional[int], int], Optional[torch.Size]]] = {}
    for prefix, module, shapes in (("body.", body, True), ("embeddings.", emb, False)):
        for name, p in module.named_parameters():
            part = (getattr(p, "partition_dim", None), int(getattr(p, "partition_stride", 1) or 1))
            out[prefix + name] = (part, p.shape if shapes else None)
    return out


def _unshard(shards: list[torch.Tensor], dim: Optional[int], stride: int, name: str) -> torch.Tensor:
    """Inverse of ``dept_mega.parallel.random.shard_rows``: ``shards[t]`` is tensor rank t's."""
    if len(shards) == 1 or dim is None:
        return shards[0]
    pieces = [s.chunk(stride, dim=dim) for s in shards]
    if any(len(p) != stride for p in pieces):
        raise CheckpointReadError(f"{name}: a shard cannot be split into {stride} blocks")
    return torch.cat([torch.cat([p[b] for p in pieces], dim=dim) for b in range(stride)], dim=dim)


# ----------------------------------------------------------------------------- DCP


def _dcp_keys(path: str) -> dict[str, Any]:
    from torch.distributed.checkpoint import FileSystemReader
    try:
        return dict(FileSystemReader(path).read_metadata().state_dict_metadata)
    except Exception as exc:  # noqa: BLE001
        raise CheckpointReadError(f"{path}: not a readable torch.distributed.checkpoint "
                                  f"({type(exc).__name__}: {exc})") from None


def _dcp_read(path: str, meta: dict[str, Any], keys: list[str]) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    state = {}
    for k in keys:
        m = meta[k]
        state[k] = torch.empty(tuple(m.size), dtype=m.properties.dtype)
    with warnings.catch_warnings():  # single process: DCP warns that it loads without dist
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=path, no_dist=True)
    return state


# ----------------------------------------------------------------------------- the reader


def trim_vocab_ids(cfg: Config, source: str) -> list[int]:
    """TRIM's V_k of ``source`` (the sorted token ids that occur in its data), as training used it."""
    from ..data.sources import vocab_set
    for i, s in enumerate(cfg.data.sources):
        if s.name == source:
            if not os.path.exists(s.prefix + ".bin"):
                raise CheckpointReadError(f"config key 'data.sources[{i}].prefix': {s.prefix}.bin does not exist "
                                          f"(TRIM's vocabulary set V_k of {source!r} is computed from the source's data)")
            return [int(x) for x in vocab_set(s.prefix, cfg.data.cache_dir)]
    raise CheckpointReadError(f"no source named {source!r} in data.sources")


def checkpoint_path(run_dir: str, step: Optional[int] = None) -> tuple[int, str]:
    """(step, its directory): ``step`` of the run, default the one ``latest`` names."""
    if step is None:
        step = latest_step(run_dir)
        if step is None:
            raise CheckpointReadError(f"{os.path.join(run_dir, 'checkpoints', 'latest')} does not exist "
                                      f"(no checkpoint in {run_dir})")
    path = step_dir(run_dir, step)
    if not os.path.isdir(path):
        raise CheckpointReadError(f"checkpoint {path} does not exist")
    return step, path


def read_full_weights(run_dir: str, step: Optional[int] = None, source: Optional[str] = None,
                      cfg: Optional[Config] = None) -> FullWeights:
    """The full fp32 weights of ``source``'s model at ``step`` (default: ``latest``).

    ``cfg``: the run's config (default: ``RUN/config.yaml``, dept_mega.run_paths). ``source`` may
    be None only for std, whose one model serves every source. Raises :class:`CheckpointReadError`."""
    if cfg is None:
        cfg, _ = load_run_config(run_dir)
    step, path = checkpoint_path(run_dir, step)
    from ..manifest import local_problem
    problem = local_problem(path)  # the manifest: every file present, of its size and checksum
    if problem:
        raise CheckpointReadError(f"checkpoint {path} is not usable: {problem}")
    variant = cfg.dept.variant
    names = [s.name for s in cfg.data.sources]
    if source is None and variant_of(variant).rounds:
        raise CheckpointReadError(f"a {variant} run has one model per source: name one of {names}")
    if source is not None and names and source not in names:
        raise CheckpointReadError(f"no source named {source!r} in the run's data.sources ({', '.join(names)})")

    from ..manifest import read_manifest
    layout = _layout(path)
    fmt = read_manifest(path)["format"]
    group, where = _locate(cfg, path, layout, step, source, fmt)
    structure = _structure(cfg)
    out = FullWeights()
    out.step = step
    # inside a round the installed group's compact tables (read with the body as its model's
    # tables) hold the source's current rows of V_k: they go over φ's
    in_round = where == "trim_round"
    model_where, dept_where = ("model", "trim") if in_round else (where, where)
    if fmt >= 2:  # global keys: whatever the layout, read whole
        _read_model_v2(path, layout, group, model_where, structure, out)
    else:
        _read_model_v1(path, layout, group, model_where, structure, out)
    compact = {n: out.pop(n) for n in list(out) if in_round and n.startswith("embeddings.")}
    if fmt >= 2:
        _read_dept_v2(path, dept_where, source, structure, out)
    else:
        _read_dept_v1(path, layout, group, dept_where, source, structure, out)
    if in_round:
        _overlay_compact(out, compact, trim_vocab_ids(cfg, source), path, source)
    out.origin = (f"step {step}, group {group}" +
                  {"model": "", "store": f" (source {source!r} from its group's store)",
                   "trim": " (TRIM: the global table φ)",
                   "trim_round": " (TRIM: the global table φ, the rows of the source's V_k from the group's "
                                 "compact table inside the round)"}[where])
    return out


def _overlay_compact(out: FullWeights, compact: dict[str, torch.Tensor], ids: list[int], path: str,
                     source: Optional[str]) -> None:
    """φ (and φ_head) in ``out`` with the rows V_k (``ids``, sorted) replaced by the first |V_k|
    rows of the group's compact tables (``compact``: row j is V_k's j-th id, TrimmedEmbeddings),
    and the group's learned positions: the model the group trains and evaluates with in the
    round (TrimStrategy.eval_embeddings), not φ as it was at the round's start."""
    from ..model.embeddings import padded_vocab_size
    index = torch.tensor(ids, dtype=torch.int64)
    for name, table in compact.items():
        if name == "embeddings.position_embeddings.weight":
            out[name] = table
            continue
        want = padded_vocab_size(max(len(ids), 1), 1)
        if table.shape[0] != want or name not in out:
            raise CheckpointReadError(f"{path}: the compact {name} of source {source!r} has {table.shape[0]} rows, "
                                      f"its V_k of {len(ids)} ids needs {want} (is its data the run's?)")
        full = out[name].clone()
        full[index] = table[:len(ids)]
        out[name] = full


def _read_dept_v1(path: str, layout: dict, group: int, where: str, source: Optional[str], structure: dict,
                  out: FullWeights) -> None:
    """The source's vocabulary-owned tensors of a format-1 checkpoint (its hook files)."""
    T, P, V = layout["tensor"], layout["pipeline"], layout["virtual_pipeline"]
    hooks0 = _load_hooks(path, _rank(layout, 0, 0, 0, group)) if where != "model" else {}
    first, last = (0, 0), (P - 1, V - 1)  # (pipeline rank, chunk) of the input side and the head
    emb_names = [n for n in structure if n.startswith("embeddings.")]
    if where == "store":
        for name in emb_names:
            pp, chunk = last if name == "embeddings.output_layer.weight" else first
            local = name[len("embeddings."):]
            shards = []
            for t in range(T):
                r = _rank(layout, t, 0, pp, group)
                sd = hooks0 if r == _rank(layout, 0, 0, 0, group) else _load_hooks(path, r)
                try:
                    shards.append(sd["store"][source]["embeddings"][chunk][local])
                except (KeyError, IndexError, TypeError):
                    raise CheckpointReadError(f"{path}/hooks_rank{r}.pt holds no {local} of source {source!r} "
                                              f"(chunk {chunk})") from None
            out[name] = _unshard(shards, *structure[name][0], name).float()
    elif where == "trim":  # the global tables
        table_rank = _rank(layout, 0, 0, 0, group)
        for name, key, pp in (("embeddings.word_embeddings.weight", "phi", 0),
                              ("embeddings.output_layer.weight", "phi_head", P - 1),
                              ("embeddings.position_embeddings.weight", "positions", 0)):
            if name not in structure:
                continue
            r = _rank(layout, 0, 0, pp, group)
            sd = hooks0 if r == table_rank else _load_hooks(path, r)
            if key not in sd:
                raise CheckpointReadError(f"{path}/hooks_rank{r}.pt has no {key!r} (TRIM's global table)")
            out[name] = _trim_rows(path, layout, pp, group, key, sd)


def _read_dept_v2(path: str, where: str, source: Optional[str], structure: dict, out: FullWeights) -> None:
    """The source's vocabulary-owned tensors of a format-2 checkpoint: its stored state
    (``source/{name}/model/...``) or TRIM's global tables (``dept/trim/...``), read whole."""
    from ..checkpoint_format import param_key, read_full, source_key, trim_key
    from ..manifest import CheckpointError
    tables = {"embeddings.word_embeddings.weight": "phi", "embeddings.output_layer.weight": "phi_head",
              "embeddings.position_embeddings.weight": "positions"}
    if where == "store":
        keys = {n: source_key(source, param_key(n, None)) for n in structure if n.startswith("embeddings.")}
    elif where == "trim":
        keys = {n: trim_key(k) for n, k in tables.items() if n in structure}
    else:
        return
    try:
        full = read_full(path, list(keys.values()))
    except CheckpointError as exc:
        raise CheckpointReadError(f"{exc} (source {source!r}; does config.yaml match the run?)") from None
    for name, key in keys.items():
        out[name] = full[key].float()


def _read_model_v1(path: str, layout: dict, group: int, where: str, structure: dict, out: FullWeights) -> None:
    """The body (and with ``where == "model"`` the embeddings) of a format-1 checkpoint:
    keys by position, tensor shards joined."""
    meta = _dcp_keys(path)
    model_keys: dict[tuple[int, int, int, int], dict[str, str]] = {}
    for key in meta:
        m = _MODEL_KEY.match(key)
        if m:
            g, t, p, c = (int(x) for x in m.groups()[:4])
            model_keys.setdefault((g, t, p, c), {})[m.group(5)] = key
    if not model_keys:
        raise CheckpointReadError(f"{path}: no model/g*/tp*/pp*/c*/ keys (an unknown checkpoint format)")
    T, P, V = layout["tensor"], layout["pipeline"], layout["virtual_pipeline"]

    # ---- body: every chunk of every pipeline stage of the group, tensor shards joined
    wanted: list[str] = []
    for (g, t, p, c), keys in model_keys.items():
        if g == group:
            wanted += [k for n, k in keys.items()
                       if n.startswith("body.") or (where == "model" and n.startswith("embeddings."))]
    loaded = _dcp_read(path, meta, wanted)
    by_name: dict[str, dict[int, list[tuple[int, int, torch.Tensor]]]] = {}
    for (g, t, p, c), keys in model_keys.items():
        if g != group:
            continue
        for n, k in keys.items():
            if k in loaded:
                by_name.setdefault(n, {}).setdefault(t, []).append((p, c, loaded[k]))
    for name, (part, shape) in structure.items():
        if not name.startswith("body."):
            continue
        if name not in by_name:
            raise CheckpointReadError(f"{path}: no shards of {name} for group {group} "
                                      f"(does config.yaml match the run?)")
        shards = [by_name[name][t][0][2] for t in range(T) if t in by_name[name]]
        if len(shards) != T:
            raise CheckpointReadError(f"{path}: {name} has {len(shards)} tensor shards, layout says {T}")
        full = _unshard(shards, part[0], part[1], name).float()
        if shape is not None and tuple(full.shape) != tuple(shape):
            raise CheckpointReadError(f"{path}: {name} has shape {tuple(full.shape)}, the config's model "
                                      f"needs {tuple(shape)} (does config.yaml match the run?)")
        out[name] = full
    extra = sorted(n for n in by_name if n.startswith("body.") and n not in structure)
    if extra:
        raise CheckpointReadError(f"{path}: body parameter {extra[0]} is not in the config's model "
                                  f"(does config.yaml match the run?)")

    emb_names = [n for n in structure if n.startswith("embeddings.")]
    first, last = (0, 0), (P - 1, V - 1)
    if where == "model":
        for name in emb_names:
            side = last if name == "embeddings.output_layer.weight" else first
            per_tp = by_name.get(name, {})
            shards = [s[2] for t in range(T) for s in per_tp.get(t, []) if (s[0], s[1]) == side]
            if len(shards) != T:
                raise CheckpointReadError(f"{path}: {name} has {len(shards)} tensor shards at pipeline stage "
                                          f"{side[0]} chunk {side[1]}, layout says {T}")
            out[name] = _unshard(shards, *structure[name][0], name).float()


def _read_model_v2(path: str, layout: dict, group: int, where: str, structure: dict, out: FullWeights) -> None:
    """The body (and with ``where == "model"`` the embeddings) of a format-2 checkpoint: each
    global tensor read whole (``dept_mega.checkpoint_format``; a strided split's axis merged)."""
    from ..checkpoint_format import param_key, read_full
    from ..manifest import CheckpointError
    names = [n for n in structure if n.startswith("body.") or (where == "model" and n.startswith("embeddings."))]
    keys = {n: param_key(n, group if int(layout["groups"]) > 1 else None) for n in names}
    try:
        full = read_full(path, list(keys.values()))
    except CheckpointError as exc:
        raise CheckpointReadError(f"{exc} (does config.yaml match the run?)") from None
    for name in names:
        (dim, stride), shape = structure[name]
        t = full[keys[name]]
        if dim is not None and stride > 1:
            t = t.flatten(dim, dim + 1)
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise CheckpointReadError(f"{path}: {name} has shape {tuple(t.shape)}, the config's model "
                                      f"needs {tuple(shape)} (does config.yaml match the run?)")
        out[name] = t.float()


def _trim_rows(path: str, layout: dict[str, int], pp: int, group: int, key: str, sd: dict) -> torch.Tensor:
    """TRIM's whole table ``key`` of stage ``pp``: the rows of every tp × dp rank of the stage
    joined in row order (dept/trim.py TrimTable; a table without ``{key}_rows`` is whole)."""
    rows = sd.get(f"{key}_rows")
    if rows is None or (rows[0] == 0 and rows[1] == rows[2]):
        return sd[key].detach().float().clone()
    parts, end = [], 0
    for d in range(layout["data"]):
        for t in range(layout["tensor"]):
            r = _rank(layout, t, d, pp, group)
            other = sd if (t, d) == (0, 0) else _load_hooks(path, r)
            got = other.get(f"{key}_rows")
            if key not in other or got is None or got[0] != end:
                raise CheckpointReadError(f"{path}/hooks_rank{r}.pt: TRIM table {key!r} rows {got!r} do not "
                                          f"continue at row {end}")
            parts.append(other[key].detach().float())
            end = got[1]
    if end != rows[2]:
        raise CheckpointReadError(f"{path}: TRIM table {key!r} shards cover {end} of {rows[2]} rows")
    return torch.cat(parts)


def _holdings(path: str, layout: dict[str, int], fmt: int) -> dict[int, tuple[Optional[str], set]]:
    """Per group: (the installed source, the stored sources) — format 2: ``group{g}.json``'s
    ``dept``; format 1: the hook file of the group's first rank."""
    out = {}
    for g in range(layout["groups"]):
        if fmt >= 2:
            f = os.path.join(path, f"group{g}.json")
            try:
                with open(f, encoding="utf-8") as fh:
                    dept = json.load(fh).get("dept") or {}
            except (OSError, ValueError) as exc:
                raise CheckpointReadError(f"{f}: cannot be read ({type(exc).__name__}: {exc})") from None
        else:
            dept = _load_hooks(path, _rank(layout, 0, 0, 0, g))
        out[g] = (dept.get("installed"), set(dept.get("store") or {}))
    return out


def _locate(cfg: Config, path: str, layout: dict[str, int], step: int, source: Optional[str],
            fmt: int) -> tuple[int, str]:
    """(group whose body to take, where the embeddings are: model | store | trim | trim_round
    (φ with the installed group's compact rows: a step inside a round))."""
    v = variant_of(cfg)
    G = layout["groups"]
    in_round = v.rounds and step % cfg.dept.local_steps != 0  # (train.steps is a multiple of it)
    mid_round = G > 1 and in_round
    if not v.source_embeddings:  # std, glob: the model holds the one shared table
        if mid_round:
            overlap = (f"; with dept.outer_overlap the boundary checkpoints are deferred past the sync "
                       f"(dept.outer_delay={cfg.dept.outer_delay}), so the run's final checkpoint is the one "
                       f"that exports" if cfg.dept.outer_overlap else "")
            raise CheckpointReadError(f"step {step} is inside a round (dept.local_steps={cfg.dept.local_steps}): "
                                      f"the {G} groups hold different local models; export a step that is a "
                                      f"multiple of {cfg.dept.local_steps} (--step){overlap}")
        return 0, "model"  # (dept.outer_fragments > 1: group 0's body; only the final step re-syncs all)
    held = _holdings(path, layout, fmt)
    installed = [g for g in range(G) if held[g][0] == source]
    stored = [g for g in range(G) if source in held[g][1]]
    if v.trimmed:
        if mid_round and not installed:
            raise CheckpointReadError(f"step {step} is inside a round and no group trains {source!r} in it: "
                                      f"export a step that is a multiple of dept.local_steps={cfg.dept.local_steps}")
        if in_round and installed:  # (G = 1 too: its source's rows moved since the round's start)
            return installed[0], "trim_round"
        return (installed[0] if installed else 0), "trim"
    if installed:
        return installed[0], "model"
    if stored:
        if mid_round:
            raise CheckpointReadError(f"step {step} is inside a round and no group trains {source!r} in it: "
                                      f"export a step that is a multiple of dept.local_steps={cfg.dept.local_steps}")
        return stored[0], "store"
    raise CheckpointReadError(f"source {source!r} has no trained embeddings at step {step} "
                              f"(no group has trained it yet)")
