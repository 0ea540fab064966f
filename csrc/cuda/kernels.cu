// CUDA kernels of the dept_mega ops behind the C interface of kernels.h (no torch headers).
//
// gather: a group of `tpr` threads (a power of two <= 32, sized to the row) copies one row
//   at a time with 16-byte vector loads when the row length and the pointers allow, so a
//   warp issues full coalesced transactions; grid-stride over rows keeps work in flight.
// scatter: ids are validated and positions sorted by destination row (CUB stable radix sort
//   over only the bits the table size needs); then one warp owns each destination row and
//   adds its contributions in ascending position order in fp32. No atomics on data: the
//   result is bit-identical from run to run and equals the CPU kernel's.
// remap: elementwise lookup, grid-stride.
#include "kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cub/device/device_radix_sort.cuh>

#include <type_traits>

namespace {

constexpr int kBlock = 256;
constexpr int64_t kMaxBlocks = int64_t{1} << 20;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }

// VEC elements moved as one aligned access (16 bytes for VEC = 16 / sizeof(T)).
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

template <typename T, int VEC>
__device__ __forceinline__ void load_float(const T* p, float (&f)[VEC]) {
  const Pack<T, VEC> x = *reinterpret_cast<const Pack<T, VEC>*>(p);
#pragma unroll
  for (int k = 0; k < VEC; ++k) f[k] = to_float(x.v[k]);
}

template <typename T, int VEC>
__device__ __forceinline__ void store_float(T* p, const float (&f)[VEC]) {
  Pack<T, VEC> x;
#pragma unroll
  for (int k = 0; k < VEC; ++k) x.v[k] = from_float<T>(f[k]);
  *reinterpret_cast<Pack<T, VEC>*>(p) = x;
}

template <typename Tin, typename Tout, typename Idx, int VEC>
__global__ void gather_kernel(const Tin* __restrict__ table, int64_t rows, int64_t dim,
                              const Idx* __restrict__ ids, int64_t n, Tout* __restrict__ out,
                              unsigned long long* bad, int tpr) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t groups = static_cast<int64_t>(gridDim.x) * blockDim.x / tpr;
  const int lane = static_cast<int>(tid & (tpr - 1));
  const int64_t nvec = dim / VEC;
  for (int64_t i = tid / tpr; i < n; i += groups) {
    const int64_t id = static_cast<int64_t>(ids[i]);
    if (id < 0 || id >= rows) {
      if (lane == 0) atomicMin(bad, static_cast<unsigned long long>(i));
      continue;
    }
    const Tin* s = table + id * dim;
    Tout* d = out + i * dim;
#pragma unroll 4
    for (int64_t v = lane; v < nvec; v += tpr) {
      if constexpr (std::is_same<Tin, Tout>::value) {
        *reinterpret_cast<Pack<Tout, VEC>*>(d + v * VEC) =
            *reinterpret_cast<const Pack<Tin, VEC>*>(s + v * VEC);
      } else {
        float f[VEC];
        load_float<Tin, VEC>(s + v * VEC, f);
        store_float<Tout, VEC>(d + v * VEC, f);
      }
    }
  }
}

template <typename Idx, typename Lut>
__global__ void remap_kernel(const Idx* __restrict__ ids, int64_t n,
                             const Lut* __restrict__ lookup, int64_t size, Idx* __restrict__ out,
                             unsigned long long* bad) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const int64_t id = static_cast<int64_t>(ids[i]);
    const int64_t v = (id >= 0 && id < size) ? static_cast<int64_t>(lookup[id]) : -1;
    if (v < 0) {
      atomicMin(bad, static_cast<unsigned long long>(i));
    } else {
      out[i] = static_cast<Idx>(v);
    }
  }
}

template <typename Idx>
__global__ void prepare_kernel(const Idx* __restrict__ ids, int64_t n, int64_t rows,
                               uint32_t* __restrict__ keys, int32_t* __restrict__ pos,
                               unsigned long long* bad) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const int64_t id = static_cast<int64_t>(ids[i]);
    const bool ok = id >= 0 && id < rows;
    if (!ok) atomicMin(bad, static_cast<unsigned long long>(i));
    keys[i] = ok ? static_cast<uint32_t>(id) : 0u;
    pos[i] = static_cast<int32_t>(i);
  }
}

