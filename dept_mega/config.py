"""Typed run configuration: YAML file + dotted command-line overrides + validation.

Every section of the YAML file is a dataclass (the reference: docs/config.md).
``load_config`` reads a YAML file, applies ``key.sub=value`` overrides (values parsed as
YAML), checks keys and types, and returns a :class:`Config`. ``validate`` checks the combinations that need the world size or the file
system; it runs before any process group or file is created, and every failure is a
:class:`ConfigError` naming the key and the value.
"""
from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml


class ConfigError(ValueError):
    """A bad configuration: the message names the key and the value."""


# Every field's meaning is its ``#:`` comment (above the field, or after it on its line):
# docs/config.md is generated from them (tools/gen_config_doc.py); a section's is its docstring.


@dataclass
class ModelConfig:
    """The transformer (decoder-only, pre-norm, causal)."""
    num_layers: int = 12  #: Transformer blocks.
    hidden_size: int = 768  #: Width of the residual stream.
    num_attention_heads: int = 12  #: Query heads per layer.
    num_query_groups: Optional[int] = None  #: Key/value heads (grouped-query attention); null = one per query head.
    ffn_hidden_size: Optional[int] = None  #: Hidden width of the MLP; null = 4 × hidden_size.
    activation: str = "gelu"  #: MLP activation (swiglu: gated, two input projections).
    normalization: str = "layernorm"  #: Norm before attention, before the MLP and after the last block.
    position_embedding: str = "alibi"  #: How positions enter: ALiBi attention bias, rotary, or a learned table.
    seq_length: int = 2048  #: Tokens per training sample.
    tie_embeddings: bool = True  #: The output head reuses the input embedding table.
    norm_eps: float = 1.0e-5  #: Epsilon of the norms.
    rope_theta: float = 10000.0  #: Rotary base frequency (position_embedding: rope).
    init_method_std: float = 0.02  #: Standard deviation of the normal weight initialisation.
    hidden_dropout: float = 0.0  #: Dropout on the attention and MLP outputs.
    attention_dropout: float = 0.0  #: Dropout on the attention probabilities.
    bias: bool = False  #: Biases in the linear layers.
    #: LayerNorm with a bias; false: weight only, as MPT's (needed to export ALiBi models to
    #: Hugging Face); RMSNorm has no bias either way.
    norm_bias: bool = True
    #: Vocabulary size when no tokenizer is configured (tests, benchmarks); otherwise the
    #: tokenizer's size is used.
    vocab_size: Optional[int] = None
    #: Attention kernel; auto picks flash-attn, flex_attention, SDPA or a materialised bias for
    #: this device and position embedding (the run log's `backends:` line says which).
    attention_backend: str = "auto"
    #: Activation recomputation in backward: selective = the attention core, full = whole blocks.
    recompute: str = "none"
    recompute_layers: Optional[int] = None  #: recompute full: only the first N blocks of each pipeline chunk; null = all.

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass
class ParallelConfig:
    """The layout of one source group: world size = groups × data × pipeline × tensor."""
    tensor: int = 1  #: Tensor-parallel size T (keep it within a node).
    pipeline: int = 1  #: Pipeline stages P (1F1B schedule).
    data: int = 1  #: Data-parallel replicas D inside each source group.
    sequence_parallel: bool = False  #: Shard the norms' and dropouts' activations over the tensor ranks.
    virtual_pipeline: int = 1  #: Model chunks per pipeline stage; > 1 runs the interleaved 1F1B schedule.


@dataclass
class OuterOptimizerConfig:
    """How the averaged pseudo-gradient of a round updates the shared weights."""
    #: fedavg: θ ← θ − lr·Δ̄ (lr 1 = plain averaging); nesterov: SGD with Nesterov momentum;
    #: adam: Adam on the pseudo-gradients.
    name: str = "fedavg"
    lr: float = 1.0  #: Outer learning rate.
    momentum: float = 0.0  #: Momentum μ of nesterov.
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  #: β1, β2 of adam.
    eps: float = 1.0e-8  #: ε of adam.


