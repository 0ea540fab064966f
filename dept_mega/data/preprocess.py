"""jsonl -> Megatron indexed dataset: the engine behind ``tools/preprocess_data.py``.

The main process streams raw lines from the input in batches; worker processes parse,
check and tokenize a batch each; the main process writes results strictly in input order.
At most ``4 * workers`` batches are in flight, so memory stays bounded whatever the input
size (the per-document index, 12 bytes a document, is the only thing that grows).
With ``partitions > 1`` the input is cut into that many contiguous byte ranges
(:mod:`dept_mega.data.partitions`), tokenized side by side in child processes that share the
workers, each written as its own dataset in a directory of the run's own beside the output
(``OUT.partitions.tmp``, :mod:`dept_mega.data.preprocess_outputs`) and then merged in order (the
directory is removed). Compressed input
(gzip, bzip2, xz; zstd with the ``zstandard`` package) is decompressed as it is read
(:mod:`dept_mega.data.compressed`; progress counts its bytes on disk); it cannot be cut into
partitions.

Outputs per key: ``OUT_{key}_document.bin/.idx`` (Megatron format, uint16 tokens when the
vocabulary has < 65500 ids, else int32) and ``OUT_{key}_document.bytes.npy`` (int64 UTF-8
byte count of each kept document's text, for bits per byte). What is kept or skipped for
each kind of bad input is listed in :mod:`dept_mega.data.jsonl`.
"""
from __future__ import annotations

import collections
import itertools
import json
import os
import time
from dataclasses import dataclass, field
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

from dept_mega.data.compressed import STREAM_ERRORS, CompressedInputError, check_readable, damaged, open_input
from dept_mega.data.indexed import (IndexedDatasetBuilder, optimal_dtype, tokenizer_record_path)
from dept_mega.data.jsonl import BadInputReport, parse_line
from dept_mega.log_lines import write_line
from dept_mega.data import partitions as _partitions
from dept_mega.data.partitions import Range, part_starts, partition_ranges, run_in_processes
from dept_mega.data.preprocess_outputs import (PreprocessError, check_output, make_partitions_dir,
                                              output_prefix_for, part_prefix, remove_earlier_run, remove_outputs,
                                              remove_partitions_dir)
from dept_mega.data.stop_signals import ignore_signals, raise_if_stopped
from dept_mega.data.token_range import record_token_range
from dept_mega.data.tokenizer import TokenizerError, model_sha256, open_tokenizer
from dept_mega.data.workers import WorkerDied, Workers

BATCH_LINES = 512
BATCH_BYTES = 4 << 20


@dataclass
class RoundTrip:
    """Of one output key's ``documents`` (``bytes``: their UTF-8 bytes), the ``checked`` ones
    (``checked_bytes``; all of them unless ``--round-trip-every`` K > 1 samples them, none when
    K = 0): how many do not come back from their tokens (``decode(encode(text)) != text``: a
    lossy tokenizer), their UTF-8 bytes, and the bytes their decoded texts have instead (the
    net change is a lower bound of what was lost)."""
    documents: int = 0
    bytes: int = 0
    checked: int = 0
    checked_bytes: int = 0
    mismatched_documents: int = 0
    mismatched_bytes: int = 0
    mismatched_decoded_bytes: int = 0

    def add(self, other: "RoundTrip") -> None:
        for k, v in vars(other).items():
            setattr(self, k, getattr(self, k) + v)

    @property
    def lossless(self) -> Optional[bool]:
        """False: some checked document does not come back; True: every document was checked
        and comes back; None: no mismatch among the checked ones, but not all were checked
        (a sample, or none), so nothing is certain."""
        if self.mismatched_documents:
            return False
        return True if self.checked == self.documents else None


