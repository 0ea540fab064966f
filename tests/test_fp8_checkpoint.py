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
from dept_mega.parallel.fp8 import default_cast_kernels
from tests.reshard_utils import make_loop, read_losses

STEPS = 6


def _over(fmt: str = "hybrid", history: int = 2, **more) -> dict:
    return {"dept": {"variant": "std"}, "precision": "bf16", "fp8": fmt, "fp8_recipe": "delayed",
            "fp8_amax_history": history, **more}


def _state(trainer) -> tuple:
    """The FP8 state a next step starts from (host copies; the last step's amaxes are zeroed
    by the next step, so they are not part of it)."""
    s = delayed_state(trainer)
    return (s.history.cpu().clone(), s.scale.cpu().clone(), s.inv.cpu().clone(), s.pos, sorted(s.recorded_columns()))


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _train(run_dir: str, over: dict, stop: int = 0, async_save: bool = False):
    """STEPS steps, or ``stop`` (``train.exit_interval``: a checkpoint, then the run ends; the
    LR schedule stays STEPS')."""
    loop = make_loop(over, run_dir, 0, data=1, steps=STEPS)
    loop.cfg.train.exit_interval = stop
    loop.cfg.train.async_save = async_save
    loop.run()
    return loop


def _resume(run_dir: str, over: dict):
    loop = make_loop(over, run_dir, 0, data=1, steps=STEPS)
    step = loop.checkpointer.load(loop)
    loop.writer.resume_at(step)
    return loop, step


@pytest.mark.parametrize("fmt,k,async_save", [("hybrid", 3, False), ("e4m3", 2, True)])
def test_resumed_delayed_fp8_run_continues_bit_for_bit(tmp_path, fmt, k, async_save):
    """Losses of every step and the FP8 state after the run equal the uninterrupted run's; the
    state right after the load equals the saved one (the scales matter only for an operand
    whose amaxes in the window are all zero, which the losses here cannot show)."""
    full = _train(str(tmp_path / "full"), _over(fmt))
    run = str(tmp_path / "resumed")
    first = _train(run, _over(fmt), k, async_save)
    saved = torch.load(os.path.join(run, "checkpoints", f"step_{k}", fp8_file(first.trainer.pg)), weights_only=True)
    assert saved["pos"] == (k - 1) % 3 != 0 and saved["history"].shape == (3, 3 * 4 * 2)  # 2 layers × 4 GEMMs
    loop, step = _resume(run, _over(fmt))
    restored = _same(_state(loop.trainer), _state(first.trainer))
    loop.run()
    got, want = read_losses(run), read_losses(str(tmp_path / "full"))
    assert step == k and sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    assert [got[s] for s in sorted(got)] == [want[s] for s in sorted(got)]  # bit for bit (floats compare exactly)
    assert _same(_state(loop.trainer), _state(full.trainer)), "the FP8 state after the run differs"
    assert restored, "the FP8 state after the load differs from the one saved"
    assert not loop.checkpointer.notes


THREE = {"model": {"num_layers": 3}}
FALLBACKS = {  # saved with, resumed with, why
    "amax_history": ({}, {"history": 3}, "was saved with fp8=hybrid, fp8_amax_history=2 (this launch: hybrid, 3)"),
    "format": ({}, {"fmt": "e4m3"}, "was saved with fp8=hybrid, fp8_amax_history=2 (this launch: e4m3, 2)"),
    "layers": (THREE, dict(THREE, fp8_first_last_layers_bf16=True),
               "fp8_tp0_dp0_pp0_g0.pt holds the amaxes of other FP8 layers than this rank runs"),
    "no_state": ({}, {}, "holds no FP8 scaling state (written without fp8_recipe: delayed, or by a dept_mega that "
                         "did not save it)")}


