// CUDA kernel of dept_mega::dgelu_cast_fp8 behind dm_dgelu_cast_fp8 (kernels.h): the GELU backward
// of fc2's input (dh = gelu_backward(grad, x), csrc/fp8_cast.h's dm_dgelu, rounded to the input
// dtype) written out, and its FP8 cast with a delayed scale (the copies fc1's backward multiplies
// with), in one pass: grad and x read once, dh written once, never read again for its cast.
//
// UNVERIFIED on a GPU: CI compiles this file for sm_90 (tools/check_cuda_compile.sh) and runs it on
// the CPU through a host emulation of CUDA (tools/cuda_emu.py, tests/test_fp8_dgelu_op.py: its
// bytes equal the CPU kernel's there); the gpu-marked test compares it with aten::gelu_backward and
// the reference cast on the GPU.
//
// The tile is fp8_cast.cu's cast_kernel's (delayed scaling only), its code from the values on
// shared with it (fp8_tile.cuh: the cast, q's rows, q_t through a shared tile stored transposed):
// one block of kThreads threads per kTile x kTile tile of the padded output (blockIdx.x: row
// tiles, blockIdx.y: column tiles); a thread owns 4 consecutive rows x 8 columns: per row one
// 16-byte load of grad and one of x (eight loads in flight), one 16-byte store of dh and, for q,
// one 8-byte store; q_t through the shared tile, then 16-byte rows of q_t. The block's amax (of
// the rounded dh) is maxed into the slot by one atomicMax on the float's bits. Shapes that do not
// allow the vector accesses (cols % 8, (rows + pad) % 16, grad or x not 16-byte aligned) take the
// same kernel with scalar, bounds-checked accesses. Pad rows and lanes outside the tensor are
// zeros (cast to zero bytes).
#include "kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "../fp8_cast.h"
#include "fp8_device.cuh"
#include "fp8_tile.cuh"

namespace {

__device__ __forceinline__ __nv_bfloat16 from_f(float f, __nv_bfloat16) { return __float2bfloat16_rn(f); }
__device__ __forceinline__ __half from_f(float f, __half) { return __float2half_rn(f); }

template <typename T, int FMT, bool VEC, bool ROWWISE, bool COLWISE>
__global__ void __launch_bounds__(kThreads)
    dgelu_cast_kernel(const T* __restrict__ g, const T* __restrict__ x, T* __restrict__ dh,
                      uint8_t* __restrict__ q, uint8_t* __restrict__ qt, int64_t rows, int64_t cols,
                      int64_t out_rows, const float* __restrict__ scale_ptr, float* __restrict__ amax_slot) {
  __shared__ __align__(16) uint8_t tile[COLWISE ? kTile * kPitch : 4];
  __shared__ int32_t red[kThreads / 32];
  const float scale = __ldg(scale_ptr);
  const TileThread t = tile_thread();
  int32_t m = 0;  // the block's amax
  uint8_t b[kRowsPerThread][kColsPerThread];
  float v[kRowsPerThread][kColsPerThread];
  if (VEC) {  // the loads first: eight in flight
    uint4 pg[kRowsPerThread], px[kRowsPerThread];
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int64_t gr = t.row(i);
      if (gr < rows && t.gc < cols) {  // cols % 8 == 0: the 8 columns are all inside
        pg[i] = __ldg(reinterpret_cast<const uint4*>(g + gr * cols + t.gc));
        px[i] = __ldg(reinterpret_cast<const uint4*>(x + gr * cols + t.gc));
      } else {
        pg[i] = px[i] = make_uint4(0u, 0u, 0u, 0u);
      }
    }
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int64_t gr = t.row(i);
      const T* eg = reinterpret_cast<const T*>(&pg[i]);
      const T* ex = reinterpret_cast<const T*>(&px[i]);
      uint4 out;
      T* eo = reinterpret_cast<T*>(&out);
#pragma unroll
      for (int k = 0; k < kColsPerThread; ++k) {
        eo[k] = from_f(dm_dgelu(to_f(eg[k]), to_f(ex[k])), T{});  // zeros outside: dgelu(0, 0) = 0
        v[i][k] = to_f(eo[k]);
      }
      if (gr < rows && t.gc < cols) *reinterpret_cast<uint4*>(dh + gr * cols + t.gc) = out;
    }
  } else {
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int64_t gr = t.row(i);
#pragma unroll
      for (int k = 0; k < kColsPerThread; ++k) {
        v[i][k] = 0.0f;
        if (gr < rows && t.gc + k < cols) {
          const int64_t at = gr * cols + t.gc + k;
          const T d = from_f(dm_dgelu(to_f(g[at]), to_f(x[at])), T{});
          dh[at] = d;
          v[i][k] = to_f(d);
        }
      }
    }
  }
  tile_cast<FMT>(v, scale, b, m);
  if (ROWWISE) tile_store_rows<VEC>(b, q, t, cols, out_rows);
  if (COLWISE) tile_put_columns(b, tile, t);
  if (amax_slot != nullptr) {
    m = block_max<kThreads>(m, red);
    if (threadIdx.x == 0) atomicMax(reinterpret_cast<int*>(amax_slot), m);
  }
  if (COLWISE) {
    __syncthreads();
    tile_store_transposed<VEC>(tile, qt, t, cols, out_rows);
  }
}

