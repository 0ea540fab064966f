"""Export a run's source models as Hugging Face ``transformers`` model directories.

    python tools/convert_to_hf.py --run-dir RUN [--step S] (--source NAME | --all-sources) --output DIR [--overwrite]

One directory per source (``--all-sources``: ``DIR/<source>``) with ``config.json``,
``model.safetensors`` (fp32), ``generation_config.json``, the source's tokenizer
(``tokenizer.json`` + ``tokenizer_config.json``: a SentencePiece model converted, with the model
as ``sentencepiece.model``; a Hugging Face tokenizer's own files copied, ``tokenizer_files``)
and ``dept_export.json`` (what was exported from where). Load it with
``AutoModelForCausalLM.from_pretrained(DIR)`` and ``AutoTokenizer.from_pretrained(DIR)``.

What a source's model is, per variant: std / glob — the one model of the run (global
tokenizer); spec — the source's own embeddings + the body (global tokenizer); spec_opt — the
source's own embeddings + the body (the source's tokenizer); trim — the global table φ + the
body with the global tokenizer, and ``generation_config.suppress_tokens`` = the ids outside the
source's vocabulary V_k (computed from its data, ``data.sources[i].prefix``), so that sampling
uses V_k as training and evaluation did (the logits of the ids in V_k are the model's). The
body is the synchronised body of a round boundary (see ``checkpoint_reader``).

The run's relative tokenizer and data paths are read from the directory it was launched from
(dept_mega.run_paths), so the export runs from any directory. Errors (bad run directory, a
configuration no architecture expresses — naming the config key —, a missing tokenizer) are one
``error: ...`` line and exit status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Callable, Optional, Sequence

from ..config import Config, ConfigError
from ..data.tokenizer import HUGGINGFACE, TokenizerError, load_tokenizer
from ..dept.federation_config import own_sources, source_owners
from ..run_paths import RunPaths, load_run_config
from ..variant import variant_of
from .checkpoint_reader import CheckpointReadError, checkpoint_path, read_full_weights, trim_vocab_ids
from .hf_mapping import ExportError, architecture_for, build_model, to_hf
from .hf_tokenizer import TokenizerExportError
from .tokenizer_files import encoding_difference, export_tokenizer

MARKER = "dept_export.json"


def tokenizer_path(cfg: Config, source: str) -> str:
    """The tokenizer of ``source``'s vocabulary (spec_opt: its own, else the global one)."""
    return tokenizer_entry(cfg, source)[0]


def tokenizer_entry(cfg: Config, source: str) -> tuple[str, str]:
    """(path, config key) of the tokenizer of ``source``'s vocabulary (spec_opt: its own, else
    the global one); an ExportError naming the key when there is none or its file is missing."""
    for i, s in enumerate(cfg.data.sources):
        if s.name == source and variant_of(cfg).own_tokenizer:
            if not s.tokenizer:
                raise ExportError(f"config key 'data.sources[{i}].tokenizer': source {source!r} has no tokenizer")
            path, key = s.tokenizer, f"data.sources[{i}].tokenizer"
            break
    else:
        if not cfg.data.tokenizer:
            raise ExportError("config key 'data.tokenizer': the run has no tokenizer to export with the model")
        path, key = cfg.data.tokenizer, "data.tokenizer"
    if not os.path.exists(path):
        raise ExportError(f"config key '{key}': tokenizer {path!r} does not exist")
    return path, key


def check_tokenizer(cfg: Config, path: str, key: str) -> None:
    """A ConfigError naming ``key`` when its tokenizer file is not the one checkpoint ``path``
    was trained with (``depends.json``'s ``tokenizers``, as a resume or an evaluation checks):
    a tokenizer retrained or replaced after the run gives ids that are not the table's rows."""
    from ..config_diff import check_differing
    from ..manifest import DEPENDS_FILE, CheckpointError, read_json
    from ..resume import depends_differences, tokenizer_fingerprint
    try:
        saved = read_json(path, DEPENDS_FILE)
    except CheckpointError as exc:
        raise ExportError(f"{exc} (it records the tokenizer the checkpoint was trained with)") from None
    rows = depends_differences(saved, {"config": {}, "tokenizers": tokenizer_fingerprint(cfg)}, (), (key,))
    check_differing(rows, f"from checkpoint {path} ({DEPENDS_FILE})",
                    "export with the tokenizer the run was trained with (put that file back, or point the key at it "
                    "in RUN/config.yaml)")


