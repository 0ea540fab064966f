"""Which implementation each part of the model uses, and the one-line description for the log.

Linear layers (the GEMMs of our column/row-parallel layers; the collectives are always ours):

* ``backend: transformer_engine`` — Transformer Engine's ``Linear`` (``parallel/te.py``); needs
  TE to import and a CUDA device, else ``BackendError``. ``backend: auto`` takes this path
  when TE imports and the device is CUDA. With ``fp8`` the TE GEMMs run under TE's FP8
  autocast (``fp8_recipe``: delayed | current, ``fp8_amax_history``), amaxes reduced over
  ``pg.tp_dp``.
* ``backend: local`` (or ``auto`` without TE) with ``fp8: hybrid | e4m3`` — our native FP8 GEMMs
  (``parallel/fp8.py``; on CUDA it needs compute capability 8.9+): ``torch._scaled_mm`` or the
  cuBLASLt operator (``fp8_gemm``, ``parallel/fp8_gemm.py``), the casts of ``fp8_casts``
  (``parallel/fp8_casts.py``), producers fused into casts per ``fp8_fused_casts``
  (``fused_casts.py``); each key's ``auto`` / null picks the fastest path measured that runs
  here, and the log's notes say why where it does not. ``backend: auto`` + ``fp8`` without TE
  is this path (said in the log), not an error. Under ``train.compile`` they are traced into the compiled blocks (``parallel/fp8_traced.py``, both
  recipes; the log says so), their casts left to inductor (``_cast_math``) unless
  ``fp8_casts: triton`` is named: then each is the Triton kernel as one operator of the graph
  (``parallel/fp8_cast_op.py``).
* otherwise ``F.linear`` in the weights' dtype (bf16/fp16 weights under half precision).

Which GEMMs run FP8: the four of every transformer block (qkv, proj, fc1, fc2) except in the
first and last block when ``fp8_first_last_layers_bf16`` (Megatron's
``--first-last-layers-bf16``), and except a GEMM whose per-rank weight is not a multiple of
16 in both sizes (cuBLASLt's FP8 rule; then it stays bf16 in every layer, logged). The output
head and the embeddings always stay bf16.

Attention (``model.attention_backend``; ``attention.py`` has the implementations):

* ``flash`` / ``flex`` / ``sdpa`` / ``bias``: that path, or one ``BackendError`` naming
  ``model.attention_backend`` when it cannot run for this config on this device (raised when
  the model is built): flash needs flash-attn, CUDA, bf16/fp16 and a head dimension that is a
  multiple of 8 up to 256; flex needs CUDA (no backward pass on CPU), a head dimension of at
  least 16, no attention dropout and, below 128 tokens, a power-of-two number of query heads
  per group; sdpa takes no ALiBi.
* ``auto`` (:func:`choose_attention`, a pure function of device type, precision, position
  embedding, head dimension, heads per group, sequence length and dropout): flash-attn where
  it can run (for fp32 inputs the choice below is used); else for ALiBi compiled ``flex``
  where it can run and the materialised ``bias`` elsewhere (CPU, head dimension below 16,
  attention dropout, ...); for RoPE and learned positions ``sdpa`` (causal, no bias). The log's
  ``attention=`` field names the choice and why.

Norms: apex's fused LayerNorm / RMSNorm when apex is installed and the device is CUDA;
otherwise ``torch.nn.functional``.

Weight gradients (``optim.grad_accum_fusion``, ``parallel/wgrad.py``): the torch GEMMs of the
blocks and the output head accumulate them straight into the gradient buffer; the log names
the accumulation call. Not the FP8 / TE GEMMs; inside ``train.compile``'s compiled blocks the
fused layers run outside the graphs.
"""
from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..config import Config, ConfigError, ModelConfig, te_fp8_conflict
from ..parallel import fp8_kernels, triton_launch
from ..parallel.fp8 import Fp8Recipe, Fp8State, fp8_gemm_shape_ok, resolve_cast_kernels
from ..parallel.fp8_casts import auto_cast_kernels, default_graph_casts
from ..parallel.fp8_gemm import auto_gemm, resolve_gemm
from ..parallel.layers import FUSED_TORCH_GEMM, TORCH_GEMM, LinearGemm
from ..parallel.te import te_importable, te_installed
from ..parallel.wgrad import describe as describe_wgrad
from ..precision import Precision
from . import fused_casts as fused_casts_rule
from .attention import flash_attn_available
from .fused_casts import fused_cast_gemms, unfused_cast_reasons  # noqa: F401  (re-exported)

