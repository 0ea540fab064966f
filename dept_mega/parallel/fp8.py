"""Native FP8 GEMMs for the tensor-parallel linear layers (``backend: local`` + ``fp8``).

``fp8_linear(x, weight, recipe, history)`` computes ``x Wᵀ`` with ``torch._scaled_mm`` on FP8
operands with one scaling factor per tensor (Transformer Engine's per-tensor recipes, written
here without TE):

* forward: the input and the weight are cast to e4m3 (``x·s_x``, ``W·s_w``, saturated to ±448)
  and multiplied with fp32 accumulation; the output is bf16 (``scale_a = 1/s_x``,
  ``scale_b = 1/s_w`` undo the scaling inside the GEMM).
* backward: the output gradient is cast to e5m2 (``fp8: hybrid``; e4m3 with ``fp8: e4m3``);
  ``dX = dY·W`` and ``dW = dYᵀ·X`` reuse the FP8 input and weight saved by the forward (so
  the saved activations are 1 byte per element). Gradients are returned in the dtypes of
  ``x`` and ``weight``; the master weights are never touched (the optimizer keeps them).
* scaling factors: ``s = FP8_MAX / amax``. ``current`` scaling takes the amax of the tensor
  being cast (exact range, one extra reduction per cast); ``delayed`` scaling takes the
  largest amax of the last ``fp8_amax_history`` casts of that operand in that layer (TE's
  ``DelayedScaling`` with ``amax_compute_algo='max'``, margin 0) and records the current amax
  afterwards; a layer's first cast (empty history) uses its current amax. The history is a
  non-persistent buffer of the layer (3 × N: input, weight, grad-output): it is per rank
  (no amax reduction across ranks: every rank scales its own shards consistently), it is
  not checkpointed (a resumed run refills it), and activation recomputation saves and
  restores it so a recomputed forward casts exactly as the original one did.

``torch._scaled_mm`` wants its first operand row-major and its second column-major, and on
CUDA every dimension a multiple of 16. The feature dimensions are checked when the model is
built (``fp8_gemm_shape_ok``; a GEMM that fails stays bf16 and the run log says so); the
token dimension is zero-padded to a multiple of 16 when needed (zero rows change neither the
amax nor the product).

torchao's float8 training API was considered and not used: it converts ``nn.Linear`` modules
(``Float8Linear``), while our column/row-parallel layers own their weights and collectives;
using its internal autograd functions would tie us to private API, and its releases are
pinned to torch releases (we run 2.11 on GPUs and 2.13 on CPU).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
_MIN_AMAX = 1e-12  # an all-zero tensor gets a finite scale (its FP8 copy is zero anyway)
_ALIGN = 16  # cuBLASLt FP8 GEMMs need every dimension to be a multiple of 16
INPUT, WEIGHT, GRAD = 0, 1, 2  # rows of the amax history


@dataclass(frozen=True)
class Fp8Recipe:
    """``fmt``: hybrid (e4m3 forward, e5m2 gradients) | e4m3 (e4m3 everywhere);
    ``scaling``: current | delayed; ``amax_history``: delayed scaling's window."""
    fmt: str = "hybrid"
    scaling: str = "delayed"
    amax_history: int = 1024

    def __post_init__(self) -> None:
        if self.fmt not in ("hybrid", "e4m3"):
            raise ValueError(f"fp8 format {self.fmt!r} is not one of hybrid | e4m3")
        if self.scaling not in ("current", "delayed"):
            raise ValueError(f"fp8 scaling {self.scaling!r} is not one of current | delayed")
        if self.amax_history < 1:
            raise ValueError(f"fp8 amax history must be >= 1, got {self.amax_history}")

    @property
    def grad_dtype(self) -> torch.dtype:
        return E5M2 if self.fmt == "hybrid" else E4M3

    def describe(self) -> str:
        extra = f", amax history {self.amax_history}" if self.scaling == "delayed" else ""
        return f"{self.fmt}, {self.scaling} scaling{extra}"


def fp8_gemm_shape_ok(in_features: int, out_features: int) -> bool:
    """Whether a (per-rank) ``in × out`` weight can run the FP8 GEMMs (both multiples of 16)."""
    return in_features % _ALIGN == 0 and out_features % _ALIGN == 0


