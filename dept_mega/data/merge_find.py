"""Finding the parts to merge in a directory: ``tools/merge_datasets.py --input-dir``.

The parts of a sharded preprocessing run (``en_000_text_document`` ... ``en_063_text_document``)
lie side by side. :func:`find_parts` takes the complete datasets (``NAME.bin`` + ``NAME.idx``)
whose NAME matches a glob, in name order with digit runs compared as numbers. It never leaves a
part out quietly: a matching part that is still being written, or whose run was killed (only its
temporary files, or a ``--partitions`` directory, are there), is refused, and so is a gap in the
numbering of the names (``en_000``, ``en_002``: ``en_001`` is missing, e.g. its run failed and
left nothing) unless gaps are allowed (:func:`numbering_gaps`).
"""
from __future__ import annotations

import fnmatch
import os
import re
from typing import Optional, Sequence

from dept_mega.data.merge import MergeError

#: the temporary names tools/preprocess_data.py writes a dataset NAME under until it is complete
TMP_SUFFIXES = (".bin.tmp", ".idx.tmp", ".bytes.npy.tmp", ".tokenizer.json.tmp")
#: the directory tools/preprocess_data.py --partitions writes its parts in (preprocess_outputs.partitions_dir)
PARTITIONS_SUFFIX = ".partitions.tmp"


def natural_key(name: str) -> tuple:
    """Sort key of a name: its digit runs compared as numbers (``shard_2`` before ``shard_10``)."""
    return tuple(int(t) if i % 2 else t for i, t in enumerate(re.split(r"(\d+)", name))), name


def numbering_gaps(names: Sequence[str], show: int = 8) -> Optional[tuple[int, list[str]]]:
    """How many names are missing from the numbering of ``names``, and the first ``show`` of
    them: ``names`` that share their text and differ in one digit run (``en_000_text_document``,
    ``en_002_text_document``) should hold every number from the smallest to the largest
    (``en_001_text_document`` is missing). (0, []) when none is missing (also for fewer than two
    names); None when the numbering cannot be checked: the names differ in their text, in more
    than one digit run, or spell one number twice (``x_1``, ``x_01``)."""
    if len(names) < 2:
        return 0, []
    runs = [re.split(r"(\d+)", n) for n in names]
    if len({tuple(r[0::2]) for r in runs}) != 1:
        return None
    varying = [i for i in range(1, len(runs[0]), 2) if len({r[i] for r in runs}) > 1]
    if len(varying) != 1:
        return None
    at = varying[0]
    numbers = {int(r[at]) for r in runs}
    if len(numbers) != len(names):
        return None
    lo, hi = min(numbers), max(numbers)
    widths = {len(r[at]) for r in runs}
    width = widths.pop() if len(widths) == 1 else 0  # zero-padded alike: the missing names are too
    missing = []
    n = lo
    while len(missing) < show and n < hi:
        if n not in numbers:
            missing.append("".join(runs[0][:at]) + str(n).zfill(width) + "".join(runs[0][at + 1:]))
        n += 1
    return hi - lo + 1 - len(numbers), missing


def _unfinished(directory: str, entries: Sequence[str], pattern: str) -> dict[str, str]:
    """The matching dataset names that a preprocessing run is still writing, or that a killed
    run left unfinished, each with the file that shows it."""
    found: dict[str, str] = {}
    for entry in entries:
        path = os.path.join(directory, entry)
        for suffix in TMP_SUFFIXES:
            if entry.endswith(suffix) and fnmatch.fnmatchcase(entry[:-len(suffix)], pattern):
                found.setdefault(entry[:-len(suffix)], path)
        if entry.endswith(PARTITIONS_SUFFIX) and os.path.isdir(path):
            # its parts are named part<i>_<key>_document; the default key "text" before any is written
            keys = {m.group(1) for m in (re.match(r"part\d+_(.+)_document\.", f) for f in os.listdir(path)) if m}
            for key in keys or {"text"}:
                name = f"{entry[:-len(PARTITIONS_SUFFIX)]}_{key}_document"
                if fnmatch.fnmatchcase(name, pattern):
                    found.setdefault(name, path)
    return found


def find_parts(directory: str, pattern: str = "*", allow_gaps: bool = False) -> list[str]:
    """The dataset prefixes in ``directory`` whose name (without ``.bin``/``.idx``) matches the
    glob ``pattern``, sorted by name with digit runs compared as numbers. Raises
    :class:`MergeError` when none matches; when a matching part is unfinished (a temporary file
    of tools/preprocess_data.py, or its ``--partitions`` directory: still being written, or its
    run was killed); when a matching ``.idx`` or ``.bin`` lacks its other half; when the matches
    are outputs of several ``--json-keys`` (``X_text_document`` and ``X_title_document``), which
    must not be merged into one; and, unless ``allow_gaps``, when the names' numbering has a gap
    (:func:`numbering_gaps`)."""
    if not os.path.isdir(directory):
        raise MergeError(f"--input-dir {directory!r} is not a directory")
    entries = sorted(os.listdir(directory))
    unfinished = _unfinished(directory, entries, pattern)
    if unfinished:
        name = min(unfinished, key=natural_key)
        more = f" (and {len(unfinished) - 1} more)" if len(unfinished) > 1 else ""
        raise MergeError(f"{unfinished[name]}: part {name} is still being written, or its run was killed{more}: "
                         f"wait for tools/preprocess_data.py to finish, or run it again for that shard (it "
                         f"removes what a killed run left); a stray file: narrow --pattern")
    names = set()
    halves: dict[str, set[str]] = {}
    for entry in entries:
        for ext in (".idx", ".bin"):
            if entry.endswith(ext) and fnmatch.fnmatchcase(entry[:-len(ext)], pattern):
                names.add(entry[:-len(ext)])
                halves.setdefault(entry[:-len(ext)], set()).add(ext)
    for name in sorted(names):
        if len(halves[name]) == 1:
            have = next(iter(halves[name]))
            lacks = ".bin" if have == ".idx" else ".idx"
            raise MergeError(f"{os.path.join(directory, name + have)} has no {name + lacks} beside it (a part "
                             f"still being written, or a stray file: narrow --pattern)")
    if not names:
        raise MergeError(f"--input-dir {directory!r}: no dataset (NAME.bin + NAME.idx) whose NAME matches "
                         f"--pattern {pattern!r}")
    keys = {m.group(1) for m in (re.search(r"_([^_]+)_document$", n) for n in names) if m}
    if len(keys) > 1:
        raise MergeError(f"--input-dir {directory!r}: the datasets matching --pattern {pattern!r} are of "
                         f"{len(keys)} json keys ({', '.join(sorted(k + '_document' for k in keys))}); merge "
                         f"each key on its own, e.g. --pattern '*_{sorted(keys)[0]}_document'")
    ordered = sorted(names, key=natural_key)
    gaps = numbering_gaps(ordered)
    if gaps is not None and gaps[0] and not allow_gaps:
        count, missing = gaps
        raise MergeError(f"--input-dir {directory!r}: the {len(ordered)} datasets matching --pattern {pattern!r} "
                         f"({ordered[0]} ... {ordered[-1]}) miss {count} number(s) of their numbering: "
                         f"{', '.join(missing)}{', ...' if count > len(missing) else ''} (a shard whose "
                         f"preprocessing failed or has not run?); pass --allow-gaps if they are meant to be missing")
    return [os.path.join(directory, n) for n in ordered]