@dataclass
class PreprocessStats:
    lines: int = 0
    documents: int = 0
    tokens: int = 0
    text_bytes: int = 0
    seconds: float = 0.0
    input_bytes: int = 0  # read so far, of total_bytes (progress: percent and ETA)
    total_bytes: int = 0
    report: BadInputReport = field(default_factory=BadInputReport)
    outputs: list[str] = field(default_factory=list)
    # per key (in --json-keys order): the documents that do not round-trip
    round_trip: list[RoundTrip] = field(default_factory=list)
    # per key: the smallest and largest token id written ((0, -1): none), cached beside the data
    # (data/token_range.py) so that the start-up check need not read the .bin again
    id_range: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class _BatchResult:
    lines: int
    # per key: concatenated tokens, per-document lengths, per-document byte counts
    tokens: list[np.ndarray]
    lengths: list[np.ndarray]
    nbytes: list[np.ndarray]
    round_trip: list[RoundTrip]
    report: BadInputReport


# Worker-process state, set once per process by the workers' initializer (the tokenizer is too
# costly to ship with every batch).
_WORKER: dict = {}


def _init_worker(model: str, keys: Sequence[str], append_eod: bool, dtype,
                 tokenizer_type: str = "SentencePieceTokenizer", round_trip_every: int = 1) -> None:
    _WORKER.update(tok=open_tokenizer(tokenizer_type, model), keys=tuple(keys), append_eod=append_eod, dtype=dtype,
                   every=round_trip_every)


def _start_workers(workers: int, init_args: tuple) -> Workers:
    """``workers`` tokenizing processes (:mod:`dept_mega.data.workers`: Ctrl-C and SIGTERM to
    the whole process group, or to the tool alone, stop them without waiting for ever)."""
    return Workers(workers, _encode_batch, _init_worker, init_args, name="tokenizer")


def checks_line(line: int, every: int) -> bool:
    """Whether the documents of input line ``line`` (0-based, counted over all inputs in order,
    bad lines included) are round-trip checked under ``--round-trip-every every``: lines 0, K,
    2K, ... (the 1st, (K+1)-th, ... line), whatever ``--workers`` and ``--partitions``."""
    return every > 0 and line % every == 0


def _encode_batch(batch: list[tuple[str, bytes]], first_line: int = 0) -> _BatchResult:
    """Parse, tokenize and round-trip check one batch; ``first_line``: the 0-based index of its
    first line in the whole input (which lines are checked, :func:`checks_line`)."""
    tok = _WORKER["tok"]
    keys, append_eod, dtype, every = _WORKER["keys"], _WORKER["append_eod"], _WORKER["dtype"], _WORKER["every"]
    report = BadInputReport()
    kept: list[list[str]] = []
    checked: list[int] = []  # indices into kept
    for i, (where, raw) in enumerate(batch):
        texts = parse_line(raw, keys, where, report)
        if texts is not None:
            if checks_line(first_line + i, every):
                checked.append(len(kept))
            kept.append(texts)
    tokens, lengths, nbytes, lossy = [], [], [], []
    eod = [tok.eos_id] if append_eod else []
    for k in range(len(keys)):
        texts = [t[k] for t in kept]
        ids = tok.encode_batch(texts) if texts else []
        sizes = np.fromiter((len(t.encode("utf-8")) for t in texts), dtype=np.int64, count=len(texts))
        lossy.append(_round_trip(tok, texts, ids, sizes, checked))
        if append_eod:
            ids = [x + eod for x in ids]
        lens = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=int(lens.sum()))
        tokens.append(flat)
        lengths.append(lens)
        nbytes.append(sizes)
    return _BatchResult(len(batch), tokens, lengths, nbytes, lossy, report)


def _round_trip(tok, texts: list[str], ids: list[list[int]], sizes: np.ndarray, checked: list[int]) -> RoundTrip:
    """Of the documents ``texts`` (``sizes``: their UTF-8 bytes), those at the indices ``checked``
    whose tokens ``ids`` do not decode to them (decoding costs a part of encoding; sampling is
    what --round-trip-every saves)."""
    out = RoundTrip(documents=len(texts), bytes=int(sizes.sum()), checked=len(checked))
    if not checked:
        return out
    all_checked = len(checked) == len(texts)
    back_all = tok.decode_batch(ids if all_checked else [ids[i] for i in checked])
    for i, back in zip(checked, back_all):
        n = int(sizes[i])
        out.checked_bytes += n
        if back != texts[i]:
            out.mismatched_documents += 1
            out.mismatched_bytes += n
            out.mismatched_decoded_bytes += len(back.encode("utf-8"))
    return out


