"""Which GEMM the native FP8 linears run (config key ``fp8_gemm``), and the C++ operator
``dept_mega::fp8_gemm`` behind ``cublaslt``.

* ``torch``: ``torch._scaled_mm`` (``fp8._scaled_mm``). Every GEMM writes a new bf16 tensor; the
  weight gradient is a bf16 dW, which ``GradBuffer.add_grad`` then copies or adds into the fp32
  ``main_grad`` (one more kernel per weight and micro-batch: 438 per step of the 1B model, 15 ms
  of a 465 ms step on an H200), and ``_scaled_mm`` sets up cuBLASLt's descriptors and asks its
  heuristic on every call.
* ``cublaslt``: the operator :func:`fp8_gemm` (``csrc/cuda/fp8_gemm_lt.cpp``: cuBLASLt called
  directly, the algorithm cached per problem; on the CPU ``csrc/cpu/ops_cpu.cpp``: PyTorch's CPU
  ``_scaled_mm`` with an fp32 output). The forward and input-gradient GEMMs return bf16 as
  ``torch`` does (the same bytes on the CPU; on a GPU cuBLASLt may pick another algorithm than
  ``_scaled_mm`` did: another summation order). The weight-gradient GEMM of a training step
  (the weight's gradient buffer active) accumulates into ``main_grad`` in the GEMM itself, in
  fp32 (beta = 1, in place; the step's first micro-batch overwrites: beta = 0), as the bf16
  layers' gradient-accumulation fusion does (``wgrad.py``): no bf16 dW, no separate add, and the
  gradient is not rounded to bf16 first (slightly different, more precise, numbers). A
  ``main_grad`` that the GEMM cannot write (not 16-byte aligned: a gradient buffer whose earlier
  parameters' sizes or data-parallel padding shift it; a dtype other than fp32 / bf16) takes the
  bf16 dW and the add, as ``torch`` (warned once). Outside a step autograd gets a bf16 dW.
  With the C++ casts and fused casts the fastest FP8 run measured (H200, 2026-11-28).
* ``auto`` (:func:`auto_gemm`): ``cublaslt`` where the operator runs on the device (CUDA), the
  FP8 linears run eagerly (no ``train.compile``), ``optim.grad_accum_fusion`` is on (the GEMM's
  accumulation into ``main_grad`` is that fusion for the FP8 GEMMs: off, the user asked for the
  bf16 dW and the add) and the gradient buffer is fp32 (``optim.grad_dtype``: the GEMM's
  accumulation into a bf16 buffer has not run on a GPU); otherwise ``torch``, and the run log
  says why.

Under ``train.compile`` the FP8 GEMMs are traced into the compiled blocks (``fp8_traced.py``) with
``torch._scaled_mm``; ``cublaslt`` applies to the eager FP8 linears (the config refuses an
explicit ``cublaslt`` with ``train.compile`` rather than ignore the key; ``auto`` is ``torch`` there).
"""
from __future__ import annotations

import functools
import warnings
from typing import Optional

import torch

from ..config_schema import FP8_GEMM_MAX_TUNING
from .fp8_recipe import FP8_MAX

GEMMS = ("auto", "torch", "cublaslt")
ALIGN = 16  # cuBLASLt FP8 GEMMs need every dimension to be a multiple of 16
PTR_ALIGN = 16  # ... and every operand and scale pointer 16-byte aligned
_FP8 = tuple(FP8_MAX)  # e4m3, e5m2
_OUT = (torch.float32, torch.bfloat16)


def check_layout(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor) -> None:
    """The layout rule of cuBLASLt's FP8 GEMM for ``a · b`` (``a`` row-major, ``b`` column-major,
    every dimension a multiple of 16, every pointer, the scales' included, 16-byte aligned: a
    scale that is element i of a packed float32 vector makes cuBLASLt answer
    CUBLAS_STATUS_NOT_SUPPORTED, H200, torch 2.11), checked before every FP8 GEMM on every device
    (the CPU kernels accept any layout), so the CPU tests hold the operands to it. A few integer
    operations (the pointers OR-ed together: 16 is a power of two); the names of what failed are
    worked out only for the error."""
    m, k = a.shape
    n = b.shape[1]
    if a.stride(1) != 1 or b.stride(0) != 1 or (m % ALIGN or k % ALIGN or n % ALIGN):
        raise ValueError(f"FP8 GEMM operands {tuple(a.shape)} strides {a.stride()} × {tuple(b.shape)} strides "
                         f"{b.stride()}: need a row-major first and a column-major second operand, sizes "
                         f"multiples of {ALIGN}")
    if (a.data_ptr() | b.data_ptr() | scale_a.data_ptr() | scale_b.data_ptr()) % PTR_ALIGN:
        misaligned = [name for name, t in (("a", a), ("b", b), ("scale_a", scale_a), ("scale_b", scale_b))
                      if t.data_ptr() % PTR_ALIGN]
        raise ValueError(f"FP8 GEMM: {', '.join(misaligned)} not {PTR_ALIGN}-byte aligned (a view at an "
                         f"offset into a larger tensor?); cuBLASLt rejects it")


