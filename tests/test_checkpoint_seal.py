"""A checkpoint's seal (``dept_mega.checkpoint_seal``) that fails on one rank fails on every
rank with the same line — the save, the lowest failing rank, its error — and no rank waits for
another: a shard gone before the seal, a read error on one rank (with ``train.async_save`` too,
where the seal runs in the writer thread on a gloo group of its own), and a run directory that
each node has its own of (simulated: a run directory per rank), whose manifest would list
shards rank 0 does not have."""
from __future__ import annotations

import errno
import io
import os
import re

import pytest
import torch

from tests.mp_utils import run_distributed


def _save(rank, world, runs, fault, async_save):
    import torch.distributed as dist

    from dept_mega import checkpoint, checkpoint_seal
    from dept_mega.checkpoint import Checkpointer
    from dept_mega.loop import StdHooks, TrainLoop
    from dept_mega.metrics import MetricsWriter
    from dept_mega.parallel.groups import build_groups
    from dept_mega.trainer import Trainer
    from tests.dept_utils import SyntheticSource, tiny_config

    run = runs[rank]
    pg = build_groups(1, world, 1)
    cfg = tiny_config({"dept": {"variant": "std"}, "parallel": {"data": world},
                       "train": {"steps": 2, "save_interval": 2, "eval_interval": 0, "run_dir": run,
                                 "micro_batch_size": 1, "global_batch_size": world, "async_save": async_save}})
    trainer = Trainer(cfg, pg, torch.device("cpu"), vocab_size=cfg.model.vocab_size)
    loop = TrainLoop(cfg, pg, trainer, StdHooks(), MetricsWriter(run, enabled=rank == 0, stream=io.StringIO()),
                     lambda n: SyntheticSource(cfg, 3, torch.arange(cfg.model.vocab_size), pg.dp_rank, pg.dp_size),
                     checkpointer=Checkpointer(run))
    real_seal = checkpoint.seal
    if fault == "remove":  # the last rank's shard, gone before the seal (after every rank wrote)
        def seal(tmp, step, layout, metadata, device, group=None):
            dist.barrier(group)
            if rank == 0:
                names = checkpoint_seal.data_files(metadata, tmp)
                assert names[-1] == f"__{world - 1}_0.distcp", names
                os.remove(os.path.join(tmp, names[-1]))
            dist.barrier(group)
            return real_seal(tmp, step, layout, metadata, device, group)
        checkpoint.seal = seal  # this forked rank's own module
    elif fault in ("eio", "enospc") and rank == world - 1:
        def digest_files(*args, **kwargs):
            code = errno.EIO if fault == "eio" else errno.ENOSPC  # (fsync on NFS: a write-back's error)
            raise OSError(code, os.strerror(code))
        checkpoint_seal.digest_files = digest_files
    try:
        loop.run()
        loop.checkpointer.wait()
        error = None
    except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
        error = f"{type(exc).__name__}: {exc}"
    return error, os.path.exists(os.path.join(run, "checkpoints", "latest")), sorted(
        os.listdir(os.path.join(run, "checkpoints")))


def _one_error(res):
    errors = [r[0] for r in res]
    assert all(errors) and len(set(errors)) == 1, errors
    assert not any(r[1] for r in res), res  # no rank's latest names the failed save
    return errors[0]


@pytest.mark.timeout(200)
def test_a_shard_gone_before_the_seal_fails_the_save_on_every_rank(tmp_path):
    """3 ranks; rank 2's shard is removed: rank 2 cannot checksum it and rank 0 does not see it;
    every rank raises rank 0's line (the lowest failing rank), which names the file."""
    runs = [str(tmp_path / "run")] * 3
    res = run_distributed(_save, 3, args=(runs, "remove", False), timeout=180)
    tmp = os.path.join(runs[0], "checkpoints", "step_2.tmp")
    assert _one_error(res) == (
        f"SealError: checkpoint save {tmp} failed on rank 0: 1 of the 3 files the ranks wrote are not in {tmp} "
        f"as rank 0 sees it (__2_0.distcp): config key 'train.run_dir' must be the same directory on every node "
        f"(a file system shared by all nodes, not node-local storage)")