@contextmanager
def _open_range(path: str, start: int, end: int, lines_at: Optional[dict] = None):
    """(lines, position) of one input range: ``lines`` yields (``file:line``, raw line) and
    ``position()`` is how far into the file on disk reading has got (a compressed input is
    always one whole range: its compressed bytes, which is what the progress counts).
    ``lines_at``: {path: (offset, lines before it)} where earlier ranges of the file ended;
    the line numbers of a range that starts there need no count (else the newlines from the
    nearest earlier end, or from the start of the file, are counted); updated at the end."""
    with open_input(path) as (stream, raw):
        if stream is raw:  # plain: read by byte offsets
            lines_at = {} if lines_at is None else lines_at
            known, lineno = lines_at.get(path, (0, 0))
            if known > start:
                known, lineno = 0, 0
            lineno += _partitions.count_newlines(path, known, start) if start > known else 0
            raw.seek(start)

            def lines():
                nonlocal lineno
                pos = start
                while pos < end:
                    line = raw.readline()
                    if not line:
                        break
                    pos += len(line)
                    lineno += 1
                    yield f"{path}:{lineno}", line
                lines_at[path] = (pos, lineno)
        else:
            def lines():
                lineno = 0
                try:
                    for line in stream:
                        lineno += 1
                        yield f"{path}:{lineno}", line
                except STREAM_ERRORS as exc:
                    raise PreprocessError(str(damaged(path, lineno, exc))) from None
        yield lines(), raw.tell


def _iter_batches(ranges: Sequence[Range], lines_at: Optional[dict] = None
                  ) -> Iterator[tuple[list[tuple[str, bytes]], int]]:
    """Batches of (``file:line``, raw line), each with the bytes on disk read for it;
    ``lines_at``: :func:`_open_range`'s."""
    batch: list[tuple[str, bytes]] = []
    size = disk = 0
    for path, start, end in ranges:
        with _open_range(path, start, end, lines_at) as (lines, position):
            taken = start
            for where, raw in lines:
                batch.append((where, raw))
                size += len(raw)
                if len(batch) >= BATCH_LINES or size >= BATCH_BYTES:
                    now = position()
                    disk, taken = disk + now - taken, now
                    yield batch, disk
                    batch, size, disk = [], 0, 0
            disk += max(end - taken, 0)  # the rest of the range (a compressed file's read-ahead, its end)
    if batch:
        yield batch, disk


def round_trip_line(output: str, rt: RoundTrip, every: int = 1) -> str:
    """The summary line of one output's round trip (tools/preprocess_data.py prints it);
    ``every``: the run's --round-trip-every, named when not every document was checked."""
    if every == 0:
        return (f"[preprocess] {output}: round trip not checked (--round-trip-every 0): whether the tokenizer "
                f"gives the {rt.documents} documents back (decode(encode(text)) == text) is unknown")
    sample = "" if rt.checked == rt.documents else (
        f" (--round-trip-every {every}: the documents on input lines 1, {1 + every}, {1 + 2 * every}, ...; "
        f"{rt.documents - rt.checked} not checked)")
    if rt.lossless:
        return (f"[preprocess] {output}: all {rt.documents} documents round-trip "
                f"(decode(encode(text)) == text): the tokenizer is lossless on this data")
    if rt.lossless is None:
        return (f"[preprocess] {output}: no mismatch in {rt.checked} checked documents of {rt.documents}"
                f"{sample}: decode(encode(text)) == text for each checked one")
    share = 100.0 * rt.mismatched_bytes / max(rt.checked_bytes, 1)
    change = 100.0 * (rt.mismatched_decoded_bytes - rt.mismatched_bytes) / max(rt.mismatched_bytes, 1)
    of = f"{rt.documents} documents" if not sample else f"{rt.checked} checked documents of {rt.documents}{sample}"
    return (f"[preprocess] warning: {output}: {rt.mismatched_documents} of {of} do not "
            f"round-trip (decode(encode(text)) != text: a lossy tokenizer); they hold {share:.1f} % of the "
            f"{rt.checked_bytes} {'checked ' if sample else ''}bytes and decode to {rt.mismatched_decoded_bytes} "
            f"bytes for their {rt.mismatched_bytes} ({change:+.1f} %); bits per byte are measured against the "
            f"original bytes, including bytes the tokens do not encode")