def op_unavailable(device: torch.device | str) -> Optional[str]:
    """Why ``fp8_gemm: cublaslt`` cannot run on ``device`` (None: it can)."""
    from ..ops import loader

    return loader.kernel_missing("dept_mega::fp8_gemm", device, "its CUDA kernels and cuBLASLt's headers "
                                 "(build/dept_mega_ops_build.log says whether they were found)", args=("tune",))


def auto_gemm(device: torch.device | str, compile: bool = False, grad_accum_fusion: bool = True,
              grad_dtype: str = "fp32") -> tuple[str, Optional[str]]:
    """What ``fp8_gemm: auto`` runs on ``device`` (the module docstring) and, on CUDA where that is
    not ``cublaslt``, why not (None elsewhere: the CPU's kernels are for verification)."""
    device = torch.device(device)
    if device.type != "cuda":
        return "torch", None
    why = ("train.compile traces the FP8 GEMMs with torch._scaled_mm" if compile else
           "optim.grad_accum_fusion is off (cuBLASLt would accumulate the weight gradients in the GEMM)"
           if not grad_accum_fusion else
           f"optim.grad_dtype {grad_dtype}: the GEMM's accumulation into a {grad_dtype} buffer is not verified on a GPU"
           if grad_dtype != "fp32" else op_unavailable(device))
    return ("cublaslt", None) if why is None else ("torch", f"cuBLASLt: {why}")


def resolve_gemm(gemm: str, device: torch.device | str, compile: bool = False, grad_accum_fusion: bool = True,
                 grad_dtype: str = "fp32") -> str:
    """``auto`` | ``torch`` | ``cublaslt`` → the GEMM to run on ``device`` (``auto``:
    :func:`auto_gemm` with the run's ``train.compile``, ``optim.grad_accum_fusion`` and
    ``optim.grad_dtype``); ``ValueError`` for a name it does not know and for ``cublaslt``
    where the operator has no kernel for ``device``."""
    if gemm not in GEMMS:
        raise ValueError(f"FP8 GEMM {gemm!r} is not one of {' | '.join(GEMMS)}")
    if gemm == "auto":
        return auto_gemm(device, compile, grad_accum_fusion, grad_dtype)[0]
    if gemm == "cublaslt" and (why := op_unavailable(device)) is not None:
        raise ValueError(f"FP8 GEMM 'cublaslt' (the C++ operator dept_mega::fp8_gemm) cannot run on "
                         f"{torch.device(device).type}: {why}")
    return gemm


def op():
    """The operator overload itself (``torch.ops.dept_mega.fp8_gemm.default``): what the FP8 linear
    calls, with operands valid by construction and :func:`check_layout` checked."""
    return torch.ops.dept_mega.fp8_gemm.default


def direct_op(fn):
    """``fn`` itself, or for an operator overload (``torch.ops.ns.name.default``) the C++ callable
    its ``__call__`` forwards to (``OpOverload._op``): the same dispatch (modes, autograd, kernels),
    one Python frame less per call (~0.3 µs). Resolve once, call many times."""
    return getattr(fn, "_op", fn) if isinstance(fn, torch._ops.OpOverload) else fn


def _shape(t: torch.Tensor) -> str:
    return f"[{', '.join(str(s) for s in t.shape)}]"


def _strides(t: torch.Tensor) -> str:
    return f"[{', '.join(str(s) for s in t.stride())}]"


