"""Config values that differ between two places (a checkpoint and this launch, this group job and
the others): where two JSON values differ, and the one ConfigError naming every differing key with
both values, so that a launch that changed three keys learns all three at once."""
from __future__ import annotations

from typing import Sequence

from .config import ConfigError
from .parallel.agree import mark_agreed

#: how :func:`both` names a checkpoint's value and this launch's
CHECKPOINT_SIDES = ("the checkpoint has", "this launch has")


def differences(mine, theirs, where: str = "") -> list[tuple[str, object, object]]:
    """Every place two JSON values differ, in a stable order (dict keys sorted, list items in
    order): [(``.lr`` / ``[2]`` / ``""``, mine, theirs), ...]; [] where they are equal."""
    if mine == theirs:
        return []
    if isinstance(mine, dict) and isinstance(theirs, dict):
        return [d for k in sorted(set(mine) | set(theirs))
                for d in differences(mine.get(k), theirs.get(k), f"{where}.{k}")]
    if isinstance(mine, list) and isinstance(theirs, list) and len(mine) == len(theirs):
        return [d for i, (a, b) in enumerate(zip(mine, theirs)) for d in differences(a, b, f"{where}[{i}]")]
    return [(where, mine, theirs)]


def both(first, second, sides: tuple[str, str] = CHECKPOINT_SIDES) -> str:
    """``the checkpoint has 2, this launch has 4``: two values, each after the words of its side."""
    return f"{sides[0]} {first!r}, {sides[1]} {second!r}"


def check_differing(rows: Sequence[tuple[str, str]], context: str, advice: str = "", agreed: bool = False) -> None:
    """A ConfigError naming every ``(key, what)`` of ``rows`` (``what``: both values, or "" where
    only hashes were compared) unless there are none: ``config key 'K' differs CONTEXT: WHAT;
    ADVICE``, or ``N config keys differ CONTEXT; ADVICE:`` and a line per key. ``context``: against
    what (``from checkpoint P``); ``agreed``: the same error on every rank (``mark_agreed``)."""
    tail = f"; {advice}" if advice else ""
    lines = [f"config key '{key}'" + (f": {what}" if what else "") for key, what in rows]
    if len(rows) == 1:
        key, what = rows[0]
        err = ConfigError(f"config key '{key}' differs {context}" + (f": {what}" if what else "") + tail)
    elif rows:
        err = ConfigError(f"{len(rows)} config keys differ {context}{tail}:\n  " + "\n  ".join(lines))
    else:
        return
    raise mark_agreed(err) if agreed else err
