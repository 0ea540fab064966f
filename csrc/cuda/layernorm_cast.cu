// CUDA kernel of dept_mega::layernorm_cast_fp8 behind dm_layernorm_cast_fp8 (kernels.h): the
// LayerNorm of a linear's input fused with its FP8 cast (delayed scaling), so the normalised
// bf16/fp16 tensor is never written to memory. Semantics: csrc/registration.cpp; the CPU kernel
// (csrc/cpu/ops_cpu.cpp) and the reference (F.layer_norm, then fp8._cast_math) compute the same
// values up to a rounding of the statistics (the tests bound how often an FP8 byte differs).
//
// UNVERIFIED on a GPU when written: tests/test_fp8_fused_op.py's gpu test compares it with the
// reference and the CPU kernel.
//
// One block of kThreads (8 warps) per kRows = 32 rows of the padded output (blockIdx.x).
// 1. Statistics: warp w takes rows 4w .. 4w + 3; its lanes read a row (16-byte loads of 8
//    elements when aligned) and keep a Welford triple (count, mean, M2), merging the exact
//    two-pass statistics of each 8-element chunk (Chan's formula); the warp's triples merge by
//    shuffles into lane 0, which writes mean and rstd = rsqrtf(M2 / cols + eps) (PyTorch's CUDA
//    kernel also uses rsqrt) to shared memory and to the outputs. One read of the row.
// 2. Column tiles of 256: a thread owns 4 rows (its warp's) x 8 columns (its lane's), loads
//    them (16 bytes per row; the L2 still holds them from step 1), computes
//    y = w * (rstd * (x - mean)) + b (one FMA, as PyTorch's CUDA kernel compiles it), rounds it
//    to the input dtype, takes the amax and casts pairs to FP8 (cast2). q: one 8-byte store per
//    row (a warp writes 256 contiguous bytes of a row). q_t: the thread's 4 rows of a column
//    are one 32-bit word of a shared tile [256 columns][8 words], the word index XOR-swizzled
//    by the column's lane (at most 4-way bank conflicts on the stores); after a barrier each
//    thread stores two 16-byte halves of q_t rows (32 bytes per q_t row and block).
// Pad rows (rows .. rows + pad - 1) are zeros cast (0 * scale). The block's amax (warp
// shuffles, then one atomicMax on the float's bits) is maxed into *amax. Shapes that do not
// allow the vector accesses (cols % 8, (rows + pad) % 16, a misaligned x) take scalar,
// bounds-checked accesses. No data errors are possible (no ids), so nothing is recorded; the
// operator's arguments are checked in Python and again in csrc/common.h.
#include "kernels.h"

#include "../fp8_cast.h"
#include "fp8_device.cuh"

namespace {

constexpr int kRows = 32;                         // rows per block
constexpr int kThreads = 256;                     // 8 warps
constexpr int kWarps = kThreads / 32;
constexpr int kRowsPerThread = kRows / kWarps;    // 4: a warp's rows, in both steps
constexpr int kColsPerThread = 8;
constexpr int kTileCols = 32 * kColsPerThread;    // 256 columns per tile
constexpr int kWords = kRows / 4;                 // 32-bit words per column of the q_t tile

static_assert(kRowsPerThread == 4, "a q_t tile word holds a thread's 4 rows");

__device__ __forceinline__ float to_f(float v) { return v; }

// A Welford triple: count, mean, sum of squared deviations.
struct Moments {
  float n, mean, m2;
};

// a = a ∪ b (Chan et al.); b.n may be 0.
__device__ __forceinline__ void merge(Moments& a, const Moments& b) {
  const float n = a.n + b.n;
  if (b.n == 0.0f) return;
  const float delta = b.mean - a.mean;
  const float f = __fdiv_rn(b.n, n);
  a.mean = a.mean + delta * f;
  a.m2 = a.m2 + b.m2 + delta * delta * a.n * f;
  a.n = n;
}

// The exact-ish moments of 8 values (two passes over registers).
__device__ __forceinline__ Moments chunk_moments(const float* v) {
  float s = 0.0f;
#pragma unroll
  for (int k = 0; k < 8; ++k) s += v[k];
  const float mean = s * 0.125f;
  float m2 = 0.0f;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const float d = v[k] - mean;
    m2 += d * d;
  }
  return {8.0f, mean, m2};
}

