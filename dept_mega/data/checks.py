"""Checks of a run's data before training: every source holds documents, and its token ids
fit the vocabulary of the tokenizer whose embeddings will read them.

Data tokenized with one tokenizer and a config naming another gives no error further on: ids
past the vocabulary become zero rows under tensor parallelism or index past the table (an
``IndexError``, a device-side assert on a GPU), and ids in the padded rows make the steps
non-finite. The largest id is computed once per data file and cached beside it
(:func:`dept_mega.data.token_range.token_id_range`). A tokenizer of the same size or larger is
caught only where the data says which tokenizer made it (``PREFIX.tokenizer.json``, written by
tools/preprocess_data.py): its checksum must be the configured tokenizer's.
"""
from __future__ import annotations

import json
import os
from typing import Optional

from dept_mega.config import Config, ConfigError, held_here
from dept_mega.data.indexed import IndexedDataset, bin_path, bytes_path, idx_path, tokenizer_record_path
from dept_mega.data.sources import naming_source
from dept_mega.data.summary import foreign_summaries, summary_path
from dept_mega.data.token_range import token_id_range
from dept_mega.variant import variant_of


def embedding_vocabularies(cfg: Config) -> list[tuple[str, str, int]]:
    """Per source: (config key of the vocabulary, its description, vocabulary size) — the
    source's own tokenizer under spec_opt, else the global tokenizer, else model.vocab_size."""
    from dept_mega.data.tokenizer import load_tokenizer
    out = []
    sizes: dict[str, int] = {}

    def size_of(path: str, key: str) -> int:
        if path not in sizes:
            sizes[path] = load_tokenizer(path, key).vocab_size
        return sizes[path]

    # spec_opt: another site's source's tokenizer is known by its summary (other variants embed
    # every source with the global vocabulary: no summary is read here)
    foreign = foreign_summaries(cfg) if variant_of(cfg).own_tokenizer else {}
    for i, s in enumerate(cfg.data.sources):
        if i in foreign:
            out.append((f"data.sources[{i}].summary", f"summary {summary_path(s)}",
                        foreign[i]["tokenizer"]["vocab_size"]))
        elif variant_of(cfg).own_tokenizer and s.tokenizer:
            out.append((f"data.sources[{i}].tokenizer", f"tokenizer {s.tokenizer}",
                        size_of(s.tokenizer, f"data.sources[{i}].tokenizer")))
        elif cfg.data.tokenizer:
            out.append(("data.tokenizer", f"tokenizer {cfg.data.tokenizer}",
                        size_of(cfg.data.tokenizer, "data.tokenizer")))
        elif cfg.model.vocab_size is not None:
            out.append(("model.vocab_size", "model.vocab_size", cfg.model.vocab_size))
        else:
            raise ConfigError(f"config key 'data.tokenizer': source '{s.name}' has no tokenizer and "
                              f"model.vocab_size is not set")
    return out


def _made_with(prefix: str, tokenizer: str, digests: dict) -> Optional[tuple[str, str]]:
    """``(record, tokenizer named there)`` when ``PREFIX.tokenizer.json`` names a tokenizer whose
    checksum (of the SentencePiece model, or of a Hugging Face tokenizer's ``tokenizer.json``) is
    not that of ``tokenizer``; None when they agree or the data has no record (left to the
    id-range check). A record that cannot be read: ValueError saying so. ``digests``: the
    tokenizers' checksums so far (``model_sha256``'s cache: a tokenizer several sources share
    is read once)."""
    from dept_mega.data.tokenizer import TOKENIZER_TYPES, model_sha256
    record = tokenizer_record_path(prefix)
    if not os.path.isfile(record):
        return None
    try:
        with open(record, encoding="utf-8") as f:
            made = json.load(f)
        made_type, made_model, made_sha = made["tokenizer_type"], made["tokenizer_model"], made["sha256"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{record} is not a tokenizer record ({exc!r}); rerun tools/preprocess_data.py, or delete "
                         f"the file to skip this check") from None
    if made_type not in TOKENIZER_TYPES or model_sha256(tokenizer, digests) == made_sha:
        return None
    return record, made_model