GEMMS = ("qkv", "proj", "fc1", "fc2")


class BackendError(ConfigError):
    """The requested backend / precision cannot be provided on this machine."""


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


@dataclass(frozen=True)
class AttentionPlan:
    kind: str  # flash | flex | sdpa | bias
    fallback: Optional[str] = None  # auto chose flash: the kind for inputs flash cannot take
    note: str = ""

    def describe(self) -> str:
        names = {"flash": "flash-attn", "flex": "flex_attention", "sdpa": "torch-sdpa",
                 "bias": "torch-sdpa+materialised-bias"}
        extra = f", {names[self.fallback]} for fp32 inputs" if self.fallback else ""
        note = f": {self.note}" if self.note else ""
        return f"{names[self.kind]}{extra}{note}"


@dataclass(frozen=True)
class Backends:
    requested: str
    attention: AttentionPlan
    norm: str  # "apex" | "torch"
    linear: str  # "torch" | "fp8-native" | "transformer_engine"
    fp8: Optional[Fp8Recipe] = None
    fp8_layers: tuple[int, ...] = ()  # global layer ids whose block GEMMs run FP8
    fp8_gemms: tuple[str, ...] = ()  # which of GEMMS (per-rank shape rule)
    fp8_casts: str = ""  # native FP8: "triton" (one kernel per cast) | "cuda" (the C++ operator) | "torch" (fp8._cast_math)
    fp8_graph_casts: str = ""  # the casts inside compiled graphs: "triton" (fp8_casts named triton) | "torch"
    fp8_gemm: str = ""  # native FP8: "torch" (torch._scaled_mm) | "cublaslt" (dept_mega::fp8_gemm, fp8_gemm.py)
    fp8_gemm_tuning: int = 0  # cublaslt: the candidates timed per problem (fp8_gemm_tuning; 0 elsewhere)
    # fp8_fused_casts for the log: "" (false, or no native FP8), "on" (true), "auto" (null; model/fused_casts.py)
    fused_casts: str = ""
    # the FP8 GEMMs whose input's producer is fused into its cast, and "dgelu" where fc1's output
    # gradient's cast is fused into fc2's GELU backward
    fp8_fused_casts: tuple[str, ...] = ()
    fp8_unfused: tuple[str, ...] = ()  # with fused_casts: the FP8 linears that do not fuse, and why
    num_layers: int = 0
    recompute: str = "none"
    recompute_layers: Optional[int] = None
    compile: bool = False
    fuse_wgrad: bool = False  # optim.grad_accum_fusion: torch GEMMs accumulate dW into main_grad
    wgrad: str = ""  # how (parallel/wgrad.py PATHS), for the log
    tied: bool = False  # model.tie_embeddings (the head shares the input embedding)
    head_apart: bool = False  # the head on another model chunk than the input embedding (pipeline/virtual > 1)
    cross_entropy: str = "eager"  # "compiled" on CUDA (parallel/cross_entropy.py), else "eager"
    rope: str = ""  # rotary positions (model/positions.py): "compiled" on CUDA, "eager" elsewhere; "" without
    notes: tuple[str, ...] = field(default=())

    def layer_fp8(self, layer_id: int) -> bool:
        return self.fp8 is not None and layer_id in self.fp8_layers

    def gemms(self, layer_id: int, fp8_state: Optional[Fp8State] = None) -> dict[str, LinearGemm]:
        """The GEMM of each linear layer of block ``layer_id``; native FP8 GEMMs need the
        model's ``fp8_state`` (``build_model`` makes one per model)."""
        if self.linear == "transformer_engine":
            return {g: LinearGemm("te") for g in GEMMS}
        torch_gemm = FUSED_TORCH_GEMM if self.fuse_wgrad else TORCH_GEMM
        if self.linear == "fp8-native" and self.layer_fp8(layer_id):
            if fp8_state is None or fp8_state.recipe != self.fp8:
                raise ValueError(f"layer {layer_id}: native FP8 GEMMs need an Fp8State with the recipe {self.fp8}")
            fused = self.fp8_fused_casts  # "dgelu": fc1's output-gradient cast (fused_casts.py)
            return {g: (LinearGemm("fp8", fp8_state, fused_casts=g in fused, fused_dgelu=g == "fc1" and "dgelu" in fused)
                        if g in self.fp8_gemms else torch_gemm) for g in GEMMS}
        return {g: torch_gemm for g in GEMMS}

    def new_fp8_state(self, device: torch.device | str) -> Optional[Fp8State]:
        """The FP8 scaling state for a model built with these backends (one per model), or None
        when its linear layers do not run native FP8."""
        if self.linear == "fp8-native" and self.fp8 is not None:
            return Fp8State(self.fp8, device, kernels=self.fp8_casts, graph_casts=self.fp8_graph_casts or None,
                            gemm=self.fp8_gemm or "torch", gemm_tuning=self.fp8_gemm_tuning)
        return None

    def describe_wgrad(self) -> str:
        if not self.fuse_wgrad:
            # fp8_gemm: cublaslt accumulates its weight gradients in the GEMM whatever this key says
            lt = self.fp8 is not None and self.linear == "fp8-native" and self.fp8_gemm == "cublaslt"
            return "grad_accum_fusion=off" + (" [but the fp8 GEMMs accumulate into main_grad themselves: "
                                              "fp8_gemm cublaslt]" if lt else "")
        # a tied head accumulates into main_grad only where its chunk holds no input embedding
        # (model/embeddings.py: fuse_tied_head); on the one chunk of pipeline 1 it does not
        where = (["output head"] if not self.tied
                 else ["tied head on a chunk without the input embedding"] if self.head_apart else [])
        if self.linear == "transformer_engine":
            where.append("not the TE GEMMs")
        else:
            where.insert(0, "torch GEMMs (outside the compiled graphs: a graph break each)" if self.compile
                         else "torch GEMMs")
            if self.fp8 is not None:
                where.append("fp8 GEMMs accumulating in fp32 themselves (fp8_gemm: cublaslt)"
                             if self.fp8_gemm == "cublaslt" else "not the fp8 GEMMs")
        return f"grad_accum_fusion=on [{', '.join(where)}]: {self.wgrad}"

    def describe_linear(self) -> str:
        if self.fp8 is None:
            return "transformer_engine (bf16)" if self.linear == "transformer_engine" else "torch"
        native = self.linear != "transformer_engine"
        traced = native and self.compile  # parallel/fp8_traced.py
        if native:
            casts = "casts in the compiled graphs" if traced else _CASTS[self.fp8_casts]
            if casts == _CASTS["triton"] and fp8_kernels.AVAILABLE:
                casts += f" ({triton_launch.describe(fp8_kernels._cast_kernel)})"
            tuned = f" tuned over {self.fp8_gemm_tuning} candidates" if self.fp8_gemm_tuning > 1 else ""
            how = f"native fp8 ({_GEMM[self.fp8_gemm or 'torch']}{tuned}, {casts})"
        else:  # Transformer Engine casts itself (fp8_casts / fp8_gemm apply to the native GEMMs only)
            how = "transformer_engine fp8"
        bf16_layers = [i for i in range(self.num_layers) if i not in self.fp8_layers]
        gemms = ", ".join(self.fp8_gemms) if self.fp8_gemms else "none"
        out = f"{how} {self.fp8.describe()}: fp8 GEMMs [{gemms}] in layers {_ranges(self.fp8_layers)}"
        stay = [g for g in GEMMS if g not in self.fp8_gemms]
        if stay:
            out += f"; bf16 GEMMs [{', '.join(stay)}] (per-rank size not a multiple of 16)"
        if bf16_layers:
            out += f"; bf16 layers {_ranges(bf16_layers)} (fp8_first_last_layers_bf16)"
        if self.fused_casts:
            out += "; " + fused_casts_rule.describe(self.fused_casts, self.fp8_fused_casts, self.fp8_unfused,
                                                    self.fp8_casts, self.fp8.scaling, self.norm == "apex")
        if traced:
            out += (f"; FP8 GEMMs traced into the compiled blocks ({self.fp8.scaling} scaling) with "
                    f"{_GRAPH_CASTS[self.fp8_graph_casts or 'torch']}")
        return out + "; bf16 output head and embeddings"

    def describe(self) -> str:
        parts = [f"backend={self.requested}: linear={self.describe_linear()}",
                 f"attention={self.attention.describe()}", f"norm={self.norm}"]
        if self.recompute == "full":
            n = "all" if self.recompute_layers is None else f"first {self.recompute_layers}"
            parts.append(f"recompute=full ({n} blocks of each chunk)")
        elif self.recompute == "selective":
            parts.append("recompute=selective (attention core)")
        if self.compile:
            parts.append("compile=per-block torch.compile")
        parts.append(self.describe_wgrad())
        parts.append(f"cross_entropy={self.cross_entropy}")
        if self.rope:
            parts.append(f"rope={self.rope}")
        note = f" ({'; '.join(self.notes)})" if self.notes else ""
        return " | ".join(parts) + note


