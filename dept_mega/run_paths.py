"""Relative paths in a run's ``config.yaml``, read from any directory.

A config's paths (:data:`~dept_mega.config_schema.PATH_KEYS`: data prefixes, tokenizers,
summaries, the cache directory, ``train.init_from``) are read from the current directory, and
``RUN/config.yaml`` keeps them as they were given. So the trainer records the directory each
launch that writes ``config.yaml`` started in, beside it, in ``RUN/launch_dir.json``
(``{"launch_dir": "/abs/dir"}``; :func:`record_launch_dir`), and every tool that reads a run's
config (``dept_mega.evaluate``, ``dept_mega.adapt``, ``tools/convert_to_hf.py``,
``tools/summarize_runs.py``) loads it through :func:`load_run_config` / :func:`run_config_tree`,
which join its relative paths to that directory. The tool says so once when that is not the
current directory (:meth:`RunPaths.note`). Paths given to the tool itself (overrides,
``--extra-source``, ``--source-config``'s) stay relative to the current directory.

A run made before the record existed keeps the old behaviour (relative paths read from the
current directory); an error about one of them gets :meth:`RunPaths.hint`, which says so.
"""
from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import yaml

from .config import Config, ConfigError, config_from_dict
from .config_schema import PATH_KEYS

CONFIG_FILE = "config.yaml"
LAUNCH_DIR_FILE = "launch_dir.json"
#: resolved as the others, but not what the tools read the run from (their --run-dir): left out
#: of the note and the hint
_RUN_DIR_KEY = "train.run_dir"


def record_launch_dir(run_dir: str, launch_dir: Optional[str] = None) -> str:
    """Write ``RUN/launch_dir.json`` (``launch_dir``, default: the current directory) through a
    temporary file and a rename; returns its path. Written whenever ``RUN/config.yaml`` is, so the
    two describe the same launch."""
    path = os.path.join(run_dir, LAUNCH_DIR_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"launch_dir": os.path.abspath(launch_dir or os.getcwd())}, f)
        f.write("\n")
    os.replace(tmp, path)
    return path


def read_launch_dir(run_dir: str) -> Optional[str]:
    """The recorded launch directory, or None for a run without ``RUN/launch_dir.json``."""
    path = os.path.join(run_dir, LAUNCH_DIR_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            rec = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not a readable JSON record of the run's launch directory ({exc})") from None
    where = rec.get("launch_dir") if isinstance(rec, dict) else None
    if not isinstance(where, str) or not os.path.isabs(where):
        raise ConfigError(f"{path}: 'launch_dir' must be an absolute directory path, got {where!r}")
    return where


def _slots(tree: Any) -> Iterator[tuple[str, dict, str]]:
    """(dotted key, mapping, field) of every path key a config tree sets to a string."""
    for pattern in PATH_KEYS:
        head, _, tail = pattern.partition("[].")
        if tail:  # a list's items: data.sources[].prefix
            items = _node(tree, head)
            for i, item in enumerate(items if isinstance(items, list) else []):
                if isinstance(item, dict) and isinstance(item.get(tail), str) and item[tail]:
                    yield f"{head}[{i}].{tail}", item, tail
            continue
        parent, _, leaf = pattern.rpartition(".")
        node = _node(tree, parent)
        if isinstance(node, dict) and isinstance(node.get(leaf), str) and node[leaf]:
            yield pattern, node, leaf


def _node(tree: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def relative_paths(tree: dict) -> dict[str, str]:
    """{dotted key: value} of the relative paths a config tree holds."""
    return {key: node[leaf] for key, node, leaf in _slots(tree) if not os.path.isabs(node[leaf])}


def resolve_tree(tree: dict, base: str) -> dict:
    """A copy of ``tree`` with every relative path joined to ``base``."""
    out = copy.deepcopy(tree)
    for _, node, leaf in _slots(out):
        if not os.path.isabs(node[leaf]):
            node[leaf] = os.path.join(base, node[leaf])
    return out


@dataclass
class RunPaths:
    """How a run's config paths were read: ``config`` the file, ``launch_dir`` the recorded
    launch directory (None: no record), ``relative`` its relative paths as written and
    ``resolved`` what they became (empty without a record)."""
    config: str
    record: str
    launch_dir: Optional[str]
    relative: dict[str, str] = field(default_factory=dict)
    resolved: dict[str, str] = field(default_factory=dict)

    def _read(self, paths: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in paths.items() if k != _RUN_DIR_KEY}

    def note(self) -> Optional[str]:
        """The line a tool logs once when the relative paths are read from the recorded launch
        directory rather than the current one; None when that changes nothing."""
        keys = list(self._read(self.resolved))
        if not keys or _same_dir(self.launch_dir, os.getcwd()):
            return None
        shown = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
        return (f"paths in {self.config} are relative to the launch directory {self.launch_dir} (recorded in "
                f"{self.record}): {shown} read from there, not from the current directory")

    def hint(self, message: str) -> str:
        """What to add to an error ``message`` that names one of the run's relative paths: where
        it was read from and why; "" for any other message."""
        if self.launch_dir is None:
            if not any(v in message for v in self._read(self.relative).values()):
                return ""
            return (f" ({self.config} holds paths relative to the directory the run was launched from, which "
                    f"this run does not record (it has no {LAUNCH_DIR_FILE}: made before dept_mega.train recorded "
                    f"it), so they are read from the current directory {os.getcwd()}: run this from the launch "
                    f"directory)")
        if any(v in message for v in self._read(self.resolved).values()):
            return (f" (a path of {self.config} relative to the launch directory {self.launch_dir}, recorded in "
                    f"{self.record}: was the run's data moved since?)")
        return ""


def _same_dir(a: Optional[str], b: str) -> bool:
    try:
        return a is not None and os.path.samefile(a, b)
    except OSError:
        return False


def run_config_tree(run_dir: str) -> tuple[dict, RunPaths]:
    """``RUN/config.yaml`` as a mapping, its relative paths joined to the recorded launch
    directory (as written when the run records none), and how (:class:`RunPaths`)."""
    path = os.path.join(run_dir, CONFIG_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            tree = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist: is {run_dir!r} a run directory?") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path!r} is not valid YAML: {exc}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"config file {path!r}: top level must be a mapping")
    base = read_launch_dir(run_dir)
    paths = RunPaths(path, os.path.join(run_dir, LAUNCH_DIR_FILE), base, relative_paths(tree))
    if base is not None and paths.relative:
        tree = resolve_tree(tree, base)
        paths.resolved = {k: os.path.join(base, v) for k, v in paths.relative.items()}
    return tree, paths


def load_run_config(run_dir: str, overrides: list[str] | tuple[str, ...] = ()) -> tuple[Config, RunPaths]:
    """The run's config (:func:`run_config_tree`) with ``overrides`` applied after the paths are
    resolved (a path given as an override is read from the current directory)."""
    tree, paths = run_config_tree(run_dir)
    return config_from_dict(tree, overrides), paths
