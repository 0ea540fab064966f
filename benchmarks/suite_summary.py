#!/usr/bin/env python3
"""Summarise what benchmarks/gpu_check.sh has left in its output folder so far, as Markdown
(written to OUT/summary.md; rewritten after every stage): environment, each stage's status and
time, the pytest results, the custom ops against the copy bandwidth, the 1B benchmark rows
(tokens/s, TFLOP/s, MFU, peak memory against the targets of docs/performance.md; each run's tokens/s over
its base runs', :data:`RATIOS`; each run's backends line), the memory model against
the measured peak, the comparison with megatron-core, torchao's float8 against bf16 on a plain
GPT of the same shape (the ``vs_torchao`` row of bench.jsonl), the host's cost per FP8 linear
call by casts + GEMM combination (the ``fp8_host`` row) and the head of each kernel breakdown.

    python benchmarks/suite_summary.py OUT [--env ENV.json] [--budget S] [--elapsed S] [--dry-run]

A file that is missing or unreadable is left out (a call cut off at its limit still gets a summary
of what exists).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

# pytest's final line: "==== 3 passed, 1 skipped in 12.0s ====" (plain pytest) or
# "3 passed, 1 skipped in 12.0s" (pytest -q); "(0:01:02)" follows long runs
_OUTCOME = r"\d+ (?:passed|failed|errors?|skipped|deselected|xfailed|xpassed|warnings?|rerun)"
PYTEST_RESULT = re.compile(rf"^(?:=+ )?((?:{_OUTCOME}(?:, )?)+ in [\d.]+s(?: \([\d:]+\))?|no tests ran in [\d.]+s)"
                           r"(?: =+)?\s*$")
STAGE_START = re.compile(r"^### stage (\w+) \(expected (\d+)s")
# (", cut at its limit of N s (what it stopped)": the stage's deadline stopped a command or left one unstarted)
STAGE_END = re.compile(r"^### stage (\w+) finished: rc=(\d+) in (\d+) s(?:, (cut at its limit .*))?$")
STAGE_SKIP = re.compile(r"^### stage (\w+) skipped: (.*)$")
NOTE = re.compile(r"^### note: (.*)$")  # a line for the summary as it is (e.g. tests left out, and why)
OWN_SECTIONS = ("vs_torchao", "fp8_host", "fp8_cast_bench", "attention_bench")  # kinds of bench.jsonl rows with a section of their own


def _load(path: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _onoff(flag) -> str:
    return "n/a" if flag is None else "on" if flag else "off"


def _fmt(x, spec: str = ",.0f", none: str = "n/a") -> str:
    return none if x is None else format(x, spec)


def pytest_results(text: str) -> list[str]:
    """Every pytest result line of a log, in both forms (see :data:`PYTEST_RESULT`)."""
    return [m.group(1) for m in (PYTEST_RESULT.match(line) for line in text.splitlines()) if m]


def stages(text: str) -> list[dict]:
    """Each stage of the log in order: name, status (ok / failed rc=N / skipped: why / running —
    a stage cut off by the call's limit), seconds, and the pytest results printed inside it."""
    out: list[dict] = []
    cur = None
    for line in text.splitlines():
        m = STAGE_START.match(line)
        if m:
            cur = {"name": m.group(1), "status": "running (cut off?)", "seconds": None, "pytest": []}
            out.append(cur)
            continue
        m = STAGE_END.match(line)
        if m and cur is not None and cur["name"] == m.group(1):
            cur["status"] = "ok" if m.group(2) == "0" else f"failed rc={m.group(2)}"
            if m.group(4):
                cur["status"] += f", {m.group(4)}"
            cur["seconds"] = int(m.group(3))
            cur = None
            continue
        m = STAGE_SKIP.match(line)
        if m:
            out.append({"name": m.group(1), "status": f"skipped ({m.group(2)})", "seconds": None, "pytest": []})
            continue
        m = PYTEST_RESULT.match(line)
        if m and cur is not None:
            cur["pytest"].append(m.group(1))
    return out


def ops_lines(ops: dict) -> list[str]:
    """benchmarks/ops_bench.py's JSON as Markdown: the rows (a row timed one call at a time whose
    host dispatch is at least half its time is marked host-bound: it measures the per-call
    overhead, not the kernel), the remap's per-call overhead at the training size, and the issue's
    targets judged on the bandwidth rows."""
    info = ops.get("info", {})
    results = ops.get("results", [])
    lines = [f"## Custom ops ({info.get('device')}, backend {info.get('backend')})",
             "", "| op | dtype | ms | GB/s | % of copy | host ms |", "| --- | --- | ---: | ---: | ---: | ---: |"]
    for r in results:
        pct = r.get("% of copy")
        note = " (host-bound)" if r.get("host-bound") else " (device waited for the host)" if r.get("queued") is False \
            else ""
        lines.append(f"| {r.get('op')} | {r.get('dtype')} | {_fmt(r.get('ms'), '.3f')} | "
                     f"{_fmt(r.get('GB/s'), '.1f')} | {'' if pct is None else f'{pct:.0f}'} | "
                     f"{_fmt(r.get('host_ms'), '.3f', '')}{note} |")
    overhead = ops.get("overhead") or []
    if overhead:
        shape = "x".join(str(x) for x in overhead[0].get("shape", []))
        lines += ["", f"Per call at the training size ({shape} ids): host = issuing one call back to back, device = "
                  "one call's device time with the calls queued, one call = a lone call on an idle device",
                  "", "| op | host us | device us | one call us |", "| --- | ---: | ---: | ---: |"]
        for r in overhead:
            lines.append(f"| {r.get('op')} | {_fmt(r.get('host_us'), '.2f')} | {_fmt(r.get('gpu_us'), '.2f')} | "
                         f"{_fmt(r.get('call_us'), '.2f')} |")
    lines += [""] + _ops_targets(results, {r.get("op"): r for r in overhead})
    return lines


def _ops_targets(results: list[dict], overhead: dict) -> list[str]:
    """Issue 24's targets for the custom ops, each with its figure and met / NOT met."""
    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    lines = []
    gather = [r for r in results if str(r.get("op", "")).startswith("gather_rows (") and "% of copy" in r]
    if gather:
        low = min(gather, key=lambda r: r["% of copy"])
        lines.append(f"- target gather >= 80% of the copy: {low['% of copy']:.0f}% at the lowest ({low['op']}, "
                     f"{low['dtype']}) ({verdict(low['% of copy'] >= 80)})")
    for r in results:
        if str(r.get("op", "")).startswith("remap_ids (") and "% of copy" in r:
            why = "" if r.get("queued") is not False else "; the device waited for the host: not a bandwidth figure"
            lines.append(f"- target remap >= 80% of the copy: {r['% of copy']:.0f}% ({r['op']}, calls queued back to "
                         f"back{why}) ({verdict(r['% of copy'] >= 80)})")
    by = {(r.get("op"), r.get("dtype")): r for r in results}
    ratios = []
    for (op, dtype), r in by.items():
        # ours against index_add_ on the same ids: "scatter_add_rows (deterministic)" and
        # "scatter_add_rows 8x2048 tokens (dups)" against "torch index_add_" and "torch index_add_ 8x2048 tokens (dups)"
        if not str(op).startswith("scatter_add_rows "):
            continue
        rest = str(op)[len("scatter_add_rows "):]
        theirs = by.get(("torch index_add_" if rest == "(deterministic)" else f"torch index_add_ {rest}", dtype))
        if theirs and r.get("ms") and theirs.get("ms"):
            bound = " (host-bound)" if r.get("host-bound") or theirs.get("host-bound") else ""
            ratios.append((f"{op}, {dtype}", theirs["ms"] / r["ms"], bound))
    if ratios:
        lines.append("- target deterministic scatter at least as fast as index_add_ (index_add_'s time over ours): "
                     + ", ".join(f"{k} {v:.2f}x{b}" for k, v, b in ratios)
                     + f" ({verdict(all(v >= 1.0 for _, v, _ in ratios))})")
    ours, theirs = overhead.get("remap_ids"), overhead.get("torch lookup[ids]")
    if ours and theirs and theirs.get("host_us") and theirs.get("gpu_us"):
        lines.append(f"- remap_ids per call against torch's lookup[ids] at the training size: host "
                     f"{ours['host_us'] / theirs['host_us']:.2f}x, device {ours['gpu_us'] / theirs['gpu_us']:.2f}x "
                     "(no target: informational)")
    return lines


def _bench_lines(rows: list[dict]) -> list[str]:
    lines = ["## The 1B model on one device", "",
             "| run | tokens/s | TFLOP/s/device | MFU (bf16 peak) | peak GB | step ms |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r.get('name')} | failed: {r['error']} | | | | |")
            continue
        mfu = "n/a" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%"
        lines.append(f"| {r.get('name')} | {_fmt(r.get('tokens_per_s'))} | {_fmt(r.get('tflops_per_device'), '.1f')} "
                     f"| {mfu} | {_fmt(r.get('peak_mem_gb'), '.1f')} | {_fmt(r.get('step_ms'), '.0f')} |")
    ok = {r["name"]: r for r in rows if "error" not in r and "name" in r}
    bf = ok.get("bf16")
    if bf is not None and bf.get("mfu") is not None:
        lines.append(f"- target bf16 MFU >= 50%: {100 * bf['mfu']:.1f}% ({'met' if bf['mfu'] >= 0.5 else 'NOT met'})")
    fp8 = "fp8" if "fp8" in ok else "fp8_torch_casts" if "fp8_torch_casts" in ok else None
    if bf is not None and fp8 is not None and bf.get("tokens_per_s"):
        ratio = ok[fp8]["tokens_per_s"] / bf["tokens_per_s"]
        lines.append(f"- target FP8 >= 1.3x bf16 tokens/s: {ratio:.2f}x ({'met' if ratio >= 1.3 else 'NOT met'})"
                     + (" (the PyTorch casts and torch._scaled_mm: the default run failed)" if fp8 != "fp8" else ""))
    lines += ratio_lines(ok)
    lines += tuning_lines(rows)
    lines += backends_lines(rows)
    return lines


# Each benchmark run beside the runs it varies (run, what it is, its bases): a line for each run
# present, with its tokens/s over each base present, in the order given, so that a call with any
# subset of the stages (``--stages fp8,fp8_fused``) still compares what it ran. A run may have
# more than one entry (bf16 is also the grad_accum_fusion run beside bf16_nofusion).
RATIOS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("fp8", "FP8 with the defaults", ("fp8_prev",)),
    ("fp8_prev", "FP8 with the previous defaults (fp8_casts=triton fp8_gemm=torch fp8_fused_casts=false)",
     ("bf16",)),
    ("fp8_all_fused", "FP8 with the C++ casts, cuBLASLt GEMMs and fp8_fused_casts=true",
     ("fp8", "fp8_prev", "bf16")),
    ("fp8_tuned", "FP8 with fp8_all_fused's settings and fp8_gemm_tuning=8", ("fp8_all_fused", "fp8", "bf16")),
    ("fp8_cuda", "FP8 with the C++/CUDA cast operator", ("fp8_prev", "fp8", "bf16")),
    ("fp8_lt", "FP8 with the C++ casts and the cuBLASLt GEMM operator", ("fp8_prev", "fp8", "fp8_cuda", "bf16")),
    ("fp8_fused", "FP8 with fp8_fused_casts=true", ("fp8_prev", "fp8", "bf16")),
    ("fp8_lt_fused", "FP8 with the C++ casts, cuBLASLt GEMMs and fp8_fused_casts=true",
     ("fp8_lt", "fp8_fused", "fp8", "bf16")),
    ("fp8_tlt_fused", "FP8 with the Triton casts, cuBLASLt GEMMs and fp8_fused_casts=true",
     ("fp8_fused", "fp8_lt_fused", "fp8", "bf16")),
    ("fp8_fast_accum", "FP8 with fp8_fast_accum=forward", ("fp8", "bf16")),
    ("fp8_current", "FP8 current scaling, eager", ("fp8", "bf16")),
    ("bf16_mb8", "bf16 with micro-batches of 8", ("bf16",)),
    ("fp8_mb8", "FP8 with micro-batches of 8", ("fp8", "bf16_mb8", "bf16")),
    ("fp8_lt_mb8", "FP8 with the C++ casts, cuBLASLt GEMMs and micro-batches of 8",
     ("fp8_lt", "fp8_mb8", "bf16_mb8", "bf16")),
    ("bf16_compile", "train.compile", ("bf16",)),
    ("fp8_compile", "FP8 with train.compile (the casts traced into the graphs)", ("bf16_compile", "fp8", "bf16")),
    ("fp8_compile_triton", "FP8 with train.compile and our Triton casts inside the graphs",
     ("fp8_compile", "bf16_compile", "fp8", "bf16")),
    ("fp8_current_compile", "FP8 current scaling traced into the compiled blocks",
     ("fp8_compile", "bf16_compile", "fp8_current", "bf16")),
    ("bf16_flex_autotune", "inductor autotuning (TORCHINDUCTOR_MAX_AUTOTUNE=1, flex_attention's block sizes; "
     "attention's ms: the two runs' kernel breakdowns)", ("bf16",)),
    ("bf16", "optim.grad_accum_fusion (the default run against the same run without it)", ("bf16_nofusion",)),
    ("bf16_compile", "optim.grad_accum_fusion under train.compile (fused layers outside the graphs)",
     ("bf16_compile_nofusion",)),
)


