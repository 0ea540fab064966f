"""Runs CUDA kernels of ``csrc/cuda`` on the CPU through a host emulation of CUDA
(``tools/cuda_emu.h``: a std::thread per CUDA thread, barriers and warp shuffles emulated), to
check their indexing, synchronisation and arithmetic without a GPU: ``layernorm_cast_fp8``'s
(``layernorm_cast.cu``, ``tests/test_layernorm_cast_emulated.py``), ``dgelu_cast_fp8``'s
(``dgelu_cast.cu``, ``tests/test_fp8_dgelu_op.py``) and ``cast_fp8``'s (``fp8_cast.cu``, both
scalings, with and without GELU: ``tests/test_fp8_cuda_cast.py``). Not their speed, and not the
GPU's own erff / expf / rsqrtf and FP8 conversion instruction (the host's IEEE arithmetic and libm, and the
kernels' portable fallbacks instead).

A kernel source up to its launch code (the first function that uses ``<<<>>>``: a
:class:`KernelSource`'s ``cut``) is compiled with g++ (C++20) and the CUDA toolkit's headers
(``cuda_bf16.h``, ``cuda_fp8.h``), behind a launch (its ``driver``) that mirrors the source's
launches and its choice of the vectorised path.
"""
from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
LAYERNORM_SRC = ROOT / "csrc" / "cuda" / "layernorm_cast.cu"
DGELU_SRC = ROOT / "csrc" / "cuda" / "dgelu_cast.cu"
_CUT = "template <typename T, typename W, int FMT, bool VEC>\ncudaError_t launch_layout"
_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # csrc/cuda/kernels.h
_FP8 = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1}  # csrc/fp8_cast.h

# After the kernel (inside the source's anonymous namespace): the emulated launch; returns 1 when
# it took the vectorised path, 0 the scalar one, -1 for dtype codes it does not know.
_DRIVER = r"""
template <typename T, typename W, int FMT, bool VEC, bool COLWISE>
void emu_run(const void* x, const void* w, const void* b, int64_t rows, int64_t cols, int64_t out_rows,
             float eps, void* q, void* qt, const float* s, float* a, float* m, float* r) {
  const unsigned grid = static_cast<unsigned>((out_rows + kRows - 1) / kRows);
  emu_launch(grid, kThreads, [&] {
    layernorm_cast_kernel<T, W, FMT, VEC, COLWISE>(
        static_cast<const T*>(x), static_cast<const W*>(w), static_cast<const W*>(b), rows, cols, out_rows, eps,
        static_cast<uint8_t*>(q), static_cast<uint8_t*>(qt), s, a, m, r);
  });
}
template <typename T, typename W, int FMT>
void emu_layouts(bool vec, const void* x, const void* w, const void* b, int64_t rows, int64_t cols,
                 int64_t out_rows, float eps, void* q, void* qt, const float* s, float* a, float* m, float* r) {
  if (vec && qt) emu_run<T, W, FMT, true, true>(x, w, b, rows, cols, out_rows, eps, q, qt, s, a, m, r);
  if (vec && !qt) emu_run<T, W, FMT, true, false>(x, w, b, rows, cols, out_rows, eps, q, qt, s, a, m, r);
  if (!vec && qt) emu_run<T, W, FMT, false, true>(x, w, b, rows, cols, out_rows, eps, q, qt, s, a, m, r);
  if (!vec && !qt) emu_run<T, W, FMT, false, false>(x, w, b, rows, cols, out_rows, eps, q, qt, s, a, m, r);
}
template <typename T, typename W>
void emu_formats(int fmt, bool vec, const void* x, const void* w, const void* b, int64_t rows, int64_t cols,
                 int64_t out_rows, float eps, void* q, void* qt, const float* s, float* a, float* m, float* r) {
  if (fmt == DM_FP8_E4M3) emu_layouts<T, W, DM_FP8_E4M3>(vec, x, w, b, rows, cols, out_rows, eps, q, qt, s, a, m, r);
  else emu_layouts<T, W, DM_FP8_E5M2>(vec, x, w, b, rows, cols, out_rows, eps, q, qt, s, a, m, r);
}
}  // namespace

extern "C" int emu_layernorm_cast_fp8(const void* x, int x_dtype, const void* w, const void* b, int w_dtype,
                                      int64_t rows, int64_t cols, int64_t pad, float eps, int fmt, void* q,
                                      void* qt, const float* s, float* a, float* m, float* r) {
  const int64_t out_rows = rows + pad;
  // launch_typed's condition of the vectorised path
  const bool vec = reinterpret_cast<uintptr_t>(x) % 16 == 0 && cols % 8 == 0 && out_rows % 16 == 0;
  if (out_rows == 0) return vec;
  const bool same = w_dtype == x_dtype;
  if (x_dtype == DM_BFLOAT16 && same)
    emu_formats<__nv_bfloat16, __nv_bfloat16>(fmt, vec, x, w, b, rows, cols, out_rows, eps, q, qt, s, a, m, r);
  else if (x_dtype == DM_BFLOAT16 && w_dtype == DM_FLOAT32)
    emu_formats<__nv_bfloat16, float>(fmt, vec, x, w, b, rows, cols, out_rows, eps, q, qt, s, a, m, r);
  else if (x_dtype == DM_FLOAT16 && same)
    emu_formats<__half, __half>(fmt, vec, x, w, b, rows, cols, out_rows, eps, q, qt, s, a, m, r);
  else if (x_dtype == DM_FLOAT16 && w_dtype == DM_FLOAT32)
    emu_formats<__half, float>(fmt, vec, x, w, b, rows, cols, out_rows, eps, q, qt, s, a, m, r);
  else
    return -1;
  return vec;
}
"""


