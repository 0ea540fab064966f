"""Data evaluated beside a run's own sources: ``python -m dept_mega.evaluate --extra-source NAME=PREFIX``.

A held-out corpus (another domain or language, a benchmark's text) evaluated on a trained
checkpoint without training on it. It must be tokenized with the run's global tokenizer
(``data.tokenizer``); the checks are those a training launch makes of its own sources (every id
inside the vocabulary, the tokenizer record's checksum, the byte counts bits per byte need:
``dept_mega.data.checks.check_extra_source``), and it is read like them: the part of
``data.split`` that ``--part`` names, its first ``train.eval_iters`` × ``train.global_batch_size``
sequences (or ``train.eval_samples``). Its record entry is named as given.

Which variants can, and why:

- **std, glob**: one global embedding table serves every source; the extra source is evaluated
  with it, exactly as the run's sources are.
- **trim**: the global table φ; a source is evaluated with the softmax over its vocabulary set
  V_k (the ids that occur in its data), rows taken from φ, as trained. An extra source is
  evaluated the same way, with V = the ids that occur in its own data (the whole ``.bin``, as
  TRIM builds V_k), so none of its ids falls outside the evaluated vocabulary. An id of V that
  no run source's V_k holds has a row that no round ever updated (φ's initial values): a warning
  says how many and what share of the source's tokens (:func:`never_updated_notes`). Likewise
  GLOB with ``dept.embedding_rows: present``, whose rounds update only V_k's rows.
- **spec, spec_opt**: each source owns its token embeddings (spec_opt also its tokenizer); a
  source the run never trained has no trained table, so it is refused: ``dept_mega.adapt``
  trains its embeddings on the frozen body (docs/dept.md, "Studies and plasticity").
"""
from __future__ import annotations

import os
from typing import Sequence

from .config import Config, ConfigError
from .config_schema import SourceConfig
from .variant import variant_of


def label(source: SourceConfig) -> str:
    """How errors and warnings name an extra source: its command-line argument."""
    return f"--extra-source {source.name}={source.prefix}"


def adapt_advice(variant: str) -> str:
    own = "token embeddings and tokenizer" if variant_of(variant).own_tokenizer else "token embeddings"
    return (f"under dept.variant {variant} each source has its own {own}, and a source the run never trained has "
            f"none: train them on this body with python -m dept_mega.adapt, then evaluate that run "
            f"(docs/dept.md \"Studies and plasticity\")")


def not_the_runs_config(variant: str) -> str:
    """What ``dept_mega.evaluate`` tells a config that differs from the checkpoint's: the
    overrides may change the layout, not the model, the variant or the sources (a source the
    run never trained has no data position). Where to take other data: ``--extra-source``
    (one global table) or ``dept_mega.adapt`` (embeddings per source)."""
    head = ("dept_mega.evaluate evaluates a checkpoint with the model, DEPT settings and data.sources it was trained "
            "with: drop that override")
    if variant_of(variant).global_table:
        return (f"{head} (to evaluate other data tokenized with the run's data.tokenizer, keep data.sources and add "
                f"it with --extra-source NAME=PREFIX, repeatable)")
    return f"{head} (a new source: {adapt_advice(variant)})"


