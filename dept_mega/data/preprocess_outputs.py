"""The files a preprocessing run writes for an output prefix: checking the destination before
any tokenizing, and removing an earlier run's files (all of them, before this run writes, so a
run stopped part way leaves no data that looks complete)."""
from __future__ import annotations

import glob
import os
import tempfile
from typing import Callable, Sequence

from dept_mega.data.indexed import bin_path, bytes_path, idx_path, tokenizer_record_path


class PreprocessError(RuntimeError):
    """Preprocessing stopped (bad arguments, unreadable input, or bad input under strict)."""


def output_prefix_for(output_prefix: str, key: str) -> str:
    return f"{output_prefix}_{key}_document"


def check_output(output_prefix: str, finals: Sequence[str]) -> None:
    """The output directory exists (created if missing) and takes a new file, and no output
    path is a directory: checked before any tokenizing."""
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    try:
        os.makedirs(out_dir, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write_test.", dir=out_dir)
        os.close(fd)
        os.remove(probe)
    except OSError as exc:
        raise PreprocessError(f"--output-prefix {output_prefix!r}: cannot write to {exc.filename or out_dir} "
                              f"({exc.strerror})") from None
    for final in finals:
        for path in (bin_path(final), idx_path(final), bytes_path(final), tokenizer_record_path(final)):
            if os.path.isdir(path):
                raise PreprocessError(f"--output-prefix {output_prefix!r}: output {path} is a directory")


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
    """Remove what an earlier run into ``output_prefix`` left (its outputs, and the parts and
    temporary files of one that was stopped), all of it before this run writes anything: a run
    stopped part way then leaves no data that looks complete, and no tokenizer record of other
    data (the pre-flight trusts a record beside the data it finds)."""
    parts = []
    for k in keys:  # the parts of an earlier --partitions run, whatever its number of parts
        pattern = glob.escape(f"{output_prefix}_part") + "[0-9]*" + glob.escape(f"_{k}_document") + ".*"
        parts += sorted({f[:f.index("_document.") + len("_document")] for f in glob.glob(pattern)})
    removed = remove_outputs([output_prefix_for(output_prefix, k) for k in keys] + parts)
    if removed:
        log(f"[preprocess] removed {len(removed)} files of an earlier run into this --output-prefix before "
            f"writing: {', '.join(removed)}")
