// CUDA kernel of dept_mega::layernorm_cast_fp8 behind dm_layernorm_cast_fp8 (kernels.h): the
// LayerNorm of a linear's input fused with its FP8 cast (delayed scaling), so the normalised
// bf16/fp16 tensor is never written to memory. Semantics: csrc/registration.cpp; the CPU kernel
// (csrc/cpu/ops_cpu.cpp) and the reference (F.layer_norm, then fp8._cast_math) compute the same
// values up to a rounding of the statistics (the tests bound how often an FP8 byte differs).
//
// UNVERIFIED on a GPU in this form (the loads reorganised for memory-level parallelism, same
// arithmetic): tests/test_fp8_fused_op.py's gpu test compares it with the reference,
// benchmarks/fp8_cast_bench.py times it against the unfused pair. Without a GPU,
// tests/test_layernorm_cast_emulated.py runs this source on the CPU (tools/cuda_emu.py: a host
// emulation of the threads, barriers and shuffles; keep every shuffle full-warp).
//
// One block of kThreads (8 warps) per kRows = 32 rows of the padded output (blockIdx.x); warp w
// owns rows 4w .. 4w + 3 in both steps. The grid is small (256 blocks at the 1B model's 8192
// tokens: two per SM), so the time is the loads' latency: each thread keeps several independent
// 16-byte loads in flight.
// 1. Statistics: the lanes read the warp's 4 rows together, kUnroll = 2 chunks of 8 elements of
//    each row per iteration (16-byte loads: 8 in flight per lane), then merge each chunk's
//    exact two-pass moments into the lane's Welford pair (mean, M2) of its row with Chan's
//    formula. The j-th chunk's weight 8 / (8j + 8) = 1 / (j + 1) is one correctly rounded
//    reciprocal for the 4 rows (the value of the IEEE division it replaces). The lanes' pairs
//    merge by shuffles into lane 0 (the 4 rows interleaved, one division per level for the 4);
//    lane 0's mean and M2 go to the whole warp (shuffles: no shared memory, no barrier), every
//    lane computes rstd = rsqrtf(M2 / cols + eps) (PyTorch's CUDA kernel also uses rsqrt), and
//    lane 0 writes mean and rstd out. Scalar path: Welford element by element, the 4 rows' loads
//    together. One read of x.
// 2. Column tiles of 256: a thread owns 4 rows (its warp's) x 8 columns (its lane's). Their x
//    (16 bytes per row; the L2 still holds them from step 1) is loaded a tile ahead: tile t + 1's
//    loads are in flight while tile t computes. Weight and bias: 16- or 32-byte loads where they
//    are 16-byte aligned (element by element otherwise). Then y = w * (rstd * (x - mean)) + b
//    (one FMA, as PyTorch's CUDA kernel compiles it), rounded to the input dtype; the amax; pairs
//    cast to FP8 (cast2). q: one 8-byte store per row (a warp writes 256 contiguous bytes of a
//    row). q_t: the thread's 4 rows of a column are one 32-bit word of a shared tile
//    [256 columns][8 words], the word index XOR-swizzled by the column's lane (at most 4-way
//    bank conflicts on the stores); after a barrier each thread stores two 16-byte halves of q_t
//    rows (32 bytes per q_t row and block). Two such tiles alternate between column tiles, so
//    one barrier per tile suffices (a tile is rewritten only after the next tile's barrier,
//    which every thread reaches after its reads).
// Registers: __launch_bounds__(kThreads, 2) (at most 128 a thread: two blocks per SM); for
// sm_90 ptxas gives 93 to 128 without spills (nvcc -Xptxas -v).
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
constexpr int kTileWords = kTileCols * kWords;    // one q_t tile (8 KB)
constexpr int kUnroll = 2;                        // step 1: chunks per row and lane per iteration

static_assert(kRowsPerThread == 4, "a q_t tile word holds a thread's 4 rows");

__device__ __forceinline__ float to_f(float v) { return v; }

__device__ __forceinline__ uint4 ldg16(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

// 8 elements of type E (16 or 32 bytes: 1 or 2 uint4) as floats.
template <typename E>
__device__ __forceinline__ void unpack8(const uint4* raw, float* v) {
  const E* e = reinterpret_cast<const E*>(raw);
#pragma unroll
  for (int k = 0; k < 8; ++k) v[k] = to_f(e[k]);
}

// (mean, m2) ∪ (b_mean, b_m2) (Chan et al.), where (mean, m2) holds n_a elements and
// f = n_b / (n_a + n_b), correctly rounded (the caller's division or reciprocal).
__device__ __forceinline__ void merge(float& mean, float& m2, float b_mean, float b_m2, float n_a, float f) {
  const float delta = b_mean - mean;
  mean = mean + delta * f;
  m2 = m2 + b_m2 + delta * delta * n_a * f;
}

// Merges the 8 elements of raw (type T) into (mean, m2), n_a elements so far: the exact-ish
// moments of the chunk (two passes over registers), then Chan's formula with f = 8 / (n_a + 8).
template <typename T>
__device__ __forceinline__ void merge_chunk(float& mean, float& m2, const uint4& raw, float n_a, float f) {
  float v[8];
  unpack8<T>(&raw, v);
  float s = 0.0f;
#pragma unroll
  for (int k = 0; k < 8; ++k) s += v[k];
  const float b_mean = s * 0.125f;
  float b_m2 = 0.0f;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const float d = v[k] - b_mean;
    b_m2 += d * d;
  }
  merge(mean, m2, b_mean, b_m2, n_a, f);
}