def ratio_lines(ok: dict[str, dict]) -> list[str]:
    """One line per :data:`RATIOS` entry whose run and at least one base succeeded: the run's
    tokens/s over each base's, each base named with what it ran (:func:`run_gist` of its
    ``backends`` line)."""
    lines = []
    for run, what, bases in RATIOS:
        mine = ok.get(run, {}).get("tokens_per_s")
        against = [f"{mine / ok[b]['tokens_per_s']:.3f}x {b} ({run_gist(ok[b].get('backends'))})"
                   for b in bases if mine and ok.get(b, {}).get("tokens_per_s")]
        if against:
            lines.append(f"- {what} ({run}): " + ", ".join(against) + " (tokens/s)")
    return lines


def _linear_part(backends: str) -> str:
    """The ``linear=...`` part of a ``backends`` line (model/backends.py ``Backends.describe``)."""
    for part in backends.split(" | "):
        if "linear=" in part:
            return part.split("linear=", 1)[1]
    return ""


def run_gist(backends: str | None) -> str:
    """A few words on how a run computes, from its ``backends`` line: the GEMMs, the FP8 casts,
    scaling, fast accumulation, fused casts, compile, gradient-accumulation fusion."""
    if not backends:
        return "backends not recorded"
    linear = _linear_part(backends)
    words = []
    if linear.startswith("native fp8"):
        words.append("cuBLASLt GEMMs" if "dept_mega::fp8_gemm" in linear else "_scaled_mm")
        if "casts in the compiled graphs" in linear:
            words.append("Triton casts in the graphs" if "dept_mega::fp8_cast)" in linear else "inductor's casts")
        else:
            casts = linear.split("(", 1)[1].split(")", 1)[0]  # "torch._scaled_mm, torch casts"
            words.append("C++ casts" if "dept_mega::cast_fp8" in casts else "Triton casts" if "Triton" in casts
                         else "torch casts" if "torch casts" in casts else casts)
        words.append("current scaling" if "current scaling" in linear else "delayed scaling")
        accum = re.search(r"fast accumulation: (\w+)", linear)
        words.append("exact sums" if accum is None or accum.group(1) == "none" else f"fast accumulation: {accum.group(1)}")
        fused = re.search(r"fused casts \(fp8_fused_casts(: null = auto)?\) \[(?!none)", linear)
        if fused:  # (fp8_fused_casts: null = auto: the producers its table fuses for the run's casts)
            # per producer: one kernel, or the producer then the cast (torch casts, current scaling)
            how = {p: "one kernel" if h.startswith("one kernel") else "apart"
                   for p, h in re.findall(r"\((layernorm|gelu), ([^,)]*)", linear)}
            dgelu = re.search(r"dgelu \(fc1's output gradient, (one kernel)?", linear)  # its cast fused into fc2's
            if dgelu:
                how["dgelu"] = "one kernel" if dgelu.group(1) else "apart"
            words.append(("auto " if fused.group(1) else "") + "fused casts"
                         + (": " + ", ".join(f"{p} {h}" for p, h in how.items()) if how else ""))
    elif linear.startswith("transformer_engine"):
        words.append(linear)
    else:
        words.append("bf16 GEMMs" if linear == "torch" else linear)
    if "compile=per-block torch.compile" in backends:
        words.append("compiled")
    if "grad_accum_fusion=off" in backends:
        words.append("grad_accum_fusion off")
    return ", ".join(words)