_GEMM = {"torch": "torch._scaled_mm",
         "cublaslt": "cuBLASLt operator dept_mega::fp8_gemm, weight gradients accumulated into main_grad by the GEMM"}
_CASTS = {"triton": "Triton cast kernels", "cuda": "C++ cast operator dept_mega::cast_fp8", "torch": "torch casts"}
_GRAPH_CASTS = {"triton": "the Triton cast kernel as one op per cast (dept_mega::fp8_cast)",
                "torch": "inductor's casts (from the torch math)"}


def _ranges(ids) -> str:
    ids = sorted(ids)
    if not ids:
        return "none"
    out, start, prev = [], ids[0], ids[0]
    for i in ids[1:] + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ", ".join(out)


# What the fused kernels accept (checked before choosing them, so that a run never meets the
# kernel's own NotImplementedError mid-training):
# * flex_attention's CUDA (Triton) lowering raises NotImplementedError("NYI: embedding dimension
#   of the query, key, and value must be at least 16") when E or Ev < 16 ("tl.dot does not
#   support embedding size less than 16"; torch/_inductor/kernel/flex/flex_attention.py, the
#   same check in every release from 2.5 to 2.13, so in 2.11). Other head sizes are padded to
#   the next power of two inside the kernel (set_head_dim_values: QK_HEAD_DIM_ROUNDED), and
#   fp32, bf16 and fp16 inputs all have kernel configs, so neither dtype nor a power of two
#   restricts it. Its decoding kernel, which inductor picks for query lengths below 128,
#   raises ValueError("Number of shared query heads sharing the same KV head must be power of
#   2") for other GQA ratios; torch 2.13 routes those to the main kernel, but that routing was
#   reported missing for some shapes (pytorch/pytorch#151359, 2025), so we do not rely on it.
# * flex_attention has no backward pass on CPU (torch 2.11 - 2.13: _validate_device raises for
#   inputs that require grad): training on CPU cannot use it.
# * flash-attn 2: head size at most 256 and a multiple of 8 (flash_api.cpp's TORCH_CHECKs),
#   fp16/bf16 CUDA inputs only.
FLEX_MIN_HEAD_DIM = 16
FLEX_DECODE_MAX_LEN = 128
FLASH_MAX_HEAD_DIM = 256


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def flex_problem(device_type: str, head_dim: int, q_per_group: int, seq_length: int) -> Optional[str]:
    """None when compiled flex_attention can train this attention on ``device_type``; else why not."""
    if device_type != "cuda":
        return f"flex_attention has no backward pass on {device_type} (torch {torch.__version__})"
    if head_dim < FLEX_MIN_HEAD_DIM:
        return f"flex_attention's CUDA kernel needs a head dimension of at least {FLEX_MIN_HEAD_DIM}, got {head_dim}"
    if not _pow2(q_per_group) and seq_length < FLEX_DECODE_MAX_LEN:
        return (f"flex_attention's kernel for sequences shorter than {FLEX_DECODE_MAX_LEN} needs a power-of-two "
                f"number of query heads per group, got {q_per_group} (seq_length {seq_length})")
    return None