def _check_made_with(cfg: Config, i: int, vkey: str, digests: dict) -> None:
    """ConfigError when the source's ``PREFIX.tokenizer.json`` names another tokenizer than the
    configured one (:func:`_made_with`)."""
    s = cfg.data.sources[i]
    if vkey == "model.vocab_size":
        return
    used = s.tokenizer if vkey.startswith("data.sources") else cfg.data.tokenizer
    try:
        other = _made_with(s.prefix, used, digests)
    except ValueError as exc:
        raise ConfigError(f"config key 'data.sources[{i}].prefix': source '{s.name}': {exc}") from None
    if other is not None:
        record, made_model = other
        raise ConfigError(f"config key '{vkey}': source '{s.name}': {bin_path(s.prefix)} was tokenized with "
                          f"{made_model} ({record}), but {vkey} is {used}, another tokenizer: point {vkey} at the "
                          f"tokenizer the data was made with, or data.sources[{i}].prefix at data tokenized "
                          f"with {used}")


def check_sources(cfg: Config, eval_part: str = "valid") -> None:
    """ConfigError (one line naming the key, the file and the numbers) when a source is empty,
    holds a token id outside the vocabulary that embeds it, or was made with another tokenizer
    than the configured one (where the data records it). ``eval_part``: the part evaluation
    reads (``valid``; ``test``: ``dept_mega.evaluate --part test``, after :func:`check_eval_part`)."""
    vocabs = embedding_vocabularies(cfg)
    digests: dict = {}
    opened = []  # (index, dataset) of the sources whose files this job reads
    foreign = foreign_summaries(cfg)  # a federated group job: another site's summary stands for its files
    for i, (s, (vkey, what, vocab)) in enumerate(zip(cfg.data.sources, vocabs)):
        if i in foreign:  # another site's source: its summary was read and checked, its files are not here
            continue
        key = f"config key 'data.sources[{i}].prefix'"
        with naming_source(i, s.name):
            ds = IndexedDataset(s.prefix)
        opened.append((i, ds))
        if ds.num_documents == 0 or ds.num_tokens == 0:
            raise ConfigError(f"{key}: source '{s.name}': {idx_path(s.prefix)} holds {ds.num_documents} documents "
                              f"and {ds.num_tokens} tokens: an empty dataset (was the preprocessing input empty "
                              f"or all bad lines?)")
        with naming_source(i, s.name):
            lo, hi = token_id_range(s.prefix, cfg.data.cache_dir)
        if lo < 0 or hi >= vocab:
            bad = lo if lo < 0 else hi
            raise ConfigError(f"{key}: source '{s.name}': {bin_path(s.prefix)} holds token id {bad}, but {what} "
                              f"({vkey}) has {vocab} ids (0..{vocab - 1}): the data was made with another "
                              f"tokenizer")
        _check_made_with(cfg, i, vkey, digests)
        _check_byte_counts(cfg, i)
    # after every source's files are known sound: a damaged file is named as such first
    for i, ds in opened:
        _check_train_size(cfg, i, ds)
        _check_validation_size(cfg, i, ds, eval_part)