@dataclass
class DeptConfig:
    """DEPT: which variant, how often groups synchronise and what crosses between them."""
    #: std: one group, batches mix all sources; glob, trim, spec, spec_opt: one source per group
    #: per round with global, trimmed, per-source embeddings, or per-source tokenizer too.
    variant: str = "spec_opt"
    local_steps: int = 500  #: Inner steps per round between outer synchronisations (train.steps must be a multiple).
    #: How sources are weighted: for STD's batch mix, and for drawing G of K > G sources each round.
    sampling: str = "uniform"
    temperature: float = 1.0  #: τ of sampling temperature: weights ∝ size^τ (0: uniform, 1: proportional).
    outer_optimizer: OuterOptimizerConfig = field(default_factory=OuterOptimizerConfig)
    reset_inner_optimizer: bool = False  #: Clear the inner AdamW state at the start of every round.
    #: Who owns the body's inner AdamW state: the group (DiLoCo) or the source (it moves with
    #: the source from group to group).
    body_optimizer_state: str = "group"
    #: What the outer sync sends: fp32 or bf16 (all-reduced), or fp8 / int8 / int4 block-wise
    #: scaled (all-gathered, reduced in fp32).
    outer_comm_dtype: str = "fp32"
    outer_quant_block: int = 256  #: Values per scale of the fp8 / int8 / int4 outer sync.
    outer_error_feedback: bool = False  #: Carry each rank's quantisation residual into the next sync.
    outer_state_device: str = "device"  #: Where θ_{t-1} and the outer optimizer state live (cpu saves device memory).
    outer_overlap: bool = False  #: Launch the outer sync and keep training while it runs (Streaming DiLoCo).
    outer_delay: int = 0  #: τ: inner steps between launching an overlapped sync and applying it (0: blocking).
    #: How an overlapped sync lands: correction (θ_t plus the τ local steps), eager (the τ steps
    #: start from an estimate of θ_t), mix (α·local + (1 − α)·θ_t).
    outer_overlap_rule: str = "correction"
    outer_mix_alpha: float = 0.5  #: α of outer_overlap_rule mix, in [0, 1].
    outer_fragments: int = 1  #: Split the body into F fragments of consecutive layers, synchronised staggered.
    trim_table_device: str = "cpu"  #: Where TRIM's global embedding table lives.
    #: GLOB: which embedding rows a group's inner steps update: all, or only the ids present in
    #: the round's source data.
    embedding_rows: str = "all"


@dataclass
class SourceConfig:
    """One data source (``data.sources`` list item)."""
    name: str = ""  #: The source's name, used in logs, metrics and checkpoints.
    prefix: str = ""  #: Path prefix of its Megatron indexed data (PREFIX.bin and PREFIX.idx).
    tokenizer: Optional[str] = None  #: Its own tokenizer model (spec_opt only).
    weight: float = 1.0  #: Multiplies the source's token count in proportional / temperature sampling.


@dataclass
class DataConfig:
    """Tokenizers and data sources."""
    tokenizer: Optional[str] = None  #: The global SentencePiece model (every variant but spec_opt).
    sources: list[SourceConfig] = field(default_factory=list)  #: The data sources, one mapping each (keys below).
    split: str = "98,2"  #: Train,valid document weights of each source (a third weight: a test part).
    cache_dir: Optional[str] = None  #: Where sample-index caches go; null = beside each source's .idx.


