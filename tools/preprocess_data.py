#!/usr/bin/env python3
"""Tokenize jsonl into Megatron indexed datasets.

    python tools/preprocess_data.py --input A.jsonl --json-keys text \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model PREFIX.model \\
        --output-prefix OUT --workers N --append-eod        # OUT_text_document.{bin,idx}

``--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR_OR_tokenizer.json`` reads a Hugging
Face ``tokenizers`` file locally and writes what Megatron-LM's preprocess_data.py writes for the
same tokenizer (its special tokens added, EOS from tokenizer_config.json). Progress lines give
the percent of the input read and an ETA.

``--input`` files may be compressed (gzip, bzip2, xz; zstd with the ``zstandard`` package),
recognised by their first bytes and decompressed as they are read; progress counts their bytes
on disk. ``--partitions P`` needs plain files (it cuts them at byte offsets): the P parts are
tokenized side by side, each in its own process with its share of ``--workers`` (at most
``--workers`` parts at once), written in OUT.partitions.tmp/ (the run's own directory,
removed when it ends), then merged in order into the same files as without it.

Also writes OUT_text_document.bytes.npy (UTF-8 bytes per document, for bits per byte) and
OUT_text_document.tokenizer.json (the tokenizer's type, path and sha256: a config naming
another tokenizer for this data is refused before training; ``append_eod`` and ``json_key``:
tools/merge_datasets.py refuses shards made otherwise; and the round trip: how many
documents do not come back from their tokens, ``decode(encode(text)) != text``, and their
bytes). Bits per byte are always measured against the original bytes, so a lossy tokenizer
(SentencePiece's default ``nmt_nfkc`` normalization collapses whitespace and drops newlines)
is charged for bytes its tokens do not encode; the summary line says how many documents
that concerns, and training's pre-flight warns about such data. Decoding every document
costs CPU (docs/performance.md, "Preprocessing"): ``--round-trip-every K`` checks only the
documents on every K-th input line (lines 1, K+1, 2K+1, ... of the inputs in order, whatever
``--workers`` and ``--partitions``), ``--round-trip-every 0`` none; the summary line and the
record then say how many were checked (``lossless`` is null unless all were).
Bad input lines (invalid JSON, missing key, non-string value, empty text, invalid UTF-8,
byte-order mark, CRLF) are counted by kind and reported at the end (stderr, also with
``--quiet``) with their first line numbers and how many more; see dept_mega/data/jsonl.py for
what is kept and what is skipped. The skipped counts are recorded in the tokenizer record
(``input``), and training's pre-flight warns about data that lacks lines. ``--strict`` makes
any of them an error. An input that leaves no document (empty, or all bad lines) is an
error too unless ``--allow-empty``, which writes an empty dataset for tools/merge_datasets.py
(a shard that came out empty): megatron-core cannot open an empty ``.bin``. Errors are one ``error:`` line and exit status 2, with no
output written; an output path that cannot be written is refused before tokenizing.

A rerun into an existing ``--output-prefix`` first removes all of the earlier run's files
there (it says which), before writing anything, so a run that is stopped part way never
leaves data that looks complete beside a record of other data. Only the exact names of
OUT's files and OUT.partitions.tmp/ are removed: other datasets whose names start with OUT
(shards such as OUT_part3 made for tools/merge_datasets.py) are kept. Ctrl-C (exit status 130) and
SIGTERM (a batch system's end of job; exit status 143) remove this run's partial files; any
further Ctrl-C or SIGTERM is ignored until they are removed.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dept_mega.log_lines import write_line  # noqa: E402
from dept_mega.data.preprocess import PreprocessError, preprocess, round_trip_line  # noqa: E402
from dept_mega.data.stop_signals import Terminated, stop_on_signals  # noqa: E402


def _every(value: str) -> int:
    """--round-trip-every: an integer >= 0, else argparse's usage error."""
    try:
        k = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer (K >= 0: 1 checks every document, "
                                         f"K the documents on every K-th line, 0 none)") from None
    if k < 0:
        raise argparse.ArgumentTypeError(f"{k} is negative (K >= 0: 1 checks every document, "
                                         f"K the documents on every K-th line, 0 none)")
    return k


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True,
                   help="jsonl file(s), read in order; gzip, bzip2, xz (and zstd with the zstandard package) "
                        "are decompressed")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="keys to tokenize (default: text)")
    p.add_argument("--tokenizer-type", default="SentencePieceTokenizer",
                   choices=["SentencePieceTokenizer", "HuggingFaceTokenizer"])
    p.add_argument("--tokenizer-model", required=True,
                   help="SentencePiece .model file, or (HuggingFaceTokenizer) a tokenizer.json or its directory; "
                        "read locally, nothing is downloaded")
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--workers", type=int, default=1, help="tokenizing processes (default 1: in-process)")
    p.add_argument("--partitions", type=int, default=1,
                   help="cut the (plain) input into this many contiguous parts, tokenize them side by side with "
                        "the --workers split among them, then merge (the output is the same; the parts, in "
                        "OUT.partitions.tmp/, take as much disk again until the merge); helps past about 10 workers")
    p.add_argument("--append-eod", action="store_true", help="append the tokenizer's EOS id to every document (recorded in the tokenizer record: "
                        "tools/merge_datasets.py refuses shards made with and without it)")
    p.add_argument("--strict", action="store_true", help="any bad input line is an error")
    p.add_argument("--allow-empty", action="store_true",
                   help="write an empty dataset when no document is left (default: an error); it is for "
                        "tools/merge_datasets.py (a shard that came out empty): megatron-core cannot open an "
                        "empty .bin (it memory-maps it), nor does training use a source without tokens")
    p.add_argument("--round-trip-every", type=_every, default=1, metavar="K",
                   help="decode the documents of every K-th input line to check decode(encode(text)) == text "
                        "(default 1: every document; 0: no check, the record says it was not checked)")
    p.add_argument("--log-interval", type=float, default=10.0, help="seconds between progress lines")
    p.add_argument("--quiet", action="store_true",
                   help="no progress or summary lines (the report of bad input lines is printed all the same)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    log = None if args.quiet else write_line
    # SIGTERM unwinds like Ctrl-C (the partial files are removed); a second one is ignored
    with stop_on_signals():
        try:
            st = preprocess(args.input, args.json_keys, args.tokenizer_model, args.output_prefix,
                            workers=args.workers, append_eod=args.append_eod, strict=args.strict,
                            partitions=args.partitions, log=log, progress_interval=args.log_interval,
                            allow_empty=args.allow_empty, tokenizer_type=args.tokenizer_type,
                            round_trip_every=args.round_trip_every)
        except PreprocessError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("interrupted; partial files removed, no output written", file=sys.stderr)
            return 130
        except Terminated:
            print("terminated (SIGTERM); partial files removed, no output written", file=sys.stderr)
            return 143
    if not args.quiet:
        el = max(st.seconds, 1e-9)
        print(f"[preprocess] done: {st.lines} lines, {st.documents} documents, {st.tokens} tokens, "
              f"{st.text_bytes} text bytes in {st.seconds:.2f}s ({st.documents / el:.0f} docs/s, "
              f"{st.tokens / el:.0f} tokens/s)", file=sys.stderr)
        for out, rt in zip(st.outputs, st.round_trip):
            print(f"[preprocess] wrote {out}.bin, {out}.idx, {out}.bytes.npy, {out}.tokenizer.json, "
                  f"{out}.token_range.json", file=sys.stderr)
            print(round_trip_line(out, rt, args.round_trip_every), file=sys.stderr)
    if st.tokens == 0:  # --allow-empty (also with --quiet: data that megatron-core cannot open)
        print(f"[preprocess] note: {', '.join(o + '.bin' for o in st.outputs)} holds no token: an empty dataset is "
              f"for tools/merge_datasets.py; megatron-core cannot open it (it memory-maps the .bin), nor does "
              f"training use it", file=sys.stderr)
    if st.report.total:  # also with --quiet: input left out of the data is never silent
        print(f"[preprocess] input problems: {st.report.skipped} of {st.lines} lines skipped (counts recorded in "
              f"{', '.join(o + '.tokenizer.json' for o in st.outputs)}; --strict stops at bad input instead):",
              file=sys.stderr)
        for line in st.report.lines():
            print(line, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
