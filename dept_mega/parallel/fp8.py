"""Native FP8 GEMMs for the tensor-parallel linear layers (``backend: local`` + ``fp8``).

``fp8_linear(x, weight, layer)`` computes ``x Wᵀ`` with ``torch._scaled_mm`` (or, with
``fp8_gemm: cublaslt``, the C++ operator of ``fp8_gemm.py``) on FP8 operands with one scaling
factor per tensor (Transformer Engine's per-tensor recipes, written here
without TE); ``layer`` is the linear layer's :class:`Fp8Layer` of the model's :class:`Fp8State`:

* forward: the input and the weight are cast to e4m3 (``x·s_x``, ``W·s_w``, saturated to ±448)
  and multiplied with fp32 accumulation; the output is bf16 (``scale_a = 1/s_x``,
  ``scale_b = 1/s_w`` undo the scaling inside the GEMM).
* backward: the output gradient is cast to e5m2 (``fp8: hybrid``; e4m3 with ``fp8: e4m3``);
  ``dX = dY·W`` and ``dW = dYᵀ·X`` reuse the FP8 input and weight of the forward (so the
  saved activations are 1 byte per element). Gradients are returned in the dtypes of ``x``
  and ``weight``; inside a training step the weight gradient goes straight into the weight's
  gradient buffer (``GradBuffer.add_grad``: what ``param.grad`` and the buffer's hook would
  do, with less host work; ``fp8_gemm: cublaslt``: the GEMM adds into it in fp32). The master weights are never touched (the optimizer keeps them).
* steps: the trainer opens one step of the model's FP8 state around a training step's
  forwards and backwards (:func:`fp8_weight_cache`; ``train=False`` around an evaluation).
  Weights are cast once per step (:class:`Fp8WeightCache`): every micro-batch, recomputed
  forward and input-gradient GEMM of the step reuses that cast, as Transformer Engine does
  with its first-micro-batch flag. Outside a step every call casts afresh.
* scaling factors: ``s = FP8_MAX / amax``. ``current`` scaling takes the amax of the tensor
  being cast (exact range; the amax is reduced before the cast). ``delayed`` scaling is
  Transformer Engine's ``DelayedScaling`` (``amax_compute_algo='max'``, margin 0) with one
  history entry per training step: a step's scale of an operand (input, weight or output
  gradient of a layer) is ``FP8_MAX / the largest amax of that operand in the previous
  ``fp8_amax_history`` steps``, fixed for the whole step; each cast maxes its amax into the
  step's entry (so an entry is the largest over the step's micro-batches). An operand's first
  training step (no history yet) uses current scaling; non-finite amaxes (a step with inf/NaN
  values) are left out of the window, and an operand with no positive amax left keeps its
  previous scale; a step the trainer skips (non-finite loss or norm) is discarded whole
  (``Fp8State.discard_step``: its finite amaxes would set the window's scales). Evaluations and calls outside a training step use current scaling and leave
  the history alone. Because the scales do not change within a step, a recomputed forward casts
  exactly as the original one did (nothing to save or restore). The bookkeeping lives in
  :class:`Fp8State`, one per model: the histories of all layers are one buffer, every scale of a
  step is computed by one batched op when the step opens, and the step's position in the history
  is a ring index kept on the host. During a step the casts max their amaxes into fixed
  per-layer tensors (``Fp8Layer.amax``, and ``grad_amax`` for the output gradients), which the
  step's close writes into the history row: so the traced path (``fp8_traced.py``) records into
  the same place without knowing the ring position. The state is per rank (no amax reduction
  across ranks: every rank scales its own shards consistently); checkpoints save it per rank
  (``checkpoint_fp8.py``) and a resume with the same layout restores it exactly
  (:meth:`Fp8State.state_dict`), so a resumed run scales as the uninterrupted one would.
* casts: on CUDA, by default (``auto``) one C++ operator per cast where the extension has its
  CUDA kernels (``fp8_casts.py``), else one Triton kernel per cast (``fp8_kernels.py``); each
  reads the tensor once, writes the row-major and/or the transposed FP8 copy and maxes the
  tensor's amax into the step's amaxes (plus a reduction kernel before it under current scaling). The reference math
  (``_cast_math``, the same bytes) runs eagerly on CPU and compiled on CUDA without Triton;
  the run log names the path (``Triton cast kernels`` | ``C++ cast operator`` | ``torch casts``).

``torch._scaled_mm`` wants its first operand row-major and its second column-major, and every
dimension a multiple of 16 (checked on every device, see ``_scaled_mm``). The feature
dimensions are checked when the model is built (``fp8_gemm_shape_ok``; a GEMM that fails stays
bf16 and the run log says so); the token dimension is zero-padded to a multiple of 16 inside
the cast when needed (zero rows change neither the amax nor the product). No operand is
transposed by a pass of its own (see ``_Fp8Linear``).

torchao's float8 training (``Float8Linear``) was considered: it converts ``nn.Linear``
modules, while our column/row-parallel layers own their weights and collectives, so only its
GEMM part could replace ours. Whether it is faster than this path is to be measured on the
device (benchmarks/vs_torchao.py, docs/performance.md); until then this is the one FP8 path.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

import torch

from . import fp8_casts, fp8_gemm, fp8_kernels
from .fp8_casts import default_cast_kernels, resolve_cast_kernels  # noqa: F401  (re-exported)
from .fp8_contexts import _host_contexts
from .fp8_gemm import ALIGN as _ALIGN, PTR_ALIGN as _PTR_ALIGN, accumulate_wgrad, direct_op, resolve_gemm
from .fp8_math import _MIN_AMAX, _cast, _cast_math, _scaled_mm  # noqa: F401  (_cast_math: re-exported)
from .fp8_recipe import E4M3, E5M2, FP8_MAX, Fp8Recipe  # noqa: F401  (E5M2: re-exported)
from .wgrad import grad_owner
from ..compile_guard import outside_compiled_graphs

_SCALE_STRIDE = _PTR_ALIGN // 4  # float32 elements between two delayed-scaling inverse scales
INPUT, WEIGHT, GRAD = 0, 1, 2  # the operands of a layer (its columns in the amax history)


def fp8_gemm_shape_ok(in_features: int, out_features: int) -> bool:
    """Whether a (per-rank) ``in × out`` weight can run the FP8 GEMMs (both multiples of 16)."""
    return in_features % _ALIGN == 0 and out_features % _ALIGN == 0


def quantize(t: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` scaled so that ``amax`` (> 0) maps to the format's largest value, saturated, cast
    to ``dtype``; returns ``(fp8 tensor, 1/scale)`` (the factor that dequantises it)."""
    scale = FP8_MAX[dtype] / amax.float().clamp(min=_MIN_AMAX)
    q, _, inv, _ = _cast(t.reshape(-1, t.shape[-1]), scale, dtype)
    return q.reshape(t.shape), inv


