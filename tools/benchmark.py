#!/usr/bin/env python3
"""Throughput of the inner training step (the `bench` record of docs/metrics.md).

    python tools/benchmark.py --config CFG.yaml [key=value ...] --steps N --out BENCH.json
    torchrun --standalone --nproc-per-node N tools/benchmark.py --config CFG.yaml ...   # N ranks

Builds the run's model and trainer in the configured layout and times ``--steps`` training
steps (after ``--warmup`` untimed ones) on synthetic token batches of the configured shape
(uniform ids from the model's vocabulary), so data loading is not measured. Every config key
and dotted override is accepted as for training (precision, fp8, backend, model.*, parallel.*,
optim.*, train.*; whatever the Trainer honours is benchmarked). Writes one ``kind: "bench"``
record (docs/metrics.md) to BENCH.json: ``tokens_per_s`` (all groups),
``tokens_per_s_per_device``, ``tflops_per_device`` (null on CPU), ``mfu`` over ``peak_tflops``,
the device's dense bf16 peak, for FP8 runs too (``mfu_basis`` says so; known for H100 SXM, H200
SXM and GH200; null elsewhere), ``step_ms`` (mean), ``peak_mem_gb`` (CUDA: peak allocated over the
timed steps, max over ranks; CPU: the process's peak resident set), ``peak_reserved_gb`` (CUDA:
the caching allocator's peak reserved memory over the timed steps, max over ranks; null on CPU).
The timed steps themselves: ``step_ms_all`` (each one's ms: CUDA events between the steps, wall
clock on the CPU), ``last_loss``, ``skipped_steps`` (steps that skipped the optimizer for a non-finite
loss or gradient norm) and ``graphs_compiled_in_timed_steps`` (torch.compile graphs made
during them: a recompilation). A timed step that skipped the optimizer makes the record invalid:
it says why in ``invalid`` and the tool exits 1 (such a step is faster than a training step).
Extra keys describe the setup: the device name, torch / CUDA versions, the date and the resolved
``config``.

``train.profile: {start, stop, ranks}`` writes a torch.profiler trace of steps start+1 … stop
to ``train.run_dir``/profile (step numbers run from 1 over the warm-up steps, then the timed
ones, then these). The profiled steps must come after the timed ones (start >= warm-up + timed
steps; they are run, untimed, after the timed window): on CUDA a profiler session leaves CUPTI
attached after it stops (kineto detaches it only with ``TEARDOWN_CUPTI=1``), which slows every
later step of the process, so a step timed after a profiled one would not be comparable with
the same step in an unprofiled run. A range that starts earlier is refused (exit 2). The
record's ``profiled_steps`` names the steps traced (null without ``train.profile``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch._inductor import config as inductor_config  # noqa: E402

from dept_mega.config import ConfigError, load_config, validate  # noqa: E402
from dept_mega.megatron_flags import parse_with_hints  # noqa: E402
from dept_mega.metrics import MFU_BASIS, device_peak_flops, make_record, train_flops_per_token  # noqa: E402
from dept_mega.model import describe_backends  # noqa: E402
from dept_mega.parallel.fp8_gemm import describe_tuning, tuning_log  # noqa: E402
from dept_mega.parallel.groups import build_groups, init_distributed  # noqa: E402
from dept_mega.profiling import PhaseTimer, StepProfiler  # noqa: E402
from dept_mega.trainer import MicroBatch, Trainer  # noqa: E402


def synthetic_step(cfg, vocab: int, pg, step: int) -> list[MicroBatch]:
    t = cfg.train
    per_rank = t.global_batch_size // pg.dp_size
    g = torch.Generator().manual_seed(cfg.train.seed * 7919 + step * 131 + pg.dp_rank)
    tokens = torch.randint(0, vocab, (per_rank, cfg.model.seq_length + 1), generator=g)
    return [MicroBatch(x) for x in tokens.split(t.micro_batch_size)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="YAML config (as for dept_mega.train)")
    ap.add_argument("--steps", type=int, required=True, help="timed training steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before them (default 2)")
    ap.add_argument("--out", required=True, help="JSON file for the bench record (docs/metrics.md)")
    ap.add_argument("overrides", nargs="*", help="dotted key=value config overrides, e.g. parallel.data=1")
    args = parse_with_hints(ap, argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.steps < 1:
        print("error: --steps must be >= 1", file=sys.stderr)
        return 2
    prof = cfg.train.profile
    timed_end = args.warmup + args.steps  # the step number of the last timed step
    if prof is not None and prof.start < timed_end:
        print(f"error: config key 'train.profile': start={prof.start} traces step {prof.start + 1}, not after the "
              f"timed steps ({args.warmup + 1}-{timed_end}); a profiler session leaves CUPTI attached on CUDA, "
              f"which slows the steps after it, so the benchmark profiles after the timed window: "
              f"train.profile.start={timed_end} train.profile.stop={timed_end + prof.stop - prof.start}",
              file=sys.stderr)
        return 2
    try:
        rank, world, device = init_distributed(device=cfg.train.device)
    except ConfigError as exc:  # train.device: cuda without a usable CUDA device, named
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        validate(cfg, world, check_files=False)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from dept_mega.run_inputs import input_errors, vocab_size_of
    from dept_mega.variant import variant_of
    try:
        vocab = vocab_size_of(cfg)
    except ConfigError as exc:  # names its own key (e.g. no tokenizer and no model.vocab_size)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except input_errors() as exc:
        # the batches are synthetic: only the vocabulary size is read from the tokenizer
        spec_opt = variant_of(cfg).own_tokenizer
        key = "data.sources[0].tokenizer" if spec_opt or not cfg.data.tokenizer else "data.tokenizer"
        size = "model.vocab_size=N" if spec_opt else "data.tokenizer=null model.vocab_size=N"
        print(f"error: config key '{key}' (read for the model's vocabulary size): {exc}; build the "
              f"tokenizers (python tools/prepare_sample.py for examples/tiny/*.yaml) or give the size: {size}",
              file=sys.stderr)
        return 2
    p = cfg.parallel
    pg = build_groups(p.tensor, p.data, p.pipeline)
    torch.manual_seed(cfg.train.seed)
    trainer = Trainer(cfg, pg, device, vocab_size=vocab)
    total = max(timed_end, prof.stop if prof is not None else 0)  # the profiled steps after the timed ones
    cfg.train.steps = max(cfg.train.steps, total)
    profiler = StepProfiler(prof, cfg.train.run_dir, rank, device)

    def step(s: int):
        profiler.before_step(s)
        res = trainer.train_step(synthetic_step(cfg, vocab, pg, s))
        profiler.after_step(s + 1)
        return res

    for s in range(args.warmup):
        step(s)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    if dist.is_initialized():
        dist.barrier()
    graphs0 = _compiled_graphs()
    # each timed step's time: a PhaseTimer (CUDA events on the stream, no wait: the steps queue as
    # untimed ones do; wall clock on the CPU), read after the synchronize below
    timers = []
    results = []
    t0 = time.perf_counter()
    for s in range(args.steps):
        timers.append(PhaseTimer(device))
        results.append(step(args.warmup + s))
        timers[-1].stop()
    if device.type == "cuda":
        torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()
    seconds = time.perf_counter() - t0
    step_ms_all = [t.seconds() * 1e3 for t in timers]
    # timed steps that skipped the optimizer (a non-finite loss or gradient norm), the most of any
    # rank (each source group has its own loss): faster than a training step, so not a speed
    skipped = torch.tensor([sum(r.skipped for r in results)], device=device if device.type == "cuda" else "cpu")
    if dist.is_initialized():
        dist.all_reduce(skipped, op=dist.ReduceOp.MAX)
    skipped_steps = int(skipped.item())
    tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_length * pg.num_groups
    tps = tokens_per_step * args.steps / seconds
    flops_tok = train_flops_per_token(cfg.model, vocab)
    if device.type == "cuda":
        mem = torch.tensor([torch.cuda.max_memory_allocated(device) / 1e9,
                            torch.cuda.max_memory_reserved(device) / 1e9], device=device)
        tflops = flops_tok * tps / world / 1e12
        peak = device_peak_flops(device)
        mfu = tflops * 1e12 / peak if peak else None
    else:
        mem = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, float("nan")])
        tflops = mfu = peak = None
    if dist.is_initialized():
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)
    for s in range(timed_end, total):  # the profiled steps, after the timed window and its figures
        step(s)
    profiler.close(total)
    tuned = tuning_log()  # fp8_gemm_tuning: what the first step tuned (on a GPU with cuBLASLt)
    rec = make_record("bench", total, 0, tokens_per_s=tps, tokens_per_s_per_device=tps / world,
                      tflops_per_device=tflops, mfu=mfu, peak_tflops=peak / 1e12 if peak else None,
                      mfu_basis=MFU_BASIS, step_ms=seconds / args.steps * 1e3,
                      peak_mem_gb=float(mem[0]), peak_reserved_gb=float(mem[1]), device=str(device), world_size=world,
                      layout={"tensor": p.tensor, "pipeline": p.pipeline, "data": p.data,
                              "virtual_pipeline": p.virtual_pipeline, "sequence_parallel": p.sequence_parallel},
                      precision=cfg.precision, backends=describe_backends(cfg, device),
                      tokens_per_step=tokens_per_step, timed_steps=args.steps,
                      flops_per_token=flops_tok, vocab_size=vocab,
                      device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                      torch_version=torch.__version__, cuda_version=torch.version.cuda,
                      inductor_max_autotune=bool(inductor_config.max_autotune),
                      date=datetime.date.today().isoformat(), config=cfg.to_dict(),
                      fp8_gemm_tuning=tuned, fp8_gemm_tuning_line=describe_tuning(tuned) if tuned else None,
                      profiled_steps=[prof.start + 1, prof.stop] if prof is not None else None,
                      last_loss=results[-1].loss, skipped_steps=skipped_steps, step_ms_all=step_ms_all,
                      graphs_compiled_in_timed_steps=_compiled_graphs() - graphs0)
    if skipped_steps:
        rec["invalid"] = (f"{skipped_steps} of {args.steps} timed steps skipped the optimizer (non-finite loss or "
                          f"gradient norm): a skipped step is faster than a training step, so tokens_per_s is no speed")
    if rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(rec, f, indent=1)
        print(json.dumps({k: v for k, v in rec.items() if k != "config"}))
        if skipped_steps:
            print(f"error: invalid benchmark: {rec['invalid']} (the record, marked invalid, is in {args.out})",
                  file=sys.stderr)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 1 if skipped_steps else 0


def _compiled_graphs() -> int:
    """Graphs torch.compile has made in this process so far (dynamo's unique_graphs counter)."""
    from torch._dynamo.utils import counters
    return int(counters["stats"]["unique_graphs"])


if __name__ == "__main__":
    from dept_mega.process_exit import exit_after
    exit_after(main)
