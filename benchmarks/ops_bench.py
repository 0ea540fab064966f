"""Benchmark of the dept_mega custom ops against a device-to-device copy of the same bytes
and against torch's index_select / index_add_ / index_put_ / lookup[ids].

Sizes (default, the issue's): a global table of 250,112 x 2048 in fp32 and bf16; TRIM gathers
216,135 rows; token batches of 8 x 2048 ids. Bandwidth counts the bytes an op must move
(read + write of the rows; ids not counted) over the median time.

Two ways of timing (see `timed` and `timed_queued`):

- the gather / scatter rows time one call at a time between CUDA events on an idle device, as in
  the earlier runs of this bench (comparable with them); each row also gives the host's part of
  that time (``host_ms``) and is flagged ``host-bound`` where the host's dispatch is at least half
  of it: such a row measures the per-call overhead, not the kernel;
- the id remap is judged at a bandwidth-bound size (``--remap-ids``, 2**25 ids by default: at
  most five 256 MiB int64 tensors at a time), on uniformly drawn ids (each lookup a random
  read of the table) and on Zipf-distributed ones (natural text's token frequencies), through the
  lookup table and through the vocabulary's ranks (``ranked``, TRIM's form: the table as 32x
  smaller bitmap ranks), its copy and torch's ``lookup[ids]`` alike, with
  calls queued back to back behind a GPU sleep, so that the host's dispatch cannot leave the
  device idle between them; and its per-call overhead at the training size (one 8 x 2048
  batch) apart (``overhead`` in the JSON): host time per call, device time per call, one call's
  latency on an idle device.

    python benchmarks/ops_bench.py --device cuda --out ops_bench.json      # on a GPU
    python benchmarks/ops_bench.py --device cpu --small                    # smoke test

Prints Markdown tables (for docs/performance.md) and writes JSON with --out.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import dept_mega.ops as ops  # noqa: E402
from suite_summary import ops_lines  # noqa: E402  (the one Markdown format of these results)

# Back-to-back calls per sample of timed_queued: enough for the device time of a bandwidth-bound
# call (~0.1 ms and up) to dwarf the samples' edges; and for the per-call overhead.
BANDWIDTH_CALLS = 10
OVERHEAD_CALLS = 100
# A row of `timed` whose host part is at least this share of its time is flagged host-bound.
HOST_BOUND = 0.5
_CALIBRATION_CYCLES = 10_000_000  # about 5 ms of torch.cuda._sleep at ~2 GHz


def timed(fn: Callable[[], object], device: torch.device, iters: int,
          warmup: int = 3) -> Tuple[float, float]:
    """Median seconds of one call, and of the host's part of it.

    On CUDA one call between two events, the device idle before it: the time is the host's
    dispatch of the call plus the device's work (launches are asynchronous, so the device waits
    for the host). The host part is a host timer around the call alone. On CPU both are the host
    timer's."""
    for _ in range(warmup):
        fn()
    times, host = [], []
    for _ in range(iters):
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            fn()
            host.append(time.perf_counter() - t0)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            host.append(times[-1])
    return statistics.median(times), statistics.median(host)


_SLEEP_RATE: Dict[int, float] = {}


def _sleep_cycles_per_s(device: torch.device) -> Optional[float]:
    """Cycles per second of torch.cuda._sleep on ``device`` (measured once); None where this
    torch has no such kernel."""
    if not hasattr(torch.cuda, "_sleep"):
        return None
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SLEEP_RATE:
        with torch.cuda.device(idx):
            torch.cuda._sleep(1000)
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            torch.cuda._sleep(_CALIBRATION_CYCLES)
            b.record()
            b.synchronize()
            _SLEEP_RATE[idx] = _CALIBRATION_CYCLES / (a.elapsed_time(b) / 1e3)
    return _SLEEP_RATE[idx]


