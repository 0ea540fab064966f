"""Which FP8 cast path an :class:`~dept_mega.parallel.fp8.Fp8State` runs (config key
``fp8_casts``), and the C++ cast operator ``dept_mega::cast_fp8``.

Paths (all give the bytes of the reference math ``fp8._cast_math``):

* ``torch``: ``_cast_math``, eager on CPU, compiled by inductor on CUDA.
* ``triton``: the Triton kernels of ``fp8_kernels.py``; CUDA (or Triton's interpreter).
* ``cuda``: :func:`cast_fp8` here, the custom operator of the ``dept_mega.ops`` extension
  (``csrc/cuda/fp8_cast.cu``; its CPU kernel in ``csrc/cpu/ops_cpu.cpp``, which the CPU tests
  compare with the reference bit for bit). Called through the PyTorch dispatcher, a cast costs
  the host a few µs, where Triton's Python launcher costs more (``benchmarks/fp8_host_bench.py``:
  ``triton_casts``). On an H200 (2026-11-28, docs/performance.md) its kernel is the fastest cast.
* ``auto``: on CUDA ``cuda`` where the operator runs (:func:`op_unavailable`, and no cast wider
  than :data:`MAX_CUDA_COLS` columns), else ``triton`` when Triton imports, else ``torch``; on
  the CPU ``torch`` (:func:`auto_cast_kernels`; the run log says why where it is not ``cuda``).
  The paths give the same bytes, so the choice changes the speed only (but with
  ``fp8_fused_casts: null`` the resolved path also decides which producers fuse on a GPU:
  ``model/fused_casts.py``).

Under every path an fp32 input takes the reference math (``Fp8State.cast``), as the kernels
take bf16 and fp16 only.

The fused operators of ``fp8_fused_casts`` (``model/fused_casts.py``) are here too:
:func:`cast_fp8` with ``gelu=True``, :func:`layernorm_cast_fp8` and :func:`dgelu_cast_fp8` (the GELU
backward and the FP8 cast of its result, fc1's output gradient: ``fp8_dgelu.py``).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import fp8_kernels
from .fp8_recipe import FP8_MAX

CAST_KERNELS = ("auto", "triton", "cuda", "torch")
_FORMATS = tuple(FP8_MAX)  # e4m3, e5m2
MAX_CUDA_COLS = 65535 * 64  # the CUDA kernel's grid: at most 65535 tiles of 64 columns (dm_fp8_max_cols)


# What this source's casts need of the extension: the operators, and the arguments added since
# they first appeared (an extension built from an older csrc/ lacks them: refused, not misused).
OPS = {"dept_mega::cast_fp8": ("gelu",), "dept_mega::layernorm_cast_fp8": (), "dept_mega::dgelu_cast_fp8": ()}


def op_unavailable(device: torch.device | str) -> Optional[str]:
    """Why the ``cuda`` casts (:func:`cast_fp8`, :func:`layernorm_cast_fp8`, :func:`dgelu_cast_fp8`) cannot run on
    ``device`` (None: they can)."""
    from ..ops import loader

    for name, args in OPS.items():
        if (why := loader.kernel_missing(name, device, args=args)) is not None:
            return why
    return None


def auto_cast_kernels(device: torch.device | str, max_cols: int = 0) -> tuple[str, Optional[str]]:
    """What ``fp8_casts: auto`` runs on ``device`` for casts of at most ``max_cols`` columns (the
    widest FP8 operand of the model; 0: not known), and, on CUDA where that is not ``cuda``, why
    not. CUDA: ``cuda`` (the C++ operator: the fastest cast measured, H200 2026-11-28) where it
    runs, else ``triton`` when Triton imports, else ``torch``; elsewhere ``torch`` (the C++
    operator's and Triton's interpreter's CPU kernels are for verification, not speed)."""
    device = torch.device(device)
    if device.type != "cuda":
        return "torch", None
    why = op_unavailable(device)
    if why is None and max_cols > MAX_CUDA_COLS:
        why = f"a cast of {max_cols} columns is wider than its CUDA kernel's {MAX_CUDA_COLS}"
    if why is None:
        return "cuda", None
    why = f"the C++ cast operator cannot run: {why}"
    return ("triton", why) if fp8_kernels.AVAILABLE else ("torch", why + "; Triton is not installed")


def default_cast_kernels(device: torch.device | str) -> str:
    """Which casts an ``Fp8State`` on ``device`` runs by default (``auto``): :func:`auto_cast_kernels`."""
    return auto_cast_kernels(device)[0]


def default_graph_casts(kernels: str) -> str:
    """The casts inside compiled graphs for the config's ``fp8_casts`` (before ``auto`` is
    resolved): ``triton`` only where it is named (the Triton kernel as one operator per cast,
    ``fp8_cast_op.py``), else ``torch`` (inductor's casts from ``_cast_math``)."""
    return "triton" if kernels == "triton" else "torch"


def resolve_cast_kernels(kernels: str, device: torch.device | str, max_cols: int = 0) -> str:
    """``auto`` | ``triton`` | ``cuda`` | ``torch`` → the casts to run on ``device`` for casts of at
    most ``max_cols`` columns (0: not known); ``ValueError`` for a name it does not know and for
    a path that cannot run there (``cuda`` on CUDA with a cast wider than its kernel takes: an
    error here rather than at the first cast)."""
    device = torch.device(device)
    kernels = auto_cast_kernels(device, max_cols)[0] if kernels == "auto" else kernels
    if kernels not in CAST_KERNELS[1:]:
        raise ValueError(f"FP8 cast kernels {kernels!r} are not one of {' | '.join(CAST_KERNELS)}")
    if kernels == "triton" and not fp8_kernels.AVAILABLE:
        raise ValueError("FP8 cast kernels 'triton' need Triton, which is not installed")
    if kernels == "triton" and device.type != "cuda" and not fp8_kernels.interpreted():
        raise ValueError(f"FP8 cast kernels 'triton' on {device.type} need Triton's interpreter "
                         f"(TRITON_INTERPRET=1)")
    if kernels == "cuda" and (why := op_unavailable(device)) is not None:
        raise ValueError(f"FP8 cast kernels 'cuda' (the C++ operator dept_mega::cast_fp8) cannot run on "
                         f"{device.type}: {why}")
    if kernels == "cuda" and device.type == "cuda" and max_cols > MAX_CUDA_COLS:
        raise ValueError(f"FP8 cast kernels 'cuda': a cast of {max_cols} columns is wider than the CUDA kernel's "
                         f"{MAX_CUDA_COLS} (use auto, triton or torch)")
    return kernels


def op():
    """The operator overload itself (``torch.ops.dept_mega.cast_fp8.default``): what
    ``Fp8State.cast`` calls, with arguments valid by construction (2-D bf16/fp16 tensors, its own
    fp32 scale and amax tensors); the overload skips the packet's resolution on every call."""
    return torch.ops.dept_mega.cast_fp8.default


def _name(dtype: torch.dtype) -> str:
    return str(dtype)[6:]  # torch.bfloat16 -> bfloat16, as csrc/common.h's dtype_name


def _check_input(t, op: str) -> None:
    """The input checks every cast operator makes first: a 2-D bf16 / fp16 tensor."""
    if t.dim() != 2:
        raise ValueError(f"{op}: takes a 2-D tensor, got shape {list(t.shape)}")
    if t.dtype not in fp8_kernels.INPUT_DTYPES:
        raise TypeError(f"{op}: takes a bfloat16 or float16 tensor, got {_name(t.dtype)}")


def check_args(t, dtype, pad, scale, scale_index, amax_out, amax_index, op: str = "cast_fp8") -> None:
    """Raises what the operator's own checks raise (``csrc/common.h``, check_cast_fp8_args);
    ``op``: the operator named in the messages."""
    x = {"cast_fp8": "t", "dgelu_cast_fp8": "grad"}.get(op, "x")
    _check_input(t, op)
    if dtype not in _FORMATS:
        raise TypeError(f"{op}: casts to float8_e4m3fn or float8_e5m2, got {_name(dtype)}")
    if pad < 0:
        raise ValueError(f"{op}: pad must be >= 0, got {pad}")
    if op != "layernorm_cast_fp8" and t.is_cuda and t.shape[1] > MAX_CUDA_COLS:
        raise ValueError(f"{op}: at most {MAX_CUDA_COLS} columns on CUDA, got {t.shape[1]}")
    for name, s, i in (("scale", scale, scale_index), ("amax_out", amax_out, amax_index)):
        if s is None:
            continue
        if s.dtype != torch.float32:
            raise TypeError(f"{op}: {name} must be float32, got {_name(s.dtype)}")
        if not s.is_contiguous():
            raise ValueError(f"{op}: {name} must be contiguous")
        if not 0 <= i < s.numel():
            raise ValueError(f"{op}: {name} index {i} is out of range for {s.numel()} elements")
        if s.device != t.device:
            raise ValueError(f"{op}: {x} is on {t.device} but {name} is on {s.device}")


def check_layernorm_args(x, weight, bias, dtype, pad, scale, scale_index, amax_out, amax_index) -> None:
    """Raises what the operator's own checks raise (``csrc/common.h``,
    check_layernorm_cast_fp8_args), in its order."""
    op = "layernorm_cast_fp8"
    _check_input(x, op)
    if x.shape[1] < 1:
        raise ValueError(f"{op}: takes a tensor of at least one column, got shape {list(x.shape)}")
    if scale is None:
        raise ValueError(f"{op}: needs a delayed scale (scale tensor); current scaling is not fused")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        if p.dim() != 1 or p.shape[0] != x.shape[1]:
            raise ValueError(f"{op}: {name} must have shape [{x.shape[1]}], got {list(p.shape)}")
        if p.dtype not in (x.dtype, torch.float32):
            raise TypeError(f"{op}: {name} must be float32 or the input's dtype ({_name(x.dtype)}), "
                            f"got {_name(p.dtype)}")
        if p.device != x.device:
            raise ValueError(f"{op}: x is on {x.device} but {name} is on {p.device}")
    if bias is not None and bias.dtype != weight.dtype:
        raise TypeError(f"{op}: bias must have weight's dtype ({_name(weight.dtype)}), got {_name(bias.dtype)}")
    check_args(x, dtype, pad, scale, scale_index, amax_out, amax_index, op=op)


def cast_fp8(t: torch.Tensor, dtype: torch.dtype, pad: int = 0, rowwise: bool = True, colwise: bool = False,
             scale: Optional[torch.Tensor] = None, scale_index: int = 0,
             amax_out: Optional[torch.Tensor] = None, amax_index: int = 0, gelu: bool = False
             ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``fp8_kernels.cast_fp8`` (same arguments, same results, same bytes) through the C++
    operator: ``(q, q_t, inv)``, ``q`` ``[rows + pad, cols]`` when ``rowwise``, ``q_t``
    ``[cols, rows + pad]`` when ``colwise``, ``inv`` the 0-d ``1/scale`` under current scaling
    (``scale`` None; None under delayed scaling). ``amax_out[amax_index]`` is maxed with ``t``'s
    amax when given. The arguments are checked here first (:func:`check_args`: the operator's
    exceptions and messages), as a C++ exception from a CUDA op crashed the process on a GPU
    machine once (see ``dept_mega.ops``' docstring); the C++ checks stay as the last line.

    ``gelu``: casts ``F.gelu(t)`` (the erf form, rounded to ``t``'s dtype) instead of ``t``, under
    both scalings (current scaling's amax is of those values too), as the reference
    ``fp8._cast_math(F.gelu(t), ...)``: the same bytes except where the kernel's erf and
    PyTorch's round GELU's fp32 value to different sides of a bf16/fp16 midpoint (rare; see
    tests/test_fp8_fused_op.py)."""
    check_args(t, dtype, pad, scale, scale_index, amax_out, amax_index)
    return op()(t, dtype, pad, rowwise, colwise, scale, scale_index, amax_out, amax_index, gelu)


def layernorm_op():
    """The overload ``torch.ops.dept_mega.layernorm_cast_fp8.default`` (arguments unchecked)."""
    return torch.ops.dept_mega.layernorm_cast_fp8.default


def layernorm_cast_fp8(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
                       dtype: torch.dtype, pad: int = 0, rowwise: bool = True, colwise: bool = False,
                       scale: Optional[torch.Tensor] = None, scale_index: int = 0,
                       amax_out: Optional[torch.Tensor] = None, amax_index: int = 0
                       ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """``F.layer_norm(x, (cols,), weight, bias, eps)`` (fp32 statistics, biased variance; rounded
    to ``x``'s dtype) cast to FP8 with the delayed scale ``scale[scale_index]`` (required:
    ``ValueError`` without), in one pass through the C++ operator ``dept_mega::layernorm_cast_fp8``:
    ``(q, q_t, mean, rstd)``. ``q`` / ``q_t`` as :func:`cast_fp8` (pad rows zero FP8, None when
    not asked for); ``amax_out[amax_index]`` is maxed with the normalised tensor's amax. ``mean``
    and ``rstd`` are ``[rows, 1]`` in the form ``aten::native_layer_norm_backward`` takes on the
    device (CPU: ``x``'s dtype; CUDA: float32). ``weight`` / ``bias`` (may be None): ``[cols]``,
    float32 or ``x``'s dtype. Arguments checked here first, as :func:`cast_fp8`'s."""
    check_layernorm_args(x, weight, bias, dtype, pad, scale, scale_index, amax_out, amax_index)
    return layernorm_op()(x, weight, bias, float(eps), dtype, pad, rowwise, colwise, scale, scale_index,
                          amax_out, amax_index)


def check_dgelu_args(grad, x, dtype, pad, scale, scale_index, amax_out, amax_index) -> None:
    """Raises what the operator's own checks raise (``csrc/common.h``, check_dgelu_cast_fp8_args),
    in its order."""
    op = "dgelu_cast_fp8"
    _check_input(grad, op)
    if x.shape != grad.shape:
        raise ValueError(f"{op}: x must have grad's shape {list(grad.shape)}, got {list(x.shape)}")
    if x.dtype != grad.dtype:
        raise TypeError(f"{op}: x must have grad's dtype ({_name(grad.dtype)}), got {_name(x.dtype)}")
    if x.device != grad.device:
        raise ValueError(f"{op}: grad is on {grad.device} but x is on {x.device}")
    if scale is None:
        raise ValueError(f"{op}: needs a delayed scale (scale tensor); current scaling is not fused")
    check_args(grad, dtype, pad, scale, scale_index, amax_out, amax_index, op=op)


def dgelu_op():
    """The overload ``torch.ops.dept_mega.dgelu_cast_fp8.default`` (arguments unchecked)."""
    return torch.ops.dept_mega.dgelu_cast_fp8.default


def dgelu_cast_fp8(grad: torch.Tensor, x: torch.Tensor, dtype: torch.dtype, pad: int = 0, rowwise: bool = True,
                   colwise: bool = False, scale: Optional[torch.Tensor] = None, scale_index: int = 0,
                   amax_out: Optional[torch.Tensor] = None, amax_index: int = 0
                   ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The GELU backward ``dh = aten.gelu_backward(grad, x)`` (the erf form, fp32, rounded to
    ``grad``'s dtype) and its FP8 cast with the delayed scale ``scale[scale_index]`` (required:
    ``ValueError`` without), in one pass through the C++ operator ``dept_mega::dgelu_cast_fp8``:
    ``(dh, q, q_t)``. ``dh`` [rows, cols] in ``grad``'s dtype; ``q`` / ``q_t`` as :func:`cast_fp8`'s
    of ``dh`` (pad rows zero FP8, None when not asked for); ``amax_out[amax_index]`` is maxed with
    ``dh``'s amax. ``x``: ``grad``'s shape, dtype and device. The same values as the composition,
    except where the kernel's erf / exp and PyTorch's round the fp32 result to different sides of a
    bf16/fp16 midpoint (GELU's negative tail; see tests/test_fp8_dgelu_op.py). Arguments checked
    here first, as :func:`cast_fp8`'s."""
    check_dgelu_args(grad, x, dtype, pad, scale, scale_index, amax_out, amax_index)
    return dgelu_op()(grad, x, dtype, pad, rowwise, colwise, scale, scale_index, amax_out, amax_index)