def flash_problem(device_type: str, head_dim: int, precision: str, installed: bool) -> Optional[str]:
    """None when flash-attn can run this attention; else why not."""
    if not installed:
        return "flash needs the flash_attn package, which is not installed"
    if device_type != "cuda" or precision not in ("bf16", "fp16"):
        return (f"flash needs a CUDA device and precision bf16 or fp16 (device {device_type}, "
                f"precision {precision})")
    if head_dim > FLASH_MAX_HEAD_DIM or head_dim % 8:
        return f"flash-attn needs a head dimension that is a multiple of 8 up to {FLASH_MAX_HEAD_DIM}, got {head_dim}"
    return None


def choose_attention(want: str, *, device_type: str, precision: str, position: str, head_dim: int,
                     q_per_group: int, seq_length: int, dropout: bool, flash_installed: bool) -> AttentionPlan:
    """The attention path for ``model.attention_backend: want`` — a pure function of the device
    type, precision, position embedding, head dimension, query heads per group, sequence length,
    attention dropout and whether flash-attn is installed. An explicit path that cannot run is
    one :class:`BackendError` naming ``model.attention_backend``; ``auto`` only picks what runs:
    flash-attn where it can (the second choice below for fp32 inputs); else for ALiBi compiled
    flex where it can (CUDA, see :func:`flex_problem`, no dropout) and the materialised bias
    otherwise; for RoPE / learned positions SDPA without a bias."""
    key = "config key 'model.attention_backend'"
    alibi = position == "alibi"
    flex_no = flex_problem(device_type, head_dim, q_per_group, seq_length)
    flash_no = flash_problem(device_type, head_dim, precision, flash_installed)
    if want == "flash":
        if flash_no:
            raise BackendError(f"{key}: {flash_no}")
        return AttentionPlan("flash")
    if want == "flex":
        if dropout:
            raise BackendError(f"{key}: flex_attention cannot apply attention dropout")
        if flex_no:
            raise BackendError(f"{key}: {flex_no}; use auto or bias")
        return AttentionPlan("flex", note="compiled" + (", ALiBi score_mod" if alibi else ", causal block mask"))
    if want == "sdpa":
        if alibi:
            raise BackendError(f"{key}: sdpa cannot apply ALiBi without a bias")
        return AttentionPlan("sdpa", note="causal, no bias")
    if want == "bias":
        return AttentionPlan("bias", note="requested")
    if want != "auto":
        raise BackendError(f"{key}: {want!r} is not one of auto | flash | flex | sdpa | bias")
    if not alibi:
        second = AttentionPlan("sdpa", note="causal, no bias")
    elif dropout:
        second = AttentionPlan("bias", note="ALiBi with attention dropout: flex_attention has no dropout")
    elif flex_no:
        second = AttentionPlan("bias", note=f"ALiBi: {flex_no}")
    else:
        second = AttentionPlan("flex", note="compiled, ALiBi score_mod")
    if flash_no is None:
        return AttentionPlan("flash", fallback=second.kind, note=second.note)
    note = second.note
    if flash_installed and device_type != "cuda":
        note += f"; flash-attn not used on {device_type}"
    elif flash_installed and device_type == "cuda" and precision in ("bf16", "fp16"):
        note += f"; {flash_no}"
    return AttentionPlan(second.kind, note=note)


