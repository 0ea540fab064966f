#!/usr/bin/env python3
"""torchao's float8 training against bf16 on one plain PyTorch GPT of our 1B shape, on the same
GPU in the same process: the reference for the target "FP8 >= 1.3x bf16 tokens/s" (docs/performance.md).

    python benchmarks/vs_torchao.py --config examples/1b/spec_opt.yaml [key=value ...] \
        [--vocab 50257] [--micro-batch 4] [--accum 4] [--steps 5] [--warmup 3] \
        [--arms bf16,tensorwise[,rowwise]] [--no-compile] [--loss-tolerance 0.02] [--grad-tolerance 0.2] \
        --out VS.json

What torchtitan users get: ``torchao.float8.convert_to_float8_training`` swaps the blocks'
``nn.Linear`` layers for ``Float8Linear`` (dynamic scaling: ``tensorwise`` = one scale per
tensor, ``rowwise`` = one per row; torchao's recipes of those names) and each transformer block
is compiled on its own (``block.compile(fullgraph=True)``, as torchtitan compiles), the final
norm, head and loss as one more compiled function. If ratio tensorwise / bf16 here is near
1.3x, the target is reachable for this shape and a shortfall of ours is ours; if it is not, the
shape (or the card) is what limits FP8.

The model (:class:`PlainGPT`, our own small code, nothing of dept_mega's model) takes the
config's shape: layers, hidden size, heads (multi-head attention only), FFN size, GELU (exact),
LayerNorm with or without bias (``model.norm_bias``), linear biases only under ``model.bias``,
sequence length, tied or untied embeddings, the vocabulary padded to a multiple of 128 as ours
pads it (the loss runs over the true vocabulary). Attention: ``scaled_dot_product_attention``
with ``is_causal=True``; **no position embeddings** (the config's ALiBi adds no parameters and
no GEMM, and RoPE / learned positions would add no GEMM either: this comparison is about the
GEMMs). The head is ``F.linear`` on the embedding (or its own) weight, not an ``nn.Linear``, so
torchao leaves it in bf16, like our FP8 (the blocks' four linear layers only).

Both arms train identically but for the linear layers: weights in bf16, initialised from the
same seed (normal with ``model.init_method_std``); micro-batch gradients added into fp32
``main_grad`` buffers, global-norm clipping at ``optim.clip_grad`` and AdamW (fused on CUDA) on
fp32 master copies written back to the bf16 weights (:class:`vs_megatron.MasterAdamW`, what
our trainer's mixed precision does). One step = ``--accum`` micro-batches of ``--micro-batch``
sequences of synthetic tokens (the same per step in every arm). Per arm: median step time over
``--steps`` timed steps after ``--warmup`` untimed ones (the compiles happen there), tokens/s,
TFLOP/s and MFU with :func:`dept_mega.metrics.train_flops_per_token` over the unpadded
vocabulary (as ``tools/benchmark.py``; null on CPU), peak allocated memory over the timed steps
(null on CPU), the compiled graph count (2 when the blocks share one graph), the losses, the
first step's gradient norms.
``ratios``: each float8 arm's tokens/s over bf16's. Sanity check: every loss finite, and each
float8 arm's first-step loss (initial weights, same batch) within ``--loss-tolerance`` of
bf16's and the first-step gradient norm of each parameter (its fp32 accumulated gradient)
within ``--grad-tolerance`` of bf16's, relatively; else exit 1 with the record saying why.

torchao is optional: when it does not import (and an arm needs it), the script prints why,
writes ``{"skipped": "..."}`` and exits 0 — the device check records that instead of failing.
``--arms bf16`` runs without torchao. On the CPU (torch 2.13) torchao's float8 runs, eager and
compiled, through PyTorch's CPU ``_scaled_mm`` (torch 2.11's takes tensorwise scales only);
``--no-compile`` keeps a CPU rehearsal cheap (inductor's CPU builds take most of a minute).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import logging
import math
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from dept_mega.config import Config, ConfigError, load_config  # noqa: E402
from dept_mega.metrics import device_peak_flops, train_flops_per_token  # noqa: E402
from dept_mega.model.embeddings import padded_vocab_size  # noqa: E402
from vs_megatron import (MasterAdamW, add_run_args, bench_device, count, one_rank_std, synthetic,  # noqa: E402
                         timed, write_record)

ARMS = ("bf16", "tensorwise", "rowwise")
FLOAT8_RECIPES = ("tensorwise", "rowwise")  # torchao's Float8LinearConfig.from_recipe_name names


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_args(ap, accum=4, steps=5)
    ap.add_argument("--arms", default="bf16,tensorwise",
                    help=f"comma-separated, bf16 first (the ratios' denominator): {', '.join(ARMS)}")
    ap.add_argument("--no-compile", action="store_true", help="eager arms (the CPU rehearsal)")
    ap.add_argument("--loss-tolerance", type=float, default=0.02,
                    help="largest |first-step loss of a float8 arm - bf16's| accepted")
    ap.add_argument("--grad-tolerance", type=float, default=0.2,
                    help="largest relative difference of a float8 arm's first-step gradient norm of any "
                         "parameter from bf16's")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--out", required=True)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    for name in ("steps", "accum", "vocab"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be positive")
    if args.warmup < 1:
        ap.error("--warmup must be at least 1 (the compiles happen there)")
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in args.arms if a not in ARMS]
    if bad or not args.arms or args.arms[0] != "bf16" or len(set(args.arms)) != len(args.arms):
        ap.error(f"--arms: a list of distinct names from {', '.join(ARMS)}, bf16 first; got {','.join(args.arms)}")
    return args


def bench_config(args) -> Config:
    """The config's model shape and optimizer, one rank, no data, no dropout."""
    base = load_config(args.config, list(args.overrides))
    micro = args.micro_batch or base.train.micro_batch_size
    fixed = one_rank_std(args.vocab, micro, args.accum) + ["precision=bf16", "fp8=null"]
    cfg = load_config(args.config, list(args.overrides) + fixed)
    m = cfg.model
    for key, ok, what in (("model.activation", m.activation == "gelu", "gelu"),
                          ("model.normalization", m.normalization == "layernorm", "layernorm"),
                          ("model.num_query_groups", m.query_groups == m.num_attention_heads,
                           "equal to model.num_attention_heads (no GQA)")):
        if not ok:
            raise ConfigError(f"config key '{key}': the plain GPT of benchmarks/vs_torchao.py supports {what} only")
    return cfg


