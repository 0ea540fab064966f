#!/usr/bin/env python3
"""Peak activation memory of one training step on one CUDA device against the memory model
(dept_mega/dept/memory.py ``activation_bytes``), for each ``model.recompute`` mode.

    python benchmarks/activation_memory.py --config CFG.yaml [key=value ...] [--modes none,selective,full] \
        [--steps 2] --out ACT.json

One process, one rank (tensor, pipeline and data 1; the config's layout keys are overridden).
For every mode: build the trainer, run ``--steps`` steps (the first creates the gradient
buffers and AdamW state), then measure ``torch.cuda.max_memory_allocated`` over one more step
from a reset, minus the memory allocated before it (weights, gradient buffers, optimizer
state): the step's peak transient memory, which the model predicts as the activations of one
micro-batch (a step accumulates its micro-batches one after another). Writes ACT.json with
predicted and measured bytes and the relative error per mode; prints one line per mode.
Needs CUDA (exits 2 without it).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def measure(cfg, steps: int) -> dict:
    import torch

    from dept_mega.dept.memory import activation_bytes
    from dept_mega.parallel.groups import Coords, ParallelGroups
    from dept_mega.trainer import MicroBatch, Trainer

    dev = torch.device("cuda")
    vocab = cfg.model.vocab_size
    pg = ParallelGroups(tp_size=1, dp_size=1, pp_size=1, num_groups=1, rank=0, coords=Coords(0, 0, 0, 0))
    torch.manual_seed(cfg.train.seed)
    trainer = Trainer(cfg, pg, dev, vocab_size=vocab)
    t = cfg.train
    gen = torch.Generator().manual_seed(0)

    def batch():
        n = t.global_batch_size // t.micro_batch_size
        return [MicroBatch(tokens=torch.randint(0, vocab, (t.micro_batch_size, cfg.model.seq_length + 1),
                                                generator=gen)) for _ in range(n)]

    for _ in range(steps):
        trainer.train_step(batch())
    mbs = batch()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    trainer.train_step(mbs)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    predicted = activation_bytes(cfg, vocab, 0)
    del trainer
    torch.cuda.empty_cache()
    return {"predicted_bytes": predicted, "measured_peak_bytes": int(peak),
            "error_pct": 100.0 * (predicted - peak) / peak if peak else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--modes", default="none,selective,full")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("activation_memory: error: needs a CUDA device", file=sys.stderr)
        return 2
    from dept_mega.config import ConfigError, load_config

    results = {}
    for mode in args.modes.split(","):
        over = list(args.overrides) + ["parallel.tensor=1", "parallel.pipeline=1", "parallel.data=1",
                                       "parallel.sequence_parallel=false", "dept.variant=std",
                                       f"model.recompute={mode}"]
        try:
            cfg = load_config(args.config, over)
        except ConfigError as exc:
            print(f"activation_memory: error: {exc}", file=sys.stderr)
            return 2
        if cfg.model.vocab_size is None:
            print("activation_memory: error: set model.vocab_size", file=sys.stderr)
            return 2
        results[mode] = measure(cfg, args.steps)
        r = results[mode]
        print(f"{mode:9} predicted {r['predicted_bytes'] / 1e9:.3f} GB, measured peak "
              f"{r['measured_peak_bytes'] / 1e9:.3f} GB, error {r['error_pct']:.1f}%")
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "config": args.config,
           "overrides": args.overrides, "modes": results}
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