def _resolve_attention(m: ModelConfig, precision: str, device: torch.device) -> AttentionPlan:
    return choose_attention(m.attention_backend, device_type=device.type, precision=precision,
                            position=m.position_embedding, head_dim=m.head_dim,
                            q_per_group=m.num_attention_heads // m.query_groups, seq_length=m.seq_length,
                            dropout=m.attention_dropout > 0, flash_installed=flash_attn_available())


def te_request_problem(device_type: Optional[str]) -> Optional[str]:
    """Why ``backend: transformer_engine`` cannot run on a ``device_type`` device, or None.
    ``device_type`` None (the pre-flight on a machine that is not the launch's, e.g. a login
    node without GPUs, where Transformer Engine may not import): only whether it is installed."""
    if not te_installed():
        return "config key 'backend': transformer_engine was requested but transformer_engine is not installed"
    if device_type is None:
        return None
    ok, info = te_importable()
    if not ok:
        return f"config key 'backend': transformer_engine was requested but {info}"
    if device_type != "cuda":
        return f"config key 'backend': transformer_engine needs a CUDA device, got {device_type}"
    return None


def _resolve_linear(cfg: Config, device: torch.device) -> tuple[str, list[str]]:
    backend, fp8 = cfg.backend, cfg.fp8
    notes: list[str] = []
    if backend not in ("auto", "local", "transformer_engine"):
        raise BackendError(f"config key 'backend': {backend!r} is not one of auto | local | transformer_engine")
    if backend == "transformer_engine":
        problem = te_request_problem(device.type)
        if problem is not None:
            raise BackendError(problem)
        linear = "transformer_engine"
        notes.append(f"transformer_engine {te_importable()[1]}")
    elif backend == "auto" and te_installed() and device.type == "cuda":
        ok, info = te_importable()
        if ok:
            linear = "transformer_engine"
            notes.append(f"transformer_engine {info}")
        else:
            linear = "fp8-native" if fp8 else "torch"
            notes.append(f"{info}: " + ("native fp8" if fp8 else "torch GEMMs"))
    else:
        linear = "fp8-native" if fp8 else "torch"
        if backend == "auto" and fp8:
            why = "not used on CPU" if te_installed() else "not installed"
            notes.append(f"transformer_engine {why}: native fp8 GEMMs")
    if linear == "fp8-native" and device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            raise BackendError(f"config key 'fp8': FP8 GEMMs need compute capability 8.9 or newer, this GPU "
                               f"has {cap[0]}.{cap[1]}")
    if linear == "transformer_engine" and fp8 and cfg.model.recompute == "full":
        raise BackendError("config key 'model.recompute': full recomputation with Transformer Engine FP8 is not "
                           "supported here (TE's amax bookkeeping needs its own checkpoint); use selective or none")
    return linear, notes


