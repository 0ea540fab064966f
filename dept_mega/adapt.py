"""Plasticity and continued pre-training: a trained body with fresh embeddings for a new source.

    torchrun --standalone --nproc-per-node N -m dept_mega.adapt --run-dir RUN \\
        --source-config NEW.yaml --steps S --out DIR [--step K] [--group G] \\
        [--body frozen|trainable] [--body-lr LR] [--no-random-baseline]

Takes the body (``body.*``) of RUN's checkpoint (``--step``, default: the newest verified
one), attaches **fresh** embeddings for the source(s) of ``NEW.yaml`` (seeded like any
source's; its own tokenizer allowed), trains S steps on that data alone — with the body
frozen (the paper's plasticity measure: how well a fixed body serves new data through a new
embedding) or trainable with its own learning rate (continued pre-training: how a SPEC /
SPEC-OPT body gets a usable embedding for new data) — and evaluates validation BPB. The same
procedure from a randomly initialised body (the model's own init, same seed) is the
reference; the gain is ``(BPB_random − BPB_trained) / BPB_random``.

``NEW.yaml`` is a partial config merged over ``RUN/config.yaml``: ``data`` (its ``sources``
replace the run's; a source's ``tokenizer`` becomes the vocabulary of the new embeddings,
otherwise ``data.tokenizer``), and optionally ``optim`` and ``train`` (batch sizes,
``eval_interval``, ``eval_iters``, ``log_interval``, ``seed``, ``device``). The model is the run's;
the layout is the run's tensor / pipeline split with every other process a data-parallel
replica (one source group, no DEPT rounds). The run's relative paths are read from the
directory it was launched from (dept_mega.run_paths), ``NEW.yaml``'s from the current one.

Writes ``DIR/trained/`` and ``DIR/random/`` (each a run directory: ``config.yaml``,
``launch_dir.json``, ``metrics.jsonl``; ``trained`` also its checkpoint, which
``tools/convert_to_hf.py`` exports) and ``DIR/adapt.json``: the settings, the final evaluation of both, and the gain per source
and on average.
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import sys
from typing import Any, Optional, Sequence

import torch.distributed as dist
import yaml

from .config import Config, ConfigError, config_from_dict, save_config
from .metrics import write_json_atomic
from .run_paths import record_launch_dir, run_config_tree

# what NEW.yaml may set (anything else belongs to the trained run)
ALLOWED_SECTIONS = {"data", "optim", "train"}
ALLOWED_TRAIN_KEYS = {"micro_batch_size", "global_batch_size", "seed", "log_interval", "eval_interval",
                      "eval_iters", "eval_samples", "save_interval", "init_timeout_s", "device"}


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m dept_mega.adapt", description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir", required=True, help="the trained run (its config.yaml and checkpoints)")
    ap.add_argument("--source-config", required=True, help="partial YAML config naming the new source(s)")
    ap.add_argument("--steps", type=int, required=True, help="inner steps of adaptation")
    ap.add_argument("--out", required=True, help="output directory (trained/, random/, adapt.json)")
    ap.add_argument("--step", type=int, default=None, help="checkpoint step of RUN (default: newest verified)")
    ap.add_argument("--group", type=int, default=None,
                    help="source group whose body to take (needed only for a step inside a round)")
    ap.add_argument("--body", choices=("frozen", "trainable"), default="frozen")
    ap.add_argument("--body-lr", type=float, default=None,
                    help="peak learning rate of a trainable body (default: optim.lr; the schedule's shape is "
                         "the embeddings')")
    ap.add_argument("--no-random-baseline", action="store_true",
                    help="skip the same procedure from a randomly initialised body")
    return ap.parse_args(argv)


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "sources":
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def check_source_paths(new: Any, new_path: str) -> None:
    """The files NEW.yaml names exist (read from the current directory when relative): each
    source's data and tokenizer, and a global tokenizer. Checked before :func:`adapt_config`
    makes a source's tokenizer ``data.tokenizer``, so that a missing one is named by its key in
    NEW.yaml, not by the merged config's."""
    data = new.get("data") if isinstance(new, dict) else None
    if not isinstance(data, dict):
        return  # adapt_config says what is missing

    def missing(key: str, path: str) -> ConfigError:
        where = "" if os.path.isabs(path) else f" (relative to the current directory {os.getcwd()})"
        return ConfigError(f"config key '{key}' in {new_path}: file {path!r} does not exist{where}")

    if isinstance(data.get("tokenizer"), str) and not os.path.exists(data["tokenizer"]):
        raise missing("data.tokenizer", data["tokenizer"])
    for i, s in enumerate(data.get("sources") or []):
        if not isinstance(s, dict):
            continue
        if isinstance(s.get("prefix"), str):
            for ext in (".bin", ".idx"):
                if not os.path.exists(s["prefix"] + ext):
                    raise missing(f"data.sources[{i}].prefix", s["prefix"] + ext)
        if isinstance(s.get("tokenizer"), str) and not os.path.exists(s["tokenizer"]):
            raise missing(f"data.sources[{i}].tokenizer", s["tokenizer"])


