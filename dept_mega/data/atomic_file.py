"""Writing a file whole or not at all: a temporary file beside it, renamed over it at the end.

The data caches and outputs lie beside shared data that other users' jobs read, so the file gets
the mode an ordinary ``open`` would give it (``0o666`` less the umask), not ``mkstemp``'s 0600: a
cache only its writer can read would be rebuilt by every other user's job."""
from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from typing import IO, Iterator, Optional


def umask() -> int:
    """The process's umask, from /proc where it can be read without changing it (``os.umask``
    sets it to read it: a file created meanwhile by another thread would get the wrong mode)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def usual_mode(path: str) -> None:
    """``path`` (a file ``mkstemp`` made) gets an ordinary ``open``'s mode."""
    os.chmod(path, 0o666 & ~umask())


@contextmanager
def atomic_file(path: str, mode: str = "wb", encoding: Optional[str] = None) -> Iterator[IO]:
    """A file object for ``path``'s new content (``mode``: ``"wb"`` or ``"w"``), in place of
    ``path`` once the block ends without an error; on an error the temporary file is removed
    and ``path`` is as it was. Raises ``OSError`` as the writes do (a read-only folder)."""
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, mode, encoding=encoding) as f:
            yield f
        usual_mode(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