def input_record(inputs: Sequence[str], lines: int, report: BadInputReport) -> dict:
    """The ``input`` field of ``PREFIX.tokenizer.json``: the input files (absolute paths), the
    lines read, and the lines skipped as bad input (``skipped``, and ``skipped_by_kind``: only
    the kinds seen), so that the pre-flight can warn about data that lacks them
    (dept_mega/data/checks.py)."""
    return {"files": [os.path.abspath(p) for p in inputs], "lines": lines, "skipped": report.skipped,
            "skipped_by_kind": report.skipped_by_kind()}


def _write_tokenizer_record(prefix: str, tokenizer_type: str, tokenizer_model: str, sha256: str,
                            round_trip: RoundTrip, every: int, source: Optional[dict], *, append_eod: bool,
                            json_key: str) -> None:
    """``PREFIX.tokenizer.json``: which tokenizer made the data (checked against the config's
    before training, dept_mega/data/checks.py), how (``append_eod``: whether each document ends
    with the EOS id, ``json_key``: the jsonl key tokenized; tools/merge_datasets.py refuses
    parts that differ in them), and whether it gave every document back
    (``lossless``: true, false, or null when not every document was checked and none of the
    checked ones failed; ``round_trip``: the counts, ``checked`` of ``documents`` and
    ``every``, the --round-trip-every K; warned about before training); ``input``: what was
    read and how many lines were skipped (:func:`input_record`; warned about before training).
    Written atomically (a temporary name, renamed), and before the data's ``.idx``
    (:func:`preprocess`): data that looks complete always has its record; a run stopped in
    between leaves a record without data, which the next run into the prefix removes."""
    path = tokenizer_record_path(prefix)
    record = {"tokenizer_type": tokenizer_type, "tokenizer_model": tokenizer_model, "sha256": sha256,
              "lossless": None if every == 0 else round_trip.lossless,  # 0 documents, unchecked: not "true"
              "round_trip": {**vars(round_trip), "every": every}, "append_eod": append_eod, "json_key": json_key}
    if source is not None:
        record["input"] = source
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


