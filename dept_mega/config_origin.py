"""Where a config's values came from: the keys the file and the overrides set (a key they left
out has the schema's default), and, for the value an error names, the override on the command
line that set it or the line of the config file. :func:`dept_mega.config.load_config` appends
the latter to the errors it raises, so that ``train.steps=ten`` given on the command line is not
looked for in the YAML."""
from __future__ import annotations

import re
from typing import Any, Optional, Sequence

import yaml

_KEY = re.compile(r"config key '([^']+)'")


def _path(dotted: str) -> list[str]:
    """``'data.sources[1].tokenizer'`` and ``'data.sources.1.tokenizer'`` -> ``['data', 'sources', '1', 'tokenizer']``."""
    return [p for p in re.sub(r"\[(\d+)\]", r".\1", dotted).split(".") if p]


def override_key(text: str) -> str:
    """The dotted key of an override ``key.sub=value`` (a leading ``--`` dropped, as Megatron's
    flags are often typed)."""
    key = text.split("=", 1)[0].strip()
    return key[2:] if key.startswith("--") else key


def _related(a: list[str], b: list[str]) -> bool:
    """One path is the other or inside it (``data.sources`` and ``data.sources.0.path``)."""
    n = min(len(a), len(b))
    return n > 0 and a[:n] == b[:n]


def _yaml_line(path: str, key: list[str]) -> Optional[int]:
    """The 1-based line where the YAML file at ``path`` sets ``key`` (or a value in its place), if it does."""
    try:
        with open(path, encoding="utf-8") as f:
            node = yaml.compose(f)
    except (OSError, yaml.YAMLError):
        return None
    line = None
    for part in key:
        if isinstance(node, yaml.MappingNode):
            found = next(((k, v) for k, v in node.value if getattr(k, "value", None) == part), None)
            if found is None:
                return None  # the file leaves the key out (the message is about an override or a default)
            line, node = found[0].start_mark.line + 1, found[1]
        elif isinstance(node, yaml.SequenceNode):
            if not part.isdigit() or int(part) >= len(node.value):
                return None
            node = node.value[int(part)]
            line = node.start_mark.line + 1
        else:  # a value where the key goes on (``data.sources: null``): the value is what is wrong
            break
    return line


def leaf_keys(tree: Any, prefix: str = "") -> set[str]:
    """The dotted keys a YAML tree sets: every key whose value is not a mapping (a list, such as
    ``data.sources``, counts as one key)."""
    if not isinstance(tree, dict):
        return {prefix} if prefix else set()
    keys: set[str] = set()
    for k, v in tree.items():
        keys |= leaf_keys(v, f"{prefix}.{k}" if prefix else str(k))
    return keys


def origin(message: str, path: Optional[str], overrides: Sequence[str]) -> str:
    """``message`` with `` (config key K set by the override K=V)`` or `` (... set in FILE, line N)``
    at its end for the first key it names (``config key '...'``); unchanged when it names none, or when neither the
    file nor an override set it (a default: the message says so itself,
    :func:`dept_mega.config.default_note`)."""
    m = _KEY.search(message)
    if m is None:
        return message
    key = _path(m.group(1))
    touching = {o: _path(override_key(o)) for o in overrides if "=" in o}
    touching = {o: p for o, p in touching.items() if _related(p, key)}
    if message.startswith("unknown config key") and touching:  # the override is the key the user typed
        return message
    # an override of the key itself or of a section holding it replaced what the file had there
    whole = any(len(p) <= len(key) for p in touching.values())
    parts = []
    if touching:
        parts.append(f"set by the override{'s' if len(touching) > 1 else ''} {', '.join(touching)}")
    if path is not None and not whole:
        line = _yaml_line(path, key)
        if line is not None:
            parts.append(f"set in {path}, line {line}")
    if not parts:
        return message
    return f"{message} ({m.group(1)} {'; '.join(parts)})"
