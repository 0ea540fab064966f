"""The configuration reference, docs/config.md, generated from the dataclasses of
``dept_mega/config_schema.py``: every key's dotted name, type, default and allowed values come from
the code, its meaning from the field's ``#:`` comment, a section's text from its docstring.
``tools/gen_config_doc.py`` writes the page; ``--check`` fails when it is stale.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import tokenize
import types
import typing
from dataclasses import dataclass
from typing import Any

from dept_mega import config_schema as config_module
from dept_mega.config_schema import CHOICES, Config


@dataclass(frozen=True)
class KeyDoc:
    key: str  # dotted name; list items as ``data.sources[].name``
    type: str
    default: str
    allowed: str
    meaning: str


@dataclass(frozen=True)
class Section:
    title: str  # the dotted prefix ("" for the top level)
    text: str  # the dataclass's docstring
    keys: tuple[KeyDoc, ...]


def field_comments(source: str) -> dict[tuple[str, str], str]:
    """``{(class name, field name): meaning}`` from the ``#:`` comments of ``source``: the
    comment lines directly above a field and the comment after it on its own line(s)."""
    own: dict[int, str] = {}
    trailing: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and tok.string.startswith("#:"):
            text = tok.string[2:].strip()
            line = tok.start[0]
            (own if not tok.line[: tok.start[1]].strip() else trailing)[line] = text
    out: dict[tuple[str, str], str] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            above: list[str] = []
            line = stmt.lineno - 1
            while line in own:
                above.insert(0, own[line])
                line -= 1
            after = [trailing[n] for n in range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1) if n in trailing]
            text = " ".join(above + after).strip()
            if text:
                out[(node.name, stmt.target.id)] = text
    return out


def _optional_inner(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(inner) == 1:
            return inner[0], True
    return tp, False


def _type_name(tp: Any) -> str:
    inner, optional = _optional_inner(tp)
    if dataclasses.is_dataclass(inner):
        name = "mapping"
    elif typing.get_origin(inner) is list:
        (item,) = typing.get_args(inner)
        name = "list of mappings" if dataclasses.is_dataclass(item) else f"list[{item.__name__}]"
    else:
        name = inner.__name__
    return f"{name} or null" if optional else name


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value else '""'
    if isinstance(value, list):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    return repr(value)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()  # type: ignore[misc]


def sections(strict: bool = True) -> list[Section]:
    """Every key of :class:`Config`, grouped by the dataclass that holds it, in field order
    (the top-level keys first). ``strict``: raise ``ValueError`` for a field without a ``#:``
    meaning or a section without a docstring."""
    comments = field_comments(inspect.getsource(config_module))
    out: list[Section] = []
    missing: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        doc = inspect.cleandoc(cls.__doc__ or "")
        if not doc or doc.startswith(cls.__name__ + "("):  # dataclass's generated signature
            missing.append(f"{cls.__name__} (docstring)")
        hints = typing.get_type_hints(cls)
        rows: list[KeyDoc] = []
        nested: list[tuple[type, str]] = []
        for f in dataclasses.fields(cls):
            key = prefix + f.name
            tp = hints[f.name]
            inner, optional = _optional_inner(tp)
            if dataclasses.is_dataclass(inner) and not optional:  # a section of its own
                nested.append((inner, key + "."))
                continue
            meaning = comments.get((cls.__name__, f.name), "")
            if not meaning:
                missing.append(key)
            allowed = CHOICES.get(key, ())
            rows.append(KeyDoc(key, _type_name(tp), _yaml(_default(f)), ", ".join(_yaml(a) for a in allowed),
                               meaning))
            if dataclasses.is_dataclass(inner):
                nested.append((inner, key + "."))
            elif typing.get_origin(inner) is list and dataclasses.is_dataclass(typing.get_args(inner)[0]):
                nested.append((typing.get_args(inner)[0], key + "[]."))
        out.append(Section(prefix[:-1], doc.replace("\n", " "), tuple(rows)))
        for sub, sub_prefix in nested:
            walk(sub, sub_prefix)

    walk(Config, "")
    if missing and strict:
        raise ValueError("dept_mega/config_schema.py: no '#:' meaning (or docstring) for " + ", ".join(missing))
    return out


def all_keys(strict: bool = True) -> list[str]:
    return [k.key for s in sections(strict) for k in s.keys]


HEADER = """\
# Configuration reference

<!-- Generated by `python tools/gen_config_doc.py` from dept_mega/config_schema.py; edit the `#:`
comments there, not this file (tests/test_config_doc.py fails when it is stale). -->

A run is configured by one YAML file with the sections below, plus dotted overrides on the
command line (`parallel.tensor=2`, `dept.outer_optimizer.lr=0.7`, `data.sources.0.weight=2.0`,
`fp8=null`; values are read as YAML). Unknown keys, wrong types, values outside the allowed
ones and impossible combinations are refused before anything starts, with one `error:` line
naming the key (exit status 2). The resolved configuration, defaults included, is written to
`RUN/config.yaml`. Examples: `examples/tiny/*.yaml` (CPU), `examples/1b/*.yaml` (the paper's
1B model).

**Batch size.** `train.global_batch_size` counts the sequences of one optimizer step in *one
source group*, not in the whole job as Megatron's `--global-batch-size` does: a DEPT job with
G groups (G = world size / (`parallel.tensor` × `parallel.pipeline` × `parallel.data`))
trains G × `train.global_batch_size` sequences per inner step. STD has one group, so there it
is the job-wide batch. Each group reaches it with `train.global_batch_size` /
(`train.micro_batch_size` × `parallel.data`) micro-batches per data-parallel rank (gradient
accumulation).

The number of source groups is not a key: it follows from the world size. `train.steps`,
`dept.local_steps` and the intervals count inner steps (optimizer steps of each group).
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    parts = [HEADER]
    for sec in sections():
        title = f"`{sec.title}`" if sec.title else "Top-level keys"
        parts.append(f"\n## {title}\n\n{sec.text}\n")
        if not sec.keys:
            continue
        parts.append("\n| key | type | default | allowed | meaning |\n|---|---|---|---|---|\n")
        for k in sec.keys:
            allowed = f"`{_cell(k.allowed)}`" if k.allowed else ""
            parts.append(f"| `{k.key}` | {_cell(k.type)} | `{_cell(k.default)}` | {allowed} | {_cell(k.meaning)} |\n")
    return "".join(parts)