def check_extra_source(cfg: Config, source, part: str, digests: dict, label: str) -> None:
    """ConfigError naming ``label`` (``--extra-source NAME=PREFIX``) when ``source`` (a
    ``SourceConfig`` evaluated beside the run's sources, never trained: dept_mega.eval_sources)
    cannot be evaluated with the run's global vocabulary: the checks a training launch makes of
    its own sources — documents present, every id inside the vocabulary, made with the run's
    tokenizer where ``PREFIX.tokenizer.json`` records it (by checksum), the byte counts bits per
    byte need — and a sample of ``model.seq_length`` + 1 tokens in part ``part`` of ``data.split``."""
    from dept_mega.data.indexed import IndexedFormatError
    vkey, what, vocab = embedding_vocabularies(_with_sources(cfg, [source]))[0]
    prefix = source.prefix
    try:
        ds = IndexedDataset(prefix)
    except IndexedFormatError as exc:
        raise ConfigError(f"{label}: {exc}") from None
    if ds.num_documents == 0 or ds.num_tokens == 0:
        raise ConfigError(f"{label}: {idx_path(prefix)} holds {ds.num_documents} documents and {ds.num_tokens} "
                          f"tokens: an empty dataset")
    how = (f"preprocess its jsonl with tools/preprocess_data.py --tokenizer-model {cfg.data.tokenizer}"
           if vkey == "data.tokenizer" else "preprocess it with the run's tokenizer")
    lo, hi = token_id_range(prefix, cfg.data.cache_dir)
    if lo < 0 or hi >= vocab:
        bad = lo if lo < 0 else hi
        raise ConfigError(f"{label}: {bin_path(prefix)} holds token id {bad}, but the run's {what} ({vkey}) has "
                          f"{vocab} ids (0..{vocab - 1}): the data was made with another tokenizer; {how}")
    if vkey == "data.tokenizer":
        try:
            other = _made_with(prefix, cfg.data.tokenizer, digests)
        except ValueError as exc:
            raise ConfigError(f"{label}: {exc}") from None
        if other is not None:
            raise ConfigError(f"{label}: {bin_path(prefix)} was tokenized with {other[1]} ({other[0]}), but the "
                              f"run's data.tokenizer is {cfg.data.tokenizer}, another tokenizer: its ids mean other "
                              f"text to this model; {how}")
    if cfg.train.eval_sequences() and not os.path.isfile(bytes_path(prefix)):
        raise ConfigError(f"{label}: {bytes_path(prefix)} does not exist: bits per byte need each document's UTF-8 "
                          f"byte count, which tools/preprocess_data.py writes (tools/add_byte_counts.py --prefix "
                          f"{prefix} --input DOCS.jsonl adds it)")
    if (empty := _empty_part(cfg, 0, ds, part, source=source)) is not None:
        raise ConfigError(f"{label}: {empty}: nothing to evaluate (its documents are split by data.split like "
                          f"the run's sources)")


def _with_sources(cfg: Config, sources) -> Config:
    """``cfg`` with ``data.sources`` replaced by ``sources`` (a shallow copy)."""
    import dataclasses
    # the extra sources are all read here (the federation's split of sources is the run's)
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, sources=list(sources)),
                               federation=dataclasses.replace(cfg.federation, lighthouse=None))


PART_NAMES = {"train": "train", "valid": "validation", "test": "test"}


def check_eval_part(cfg: Config, part: str) -> None:
    """ConfigError naming ``data.split`` when evaluation is to read part ``part`` (``valid`` |
    ``test``) but the split gives it no weight: ``data.split`` ``"98,2"`` has no test part."""
    from dept_mega.data.gpt_dataset import PARTS, parse_split
    if part not in PARTS[1:]:
        raise ConfigError(f"evaluation part {part!r} is not one of {' | '.join(PARTS[1:])}")
    try:
        weights = parse_split(cfg.data.split)
    except ValueError as exc:
        raise ConfigError(f"config key 'data.split': {exc}") from None
    index = PARTS.index(part)
    if index >= len(weights) or weights[index] <= 0:
        raise ConfigError(f"config key 'data.split': {cfg.data.split!r} has no {PART_NAMES[part]} part (weights "
                          f"train,valid,test: a third weight > 0 makes a test part, which training never reads); "
                          f"the run's documents were split without one, so evaluate its validation part (--part "
                          f"valid), or train with a data.split such as '90,5,5' to hold out a test part")


def _empty_part(cfg: Config, i: int, ds: IndexedDataset, which: str, source=None) -> Optional[str]:
    """None when source ``i``'s part ``which`` (``train`` | ``valid`` | ``test``) holds a sample of
    ``model.seq_length`` + 1 tokens, else what it holds, for the check's error; a ConfigError
    naming ``data.split`` when the split cannot be applied. ``source``: the source (default:
    ``data.sources[i]``)."""
    from dept_mega.data.gpt_dataset import DatasetError, part_tokens
    s = cfg.data.sources[i] if source is None else source
    try:
        lo, hi, tokens = part_tokens(ds, cfg.data.split, which)
    except DatasetError as exc:
        raise ConfigError(f"config key 'data.split': source '{s.name}' ({idx_path(s.prefix)}): {exc}") from None
    if max(tokens - 1, 0) // cfg.model.seq_length > 0:
        return None
    part = PART_NAMES[which]
    return (f"its {part} part ({hi - lo} of {ds.num_documents} documents under data.split {cfg.data.split!r}, "
            f"{tokens} tokens) holds no sample of model.seq_length + 1 = {cfg.model.seq_length + 1} tokens")


