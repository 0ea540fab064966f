"""A study grid: which runs to make, each one a ``dept_mega.train`` command at equal compute.

Grid file (YAML)::

    prepare: ["python tools/prepare_sample.py"]   # optional: run first (must be idempotent)
    groups: 5                # source groups of every DEPT run
    group_batch: 16          # sequences per inner step of one group
    configs:                 # the base config of each variant
      std: examples/tiny/std.yaml
      glob: examples/tiny/glob.yaml
    set: {train.steps: 200}  # dotted overrides for every run
    eval_whole: true         # optional: every run reads every validation part whole (the same text
                             # under any tokenizer; default: eval_iters × group_batch sequences)
    runs:
      - variant: std
        name: std_t{dept.temperature}          # optional; {key} is replaced by that key's value
        set: {dept.sampling: temperature}
        grid: {dept.temperature: [0.0, 1.0]}   # one run per value (product over keys)
      - variant: [glob, spec_opt]              # one entry per variant
        grid: {dept.outer_optimizer: [{name: fedavg, lr: 1.0}, {name: nesterov, lr: 0.7, momentum: 0.9}]}
      - variant: glob                          # an outer lr sweep: names glob_lr0.7, glob_lr0.5
        name: glob_lr{dept.outer_optimizer.lr} # (an entry of a grid key's mapping; without a
        grid: {dept.outer_optimizer: [{name: nesterov, lr: 0.7}, {name: nesterov, lr: 0.5}]}
                                               # template: glob_outer_optimizer=nesterov-lr0.7, ...)

Runs whose configs differ only in ``train.seed`` (e.g. a grid over it, named with ``{train.seed}``) make
one row of the report: mean ± sd over the seeds, and n. Two runs whose resolved configs are equal,
seed included, are an error (they would count as two seeds of one row).

Equal compute (the paper's comparison): every run makes the same number of inner steps of
the same sequence length, a DEPT run with ``groups`` groups of ``group_batch`` sequences each,
an STD run with one group of ``groups × group_batch`` sequences, so every run sees the same
number of tokens. The tool sets ``train.global_batch_size`` itself; a grid that sets it is an
error, and so is a run whose steps or sequence length differ from the others'. Runs whose
models differ (a model ablation, e.g. ``model.num_layers``) are allowed, but then equal tokens
are not equal compute: :func:`compute_note` says so, in ``describe`` and in results.md.
"""
from __future__ import annotations

import itertools
import json
import os
import re
import shlex
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml

from ..config import Config, ConfigError, load_config
from ..metrics import train_flops_per_token
from ..schedule_warnings import eval_interval_warning, save_interval_warning
from ..variant import VARIANT_NAMES, variant_of

TOP_KEYS = {"description", "prepare", "groups", "group_batch", "configs", "set", "runs", "plasticity", "eval_whole"}
RUN_KEYS = {"variant", "name", "set", "grid"}
# model keys that do not make runs' models different for the equal-compute check: the
# vocabulary (SPEC-OPT's differs by design; the head is not the body) and how the same model is
# computed (kernel choice, activation recomputation)
MODEL_KEYS_NOT_COMPARED = {"vocab_size", "attention_backend", "recompute", "recompute_layers"}
#: train.eval_samples under ``eval_whole: true``: more sequences than any validation part holds,
#: so each run reads every part whole (the evaluation takes min(eval_samples, the part's samples))
WHOLE_PART = 10**12


class GridError(ValueError):
    """A bad study grid: the message names the file and the key."""


@dataclass
class RunSpec:
    """One run of the study."""
    name: str
    variant: str
    config: str  # base config file
    overrides: list[str]  # dotted key=value, in order (the tool's own last)
    nproc: int  # processes (torchrun --nproc-per-node)
    settings: dict[str, Any] = field(default_factory=dict)  # the grid values of this run
    # the name with its train.seed as "*" (None: the grid does not vary the seed): the label of
    # the report's row of the runs that differ only in their seed
    seed_label: Optional[str] = None
    entry: int = 0  # the grid's runs[entry] that made this run

    def command(self, python: str = "python") -> list[str]:
        return [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(self.nproc),
                "-m", "dept_mega.train", "--config", self.config, *self.overrides]