template <typename T>
__device__ __forceinline__ void load8(const T* p, float* v) {
  const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int k = 0; k < 8; ++k) v[k] = to_f(e[k]);
}

template <typename T, typename W, int FMT, bool VEC, bool COLWISE>
__global__ void __launch_bounds__(kThreads)
    layernorm_cast_kernel(const T* __restrict__ x, const W* __restrict__ weight,
                          const W* __restrict__ bias, int64_t rows, int64_t cols, int64_t out_rows,
                          float eps, uint8_t* __restrict__ q, uint8_t* __restrict__ qt,
                          const float* __restrict__ scale_ptr, float* __restrict__ amax_slot,
                          float* __restrict__ mean_out, float* __restrict__ rstd_out) {
  __shared__ uint32_t tile[COLWISE ? kTileCols * kWords : 1];
  __shared__ float s_mean[kRows], s_rstd[kRows];
  __shared__ int32_t red[kWarps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kRows;

  // 1. the statistics of the warp's rows
#pragma unroll 1
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int lr = warp * kRowsPerThread + i;
    const int64_t gr = r0 + lr;
    if (gr >= rows) {  // a pad row (or past the end): never normalised
      if (lane == 0) s_mean[lr] = s_rstd[lr] = 0.0f;
      continue;
    }
    const T* xr = x + gr * cols;
    Moments m = {0.0f, 0.0f, 0.0f};
    if (VEC) {
      for (int64_t c = lane * 8; c < cols; c += kTileCols) {
        float v[8];
        load8(xr + c, v);
        merge(m, chunk_moments(v));
      }
    } else {
      for (int64_t c = lane; c < cols; c += 32) {
        const float v = to_f(xr[c]);
        m.n += 1.0f;
        const float d = v - m.mean;
        m.mean += __fdiv_rn(d, m.n);
        m.m2 += d * (v - m.mean);
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {  // lane 0 ends with the row's moments
      Moments b;
      b.n = __shfl_down_sync(0xffffffffu, m.n, o);
      b.mean = __shfl_down_sync(0xffffffffu, m.mean, o);
      b.m2 = __shfl_down_sync(0xffffffffu, m.m2, o);
      if (lane + o < 32) merge(m, b);
    }
    if (lane == 0) {
      const float var = fmaxf(__fdiv_rn(m.m2, static_cast<float>(cols)), 0.0f);
      const float rstd = rsqrtf(var + eps);
      s_mean[lr] = m.mean;
      s_rstd[lr] = rstd;
      mean_out[gr] = m.mean;
      rstd_out[gr] = rstd;
    }
  }
  __syncthreads();

  // 2. normalise, cast and store, a tile of 256 columns at a time
  const float scale = __ldg(scale_ptr);
  float mean[kRowsPerThread], rstd[kRowsPerThread];
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    mean[i] = s_mean[warp * kRowsPerThread + i];
    rstd[i] = s_rstd[warp * kRowsPerThread + i];
  }
  int32_t amax = 0;
  const int swz = lane & 7;  // the q_t tile's swizzle of this lane's columns ((col >> 3) & 7)
  for (int64_t c0 = 0; c0 < cols; c0 += kTileCols) {
    const int64_t gc = c0 + lane * kColsPerThread;
    float w[kColsPerThread], b[kColsPerThread];
#pragma unroll
    for (int k = 0; k < kColsPerThread; ++k) {
      const bool in = gc + k < cols;
      w[k] = in ? to_f(weight[gc + k]) : 0.0f;
      b[k] = (in && bias != nullptr) ? to_f(bias[gc + k]) : 0.0f;
    }
    uint8_t bytes[kRowsPerThread][kColsPerThread];
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int64_t gr = r0 + warp * kRowsPerThread + i;
      float v[kColsPerThread];
      if (VEC && gr < rows && gc < cols) {
        load8(x + gr * cols + gc, v);
      } else {
#pragma unroll
        for (int k = 0; k < kColsPerThread; ++k)
          v[k] = (gr < rows && gc + k < cols) ? to_f(x[gr * cols + gc + k]) : 0.0f;
      }
      float y[kColsPerThread];
#pragma unroll
      for (int k = 0; k < kColsPerThread; ++k) {
        // outside the tensor or a pad row: 0 (the reference's pad zeros; no NaN of a degenerate row)
        // without a bias no + 0 (it would turn a -0 into +0, another FP8 byte than the reference's)
        const float t = __fmul_rn(rstd[i], __fsub_rn(v[k], mean[i]));
        y[k] = (gr < rows && gc + k < cols)
                   ? round_as(bias != nullptr ? __fmaf_rn(w[k], t, b[k]) : __fmul_rn(w[k], t), T{})
                   : 0.0f;
        amax = max(amax, dm_abs_bits(y[k]));
      }
#pragma unroll
      for (int k = 0; k < kColsPerThread; k += 2) {
        const uint32_t two = cast2<FMT>(y[k], y[k + 1], scale);
        bytes[i][k] = static_cast<uint8_t>(two);
        bytes[i][k + 1] = static_cast<uint8_t>(two >> 8);
      }
      if (q != nullptr && gr < out_rows) {
        if (VEC) {
          if (gc < cols) {
            uint2 pk;
            pk.x = bytes[i][0] | (bytes[i][1] << 8) | (bytes[i][2] << 16) | (static_cast<uint32_t>(bytes[i][3]) << 24);
            pk.y = bytes[i][4] | (bytes[i][5] << 8) | (bytes[i][6] << 16) | (static_cast<uint32_t>(bytes[i][7]) << 24);
            *reinterpret_cast<uint2*>(q + gr * cols + gc) = pk;
          }
        } else {
#pragma unroll
          for (int k = 0; k < kColsPerThread; ++k)
            if (gc + k < cols) q[gr * cols + gc + k] = bytes[i][k];
        }
      }
    }
    if (COLWISE) {
      // tile[col][word], word = (the warp's row group) ^ swizzle: 4 rows of a column per word
#pragma unroll
      for (int k = 0; k < kColsPerThread; ++k) {
        const int col = lane * kColsPerThread + k;
        tile[col * kWords + (warp ^ swz)] = bytes[0][k] | (bytes[1][k] << 8) | (bytes[2][k] << 16) |
                                            (static_cast<uint32_t>(bytes[3][k]) << 24);
      }
      __syncthreads();
#pragma unroll
      for (int s = 0; s < 2; ++s) {  // 256 q_t rows x 2 halves of 16 bytes
        const int idx = threadIdx.x + s * kThreads;
        const int col = idx / 2, half = idx % 2;
        const int64_t qc = c0 + col, qr = r0 + half * 16;
        if (qc >= cols) continue;
        const int sw = (col >> 3) & 7;
        uint32_t wd[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) wd[j] = tile[col * kWords + ((half * 4 + j) ^ sw)];
        if (VEC) {  // out_rows % 16 == 0: the 16 rows are all inside or all outside
          if (qr < out_rows) *reinterpret_cast<uint4*>(qt + qc * out_rows + qr) = make_uint4(wd[0], wd[1], wd[2], wd[3]);
        } else {
          for (int k = 0; k < 16 && qr + k < out_rows; ++k)
            qt[qc * out_rows + qr + k] = static_cast<uint8_t>(wd[k / 4] >> (8 * (k % 4)));
        }
      }
      __syncthreads();  // the tile is rewritten by the next column tile
    }
  }
  if (amax_slot != nullptr) {
    amax = block_max<kThreads>(amax, red);
    if (threadIdx.x == 0) atomicMax(reinterpret_cast<int*>(amax_slot), amax);
  }
}