@pytest.mark.parametrize("case", sorted(FALLBACKS))
def test_no_restore_under_another_recipe_or_layers_or_without_saved_state(tmp_path, monkeypatch, case):
    """The resume goes on with an empty history (the first step current-scaled) and one line
    in the notes naming the reason; "no_state" is a checkpoint of a writer that saves none."""
    saved_with, resumed_with, why = FALLBACKS[case]
    run = str(tmp_path / "run")
    if case == "no_state":
        import dept_mega.checkpoint as checkpoint_module
        monkeypatch.setattr(checkpoint_module, "stage_fp8", lambda trainer: None)
    _train(run, _over(**saved_with), 2)
    monkeypatch.undo()
    loop, step = _resume(run, _over(**resumed_with))
    assert step == 2 and delayed_state(loop.trainer).history is None
    (line,) = loop.checkpointer.notes
    assert line.startswith(f"fp8: amax history not restored: checkpoint {run}/checkpoints/step_2") and why in line
    assert line.endswith("; the first step uses current scaling")
    loop.run()
    assert delayed_state(loop.trainer).history is not None


def _resume_two_replicas(rank, world, run_dir):
    loop = make_loop(_over(), run_dir, rank, data=2, steps=STEPS)
    assert loop.checkpointer.load(loop) == 2
    empty = delayed_state(loop.trainer).history is None
    loop.run()
    return loop.checkpointer.notes, empty, delayed_state(loop.trainer).history is not None


def test_no_restore_under_another_layout(tmp_path):
    """Saved by one process, resumed by two data-parallel replicas: every rank starts with an
    empty history, the notes say why (the same line on every rank), and training goes on."""
    from tests.mp_utils import run_distributed
    run = str(tmp_path / "run")
    _train(run, _over(), 2)
    out = run_distributed(_resume_two_replicas, 2, args=(run,), timeout=120)
    line = (f"fp8: amax history not restored: checkpoint {run}/checkpoints/step_2 was saved under another layout, "
            f"parallel.data=1 (this launch: 2); per-rank amaxes do not map onto other shards; the first step uses "
            f"current scaling")
    assert out == [([line], True, True)] * 2


@pytest.mark.gpu
def test_delayed_fp8_resumes_exactly_on_cuda(tmp_path):
    """The same on the GPU: the Triton casts read the restored scales in place, the restored
    history lives on the device; three steps, a save, a fresh trainer loads it, and both
    trainers take three more steps with the same losses, gradient norms and FP8 state.
    (``DEPT_MEGA_GPU_TESTS_ON_CPU=1`` rehearses it on the CPU.)"""
    from dept_mega.checkpoint import Checkpointer, load_weights
    from dept_mega.parallel.groups import build_groups
    from dept_mega.trainer import Trainer
    from tests.trainer_utils import dp_micro_batches, global_batch, tiny_config
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need compute capability 8.9+")
    cfg = tiny_config({"precision": "bf16", "fp8": "hybrid", "fp8_recipe": "delayed", "fp8_amax_history": 2,
                       "train": {"run_dir": str(tmp_path), "steps": 6}})
    a = Trainer(cfg, build_groups(), dev, vocab_size=cfg.model.vocab_size)
    assert delayed_state(a).kernels == default_cast_kernels(dev)  # on CUDA with Triton: its cast kernels
    step = lambda tr, s: tr.train_step(dp_micro_batches(cfg, global_batch(cfg, s), 0, 1))  # noqa: E731
    for s in range(3):
        step(a, s)

    class _Loop:  # what Checkpointer.save reads
        trainer, hooks, iterators = a, None, {}

    Checkpointer(str(tmp_path)).save(_Loop())
    b = Trainer(cfg, build_groups(), dev, vocab_size=cfg.model.vocab_size)
    notes: list = []
    load_weights(b, str(tmp_path), 3, notes=notes)
    b.step = 3
    assert not notes and delayed_state(b).pos == 2
    for s in range(3, 6):
        ra, rb = step(a, s), step(b, s)
        assert (ra.loss, ra.grad_norm) == (rb.loss, rb.grad_norm), s
    assert _same(_state(a), _state(b))
