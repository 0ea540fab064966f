#!/usr/bin/env python3
"""Our trainer side by side with megatron-core's GPTModel (local, non-Transformer-Engine spec)
on the same GPU in the same process.

    python benchmarks/vs_megatron.py --config examples/1b/spec_opt.yaml [key=value ...] \
        [--vocab 50257] [--micro-batch 4] [--accum 1] [--steps 10] [--warmup 3] \
        [--position rope|config] [--only ours|megatron] [--check-shapes] \
        [--megatron-fusions auto|on|off] --out VS.json

Both sides train the same model shape (layers, hidden, heads, query groups, FFN, activation,
norm, tied embeddings, no linear biases unless ``model.bias``, vocabulary padded to a multiple
of 128 as ours pads it) with the same micro-batch, on synthetic token batches, in the same
precision and with the same attention kernel (both printed and written to the JSON):

* precision: the config's. Under bf16 / fp16 both models hold their weights and compute their
  activations in that dtype and the optimizer updates fp32 master weights (ours: the trainer's
  mixed precision; Megatron: ``params_dtype`` / ``bf16`` in its config, the model cast as its
  ``Float16Module`` casts it, and :class:`MasterAdamW` below, the update of Megatron's
  ``Float16OptimizerWithFloat16Params`` without its distributed machinery); both accumulate
  the micro-batches' gradients in fp32 (ours: the trainer's gradient buffer; Megatron: the
  ``main_grad`` of its ``DistributedDataParallel``, reproduced by :class:`MasterAdamW`);
* attention: ``torch.nn.functional.scaled_dot_product_attention``, causal, no bias, on both
  sides (ours: ``model.attention_backend=sdpa``; Megatron: its local spec with the core
  attention replaced by :class:`SDPACoreAttention`, since its own local ``DotProductAttention``
  materialises the s x s scores and the fused kernels it would use instead need Transformer
  Engine, which the GPU machine lacks).

Fusions (each side's are in the JSON, ``fusions``): Megatron runs those of megatron-core that
need neither apex nor Transformer Engine (``--megatron-fusions``): its native fused cross
entropy (``cross_entropy_loss_fusion``, ``cross_entropy_fusion_impl="native"``; unfused it casts
the whole [s, b, vocab] logits to fp32 and passes over them several times), the fused
bias-dropout-add (``bias_dropout_fusion``, on by default in Megatron-LM's ``pretrain_gpt``) and,
where the model has one (SwiGLU, or GELU with linear biases), the fused bias-activation;
megatron-core compiles each with ``torch.compile`` (its ``jit_fuser``). Ours runs its compiled
cross entropy (and RoPE) on CUDA. Two fusions only ours has, because Megatron's need what the
GPU machine lacks: the RoPE fusion (``apply_rope_fusion``: Transformer Engine) and the weight
gradient accumulated into the fp32 ``main_grad`` by the GEMM itself (ours:
``optim.grad_accum_fusion``; Megatron's ``gradient_accumulation_fusion``: apex's
``fused_weight_gradient_mlp_cuda``), so the ratio includes what those two save; LayerNorm is
torch's on both sides (``persist_layer_norm`` needs apex). ``--megatron-fusions auto`` (default)
turns Megatron's on on CUDA only, as ours compiles its cross entropy and RoPE on CUDA only: on
the CPU inductor's build of megatron-core's fused functions takes about 40 s for a one-step
check (``on`` forces them there).

One step is ``--accum`` micro-batches of forward and backward, global-norm clipping at
``optim.clip_grad`` and an AdamW step (fused on CUDA) — ours through ``Trainer.train_step``
(pipeline schedule with one stage, its bookkeeping included), Megatron's through a plain loop
around its ``GPTModel`` (megatron.core.parallel_state initialised for one rank). Reported per
side: median step time over ``--steps`` timed steps after ``--warmup`` untimed ones, tokens/s,
peak allocated memory and the parameter count; ``ratio`` = our tokens/s over Megatron's (goal:
>= 1.0).

Position embeddings: Megatron-core has no ALiBi. ``--position rope`` (default) runs both sides
with RoPE; ``--position config`` keeps the config's (RoPE or learned; ALiBi is refused).

Megatron's RoPE calls CUDA directly: on CPU its side runs with learned positions only (``--position
config model.position_embedding=learned``; the CPU rehearsal of benchmarks/gpu_check.sh does
this), else only ``--only ours``. ``--check-shapes`` builds Megatron's model on the CPU to check
that both sides have the same number of parameters (the shape translation). Versions, device
and date go into the JSON, which is written after each side (a crash of Megatron's side, run
second, leaves ours); ``same_model`` is whether the two models have the same parameter count
(those trained, else ``--check-shapes``'; null when neither tells), and a side that raised is
``{"error": ...}`` (exit 1). ``fp8`` is refused: Megatron's local spec has no FP8, so the sides
would differ in precision.
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
import traceback

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dept_mega.config import Config, ConfigError, load_config  # noqa: E402
from dept_mega.model.embeddings import padded_vocab_size  # noqa: E402


def add_run_args(ap: argparse.ArgumentParser, accum: int, steps: int) -> None:
    """The options both side-by-side benchmarks take: the config, the synthetic vocabulary, the
    micro-batch, micro-batches per step (default ``accum``), timed (default ``steps``) and warmup
    steps."""
    ap.add_argument("--config", required=True)
    ap.add_argument("--vocab", type=int, default=50257, help="vocabulary (before padding to 128)")
    ap.add_argument("--micro-batch", type=int, default=None, help="default: train.micro_batch_size")
    ap.add_argument("--accum", type=int, default=accum, help="micro-batches per step")
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--warmup", type=int, default=3)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_args(ap, accum=1, steps=10)
    ap.add_argument("--position", choices=("rope", "config"), default="rope",
                    help="rope: both sides RoPE; config: the config's (rope or learned)")
    ap.add_argument("--only", choices=("ours", "megatron"), default=None)
    ap.add_argument("--check-shapes", action="store_true",
                    help="build Megatron's model (CPU init) and compare parameter counts with ours")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--megatron-fusions", choices=("auto", "on", "off"), default="auto",
                    help="megatron-core's fusions that need neither apex nor Transformer Engine (fused cross "
                         "entropy, bias-dropout-add, bias-activation where the model has one): auto = on on CUDA")
    ap.add_argument("--out", required=True)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    for name in ("steps", "warmup", "accum", "vocab"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            ap.error(f"--{name} must be positive")
    return args


def one_rank_std(vocab: int, micro: int, accum: int) -> list[str]:
    """Overrides shared by the side-by-side benchmarks: one rank, the STD variant, no data (a
    synthetic ``vocab``), ``accum`` micro-batches of ``micro`` sequences a step, no dropout."""
    return ["parallel.tensor=1", "parallel.pipeline=1", "parallel.data=1", "parallel.virtual_pipeline=1",
            "parallel.sequence_parallel=false", "dept.variant=std", "data.sources=[]", "data.tokenizer=null",
            f"model.vocab_size={vocab}", f"train.micro_batch_size={micro}",
            f"train.global_batch_size={micro * accum}", "model.hidden_dropout=0.0", "model.attention_dropout=0.0"]


def bench_config(args) -> Config:
    """Our config for the comparison: one rank, std, synthetic vocabulary."""
    cfg = load_config(args.config, list(args.overrides))
    micro = args.micro_batch or cfg.train.micro_batch_size
    fixed = one_rank_std(args.vocab, micro, args.accum) + [
             f"train.steps={args.warmup + args.steps + 1}", "optim.warmup_steps=1",
             # megatron-core's LayerNorm always has a bias: the same parameters on both sides
             "model.norm_bias=true", f"model.attention_backend={OUR_ATTENTION}"]
    if args.position == "rope":
        fixed.append("model.position_embedding=rope")
    elif load_config(args.config, list(args.overrides)).model.position_embedding == "alibi":
        raise ConfigError("config key 'model.position_embedding': megatron-core has no ALiBi, so the two models "
                          "would differ; use --position rope (or a rope / learned config)")
    cfg = load_config(args.config, list(args.overrides) + fixed)
    if cfg.fp8:
        raise ConfigError(f"config key 'fp8': {cfg.fp8!r} would run our side's GEMMs in FP8 while Megatron's runs "
                          f"{cfg.precision} (its local spec has no FP8: that needs Transformer Engine), so the two "
                          f"sides would differ in precision; compare without fp8")
    return cfg


# the attention kernel of both sides (module doc)
OUR_ATTENTION = "sdpa"
ATTENTION = "torch scaled_dot_product_attention, causal, no bias (both sides)"


def megatron_position(cfg: Config) -> str:
    return {"rope": "rope", "learned": "learned_absolute"}[cfg.model.position_embedding]


def model_dtype(cfg: Config) -> torch.dtype:
    from dept_mega.precision import dtype_of
    return dtype_of(cfg.precision)


def describe_setup(cfg: Config) -> dict:
    """What both sides share, for the output: precision, micro-batch, attention."""
    return {"precision": cfg.precision, "micro_batch_size": cfg.train.micro_batch_size, "attention": ATTENTION,
            "positions": cfg.model.position_embedding,
            "grad_accumulation": "fp32" if cfg.precision in ("bf16", "fp16") else "autograd (fp32 weights)"}


def fusions_on(setting: str | None, device: torch.device) -> bool:
    """``--megatron-fusions``: on, off, or auto (None too) = on on CUDA (module doc)."""
    return setting == "on" or (setting in (None, "auto") and device.type == "cuda")


def bias_activation_fusable(cfg: Config) -> bool:
    """megatron-core fuses the bias with SwiGLU, or with GELU only where the linears have biases."""
    return cfg.model.activation == "swiglu" or cfg.model.bias


def megatron_fusions(cfg: Config, on: bool) -> dict:
    """What Megatron's side fuses (``fusions.megatron`` of the JSON)."""
    jit = "fused (megatron-core's jit_fuser: torch.compile)"
    out = {"cross_entropy": f"{jit}, native" if on else "unfused: vocab_parallel_cross_entropy (fp32 logits)",
           "bias_dropout_add": jit if on else "unfused",
           "bias_activation": (jit if on else "unfused") if bias_activation_fusable(cfg)
           else "none to fuse (GELU without linear biases)",
           "gradient_accumulation": "unfused: a hook adds each weight's gradient into main_grad (the fused GEMM "
                                    "needs apex's fused_weight_gradient_mlp_cuda)",
           "layer_norm": "torch (persist_layer_norm needs apex)"}
    if cfg.model.position_embedding == "rope":
        out["rope"] = "unfused (apply_rope_fusion needs Transformer Engine)"
    return out


