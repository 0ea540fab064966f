// Device helpers of the FP8 cast kernels (fp8_cast.cu: cast_fp8; layernorm_cast.cu:
// layernorm_cast_fp8; dgelu_cast.cu: dgelu_cast_fp8; fp8_tile.cuh, the tile two of them share):
// conversions, the two-element FP8 cast and the max reductions. Plain CUDA C++, no torch headers;
// internal linkage (each .cu gets its own copy).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "../fp8_cast.h"

namespace {

__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }

// f rounded to T (nearest, ties to even) and back: the value a T tensor holds.
__device__ __forceinline__ float round_as(float f, __nv_bfloat16) { return __bfloat162float(__float2bfloat16_rn(f)); }
__device__ __forceinline__ float round_as(float f, __half) { return __half2float(__float2half_rn(f)); }

// The value cast for an input element v (as fp32): v, or (GELU) GELU(v) rounded to T
// (csrc/fp8_cast.h, dm_gelu), what F.gelu(t) holds.
template <typename T, bool GELU>
__device__ __forceinline__ float prologue(float v) {
  if (GELU) return round_as(dm_gelu(v), T{});
  return v;
}

// The FP8 bytes of a * scale and b * scale (csrc/fp8_cast.h's dm_fp8_cast_one), a's in the low
// byte. From sm_89 one hardware conversion of the two products, cvt.rn.satfinite.{e4m3,e5m2}x2.f32,
// which rounds to the nearest FP8 value (ties to even) and saturates to ±FP8_MAX, a NaN giving
// the canonical NaN 0x7F: by IEEE semantics the bytes of the header's saturate-then-round
// arithmetic (the gpu-marked tests compare them with the reference and the Triton kernel bit for
// bit), in about a third of its instructions, which bound this kernel (SASS for sm_90: 2408
// instructions for a thread's 32 elements with the header's arithmetic, about 3/4 of them the
// per-element rounding and encoding; a copy of the same bytes needs far fewer).
template <int FMT>
__device__ __forceinline__ uint32_t cast2(float a, float b, float scale) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  return __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(a, scale), __fmul_rn(b, scale)), __NV_SATFINITE,
                                  FMT == DM_FP8_E4M3 ? __NV_E4M3 : __NV_E5M2);
#else
  const DmFp8Format f = dm_fp8_format(FMT);
  return dm_fp8_cast_one(a, scale, f) | (static_cast<uint32_t>(dm_fp8_cast_one(b, scale, f)) << 8);
#endif
}

__device__ __forceinline__ int32_t warp_max(int32_t v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The max over the block's threads (all threads call it; the result is valid in thread 0).
template <int THREADS>
__device__ __forceinline__ int32_t block_max(int32_t v, int32_t* smem) {
  v = warp_max(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
#pragma unroll
    for (int w = 1; w < THREADS / 32; ++w) v = max(v, smem[w]);
  }
  return v;
}

}  // namespace
