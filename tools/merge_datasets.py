#!/usr/bin/env python3
"""Merge indexed datasets preprocessed in shards into one dataset.

    python tools/merge_datasets.py --input data/shards/en_00_text_document data/shards/en_01_text_document \\
        --output-prefix data/mc4/global_tok/en_text_document
    python tools/merge_datasets.py --input-dir data/shards --pattern 'en_*_text_document' \\
        --output-prefix data/mc4/global_tok/en_text_document

The parts are concatenated in the order given; with ``--input-dir`` in the order of their names
with digit runs compared as numbers (``shard_2`` before ``shard_10``; the count, the first and
last names and the order are printed). ``--input-dir`` refuses a matching part that is still
being written or whose run was killed (only its temporary files, ``NAME.bin.tmp`` ..., or its
``--partitions`` directory are there), and a gap in the numbering of the names (``en_000``,
``en_002``: ``en_001`` missing, e.g. its run failed) unless ``--allow-gaps`` is given.
Merged in the order the jsonl was split, the ``.bin``, ``.idx`` and ``.bytes.npy`` are
byte for byte those that tools/preprocess_data.py writes from the whole jsonl in one go.
``--output-prefix`` is the merged dataset's whole prefix (nothing is appended to it).

Every part needs its ``.bytes.npy`` and ``.tokenizer.json`` (tools/preprocess_data.py writes
both); parts made with different tokenizers (the records' type and checksum) or token dtypes,
or with and without --append-eod or from different --json-keys (the records' ``append_eod`` and
``json_key``) are refused, naming the part and the field, as is an output prefix that is one of
the inputs, all before anything is written. Records older than ``append_eod``/``json_key`` lack
them: such parts merge only among themselves (how they were made is unknown). The output's ``.tokenizer.json`` names the tokenizer, adds up
the parts' round-trip and input counts and lists the parts (``merged_from``). Files are read in
chunks (memory does not grow with the data) and written under temporary names, renamed when
complete, the ``.idx`` last; Ctrl-C or SIGTERM removes them (further ones are ignored until
that is done). Errors are one ``error:`` line and
exit status 2, with nothing written; interrupted: exit status 130 (Ctrl-C) or 143 (SIGTERM).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dept_mega.data.merge import MergeError, human_size, merge  # noqa: E402
from dept_mega.data.merge_find import find_parts, numbering_gaps  # noqa: E402
from dept_mega.data.stop_signals import Terminated, stop_on_signals  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", nargs="+", metavar="PREFIX",
                     help="the parts' prefixes (without .bin/.idx), merged in this order")
    src.add_argument("--input-dir", metavar="DIR",
                     help="merge the datasets in DIR (NAME.bin + NAME.idx), in name order, digit runs as numbers")
    p.add_argument("--pattern", default="*",
                   help="with --input-dir: a glob the NAMEs must match (default *), e.g. 'en_*_text_document'")
    p.add_argument("--allow-gaps", action="store_true",
                   help="with --input-dir: merge even when the numbering of the matched NAMEs has a gap (en_000, "
                        "en_002: en_001 missing), which is refused by default (a shard that failed or has not run)")
    p.add_argument("--output-prefix", required=True, help="the merged dataset's prefix (writes PREFIX.bin, .idx, ...)")
    p.add_argument("--force", action="store_true", help="replace an existing dataset at --output-prefix")
    p.add_argument("--log-interval", type=float, default=10.0, help="seconds between progress lines")
    p.add_argument("--quiet", action="store_true", help="no progress or summary lines")
    args = p.parse_args(argv)
    if args.pattern != "*" and args.input_dir is None:
        p.error("--pattern needs --input-dir")
    if args.allow_gaps and args.input_dir is None:
        p.error("--allow-gaps needs --input-dir")
    return args


def _names(prefixes, limit: int = 8) -> str:
    names = [os.path.basename(x) for x in prefixes]
    if len(names) <= limit:
        return ", ".join(names)
    return ", ".join(names[:limit // 2]) + f", ... ({len(names) - limit} more), " + ", ".join(names[-limit // 2:])


def _numbering(prefixes) -> str:
    gaps = numbering_gaps([os.path.basename(x) for x in prefixes])
    if gaps is None:
        return "not checked (the names differ in their text or in more than one digit run)"
    count, missing = gaps
    if not count:
        return "no gaps"
    return f"{count} missing (--allow-gaps): {', '.join(missing)}{', ...' if count > len(missing) else ''}"


def main(argv=None) -> int:
    args = parse_args(argv)
    log = (lambda m: None) if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    # SIGTERM unwinds like Ctrl-C (the merge removes its temporary files); a second one is ignored
    with stop_on_signals():
        try:
            if args.input_dir is not None:
                prefixes = find_parts(args.input_dir, args.pattern, allow_gaps=args.allow_gaps)
                log(f"[merge] {len(prefixes)} parts from {args.input_dir}, first {os.path.basename(prefixes[0])}, "
                    f"last {os.path.basename(prefixes[-1])}; in name order (digit runs as numbers): "
                    f"{_names(prefixes)}")
                log(f"[merge] numbering: {_numbering(prefixes)}")
            else:
                prefixes = args.input
            st = merge(prefixes, args.output_prefix, force=args.force, log=log,
                       progress_interval=args.log_interval)
        except MergeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("interrupted; no output written", file=sys.stderr)
            return 130
        except Terminated:
            print("terminated (SIGTERM); no output written", file=sys.stderr)
            return 143
    el = max(st.seconds, 1e-9)
    log(f"[merge] done: {st.parts} parts, {st.documents} documents, {st.tokens} tokens, {human_size(st.bin_bytes)} "
        f"in {st.seconds:.1f}s ({st.bin_bytes / el / 1e6:.0f} MB/s)")
    log(f"[merge] wrote {', '.join(st.outputs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
