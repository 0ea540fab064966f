#!/usr/bin/env python
"""Write docs/config.md, the configuration reference, from dept_mega/config_schema.py.

    python tools/gen_config_doc.py           # (re)write docs/config.md
    python tools/gen_config_doc.py --check   # exit 1 when docs/config.md is not up to date

A key's meaning is the ``#:`` comment of its dataclass field; a field without one is an error.
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from dept_mega.config_doc import render  # noqa: E402

DOC = os.path.join(ROOT, "docs", "config.md")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare instead of writing")
    ap.add_argument("--out", default=DOC, help="the page to write or check (default: docs/config.md)")
    args = ap.parse_args(argv)
    try:
        text = render()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.check:
        try:
            with open(args.out, encoding="utf-8") as f:
                current = f.read()
        except OSError:
            current = None
        if current != text:
            print(f"error: {args.out} is not up to date with dept_mega/config_schema.py; run "
                  "python tools/gen_config_doc.py", file=sys.stderr)
            return 1
        return 0
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
