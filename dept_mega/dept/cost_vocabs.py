"""The vocabulary sizes the cost model (``costs.py``) needs, and where each comes from: given,
read from the tokenizers the config names, or counted in the sources' data (TRIM's |V_k|)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..config import Config, ConfigError


@dataclass
class Vocabs:
    """The vocabulary sizes the cost model needs, and where each came from.

    ``global_vocab``: the global tokenizer (std, glob, trim, spec). ``source_vocabs``: each
    source's own tokenizer (spec_opt), by source name. ``trim_vocabs``: |V_k| per source,
    the global-tokenizer ids occurring in source k's data (trim). ``None`` = unknown.
    ``notes``: the sizes :func:`with_defaults` assumed, one sentence each.
    """

    global_vocab: Optional[int] = None
    source_vocabs: dict[str, int] = field(default_factory=dict)
    trim_vocabs: dict[str, int] = field(default_factory=dict)
    origin: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def mean_source_vocab(self) -> Optional[float]:
        return _mean(self.source_vocabs.values())

    @property
    def mean_trim_vocab(self) -> Optional[float]:
        return _mean(self.trim_vocabs.values())


def _mean(values) -> Optional[float]:
    values = list(values)
    return sum(values) / len(values) if values else None


class MissingTokenizer(ConfigError):
    """A tokenizer file the config names does not exist; ``key`` is its config key."""

    def __init__(self, message: str, key: str) -> None:
        super().__init__(message)
        self.key = key


def tokenizer_vocab_size(path: str, key: str) -> int:
    """The vocabulary size of a tokenizer (a SentencePiece model, or a Hugging Face
    ``tokenizer.json`` or its directory, added tokens included); a missing file is a ConfigError,
    one that is neither kind too (naming ``key``). A missing one is a :class:`MissingTokenizer`:
    the tools that can take the size instead say so themselves (tools/dept_costs.py)."""
    import os

    from ..data.tokenizer import TokenizerError, load_tokenizer
    if not os.path.exists(path):
        raise MissingTokenizer(f"config key '{key}': tokenizer file {path!r} does not exist (its vocabulary size "
                               f"is needed)", key)
    try:
        return int(load_tokenizer(path, key).vocab_size)
    except TokenizerError as exc:  # the tools report ConfigErrors as one line
        raise ConfigError(str(exc)) from None


def resolve_vocabs(cfg: Config, global_vocab: Optional[int] = None, source_vocab: Optional[int] = None,
                   trim_vocab: Optional[int] = None, read_trim_from_data: bool = True) -> Vocabs:
    """Find the vocabulary sizes: explicit arguments first, then the config's tokenizers
    (``data.tokenizer``, ``data.sources[i].tokenizer``), then ``model.vocab_size``.

    ``trim_vocab`` (the mean |V_k|) may also come from the sources' data files through the
    data package's ``vocab_set`` when they exist, the global vocabulary is the config's own
    (not ``global_vocab``: the files' ids belong to the config's tokenizer) and no source names
    its own tokenizer (then the files are tokenized with those, as SPEC-OPT's are); otherwise it
    stays unknown and :func:`predict_costs` reports TRIM untrimmed (and says so).
    """
    v = Vocabs()
    if global_vocab is not None:
        v.global_vocab, v.origin["global"] = int(global_vocab), "--global-vocab"
    elif cfg.data.tokenizer:
        v.global_vocab = tokenizer_vocab_size(cfg.data.tokenizer, "data.tokenizer")
        v.origin["global"] = f"data.tokenizer ({cfg.data.tokenizer})"
    elif cfg.model.vocab_size is not None:
        v.global_vocab, v.origin["global"] = cfg.model.vocab_size, "model.vocab_size"

    names = [s.name for s in cfg.data.sources] or ["source"]
    if source_vocab is not None:
        v.source_vocabs = {n: int(source_vocab) for n in names}
        v.origin["source"] = "--source-vocab"
    elif cfg.data.sources and all(s.tokenizer for s in cfg.data.sources):
        foreign = _foreign_summaries(cfg)  # a federated group job: other sites' sources by their summaries
        v.source_vocabs = {s.name: (int(foreign[i]["tokenizer"]["vocab_size"]) if i in foreign
                                    else tokenizer_vocab_size(s.tokenizer, f"data.sources[{i}].tokenizer"))
                           for i, s in enumerate(cfg.data.sources)}
        v.origin["source"] = "data.sources[*].tokenizer"

    if trim_vocab is not None:
        v.trim_vocabs = {n: int(trim_vocab) for n in names}
        v.origin["trim"] = "--trim-vocab"
    elif (read_trim_from_data and cfg.data.sources and global_vocab is None and v.global_vocab is not None
          and not any(s.tokenizer for s in cfg.data.sources)):
        # only when the global vocabulary is the config's own and no source names its own
        # tokenizer (a spec_opt config's files hold its sources' own ids): the data's ids are it
        found = _trim_vocabs_from_data(cfg)
        if found:
            v.trim_vocabs, v.origin["trim"] = found, "vocab_set(data.sources[*].prefix)"
    for name, size in [("global", v.global_vocab), *[(f"source {k}", s) for k, s in v.source_vocabs.items()],
                       *[(f"trim {k}", s) for k, s in v.trim_vocabs.items()]]:
        if size is not None and size <= 0:
            raise ConfigError(f"{name} vocabulary size must be > 0, got {size}")
    return v


def with_defaults(v: Vocabs, cfg: Config) -> Vocabs:
    """``v`` with the sizes a config cannot give assumed, each with a note saying so: a config of
    one tokenizer (std, glob, trim, spec) names no per-source tokenizers, so SPEC-OPT's vocabulary
    is taken as the global one; a spec_opt config names no global tokenizer, so the global
    vocabulary (the other variants' table) is taken as the largest source vocabulary. The cost
    table of every variant then prints for any config; the figures of the config's own variant
    use only sizes the config gives. Neither size known is a ConfigError."""
    import dataclasses

    out = dataclasses.replace(v, source_vocabs=dict(v.source_vocabs), origin=dict(v.origin), notes=list(v.notes))
    if out.global_vocab is None and out.source_vocabs:
        name, size = max(out.source_vocabs.items(), key=lambda kv: kv[1])
        out.global_vocab, out.origin["global"] = size, "the largest source vocabulary (assumed)"
        out.notes.append(f"the config names no global tokenizer (data.tokenizer) or model.vocab_size: the global "
                         f"vocabulary (std, glob, trim, spec) is taken as the largest source vocabulary, {size} "
                         f"({name}); pass --global-vocab N for another")
    if not out.source_vocabs and out.global_vocab is not None:
        names = [s.name for s in cfg.data.sources] or ["source"]
        out.source_vocabs = {n: out.global_vocab for n in names}
        out.origin["source"] = "the global vocabulary (assumed)"
        out.notes.append(f"the config names no per-source tokenizers (data.sources[i].tokenizer): SPEC-OPT's "
                         f"vocabulary is taken as the global one, {out.global_vocab}; pass --source-vocab N for another")
    if out.global_vocab is None:
        raise ConfigError("no vocabulary size: set data.tokenizer, data.sources[i].tokenizer or model.vocab_size, "
                          "or pass --global-vocab N")
    return out


def _trim_vocabs_from_data(cfg: Config) -> dict[str, int]:
    """|V_k| of every source from its indexed data, when the files and the data package exist."""
    import os

    try:
        from ..data.sources import vocab_set
    except ImportError:
        return {}
    foreign = _foreign_summaries(cfg)
    if not all(i in foreign or os.path.exists(s.prefix + ".idx") for i, s in enumerate(cfg.data.sources)):
        return {}
    return {s.name: int(foreign[i]["distinct_ids"]) if i in foreign
            else int(len(vocab_set(s.prefix, cfg.data.cache_dir))) for i, s in enumerate(cfg.data.sources)}


def _foreign_summaries(cfg: Config) -> dict:
    """:func:`~dept_mega.data.summary.foreign_summaries`: the summaries of the sources a federated
    group job does not hold; {} also where the config does not say which group this job is (a
    cost tool run on a group job's config without DEPT_GROUP estimates from every source's files,
    as the single job does). A missing or wrong summary is still the ConfigError naming its key."""
    from ..config import held_here
    from ..data.summary import foreign_summaries
    try:
        held_here(cfg)
    except ConfigError:  # the group is not known: this tool reads every file
        return {}
    return foreign_summaries(cfg)
