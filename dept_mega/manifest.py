"""Checkpoint integrity at the file level: the manifest, checksums, what a format expects,
durable writes.

``step_N/manifest.json`` is written last, after every other file of the checkpoint:

    {"format": 1, "step": N, "algorithm": "xxh3_128",
     "files": {"layout.json": {"size": 123, "digest": "..."}, "__0_0.distcp": {...}, ...}}

It lists every file of the step directory with its size and checksum (xxh3-128 from the
``xxhash`` package when installed, else sha256). A checkpoint without a manifest, with a file
missing, of another size or checksum, or missing a file its format expects, is not loaded
(:func:`local_problem` says why, naming the file). The format version decides what is
expected (:func:`expected_files`): format 1 wants ``layout.json``, ``depends.json``, DCP's
``.metadata``, ``group{g}.json`` for every source group, ``hooks_rank{r}.pt`` for every rank
when the round hooks have state (with ``hooks_dp0``: for the data-parallel rank 0 of every
(tp, pp, group) position only), and ``rng_tp{t}_pp{p}.pt`` for every tensor/pipeline position
when the model has dropout streams; format 2 also ``fp8_tp{t}_dp{d}_pp{p}_g{g}.pt`` for every
rank when ``layout.json`` says ``fp8_state`` (native FP8 with delayed scaling,
``dept_mega.checkpoint_fp8``).

Hashing is spread over the ranks (each checks a share of the files, in threads) by the callers
in :mod:`dept_mega.checkpoint`; everything here is local to one process.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Optional

FORMAT = 2  # 1: keys by position (dept_mega.checkpoint_v1); 2: global keys and boxes (checkpoint_format)
MANIFEST = "manifest.json"
#: a complete checkpoint's directory name, ``step_N`` (``resume.step_dirs``, :func:`step_problem`)
STEP_DIR = re.compile(r"^step_(\d+)$")
LAYOUT_FILE = "layout.json"
DEPENDS_FILE = "depends.json"
DCP_METADATA = ".metadata"
CHUNK = 8 << 20
FP8_FILE = "fp8_tp{t}_dp{d}_pp{p}_g{g}.pt"  # a rank's FP8 scaling state (dept_mega.checkpoint_fp8)


class CheckpointError(Exception):
    """A checkpoint that cannot be used (damaged, incomplete, unsafe): one line naming the file."""


# ------------------------------------------------------------------------------ checksums


def default_algorithm() -> str:
    try:
        import xxhash  # noqa: F401
        return "xxh3_128"
    except ImportError:
        return "sha256"


def _hasher(algorithm: str):
    if algorithm == "xxh3_128":
        try:
            import xxhash
        except ImportError:
            raise CheckpointError("the checkpoint's checksums are xxh3_128, which needs the xxhash package "
                                  "(pip install xxhash)") from None
        return xxhash.xxh3_128()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise CheckpointError(f"unknown checksum algorithm {algorithm!r}")


def file_digest(path: str, algorithm: str, fsync: bool = False) -> dict[str, Any]:
    """``{"size", "digest"}`` of one file; ``fsync`` also forces it to stable storage (at save
    time: the files DCP and torch.save wrote are read back here anyway)."""
    h = _hasher(algorithm)
    with open(path, "rb") as f:
        size = 0
        while True:
            block = f.read(CHUNK)
            if not block:
                break
            h.update(block)
            size += len(block)
        if fsync:
            os.fsync(f.fileno())
    return {"size": size, "digest": h.hexdigest()}


def digest_files(directory: str, names: Iterable[str], algorithm: str, fsync: bool = False,
                 threads: int = 8) -> dict[str, dict[str, Any]]:
    names = sorted(set(names))
    if not names:
        return {}
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(names)))) as pool:
        results = pool.map(lambda n: file_digest(os.path.join(directory, n), algorithm, fsync), names)
        return dict(zip(names, results))


# ------------------------------------------------------------------------------ durability


def fsync_dir(path: str) -> None:
    """Make a rename or a new file in ``path`` durable (the directory entry itself)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot fsync a directory; the data files are synced
    finally:
        os.close(fd)


def fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def write_durable(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it (the caller renames and fsyncs the directory)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_json_durable(path: str, obj: Any) -> None:
    write_durable(path, json.dumps(obj, indent=1, sort_keys=True).encode("utf-8"))


def replace_durable(path: str, data: bytes) -> None:
    """Atomically replace ``path`` with ``data``: temporary file, fsync, rename, fsync the
    directory (``checkpoints/latest``)."""
    tmp = path + ".tmp"
    write_durable(tmp, data)
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


# ------------------------------------------------------------------------------ manifest


def expected_files(fmt: int, layout: dict[str, Any]) -> list[str]:
    """The files checkpoint format ``fmt`` must hold for the layout it records."""
    if fmt not in (1, 2):
        raise CheckpointError(f"checkpoint format {fmt} is not known to this dept_mega (it reads format {FORMAT})")
    T, P, D, G = (int(layout[k]) for k in ("tensor", "pipeline", "data", "groups"))
    names = [LAYOUT_FILE, DEPENDS_FILE, DCP_METADATA] + [f"group{g}.json" for g in range(G)]
    if layout.get("per_rank_hooks") and layout.get("hooks_dp0"):  # once per (tp, pp, group): dp rank 0's
        names += [f"hooks_rank{t + T * D * (p + P * g)}.pt" for g in range(G) for p in range(P) for t in range(T)]
    elif layout.get("per_rank_hooks"):
        names += [f"hooks_rank{r}.pt" for r in range(T * P * D * G)]
    if layout.get("dropout_rng"):
        names += [f"rng_tp{t}_pp{p}.pt" for t in range(T) for p in range(P)]
    if layout.get("fp8_state"):
        names += [FP8_FILE.format(t=t, d=d, p=p, g=g) for g in range(G) for p in range(P) for d in range(D)
                  for t in range(T)]
    return names


def write_manifest(directory: str, step: int, algorithm: str, files: dict[str, dict[str, Any]]) -> None:
    """Write ``manifest.json`` (durably) and fsync the directory."""
    write_json_durable(os.path.join(directory, MANIFEST),
                       {"format": FORMAT, "step": int(step), "algorithm": algorithm, "files": files})
    fsync_dir(directory)


def seal(directory: str, step: int, algorithm: Optional[str] = None) -> None:
    """Write the manifest of every file in ``directory`` from one process (tests, tools that
    rewrite a checkpoint on purpose). Training seals its checkpoints with the hashing shared
    by all ranks (``dept_mega.checkpoint``)."""
    algorithm = algorithm or default_algorithm()
    names = [n for n in os.listdir(directory) if n != MANIFEST and os.path.isfile(os.path.join(directory, n))]
    write_manifest(directory, step, algorithm, digest_files(directory, names, algorithm, fsync=True))


def read_manifest(directory: str) -> dict[str, Any]:
    """The parsed manifest; :class:`CheckpointError` naming the file when it is missing,
    unreadable or of an unknown format."""
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing (a checkpoint without a manifest was written by a dept_mega "
                              f"older than checkpoint format {FORMAT}, or its save did not finish)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is unreadable ({exc})") from None
    try:
        man = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(man, dict) or not isinstance(man.get("files"), dict):
        raise CheckpointError(f"{path} has no 'files' table")
    fmt = man.get("format")
    if not isinstance(fmt, int) or not 1 <= fmt <= FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {fmt!r} is not known to this dept_mega "
                              f"(it reads format {FORMAT})")
    for name, entry in man["files"].items():
        if not isinstance(entry, dict) or not isinstance(entry.get("size"), int) or "digest" not in entry:
            raise CheckpointError(f"{path}: bad entry for {name!r}")
    return man


def read_json(directory: str, name: str) -> Any:
    path = os.path.join(directory, name)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is not readable JSON ({exc})") from None


def _check_one(directory: str, name: str, entry: dict[str, Any], algorithm: str) -> Optional[str]:
    path = os.path.join(directory, name)
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        return f"{path} is missing"
    except OSError as exc:
        return f"{path} is unreadable ({exc.strerror})"
    if size != entry["size"]:
        return f"{path} has {size} bytes, the manifest says {entry['size']} (truncated or overwritten)"
    try:
        got = file_digest(path, algorithm)
    except OSError as exc:
        return f"{path} is unreadable ({exc.strerror})"
    if got["size"] != entry["size"] or got["digest"] != entry["digest"]:
        return f"{path}: {algorithm} checksum does not match the manifest (the file is corrupted)"
    return None


def step_problem(directory: str, man: dict) -> Optional[str]:
    """A ``step_N`` directory whose manifest records another step (a copy renamed by hand): the
    resume would take N for its step (the round, which source's embeddings to install) and load
    the manifest step's state."""
    m = STEP_DIR.match(os.path.basename(os.path.normpath(directory)).removesuffix(".tmp"))
    if m is None or "step" not in man or int(man["step"]) == int(m.group(1)):
        return None
    return (f"{os.path.join(directory, MANIFEST)} records step {man['step']}, the directory's name step "
            f"{m.group(1)} (a checkpoint copied or renamed: name it step_{man['step']})")


def local_problem(directory: str, rank: int = 0, world: int = 1, threads: int = 8) -> Optional[str]:
    """Why the checkpoint in ``directory`` must not be loaded, as far as this rank can tell, or
    None. Every rank checks the manifest and the files the format expects; the checksums are
    shared out: rank r reads the files ``sorted(names)[r::world]``."""
    if not os.path.isdir(directory):
        return f"{directory} does not exist"
    try:
        man = read_manifest(directory)
        if (problem := step_problem(directory, man)) is not None:
            return problem
        layout = read_json(directory, LAYOUT_FILE)
        if not isinstance(layout, dict):
            raise CheckpointError(f"{os.path.join(directory, LAYOUT_FILE)} is not a JSON object")
        try:
            expected = expected_files(man["format"], layout)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{os.path.join(directory, LAYOUT_FILE)} lacks the layout ({exc})") from None
        files = man["files"]
        for name in expected:
            if name not in files:
                return (f"{os.path.join(directory, name)} is missing (checkpoint format {man['format']} with "
                        f"{layout.get('groups')} group(s) expects it; it is not in the manifest)")
        # every data file DCP's metadata can name must be covered by a checksum
        unlisted = sorted(n for n in os.listdir(directory) if n.endswith(".distcp") and n not in files)
        if unlisted:
            more = f" and {len(unlisted) - 1} more" if len(unlisted) > 1 else ""
            return (f"{os.path.join(directory, unlisted[0])}{more} not in the manifest (data files no checksum "
                    f"covers)")
        if not any(n.endswith(".distcp") for n in files):
            return f"{directory}: the manifest lists no .distcp data file"
        mine = sorted(files)[rank::world]
        algorithm = man.get("algorithm", "sha256")
        _hasher(algorithm)  # a CheckpointError when it is not available
        if not mine:
            return None
        with ThreadPoolExecutor(max_workers=max(1, min(threads, len(mine)))) as pool:
            problems = list(pool.map(lambda n: _check_one(directory, n, files[n], algorithm), mine))
    except CheckpointError as exc:
        return str(exc)
    return next((p for p in problems if p), None)
