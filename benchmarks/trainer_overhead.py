#!/usr/bin/env python3
"""Overhead of our trainer against a minimal single-process PyTorch loop.

    OMP_NUM_THREADS=1 python benchmarks/trainer_overhead.py [--config examples/tiny/std.yaml] \
        [--steps 20] [--trials 5] [--out OVERHEAD.json] [key=value ...]

Both loops train the same model (``build_model`` with the same seed, so identical initial
weights) on the same synthetic batches with the same math: micro-batches with fp32 gradient
accumulation, loss = sum of token losses / tokens of the global batch, global-norm clipping,
AdamW (foreach on CPU) with the same LR schedule, the same precision. The minimal loop is the
textbook ``forward / backward / clip_grad_norm_ / step`` with one ``.item()`` per step for the
loss; ours is ``Trainer.train_step`` (pipeline schedule with one stage, bookkeeping of loss by
source, NaN checks, two optimizers). Trials alternate between the two to share the machine's
noise (step by step, alternating which goes first); the result is the median step time of
each and ``overhead = ours / minimal - 1`` (wall clock), ``overhead_cpu`` the same on the
process's CPU time (steadier on a shared machine; with one thread it is the step's compute). The
losses of the two loops are checked to agree (same math; 1e-4 relative in fp32, 2e-3 with
half-precision weights), otherwise the script fails.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from dept_mega.config import load_config  # noqa: E402
from dept_mega.model import build_model  # noqa: E402
from dept_mega.optim import build_adamw, lr_at  # noqa: E402
from dept_mega.parallel.groups import build_groups  # noqa: E402
from dept_mega.precision import Precision  # noqa: E402
from dept_mega.trainer import MicroBatch, Trainer  # noqa: E402


def batches(cfg, vocab: int, n: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, vocab, (cfg.train.global_batch_size, cfg.model.seq_length + 1), generator=g)
        out.append(list(tokens.split(cfg.train.micro_batch_size)))
    return out


class Minimal:
    """The reference loop: nothing but the model math."""

    def __init__(self, cfg, vocab: int) -> None:
        self.cfg = cfg
        (self.model,) = build_model(cfg, build_groups(), vocab, cfg.train.seed)
        self.params = list(self.model.parameters())
        half = Precision(cfg.precision, torch.device("cpu")).param_dtype
        self.half = half != torch.float32
        # half precision: fp32 masters (the init values), half weights, fp32 gradient sums
        self.masters = [p.detach().clone() for p in self.params] if self.half else self.params
        if self.half:
            for p in self.params:
                p.data = p.data.to(half)
        self.opt = build_adamw(self.masters, cfg.optim, torch.device("cpu"))
        self.step_no = 0

    def step(self, mbs: list[torch.Tensor]) -> float:
        cfg = self.cfg
        for g in self.opt.param_groups:
            g["lr"] = lr_at(self.step_no, cfg.optim, cfg.train.steps)
        self.opt.zero_grad(set_to_none=True)
        n = sum(x.shape[0] * (x.shape[1] - 1) for x in mbs)
        total = torch.zeros(())
        for x in mbs:
            per_token = self.model(x[:, :-1], x[:, 1:])
            loss = per_token.float().sum() / n
            loss.backward()
            total += loss.detach()
            if self.half:
                for m, p in zip(self.masters, self.params):
                    m.grad = p.grad.float() if m.grad is None else m.grad.add_(p.grad)
                    p.grad = None
        torch.nn.utils.clip_grad_norm_(self.masters, cfg.optim.clip_grad)
        self.opt.step()
        if self.half:
            with torch.no_grad():
                for m, p in zip(self.masters, self.params):
                    p.copy_(m)
        self.step_no += 1
        return float(total.item())


class Ours:
    def __init__(self, cfg, vocab: int) -> None:
        self.trainer = Trainer(cfg, build_groups(), torch.device("cpu"), vocab_size=vocab)

    def step(self, mbs: list[torch.Tensor]) -> float:
        return self.trainer.train_step([MicroBatch(x) for x in mbs]).loss


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=os.path.join(ROOT, "examples", "tiny", "std.yaml"))
    ap.add_argument("--steps", type=int, default=20, help="timed steps per trial")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cfg = load_config(args.config, args.overrides)
    from dept_mega.train import vocab_size_of
    vocab = vocab_size_of(cfg)
    total = args.warmup + args.steps * args.trials
    cfg.train.steps = total
    data = batches(cfg, vocab, total)
    runners = {"minimal": Minimal(cfg, vocab), "ours": Ours(cfg, vocab)}
    losses = {k: [] for k in runners}
    times = {k: [] for k in runners}
    cpu = {k: [] for k in runners}
    for s in range(args.warmup):
        for k, r in runners.items():
            losses[k].append(r.step(data[s]))
    # Step by step, alternating which loop goes first: slow drifts of a shared machine's load
    # hit both loops alike; the median per-step time ignores the outliers.
    for i in range(args.steps * args.trials):
        s = args.warmup + i
        order = list(runners) if i % 2 == 0 else list(reversed(runners))
        for k in order:
            t0, c0 = time.perf_counter(), time.process_time()
            losses[k].append(runners[k].step(data[s]))
            times[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
    # fp32: the loops agree to ~1e-8; with half-precision weights a 1-ulp difference of an fp32
    # master (the two loops sum the gradient norm in another order) can flip a bf16 rounding
    tol = 1e-4 if cfg.precision == "fp32" else 2e-3
    for a, b in zip(losses["ours"], losses["minimal"]):
        if abs(a - b) > tol * abs(b):
            print(f"error: the two loops disagree (loss {a} vs {b}): not the same math", file=sys.stderr)
            return 1
    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    tokens = cfg.train.global_batch_size * cfg.model.seq_length
    result = {"overhead": med["ours"] / med["minimal"] - 1.0,
              "overhead_cpu": med_cpu["ours"] / med_cpu["minimal"] - 1.0,
              "cpu_step_ms": {k: v * 1e3 for k, v in med_cpu.items()},
              "step_ms": {k: v * 1e3 for k, v in med.items()},
              "tokens_per_s": {k: tokens / v for k, v in med.items()},
              "mean_step_ms": {k: statistics.mean(v) * 1e3 for k, v in times.items()},
              "timed_steps": len(times["ours"]), "precision": cfg.precision, "threads": torch.get_num_threads(),
              "final_loss": {k: v[-1] for k, v in losses.items()}}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
