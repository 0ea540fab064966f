#!/usr/bin/env python3
"""Our trainer side by side with megatron-core's GPTModel (local, non-Transformer-Engine spec)
on the same GPU in the same process (issue 12, item 4).

    python benchmarks/vs_megatron.py --config examples/1b/spec_opt.yaml [key=value ...] \
        [--vocab 50257] [--micro-batch 4] [--accum 1] [--steps 10] [--warmup 3] \
        [--position rope|config] [--only ours|megatron] [--check-shapes] --out VS.json

Both sides train the same model shape (layers, hidden, heads, query groups, FFN, activation,
norm, tied embeddings, no linear biases unless ``model.bias``, vocabulary padded to a multiple
of 128 as ours pads it) in the config's precision (bf16: autocast over fp32 weights on both
sides) with the same micro-batch, on synthetic token batches; one step is ``--accum``
micro-batches of forward and backward, global-norm clipping at ``optim.clip_grad`` and an
AdamW step (fused on CUDA) — ours through ``Trainer.train_step`` (pipeline schedule with one
stage, its bookkeeping included), Megatron's through a plain loop around its ``GPTModel``
(megatron.core.parallel_state initialised for one rank). Reported per side: median step time
over ``--steps`` timed steps after ``--warmup`` untimed ones, tokens/s, peak allocated memory
and the parameter count; ``ratio`` = our tokens/s over Megatron's (goal: >= 1.0).

Position embeddings: Megatron-core has no ALiBi. ``--position rope`` (default) runs both sides
with RoPE (the like-for-like comparison); ``--position config`` keeps ours as configured (e.g.
ALiBi, the paper's) and gives Megatron RoPE — then the models differ in their attention bias
and the ratio says so (``same_model: false``).

Megatron's local attention needs CUDA; on CPU only ``--only ours`` runs, and ``--check-shapes``
builds Megatron's model on the CPU to check that both sides have the same number of parameters
(the shape translation). Versions, device and date go into the JSON.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dept_mega.config import Config, ConfigError, load_config  # noqa: E402
from dept_mega.model.embeddings import padded_vocab_size  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--vocab", type=int, default=50257, help="vocabulary (before padding to 128)")
    ap.add_argument("--micro-batch", type=int, default=None, help="default: train.micro_batch_size")
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per step")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--position", choices=("rope", "config"), default="rope")
    ap.add_argument("--only", choices=("ours", "megatron"), default=None)
    ap.add_argument("--check-shapes", action="store_true",
                    help="build Megatron's model (CPU init) and compare parameter counts with ours")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--out", required=True)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    for name in ("steps", "warmup", "accum", "vocab"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            ap.error(f"--{name} must be positive")
    return args


def bench_config(args) -> Config:
    """Our config for the comparison: one rank, std, synthetic vocabulary."""
    cfg = load_config(args.config, list(args.overrides))
    micro = args.micro_batch or cfg.train.micro_batch_size
    fixed = ["parallel.tensor=1", "parallel.pipeline=1", "parallel.data=1", "parallel.virtual_pipeline=1",
             "parallel.sequence_parallel=false", "dept.variant=std", "data.sources=[]", "data.tokenizer=null",
             f"model.vocab_size={args.vocab}", f"train.micro_batch_size={micro}",
             f"train.global_batch_size={micro * args.accum}", f"train.steps={args.warmup + args.steps + 1}",
             "optim.warmup_steps=1", "model.hidden_dropout=0.0", "model.attention_dropout=0.0",
             # megatron-core's LayerNorm always has a bias: the same parameters on both sides
             "model.norm_bias=true"]
    if args.position == "rope":
        fixed.append("model.position_embedding=rope")
    return load_config(args.config, list(args.overrides) + fixed)


def megatron_position(cfg: Config) -> str:
    return {"rope": "rope", "learned": "learned_absolute", "alibi": "rope"}[cfg.model.position_embedding]


def megatron_config(cfg: Config, device: torch.device):
    """megatron.core TransformerConfig with our model's shape (local spec, no fusions that need
    apex / Transformer Engine)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig
    m = cfg.model
    kw = dict(num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
              num_query_groups=m.query_groups, ffn_hidden_size=m.ffn_size, kv_channels=m.head_dim,
              hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=m.bias, layernorm_epsilon=m.norm_eps,
              normalization="RMSNorm" if m.normalization == "rmsnorm" else "LayerNorm",
              init_method_std=m.init_method_std, params_dtype=torch.float32, pipeline_dtype=torch.float32,
              use_cpu_initialization=device.type != "cuda", bias_activation_fusion=False,
              masked_softmax_fusion=False, bias_dropout_fusion=False, persist_layer_norm=False,
              gradient_accumulation_fusion=False, apply_rope_fusion=False)
    if m.activation == "swiglu":
        kw.update(gated_linear_unit=True, activation_func=F.silu)
    return TransformerConfig(**kw)


