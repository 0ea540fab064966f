"""The ranks build the sample indexes between them at start-up, outside collectives
(dept_mega/data/index_build.py), with a shared and with a node-local cache directory; a slow
build does not time the waiting ranks out; a builder's failure is every rank's; one process
builds alone; a cache nobody can write is not built at start-up."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

from dept_mega.data.gpt_dataset import EPOCH_ARRAYS, PART_ARRAYS
from dept_mega.data.index_build import IndexSpec, ensure_indexes, spec_cached
from tests.data_utils import numbered_docs, write_docs
from tests.mp_utils import run_distributed


def _specs(prefix: str, cache_dir: str, seq_length: int = 8) -> list[IndexSpec]:
    return [IndexSpec(0, "src", prefix, "train", seq_length, "90,10", 5, cache_dir, True),
            IndexSpec(0, "src", prefix, "valid", seq_length, "90,10", 5, cache_dir, False)]


def _cache_files(cache_dir: str) -> dict[str, int]:
    """name -> inode of every cached array: a file rewritten by a second builder changes inode."""
    return {f: os.stat(os.path.join(cache_dir, f)).st_ino for f in sorted(os.listdir(cache_dir))}


def _rank(rank: int, world: int, prefix: str, root: str, node_local: bool, seq_length: int,
          build_s: float = 1.0, timeout_s: float = 0.0) -> dict:
    # node_local: ranks 0,1 are "node 0" and ranks 2,3 "node 1", each node with its own cache dir
    from datetime import timedelta

    from dept_mega.data.gpt_dataset import GPTDataset
    if timeout_s:  # collectives on the world group time out after timeout_s, as under NCCL
        import torch.distributed.distributed_c10d as c10d
        c10d._set_pg_timeout(timedelta(seconds=timeout_s))
    builds = []

    def noting(method, sleep_s):
        def wrapped(self, *args):
            builds.append(f"{self.which} {method.__name__}")
            time.sleep(sleep_s)  # every rank starts its walk before the first build ends
            return method(self, *args)
        return wrapped
    GPTDataset._build = noting(GPTDataset._build, build_s)
    GPTDataset._build_part = noting(GPTDataset._build_part, 0.0)
    cache_dir = os.path.join(root, f"node{rank // 2}" if node_local else "shared")
    local_rank = rank % 2 if node_local else rank
    specs = _specs(prefix, cache_dir, seq_length)
    built = ensure_indexes(specs, rank, local_rank, log=None)
    if timeout_s:  # the rest of the test (reading samples, the harness's barrier) has no deadline
        c10d._set_pg_timeout(timedelta(seconds=300))
    files = _cache_files(cache_dir)
    sets = [s.open() for s in specs]
    samples = [np.stack([ds[i] for i in range(len(ds))]).tolist() for ds in sets]
    return {"built": built, "builds": builds, "files": files, "samples": samples,
            "misses": [d.cache_misses for d in sets],
            "mapped": all(isinstance(d.epoch_index(0).sample_order, np.memmap) for d in sets)}


@pytest.fixture()
def prefix(tmp_path):
    return write_docs(str(tmp_path / "src"), numbered_docs(80, seed=3), nbytes=[1] * 80)


def _each_built_once(outs: list) -> None:
    """Every array set (each part's documents and epoch 0) built once in all, and by more than
    one of the ranks ``outs`` (which one builds what depends on timing: a rank may build a
    part's documents and another its epoch 0)."""
    assert sum(bool(o["built"]) for o in outs) >= 2, [o["builds"] for o in outs]
    every = [b for o in outs for b in o["builds"]]
    assert sorted(every) == sorted(f"{w} {m}" for w in ("train", "valid") for m in ("_build", "_build_part")), every


def test_the_ranks_share_the_build_and_load_the_same_files(prefix, tmp_path):
    out = run_distributed(_rank, 3, args=(prefix, str(tmp_path), False, 8), timeout=120)
    _each_built_once(out)  # rank r starts at part r  # no part twice, on one rank or two
    assert all(o["misses"] == [0, 0] and o["mapped"] for o in out)  # nobody built after the walk
    assert out[0]["files"] == out[1]["files"] == out[2]["files"]  # the same files, written once
    assert len(out[0]["files"]) == 2 * (len(PART_ARRAYS) + len(EPOCH_ARRAYS))
    assert out[0]["samples"] == out[1]["samples"] == out[2]["samples"]


def test_a_slow_build_does_not_time_out_the_waiting_ranks(prefix, tmp_path):
    """Each build takes 3 s, collectives on the world group time out after 2 s: the ranks that
    wait for a part wait for its files, not in a collective."""
    out = run_distributed(_rank, 3, args=(prefix, str(tmp_path), False, 8, 3.0, 2.0), timeout=120)
    _each_built_once(out)
    assert out[0]["samples"] == out[1]["samples"] == out[2]["samples"]


def test_a_node_local_cache_is_built_by_each_nodes_ranks(prefix, tmp_path):
    out = run_distributed(_rank, 4, args=(prefix, str(tmp_path), True, 8), timeout=120)
    _each_built_once(out[:2])
    _each_built_once(out[2:])
    assert all(o["misses"] == [0, 0] and o["mapped"] for o in out)
    assert out[0]["files"] == out[1]["files"] and out[2]["files"] == out[3]["files"]
    assert out[0]["samples"] == out[1]["samples"] == out[2]["samples"] == out[3]["samples"]


def _failing(rank: int, world: int, prefix: str, cache_dir: str, seq_length: int) -> tuple:
    from dept_mega.parallel.agree import is_agreed
    try:
        ensure_indexes(_specs(prefix, cache_dir, seq_length), rank, rank, log=None)
    except Exception as exc:  # noqa: BLE001 - the outcome is the test's subject
        return type(exc).__name__, str(exc), is_agreed(exc)
    return None


def test_a_builders_input_error_is_every_ranks(prefix, tmp_path):
    # seq_length longer than the valid part: the builder's DatasetError, raised on every rank
    out = run_distributed(_failing, 3, args=(prefix, str(tmp_path / "c"), 10_000), timeout=120)
    assert all(o is not None and o[0] == "DatasetError" and o[2] for o in out), out
    assert all("one sample needs seq_length" in o[1] and prefix in o[1] for o in out), out


def _crashing(rank: int, world: int, prefix: str, cache_dir: str) -> tuple:
    from dept_mega.data.gpt_dataset import GPTDataset
    build, tries = GPTDataset._build, []

    def noting(self, epoch):
        tries.append(self.which)
        if rank == 0:
            raise MemoryError("no memory for the sample index")
        return build(self, epoch)
    GPTDataset._build = noting  # this rank's process only
    if rank:  # rank 0 claims both parts first, fails and releases them
        from dept_mega.data import index_build
        walk = index_build.build_parts

        def notes() -> int:
            return sum(f.endswith(".failed") for f in os.listdir(cache_dir)) if os.path.isdir(cache_dir) else 0

        def later(*args, **kwargs):  # after rank 0's two notes (or 5 s, without them)
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline and notes() < 2:
                time.sleep(0.05)
            return walk(*args, **kwargs)
        index_build.build_parts = later
    return _failing(rank, world, prefix, cache_dir, 8), tries


def test_a_failing_build_is_tried_once_and_its_error_is_every_ranks(prefix, tmp_path):
    """Rank 0's builds fail: it notes each failure before releasing the claim, and the other
    ranks (their walk starts once the notes are there) report that error instead of building again; the next launch builds (the note is
    that launch's) and removes the note."""
    cache_dir = str(tmp_path / "c")
    out = run_distributed(_crashing, 3, args=(prefix, cache_dir), timeout=120)
    assert out[0] == (("MemoryError", "no memory for the sample index", False), ["train", "valid"]), out
    for o, tries in out[1:]:
        assert tries == [] and o[0] == "IndexBuildFailed", out
        assert "failed to build on rank 0 (" in o[1] and "MemoryError: no memory" in o[1], out
    assert len([f for f in os.listdir(cache_dir) if f.endswith(".failed")]) == 2
    specs = _specs(prefix, cache_dir)
    assert ensure_indexes(specs, 0, 0, log=None) == 2 and all(spec_cached(s) for s in specs)
    assert not [f for f in os.listdir(cache_dir) if not f.endswith(".npy")]


def test_one_process_builds_once_and_then_only_loads(prefix, tmp_path):
    specs = _specs(prefix, str(tmp_path / "c"))
    assert not any(spec_cached(s) for s in specs)
    lines = []
    assert ensure_indexes(specs, 0, 0, log=lines.append, log_after_s=0.0) == 2
    assert all(spec_cached(s) for s in specs) and len(lines) == 2 and "part train" in lines[0]
    assert ensure_indexes(specs, 0, 0, log=lines.append, log_after_s=0.0) == 0 and len(lines) == 2


def _train_rank(argv: list, env: dict, builds: str) -> None:
    """One rank of ``python -m dept_mega.train ARGV`` (forked, torchrun's environment) that
    notes in ``builds`` each index array set it builds."""
    os.environ.clear()
    os.environ.update(env)
    from tests.trainer_utils import ROOT
    os.chdir(ROOT)
    out = os.open(os.devnull, os.O_WRONLY)
    os.dup2(out, 1)
    import torch
    torch.set_num_threads(1)
    from dept_mega import train
    from dept_mega.data.gpt_dataset import GPTDataset
    from dept_mega.process_exit import exit_after
    rank = env.get("RANK", "0")

    def noting(method):
        def wrapped(self, *args):
            with open(builds, "a") as f:
                f.write(f"{rank} {os.path.basename(self.prefix)} {self.which} {method.__name__}\n")
            return method(self, *args)
        return wrapped
    GPTDataset._build = noting(GPTDataset._build)
    GPTDataset._build_part = noting(GPTDataset._build_part)
    exit_after(lambda: train.main(argv))


def test_a_training_job_builds_each_index_once(tmp_path):
    """dept_mega.train on 2 ranks: every part's arrays and epoch 0's are built once, by one rank
    or the other; nobody builds again, training and the final evaluation included."""
    import multiprocessing

    from dept_mega.config import load_config
    from tests.mp_utils import _start_method, free_port, torchrun_env
    from tests.trainer_utils import TINY_STD, ensure_sample_corpus
    ensure_sample_corpus()
    world = 2
    argv = ["--config", TINY_STD, f"train.run_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}",
            "train.steps=1", "train.eval_interval=0", "train.eval_iters=1", "train.save_interval=0",
            "train.init_timeout_s=60", f"parallel.data={world}", "train.micro_batch_size=1",
            "train.global_batch_size=2"]
    builds = str(tmp_path / "builds.txt")
    port = free_port()
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    base.update({"OMP_NUM_THREADS": "1", "DEPT_MEGA_DEVICE": "cpu"})
    ctx = multiprocessing.get_context(_start_method())
    procs = [ctx.Process(target=_train_rank, args=(argv, dict(base, **torchrun_env(r, world, port)), builds))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
    for p in procs:
        if p.exitcode is None:
            p.kill()
    assert [p.exitcode for p in procs] == [0] * world
    with open(builds) as f:
        lines = sorted(f.read().split("\n")[:-1])
    names = [os.path.basename(s.prefix) for s in load_config(TINY_STD).data.sources]
    want = sorted(f"{n} {part} {m}" for n in names for part in ("train", "valid") for m in ("_build", "_build_part"))
    assert sorted(line.partition(" ")[2] for line in lines) == want, lines  # each once, by either rank


def _read_only_rank(rank: int, world: int, prefix: str, root: str, probe_refused: bool) -> dict:
    # a cache directory nobody can write (a read-only data directory without data.cache_dir):
    # writing is made to fail, as running as root would not let a chmod do it; probe_refused:
    # the write probe fails too (a read-only directory), else only saving does (a full disk)
    import warnings

    from dept_mega.data import gpt_dataset, index_build

    def refuse(stem, arrays):
        raise PermissionError(13, "Permission denied", stem)
    gpt_dataset.save_arrays = refuse
    if probe_refused:
        index_build.can_write = lambda directory: False
    specs = _specs(prefix, os.path.join(root, "ro"), 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built = ensure_indexes(specs, rank, 0, log=None)
        sets = [s.open() for s in specs]
        samples = [np.stack([ds[i] for i in range(len(ds))]).tolist() for ds in sets]
    return {"built": built, "misses": [d.cache_misses for d in sets], "samples": samples}


@pytest.mark.parametrize("probe_refused", [True, False])
def test_a_cache_nobody_can_write_is_not_built_at_start_up(prefix, tmp_path, probe_refused):
    """A cache directory that cannot be written: no rank builds at start-up (where the probe
    finds it out), or each rank at most one part (where only its save fails: it builds nothing
    more there); every rank builds its arrays once, in memory, when it opens a part, and reads
    the same samples."""
    out = run_distributed(_read_only_rank, 3, args=(prefix, str(tmp_path), probe_refused), timeout=120)
    assert all(o["built"] <= (0 if probe_refused else 1) for o in out), [o["built"] for o in out]
    assert all(o["misses"] == [1, 1] for o in out), [o["misses"] for o in out]  # epoch 0 of each part, once
    assert out[0]["samples"] == out[1]["samples"] == out[2]["samples"]