def preprocess(inputs: Sequence[str], keys: Sequence[str], tokenizer_model: str, output_prefix: str,
               workers: int = 1, append_eod: bool = False, strict: bool = False, partitions: int = 1,
               log: Optional[Callable[[str], None]] = write_line, progress_interval: float = 10.0,
               allow_empty: bool = False, tokenizer_type: str = "SentencePieceTokenizer",
               round_trip_every: int = 1) -> PreprocessStats:
    """Tokenize ``inputs`` into one indexed dataset per key. Raises :class:`PreprocessError`
    (also when no document is left, e.g. an empty or all-bad input: nothing is written then,
    unless ``allow_empty``). ``tokenizer_type``: SentencePieceTokenizer, or HuggingFaceTokenizer
    (``tokenizer_model``: a ``tokenizer.json`` or its directory; Megatron's encoding).
    ``round_trip_every``: decode the documents of every K-th input line to check they come
    back (1: all, the default; 0: none; :func:`checks_line`)."""
    log = log or (lambda msg: None)
    for path in inputs:
        if not os.path.exists(path):
            raise PreprocessError(f"input file {path!r} does not exist")
        if not os.path.isfile(path):  # a pipe (<(zcat ...)), a device, a directory
            raise PreprocessError(f"input {path!r} is not a regular file: the input is read by byte offsets "
                                  f"(progress, --partitions), so write a stream to a file first")
        try:  # compressed input (dept_mega.data.compressed): decompressed as it is read
            kind = check_readable(path)
        except CompressedInputError as exc:
            raise PreprocessError(str(exc)) from None
        if kind is not None and partitions > 1:
            raise PreprocessError(f"--partitions {partitions} cuts the input at byte offsets, which the "
                                  f"{kind}-compressed input {path!r} does not allow: use --partitions 1 (--workers "
                                  f"still tokenizes in parallel) or decompress the file first")
    if not keys:
        raise PreprocessError("no --json-keys given")
    repeated = sorted({k for k in keys if list(keys).count(k) > 1})
    if repeated:  # both would write OUT_<key>_document
        raise PreprocessError(f"--json-keys: key {repeated[0]!r} is given more than once; each key gives one dataset "
                              f"(OUT_{repeated[0]}_document), so give each once")
    if workers < 1 or partitions < 1:
        raise PreprocessError(f"--workers ({workers}) and --partitions ({partitions}) must be >= 1")
    if isinstance(round_trip_every, bool) or not isinstance(round_trip_every, int) or round_trip_every < 0:
        raise PreprocessError(f"--round-trip-every ({round_trip_every!r}) must be an integer >= 0")
    try:
        tok = open_tokenizer(tokenizer_type, tokenizer_model)
    except TokenizerError as exc:
        raise PreprocessError(str(exc)) from None
    if append_eod and tok.eos_id is None:
        raise PreprocessError(f"--append-eod: tokenizer {tokenizer_model!r} names no eos_token (tokenizer_config.json "
                              f"or special_tokens_map.json beside its tokenizer.json)")
    dtype = optimal_dtype(tok.vocab_size)
    stats = PreprocessStats(total_bytes=sum(os.path.getsize(p) for p in inputs),
                            round_trip=[RoundTrip() for _ in keys], id_range=[(0, -1) for _ in keys])
    finals = [output_prefix_for(output_prefix, k) for k in keys]
    check_output(output_prefix, finals, partitioned=partitions > 1)
    remove_earlier_run(output_prefix, keys, log)
    t0 = time.time()

    init_args = (tokenizer_model, tuple(keys), append_eod, dtype, tokenizer_type, round_trip_every)
    parts = partition_ranges(inputs, partitions) if partitions > 1 else \
        [[(p, 0, os.path.getsize(p)) for p in inputs]]
    pool = None
    partitioned = False  # whether this run made its partitions directory (removed in the finally)
    builders: list[IndexedDatasetBuilder] = []
    try:
        if len(parts) == 1:
            if workers > 1:
                pool = _start_workers(workers, init_args)
            else:
                _init_worker(*init_args)
            builders = _run_part(parts[0], finals, pool, dtype, strict, stats, log, progress_interval, t0)
            if pool is not None:
                pool.stop(finished=True)  # in the try: a signal meanwhile removes the (unfinished) outputs
        else:
            make_partitions_dir(output_prefix)  # the parts' own directory: no name beside the output
            partitioned = True  # only now: a directory another run made is not this run's to remove
            part_prefixes = [[part_prefix(output_prefix, pi, k) for k in keys] for pi in range(len(parts))]
            _run_partitions(parts, part_prefixes, workers, init_args, dtype, strict, stats, log, progress_interval,
                            t0)
            builders = [IndexedDatasetBuilder(final, dtype) for final in finals]
            for k, builder in enumerate(builders):
                for prefixes in part_prefixes:
                    builder.add_index(prefixes[k])
            log(f"[preprocess] merged {len(parts)} partitions")
        stats.seconds = time.time() - t0
        if stats.documents == 0 and not allow_empty:
            what = (f"{stats.lines} lines read, {stats.report.skipped} skipped as bad input: {stats.report.brief()}"
                    if stats.lines else "the input is empty")
            # one line (a tool's refusal before any output): the kinds with their first places
            raise PreprocessError(f"no documents to write ({what}); nothing written (--allow-empty writes an "
                                  f"empty dataset)")
        digest = model_sha256(tokenizer_model)
        source = input_record(inputs, stats.lines, stats.report)
        for k, final in enumerate(finals):  # the absolute path: the record is read from other working directories
            # the record before the data: data that looks complete always has its record
            _write_tokenizer_record(final, tokenizer_type, os.path.abspath(tokenizer_model), digest,
                                    stats.round_trip[k], round_trip_every, source, append_eod=append_eod,
                                    json_key=keys[k])
        for b in builders:
            b.finalize()
        for k, final in enumerate(finals):
            record_token_range(final, *stats.id_range[k])
    except BaseException:  # an error, Ctrl-C, SIGTERM (the tools raise it): no output of this run is left
        for b in builders:
            b.abort()
        remove_outputs(finals)
        raise
    finally:
        if pool is not None:
            pool.stop()  # at once after an error or a signal; nothing left to do after a finished run
        if partitioned:
            remove_partitions_dir(output_prefix)
    stats.outputs = finals
    return stats