def resolve_backends(cfg: Config | ModelConfig | None = None, device: torch.device | str = "cpu") -> Backends:
    """The backends of a run with config ``cfg`` on ``device`` (a bare ``ModelConfig``: the
    defaults of the other sections with backend local). Raises :class:`BackendError` for what cannot
    run here."""
    if cfg is None:
        cfg = Config()
    elif isinstance(cfg, ModelConfig):
        cfg = Config(model=cfg, backend="local")
    device = torch.device(device)
    m = cfg.model
    linear, notes = _resolve_linear(cfg, device)
    attention = _resolve_attention(m, cfg.precision, device)
    cuda = device.type == "cuda"
    compiled_math = "compiled" if cuda else "eager"  # the cross entropy and RoPE (parallel/compiled_math.py)
    if _installed("apex") and cuda:
        norm = "apex"
    else:
        norm = "torch"
        notes.append("apex " + ("not used on CPU" if _installed("apex") else "not installed"))
    if not flash_attn_available() and attention.kind != "flash" and cuda:
        notes.append("flash-attn not installed")
    recipe = None
    fp8_layers: tuple[int, ...] = ()
    fp8_gemms: tuple[str, ...] = ()
    fp8_casts = fp8_graph_casts = fp8_gemm = fused_mode = ""
    tuning = 0
    fused_gemms: tuple[str, ...] = ()  # fp8_fused_casts: which GEMMs fuse
    unfused: tuple[str, ...] = ()  # ... and why the others do not
    if cfg.fp8 is not None:
        fast_accum = cfg.fp8_fast_accum
        if fast_accum == "auto":  # exact sums in our GEMMs; Transformer Engine accumulates as 'forward'
            fast_accum = "forward" if linear == "transformer_engine" else "none"
        recipe = Fp8Recipe(cfg.fp8, cfg.fp8_recipe, cfg.fp8_amax_history, fast_accum)
        fp8_layers = fp8_block_layers(m.num_layers, cfg.fp8_first_last_layers_bf16)
        if linear == "fp8-native":
            fp8_gemms = native_fp8_gemms(m, cfg.parallel.tensor)
            fp8_casts, fp8_gemm = _native_fp8_paths(cfg, device, fp8_gemms, notes)
            tuning = cfg.fp8_gemm_tuning if fp8_gemm == "cublaslt" and device.type == "cuda" else 0
            if cfg.fp8_gemm_tuning > 1 and not tuning:
                notes.append(f"fp8_gemm_tuning {cfg.fp8_gemm_tuning} not applied: " + (
                    "the FP8 GEMMs are torch._scaled_mm" if fp8_gemm != "cublaslt" else
                    f"the operator's {device.type} kernel has one algorithm"))
            fp8_graph_casts = default_graph_casts(cfg.fp8_casts)
            # (with train.compile, fp8_gemm: cublaslt and fp8_fused_casts: true are refused with the config)
            if cfg.fp8_fused_casts is not False:
                how = dict(setting=cfg.fp8_fused_casts, casts=fp8_casts, scaling=recipe.scaling,
                           compile=cfg.train.compile, gpu=device.type == "cuda")
                fused_mode = "on" if cfg.fp8_fused_casts else "auto"
                fused_gemms = fused_cast_gemms(m, cfg.parallel.tensor, fp8_gemms, **how)
                unfused = unfused_cast_reasons(m, cfg.parallel.tensor, fp8_gemms, **how)
        else:
            if (why := te_fp8_conflict(cfg)) is not None:
                chose = " (backend: auto chose it: set backend: local)" if cfg.backend == "auto" else ""
                raise BackendError(why + chose)
            fp8_gemms = GEMMS  # TE checks shapes itself
    fuse = cfg.optim.grad_accum_fusion
    wgrad = ""
    if fuse:
        prec = Precision(cfg.precision, device, cfg.optim.grad_dtype)  # raises for a combination it rejects
        wgrad = describe_wgrad(device, prec.param_dtype, prec.grad_dtype)
    return Backends(requested=cfg.backend, attention=attention, norm=norm, linear=linear, fp8=recipe,
                    fp8_layers=fp8_layers, fp8_gemms=fp8_gemms, fp8_casts=fp8_casts,
                    fp8_graph_casts=fp8_graph_casts, fp8_gemm=fp8_gemm, fp8_gemm_tuning=tuning, fused_casts=fused_mode,
                    fp8_fused_casts=fused_gemms, fp8_unfused=unfused, num_layers=m.num_layers,
                    recompute=m.recompute, recompute_layers=m.recompute_layers, compile=cfg.train.compile,
                    fuse_wgrad=fuse, wgrad=wgrad, tied=m.tie_embeddings,
                    head_apart=cfg.parallel.pipeline * cfg.parallel.virtual_pipeline > 1,
                    cross_entropy=compiled_math, rope=compiled_math if m.position_embedding == "rope" else "",
                    notes=tuple(notes))


