"""Tensor-parallel layers: column- and row-parallel linear, vocabulary-parallel embedding.

Weights are initialised on their full shape from (seed, ``name``) and sliced to this rank
(see ``random.init_full_then_shard``), so the full matrices do not depend on the layout.

Parameter attributes read by the trainer / gradient-norm code:

* ``tensor_parallel`` — True: the parameter is a shard (count it on every tensor rank);
  False: replicated on every tensor rank (count it once).
* ``sequence_parallel`` — True: under sequence parallelism each tensor rank only sees part of
  the sequence, so its gradient is partial and must be all-reduced over ``pg.tp``.
* ``partition_dim`` / ``partition_stride`` — how the full tensor is sharded (for resharding).

The GEMM of a column/row-parallel layer is chosen by its :class:`LinearGemm`: ``torch``
(``F.linear``; with ``fuse_wgrad`` its weight gradient accumulates into ``main_grad``,
``wgrad.py``), ``fp8`` (our FP8 GEMMs, ``fp8.py``; inside a compiled block the traced
version, ``fp8_traced.py``) or ``te`` (Transformer Engine's ``Linear``,
``te.py``). Whatever the GEMM, the tensor/sequence-parallel collectives around it are ours and
go through ``pg.comm``.

A layer's ``forward(x, prologue=None)`` applies ``prologue`` (a callable: the block's norm
before QKV and fc1, the GELU before fc2) to its input first. With ``fp8_fused_casts``
(``LinearGemm.fused_casts``) an eager FP8 GEMM fuses a fusable prologue (LayerNorm, GELU) into
the cast of its input when no collective sits between the two (``fp8_prologue.py``);
otherwise the prologue runs as a call of its own and the layer as without one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .mappings import (copy_to_tp_region, gather_from_sequence_parallel_region, gather_from_tp_region,
                       reduce_from_tp_region, reduce_scatter_to_sequence_parallel_region,
                       scatter_to_tp_region, tp_world)
from .fp8 import Fp8Layer, Fp8Recipe, Fp8State, fp8_gemm_shape_ok, fp8_linear_eager
from .fp8_prologue import fp8_prologue_linear
from .fp8_traced import fp8_linear_traced
from .random import init_full_then_shard
from .sp_linear import sp_gather_linear
from .te import TELinearHolder
from .wgrad import linear as _linear_fn


class GroupsRef:
    """Holds the ``ParallelGroups`` for a module. ``copy.deepcopy`` of a module shares it (a
    copy must keep counting bytes in the same ``pg.comm`` and process groups cannot be
    copied)."""

    __slots__ = ("pg",)

    def __init__(self, pg) -> None:
        self.pg = pg

    def __deepcopy__(self, memo) -> "GroupsRef":
        return self


class UsesGroups:
    """Mixin: ``self.pg`` stored through a :class:`GroupsRef`."""

    @property
    def pg(self):
        return self._groups.pg

    @pg.setter
    def pg(self, value) -> None:
        object.__setattr__(self, "_groups", GroupsRef(value))


def mark(p: nn.Parameter, *, tensor_parallel: bool, sequence_parallel: bool = False,
         partition_dim: Optional[int] = None, partition_stride: int = 1) -> nn.Parameter:
    p.tensor_parallel = tensor_parallel
    p.sequence_parallel = sequence_parallel
    p.partition_dim = partition_dim
    p.partition_stride = partition_stride
    return p


PARALLEL_ATTRIBUTES = ("tensor_parallel", "sequence_parallel", "partition_dim", "partition_stride")


def copy_parallel_attributes(src: nn.Module, dst: nn.Module) -> None:
    """Copy the attributes above from ``src``'s parameters to ``dst``'s, matched by name.

    ``copy.deepcopy`` of an ``nn.Parameter`` drops Python attributes (pickling keeps them), so
    a deep-copied module needs this before its gradients are reduced or its norm counted.
    """
    dst_params = dict(dst.named_parameters())
    for name, p in src.named_parameters():
        if name in dst_params:
            for attr in PARALLEL_ATTRIBUTES:
                if hasattr(p, attr):
                    setattr(dst_params[name], attr, getattr(p, attr))


@dataclass(frozen=True)
class LinearGemm:
    """How a parallel linear layer multiplies: ``torch`` (F.linear in the weights' dtype),
    ``fp8`` (native FP8 GEMMs scaled by the model's ``fp8_state``, whose recipe they follow),
    ``te`` (Transformer Engine ``Linear``; FP8 when the caller is inside TE's FP8 autocast, see
    ``te.py``). ``fuse_wgrad`` (``torch`` only): the weight gradient accumulates straight into
    the gradient buffer (``wgrad.py``, ``optim.grad_accum_fusion``). ``fused_casts`` (``fp8``
    only, ``fp8_fused_casts``): a fusable prologue is fused into the input's cast
    (``fp8_prologue.py``). ``fused_dgelu`` (``fp8`` only; fc1): the cast of the layer's output
    gradient is fused into the GELU backward that produces it (``fp8_dgelu.py``; the MLP hands
    the layer to fc2's GELU prologue)."""
    kind: str = "torch"
    fp8_state: Optional[Fp8State] = None
    fuse_wgrad: bool = False
    fused_casts: bool = False
    fused_dgelu: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("torch", "fp8", "te"):
            raise ValueError(f"unknown GEMM kind {self.kind!r}")
        if self.kind == "fp8" and self.fp8_state is None:
            raise ValueError("an fp8 GEMM needs the model's Fp8State")
        if self.fuse_wgrad and self.kind != "torch":
            raise ValueError(f"gradient-accumulation fusion is for torch GEMMs, not {self.kind!r}")
        if (self.fused_casts or self.fused_dgelu) and self.kind != "fp8":
            raise ValueError(f"fused FP8 casts are for fp8 GEMMs, not {self.kind!r}")

    @property
    def recipe(self) -> Optional[Fp8Recipe]:
        return self.fp8_state.recipe if self.fp8_state is not None else None


TORCH_GEMM = LinearGemm()
FUSED_TORCH_GEMM = LinearGemm(fuse_wgrad=True)


class _GemmMixin:
    """The GEMM ``x Wᵀ`` (no bias) of a parallel linear layer, by ``self.gemm.kind``."""

    def _setup_gemm(self, gemm: Optional[LinearGemm], in_local: int, out_local: int, name: str, device,
                    direct: bool) -> None:
        """``direct``: no collective between the layer's input and its GEMM (a prologue may fuse)."""
        self.gemm = gemm or TORCH_GEMM
        self._fuse_prologue = self.gemm.fused_casts and direct
        if self.gemm.kind == "fp8":
            if not fp8_gemm_shape_ok(in_local, out_local):
                raise ValueError(f"{name}: FP8 GEMMs need the per-rank weight sizes ({out_local} × {in_local}) "
                                 f"to be multiples of 16")
            # its columns in the model's scaling state and its weight cache (opened per step by the trainer)
            self.fp8_layer: Optional[Fp8Layer] = self.gemm.fp8_state.new_layer()
            self._fp8_grad_dtype = self.gemm.recipe.grad_dtype
        else:
            self.fp8_layer = None
        self._te = TELinearHolder() if self.gemm.kind == "te" else None

    def _fuses(self, prologue) -> bool:
        """Whether ``prologue`` is fused into the FP8 cast of this call's input: ``fused_casts``,
        no collective in between, eager (a compiled block traces the unfused path) and a prologue
        that says it is fusable (``fp8_prologue.py``)."""
        return (self._fuse_prologue and getattr(prologue, "fp8_prologue", None) is not None
                and not torch.compiler.is_compiling())

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemm.kind == "fp8":
            # inside a compiled block: traced into the graph (fp8_traced.py, both recipes);
            # otherwise the eager FP8 linear (here never traced: without fp8_linear's graph-break wrapper)
            if torch.compiler.is_compiling():
                return fp8_linear_traced(x, self.weight, self._fp8_grad_dtype, self.fp8_layer)
            return fp8_linear_eager(x, self.weight, self.fp8_layer)
        if self.gemm.kind == "te":
            return self._te(self.weight, x)
        return _linear_fn(x, self.weight, None, self.gemm.fuse_wgrad)

    def _linear(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if self.gemm.kind == "torch":
            return _linear_fn(x, self.weight, bias, self.gemm.fuse_wgrad)
        y = self._matmul(x)
        return y if bias is None else y + bias.to(y.dtype)


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {d}")
    return n // d


class ColumnParallelLinear(_GemmMixin, UsesGroups, nn.Module):
    """``y = x Aᵀ + b`` with A split by output rows over the tensor group.

    Input: replicated ``[..., in]`` — or, with ``sequence_parallel``, this rank's sequence
    shard ``[s/T, ..., in]`` which is all-gathered first (backward: reduce-scatter). With the
    ``torch`` GEMMs only the shard is kept for the weight gradient and the backward all-gathers
    it again (``sp_linear.py``, as Megatron-LM); the FP8 and Transformer Engine GEMMs keep their
    own copies of the gathered input.
    Output: this rank's ``[..., out/T]`` columns, or the full ``[..., out]`` with
    ``gather_output``. ``stride``: the output dimension is made of that many equal blocks
    (SwiGLU's [gate; up]) and each rank holds its chunk of every block. ``gemm``: see
    :class:`LinearGemm` (default: ``F.linear``).
    """

    def __init__(self, in_features: int, out_features: int, pg, *, name: str, seed: int, init_std: float,
                 bias: bool = False, gather_output: bool = False, sequence_parallel: bool = False,
                 stride: int = 1, gemm: Optional[LinearGemm] = None,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        T = tp_world(pg)
        if sequence_parallel and gather_output:
            raise ValueError("ColumnParallelLinear: gather_output with a sequence-parallel input is not supported")
        self.pg = pg
        self.in_features = in_features
        self.out_features = out_features
        self.out_per_rank = _divide(out_features, T * stride, f"{name} output size / stride {stride}") * stride
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel and T > 1
        kw = dict(rank=pg.tp_rank, world=T, device=device, dtype=dtype)
        self.weight = mark(nn.Parameter(init_full_then_shard(
            f"{name}.weight", (out_features, in_features), seed, std=init_std, partition_dim=0,
            stride=stride, **kw)), tensor_parallel=T > 1, partition_dim=0, partition_stride=stride)
        if bias:
            self.bias = mark(nn.Parameter(init_full_then_shard(
                f"{name}.bias", (out_features,), seed, const=0.0, partition_dim=0, stride=stride, **kw)),
                tensor_parallel=T > 1, partition_dim=0, partition_stride=stride)
        else:
            self.register_parameter("bias", None)
        self._setup_gemm(gemm, in_features, self.out_per_rank, name, device, direct=T == 1)

    def forward(self, x: torch.Tensor, prologue=None) -> torch.Tensor:
        if prologue is not None:
            if self._fuses(prologue):  # one rank: no collective before the GEMM, none after it
                y = fp8_prologue_linear(x, self.weight, self.fp8_layer, prologue)
                return y if self.bias is None else y + self.bias.to(y.dtype)
            x = prologue(x)
        if self.sequence_parallel and self.gemm.kind == "torch":
            # keeps only this rank's shard for backward and all-gathers it again there (sp_linear.py)
            # (gather_output is refused with a sequence-parallel input)
            return sp_gather_linear(x, self.weight, self.bias, self.pg, self.gemm.fuse_wgrad)
        if self.sequence_parallel:  # FP8 / Transformer Engine: they keep their own copy of the gathered input
            x = gather_from_sequence_parallel_region(x, self.pg, tensor_parallel_output_grad=True)
        else:
            x = copy_to_tp_region(x, self.pg)
        y = self._linear(x, self.bias)
        if self.gather_output:
            y = gather_from_tp_region(y, self.pg)
        return y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} (local {self.out_per_rank}), "
                f"bias={self.bias is not None}, sp={self.sequence_parallel}, gemm={self.gemm.kind}")


class RowParallelLinear(_GemmMixin, UsesGroups, nn.Module):
    """``y = x Aᵀ + b`` with A split by input columns over the tensor group.

    Input: this rank's ``[..., in/T]`` (``input_is_parallel``) or the full input, which is
    split first. The partial products are all-reduced — or, with ``sequence_parallel``,
    reduce-scattered along dim 0 so each rank gets its sequence shard. The bias (replicated)
    is added after the reduction; under sequence parallelism its gradient is partial. ``gemm``:
    see :class:`LinearGemm`.
    """

    def __init__(self, in_features: int, out_features: int, pg, *, name: str, seed: int, init_std: float,
                 bias: bool = False, input_is_parallel: bool = True, sequence_parallel: bool = False,
                 gemm: Optional[LinearGemm] = None,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        T = tp_world(pg)
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel needs input_is_parallel=True")
        self.pg = pg
        self.in_features = in_features
        self.out_features = out_features
        self.in_per_rank = _divide(in_features, T, f"{name} input size")
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel and T > 1
        kw = dict(rank=pg.tp_rank, world=T, device=device, dtype=dtype)
        self.weight = mark(nn.Parameter(init_full_then_shard(
            f"{name}.weight", (out_features, in_features), seed, std=init_std, partition_dim=1, **kw)),
            tensor_parallel=T > 1, partition_dim=1)
        if bias:
            self.bias = mark(nn.Parameter(init_full_then_shard(
                f"{name}.bias", (out_features,), seed, const=0.0, device=device, dtype=dtype)),
                tensor_parallel=False, sequence_parallel=self.sequence_parallel)
        else:
            self.register_parameter("bias", None)
        self._setup_gemm(gemm, self.in_per_rank, out_features, name, device, direct=input_is_parallel or T == 1)

    def forward(self, x: torch.Tensor, prologue=None) -> torch.Tensor:
        if prologue is not None and self._fuses(prologue):  # the input is this rank's: nothing in between
            y = fp8_prologue_linear(x, self.weight, self.fp8_layer, prologue)
        else:
            if prologue is not None:
                x = prologue(x)
            if not self.input_is_parallel:
                x = scatter_to_tp_region(x, self.pg)
            y = self._matmul(x)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.pg)
        else:
            y = reduce_from_tp_region(y, self.pg)
        if self.bias is not None:
            y = y + self.bias
        return y

    def extra_repr(self) -> str:
        return (f"in={self.in_features} (local {self.in_per_rank}), out={self.out_features}, "
                f"bias={self.bias is not None}, sp={self.sequence_parallel}, gemm={self.gemm.kind}")


class VocabParallelEmbedding(UsesGroups, nn.Module):
    """An embedding table split by vocabulary rows over the tensor group.

    ``forward`` returns this rank's *partial* lookup (rows it does not own are zero); the
    caller sums over the tensor group (all-reduce, or reduce-scatter under sequence
    parallelism) — see ``partial=False`` for the all-reduced result.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, pg, *, name: str, seed: int, init_std: float,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        T = tp_world(pg)
        self.pg = pg
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.rows_per_rank = _divide(num_embeddings, T, f"{name} vocabulary size")
        self.vocab_start = pg.tp_rank * self.rows_per_rank if T > 1 else 0
        self.vocab_end = self.vocab_start + self.rows_per_rank
        self.weight = mark(nn.Parameter(init_full_then_shard(
            f"{name}.weight", (num_embeddings, embedding_dim), seed, std=init_std, partition_dim=0,
            rank=pg.tp_rank, world=T, device=device, dtype=dtype)), tensor_parallel=T > 1, partition_dim=0)

    def forward(self, ids: torch.Tensor, partial: bool = False) -> torch.Tensor:
        if tp_world(self.pg) == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return out if partial else reduce_from_tp_region(out, self.pg)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim} (local rows {self.vocab_start}:{self.vocab_end})"
