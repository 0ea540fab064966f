// The per-element math of the FP8 cast operator dept_mega::cast_fp8, shared by the CPU kernel
// (csrc/cpu/ops_cpu.cpp) and the CUDA kernel (csrc/cuda/fp8_cast.cu) so both compute the same
// bytes as the reference math (dept_mega/parallel/fp8.py, _cast_math) and the Triton kernel
// (dept_mega/parallel/fp8_kernels.py, whose docstring states the semantics). Plain C++ that
// nvcc and g++ both compile; no torch headers.
//
// One element: y = x * scale in fp32, saturated to [-FP8_MAX, FP8_MAX] (NaN stays NaN),
// rounded to the FP8 grid (nearest, ties to even) in fp32 arithmetic by the Triton kernel's
// trick (y + 1.5 * 2^(23 + k) rounds y to a multiple of 2^k, k = max(exponent(y), EMIN) - MBITS;
// subtracting is exact), the sign of y kept (a negative value that rounds to zero is -0), then
// encoded into the FP8 byte by bit manipulation (exact: the value is on the grid).
//
// NaN: on the host a NaN byte is 0x7F with the sign of y, where y is what x86 arithmetic and so
// PyTorch's CPU kernels give (the NaN of x, or the scale's NaN when the scale is NaN: what
// `scaled.mul_(scale)` of _cast_math gives, checked against it bit for bit); on the GPU it is
// 0x7F, the canonical NaN the GPU's arithmetic and the Triton kernel's NaN-propagating
// clamp produce (unverified on a GPU: the gpu-marked test compares the bytes).
#pragma once

#include <stdint.h>

#include <cmath>
#include <cstring>

#ifdef __CUDACC__
#define DM_HD __host__ __device__ __forceinline__
#else
#define DM_HD inline
#endif

enum { DM_FP8_E4M3 = 0, DM_FP8_E5M2 = 1 };  // FP8 formats (float8_e4m3fn, float8_e5m2)

#define DM_FP8_MIN_AMAX 1e-12f  // current scaling: scale = FP8_MAX * (1 / max(amax, 1e-12))

// (largest value, mantissa bits, smallest normal exponent, exponent bias) of a format
typedef struct DmFp8Format {
  float fmax;
  int mbits;
  int emin;
  int bias;
} DmFp8Format;

DM_HD DmFp8Format dm_fp8_format(int fmt) {
  DmFp8Format f;
  if (fmt == DM_FP8_E4M3) {
    f.fmax = 448.0f; f.mbits = 3; f.emin = -6; f.bias = 7;
  } else {
    f.fmax = 57344.0f; f.mbits = 2; f.emin = -14; f.bias = 15;
  }
  return f;
}

DM_HD uint32_t dm_f2u(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

DM_HD float dm_u2f(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// |x| as the int whose order is the order of the magnitudes (non-negative floats order as
// their bits do; a NaN, its sign cleared, is above +inf): the amax is the int max of these,
// NaN propagating. Exact bit manipulation (no fabs whose NaN result could vary).
DM_HD int32_t dm_abs_bits(float x) { return static_cast<int32_t>(dm_f2u(x) & 0x7FFFFFFFu); }

// The scale of current scaling from the tensor's amax: FP8_MAX * (1 / max(amax, 1e-12)) with an
// IEEE (round-to-nearest) reciprocal, as PyTorch computes `FP8_MAX / amax.clamp(min=1e-12)`;
// a NaN amax gives a NaN scale.
DM_HD float dm_fp8_current_scale(float amax, float fmax) {
  const float a = (amax != amax) ? amax : (amax < DM_FP8_MIN_AMAX ? DM_FP8_MIN_AMAX : amax);
#ifdef __CUDA_ARCH__
  return __fdiv_rn(1.0f, a) * fmax;
#else
  return (1.0f / a) * fmax;
#endif
}

DM_HD float dm_reciprocal(float s) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(1.0f, s);
#else
  return 1.0f / s;
#endif
}

// The FP8 byte of x * scale (see the top of the file).
DM_HD uint8_t dm_fp8_cast_one(float x, float scale, const DmFp8Format& f) {
#ifdef __CUDA_ARCH__
  float y = __fmul_rn(x, scale);  // never contracted into an FMA with what follows
#else
  // both NaN: the scale's NaN, as PyTorch's CPU multiply gives (one NaN: that NaN, any order)
  float y = (scale != scale) ? scale : x * scale;
#endif
  y = y > f.fmax ? f.fmax : (y < -f.fmax ? -f.fmax : y);  // comparisons with NaN are false: NaN stays
  const uint32_t bits = dm_f2u(y);
  const uint32_t sign = (bits >> 24) & 0x80u;
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) {
#ifdef __CUDA_ARCH__
    return 0x7F;
#else
    return static_cast<uint8_t>(sign | 0x7Fu);
#endif
  }
  int e = static_cast<int>((bits >> 23) & 0xFFu) - 127;
  if (e < f.emin) e = f.emin;
  const float magic = dm_u2f((static_cast<uint32_t>(e - f.mbits + 23 + 127) << 23) | 0x400000u);
#ifdef __CUDA_ARCH__
  const float r = __fsub_rn(__fadd_rn(y, magic), magic);  // never contracted or reassociated
#else
  const float r = (y + magic) - magic;  // built with -ffp-contract=off, no fast-math
#endif
  const uint32_t a = dm_f2u(r) & 0x7FFFFFFFu;  // on the grid, |r| <= FP8_MAX
  if (a == 0) return static_cast<uint8_t>(sign);
  const int er = static_cast<int>(a >> 23) - 127;
  if (er >= f.emin) {
    return static_cast<uint8_t>(sign | (static_cast<uint32_t>(er + f.bias) << f.mbits) |
                                ((a & 0x7FFFFFu) >> (23 - f.mbits)));
  }
  // an FP8 subnormal m * 2^(emin - mbits): m = significand * 2^(er - 23 - emin + mbits), exact
  const uint32_t sig = (a & 0x7FFFFFu) | 0x800000u;
  return static_cast<uint8_t>(sign | (sig >> (23 - f.mbits + f.emin - er)));
}

