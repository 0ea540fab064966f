#!/usr/bin/env python3
"""Summarise what benchmarks/h100_suite.sh left in its output folder as Markdown (printed and
written to OUT/summary.md): environment, pytest -m gpu result, the 1B benchmark rows
(tokens/s, TFLOP/s, MFU, peak memory against the targets of issue 12), the comparison with
megatron-core and the memory model against the measured peak.

    python benchmarks/suite_summary.py OUT
"""
from __future__ import annotations

import json
import os
import re
import sys


def _load(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _fmt(x, spec: str = ",.0f", none: str = "n/a") -> str:
    return none if x is None else format(x, spec)


def summary(out: str) -> str:
    lines = ["# GPU suite summary", ""]
    env = _load(os.path.join(out, "env.json"))
    if env:
        lines.append(f"- device: {env.get('device_name')} | torch {env.get('torch')} | CUDA {env.get('cuda')} | "
                     f"date {env.get('date')} | ops backend {env.get('ops_backend')}")
    log = os.path.join(out, "suite.log")
    if os.path.exists(log):
        text = open(log, encoding="utf-8", errors="replace").read()
        results = re.findall(r"^=+ (.*(?:passed|failed|error|skipped).*) =+$", text, flags=re.M)
        if results:
            lines.append(f"- pytest -m gpu: {results[-1]}")
        for stage, rc in re.findall(r"^### stage (\w+) finished: rc=(\d+)", text, flags=re.M):
            if rc != "0":
                lines.append(f"- stage {stage} failed (rc={rc}); see suite.log")
    bench = os.path.join(out, "bench.jsonl")
    if os.path.exists(bench):
        rows = [json.loads(line) for line in open(bench, encoding="utf-8") if line.strip()]
        lines += ["", "| run | tokens/s | TFLOP/s/device | MFU | peak GB | step ms |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        base = None
        for r in rows:
            if "error" in r:
                lines.append(f"| {r['name']} | failed: {r['error']} | | | | |")
                continue
            if r["name"] == "bf16":
                base = r["tokens_per_s"]
            mfu = "n/a" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%"
            lines.append(f"| {r['name']} | {_fmt(r['tokens_per_s'])} | {_fmt(r.get('tflops_per_device'), '.1f')} | "
                         f"{mfu} | {_fmt(r.get('peak_mem_gb'), '.1f')} | {_fmt(r.get('step_ms'), '.0f')} |")
        fp8 = next((r for r in rows if r.get("name") == "fp8" and "error" not in r), None)
        bf = next((r for r in rows if r.get("name") == "bf16" and "error" not in r), None)
        if bf is not None and bf.get("mfu") is not None:
            lines.append(f"- target bf16 MFU >= 50%: {100 * bf['mfu']:.1f}% "
                         f"({'met' if bf['mfu'] >= 0.5 else 'NOT met'})")
        if fp8 is not None and base:
            ratio = fp8["tokens_per_s"] / base
            lines.append(f"- target FP8 >= 1.3x bf16 tokens/s: {ratio:.2f}x ({'met' if ratio >= 1.3 else 'NOT met'})")
    mem = _load(os.path.join(out, "memory.json"))
    if mem:
        lines.append(f"- memory model: {mem.get('note', '')}")
        for k, v in mem.get("comparison", {}).items():
            lines.append(f"  - {k}: predicted {_fmt(v.get('predicted_gb'), '.2f')} GB, measured "
                         f"{_fmt(v.get('measured_gb'), '.2f')} GB, "
                         f"error {_fmt(v.get('error_pct'), '+.1f')}% (target within 5%)")
    vs = _load(os.path.join(out, "vs_megatron.json"))
    if vs:
        o, m = vs.get("ours", {}), vs.get("megatron", {})
        lines.append(f"- vs megatron-core {vs.get('megatron_core_version')}: ours {_fmt(o.get('tokens_per_s'))} "
                     f"tokens/s, megatron {_fmt(m.get('tokens_per_s'))} tokens/s, ratio "
                     f"{_fmt(vs.get('ratio'), '.3f')} (goal >= 1.0; positions ours {vs.get('ours_position')}, "
                     f"megatron {vs.get('megatron_position')})")
    kern = os.path.join(out, "kernels.txt")
    if os.path.exists(kern):
        head = open(kern, encoding="utf-8").read().splitlines()[:12]
        lines += ["", "Kernel breakdown (first lines of kernels.txt):", ""] + head
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python benchmarks/suite_summary.py OUT", file=sys.stderr)
        return 2
    text = summary(argv[0])
    with open(os.path.join(argv[0], "summary.md"), "w", encoding="utf-8") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
