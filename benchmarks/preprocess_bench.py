#!/usr/bin/env python3
"""Preprocessing throughput: tools/preprocess_data.py's engine with 1 and 2 workers against
a bare single-process loop of ``SentencePieceProcessor.encode`` over the same texts.

    python benchmarks/preprocess_bench.py [--repeat 3] [--tokenizer examples/data/build/tok/global.model] \
        [--round-trip-every 1 0 100]

Input: the sample corpus (examples/data/*.jsonl) concatenated ``--repeat`` times. The bare
loop times only tokenization of texts already in memory (no JSON, no I/O, no writing); the
preprocess runs are end to end (read, parse, check, tokenize, write .bin/.idx/.bytes.npy).
Each figure is the best of ``--trials`` runs. Needs tools/prepare_sample.py's tokenizer, or
any SentencePiece model given with --tokenizer.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import resource
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import sentencepiece as spm  # noqa: E402

from dept_mega.data.preprocess import preprocess  # noqa: E402


def _cpu() -> float:
    """CPU seconds of this process and its finished children (the pool workers)."""
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", default=os.path.join(ROOT, "examples/data/build/tok/global.model"))
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--trials", type=int, default=2)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--round-trip-every", type=int, nargs="+", default=[1], metavar="K",
                   help="preprocess runs with each of these --round-trip-every values (default: 1, every document)")
    p.add_argument("--out", help="write the figures as JSON here")
    args = p.parse_args(argv)
    if not os.path.exists(args.tokenizer):
        print(f"error: {args.tokenizer} missing; run tools/prepare_sample.py first", file=sys.stderr)
        return 1
    files = sorted(glob.glob(os.path.join(ROOT, "examples/data/*.jsonl")))
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "input.jsonl")
        with open(src, "wb") as out:
            for _ in range(args.repeat):
                for f in files:
                    out.write(open(f, "rb").read())
        texts = [json.loads(line)["text"] for line in open(src, encoding="utf-8")]
        size_mb = os.path.getsize(src) / 1e6
        sp = spm.SentencePieceProcessor(model_file=args.tokenizer)
        best, cpu, tokens = float("inf"), 0.0, 0
        for _ in range(args.trials):
            c0, t0 = _cpu(), time.perf_counter()
            tokens = 0
            for t in texts:
                tokens += len(sp.encode(t))
            el = time.perf_counter() - t0
            if el < best:
                best, cpu = el, _cpu() - c0
        rows = [{"method": "bare sp.encode loop (1 process)", "seconds": best, "cpu_seconds": cpu, "tokens": tokens,
                 "tokens_per_s": tokens / best, "docs_per_s": len(texts) / best}]
        for w, k in [(w, k) for w in args.workers for k in args.round_trip_every]:
            bw, cpu = float("inf"), 0.0
            for _ in range(args.trials):
                c0 = _cpu()
                st = preprocess([src], ["text"], args.tokenizer, os.path.join(tmp, f"w{w}"), workers=w,
                                append_eod=True, log=None, round_trip_every=k)
                if st.seconds < bw:
                    bw, cpu = st.seconds, _cpu() - c0
            # --append-eod adds one token a document: count the same tokens as the bare loop
            method = f"preprocess_data --workers {w}" + (f" --round-trip-every {k}" if args.round_trip_every != [1] else "")
            rows.append({"method": method, "seconds": bw, "cpu_seconds": cpu, "round_trip_every": k,
                         "checked": st.round_trip[0].checked,
                         "tokens": st.tokens - st.documents, "tokens_per_s": (st.tokens - st.documents) / bw,
                         "docs_per_s": st.documents / bw})
    info = {"input_mb": round(size_mb, 2), "documents": len(texts), "cpus": os.cpu_count(),
            "machine": platform.processor() or platform.machine(), "python": platform.python_version(),
            "sentencepiece": spm.__version__, "tokenizer": os.path.relpath(args.tokenizer, ROOT), "rows": rows}
    print(f"input: {size_mb:.1f} MB, {len(texts)} documents, {os.cpu_count()} CPUs")
    info["load_average_1m"] = os.getloadavg()[0]
    print(f"{'method':<56} {'wall s':>7} {'CPU s':>6} {'tokens/s':>12} {'docs/s':>9}")
    for r in rows:
        print(f"{r['method']:<56} {r['seconds']:>7.2f} {r['cpu_seconds']:>6.2f} {r['tokens_per_s']:>12,.0f} "
              f"{r['docs_per_s']:>9,.0f}")
    print(f"1-minute load average after the runs: {info['load_average_1m']:.2f} on {os.cpu_count()} CPUs")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(info, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
