"""On-disk cache of a :class:`~dept_mega.data.gpt_dataset.GPTDataset`'s index arrays.

Each array is its own ``<stem>.<name>.npy`` so that every rank of a node can memory-map it
(``np.load(mmap_mode="r")``): the pages live once in the page cache, not once per rank (an
``.npz`` cannot be mapped and is read into private memory by each rank). Every file is written
under a temporary name and renamed, so a reader sees a whole file or none; the contents are a
function of the stem's key, so two writers of the same stem write the same bytes and a set
mixed from both is still right.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import socket
import tempfile
import threading
import time
import uuid
import warnings
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from dept_mega.data.atomic_file import atomic_file

INT32_MAX = int(np.iinfo(np.int32).max)


def narrow_int(values: np.ndarray, bound: int) -> np.ndarray:
    """``values`` (all in ``[0, bound]``) as int32 when ``bound`` fits, else int64: the same
    numbers in half the bytes for any part of fewer than 2**31 documents or samples."""
    dtype = np.int32 if bound <= INT32_MAX else np.int64
    return np.ascontiguousarray(values, dtype=dtype)


def array_path(stem: str, name: str) -> str:
    return f"{stem}.{name}.npy"


def is_cached(stem: str, names: Sequence[str]) -> bool:
    return all(os.path.exists(array_path(stem, n)) for n in names)


def can_write(directory: str) -> bool:
    """Whether this process can create files in ``directory`` (made if missing): a probe file,
    created and removed."""
    try:
        os.makedirs(directory, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe.", dir=directory)
        os.close(fd)
        os.remove(probe)
    except OSError:
        return False
    return True


def save_arrays(stem: str, arrays: dict[str, np.ndarray]) -> None:
    """Write each array to ``<stem>.<name>.npy`` atomically (:func:`atomic_file`, readable by
    other users). Raises ``OSError`` (e.g. a read-only directory)."""
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    for name, arr in arrays.items():
        with atomic_file(array_path(stem, name)) as f:
            np.save(f, np.ascontiguousarray(arr), allow_pickle=False)


def load_arrays(stem: str, lengths: dict[str, Optional[int]]) -> Optional[dict[str, np.ndarray]]:
    """The arrays ``lengths`` names, memory-mapped read-only; None when any file is missing.
    ``lengths[name]`` is the length the array must have (None: any, but all the None ones
    equal). A file that exists but is unreadable or of the wrong shape/dtype is reported with a
    warning naming it and None is returned (the caller rebuilds and rewrites it)."""
    if not is_cached(stem, lengths):
        return None
    out: dict[str, np.ndarray] = {}
    free: Optional[int] = None
    for name, want in lengths.items():
        path = array_path(stem, name)
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as exc:
            warnings.warn(f"dataset index cache {path} is unreadable ({exc}); rebuilding it")
            return None
        if want is None:
            want = free = len(arr) if free is None else free
        if arr.ndim != 1 or len(arr) != want or arr.dtype.kind != "i":
            warnings.warn(f"dataset index cache {path} holds {arr.dtype}{list(arr.shape)}, expected "
                          f"{want} integers; rebuilding it")
            return None
        out[name] = arr
    return out


# ------------------------------------------------------------------ one builder per stem
# Arrays are built by the first process that needs them (at start-up spread over the ranks,
# dept_mega.data.index_build; later an epoch reached during the run, the epoch a resumed run
# starts in). That process claims the stem by creating ``<stem>.building`` exclusively (O_EXCL:
# atomic, also on NFS) and builds; the others wait for its files instead of building the same
# arrays. The claim holds ``host pid token`` (the token is unique to that claim): the owner
# refreshes (:func:`heartbeat`) and releases (:func:`release`) the claim file only while it
# holds its own token, so an owner whose claim was taken over never touches the taker's. While
# it builds, a thread touches the claim every HEARTBEAT_S seconds, and keeps doing so through
# transient errors (a soft NFS mount's EIO/ETIMEDOUT); a claim whose modification time a waiter
# has not seen change for STALE_S seconds (several heartbeats: an NFS client may show a new mtime
# up to a minute late) belongs to a process that is gone and is taken over. Only changes of the
# claim's own mtime are watched, against the waiter's monotonic clock: the hosts' clocks are
# never compared. A takeover renames the claim to ``<claim>.stale.<token>`` (one of several
# waiters doing so at once wins the rename) and goes ahead only if the renamed file is the
# claim it judged stale (the same token and mtime): a fresh claim renamed away by a late waiter
# is put back. A claim that vanishes for a moment (just released; on NFS a stale handle,
# ESTALE, when another client removed it between open and read) is looked at again after a
# short sleep.
#
# A builder that fails writes ``<stem>.failed`` (its rank, host, pid and error) before it
# releases its claim; in a launch's start-up walk (:class:`Launch`) a rank that then claims the
# stem reports that error instead of building again, so a failing build is tried once, not once
# by each rank in turn. The file names the launch it was written in: a later launch ignores it
# (a fixed rerun builds), and a successful build removes it.

HEARTBEAT_S = 15.0
STALE_S = 120.0


@dataclass(frozen=True)
class Claim:
    """A claim this process made: its file and its unique token. False (``NO_CLAIM``) where no
    claim could be made (a directory that cannot be written: build without one)."""
    path: str
    token: str
    locks: tuple[str, ...] = ()  # takeover locks this process won before making it (release removes them)

    def __bool__(self) -> bool:
        return bool(self.path)


NO_CLAIM = Claim("", "")


@dataclass(frozen=True)
class Launch:
    """A launch's start-up walk: its id (the same on every rank, new at each launch) and this
    process's rank, written into a ``.failed`` note and matched against one."""
    id: str
    rank: int


