"""Native FP8 with delayed scaling resumes exactly: each rank's amax history, scales, ring
position and ready operands go into the checkpoint (``dept_mega/checkpoint_fp8.py``) and come
back under the same layout and recipe, so a run resumed from step k makes the uninterrupted
run's losses and ends with its FP8 state, bit for bit. Under another layout or recipe, or from a
checkpoint without the state, the history starts empty (the first resumed step current-scaled)
and the load notes one line saying why, rather than failing.

The runs are the real ``TrainLoop`` (``tests/reshard_utils.make_loop``, STD, one process) with
a 2-step amax window, so the ring (3 rows) wraps during the run and a resume at k = 2 or 3
restarts it at a position other than 0."""
from __future__ import annotations

import os

import pytest
import torch

from dept_mega.checkpoint_fp8 import delayed_state, fp8_file
from tests.reshard_utils import make_loop, read_losses

STEPS = 6


def _over(fmt: str, history: int = 2) -> dict:
    return {"dept": {"variant": "std"}, "precision": "bf16", "fp8": fmt, "fp8_recipe": "delayed",
            "fp8_amax_history": history}


def _state(loop) -> tuple:
    """The FP8 state a next step starts from (host copies; the last step's amaxes are zeroed
    by the next step, so they are not part of it)."""
    s = delayed_state(loop.trainer)
    return (s.history.clone(), s.scale.clone(), s.inv.clone(), s.pos, sorted(s.recorded_columns()))


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _train(run_dir: str, fmt: str, stop: int, history: int = 2):
    loop = make_loop(_over(fmt, history), run_dir, 0, data=1, steps=STEPS)
    loop.cfg.train.exit_interval = stop  # stops after that step with a checkpoint (the LR schedule is STEPS')
    loop.run()
    return loop


def _resume(run_dir: str, fmt: str, history: int = 2):
    loop = make_loop(_over(fmt, history), run_dir, 0, data=1, steps=STEPS)
    step = loop.checkpointer.load(loop)
    loop.writer.resume_at(step)
    return loop, step


@pytest.mark.parametrize("fmt,k", [("hybrid", 3), ("e4m3", 2)])
def test_resumed_delayed_fp8_run_continues_bit_for_bit(tmp_path, fmt, k):
    full = _train(str(tmp_path / "full"), fmt, 0)
    run = str(tmp_path / "resumed")
    first = _train(run, fmt, k)
    saved = torch.load(os.path.join(run, "checkpoints", f"step_{k}", fp8_file(first.trainer.pg)), weights_only=True)
    assert saved["pos"] == (k - 1) % 3 != 0 and saved["history"].shape == (3, 3 * 4 * 2)  # 2 layers × 4 GEMMs
    loop, step = _resume(run, fmt)
    restored = _same(_state(loop), _state(first))
    loop.run()
    got, want = read_losses(run), read_losses(str(tmp_path / "full"))
    assert step == k and sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    assert [got[s] for s in sorted(got)] == [want[s] for s in sorted(got)]  # bit for bit (floats compare exactly)
    assert _same(_state(loop), _state(full)), "the FP8 state after the run differs from the uninterrupted run's"
    assert restored, "the FP8 state after the load differs from the one saved"
    assert not loop.checkpointer.notes


def test_no_restore_under_another_recipe_or_from_a_checkpoint_without_fp8_state(tmp_path, monkeypatch):
    run = str(tmp_path / "run")
    _train(run, "hybrid", 2)
    # another amax window: an empty history, one line in the notes, and training goes on
    loop, _ = _resume(run, "hybrid", history=3)
    assert delayed_state(loop.trainer).history is None
    assert loop.checkpointer.notes == [
        f"fp8: amax history not restored: checkpoint {run}/checkpoints/step_2 was saved with fp8=hybrid, "
        f"fp8_amax_history=2 (this launch: hybrid, 3); the first step uses current scaling"]
    loop.run()
    assert delayed_state(loop.trainer).history is not None
    # a checkpoint written without the state (an older dept_mega): loads, with the same kind of line
    import dept_mega.checkpoint as checkpoint_module
    old = str(tmp_path / "old")
    monkeypatch.setattr(checkpoint_module, "stage_fp8", lambda trainer: None)
    _train(old, "hybrid", 2)
    monkeypatch.undo()
    loop, step = _resume(old, "hybrid")
    assert step == 2 and delayed_state(loop.trainer).history is None
    assert len(loop.checkpointer.notes) == 1 and loop.checkpointer.notes[0].startswith(
        f"fp8: amax history not restored: checkpoint {old}/checkpoints/step_2 holds no FP8 scaling state")
    loop.run()


def _resume_two_replicas(rank, world, run_dir):
    loop = make_loop(_over("hybrid"), run_dir, rank, data=2, steps=STEPS)
    assert loop.checkpointer.load(loop) == 2
    empty = delayed_state(loop.trainer).history is None
    loop.run()
    return loop.checkpointer.notes, empty, delayed_state(loop.trainer).history is not None


def test_no_restore_under_another_layout(tmp_path):
    """Saved by one process, resumed by two data-parallel replicas: every rank starts with an
    empty history, the notes say why (the same line on every rank), and training goes on."""
    from tests.mp_utils import run_distributed
    run = str(tmp_path / "run")
    _train(run, "hybrid", 2)
    out = run_distributed(_resume_two_replicas, 2, args=(run,), timeout=120)
    line = (f"fp8: amax history not restored: checkpoint {run}/checkpoints/step_2 was saved under another layout, "
            f"parallel.data=1 (this launch: 2); per-rank amaxes do not map onto other shards; the first step uses "
            f"current scaling")
    assert out == [([line], True, True)] * 2