def check_args(a, b, scale_a, scale_b, out=None, first=False, tune=0) -> None:
    """Raises what the operator's own checks raise (``csrc/fp8_gemm.h``), in the same order with
    the same messages: a C++ exception from a CUDA op once crashed the process on a GPU machine
    (``dept_mega.ops``' docstring), so :func:`fp8_gemm` checks here first."""
    op_name = "fp8_gemm"
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"{op_name}: a and b must be 2-D, got shapes {_shape(a)} and {_shape(b)}")
    if a.dtype not in _FP8 or b.dtype not in _FP8:
        raise TypeError(f"{op_name}: a and b must be float8_e4m3fn or float8_e5m2, got {str(a.dtype)[6:]} and "
                        f"{str(b.dtype)[6:]}")
    if a.dtype == b.dtype == torch.float8_e5m2:
        raise TypeError(f"{op_name}: float8_e5m2 x float8_e5m2 has no FP8 GEMM (one operand must be float8_e4m3fn)")
    m, k = a.shape
    n = b.shape[1]
    if b.shape[0] != k:
        raise ValueError(f"{op_name}: a {_shape(a)} and b {_shape(b)} cannot be multiplied")
    if m % ALIGN or k % ALIGN or n % ALIGN:
        raise ValueError(f"{op_name}: m, k, n must be multiples of {ALIGN}, got {m}, {k}, {n}")
    if a.stride(1) != 1 or a.stride(0) < k or a.stride(0) % ALIGN:
        raise ValueError(f"{op_name}: a must be row-major (strides [ld, 1], ld >= k and a multiple of 16), got "
                         f"strides {_strides(a)}")
    if b.stride(0) != 1 or b.stride(1) < k or b.stride(1) % ALIGN:
        raise ValueError(f"{op_name}: b must be column-major (strides [1, ld], ld >= k and a multiple of 16; e.g. "
                         f"the .t() of a row-major [n, k] tensor), got strides {_strides(b)}")
    for name, s in (("scale_a", scale_a), ("scale_b", scale_b)):
        if s.dtype != torch.float32:
            raise TypeError(f"{op_name}: {name} must be float32, got {str(s.dtype)[6:]}")
        if s.numel() != 1:
            raise ValueError(f"{op_name}: {name} must have one element (per-tensor scaling), got shape {_shape(s)}")
        if s.device != a.device:
            raise ValueError(f"{op_name}: a is on {a.device} but {name} is on {s.device}")
    if b.device != a.device:
        raise ValueError(f"{op_name}: a is on {a.device} but b is on {b.device}")
    if out is None and first:
        raise ValueError(f"{op_name}: first=True (overwrite) needs an out tensor to write into")
    if out is not None:
        if out.dtype not in _OUT:
            raise TypeError(f"{op_name}: out must be float32 or bfloat16, got {str(out.dtype)[6:]}")
        if out.dim() != 2 or tuple(out.shape) != (m, n):
            raise ValueError(f"{op_name}: out must have shape [{m}, {n}], got {_shape(out)}")
        if not out.is_contiguous():
            raise ValueError(f"{op_name}: out must be contiguous (row-major), got strides {_strides(out)}")
        if out.device != a.device:
            raise ValueError(f"{op_name}: a is on {a.device} but out is on {out.device}")
    if not 0 <= tune <= FP8_GEMM_MAX_TUNING:
        raise ValueError(f"{op_name}: tune must be between 0 and {FP8_GEMM_MAX_TUNING} (the algorithms to time), "
                         f"got {tune}")
    for name, t in (("a", a), ("b", b), ("scale_a", scale_a), ("scale_b", scale_b), ("out", out)):
        if t is not None and t.data_ptr() % PTR_ALIGN:
            raise ValueError(f"{op_name}: {name} is not {PTR_ALIGN}-byte aligned (a view at an offset into a larger "
                             f"tensor?); cuBLASLt rejects it")


def fp8_gemm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
             use_fast_accum: bool = False, out: Optional[torch.Tensor] = None,
             first: bool = False, tune: int = 0) -> Optional[torch.Tensor]:
    """``scale_a · scale_b · (a · b)`` through ``dept_mega::fp8_gemm``, arguments checked first
    (:func:`check_args`). ``a`` FP8 ``[m, k]`` row-major, ``b`` FP8 ``[k, n]`` column-major, the
    scales 1-element fp32 tensors (``torch._scaled_mm``'s rule and meaning). ``out`` None: returns
    a new bf16 ``[m, n]`` tensor. ``out`` an fp32 or bf16 ``[m, n]`` contiguous tensor: adds the
    product into it in place (``first``: overwrites it) and returns None. ``tune`` > 1: on a
    problem's first call time that many of cuBLASLt's candidate algorithms and keep the fastest
    (:func:`tuning_log`; the CPU kernel ignores it)."""
    check_args(a, b, scale_a, scale_b, out, first, tune)
    return op()(a, b, scale_a, scale_b, use_fast_accum, out, first, tune)