class IndexBuildFailed(RuntimeError):
    """Another rank of this launch failed to build the arrays of a stem: its error, not built again."""


def _claim_path(stem: str) -> str:
    return stem + ".building"


def _failed_path(stem: str) -> str:
    return stem + ".failed"


def _owner_gone(text: str) -> bool:
    """Whether the claim's owner (``host pid [token]``) is a process of this host that has ended."""
    fields = text.split()
    if len(fields) < 2 or fields[0] != socket.gethostname() or not fields[1].isdigit():
        return False
    try:
        os.kill(int(fields[1]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _owner(text: str) -> str:
    """``host pid`` of a claim's text, for messages."""
    return " ".join(text.split()[:2]) or "an unknown process"


def _read_claim(path: str) -> Optional[tuple[str, int]]:
    """``(text, st_mtime_ns)`` of a claim file (read and stat'ed through one open file: the same
    file); None when there is none, or it vanished while being read (ESTALE on NFS: removed by
    another client between open and read): look again."""
    try:
        with open(path) as f:
            return f.read().strip(), os.fstat(f.fileno()).st_mtime_ns
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ESTALE:
            return None
        raise


def claim_holder(stem: str) -> Optional[str]:
    """The owner (``host pid``) of a claim on ``stem`` held by a live process as far as can be
    told at a glance (not an ended process of this host), or None: whether to build something
    else first. Waits for nothing."""
    claim = _read_claim(_claim_path(stem))
    if claim is None or _owner_gone(claim[0]):
        return None
    return _owner(claim[0])


def _take_over(path: str, judged: tuple[str, int], token: str, locks: dict[str, float], stale_s: float) -> None:
    """Remove the claim ``judged`` stale, if no other waiter is doing so and ``path`` still is
    that claim (see the section's comment). ``locks``: this waiter's takeover locks (won:
    ``-1``; another's, first seen at that monotonic time)."""
    # one waiter takes a given claim over: the one that creates its lock (kept until that
    # waiter's own claim is released, so that a late waiter that judged the same claim stale
    # does not take the next one over); a lock whose waiter died is removed after stale_s
    lock = f"{path}.takeover.{hashlib.sha256(repr(judged).encode()).hexdigest()[:16]}"
    try:
        os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        since = locks.setdefault(lock, time.monotonic())
        if since >= 0 and time.monotonic() - since > stale_s:
            warnings.warn(f"{lock}: removing the takeover lock of a waiter that is gone")
            _remove(lock)
            del locks[lock]
        return
    except OSError:
        return  # the claim file is as before: look again
    locks[lock] = -1.0
    aside = f"{path}.stale.{token}"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return  # released by its owner meanwhile
    except PermissionError as exc:
        raise PermissionError(exc.errno, f"{path}: cannot take over this stale dataset index claim of "
                              f"{_owner(judged[0])} ({exc.strerror}; a directory with the sticky bit, "
                              "another user's file): remove it by hand, or set data.cache_dir to a "
                              "directory of your own") from None
    renamed = _read_claim(aside)
    if renamed is not None and renamed != judged:  # a fresh claim made meanwhile: give it back
        try:
            os.link(aside, path)  # fails if yet another claim was made meanwhile: that one stands
        except OSError:
            pass
    _remove(aside)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def claim_or_wait(stem: str, names: Sequence[str], stale_s: float = STALE_S, poll_s: float = 0.2,
                  log=None, launch: Optional[Launch] = None) -> Optional[Claim]:
    """Claim the building of ``stem``'s arrays, or wait for the process that holds the claim.

    Returns the :class:`Claim` when this process is to build (hold :func:`heartbeat` on it
    while building; pass it to :func:`release` after writing the arrays, or to
    :func:`record_failure` if the build failed), ``NO_CLAIM`` when no claim can be made (a
    directory that cannot be written: build without one, as before), or None when the arrays
    ``names`` appeared while waiting (load them). A claim whose owner has ended (same host, no
    such pid: a killed job) or whose mtime has not changed for ``stale_s`` seconds of waiting (no
    heartbeat) is taken over, saying so. ``launch``: raises :class:`IndexBuildFailed` when a
    process of that launch failed to build the stem. ``log`` gets a line every 30 s of waiting,
    naming the stem and the claim's owner."""
    path = _claim_path(stem)
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    except OSError:
        return NO_CLAIM
    token = f"{socket.gethostname()} {os.getpid()} {uuid.uuid4().hex}"
    locks: dict[str, float] = {}

    def won() -> tuple[str, ...]:
        return tuple(k for k, v in locks.items() if v < 0)
    try:
        claim = _claim_loop(stem, names, path, token, stale_s, poll_s, log, launch, locks, won)
    except BaseException:
        for lock in won():
            _remove(lock)
        raise
    if not claim:
        for lock in won():
            _remove(lock)
    return claim


def _claim_loop(stem, names, path, token, stale_s, poll_s, log, launch, locks, won) -> Optional[Claim]:
    start = last = seen_at = time.monotonic()
    seen: Optional[tuple[str, int]] = None  # the claim as last seen, and since when (monotonic)
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            pass
        except OSError:
            return NO_CLAIM
        else:
            with os.fdopen(fd, "w") as f:
                f.write(token)
            claim = Claim(path, token, won())
            if is_cached(stem, names):  # built by the claim's previous owner, released just now
                release(claim)
                return None
            failure = _launch_failure(stem, launch)
            if failure is not None:
                release(claim)
                raise IndexBuildFailed(failure)
            return claim
        if is_cached(stem, names):
            return None
        found = _read_claim(path)
        if found is None:  # released just now, or a stale negative lookup: look again shortly
            time.sleep(poll_s)
            continue
        now = time.monotonic()
        if found != seen:  # a new claim or a heartbeat
            seen, seen_at = found, now
        owner = _owner(found[0])
        gone = _owner_gone(found[0])
        if gone or now - seen_at > stale_s:
            why = "has ended" if gone else f"has not refreshed its claim for {now - seen_at:.0f} s"
            warnings.warn(f"{path}: taking over the dataset index build of {owner}, which {why}")
            _take_over(path, found, token.split()[-1], locks, stale_s)
            seen = None
            continue
        if log is not None and now - last >= 30.0:
            log(f"data: waiting {now - start:.0f} s for {owner} to build the dataset index {stem}")
            last = now
        time.sleep(poll_s)


def _holds(claim: Claim, f) -> bool:
    """Whether the open claim file ``f`` holds ``claim``'s token."""
    return f.read().strip() == claim.token


class heartbeat:
    """``with heartbeat(claim): build()``: a daemon thread touches the claim file every
    ``interval_s`` seconds while the block runs, so that waiters see its owner alive however
    long the build takes (a thread, not touches between build phases: one numpy call can take
    minutes). Nothing for an empty or None claim. It touches the file it read its own token
    from (through that open file) and stops when the claim is gone or holds another token (taken
    over); any other error (a soft NFS mount's EIO/ETIMEDOUT, ESTALE) is warned of once and the
    beating goes on: stopping would let waiters take a live owner's claim over."""

    def __init__(self, claim: Optional[Claim], interval_s: float = HEARTBEAT_S):
        self.claim, self.interval_s = claim, interval_s
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.lost = False  # the claim was gone or another's at a beat
        self._warned = False

    def beat(self) -> bool:
        """One touch; False when there is nothing left to keep alive."""
        try:
            with open(self.claim.path) as f:
                if not _holds(self.claim, f):
                    self.lost = True
                    return False
                os.utime(f.fileno())
        except FileNotFoundError:
            self.lost = True
            return False
        except OSError as exc:
            if not self._warned:
                self._warned = True
                warnings.warn(f"{self.claim.path}: could not refresh this dataset index claim ({exc}); "
                              "trying again every beat")
        return True

    def _beat(self) -> None:
        while not self._stop.wait(self.interval_s):
            if not self.beat():
                return

    def __enter__(self) -> "heartbeat":
        if self.claim:
            self._thread = threading.Thread(target=self._beat, name="index-claim-heartbeat", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def release(claim: Optional[Claim]) -> None:
    """Remove the claim file if it still holds ``claim``'s token (renamed aside first, then
    checked: a claim another process took over meanwhile is put back, not removed)."""
    if not claim:
        return
    aside = f"{claim.path}.release.{claim.token.split()[-1]}"
    try:
        os.rename(claim.path, aside)
    except FileNotFoundError:
        return
    try:
        with open(aside) as f:
            mine = _holds(claim, f)
    except OSError:
        mine = True  # gone meanwhile: nothing to put back
    if not mine:
        try:
            os.link(aside, claim.path)  # another's claim: back, unless a newer one is there
        except OSError:
            pass
    _remove(aside)
    for lock in claim.locks:
        _remove(lock)


def record_failure(stem: str, claim: Optional[Claim], launch: Optional[Launch], exc: BaseException) -> None:
    """Note a failed build of ``stem`` in ``<stem>.failed`` (written under a temporary name and
    renamed) for the other ranks of ``launch``, while holding its claim; best effort: a note that
    cannot be written leaves the others to try the build themselves."""
    if not claim:
        return
    host, pid = socket.gethostname(), os.getpid()
    who = f"rank {launch.rank} ({host} pid {pid})" if launch is not None else f"{host} pid {pid}"
    text = json.dumps({"launch": launch.id if launch is not None else None,
                       "by": who, "error": f"{type(exc).__name__}: {exc}"})
    path = _failed_path(stem)
    try:
        with atomic_file(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as err:
        warnings.warn(f"{path}: could not note the failed dataset index build ({err})")


def clear_failure(stem: str) -> None:
    """Remove ``<stem>.failed`` (after a successful build)."""
    try:
        os.remove(_failed_path(stem))
    except FileNotFoundError:
        pass
    except OSError as exc:
        warnings.warn(f"{_failed_path(stem)}: could not remove this old note of a failed build ({exc})")


def _launch_failure(stem: str, launch: Optional[Launch]) -> Optional[str]:
    """The message for a failed build of ``stem`` noted in this ``launch``; None when there is
    none (or no launch, or the note is another launch's: ignored)."""
    if launch is None:
        return None
    path = _failed_path(stem)
    try:
        with open(path) as f:
            note = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        warnings.warn(f"{path}: unreadable note of a failed dataset index build ({exc}); building")
        return None
    if not isinstance(note, dict) or note.get("launch") != launch.id:
        return None
    return (f"the dataset index {stem} failed to build on {note.get('by')}: {note.get('error')} "
            f"(noted in {path}; not built again by this rank)")