template <typename T, typename W, int FMT, bool VEC>
cudaError_t launch_layout(bool colwise, const T* x, const W* w, const W* b, int64_t rows, int64_t cols,
                          int64_t out_rows, float eps, uint8_t* q, uint8_t* qt, const float* scale,
                          float* amax, float* mean, float* rstd, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((out_rows + kRows - 1) / kRows));
  if (colwise) {
    layernorm_cast_kernel<T, W, FMT, VEC, true><<<grid, kThreads, 0, stream>>>(
        x, w, b, rows, cols, out_rows, eps, q, qt, scale, amax, mean, rstd);
  } else {
    layernorm_cast_kernel<T, W, FMT, VEC, false><<<grid, kThreads, 0, stream>>>(
        x, w, b, rows, cols, out_rows, eps, q, qt, scale, amax, mean, rstd);
  }
  return cudaGetLastError();
}

template <typename T, typename W>
cudaError_t launch_typed(const void* x, const void* weight, const void* bias, int64_t rows, int64_t cols,
                         int64_t pad, float eps, int fmt, void* q, void* qt, const float* scale,
                         float* amax, float* mean, float* rstd, cudaStream_t stream) {
  const int64_t out_rows = rows + pad;
  if (out_rows == 0) return cudaSuccess;
  const bool vec = reinterpret_cast<uintptr_t>(x) % 16 == 0 && cols % 8 == 0 && out_rows % 16 == 0;
  const T* xp = static_cast<const T*>(x);
  const W* wp = static_cast<const W*>(weight);
  const W* bp = static_cast<const W*>(bias);
  uint8_t* qp = static_cast<uint8_t*>(q);
  uint8_t* qtp = static_cast<uint8_t*>(qt);
  const bool col = qt != nullptr;
#define DM_LN_LAUNCH(F, V) \
  launch_layout<T, W, F, V>(col, xp, wp, bp, rows, cols, out_rows, eps, qp, qtp, scale, amax, mean, rstd, stream)
  if (fmt == DM_FP8_E4M3) return vec ? DM_LN_LAUNCH(DM_FP8_E4M3, true) : DM_LN_LAUNCH(DM_FP8_E4M3, false);
  return vec ? DM_LN_LAUNCH(DM_FP8_E5M2, true) : DM_LN_LAUNCH(DM_FP8_E5M2, false);
#undef DM_LN_LAUNCH
}