template <typename T, typename W, int FMT, bool VEC, bool COLWISE>
__global__ void __launch_bounds__(kThreads, 2)
    layernorm_cast_kernel(const T* __restrict__ x, const W* __restrict__ weight,
                          const W* __restrict__ bias, int64_t rows, int64_t cols, int64_t out_rows,
                          float eps, uint8_t* __restrict__ q, uint8_t* __restrict__ qt,
                          const float* __restrict__ scale_ptr, float* __restrict__ amax_slot,
                          float* __restrict__ mean_out, float* __restrict__ rstd_out) {
  __shared__ uint32_t tile[COLWISE ? 2 * kTileWords : 1];  // two q_t tiles: even and odd column tiles
  __shared__ int32_t red[kWarps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kRows + warp * kRowsPerThread;  // the warp's first row
  const uint4 zero4 = make_uint4(0u, 0u, 0u, 0u);

  bool live[kRowsPerThread];  // a row of x (not a pad row, not past the end)
  const T* xr[kRowsPerThread];
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    live[i] = r0 + i < rows;
    xr[i] = x + (live[i] ? r0 + i : 0) * cols;  // never read when not live
  }

  // 1. the statistics of the warp's 4 rows, interleaved: the lane's moments of each row (its
  //    elements, the same count n for the 4 rows), a pad row's from zeros (never used)
  float mean[kRowsPerThread], m2[kRowsPerThread];
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) mean[i] = m2[i] = 0.0f;
  float n = 0.0f;
  if (VEC) {
    // chunks of 8 at lane * 8 + j * 256: kUnroll chunks of the 4 rows loaded at once, then
    // merged; the j-th merge's f = 8 / (8j + 8) = 1 / (j + 1) is one reciprocal for the 4 rows
    int64_t c = lane * kColsPerThread;
    int j = 0;
#pragma unroll 1
    for (; c + (kUnroll - 1) * kTileCols < cols; c += kUnroll * kTileCols) {
      uint4 raw[kUnroll][kRowsPerThread];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) raw[u][i] = live[i] ? ldg16(xr[i] + c + u * kTileCols) : zero4;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u, ++j) {
        const float f = __frcp_rn(static_cast<float>(j + 1));
#pragma unroll
        for (int i = 0; i < kRowsPerThread; ++i) merge_chunk<T>(mean[i], m2[i], raw[u][i], n, f);
        n += 8.0f;
      }
    }