@dataclass
class OptimConfig:
    """The inner optimizer: AdamW with linear warmup and cosine decay."""
    lr: float = 6.0e-4  #: Peak learning rate, reached after warmup_steps.
    min_lr: float = 6.0e-5  #: Learning rate at train.steps (cosine decay from lr).
    warmup_steps: int = 100  #: Steps of linear warmup.
    weight_decay: float = 0.1  #: AdamW decoupled weight decay.
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  #: AdamW β1, β2.
    eps: float = 1.0e-8  #: AdamW ε.
    clip_grad: float = 1.0  #: Clip the global gradient norm to this (0: no clipping).
    max_consecutive_nonfinite: int = 10  #: Stop the run after this many skipped (inf/nan) steps in a row.
    #: Megatron's distributed optimizer (ZeRO-1): fp32 masters and AdamW moments sharded over
    #: the group's data-parallel ranks.
    distributed: bool = False
    grad_dtype: str = "fp32"  #: Dtype of the gradient accumulation and reduction buffer (bf16 needs precision bf16).
    overlap_grad_reduce: bool = True  #: Start each bucket's data-parallel reduction during backward.
    grad_bucket_size: int = 25_000_000  #: Elements per gradient bucket (one data-parallel collective each).
    fused: Optional[bool] = None  #: AdamW kernel: null = fused on CUDA, foreach elsewhere; true / false force it.


@dataclass
class ProfileConfig:
    """``train.profile``: a torch.profiler trace of the inner steps after ``start`` and up to
    ``stop`` on the listed global ranks, written to ``RUN/profile/``."""
    start: int = 0  #: Trace the steps after this many inner steps.
    stop: int = 1  #: Last inner step traced.
    ranks: list[int] = field(default_factory=lambda: [0])  #: Global ranks that write a trace.


@dataclass
class TrainConfig:
    """The run: length, batch, logging, evaluation and checkpoints."""
    steps: int = 7000  #: Inner steps of the whole run (the learning-rate schedule's length).
    micro_batch_size: int = 4  #: Sequences per forward/backward pass on one rank.
    #: Sequences per optimizer step in each source group (not job-wide: the job trains
    #: groups × this many); must divide by micro_batch_size × parallel.data.
    global_batch_size: int = 256
    seed: int = 1234  #: Seed of the initial weights, data order, dropout and the round sampler.
    run_dir: str = "runs/example"  #: Directory of the run's config, metrics, logs and checkpoints.
    log_interval: int = 10  #: Steps between log lines and train records.
    eval_interval: int = 500  #: Steps between evaluations on every source (0: only at the end).
    eval_iters: int = 20  #: Validation batches per source and evaluation (at most one pass over its part).
    save_interval: int = 500  #: Steps between checkpoints (0: only at the end).
    profile: Optional[ProfileConfig] = None  #: A torch.profiler trace of some steps; null = off.
    #: Seconds to wait for every rank at start-up; torch applies the same limit to later
    #: collectives on the world group (checkpoint barriers).
    init_timeout_s: float = 600.0
    compile: bool = False  #: torch.compile each transformer block.
    keep_checkpoints: int = 0  #: Keep the newest N complete checkpoints (0: keep all).
    async_save: bool = False  #: Write checkpoints from a background thread after a host copy.


@dataclass
class FederationConfig:
    """Source groups as separate jobs joined through a torchft lighthouse (docs/launching.md,
    "Federated source groups"); ``lighthouse: null`` is the single job."""
    #: host:port of the lighthouse (``python -m dept_mega.lighthouse``); null: every group in
    #: this one job, no federation.
    lighthouse: Optional[str] = None
    #: This job's group index in [0, groups); null: from the environment variable DEPT_GROUP.
    group: Optional[int] = None
    groups: int = 1  #: Number of group jobs expected (one source per group: data.sources has this many).
    min_groups: int = 1  #: Fewest groups that may complete a round (the others' pseudo-gradients are not waited for).
    #: Seconds survivors wait for a missing group: collectives and commits across groups, and
    #: a fresh run's first round waiting for every expected group.
    timeout_s: float = 60.0