template <typename T>
cudaError_t launch_weights(int w_dtype, const void* x, const void* weight, const void* bias, int64_t rows,
                           int64_t cols, int64_t pad, float eps, int fmt, void* q, void* qt,
                           const float* scale, float* amax, float* mean, float* rstd, cudaStream_t stream) {
  if (w_dtype == DM_FLOAT32)
    return launch_typed<T, float>(x, weight, bias, rows, cols, pad, eps, fmt, q, qt, scale, amax, mean, rstd, stream);
  return launch_typed<T, T>(x, weight, bias, rows, cols, pad, eps, fmt, q, qt, scale, amax, mean, rstd, stream);
}

}  // namespace

extern "C" {

cudaError_t dm_layernorm_cast_fp8(const void* x, int x_dtype, const void* weight, const void* bias,
                                  int w_dtype, int64_t rows, int64_t cols, int64_t pad, float eps,
                                  int fp8_format, void* q, void* qt, const float* scale, float* amax,
                                  float* mean, float* rstd, cudaStream_t stream) {
  if (w_dtype != DM_FLOAT32 && w_dtype != x_dtype) return cudaErrorInvalidValue;
  if (x_dtype == DM_BFLOAT16)
    return launch_weights<__nv_bfloat16>(w_dtype, x, weight, bias, rows, cols, pad, eps, fp8_format, q, qt,
                                         scale, amax, mean, rstd, stream);
  if (x_dtype == DM_FLOAT16)
    return launch_weights<__half>(w_dtype, x, weight, bias, rows, cols, pad, eps, fp8_format, q, qt, scale,
                                  amax, mean, rstd, stream);
  return cudaErrorInvalidValue;
}

}  // extern "C"
