"""Benchmark of the dept_mega custom ops against a device-to-device copy of the same bytes
and against torch's index_select / index_add_ / index_put_.

Sizes (default, the issue's): a global table of 250,112 x 2048 in fp32 and bf16; TRIM gathers
216,135 rows; token batches of 8 x 2048 ids. Bandwidth counts the bytes an op must move
(read + write of the rows; ids not counted) over the median time.

    python benchmarks/ops_bench.py --device cuda --out ops_bench.json      # on a GPU
    python benchmarks/ops_bench.py --device cpu --small                    # smoke test

Prints a Markdown table (for docs/performance.md) and writes JSON with --out.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import dept_mega.ops as ops  # noqa: E402


def timed(fn: Callable[[], object], device: torch.device, iters: int, warmup: int = 3) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        for _ in range(iters):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(device: torch.device, vocab: int, dim: int, n_rows: int, batch: tuple, iters: int,
        sources: int) -> List[Dict]:
    # Every input is drawn on the device (billions of normals at the default sizes: drawing
    # them on the host took most of the run).
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, dtype):
        return torch.randn(*shape, generator=g, device=device, dtype=dtype)

    def randperm(n):
        return torch.randperm(n, generator=g, device=device)
    results: List[Dict] = []

    def record(name: str, dtype, seconds: float, nbytes: int, copy_s: float = None):
        row = {"op": name, "dtype": str(dtype).replace("torch.", ""), "ms": seconds * 1e3,
               "GB/s": nbytes / seconds / 1e9}
        if copy_s is not None:
            row["% of copy"] = 100.0 * copy_s / seconds
        results.append(row)
        print(f"  {name:<44} {row['dtype']:<9} {row['ms']:9.3f} ms {row['GB/s']:8.1f} GB/s"
              + (f" {row['% of copy']:6.1f}% of copy" if copy_s is not None else ""), flush=True)

    # TRIM gathers one source's vocabulary: distinct ids, sorted (a vocabulary set).
    ids = randperm(vocab)[:n_rows].sort().values
    ids_shuffled = ids[randperm(n_rows)]
    for dtype in (torch.float32, torch.bfloat16):
        table = randn(vocab, dim, dtype=dtype)
        es = table.element_size()
        src = randn(n_rows, dim, dtype=dtype)
        dst = torch.empty_like(src)
        copy_s = timed(lambda: dst.copy_(src), device, iters)
        moved = 2 * n_rows * dim * es
        record("copy (same bytes as the gather)", dtype, copy_s, moved)
        record("gather_rows (sorted ids)", dtype,
               timed(lambda: ops.gather_rows(table, ids), device, iters), moved, copy_s)
        record("gather_rows (shuffled ids)", dtype,
               timed(lambda: ops.gather_rows(table, ids_shuffled), device, iters), moved, copy_s)
        record("torch index_select", dtype,
               timed(lambda: table.index_select(0, ids), device, iters), moved, copy_s)
        if dtype == torch.float32:
            mixed = n_rows * dim * (4 + 2)
            record("gather_rows fp32 -> bf16 rows", dtype,
                   timed(lambda: ops.gather_rows(table, ids, torch.bfloat16), device, iters),
                   mixed)

        # Scatter back the trimmed rows (distinct ids): read rows + read/write table rows.
        rows = randn(n_rows, dim, dtype=dtype)
        moved_s = 3 * n_rows * dim * es
        record("scatter_add_rows (deterministic)", dtype,
               timed(lambda: ops.scatter_add_rows(table, ids_shuffled, rows), device, iters),
               moved_s, copy_s * 1.5)
        record("torch index_add_", dtype,
               timed(lambda: table.index_add_(0, ids_shuffled, rows), device, iters), moved_s,
               copy_s * 1.5)
        record("torch index_put_(accumulate=True)", dtype,
               timed(lambda: table.index_put_((ids_shuffled,), rows, accumulate=True), device,
                     iters), moved_s, copy_s * 1.5)

        # Embedding-gradient-like scatter: one batch of token rows, ids repeat (Zipf-ish).
        ntok = batch[0] * batch[1]
        # Pareto(scale 1, alpha 1.2) by inversion, minus one: about 57% of the ids are 0.
        u = torch.rand(ntok, generator=g, device=device, dtype=torch.float64)
        tok_ids = u.pow(-1.0 / 1.2).long().clamp(max=vocab) - 1
        grads = randn(ntok, dim, dtype=dtype)
        moved_g = 2 * ntok * dim * es
        record(f"scatter_add_rows {batch[0]}x{batch[1]} tokens (dups)", dtype,
               timed(lambda: ops.scatter_add_rows(table, tok_ids, grads), device, iters),
               moved_g)
        record(f"torch index_add_ {batch[0]}x{batch[1]} tokens (dups)", dtype,
               timed(lambda: table.index_add_(0, tok_ids, grads), device, iters), moved_g)

        # TRIM round end: `sources` overlapping vocabularies contribute their rows.
        mean_ids = torch.cat([randperm(vocab)[:n_rows] for _ in range(sources)])
        mean_rows = randn(mean_ids.numel(), dim, dtype=dtype)
        record(f"scatter_mean_rows ({sources} sources)", dtype,
               timed(lambda: ops.scatter_mean_rows(table, mean_ids, mean_rows), device, iters),
               2 * mean_ids.numel() * dim * es)
        del table, src, dst, rows, grads, mean_rows
        if device.type == "cuda":
            torch.cuda.empty_cache()

    # Remap one token batch (and a 64x larger one, to see bandwidth rather than latency).
    lookup = torch.full((vocab,), -1, dtype=torch.int64, device=device)
    lookup[ids] = torch.arange(n_rows, device=device)
    for mult in (1, 64):
        shape = (batch[0] * mult, batch[1])
        toks = ids[torch.randint(0, n_rows, shape, generator=g, device=device)]
        out = torch.empty_like(toks)
        copy_s = timed(lambda: out.copy_(toks), device, iters)
        moved = 2 * toks.numel() * 8
        record(f"copy ({shape[0]}x{shape[1]} int64)", torch.int64, copy_s, moved)
        record(f"remap_ids ({shape[0]}x{shape[1]})", torch.int64,
               timed(lambda: ops.remap_ids(toks, lookup), device, iters), moved, copy_s)
        record(f"torch lookup[ids] ({shape[0]}x{shape[1]})", torch.int64,
               timed(lambda: lookup[toks], device, iters), moved, copy_s)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="tiny sizes (smoke test)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sources", type=int, default=4)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.small:
        vocab, dim, n_rows, batch = 5000, 64, 3000, (2, 128)
    else:
        vocab, dim, n_rows, batch = 250_112, 2048, 216_135, (8, 2048)
    info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda"
            else platform.processor() or platform.machine(),
            "backend": ops.backend(device), "extension": ops.extension_status().reason,
            "torch": torch.__version__, "vocab": vocab, "dim": dim, "rows": n_rows,
            "batch": list(batch), "iters": args.iters}
    print(json.dumps(info), flush=True)
    if info["backend"] == "torch":
        print("WARNING: dept_mega.ops uses the PyTorch fallback on this device: the figures are "
              "not the compiled kernels'", flush=True)
    results = run(device, vocab, dim, n_rows, batch, args.iters, args.sources)
    print("\n| op | dtype | ms | GB/s | % of copy |\n| --- | --- | ---: | ---: | ---: |")
    for r in results:
        pct = f"{r['% of copy']:.0f}" if "% of copy" in r else ""
        print(f"| {r['op']} | {r['dtype']} | {r['ms']:.3f} | {r['GB/s']:.1f} | {pct} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"info": info, "results": results}, indent=1))


if __name__ == "__main__":
    main()
