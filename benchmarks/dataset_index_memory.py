#!/usr/bin/env python3
"""Memory and time of a GPTDataset's sample index on a large synthetic source.

    python benchmarks/dataset_index_memory.py --docs 5000000 [--dir /tmp/dim] [--seq-length 2048]

Writes ``DIR/big.idx`` for ``--docs`` documents of 1..2*mean-1 tokens (mean ``--mean-tokens``),
a sparse ``DIR/big.bin`` of that many uint16 tokens (zeros: the index never reads tokens)
and ``DIR/big.bytes.npy``, once (reused when present). Then, each in a fresh process (so that
the resident memory is that step's): ``open`` (GPTDataset(..., '98,2') on a cold cache: the
part's arrays are built), ``epoch`` (the same plus epoch 0's arrays on a cold cache), and
``warm`` (open + epoch 0 again, from the cache); the last two then read 64 samples. Prints, per step,
the wall time, what the dataset added to the process's RssAnon (private memory: the
interpreter's and numpy's own are subtracted), RssFile (file pages mapped: shared with every
process mapping them) and the peak RSS (VmHWM) from /proc/self/status, and the cache's size on
disk. Linux only (reads /proc).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile", "VmHWM"):
                out[key] = int(value.split()[0]) // 1024  # MiB
    return out


def make_data(prefix: str, docs: int, mean: int, seed: int = 0) -> None:
    from dept_mega.data.indexed import write_index
    if os.path.exists(prefix + ".idx"):
        return
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 2 * mean, size=docs, dtype=np.int32)
    write_index(prefix + ".idx", np.uint16, lengths)
    with open(prefix + ".bin", "wb") as f:
        f.truncate(int(lengths.sum(dtype=np.int64)) * 2)
    np.save(prefix + ".bytes.npy", lengths.astype(np.int64) * 4)


def step(prefix: str, cache: str, seq_length: int, which: str) -> dict:
    """One measurement, in this process: ``which`` is open, epoch or warm."""
    from dept_mega.data.gpt_dataset import GPTDataset
    before = _status()["RssAnon"]
    t0 = time.perf_counter()
    ds = GPTDataset(prefix, seq_length, "98,2", "train", seed=1, cache_dir=cache)
    t_open = time.perf_counter() - t0
    if which in ("epoch", "warm"):
        ds.epoch_index(0)
    t_all = time.perf_counter() - t0
    if which != "open":
        rng = np.random.default_rng(0)
        for i in rng.integers(0, ds.samples_per_epoch, size=64):
            ds[int(i)]
    after = _status()
    return {"step": which, "documents": len(ds.doc_ids), "samples": ds.samples_per_epoch,
            "open_s": round(t_open, 2), "total_s": round(t_all, 2), "anon": after["RssAnon"] - before, **after}


def _cache_mib(cache: str) -> float:
    if not os.path.isdir(cache):
        return 0.0
    return sum(os.path.getsize(os.path.join(cache, f)) for f in os.listdir(cache)) / 2**20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=5_000_000)
    ap.add_argument("--mean-tokens", type=int, default=500)
    ap.add_argument("--seq-length", type=int, default=2048)
    ap.add_argument("--dir", default="/tmp/dataset_index_memory")
    ap.add_argument("--code", default=ROOT, help="the checkout whose dept_mega is measured (default: this "
                    "one; e.g. an older commit's, from git archive)")
    ap.add_argument("--step", choices=("open", "epoch", "warm"), help=argparse.SUPPRESS)  # one child's step
    args = ap.parse_args(argv)
    prefix = os.path.join(args.dir, "big")
    cache = os.path.join(args.dir, "cache")
    if args.step:
        print(json.dumps(step(prefix, cache, args.seq_length, args.step)))
        return 0
    os.makedirs(args.dir, exist_ok=True)
    t0 = time.perf_counter()
    make_data(prefix, args.docs, args.mean_tokens)
    print(f"data: {args.docs} documents, {os.path.getsize(prefix + '.bin') // 2} tokens, .idx "
          f"{os.path.getsize(prefix + '.idx') / 2**20:.0f} MiB ({time.perf_counter() - t0:.1f} s)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath(args.code), ROOT,
                                                         os.environ.get("PYTHONPATH", "")]))
    for which in ("open", "epoch", "warm"):
        if which != "warm":
            shutil.rmtree(cache, ignore_errors=True)
        res = subprocess.run([sys.executable, os.path.abspath(__file__), "--dir", args.dir, "--seq-length",
                              str(args.seq_length), "--step", which], capture_output=True, text=True, env=env)
        if res.returncode:
            print(res.stderr, file=sys.stderr)
            return res.returncode
        rec = json.loads(res.stdout.strip().splitlines()[-1])
        print(f"{which:5s}: {rec['documents']} documents, {rec['samples']} samples; open {rec['open_s']} s, "
              f"total {rec['total_s']} s; RssAnon +{rec['anon']} MiB, RssFile {rec['RssFile']} MiB, "
              f"peak RSS {rec['VmHWM']} MiB; cache {_cache_mib(cache):.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
