// CUDA kernels of the FP8 cast operator dept_mega::cast_fp8 behind dm_fp8_cast (kernels.h).
// The per-element bytes are csrc/fp8_cast.h's (those of fp8._cast_math and the Triton kernel),
// computed from sm_89 by the hardware conversion (cast2, fp8_device.cuh).
//
// Verified on an H200 (2026-11-28, docs/performance.md): the gpu-marked test
// (tests/test_fp8_cuda_cast.py) gives the Triton kernel's and the reference's bytes bit for bit;
// 83-87 % of a copy's bandwidth at the 1B model's shapes (benchmarks/fp8_cast_bench.py). Its tile
// code, since moved into fp8_tile.cuh, compiles to the same sm_90 SASS. CI compiles this file for
// sm_90 (tools/check_cuda_compile.sh) and runs it on the CPU through a host emulation of CUDA
// (tools/cuda_emu.py, tests/test_fp8_cuda_cast.py: its bytes equal the CPU kernel's there).
//
// cast_kernel: fp8_tile.cuh's tile (shared with dgelu_cast.cu): one block of kThreads threads per
//   kTile x kTile tile of the padded output (blockIdx.x: row tiles, blockIdx.y: column tiles). A
//   thread owns 4 consecutive rows x 8 columns: per row one 16-byte load of 8 bf16/fp16 (eight
//   lanes read a 128-byte row segment) and, for q, one 8-byte store. For q_t the thread packs its
//   4 rows' bytes of each column into a 32-bit word of a shared tile stored transposed
//   ([column][row], pitch kPitch bytes: at most 2-way bank conflicts); after a barrier each thread
//   stores 16-byte rows of q_t (four lanes write a 64-byte segment of one q_t row), so both outputs
//   are written coalesced. Shapes that do not allow the vector accesses (cols % 8, (rows + pad) %
//   16, a misaligned input) take the same kernel with scalar, bounds-checked accesses.
//   Delayed scaling: the scale is read on the device; with an amax slot, the block's amax
//   (warp shuffles, then one atomicMax on the float's bits per block: non-negative floats order
//   as ints, and a NaN, sign cleared, is above +inf, so it propagates) is maxed into it.
//   Current scaling: amax_parts_kernel first writes one partial maximum per block (at most
//   kMaxParts); every cast block reduces them (one warp) and computes the scale; block (0, 0)
//   writes 1/scale and records the amax. No host synchronisation anywhere.
// gelu (a template argument, so the plain cast is the same code as without it): every loaded
//   element becomes GELU(x) rounded to the input dtype (dm_gelu) before the amax and the cast,
//   in both kernels; the zeros of padding and out-of-range lanes stay zeros.
// Indexing is int64; the grid limits the columns to 65535 tiles (checked by the operator).
#include "kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "../fp8_cast.h"
#include "fp8_device.cuh"
#include "fp8_tile.cuh"

