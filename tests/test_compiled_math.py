"""``CudaCompiled`` (``parallel/compiled_math.py``): on CUDA a function is ``torch.compile``'d with
``fullgraph``, where going over Dynamo's ``recompile_limit`` is a hard ``FailOnRecompileLimitHit``.
Each function has a limit of its own (``RECOMPILE_LIMIT``) that leaves the global one alone, and
the FP8 torch casts of a delayed-scaling run with an evaluation stay within it.

The CUDA branch is forced on the CPU: ``on`` returns the compiled function and ``torch.compile``
uses the ``eager`` backend (Dynamo's guards, hence its recompiles, do not
depend on the device or the backend)."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo

from dept_mega.parallel import compiled_math
from dept_mega.parallel.compiled_math import CudaCompiled


def as_on_cuda(fn) -> CudaCompiled:
    """``CudaCompiled(fn)`` whose ``on`` returns, on any device, what it returns on CUDA."""
    out = CudaCompiled(fn)
    out.on = lambda device: out.fn if torch.compiler.is_compiling() else out.compiled
    return out


@pytest.fixture
def on_cuda(monkeypatch):
    """``torch.compile`` with the ``eager`` backend; returns the list of graphs it makes."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, **{**kw, "backend": backend}))
    torch._dynamo.reset()
    yield graphs
    torch._dynamo.reset()


def _tagged(x: torch.Tensor, tag: str) -> torch.Tensor:
    return x + len(tag)  # a graph per tag (a str is a constant to Dynamo)


def _tagged_elsewhere(x: torch.Tensor, tag: str) -> torch.Tensor:
    return x - len(tag)


@pytest.mark.parametrize("scoped", [True, False], ids=["compile-recompile_limit", "retry-under-patch"])
def test_a_compiled_function_has_its_own_recompile_limit(on_cuda, monkeypatch, scoped):
    """More graphs than Dynamo's default limit (8) for one ``CudaCompiled`` function, each run once
    and then again from its cache; the global limit is unchanged and still stops another compiled
    function at 8. ``scoped``: torch.compile's ``recompile_limit`` (torch 2.13), else the retry
    under a patched limit that torch 2.11 gets."""
    if scoped and not compiled_math._SCOPED_LIMIT:
        pytest.skip("this torch.compile has no recompile_limit")
    monkeypatch.setattr(compiled_math, "_SCOPED_LIMIT", scoped)
    default = torch._dynamo.config.recompile_limit
    assert default < 12 < compiled_math.RECOMPILE_LIMIT
    fn = as_on_cuda(_tagged).on(torch.device("cpu"))
    tags = [f"t{i:02d}" + "x" * i for i in range(12)]
    for _ in range(2):
        for tag in tags:
            assert fn(torch.zeros(2), tag).tolist() == [len(tag)] * 2
    assert len(on_cuda) == len(tags)
    assert torch._dynamo.config.recompile_limit == default
    other = torch.compile(_tagged_elsewhere, fullgraph=True, dynamic=True)
    with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
        for tag in tags:
            other(torch.zeros(2), tag)
    assert len(on_cuda) == len(tags) + default


@pytest.mark.slow
def test_the_cuda_compiled_cast_serves_a_delayed_run_without_recompile_limit(on_cuda, monkeypatch):
    """``fp8_casts: torch``: the compiled ``fp8_math._CAST`` (as on CUDA) through three steps of
    delayed scaling (the first with current scaling) and an evaluation. Without the input
    detached and the function's own limit it made 11 graphs in training (``requires_grad`` and
    view-base variants), and failed with FailOnRecompileLimitHit in step 1."""
    from dept_mega.parallel import fp8_math
    from dept_mega.parallel.groups import build_groups
    from dept_mega.trainer import Trainer
    from tests.trainer_utils import dp_micro_batches, global_batch, tiny_config
    monkeypatch.setattr(fp8_math, "_CAST", as_on_cuda(fp8_math._cast_math))
    cfg = tiny_config({"precision": "bf16", "fp8": "hybrid", "fp8_casts": "torch", "model": {"num_layers": 2}})
    trainer = Trainer(cfg, build_groups(), torch.device("cpu"), vocab_size=cfg.model.vocab_size)
    with torch.backends.mkldnn.flags(enabled=False):
        for step in range(3):
            trainer.train_step(dp_micro_batches(cfg, global_batch(cfg, step), 0, 1))
        trainer.eval_batches(dp_micro_batches(cfg, global_batch(cfg, 9), 0, 1))
    assert 0 < len(on_cuda) <= 8, f"{len(on_cuda)} graphs of the cast"  # within Dynamo's default limit
