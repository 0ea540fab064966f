"""DEPT evaluation shared out over the source groups (dept_mega/dept/eval_split.py): after a round's
sync each source is evaluated by one group only, and the records are bit for bit those of every
group evaluating every source (the behaviour before, forced here by patching the assignment
away); in the middle of a round every group still evaluates every source. Two groups of one
rank (gloo), three sources of the sample corpus, an evaluation after every step of two rounds
of two steps; then ``dept_mega.evaluate`` of the final checkpoint in two groups shares the
sources out as well, with the run's final numbers."""
from __future__ import annotations

import os

import pytest
import torch

from tests.federation_utils import write_config
from tests.test_fp8_auto import cuda_here  # noqa: F401 - the fixture
from tests.mp_utils import run_distributed
from tests.trainer_utils import read_jsonl, tiny_config


def _rank(rank: int, world: int, argv: list, log: str, split: bool, module: str) -> dict:
    """One rank of ``python -m dept_mega.<module> ARGV`` (train or evaluate), its output to
    ``log``.rank; ``split=False``: every group evaluates every source (the assignment patched
    away), and the run writes no checkpoint (that reference run's are read by nothing: ~1 s a
    save). Returns its status and the (step, source) of each evaluation this rank ran."""
    import importlib
    import sys

    from dept_mega.dept.driver import DeptHooks
    seen: list = []
    original = DeptHooks.eval_context

    def eval_context(self, loop, source, **kw):
        seen.append((self.trainer.step, source))
        return original(self, loop, source, **kw)

    DeptHooks.eval_context = eval_context
    if not split:
        from dept_mega.checkpoint import Checkpointer
        DeptHooks.eval_assignment = lambda self, names: None
        Checkpointer.save = lambda self, loop: None
    with open(f"{log}.{rank}", "w") as f:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        status = importlib.import_module(f"dept_mega.{module}").main(argv)
        sys.stdout.flush()
        sys.stderr.flush()
    return {"status": status, "seen": seen}


def _run(cfg: str, run: str, split: bool, *extra: str) -> list[dict]:
    os.makedirs(run, exist_ok=True)
    # train.seed 1: the round plans put en on group 1 and fr on group 0 (SPEC evaluates a source where
    # its embeddings are, not in the order of the sources)
    # (2 rounds of 2 groups over the tiny configs' sources leave some untrained: SPEC launches anyway)
    argv = ["--config", cfg, f"train.run_dir={run}", "train.eval_interval=1", "train.seed=1",
            "dept.untrained_sources=warn", *extra]
    out = run_distributed(_rank, 2, args=(argv, os.path.join(run, "out"), split, "train"), timeout=180)
    assert [r["status"] for r in out] == [0, 0], [open(os.path.join(run, f"out.{r}")).read()[-3000:] for r in (0, 1)]
    return out


def _records(run: str, kind: str, drop=("time",)) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in drop} for r in read_jsonl(os.path.join(run, "metrics.jsonl"))
            if r["kind"] == kind]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("variant", ["glob", "trim", "spec", "spec_opt"])
@pytest.mark.slow
def test_shared_out_evaluation_gives_every_groups_numbers(tmp_path, variant):
    cfg = write_config(str(tmp_path), steps=4, local_steps=2, sources=3, example=variant)
    shared = _run(cfg, str(tmp_path / "shared"), split=True)
    every = _run(cfg, str(tmp_path / "every"), split=False)
    evals = _records(str(tmp_path / "shared"), "eval")
    assert [r["step"] for r in evals] == [1, 2, 3, 4]
    assert evals == _records(str(tmp_path / "every"), "eval")  # bit for bit (JSON floats round-trip)
    # the evaluations changed nothing the run trained or sent
    timing = ("time", "tokens_per_s", "tokens_per_s_per_device", "tflops_per_device", "mfu")
    assert _records(str(tmp_path / "shared"), "train", timing) == _records(str(tmp_path / "every"), "train", timing)
    sent = [r["bytes"] for r in _records(str(tmp_path / "shared"), "outer")]
    assert sent == [r["bytes"] for r in _records(str(tmp_path / "every"), "outer")]
    names = sorted(evals[0]["by_source"])
    for step in (1, 2, 3, 4):
        every_ran = [sorted(s for t, s in r["seen"] if t == step) for r in every]
        assert every_ran == [names, names], (step, every_ran)
        ran = [sorted(s for t, s in r["seen"] if t == step) for r in shared]
        if step % 2:  # mid-round: the groups' bodies differ, every group evaluates every source
            assert ran == [names, names], (step, ran)
        else:  # after the round's sync: each source once, ~K/G per group
            assert sorted(ran[0] + ran[1]) == names and {len(ran[0]), len(ran[1])} == {1, 2}, (step, ran)
    if variant in ("trim", "spec"):
        ran = _evaluate_checkpoint(str(tmp_path / "shared"), evals[-1])
        assert sorted(ran[0] + ran[1]) == names and all(ran), ran