class Fp8State:
    """The FP8 scaling state of one model: all FP8 linear layers of this rank (``build_model``
    makes one and hands it to every layer; a layer holds an :class:`Fp8Layer` of it).

    Delayed scaling keeps one amax history for the whole model: ``history`` ``[N + 1, 3 L]``
    (N = ``amax_history``, L layers, columns ``3·layer + operand``), a ring of one row per
    training step. :meth:`begin_step` (training) moves to the next row, zeroes it and computes
    the scales of every layer and operand at once: ``scale = FP8_MAX / max of the other N rows``
    (the previous N steps; non-finite amaxes, from a step with inf/NaN values, are left out, and
    a column with no positive amax left keeps its last scale, as in Transformer Engine). During
    the step every cast of an operand uses that fixed scale and maxes its amax into the current
    row, so the row ends up holding the step's largest amax over all its micro-batches (and
    recomputations, which see the same tensors). An operand's casts in its first training step
    (nothing recorded yet; tracked on the host: ``Fp8Layer.recorded_*``) use current scaling and
    record their amax too.

    Outside a training step (no step open, or an evaluation opened with ``train=False``)
    every cast uses current scaling and records nothing, so evaluations and direct calls leave
    the history alone. ``current`` scaling never records. The state is per rank; between
    steps :meth:`state_dict` / :meth:`load_state_dict` save and restore it exactly (the
    checkpoints' ``fp8_*.pt`` files, ``checkpoint_fp8.py``).

    ``kernels``: ``triton`` (``fp8_kernels.py``) | ``cuda`` (the C++ operator, ``fp8_casts.py``) |
    ``torch`` (``_cast_math``) | ``auto``; ``graph_casts`` (fp8_traced.py's): ``triton`` | ``torch``,
    by default ``triton`` where ``kernels`` names it; ``gemm``: ``torch`` (``torch._scaled_mm``) |
    ``cublaslt`` (the C++ operator, weight gradients accumulated into ``main_grad`` by the GEMM:
    ``fp8_gemm.py``), the eager linears' GEMMs: ``torch`` unless named (the config's ``fp8_gemm:
    auto`` is resolved by ``model/backends.py``, which knows the run's gradient settings),
    ``gemm_tuning`` its algorithm timing (``fp8_gemm.bound_op``)."""

    def __init__(self, recipe: Fp8Recipe, device: torch.device | str, kernels: str = "auto",
                 graph_casts: Optional[str] = None, gemm: str = "torch", gemm_tuning: int = 0) -> None:
        self.recipe = recipe
        self.device = torch.device(device)
        self.gemm = resolve_gemm(gemm, self.device)
        self.lt = self.gemm == "cublaslt"  # read by every GEMM of the FP8 linears
        # the eager linears' GEMM, (a, b, scale_a, scale_b, fast) -> bf16, and with cublaslt the
        # operator itself (the weight gradient's accumulation), resolved once here
        self.gemm_op = fp8_gemm.bound_op(gemm_tuning) if self.lt else None  # tuning: fp8_gemm_tuning
        self.mm = fp8_gemm.lt_mm_via(self.gemm_op) if self.lt else _scaled_mm
        self.kernels = resolve_cast_kernels(kernels, self.device)
        self._cast_op = direct_op(fp8_casts.op()) if self.kernels == "cuda" else None  # dept_mega::cast_fp8
        self.graph_casts = graph_casts or fp8_casts.default_graph_casts(kernels)
        self.grad_dtype = recipe.grad_dtype  # the output gradients' FP8 format (read by every backward)
        self.fast_gemms = recipe.fast_gemms  # use_fast_accum of the (forward, dgrad, wgrad) GEMMs
        self.layers: list[Fp8Layer] = []
        self.mode: Optional[str] = None  # None (no step open) | "train" | "eval"
        self._record = False  # a training step under delayed scaling is open: casts record their amax
        self.history: Optional[torch.Tensor] = None  # [N + 1, 3 L], allocated by the first training step
        self.scale: Optional[torch.Tensor] = None  # [3 L] this step's scales (delayed scaling)
        # [3 L] their reciprocals (the GEMMs' dequantisation), one per 16 bytes: see _scaled_mm
        self.inv: Optional[torch.Tensor] = None
        self.pos = 0  # the history row of the current step
        self._fmax: Optional[torch.Tensor] = None
        self._inv_views: list[torch.Tensor] = []
        # the current step's amaxes: every cast of a training step maxes into fixed tensors of
        # its layer (eager and traced alike, so a compiled graph depends neither on ``pos`` nor
        # on the layer's index): ``Fp8Layer.amax`` (input, weight) and ``Fp8Layer.grad_amax``
        # (output gradient; a storage of its own: AOT autograd keeps a backward's mutation of a
        # graph input in the backward graph only for an input the forward does not mutate);
        # :meth:`end_step` writes them into the history row ``pos``
        self._ready: set[int] = set()  # columns recorded before this step (this step's: Fp8Layer)

    def new_layer(self) -> "Fp8Layer":
        if self.history is not None:
            raise RuntimeError("Fp8State: layers are added before the first training step")
        layer = Fp8Layer(self, len(self.layers))
        self.layers.append(layer)
        return layer

    @property
    def delayed(self) -> bool:
        return self.recipe.scaling == "delayed"

    def begin_step(self, train: bool = True) -> None:
        """Open a step: the weight caches (each weight cast once until :meth:`end_step`) and,
        for a training step under delayed scaling, the next history row and the step's scales."""
        if self.mode is not None:
            raise RuntimeError("Fp8State: a step is already open (fp8_weight_cache does not nest)")
        for layer in self.layers:
            layer.cache.open()
        self.mode = "train" if train else "eval"
        self._record = train and self.delayed
        if self._record and self.layers:
            self._advance()

    def end_step(self) -> None:
        for layer in self.layers:
            layer.cache.close()
            layer.handoff = None
        if self._record and self.layers:
            with torch.no_grad():
                torch.maximum(torch.cat([layer.amax for layer in self.layers]),
                              torch.cat([layer.grad_amax for layer in self.layers]), out=self.history[self.pos])
        self.mode, self._record = None, False

    @torch.no_grad()
    def discard_step(self) -> None:
        """Forget the training step just closed (the trainer skipped it: non-finite loss or
        gradient norm): its history row is zeroed and the ring rewound, and operands first
        recorded in it are not ready, so the next step scales as if it had not run (a
        diverging step's huge finite amaxes would otherwise set the scales for the window)."""
        if self.mode is not None:
            raise RuntimeError("Fp8State.discard_step: a step is open (discard after it closed)")
        for layer in self.layers:
            layer.recorded_fwd = layer.recorded_grad = False
        if self.history is not None and self.delayed:
            self.history[self.pos].zero_()
            self.pos = (self.pos - 1) % self.history.shape[0]

    def recorded_columns(self) -> set[int]:
        """The columns with an amax recorded so far (earlier training steps and the open one)."""
        out = set(self._ready)
        for layer in self.layers:
            flags = (layer.recorded_fwd, layer.recorded_fwd, layer.recorded_grad)
            out.update(3 * layer.index + op for op in (INPUT, WEIGHT, GRAD) if flags[op])
        return out

    def state_dict(self) -> dict:
        """The delayed-scaling state between two steps, as host copies: the recipe's format and
        window, the number of layers and, once a training step has run, the amax ``history``,
        this step's ``scale``s, the ring position ``pos`` and the ``ready`` columns (those with
        an amax recorded: the next step scales them from the history)."""
        if self.mode is not None:
            raise RuntimeError("Fp8State.state_dict: a step is open (save between steps)")
        out = {"fmt": self.recipe.fmt, "amax_history": self.recipe.amax_history, "layers": len(self.layers)}
        if self.history is not None:
            out.update(history=self.history.detach().to("cpu", copy=True),
                       scale=self.scale.detach().to("cpu", copy=True), pos=self.pos,
                       ready=sorted(self.recorded_columns()))
        return out

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output (ValueError when it was saved for another recipe
        or number of layers); without a history: the empty state of a run before its first
        training step. The next step continues exactly as it would have after the save."""
        if self.mode is not None:
            raise RuntimeError("Fp8State.load_state_dict: a step is open")
        saved = (state.get("fmt"), state.get("amax_history"), state.get("layers"))
        if saved != (self.recipe.fmt, self.recipe.amax_history, len(self.layers)):
            raise ValueError(f"FP8 state saved for (format, amax history, layers) {saved}, this state is "
                             f"{(self.recipe.fmt, self.recipe.amax_history, len(self.layers))}")
        self.history = self.scale = self.inv = None
        self.pos, self._ready = 0, set()
        for layer in self.layers:
            layer.recorded_fwd = layer.recorded_grad = False
            layer.ready = (False, False, False)
            layer.scale = layer.amax = layer.grad_amax = None
        if state.get("history") is None:
            return
        self._allocate()
        self.history.copy_(state["history"])
        self.scale.copy_(state["scale"])
        torch.reciprocal(self.scale, out=self.inv)
        self.pos = int(state["pos"])
        self._ready = {int(c) for c in state["ready"]}

    def _allocate(self) -> None:
        cols = 3 * len(self.layers)
        self.history = torch.zeros(self.recipe.amax_history + 1, cols, dtype=torch.float32, device=self.device)
        self.scale = torch.ones(cols, dtype=torch.float32, device=self.device)
        self.inv = torch.ones(cols, _SCALE_STRIDE, dtype=torch.float32, device=self.device)[:, 0]
        fmax = (FP8_MAX[E4M3], FP8_MAX[E4M3], FP8_MAX[self.recipe.grad_dtype])
        self._fmax = torch.tensor(fmax * len(self.layers), dtype=torch.float32, device=self.device)
        self._inv_views = list(self.inv.unbind(0))
        for layer in self.layers:
            layer.scale = self.scale[3 * layer.index:3 * layer.index + 3]
            layer.amax = torch.zeros(3, dtype=torch.float32, device=self.device)
            layer.grad_amax = torch.zeros(3, dtype=torch.float32, device=self.device)
        self.pos = 0

    @torch.no_grad()
    def _advance(self) -> None:
        if self.history is None:
            self._allocate()
            return
        self._ready = self.recorded_columns()
        for layer in self.layers:
            layer.recorded_fwd = layer.recorded_grad = False
            layer.ready = tuple(3 * layer.index + op in self._ready for op in (INPUT, WEIGHT, GRAD))
        self.pos = (self.pos + 1) % self.history.shape[0]
        self.history[self.pos].zero_()
        torch._foreach_zero_([t for layer in self.layers for t in (layer.amax, layer.grad_amax)])
        h = self.history
        amax = torch.where(torch.isfinite(h), h, 0.0).amax(dim=0)  # a step with inf/NaN is left out
        self.scale.copy_(torch.where(amax > 0, self._fmax / amax, self.scale))
        torch.reciprocal(self.scale, out=self.inv)

    def cast(self, t: torch.Tensor, layer: int, operand: int, dtype: torch.dtype, pad: int = 0,
             rowwise: bool = True, colwise: bool = False, gelu: bool = False):
        """One FP8 cast of ``layer``'s ``operand`` (INPUT | WEIGHT | GRAD): ``(q, q_t, 1/scale)``
        (see ``_cast_math``). Delayed scaling inside a training step: the step's scale, the amax
        maxed into the history; otherwise current scaling. Triton or the C++ operator: one
        launch (two for current scaling); an fp32 ``t`` takes the reference math (see ``fp8_kernels``).
        ``gelu``: cast ``F.gelu(t)`` instead (fc2's fused prologue, ``fp8_prologue.py``)."""
        col = 3 * layer + operand
        record = self._record
        delayed = record and col in self._ready
        if record:  # the step's amax, and the layer's flag for it (see Fp8Layer)
            owner = self.layers[layer]
            if operand == GRAD:
                amax, owner.recorded_grad = owner.grad_amax, True
            else:
                amax, owner.recorded_fwd = owner.amax, True
        if self.kernels != "torch" and t.dtype in fp8_kernels.INPUT_DTYPES:  # triton | cuda: one operator
            args = (t, dtype, pad, rowwise, colwise, self.scale if delayed else None, col,
                    amax if record else None, operand)
            if not gelu:
                q, q_t, inv = (fp8_kernels.cast_fp8 if self.kernels == "triton" else self._cast_op)(*args)
            elif self.kernels == "triton":
                q, q_t, inv = fp8_kernels.cast_fp8(*args, gelu=True)
            else:  # the operator's schema ends in ``bool gelu=False``
                q, q_t, inv = self._cast_op(*args, True)
        else:
            q, q_t, inv, current = _cast(t, self.scale[col] if delayed else None, dtype, pad, rowwise, colwise, gelu)
            if record:
                torch.maximum(amax[operand], current, out=amax[operand])
        return q, q_t, (self._inv_views[col] if delayed else inv)

    def norm_cast(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
                  layer: int, pad: int = 0, colwise: bool = False):
        """``F.layer_norm(x, (H,), weight, bias, eps)`` of the 2-D ``x`` cast to e4m3 as ``layer``'s
        INPUT (the fused prologue of QKV and fc1, ``fp8_prologue.py``): ``(q, q_t, 1/scale, mean,
        rstd)``, ``mean``/``rstd`` in the form ``aten.native_layer_norm_backward`` takes. Under a
        ready delayed scale with the Triton or C++ casts and a bf16/fp16 ``x``: one kernel
        (norm, cast and amax); otherwise ``torch.native_layer_norm`` and :meth:`cast` (the same
        math; current scaling needs the output's amax before the cast). The amax and the layer's
        flag are recorded as :meth:`cast` records them."""
        col = 3 * layer + INPUT
        if (self._record and col in self._ready and self.kernels != "torch"
                and x.dtype in fp8_kernels.INPUT_DTYPES):
            owner = self.layers[layer]
            owner.recorded_fwd = True
            fused = fp8_kernels.layernorm_cast_fp8 if self.kernels == "triton" else fp8_casts.layernorm_cast_fp8
            q, q_t, mean, rstd = fused(x, weight, bias, eps, E4M3, pad, True, colwise, scale=self.scale,
                                       scale_index=col, amax_out=owner.amax, amax_index=INPUT)
            return q, q_t, self._inv_views[col], mean, rstd
        y, mean, rstd = torch.native_layer_norm(x, (x.shape[1],), weight, bias, eps)
        q, q_t, inv = self.cast(y, layer, INPUT, E4M3, pad, colwise=colwise)
        return q, q_t, inv, mean, rstd


@dataclass(frozen=True)
class WeightFp8:
    """A weight's FP8 copies: ``q`` [out, in] (the forward GEMM's second operand as ``q.t()``),
    ``q_t`` [in, out] (the input-gradient GEMM's second operand as ``q_t.t()``; None when not
    needed) and the dequantisation factor ``inv``. ``fwd`` and ``dgrad`` are those column-major
    views, made once with the copies (a ``.t()`` per GEMM is a dispatch of its own)."""
    q: torch.Tensor
    q_t: Optional[torch.Tensor]
    inv: torch.Tensor
    fwd: torch.Tensor = dataclasses.field(init=False, repr=False, compare=False)
    dgrad: Optional[torch.Tensor] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "fwd", self.q.t())
        object.__setattr__(self, "dgrad", None if self.q_t is None else self.q_t.t())


