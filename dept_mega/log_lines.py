"""One line in one write: what the tools, the dataset builders and a job's ranks log with.

``print(line, file=f)`` writes the text and its newline apart, and another process on the same
stream (a tokenizer worker's library warning, a child's last words, another rank's line) can
land in between, inside the line."""
from __future__ import annotations

import sys
from typing import Optional, TextIO


def write_line(msg: str, stream: Optional[TextIO] = None) -> None:
    """``msg`` and its newline to ``stream`` (default: the current ``sys.stderr``) in one write,
    flushed."""
    out = stream if stream is not None else sys.stderr
    out.write(msg + "\n")
    out.flush()
