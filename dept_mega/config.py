"""Typed run configuration: YAML file + dotted command-line overrides + validation.

Every section of the YAML file is a dataclass (the reference: docs/config.md).
``load_config`` reads a YAML file, applies ``key.sub=value`` overrides (values parsed as
YAML), checks keys and types, and returns a :class:`Config`. ``validate`` checks the combinations that need the world size or the file
system; it runs before any process group or file is created, and every failure is a
:class:`ConfigError` naming the key and the value.
"""
from __future__ import annotations

import dataclasses
import difflib
import glob
import os
import types
import typing
from typing import Any, Optional

import yaml

from .config_schema import (  # noqa: F401 - the schema is re-exported: import it from here
    ConfigError, ModelConfig, ParallelConfig, OuterOptimizerConfig, DeptConfig, SourceConfig, DataConfig, OptimConfig, ProfileConfig, TrainConfig, FederationConfig, Config, CHOICES, FP8_GEMM_MAX_TUNING, get_key)
from .config_origin import leaf_keys, origin, override_key
from .variant import one_group_data_hint, variant_of


# ----------------------------------------------------------------------------- building


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp`` and build nested dataclasses."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if inner == [bool] and not isinstance(value, bool):  # optim.fused, fp8_fused_casts, train.tensorboard
            raise ConfigError(f"config key '{key}': expected true, false or null (null: chosen automatically, "
                              f"as docs/config.md says for the key), got {value!r}")
        return _convert(value, inner[0], key)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}': expected a mapping, got {value!r}")
        return _build(tp, value, key)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key '{key}': expected a list, got {value!r}")
        return [_convert(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"config key '{key}': expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config key '{key}': expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            # YAML 1.1 reads "6e-4" (no dot) as a string; accept numeric strings explicitly.
            if isinstance(value, str):
                try:
                    return float(value)
                except ValueError:
                    pass
            raise ConfigError(f"config key '{key}': expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"config key '{key}': expected a string, got {value!r}")
        return value
    raise ConfigError(f"config key '{key}': unsupported type {_type_name(tp)}")


def _unknown_key(key: str, known) -> ConfigError:
    """The error for a key its section does not have, with the closest key of that section when
    one is close (a typo such as ``model.hiden_size``)."""
    head, _, last = key.rpartition(".")
    near = difflib.get_close_matches(last, sorted(known), n=1, cutoff=0.75)
    if near:
        return ConfigError(f"unknown config key '{key}'; did you mean '{head + '.' if head else ''}{near[0]}'? "
                           f"(every key: docs/config.md)")
    # no typo: perhaps a Megatron-LM / torchtitan setting under its own name (optim.adam_beta1)
    return ConfigError(f"unknown config key '{key}' (every key: docs/config.md; Megatron-LM's and torchtitan's "
                       f"settings and their keys here: docs/migrating.md)")


def _build(cls: type, values: dict[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in values.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k not in names:
            raise _unknown_key(key, names)
        kwargs[k] = _convert(v, hints[k], key)
    return cls(**kwargs)


def _unwrap_optional(tp: Any) -> Any:
    """``Optional[X]`` -> ``X`` (so dotted overrides reach into optional sections)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(inner) == 1:
            return inner[0]
    return tp


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``tree[a][b][c] = value`` for ``dotted = 'a.b.c'``; list items by index."""
    parts = dotted.split(".")
    node: Any = tree
    cls: Any = Config
    for i, part in enumerate(parts):
        here = ".".join(parts[: i + 1])
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"config key '{here}': no list item {part!r}")
            idx = int(part)
            if i == len(parts) - 1:
                node[idx] = value
                return
            node = node[idx]
            continue
        hints = typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}
        if part not in hints:
            raise _unknown_key(here, hints)
        if i == len(parts) - 1:
            node[part] = value
            return
        tp = _unwrap_optional(hints[part])
        if typing.get_origin(tp) is list:
            node.setdefault(part, [])
            cls = typing.get_args(tp)[0]
        else:
            node.setdefault(part, {})
            if node[part] is None:
                node[part] = {}
            cls = tp
        node = node[part]


def parse_override(text: str) -> tuple[str, Any]:
    """``'parallel.tensor=2'`` -> ``('parallel.tensor', 2)``; the value is read as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key.sub=value")
    key, raw = override_key(text), text.split("=", 1)[1]
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"override '{key}': value {raw!r} is not valid YAML ({exc})") from exc
    return key, value


def config_from_dict(values: dict[str, Any], overrides: list[str] | tuple[str, ...] = ()) -> Config:
    tree = dict(values or {})
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(tree, key, value)
    cfg = _build(Config, tree)
    # which keys the file and the overrides set: an error about a key left at its default says so
    # (default_note); not a dataclass field, so never written to config.yaml
    cfg.set_keys = frozenset(leaf_keys(tree))
    _check_choices(cfg)
    _check_values(cfg)
    return cfg


def default_note(cfg: Config, key: str, hint: str = "") -> str:
    """``" (the default[; hint])"`` when the config file and the overrides left ``key`` unset (its
    value is then the schema's default, which the user may not know is in play), else ``""``;
    also ``""`` for a Config built in code (nothing recorded)."""
    keys = getattr(cfg, "set_keys", None)
    if keys is None or any(k == key or key.startswith(k + ".") or k.startswith(key + ".") for k in keys):
        return ""
    return f" (the default{'; ' + hint if hint else ''})"


def load_config(path: str | os.PathLike[str] | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML config (or start from defaults when ``path`` is None) and apply overrides."""
    values: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                values = yaml.safe_load(f) or {}
        except FileNotFoundError as exc:
            raise ConfigError(f"config file {str(path)!r} does not exist") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {exc}") from exc
        if not isinstance(values, dict):
            raise ConfigError(f"config file {str(path)!r}: top level must be a mapping")
    try:
        return config_from_dict(values, overrides)
    except ConfigError as exc:  # the key's origin: an override, or the file's line
        raise ConfigError(origin(str(exc), None if path is None else str(path), overrides)) from None


def _check_choices(cfg: Config) -> None:
    for key, allowed in CHOICES.items():
        value = get_key(cfg, key)
        if value not in allowed:
            shown = " | ".join("null" if a is None else str(a) for a in allowed)
            raise ConfigError(f"config key '{key}': {value!r} is not one of {shown}")


def _positive(cfg: Config, keys: list[str], allow_zero: bool = False) -> None:
    for key in keys:
        value = get_key(cfg, key)
        if value is None:
            continue
        if value < 0 or (value == 0 and not allow_zero):
            raise ConfigError(f"config key '{key}': must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def _check_values(cfg: Config) -> None:
    """Checks that need neither the world size nor the file system."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    _positive(cfg, ["model.num_layers", "model.hidden_size", "model.num_attention_heads",
                    "model.num_query_groups", "model.ffn_hidden_size", "model.seq_length",
                    "model.vocab_size", "model.recompute_layers", "fp8_amax_history", "parallel.tensor",
                    "parallel.pipeline", "parallel.data", "parallel.virtual_pipeline", "dept.local_steps", "train.steps",
                    "train.micro_batch_size", "train.global_batch_size", "train.log_interval", "train.exit_interval",
                    "train.exit_duration_mins",
                    "optim.max_consecutive_nonfinite", "train.init_timeout_s", "optim.grad_bucket_size",
                    "dept.outer_quant_block", "dept.outer_fragments", "optim.lr_decay_steps",
                    "optim.lr_wsd_decay_steps"])
    _positive(cfg, ["optim.lr", "optim.min_lr", "optim.warmup_steps", "optim.weight_decay",
                    "optim.eps", "optim.clip_grad", "dept.temperature", "train.eval_interval",
                    "train.eval_iters", "train.eval_samples", "train.save_interval", "train.keep_checkpoints", "model.hidden_dropout",
                    "model.attention_dropout", "dept.outer_delay", "fp8_gemm_tuning"], allow_zero=True)
    if cfg.fp8_gemm_tuning > FP8_GEMM_MAX_TUNING:
        raise ConfigError(f"config key 'fp8_gemm_tuning': at most {FP8_GEMM_MAX_TUNING} algorithms are timed, got "
                          f"{cfg.fp8_gemm_tuning}")
    if m.hidden_size % m.num_attention_heads:
        raise ConfigError(f"config key 'model.hidden_size': {m.hidden_size} is not divisible by "
                          f"model.num_attention_heads={m.num_attention_heads}")
    if m.num_attention_heads % m.query_groups:
        raise ConfigError(f"config key 'model.num_query_groups': model.num_attention_heads="
                          f"{m.num_attention_heads} is not divisible by {m.query_groups}")
    if m.position_embedding == "rope" and m.head_dim % 2:
        raise ConfigError(f"config key 'model.position_embedding': rope needs an even head size, got {m.head_dim}")
    if m.num_attention_heads % p.tensor:
        raise ConfigError(f"config key 'parallel.tensor': model.num_attention_heads="
                          f"{m.num_attention_heads} is not divisible by {p.tensor}")
    if m.query_groups % p.tensor:
        raise ConfigError(f"config key 'parallel.tensor': model.num_query_groups={m.query_groups} "
                          f"is not divisible by {p.tensor}")
    if m.ffn_size % p.tensor:
        raise ConfigError(f"config key 'parallel.tensor': model.ffn_hidden_size={m.ffn_size} "
                          f"is not divisible by {p.tensor}")
    if p.sequence_parallel and m.seq_length % p.tensor:
        raise ConfigError(f"config key 'parallel.sequence_parallel': model.seq_length={m.seq_length} "
                          f"is not divisible by parallel.tensor={p.tensor}")
    if m.num_layers % (p.pipeline * p.virtual_pipeline):
        raise ConfigError(f"config key 'parallel.pipeline': model.num_layers={m.num_layers} is not "
                          f"divisible by pipeline × virtual_pipeline = {p.pipeline * p.virtual_pipeline}")
    if p.virtual_pipeline > 1 and p.pipeline == 1:
        raise ConfigError("config key 'parallel.virtual_pipeline': interleaving needs parallel.pipeline > 1")
    if t.global_batch_size % (t.micro_batch_size * p.data):
        raise ConfigError(f"config key 'train.global_batch_size': {t.global_batch_size} is not divisible "
                          f"by train.micro_batch_size × parallel.data = {t.micro_batch_size * p.data}")
    if p.virtual_pipeline > 1 and (n := t.global_batch_size // (t.micro_batch_size * p.data)) % p.pipeline:
        raise ConfigError(f"config key 'train.global_batch_size': parallel.virtual_pipeline > 1 needs the micro-batches per "
                          f"step ({n} = global_batch_size / (micro_batch_size × data)) to be a multiple of parallel.pipeline={p.pipeline}")
    if t.init_from is not None and not t.init_from.strip():
        raise ConfigError("config key 'train.init_from': a run directory or its checkpoints/step_N, or null")
    if t.wandb is not None and not t.wandb.strip():
        raise ConfigError("config key 'train.wandb': a Weights & Biases project name, or null for off")
    _check_schedule(cfg)
    if cfg.optim.min_lr > cfg.optim.lr:
        raise ConfigError(f"config key 'optim.min_lr': {cfg.optim.min_lr} is above optim.lr={cfg.optim.lr}")
    if len(cfg.optim.betas) != 2:
        raise ConfigError(f"config key 'optim.betas': expected two numbers, got {cfg.optim.betas!r}")
    if len(cfg.dept.outer_optimizer.betas) != 2:
        raise ConfigError(f"config key 'dept.outer_optimizer.betas': expected two numbers, "
                          f"got {cfg.dept.outer_optimizer.betas!r}")
    try:
        parts = [float(x) for x in cfg.data.split.split(",")]
    except ValueError:
        parts = []
    if len(parts) not in (2, 3) or any(x < 0 for x in parts) or sum(parts) <= 0 or parts[0] <= 0:
        raise ConfigError(f"config key 'data.split': {cfg.data.split!r} is not 'train,valid' weights like '98,2'")
    names = [s.name for s in cfg.data.sources]
    for i, s in enumerate(cfg.data.sources):
        if not s.name:
            raise ConfigError(f"config key 'data.sources[{i}].name': a source needs a name")
        if s.weight <= 0:
            raise ConfigError(f"config key 'data.sources[{i}].weight': must be > 0, got {s.weight}")
        if s.weight != 1.0 and cfg.dept.sampling == "balanced":
            raise ConfigError(f"config key 'data.sources[{i}].weight': {s.weight} has no effect under "
                              f"dept.sampling=balanced (every source trained once before any again); set "
                              f"dept.sampling=weights, proportional or temperature, or drop the weight")
        if s.weight != 1.0 and cfg.dept.sampling == "uniform":
            raise ConfigError(f"config key 'data.sources[{i}].weight': {s.weight} has no effect under "
                              f"dept.sampling=uniform (the default: every source equally likely); set "
                              f"dept.sampling=weights (the weights alone are the shares, as Megatron-LM's "
                              f"--data-path 0.3 A 0.7 B), proportional (a source's share ∝ its tokens × weight) or "
                              f"temperature ((tokens × weight)^dept.temperature), or drop the weight")
    if cfg.dept.sampling == "balanced" and not variant_of(cfg).rounds:
        raise ConfigError("config key 'dept.sampling': balanced orders DEPT's rounds (every source once before any "
                          "again); std mixes the sources in every batch: use uniform for equal shares")
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"config key 'data.sources': duplicate source name(s) {dupes}")
    if cfg.fp8 is not None and cfg.precision != "bf16":
        raise ConfigError(f"config key 'fp8': {cfg.fp8!r} needs precision: bf16, got {cfg.precision!r}")
    if cfg.fp8_fused_casts is True and cfg.fp8 is None:
        raise ConfigError("config key 'fp8_fused_casts': true fuses casts into the native FP8 linears, but fp8 is "
                          "off (set fp8: hybrid or e4m3, or fp8_fused_casts: false)")
    _check_eager_fp8(cfg)
    if t.profile is not None:
        prof = t.profile
        if prof.start < 0 or prof.stop <= prof.start:
            raise ConfigError(f"config key 'train.profile': needs 0 <= start < stop, got start={prof.start} "
                              f"stop={prof.stop}")
        if not prof.ranks or any(r < 0 for r in prof.ranks) or len(set(prof.ranks)) != len(prof.ranks):
            raise ConfigError(f"config key 'train.profile.ranks': a non-empty list of distinct ranks >= 0, "
                              f"got {prof.ranks!r}")
    if cfg.dept.embedding_rows == "present" and not variant_of(cfg).synced_table:
        raise ConfigError(f"config key 'dept.embedding_rows': present applies to glob (TRIM's compact tables hold "
                          f"only V_k, SPEC's tables are never averaged), got dept.variant={cfg.dept.variant!r}")
    if cfg.dept.embedding_rows == "present" and (cfg.dept.outer_overlap or cfg.dept.outer_fragments > 1):
        raise ConfigError(f"config key 'dept.embedding_rows': present needs dept.outer_overlap false and dept.outer_fragments 1 "
                          f"(a sync that lands inside a round is undone: its inner steps hold the other rows at their "
                          f"round-start values); got outer_overlap {cfg.dept.outer_overlap}, outer_fragments {cfg.dept.outer_fragments}")
    if cfg.dept.embedding_rows == "present" and cfg.optim.distributed:
        raise ConfigError("config key 'dept.embedding_rows': present needs optim.distributed false (the "
                          "distributed optimizer's gradients and masters are flat shards, not rows)")
    _check_outer_sync(cfg)
    if cfg.dept.body_optimizer_state == "source" and not variant_of(cfg).rounds:
        raise ConfigError("config key 'dept.body_optimizer_state': source needs a DEPT variant "
                          "(std trains one group on the blend of all sources)")
    if cfg.dept.body_optimizer_state == "source" and cfg.dept.reset_inner_optimizer:
        raise ConfigError("config key 'dept.body_optimizer_state': source keeps the body's inner optimizer "
                          "state per source, but dept.reset_inner_optimizer: true clears it every round")
    if cfg.optim.grad_dtype == "bf16" and cfg.precision != "bf16":
        raise ConfigError(f"config key 'optim.grad_dtype': bf16 gradients need precision: bf16, "
                          f"got {cfg.precision!r}")
    if m.recompute_layers is not None:
        if m.recompute != "full":
            raise ConfigError(f"config key 'model.recompute_layers': {m.recompute_layers} only applies to "
                              f"model.recompute: full, got {m.recompute!r}")
        per_chunk = m.num_layers // (p.pipeline * p.virtual_pipeline)
        if m.recompute_layers > per_chunk:
            raise ConfigError(f"config key 'model.recompute_layers': {m.recompute_layers} is more than the "
                              f"{per_chunk} layers of a pipeline chunk")
    if t.compile and m.recompute == "full":
        raise ConfigError("config key 'train.compile': per-block torch.compile with model.recompute: full is not "
                          "supported (recomputing a compiled block does not reproduce its saved tensors in "
                          "torch 2.13); use model.recompute: selective or none, or train.compile: false")
    if m.attention_backend == "sdpa" and m.position_embedding == "alibi":
        raise ConfigError("config key 'model.attention_backend': sdpa has no ALiBi without a materialised "
                          "bias; use auto, flash, flex or bias")
    if m.attention_backend == "flex" and m.attention_dropout > 0:
        raise ConfigError(f"config key 'model.attention_backend': flex_attention cannot apply attention "
                          f"dropout (model.attention_dropout={m.attention_dropout}); use auto, sdpa, flash or bias")
    if variant_of(cfg).rounds and t.steps % cfg.dept.local_steps:
        raise ConfigError(f"config key 'dept.local_steps': train.steps={t.steps} is not a multiple of "
                          f"{cfg.dept.local_steps}" + default_note(cfg, "dept.local_steps", "a round is "
                          "dept.local_steps inner steps: set it to a divisor of train.steps")
                          + _variant_note(cfg, "dept.variant: std trains without rounds"))


def _variant_note(cfg: Config, hint: str) -> str:
    """`` under dept.variant V (the default; hint)`` on an error of the variant's own where
    ``dept.variant`` was left at its default (spec_opt), which the user may not know is in play;
    else ``""``."""
    note = default_note(cfg, "dept.variant", hint)
    return f" under dept.variant {cfg.dept.variant}{note}" if note else ""


def te_fp8_conflict(cfg: Config) -> Optional[str]:
    """The first setting of the native FP8 linears that Transformer Engine's linears would not
    honour (``fp8_fused_casts: true``, ``fp8_gemm: cublaslt``, ``fp8_fast_accum`` other than what
    TE does), as an error line naming the key; None when there is none (an ``auto`` / null setting
    never conflicts: it picks nothing of the native linears' there). Checked with the config for an
    explicit ``backend: transformer_engine`` and by ``model/backends.py`` when ``auto`` picks TE."""
    settings = (("fp8_fused_casts", cfg.fp8_fused_casts, (False, None), "Transformer Engine casts itself"),
                ("fp8_gemm", cfg.fp8_gemm, ("torch", "auto"), "Transformer Engine runs its own"),
                ("fp8_fast_accum", cfg.fp8_fast_accum, ("forward", "auto"),
                 "Transformer Engine's accumulate as 'forward' does"),
                ("fp8_gemm_tuning", cfg.fp8_gemm_tuning, (0, 1), "Transformer Engine picks its own GEMM algorithms"))
    for key, value, te_does, why in settings:
        if value not in te_does:
            return (f"config key '{key}': {str(value).lower()} applies to the native FP8 linears "
                    f"(backend: local); {why}")
    return None


def _check_eager_fp8(cfg: Config) -> None:
    """The settings of the native FP8 linears against an explicit ``backend: transformer_engine``,
    and those that run only in the eager FP8 linears against ``train.compile`` (checked here, with the config, so that
    ``--check`` and the launchers' pre-flight report them; ``backend: auto`` choosing Transformer
    Engine is found where the backend is resolved, ``model/backends.py``). Only explicit
    settings are refused: ``fp8_gemm: auto`` and ``fp8_fused_casts: null`` choose what runs there."""
    if cfg.fp8 is None:
        return
    if cfg.backend == "transformer_engine" and (why := te_fp8_conflict(cfg)) is not None:
        raise ConfigError(why)  # first: with TE the compile conflicts below do not arise
    if cfg.train.compile and cfg.fp8_gemm == "cublaslt":
        raise ConfigError("config key 'fp8_gemm': cublaslt runs in the eager FP8 linears; under train.compile the "
                          "FP8 GEMMs are traced into the compiled blocks with torch._scaled_mm (use fp8_gemm: auto "
                          "or torch, or train.compile: false)")
    if cfg.fp8_gemm_tuning > 1 and cfg.fp8_gemm == "torch":
        raise ConfigError(f"config key 'fp8_gemm_tuning': {cfg.fp8_gemm_tuning} times the algorithms of the cublaslt FP8 "
                          f"GEMMs; fp8_gemm is torch (torch._scaled_mm picks its own): use fp8_gemm: auto or cublaslt, "
                          f"or fp8_gemm_tuning: 0")
    if cfg.train.compile and cfg.fp8_fused_casts is True:
        raise ConfigError("config key 'fp8_fused_casts': the fused casts run in the eager FP8 linears; under "
                          "train.compile the norms, GELUs and casts are traced into the compiled blocks (use "
                          "fp8_fused_casts: null or false, or train.compile: false)")


def _check_schedule(cfg: Config) -> None:
    """The learning-rate schedule's keys (optim.lr_at). An lr_decay_steps above train.steps is
    allowed, as in Megatron-LM (a run meant to be extended, or cut short, before min_lr)."""
    o = cfg.optim
    if o.lr_decay_steps is not None and o.lr_decay_steps <= o.warmup_steps:
        raise ConfigError(f"config key 'optim.lr_decay_steps': {o.lr_decay_steps} must be above "
                          f"optim.warmup_steps={o.warmup_steps} (the decay ends at this step, counted from 0)")
    if o.lr_decay_style != "wsd":
        if o.lr_wsd_decay_steps is not None:
            raise ConfigError(f"config key 'optim.lr_wsd_decay_steps': {o.lr_wsd_decay_steps} has no effect "
                              f"under optim.lr_decay_style={o.lr_decay_style!r}; set lr_decay_style: wsd, or drop it")
        return
    if o.lr_wsd_decay_steps is None:
        raise ConfigError("config key 'optim.lr_wsd_decay_steps': optim.lr_decay_style=wsd needs the length "
                          "of its final decay in steps (Megatron's --lr-wsd-decay-iters)")
    decay_steps = cfg.train.steps if o.lr_decay_steps is None else o.lr_decay_steps
    key = "train.steps" if o.lr_decay_steps is None else "optim.lr_decay_steps"
    if o.lr_wsd_decay_steps > decay_steps - o.warmup_steps:
        raise ConfigError(f"config key 'optim.lr_wsd_decay_steps': {o.lr_wsd_decay_steps} is more than the "
                          f"{decay_steps - o.warmup_steps} steps between warmup (optim.warmup_steps="
                          f"{o.warmup_steps}) and the end of the decay ({key}={decay_steps})")


def _check_outer_sync(cfg: Config) -> None:
    """The outer synchronisation's keys (docs/dept.md "Outer synchronisation")."""
    d = cfg.dept
    if d.outer_error_feedback and d.outer_comm_dtype not in ("fp8", "int8", "int4"):
        raise ConfigError(f"config key 'dept.outer_error_feedback': needs a quantised dept.outer_comm_dtype "
                          f"(fp8 | int8 | int4), got {d.outer_comm_dtype!r}")
    if d.outer_delay and not d.outer_overlap:
        raise ConfigError(f"config key 'dept.outer_delay': {d.outer_delay} needs dept.outer_overlap: true")
    if d.outer_overlap_rule != "correction" and not (d.outer_overlap and d.outer_delay > 0):
        raise ConfigError(f"config key 'dept.outer_overlap_rule': {d.outer_overlap_rule} needs dept.outer_overlap: "
                          f"true and dept.outer_delay > 0 (it says what the overlapped steps start from)")
    if not 0.0 <= d.outer_mix_alpha <= 1.0:
        raise ConfigError(f"config key 'dept.outer_mix_alpha': {d.outer_mix_alpha} is not in [0, 1] (the weight of "
                          f"the local weights in dept.outer_overlap_rule: mix)")
    if d.outer_delay >= d.local_steps:
        raise ConfigError(f"config key 'dept.outer_delay': {d.outer_delay} must be < dept.local_steps="
                          f"{d.local_steps} (a sync is applied before the next one of its fragment starts)")
    if d.outer_fragments > cfg.model.num_layers:
        raise ConfigError(f"config key 'dept.outer_fragments': {d.outer_fragments} fragments of consecutive "
                          f"layers need at least as many layers, model.num_layers={cfg.model.num_layers}")
    if d.outer_fragments > d.local_steps:
        raise ConfigError(f"config key 'dept.outer_fragments': {d.outer_fragments} staggered fragments need "
                          f"dept.local_steps >= {d.outer_fragments}, got {d.local_steps}")
    if d.outer_overlap and d.embedding_rows == "present":
        raise ConfigError("config key 'dept.outer_overlap': not supported with dept.embedding_rows: present "
                          "(the row mask would undo the delayed update of the frozen rows)")


def source_groups(cfg: Config, groups: int) -> list[int] | None:
    """The group that owns each source (``data.sources[i].group``; null: i mod ``groups``) when
    sources belong to groups: when any source sets ``group``, or under federation with more
    sources than groups (a source's data stays at its site). None: every group may train any
    source (the seeded sampler moves sources between groups). Raises :class:`ConfigError`
    for a group index out of range or a group that owns no source."""
    sources = cfg.data.sources
    federated_k_gt_g = cfg.federation.lighthouse is not None and len(sources) > groups
    if not any(s.group is not None for s in sources) and not federated_k_gt_g:
        return None
    owners = []
    for i, s in enumerate(sources):
        g = i % groups if s.group is None else s.group
        if not 0 <= g < groups:
            raise ConfigError(f"config key 'data.sources[{i}].group': {g} is not a group index in [0, {groups}) "
                              f"(source '{s.name}')")
        owners.append(g)
    empty = [g for g in range(groups) if g not in owners]
    if empty:
        raise ConfigError(f"config key 'data.sources[].group': group {empty[0]} of {groups} owns no source (every "
                          f"group trains one of its own sources each round; data.sources[i].group null = i mod "
                          f"{groups})")
    return owners


def held_here(cfg) -> list[int] | None:
    """The indices of the sources whose files this job reads: every one (None) but in a federated
    group job, its own (:func:`source_groups`; group: ``federation.group``, else ``DEPT_GROUP``)."""
    f = getattr(cfg, "federation", None)  # (a config-like namespace without one: the single job)
    if f is None or f.lighthouse is None or not variant_of(cfg).rounds:
        return None
    group, env = f.group, os.environ.get("DEPT_GROUP", "")
    if group is None and not env.strip().lstrip("-").isdigit():
        raise ConfigError("config key 'federation.group': null and DEPT_GROUP is not set to an integer (this "
                          "job's group index; it says which sources' files the job reads)")
    group = int(env) if group is None else group
    owners = source_groups(cfg, int(f.groups)) or list(range(len(cfg.data.sources)))
    return [i for i, g in enumerate(owners) if g == group]


def _prefix_hint(prefix: str) -> str:
    """What a missing ``PREFIX.bin`` most likely means: the prefix names the file itself
    (``.bin`` / ``.idx`` written out), or it is the ``--output-prefix`` given to
    tools/preprocess_data.py, which writes ``OUTPUT-PREFIX_<json key>_document.bin``."""
    for ext in (".bin", ".idx"):
        stem = prefix[: -len(ext)]
        if prefix.endswith(ext) and os.path.exists(stem + ".bin") and os.path.exists(stem + ".idx"):
            return f"; the prefix is the path without '.bin' / '.idx': {stem!r}"
    found = sorted(p[: -len(".bin")] for p in glob.glob(glob.escape(prefix) + "_*_document.bin")
                   if os.path.exists(p[: -len(".bin")] + ".idx"))
    if found:
        return (f"; tools/preprocess_data.py appends _<json key>_document to its --output-prefix: "
                f"did you mean {found[0]!r}?")
    return ""


def validate(cfg: Config, world_size: int, check_files: bool = True) -> None:
    """Checks that need the world size and the data files. Raises :class:`ConfigError`."""
    p = cfg.parallel
    per_group = p.tensor * p.pipeline * p.data
    if world_size % per_group:
        hint = one_group_data_hint(cfg, world_size)
        raise ConfigError(f"config key 'parallel': world size {world_size} is not divisible by "
                          f"tensor × pipeline × data = {p.tensor}×{p.pipeline}×{p.data} = {per_group}"
                          + (f"; std trains one group: {hint}" if hint else ""))
    groups = world_size // per_group
    if cfg.federation.lighthouse is not None and groups != 1:
        raise ConfigError(f"config key 'parallel': a federated group job (federation.lighthouse set) is one source group, "
                          f"but world size {world_size} with tensor×pipeline×data={per_group} gives {groups}; launch "
                          f"{per_group} process(es) per group job (torchrun --nproc-per-node), or raise parallel.data")
    prof = cfg.train.profile
    if prof is not None and max(prof.ranks) >= world_size:
        raise ConfigError(f"config key 'train.profile.ranks': rank {max(prof.ranks)} does not exist in a world "
                          f"of {world_size}")
    variant, v = cfg.dept.variant, variant_of(cfg)
    k = len(cfg.data.sources)
    if not v.rounds and groups != 1:
        raise ConfigError(f"config key 'dept.variant': std trains one group, but world size {world_size} "
                          f"with tensor×pipeline×data={p.tensor}×{p.pipeline}×{p.data}={per_group} gives {groups} "
                          f"groups: {one_group_data_hint(cfg, world_size)}")
    if v.own_embeddings and k < groups:
        raise ConfigError(f"config key 'data.sources': {variant} needs at least one source per group, "
                          f"got {k} sources for {groups} groups" + _variant_note(
                              cfg, "every DEPT variant needs a source per group; std trains one group"))
    if v.rounds and k and k < groups:
        raise ConfigError(f"config key 'data.sources': {k} sources cannot fill {groups} groups")
    if v.rounds and k:
        # the group jobs' number under federation (each job's own world is one group)
        source_groups(cfg, cfg.federation.groups if cfg.federation.lighthouse is not None else groups)
    if v.own_tokenizer:
        for i, s in enumerate(cfg.data.sources):
            if not s.tokenizer:
                raise ConfigError(f"config key 'data.sources[{i}].tokenizer': spec_opt needs a tokenizer "
                                  f"for source '{s.name}'" + _variant_note(
                                  cfg, "spec_opt gives each source its own data.sources[].tokenizer; glob, trim and "
                                  "spec use one global data.tokenizer"))
    elif cfg.data.sources and not cfg.data.tokenizer and cfg.model.vocab_size is None:
        raise ConfigError(f"config key 'data.tokenizer': variant {variant} needs a global tokenizer")
    if not check_files:
        return
    if cfg.data.tokenizer and not v.own_tokenizer and not os.path.exists(cfg.data.tokenizer):
        raise ConfigError(f"config key 'data.tokenizer': file {cfg.data.tokenizer!r} does not exist")
    held = held_here(cfg)  # a federated group job reads only its own sources' files (the others':
    for i, s in enumerate(cfg.data.sources):  # their summaries, data.checks.check_sources)
        if held is not None and i not in held:
            continue
        for ext in (".bin", ".idx"):
            if not os.path.exists(s.prefix + ext):
                raise ConfigError(f"config key 'data.sources[{i}].prefix': file {s.prefix + ext!r} "
                                  f"does not exist (source '{s.name}'){_prefix_hint(s.prefix)}")
        if v.own_tokenizer and s.tokenizer and not os.path.exists(s.tokenizer):
            raise ConfigError(f"config key 'data.sources[{i}].tokenizer': file {s.tokenizer!r} does not exist")


def save_config(cfg: Config, path: str | os.PathLike[str]) -> None:
    """Write the resolved config as YAML (atomically), e.g. to ``RUN/config.yaml``."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)
    os.replace(tmp, path)
