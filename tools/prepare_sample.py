#!/usr/bin/env python3
"""Build the sample corpus's tokenizers and indexed binaries (idempotent), print a summary.

    python tools/prepare_sample.py [--build-dir examples/data/build] [--force]

Writes, for every source S of examples/data/S.jsonl:
    BUILD/tok/global.model            unigram, shared by all sources (std, glob, trim, spec)
    BUILD/tok/S.model                 unigram, S's own (spec_opt); vocab sizes differ per source
    BUILD/S_global_text_document.{bin,idx,bytes.npy}   S under the global tokenizer
    BUILD/S_own_text_document.{bin,idx,bytes.npy}      S under its own tokenizer
    BUILD/summary.json                the table printed at the end
A stamp (BUILD/stamp.json: hashes of the inputs and the settings) makes a second run a no-op.
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

# (torch-free imports: the tool needs none of torch's ~3 s of CPU to start)
from dept_mega.data.indexed import IndexedDataset  # noqa: E402
from dept_mega.data.preprocess import PreprocessError, preprocess  # noqa: E402
from dept_mega.data.token_counts import token_counts  # noqa: E402

DATA_DIR = os.path.join(ROOT, "examples", "data")
SOURCES = ("en", "fr", "ja", "ru", "code")
GLOBAL_VOCAB = 8000
# Each source's own vocabulary (SPEC-OPT): different sizes on purpose.
OWN_VOCAB = {"en": 3000, "fr": 3000, "ja": 4000, "ru": 3500, "code": 2500}
VERSION = 2  # 2: lossless tokenizers (tools/train_tokenizer.py's defaults)
# SentencePiece's trainer splits its work over its threads, and the pieces it learns depend on
# how many: a fixed count makes the sample tokenizers (and examples/main.sh's figures) the same
# on every machine, whatever its number of cores.
THREADS = 2


def _sha(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _train(inputs: list[str], vocab: int, prefix: str) -> None:
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import train_tokenizer

    rc = train_tokenizer.main(["--input", *inputs, "--json-key", "text", "--vocab-size", str(vocab),
                               "--model-type", "unigram", "--output-prefix", prefix, "--strict",
                               "--threads", str(THREADS)])
    if rc:
        raise SystemExit(f"error: training tokenizer {prefix}.model failed (exit {rc})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build-dir", default=os.path.join(DATA_DIR, "build"))
    p.add_argument("--data-dir", default=DATA_DIR)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--force", action="store_true", help="rebuild even when the stamp matches")
    args = p.parse_args(argv)
    t0 = time.time()
    build = os.path.abspath(args.build_dir)
    tok_dir = os.path.join(build, "tok")
    os.makedirs(tok_dir, exist_ok=True)
    # one builder at a time (tests and the main job may start this concurrently); the lock
    # is released when the process exits
    lock = open(os.path.join(build, ".lock"), "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    inputs = {s: os.path.join(args.data_dir, f"{s}.jsonl") for s in SOURCES}
    for s, path in inputs.items():
        if not os.path.isfile(path):
            print(f"error: {path} is missing (rebuild with examples/data/build_corpus.py)", file=sys.stderr)
            return 1
    stamp = {"version": VERSION, "global_vocab": GLOBAL_VOCAB, "own_vocab": OWN_VOCAB, "threads": THREADS,
             "inputs": {s: _sha(p) for s, p in inputs.items()}}
    stamp_path = os.path.join(build, "stamp.json")
    summary_path = os.path.join(build, "summary.json")
    outputs = [os.path.join(tok_dir, "global.model")] + [os.path.join(tok_dir, f"{s}.model") for s in SOURCES]
    for s in SOURCES:
        for kind in ("global", "own"):
            outputs += [os.path.join(build, f"{s}_{kind}_text_document{e}") for e in (".bin", ".idx", ".bytes.npy")]
    fresh = (not args.force and os.path.exists(stamp_path) and os.path.exists(summary_path)
             and all(os.path.exists(o) for o in outputs))
    if fresh:
        with open(stamp_path) as f:
            fresh = json.load(f) == stamp
    if fresh:
        with open(summary_path) as f:
            rows = json.load(f)
        print(f"[prepare_sample] up to date in {build} (use --force to rebuild)")
    else:
        if os.path.exists(stamp_path):
            os.remove(stamp_path)
        print(f"[prepare_sample] training global tokenizer (unigram, {GLOBAL_VOCAB})", flush=True)
        _train(list(inputs.values()), GLOBAL_VOCAB, os.path.join(tok_dir, "global"))
        for s in SOURCES:
            print(f"[prepare_sample] training {s} tokenizer (unigram, {OWN_VOCAB[s]})", flush=True)
            _train([inputs[s]], OWN_VOCAB[s], os.path.join(tok_dir, s))
        rows = []
        for s in SOURCES:
            row = {"source": s}
            for kind, model in (("global", "global.model"), ("own", f"{s}.model")):
                out = os.path.join(build, f"{s}_{kind}")
                try:
                    st = preprocess([inputs[s]], ["text"], os.path.join(tok_dir, model), out,
                                    workers=args.workers, append_eod=True, strict=True, log=None)
                except PreprocessError as exc:
                    print(f"error: preprocessing {inputs[s]}: {exc}", file=sys.stderr)
                    return 1
                prefix = out + "_text_document"
                row.update({"documents": st.documents, "bytes": st.text_bytes,
                            f"tokens_{kind}": st.tokens, f"V_k_{kind}": int(np.count_nonzero(token_counts(prefix))),
                            f"prefix_{kind}": os.path.relpath(prefix, ROOT)})
            row["vocab_own"] = OWN_VOCAB[s]
            row["tokenizer_own"] = os.path.relpath(os.path.join(tok_dir, f"{s}.model"), ROOT)
            rows.append(row)
        with open(summary_path, "w") as f:
            json.dump(rows, f, indent=1)
        with open(stamp_path, "w") as f:
            json.dump(stamp, f)
    # check the outputs are readable before reporting
    for r in rows:
        for kind in ("global", "own"):
            IndexedDataset(os.path.join(ROOT, r[f"prefix_{kind}"]))
    print(f"global tokenizer: {os.path.relpath(os.path.join(tok_dir, 'global.model'), ROOT)} "
          f"(vocab {GLOBAL_VOCAB})")
    head = (f"{'source':<6} {'docs':>6} {'bytes':>9} {'tok(global)':>11} {'|V_k| global':>12} "
            f"{'tok(own)':>9} {'vocab own':>9} {'|V_k| own':>9} {'bytes/tok g':>11}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['source']:<6} {r['documents']:>6} {r['bytes']:>9} {r['tokens_global']:>11} "
              f"{r['V_k_global']:>12} {r['tokens_own']:>9} {r['vocab_own']:>9} {r['V_k_own']:>9} "
              f"{r['bytes'] / r['tokens_global']:>11.2f}")
    print(f"data: {os.path.relpath(build, ROOT)}/<source>_{{global,own}}_text_document "
          f"({time.time() - t0:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