def timed_queued(fn: Callable[[], object], device: torch.device, iters: int, calls: int,
                 warmup: int = 3) -> Dict[str, object]:
    """Per call of ``calls`` back-to-back calls, medians over ``iters`` samples: ``s``, the
    device's time, and ``host_s``, the host's time to issue a call (Python wrapper, dispatcher,
    launch).

    On CUDA each sample's calls are queued behind a GPU sleep of twice the host's issue time
    (plus 1 ms), and CUDA events around the calls time them: the device runs them back to back
    whatever the host's dispatch costs. ``queued`` is True when, in every sample, the host had
    issued all calls before the sleep ended (False: the device may have waited for the host,
    and ``s`` includes that; None: this torch has no sleep kernel, and the device waited for the
    first call). On CPU the calls are synchronous: ``s`` and ``host_s`` are both the host timer's
    and ``queued`` is None."""
    for _ in range(warmup):
        fn()
    dev: List[float] = []
    host: List[float] = []
    if device.type != "cuda":
        for _ in range(iters):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            host.append((time.perf_counter() - t0) / calls)
        return {"s": statistics.median(host), "host_s": statistics.median(host), "queued": None}
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    issue = time.perf_counter() - t0
    torch.cuda.synchronize(device)
    rate = _sleep_cycles_per_s(device)
    queued = []
    with torch.cuda.device(device):
        for _ in range(iters):
            before, start, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            before.record()
            if rate is not None:
                torch.cuda._sleep(int(rate * (2 * issue + 1e-3)))
            start.record()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            issue = time.perf_counter() - t0
            end.record()
            end.synchronize()
            # The host started issuing after the sleep's launch, so this margin is safe.
            queued.append(issue < 0.9 * before.elapsed_time(start) / 1e3)
            dev.append(start.elapsed_time(end) / 1e3 / calls)
            host.append(issue / calls)
    return {"s": statistics.median(dev), "host_s": statistics.median(host),
            "queued": all(queued) if rate is not None else None}


class Recorder:
    """The result rows: op, dtype, ms, GB/s, % of copy (when given), host_ms, and on CUDA
    host-bound / queued flags."""

    def __init__(self, device: torch.device):
        self.device = device
        self.rows: List[Dict] = []

    def add(self, name: str, dtype, timing, nbytes: int, copy_s: Optional[float] = None) -> None:
        """``timing``: `timed`'s (seconds, host seconds) or `timed_queued`'s dict."""
        if isinstance(timing, dict):
            seconds, host_s = timing["s"], timing["host_s"]
        else:
            seconds, host_s = timing
        row = {"op": name, "dtype": str(dtype).replace("torch.", ""), "ms": seconds * 1e3,
               "GB/s": nbytes / seconds / 1e9}
        if copy_s is not None:
            row["% of copy"] = 100.0 * copy_s / seconds
        row["host_ms"] = host_s * 1e3
        flags = []
        if self.device.type == "cuda":
            if isinstance(timing, dict):
                row["queued"] = timing["queued"]
                if timing["queued"] is False:
                    flags.append("device waited for the host")
            else:
                row["host-bound"] = host_s >= HOST_BOUND * seconds
                if row["host-bound"]:
                    flags.append("host-bound")
        self.rows.append(row)
        print(f"  {name:<44} {row['dtype']:<9} {row['ms']:9.3f} ms {row['GB/s']:8.1f} GB/s"
              + (f" {row['% of copy']:6.1f}% of copy" if copy_s is not None else "")
              + f"  host {row['host_ms']:.3f} ms" + "".join(f" [{f}]" for f in flags), flush=True)


def _row_ops(device, dtype, g, record: Recorder, vocab, dim, n_rows, batch, iters, sources, ids,
             ids_shuffled) -> None:
    """The gather / scatter rows of one dtype (their tensors are freed on return)."""
    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=dtype)

    def randperm(n):
        return torch.randperm(n, generator=g, device=device)

    table = randn(vocab, dim)
    es = table.element_size()
    src = randn(n_rows, dim)
    dst = torch.empty_like(src)
    copy_s, copy_host = timed(lambda: dst.copy_(src), device, iters)
    moved = 2 * n_rows * dim * es
    record.add("copy (same bytes as the gather)", dtype, (copy_s, copy_host), moved)
    record.add("gather_rows (sorted ids)", dtype,
               timed(lambda: ops.gather_rows(table, ids), device, iters), moved, copy_s)
    record.add("gather_rows (shuffled ids)", dtype,
               timed(lambda: ops.gather_rows(table, ids_shuffled), device, iters), moved, copy_s)
    record.add("torch index_select", dtype,
               timed(lambda: table.index_select(0, ids), device, iters), moved, copy_s)
    if dtype == torch.float32:
        record.add("gather_rows fp32 -> bf16 rows", dtype,
                   timed(lambda: ops.gather_rows(table, ids, torch.bfloat16), device, iters),
                   n_rows * dim * (4 + 2))

    # Scatter back the trimmed rows (distinct ids): read rows + read/write table rows.
    rows = randn(n_rows, dim)
    moved_s = 3 * n_rows * dim * es
    record.add("scatter_add_rows (deterministic)", dtype,
               timed(lambda: ops.scatter_add_rows(table, ids_shuffled, rows), device, iters),
               moved_s, copy_s * 1.5)
    record.add("torch index_add_", dtype,
               timed(lambda: table.index_add_(0, ids_shuffled, rows), device, iters), moved_s,
               copy_s * 1.5)
    record.add("torch index_put_(accumulate=True)", dtype,
               timed(lambda: table.index_put_((ids_shuffled,), rows, accumulate=True), device,
                     iters), moved_s, copy_s * 1.5)

    # Embedding-gradient-like scatter: one batch of token rows, ids repeat (Zipf-ish).
    ntok = batch[0] * batch[1]
    # Pareto(scale 1, alpha 1.2) by inversion, minus one: about 57% of the ids are 0.
    u = torch.rand(ntok, generator=g, device=device, dtype=torch.float64)
    tok_ids = u.pow(-1.0 / 1.2).long().clamp(max=vocab) - 1
    grads = randn(ntok, dim)
    moved_g = 2 * ntok * dim * es
    record.add(f"scatter_add_rows {batch[0]}x{batch[1]} tokens (dups)", dtype,
               timed(lambda: ops.scatter_add_rows(table, tok_ids, grads), device, iters), moved_g)
    record.add(f"torch index_add_ {batch[0]}x{batch[1]} tokens (dups)", dtype,
               timed(lambda: table.index_add_(0, tok_ids, grads), device, iters), moved_g)

    # TRIM round end: `sources` overlapping vocabularies contribute their rows.
    mean_ids = torch.cat([randperm(vocab)[:n_rows] for _ in range(sources)])
    mean_rows = randn(mean_ids.numel(), dim)
    record.add(f"scatter_mean_rows ({sources} sources)", dtype,
               timed(lambda: ops.scatter_mean_rows(table, mean_ids, mean_rows), device, iters),
               2 * mean_ids.numel() * dim * es)