def quantize_weight(weight: torch.Tensor, layer: "Fp8Layer", transposed: bool) -> WeightFp8:
    """One cast of a weight to e4m3, in both layouts when ``transposed`` (one pass)."""
    with torch.no_grad():
        q, q_t, inv = layer.state.cast(weight.detach(), layer.index, WEIGHT, E4M3, colwise=transposed)
    return WeightFp8(q, q_t, inv)


class Fp8WeightCache:
    """The FP8 copies of one layer's weight, made once per training step and reused by every
    micro-batch of the step (Transformer Engine's ``is_first_microbatch``): by the forwards,
    by recomputed forwards and by the input-gradient GEMMs of the backwards.

    The cache holds only while a step is open (:func:`fp8_weight_cache`, opened by the trainer
    around the step's forwards and backwards, closed before the optimizer steps, and around an
    evaluation's forwards). So it never outlives a weight update, whichever way the weights are
    written (optimizer, the distributed optimizer's all-gather into its flat buffer, DEPT's
    outer sync, a checkpoint load). Outside (a model called directly) every call casts the
    weight afresh.
    Inside a step the weights must not change: a weight written in place after its cast is
    an error (caught through the tensor's version counter; writes through ``.data`` bypass it).
    """

    def __init__(self) -> None:
        self.is_open = False
        self._entry: Optional[WeightFp8] = None
        self._key: Optional[tuple[int, int]] = None

    def open(self) -> None:
        self.is_open, self._entry, self._key = True, None, None

    def close(self) -> None:
        self.is_open, self._entry, self._key = False, None, None

    def operands(self, weight: torch.Tensor, layer: "Fp8Layer", transposed: bool) -> WeightFp8:
        key = (weight._version, weight.data_ptr())
        if self._entry is not None:
            if key != self._key:
                raise RuntimeError("a weight with an FP8 copy changed during a training step (the FP8 weight "
                                   "cache holds from the step's first forward to its last backward)")
            if transposed and self._entry.q_t is None:  # first needed after a forward-only use
                self._entry = dataclasses.replace(self._entry, q_t=self._entry.q.t().contiguous())
            return self._entry
        ops = quantize_weight(weight, layer, transposed)
        if self.is_open:
            self._entry, self._key = ops, key
        return ops