def bound_op(tune: int = 0):
    """The operator as the FP8 linears call it (:func:`direct_op` of :func:`op`), with ``tune``
    (config key ``fp8_gemm_tuning``) bound when it asks for timing (> 1): the calls pass only the
    arguments they need."""
    gemm = direct_op(op())
    return functools.partial(gemm, tune=tune) if tune > 1 else gemm


def tuning_log(clear: bool = False) -> list[dict]:
    """What ``fp8_gemm(tune > 1)`` tuned in this process, one dict per problem, in order: ``m``,
    ``n``, ``k``, the dtypes (``a``, ``b``, ``out``), ``accumulate``, ``fast_accum``, ``how``
    (``timed``, or why not), ``ms`` (each candidate in the heuristic's order; None: it did not
    run), ``algo_ids``, ``tile_ids`` (cuBLASLt's) and ``chosen`` (the index kept: 0 unless another
    was at least 2 % faster). Empty on the CPU and without the extension."""
    import json

    from ..ops import loader

    if not loader.status().loaded or not hasattr(torch.ops.dept_mega, "fp8_gemm_tuning_log"):
        return []
    return [json.loads(line) for line in torch.ops.dept_mega.fp8_gemm_tuning_log(clear)]


def describe_tuning(rows: list[dict]) -> str:
    """One line for the run log: per tuned problem its shape, the heuristic's first and the kept
    algorithm's time, and the step's total gain."""
    if not rows:
        return "fp8_gemm_tuning: no problem tuned"
    parts, first_ms, kept_ms = [], 0.0, 0.0
    for r in rows:
        ms = r["ms"]
        if r["how"] != "timed" or ms[0] is None:
            parts.append(f"{r['m']}x{r['n']}x{r['k']}: {r['how']}")
            continue
        kept = ms[r["chosen"]]
        first_ms, kept_ms = first_ms + ms[0], kept_ms + kept
        acc = " acc" if r["accumulate"] else ""
        parts.append(f"{r['m']}x{r['n']}x{r['k']}{acc} #{r['chosen']} of {len(ms)} {kept:.3f} ms "
                     f"(first {ms[0]:.3f})")
    gain = f"; kept {kept_ms:.3f} ms against the heuristic's first {first_ms:.3f} ms" if first_ms else ""
    return f"fp8_gemm_tuning: {len(rows)} problems tuned{gain}: " + "; ".join(parts)


def lt_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
          fast: bool = False) -> torch.Tensor:
    """``fp8._scaled_mm`` through the operator: the same checks (:func:`check_layout`), a bf16 result."""
    check_layout(a, b, scale_a, scale_b)
    return op()(a, b, scale_a, scale_b, fast, None, False)


def lt_mm_via(gemm):
    """:func:`lt_mm` with the operator ``gemm`` (``op()``, through :func:`direct_op`) bound once:
    what an ``Fp8State`` with ``cublaslt`` runs for every forward and input-gradient GEMM."""
    def lt_mm_bound(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                    fast: bool = False) -> torch.Tensor:
        check_layout(a, b, scale_a, scale_b)
        # out=None, first=False: the schema's defaults, left out (each argument passed costs the
        # operator's Python binding ~0.15 µs)
        return gemm(a, b, scale_a, scale_b, fast)
    return lt_mm_bound


@functools.lru_cache(maxsize=None)
def _warn_once(why: str) -> None:
    warnings.warn(f"fp8_gemm: cublaslt: {why}: those weight gradients go through a bf16 dW and an add instead",
                  stacklevel=3)


def accumulate_wgrad(owner, p: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                     scale_b: torch.Tensor, fast: bool, gemm=None) -> bool:
    """The weight gradient ``a · b`` (scaled) of ``p`` accumulated into ``p.main_grad`` by the GEMM
    itself, through ``owner.arrive`` (``GradBuffer``: the step's bookkeeping; the step's first
    micro-batch overwrites). False, nothing done, when ``main_grad`` cannot be the GEMM's output
    (the caller then takes the bf16 dW path). ``gemm``: the operator (None: ``op()``)."""
    mg = p.main_grad
    if mg.dtype not in _OUT or not mg.is_contiguous() or mg.data_ptr() % PTR_ALIGN:
        _warn_once(f"a main_grad that is {str(mg.dtype)[6:]}, {'' if mg.is_contiguous() else 'not '}contiguous, "
                   f"at an address {mg.data_ptr() % PTR_ALIGN} bytes past 16-byte alignment")
        return False
    check_layout(a, b, scale_a, scale_b)
    first = owner.is_first(p)
    if gemm is None:
        gemm = op()
    owner.arrive(p, lambda main: gemm(a, b, scale_a, scale_b, fast, main, first))
    return True