@dataclass
class Study:
    path: str
    groups: int
    group_batch: int
    runs: list[RunSpec]
    description: str = ""
    prepare: list[list[str]] = field(default_factory=list)  # commands run before the runs (idempotent)
    plasticity: Optional["Plasticity"] = None  # adapt every run's body to a held-out source
    # filled by _resolve: the model keys (dotted) whose values differ between runs, outside
    # the vocabulary and the implementation (MODEL_KEYS_NOT_COMPARED), and each run's training
    # FLOPs per token of the transformer body (no output head: vocabularies differ by design)
    model_differs_in: list[str] = field(default_factory=list)
    body_flops: dict[str, float] = field(default_factory=dict)
    # ``eval_whole: true``: every run reads every validation part whole (train.eval_samples =
    # WHOLE_PART), so runs with other tokenizers (SPEC-OPT) are scored on the same text
    eval_whole: bool = False
    # filled by _resolve: a warning per run whose evaluations fall inside a round
    # (schedule_warnings.eval_interval_warning), {run name: warning}
    warnings: dict[str, str] = field(default_factory=dict)
    # filled by _resolve: a warning per run whose periodic checkpoints fall inside a round
    # (schedule_warnings.save_interval_warning; the listing's, not the report's), {run name: warning}
    checkpoint_warnings: dict[str, str] = field(default_factory=dict)


def _yaml_value(value: Any) -> str:
    """A value as the YAML text of a dotted override (``key=<this>``)."""
    text = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=1 << 30).strip()
    if text.endswith("\n..."):
        text = text[: -len("\n...")]
    return text.removesuffix("...").strip()