def new_amax_history(recipe: Fp8Recipe, device: torch.device | str) -> Optional[torch.Tensor]:
    """The per-layer buffer of delayed scaling (None for current scaling)."""
    if recipe.scaling != "delayed":
        return None
    return torch.zeros(3, recipe.amax_history, dtype=torch.float32, device=device)


def _amax(t: torch.Tensor) -> torch.Tensor:
    return t.detach().abs().amax().float()


def _scaling_amax(t: torch.Tensor, history: Optional[torch.Tensor], row: int) -> torch.Tensor:
    """The amax that sets this cast's scale; records the current amax in delayed scaling."""
    current = _amax(t)
    if history is None:
        return current
    past = history[row].amax()
    used = torch.where(past > 0, past, current)
    history[row] = torch.roll(history[row], 1)
    history[row, 0] = current
    return used


def quantize(t: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` scaled so that ``amax`` maps to the format's largest value, saturated, cast to
    ``dtype``; returns ``(fp8 tensor, 1/scale)`` (the factor that dequantises it)."""
    fmax = FP8_MAX[dtype]
    scale = fmax / amax.clamp(min=_MIN_AMAX)
    q = (t.float() * scale).clamp_(-fmax, fmax).to(dtype)
    return q, scale.reciprocal()


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    rows = t.shape[0]
    extra = (-rows) % _ALIGN
    if extra == 0:
        return t
    return torch.cat([t, t.new_zeros((extra,) + tuple(t.shape[1:]))], dim=0)


def _scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor) -> torch.Tensor:
    """``torch._scaled_mm`` with a bf16 output. On CPU it runs PyTorch's own kernel with oneDNN
    switched off for the call: oneDNN's FP8 GEMM took ~10 ms per call at our test sizes
    (~200× the reference kernel; torch 2.13, measured on the project VM)."""
    if a.device.type != "cpu":
        return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
    was = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
    finally:
        torch._C._set_mkldnn_enabled(was)


def _col_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix laid out column-major (what ``_scaled_mm`` wants as second operand)."""
    return t.t().contiguous().t()


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, recipe: Fp8Recipe,
                history: Optional[torch.Tensor]) -> torch.Tensor:
        out_features, in_features = weight.shape
        lead = x.shape[:-1]
        x2 = x.reshape(-1, in_features)
        rows = x2.shape[0]
        with torch.autocast(device_type=x.device.type, enabled=False):
            xq, x_inv = quantize(_pad_rows(x2), _scaling_amax(x2, history, INPUT), E4M3)
            wq, w_inv = quantize(weight, _scaling_amax(weight, history, WEIGHT), E4M3)
            y = _scaled_mm(xq, wq.t(), x_inv, w_inv)
        ctx.save_for_backward(xq, x_inv, wq, w_inv)
        ctx.meta = (recipe, history, rows, x.dtype, weight.dtype)
        return y[:rows].reshape(*lead, out_features)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        xq, x_inv, wq, w_inv = ctx.saved_tensors
        recipe, history, rows, x_dtype, w_dtype = ctx.meta
        out_features = wq.shape[0]
        g2 = grad_out.reshape(-1, out_features)
        grad_x = grad_w = None
        with torch.autocast(device_type=grad_out.device.type, enabled=False):
            gq, g_inv = quantize(_pad_rows(g2), _scaling_amax(g2, history, GRAD), recipe.grad_dtype)
            if ctx.needs_input_grad[0]:  # dX [M, in] = dY [M, out] · W [out, in]
                grad_x = _scaled_mm(gq, _col_major(wq), g_inv, w_inv)[:rows]
                grad_x = grad_x.reshape(*grad_out.shape[:-1], wq.shape[1]).to(x_dtype)
            if ctx.needs_input_grad[1]:  # dW [out, in] = dYᵀ [out, M] · X [M, in]
                grad_w = _scaled_mm(gq.t().contiguous(), _col_major(xq), g_inv, x_inv).to(w_dtype)
        return grad_x, grad_w, None, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, recipe: Fp8Recipe,
               history: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x Wᵀ`` through FP8 GEMMs (see the module docstring); bf16 output ``[..., out]``."""
    if recipe.scaling == "delayed" and history is None:
        raise ValueError("delayed FP8 scaling needs the layer's amax history (new_amax_history)")
    return _Fp8Linear.apply(x, weight, recipe, history)