def _check_train_size(cfg: Config, i: int, ds: IndexedDataset) -> None:
    """ConfigError when a source's train part holds no sample of ``model.seq_length`` + 1 tokens:
    the launch could not build its dataset (every variant; found here rather than on the
    allocated nodes)."""
    if (empty := _empty_part(cfg, i, ds, "train")) is not None:
        raise ConfigError(f"config key 'data.sources[{i}].prefix': source '{cfg.data.sources[i].name}': {empty}: "
                          f"nothing to train on. Use more data for this source, give the train part more weight "
                          f"in data.split, or a shorter model.seq_length")


def _check_validation_size(cfg: Config, i: int, ds: IndexedDataset, part: str = "valid") -> None:
    """ConfigError when evaluation will run but the source's validation part holds no sample of
    ``model.seq_length`` + 1 tokens: its loss and bits per byte would be computed from no tokens
    at all (NaN in the log and metrics.jsonl) at every evaluation. A part with fewer samples
    than ``train.eval_iters`` × ``train.global_batch_size`` is evaluated whole
    (``dept_mega.data.sources.ValidationBatches``)."""
    if cfg.train.eval_sequences() == 0 or (empty := _empty_part(cfg, i, ds, part)) is None:
        return
    raise ConfigError(f"config key 'data.split': source '{cfg.data.sources[i].name}': {empty}: its loss and bits "
                      f"per byte would be NaN. Give the {PART_NAMES[part]} part more weight in data.split, use more data "
                      f"for this source, or set train.eval_iters=0 (and train.eval_samples=0 where set) to train "
                      f"without evaluation")


def source_warnings(cfg: Config) -> list[str]:
    """What the pre-flight (``--check``) and the launch warn about the sources' data, from their
    ``PREFIX.tokenizer.json`` (each read once): input lines skipped at preprocessing, then lossy
    tokenizers."""
    held = held_here(cfg)  # a federated group job: only its own sources' records
    records = [_read_record(s.prefix) if held is None or i in held else None for i, s in enumerate(cfg.data.sources)]
    return skipped_input_warnings(cfg, records) + lossy_source_warnings(cfg, records)


def _read_record(prefix: str):
    """A source's ``PREFIX.tokenizer.json`` as a dict, or None (no record, or one that
    :func:`check_sources` reports)."""
    try:
        with open(tokenizer_record_path(prefix), encoding="utf-8") as f:
            made = json.load(f)
    except (OSError, ValueError):
        return None
    return made if isinstance(made, dict) else None


def skipped_input_warnings(cfg: Config, records: Optional[list] = None) -> list[str]:
    """One line per source whose ``PREFIX.tokenizer.json`` says tools/preprocess_data.py skipped
    input lines as bad input (``input.skipped`` > 0, by kind in ``input.skipped_by_kind``): the
    data lacks those lines, which the preprocessing report named at the time. Records without
    the field (written before it existed) or with nothing skipped: nothing. ``records``: the
    sources' records as :func:`_read_record` gives them (read here when None)."""
    if records is None:
        records = [_read_record(s.prefix) for s in cfg.data.sources]
    out = []
    for i, (s, made) in enumerate(zip(cfg.data.sources, records)):
        source = (made or {}).get("input")
        skipped = source.get("skipped") if isinstance(source, dict) else None
        if isinstance(skipped, bool) or not isinstance(skipped, int) or skipped <= 0:
            continue
        lines = source.get("lines")
        of = f"{skipped} of {lines}" if isinstance(lines, int) and not isinstance(lines, bool) else f"{skipped}"
        kinds = source.get("skipped_by_kind")
        by = (", ".join(f"{k} {n}" for k, n in kinds.items()) if isinstance(kinds, dict) and kinds
              else "kinds not recorded")
        out.append(f"config key 'data.sources[{i}].prefix': source '{s.name}': {s.prefix}: {of} input lines were "
                   f"skipped as bad input when it was preprocessed ({by}; {tokenizer_record_path(s.prefix)}): "
                   f"this data lacks them; fix the input and preprocess again (tools/preprocess_data.py's report "
                   f"names the first lines of each kind), or preprocess with --strict to stop at bad input "
                   f"instead of skipping it")
    return out


