#!/usr/bin/env python3
"""Train a SentencePiece tokenizer (unigram or BPE) from jsonl files.

    python tools/train_tokenizer.py --input A.jsonl [B.jsonl.gz ...] --json-key text \\
        --vocab-size N --model-type unigram|bpe --output-prefix PREFIX   # PREFIX.model, PREFIX.vocab

Compressed input (gzip, bzip2, xz; zstd with the ``zstandard`` package) is decompressed as it is read.

The tokenizer is lossless by default: decoding a document's tokens gives the document back,
byte for byte, so bits per byte (measured against the documents' original UTF-8 bytes) count
bits for bytes the tokens really encode, and code keeps its indentation and line structure:

* ``--normalization identity``: no Unicode normalization (SentencePiece's default
  ``nmt_nfkc`` rewrites full-width forms, ligatures, "…", control characters and newlines);
* whitespace kept as written (``remove_extra_whitespaces=False``), and pieces made only of
  spaces allowed (``allow_whitespace_only_pieces``: a 4- or 8-space indent can be one token);
* no dummy prefix: a document's first word is encoded like a line's first word, as written;
* "\\n" is a piece of its own (a user-defined symbol); "\\r", tabs and any other character
  roundtrip through the vocabulary or, if rare, byte fallback (``--byte-fallback``, on by
  default: 256 byte pieces; ``--no-byte-fallback`` turns unknown characters into ``<unk>``);
* the training "sentences" are a document's lines with only the "\\n" removed
  (indentation, trailing spaces and a CRLF's "\\r" kept); lines of only whitespace are skipped.

One character cannot roundtrip: U+2581 ("▁"), SentencePiece's space symbol, decodes as a
space. ``--normalization nmt_nfkc`` gives SentencePiece's defaults instead (NFKC, runs of
whitespace collapsed, newlines become spaces, dummy prefix, stripped training lines, byte
fallback only when asked): LOSSY, kept for tokenizers that must match older ones.
``tools/preprocess_data.py`` reports how many documents a tokenizer does not roundtrip.

With more sentences than ``--max-sentences`` a seeded reservoir sample of that many is used
(memory stays bounded for very large inputs): each input weighs in proportion to the sentences
read from it. ``--max-bytes-per-input N`` stops reading each input after its first N bytes, a
quota that keeps one large input (one big language) from dominating the sample. A line longer
than ``--max-sentence-length`` bytes (SentencePiece would skip it) is split into pieces under
the limit at whitespace, else between characters, so its text keeps its weight; the split
lines are counted and reported. Progress lines give the percent read and an ETA. Special ids: unk=0, bos=1, eos=2 (the
end-of-document token appended by ``preprocess_data.py --append-eod``), pad=3. Bad input
lines are counted and reported like in preprocess_data.py; ``--strict`` makes any of them an
error.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dept_mega.data.compressed import CompressedInputError, check_readable  # noqa: E402
from dept_mega.data.jsonl import BadInputReport  # noqa: E402
from dept_mega.data.tokenizer_sample import collect_sentences  # noqa: E402

NORMALIZATIONS = ("identity", "nmt_nfkc")


def spm_options(normalization: str, byte_fallback: bool) -> dict:
    """SentencePiece trainer options of a ``--normalization`` (see the module docstring)."""
    if normalization == "nmt_nfkc":
        return {"normalization_rule_name": "nmt_nfkc", "byte_fallback": byte_fallback}
    return {"normalization_rule_name": "identity", "remove_extra_whitespaces": False,
            "add_dummy_prefix": False, "allow_whitespace_only_pieces": True,
            "user_defined_symbols": ["\n"], "byte_fallback": byte_fallback}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="jsonl file(s), one JSON object per line")
    p.add_argument("--json-key", "--json-keys", dest="json_key", default="text",
                   help="key holding the text (default: text; --json-keys, preprocess_data.py's name, is accepted)")
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--model-type", choices=("unigram", "bpe"), default="unigram")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--normalization", choices=NORMALIZATIONS, default="identity",
                   help="identity (default): lossless, whitespace and newlines kept; nmt_nfkc: SentencePiece's "
                        "defaults (NFKC, whitespace collapsed, newlines lost, dummy prefix): LOSSY")
    p.add_argument("--byte-fallback", action=argparse.BooleanOptionalAction, default=None,
                   help="unknown characters become UTF-8 byte pieces instead of <unk> (adds 256 ids); "
                        "default: on with --normalization identity, off with nmt_nfkc")
    p.add_argument("--character-coverage", type=float, default=0.9995,
                   help="share of characters the vocabulary must cover (default 0.9995)")
    p.add_argument("--max-sentences", type=int, default=2_000_000,
                   help="train on at most this many sentences (a seeded reservoir sample of all sentences read: "
                        "each input weighs in proportion to its sentences read; a 250k vocabulary wants about "
                        "10 million, see docs/launching.md)")
    p.add_argument("--max-sentence-length", type=int, default=8192,
                   help="longest training sentence in UTF-8 bytes (SentencePiece's max_sentence_length); a longer "
                        "line is split into pieces under it at whitespace, else between characters, so its text "
                        "keeps its weight (counted and reported; default 8192, about 2700 CJK characters)")
    p.add_argument("--max-bytes-per-input", type=int, default=None, metavar="N",
                   help="stop reading each input after its first N bytes (decompressed, whole lines): a quota "
                        "per input, so that one large input (one big language) does not dominate the sample; "
                        "default: read every input to its end")
    p.add_argument("--seed", type=int, default=1234, help="seed of the sentence sample")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--strict", action="store_true", help="any bad input line is an error")
    p.add_argument("--verbose", action="store_true", help="show SentencePiece's own training log")
    p.add_argument("--log-interval", type=float, default=5.0,
                   help="seconds between progress lines while reading (percent of the input and ETA; default 5)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import sentencepiece as spm
    if args.byte_fallback is None:
        args.byte_fallback = args.normalization == "identity"

    for path in args.input:
        if not os.path.isfile(path):
            print(f"error: input file {path!r} does not exist", file=sys.stderr)
            return 2
        try:  # gzip / bzip2 / xz / zstd input is decompressed as it is read
            check_readable(path)
        except CompressedInputError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if args.vocab_size < 8:
        print(f"error: --vocab-size {args.vocab_size} is too small (special ids alone take 4)", file=sys.stderr)
        return 2
    if args.max_sentences < 1:
        print("error: --max-sentences must be >= 1", file=sys.stderr)
        return 2
    if args.max_sentence_length < 4:  # a UTF-8 character takes up to 4 bytes
        print(f"error: --max-sentence-length {args.max_sentence_length} must be >= 4 (bytes)", file=sys.stderr)
        return 2
    if args.max_bytes_per_input is not None and args.max_bytes_per_input < 1:
        print(f"error: --max-bytes-per-input {args.max_bytes_per_input} must be >= 1", file=sys.stderr)
        return 2
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(out_dir, exist_ok=True)

    t0 = time.time()
    report = BadInputReport()
    try:
        sample, st = collect_sentences(
            args.input, args.json_key, report, normalization=args.normalization, max_sentences=args.max_sentences,
            seed=args.seed, max_sentence_length=args.max_sentence_length,
            max_bytes_per_input=args.max_bytes_per_input, interval=args.log_interval,
            log=lambda m: print(m, file=sys.stderr, flush=True))
    except CompressedInputError as exc:  # a damaged compressed stream: nothing written
        print(f"error: {exc}; nothing written", file=sys.stderr)
        return 2
    if report.total and args.strict:
        print("error: bad input lines and --strict given: nothing written; found:", file=sys.stderr)
        for line in report.lines(found=True):
            print(line, file=sys.stderr)
        return 2  # bad input, as preprocess_data.py --strict
    if report.total:  # always printed (this tool has no --quiet): input left out is never silent
        print(f"[train_tokenizer] input problems: {report.skipped} lines skipped:", file=sys.stderr)
        for line in report.lines():
            print(line, file=sys.stderr)
    if not sample:
        print(f"error: no text found under key {args.json_key!r} in {', '.join(args.input)}", file=sys.stderr)
        return 2
    docs, seen = st.documents, st.sentences
    for rd in st.inputs:
        if rd.stopped:
            print(f"[train_tokenizer] {rd.path}: stopped after its first {rd.bytes} bytes (--max-bytes-per-input "
                  f"{args.max_bytes_per_input}; {rd.position} of its {rd.size} bytes on disk read)", file=sys.stderr)
    if st.long_lines:
        print(f"[train_tokenizer] {st.long_lines} lines longer than --max-sentence-length {args.max_sentence_length} "
              f"bytes were split into {st.long_pieces} sentences at whitespace or between characters (their text "
              f"kept; a larger --max-sentence-length keeps such lines whole)", file=sys.stderr)
    capped = f" (sampled {len(sample)} of {seen})" if seen > len(sample) else ""
    lossy = "; LOSSY: decoding does not give the text back" if args.normalization != "identity" else ""
    print(f"[train_tokenizer] {docs} documents, {seen} sentences{capped} read in {time.time() - t0:.1f}s; "
          f"training {args.model_type} with vocab {args.vocab_size}, normalization {args.normalization}, "
          f"byte fallback {'on' if args.byte_fallback else 'off'}{lossy}", file=sys.stderr, flush=True)

    t1 = time.time()
    model_file = args.output_prefix + ".model"
    tmp_prefix = args.output_prefix + ".tmp"
    try:
        spm.SentencePieceTrainer.Train(
            sentence_iterator=iter(sample),
            model_prefix=tmp_prefix,
            vocab_size=args.vocab_size,
            model_type=args.model_type,
            character_coverage=args.character_coverage,
            **spm_options(args.normalization, args.byte_fallback),
            unk_id=0, bos_id=1, eos_id=2, pad_id=3,
            input_sentence_size=0,  # we sampled already
            shuffle_input_sentence=False,
            max_sentence_length=args.max_sentence_length,
            num_threads=max(1, args.threads),
            minloglevel=0 if args.verbose else 2,
        )
    except RuntimeError as exc:
        msg = str(exc)
        high = re.search(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)", msg)
        low = re.search(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)", msg)
        if high:
            print(f"error: --vocab-size {high.group(1)} is too large for this corpus: SentencePiece can make "
                  f"at most {high.group(2)} pieces from these {len(sample)} sentences. Use --vocab-size "
                  f"<= {high.group(2)}, or give it more text.", file=sys.stderr)
        elif low:
            fb = (" (256 of them byte fallback's byte pieces: --no-byte-fallback drops them, and characters "
                  "outside the vocabulary then become <unk>, which is lossy)") if args.byte_fallback else ""
            print(f"error: --vocab-size {low.group(1)} is too small: the special pieces and the characters "
                  f"this corpus needs take {low.group(2)} ids{fb}. Use --vocab-size >= {low.group(2)}.",
                  file=sys.stderr)
        else:
            print(f"error: SentencePiece training failed: {msg}", file=sys.stderr)
        for ext in (".model", ".vocab"):
            if os.path.exists(tmp_prefix + ext):
                os.remove(tmp_prefix + ext)
        return 1
    os.replace(tmp_prefix + ".vocab", args.output_prefix + ".vocab")
    os.replace(tmp_prefix + ".model", model_file)

    sp = spm.SentencePieceProcessor(model_file=model_file)
    print(f"[train_tokenizer] wrote {model_file} and {args.output_prefix}.vocab: {sp.get_piece_size()} pieces, "
          f"unk={sp.unk_id()} bos={sp.bos_id()} eos={sp.eos_id()} pad={sp.pad_id()}, "
          f"trained in {time.time() - t1:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