@pytest.mark.timeout(200)
@pytest.mark.slow
def test_fragments_trained_on_after_their_sync_keep_every_group_evaluating(tmp_path):
    """``dept.outer_fragments: 2``: the first fragment is synchronised after a round's first step
    and trained on after it, so at the first round's end the groups' bodies differ: every group
    evaluates every source, in the run and in ``dept_mega.evaluate`` of that step's checkpoint
    (which holds that fragment per group). At the run's end every fragment is synchronised once
    more (the final weights are the same in every group): shared out."""
    cfg = write_config(str(tmp_path), steps=4, local_steps=2, sources=3, example="glob")
    run = str(tmp_path / "run")
    res = _run(cfg, run, True, "dept.outer_fragments=2", "train.save_interval=2")
    evals = _records(run, "eval")
    names = sorted(evals[0]["by_source"])
    for step in (1, 2, 3):
        assert [sorted(s for t, s in r["seen"] if t == step) for r in res] == [names, names], step
    assert sorted(sum([[s for t, s in r["seen"] if t == 4] for r in res], [])) == names
    assert _evaluate_checkpoint(run, evals[1], step=2) == [names, names]
    ran = _evaluate_checkpoint(run, evals[-1])
    assert sorted(ran[0] + ran[1]) == names and all(ran), ran


def _evaluate_checkpoint(run: str, record: dict, step=None) -> list[list[str]]:
    """``dept_mega.evaluate`` of the run's checkpoint of ``step`` (default: the final one) in two
    groups: its numbers are the run's evaluation ``record`` of that step. Returns the sources each
    rank evaluated (shared out where every model parameter was read from its group-free key, at
    a round boundary after a blocking sync)."""
    import json
    out = os.path.join(run, "e.json")
    argv = ["--run-dir", run, "--out", out] + ([] if step is None else ["--step", str(step)])
    res = run_distributed(_rank, 2, args=(argv, os.path.join(run, "eval_out"), True, "evaluate"), timeout=120)
    assert [r["status"] for r in res] == [0, 0], open(os.path.join(run, "eval_out.0")).read()[-3000:]
    got = json.load(open(out))
    assert got["by_source"] == record["by_source"] and got["step"] == record["step"]
    return [sorted(s for _, s in r["seen"]) for r in res]


@pytest.mark.timeout(200)
def test_stages_agree_on_whether_to_share_out(tmp_path):
    """SPEC, two pipeline stages per group, ``dept.outer_fragments: 2``: at the first round's end
    the second stage's parameters are fresh from their sync and the first stage's are not; the
    stages must take the same decision (every group evaluates every source), or their
    collectives would not pair up."""
    cfg = write_config(str(tmp_path), steps=4, local_steps=2, sources=3, example="spec")
    run = str(tmp_path / "run")
    os.makedirs(run, exist_ok=True)
    argv = ["--config", cfg, f"train.run_dir={run}", "train.eval_interval=2", "train.seed=1", "dept.untrained_sources=warn",
            "parallel.pipeline=2", "dept.outer_fragments=2"]
    res = run_distributed(_rank, 4, args=(argv, os.path.join(run, "out"), True, "train"), timeout=150)
    assert [r["status"] for r in res] == [0] * 4, open(os.path.join(run, "out.0")).read()[-3000:]
    names = sorted(_records(run, "eval")[0]["by_source"])
    assert [sorted(s for t, s in r["seen"] if t == 2) for r in res] == [names] * 4


def test_math_that_differs_between_groups_keeps_every_group_evaluating(cuda_here, monkeypatch):  # noqa: F811
    """Where the same parameters give other bits in another group the evaluation is not shared
    out: cuBLASLt algorithms timed per rank (fp8_gemm_tuning, on a GPU), Transformer Engine's
    FP8 (each group's own amax history); native FP8 evaluates with current scaling: shared."""
    from types import SimpleNamespace

    from dept_mega.dept.driver import DeptHooks
    from dept_mega.model import backends as backends_module
    fp8 = {"precision": "bf16", "fp8": "hybrid"}
    ask = lambda over, device="cuda": DeptHooks._group_dependent_math(  # noqa: E731
        SimpleNamespace(cfg=tiny_config(over), device=torch.device(device)))
    assert not ask({}) and not ask(fp8)
    assert ask({**fp8, "fp8_gemm_tuning": 8}) and not ask({**fp8, "fp8_gemm_tuning": 8}, "cpu")
    monkeypatch.setattr(backends_module, "_resolve_linear", lambda cfg, device: ("transformer_engine", []))
    assert ask(fp8)
