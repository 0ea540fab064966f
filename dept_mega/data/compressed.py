"""Reading compressed jsonl input (``tools/preprocess_data.py``, ``tools/train_tokenizer.py``).

A file is recognised by its first bytes, not its name (a ``.jsonl`` that holds gzip is read as
gzip): gzip, bzip2 and xz are decompressed with the standard library; zstd with Python 3.14's
``compression.zstd`` or the ``zstandard`` package when installed (else
:class:`CompressedInputError` naming the file and what to install). Without this, the compressed bytes would be read as lines of text
and every one of them skipped as bad input (``invalid_utf8``).

:func:`open_input` gives the decompressed stream and the file underneath it, whose position
(compressed bytes read) is what progress and ETA count: the input's size on disk.
"""
from __future__ import annotations

import io
from contextlib import contextmanager
from typing import BinaryIO, Iterator, Optional

#: (format, its first bytes)
MAGICS = (("gzip", b"\x1f\x8b"), ("zstd", b"\x28\xb5\x2f\xfd"), ("bzip2", b"BZh"), ("xz", b"\xfd7zXZ\x00"))
#: what a damaged or truncated compressed stream raises while it is read: OSError (gzip's
#: BadGzipFile, bz2), EOFError (truncated), lzma.LZMAError, zstd's ZstdError; only the
#: decompressing read is inside the ``try``
STREAM_ERRORS = (Exception,)


class CompressedInputError(ValueError):
    """A compressed input that cannot be read here (its module is missing), or a damaged stream."""


def compression_of(path: str) -> Optional[str]:
    """``gzip`` / ``zstd`` / ``bzip2`` / ``xz`` from the file's first bytes, None for anything else."""
    with open(path, "rb") as f:
        head = f.read(6)
    kind = next((name for name, magic in MAGICS if head.startswith(magic)), None)
    # a zstd skippable frame first (pzstd writes one before each frame): magic 0x184D2A50-5F, little-endian
    if kind is None and len(head) >= 4 and 0x50 <= head[0] <= 0x5F and head[1:4] == b"\x2a\x4d\x18":
        kind = "zstd"
    return kind


def _decompressor(kind: str, raw: BinaryIO, path: str) -> BinaryIO:
    def missing(module: str, install: str, tool: str) -> CompressedInputError:
        return CompressedInputError(f"input {path!r} is {kind}-compressed and the Python module {module!r} that "
                                    f"reads it is not available: {install}, or decompress the file first "
                                    f"({tool} {path})")
    if kind == "gzip":
        import gzip
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if kind == "bzip2":
        try:
            import bz2
        except ImportError:
            raise missing("bz2", "use a Python built with bz2", "bunzip2 -k") from None
        return bz2.BZ2File(raw, mode="rb")
    if kind == "xz":
        try:
            import lzma
        except ImportError:
            raise missing("lzma", "use a Python built with lzma", "unxz -k") from None
        return lzma.LZMAFile(raw, mode="rb")
    try:  # Python 3.14's own
        from compression import zstd  # type: ignore[import-not-found]
        return zstd.ZstdFile(raw, mode="rb")
    except ImportError:
        pass
    try:
        import zstandard
    except ImportError:
        raise missing("zstandard", "pip install zstandard", "zstd -d") from None
    # every frame (a file of several, as pzstd or cat writes, would otherwise end after the first)
    return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True, closefd=False))


def check_readable(path: str) -> Optional[str]:
    """The input's compression (None: plain), or :class:`CompressedInputError` when this
    Python cannot decompress it: the check to make before any work."""
    kind = compression_of(path)
    if kind is not None:
        with open(path, "rb") as raw:
            _decompressor(kind, raw, path).close()
    return kind


@contextmanager
def open_input(path: str) -> Iterator[tuple[BinaryIO, BinaryIO]]:
    """(the decompressed byte stream, the file on disk) of ``path``; the same file twice when
    it is not compressed."""
    kind = compression_of(path)
    raw = open(path, "rb")
    try:
        if kind is None:
            yield raw, raw
        else:
            stream = _decompressor(kind, raw, path)
            try:
                yield stream, raw
            finally:
                stream.close()
    finally:
        raw.close()


def damaged(path: str, line: int, exc: BaseException) -> CompressedInputError:
    """The error of a compressed stream that breaks off after input line ``line``."""
    return CompressedInputError(f"input {path!r}: the compressed stream is damaged or truncated after line {line} "
                                f"({type(exc).__name__}: {exc}); lines up to there were read")


def iter_lines(path: str) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, raw line) of ``path``, decompressed; a damaged stream raises
    :func:`damaged`'s error naming the file and the last line read."""
    lineno = 0
    with open_input(path) as (stream, raw):
        try:
            for raw_line in stream:
                lineno += 1
                yield lineno, raw_line
        except STREAM_ERRORS as exc:
            if stream is raw:  # a plain file's read error is not a damaged stream
                raise
            raise damaged(path, lineno, exc) from None