def init_single_process(device: torch.device) -> None:
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def build_megatron(cfg: Config, vocab: int, device: torch.device):
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    init_single_process(device)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.train.seed)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm" if cfg.model.normalization == "rmsnorm" else None)
    model = GPTModel(megatron_config(cfg, device), spec, vocab_size=padded_vocab_size(vocab, 1),
                     max_sequence_length=cfg.model.seq_length, position_embedding_type=megatron_position(cfg),
                     share_embeddings_and_output_weights=cfg.model.tie_embeddings,
                     rotary_base=int(cfg.model.rope_theta))
    return model.to(device)


def count(params) -> int:
    seen, n = set(), 0
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            n += p.numel()
    return n


def synthetic(cfg: Config, vocab: int, step: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(cfg.train.seed * 7919 + step)
    t = cfg.train
    return torch.randint(0, vocab, (t.global_batch_size, cfg.model.seq_length + 1), generator=g).to(device)


def timed(step_fn, warmup: int, steps: int, device: torch.device) -> dict:
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for s in range(warmup):
        step_fn(s)
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for s in range(steps):
        sync()
        t0 = time.perf_counter()
        step_fn(warmup + s)
        sync()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
    return {"step_ms_median": statistics.median(times) * 1e3, "step_ms_all": [x * 1e3 for x in times],
            "peak_mem_gb": peak}


def run_ours(cfg: Config, vocab: int, device: torch.device, warmup: int, steps: int) -> dict:
    from dept_mega.model.gpt import describe_backends
    from dept_mega.parallel.groups import build_groups
    from dept_mega.trainer import MicroBatch, Trainer
    torch.manual_seed(cfg.train.seed)
    trainer = Trainer(cfg, build_groups(), device, vocab_size=vocab)
    micro = cfg.train.micro_batch_size
    losses = []

    def step(s: int) -> None:
        tokens = synthetic(cfg, vocab, s, device)
        losses.append(trainer.train_step([MicroBatch(x) for x in tokens.split(micro)]).loss)

    out = timed(step, warmup, steps, device)
    out.update(params=count(trainer.parameters()), backends=describe_backends(cfg, device),
               precision=trainer.precision.describe(), last_loss=losses[-1])
    del trainer
    return out


def run_megatron(cfg: Config, vocab: int, device: torch.device, warmup: int, steps: int) -> dict:
    from dept_mega.optim import param_groups
    from dept_mega.precision import Precision
    torch.manual_seed(cfg.train.seed)
    model = build_megatron(cfg, vocab, device)
    model.train()
    o = cfg.optim
    kwargs = {"fused": True} if device.type == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW(param_groups(model.parameters(), o.weight_decay), lr=o.lr, betas=tuple(o.betas),
                            eps=o.eps, **kwargs)
    autocast = Precision(cfg.precision, device).autocast()
    s_len, micro = cfg.model.seq_length, cfg.train.micro_batch_size
    position_ids = torch.arange(s_len, device=device).unsqueeze(0).expand(micro, -1)
    # Megatron's convention: True = masked out (the causal upper triangle)
    mask = torch.triu(torch.ones(1, 1, s_len, s_len, dtype=torch.bool, device=device), diagonal=1)
    params = [p for p in model.parameters() if p.requires_grad]
    losses = []

    def step(s: int) -> None:
        tokens = synthetic(cfg, vocab, s, device)
        opt.zero_grad(set_to_none=True)
        total = tokens.shape[0] * s_len
        loss_sum = torch.zeros((), device=device)
        for mb in tokens.split(micro):
            with autocast():
                per_token = model(mb[:, :-1], position_ids, mask, labels=mb[:, 1:])
            loss = per_token.float().sum() / total
            loss.backward()
            loss_sum += loss.detach()
        if o.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(params, o.clip_grad, foreach=True)
        opt.step()
        losses.append(float(loss_sum))

    out = timed(step, warmup, steps, device)
    out.update(params=count(model.parameters()), last_loss=losses[-1])
    del model, opt
    return out


def environment(device: torch.device) -> dict:
    env = {"device": str(device), "torch_version": torch.__version__, "cuda_version": torch.version.cuda,
           "date": datetime.date.today().isoformat()}
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
    try:
        from importlib.metadata import version
        env["megatron_core_version"] = version("megatron-core")
    except Exception:  # noqa: BLE001 - not installed: only our side can run
        env["megatron_core_version"] = None
    return env


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cfg = bench_config(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if device.type != "cuda" and args.only != "ours":
        print("error: Megatron-core's local attention needs CUDA; on CPU use --only ours (and --check-shapes)",
              file=sys.stderr)
        return 2
    tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_length
    rec: dict = {"kind": "vs_megatron", "config": cfg.to_dict(), "vocab_size": args.vocab,
                 "padded_vocab_size": padded_vocab_size(args.vocab, 1), "tokens_per_step": tokens_per_step,
                 "micro_batch_size": cfg.train.micro_batch_size, "accum": args.accum,
                 "timed_steps": args.steps, "warmup_steps": args.warmup,
                 "ours_position": cfg.model.position_embedding, "megatron_position": megatron_position(cfg),
                 "same_model": cfg.model.position_embedding != "alibi", **environment(device)}
    if args.check_shapes:
        from dept_mega.model import build_model
        from dept_mega.parallel.groups import build_groups
        ours = count(p for st in build_model(cfg, build_groups(), args.vocab, cfg.train.seed) for p in st.parameters())
        theirs = count(build_megatron(cfg, args.vocab, torch.device("cpu")).parameters())
        rec["shape_check"] = {"ours_params": ours, "megatron_params": theirs, "equal": ours == theirs}
        print(f"parameters: ours {ours:,}, megatron-core {theirs:,}")
    for side, fn in (("ours", run_ours), ("megatron", run_megatron)):
        if args.only not in (None, side):
            continue
        res = fn(cfg, args.vocab, device, args.warmup, args.steps)
        res["tokens_per_s"] = tokens_per_step / (res["step_ms_median"] / 1e3)
        rec[side] = res
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        peak = "n/a" if res["peak_mem_gb"] is None else f"{res['peak_mem_gb']:.1f} GB"
        print(f"{side:>9}: {res['tokens_per_s']:,.0f} tokens/s, median step {res['step_ms_median']:.1f} ms, "
              f"peak memory {peak}, {res['params']:,} parameters", flush=True)
    if "ours" in rec and "megatron" in rec:
        rec["ratio"] = rec["ours"]["tokens_per_s"] / rec["megatron"]["tokens_per_s"]
        print(f"ratio ours / megatron-core: {rec['ratio']:.3f}"
              f"{'' if rec['same_model'] else ' (ours with ALiBi, Megatron with RoPE: not the same model)'}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(rec, f, indent=1)
    if dist.is_initialized():
        dist.destroy_process_group()
    if args.check_shapes and not rec["shape_check"]["equal"]:
        print("error: the two models have different parameter counts: the shape translation is wrong",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
