"""Which FP8 cast path an :class:`~dept_mega.parallel.fp8.Fp8State` runs (config key
``fp8_casts``), and the C++ cast operator ``dept_mega::cast_fp8``.

Paths (all give the bytes of the reference math ``fp8._cast_math``):

* ``torch``: ``_cast_math``, eager on CPU, compiled by inductor on CUDA.
* ``triton``: the Triton kernels of ``fp8_kernels.py``; CUDA (or Triton's interpreter).
* ``cuda``: :func:`cast_fp8` here, the custom operator of the ``dept_mega.ops`` extension
  (``csrc/cuda/fp8_cast.cu``; its CPU kernel in ``csrc/cpu/ops_cpu.cpp``, which the CPU tests
  compare with the reference bit for bit). Called through the PyTorch dispatcher, a cast costs
  the host a few µs, where Triton's Python launcher costs more (``benchmarks/fp8_host_bench.py``:
  ``triton_casts``). UNVERIFIED on a GPU so far: ``auto`` does not pick it.
* ``auto``: ``triton`` on CUDA when Triton imports, else ``torch``.

Under every path an fp32 input takes the reference math (``Fp8State.cast``), as the kernels
take bf16 and fp16 only.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import fp8_kernels
from .fp8_recipe import FP8_MAX

CAST_KERNELS = ("auto", "triton", "cuda", "torch")
_FORMATS = tuple(FP8_MAX)  # e4m3, e5m2
MAX_CUDA_COLS = 65535 * 64  # the CUDA kernel's grid: at most 65535 tiles of 64 columns (dm_fp8_max_cols)


def op_unavailable(device: torch.device | str) -> Optional[str]:
    """Why the ``cuda`` casts cannot run on ``device`` (None: they can)."""
    from ..ops import loader

    return loader.kernel_missing("dept_mega::cast_fp8", device)


def default_cast_kernels(device: torch.device | str) -> str:
    """Which casts an ``Fp8State`` on ``device`` runs by default (``auto``): ``triton`` (the
    kernels of ``fp8_kernels.py``) on CUDA when Triton imports, else ``torch`` (``_cast_math``)."""
    return "triton" if torch.device(device).type == "cuda" and fp8_kernels.AVAILABLE else "torch"


def default_graph_casts(kernels: str) -> str:
    """The casts inside compiled graphs for the config's ``fp8_casts`` (before ``auto`` is
    resolved): ``triton`` only where it is named (the Triton kernel as one operator per cast,
    ``fp8_cast_op.py``), else ``torch`` (inductor's casts from ``_cast_math``)."""
    return "triton" if kernels == "triton" else "torch"


def resolve_cast_kernels(kernels: str, device: torch.device | str) -> str:
    """``auto`` | ``triton`` | ``cuda`` | ``torch`` → the casts to run on ``device``;
    ``ValueError`` for a name it does not know and for a path that cannot run there."""
    device = torch.device(device)
    kernels = default_cast_kernels(device) if kernels == "auto" else kernels
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
    return kernels


def op():
    """The operator overload itself (``torch.ops.dept_mega.cast_fp8.default``): what
    ``Fp8State.cast`` calls, with arguments valid by construction (2-D bf16/fp16 tensors, its own
    fp32 scale and amax tensors); the overload skips the packet's resolution on every call."""
    return torch.ops.dept_mega.cast_fp8.default


def check_args(t, dtype, pad, scale, scale_index, amax_out, amax_index) -> None:
    """Raises what the operator's own checks raise (``csrc/common.h``, check_cast_fp8_args)."""
    if t.dim() != 2:
        raise ValueError(f"cast_fp8: takes a 2-D tensor, got shape {list(t.shape)}")
    if t.dtype not in fp8_kernels.INPUT_DTYPES:
        raise TypeError(f"cast_fp8: takes a bfloat16 or float16 tensor, got {str(t.dtype)[6:]}")
    if dtype not in _FORMATS:
        raise TypeError(f"cast_fp8: casts to float8_e4m3fn or float8_e5m2, got {str(dtype)[6:]}")
    if pad < 0:
        raise ValueError(f"cast_fp8: pad must be >= 0, got {pad}")
    if t.is_cuda and t.shape[1] > MAX_CUDA_COLS:
        raise ValueError(f"cast_fp8: at most {MAX_CUDA_COLS} columns on CUDA, got {t.shape[1]}")
    for name, s, i in (("scale", scale, scale_index), ("amax_out", amax_out, amax_index)):
        if s is None:
            continue
        if s.dtype != torch.float32:
            raise TypeError(f"cast_fp8: {name} must be float32, got {str(s.dtype)[6:]}")
        if not s.is_contiguous():
            raise ValueError(f"cast_fp8: {name} must be contiguous")
        if not 0 <= i < s.numel():
            raise ValueError(f"cast_fp8: {name} index {i} is out of range for {s.numel()} elements")
        if s.device != t.device:
            raise ValueError(f"cast_fp8: t is on {t.device} but {name} is on {s.device}")


def cast_fp8(t: torch.Tensor, dtype: torch.dtype, pad: int = 0, rowwise: bool = True, colwise: bool = False,
             scale: Optional[torch.Tensor] = None, scale_index: int = 0,
             amax_out: Optional[torch.Tensor] = None, amax_index: int = 0
             ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``fp8_kernels.cast_fp8`` (same arguments, same results, same bytes) through the C++
    operator: ``(q, q_t, inv)``, ``q`` ``[rows + pad, cols]`` when ``rowwise``, ``q_t``
    ``[cols, rows + pad]`` when ``colwise``, ``inv`` the 0-d ``1/scale`` under current scaling
    (``scale`` None; None under delayed scaling). ``amax_out[amax_index]`` is maxed with ``t``'s
    amax when given. The arguments are checked here first (:func:`check_args`: the operator's
    exceptions and messages), as a C++ exception from a CUDA op crashed the process on a GPU
    machine once (see ``dept_mega.ops``' docstring); the C++ checks stay as the last line."""
    check_args(t, dtype, pad, scale, scale_index, amax_out, amax_index)
    return op()(t, dtype, pad, rowwise, colwise, scale, scale_index, amax_out, amax_index)
