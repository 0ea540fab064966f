"""No host synchronisation inside a training step beyond the documented ones.

A CUDA step must not wait for the GPU except once, for the step's loss statistics and gradient
norm, read together in one copy after the step's kernels up to the optimizer are launched. Without a GPU, torch's sync debug mode does not
exist, so this test watches the Python side instead: it counts every read of a tensor's value
on the host (``item``, ``tolist``, ``cpu``, ``numpy``, ``bool`` / ``int`` / ``float``) made by
dept_mega code during a TRIM step with attention and hidden dropout (the custom ops' remap and
gather, the dropout streams' ``fork_device_rng``), with and without the activation norms, and
names the call sites. The compiled
CUDA ops' own C++ is covered by tests/test_ops_gpu.py on a GPU.
"""
from __future__ import annotations

import inspect
import os

import pytest
import torch

from dept_mega.dept.driver import DeptHooks
from dept_mega.trainer import Trainer
from tests.dept_utils import SyntheticSource, allowed_ids, solo_groups, source_infos, tiny_config

import dept_mega

# the package's own folder: a path merely containing "dept_mega/" (a checkout named so, with
# its .venv and torch inside) is not ours
PKG = os.path.join(os.path.realpath(os.path.dirname(dept_mega.__file__)), "")
# (file, function, read) of the documented reads: the step's loss / token statistics with the
# gradient norm (needed every step for clipping and the non-finite skip), and the dropout
# seed's hash of a generator state, which torch keeps on the host for every device
# (Generator.get_state() is a CPU ByteTensor; a CUDA generator's Philox seed and offset).
ALLOWED = {("trainer.py", "train_step", "cpu"), ("trainer.py", "train_step", "tolist"),
           ("random.py", "fork_device_rng", "numpy")}
# the PyTorch fallback of the custom ops (no compiled extension) checks a remap's ids on the
# host, to raise for an id outside the source's vocabulary; the compiled kernels check on the device
FALLBACK_READS = {("fallback.py", "_remapped", "__bool__")}
READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")


def _caller_in_package():
    """(file name, function) of the read's caller when that is dept_mega code. Reads inside
    torch itself are not counted: e.g. torch.optim's AdamW reads its step counter, which it
    keeps on the host unless capturable / fused."""
    frame = inspect.stack(context=0)[2]
    if os.path.realpath(frame.filename).startswith(PKG):
        return os.path.basename(frame.filename), frame.function
    return None


@pytest.mark.parametrize("activation_norms", [False, True])
def test_trim_step_with_dropout_reads_no_tensor_outside_the_documented_sites(monkeypatch, activation_norms):
    """Also a step that measures the activation norms (train.log_activation_norms on a step
    that logs): they come back in the same read."""
    cfg = tiny_config({"dept": {"variant": "trim"},
                       "model": {"attention_dropout": 0.1, "hidden_dropout": 0.1}})
    sources = source_infos(2, trim=True)
    torch.manual_seed(cfg.train.seed)
    pg = solo_groups()
    trainer = Trainer(cfg, pg, torch.device("cpu"), vocab_size=sources[0].vocab_size)
    hooks = DeptHooks(cfg, pg, trainer, torch.device("cpu"), sources)
    name = hooks.round_start(None, 0)[pg.group_index]
    info = next(s for s in sources if s.name == name)
    it = SyntheticSource(cfg, 1, allowed_ids(info))
    trainer.train_step(it.next_step())  # warm-up: lazy state is built outside the count

    seen: dict[tuple, int] = {}
    for attr in READS:
        original = getattr(torch.Tensor, attr)

        def wrapped(self, *args, __original=original, __attr=attr, **kwargs):
            site = _caller_in_package()
            if site is not None:
                key = (*site, __attr)
                seen[key] = seen.get(key, 0) + 1
            return __original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, attr, wrapped)
    hooks.before_step(None)
    res = trainer.train_step(it.next_step(), activation_norms=activation_norms)
    hooks.after_step(None)
    monkeypatch.undo()
    assert (res.act_sums is not None) == activation_norms

    assert seen, "the patch saw no read at all (the documented ones must show)"
    from dept_mega.ops import loader
    allowed = ALLOWED if loader.status().loaded else ALLOWED | FALLBACK_READS
    assert set(seen) <= allowed, f"host reads outside the documented sites: {seen}"
    # one read of the device per step: the statistics and the norm together
    assert seen.get(("trainer.py", "train_step", "cpu")) == 1, seen


@pytest.mark.parametrize("tensor_parallel", [False, True])
def test_fork_device_rng_replays_and_does_not_read_the_stream(tensor_parallel, monkeypatch):
    """The seed comes from the stream's state (no value read back), differs call to call, and
    restoring the stream replays it (activation recomputation relies on that)."""
    from dept_mega.parallel.random import RNGTracker

    tracker = RNGTracker(3)

    def draw():
        with tracker.fork_device_rng(tensor_parallel):
            return torch.rand(4)

    states = tracker.get_states()
    monkeypatch.setattr(torch.Tensor, "item", lambda self: pytest.fail("item() in fork_device_rng"))
    a, b = draw(), draw()
    tracker.set_states(states)
    c = draw()
    monkeypatch.undo()
    assert not torch.equal(a, b) and torch.equal(a, c)


def test_phase_timer_measures_wall_clock_on_cpu():
    import time

    from dept_mega.profiling import PhaseTimer

    timer = PhaseTimer("cpu")
    with pytest.raises(RuntimeError, match=r"seconds\(\) before stop\(\)"):
        timer.seconds()
    time.sleep(0.05)
    assert 0.045 <= timer.stop().seconds() < 1.0
