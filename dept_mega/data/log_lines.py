"""One line to stderr in one write: what the data tools and the dataset builders log with.

``print(line, file=sys.stderr)`` writes the text and its newline apart, and another process on
the same stderr (a tokenizer worker's library warning, a child's last words, another rank's
line) can land in between, inside the line."""
from __future__ import annotations

import sys


def stderr_line(msg: str) -> None:
    """``msg`` and its newline to the current ``sys.stderr`` in one write, flushed."""
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()