def _native_fp8_paths(cfg: Config, device: torch.device, fp8_gemms: tuple[str, ...],
                      notes: list[str]) -> tuple[str, str]:
    """The native FP8 linears' casts (``fp8_casts``) and GEMM (``fp8_gemm``) on ``device``; an
    ``auto`` that does not take the fastest path measured (the C++ casts, the cuBLASLt GEMM) says
    why in ``notes``. :class:`BackendError` for an explicit path that cannot run here."""
    shapes = _gemm_shapes(cfg.model, cfg.parallel.tensor)
    widest = max((max(shapes[g]) for g in fp8_gemms), default=0)  # the most columns a cast sees
    try:
        casts = resolve_cast_kernels(cfg.fp8_casts, device, widest)
    except ValueError as exc:
        raise BackendError(f"config key 'fp8_casts': {exc}") from None
    if cfg.fp8_casts == "auto" and (why := auto_cast_kernels(device, widest)[1]) is not None:
        notes.append(f"fp8_casts auto: {casts} ({why})")
    o = cfg.optim
    try:
        gemm = resolve_gemm(cfg.fp8_gemm, device, cfg.train.compile, o.grad_accum_fusion, o.grad_dtype)
    except ValueError as exc:
        raise BackendError(f"config key 'fp8_gemm': {exc}") from None
    if cfg.fp8_gemm == "auto" and (why := auto_gemm(device, cfg.train.compile, o.grad_accum_fusion,
                                                     o.grad_dtype)[1]) is not None:
        notes.append(f"fp8_gemm auto: torch._scaled_mm ({why})")
    return casts, gemm