def _eta(seconds: float) -> str:
    if seconds != seconds:  # nothing read yet
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _progress_line(stats: PreprocessStats, t0: float) -> str:
    el = max(time.time() - t0, 1e-9)
    done, total = stats.input_bytes, max(stats.total_bytes, 1)
    eta = el * (total - done) / done if done else float("nan")
    return (f"[preprocess] {100.0 * done / total:5.1f}% ({done / 1e6:.1f} of {total / 1e6:.1f} MB) | "
            f"{stats.documents} docs, {stats.tokens} tokens | {stats.documents / el:.0f} docs/s, "
            f"{stats.tokens / el:.0f} tokens/s, {done / el / 1e6:.1f} MB/s | ETA {_eta(eta)}")


def _part_child(q, index: int, ranges, prefixes, lines_at: dict, first_line: int, workers: int, init_args: tuple,
                dtype, strict: bool) -> None:
    """One partition in its own process (:func:`dept_mega.data.partitions.run_in_processes`):
    tokenize ``ranges`` into ``prefixes`` with ``workers`` processes (1: in this one), sending
    ("tick", disk bytes, documents, tokens) per batch, then ("stats", index, PreprocessStats)
    and ("done", index); an error is ("error", index, message). Ctrl-C or SIGTERM (the tool's
    handler, inherited), also while its workers are being stopped: the builders abort, the
    workers are stopped, and the process exits 1 at once, without a traceback and without
    Python's exit. Once its last message is sent, later signals are ignored: the process only
    exits."""
    pool = None
    try:
        try:
            if workers > 1:
                pool = _start_workers(workers, init_args)
            else:
                _init_worker(*init_args)
            keys = init_args[1]
            st = PreprocessStats(lines=first_line, round_trip=[RoundTrip() for _ in keys],
                                 id_range=[(0, -1) for _ in keys])
            builders = _run_part(ranges, prefixes, pool, dtype, strict, st, lambda m: None, float("inf"), 0.0,
                                 dict(lines_at), tick=lambda *t: q.put(("tick", *t)))
            if pool is not None:
                pool.stop(finished=True)
            for b in builders:
                b.finalize()
            st.lines -= first_line
            q.put(("stats", index, st))
            q.put(("done", index))
        except Exception as exc:  # noqa: BLE001 - sent to the parent, which stops the run with it
            q.put(("error", index, str(exc) if isinstance(exc, PreprocessError) else f"{type(exc).__name__}: {exc}"))
        finally:
            if pool is not None:
                pool.stop()
        ignore_signals()
    except BaseException:  # a signal, also one that cut the stop() in the finally short
        if pool is not None:
            pool.stop()
        os._exit(1)