def lossy_source_warnings(cfg: Config, records: Optional[list] = None) -> list[str]:
    """One line per source whose ``PREFIX.tokenizer.json`` says its tokenizer did not give every
    checked document back (``lossless: false``, written by tools/preprocess_data.py): its bits
    per byte count the original bytes, including bytes the tokens do not encode, so they are
    understated against a lossless tokenizer's. A source preprocessed with
    ``--round-trip-every 0`` (``lossless: null``, ``round_trip.checked: 0``) gets a note that
    its round trip was not checked. Sampled with no mismatch (``lossless: null``, some checked),
    lossless, or older records without the fields (``checked`` absent: every document was
    checked): nothing. ``records``: as for :func:`skipped_input_warnings`."""
    if records is None:
        records = [_read_record(s.prefix) for s in cfg.data.sources]
    out = []
    for i, (s, made) in enumerate(zip(cfg.data.sources, records)):
        if made is None:
            continue  # no record, or one check_sources reports
        record = tokenizer_record_path(s.prefix)
        lossless, rt = made.get("lossless", True), made.get("round_trip")
        where = f"config key 'data.sources[{i}].prefix': source '{s.name}': {record}"
        if lossless is None and isinstance(rt, dict) and rt.get("checked") == 0:
            every = rt.get("every", 0)
            how = ("--round-trip-every 0" if not every else
                   f"--round-trip-every {every}: no valid document on the sampled lines")
            out.append(f"{where}: the round trip was not checked (tools/preprocess_data.py {how}): "
                       f"whether its tokenizer gives the documents back is unknown, and with a lossy one bits per "
                       f"byte count bytes the tokens do not encode; preprocess again without --round-trip-every 0 "
                       f"(or with a K > 1 to sample) to know")
            continue
        if lossless is not False:
            continue
        try:
            checked = rt.get("checked", rt["documents"])
            share = 100.0 * rt["mismatched_bytes"] / max(rt.get("checked_bytes", rt["bytes"]), 1)
            of = (f"{rt['documents']} documents" if checked == rt["documents"]
                  else f"{checked} checked documents of {rt['documents']}")
            what = (f"{rt['mismatched_documents']} of {of} ({share:.1f} % of the "
                    f"{'checked ' if checked != rt['documents'] else ''}bytes) do not round-trip")
        except (KeyError, TypeError, AttributeError):
            what = "documents do not round-trip"
        out.append(f"{where}: the tokenizer is lossy "
                   f"on this data ({what}: decode(encode(text)) != text); its bits per byte count bytes the "
                   f"tokens do not encode, so they are not comparable with a lossless tokenizer's "
                   f"(tools/train_tokenizer.py trains lossless tokenizers by default)")
    return out


def _check_byte_counts(cfg: Config, i: int) -> None:
    """ConfigError when evaluation will run (``train.eval_iters`` > 0) but the source has no
    ``PREFIX.bytes.npy``: its bits per byte need each document's UTF-8 byte count, which
    tools/preprocess_data.py writes and Megatron-LM's preprocess_data.py does not. Without this
    check such data trains until the first evaluation and then stops with a traceback."""
    s = cfg.data.sources[i]
    path = bytes_path(s.prefix)
    if cfg.train.eval_sequences() == 0 or os.path.isfile(path):
        return
    raise ConfigError(f"config key 'data.sources[{i}].prefix': source '{s.name}': {path} does not exist: "
                      f"evaluation ({cfg.train.eval_sequences()} sequences per source) reports bits per byte from each "
                      f"document's UTF-8 byte count, which tools/preprocess_data.py writes beside the .bin/.idx "
                      f"(Megatron-LM's preprocess_data.py does not): write it from the source's jsonl with "
                      f"tools/add_byte_counts.py --prefix {s.prefix} --input DOCS.jsonl, re-run "
                      f"tools/preprocess_data.py on the jsonl, or set train.eval_iters=0 (and train.eval_samples=0 where set) to train without evaluation")