def adapt_config(run_cfg: dict, new: dict, new_path: str, steps: int, run_dir: str, world: int) -> Config:
    """The config of one adaptation run (see the module doc)."""
    if not isinstance(new, dict):
        raise ConfigError(f"{new_path}: top level must be a mapping")
    bad = sorted(set(new) - ALLOWED_SECTIONS)
    if bad:
        raise ConfigError(f"config key '{bad[0]}' in {new_path}: adaptation keeps the trained run's model and "
                          f"layout; only {sorted(ALLOWED_SECTIONS)} may be set")
    for k in (new.get("train") or {}):
        if k not in ALLOWED_TRAIN_KEYS:
            raise ConfigError(f"config key 'train.{k}' in {new_path}: set by dept_mega.adapt or not allowed "
                              f"(allowed: {sorted(ALLOWED_TRAIN_KEYS)})")
    data = new.get("data") or {}
    if not data.get("sources"):
        raise ConfigError(f"config key 'data.sources' in {new_path}: name at least one new source")
    merged = _merge(run_cfg, new)
    new_train = new.get("train") or {}
    if "eval_iters" in new_train and "eval_samples" not in new_train:
        # the run's eval_samples (the study tool sets it) would override the eval_iters asked for
        merged.setdefault("train", {})["eval_samples"] = None
    # the vocabulary of the fresh embeddings: the new source's own tokenizer, else data.tokenizer
    own = {s.get("tokenizer") for s in data["sources"] if isinstance(s, dict)}
    if len(own) == 1 and None not in own:
        merged["data"]["tokenizer"] = own.pop()
    elif len(own) > 1:
        raise ConfigError(f"config key 'data.sources' in {new_path}: the new sources name different tokenizers "
                          f"{sorted(str(t) for t in own)}; adapt one vocabulary at a time")
    if merged["data"].get("tokenizer"):
        merged["model"]["vocab_size"] = None
    # one source group, no rounds: the run's DEPT keys (embedding_rows, body_optimizer_state,
    # the outer sync's) describe training that does not happen here, and some refuse std
    merged["dept"] = {"variant": "std"}
    # a federated group job's run: the adaptation is a job of its own, not one of the group jobs
    merged.pop("federation", None)
    p = merged["parallel"]
    per_replica = int(p.get("tensor", 1)) * int(p.get("pipeline", 1))
    if world % per_replica:
        raise ConfigError(f"config key 'parallel': the run's tensor × pipeline = {per_replica} does not divide "
                          f"the {world} processes of this launch")
    p["data"] = world // per_replica
    merged["train"]["steps"] = steps
    merged["train"]["run_dir"] = run_dir
    gbs = merged["train"]["global_batch_size"]
    mbs = merged["train"]["micro_batch_size"]
    if gbs % (mbs * p["data"]):
        # keep the run's sequences per step when the data-parallel size allows, else say so
        raise ConfigError(f"config key 'train.global_batch_size': {gbs} is not divisible by micro_batch_size × "
                          f"data-parallel processes = {mbs} × {p['data']}; set train.global_batch_size in "
                          f"{new_path}")
    return config_from_dict(merged)


def _mean(values: list[float]) -> float:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return sum(vals) / len(vals) if vals and len(vals) == len(values) else float("nan")


