"""A source's summary: what a federated group job knows of a source another site holds, without
its files (docs/launching.md §12, *Sources*).

A group job reads only its own sources' files (``data.sources[i].group``). Of every other
source it needs a few numbers that weigh the round plans and describe the run: the tokens in its
``.bin`` (proportional / temperature sampling), the identity of its files (``depends.json``,
and what every group job must agree on), its tokenizer's vocabulary size and checksum
(spec_opt), and the number of distinct ids in it (TRIM's |V_k|, for cost estimates). The site
that holds the source writes them once, beside the data::

    python -m dept_mega.data.summary PREFIX [--tokenizer TOKENIZER] [--name NAME]

which writes ``PREFIX.summary.json`` (a few hundred bytes, no text), and shares that file with
the other sites; their configs find it at ``data.sources[i].summary`` (null: ``PREFIX.summary.json``
beside the prefix the config gives). The single job and a group job's own sources never read
a summary: they count from the files, as before.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable, Optional, Sequence

from ..config import ConfigError, held_here
from ..variant import variant_of

FORMAT = 1
SUFFIX = ".summary.json"


def summary_path(source) -> str:
    """Where a config finds the summary of ``source`` (a ``SourceConfig``)."""
    return source.summary or source.prefix + SUFFIX


def make_summary(prefix: str, name: Optional[str] = None, tokenizer: Optional[str] = None,
                 cache_dir: Optional[str] = None,
                 progress: Optional[Callable[[int, int], None]] = None) -> dict[str, Any]:
    """The summary of the data at ``prefix`` (and of ``tokenizer``, the source's own under
    spec_opt), from its files. OSError / IndexedFormatError when they cannot be read.
    ``progress(done, total)``: the tokens of the distinct-id pass counted so far (one pass over
    the ``.bin``; none when its count is cached)."""
    from .identity import source_identity
    from .indexed import IndexedDataset
    from .sources import vocab_set
    from .tokenizer import load_tokenizer, model_sha256
    ident = source_identity(prefix)
    if ident is None:
        raise OSError(f"{prefix}.idx / {prefix}.bin cannot be read as indexed data")
    out: dict[str, Any] = {"format": FORMAT, "name": name, "tokens": int(len(IndexedDataset(prefix).tokens)),
                           "distinct_ids": int(len(vocab_set(prefix, cache_dir, progress))), "identity": ident,
                           "tokenizer": None}
    if tokenizer:
        out["tokenizer"] = {"vocab_size": int(load_tokenizer(tokenizer, "--tokenizer").vocab_size),
                            "sha256": model_sha256(tokenizer)}
    return out


def summary_command(name: str, tokenizer: bool) -> str:
    """The command that makes source ``name``'s summary at its site (``tokenizer``: with the
    source's own tokenizer, spec_opt), as the errors that ask for one name it."""
    return f"python -m dept_mega.data.summary PREFIX{' --tokenizer TOKENIZER' if tokenizer else ''} --name {name}"


def is_foreign(cfg, i: int, held: Optional[list[int]] = None) -> bool:
    """Whether source ``i`` is another group job's (its facts come from its summary)."""
    held = held_here(cfg) if held is None else held
    return held is not None and i not in held


def read_summary(cfg, i: int) -> dict[str, Any]:
    """The summary of ``data.sources[i]`` (another site's source), checked: a ConfigError naming
    ``data.sources[i].summary`` when it is missing, unreadable, of another source or lacks what
    this config needs (spec_opt: the tokenizer's vocabulary). Where it is: ``data.sources[i].summary``
    when set; else ``PREFIX.summary.json``; else, when the source's files are on this machine
    (every site's data on one file system), the same numbers made from them."""
    s = cfg.data.sources[i]
    path, key = summary_path(s), f"config key 'data.sources[{i}].summary'"
    command = summary_command(s.name, variant_of(cfg).own_tokenizer)
    how = (f"make it at the site that holds source '{s.name}' with {command}"
           + f" (it writes PREFIX{SUFFIX}) and copy it here, or point data.sources[{i}].summary at it")
    if not os.path.exists(path):
        if not s.summary and all(os.path.exists(s.prefix + ext) for ext in (".bin", ".idx")) and (
                not variant_of(cfg).own_tokenizer or (s.tokenizer and os.path.exists(s.tokenizer))):
            # every site's files on one file system (a trial on one machine): the same numbers from them
            return make_summary(s.prefix, s.name, s.tokenizer if variant_of(cfg).own_tokenizer else None,
                                cfg.data.cache_dir)
        raise ConfigError(f"{key}: source '{s.name}' is held by another group job, whose data this job does not "
                          f"read; its summary {path!r} does not exist: {how}")
    try:
        with open(path, encoding="utf-8") as f:
            out = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{key}: {path!r} cannot be read as a summary ({exc}): {how}") from None
    if not isinstance(out, dict) or out.get("format") != FORMAT:
        raise ConfigError(f"{key}: {path!r} is not a summary of format {FORMAT}: {how}")
    if out.get("name") not in (None, s.name):
        raise ConfigError(f"{key}: {path!r} is the summary of source {out['name']!r}, not '{s.name}'")
    for field in ("tokens", "distinct_ids"):
        if not isinstance(out.get(field), int) or out[field] <= 0:
            raise ConfigError(f"{key}: {path!r}: '{field}' must be a positive integer, got {out.get(field)!r}")
    if not isinstance(out.get("identity"), dict):
        raise ConfigError(f"{key}: {path!r} has no 'identity' of the data: {how}")
    tok = out.get("tokenizer")
    if variant_of(cfg).own_tokenizer and not (isinstance(tok, dict) and isinstance(tok.get("vocab_size"), int)):
        raise ConfigError(f"{key}: {path!r} has no tokenizer vocabulary (spec_opt embeds each source's own "
                          f"tokenizer): {how}")
    return out