@pytest.mark.timeout(200)
@pytest.mark.parametrize("async_save", [False, True])
def test_a_read_error_on_one_rank_fails_the_save_on_every_rank(tmp_path, async_save):
    """Rank 2 of 3 cannot read its share: every rank raises the same line naming rank 2 and its
    error (train.async_save: through the writer thread, at the loop's wait)."""
    runs = [str(tmp_path / "run")] * 3
    res = run_distributed(_save, 3, args=(runs, "eio", async_save), timeout=180)
    tmp = os.path.join(runs[0], "checkpoints", "step_2.tmp")
    line = f"checkpoint save {tmp} failed on rank 2: OSError: [Errno 5] Input/output error"
    want = f"RuntimeError: asynchronous checkpoint save failed: {line}" if async_save else f"SealError: {line}"
    assert _one_error(res) == want


@pytest.mark.timeout(200)
def test_no_space_while_sealing_on_one_rank_is_the_full_disk_error_on_every_rank(tmp_path):
    """ENOSPC on rank 2's share (fsync of a file on NFS reports a failed write-back): every rank
    raises the full-disk error, and the partial step directory is removed."""
    runs = [str(tmp_path / "run")] * 3
    res = run_distributed(_save, 3, args=(runs, "enospc", False), timeout=180)
    free = re.compile(r"[\d,]+ bytes are free")  # read by each rank at its own moment
    error = _one_error([(free.sub("", r[0] or ""), *r[1:]) for r in res])
    assert error.startswith("CheckpointSpaceError: checkpoint step_2 not written: no space left"), error
    assert all(r[2] == [] for r in res), res


@pytest.mark.timeout(200)
def test_a_manifest_never_lists_a_shard_rank_0_does_not_have(tmp_path):
    """Each rank its own run directory (two nodes' local disks): rank 1 checksums its shard on its
    disk, but rank 0, which writes the manifest, has no such file: the save fails on both."""
    runs = [str(tmp_path / "node0" / "run"), str(tmp_path / "node1" / "run")]
    res = run_distributed(_save, 2, args=(runs, None, False), timeout=180)
    tmp = os.path.join(runs[0], "checkpoints", "step_2.tmp")
    why = (f"failed on rank 0: 1 of the 2 files the ranks wrote are not in {tmp} as rank 0 sees it (__1_0.distcp): "
           f"config key 'train.run_dir' must be the same directory on every node (a file system shared by all "
           f"nodes, not node-local storage)")
    # each rank names the save by its own path (one path on two nodes, in a real job)
    assert [r[0] for r in res] == [f"SealError: checkpoint save {run}/checkpoints/step_2.tmp {why}" for run in runs]
    assert not any(r[1] for r in res), res
    assert os.path.exists(os.path.join(runs[1], "checkpoints", "step_2.tmp", "__1_0.distcp"))


def test_the_seal_finds_dcps_data_files_whatever_metadata_dcp_returns(tmp_path):
    """The data files the seal splits among the ranks (and rank 0 checks it sees) are those DCP
    wrote, also where ``dcp.save``'s returned metadata names none (torch 2.11: its writer sets
    them on a copy): then they come from DCP's metadata file. Without them rank 0 would checksum
    every file alone, and a run directory on node-local storage would go unnoticed."""
    from types import SimpleNamespace

    import torch.distributed.checkpoint as dcp

    from dept_mega.checkpoint_seal import data_files
    tmp = str(tmp_path / "step_1.tmp")
    returned = dcp.save({"w": torch.ones(4), "b": torch.zeros(2)}, checkpoint_id=tmp)
    written = sorted(n for n in os.listdir(tmp) if n.endswith(".distcp"))
    assert written
    assert data_files(returned, tmp) == written
    assert data_files(SimpleNamespace(storage_data=None), tmp) == written  # (torch 2.11's)
    assert data_files(None, tmp) == []
