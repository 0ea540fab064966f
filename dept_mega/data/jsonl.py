"""Reading jsonl input line by line, with every kind of bad input counted.

Rules (one per kind; nothing is dropped without being counted):

==============  ==========================================================  =========
kind            what                                                         the line
==============  ==========================================================  =========
blank_line      an empty or whitespace-only line                              skipped
invalid_utf8    the line is not valid UTF-8, or a string holds a lone         skipped
                surrogate escape (``"\\ud800"``) that cannot be UTF-8
invalid_json    not parseable JSON, or JSON that is not an object             skipped
missing_key     a requested key is absent                                     skipped
non_string      a requested key holds a non-string (number, null, list...)    skipped
empty_text      the text is empty or whitespace only                          skipped
bom             a UTF-8 byte-order mark at the start of the line              kept, mark removed
crlf            CRLF line ending, or ``\\r\\n`` inside the text                 kept, each ``\\r\\n``
                                                                              becomes ``\\n``
==============  ==========================================================  =========

With several keys a line is kept only when every key is good, so the outputs of the keys
stay aligned document by document. Kept documents' byte counts are of the text as kept
(after BOM removal and CRLF normalisation).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

BOM = b"\xef\xbb\xbf"
SKIPPED_KINDS = ("blank_line", "invalid_utf8", "invalid_json", "missing_key", "non_string", "empty_text")
KEPT_KINDS = ("bom", "crlf")
KINDS = SKIPPED_KINDS + KEPT_KINDS
MAX_EXAMPLES = 5


@dataclass
class BadInputReport:
    """Counts of each kind of bad input, with the first few places (``file:line``)."""

    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def add(self, kind: str, where: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        ex = self.examples.setdefault(kind, [])
        if len(ex) < MAX_EXAMPLES:
            ex.append(where)

    def merge(self, other: "BadInputReport") -> None:
        for kind, n in other.counts.items():
            self.counts[kind] = self.counts.get(kind, 0) + n
            ex = self.examples.setdefault(kind, [])
            ex.extend(other.examples.get(kind, [])[: MAX_EXAMPLES - len(ex)])

    @property
    def skipped(self) -> int:
        return sum(self.counts.get(k, 0) for k in SKIPPED_KINDS)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def skipped_by_kind(self) -> dict[str, int]:
        """The counts of the kinds whose lines are dropped (only those seen)."""
        return {k: self.counts[k] for k in SKIPPED_KINDS if self.counts.get(k)}

    def brief(self) -> str:
        """One line: each kind seen with its count and first place (``invalid_json 2 (a.jsonl:4)``)."""
        return ", ".join(f"{kind} {self.counts[kind]} ({self.examples[kind][0]})"
                         for kind in KINDS if self.counts.get(kind) and self.examples.get(kind))

    def lines(self, found: bool = False) -> list[str]:
        """Human-readable summary, one line per kind seen: the count, what became of the lines
        ("skipped", "kept (fixed)"; ``found``: only "found", for a run stopped by --strict that
        wrote nothing), the first few places and how many more there are."""
        out = []
        for kind in KINDS:
            n = self.counts.get(kind, 0)
            if n:
                action = "found" if found else "skipped" if kind in SKIPPED_KINDS else "kept (fixed)"
                ex = self.examples.get(kind, [])
                more = f", ... and {n - len(ex)} more" if n > len(ex) else ""
                out.append(f"  {kind:<13} {n:>9}  {action:<13} {'at' if n == 1 else 'first at'}: "
                           f"{', '.join(ex)}{more}")
        return out


def parse_line(raw: bytes, keys: Sequence[str], where: str,
               report: BadInputReport) -> Optional[list[str]]:
    """Parse one raw jsonl line (without or with its ``\\n``). Returns the texts under
    ``keys`` or None when the line is skipped; every problem is added to ``report``."""
    if raw.endswith(b"\n"):
        raw = raw[:-1]
    crlf = False
    if raw.endswith(b"\r"):
        raw = raw[:-1]
        crlf = True
    if raw.startswith(BOM):
        raw = raw[len(BOM):]
        report.add("bom", where)
    if not raw.strip():
        report.add("blank_line", where)
        return None
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        report.add("invalid_utf8", f"{where} (byte {exc.start})")
        return None
    try:
        obj = json.loads(line)
    except ValueError:
        report.add("invalid_json", where)
        return None
    if not isinstance(obj, dict):
        report.add("invalid_json", f"{where} (a JSON {type(obj).__name__}, not an object)")
        return None
    texts = []
    for key in keys:
        if key not in obj:
            report.add("missing_key", f"{where} ({key!r})")
            return None
        value = obj[key]
        if not isinstance(value, str):
            report.add("non_string", f"{where} ({key!r} is {type(value).__name__})")
            return None
        if "\r\n" in value:
            value = value.replace("\r\n", "\n")
            crlf = True
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            report.add("invalid_utf8", f"{where} ({key!r}: lone surrogate)")
            return None
        if not value.strip():
            report.add("empty_text", f"{where} ({key!r})")
            return None
        texts.append(value)
    if crlf:
        report.add("crlf", where)
    return texts


def iter_raw_lines(paths: Sequence[str]) -> Iterator[tuple[str, bytes]]:
    """Yield (``file:line``, raw bytes) for each line of each file, streaming; a compressed file
    decompressed (:mod:`dept_mega.data.compressed`)."""
    from .compressed import iter_lines
    for path in paths:
        for lineno, raw in iter_lines(path):
            yield f"{path}:{lineno}", raw


def iter_texts(paths: Sequence[str], key: str, report: BadInputReport) -> Iterator[str]:
    """The good texts under ``key`` of all files, in order; bad lines go to ``report``."""
    for where, raw in iter_raw_lines(paths):
        texts = parse_line(raw, (key,), where, report)
        if texts is not None:
            yield texts[0]
