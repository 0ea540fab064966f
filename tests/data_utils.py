"""Helpers for the data-pipeline tests: tiny tokenizers, jsonl files, synthetic indexed data."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from typing import Sequence

import numpy as np
import pytest

from dept_mega.data.indexed import IndexedDatasetBuilder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, "tools")


def megatron_indexed():
    """megatron-core's indexed-dataset module, for the byte-level interop checks; it is the
    ``benchmark`` extra (tools/setup_env.sh installs it), and without it those tests skip."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("megatron.core.datasets.indexed_dataset",
                                   reason="megatron-core is not installed (pip install '.[benchmark]')")

_BASE = ("the quick brown fox jumps over lazy dog data source token model train eval byte "
         "alpha beta gamma delta epsilon zeta theta lambda sigma omega river stone cloud fire").split()
_rng = np.random.default_rng(12345)
# plus 300 seeded pseudo-words, so tokenizers of a few hundred pieces can be trained
WORDS = _BASE + ["".join(chr(97 + int(c)) for c in _rng.integers(0, 26, size=int(_rng.integers(3, 9))))
                 for _ in range(300)]


def synthetic_texts(n: int, seed: int = 0, words: int = 30) -> list[str]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        k = int(rng.integers(3, words))
        out.append(" ".join(WORDS[int(i)] for i in rng.integers(0, len(WORDS), size=k)) + ".")
    return out


def write_jsonl(path: str, texts: Sequence[str], key: str = "text") -> str:
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({key: t}, ensure_ascii=False) + "\n")
    return path


def run_tool(name: str, args: Sequence[str], timeout: float = 120) -> subprocess.CompletedProcess:
    """Run tools/<name>.py in a subprocess (the command-line contract)."""
    return subprocess.run([sys.executable, os.path.join(TOOLS, name), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def train_tiny_tokenizer(directory: str, vocab: int = 120, model_type: str = "unigram",
                         extra: Sequence[str] = ()) -> str:
    """Train a small SentencePiece model on synthetic text (lossless settings, byte fallback
    only when ``extra`` asks for it); returns the .model path."""
    os.makedirs(directory, exist_ok=True)
    src = write_jsonl(os.path.join(directory, "tok_train.jsonl"), synthetic_texts(400, seed=1))
    prefix = os.path.join(directory, f"tiny_{model_type}_{vocab}")
    if not os.path.exists(prefix + ".model"):
        sys.path.insert(0, TOOLS)
        import train_tokenizer

        # vocabularies this small have no room for byte fallback's 256 byte pieces
        fb = [] if any(x.endswith("byte-fallback") for x in extra) else ["--no-byte-fallback"]
        rc = train_tokenizer.main(["--input", src, "--json-key", "text", "--vocab-size", str(vocab),
                                   "--model-type", model_type, "--output-prefix", prefix, "--threads", "1",
                                   *fb, *extra])
        assert rc == 0
    return prefix + ".model"


def write_docs(prefix: str, docs: Sequence[Sequence[int]], nbytes: Sequence[int] | None = None,
               dtype=np.uint16) -> str:
    """Write an indexed dataset with the given token documents (and byte counts)."""
    b = IndexedDatasetBuilder(prefix, dtype, with_bytes=nbytes is not None)
    for i, d in enumerate(docs):
        b.add_document(d, None if nbytes is None else nbytes[i])
    b.finalize()
    return prefix


def numbered_docs(n: int, seed: int = 0, lo: int = 1, hi: int = 40) -> list[list[int]]:
    """Documents whose tokens say where they are: doc d holds d*100 + position (mod 60000)."""
    rng = np.random.default_rng(seed)
    return [[(d * 100 + k) % 60000 for k in range(int(rng.integers(lo, hi)))] for d in range(n)]


def in_a_fork(target, seconds: float, what: str) -> list:
    """``target(out)`` in a forked process given ``seconds``: what it put in ``out`` (a queue), in
    order; an AssertionError saying ``what`` it was still doing when it has to be killed (for
    tests of code that must not wait for ever: a hang fails the test instead of stopping it)."""
    import multiprocessing as mp
    ctx = mp.get_context("fork")
    out = ctx.SimpleQueue()
    proc = ctx.Process(target=target, args=(out,))
    proc.start()
    proc.join(seconds)
    if proc.is_alive():
        proc.kill()
        proc.join()
        raise AssertionError(f"still {what} after {seconds:g} s")
    got = []
    while not out.empty():
        got.append(out.get())
    return got