#pragma unroll 1
    for (; c < cols; c += kTileCols, ++j) {  // the last chunks (fewer than kUnroll)
      uint4 raw[kRowsPerThread];
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) raw[i] = live[i] ? ldg16(xr[i] + c) : zero4;
      const float f = __frcp_rn(static_cast<float>(j + 1));
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) merge_chunk<T>(mean[i], m2[i], raw[i], n, f);
      n += 8.0f;
    }
  } else {
    // element by element (Welford), the 4 rows' loads together
#pragma unroll 2
    for (int64_t c = lane; c < cols; c += 32) {
      float v[kRowsPerThread];
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) v[i] = live[i] ? to_f(xr[i][c]) : 0.0f;
      n += 1.0f;
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) {
        const float d = v[i] - mean[i];
        mean[i] += __fdiv_rn(d, n);
        m2[i] += d * (v[i] - mean[i]);
      }
    }
  }
  // the lanes' moments merge into lane 0 (the 4 rows' shuffles and merges interleaved)
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float nb = __shfl_down_sync(0xffffffffu, n, o);
    float bm[kRowsPerThread], bm2[kRowsPerThread];
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      bm[i] = __shfl_down_sync(0xffffffffu, mean[i], o);
      bm2[i] = __shfl_down_sync(0xffffffffu, m2[i], o);
    }
    if (lane + o < 32 && nb != 0.0f) {
      const float nn = n + nb;
      const float f = __fdiv_rn(nb, nn);
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) merge(mean[i], m2[i], bm[i], bm2[i], n, f);
      n = nn;
    }
  }
  // lane 0's moments to every lane of the warp (step 2 normalises the warp's own rows)
  float rstd[kRowsPerThread];
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    mean[i] = __shfl_sync(0xffffffffu, mean[i], 0);
    const float var = fmaxf(__fdiv_rn(__shfl_sync(0xffffffffu, m2[i], 0), static_cast<float>(cols)), 0.0f);
    rstd[i] = rsqrtf(var + eps);
    if (lane == 0 && live[i]) {
      mean_out[r0 + i] = mean[i];
      rstd_out[r0 + i] = rstd[i];
    }
  }

  // 2. normalise, cast and store, a tile of 256 columns at a time
  const float scale = __ldg(scale_ptr);
  int32_t amax = 0;
  const int swz = lane & 7;  // the q_t tile's swizzle of this lane's columns ((col >> 3) & 7)
  // VEC: x of the next column tile is loaded during this one (16 bytes per row and thread)
  uint4 cur[kRowsPerThread], nxt[kRowsPerThread];
  const auto load_x = [&](uint4* t, int64_t c0) {
    const int64_t gc = c0 + lane * kColsPerThread;
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) t[i] = live[i] && gc < cols ? ldg16(xr[i] + gc) : zero4;
  };
  if (VEC) load_x(cur, 0);
  // weight and bias 16-byte aligned (VEC: then so is every 8th element); else element by element
  const bool wb_aligned = ((reinterpret_cast<uintptr_t>(weight) | reinterpret_cast<uintptr_t>(bias)) & 15) == 0;
  int parity = 0;  // which of the two q_t tiles this column tile uses
  for (int64_t c0 = 0; c0 < cols; c0 += kTileCols, parity ^= 1) {
    const int64_t gc = c0 + lane * kColsPerThread;
    float w[kColsPerThread], b[kColsPerThread], v[kRowsPerThread][kColsPerThread];
    if (VEC && wb_aligned) {  // 16- or 32-byte loads of the 8 weights and biases (L1 hits mostly)
      constexpr int kW = 8 * sizeof(W) / 16;  // uint4 per 8 weights: 1 (bf16/fp16) or 2 (fp32)
      uint4 wr[kW], br[kW];
#pragma unroll
      for (int k = 0; k < kW; ++k) {
        wr[k] = gc < cols ? ldg16(weight + gc + k * 4) : zero4;
        br[k] = gc < cols && bias != nullptr ? ldg16(bias + gc + k * 4) : zero4;
      }
      unpack8<W>(wr, w);
      unpack8<W>(br, b);
    } else {
#pragma unroll
      for (int k = 0; k < kColsPerThread; ++k) {
        const bool in = gc + k < cols;
        w[k] = in ? to_f(__ldg(weight + gc + k)) : 0.0f;
        b[k] = (in && bias != nullptr) ? to_f(__ldg(bias + gc + k)) : 0.0f;
      }
    }
    if (VEC) {
      if (c0 + kTileCols < cols) load_x(nxt, c0 + kTileCols);
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) unpack8<T>(&cur[i], v[i]);
    } else {
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i)
#pragma unroll
        for (int k = 0; k < kColsPerThread; ++k) v[i][k] = live[i] && gc + k < cols ? to_f(xr[i][gc + k]) : 0.0f;
    }
    uint8_t bytes[kRowsPerThread][kColsPerThread];
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int64_t gr = r0 + i;
      float y[kColsPerThread];
#pragma unroll
      for (int k = 0; k < kColsPerThread; ++k) {
        // outside the tensor or a pad row: 0 (the reference's pad zeros; no NaN of a degenerate row)
        // without a bias no + 0 (it would turn a -0 into +0, another FP8 byte than the reference's)
        const float t = __fmul_rn(rstd[i], __fsub_rn(v[i][k], mean[i]));
        y[k] = (live[i] && (VEC ? gc : gc + k) < cols)  // VEC: cols % 8 == 0
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
      // buf[col][word], word = (the warp's row group) ^ swizzle: 4 rows of a column per word.
      // Two buffers: a thread rewrites this one two tiles later, after the next tile's barrier,
      // which every thread reaches only after its reads below: one barrier per tile.
      uint32_t* buf = tile + parity * kTileWords;
#pragma unroll
      for (int k = 0; k < kColsPerThread; ++k) {
        const int col = lane * kColsPerThread + k;
        buf[col * kWords + (warp ^ swz)] = bytes[0][k] | (bytes[1][k] << 8) | (bytes[2][k] << 16) |
                                           (static_cast<uint32_t>(bytes[3][k]) << 24);
      }
      __syncthreads();
      const int64_t b0 = static_cast<int64_t>(blockIdx.x) * kRows;  // the block's first row
#pragma unroll
      for (int s = 0; s < 2; ++s) {  // 256 q_t rows x 2 halves of 16 bytes
        const int idx = threadIdx.x + s * kThreads;
        const int col = idx / 2, half = idx % 2;
        const int64_t qc = c0 + col, qr = b0 + half * 16;
        if (qc >= cols) continue;
        const int sw = (col >> 3) & 7;
        uint32_t wd[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) wd[j] = buf[col * kWords + ((half * 4 + j) ^ sw)];
        if (VEC) {  // out_rows % 16 == 0: the 16 rows are all inside or all outside
          if (qr < out_rows) *reinterpret_cast<uint4*>(qt + qc * out_rows + qr) = make_uint4(wd[0], wd[1], wd[2], wd[3]);
        } else {
          for (int k = 0; k < 16 && qr + k < out_rows; ++k)
            qt[qc * out_rows + qr + k] = static_cast<uint8_t>(wd[k / 4] >> (8 * (k % 4)));
        }
      }
    }
    if (VEC) {
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) cur[i] = nxt[i];
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