def foreign_summaries(cfg) -> dict[int, dict[str, Any]]:
    """{index: summary} of the sources this job does not hold (a federated group job: the other
    sites' sources, each read by :func:`read_summary`, whose ConfigError names the key and the
    command); {} in the single job. A config that does not say which group this job is
    (``federation.group`` null and ``DEPT_GROUP`` unset) raises :func:`held_here`'s ConfigError:
    a caller that may read every file instead (the cost tools) decides so itself."""
    held = held_here(cfg)
    if held is None:
        return {}
    return {i: read_summary(cfg, i) for i in range(len(cfg.data.sources)) if i not in held}


def source_facts(cfg, i: int, held: Optional[list[int]] = None) -> dict[str, Any]:
    """What this job knows of ``data.sources[i]``: from its files where it reads them, else from
    its summary (:func:`read_summary`): ``tokens``, ``identity``, ``tokenizer`` (spec_opt:
    ``vocab_size``, ``sha256``; else None)."""
    if is_foreign(cfg, i, held):
        return read_summary(cfg, i)
    s = cfg.data.sources[i]
    from .identity import source_identity
    from .indexed import IndexedDataset
    tok = None
    if variant_of(cfg).own_tokenizer and s.tokenizer:
        from .tokenizer import load_tokenizer, model_sha256
        tok = {"vocab_size": int(load_tokenizer(s.tokenizer, f"data.sources[{i}].tokenizer").vocab_size),
               "sha256": model_sha256(s.tokenizer)}
    return {"tokens": int(len(IndexedDataset(s.prefix).tokens)), "identity": source_identity(s.prefix),
            "tokenizer": tok}


def agreed_facts(cfg) -> list:
    """Per source, what every group job must see alike: [name, tokens, identity's sha256,
    tokenizer sha256]: a summary that is not of the data its site trains on (made before the
    data changed, or of other files) differs from that site's own count (an agreed key of
    ``dept_mega.dept.federation_config``)."""
    held = held_here(cfg)
    out = []
    for i, s in enumerate(cfg.data.sources):
        f = source_facts(cfg, i, held)
        out.append([s.name, f["tokens"], (f.get("identity") or {}).get("sha256"),
                    (f.get("tokenizer") or {}).get("sha256")])
    return out


#: the fields of a source's :func:`agreed_facts` entry after its name, as an error names them
FACT_FIELDS = ("tokens", "data sha256", "tokenizer sha256")