class Fp8Layer:
    """One FP8 linear layer's handle: its history columns (``index``), weight cache and flags."""

    def __init__(self, state: Fp8State, index: int) -> None:
        self.state = state
        self.index = index
        self.cache = Fp8WeightCache()
        # whether the open training step recorded this layer's input and weight amaxes (always
        # together: a forward casts both, the weight once per step) and its output gradient's;
        # set by the eager casts and the traced linears (fp8_traced.py: writes Dynamo replays)
        self.recorded_fwd = self.recorded_grad = False
        # which operands (INPUT, WEIGHT, GRAD) have an amax from an earlier training step, i.e.
        # cast with the step's delayed scale (set when a step opens; a Python fact the traced
        # path guards on: one recompile when it flips after the first step)
        self.ready = (False, False, False)
        # the first training step allocates these (delayed scaling): this layer's three scales
        # (a view of ``Fp8State.scale``) and the step's amaxes of its input and weight (``amax``)
        # and of its output gradient (``grad_amax``), indexed by operand
        self.scale: Optional[torch.Tensor] = None
        self.amax: Optional[torch.Tensor] = None
        self.grad_amax: Optional[torch.Tensor] = None
        # the FP8 copies of this layer's output gradient a fused producer made (fp8_dgelu.Handoff), one use
        self.handoff = None