def _parts(backends: str) -> dict[str, str]:
    """A ``backends`` line's parts by key (the text before the first ``=``; "backend" for the
    first, which holds the linear layers)."""
    return {p.split("=", 1)[0]: p for p in backends.split(" | ")}


def tuning_lines(rows: list[dict]) -> list[str]:
    """For each run whose record lists FP8 GEMM problems tuned (``fp8_gemm_tuning``): the run log's
    line of them (``fp8_gemm_tuning_line``: each problem's kept and first candidate's ms, their sums)."""
    return [f"- {r['name']}: {r['fp8_gemm_tuning_line']}" for r in rows
            if "error" not in r and r.get("fp8_gemm_tuning")]


def backends_lines(rows: list[dict]) -> list[str]:
    """Each run's ``backends`` line: the first run's in full, every other's as the parts that
    differ from it (and the parts it lacks), so that e.g. the fused casts of fp8_fused show."""
    lines = ["- backends of each run (the first in full; the others: the parts that differ from it)"]
    first = None
    for r in rows:
        if "error" in r or "name" not in r:
            continue
        b = r.get("backends")
        if not b:
            lines.append(f"  - {r['name']}: not recorded")
        elif first is None:
            first = (r["name"], b)
            lines.append(f"  - {r['name']}: {b}")
        else:
            base, mine = _parts(first[1]), _parts(b)
            diff = [p for k, p in mine.items() if base.get(k) != p] + [f"no {k}" for k in base if k not in mine]
            lines.append(f"  - {r['name']}: " + (" | ".join(diff) if diff else f"as {first[0]}"))
    return lines if len(lines) > 1 else []