def _short(value: Any, others: tuple = ()) -> str:
    """A value as it appears in a run name. A mapping with a ``name`` (an outer optimizer) is
    its name, followed by the entries that tell it apart from ``others`` (the other values of
    the same grid key) sharing that name: ``nesterov`` beside ``fedavg``, but ``nesterov-lr0.7``
    and ``nesterov-lr0.5`` in an lr sweep."""
    if isinstance(value, dict):
        if "name" in value:
            same = [o for o in others if isinstance(o, dict) and o.get("name") == value["name"] and o != value]
            keys = [k for k in value if k != "name" and any(o.get(k) != value[k] for o in same)]
            keys += [k for k in sorted({k for o in same for k in o} - set(value)) if k != "name"]
            return "-".join([str(value["name"])] + [f"{k}{_short(value.get(k, 'none'))}" for k in keys])
        return "-".join(_short(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return "-".join(_short(v) for v in value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


#: the grid key whose runs a study groups into one row (mean ± sd over seeds)
SEED_KEY = "train.seed"


def _lookup(key: str, settings: dict[str, Any]) -> tuple[str, Any]:
    """The grid key and value a template's ``{key}`` names: a grid key itself, or an entry
    inside a grid key's mapping (``{dept.outer_optimizer.lr}`` under a grid over
    ``dept.outer_optimizer``)."""
    if key in settings:
        return key, settings[key]
    for k, v in settings.items():
        if key.startswith(k + ".") and isinstance(v, dict):
            for part in key[len(k) + 1:].split("."):
                if not isinstance(v, dict) or part not in v:
                    raise KeyError(key)
                v = v[part]
            return k, v
    raise KeyError(key)


def _name(template: Optional[str], variant: str, settings: dict[str, Any], varying: list[str],
          grid: Optional[dict[str, list]] = None, seed: Optional[str] = None) -> str:
    """A run's name from ``template`` (else the variant and the keys that vary). ``seed``: the
    text that replaces the run's ``train.seed`` (an automatic name then leaves the seed out):
    the label of the row of runs that differ only in their seed."""
    grid = grid or {}
    if template:
        def sub(m: re.Match) -> str:
            key = m.group(1)
            if key == "variant":
                return variant
            if key == SEED_KEY and seed is not None:
                return "\0"
            gkey, value = _lookup(key, settings)
            return _short(value, tuple(grid.get(gkey, ())) if gkey == key else ())
        try:
            name = re.sub(r"\{([^{}]+)\}", sub, template)
        except KeyError as exc:
            raise GridError(f"run name {template!r}: {{{exc.args[0]}}} is neither a grid key of this run nor an "
                            f"entry of one (e.g. {{dept.outer_optimizer.lr}})") from None
    else:
        keys = [k for k in varying if not (seed is not None and k == SEED_KEY)]
        parts = [variant] + [f"{k.rsplit('.', 1)[-1]}={_short(settings[k], tuple(grid.get(k, ())))}" for k in keys]
        name = "_".join(parts)
    name = re.sub(r"[^A-Za-z0-9_.=+\0-]", "-", name)
    return name.replace("\0", seed or "")


def _as_mapping(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise GridError(f"{where}: expected a mapping of dotted keys, got {value!r}")
    return dict(value)


def load_study(path: str, base_dir: Optional[str] = None) -> Study:
    """Read and expand a grid file. Relative config paths are taken from ``base_dir`` (default:
    the current directory, where ``dept_mega.train`` will run)."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f) or {}
    except FileNotFoundError:
        raise GridError(f"grid file {path!r} does not exist") from None
    except yaml.YAMLError as exc:
        raise GridError(f"grid file {path!r} is not valid YAML: {exc}") from None
    if not isinstance(doc, dict):
        raise GridError(f"{path}: top level must be a mapping")
    unknown = sorted(set(doc) - TOP_KEYS)
    if unknown:
        raise GridError(f"{path}: unknown key(s) {unknown} (allowed: {sorted(TOP_KEYS)})")
    for key in ("groups", "group_batch"):
        if not isinstance(doc.get(key), int) or isinstance(doc.get(key), bool) or doc[key] < 1:
            raise GridError(f"{path}: '{key}' must be a positive integer, got {doc.get(key)!r}")
    configs = _as_mapping(doc.get("configs"), f"{path}: 'configs'")
    common = _as_mapping(doc.get("set"), f"{path}: 'set'")
    runs_doc = doc.get("runs")
    if not isinstance(runs_doc, list) or not runs_doc:
        raise GridError(f"{path}: 'runs' must be a non-empty list")
    base_dir = base_dir or os.getcwd()
    groups, group_batch = doc["groups"], doc["group_batch"]
    runs: list[RunSpec] = []
    for i, entry in enumerate(runs_doc):
        where = f"{path}: runs[{i}]"
        if not isinstance(entry, dict):
            raise GridError(f"{where}: expected a mapping")
        bad = sorted(set(entry) - RUN_KEYS)
        if bad:
            raise GridError(f"{where}: unknown key(s) {bad} (allowed: {sorted(RUN_KEYS)})")
        variants = entry.get("variant")
        variants = variants if isinstance(variants, list) else [variants]
        fixed = _as_mapping(entry.get("set"), f"{where}.set")
        grid = _as_mapping(entry.get("grid"), f"{where}.grid")
        for k, values in grid.items():
            if not isinstance(values, list) or not values:
                raise GridError(f"{where}.grid.{k}: expected a non-empty list of values")
        varying = [k for k, v in grid.items() if len(v) > 1]
        for variant in variants:
            if variant not in VARIANT_NAMES:
                raise GridError(f"{where}.variant: {variant!r} is not one of {' | '.join(VARIANT_NAMES)}")
            if variant not in configs:
                raise GridError(f"{where}: no config for variant {variant!r} under 'configs'")
            cfg_path = configs[variant]
            if not os.path.isabs(cfg_path):
                cfg_path = os.path.relpath(os.path.join(base_dir, cfg_path), base_dir)
            for combo in itertools.product(*grid.values()) if grid else [()]:
                settings = dict(zip(grid.keys(), combo))
                name = _name(entry.get("name"), variant, settings, varying, grid)
                seed_label = (_name(entry.get("name"), variant, settings, varying, grid, seed="*")
                              if SEED_KEY in varying else None)
                values = {**common, **fixed, **settings}
                for key in values:
                    if key in ("train.global_batch_size", "train.run_dir", "dept.variant"):
                        raise GridError(f"{where}: '{key}' is set by the study tool (equal compute, run "
                                        f"directories, variants); remove it")
                overrides = [f"{k}={_yaml_value(v)}" for k, v in values.items()]
                overrides.append(f"dept.variant={variant}")
                batch = group_batch if variant_of(variant).rounds else groups * group_batch
                overrides.append(f"train.global_batch_size={batch}")
                runs.append(RunSpec(name, variant, cfg_path, overrides, nproc=0, settings=settings,
                                    seed_label=seed_label, entry=i))
    names = [r.name for r in runs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise GridError(f"{path}: runs share the name(s) {dupes}; give them a 'name' template")
    plasticity = _plasticity(doc.get("plasticity"), path, base_dir)
    prepare = doc.get("prepare") or []
    if not isinstance(prepare, list) or not all(isinstance(c, str) for c in prepare):
        raise GridError(f"{path}: 'prepare' must be a list of command lines")
    if plasticity is not None and plasticity.runs is not None:
        unknown = sorted(set(plasticity.runs) - {r.name for r in runs})
        if unknown:
            raise GridError(f"{path}: 'plasticity.runs' names unknown run(s) {unknown}")
    eval_whole = doc.get("eval_whole", False)
    if not isinstance(eval_whole, bool):
        raise GridError(f"{path}: 'eval_whole' must be true or false, got {eval_whole!r}")
    study = Study(path, groups, group_batch, runs, str(doc.get("description", "")),
                  [shlex.split(c) for c in prepare], plasticity, eval_whole=eval_whole)
    _resolve(study, base_dir)
    return study


@dataclass
class Plasticity:
    """``plasticity:`` in a grid: after training, ``dept_mega.adapt`` gives every run's body
    (``runs``: those named, default all) fresh embeddings for a held-out source and trains them
    ``steps`` steps; the same from a random body is the reference, made once per distinct
    adaptation (runs whose adaptation configs are equal share it: the random body and its
    training depend on the run's model, seed, batch sizes and optimizer, not on its weights)."""
    source_config: str
    steps: int
    body: str = "frozen"
    body_lr: Optional[float] = None
    runs: Optional[list[str]] = None

    def args(self) -> list[str]:
        out = ["--source-config", self.source_config, "--steps", str(self.steps), "--body", self.body]
        if self.body_lr is not None:
            out += ["--body-lr", repr(self.body_lr)]
        return out


def _plasticity(doc: Any, path: str, base_dir: str) -> Optional[Plasticity]:
    if doc is None:
        return None
    where = f"{path}: 'plasticity'"
    if not isinstance(doc, dict):
        raise GridError(f"{where}: expected a mapping")
    bad = sorted(set(doc) - {"source_config", "steps", "body", "body_lr", "runs"})
    if bad:
        raise GridError(f"{where}: unknown key(s) {bad}")
    if not isinstance(doc.get("source_config"), str):
        raise GridError(f"{where}.source_config: the held-out source's partial config (a path) is required")
    steps = doc.get("steps")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise GridError(f"{where}.steps: a positive integer, got {steps!r}")
    body = doc.get("body", "frozen")
    if body not in ("frozen", "trainable"):
        raise GridError(f"{where}.body: frozen | trainable, got {body!r}")
    lr = doc.get("body_lr")
    if lr is not None and (body != "trainable" or not isinstance(lr, (int, float))):
        raise GridError(f"{where}.body_lr: a number, with body: trainable")
    runs = doc.get("runs")
    if runs is not None and (not isinstance(runs, list) or not all(isinstance(r, str) for r in runs)):
        raise GridError(f"{where}.runs: a list of run names")
    _check_source_config(doc["source_config"], where, base_dir)
    return Plasticity(doc["source_config"], steps, body, None if lr is None else float(lr), runs)


def _check_source_config(source_config: str, where: str, base_dir: str) -> None:
    """The held-out source's partial config must exist and be a YAML mapping now: it is first
    read by dept_mega.adapt after every run has trained, where a bad path would fail each
    adaptation with only its log naming the file. Relative paths are taken from ``base_dir``,
    where the adaptations run."""
    full = source_config if os.path.isabs(source_config) else os.path.join(base_dir, source_config)
    try:
        with open(full, encoding="utf-8") as f:
            values = yaml.safe_load(f)
    except FileNotFoundError:
        raise GridError(f"{where}.source_config: {full!r} does not exist") from None
    except (OSError, yaml.YAMLError) as exc:
        raise GridError(f"{where}.source_config: {full!r} is not a readable YAML file: {exc}") from None
    if not isinstance(values, dict):
        raise GridError(f"{where}.source_config: {full!r} must hold a mapping (a partial config), "
                        f"got {type(values).__name__}")


def _resolve(study: Study, base_dir: str) -> None:
    """Load every run's config (the way dept_mega.train will) to fill in the process count and
    check equal compute."""
    shape: Optional[tuple[int, int]] = None
    first = None
    models: list[dict[str, Any]] = []
    resolved: dict[str, RunSpec] = {}
    for run in study.runs:
        try:
            cfg = load_config(os.path.join(base_dir, run.config), run.overrides)
        except ConfigError as exc:
            raise GridError(f"{study.path}: run {run.name!r}: {exc}") from None
        # the report makes runs that differ only in train.seed one row of seeds: two equal
        # configs (seed included) would be one run counted as two seeds (a copy-paste)
        same = resolved.setdefault(json.dumps(cfg.to_dict(), sort_keys=True, default=str), run)
        if same is not run:
            raise GridError(f"{study.path}: runs {same.name!r} (runs[{same.entry}]) and {run.name!r} "
                            f"(runs[{run.entry}]) resolve to the same config, train.seed {cfg.train.seed} "
                            f"included; give them different seeds or remove one")
        if study.eval_whole:
            if any(o.startswith("train.eval_samples=") for o in run.overrides):
                raise GridError(f"{study.path}: run {run.name!r}: 'eval_whole: true' sets train.eval_samples itself; "
                                f"remove it from the run's 'set' or 'grid'")
            run.overrides.append(f"train.eval_samples={WHOLE_PART}")
        elif cfg.train.eval_samples is None:  # the same validation sequences in every run (STD's batch is larger)
            run.overrides.append(f"train.eval_samples={cfg.train.eval_iters * study.group_batch}")
        warning = eval_interval_warning(cfg)
        if warning:
            study.warnings[run.name] = warning
        warning = save_interval_warning(cfg)
        if warning:
            study.checkpoint_warnings[run.name] = warning
        models.append(cfg.to_dict()["model"])
        study.body_flops[run.name] = train_flops_per_token(cfg.model, 0)  # vocab 0: the body alone
        per_group = cfg.parallel.tensor * cfg.parallel.pipeline * cfg.parallel.data
        run.nproc = per_group * (study.groups if variant_of(run.variant).rounds else 1)
        here = (cfg.train.steps, cfg.model.seq_length)
        if shape is None:
            shape, first = here, run.name
        elif here != shape:
            raise GridError(f"{study.path}: run {run.name!r} makes {here[0]} steps of {here[1]} tokens, run "
                            f"{first!r} {shape[0]} of {shape[1]}: equal compute needs the same train.steps "
                            f"and model.seq_length")
    study.model_differs_in = [f"model.{k}" for k in models[0] if k not in MODEL_KEYS_NOT_COMPARED
                              and any(m[k] != models[0][k] for m in models)]


def compute_note(study: Study) -> Optional[str]:
    """None when the runs make equal compute (equal tokens and steps, the same body); otherwise
    a sentence saying how they differ. A warning, not an error: model ablations are legitimate,
    but their tokens are not equal compute."""
    if not study.model_differs_in:
        return None
    keys = ", ".join(study.model_differs_in)
    flops = sorted(set(study.body_flops.values()))
    if len(flops) > 1:
        return (f"equal tokens and steps; NOT equal compute: runs differ in {keys} (training FLOPs per token of "
                f"the transformer body {flops[0]:.4g} to {flops[-1]:.4g})")
    return (f"equal tokens, steps and body FLOPs per token, but NOT the same model: runs differ in {keys}")


def run_config(study_base: str, run: RunSpec, run_dir: str) -> Config:
    """The resolved config of ``run`` with its run directory (what dept_mega.train will use)."""
    return load_config(os.path.join(study_base, run.config), [*run.overrides, f"train.run_dir={run_dir}"])


def describe(study: Study) -> str:
    lines = [f"study {study.path}: {len(study.runs)} runs, {study.groups} groups × {study.group_batch} "
             f"sequences per inner step (STD: one group of {study.groups * study.group_batch})"]
    for r in study.runs:
        extra = f"  {json.dumps(r.settings, default=str)}" if r.settings else ""
        lines.append(f"  {r.name:<28} {r.variant:<9} {r.nproc} process(es){extra}")
    if study.eval_whole:
        lines.append("every run reads every validation part whole (eval_whole: true)")
    note = compute_note(study)
    if note:
        lines.append(f"warning: {note}")
    for name, warning in [*study.warnings.items(), *study.checkpoint_warnings.items()]:
        lines.append(f"warning: run {name}: {warning}")
    return "\n".join(lines)
