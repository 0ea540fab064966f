#!/usr/bin/env python3
"""Rebuild the sample corpus (examples/data/*.jsonl) from installed Debian packages and
the local Python standard library. See SOURCES.md for origins and licences.

    apt-get install debian-reference-en debian-reference-fr debian-reference-ja fortunes-ru
    python examples/data/build_corpus.py [--out-dir examples/data] [--max-bytes 700000]

Each source is cut into documents of a few KB (paragraphs, fortunes or top-level code
blocks, packed up to ``--doc-bytes``), in file order, until ``--max-bytes`` of text.
The output is deterministic for the same package versions (the code source depends on
the Python version whose standard library is read).
"""
from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re
import sys
import sysconfig
from typing import Iterable, Iterator

DEBREF = "/usr/share/debian-reference/debian-reference.{lang}.txt.gz"
FORTUNES_RU = "/usr/share/games/fortunes/ru"
# Top-level stdlib modules skipped: generated tables, huge data blobs, test helpers.
CODE_SKIP = {"this.py", "antigravity.py", "__phello__.foo.py"}
CODE_SKIP_PREFIX = ("_pydecimal", "_pydatetime", "_sysconfigdata", "pydoc", "test")


def pack(pieces: Iterable[str], doc_bytes: int, sep: str) -> Iterator[str]:
    """Join consecutive pieces with ``sep`` into documents of about ``doc_bytes`` bytes;
    a single piece longer than twice that is cut at line boundaries."""
    buf: list[str] = []
    size = 0
    for piece in pieces:
        piece = piece.strip("\n")
        if not piece.strip():
            continue
        n = len(piece.encode("utf-8"))
        if n > 2 * doc_bytes:
            if buf:
                yield sep.join(buf)
                buf, size = [], 0
            lines, cur, cur_n = piece.split("\n"), [], 0
            for line in lines:
                cur.append(line)
                cur_n += len(line.encode("utf-8")) + 1
                if cur_n >= doc_bytes:
                    yield "\n".join(cur)
                    cur, cur_n = [], 0
            if cur:
                yield "\n".join(cur)
            continue
        buf.append(piece)
        size += n + len(sep)
        if size >= doc_bytes:
            yield sep.join(buf)
            buf, size = [], 0
    if buf:
        yield sep.join(buf)


def debian_reference(lang: str) -> Iterator[tuple[str, str]]:
    path = DEBREF.format(lang=lang)
    with gzip.open(path, "rt", encoding="utf-8") as f:
        text = f.read()
    # Skip the table of contents: the body starts at the second "Chapter 1"-like heading,
    # i.e. the preface's first paragraph after the TOC. Keep it simple: drop the first 8%.
    paragraphs = re.split(r"\n\s*\n", text)
    start = len(paragraphs) // 12
    for p in paragraphs[start:]:
        yield path, p


def fortunes_ru() -> Iterator[tuple[str, str]]:
    files = sorted(f for f in glob.glob(os.path.join(FORTUNES_RU, "*"))
                   if os.path.isfile(f) and not f.endswith((".dat", ".u8")))
    for path in files:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError:
            continue
        for fortune in re.split(r"\n%\n", text):
            yield path, fortune


def python_stdlib() -> Iterator[tuple[str, str]]:
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(f for f in os.listdir(root) if f.endswith(".py") and f not in CODE_SKIP
                   and not f.startswith(CODE_SKIP_PREFIX))
    for name in files:
        path = os.path.join(root, name)
        with open(path, encoding="utf-8") as f:
            src = f.read()
        # split before top-level def/class/decorator lines
        for block in re.split(r"\n(?=(?:def |class |@|async def ))", src):
            yield path, block


def build(source: Iterator[tuple[str, str]], name: str, out_path: str, max_bytes: int,
          doc_bytes: int, sep: str) -> tuple[int, int]:
    docs = total = 0
    tmp = out_path + ".tmp"
    with open(tmp, "w", encoding="utf-8", newline="\n") as out:
        current_file = None
        group: list[str] = []

        def flush() -> bool:
            nonlocal docs, total
            for doc in pack(group, doc_bytes, sep):
                out.write(json.dumps({"text": doc, "source": name,
                                      "origin": os.path.basename(current_file)}, ensure_ascii=False) + "\n")
                docs += 1
                total += len(doc.encode("utf-8"))
                if total >= max_bytes:
                    return False
            return True

        for path, piece in source:
            if path != current_file:
                if group and not flush():
                    break
                current_file, group = path, []
            group.append(piece)
        else:
            if group:
                flush()
    os.replace(tmp, out_path)
    return docs, total


SOURCES = {
    "en": (lambda: debian_reference("en"), "\n\n"),
    "fr": (lambda: debian_reference("fr"), "\n\n"),
    "ja": (lambda: debian_reference("ja"), "\n\n"),
    "ru": (fortunes_ru, "\n%\n"),
    "code": (python_stdlib, "\n"),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", default=os.path.dirname(os.path.abspath(__file__)))
    p.add_argument("--max-bytes", type=int, default=700_000, help="text bytes per source")
    p.add_argument("--doc-bytes", type=int, default=2000, help="target document size in bytes")
    p.add_argument("--sources", nargs="+", default=list(SOURCES), choices=list(SOURCES))
    args = p.parse_args(argv)
    missing = [DEBREF.format(lang=l) for l in ("en", "fr", "ja") if l in args.sources
               and not os.path.exists(DEBREF.format(lang=l))]
    if "ru" in args.sources and not os.path.isdir(FORTUNES_RU):
        missing.append(FORTUNES_RU)
    if missing:
        print("error: missing " + ", ".join(missing) + "\n  apt-get install debian-reference-en "
              "debian-reference-fr debian-reference-ja fortunes-ru", file=sys.stderr)
        return 1
    for name in args.sources:
        fn, sep = SOURCES[name]
        out = os.path.join(args.out_dir, f"{name}.jsonl")
        docs, total = build(fn(), name, out, args.max_bytes, args.doc_bytes, sep)
        print(f"{name:>5}: {docs:5d} documents, {total / 1e3:7.1f} kB text -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