def _states(modules: Iterable[torch.nn.Module]) -> list[Fp8State]:
    out: dict[int, Fp8State] = {}
    for mod in modules:
        for m in mod.modules():
            layer = getattr(m, "fp8_layer", None)
            if isinstance(layer, Fp8Layer):
                out.setdefault(id(layer.state), layer.state)
    return list(out.values())


@contextlib.contextmanager
def fp8_weight_cache(modules: Iterable[torch.nn.Module], train: bool = True) -> Iterator[int]:
    """One step of the FP8 layers of ``modules``: opens their states (:meth:`Fp8State.begin_step`:
    the weight caches and, for a training step, the step's delayed scales) and closes them when
    the block exits. ``train=False`` for an evaluation (current scaling, nothing recorded).
    Yields the number of FP8 layers opened."""
    opened: list[Fp8State] = []
    try:
        for state in _states(modules):
            state.begin_step(train)
            opened.append(state)
        yield sum(len(s.layers) for s in opened)
    finally:
        for state in opened:
            state.end_step()


def fp8_discard_step(modules: Iterable[torch.nn.Module]) -> None:
    """The training step just closed was skipped: :meth:`Fp8State.discard_step` on the FP8
    states of ``modules`` (the trainer calls it on every rank alike)."""
    for state in _states(modules):
        state.discard_step()