def our_fusions(cfg: Config, device: torch.device) -> dict:
    """What our side compiles or fuses (``fusions.ours`` of the JSON), from its backends."""
    from dept_mega.model.backends import resolve_backends
    b = resolve_backends(cfg, device)
    out = {"cross_entropy": b.cross_entropy, "gradient_accumulation": b.describe_wgrad()}
    if b.rope:
        out["rope"] = b.rope
    return out


def megatron_config(cfg: Config, device: torch.device, fusions: bool | None = None):
    """megatron.core TransformerConfig with our model's shape (local spec); ``fusions`` (default:
    :func:`fusions_on` auto) turns on those of megatron-core's fusions that need neither apex nor
    Transformer Engine (module doc)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig
    m = cfg.model
    if fusions is None:
        fusions = fusions_on("auto", device)
    kw = dict(num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
              num_query_groups=m.query_groups, ffn_hidden_size=m.ffn_size, kv_channels=m.head_dim,
              hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=m.bias, layernorm_epsilon=m.norm_eps,
              normalization="RMSNorm" if m.normalization == "rmsnorm" else "LayerNorm",
              init_method_std=m.init_method_std, params_dtype=model_dtype(cfg), pipeline_dtype=model_dtype(cfg),
              bf16=cfg.precision == "bf16", fp16=cfg.precision == "fp16", use_cpu_initialization=device.type != "cuda",
              bias_activation_fusion=fusions and bias_activation_fusable(cfg), bias_dropout_fusion=fusions,
              cross_entropy_loss_fusion=fusions, cross_entropy_fusion_impl="native",
              # these need apex or Transformer Engine (the softmax's: SDPACoreAttention has none)
              masked_softmax_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
              apply_rope_fusion=False)
    if m.activation == "swiglu":
        kw.update(gated_linear_unit=True, activation_func=F.silu)
    return TransformerConfig(**kw)


def init_single_process(device: torch.device) -> None:
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def sdpa_core_attention():
    """Megatron's local core attention with its forward replaced by torch's SDPA (causal, no
    bias, no dropout): the attention kernel ours uses, so that the comparison is of the rest.
    Megatron's layout: q [sq, b, heads, d], k / v [sk, b, groups, d] -> [sq, b, heads·d]."""
    import torch.nn.functional as F
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class SDPACoreAttention(DotProductAttention):
        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if attention_bias is not None or packed_seq_params is not None:
                raise ValueError("SDPACoreAttention: no attention bias and no packed sequences")
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                                 enable_gqa=q.shape[1] != k.shape[1])
            return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)

    return SDPACoreAttention