def facts_rows(seen: dict[str, list], holders: Optional[list[str]]) -> Optional[list[tuple[str, str]]]:
    """The rows of a ConfigError (``config_diff.check_differing``) for :func:`agreed_facts`
    values that differ between group jobs, one per source, readable: the source's name, each
    field that differs with every side's value, and which copy is stale and how to remake it
    (a raw ``summary[1][2]`` with two sha256 told the user nothing). ``seen``: side ("group 0",
    "this job") -> its value; ``holders``: per source, the side that holds its files and counts
    them (None: the jobs disagree on ``data.sources[].group``). None when the sides list other
    sources or another order (the caller's plain rows then: ``data.sources[].group`` differs too)."""
    sides = list(seen)
    entries = [seen[side] for side in sides]
    if any(len(e) != len(entries[0]) for e in entries) or any(
            len(s) != 1 + len(FACT_FIELDS) or s[0] != e0[0] for e in entries for s, e0 in zip(e, entries[0])):
        return None
    rows = []
    for i, name in enumerate(e0[0] for e0 in entries[0]):
        here = {side: seen[side][i] for side in sides}
        fields = [f"{field}: " + ", ".join(f"{side} {_has(side)} {_short(here[side][1 + k])}" for side in sides)
                  for k, field in enumerate(FACT_FIELDS) if len({json.dumps(v[1 + k]) for v in here.values()}) > 1]
        if fields:
            tok = any(v[3] is not None for v in here.values())
            rows.append((f"data.sources[{i}].summary", f"source '{name}': " + "; ".join(fields) + "; "
                         + _stale(here, holders[i] if holders else None, i, summary_command(name, tok))))
    return rows


def _has(side: str) -> str:
    return "have" if side.endswith("groups") else "has"  # (the running groups)


def _short(value) -> str:
    """A field's value in an error: a sha256 by its first 12 digits (enough to tell two apart)."""
    if isinstance(value, str) and len(value) == 64:
        return f"'{value[:12]}…'"
    return "none" if value is None else repr(value)


def _stale(here: dict[str, list], holder: Optional[str], i: int, command: str) -> str:
    """Which side's summary of source ``i`` is stale (``holder`` counts from the files, every
    other side read a summary) and the remedy: make it again at the holder's site."""
    key = f"data.sources[{i}].summary"
    if holder is None:  # the jobs disagree on which job holds it
        return (f"the group job that holds its files (data.sources[{i}].group) counts them, the others read its "
                f"summary: make it again at that site with {command} and copy it to the others ({key})")
    if holder not in here:  # (a group not in this quorum, or a peer that may be it)
        return (f"{holder} holds its files and counts them, the other jobs read its summary, and a copy compared "
                f"here is stale: make it again at {holder}'s site with {command} and copy it to every group job "
                f"but {holder} ({key})")
    stale = [side for side, v in here.items() if v != here[holder]]
    return (f"{holder} holds its files and counts them, so the summary in {' and '.join(stale)} is stale (made "
            f"before the data changed, or of other files): make it again at {holder}'s site with {command} "
            f"and copy it to {' and '.join(stale)} ({key})")


def _progress_printer(interval: float) -> Callable[[int, int], None]:
    """A ``progress(done, total)`` that prints a line (stderr) at most every ``interval``
    seconds: percent of the tokens counted, tokens/s and ETA, like the other tools'."""
    t0 = last = time.time()

    def progress(done: int, total: int) -> None:
        nonlocal last
        now = time.time()
        if now - last < interval:
            return
        last = now
        el = max(now - t0, 1e-9)
        eta = int(round(el * (total - done) / done)) if done else None
        eta_s = "?" if eta is None else f"{eta // 3600}:{eta // 60 % 60:02d}:{eta % 60:02d}"
        print(f"[summary] distinct ids: {100.0 * done / max(total, 1):5.1f}% ({done:,} of {total:,} tokens) | "
              f"{done / el / 1e6:.1f} M tokens/s | ETA {eta_s}", file=sys.stderr, flush=True)
    return progress


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dept_mega.data.summary", description=__doc__.split("\n\n")[0])
    ap.add_argument("prefix", help="the source's data prefix (PREFIX.bin, PREFIX.idx)")
    ap.add_argument("--tokenizer", default=None, help="the source's own tokenizer (spec_opt's data.sources[i].tokenizer)")
    ap.add_argument("--name", default=None, help="the source's name in the configs (checked by the readers)")
    ap.add_argument("--out", default=None, help=f"where to write it (default: PREFIX{SUFFIX})")
    ap.add_argument("--cache-dir", default=None, help="data.cache_dir (where the count of distinct ids is cached)")
    ap.add_argument("--log-interval", type=float, default=10.0,
                    help="seconds between progress lines of the distinct-id pass over the .bin (default 10)")
    args = ap.parse_args(argv)
    from .indexed import IndexedFormatError
    from .tokenizer import TokenizerError
    try:
        out = make_summary(args.prefix, args.name, args.tokenizer, args.cache_dir,
                           _progress_printer(args.log_interval))
    except (OSError, IndexedFormatError, TokenizerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    path = args.out or args.prefix + SUFFIX
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
    print(f"wrote {path}: {out['tokens']:,} tokens, {out['identity']['documents']:,} documents"
          + (f", tokenizer of {out['tokenizer']['vocab_size']:,} ids" if out["tokenizer"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