def run_arm(cfg: Config, *, body_from: Optional[tuple[str, int, Optional[int]]], frozen: bool,
            body_lr: Optional[float], save: bool, variant: str = "") -> dict[str, Any]:
    """Train one arm (the body loaded from ``(run_dir, step, group)``, or the model's random
    init when None) and return its final evaluation {source: {loss, ppl, bpb, tokens, bytes}}.
    ``variant``: the trained run's dept.variant (the log's label)."""
    from .checkpoint import load_body
    from .train import build_session, describe
    said = []

    def prepare(stages, pg, device):
        if body_from is not None:
            run_dir, step, group = body_from
            group = load_body(stages, cfg, pg, run_dir, step, group, device)
            said.append(f"adapt: body of {run_dir} step {step} (group {group})")
        else:
            said.append("adapt: randomly initialised body (the reference)")
        if frozen:
            for st in stages:
                for p in st.body.parameters():
                    p.requires_grad_(False)  # no gradient, no optimizer state, no update
        said.append(f"adapt: body {'frozen' if frozen else 'trainable'}"
                    + (f", body LR {body_lr:g}" if body_lr is not None and not frozen else ""))

    session = build_session(cfg, prepare_stages=prepare)
    tr, loop = session.trainer, session.loop
    if body_lr is not None and not frozen:
        tr.body_lr_scale = body_lr / cfg.optim.lr
    if not save:
        loop.checkpointer = None
    if session.rank == 0:
        os.makedirs(cfg.train.run_dir, exist_ok=True)
        save_config(cfg, os.path.join(cfg.train.run_dir, "config.yaml"))
        record_launch_dir(cfg.train.run_dir)  # NEW.yaml's relative paths: from here
    for line in said:
        session.writer.log(line)
    names = ", ".join(s.name for s in cfg.data.sources)
    label = (f"dept_mega adapt: new source{'s' if len(cfg.data.sources) > 1 else ''} {names} on "
             + (f"the body of {body_from[0]} ({variant})" if body_from is not None
                else "a randomly initialised body (the reference)"))
    session.writer.log(describe(session, label))
    try:
        loop.run()
    finally:
        session.writer.close()
    return loop.eval_history[-1]["by_source"] if loop.eval_history else {}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    from .checkpoint import CheckpointError
    from .parallel.agree import mark_agreed
    from .resume import select_checkpoint
    from .run_inputs import input_errors
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    paths = None
    try:
        if args.steps < 1:
            raise ConfigError(f"--steps must be >= 1, got {args.steps}")
        if args.body_lr is not None and args.body == "frozen":
            raise ConfigError("--body-lr needs --body trainable")
        run_cfg, paths = run_config_tree(args.run_dir)
        try:
            with open(args.source_config, encoding="utf-8") as f:
                new = yaml.safe_load(f) or {}
        except FileNotFoundError:
            raise ConfigError(f"--source-config {args.source_config!r} does not exist") from None
        check_source_paths(new, args.source_config)
        note = paths.note()
        if note is not None and rank == 0:
            print(note, flush=True)
        if os.path.exists(args.out) and os.listdir(args.out):
            raise ConfigError(f"--out {args.out!r} exists and is not empty; choose a new directory")
        arms = [("trained", True)] + ([] if args.no_random_baseline else [("random", False)])
        cfgs = {name: adapt_config(run_cfg, new, args.source_config, args.steps, os.path.join(args.out, name),
                                   world) for name, _ in arms}
        from .parallel.groups import init_distributed
        _, _, device = init_distributed(timeout_s=cfgs["trained"].train.init_timeout_s,
                                        device=cfgs["trained"].train.device)
        sel = select_checkpoint(args.run_dir, device, args.step)
        if sel.step is None:  # (rank 0's view of the directory decided: the same on every rank)
            raise mark_agreed(CheckpointError(f"{args.run_dir} has no checkpoint to take a body from"))
        if rank == 0:
            for note in sel.notes:
                print(f"warning: {note}", file=sys.stderr)
        results = {}
        for name, trained in arms:
            results[name] = run_arm(cfgs[name], body_from=(args.run_dir, sel.step, args.group) if trained else None,
                                    frozen=args.body == "frozen", body_lr=args.body_lr, save=trained,
                                    variant=str((run_cfg.get("dept") or {}).get("variant", "spec_opt")))
    except (*input_errors(), FileNotFoundError) as exc:
        from .parallel.agree import is_agreed
        from .process_exit import report_error
        report_error(str(exc) + (paths.hint(str(exc)) if paths is not None else ""),
                     agreed=is_agreed(exc))  # before the process group: rank 0's line
        return 2
    if rank == 0:
        report = {"run_dir": args.run_dir, "step": sel.step, "group": args.group,
                  "source_config": args.source_config, "steps": args.steps, "body": args.body,
                  "body_lr": args.body_lr, "sources": [s.name for s in cfgs["trained"].data.sources],
                  "trained": results["trained"], "random": results.get("random")}
        tb = _mean([v["bpb"] for v in results["trained"].values()])
        report["bpb"] = tb
        if "random" in results:
            rb = _mean([v["bpb"] for v in results["random"].values()])
            report["random_bpb"] = rb
            report["gain_pct"] = (rb - tb) / rb * 100.0 if math.isfinite(rb) and rb else None
        write_json_atomic(os.path.join(args.out, "adapt.json"), report)
        line = f"adapt: {args.body} body, {args.steps} steps: validation BPB {tb:.4f}"
        if report.get("random_bpb") is not None:
            line += f" (random body {report['random_bpb']:.4f}, gain {report['gain_pct']:+.1f} %)"
        print(line, flush=True)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from dept_mega.process_exit import exit_after
    exit_after(main)
