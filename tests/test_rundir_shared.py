"""``train.run_dir`` must be one directory for every rank: a run directory on node-local storage
is refused at start, on every rank, with one line naming the rank and host that sees another
directory. Two nodes with separate disks are simulated by giving each rank its own run
directory (the same path on two nodes is two directories, as two paths are on one machine)."""
from __future__ import annotations

import contextlib
import io
import os

import pytest

from tests.mp_utils import run_distributed
from tests.test_train_cli import _setup

QUICK = ["train.steps=2", "train.eval_interval=0", "train.save_interval=1", "train.log_interval=1"]


def _launch(rank, world, cfg, runs):
    from unittest import mock

    from dept_mega import rundir
    from dept_mega import train as train_cli
    rundir.SHARED_WAIT_S = 1.0  # (60 s on a cluster: an NFS attribute cache)
    out, err = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, {"DEPT_MEGA_DEVICE": "cpu"}), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        status = train_cli.main(["--config", cfg, *QUICK, f"train.run_dir={runs[rank]}"])
    return status, err.getvalue()


@pytest.mark.timeout(200)
def test_a_run_dir_each_node_has_its_own_of_stops_the_job_at_start(tmp_path):
    """Rank 1's node has no such file as rank 0 wrote: exit status 2 on both ranks, one error
    line from rank 0 naming rank 1 and what it found, and nothing trained or saved."""
    cfg = _setup(tmp_path)  # GLOB: 2 ranks are 2 source groups
    runs = [str(tmp_path / "node0" / "run"), str(tmp_path / "node1" / "run")]
    (s0, err0), (s1, err1) = run_distributed(_launch, 2, args=(cfg, runs), timeout=180)
    assert s0 == s1 == 2, err0[-2000:] + err1[-2000:]
    lines = [ln for ln in err0.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err0, err0
    assert lines[0].startswith("error: config key 'train.run_dir' is not the same directory on every node: rank 1 "
                               "on host "), lines[0]
    assert f"finds no file {runs[1]}/.shared_check, not the token " in lines[0]
    assert lines[0].endswith("use a file system shared by all nodes"), lines[0]
    assert not [ln for ln in err1.splitlines() if ln.startswith("error:")], err1  # rank 0 speaks for the job
    for run in runs:
        assert not os.path.exists(os.path.join(run, "checkpoints", "latest"))
        assert not os.path.exists(os.path.join(run, "metrics.jsonl"))


def _take_stale(rank, world, runs):
    from dept_mega.config import ConfigError
    from dept_mega.parallel.agree import is_agreed
    from dept_mega import rundir
    from dept_mega.rundir import take_run_dir, write_token
    rundir.SHARED_WAIT_S = 1.0
    if rank == 1:  # an earlier job's token on this node's own disk
        os.makedirs(runs[1], exist_ok=True)
        write_token(runs[1])
    try:
        take_run_dir(runs[rank], rank).release()
        return ("ok",)
    except ConfigError as e:
        return (str(e), is_agreed(e))


def test_a_token_left_by_an_earlier_job_on_another_disk_is_not_taken_for_this_ones(tmp_path):
    """Rank 1's directory holds a token file, an earlier one's: every rank raises the same
    agreed error, saying whose token rank 1 found."""
    runs = [str(tmp_path / "node0" / "run"), str(tmp_path / "node1" / "run")]
    (r0, r1) = run_distributed(_take_stale, 2, args=(runs,), timeout=60)
    assert r0 == r1 and r0[1] is True, (r0, r1)
    assert f"rank 1 on host {os.uname().nodename} finds in {runs[1]}/.shared_check token " in r0[0], r0
    assert "not the token " in r0[0] and "that rank 0 on host " in r0[0], r0


def test_a_token_that_shows_late_is_waited_for(tmp_path, monkeypatch):
    """A file system that shows rank 0's new file a few seconds late (an NFS client's attribute
    cache) is shared: the check looks again until the token reads right, and refuses only after
    SHARED_WAIT_S."""
    import threading
    import time

    from dept_mega import rundir
    from dept_mega.config import ConfigError
    here, there = tmp_path / "rank0", tmp_path / "rank1"
    here.mkdir()
    there.mkdir()
    token = rundir.write_token(str(here))

    def show_late():
        time.sleep(1.0)
        (there / rundir.SHARED_FILE).write_text(token)
    late = threading.Thread(target=show_late)
    monkeypatch.setattr(rundir, "SHARED_WAIT_S", 10.0)
    late.start()
    t0 = time.monotonic()
    rundir.check_shared(str(there), token, 1)
    late.join()
    assert 0.9 < time.monotonic() - t0 < 5
    (there / rundir.SHARED_FILE).unlink()
    monkeypatch.setattr(rundir, "SHARED_WAIT_S", 0.6)
    with pytest.raises(ConfigError, match=r"finds no file .*\(looked for 1 s\)"):
        rundir.check_shared(str(there), token, 1)
