"""The run directory: checked before any heavy work, and held by one job at a time.

* :func:`prepare_run_dir`: ``train.run_dir`` must be a directory (created if missing) in which
  ``checkpoints/`` can be written — checked with a real file before step 1, not at the first
  save — and not a directory of imported weights (:data:`IMPORTED`). Failures are one
  :class:`ConfigError` naming ``train.run_dir``.
* :class:`RunLock`: global rank 0 takes an exclusive ``fcntl.flock`` on ``RUN/.lock`` for the
  life of the job and writes its host and pid into it; a second job on the same directory is
  refused in one line that names them. Every rank of the job also holds a *shared* lock on
  ``RUN/.lock.workers``, and rank 0 of a new job first probes that file for an exclusive lock:
  so workers left running after their launcher was killed (torchrun starts them in their own
  sessions; they outlive it) hold a new job off too, even when the old rank 0 is gone.
  The kernel drops the locks when a process ends, however it ends. On a network file system
  ``flock`` works across nodes on NFS (Linux emulates it with byte-range locks) and on Lustre
  mounted with ``-o flock``; where locks are not supported the job goes on with a warning.
* :func:`write_token` / :func:`check_shared`: every rank must see the *same* directory. Rank 0
  writes a random token into ``RUN/.shared_check``; every rank reads it back and compares it with
  rank 0's, which it received over the process group. A run directory on node-local storage
  (``/tmp``, ``/scratch``, ``$TMPDIR``) passes every other check on each node, trains to the end,
  and leaves checkpoints whose manifests name shards that only another node holds; here it is
  refused at start, on every rank, naming the rank and host that sees something else.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import socket
import sys
import tempfile
import time
from typing import Optional

from .config import ConfigError
from .log_lines import write_line
from .resume import CKPT_DIR

LOCK_FILE = ".lock"
#: ``RUN/hf_import.json``: the directory holds weights imported by tools/convert_from_hf.py (a
#: checkpoint to start runs from with ``train.init_from``, never a run that trains on)
IMPORTED = "hf_import.json"
WORKERS_FILE = ".lock.workers"
#: ``RUN/.shared_check``: rank 0's token of this launch (:func:`write_token`)
SHARED_FILE = ".shared_check"
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)


def prepare_run_dir(run_dir: str) -> None:
    """Create ``run_dir`` and ``run_dir/checkpoints`` and prove the latter writable."""
    key = "config key 'train.run_dir'"
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise ConfigError(f"{key}: {run_dir} exists and is not a directory")
    if os.path.isfile(os.path.join(run_dir, IMPORTED)):
        raise ConfigError(f"{key}: {run_dir} holds weights imported by tools/convert_from_hf.py ({IMPORTED}), a "
                          f"checkpoint to start from, not a run to continue: set train.init_from: {run_dir} and "
                          f"another train.run_dir")
    ckdir = os.path.join(run_dir, CKPT_DIR)
    try:
        os.makedirs(ckdir, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write_test.", dir=ckdir)
        os.close(fd)
        os.remove(probe)
    except OSError as exc:
        where = exc.filename or ckdir
        raise ConfigError(f"{key}: cannot write checkpoints to {ckdir} ({where}: {exc.strerror})") from None


def _holder(fd: int) -> str:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        info = json.loads(os.read(fd, 4096).decode("utf-8"))
        return (f"host {info.get('host')}, pid {info.get('pid')}, started "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(info.get('time', 0)))}")
    except (OSError, ValueError, AttributeError):
        return "holder unknown"


class RunLock:
    """The job's hold on its run directory (see the module doc). Keep the object alive for the
    life of the job; :meth:`release` (or the process's end) lets go."""

    def __init__(self) -> None:
        self._fds: list[int] = []

    def _open(self, path: str) -> int:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        self._fds.append(fd)
        return fd

    def acquire(self, run_dir: str) -> None:
        """Global rank 0: the exclusive lock, then the probe for another job's workers."""
        key = "config key 'train.run_dir'"
        path, workers = os.path.join(run_dir, LOCK_FILE), os.path.join(run_dir, WORKERS_FILE)
        try:
            fd = self._open(path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                who = _holder(fd)
                self.release()
                raise ConfigError(f"{key}: run directory {run_dir} is in use by another job ({path} is locked by "
                                  f"{who}); wait for it to end or choose another train.run_dir") from None
            wfd = self._open(workers)
            try:
                fcntl.flock(wfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                who = _holder(fd)
                self.release()
                # on NFS / Lustre the lock can outlive a node that died (NLM: until it reboots; NFSv4:
                # its lease; Lustre: its eviction), and fuser sees only this node's processes
                raise ConfigError(f"{key}: run directory {run_dir} is in use: processes of an earlier job still "
                                  f"hold {workers} (workers left running after their launcher was killed? the "
                                  f"last job's rank 0 was {who}); stop them (fuser -v {workers} on each node) or "
                                  f"choose another train.run_dir. The holder may also be a node of that job that "
                                  f"died: a lock on a network file system can outlive it; once no job of this run "
                                  f"is running, removing {workers} is safe") from None
            fcntl.flock(wfd, fcntl.LOCK_SH)
            info = {"host": socket.gethostname(), "pid": os.getpid(), "time": time.time(),
                    "job": os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID")}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(info).encode("utf-8"), 0)
            os.fsync(fd)
        except OSError as exc:
            self.release()
            if exc.errno in _NO_LOCKS:
                print(f"warning: the file system of {run_dir} does not support locks ({exc.strerror}): "
                      f"nothing stops a second job from using the same run directory", file=sys.stderr)
                return
            raise ConfigError(f"{key}: cannot lock {path} ({exc.strerror})") from None

    def join(self, run_dir: str) -> None:
        """Every other rank: a shared lock on the workers file, held for the life of the job."""
        try:
            fcntl.flock(self._open(os.path.join(run_dir, WORKERS_FILE)), fcntl.LOCK_SH)
        except OSError as exc:
            if exc.errno not in _NO_LOCKS:
                raise ConfigError(f"config key 'train.run_dir': cannot lock "
                                  f"{os.path.join(run_dir, WORKERS_FILE)} ({exc.strerror})") from None

    def release(self) -> None:
        for fd in self._fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = []

    @property
    def held(self) -> bool:
        return bool(self._fds)


def write_token(run_dir: str) -> str:
    """Rank 0: a new random token (with its host) into ``RUN/.shared_check``; returns the text
    written. Replaced by a rename: a node that cached the last launch's file sees a new one."""
    text = json.dumps({"token": secrets.token_hex(16), "host": socket.gethostname(), "pid": os.getpid()})
    path = os.path.join(run_dir, SHARED_FILE)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        raise ConfigError(f"config key 'train.run_dir': cannot write {path} ({exc.strerror})") from None
    return text


#: seconds a rank that does not see rank 0's token yet keeps looking before it calls the run
#: directory unshared: an NFS client may serve a directory's cached attributes (a "no such file",
#: last launch's file) for up to ``acdirmax`` (60 s by default; 30 s is the usual minimum); the
#: check passes as soon as the file reads right, so a shared directory costs nothing
SHARED_WAIT_S = 60.0


def _read_token(path: str, rank: int) -> Optional[str]:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"config key 'train.run_dir': cannot read {path} on rank {rank} (host "
                          f"{socket.gethostname()}): {exc.strerror}") from None


def check_shared(run_dir: str, expected: str, rank: int) -> None:
    """Every rank: ``RUN/.shared_check`` holds ``expected`` (rank 0's :func:`write_token` of this
    launch), else, after looking again for :data:`SHARED_WAIT_S` (a file system's attribute
    cache), a ConfigError naming this rank, its host and what it found there."""
    path = os.path.join(run_dir, SHARED_FILE)
    start = time.monotonic()
    told = False
    while True:
        seen = _read_token(path, rank)
        if seen == expected:
            return
        waited = time.monotonic() - start
        if waited >= SHARED_WAIT_S:
            break
        if waited >= 5 and not told:
            told = True
            write_line(f"[run_dir] rank {rank} (host {socket.gethostname()}) does not see rank 0's {path} yet; "
                       f"looking again for up to {SHARED_WAIT_S:.0f} s (a file system's attribute cache)")
        time.sleep(0.5)
    wrote = json.loads(expected)
    if seen is None:
        saw = f"no file {path}"
    else:
        try:
            other = json.loads(seen)
            saw = f"in {path} token {str(other['token'])[:8]}... of host {other['host']} (pid {other['pid']})"
        except (ValueError, TypeError, KeyError):
            saw = f"in {path} {len(seen)} bytes that are no token"
    raise ConfigError(f"config key 'train.run_dir' is not the same directory on every node: rank {rank} on host "
                      f"{socket.gethostname()} finds {saw}, not the token {wrote['token'][:8]}... that rank 0 on "
                      f"host {wrote['host']} (pid {wrote['pid']}) wrote there at this launch's start (looked for "
                      f"{SHARED_WAIT_S:.0f} s); a directory on node-local storage (/tmp, /scratch, $TMPDIR) is not shared: use a file system shared by all nodes")


def take_run_dir(run_dir: str, rank: int, device=None, check: Optional[callable] = None) -> RunLock:
    """The start of a training job, on every rank: rank 0 runs ``check`` (e.g. config
    validation), :func:`prepare_run_dir`, :meth:`RunLock.acquire` and :func:`write_token`; its
    verdict and token are shared with every rank, which then checks that it sees the same
    directory (:func:`check_shared`) and joins the lock. A refusal is the same ConfigError
    everywhere (marked agreed: the job prints it once)."""
    from .parallel.agree import agree_errors, all_gather_text
    lock = RunLock()

    def first() -> str:
        if check is not None:
            check()
        prepare_run_dir(run_dir)
        lock.acquire(run_dir)
        return write_token(run_dir)

    def then(token: str) -> None:
        check_shared(run_dir, token, rank)
        if rank != 0:
            lock.join(run_dir)

    # (agree_errors: any other exception of a rank's does not leave the others waiting for it)
    try:
        written = agree_errors(first if rank == 0 else (lambda: ""), (ConfigError,), device)
        token = all_gather_text(written, device)[0]  # rank 0's
        # every rank goes on, or none does
        agree_errors(lambda: then(token), (ConfigError,), device)
    except BaseException:
        lock.release()
        raise
    return lock
