"""On-disk cache of a :class:`~dept_mega.data.gpt_dataset.GPTDataset`'s index arrays.

Each array is its own ``<stem>.<name>.npy`` so that every rank of a node can memory-map it
(``np.load(mmap_mode="r")``): the pages live once in the page cache, not once per rank (an
``.npz`` cannot be mapped and is read into private memory by each rank). Every file is written
under a temporary name and renamed, so a reader sees a whole file or none; the contents are a
function of the stem's key, so two writers of the same stem write the same bytes and a set
mixed from both is still right.
"""
from __future__ import annotations

import os
import socket
import tempfile
import threading
import time
import warnings
from typing import Optional, Sequence

import numpy as np

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


def _umask() -> int:
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
    """Write each array to ``<stem>.<name>.npy`` atomically (temporary file + rename). Raises
    ``OSError`` (e.g. a read-only directory); a temporary file is removed on failure. The files
    get the mode an ordinary ``open`` would give them (``0o666`` less the umask), not
    ``mkstemp``'s 0600: the default cache lies beside shared data, which other users' jobs read."""
    directory = os.path.dirname(stem) or "."
    os.makedirs(directory, exist_ok=True)
    for name, arr in arrays.items():
        path = array_path(stem, name)
        fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(fd, "wb") as f:
                np.save(f, np.ascontiguousarray(arr), allow_pickle=False)
            os.chmod(tmp, 0o666 & ~_umask())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise


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
# arrays. While it builds, a thread (:func:`heartbeat`) touches the claim every
# HEARTBEAT_S seconds; a claim whose modification time a waiter has not seen change for STALE_S
# seconds (several heartbeats: an NFS client may show a new mtime up to a minute late) belongs
# to a process that is gone and is taken over. Only changes of the claim's own mtime are
# watched, against the waiter's monotonic clock: the hosts' clocks are never compared.

HEARTBEAT_S = 15.0
STALE_S = 120.0


def _claim_path(stem: str) -> str:
    return stem + ".building"


def _owner_gone(text: str) -> bool:
    """Whether the claim's owner (``host pid``) is a process of this host that has ended."""
    host, _, pid = text.partition(" ")
    if host != socket.gethostname() or not pid.strip().isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _read_claim(path: str) -> Optional[tuple[str, int]]:
    """``(owner, st_mtime_ns)`` of a claim file; None when there is none."""
    try:
        with open(path) as f:
            owner = f.read().strip()
        return owner, os.stat(path).st_mtime_ns
    except FileNotFoundError:
        return None


def claim_holder(stem: str) -> Optional[str]:
    """The owner (``host pid``) of a claim on ``stem`` held by a live process as far as can be
    told at a glance (not an ended process of this host), or None: whether to build something
    else first. Waits for nothing."""
    claim = _read_claim(_claim_path(stem))
    if claim is None or _owner_gone(claim[0]):
        return None
    return claim[0] or "an unknown process"


def claim_or_wait(stem: str, names: Sequence[str], stale_s: float = STALE_S, poll_s: float = 0.2,
                  log=None) -> Optional[str]:
    """Claim the building of ``stem``'s arrays, or wait for the process that holds the claim.

    Returns the claim file's path when this process is to build (hold :func:`heartbeat` on it
    while building; pass it to :func:`release` after writing the arrays), "" when no claim can
    be made (a directory that cannot be written: build without one, as before), or None when
    the arrays ``names`` appeared while waiting (load them). A claim whose owner has ended
    (same host, no such pid: a killed job) or whose mtime has not changed for ``stale_s``
    seconds of waiting (no heartbeat) is taken over, saying so. ``log`` gets a line every 30 s
    of waiting, naming the stem and the claim's owner."""
    path = _claim_path(stem)
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    except OSError:
        return ""
    start = last = time.monotonic()
    seen: Optional[tuple[str, int]] = None  # the claim as last seen, and since when (monotonic)
    seen_at = start
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            pass
        except OSError:
            return ""
        else:
            with os.fdopen(fd, "w") as f:
                f.write(f"{socket.gethostname()} {os.getpid()}")
            if is_cached(stem, names):  # built by the claim's previous owner, released just now
                release(path)
                return None
            return path
        if is_cached(stem, names):
            return None
        claim = _read_claim(path)
        if claim is None:
            continue  # released just now: look again
        now = time.monotonic()
        if claim != seen:  # a new claim or a heartbeat
            seen, seen_at = claim, now
        owner = claim[0] or "an unknown process"
        gone = _owner_gone(claim[0])
        if gone or now - seen_at > stale_s:
            why = "has ended" if gone else f"has not refreshed its claim for {now - seen_at:.0f} s"
            warnings.warn(f"{path}: taking over the dataset index build of {owner}, which {why}")
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
            seen = None
            continue
        if log is not None and now - last >= 30.0:
            log(f"data: waiting {now - start:.0f} s for {owner} to build the dataset index {stem}")
            last = now
        time.sleep(poll_s)


class heartbeat:
    """``with heartbeat(claim): build()``: a daemon thread touches the claim file every
    ``interval_s`` seconds while the block runs, so that waiters see its owner alive however
    long the build takes (a thread, not touches between build phases: one numpy call can take
    minutes). Nothing for an empty or None claim; stops when the file is gone."""

    def __init__(self, claim: Optional[str], interval_s: float = HEARTBEAT_S):
        self.claim, self.interval_s = claim, interval_s
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _beat(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                os.utime(self.claim)
            except OSError:  # released, or taken over and removed: nothing left to keep alive
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


def release(claim: Optional[str]) -> None:
    if claim:
        try:
            os.remove(claim)
        except FileNotFoundError:
            pass