ZIPF_S = 1.0  # Zipf's law of word frequencies in natural text: the r-th most frequent ∝ 1 / r


def zipf_ranks(n: int, size: int, shape: tuple, g: torch.Generator, device) -> torch.Tensor:
    """``shape`` ranks in ``[0, size)`` drawn with probability ∝ 1 / (rank + 1)^ZIPF_S (inverse
    CDF on the device)."""
    weights = torch.arange(1, size + 1, device=device, dtype=torch.float64).pow(-ZIPF_S)
    cdf = weights.cumsum(0)
    u = torch.rand(shape, generator=g, device=device, dtype=torch.float64) * cdf[-1]
    return torch.searchsorted(cdf, u).clamp_(max=size - 1)


def _remap_bandwidth(device, g, record: Recorder, ids, lookup, ranks, cols: int, n_ids: int,
                     iters: int) -> None:
    """Copy, remap_ids (through the lookup table, and through the vocabulary's ranks: the
    ``ranked`` rows, TRIM's form) and torch's lookup[ids] on ``n_ids`` ids (rounded to rows of ``cols``):
    calls queued back to back, so the device's bandwidth, not the host's dispatch, sets the
    time. Two draws of the source's tokens: uniform (every lookup a random read of the table,
    the worst case) and Zipf (natural text's token frequencies; a BPE vocabulary numbers its
    tokens roughly by frequency, so the frequent ones are the low ids)."""
    shape = (max(1, n_ids // cols), cols)
    label = f"{shape[0]}x{shape[1]}"
    for dist in ("uniform", f"Zipf {ZIPF_S:g}"):
        if dist == "uniform":
            toks = ids[torch.randint(0, ids.numel(), shape, generator=g, device=device)]
        else:
            toks = ids[zipf_ranks(n_ids, ids.numel(), shape, g, device)]
        out = torch.empty_like(toks)
        moved = 2 * toks.numel() * toks.element_size()
        copy = timed_queued(lambda: out.copy_(toks), device, iters, BANDWIDTH_CALLS)
        record.add(f"copy ({label} int64, {dist})", torch.int64, copy, moved)
        record.add(f"remap_ids ({label}, {dist})", torch.int64,
                   timed_queued(lambda: ops.remap_ids(toks, lookup), device, iters, BANDWIDTH_CALLS),
                   moved, copy["s"])
        record.add(f"remap_ids ({label}, {dist}, ranked)", torch.int64,
                   timed_queued(lambda: ops.remap_ids(toks, ranks), device, iters, BANDWIDTH_CALLS),
                   moved, copy["s"])
        record.add(f"torch lookup[ids] ({label}, {dist})", torch.int64,
                   timed_queued(lambda: lookup[toks], device, iters, BANDWIDTH_CALLS), moved,
                   copy["s"])
        toks = out = None  # freed before the next draw
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _remap_overhead(device, g, ids, lookup, ranks, batch, iters: int) -> List[Dict]:
    """Per call at the training size (one batch): ``host_us``, the host's time to issue a call
    back to back; ``gpu_us``, the device's time per call with the calls queued; ``call_us``, one
    call on an idle device (host dispatch + kernel: what the earlier runs' rows measured)."""
    toks = ids[torch.randint(0, ids.numel(), tuple(batch), generator=g, device=device)]
    out = torch.empty_like(toks)
    rows = []
    for name, fn in (("copy", lambda: out.copy_(toks)),
                     ("remap_ids", lambda: ops.remap_ids(toks, lookup)),
                     ("remap_ids (ranked)", lambda: ops.remap_ids(toks, ranks)),
                     ("torch lookup[ids]", lambda: lookup[toks])):
        q = timed_queued(fn, device, iters, OVERHEAD_CALLS)
        one, _ = timed(fn, device, iters)
        rows.append({"op": name, "shape": list(batch), "host_us": q["host_s"] * 1e6,
                     "gpu_us": q["s"] * 1e6, "call_us": one * 1e6, "queued": q["queued"]})
        print(f"  per call {name:<20} {batch[0]}x{batch[1]}: host {rows[-1]['host_us']:7.2f} us, "
              f"device {rows[-1]['gpu_us']:7.2f} us (queued: {q['queued']}), one call "
              f"{rows[-1]['call_us']:7.2f} us", flush=True)
    return rows


def run(device: torch.device, vocab: int, dim: int, n_rows: int, batch: tuple, iters: int,
        sources: int, remap_ids: int) -> Tuple[List[Dict], List[Dict]]:
    """(result rows, per-call overhead rows)."""
    # Every input is drawn on the device (billions of normals at the default sizes: drawing
    # them on the host took most of the run).
    g = torch.Generator(device=device).manual_seed(0)
    record = Recorder(device)

    # TRIM gathers one source's vocabulary: distinct ids, sorted (a vocabulary set).
    ids = torch.randperm(vocab, generator=g, device=device)[:n_rows].sort().values
    ids_shuffled = ids[torch.randperm(n_rows, generator=g, device=device)]
    for dtype in (torch.float32, torch.bfloat16):
        _row_ops(device, dtype, g, record, vocab, dim, n_rows, batch, iters, sources, ids,
                 ids_shuffled)
        if device.type == "cuda":
            torch.cuda.empty_cache()

    # Remap into one source's vocabulary (every token in it).
    ranks = ops.VocabRanks.from_ids(ids, vocab)  # the map as TRIM builds it (its ranks)
    lookup = ranks.to_lookup()  # the same map as a table: lookup[v] = rank of v, -1 elsewhere
    _remap_bandwidth(device, g, record, ids, lookup, ranks, batch[1], remap_ids, iters)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    overhead = _remap_overhead(device, g, ids, lookup, ranks, batch, iters)
    return record.rows, overhead


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="tiny sizes (smoke test)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sources", type=int, default=4)
    ap.add_argument("--remap-ids", type=int, default=None,
                    help="ids of the remap's bandwidth rows (default 2**25: 1.25 GiB on the "
                    "device at most; --small: 2**13)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.small:
        vocab, dim, n_rows, batch, remap_ids = 5000, 64, 3000, (2, 128), 2 ** 13
    else:
        vocab, dim, n_rows, batch, remap_ids = 250_112, 2048, 216_135, (8, 2048), 2 ** 25
    if args.remap_ids is not None:
        remap_ids = args.remap_ids
    if remap_ids < batch[1]:
        ap.error(f"--remap-ids {remap_ids}: at least one row of {batch[1]} ids")
    info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda"
            else platform.processor() or platform.machine(),
            "backend": ops.backend(device), "extension": ops.extension_status().reason,
            "torch": torch.__version__, "vocab": vocab, "dim": dim, "rows": n_rows,
            "batch": list(batch), "iters": args.iters,
            "remap_ids": remap_ids // batch[1] * batch[1],
            # the bandwidth rows' int64 tensors of the ids' size, at most: the ids, the copy's
            # target, the index draw and two outputs (kept by the caching allocator)
            "remap_mib": 5 * (remap_ids // batch[1] * batch[1]) * 8 / 2 ** 20,
            "calls": {"bandwidth": BANDWIDTH_CALLS, "overhead": OVERHEAD_CALLS}}
    print(json.dumps(info), flush=True)
    if info["backend"] == "torch":
        print("WARNING: dept_mega.ops uses the PyTorch fallback on this device: the figures are "
              "not the compiled kernels'", flush=True)
    results, overhead = run(device, vocab, dim, n_rows, batch, args.iters, args.sources,
                            remap_ids)
    report = {"info": info, "results": results, "overhead": overhead}
    print("\n" + "\n".join(ops_lines(report)))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