# ------------------------------------------------------------------ the model


class Block(nn.Module):
    """Pre-norm transformer block: causal SDPA attention and a GELU MLP, four ``nn.Linear``."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        m = cfg.model
        d, q = m.hidden_size, m.num_attention_heads * m.head_dim
        self.heads, self.head_dim = m.num_attention_heads, m.head_dim
        self.ln1 = nn.LayerNorm(d, eps=m.norm_eps, bias=m.norm_bias)
        self.qkv = nn.Linear(d, 3 * q, bias=m.bias)
        self.proj = nn.Linear(q, d, bias=m.bias)
        self.ln2 = nn.LayerNorm(d, eps=m.norm_eps, bias=m.norm_bias)
        self.fc1 = nn.Linear(d, m.ffn_size, bias=m.bias)
        self.fc2 = nn.Linear(m.ffn_size, d, bias=m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class PlainGPT(nn.Module):
    """Token embedding, the blocks, a final LayerNorm and the (tied) head; no positions (module
    doc). ``forward(inputs, labels)`` returns the mean cross-entropy over the true vocabulary."""

    def __init__(self, cfg: Config, vocab: int) -> None:
        super().__init__()
        m = cfg.model
        self.vocab = vocab
        self.wte = nn.Embedding(padded_vocab_size(vocab, 1), m.hidden_size)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(m.num_layers))
        self.ln_f = nn.LayerNorm(m.hidden_size, eps=m.norm_eps, bias=m.norm_bias)
        # a Parameter used through F.linear, not an nn.Linear: torchao's conversion leaves it alone
        self.head = None if m.tie_embeddings else nn.Parameter(torch.empty_like(self.wte.weight))
        self._head_loss = self.head_loss

    def reset_parameters(self, std: float, seed: int) -> None:
        """Normal(0, std) weights and embedding (the output projections scaled by
        1/sqrt(2·layers), as Megatron's), unit norms, zero biases; the same for every arm."""
        g = torch.Generator(device=self.wte.weight.device).manual_seed(seed)
        out_std = std / math.sqrt(2 * len(self.blocks))
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith(("proj.weight", "fc2.weight")):
                    p.normal_(0.0, out_std, generator=g)
                elif p.ndim == 2:
                    p.normal_(0.0, std, generator=g)
                elif "ln" in name and name.endswith("weight"):
                    p.fill_(1.0)
                else:
                    p.zero_()

    def compile_like_torchtitan(self) -> None:
        """Each block compiled on its own (fullgraph), the head and loss as one more graph."""
        for block in self.blocks:
            block.compile(fullgraph=True)
        self._head_loss = torch.compile(self.head_loss, fullgraph=True)

    def head_loss(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        w = self.wte.weight if self.head is None else self.head
        logits = F.linear(self.ln_f(x), w)[..., : self.vocab]
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.wte(inputs)
        for block in self.blocks:
            x = block(x)
        return self._head_loss(x, labels)


# ------------------------------------------------------------------ torchao


def import_torchao() -> tuple[object, list[str]]:
    """torchao's float8 module and the warnings its import logged (its C++ extensions may fail
    to load under another torch build; float8 training does not use them). Raises ImportError."""
    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage()[:300])

    handler, log = Keep(level=logging.WARNING), logging.getLogger("torchao")
    log.addHandler(handler)
    try:
        import torchao.float8 as float8
    finally:
        log.removeHandler(handler)
    return float8, messages


def torchao_version() -> str | None:
    try:
        from importlib.metadata import version
        return version("torchao")
    except Exception:  # noqa: BLE001 - not installed
        return None


def build(cfg: Config, vocab: int, arm: str, device: torch.device, compile_: bool) -> tuple[PlainGPT, int]:
    """The arm's model on ``device`` in bf16 (float8 arms: blocks' linears converted) and the
    number of Float8Linear layers in it."""
    with torch.device(device):
        model = PlainGPT(cfg, vocab)
    model.reset_parameters(cfg.model.init_method_std, cfg.train.seed)
    model.to(torch.bfloat16)
    converted = 0
    if arm in FLOAT8_RECIPES:
        float8, _ = import_torchao()
        float8.convert_to_float8_training(model, config=float8.Float8LinearConfig.from_recipe_name(arm))
        converted = sum(type(mod).__name__ == "Float8Linear" for mod in model.modules())
    if compile_:
        model.compile_like_torchtitan()
    return model, converted


def run_arm(cfg: Config, vocab: int, arm: str, device: torch.device, args) -> dict:
    torch._dynamo.reset()
    from torch._dynamo.utils import counters
    counters.clear()
    model, converted = build(cfg, vocab, arm, device, not args.no_compile)
    opt = MasterAdamW(model.parameters(), cfg, device)
    micro = cfg.train.micro_batch_size
    losses: list[float] = []
    grad_norms: dict[str, float] = {}
    names = [n for n, p in model.named_parameters() if p.requires_grad]  # MasterAdamW.params' order

    def step(s: int) -> None:
        tokens = synthetic(cfg, vocab, s, device)
        opt.zero_grad()
        total = torch.zeros((), device=device)
        for mb in tokens.split(micro):
            loss = model(mb[:, :-1], mb[:, 1:]) / args.accum
            loss.backward()
            total += loss.detach()
        if s == 0:  # the sanity check's gradient norms (a warm-up step: not timed)
            norms = torch.stack(torch._foreach_norm([p.main_grad for p in opt.params])).tolist()
            grad_norms.update(zip(names, norms))
        opt.step()
        losses.append(float(total))

    out = timed(step, args.warmup, args.steps, device)
    out.update(params=count(model.parameters()), float8_linears=converted, losses=losses,
               first_loss=losses[0], last_loss=losses[-1], first_grad_norm=math.sqrt(sum(x * x for x in grad_norms.values())), first_grad_norms=grad_norms,
               compiled_graphs=None if args.no_compile else int(counters["stats"]["unique_graphs"]),
               param_dtypes=sorted({str(p.dtype) for p in model.parameters()}))
    model = opt = None  # frees the arm's memory before the next (the closure holds the same cells)
    return out


def check_losses(arms: dict, tolerance: float, grad_tolerance: float) -> list[str]:
    """What is wrong with the arms' losses (empty: nothing): a loss or first-step gradient norm
    that is not finite; a float8 arm whose first-step loss is further than ``tolerance`` from
    bf16's, or the first-step gradient norm of one of whose parameters (``first_grad_norms``)
    differs from bf16's by more than ``grad_tolerance`` of it. Same weights, same batch: only FP8
    rounding may separate the arms. The loss of random tokens at initialisation is near
    ln(vocab) for almost any model; each weight's gradient norm tells a GEMM that computes
    something else (a wrong scale or layout) in either direction."""
    errors = []
    for name, res in arms.items():
        bad = [i for i, x in enumerate(res.get("losses", [])) if not math.isfinite(x)]
        if bad:
            errors.append(f"{name}: loss not finite at step(s) {bad}")
        if not math.isfinite(res.get("first_grad_norm", 0.0)):
            errors.append(f"{name}: first-step gradient norm not finite")
    base = arms.get("bf16", {})
    for name, res in arms.items():
        if name == "bf16" or "first_loss" not in base or "first_loss" not in res:
            continue
        diff = abs(res["first_loss"] - base["first_loss"])
        if not diff <= tolerance:
            errors.append(f"{name}: first-step loss {res['first_loss']:.5f} differs from bf16's "
                          f"{base['first_loss']:.5f} by {diff:.5f} > {tolerance} (same weights, same batch)")
        ours, theirs = res.get("first_grad_norms", {}), base.get("first_grad_norms", {})
        if set(ours) != set(theirs):
            errors.append(f"{name}: other parameters than bf16's: {sorted(set(ours) ^ set(theirs))[:4]}")
            continue
        off = {p: abs(ours[p] - theirs[p]) / max(theirs[p], 1e-30) for p in theirs}
        off = {p: r for p, r in off.items() if not r <= grad_tolerance}
        if off:
            worst = max(off, key=off.get)
            errors.append(f"{name}: first-step gradient norms of {len(off)} parameter(s) differ from bf16's by more "
                          f"than {100 * grad_tolerance:g}%, the most {worst} ({ours[worst]:.4g} against "
                          f"{theirs[worst]:.4g}, same weights, same batch)")
    return errors


def environment(device: torch.device) -> dict:
    env = {"device": str(device), "torch_version": torch.__version__, "cuda_version": torch.version.cuda,
           "date": datetime.date.today().isoformat(), "torchao_version": torchao_version(),
           "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    return env


def describe_model(cfg: Config, vocab: int) -> dict:
    m = cfg.model
    return {"layers": m.num_layers, "hidden": m.hidden_size, "heads": m.num_attention_heads, "ffn": m.ffn_size,
            "seq_length": m.seq_length, "vocab": vocab, "padded_vocab": padded_vocab_size(vocab, 1),
            "activation": "gelu (exact)", "norm": f"layernorm{'' if m.norm_bias else ' without bias'}",
            "linear_bias": m.bias, "tied_embeddings": m.tie_embeddings,
            "positions": "none (the config's " + m.position_embedding + " is not modelled: no GEMM)",
            "attention": "torch scaled_dot_product_attention, is_causal",
            "weights": "bf16; fp32 main_grad accumulation, fp32 masters, AdamW "
                       "(fused on CUDA) and global-norm clipping: the same in every arm",
            "float8": "torchao convert_to_float8_training on the blocks' nn.Linear layers (head and attention bf16)"}


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cfg = bench_config(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    device = bench_device(args.device)
    tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_length
    rec: dict = {"kind": "vs_torchao", "arms_requested": args.arms, "compiled": not args.no_compile,
                 "vocab_size": args.vocab, "tokens_per_step": tokens_per_step,
                 "micro_batch_size": cfg.train.micro_batch_size, "accum": args.accum, "timed_steps": args.steps,
                 "warmup_steps": args.warmup, "model": describe_model(cfg, args.vocab),
                 "flops_per_token": train_flops_per_token(cfg.model, args.vocab), **environment(device),
                 "config": cfg.to_dict()}
    if any(a in FLOAT8_RECIPES for a in args.arms):
        try:
            _, rec["torchao_import_warnings"] = import_torchao()
        except Exception as exc:  # noqa: BLE001 - any import failure means: no torchao here
            rec["skipped"] = (f"torchao is not importable ({type(exc).__name__}: {exc}); carry its wheel "
                              "(bash benchmarks/fetch_device_wheels.sh, carry .whl) or run --arms bf16")
            print(f"skipped: {rec['skipped']}", file=sys.stderr)
            write_record(rec, args.out)
            return 0
    print("model: " + ", ".join(f"{k} {v}" for k, v in rec["model"].items()), flush=True)
    peak = device_peak_flops(device)
    rec["arms"], failed = {}, False
    for arm in args.arms:
        name = arm if arm == "bf16" else f"float8_{arm}"
        try:
            res = run_arm(cfg, args.vocab, arm, device, args)
        except Exception as exc:  # noqa: BLE001 - recorded; the other arms still run
            rec["arms"][name] = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
            print(f"{name:>18}: failed: {rec['arms'][name]['error']}", file=sys.stderr, flush=True)
            failed = True
            continue
        finally:  # the arm's compiled code may hold its model: dropped before the next arm
            torch._dynamo.reset()
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        res["tokens_per_s"] = tokens_per_step / (res["step_ms_median"] / 1e3)
        res["tflops"] = rec["flops_per_token"] * res["tokens_per_s"] / 1e12 if device.type == "cuda" else None
        res["mfu"] = res["tflops"] * 1e12 / peak if res["tflops"] is not None and peak else None
        rec["arms"][name] = res
        mem = "n/a" if res["peak_mem_gb"] is None else f"{res['peak_mem_gb']:.1f} GB"
        tf = "" if res["tflops"] is None else f", {res['tflops']:.0f} TFLOP/s"
        print(f"{name:>18}: {res['tokens_per_s']:,.0f} tokens/s{tf}, median step {res['step_ms_median']:.1f} ms, "
              f"peak memory {mem}, first loss {res['first_loss']:.4f}, {res['float8_linears']} Float8Linear",
              flush=True)
    ok = {k: v for k, v in rec["arms"].items() if "error" not in v}
    if "bf16" in ok:
        rec["ratios"] = {k: v["tokens_per_s"] / ok["bf16"]["tokens_per_s"] for k, v in ok.items() if k != "bf16"}
        for k, v in rec["ratios"].items():
            print(f"ratio {k} / bf16: {v:.3f} tokens/s")
    rec["loss_errors"] = check_losses(ok, args.loss_tolerance, args.grad_tolerance)
    write_record(rec, args.out)
    for e in rec["loss_errors"]:
        print(f"error: {e}", file=sys.stderr)
    return 1 if failed or rec["loss_errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