def check_table_rows(cfg: Config, weights: dict, vocab: int, tok_path: str, tok_key: str) -> None:
    """An ExportError unless the token table (and untied head) has the rows the tokenizer's
    vocabulary gives: padded to a multiple of 128 in the model, exactly ``vocab`` in TRIM's φ."""
    from ..model.embeddings import padded_vocab_size
    want = vocab if variant_of(cfg).trimmed else padded_vocab_size(vocab, 1)
    for name in ("embeddings.word_embeddings.weight", "embeddings.output_layer.weight"):
        if name in weights and weights[name].shape[0] != want:
            raise ExportError(f"config key '{tok_key}': tokenizer {tok_path!r} has {vocab} pieces, which need a "
                              f"table of {want} rows, but the checkpoint's {name} ({weights.origin}) has "
                              f"{weights[name].shape[0]}: not the tokenizer the run was trained with")


def replace_dir(tmp: str, output: str) -> None:
    """``output`` := the finished directory ``tmp`` (an earlier one removed first)."""
    if os.path.exists(output):
        shutil.rmtree(output)
    os.replace(tmp, output)


def check_output(output: str, overwrite: bool = False, marker: str = MARKER, flag: str = "--output",
                 what: str = "export") -> bool:
    """Whether ``output`` holds an earlier export that this one replaces (``overwrite``); an
    ExportError for anything else there: a file, a directory with other contents (never
    removed), or an earlier export without ``overwrite``; also a symbolic link (replacing it
    would replace the link, not the folder it names) and a path under a file. ``marker``,
    ``flag``, ``what``: the file that marks an earlier one, the option naming ``output`` and
    what it is (the import, ``tools/convert_from_hf.py``, writes run directories)."""
    output = output.rstrip(os.sep) or os.sep  # "link/" would follow the link
    if os.path.islink(output):
        raise ExportError(f"{flag} {output} is a symbolic link; give the directory it names")
    if os.path.exists(output) and not os.path.isdir(output):
        raise ExportError(f"{flag} {output} exists and is not a directory")
    parent = os.path.dirname(os.path.abspath(output))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ExportError(f"{flag} {output}: {parent} is a file, not a directory")
    if not os.path.isdir(output) or not os.listdir(output):
        return False
    if not os.path.exists(os.path.join(output, marker)):
        raise ExportError(f"{flag} {output} exists, is not empty and is not an earlier {what} (no {marker}); "
                          f"choose a new directory")
    if not overwrite:
        raise ExportError(f"{flag} {output} holds an earlier {what} ({marker}); pass --overwrite to replace it, "
                          f"or choose a new directory")
    return True


