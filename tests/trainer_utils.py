"""Helpers for the trainer / pipeline / layout tests: tiny configs, deterministic global
batches split by data-parallel rank, and a worker that trains several layouts in one spawn."""
from __future__ import annotations

import copy
from typing import Any, Optional

import torch

from dept_mega.config import Config, config_from_dict
from dept_mega.parallel.groups import build_groups
from dept_mega.trainer import MicroBatch, Trainer

VOCAB = 100

TINY: dict[str, Any] = {
    "model": {"num_layers": 4, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 4,
              "ffn_hidden_size": 64, "seq_length": 16, "vocab_size": VOCAB, "position_embedding": "alibi",
              "hidden_dropout": 0.0, "attention_dropout": 0.0},
    "precision": "fp32",
    "backend": "local",
    "dept": {"variant": "std"},
    "optim": {"lr": 3.0e-3, "min_lr": 3.0e-4, "warmup_steps": 1, "clip_grad": 1.0},
    "train": {"steps": 3, "micro_batch_size": 2, "global_batch_size": 8, "seed": 7},
}


def gpu_test_device(fp8: bool = False, triton: bool = False) -> str:
    """The device of a test marked ``gpu``: ``cuda``, or ``cpu`` under DEPT_MEGA_GPU_TESTS_ON_CPU=1
    (a rehearsal of the test's logic; conftest skips ``gpu`` tests without CUDA otherwise).
    On a GPU, ``fp8`` skips without FP8 GEMMs (compute capability 8.9+), ``triton`` without
    Triton (the FP8 cast kernels)."""
    import os

    import pytest
    if not torch.cuda.is_available():
        if os.environ.get("DEPT_MEGA_GPU_TESTS_ON_CPU") == "1":
            return "cpu"
        pytest.skip("needs a CUDA device")
    if fp8 and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a CUDA GPU with FP8 (compute capability 8.9+)")
    if triton:
        from dept_mega.parallel import fp8_kernels
        if not fp8_kernels.AVAILABLE:
            pytest.skip("needs Triton")
    return "cuda"


def merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def tiny_config(over: Optional[dict] = None, overrides: tuple[str, ...] = ()) -> Config:
    return config_from_dict(merge(TINY, over or {}), list(overrides))


def global_batch(cfg: Config, step: int, seed: int = 0) -> torch.Tensor:
    """[global_batch_size, s+1] tokens of one step, independent of the layout."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    return torch.randint(0, cfg.model.vocab_size, (cfg.train.global_batch_size, cfg.model.seq_length + 1),
                         generator=g)


def dp_micro_batches(cfg: Config, tokens: torch.Tensor, dp_rank: int, dp_size: int) -> list[MicroBatch]:
    """The micro-batches of one data-parallel rank: a contiguous slice of the global batch."""
    per = tokens.shape[0] // dp_size
    mine = tokens[dp_rank * per:(dp_rank + 1) * per]
    b = cfg.train.micro_batch_size
    return [MicroBatch(tokens=mine[i:i + b]) for i in range(0, per, b)]


def train_losses(cfg: Config, steps: int, data_seed: int = 0, weights: bool = False) -> dict:
    """Train ``steps`` steps in the current process (distributed or not) with the config's
    layout; every rank returns the group-level losses and gradient norms, the held-out loss and,
    with ``weights``, this rank's parameters after the evaluation (``{"chunk.name": tensor}``)."""
    p = cfg.parallel
    pg = build_groups(p.tensor, p.data, p.pipeline)
    trainer = Trainer(cfg, pg, torch.device("cpu"), vocab_size=cfg.model.vocab_size)
    losses, norms = [], []
    for step in range(steps):
        mbs = dp_micro_batches(cfg, global_batch(cfg, step, data_seed), pg.dp_rank, pg.dp_size)
        res = trainer.train_step(mbs)
        losses.append(res.loss)
        norms.append(res.grad_norm)
    # forward-only (evaluation) schedule on a held-out batch: the mean token loss
    held_out = dp_micro_batches(cfg, global_batch(cfg, 10_000, data_seed), pg.dp_rank, pg.dp_size)
    loss_sum, tokens = trainer.eval_batches(held_out)
    out = {"loss": losses, "grad_norm": norms, "eval": [loss_sum / tokens]}
    if weights:
        out["weights"] = {f"{i}.{n}": p.detach().clone() for i, st in enumerate(trainer.stages)
                          for n, p in st.named_parameters()}
    return out


def layouts_worker(rank: int, world_size: int, runs: list[tuple[dict, tuple[str, ...]]], steps: int) -> list[dict]:
    """Run every (config dict, overrides) in ``runs`` one after another on the same ranks."""
    torch.manual_seed(0)
    return [train_losses(tiny_config(over, overrides), steps) for over, overrides in runs]


def assert_close(a: list[float], b: list[float], rel: float, what: str) -> None:
    assert len(a) == len(b), (what, a, b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= rel * max(abs(y), 1e-12), f"{what} step {i}: {x} vs reference {y}"


# ----------------------------------------------------------------------- sample corpus runs

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_STD = os.path.join(ROOT, "examples", "tiny", "std.yaml")


def ensure_sample_corpus() -> None:
    """Build examples/data/build (idempotent: a no-op when up to date)."""
    stamp = os.path.join(ROOT, "examples", "data", "build", "stamp.json")
    if os.path.exists(stamp) and os.path.exists(os.path.join(ROOT, "examples", "data", "build", "summary.json")):
        return
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "prepare_sample.py")], check=True, cwd=ROOT,
                   stdout=subprocess.DEVNULL, timeout=600)


def read_jsonl(path: str) -> list[dict]:
    import json
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def without_tensorboard_warning(err: str) -> str:
    """``err`` without the line a launch prints when the tensorboard package is missing (one
    per launch), so that checks of a launch's other stderr lines hold with or without it."""
    return "".join(ln for ln in err.splitlines(True) if not ln.startswith("warning: no TensorBoard events in "))


def run_script(script: str, *args: str, monkeypatch) -> int:
    """``python SCRIPT ARGS...``'s exit status, the script run as ``__main__`` in this process
    (its changes to sys.path and sys.argv taken back after the test): the script's own lines, without
    a fresh interpreter's imports (~4 s of CPU). DEPT_MEGA_FULL_EXIT=1: an entry point that leaves
    through dept_mega.process_exit raises SystemExit instead of ending this process."""
    import runpy

    import pytest
    monkeypatch.setenv("DEPT_MEGA_FULL_EXIT", "1")
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "argv", [script, *args])
    with pytest.raises(SystemExit) as exc:
        runpy.run_path(script, run_name="__main__")
    return exc.value.code
