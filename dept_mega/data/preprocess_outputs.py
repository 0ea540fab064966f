"""The files a preprocessing run writes for an output prefix: checking the destination before
any tokenizing, and removing an earlier run's files (all of them, before this run writes, so a
run stopped part way leaves no data that looks complete).

Only exact names are removed: the files :func:`output_files` lists for this output prefix, and
the run's own partitions directory (:func:`partitions_dir`), which holds the parts of a
``--partitions`` run until they are merged. Nothing is found by a pattern beside the output:
another dataset whose name starts with this prefix (``en_part2_text_document`` beside
``--output-prefix en``, made by a run of its own) is never touched."""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Callable, Sequence

from dept_mega.data.indexed import bin_path, bytes_path, idx_path, tokenizer_record_path


class PreprocessError(RuntimeError):
    """Preprocessing stopped (bad arguments, unreadable input, or bad input under strict)."""


def output_prefix_for(output_prefix: str, key: str) -> str:
    return f"{output_prefix}_{key}_document"


# The file that marks a partitions directory as made by a preprocessing run: only a directory
# that has it (or an empty one: a run stopped just after creating it) is ever removed.
PARTITIONS_MARKER = ".dept_mega_preprocess_partitions"


def partitions_dir(output_prefix: str) -> str:
    """The directory, beside the output, that holds the parts of a ``--partitions`` run into
    ``output_prefix`` until they are merged; removed at the end of the run (also when it fails
    or is stopped), and at the start of the next run into ``output_prefix`` if a killed run
    left it."""
    return output_prefix + ".partitions.tmp"


def part_prefix(output_prefix: str, part: int, key: str) -> str:
    """The dataset prefix of partition ``part``'s output of ``key``, in :func:`partitions_dir`."""
    return os.path.join(partitions_dir(output_prefix), f"part{part}_{key}_document")


def _ours(directory: str) -> bool:
    """Whether ``directory`` was made by a preprocessing run: it has the marker, or is empty."""
    return os.path.isfile(os.path.join(directory, PARTITIONS_MARKER)) or not os.listdir(directory)


def make_partitions_dir(output_prefix: str) -> str:
    """Create :func:`partitions_dir` (it must not exist: :func:`remove_earlier_run` removed an
    earlier one) with its marker; its path. One that appeared since (another run into the same
    ``output_prefix``, started at the same time) is refused, and left to that run."""
    d = partitions_dir(output_prefix)
    try:
        os.mkdir(d)
    except FileExistsError:
        raise PreprocessError(f"--output-prefix {output_prefix!r}: {d}, where --partitions writes its parts, "
                              f"appeared after this run removed an earlier run's files: another run into this "
                              f"--output-prefix is running? Nothing of it was touched") from None
    with open(os.path.join(d, PARTITIONS_MARKER), "w", encoding="utf-8") as f:
        f.write(f"the parts of a tools/preprocess_data.py --partitions run into --output-prefix {output_prefix}; "
                f"removed when that run ends, or by the next run into it\n")
    return d


def remove_partitions_dir(output_prefix: str) -> list[str]:
    """Remove :func:`partitions_dir` if a preprocessing run made it (a foreign file or
    directory of that name is left alone: :func:`check_output` refuses it where a run needs
    it); the files it held."""
    d = partitions_dir(output_prefix)
    if not os.path.isdir(d) or os.path.islink(d) or not _ours(d):
        return []
    held = sorted(os.path.join(d, f) for f in os.listdir(d) if f != PARTITIONS_MARKER)
    shutil.rmtree(d)
    return held


def check_output_dir(output_prefix: str, error: type = None) -> None:
    """The directory of ``output_prefix`` exists (created if missing) and takes a new file (a
    probe written and removed); else ``error`` (default :class:`PreprocessError`) naming
    ``--output-prefix`` and why. The preprocessing and merge tools check it before any work."""
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    try:
        os.makedirs(out_dir, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write_test.", dir=out_dir)
        os.close(fd)
        os.remove(probe)
    except OSError as exc:
        raise (error or PreprocessError)(f"--output-prefix {output_prefix!r}: cannot write to "
                                         f"{exc.filename or out_dir} ({exc.strerror})") from None


def check_output(output_prefix: str, finals: Sequence[str], partitioned: bool = False) -> None:
    """The output directory exists (created if missing) and takes a new file, and no output
    path is a directory; with ``partitioned``, :func:`partitions_dir` is free or a directory
    an earlier run left. Checked before any tokenizing."""
    check_output_dir(output_prefix, PreprocessError)
    for final in finals:
        for path in (bin_path(final), idx_path(final), bytes_path(final), tokenizer_record_path(final)):
            if os.path.isdir(path):
                raise PreprocessError(f"--output-prefix {output_prefix!r}: output {path} is a directory")
    d = partitions_dir(output_prefix)
    if partitioned and os.path.lexists(d) and (not os.path.isdir(d) or os.path.islink(d) or not _ours(d)):
        raise PreprocessError(f"--output-prefix {output_prefix!r}: {d}, where --partitions writes its parts, exists "
                              f"and was not made by this tool (no {PARTITIONS_MARKER} in it): move it away or choose "
                              f"another --output-prefix")


def output_files(prefix: str) -> list[str]:
    """Every file a run writes for ``prefix`` (the ``.idx`` first: it is what makes the data
    readable), the caches kept beside the data, and the temporary names of an unfinished run."""
    finals = [idx_path(prefix), bin_path(prefix), bytes_path(prefix), tokenizer_record_path(prefix),
              prefix + ".token_range.json", prefix + ".token_counts.npz"]
    return finals + [f + ".tmp" for f in finals[:4]]


def remove_outputs(prefixes: Sequence[str]) -> list[str]:
    """Remove the :func:`output_files` of ``prefixes``; the files removed."""
    removed = []
    for p in prefixes:
        for f in output_files(p):
            if os.path.isfile(f):
                os.remove(f)
                removed.append(f)
    return removed


def remove_earlier_run(output_prefix: str, keys: Sequence[str], log: Callable[[str], None]) -> None:
    """Remove what an earlier run into ``output_prefix`` left (its outputs, and the partitions
    directory and temporary files of one that was stopped), all of it before this run writes
    anything: a run stopped part way then leaves no data that looks complete, and no tokenizer
    record of other data (the pre-flight trusts a record beside the data it finds). Only
    exact names (the module docstring): other datasets beside the output are kept."""
    removed = remove_outputs([output_prefix_for(output_prefix, k) for k in keys])
    if removed:
        log(f"[preprocess] removed {len(removed)} files of an earlier run into this --output-prefix before "
            f"writing: {', '.join(removed)}")
    held = remove_partitions_dir(output_prefix)
    if held:
        log(f"[preprocess] removed {partitions_dir(output_prefix)} (the parts of an earlier --partitions run that "
            f"was stopped: {len(held)} files)")