namespace {

constexpr int kMaxParts = 256;            // partial maxima of current scaling
constexpr int64_t kPartElems = 8192;      // elements per partial (at least)
constexpr int kAmaxThreads = 256;

// parts[blockIdx.x] = max |x| over a grid-stride share of the n elements (as dm_abs_bits).
template <typename T, bool GELU>
__global__ void __launch_bounds__(kAmaxThreads)
    amax_parts_kernel(const T* __restrict__ x, int64_t n, bool vec, int32_t* __restrict__ parts) {
  __shared__ int32_t smem[kAmaxThreads / 32];
  int32_t m = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kAmaxThreads;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kAmaxThreads + threadIdx.x;
  int64_t tail = 0;
  if (vec) {  // 16-byte loads of 8 elements, then the last n % 8 one by one
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    const int64_t nv = n / 8;
    for (int64_t i = first; i < nv; i += stride) {
      const uint4 p = __ldg(xv + i);
      const T* e = reinterpret_cast<const T*>(&p);
#pragma unroll
      for (int k = 0; k < 8; ++k) m = max(m, dm_abs_bits(prologue<T, GELU>(to_f(e[k]))));
    }
    tail = nv * 8;
  }
  for (int64_t i = tail + first; i < n; i += stride) m = max(m, dm_abs_bits(prologue<T, GELU>(to_f(x[i]))));
  m = block_max<kAmaxThreads>(m, smem);
  if (threadIdx.x == 0) parts[blockIdx.x] = m;
}

template <typename T, int FMT, bool VEC, bool ROWWISE, bool COLWISE, bool GELU>
__global__ void __launch_bounds__(kThreads)
    cast_kernel(const T* __restrict__ x, uint8_t* __restrict__ q, uint8_t* __restrict__ qt,
                int64_t rows, int64_t cols, int64_t out_rows,
                const float* __restrict__ scale_ptr, float* __restrict__ inv,
                const int32_t* __restrict__ parts, int nparts, float* __restrict__ amax_slot) {
  __shared__ __align__(16) uint8_t tile[COLWISE ? kTile * kPitch : 4];
  __shared__ int32_t red[kThreads / 32];
  __shared__ float s_scale;
  const DmFp8Format fmt = dm_fp8_format(FMT);  // constants: the format is a template argument
  const bool current = scale_ptr == nullptr;
  float scale;
  if (current) {  // reduce the partial maxima (one warp), the scale from their max
    if (threadIdx.x < 32) {
      int32_t m = 0;
      for (int i = threadIdx.x; i < nparts; i += 32) m = max(m, parts[i]);
      m = warp_max(m);
      if (threadIdx.x == 0) {
        const float amax = dm_u2f(static_cast<uint32_t>(m));
        const float s = dm_fp8_current_scale(amax, fmt.fmax);
        s_scale = s;
        if (blockIdx.x == 0 && blockIdx.y == 0) {
          *inv = dm_reciprocal(s);
          if (amax_slot != nullptr) atomicMax(reinterpret_cast<int*>(amax_slot), m);
        }
      }
    }
    __syncthreads();
    scale = s_scale;
  } else {
    scale = __ldg(scale_ptr);
  }

  const TileThread t = tile_thread();
  int32_t m = 0;  // the block's amax (delayed scaling with a slot)
  uint8_t b[kRowsPerThread][kColsPerThread];
  float v[kRowsPerThread][kColsPerThread];
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {  // the loads first: four in flight
    const int64_t gr = t.row(i);
    if (VEC) {
      if (gr < rows && t.gc < cols) {  // cols % 8 == 0: the 8 columns are all inside
        const uint4 p = __ldg(reinterpret_cast<const uint4*>(x + gr * cols + t.gc));
        const T* e = reinterpret_cast<const T*>(&p);
#pragma unroll
        for (int k = 0; k < kColsPerThread; ++k) v[i][k] = to_f(e[k]);
      } else {
#pragma unroll
        for (int k = 0; k < kColsPerThread; ++k) v[i][k] = 0.0f;
      }
    } else {
#pragma unroll
      for (int k = 0; k < kColsPerThread; ++k)
        v[i][k] = (gr < rows && t.gc + k < cols) ? to_f(x[gr * cols + t.gc + k]) : 0.0f;
    }
  }
  if (GELU) {  // GELU(0) = 0: the zeros outside stay zeros
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
#pragma unroll
      for (int k = 0; k < kColsPerThread; ++k) v[i][k] = prologue<T, true>(v[i][k]);
    }
  }
  tile_cast<FMT>(v, scale, b, m);
  if (ROWWISE) tile_store_rows<VEC>(b, q, t, cols, out_rows);
  if (COLWISE) tile_put_columns(b, tile, t);
  if (amax_slot != nullptr && !current) {
    m = block_max<kThreads>(m, red);
    if (threadIdx.x == 0) atomicMax(reinterpret_cast<int*>(amax_slot), m);
  }
  if (COLWISE) {
    __syncthreads();
    tile_store_transposed<VEC>(tile, qt, t, cols, out_rows);
  }
}

template <typename T, int FMT, bool VEC, bool GELU>
cudaError_t launch_cast(const void* x, int64_t rows, int64_t cols, int64_t out_rows, void* q,
                        void* qt, const float* scale, float* inv, const int32_t* parts, int nparts,
                        float* amax, dim3 grid, cudaStream_t stream) {
  const T* xp = static_cast<const T*>(x);
  uint8_t* qp = static_cast<uint8_t*>(q);
  uint8_t* qtp = static_cast<uint8_t*>(qt);
  if (q != nullptr && qt != nullptr) {
    cast_kernel<T, FMT, VEC, true, true, GELU><<<grid, kThreads, 0, stream>>>(
        xp, qp, qtp, rows, cols, out_rows, scale, inv, parts, nparts, amax);
  } else if (qt != nullptr) {
    cast_kernel<T, FMT, VEC, false, true, GELU><<<grid, kThreads, 0, stream>>>(
        xp, qp, qtp, rows, cols, out_rows, scale, inv, parts, nparts, amax);
  } else if (q != nullptr) {
    cast_kernel<T, FMT, VEC, true, false, GELU><<<grid, kThreads, 0, stream>>>(
        xp, qp, qtp, rows, cols, out_rows, scale, inv, parts, nparts, amax);
  } else {  // no copy asked for: the amax and 1/scale only
    cast_kernel<T, FMT, VEC, false, false, GELU><<<grid, kThreads, 0, stream>>>(
        xp, qp, qtp, rows, cols, out_rows, scale, inv, parts, nparts, amax);
  }
  return cudaGetLastError();
}

