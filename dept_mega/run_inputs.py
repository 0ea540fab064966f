"""What a launch is made of before any process group exists: the model's vocabulary, the batch
per group and job-wide, and which exceptions mean bad input. Shared by the launcher
(``dept_mega.train``), the pre-flight (``dept_mega.preflight``), evaluation and adaptation."""
from __future__ import annotations

from .config import Config, ConfigError
from .variant import variant_of


def vocab_size_of(cfg: Config) -> int:
    """The vocabulary of the model built at start: the global tokenizer's, else
    ``model.vocab_size``, else (spec_opt) the first source's tokenizer's."""
    from .data.tokenizer import load_tokenizer
    if cfg.data.tokenizer and not variant_of(cfg).own_tokenizer:
        return load_tokenizer(cfg.data.tokenizer, "data.tokenizer").vocab_size
    if cfg.model.vocab_size is not None:
        return cfg.model.vocab_size
    from .data.summary import is_foreign, read_summary
    if cfg.data.sources and is_foreign(cfg, 0):  # a federated group job: source 0 is at another site
        return int(read_summary(cfg, 0)["tokenizer"]["vocab_size"])
    if cfg.data.sources and cfg.data.sources[0].tokenizer:
        return load_tokenizer(cfg.data.sources[0].tokenizer, "data.sources[0].tokenizer").vocab_size
    raise ConfigError("config key 'data.tokenizer': no tokenizer and no model.vocab_size")


def describe_batch(cfg: Config, groups: int) -> str:
    """The batch per group and job-wide: ``train.global_batch_size`` counts the sequences of one
    source group's step (Megatron's global batch is the whole job's)."""
    t, p = cfg.train, cfg.parallel
    per_group = t.global_batch_size
    accumulation = per_group // (t.micro_batch_size * p.data)
    seq = cfg.model.seq_length
    return (f"batch: {per_group} sequences per group (train.global_batch_size) × {groups} group(s) = "
            f"{per_group * groups} sequences = {per_group * groups * seq:,} tokens per step job-wide; "
            f"micro-batch {t.micro_batch_size} × {accumulation} accumulation step(s) × data {p.data}")


def input_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean bad input (config, data or tokenizer files): reported as one
    ``error: ...`` line and exit status 2 on every rank, not a traceback."""
    from .data.gpt_dataset import DatasetError
    from .data.indexed import IndexedFormatError
    from .data.tokenizer import TokenizerError
    from .manifest import CheckpointError
    return (ConfigError, IndexedFormatError, TokenizerError, DatasetError, CheckpointError)