def export_source(run_dir: str, source: str, output: str, step: Optional[int] = None,
                  cfg: Optional[Config] = None, log: Callable[[str], None] = print, overwrite: bool = False) -> dict:
    """Export ``source``'s model of ``run_dir`` at ``step`` (default latest) to ``output``
    (``overwrite``: replacing an earlier export there, :func:`check_output`); returns the
    contents of ``dept_export.json``."""
    if cfg is None:
        cfg, _ = load_run_config(run_dir)
    names = [s.name for s in cfg.data.sources]
    if source not in names:
        raise ExportError(f"no source named {source!r} in the run's data.sources ({', '.join(names)})")
    arch = architecture_for(cfg.model)  # refuse before reading anything
    replaces = check_output(output, overwrite)
    tok_path, tok_key = tokenizer_entry(cfg, source)
    tok = load_tokenizer(tok_path, tok_key)  # a file that is no tokenizer: refused before the weights are read
    step, path = checkpoint_path(run_dir, step)
    check_tokenizer(cfg, path, tok_key)
    weights = read_full_weights(run_dir, step, source, cfg)
    check_table_rows(cfg, weights, tok.vocab_size, tok_path, tok_key)
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    tmp = f"{output.rstrip(os.sep)}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        special = export_tokenizer(tok, tmp)
        vocab = tok.vocab_size
        ids = {"bos_token_id": special["bos_token_id"], "eos_token_id": special["eos_token_id"],
               "pad_token_id": special["pad_token_id"] if special["pad_token_id"] is not None
               else special["eos_token_id"]}
        exp = to_hf(cfg, weights, vocab, ids)
        model = build_model(exp)
        info = {"run_dir": os.path.abspath(run_dir), "step": weights.step, "source": source,
                "variant": cfg.dept.variant, "architecture": arch, "from": weights.origin,
                "tokenizer": os.path.abspath(tok_path), "tokenizer_kind": tok.kind, "vocab_size": vocab,
                "parameters": int(sum(p.numel() for p in model.parameters()))}
        if variant_of(cfg).trimmed:
            keep = set(trim_vocab_ids(cfg, source))
            if keep and max(keep) >= vocab:
                raise ExportError(f"TRIM vocabulary of {source!r} holds id {max(keep)}, outside the "
                                  f"tokenizer's {vocab} pieces")
            model.generation_config.suppress_tokens = [i for i in range(vocab) if i not in keep]
            info["trim_vocab_size"] = len(keep)
        model.save_pretrained(tmp)
        if tok.kind == HUGGINGFACE and (differs := encoding_difference(tmp, tok)) is not None:
            print(f"warning: {source!r}: {differs}", file=sys.stderr, flush=True)
            info["tokenizer_differs"] = differs
        with open(os.path.join(tmp, MARKER), "w", encoding="utf-8") as f:
            json.dump(info, f, indent=1)
        replace_dir(tmp, output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"exported {source!r} ({info['from']}) as {arch} ({info['parameters']:,} parameters, vocabulary "
        f"{vocab}) to {output}" + (" (replacing the earlier export there)" if replaces else ""))
    return info


def held_sources(cfg: Config) -> list[str]:
    """The sources whose weights this run directory holds: all of them, or a federated group
    job's own (``data.sources[i].group``, null: i mod ``federation.groups``)."""
    f = cfg.federation
    if f.lighthouse is None or f.group is None:
        return [s.name for s in cfg.data.sources]
    return own_sources(cfg)


def held_elsewhere(cfg: Config, source: str) -> str:
    """Why ``source`` is not in this run directory (a federated group job holds only its own)."""
    names = [s.name for s in cfg.data.sources]
    if source not in names:
        return f"source {source!r} is not in the run's data.sources ({', '.join(names)})"
    owner = source_owners(cfg)[names.index(source)]
    return (f"source {source!r} is trained by group job {owner} of this federated run; this run directory is "
            f"group job {cfg.federation.group}'s (its sources: {', '.join(held_sources(cfg))}): export {source!r} "
            f"from that job's run directory")


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/convert_to_hf.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--source", help="the source whose model to export")
    which.add_argument("--all-sources", action="store_true", help="every source, to OUTPUT/<source>")
    ap.add_argument("--output", required=True, help="the model directory to write")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace an earlier export at --output (without it an existing, non-empty --output is "
                         "refused; a directory that is not an export always is)")
    args = ap.parse_args(argv)
    paths: Optional[RunPaths] = None
    try:
        cfg, paths = load_run_config(args.run_dir)
        if paths.note() is not None:
            print(paths.note(), flush=True)
        held = held_sources(cfg)
        if args.source is not None and args.source not in held:
            raise ExportError(held_elsewhere(cfg, args.source))
        if args.all_sources:
            names = held
            if not names:
                raise ExportError("the run's data.sources is empty: no source to export")
            for name in names:  # every output refused before any is written
                check_output(os.path.join(args.output, name), args.overwrite)
            for k, name in enumerate(names):
                try:
                    export_source(args.run_dir, name, os.path.join(args.output, name), args.step, cfg,
                                  overwrite=args.overwrite)
                except Exception:
                    print(f"exported {k} of {len(names)} sources before {name!r} failed", file=sys.stderr)
                    raise
        else:
            export_source(args.run_dir, args.source, args.output, args.step, cfg, overwrite=args.overwrite)
    except (ExportError, CheckpointReadError, TokenizerExportError, TokenizerError, ConfigError,
            FileNotFoundError) as exc:
        print(f"error: {exc}{paths.hint(str(exc)) if paths is not None else ''}", file=sys.stderr)
        return 2
    except ImportError as exc:
        print(f"error: exporting needs transformers, tokenizers and protobuf "
              f"(pip install -e '.[hf]'): {exc}", file=sys.stderr)
        return 2
    return 0