// One warp per destination row: the warp whose sorted position starts a run of equal keys
// sums that run in order. Rows of other warps are never touched, so no atomics.
template <typename Tout, typename Tsrc, int VEC>
__global__ void apply_kernel(Tout* __restrict__ out, int64_t dim, const Tsrc* __restrict__ src,
                             int64_t n, const uint32_t* __restrict__ keys,
                             const int32_t* __restrict__ pos, int mode, float alpha) {
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t nwarps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  const int lane = threadIdx.x & 31;
  const int64_t nvec = dim / VEC;
  for (int64_t p = warp; p < n; p += nwarps) {
    const uint32_t r = keys[p];
    if (p > 0 && keys[p - 1] == r) continue;
    int64_t end = p + 1;
    while (end < n && keys[end] == r) ++end;
    const float count = static_cast<float>(end - p);
    Tout* d = out + static_cast<int64_t>(r) * dim;
    for (int64_t v = lane; v < nvec; v += 32) {
      float acc[VEC];
      if (mode == DM_SCATTER_ADD) {
        load_float<Tout, VEC>(d + v * VEC, acc);
      } else {
#pragma unroll
        for (int k = 0; k < VEC; ++k) acc[k] = 0.0f;
      }
      for (int64_t q = p; q < end; ++q) {
        float f[VEC];
        load_float<Tsrc, VEC>(src + static_cast<int64_t>(pos[q]) * dim + v * VEC, f);
#pragma unroll
        for (int k = 0; k < VEC; ++k) acc[k] += f[k];
      }
      // __fmul_rn / __fadd_rn: no contraction into an FMA, so the result rounds like the
      // CPU kernel's and the fallback's separate multiply and add.
      if (mode == DM_SCATTER_MEAN) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) acc[k] = __fmul_rn(alpha, __fdiv_rn(acc[k], count));
      } else if (mode == DM_SCATTER_MEAN_ACCUMULATE) {
        float old[VEC];
        load_float<Tout, VEC>(d + v * VEC, old);
#pragma unroll
        for (int k = 0; k < VEC; ++k)
          acc[k] = __fadd_rn(old[k], __fmul_rn(alpha, __fdiv_rn(acc[k], count)));
      }
      store_float<Tout, VEC>(d + v * VEC, acc);
    }
  }
}

inline int64_t blocks_for(int64_t threads) {
  int64_t b = (threads + kBlock - 1) / kBlock;
  return b < 1 ? 1 : (b > kMaxBlocks ? kMaxBlocks : b);
}

inline bool aligned(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// Calls f(T{}) for a row dtype code; false for an unknown code.
template <typename F>
bool with_row_type(int dtype, F&& f) {
  switch (dtype) {
    case DM_FLOAT32: f(float{}); return true;
    case DM_BFLOAT16: f(__nv_bfloat16{}); return true;
    case DM_FLOAT16: f(__half{}); return true;
    default: return false;
  }
}

template <typename F>
bool with_id_type(int dtype, F&& f) {
  switch (dtype) {
    case DM_INT32: f(int32_t{}); return true;
    case DM_INT64: f(int64_t{}); return true;
    default: return false;
  }
}

inline int threads_per_row(int64_t nvec) {
  int t = 1;
  while (t < 32 && t < nvec) t *= 2;
  return t;
}

inline size_t align256(size_t x) { return (x + 255) / 256 * 256; }

inline int key_bits(int64_t rows) {
  int bits = 1;
  while (bits < 32 && (int64_t{1} << bits) < rows) ++bits;
  return bits;
}

struct Workspace {
  uint32_t* keys_in;
  uint32_t* keys_out;
  int32_t* pos_in;
  int32_t* pos_out;
  void* temp;
  size_t temp_bytes;
};

inline Workspace carve(void* base, int64_t n, size_t total) {
  char* p = static_cast<char*>(base);
  const size_t a = align256(static_cast<size_t>(n) * 4);
  Workspace w;
  w.keys_in = reinterpret_cast<uint32_t*>(p);
  w.keys_out = reinterpret_cast<uint32_t*>(p + a);
  w.pos_in = reinterpret_cast<int32_t*>(p + 2 * a);
  w.pos_out = reinterpret_cast<int32_t*>(p + 3 * a);
  w.temp = p + 4 * a;
  w.temp_bytes = total > 4 * a ? total - 4 * a : 0;
  return w;
}

inline size_t sort_temp_bytes(int64_t n, int64_t rows) {
  size_t bytes = 0;
  cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const uint32_t*>(nullptr),
                                  static_cast<uint32_t*>(nullptr),
                                  static_cast<const int32_t*>(nullptr),
                                  static_cast<int32_t*>(nullptr), static_cast<int>(n), 0,
                                  key_bits(rows));
  return bytes;
}

}  // namespace

extern "C" cudaError_t dm_gather_rows(const void* table, int table_dtype, int64_t rows,
                                      int64_t dim, const void* ids, int ids_dtype, int64_t n,
                                      void* out, int out_dtype, unsigned long long* bad,
                                      cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  bool ok = true;
  if (!with_id_type(ids_dtype, [&](auto idx_tag) {
    using Idx = decltype(idx_tag);
    if (!with_row_type(table_dtype, [&](auto in_tag) {
      using Tin = decltype(in_tag);
      if (!with_row_type(out_dtype, [&](auto out_tag) {
        using Tout = decltype(out_tag);
        constexpr int V = static_cast<int>(16 / sizeof(Tin));
        const bool vec = dim % V == 0 && aligned(table, 16) && aligned(out, V * sizeof(Tout));
        const int64_t nvec = vec ? dim / V : dim;
        const int tpr = threads_per_row(nvec);
        const int64_t blocks = blocks_for(n * tpr);
        if (vec) {
          gather_kernel<Tin, Tout, Idx, V><<<blocks, kBlock, 0, stream>>>(
              static_cast<const Tin*>(table), rows, dim, static_cast<const Idx*>(ids), n,
              static_cast<Tout*>(out), bad, tpr);
        } else {
          gather_kernel<Tin, Tout, Idx, 1><<<blocks, kBlock, 0, stream>>>(
              static_cast<const Tin*>(table), rows, dim, static_cast<const Idx*>(ids), n,
              static_cast<Tout*>(out), bad, tpr);
        }
      }))
        ok = false;
    }))
      ok = false;
  }))
    ok = false;
  if (!ok) return cudaErrorInvalidValue;
  return cudaGetLastError();
}

