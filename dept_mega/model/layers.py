"""The pieces of a transformer block: norm, self-attention, MLP (tensor-parallel)."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import ModelConfig
from ..parallel.fp8_prologue import GELU, Gelu
from ..parallel.layers import ColumnParallelLinear, LinearGemm, RowParallelLinear, mark
from ..parallel.mappings import tp_world
from ..parallel.random import RNGTracker, init_full_then_shard
from .attention import CoreAttention, FlexState, flash_takes
from .backends import Backends
from .positions import RotaryEmbedding, causal_alibi_bias, causal_mask_bias, local_alibi_slopes
from .recompute import recompute
from ..compile_guard import outside_compiled_graphs

try:  # optional fused kernels; only used on CUDA (see backends.py)
    from apex.normalization.fused_layer_norm import (fused_layer_norm_affine as _apex_ln,  # type: ignore
                                                     fused_rms_norm_affine as _apex_rms)
except Exception:  # noqa: BLE001
    _apex_ln = _apex_rms = None


class Norm(nn.Module):
    """LayerNorm (weight + bias, or weight only with ``bias=False``: ``model.norm_bias``) or
    RMSNorm (weight), parameters replicated over TP.

    Under sequence parallelism each tensor rank normalises its own sequence shard, so the
    weight's gradient is partial: ``sequence_parallel`` marks it for an all-reduce over TP.

    The block hands its norms to the linear layers that read their output (QKV, fc1) as their
    ``prologue``; ``fp8_prologue`` says whether an FP8 linear may fuse it into its input's cast
    (``parallel/fp8_prologue.py``: LayerNorm, by its ``weight``, ``bias`` and ``eps``).
    """

    def __init__(self, kind: str, hidden: int, eps: float, *, name: str, seed: int,
                 sequence_parallel: bool = False, use_apex: bool = False, bias: bool = True,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if kind not in ("layernorm", "rmsnorm"):
            raise ValueError(f"config key 'model.normalization': unknown norm {kind!r}")
        self.kind = kind
        self.hidden = hidden
        self.eps = eps
        # apex's affine LayerNorm needs a bias; without one torch's kernel runs
        self.use_apex = use_apex and _apex_ln is not None and (kind == "rmsnorm" or bias)
        self.weight = mark(nn.Parameter(init_full_then_shard(f"{name}.weight", (hidden,), seed, const=1.0,
                                                             device=device, dtype=dtype)),
                           tensor_parallel=False, sequence_parallel=sequence_parallel)
        if kind == "layernorm" and bias:
            self.bias = mark(nn.Parameter(init_full_then_shard(f"{name}.bias", (hidden,), seed, const=0.0,
                                                               device=device, dtype=dtype)),
                             tensor_parallel=False, sequence_parallel=sequence_parallel)
        else:
            self.register_parameter("bias", None)

    @property
    def fp8_prologue(self) -> Optional[str]:
        return "layernorm" if self.kind == "layernorm" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_apex and x.is_cuda:
            if self.kind == "layernorm":
                return _apex_ln(x, self.weight, self.bias, (self.hidden,), self.eps)
            return _apex_rms(x, self.weight, (self.hidden,), self.eps)
        if self.kind == "layernorm":
            return F.layer_norm(x, (self.hidden,), self.weight, self.bias, self.eps)
        return F.rms_norm(x, (self.hidden,), self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.kind}, {self.hidden}, eps={self.eps}"


class PositionState:
    """Position helpers shared by the layers of one body (caches attention biases, RoPE tables;
    with ``flex`` the flex_attention state, prepared for ``model.seq_length`` on ``device``)."""

    def __init__(self, cfg: ModelConfig, tp_rank: int, tp_size: int, *, flex: bool = False,
                 compile_flex: bool = True, device: torch.device | str = "cpu", bias: str = "") -> None:
        self.kind = cfg.position_embedding
        self.heads_local = cfg.num_attention_heads // tp_size
        self.slopes = (local_alibi_slopes(cfg.num_attention_heads, tp_rank, tp_size)
                       if self.kind == "alibi" else None)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta) if self.kind == "rope" else None
        self.flex: Optional[FlexState] = None
        if flex:
            self.flex = FlexState(self.slopes, compile=compile_flex)
            self.flex.prepare(cfg.seq_length, device)
        # when the attention reads the materialised bias: "always" (kind bias), "fallback" (flash's
        # fallback: inputs that are not fp16/bf16 CUDA tensors), "" never
        self.bias = bias
        self._bias: dict[tuple[int, str, torch.dtype], torch.Tensor] = {}

    def prepare(self, seq_len: int, device: torch.device, dtype: Optional[torch.dtype] = None) -> None:
        """What the attention of a ``seq_len``-token input (``dtype``: its activations') needs, made
        before (compiled) blocks run: the flex state, the materialised bias where it is read (made
        in a compiled block's first call, the cache's new entry would recompile the block at once)."""
        if self.flex is not None:
            self.flex.prepare(seq_len, device)
        if dtype is not None and (self.bias == "always" or (self.bias == "fallback" and not flash_takes(device, dtype))):
            self.attention_bias(seq_len, dtype, torch.device(device))

    def attention_bias(self, seq_len: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The materialised additive bias: ALiBi + causal ``[1, H, s, s]``, else causal ``[1, 1, s, s]``."""
        key = (seq_len, str(device), dtype)
        if key not in self._bias:
            if len(self._bias) > 8:
                self._bias.clear()
            self._bias[key] = (causal_alibi_bias(self.slopes, seq_len, dtype, device) if self.slopes is not None
                               else causal_mask_bias(seq_len, dtype, device))
        return self._bias[key]


class SelfAttention(nn.Module):
    """Causal self-attention, heads split over the tensor group; MHA or GQA.

    The fused QKV weight's full layout is grouped by query group — for each group g:
    [its q heads; its k head; its v head] — so a contiguous split of the output rows gives
    each tensor rank whole query groups (and the matching query heads).
    """

    def __init__(self, cfg: ModelConfig, pg, *, prefix: str, seed: int, num_layers: int,
                 sequence_parallel: bool, positions: PositionState, backends: Backends,
                 rng: Optional[RNGTracker], device, dtype, gemms: Optional[dict[str, LinearGemm]] = None) -> None:
        super().__init__()
        gemms = gemms or {}
        T = tp_world(pg)
        self.heads = cfg.num_attention_heads
        self.groups = cfg.query_groups
        self.head_dim = cfg.head_dim
        self.heads_local = self.heads // T
        self.groups_local = self.groups // T
        self.q_per_group = self.heads // self.groups
        self.positions = positions
        self.rng = rng
        self.recompute_core = cfg.recompute == "selective"
        plan = backends.attention
        self.core = CoreAttention(plan.kind, positions, q_per_group=self.q_per_group,
                                  dropout_p=cfg.attention_dropout, rng=rng, fallback=plan.fallback)
        std = cfg.init_method_std
        qkv_out = (self.heads + 2 * self.groups) * self.head_dim
        self.qkv = ColumnParallelLinear(cfg.hidden_size, qkv_out, pg, name=f"{prefix}.qkv", seed=seed,
                                        init_std=std, bias=cfg.bias, sequence_parallel=sequence_parallel,
                                        gemm=gemms.get("qkv"), device=device, dtype=dtype)
        self.proj = RowParallelLinear(self.heads * self.head_dim, cfg.hidden_size, pg, name=f"{prefix}.proj",
                                      seed=seed, init_std=std / math.sqrt(2.0 * num_layers), bias=cfg.bias,
                                      input_is_parallel=True, sequence_parallel=sequence_parallel,
                                      gemm=gemms.get("proj"), device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, norm: Optional[nn.Module] = None) -> torch.Tensor:
        """``x`` the block's input, normalised by ``norm`` first (QKV's prologue: see ``Norm``)."""
        if self.training and self.core.dropout_p > 0 and torch.compiler.is_compiling():
            return self._forward_eager(x if norm is None else norm(x))  # the norm stays in the graph
        return self._forward(x, norm)

    @outside_compiled_graphs
    def _forward_eager(self, x: torch.Tensor) -> torch.Tensor:
        """Attention dropout inside a compiled block (``train.compile``) runs eagerly: the kernel's
        dropout draws from the device generator seeded from our stream (``fork_device_rng``),
        which Dynamo cannot trace; a graph break inside the core made torch 2.13's AOT autograd
        fail replaying the QKV views, so the whole module is left out of the graph."""
        return self._forward(x)

    def _forward(self, x: torch.Tensor, norm: Optional[nn.Module] = None) -> torch.Tensor:
        qkv = self.qkv(x, prologue=norm)  # [s, b, groups_local * (q_per_group + 2) * hd]
        s, b, hd = qkv.shape[0], qkv.shape[1], self.head_dim
        qkv = qkv.view(s, b, self.groups_local, (self.q_per_group + 2) * hd)
        # A split, not indexing: the backward of a split is one concatenation into the QKV
        # gradient, where indexing's backward is a zero-filled full-size tensor per piece plus two
        # adds. A split of this 4-d view, not of [s, b, groups, q_per_group + 2, hd]: CUDA's cat
        # runs one batched (vectorised) kernel for tensors of at most 4 dimensions and otherwise
        # one strided copy per piece (aten/src/ATen/native/cuda/Shape.cu, CAT_ARRAY_MAX_INPUT_DIMS),
        # which were three of the four strided copies per layer and micro-batch of the 1B model.
        q, k, v = torch.split(qkv, [self.q_per_group * hd, hd, hd], dim=3)
        q = q.reshape(s, b, self.heads_local, hd)  # a view with one query head per group, else a copy
        if self.positions.rope is not None:
            q = self.positions.rope.apply(q)
            k = self.positions.rope.apply(k)
        if self.recompute_core and self.training:
            # selective recomputation: keep q, k, v; rebuild the core (and its dropout) in backward
            out = recompute(self.core, q, k, v, replay=[self.rng] if self.rng is not None else [])
        else:
            out = self.core(q, k, v)
        return self.proj(out.reshape(s, b, self.heads_local * hd))


class MLP(nn.Module):
    """fc1 (column-parallel; SwiGLU: [gate; up] as two row blocks) → activation → fc2 (row)."""

    def __init__(self, cfg: ModelConfig, pg, *, prefix: str, seed: int, num_layers: int,
                 sequence_parallel: bool, device, dtype, gemms: Optional[dict[str, LinearGemm]] = None) -> None:
        super().__init__()
        gemms = gemms or {}
        if cfg.activation not in ("gelu", "swiglu"):
            raise ValueError(f"config key 'model.activation': unknown activation {cfg.activation!r}")
        self.swiglu = cfg.activation == "swiglu"
        std = cfg.init_method_std
        ffn = cfg.ffn_size
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, ffn * (2 if self.swiglu else 1), pg, name=f"{prefix}.fc1",
                                        seed=seed, init_std=std, bias=cfg.bias, sequence_parallel=sequence_parallel,
                                        stride=2 if self.swiglu else 1, gemm=gemms.get("fc1"), device=device,
                                        dtype=dtype)
        self.fc2 = RowParallelLinear(ffn, cfg.hidden_size, pg, name=f"{prefix}.fc2", seed=seed,
                                     init_std=std / math.sqrt(2.0 * num_layers), bias=cfg.bias,
                                     input_is_parallel=True, sequence_parallel=sequence_parallel,
                                     gemm=gemms.get("fc2"), device=device, dtype=dtype)
        # fc2's prologue: the GELU, naming fc1 where fc1's output-gradient cast is fused into the
        # GELU's backward (fp8_fused_casts' dgelu, parallel/fp8_dgelu.py)
        self.gelu = Gelu(self.fc1) if self.fc1.gemm.fused_dgelu and not self.swiglu else GELU

    def forward(self, x: torch.Tensor, norm: Optional[nn.Module] = None) -> torch.Tensor:
        """``x`` the block's input, normalised by ``norm`` first (fc1's prologue: see ``Norm``);
        GELU is fc2's prologue (``parallel/fp8_prologue.py``)."""
        h = self.fc1(x, prologue=norm)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            return self.fc2(F.silu(gate) * up)
        return self.fc2(h, prologue=self.gelu)