def cuda_include() -> Optional[Path]:
    """The CUDA toolkit's include folder (with cuda_bf16.h and cuda_fp8.h): CUDA_HOME's, the one
    next to nvcc on PATH, /usr/local/cuda's; None when there is none."""
    cands = [os.environ.get("CUDA_HOME")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        cands.append(str(Path(nvcc).resolve().parents[1]))
    cands.append("/usr/local/cuda")
    for c in cands:
        if c and (Path(c) / "include" / "cuda_fp8.h").is_file():
            return Path(c) / "include"
    return None


@dataclasses.dataclass(frozen=True)
class KernelSource:
    """A kernel source for the emulation: the library's ``name``, the ``src`` file, ``cut`` (the
    text that starts its launch code: the source is compiled up to there) and ``driver`` (C++
    after it, inside the source's anonymous namespace first: the emulated launch, ``extern "C"``)."""
    name: str
    src: Path
    cut: str
    driver: str


def build(out_dir: Path, kernel: KernelSource) -> Path:
    """Compiles the emulation of ``kernel`` into a shared library in ``out_dir`` (kept: the name
    carries the source's hash) and returns its path."""
    src = kernel.src
    text = src.read_text()
    if kernel.cut not in text:
        raise ValueError(f"{src}: no '{kernel.cut.splitlines()[-1]}' after the kernel: the emulation cuts the "
                         "source there (tools/cuda_emu.py)")
    inc = cuda_include()
    if inc is None:
        raise RuntimeError("tools/cuda_emu.py: the CUDA toolkit's headers (cuda_fp8.h) are not found "
                           "(CUDA_HOME, nvcc on PATH, /usr/local/cuda)")
    code = '#include "cuda_emu.h"\n#line 1 "' + str(src) + '"\n' + text[:text.index(kernel.cut)] + kernel.driver
    # the key covers the headers the kernel may include (its folder's and csrc/'s), not only its own text
    headers = sorted({*src.parent.glob("*.cuh"), *src.parent.glob("*.h"), *(ROOT / "csrc").glob("*.h"),
                      ROOT / "tools" / "cuda_emu.h"})
    digest = hashlib.sha256((code + "".join(h.read_text() for h in headers)).encode()).hexdigest()[:16]
    lib = Path(out_dir) / f"{kernel.name}_emu_{digest}.so"
    if lib.exists():
        return lib
    cpp = lib.with_suffix(".cpp")
    cpp.write_text(code)
    # -O0: the compile is most of an emulation test's time (each emulation's tests run a few small
    # launches), and on x86-64 (SSE arithmetic) with -ffp-contract=off the level changes no result
    cmd = [os.environ.get("CXX", "g++"), "-std=c++20", "-O0", "-ffp-contract=off", "-fPIC", "-shared", "-w",
           "-I", str(ROOT / "tools"), "-I", str(src.parent), "-I", str(inc), str(cpp), "-o", str(lib), "-lpthread"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"tools/cuda_emu.py: compiling the emulation failed:\n{' '.join(cmd)}\n{res.stderr}")
    return lib


LAYERNORM = KernelSource("layernorm_cast", LAYERNORM_SRC, _CUT, _DRIVER)


def build_layernorm_cast(out_dir: Path, src: Path = LAYERNORM_SRC) -> Path:
    """:func:`build` of ``layernorm_cast.cu``'s kernel (or of ``src``, a variant of it)."""
    return build(out_dir, dataclasses.replace(LAYERNORM, src=src))


def _ptr(t, index=0):
    return None if t is None else t.data_ptr() + index * t.element_size()


def _unwritten(*shape, dtype=torch.float32) -> torch.Tensor:
    """An output buffer (the operator's ``torch.empty``) with every byte 0x5A, so that an element
    the kernel leaves unwritten shows as a difference (fresh ``torch.empty`` memory is often zeros,
    the value of pad rows)."""
    t = torch.empty(*shape, dtype=dtype)
    t.view(torch.uint8).fill_(0x5A)
    return t


def _check_cpu(*tensors) -> None:
    for t in tensors:
        if t is not None and (t.device.type != "cpu" or not t.is_contiguous()):
            raise ValueError("the emulated kernel takes contiguous CPU tensors")


class LayerNormCast:
    """``layernorm_cast_fp8`` through the emulated kernel: CPU tensors in, the CUDA operator's
    outputs (q, q_t, mean and rstd float32 [rows, 1]) out, and ``vec``: whether the launch took
    the vectorised path."""

    def __init__(self, lib: Path):
        self._f = ctypes.CDLL(str(lib)).emu_layernorm_cast_fp8
        p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        self._f.argtypes = [p, i, p, p, i, i64, i64, i64, ctypes.c_float, i, p, p, p, p, p, p]
        self._f.restype = i

    def __call__(self, x, weight, bias, eps, dtype, pad=0, rowwise=True, colwise=False, scale=None, scale_index=0,
                 amax_out=None, amax_index=0):
        """As ``fp8_casts.layernorm_cast_fp8`` (x, weight, bias contiguous: their addresses are
        the kernel's, alignment included); returns (q, q_t, mean, rstd, vec)."""
        _check_cpu(x, weight, bias, scale, amax_out)
        rows, cols = x.shape
        out_rows = rows + pad
        q = _unwritten(out_rows, cols, dtype=dtype) if rowwise else None
        qt = _unwritten(cols, out_rows, dtype=dtype) if colwise else None
        mean = _unwritten(rows, 1)
        rstd = _unwritten(rows, 1)
        ptr = _ptr
        vec = self._f(ptr(x), _CODES[x.dtype], ptr(weight), ptr(bias), _CODES[weight.dtype], rows, cols, pad, eps,
                      _FP8[dtype], ptr(q), ptr(qt), ptr(scale, scale_index), ptr(amax_out, amax_index), ptr(mean),
                      ptr(rstd))
        if vec < 0:
            raise TypeError(f"the emulated kernel takes no x {x.dtype} with weight {weight.dtype}")
        return q, qt, mean, rstd, bool(vec)


# dgelu_cast.cu: after the kernel, the emulated launch (as dgelu_cast's); returns 1 when it took the
# vectorised path, 0 the scalar one, -1 for a dtype code it does not know.
_DGELU_CUT = "template <typename T, int FMT, bool VEC>\ncudaError_t launch_dgelu"
_DGELU_DRIVER = r"""
template <typename T, int FMT, bool VEC, bool R, bool C>
void emu_run(const void* g, const void* x, void* dh, int64_t rows, int64_t cols, int64_t out_rows, void* q,
             void* qt, const float* s, float* a) {
  const EmuDim3 grid{static_cast<unsigned>((out_rows + kTile - 1) / kTile),
                     static_cast<unsigned>((cols + kTile - 1) / kTile), 1};
  emu_launch(grid, kThreads, [&] {
    dgelu_cast_kernel<T, FMT, VEC, R, C>(static_cast<const T*>(g), static_cast<const T*>(x), static_cast<T*>(dh),
                                         static_cast<uint8_t*>(q), static_cast<uint8_t*>(qt), rows, cols,
                                         out_rows, s, a);
  });
}
template <typename T, int FMT, bool VEC>
void emu_layouts(const void* g, const void* x, void* dh, int64_t rows, int64_t cols, int64_t out_rows, void* q,
                 void* qt, const float* s, float* a) {
  if (q && qt) emu_run<T, FMT, VEC, true, true>(g, x, dh, rows, cols, out_rows, q, qt, s, a);
  if (!q && qt) emu_run<T, FMT, VEC, false, true>(g, x, dh, rows, cols, out_rows, q, qt, s, a);
  if (q && !qt) emu_run<T, FMT, VEC, true, false>(g, x, dh, rows, cols, out_rows, q, qt, s, a);
  if (!q && !qt) emu_run<T, FMT, VEC, false, false>(g, x, dh, rows, cols, out_rows, q, qt, s, a);
}
template <typename T>
void emu_formats(int fmt, bool vec, const void* g, const void* x, void* dh, int64_t rows, int64_t cols,
                 int64_t out_rows, void* q, void* qt, const float* s, float* a) {
  if (fmt == DM_FP8_E4M3 && vec) emu_layouts<T, DM_FP8_E4M3, true>(g, x, dh, rows, cols, out_rows, q, qt, s, a);
  if (fmt == DM_FP8_E4M3 && !vec) emu_layouts<T, DM_FP8_E4M3, false>(g, x, dh, rows, cols, out_rows, q, qt, s, a);
  if (fmt != DM_FP8_E4M3 && vec) emu_layouts<T, DM_FP8_E5M2, true>(g, x, dh, rows, cols, out_rows, q, qt, s, a);
  if (fmt != DM_FP8_E4M3 && !vec) emu_layouts<T, DM_FP8_E5M2, false>(g, x, dh, rows, cols, out_rows, q, qt, s, a);
}
}  // namespace

extern "C" int emu_dgelu_cast_fp8(const void* g, const void* x, int dtype, void* dh, int64_t rows, int64_t cols,
                                  int64_t pad, int fmt, void* q, void* qt, const float* s, float* a) {
  const int64_t out_rows = rows + pad;
  // dgelu_cast's condition of the vectorised path
  const bool aligned = reinterpret_cast<uintptr_t>(g) % 16 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(dh) % 16 == 0;
  const bool vec = aligned && cols % 8 == 0 && out_rows % 16 == 0;
  if (out_rows == 0 || cols == 0) return vec;
  if (dtype == DM_BFLOAT16) emu_formats<__nv_bfloat16>(fmt, vec, g, x, dh, rows, cols, out_rows, q, qt, s, a);
  else if (dtype == DM_FLOAT16) emu_formats<__half>(fmt, vec, g, x, dh, rows, cols, out_rows, q, qt, s, a);
  else return -1;
  return vec;
}
"""
DGELU = KernelSource("dgelu_cast", DGELU_SRC, _DGELU_CUT, _DGELU_DRIVER)


class DgeluCast:
    """``dgelu_cast_fp8`` through the emulated kernel (``lib``: :func:`build` of :data:`DGELU`): CPU
    tensors in, the CUDA operator's outputs (dh, q, q_t) out, and ``vec``: whether the launch took
    the vectorised path."""

    def __init__(self, lib: Path):
        self._f = ctypes.CDLL(str(lib)).emu_dgelu_cast_fp8
        p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        self._f.argtypes = [p, p, i, p, i64, i64, i64, i, p, p, p, p]
        self._f.restype = i

    def __call__(self, grad, x, dtype, pad=0, rowwise=True, colwise=False, scale=None, scale_index=0,
                 amax_out=None, amax_index=0):
        """As ``fp8_casts.dgelu_cast_fp8`` (grad, x contiguous: their addresses are the kernel's,
        alignment included; ``scale`` required); returns (dh, q, q_t, vec)."""
        _check_cpu(grad, x, scale, amax_out)
        if scale is None:
            raise ValueError("the emulated dgelu_cast_fp8 needs a delayed scale")
        rows, cols = grad.shape
        out_rows = rows + pad
        dh = _unwritten(rows, cols, dtype=grad.dtype)
        q = _unwritten(out_rows, cols, dtype=dtype) if rowwise else None
        qt = _unwritten(cols, out_rows, dtype=dtype) if colwise else None
        vec = self._f(_ptr(grad), _ptr(x), _CODES[grad.dtype], _ptr(dh), rows, cols, pad, _FP8[dtype], _ptr(q),
                      _ptr(qt), _ptr(scale, scale_index), _ptr(amax_out, amax_index))
        if vec < 0:
            raise TypeError(f"the emulated kernel takes no {grad.dtype}")
        return dh, q, qt, bool(vec)


# fp8_cast.cu: after the kernels, the emulated launches (as fp8_cast's: current scaling's partial
# maxima first, then the cast); returns 1 when the cast took the vectorised path, 0 the scalar one,
# -1 for a dtype code it does not know.
_CAST_CUT = "template <typename T, int FMT, bool VEC, bool GELU>\ncudaError_t launch_cast"
_CAST_DRIVER = r"""
template <typename T, int FMT, bool VEC, bool R, bool C, bool GELU>
void emu_run(EmuDim3 grid, const void* x, int64_t rows, int64_t cols, int64_t out_rows, void* q, void* qt,
             const float* s, float* inv, const int32_t* parts, int nparts, float* a) {
  emu_launch(grid, kThreads, [&] {
    cast_kernel<T, FMT, VEC, R, C, GELU>(static_cast<const T*>(x), static_cast<uint8_t*>(q),
                                         static_cast<uint8_t*>(qt), rows, cols, out_rows, s, inv, parts, nparts, a);
  });
}
template <typename T, int FMT, bool VEC, bool GELU>
void emu_layouts(EmuDim3 grid, const void* x, int64_t rows, int64_t cols, int64_t out_rows, void* q, void* qt,
                 const float* s, float* inv, const int32_t* parts, int nparts, float* a) {
  if (q && qt) emu_run<T, FMT, VEC, true, true, GELU>(grid, x, rows, cols, out_rows, q, qt, s, inv, parts, nparts, a);
  if (!q && qt) emu_run<T, FMT, VEC, false, true, GELU>(grid, x, rows, cols, out_rows, q, qt, s, inv, parts, nparts, a);
  if (q && !qt) emu_run<T, FMT, VEC, true, false, GELU>(grid, x, rows, cols, out_rows, q, qt, s, inv, parts, nparts, a);
  if (!q && !qt) emu_run<T, FMT, VEC, false, false, GELU>(grid, x, rows, cols, out_rows, q, qt, s, inv, parts, nparts, a);
}
template <typename T, int FMT>
void emu_variants(bool vec, bool gelu, EmuDim3 grid, const void* x, int64_t rows, int64_t cols, int64_t out_rows,
                  void* q, void* qt, const float* s, float* inv, const int32_t* parts, int nparts, float* a) {
#define EMU_LAYOUTS(V, G) emu_layouts<T, FMT, V, G>(grid, x, rows, cols, out_rows, q, qt, s, inv, parts, nparts, a)
  if (vec && gelu) EMU_LAYOUTS(true, true);
  if (vec && !gelu) EMU_LAYOUTS(true, false);
  if (!vec && gelu) EMU_LAYOUTS(false, true);
  if (!vec && !gelu) EMU_LAYOUTS(false, false);
#undef EMU_LAYOUTS
}
template <typename T>
int emu_cast(const void* x, int64_t rows, int64_t cols, int64_t pad, int fmt, void* q, void* qt, const float* s,
             float* inv, float* a, bool gelu) {
  const int64_t out_rows = rows + pad, n = rows * cols;
  const bool aligned = reinterpret_cast<uintptr_t>(x) % 16 == 0;
  std::vector<int32_t> parts;
  if (s == nullptr) {  // dm_fp8_amax_parts(n) partial maxima; a NaN's bits in each until its block writes it
    const int64_t np = (n + kPartElems - 1) / kPartElems;
    parts.assign(np < 1 ? 1 : (np > kMaxParts ? kMaxParts : np), 0x7FC00000);
    int32_t* p = parts.data();
    emu_launch(static_cast<unsigned>(parts.size()), kAmaxThreads, [&] {
      if (gelu) amax_parts_kernel<T, true>(static_cast<const T*>(x), n, aligned, p);
      else amax_parts_kernel<T, false>(static_cast<const T*>(x), n, aligned, p);
    });
  }
  // fp8_cast's grid (at least one block) and its condition of the vectorised path
  const EmuDim3 grid{static_cast<unsigned>(out_rows > 0 ? (out_rows + kTile - 1) / kTile : 1),
                     static_cast<unsigned>(cols > 0 ? (cols + kTile - 1) / kTile : 1), 1};
  const bool vec = aligned && cols % 8 == 0 && out_rows % 16 == 0;
  const int32_t* p = parts.data();
  const int np = static_cast<int>(parts.size());
  if (fmt == DM_FP8_E4M3) emu_variants<T, DM_FP8_E4M3>(vec, gelu, grid, x, rows, cols, out_rows, q, qt, s, inv, p, np, a);
  else emu_variants<T, DM_FP8_E5M2>(vec, gelu, grid, x, rows, cols, out_rows, q, qt, s, inv, p, np, a);
  return vec;
}
}  // namespace

extern "C" int emu_cast_fp8(const void* x, int dtype, int64_t rows, int64_t cols, int64_t pad, int fmt, void* q,
                            void* qt, const float* s, float* inv, float* a, int gelu) {
  if (dtype == DM_BFLOAT16) return emu_cast<__nv_bfloat16>(x, rows, cols, pad, fmt, q, qt, s, inv, a, gelu != 0);
  if (dtype == DM_FLOAT16) return emu_cast<__half>(x, rows, cols, pad, fmt, q, qt, s, inv, a, gelu != 0);
  return -1;
}
"""
CAST = KernelSource("fp8_cast", ROOT / "csrc" / "cuda" / "fp8_cast.cu", _CAST_CUT, _CAST_DRIVER)


class Fp8Cast:
    """``cast_fp8`` through the emulated kernels (``lib``: :func:`build` of :data:`CAST`): CPU tensors
    in, the CUDA operator's outputs (q, q_t, inv) out, and ``vec``: whether the cast took the
    vectorised path."""

    def __init__(self, lib: Path):
        self._f = ctypes.CDLL(str(lib)).emu_cast_fp8
        p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        self._f.argtypes = [p, i, i64, i64, i64, i, p, p, p, p, p, i]
        self._f.restype = i

    def __call__(self, t, dtype, pad=0, rowwise=True, colwise=False, scale=None, scale_index=0, amax_out=None,
                 amax_index=0, gelu=False):
        """As ``fp8_casts.cast_fp8`` (``t`` contiguous: its address is the kernel's, alignment
        included); returns (q, q_t, inv, vec), ``inv`` the 0-d 1/scale of current scaling (``scale``
        None), else None."""
        _check_cpu(t, scale, amax_out)
        rows, cols = t.shape
        out_rows = rows + pad
        q = _unwritten(out_rows, cols, dtype=dtype) if rowwise else None
        qt = _unwritten(cols, out_rows, dtype=dtype) if colwise else None
        inv = torch.full((), float("nan")) if scale is None else None
        vec = self._f(_ptr(t), _CODES[t.dtype], rows, cols, pad, _FP8[dtype], _ptr(q), _ptr(qt),
                      _ptr(scale, scale_index), _ptr(inv), _ptr(amax_out, amax_index), int(gelu))
        if vec < 0:
            raise TypeError(f"the emulated kernel takes no {t.dtype}")
        return q, qt, inv, bool(vec)
