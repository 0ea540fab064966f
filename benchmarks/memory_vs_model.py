#!/usr/bin/env python3
"""Measured peak memory of a benchmark run against the memory model's prediction (the target:
within 5%).

    python benchmarks/memory_vs_model.py --bench BENCH.json --costs COSTS.json --variant NAME --out MEM.json

BENCH.json: a ``kind: "bench"`` record of tools/benchmark.py (``peak_mem_gb``: peak allocated over
the timed steps, GB = 1e9 bytes). COSTS.json: ``tools/dept_costs.py --memory --json`` for the same
config and overrides, ``{"variants": {NAME: {"memory": {"weights", "grads", "optimizer", "outer",
"trim_table", "activations_per_microbatch", "ce_transient", "total"}}}}`` in bytes per rank. The
benchmark runs the trainer alone (no DEPT round hooks), so the prediction it is compared with is
the trainer's share: weights + grads + optimizer + activations of the micro-batches in flight (one
for a single pipeline stage; ``--in-flight`` otherwise) + the cross entropy's transient + with native
FP8 its weight copies and scaling state. Writes MEM.json with both and the error.
"""
from __future__ import annotations

import argparse
import json
import sys


def compare(bench: dict, costs: dict, variant: str, in_flight: int = 1) -> dict:
    try:
        mem = costs["variants"][variant]["memory"]
    except (KeyError, TypeError):
        raise ValueError(f"costs JSON has no variants.{variant}.memory (keys: {sorted(costs.get('variants', {}))})")
    need = ("weights", "grads", "optimizer", "activations_per_microbatch")
    missing = [k for k in need if k not in mem]
    if missing:
        raise ValueError(f"costs JSON variants.{variant}.memory misses {missing}")
    predicted = (mem["weights"] + mem["grads"] + mem["optimizer"]
                 + in_flight * mem["activations_per_microbatch"] + mem.get("ce_transient", 0)
                 + mem.get("fp8_weight_copies", 0) + mem.get("fp8_scaling", 0)) / 1e9
    measured = bench.get("peak_mem_gb")
    out = {"variant": variant, "in_flight": in_flight, "model_bytes": mem,
           "comparison": {"trainer": {"predicted_gb": predicted, "measured_gb": measured,
                                      "error_pct": None if not measured else 100 * (predicted - measured) / measured}},
           "note": "trainer only (weights + grads + optimizer + activations in flight + cross-entropy transient "
                   "+ FP8 weight copies and scaling state) vs peak allocated"}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", required=True)
    ap.add_argument("--costs", required=True)
    ap.add_argument("--variant", required=True)
    ap.add_argument("--in-flight", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    with open(args.bench, encoding="utf-8") as f:
        bench = json.load(f)
    with open(args.costs, encoding="utf-8") as f:
        costs = json.load(f)
    try:
        res = compare(bench, costs, args.variant, args.in_flight)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(res, f, indent=1)
    c = res["comparison"]["trainer"]
    print(f"memory: predicted {c['predicted_gb']:.2f} GB, measured {c['measured_gb']} GB, "
          f"error {c['error_pct'] if c['error_pct'] is None else round(c['error_pct'], 2)}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