def torchao_lines(r: dict, ours: list[dict]) -> list[str]:
    """benchmarks/vs_torchao.py's record (a bench.jsonl row of kind ``vs_torchao``): each arm's
    figures, torchao float8's tokens/s over bf16's, and our FP8 runs' ratios beside it (``ours``:
    the bench rows; the compiled ones are what the compiled torchao arms compare with)."""
    how = "compiled per block" if r.get("compiled") else "eager"
    version = f" {r['torchao_version']}" if r.get("torchao_version") else ""
    lines = [f"## torchao{version} float8 against bf16 on a plain PyTorch GPT of the same shape ({how})", ""]
    if "skipped" in r:
        return lines + [f"- skipped: {r['skipped']}"]
    if "error" in r:
        return lines + [f"- failed: {r['error']}"]
    model = r.get("model") or {}
    lines += [f"- {model.get('layers')} x {model.get('hidden')}, {model.get('heads')} heads, FFN {model.get('ffn')}, "
              f"sequence {model.get('seq_length')}, vocabulary {model.get('vocab')}, positions {model.get('positions')}; "
              f"micro-batch {r.get('micro_batch_size')} x {r.get('accum')}; weights {model.get('weights')}",
              "", "| arm | tokens/s | TFLOP/s | MFU (bf16 peak) | peak GB | step ms | first loss | Float8Linear | graphs |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, a in (r.get("arms") or {}).items():
        if "error" in a:
            lines.append(f"| {name} | failed: {a['error'][:200]} | | | | | | | |")
            continue
        mfu = "n/a" if a.get("mfu") is None else f"{100 * a['mfu']:.1f}%"
        lines.append(f"| {name} | {_fmt(a.get('tokens_per_s'))} | {_fmt(a.get('tflops'), '.1f')} | {mfu} | "
                     f"{_fmt(a.get('peak_mem_gb'), '.1f')} | {_fmt(a.get('step_ms_median'), '.0f')} | "
                     f"{_fmt(a.get('first_loss'), '.4f')} | {a.get('float8_linears')} | "
                     f"{_fmt(a.get('compiled_graphs'), 'd', '')} |")
    if r.get("compiled"):
        lines.append("- graphs: the compiled graphs of the arm (2 = one for all blocks, one for the head and loss)")
    for name, ratio in (r.get("ratios") or {}).items():
        lines.append(f"- torchao {name}: {ratio:.2f}x its bf16 tokens/s (the target for our FP8: 1.3x)")
    ok = {x["name"]: x for x in ours if "error" not in x and x.get("tokens_per_s")}
    mine = [f"{ok[f]['tokens_per_s'] / ok[b]['tokens_per_s']:.2f}x ({f} / {b})" for f, b in (
        ("fp8_compile_triton", "bf16_compile"), ("fp8_current_compile", "bf16_compile"), ("fp8_compile", "bf16_compile"),
        ("fp8", "bf16"))
        if f in ok and b in ok]
    if mine:
        lines.append("- ours on the same card: " + ", ".join(mine))
    for e in r.get("loss_errors") or []:
        lines.append(f"- SANITY CHECK FAILED: {e}")
    warnings = r.get("torchao_import_warnings") or []
    if warnings:
        lines.append(f"- torchao's import warned ({len(warnings)}): {warnings[0][:160]}")
    return lines


def fp8_host_lines(r: dict) -> list[str]:
    """benchmarks/fp8_host_bench.py's record (a bench.jsonl row of kind ``fp8_host``): one table,
    µs per linear call forward and backward and their dispatcher ops by casts + GEMM combination
    (the combinations that did not run and why), then the derived differences (what Triton's
    launcher, ``cast_fp8``'s Python and ``_scaled_mm``'s host path cost over the C++ operators)."""
    lines = ["## FP8: the host's cost per linear call (benchmarks/fp8_host_bench.py)", ""]
    if "error" in r:
        return lines + [f"- failed: {r['error']}"]
    shape = "x".join(str(x) for x in r.get("shape") or [])
    lines += [f"- {r.get('device_name')}, {r.get('timing')}; operands {shape}, a chain of {r.get('depth')}, "
              f"{r.get('scaling')} scaling, kernels {r.get('kernels')}, min of {r.get('passes')} passes",
              "", "| combination | fwd us | bwd us | sum | ops fwd / bwd | Python calls fwd / bwd | syncs |",
              "| --- | ---: | ---: | ---: | --- | --- | ---: |"]
    for c, x in (r.get("combos") or {}).items():
        f, b = x.get("fwd_us"), x.get("bwd_us")
        total = None if f is None or b is None else f + b
        syncs = (x.get("fwd_syncs") or 0) + (x.get("bwd_syncs") or 0)
        lines.append(f"| {c} | {_fmt(f, '.1f')} | {_fmt(b, '.1f')} | {_fmt(total, '.1f')} | "
                     f"{_fmt(x.get('fwd_ops'), 'g')} / {_fmt(x.get('bwd_ops'), 'g')} | "
                     f"{_fmt(x.get('fwd_py_calls'), '.1f')} / {_fmt(x.get('bwd_py_calls'), '.1f')} | {syncs} |")
    for c, why in (r.get("skipped") or {}).items():
        lines.append(f"| {c} | skipped: {why} | | | | | |")
    lines.append("")
    for name, d in (r.get("derived") or {}).items():
        lines.append(f"- {name}: {_fmt(d.get('us'), '.1f')} us per call = {d.get('of')}: {d.get('what')}")
    return lines


def fp8_cast_lines(r: dict) -> list[str]:
    """benchmarks/fp8_cast_bench.py's rows (a bench.jsonl row of kind ``fp8_cast_bench``): each
    kernel's device µs per cast at the 1B shapes and its bandwidth against a copy of the same
    bytes, the fastest per shape marked."""
    lines = ["## FP8 casts: device time per cast by kernel (benchmarks/fp8_cast_bench.py)", ""]
    if "error" in r:
        return lines + [f"- failed: {r['error']}"]
    lines += ["| shape | kernel | us | GB/s | % of copy | host us | same bytes |",
              "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    rows = r.get("rows") or []
    for shape in dict.fromkeys(x.get("shape") for x in rows):
        mine = [x for x in rows if x.get("shape") == shape]
        timed = [x for x in mine if "pct_of_copy" in x]
        best = max(timed, key=lambda x: x["pct_of_copy"]) if timed else None
        for x in mine:
            if "error" in x:
                lines.append(f"| {shape} | {x['kernel']} | failed: {x['error'][:150]} | | | | |")
                continue
            mark = " (fastest)" if x is best else ""
            lines.append(f"| {shape} | {x['kernel']}{mark} | {_fmt(x.get('us'), '.1f')} | {_fmt(x.get('gbps'), '.0f')} | "
                         f"{_fmt(x.get('pct_of_copy'), '.0f', '')} | {_fmt(x.get('host_us'), '.1f')} | "
                         f"{'' if x.get('same_bytes') is None else ('yes' if x['same_bytes'] else 'NO')} |")
    if "fused" in r:
        lines += [""] + fused_cast_lines(r["fused"], r.get("fused_max_fraction"))
    return lines


def attention_lines(r: dict) -> list[str]:
    """benchmarks/attention_bench.py's rows (a bench.jsonl row of kind ``attention_bench``): each
    kernel's device ms per forward + backward, TFLOP/s and largest error against the fp32
    reference; the fastest row computing the model's function (ALiBi) marked."""
    lines = ["## Attention: device time per forward + backward by kernel (benchmarks/attention_bench.py)", ""]
    if "error" in r and not r.get("rows"):
        return lines + [f"- failed: {r['error']}"]
    lines += ["| kernel | ms | TFLOP/s | largest error (out, dq, dk, dv) |", "| --- | ---: | ---: | --- |"]
    rows = r.get("rows") or []
    alibi = [x for x in rows if "ms" in x and "no ALiBi" not in x["kernel"]]
    best = min(alibi, key=lambda x: x["ms"]) if alibi else None
    for x in rows:
        if "failed" in x:
            lines.append(f"| {x['kernel']} | failed: {x['failed'][:150]} | | |")
            continue
        e = x.get("error") or {}
        errs = ", ".join(f"{e.get(k, float('nan')):.1e}" for k in ("out", "dq", "dk", "dv"))
        mark = " (fastest)" if x is best else ""
        lines.append(f"| {x['kernel']}{mark} | {_fmt(x.get('ms'), '.3f')} | {_fmt(x.get('tflops'), '.0f')} | {errs} |")
    return lines


def fused_cast_lines(rows: list[dict], max_fraction: float | None) -> list[str]:
    """The fused-cast rows of fp8_cast_bench.py (its JSON's ``fused``): per op and path, the
    unfused pass (producer, then the cast) against the fused kernel, the speed-up, and how many
    of the fused kernel's bytes differ from the unfused (beyond ``max_fraction`` or one FP8
    step: flagged); the fastest fused kernel per op marked."""
    lines = ["### Fused vs unfused: the producer (LayerNorm, GELU) and the FP8 cast in one kernel", "",
             "| op | path | unfused us | fused kernel | fused us | % of copy | host us | speed-up | differing bytes |",
             "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | --- |"]
    for op in dict.fromkeys(x.get("op") for x in rows):
        mine = [x for x in rows if x.get("op") == op]
        unfused = {x["path"]: x for x in mine if x.get("variant") == "unfused" and "error" not in x}
        fused = [x for x in mine if x.get("variant") == "fused"]
        timed = [x for x in fused if "error" not in x]
        best = min(timed, key=lambda x: x["us"]) if timed else None
        for x in mine:
            if "error" in x:
                lines.append(f"| {op} | {x.get('path')} | | {x['kernel']} | failed: {x['error'][:150]} | | | | |")
        for x in timed:
            base = unfused.get(x["path"])
            n, frac, steps = x.get("differ_bytes"), x.get("differ_fraction"), x.get("max_steps")
            differ = "n/a" if n is None else ("none" if n == 0 else f"{n:,} ({frac:.1e}, up to {steps} FP8 steps)")
            if n and ((max_fraction is not None and frac > max_fraction) or steps > 1):
                differ += " BEYOND TOLERANCE"
            name = x["kernel"].removeprefix("fused: ") + (" (fastest)" if x is best else "")
            lines.append(f"| {op} | {x['path']} | {_fmt(base and base.get('us'), '.1f')} | {name} | "
                         f"{_fmt(x.get('us'), '.1f')} | {_fmt(x.get('pct_of_copy'), '.0f')} | "
                         f"{_fmt(x.get('host_us'), '.1f')} | {_fmt(x.get('speedup'), '.2f')}"
                         f"{'' if x.get('speedup') is None else 'x'} | {differ} |")
        for path, x in unfused.items():
            if not any(f["path"] == path for f in fused):
                lines.append(f"| {op} | {path} | {_fmt(x.get('us'), '.1f')} | none (this path runs them apart) | "
                             f"| | | | |")
    lines += ["", "- speed-up: the unfused pass's device us over the fused kernel's, same path; % of copy: a "
              "copy of the bytes a minimal pass moves (read bf16, write both FP8 layouts: 4 B per element)"]
    return lines


def rerun_line(found: list[dict], planned: list[str]) -> str | None:
    """The command for a second call: every planned stage that did not finish ok (failed, cut
    off, skipped for time, or not reached before the call ended), in the planned order."""
    ok = {st["name"] for st in found if st["status"] == "ok"}
    left = [name for name in planned if name not in ok]
    if not left:
        return None
    return f"- to run what failed, was cut off or did not run: `bash benchmarks/gpu_check.sh --stages {','.join(left)}`"


def summary(out: str, env_path: str | None = None, budget: int | None = None, elapsed: int | None = None,
            dry_run: bool = False, planned: list[str] | None = None) -> str:
    lines = ["# GPU check summary" + (" (dry run on the CPU: tiny model, no figure means anything)" if dry_run
                                      else ""), ""]
    env = _load(env_path) if env_path else None
    if env:
        lines.append(f"- device: {env.get('device_name')} | torch {env.get('torch')} | CUDA {env.get('cuda')} | "
                     f"megatron-core {env.get('megatron_core')} | date {env.get('date')}")
    if budget is not None:
        lines.append(f"- time: {_fmt(elapsed, 'd')} s of the {budget} s budget")
    log = os.path.join(out, "gpu_check.log")
    if os.path.exists(log):
        text = open(log, encoding="utf-8", errors="replace").read()
        lines += ["", "| stage | status | s | pytest |", "| --- | --- | ---: | --- |"]
        found = stages(text)
        for st in found:
            lines.append(f"| {st['name']} | {st['status']} | {_fmt(st['seconds'], 'd', '')} | "
                         f"{'; '.join(st['pytest'])} |")
        notes = [m.group(1) for m in (NOTE.match(line) for line in text.splitlines()) if m]
        if notes:
            lines += [""] + [f"- note: {n}" for n in notes]
        rerun = rerun_line(found, planned or [])
        if rerun:
            lines += ["", rerun]
    ops = _load(os.path.join(out, "ops_bench.json"))
    if isinstance(ops, dict):
        lines += [""] + ops_lines(ops)
    bench = os.path.join(out, "bench.jsonl")
    if os.path.exists(bench):
        rows = []
        for line in open(bench, encoding="utf-8"):
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
        bench_rows = [r for r in rows if r.get("kind") not in OWN_SECTIONS]  # the 1B runs (kind "bench")
        if bench_rows:
            lines += [""] + _bench_lines(bench_rows)
        for r in rows:
            if r.get("kind") == "vs_torchao":
                lines += [""] + torchao_lines(r, bench_rows)
            elif r.get("kind") == "fp8_host":
                lines += [""] + fp8_host_lines(r)
            elif r.get("kind") == "fp8_cast_bench":
                lines += [""] + fp8_cast_lines(r)
            elif r.get("kind") == "attention_bench":
                lines += [""] + attention_lines(r)
    mem = _load(os.path.join(out, "memory.json"))
    if mem:
        lines += ["", f"## Memory model ({mem.get('note', '')})", ""]
        for k, v in mem.get("comparison", {}).items():
            lines.append(f"- {k}: predicted {_fmt(v.get('predicted_gb'), '.2f')} GB, measured "
                         f"{_fmt(v.get('measured_gb'), '.2f')} GB, error {_fmt(v.get('error_pct'), '+.1f')}% "
                         f"(target within 5%)")
    vs = _load(os.path.join(out, "vs_megatron.json"))
    if vs:
        o, m = vs.get("ours", {}), vs.get("megatron", {})
        lines += ["", f"## Megatron-core {vs.get('megatron_core_version')} side by side", "",
                  f"- both: precision {vs.get('precision')}, micro-batch {vs.get('micro_batch_size')}, attention "
                  f"{vs.get('attention')}, positions {vs.get('ours_position')}, gradient accumulation "
                  f"{vs.get('grad_accumulation', 'bf16 on the Megatron side (before 2026-11-26)')}; megatron-core's "
                  f"fusions without apex / TE {_onoff((vs.get('megatron_fusions') or {}).get('on'))}",
                  f"- ours {_fmt(o.get('tokens_per_s'))} tokens/s ({_fmt(o.get('peak_mem_gb'), '.1f')} GB), "
                  f"megatron {_fmt(m.get('tokens_per_s'))} tokens/s ({_fmt(m.get('peak_mem_gb'), '.1f')} GB), "
                  f"ratio {_fmt(vs.get('ratio'), '.3f')} (goal >= 1.0)"]
        lines += [f"- {side} failed: {r['error'][:300]}" for side, r in (("ours", o), ("megatron", m)) if "error" in r]
    kern = os.path.join(out, "kernels.txt")
    if os.path.exists(kern):
        lines += ["", "## Kernel breakdowns (heads of kernels.txt)", ""]
        for section in re.split(r"^(?=# kernels: )", open(kern, encoding="utf-8").read(), flags=re.M):
            if section.startswith("# kernels: "):
                head = section.splitlines()[:12]
                # and each step's GPU idle figures (kernel_breakdown's per-step part, further down)
                idle = [ln for ln in section.splitlines()[12:] if ln.startswith(("step ", "GPU active ", "idle gaps > "))]
                lines += [head[0][2:]] + head[1:] + idle + [""]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--env", default=None, help="the environment JSON gpu_check.sh wrote")
    ap.add_argument("--budget", type=int, default=None)
    ap.add_argument("--elapsed", type=int, default=None)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--planned", default="", help="the stages this call runs, comma-separated, in order")
    args = ap.parse_args(argv)
    planned = [name for name in args.planned.split(",") if name]
    text = summary(args.out, args.env, args.budget, args.elapsed, args.dry_run, planned)
    with open(os.path.join(args.out, "summary.md"), "w", encoding="utf-8") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