template <typename T, int FMT>
cudaError_t launch_format(bool vec, bool gelu, const void* x, int64_t rows, int64_t cols, int64_t out_rows,
                          void* q, void* qt, const float* scale, float* inv, const int32_t* parts,
                          int nparts, float* amax, dim3 grid, cudaStream_t stream) {
#define DM_LAUNCH(V, G) launch_cast<T, FMT, V, G>(x, rows, cols, out_rows, q, qt, scale, inv, parts, nparts, amax, grid, stream)
  if (gelu) return vec ? DM_LAUNCH(true, true) : DM_LAUNCH(false, true);
  return vec ? DM_LAUNCH(true, false) : DM_LAUNCH(false, false);
#undef DM_LAUNCH
}

template <typename T>
cudaError_t fp8_cast(const void* x, int64_t rows, int64_t cols, int64_t pad, int fmt, void* q,
                     void* qt, const float* scale, float* inv, void* parts, float* amax, bool gelu,
                     cudaStream_t stream) {
  const int64_t out_rows = rows + pad, n = rows * cols;
  const bool aligned = reinterpret_cast<uintptr_t>(x) % 16 == 0;
  int nparts = 0;
  if (scale == nullptr) {
    nparts = dm_fp8_amax_parts(n);
    if (gelu) {
      amax_parts_kernel<T, true><<<nparts, kAmaxThreads, 0, stream>>>(static_cast<const T*>(x), n, aligned,
                                                                      static_cast<int32_t*>(parts));
    } else {
      amax_parts_kernel<T, false><<<nparts, kAmaxThreads, 0, stream>>>(static_cast<const T*>(x), n, aligned,
                                                                       static_cast<int32_t*>(parts));
    }
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  // at least one block: a current-scaled cast of an empty tensor still writes 1/scale
  const dim3 grid(static_cast<unsigned>(out_rows > 0 ? (out_rows + kTile - 1) / kTile : 1),
                  static_cast<unsigned>(cols > 0 ? (cols + kTile - 1) / kTile : 1));
  const bool vec = aligned && cols % 8 == 0 && out_rows % 16 == 0;
  const int32_t* p = static_cast<const int32_t*>(parts);
  return fmt == DM_FP8_E4M3
             ? launch_format<T, DM_FP8_E4M3>(vec, gelu, x, rows, cols, out_rows, q, qt, scale, inv, p, nparts, amax, grid, stream)
             : launch_format<T, DM_FP8_E5M2>(vec, gelu, x, rows, cols, out_rows, q, qt, scale, inv, p, nparts, amax, grid, stream);
}

}  // namespace

extern "C" {

int dm_fp8_amax_parts(int64_t n) {
  const int64_t parts = (n + kPartElems - 1) / kPartElems;
  return static_cast<int>(parts < 1 ? 1 : (parts > kMaxParts ? kMaxParts : parts));
}

int64_t dm_fp8_max_cols(void) { return int64_t{65535} * kTile; }

cudaError_t dm_fp8_cast(const void* x, int x_dtype, int64_t rows, int64_t cols, int64_t pad,
                        int fp8_format, void* q, void* qt, const float* scale, float* inv,
                        void* parts, float* amax, int gelu, cudaStream_t stream) {
  if (x_dtype == DM_BFLOAT16)
    return fp8_cast<__nv_bfloat16>(x, rows, cols, pad, fp8_format, q, qt, scale, inv, parts, amax, gelu != 0, stream);
  if (x_dtype == DM_FLOAT16)
    return fp8_cast<__half>(x, rows, cols, pad, fp8_format, q, qt, scale, inv, parts, amax, gelu != 0, stream);
  return cudaErrorInvalidValue;
}

}  // extern "C"
