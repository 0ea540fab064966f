#!/usr/bin/env python
"""Parameters, memory and per-step communication of every DEPT variant (paper Table 1).

    python tools/dept_costs.py --config CFG.yaml [key=value ...] \
        [--global-vocab N] [--source-vocab N] [--trim-vocab N] \
        [--groups G --comm-dtype fp32|bf16|fp8|int8|int4] [--memory [--outer-state full|lean] [--set KEY=VALUE ...]]
        [--json]

Vocabulary sizes come from the command line when given, else from the config's tokenizers
(``data.tokenizer``; ``data.sources[i].tokenizer`` for SPEC-OPT), else ``model.vocab_size``.
A size the config cannot give is assumed, and a note says so: SPEC-OPT's vocabulary is the
global one for a config of one tokenizer; the global one is the largest source vocabulary for
a spec_opt config (``vocab.notes`` in the JSON).
``--trim-vocab`` is TRIM's mean |V_k|; without it (and without the sources' data files) TRIM
is shown untrimmed, with a note. ``--groups G`` adds the predicted bytes of one round's outer synchronisation
per variant (``outer_round_bytes``), summed over ranks as dept_mega/parallel/comm.py counts, and
the bytes that cross groups after each inner step of a round (``outer_step_bytes``; with
``dept.outer_fragments`` they are spread over the round) with their peak (``peak_step_bytes``);
every ``dept.outer_*`` key of the config (or given as an override) counts.
Each variant's ``inner_step_bytes`` = {dp, tp, pp}: one inner training step of one group, summed
over its ranks (dept_mega/dept/step_bytes.py: gradient reduction, tensor-parallel activations,
pipeline sends; TRIM and SPEC-OPT with their mean vocabulary). With ``--groups`` also
``inner_round_bytes`` (``dept.local_steps`` steps of every group; TRIM's and SPEC-OPT's groups each
with their own |V_k| when there is one size per group) and ``record_bytes`` = {dp, tp, pp} of a
round record: the inner steps plus the outer synchronisation's share (``outer_round_bytes``).
All ``*_params`` figures use the true vocabulary; ``padded_*`` the model's 128-padded table.
Each variant's ``flops_per_token`` (training FLOPs per token, docs/metrics.md: what the log's
``tflops_per_device`` counts, with the variant's vocabulary) and ``flops_per_group_step`` (times
``train.global_batch_size`` × ``model.seq_length``).
``--memory`` adds each variant's bytes per rank (the largest rank; dept_mega/dept/memory.py):
``memory`` = {weights, grads, optimizer, outer, trim_table, activations_per_microbatch, ce_transient,
fp8_weight_copies, fp8_scaling, total} (the FP8 terms: native FP8, ``fp8`` with ``backend: local``;
its activations are counted at their FP8 size).
``--outer-state`` picks FlatSync's θ_prev layout (default: what dept/outer.py does);
``--set KEY=VALUE`` changes the config after validation, without checking it (what-if
predictions of a combination the config checks refuse); an override after the config
(``KEY=VALUE``) is checked as the trainer checks it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dept_mega.config import ConfigError, load_config  # noqa: E402
from dept_mega.metrics import train_flops_per_token  # noqa: E402
from dept_mega.dept.costs import (MEMORY_KEYS, VARIANTS, predict_costs, predict_memory,  # noqa: E402
                                  predict_outer_sync, resolve_vocabs)
from dept_mega.dept.cost_vocabs import MissingTokenizer, with_defaults  # noqa: E402
from dept_mega.dept.step_bytes import predict_inner_round_bytes, predict_inner_step_bytes  # noqa: E402
from dept_mega.variant import variant_of  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="YAML config (its model and dept sections are used)")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. model.num_layers=12")
    ap.add_argument("--global-vocab", type=int, default=None, help="global tokenizer's vocabulary size")
    ap.add_argument("--source-vocab", type=int, default=None, help="SPEC-OPT per-source vocabulary size")
    ap.add_argument("--trim-vocab", type=int, default=None, help="TRIM mean per-source |V_k|")
    ap.add_argument("--groups", type=int, default=None,
                    help="G source groups: also predict the bytes of one outer round")
    ap.add_argument("--comm-dtype", choices=("fp32", "bf16", "fp8", "int8", "int4"), default=None,
                    help="outer communication dtype (default: the config's dept.outer_comm_dtype)")
    ap.add_argument("--memory", action="store_true", help="also predict the bytes per rank of every variant")
    ap.add_argument("--outer-state", choices=("full", "lean"), default=None,
                    help="FlatSync's theta_prev: the rank's 1/D chunk (lean, what the trainer keeps: the "
                         "default) or, for comparison, full on every dp rank")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="change a config key after validation, unchecked (what-if memory predictions)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return ap.parse_args(argv)


def compute(args: argparse.Namespace) -> dict:
    cfg = unchecked(load_config(args.config, args.overrides), args.set)
    # sizes the config cannot give (SPEC-OPT's for a one-tokenizer config, the global one for a
    # spec_opt config) are assumed, with a note, so the table of every variant prints
    try:
        found = resolve_vocabs(cfg, args.global_vocab, args.source_vocab, args.trim_vocab)
    except MissingTokenizer as exc:
        option = "--global-vocab" if exc.key == "data.tokenizer" else "--source-vocab"
        raise ConfigError(f"{exc}; or pass the size as {option} N") from None
    vocabs = with_defaults(found, cfg)
    variants = predict_costs(cfg, vocabs.global_vocab, vocabs.source_vocabs or None, vocabs.trim_vocabs or None)
    tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_length  # one group's inner step
    for name, c in variants.items():
        # what the run's tflops_per_device counts (dept_mega/metrics.py), with the variant's vocabulary
        c["flops_per_token"] = train_flops_per_token(cfg.model, c["vocab"])
        c["flops_per_group_step"] = c["flops_per_token"] * tokens_per_step
        # one group's inner step (dept_mega/dept/step_bytes.py), with the variant's (mean) vocabulary
        c["inner_step_bytes"] = predict_inner_step_bytes(_variant(cfg, name), round(c["vocab"]))
    if args.groups is not None:
        if args.groups < 1:
            raise ConfigError(f"--groups must be >= 1, got {args.groups}")
        # TRIM's rows per group: the sources' own |V_k| when there is one per group (K = G),
        # else the mean for every group; unknown -> untrimmed, as in the table.
        sizes = list(vocabs.trim_vocabs.values())
        if len(sizes) == args.groups:
            trim = sizes
        elif sizes:
            trim = [round(sum(sizes) / len(sizes))] * args.groups
        else:
            trim = [vocabs.global_vocab] * args.groups
        # SPEC-OPT's table per group: its source's vocabulary when there is one source per group
        src = list(vocabs.source_vocabs.values())
        per_group = {"trim": trim, "spec_opt": src if len(src) == args.groups else
                     [round(variants["spec_opt"]["vocab"])] * args.groups}
        for name in VARIANTS:
            one = _variant(cfg, name)
            dtype = args.comm_dtype or cfg.dept.outer_comm_dtype
            groups = args.groups if variant_of(name).rounds else 1
            pred = predict_outer_sync(one, groups, dtype, vocabs.global_vocab, trim)
            variants[name]["outer_round_bytes"] = pred["round"]
            variants[name]["outer_step_bytes"] = pred["outer_per_step"]
            variants[name]["peak_step_bytes"] = pred["peak_step_bytes"]
            inner = predict_inner_round_bytes(one, per_group.get(name, [vocabs.global_vocab] * groups))
            variants[name]["inner_round_bytes"] = inner
            # a round record's dp / tp / pp: the inner steps plus what the outer sync adds
            variants[name]["record_bytes"] = {k: inner[k] + pred["round"].get(k, 0) for k in inner}
    if args.memory:
        lean = None if args.outer_state is None else args.outer_state == "lean"
        for name in VARIANTS:
            one = dataclasses.replace(cfg, dept=dataclasses.replace(cfg.dept, variant=name))
            mem = predict_memory(one, vocabs.global_vocab, list(vocabs.source_vocabs.values()),
                                 list(vocabs.trim_vocabs.values()), lean)
            variants[name]["memory"] = {k: int(mem[k]) for k in MEMORY_KEYS}
            variants[name]["in_flight_microbatches"] = mem["in_flight_microbatches"]
    m = cfg.model
    notes = memory_notes(cfg) if args.memory else []
    return {
        "model": {"num_layers": m.num_layers, "hidden_size": m.hidden_size,
                  "num_attention_heads": m.num_attention_heads, "num_query_groups": m.query_groups,
                  "ffn_hidden_size": m.ffn_size, "activation": m.activation,
                  "normalization": m.normalization, "position_embedding": m.position_embedding,
                  "seq_length": m.seq_length, "tie_embeddings": m.tie_embeddings, "bias": m.bias},
        "local_steps": cfg.dept.local_steps,
        "vocab": {"global": vocabs.global_vocab, "source_mean": vocabs.mean_source_vocab,
                  "trim_mean": vocabs.mean_trim_vocab, "origin": vocabs.origin, "notes": vocabs.notes},
        "variants": variants,
        **({"memory_notes": notes} if notes else {}),
    }


def _variant(cfg, name: str):
    return dataclasses.replace(cfg, dept=dataclasses.replace(cfg.dept, variant=name))


def memory_notes(cfg) -> list[str]:
    """What the memory model leaves out for this config and the prediction does not show."""
    notes = []
    p = cfg.parallel
    if cfg.backend == "auto" and p.sequence_parallel and p.tensor > 1:
        # memory.py counts Transformer Engine's gathered QKV / fc1 inputs for backend transformer_engine only
        notes.append("backend auto uses Transformer Engine where it is installed on a CUDA device; with sequence "
                     "parallelism its QKV and fc1 layers keep their whole gathered input, which the prediction "
                     "counts only with backend transformer_engine (here: the local layers' input shards)")
    return notes + _fp8_notes(cfg)


def _fp8_notes(cfg) -> list[str]:
    if not cfg.fp8:
        return []
    # native FP8 (backend local) is counted: fp8_weight_copies, fp8_scaling and the activations
    # at their FP8 size (dept_mega/dept/memory_fp8.py); Transformer Engine's FP8 is not
    if cfg.backend == "transformer_engine":
        return [f"fp8={cfg.fp8} with backend transformer_engine: Transformer Engine's FP8 is not in the memory "
                "model; the prediction is that of the same run without FP8"]
    if cfg.backend == "auto":
        return ["backend auto uses Transformer Engine's FP8 where it is installed on a CUDA device, which the "
                "memory model does not count: the prediction is that of the native FP8 GEMMs (backend local)"]
    return []


def unchecked(cfg, assignments: list[str]):
    """``cfg`` with dotted ``KEY=VALUE`` (YAML values) set without validation; an unknown key
    is a ConfigError naming it."""
    import yaml

    for item in assignments:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE")
        parts = key.split(".")

        def put(obj, path):
            if not dataclasses.is_dataclass(obj) or not hasattr(obj, path[0]):
                raise ConfigError(f"--set: unknown config key {key!r}")
            if len(path) == 1:
                return dataclasses.replace(obj, **{path[0]: yaml.safe_load(raw)})
            return dataclasses.replace(obj, **{path[0]: put(getattr(obj, path[0]), path[1:])})

        cfg = put(cfg, parts)
    return cfg


def _fmt(x: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3f}{unit}"
    return f"{x:.1f}" if not float(x).is_integer() else str(int(x))


def _fmt_bytes(x: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3f} {unit}"
    return f"{int(x)} B"


def _vocab(x) -> str:
    """A vocabulary size, or a mean of several: 2000, 2667.7 (not 2000.0, 2667.6666666666665)."""
    if x is None:
        return "unknown"
    return f"{int(x)}" if float(x).is_integer() else f"{x:.1f}"


def table(result: dict) -> str:
    v = result["vocab"]
    lines = [f"global vocab {_vocab(v['global'])}, SPEC-OPT vocab {_vocab(v['source_mean'])}, TRIM mean |V_k| "
             f"{_vocab(v['trim_mean'])}; "
             f"N_local {result['local_steps']}",
             f"{'variant':9} {'vocab':>9} {'embedding':>11} {'total':>11} {'per step':>11} {'per round':>11}",
             "-" * 68]
    notes = [f"  {n}" for n in v.get("notes", [])]
    for name, c in result["variants"].items():
        lines.append(f"{name:9} {_fmt(c['vocab']):>9} {_fmt(c['embedding_params']):>11} "
                     f"{_fmt(c['total_params']):>11} {_fmt(c['per_step_comm_params']):>11} "
                     f"{_fmt(c['per_round_comm_params']):>11}")
        if c.get("note"):
            notes.append(f"  {name}: {c['note']}")
    lines.append("params with the true vocabulary; per step/round = parameters crossing groups (Table 1)")
    lines.append("training FLOPs per token / per inner step of one group (docs/metrics.md's formula, what "
                 "the log's TFLOP/s counts):")
    lines += [f"  {name:9} {c['flops_per_token'] / 1e9:.3f} GFLOP / {c['flops_per_group_step'] / 1e15:.3f} PFLOP"
              for name, c in result["variants"].items()]
    lines.append("predicted bytes of one inner step of one group, summed over its ranks (dp: gradient "
                 "reduction; tp: activations; pp: pipeline sends):")
    lines += [f"  {name:9} " + ", ".join(f"{k} {_fmt_bytes(x)}" for k, x in c["inner_step_bytes"].items())
              for name, c in result["variants"].items()]
    if any("outer_round_bytes" in c for c in result["variants"].values()):
        lines.append("predicted bytes of one round's outer synchronisation, summed over ranks "
                     "(dp, tp: what it adds inside the groups; inner steps not included):")
        for name, c in result["variants"].items():
            b = c["outer_round_bytes"]
            lines.append(f"  {name:9} " + ", ".join(f"{k} {_fmt_bytes(x)}" for k, x in b.items())
                         + f"; peak per inner step {_fmt_bytes(c['peak_step_bytes'])}")
        lines.append(f"a round record's dp / tp / pp (N_local {result['local_steps']} inner steps of every "
                     f"group + the outer synchronisation's share):")
        for name, c in result["variants"].items():
            lines.append(f"  {name:9} " + ", ".join(f"{k} {_fmt_bytes(x)}" for k, x in c["record_bytes"].items()))
    if any("memory" in c for c in result["variants"].values()):
        lines.append("predicted bytes per rank (the largest rank):")
        # the FP8 columns (native FP8 only) when any variant has them
        keys = [k for k in MEMORY_KEYS if not k.startswith("fp8_")
                or any(c["memory"][k] for c in result["variants"].values())]
        short = {"activations_per_microbatch": "act/micro", "fp8_weight_copies": "fp8 weights",
                 "fp8_scaling": "fp8 scaling"}
        lines.append(f"  {'variant':9} " + " ".join(f"{short.get(k, k)[:11]:>11}" for k in keys))
        for name, c in result["variants"].items():
            mem = c["memory"]
            lines.append(f"  {name:9} " + " ".join(f"{_fmt_bytes(mem[k]):>11}" for k in keys))
    notes += [f"  {n}" for n in result.get("memory_notes", [])]
    return "\n".join(lines + (["notes:"] + notes if notes else []))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = compute(args)
    except ConfigError as exc:
        print(f"dept_costs: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else table(result))
    return 0


if __name__ == "__main__":
    from dept_mega.process_exit import exit_after
    exit_after(main)