def _run_partitions(parts, part_prefixes, workers: int, init_args: tuple, dtype, strict: bool,
                    stats: PreprocessStats, log, interval: float, t0: float) -> None:
    """The parts side by side, each into its ``part_prefixes`` (finalized; the caller merges
    and removes them): at most ``workers`` at once, the workers split among them; their counts
    added to ``stats`` in input order (so the bad-line examples are the first ones)."""
    starts = part_starts(parts)
    concurrency = max(1, min(len(parts), workers))
    tasks = [(pi, ranges, part_prefixes[pi], starts[pi][0], starts[pi][1],
              workers // concurrency + (pi % concurrency < workers % concurrency), init_args, dtype, strict)
             for pi, ranges in enumerate(parts)]
    got: dict[int, PreprocessStats] = {}
    last = [time.time()]

    def on_message(msg) -> None:
        if msg[0] == "tick":
            stats.input_bytes += msg[1]
            stats.documents += msg[2]
            stats.tokens += msg[3]
            if time.time() - last[0] >= interval:
                last[0] = time.time()
                log(_progress_line(stats, t0))
        elif msg[0] == "stats":
            got[msg[1]] = msg[2]
        elif msg[0] == "error":
            raise PreprocessError(msg[2])

    try:
        run_in_processes(tasks, _part_child, concurrency, on_message, log=log)
    except RuntimeError as exc:
        raise PreprocessError(str(exc)) from None
    stats.documents = stats.tokens = 0
    for pi in range(len(parts)):
        st = got[pi]
        stats.report.merge(st.report)
        stats.lines += st.lines
        stats.documents += st.documents
        stats.tokens += st.tokens
        stats.text_bytes += st.text_bytes
        for total, part in zip(stats.round_trip, st.round_trip):
            total.add(part)
        for k, (lo, hi) in enumerate(st.id_range):
            was = stats.id_range[k]
            if hi >= lo:
                stats.id_range[k] = (lo, hi) if was[1] < was[0] else (min(was[0], lo), max(was[1], hi))


def _result(pool: Workers, seq: int) -> _BatchResult:
    """Batch ``seq``'s result from the workers; one that died meanwhile is an error of the run."""
    try:
        return pool.result(seq)
    except WorkerDied as exc:
        raise PreprocessError(f"{exc} (--workers)") from None


def _run_part(ranges, prefixes, pool: Optional[Workers], dtype, strict, stats: PreprocessStats, log, interval, t0,
              lines_at: Optional[dict] = None, tick: Optional[Callable[[int, int, int], None]] = None
              ) -> list[IndexedDatasetBuilder]:
    """Tokenize ``ranges`` into builders of ``prefixes``, returned unfinalized (aborted on any
    error); ``lines_at``: line numbers carried from range to range (:func:`_iter_batches`);
    ``tick(disk bytes, documents, tokens)``: called per batch written."""
    builders = [IndexedDatasetBuilder(p, dtype) for p in prefixes]
    pending: collections.deque = collections.deque()
    max_inflight = 4 * (pool.processes if pool is not None else 1)
    last = time.time()

    def consume(result: _BatchResult, disk: int) -> None:
        nonlocal last
        raise_if_stopped()  # a signal whose exception a finalizer dropped (stop_signals)
        if strict and result.report.total:
            stats.report.merge(result.report)
            raise PreprocessError("bad input and --strict given: nothing written; found in the lines read before "
                                  "stopping (later lines not read):\n" + "\n".join(result.report.lines(found=True)))
        stats.report.merge(result.report)
        stats.lines += result.lines
        stats.input_bytes += disk
        for k, b in enumerate(builders):
            b.add_documents(result.tokens[k], result.lengths[k], result.nbytes[k])
            if result.tokens[k].size:
                lo, hi = int(result.tokens[k].min()), int(result.tokens[k].max())
                was = stats.id_range[k]
                stats.id_range[k] = (lo, hi) if was[1] < was[0] else (min(was[0], lo), max(was[1], hi))
        stats.documents += len(result.lengths[0])
        stats.tokens += int(result.lengths[0].sum())
        stats.text_bytes += int(result.nbytes[0].sum())
        for total, part in zip(stats.round_trip, result.round_trip):
            total.add(part)
        if tick is not None:
            tick(disk, len(result.lengths[0]), int(result.lengths[0].sum()))
        now = time.time()
        if now - last >= interval:
            last = now
            log(_progress_line(stats, t0))

    line = stats.lines  # 0-based index of the next batch's first line in the whole input (earlier parts done)
    try:
        for batch, disk in _iter_batches(ranges, lines_at):
            first, line = line, line + len(batch)
            if pool is None:
                consume(_encode_batch(batch, first), disk)
                continue
            pending.append((pool.submit(batch, first), disk))
            while len(pending) >= max_inflight:
                seq, done = pending.popleft()
                consume(_result(pool, seq), done)
        while pending:
            seq, done = pending.popleft()
            consume(_result(pool, seq), done)
    except BaseException:
        for b in builders:
            b.abort()
        raise
    return builders