def build_megatron(cfg: Config, vocab: int, device: torch.device, fusions: bool | None = None):
    """Megatron-core's GPTModel with our shape, its local spec with :func:`sdpa_core_attention`,
    in the config's precision: weights cast to it as ``Float16Module`` casts them; ``fusions`` as
    :func:`megatron_config`."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    init_single_process(device)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(cfg.train.seed)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm" if cfg.model.normalization == "rmsnorm" else None)
    spec.submodules.self_attention.submodules.core_attention = sdpa_core_attention()
    model = GPTModel(megatron_config(cfg, device, fusions), spec, vocab_size=padded_vocab_size(vocab, 1),
                     max_sequence_length=cfg.model.seq_length, position_embedding_type=megatron_position(cfg),
                     share_embeddings_and_output_weights=cfg.model.tie_embeddings,
                     rotary_base=int(cfg.model.rope_theta))
    return model.to(device=device, dtype=model_dtype(cfg))


class MasterAdamW:
    """AdamW on fp32 master copies of half-precision weights (fused on CUDA, foreach on CPU),
    with the gradient accumulation of megatron-core's ``DistributedDataParallel`` under bf16
    (``grad_reduce_in_fp32``, Megatron-LM's default for bf16): after each micro-batch's backward
    a hook adds the weight's half-precision gradient into an fp32 ``main_grad`` and frees it, as
    Megatron's DDP hook does (its buffers need CUDA, so the hook is reproduced here). Each step
    clips the fp32 gradients by their global norm, updates the masters and copies them back into
    the weights. For fp32 weights the masters are the weights and autograd accumulates."""

    def __init__(self, params, cfg: Config, device: torch.device) -> None:
        from dept_mega.optim import param_groups
        self.params = [p for p in params if p.requires_grad]
        self.half = any(p.dtype != torch.float32 for p in self.params)
        self.masters = ([p.detach().float().requires_grad_() for p in self.params] if self.half else self.params)
        if self.half:
            for p in self.params:
                p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                p.register_post_accumulate_grad_hook(self._accumulate)
        o = cfg.optim
        self.clip = o.clip_grad
        kwargs = {"fused": True} if device.type == "cuda" else {"foreach": True}
        self.opt = torch.optim.AdamW(param_groups(self.masters, o.weight_decay), lr=o.lr, betas=tuple(o.betas),
                                     eps=o.eps, **kwargs)

    @staticmethod
    def _accumulate(p: torch.Tensor) -> None:
        p.main_grad.add_(p.grad)
        p.grad = None

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
            if self.half:
                p.main_grad.zero_()

    def step(self) -> None:
        if self.half:
            for p, m in zip(self.params, self.masters):
                m.grad = p.main_grad
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.masters, self.clip, foreach=True)
        self.opt.step()
        if self.half:
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.masters)


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
               precision=trainer.precision.describe(), last_loss=losses[-1],
               param_dtypes=sorted({str(p.dtype) for p in trainer.parameters()}))
    trainer = None  # frees its GPU memory before the other side runs (the closure holds the same cell)
    return out


def megatron_step(cfg: Config, model, vocab: int, device: torch.device, losses: list):
    """One training step of Megatron's model (``step(s)``): the micro-batches' forward and
    backward (its per-token loss, summed in fp32 over the step's tokens), then
    :class:`MasterAdamW`."""
    model.train()
    opt = MasterAdamW(model.parameters(), cfg, device)
    s_len, micro = cfg.model.seq_length, cfg.train.micro_batch_size
    position_ids = torch.arange(s_len, device=device).unsqueeze(0).expand(micro, -1)
    # Megatron's convention: True = masked out (the causal upper triangle); SDPACoreAttention
    # applies the causal mask itself, the embedding and the model's checks still take it
    mask = torch.triu(torch.ones(1, 1, s_len, s_len, dtype=torch.bool, device=device), diagonal=1)

    def step(s: int) -> None:
        tokens = synthetic(cfg, vocab, s, device)
        opt.zero_grad()
        total = tokens.shape[0] * s_len
        loss_sum = torch.zeros((), device=device)
        for mb in tokens.split(micro):
            per_token = model(mb[:, :-1], position_ids, mask, labels=mb[:, 1:])
            loss = per_token.float().sum() / total
            loss.backward()
            loss_sum += loss.detach()
        opt.step()
        losses.append(float(loss_sum))

    return step


def run_megatron(cfg: Config, vocab: int, device: torch.device, warmup: int, steps: int,
                 fusions: bool | None = None) -> dict:
    torch.manual_seed(cfg.train.seed)
    model = build_megatron(cfg, vocab, device, fusions)
    losses: list = []
    out = timed(megatron_step(cfg, model, vocab, device, losses), warmup, steps, device)
    out.update(params=count(model.parameters()), last_loss=losses[-1],
               param_dtypes=sorted({str(p.dtype) for p in model.parameters()}))
    del model
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


def write_record(rec: dict, path: str) -> None:
    """The benchmark's JSON record at ``path`` (its folder made if missing)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(rec, f, indent=1)


def bench_device(name) -> torch.device:
    """``--device``, else cuda where there is one; a CUDA device with its index (the current one:
    ``set_device`` needs an index)."""
    device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cfg = bench_config(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    device = bench_device(args.device)
    if device.type == "cuda":  # Megatron's layers use the current device
        torch.cuda.set_device(device)
    if device.type != "cuda" and args.only != "ours" and cfg.model.position_embedding == "rope":
        print("error: megatron-core's RoPE needs CUDA; on CPU use --only ours (and --check-shapes), or "
              "learned positions (--position config model.position_embedding=learned)", file=sys.stderr)
        return 2
    tokens_per_step = cfg.train.global_batch_size * cfg.model.seq_length
    rec: dict = {"kind": "vs_megatron", "config": cfg.to_dict(), "vocab_size": args.vocab,
                 "padded_vocab_size": padded_vocab_size(args.vocab, 1), "tokens_per_step": tokens_per_step,
                 "micro_batch_size": cfg.train.micro_batch_size, "accum": args.accum,
                 "timed_steps": args.steps, "warmup_steps": args.warmup,
                 "ours_position": cfg.model.position_embedding, "megatron_position": megatron_position(cfg),
                 "same_model": None, **describe_setup(cfg), **environment(device)}
    fused = fusions_on(args.megatron_fusions, device)
    rec["megatron_fusions"] = {"setting": args.megatron_fusions, "on": fused}
    rec["fusions"] = {"ours": our_fusions(cfg, device), "megatron": megatron_fusions(cfg, fused)}
    print("both sides: " + ", ".join(f"{k} {v}" for k, v in describe_setup(cfg).items()), flush=True)
    print(f"megatron-core's fusions without apex / Transformer Engine: {'on' if fused else 'off'} "
          f"(--megatron-fusions {args.megatron_fusions})", flush=True)
    if args.check_shapes:
        from dept_mega.model import build_model
        from dept_mega.parallel.groups import build_groups
        ours = count(p for st in build_model(cfg, build_groups(), args.vocab, cfg.train.seed) for p in st.parameters())
        theirs = count(build_megatron(cfg, args.vocab, torch.device("cpu")).parameters())
        rec["shape_check"] = {"ours_params": ours, "megatron_params": theirs, "equal": ours == theirs}
        print(f"parameters: ours {ours:,}, megatron-core {theirs:,}")
        rec["same_model"] = rec["shape_check"]["equal"]
    failed = False
    for side, fn in (("ours", run_ours), ("megatron", lambda *a: run_megatron(*a, fusions=fused))):
        if args.only not in (None, side):
            continue
        try:
            res = fn(cfg, args.vocab, device, args.warmup, args.steps)
        except Exception as exc:  # noqa: BLE001 - recorded; the other side still runs
            traceback.print_exc()
            rec[side] = {"error": f"{type(exc).__name__}: {exc}"}
            failed = True
        else:
            res["tokens_per_s"] = tokens_per_step / (res["step_ms_median"] / 1e3)
            rec[side] = res
            peak = "n/a" if res["peak_mem_gb"] is None else f"{res['peak_mem_gb']:.1f} GB"
            print(f"{side:>9}: {res['tokens_per_s']:,.0f} tokens/s, median step {res['step_ms_median']:.1f} ms, "
                  f"peak memory {peak}, {res['params']:,} parameters", flush=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        ran = [rec[s] for s in ("ours", "megatron") if "params" in rec.get(s, {})]
        if len(ran) == 2:  # the models trained, whatever --check-shapes built
            rec["same_model"] = ran[0]["params"] == ran[1]["params"]
        write_record(rec, args.out)  # after each side: a crash of the next one leaves these figures
    if "tokens_per_s" in rec.get("ours", {}) and "tokens_per_s" in rec.get("megatron", {}):
        rec["ratio"] = rec["ours"]["tokens_per_s"] / rec["megatron"]["tokens_per_s"]
        print(f"ratio ours / megatron-core: {rec['ratio']:.3f}")
    write_record(rec, args.out)
    if dist.is_initialized():
        dist.destroy_process_group()
    if rec["same_model"] is False:
        print("error: the two models have different parameter counts: the shape translation is wrong",
              file=sys.stderr)
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