extern "C" cudaError_t dm_remap_ids(const void* ids, int ids_dtype, int64_t n,
                                    const void* lookup, int lookup_dtype, int64_t lookup_size,
                                    void* out, unsigned long long* bad, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  bool ok = true;
  if (!with_id_type(ids_dtype, [&](auto idx_tag) {
    using Idx = decltype(idx_tag);
    if (!with_id_type(lookup_dtype, [&](auto lut_tag) {
      using Lut = decltype(lut_tag);
      remap_kernel<Idx, Lut><<<blocks_for(n), kBlock, 0, stream>>>(
          static_cast<const Idx*>(ids), n, static_cast<const Lut*>(lookup), lookup_size,
          static_cast<Idx*>(out), bad);
    }))
      ok = false;
  }))
    ok = false;
  if (!ok) return cudaErrorInvalidValue;
  return cudaGetLastError();
}

extern "C" size_t dm_scatter_workspace_bytes(int64_t n, int64_t rows) {
  if (n <= 0) return 0;
  return 4 * align256(static_cast<size_t>(n) * 4) + align256(sort_temp_bytes(n, rows));
}

extern "C" cudaError_t dm_scatter_prepare(const void* ids, int ids_dtype, int64_t n,
                                          int64_t rows, void* workspace,
                                          size_t workspace_bytes, unsigned long long* bad,
                                          cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (n >= (int64_t{1} << 31) || rows > (int64_t{1} << 32)) return cudaErrorInvalidValue;
  if (workspace_bytes < dm_scatter_workspace_bytes(n, rows)) return cudaErrorInvalidValue;
  Workspace w = carve(workspace, n, workspace_bytes);
  const bool ok = with_id_type(ids_dtype, [&](auto idx_tag) {
    using Idx = decltype(idx_tag);
    prepare_kernel<Idx><<<blocks_for(n), kBlock, 0, stream>>>(static_cast<const Idx*>(ids), n,
                                                             rows, w.keys_in, w.pos_in, bad);
  });
  if (!ok) return cudaErrorInvalidValue;
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  size_t temp = w.temp_bytes;
  return cub::DeviceRadixSort::SortPairs(w.temp, temp, w.keys_in, w.keys_out, w.pos_in,
                                         w.pos_out, static_cast<int>(n), 0, key_bits(rows),
                                         stream);
}

extern "C" cudaError_t dm_scatter_apply(void* out, int out_dtype, int64_t rows, int64_t dim,
                                        const void* src, int src_dtype, int64_t n, int mode,
                                        float alpha, const void* workspace,
                                        cudaStream_t stream) {
  (void)rows;
  if (n == 0 || dim == 0) return cudaSuccess;
  if (mode != DM_SCATTER_ADD && mode != DM_SCATTER_MEAN && mode != DM_SCATTER_MEAN_ACCUMULATE)
    return cudaErrorInvalidValue;
  // The workspace is only read here; carve() needs a mutable base for its pointer types.
  Workspace w = carve(const_cast<void*>(workspace), n, 0);
  const int64_t blocks = blocks_for(n * 32);
  bool ok = true;
  if (!with_row_type(out_dtype, [&](auto out_tag) {
    using Tout = decltype(out_tag);
    if (!with_row_type(src_dtype, [&](auto src_tag) {
      using Tsrc = decltype(src_tag);
      constexpr int V = 4;  // 16-byte fp32 accesses, 8-byte half / bf16 accesses
      const bool vec = dim % V == 0 && aligned(out, V * sizeof(Tout)) &&
                       aligned(src, V * sizeof(Tsrc));
      if (vec) {
        apply_kernel<Tout, Tsrc, V><<<blocks, kBlock, 0, stream>>>(
            static_cast<Tout*>(out), dim, static_cast<const Tsrc*>(src), n, w.keys_out,
            w.pos_out, mode, alpha);
      } else {
        apply_kernel<Tout, Tsrc, 1><<<blocks, kBlock, 0, stream>>>(
            static_cast<Tout*>(out), dim, static_cast<const Tsrc*>(src), n, w.keys_out,
            w.pos_out, mode, alpha);
      }
    }))
      ok = false;
  }))
    ok = false;
  if (!ok) return cudaErrorInvalidValue;
  return cudaGetLastError();
}