// GELU, the erf form, in fp32 as PyTorch writes it (`(x * 0.5) * (1 + erf(x * M_SQRT1_2))`, opmath
// fp32): the prologue of cast_fp8(gelu=True). The caller rounds the result to the input's dtype
// (bf16 / fp16, nearest-even) before the cast and the amax. erff is the platform's (glibc's on the
// host, CUDA's on the device), so a value can differ from PyTorch's by an ulp where PyTorch's
// CPU kernel uses its own vectorised erf: the tests bound how often that changes an FP8 byte.
DM_HD float dm_gelu(float x) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(__fmul_rn(x, 0.5f), __fadd_rn(1.0f, erff(__fmul_rn(x, 0.70710678118654752f))));
#else
  return (x * 0.5f) * (1.0f + std::erf(x * 0.70710678118654752f));
#endif
}

// The GELU backward, the erf form, in fp32 as PyTorch's gelu_backward writes it (approximate='none',
// opmath fp32): dy * (cdf + x * pdf) with cdf = 0.5 * (1 + erf(x / sqrt(2))) and
// pdf = exp(-x^2 / 2) / sqrt(2 pi), the constants rounded to fp32 from double as PyTorch's. The
// prologue of dgelu_cast_fp8; the caller rounds the result to the gradient's dtype (bf16 / fp16,
// nearest-even): that value is the op's dH, and the cast and the amax are of it. erff / expf are the
// platform's: on the device CUDA's, as PyTorch's CUDA kernel calls them, whose `cdf + x * pdf` nvcc
// contracts into one FMA (PyTorch is built without --fmad=false; this source is built with it, so
// the FMA is written out); on the host glibc's without an FMA, where PyTorch's CPU kernel uses its
// own vectorised erf and exp: in GELU's negative tail, where cdf + x * pdf cancels, the results
// differ there (tests/test_fp8_dgelu_op.py bounds how often that changes a byte).
DM_HD float dm_dgelu(float dy, float x) {
  const float kAlpha = static_cast<float>(0.70710678118654752440);                // M_SQRT1_2
  const float kBeta = static_cast<float>(1.12837916709551257390 * 0.70710678118654752440 * 0.5);
#ifdef __CUDA_ARCH__
  const float cdf = __fmul_rn(0.5f, __fadd_rn(1.0f, erff(__fmul_rn(x, kAlpha))));
  const float pdf = __fmul_rn(expf(__fmul_rn(__fmul_rn(-0.5f, x), x)), kBeta);
  return __fmul_rn(dy, __fmaf_rn(x, pdf, cdf));
#else
  const float cdf = 0.5f * (1.0f + std::erf(x * kAlpha));
  const float pdf = kBeta * std::exp(x * x * -0.5f);
  return dy * (cdf + x * pdf);
#endif
}