@dataclass
class Config:
    """A run's configuration: ``RUN/config.yaml`` holds the resolved one."""
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: str = "bf16"  #: Dtype of weights and activations; bf16 / fp16 keep fp32 masters in the optimizer.
    fp8: Optional[str] = None  #: FP8 GEMMs in the transformer blocks (needs precision bf16); null = off.
    fp8_recipe: str = "delayed"  #: FP8 scaling: from an amax history (delayed) or the current tensor.
    fp8_amax_history: int = 1024  #: Length of the delayed recipe's amax history.
    fp8_first_last_layers_bf16: bool = False  #: Keep the first and last transformer block in bf16.
    backend: str = "auto"  #: Linear layers: auto (Transformer Engine when it imports on CUDA), local or transformer_engine.
    dept: DeptConfig = field(default_factory=DeptConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    federation: FederationConfig = field(default_factory=FederationConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def num_groups(self, world_size: int) -> int:
        """G = world / (D·P·T): the number of source groups training concurrently."""
        p = self.parallel
        return world_size // (p.tensor * p.pipeline * p.data)


CHOICES: dict[str, tuple[Any, ...]] = {
    "model.activation": ("gelu", "swiglu"),
    "model.normalization": ("layernorm", "rmsnorm"),
    "model.position_embedding": ("alibi", "rope", "learned"),
    "model.attention_backend": ("auto", "flash", "flex", "sdpa", "bias"),
    "model.recompute": ("none", "selective", "full"),
    "precision": ("fp32", "bf16", "fp16"),
    "fp8": (None, "hybrid", "e4m3"),
    "fp8_recipe": ("delayed", "current"),
    "backend": ("auto", "local", "transformer_engine"),
    "dept.variant": ("std", "glob", "trim", "spec", "spec_opt"),
    "dept.sampling": ("uniform", "proportional", "temperature"),
    "dept.embedding_rows": ("all", "present"),
    "dept.outer_optimizer.name": ("fedavg", "nesterov", "adam"),
    "dept.outer_comm_dtype": ("fp32", "bf16", "fp8", "int8", "int4"),
    "dept.outer_state_device": ("device", "cpu"),
    "dept.outer_overlap_rule": ("correction", "eager", "mix"),
    "dept.body_optimizer_state": ("group", "source"),
    "dept.trim_table_device": ("cpu",),  # a table sharded over the outer group: not yet
    "optim.grad_dtype": ("fp32", "bf16"),
}


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


def _build(cls: type, values: dict[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in values.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k not in names:
            raise ConfigError(f"unknown config key '{key}'")
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
            raise ConfigError(f"unknown config key '{here}'")
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
    key, raw = text.split("=", 1)
    key = key.strip()
    if key.startswith("--"):
        key = key[2:]
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
    _check_choices(cfg)
    _check_values(cfg)
    return cfg


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
    return config_from_dict(values, overrides)


def get_key(cfg: Config, dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


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
                    "train.micro_batch_size", "train.global_batch_size", "train.log_interval",
                    "optim.max_consecutive_nonfinite", "train.init_timeout_s", "optim.grad_bucket_size",
                    "dept.outer_quant_block", "dept.outer_fragments"])
    _positive(cfg, ["optim.lr", "optim.min_lr", "optim.warmup_steps", "optim.weight_decay",
                    "optim.eps", "optim.clip_grad", "dept.temperature", "train.eval_interval",
                    "train.eval_iters", "train.save_interval", "train.keep_checkpoints", "model.hidden_dropout",
                    "model.attention_dropout", "dept.outer_delay"], allow_zero=True)
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
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"config key 'data.sources': duplicate source name(s) {dupes}")
    if cfg.fp8 is not None and cfg.precision != "bf16":
        raise ConfigError(f"config key 'fp8': {cfg.fp8!r} needs precision: bf16, got {cfg.precision!r}")
    if t.profile is not None:
        prof = t.profile
        if prof.start < 0 or prof.stop <= prof.start:
            raise ConfigError(f"config key 'train.profile': needs 0 <= start < stop, got start={prof.start} "
                              f"stop={prof.stop}")
        if not prof.ranks or any(r < 0 for r in prof.ranks) or len(set(prof.ranks)) != len(prof.ranks):
            raise ConfigError(f"config key 'train.profile.ranks': a non-empty list of distinct ranks >= 0, "
                              f"got {prof.ranks!r}")
    if cfg.dept.embedding_rows == "present" and cfg.dept.variant != "glob":
        raise ConfigError(f"config key 'dept.embedding_rows': present applies to glob (TRIM's compact tables hold "
                          f"only V_k, SPEC's tables are never averaged), got dept.variant={cfg.dept.variant!r}")
    if cfg.dept.embedding_rows == "present" and cfg.dept.outer_overlap:
        raise ConfigError("config key 'dept.embedding_rows': present needs dept.outer_overlap false (an overlapped "
                          "sync lands inside the next round, whose inner steps hold the other rows at their "
                          "round-start values and would undo it)")
    if cfg.dept.embedding_rows == "present" and cfg.optim.distributed:
        raise ConfigError("config key 'dept.embedding_rows': present needs optim.distributed false (the "
                          "distributed optimizer's gradients and masters are flat shards, not rows)")
    _check_outer_sync(cfg)
    if cfg.dept.body_optimizer_state == "source" and cfg.dept.variant == "std":
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
    if cfg.dept.variant != "std" and t.steps % cfg.dept.local_steps:
        raise ConfigError(f"config key 'dept.local_steps': train.steps={t.steps} is not a multiple of "
                          f"{cfg.dept.local_steps}")


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


def validate(cfg: Config, world_size: int, check_files: bool = True) -> None:
    """Checks that need the world size and the data files. Raises :class:`ConfigError`."""
    p = cfg.parallel
    per_group = p.tensor * p.pipeline * p.data
    if world_size % per_group:
        raise ConfigError(f"config key 'parallel': world size {world_size} is not divisible by "
                          f"tensor × pipeline × data = {p.tensor}×{p.pipeline}×{p.data} = {per_group}")
    groups = world_size // per_group
    prof = cfg.train.profile
    if prof is not None and max(prof.ranks) >= world_size:
        raise ConfigError(f"config key 'train.profile.ranks': rank {max(prof.ranks)} does not exist in a world "
                          f"of {world_size}")
    variant = cfg.dept.variant
    k = len(cfg.data.sources)
    if variant == "std" and groups != 1:
        raise ConfigError(f"config key 'dept.variant': std trains one group, but world size {world_size} "
                          f"with tensor×pipeline×data={per_group} gives {groups} groups")
    if variant in ("spec", "spec_opt") and k < groups:
        raise ConfigError(f"config key 'data.sources': {variant} needs at least one source per group, "
                          f"got {k} sources for {groups} groups")
    if variant != "std" and k and k < groups:
        raise ConfigError(f"config key 'data.sources': {k} sources cannot fill {groups} groups")
    if variant == "spec_opt":
        for i, s in enumerate(cfg.data.sources):
            if not s.tokenizer:
                raise ConfigError(f"config key 'data.sources[{i}].tokenizer': spec_opt needs a tokenizer "
                                  f"for source '{s.name}'")
    elif cfg.data.sources and not cfg.data.tokenizer and cfg.model.vocab_size is None:
        raise ConfigError(f"config key 'data.tokenizer': variant {variant} needs a global tokenizer")
    if not check_files:
        return
    if cfg.data.tokenizer and variant != "spec_opt" and not os.path.exists(cfg.data.tokenizer):
        raise ConfigError(f"config key 'data.tokenizer': file {cfg.data.tokenizer!r} does not exist")
    for i, s in enumerate(cfg.data.sources):
        for ext in (".bin", ".idx"):
            if not os.path.exists(s.prefix + ext):
                raise ConfigError(f"config key 'data.sources[{i}].prefix': file {s.prefix + ext!r} "
                                  f"does not exist (source '{s.name}')")
        if variant == "spec_opt" and s.tokenizer and not os.path.exists(s.tokenizer):
            raise ConfigError(f"config key 'data.sources[{i}].tokenizer': file {s.tokenizer!r} does not exist")


def save_config(cfg: Config, path: str | os.PathLike[str]) -> None:
    """Write the resolved config as YAML (atomically), e.g. to ``RUN/config.yaml``."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)
    os.replace(tmp, path)
