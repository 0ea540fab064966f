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
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import tempfile
import time
from typing import Optional

from .config import ConfigError
from .resume import CKPT_DIR

LOCK_FILE = ".lock"
#: ``RUN/hf_import.json``: the directory holds weights imported by tools/convert_from_hf.py (a
#: checkpoint to start runs from with ``train.init_from``, never a run that trains on)
IMPORTED = "hf_import.json"
WORKERS_FILE = ".lock.workers"
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
                raise ConfigError(f"{key}: run directory {run_dir} is in use: processes of an earlier job still "
                                  f"hold {workers} (workers left running after their launcher was killed? the "
                                  f"last job's rank 0 was {who}); stop them (fuser -v {workers}) or choose "
                                  f"another train.run_dir") from None
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


def take_run_dir(run_dir: str, rank: int, device=None, check: Optional[callable] = None) -> RunLock:
    """The start of a training job, on every rank: rank 0 runs ``check`` (e.g. config
    validation), :func:`prepare_run_dir` and :meth:`RunLock.acquire`; its verdict is shared
    with every rank, which then joins the lock. A refusal is the same ConfigError everywhere
    (marked agreed: the job prints it once)."""
    from .parallel.agree import agree_errors
    lock = RunLock()

    def first():
        if check is not None:
            check()
        prepare_run_dir(run_dir)
        lock.acquire(run_dir)

    # (agree_errors: any other exception of a rank's does not leave the others waiting for it)
    try:
        agree_errors(first if rank == 0 else (lambda: None), (ConfigError,), device)
        # every rank goes on, or none does
        agree_errors((lambda: lock.join(run_dir)) if rank != 0 else (lambda: None), (ConfigError,), device)
    except BaseException:
        lock.release()
        raise
    return lock
