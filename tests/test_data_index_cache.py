"""One process builds a set of index arrays at a time (dept_mega/data/index_cache.py's claim):
ranks that reach a new epoch together build it once; a claim left by a process that ended,
or held too long, is taken over; a waiter loads what the claim's owner wrote."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from dept_mega.data.index_cache import Claim, NO_CLAIM, claim_or_wait, heartbeat, load_arrays, release, save_arrays
from tests.data_utils import numbered_docs, write_docs
from tests.mp_utils import run_distributed


def _next_epoch_together(rank: int, world: int, prefix: str, cache_dir: str) -> tuple:
    import torch.distributed as dist

    from dept_mega.data.gpt_dataset import GPTDataset
    build = GPTDataset._build

    def slow(self, epoch):  # long enough that the ranks overlap
        time.sleep(1.0)
        return build(self, epoch)
    GPTDataset._build = slow
    ds = GPTDataset(prefix, 8, "1,0", "train", seed=3, cache_dir=cache_dir)
    ds.epoch_index(0)
    dist.barrier()
    misses = ds.cache_misses
    sample = ds[ds.samples_per_epoch + 2].tolist()  # epoch 1, reached by every rank at once
    return ds.cache_misses - misses, sample


def test_ranks_reaching_an_epoch_together_build_it_once(tmp_path):
    prefix = write_docs(str(tmp_path / "src"), numbered_docs(60, seed=2), nbytes=[1] * 60)
    GPTDataset = __import__("dept_mega.data.gpt_dataset", fromlist=["GPTDataset"]).GPTDataset
    GPTDataset(prefix, 8, "1,0", "train", seed=3, cache_dir=str(tmp_path / "c")).epoch_index(0)
    out = run_distributed(_next_epoch_together, 3, args=(prefix, str(tmp_path / "c")), timeout=120)
    assert sorted(o[0] for o in out) == [0, 0, 1], out
    assert out[0][1] == out[1][1] == out[2][1]
    assert not [f for f in os.listdir(tmp_path / "c") if f.endswith(".building")]


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_claim_whose_owner_ended_is_taken_over(tmp_path):
    stem = str(tmp_path / "x_train_abc")
    with open(stem + ".building", "w") as f:
        f.write(f"{socket.gethostname()} {_dead_pid()}")
    with pytest.warns(UserWarning, match="has ended"):
        claim = claim_or_wait(stem, ["a"], poll_s=0.01)
    assert claim.path == stem + ".building" and claim.token.startswith(f"{socket.gethostname()} {os.getpid()} ")
    assert open(claim.path).read() == claim.token
    release(claim)
    assert not os.path.exists(claim.path)


def test_a_claim_without_heartbeat_is_taken_over_after_the_stale_window(tmp_path):
    stem = str(tmp_path / "x_train_abc")
    with open(stem + ".building", "w") as f:
        f.write(f"otherhost {os.getpid()}")  # another host's: only its heartbeat tells
    t0 = time.monotonic()
    with pytest.warns(UserWarning, match="has not refreshed its claim"):
        claim = claim_or_wait(stem, ["a"], stale_s=0.5, poll_s=0.01)
    assert claim and time.monotonic() - t0 >= 0.5


def test_a_heartbeat_keeps_a_slow_claim_from_being_taken_over(tmp_path):
    """The owner builds for 8 stale windows; its heartbeat keeps the waiter waiting, and the
    waiter loads what it wrote. Without the heartbeat the waiter takes the claim over."""
    import warnings
    stem = str(tmp_path / "x_train_abc")
    mine = Claim(stem + ".building", f"otherhost {os.getpid()} t0")
    with open(mine.path, "w") as f:
        f.write(mine.token)

    def owner():
        with heartbeat(mine, interval_s=0.05):
            time.sleep(2.0)
            save_arrays(stem, {"a": np.arange(5, dtype=np.int32)})
        release(mine)
    th = threading.Thread(target=owner)
    th.start()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert claim_or_wait(stem, ["a"], stale_s=0.25, poll_s=0.01) is None
    th.join()


def test_a_set_written_meanwhile_is_kept_not_replaced(tmp_path):
    """A builder whose claim was taken over finds the other's whole set when it is done: it maps
    that set (other processes may have it mapped) instead of replacing the files."""
    from dept_mega.data.gpt_dataset import EPOCH_ARRAYS, GPTDataset
    prefix = write_docs(str(tmp_path / "src"), numbered_docs(30, seed=2), nbytes=[1] * 30)
    ds = GPTDataset(prefix, 8, "1,0", "train", seed=3, cache_dir=str(tmp_path / "c"))
    stem = ds.cache_path(1)
    build, theirs = ds._build, {}

    def other_writes_first(epoch):  # the other process finishes while this one builds
        arrays = build(epoch)
        save_arrays(stem, arrays)
        theirs.update({k: os.stat(f"{stem}.{k}.npy").st_ino for k in EPOCH_ARRAYS})
        return arrays
    ds._build = other_writes_first
    idx = ds.epoch_index(1)
    assert ds.cache_misses == 1 and isinstance(idx.sample_order, np.memmap)
    assert {k: os.stat(f"{stem}.{k}.npy").st_ino for k in EPOCH_ARRAYS} == theirs


def _owner_finishing(stem: str) -> threading.Thread:
    """Another owner of ``stem``'s claim (already written): 0.3 s later it writes array ``a`` and
    releases the claim; started, returned to join."""
    def owner():
        time.sleep(0.3)
        save_arrays(stem, {"a": np.arange(5, dtype=np.int32)})
        os.remove(stem + ".building")
    th = threading.Thread(target=owner)
    th.start()
    return th


def test_a_waiter_loads_what_the_claims_owner_wrote(tmp_path):
    stem = str(tmp_path / "x_train_abc")
    with open(stem + ".building", "w") as f:
        f.write(f"otherhost {os.getpid()}")  # another host's: never judged ended

    th = _owner_finishing(stem)
    lines = []
    assert claim_or_wait(stem, ["a"], poll_s=0.01, log=lines.append) is None
    th.join()
    assert load_arrays(stem, {"a": 5})["a"].tolist() == [0, 1, 2, 3, 4]


def test_no_claim_where_the_directory_cannot_be_made(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert claim_or_wait(str(blocker / "sub" / "x"), ["a"]) == NO_CLAIM


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o002])
def test_data_caches_get_the_mode_the_umask_gives(tmp_path, mask):
    """Other users' jobs read a cache beside shared data: not mkstemp's 0600 (the sample index
    arrays, a source's token-id range and its token counts)."""
    from dept_mega.data.token_counts import token_counts
    from dept_mega.data.token_range import token_id_range
    prefix = write_docs(str(tmp_path / "src"), numbered_docs(5))
    old = os.umask(mask)
    try:
        save_arrays(str(tmp_path / "x_train_abc"), {"a": np.arange(3, dtype=np.int32)})
        token_id_range(prefix)
        token_counts(prefix, cache_dir=str(tmp_path / "cache"))
    finally:
        os.umask(old)
    written = [tmp_path / "x_train_abc.a.npy", tmp_path / "src.token_range.json",
               *(tmp_path / "cache").iterdir()]
    assert len(written) == 3 and {os.stat(p).st_mode & 0o777 for p in written} == {0o666 & ~mask}, written


def test_waiters_taking_a_stale_claim_over_together_make_one_builder(tmp_path):
    """Eight waiters judge the same claim stale at about the same time: one of them builds, the
    others wait for its files (each removing the claim by path would remove fresh claims)."""
    import warnings
    stem = str(tmp_path / "x_train_abc")
    with open(stem + ".building", "w") as f:
        f.write("otherhost 1 old")  # no heartbeat: stale after stale_s
    builders, results = [], []
    go = threading.Barrier(8)

    def waiter():
        go.wait()
        claim = claim_or_wait(stem, ["a"], stale_s=0.3, poll_s=0.005)
        if claim:
            builders.append(claim.token)
            with heartbeat(claim, interval_s=0.02):
                time.sleep(1.0)
                save_arrays(stem, {"a": np.arange(5, dtype=np.int32)})
            release(claim)
        results.append(claim)
    with warnings.catch_warnings():
        # the waiters pause between judging the claim stale and taking it over (here in the
        # warning; on NFS any call can take that long): each removing the claim by path then
        # removes the fresh claims of the others
        warnings.simplefilter("always")
        warnings.showwarning = lambda *args, **kwargs: time.sleep(0.05)
        threads = [threading.Thread(target=waiter) for _ in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    assert len(builders) == 1 and results.count(None) == 7, builders
    assert not [f for f in os.listdir(tmp_path) if ".building" in f]


def test_an_owner_taken_over_neither_refreshes_nor_releases_the_takers_claim(tmp_path):
    path = str(tmp_path / "x_train_abc.building")
    mine = Claim(path, "thishost 1 mine")
    with open(path, "w") as f:
        f.write(mine.token)
    with heartbeat(mine, interval_s=0.02) as hb:
        os.remove(path)  # taken over: another's claim in its place, last touched long ago
        with open(path, "w") as f:
            f.write("otherhost 2 theirs")
        os.utime(path, ns=(10**18, 10**18))
        time.sleep(0.3)
    assert hb.lost and os.stat(path).st_mtime_ns == 10**18
    release(mine)
    assert open(path).read() == "otherhost 2 theirs"
    release(Claim(path, "otherhost 2 theirs"))
    assert os.listdir(tmp_path) == []


def test_the_heartbeat_beats_on_through_transient_errors(tmp_path, monkeypatch):
    """EIO/ETIMEDOUT on a soft NFS mount: warned of once, the claim is refreshed once it passes."""
    import errno

    from dept_mega.data import index_cache
    path = str(tmp_path / "x_train_abc.building")
    mine = Claim(path, "thishost 1 mine")
    with open(path, "w") as f:
        f.write(mine.token)
    os.utime(path, ns=(10**18, 10**18))
    utime, failures = os.utime, [errno.EIO, errno.ETIMEDOUT, errno.ESTALE]

    def flaky(*args, **kwargs):
        if failures:
            raise OSError(failures.pop(0), "transient")
        return utime(*args, **kwargs)
    monkeypatch.setattr(index_cache.os, "utime", flaky)
    with pytest.warns(UserWarning, match="could not refresh") as caught:
        with heartbeat(mine, interval_s=0.02) as hb:
            deadline = time.monotonic() + 5.0
            while os.stat(path).st_mtime_ns == 10**18 and time.monotonic() < deadline:
                time.sleep(0.01)
    assert os.stat(path).st_mtime_ns != 10**18 and not hb.lost and not failures
    assert len([w for w in caught if "could not refresh" in str(w.message)]) == 1


def test_a_claim_read_with_a_stale_nfs_handle_is_looked_at_again(tmp_path, monkeypatch):
    """ESTALE reading the claim (released from another NFS client between open and read): look
    again, wait for the files; no error."""
    import builtins
    import errno

    from dept_mega.data import index_cache
    stem = str(tmp_path / "x_train_abc")
    with open(stem + ".building", "w") as f:
        f.write("otherhost 2 theirs")
    stale = [1, 1]

    def estale_open(file, *args, **kwargs):
        if str(file).endswith(".building") and stale:
            stale.pop()
            raise OSError(errno.ESTALE, "Stale file handle", file)
        return builtins.open(file, *args, **kwargs)
    monkeypatch.setattr(index_cache, "open", estale_open, raising=False)

    th = _owner_finishing(stem)
    assert claim_or_wait(stem, ["a"], poll_s=0.01) is None
    th.join()
    assert not stale


def test_a_stale_claim_that_cannot_be_removed_is_named(tmp_path, monkeypatch):
    """Another user's stale claim in a sticky directory: an error naming the claim file."""
    import errno

    from dept_mega.data import index_cache
    stem = str(tmp_path / "x_train_abc")
    with open(stem + ".building", "w") as f:
        f.write("otherhost 2 theirs")

    def refuse(src, dst):
        raise PermissionError(errno.EPERM, "Operation not permitted", src)
    monkeypatch.setattr(index_cache.os, "rename", refuse)
    with pytest.warns(UserWarning, match="taking over"):
        with pytest.raises(PermissionError, match=f"{stem}.building: cannot take over .*otherhost 2"):
            claim_or_wait(stem, ["a"], stale_s=0.1, poll_s=0.01)


def test_a_claim_that_looks_absent_is_looked_at_again_after_a_pause(tmp_path, monkeypatch):
    """The claim file is there but a lookup says it is not (an NFS client's stale negative
    entry): the waiter pauses between looks instead of spinning."""
    from dept_mega.data import index_cache
    stem = str(tmp_path / "x_train_abc")
    with open(stem + ".building", "w") as f:
        f.write("otherhost 2 theirs")
    sleeps, looks = [], []

    def absent(path):
        looks.append(len(sleeps))
        if len(looks) == 3:
            save_arrays(stem, {"a": np.arange(5, dtype=np.int32)})
        return None
    monkeypatch.setattr(index_cache, "_read_claim", absent)
    monkeypatch.setattr(index_cache.time, "sleep", sleeps.append)
    assert claim_or_wait(stem, ["a"], poll_s=0.01) is None
    assert looks == [0, 1, 2] and sleeps == [0.01, 0.01, 0.01]


def test_a_takeover_lock_left_by_a_waiter_that_died_is_removed(tmp_path):
    """A waiter died between locking a stale claim's takeover and taking it over: after another
    stale window the lock is removed and the claim taken over."""
    import hashlib
    import warnings

    from dept_mega.data.index_cache import _read_claim
    stem = str(tmp_path / "x_train_abc")
    with open(stem + ".building", "w") as f:
        f.write("otherhost 1 old")
    judged = _read_claim(stem + ".building")
    lock = f"{stem}.building.takeover.{hashlib.sha256(repr(judged).encode()).hexdigest()[:16]}"
    open(lock, "w").close()
    got = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        th = threading.Thread(target=lambda: got.append(claim_or_wait(stem, ["a"], stale_s=0.2, poll_s=0.01)),
                              daemon=True)
        th.start()
        th.join(10.0)
    assert got and got[0], "still waiting behind the dead waiter's lock"
    assert any("removing the takeover lock" in str(w.message) for w in caught)
    release(got[0])
    assert os.listdir(tmp_path) == []


def test_an_index_is_hashed_once_per_file_and_again_when_rewritten(tmp_path, monkeypatch):
    """data_hash (the cache key's data part) reads a whole .idx: a start-up opens each source's
    index several times, and hashes it once; a dataset preprocessed again at the same prefix (a
    new file) is hashed again, to its own value."""
    import hashlib

    from dept_mega.data import gpt_dataset
    from dept_mega.data.indexed import IndexedDataset
    monkeypatch.setattr(gpt_dataset, "_HASHED", {})
    hashed = []

    class Counting:
        def __init__(self):
            hashed.append(1)
            self.h = hashlib.sha256()

        def update(self, b):
            self.h.update(b)

        def hexdigest(self):
            return self.h.hexdigest()
    monkeypatch.setattr(gpt_dataset, "hashlib", type("CountingHashlib", (), {"sha256": Counting}))
    prefix = write_docs(str(tmp_path / "src"), numbered_docs(40, seed=1), nbytes=[1] * 40)
    first = [gpt_dataset.data_hash(IndexedDataset(prefix)) for _ in range(3)]
    assert len(set(first)) == 1 and len(hashed) == 1
    write_docs(prefix, numbered_docs(41, seed=2), nbytes=[1] * 41)  # preprocessed again: a new file
    again = gpt_dataset.data_hash(IndexedDataset(prefix))
    assert len(hashed) == 2 and again != first[0]
