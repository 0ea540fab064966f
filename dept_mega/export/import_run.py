"""Import a Hugging Face Llama or MPT model as a dept_mega run directory to start runs from.

    python tools/convert_from_hf.py --hf-dir DIR --config CFG.yaml [key=value ...] --run-dir OUT [--overwrite]
    python tools/convert_from_hf.py --hf-dir DIR --print-model-config

``OUT`` holds one complete checkpoint, ``OUT/checkpoints/step_0`` (checkpoint format 2,
written by the project's :class:`~dept_mega.checkpoint.Checkpointer` from a one-process STD
trainer whose weights are the model's: manifest, ``depends.json``, ``layout.json``, the
step's ``config.yaml``), ``OUT/config.yaml`` (CFG as the STD run that holds these weights:
``dept.variant: std``, one process, fp32) and ``OUT/hf_import.json`` (what was imported from
where). A run starts from it with ``train.init_from: OUT`` — std, glob, trim or spec
(``init_from.STARTS_FROM``), at any layout and precision; the optimizer state, step and data
position start fresh. ``OUT`` is not a run to continue (``train.run_dir: OUT`` is refused).

The config's model keys must be the Hugging Face model's (``--print-model-config`` prints the
``model:`` section): one error naming every differing key. The vocabulary: the tokenizer of
``data.tokenizer`` (or ``model.vocab_size`` without one) must have the model's size; the
checkpoint's ``depends.json`` records the config's ``data.tokenizer`` and its checksum, as
a training run's does, so ``train.init_from`` later accepts the same tokenizer file (by
content) and refuses another. The tables are padded to a multiple of 128 rows as in every
dept_mega model; the padding rows are zero (no token reaches them, their logits are −inf).

Errors are one ``error: ...`` line (or one line per differing key) and exit status 2.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from types import SimpleNamespace
from typing import Any, Callable, Optional, Sequence

import torch
import yaml

from ..config import Config, ConfigError, config_from_dict, load_config, save_config
from ..config_diff import both, check_differing
from ..run_paths import record_launch_dir
from ..rundir import IMPORTED
from ..variant import variant_of
from .convert import check_output, replace_dir
from .hf_mapping import ExportError
from .hf_dir import HFDirError, HFDirectory, describe_weights, tokenizer_files
from .hf_import import HFImportError, check_names, model_keys, tied_copy, weight_plan

TABLES = ("embeddings.word_embeddings.weight", "embeddings.output_layer.weight")
SIDES = ("the Hugging Face model has", "this config has")
ADVICE = "print the matching model section with --print-model-config"


def model_section(d: HFDirectory) -> str:
    """The ``model:`` YAML section that expresses the model of ``d`` (``--print-model-config``)."""
    keys = model_keys(d.model_type, d.config, d.raw)
    lines = [f"# the model of {d.path} ({d.model_type}; tools/convert_from_hf.py --print-model-config)", "model:"]
    notes = {"model.seq_length": "the model's maximum positions; a training choice, not checked",
             "model.vocab_size": "with data.tokenizer set its size is used and must be this"}
    for key, value in keys.items():
        text = yaml.safe_dump({key.split(".", 1)[1]: value}, default_flow_style=True).strip()[1:-1]
        lines.append(f"  {text}" + (f"  # {notes[key]}" if key in notes else ""))
    return "\n".join(lines) + "\n"


def _config_value(cfg: Config, key: str) -> Any:
    m = cfg.model
    resolved = {"model.num_query_groups": m.query_groups, "model.ffn_hidden_size": m.ffn_size}
    return resolved[key] if key in resolved else getattr(m, key.split(".", 1)[1])


def check_config(cfg: Config, d: HFDirectory) -> int:
    """One ConfigError naming every model key in which ``cfg`` differs from the Hugging Face
    model (and a vocabulary of another size, naming data.tokenizer or model.vocab_size);
    returns the vocabulary size."""
    from ..run_inputs import vocab_size_of
    if variant_of(cfg).own_tokenizer:
        raise ConfigError("config key 'dept.variant': 'spec_opt' — its tables belong to each source's own "
                          "tokenizer; imported weights have one vocabulary (the Hugging Face model's) and start "
                          "std, glob, trim and spec runs")
    keys = model_keys(d.model_type, d.config, d.raw)
    rows = []
    for key, want in keys.items():
        if key in ("model.seq_length", "model.vocab_size"):
            continue
        have = _config_value(cfg, key)
        if have != want:
            rows.append((key, both(want, have, SIDES)))
    vocab = vocab_size_of(cfg)
    if vocab != keys["model.vocab_size"]:
        key = "data.tokenizer" if cfg.data.tokenizer else "model.vocab_size"
        whose = f"tokenizer {cfg.data.tokenizer!r} has" if cfg.data.tokenizer else "config has"
        rows.append((key, f"the Hugging Face model has a vocabulary of {keys['model.vocab_size']}, this {whose} "
                          f"{vocab}"))
    check_differing(rows, f"from the Hugging Face model {d.path}", ADVICE)
    return vocab


def run_config(cfg: Config, run_dir: str) -> Config:
    """``cfg`` as the one-process STD run that holds the imported weights (``OUT/config.yaml``)."""
    values = cfg.to_dict()
    values["dept"]["variant"] = "std"
    values["parallel"] = {"tensor": 1, "pipeline": 1, "data": 1, "sequence_parallel": False, "virtual_pipeline": 1}
    values.update(precision="fp32", fp8=None, backend="local")
    values["optim"]["distributed"] = False
    values["train"].update(run_dir=run_dir, init_from=None, profile=None, compile=False, async_save=False)
    values["federation"]["lighthouse"] = None
    values["federation"]["group"] = None
    return config_from_dict(values)


def _fill(trainer, d: HFDirectory, vocab: int, plan: list) -> None:
    """Copy the Hugging Face weights into the trainer's one model chunk by ``plan``
    (``hf_import.weight_plan``, its names checked); the tables' padding rows zero."""
    m = trainer.cfg.model
    params = dict(trainer.stages[0].named_parameters())
    filled = set()
    with torch.no_grad():
        for piece in plan:
            if piece.name not in params:
                raise HFImportError(f"dept_mega's model for this config has no parameter {piece.name!r} "
                                    f"(for {', '.join(piece.sources)})")
            t = piece.combine(*(d.get(s) for s in piece.sources))
            p = params[piece.name]
            if piece.name in TABLES:
                if tuple(t.shape) != (vocab,) + tuple(p.shape[1:]):
                    raise HFImportError(f"{piece.sources[0]} has shape {tuple(t.shape)}, the config's model needs "
                                        f"{(vocab,) + tuple(p.shape[1:])}")
                p[:vocab].copy_(t)
                p[vocab:].zero_()
            else:
                if tuple(t.shape) != tuple(p.shape):
                    raise HFImportError(f"{', '.join(piece.sources)} make a tensor of shape {tuple(t.shape)}, the "
                                        f"config's model needs {tuple(p.shape)} for {piece.name}")
                p.copy_(t)
            filled.add(piece.name)
        head, table = tied_copy(d.model_type)
        if m.tie_embeddings and head in d.names() and not torch.equal(d.get(head), d.get(table)):
            raise HFImportError(f"{head} differs from {table}, but the model ties them (tie_word_embeddings); "
                                f"import it with model.tie_embeddings: false (and tie_word_embeddings: false)")
    left = sorted(set(params) - filled)
    if left:
        raise HFImportError(f"dept_mega's model for this config has parameter {left[0]!r}, which no Hugging Face "
                            f"tensor fills (a model key the model does not have?)")


