#!/usr/bin/env python3
"""Write PREFIX.bytes.npy for a .bin/.idx pair from Megatron-LM's preprocess_data.py, from the jsonl it was made from.

    python tools/add_byte_counts.py --prefix data/corpus_text_document --input corpus.jsonl \\
        [--json-key text] [--partitions P [--keep-sequential-samples]] \\
        [--tokenizer-model tok.model [--tokenizer-type SentencePieceTokenizer] --check 1000 [--append-eod]]

Evaluation's bits per byte need each document's UTF-8 byte count, which Megatron-LM's
preprocessing does not write. This counts them from the original jsonl without tokenizing it
again. The line count must equal the .idx's document count (Megatron makes one document of
every line); any line Megatron's preprocessing would have stopped on (blank, invalid JSON or
UTF-8, missing key) is an error naming it; ``--partitions`` (the value preprocessing ran with)
gives the document order of partitioned runs. A compressed input (``corpus.jsonl.gz``, as
Megatron's ``--partitions`` reads it; bzip2, xz, zstd too) is decompressed as it is read. ``--check N`` re-tokenizes the first N documents
and compares their token counts with the .idx (pass ``--append-eod`` when preprocessing did).
The file is written under a temporary name and renamed; errors are one ``error:`` line and exit
status 2, with nothing written. See dept_mega/data/byte_counts.py for the rules.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dept_mega.data.byte_counts import ByteCountError, add_byte_counts, open_for_check, summary  # noqa: E402
from dept_mega.data.indexed import IndexedFormatError  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prefix", required=True, help="the dataset path without .bin/.idx")
    p.add_argument("--input", nargs="+", required=True,
                   help="the jsonl file(s) the data was made from, in the order preprocessing read them")
    p.add_argument("--json-key", default="text", help="the key that was tokenized (default: text)")
    p.add_argument("--partitions", type=int, default=1, help="Megatron's --partitions when the data was made")
    p.add_argument("--keep-sequential-samples", action="store_true",
                   help="Megatron's --keep-sequential-samples was given (partitions keep the input order)")
    p.add_argument("--tokenizer-type", default="SentencePieceTokenizer",
                   choices=["SentencePieceTokenizer", "HuggingFaceTokenizer"])
    p.add_argument("--tokenizer-model", default=None, help="the tokenizer the data was made with (for --check)")
    p.add_argument("--check", type=int, default=0, metavar="N",
                   help="re-tokenize the first N documents and compare token counts with the .idx")
    p.add_argument("--append-eod", action="store_true", help="preprocessing appended an EOD to every document")
    p.add_argument("--force", action="store_true", help="replace an existing PREFIX.bytes.npy")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.check < 0:
        print(f"error: --check must be >= 0, got {args.check}", file=sys.stderr)
        return 2
    try:
        tok = open_for_check(args.tokenizer_type, args.tokenizer_model) if args.check else None
        res = add_byte_counts(args.prefix, args.input, args.json_key, partitions=args.partitions,
                              keep_sequential=args.keep_sequential_samples, tokenizer=tok,
                              append_eod=args.append_eod, check=args.check, force=args.force)
    except (ByteCountError, IndexedFormatError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    summary(res, lambda m: print(m, file=sys.stderr), args.prefix)
    return 0


if __name__ == "__main__":
    sys.exit(main())