class _Fp8Linear(torch.autograd.Function):
    """Layouts (all without a separate transpose pass; ``·_t`` copies come out of the casts):
    forward ``y = xq · wq.t()``; input gradient ``dX = gq · w.q_t.t()``; weight gradient
    ``dW = gq_t · xq_t.t()``, which contracts over the tokens and so needs both operands
    token-major: the forward saves the input's transposed FP8 copy (instead of the row-major
    one, the same bytes) and the gradient's cast writes its transposed copy too.

    Host time matters here (on a fast GPU the step waits for the Python of its FP8 linears,
    ``benchmarks/fp8_host_bench.py``): a reshape, slice or
    dtype conversion that would change nothing is skipped rather than dispatched (2-D operands,
    token counts that need no padding, gradients already in the operand's dtype), and no context
    is entered where none is needed (``_host_contexts``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, layer: Fp8Layer, grad: bool) -> torch.Tensor:
        x2 = x if x.dim() == 2 else x.reshape(-1, weight.shape[1])
        rows = x2.shape[0]
        pad = (-rows) % _ALIGN
        need_dx, need_dw = grad and ctx.needs_input_grad[0], grad and ctx.needs_input_grad[1]
        contexts = _host_contexts("dept_mega::fp8_linear_forward", x.device.type)
        try:
            xq, xq_t, x_inv = layer.state.cast(x2, layer.index, INPUT, E4M3, pad, colwise=need_dw)
            y, w = linear_gemm(ctx, x, xq, x_inv, weight, layer, rows, pad, need_dx)
        finally:
            if contexts is not None:
                contexts.close()
        ctx.save_for_backward(xq_t, x_inv, w.dgrad, w.inv)
        return y

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        xq_t, x_inv, w_dgrad, w_inv = ctx.saved_tensors
        grad_x, grad_w = linear_grads(ctx, grad_out, xq_t, x_inv, w_dgrad, w_inv, ctx.needs_input_grad[0],
                                      ctx.needs_input_grad[1])
        return grad_x, grad_w, None, None


def linear_gemm(ctx, x: torch.Tensor, xq: torch.Tensor, x_inv: torch.Tensor, weight: torch.Tensor,
                layer: Fp8Layer, rows: int, pad: int, need_dx: bool) -> tuple[torch.Tensor, WeightFp8]:
    """The forward GEMM of an FP8 linear (``_Fp8Linear``, ``fp8_prologue``'s fused linears)
    from its input's FP8 copy ``xq`` (``rows`` rows of ``x`` + ``pad``): ``(y [..., out] in
    x's leading shape, the weight's FP8 operands)``; notes in ``ctx`` what
    :func:`linear_grads` reads (``meta``, ``param``: the parameter itself, its gradient buffer)."""
    state = layer.state
    w = layer.cache.operands(weight, layer, need_dx)
    y = state.mm(xq, w.fwd, x_inv, w.inv, state.fast_gemms[0])
    ctx.meta = (layer, rows, pad, x.dtype, weight.dtype)
    ctx.param = weight
    if pad:
        y = y[:rows]
    return (y if x.dim() == 2 else y.reshape(*x.shape[:-1], weight.shape[0])), w


def linear_grads(ctx, grad_out: torch.Tensor, xq_t: Optional[torch.Tensor], x_inv: torch.Tensor,
                 w_dgrad: Optional[torch.Tensor], w_inv: torch.Tensor, need_dx: bool, need_dw: bool):
    """The backward of an FP8 linear whose forward ran :func:`linear_gemm` (``ctx.meta``,
    ``ctx.param``) on the input's transposed FP8 copy ``xq_t`` and the weight's ``w_dgrad``:
    ``(grad of the GEMM's input in its dtype and shape, or None; grad_w)``. Inside a training
    step the weight gradient goes into the gradient buffer (then ``grad_w`` is None)."""
    layer, rows, pad, x_dtype, w_dtype = ctx.meta
    g2 = grad_out if grad_out.dim() == 2 else grad_out.reshape(-1, grad_out.shape[-1])
    grad_x = grad_w = None
    state = layer.state
    mm = state.mm
    contexts = _host_contexts("dept_mega::fp8_linear_backward", grad_out.device.type)
    try:
        hand, layer.handoff = layer.handoff, None  # taken only if g2 is the tensor it cast (fp8_dgelu.py)
        hand = hand and hand.take(g2, rows + pad, need_dx, need_dw)
        gq, gq_t, g_inv = hand or state.cast(g2, layer.index, GRAD, state.grad_dtype, pad, rowwise=need_dx,
                                             colwise=need_dw)
        if need_dx:  # dX [M, in] = dY [M, out] · W [out, in]
            grad_x = mm(gq, w_dgrad, g_inv, w_inv, state.fast_gemms[1])
            if pad:
                grad_x = grad_x[:rows]
            if grad_out.dim() != 2:
                grad_x = grad_x.reshape(*grad_out.shape[:-1], w_dgrad.shape[1])
            if grad_x.dtype != x_dtype:
                grad_x = grad_x.to(x_dtype)
        if need_dw:  # dW [out, in] = dYᵀ [out, M] · X [M, in]
            owner = grad_owner(ctx.param)
            step = owner is not None and owner.active  # inside a training step: straight into main_grad
            # cublaslt: the GEMM accumulates into main_grad in fp32 itself (False: it cannot, see fp8_gemm)
            if not (step and state.lt and accumulate_wgrad(owner, ctx.param, gq_t, xq_t.t(), g_inv, x_inv,
                                                           state.fast_gemms[2], state.gemm_op)):
                grad_w = mm(gq_t, xq_t.t(), g_inv, x_inv, state.fast_gemms[2])
                if grad_w.dtype != w_dtype:
                    grad_w = grad_w.to(w_dtype)
                if step:
                    owner.add_grad(ctx.param, grad_w)
                    grad_w = None
    finally:
        if contexts is not None:
            contexts.close()
    return grad_x, grad_w


# ``torch.autograd.Function.apply`` without its Python wrapper (what it calls when no functorch
# transform is active, after replacing a dead functorch wrapper by its tensor): the C++ apply of
# ``_Fp8Linear`` bound once. The wrapper's own work (``setup_context`` inspection, the transforms'
# check, a generator over the arguments) is ~1.5 µs of host time per call; see fp8_linear_eager.
_transforms_active = torch._C._are_functorch_transforms_active
_unwrap_if_dead = getattr(getattr(torch._C, "_functorch", None), "unwrap_if_dead", None)


def direct_apply(fn: type):
    """The C++ apply of the ``autograd.Function`` ``fn``, bound (see above), or None on a torch
    whose ``Function.apply`` is laid out otherwise (then the callers take the public apply)."""
    apply = getattr(super(torch.autograd.Function, fn), "apply", None)
    return None if _unwrap_if_dead is None or apply is None or apply == fn.apply else apply


_APPLY = direct_apply(_Fp8Linear)


def fp8_linear_eager(x: torch.Tensor, weight: torch.Tensor, layer: Fp8Layer) -> torch.Tensor:
    """:func:`fp8_linear` for a caller that is never traced by Dynamo (the layers call it when
    ``torch.compiler.is_compiling()`` is False): without ``outside_compiled_graphs``'s wrapper
    (~1 µs of host time per call) and, when no functorch transform is active (training), with
    ``_Fp8Linear``'s C++ apply called directly, which is what ``Function.apply`` calls then
    (the same autograd node, the same results)."""
    # under no_grad (evaluation) ``needs_input_grad`` still says True: no backward layouts then
    if _APPLY is None or _transforms_active():
        return _Fp8Linear.apply(x, weight, layer, torch.is_grad_enabled())
    return _APPLY(_unwrap_if_dead(x), _unwrap_if_dead(weight), layer, torch.is_grad_enabled())


@outside_compiled_graphs
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, layer: Fp8Layer) -> torch.Tensor:
    """``x Wᵀ`` through FP8 GEMMs (see the module docstring); bf16 output ``[..., out]``.
    ``layer``: the layer's :class:`Fp8Layer` (its scaling state and weight cache). Runs
    eagerly inside a compiled block (``train.compile``): the autograd function and the
    bookkeeping are Python state; the casts in it are kernels of their own. (The layers'
    compiled blocks call ``fp8_traced.fp8_linear_traced`` instead, which traces.)"""
    return fp8_linear_eager(x, weight, layer)