def fp8_block_layers(num_layers: int, first_last_bf16: bool) -> tuple[int, ...]:
    """Global ids of the blocks whose GEMMs run FP8 (with ``fp8`` set): all, or all but the
    first and the last (``fp8_first_last_layers_bf16``). The memory and communication models
    (dept/memory_fp8.py, dept/step_bytes.py) use this too."""
    skip = {0, num_layers - 1} if first_last_bf16 else set()
    return tuple(i for i in range(num_layers) if i not in skip)


def native_fp8_gemms(m: ModelConfig, tp: int) -> tuple[str, ...]:
    """Which of :data:`GEMMS` run native FP8 in an FP8 block: those whose per-rank weight sizes
    are multiples of 16 (``fp8_gemm_shape_ok``)."""
    return tuple(g for g, (i, o) in _gemm_shapes(m, tp).items() if fp8_gemm_shape_ok(i, o))


def _gemm_shapes(m: ModelConfig, tp: int) -> dict[str, tuple[int, int]]:
    """Per-rank (in, out) of each block GEMM."""
    h, d = m.hidden_size, m.head_dim
    ffn_out = m.ffn_size * (2 if m.activation == "swiglu" else 1)
    return {"qkv": (h, (m.num_attention_heads + 2 * m.query_groups) * d // tp),
            "proj": (m.num_attention_heads * d // tp, h),
            "fc1": (h, ffn_out // tp),
            "fc2": (m.ffn_size // tp, h)}


@functools.lru_cache(maxsize=None)
def compile_problem(device: str) -> Optional[str]:
    """None when ``torch.compile`` works on ``device``; else a one-line reason. Compiles and runs
    a tiny function once per process and device (a missing C++ compiler on CPU or Triton on
    CUDA shows up only when compiled code first runs)."""
    try:
        fn = torch.compile(lambda x: torch.sin(x) * 2.0 + 1.0, dynamic=False)
        x = torch.linspace(0.0, 1.0, 8, device=device)
        if not torch.allclose(fn(x), torch.sin(x) * 2.0 + 1.0):
            return "compiled code gave a wrong result"
    except Exception as exc:  # noqa: BLE001 - reported in one line, the run stops
        msg = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {msg[0] if msg else ''}"[:300]
    return None