def _tokenizer_note(cfg: Config, d: HFDirectory) -> Optional[str]:
    """A line when ``data.tokenizer`` is none of the Hugging Face directory's tokenizer files."""
    from ..data.tokenizer import model_sha256
    tok = cfg.data.tokenizer
    files = tokenizer_files(d.path)
    if tok is None:
        return (f"note: data.tokenizer is null (model.vocab_size {cfg.model.vocab_size}); train on data made with the "
                f"Hugging Face model's tokenizer ({', '.join(files) or 'none in ' + d.path})")
    mine = model_sha256(tok)
    if any(model_sha256(os.path.join(d.path, f)) == mine for f in files):
        return None
    return (f"note: data.tokenizer {tok!r} is none of {d.path}'s tokenizer files ({', '.join(files) or 'none'}): "
            f"the vocabulary sizes agree, but only the model's own tokenizer gives the ids it was trained with")


def import_hf(hf_dir: str, cfg: Config, run_dir: str, overwrite: bool = False,
              log: Callable[[str], None] = print) -> dict[str, Any]:
    """Write ``run_dir`` from the Hugging Face model in ``hf_dir`` for config ``cfg`` (module
    doc); returns the content of ``hf_import.json``."""
    from ..checkpoint import Checkpointer
    from ..loop import StdHooks
    from ..parallel.groups import build_groups
    from ..trainer import Trainer
    d = HFDirectory(hf_dir)
    vocab = check_config(cfg, d)
    replaces = check_output(run_dir, overwrite, marker=IMPORTED, flag="--run-dir", what="import")
    out_cfg = run_config(cfg, run_dir)
    plan = weight_plan(out_cfg.model, d.model_type)
    ignored = check_names(plan, d.names(), d.model_type, out_cfg.model.tie_embeddings)  # before any allocation
    tmp = f"{run_dir.rstrip(os.sep)}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        torch.manual_seed(out_cfg.train.seed)
        trainer = Trainer(out_cfg, build_groups(1, 1, 1), torch.device("cpu"), vocab_size=vocab)
        _fill(trainer, d, vocab, plan)
        # what Checkpointer.save reads of a training loop: the project's own save, nothing by hand
        Checkpointer(tmp).save(SimpleNamespace(trainer=trainer, hooks=StdHooks(), iterators={}))
        save_config(out_cfg, os.path.join(tmp, "config.yaml"))
        record_launch_dir(tmp)  # its relative paths (data.tokenizer): from here, as a run's (dept_mega.run_paths)
        n = sum(math.prod(d.shape(s)) for piece in plan for s in piece.sources)  # the model's, without padding
        info = {"hf_dir": os.path.abspath(hf_dir), "model_type": d.model_type, "weights": describe_weights(d),
                "ignored_tensors": ignored, "tokenizer_files": tokenizer_files(hf_dir),
                "data.tokenizer": cfg.data.tokenizer, "vocab_size": vocab, "parameters": int(n),
                "checkpoint": "checkpoints/step_0"}
        with open(os.path.join(tmp, IMPORTED), "w", encoding="utf-8") as f:
            json.dump(info, f, indent=1)
        d.close()
        replace_dir(tmp, run_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    note = _tokenizer_note(cfg, d)
    if note:
        log(note)
    log(f"imported {hf_dir} ({d.model_type}, {info['parameters']:,} parameters, vocabulary {vocab}) to {run_dir}" + (" (replacing the earlier import there)" if replaces else "")
        + f"; start runs from it with train.init_from: {run_dir}")
    return info


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/convert_from_hf.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf-dir", required=True, help="a local Hugging Face model directory (config.json + weights)")
    ap.add_argument("--config", help="the YAML config of the runs that will start from the weights")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.norm_eps=1e-6")
    ap.add_argument("--run-dir", help="the run directory to write (start runs from it with train.init_from)")
    ap.add_argument("--print-model-config", action="store_true",
                    help="print the model: section that expresses the Hugging Face model, and exit")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace an earlier import at --run-dir (a directory that is not one is always refused)")
    args = ap.parse_args(argv)
    if not args.print_model_config and (args.config is None or args.run_dir is None):
        ap.error("--config and --run-dir are required (or --print-model-config)")
    from ..data.tokenizer import TokenizerError
    from ..manifest import CheckpointError
    try:
        if args.print_model_config:
            print(model_section(HFDirectory(args.hf_dir)), end="")
            return 0
        import_hf(args.hf_dir, load_config(args.config, args.overrides), args.run_dir, args.overwrite)
    except ImportError as exc:
        print(f"error: importing needs transformers and safetensors (pip install -e '.[hf]'): {exc}", file=sys.stderr)
        return 2
    except (HFDirError, HFImportError, ExportError, ConfigError, TokenizerError, CheckpointError,
            FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
