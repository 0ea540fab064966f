"""tools/convert_checkpoint.py: a format-1 checkpoint (keys by rank position, written here by
the format-1 writers in dept_mega.checkpoint_v1, as the previous release wrote them) is
refused under another layout with one line naming the converter; converted, it resumes under
another layout with the losses of the original resumed at its own layout (within 1e-6)."""
import os
import shutil
import subprocess
import sys

import pytest

from tests.mp_utils import run_distributed
from tests.test_reshard import _loop, _losses

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STD = {"dept": {"variant": "std"}, "optim": {"distributed": True}}


def _write_format1(rank, world, run_dir):
    import dept_mega.checkpoint as ck
    import dept_mega.manifest as manifest
    from dept_mega.checkpoint_format import whole
    from dept_mega.checkpoint_v1 import model_state
    from dept_mega.config import save_config
    ck.FORMAT = manifest.FORMAT = 1
    ck.model_entries = lambda trainer, optimizer=True, replicated=frozenset(): [
        whole(k, v) for k, v in model_state(trainer).items()]
    loop = _loop(STD, run_dir, rank, data=2)
    loop.cfg.train.steps = 2
    if rank == 0:
        save_config(loop.cfg, os.path.join(run_dir, "config.yaml"))
    loop.run()


def _resume(rank, world, run_dir, data, tensor, expect_refusal=False):
    from dept_mega.manifest import CheckpointError
    loop = _loop(STD, run_dir, rank, data=data, tensor=tensor)
    if expect_refusal:
        with pytest.raises(CheckpointError) as err:
            loop.checkpointer.load(loop)
        return str(err.value)
    assert loop.checkpointer.load(loop) == 2
    loop.writer.resume_at(2)
    loop.run()
    return None


@pytest.mark.timeout(400)
def test_format1_checkpoint_converts_and_resumes_under_another_layout(tmp_path):
    run, same = str(tmp_path / "run"), str(tmp_path / "same")
    run_distributed(_write_format1, 2, args=(run,), timeout=200)
    step = os.path.join(run, "checkpoints", "step_2")
    with open(os.path.join(step, "manifest.json")) as f:
        assert '"format": 1' in f.read()
    shutil.copytree(run, same)
    # before conversion: one line naming the converter
    msg = run_distributed(_resume, 2, args=(run, 1, 2, True), timeout=200)[0]
    assert "format 1" in msg and f"tools/convert_checkpoint.py --run-dir {run} --step 2" in msg and "\n" not in msg
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"), "--run-dir", run],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr
    with open(os.path.join(step, "manifest.json")) as f:
        assert '"format": 2' in f.read()
    with open(os.path.join(run, "checkpoints", "latest")) as f:
        assert f.read().strip() == "2"
    assert os.path.isdir(step + ".format1")
    # the original at its own layout (data 2, distributed optimizer); the converted one under tensor 2
    run_distributed(_resume, 2, args=(same, 2, 1), timeout=200)
    run_distributed(_resume, 2, args=(run, 1, 2), timeout=200)
    got, want = _losses(run), _losses(same)
    assert [s for s in got if s > 2] == [s for s in want if s > 2] == [3, 4]
    for s in (3, 4):
        assert got[s] == pytest.approx(want[s], rel=1e-6, abs=0), (s, got[s], want[s])