template <typename T, int FMT, bool VEC>
cudaError_t launch_dgelu(const void* g, const void* x, void* dh, int64_t rows, int64_t cols, int64_t out_rows,
                         void* q, void* qt, const float* scale, float* amax, dim3 grid, cudaStream_t stream) {
  const T* gp = static_cast<const T*>(g);
  const T* xp = static_cast<const T*>(x);
  T* dp = static_cast<T*>(dh);
  uint8_t* qp = static_cast<uint8_t*>(q);
  uint8_t* qtp = static_cast<uint8_t*>(qt);
#define DM_DGELU(R, C) \
  dgelu_cast_kernel<T, FMT, VEC, R, C><<<grid, kThreads, 0, stream>>>(gp, xp, dp, qp, qtp, rows, cols, out_rows, scale, amax)
  if (q != nullptr && qt != nullptr) {
    DM_DGELU(true, true);
  } else if (qt != nullptr) {
    DM_DGELU(false, true);
  } else if (q != nullptr) {
    DM_DGELU(true, false);
  } else {  // no copy asked for: dh and the amax only
    DM_DGELU(false, false);
  }
#undef DM_DGELU
  return cudaGetLastError();
}

template <typename T>
cudaError_t dgelu_cast(const void* g, const void* x, void* dh, int64_t rows, int64_t cols, int64_t pad, int fmt,
                       void* q, void* qt, const float* scale, float* amax, cudaStream_t stream) {
  const int64_t out_rows = rows + pad;
  if (out_rows == 0 || cols == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((out_rows + kTile - 1) / kTile), static_cast<unsigned>((cols + kTile - 1) / kTile));
  const bool aligned = reinterpret_cast<uintptr_t>(g) % 16 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(dh) % 16 == 0;
  const bool vec = aligned && cols % 8 == 0 && out_rows % 16 == 0;
  if (fmt == DM_FP8_E4M3) {
    return vec ? launch_dgelu<T, DM_FP8_E4M3, true>(g, x, dh, rows, cols, out_rows, q, qt, scale, amax, grid, stream)
               : launch_dgelu<T, DM_FP8_E4M3, false>(g, x, dh, rows, cols, out_rows, q, qt, scale, amax, grid, stream);
  }
  return vec ? launch_dgelu<T, DM_FP8_E5M2, true>(g, x, dh, rows, cols, out_rows, q, qt, scale, amax, grid, stream)
             : launch_dgelu<T, DM_FP8_E5M2, false>(g, x, dh, rows, cols, out_rows, q, qt, scale, amax, grid, stream);
}

}  // namespace

extern "C" {

cudaError_t dm_dgelu_cast_fp8(const void* grad, const void* x, int dtype, void* dh, int64_t rows, int64_t cols,
                              int64_t pad, int fp8_format, void* q, void* qt, const float* scale, float* amax,
                              cudaStream_t stream) {
  if (dtype == DM_BFLOAT16)
    return dgelu_cast<__nv_bfloat16>(grad, x, dh, rows, cols, pad, fp8_format, q, qt, scale, amax, stream);
  if (dtype == DM_FLOAT16)
    return dgelu_cast<__half>(grad, x, dh, rows, cols, pad, fp8_format, q, qt, scale, amax, stream);
  return cudaErrorInvalidValue;
}

}  // extern "C"