def parse_extra_sources(specs: Sequence[str], cfg: Config) -> list[SourceConfig]:
    """``--extra-source NAME=PREFIX`` arguments as SourceConfigs; a ConfigError for a malformed
    argument, a name the run's sources or another extra source have, missing files, or a
    variant whose sources own their embeddings (not ``Variant.global_table``)."""
    if not specs:
        return []
    variant = cfg.dept.variant
    if not variant_of(variant).global_table:
        raise ConfigError(f"--extra-source: {adapt_advice(variant)}")
    taken = {s.name for s in cfg.data.sources}
    out: list[SourceConfig] = []
    for spec in specs:
        name, sep, prefix = (x.strip() for x in spec.partition("="))
        if not sep or not name or not prefix:
            raise ConfigError(f"--extra-source {spec!r}: expected NAME=PREFIX (the PREFIX.bin / PREFIX.idx of "
                              f"tools/preprocess_data.py with the run's data.tokenizer), e.g. "
                              f"--extra-source heldout=data/heldout_text_document")
        if name in taken:
            what = "a source of the run (data.sources)" if name in {s.name for s in cfg.data.sources} \
                else "given twice"
            raise ConfigError(f"--extra-source {spec}: the name {name!r} is {what}: give it another name")
        for ext in (".bin", ".idx"):
            if not os.path.exists(prefix + ext):
                raise ConfigError(f"--extra-source {spec}: file {prefix + ext!r} does not exist")
        taken.add(name)
        out.append(SourceConfig(name=name, prefix=prefix))
    return out


def check_extra_sources(cfg: Config, extra: Sequence[SourceConfig], part: str) -> None:
    """The data checks of every extra source (``dept_mega.data.checks.check_extra_source``)."""
    from .data.checks import check_extra_source
    digests: dict = {}
    for s in extra:
        check_extra_source(cfg, s, part, digests, label(s))


def extra_infos(cfg: Config, extra: Sequence[SourceConfig], vocab: int) -> list:
    """``SourceInfo`` of each extra source, as the run's sources get theirs (TRIM's and
    ``embedding_rows: present``'s V: the ids of its data)."""
    from .data.checks import _with_sources
    from .dept.source_info import sources_from_config
    return sources_from_config(_with_sources(cfg, extra), vocab)


def register_extra_sources(cfg: Config, hooks, extra: Sequence[SourceConfig], vocab: int) -> None:
    """Tell the DEPT hooks (GLOB, TRIM) of the extra sources, which they evaluate with the
    global table (TRIM: its rows V of φ); STD's hooks need nothing (the model's one table)."""
    add = getattr(hooks, "add_eval_sources", None)
    if add is not None and extra:
        add(extra_infos(cfg, extra, vocab))


def never_updated_notes(cfg: Config, extra: Sequence[SourceConfig]) -> list[str]:
    """One warning line per extra source some of whose ids have rows that no round updated
    (TRIM: rows of φ outside every run source's V_k; GLOB with ``dept.embedding_rows:
    present`` likewise): how many ids, and what share of the source's tokens they are. Other
    variants update every row: nothing."""
    v = variant_of(cfg)
    if not extra or not (v.trimmed or (v.synced_table and cfg.dept.embedding_rows == "present")):
        return []
    import numpy as np

    from .data.sources import token_counts
    trained = np.zeros(0, dtype=bool)
    for s in cfg.data.sources:
        present = token_counts(s.prefix, cfg.data.cache_dir) > 0
        if len(present) > len(trained):
            present[:len(trained)] |= trained
            trained = present
        else:
            trained[:len(present)] |= present
    out = []
    for s in extra:
        counts = token_counts(s.prefix, cfg.data.cache_dir)
        ids = np.flatnonzero(counts)
        known = np.zeros(len(ids), dtype=bool)
        inside = ids < len(trained)
        known[inside] = trained[ids[inside]]
        fresh = ids[~known]
        if not len(fresh):
            continue
        share = 100.0 * float(counts[fresh].sum()) / max(float(counts.sum()), 1.0)
        how = (f"φ hold their initial values; it is evaluated with the softmax over its own {len(ids)} ids, as trim "
               f"evaluates a source" if v.trimmed else
               "the global table hold their initial values; it is evaluated with the whole table, as glob evaluates "
               "every source")
        out.append(f"{label(s)}: {len(fresh)} of its {len(ids)} token ids ({share:.2f} % of its tokens) occur in the "
                   f"data of no source of the run, and a round updates only the rows of its source's ids: those "
                   f"rows of {how}")
    return out
