// CUDA kernels of the dept_mega ops behind the C interface of kernels.h (no torch headers).
//
// gather: a group of `tpr` threads (a power of two <= 32, sized to the row) copies one row
//   at a time with 16-byte vector loads when the row length and the pointers allow, so a
//   warp issues full coalesced transactions; grid-stride over rows keeps work in flight.
// scatter: ids are validated and positions sorted by destination row (CUB stable radix sort
//   over only the bits the table size needs). A destination row's contributions (a run of
//   the sorted positions, ascending position order) are cut into chunks of DM_SCATTER_CHUNK:
//   partial_kernel sums chunks 1, 2, ... of every run in parallel (one warp per chunk and
//   column tile), then final_kernel (one warp per row and column tile) adds chunk 0 to the
//   row's start value and the chunk sums in chunk order. All sums in fp32, no atomics on
//   data: a long run (a frequent token) is reduced in parallel, and the result is fixed by
//   the ids alone, bit-identical from run to run and equal to the CPU kernel's.
// remap: elementwise lookup, grid-stride, kRemapItems independent ids per thread in flight.
// Invalid ids (the output gets a zero row / 0 there, so that nothing read before check_errors is
//   out of range): gather and remap in their one launch (finish_call, call_record.cuh: the last
//   block to finish writes the error record and resets the per-stream scratch); the scatters
//   with a per-call flag that the writing kernels read (nothing written on error) and a
//   one-thread record_kernel. The ranked remap: remap_ranked.cu.
#include "kernels.h"
#include "call_record.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cub/device/device_radix_sort.cuh>

#include <type_traits>

namespace {

constexpr int kBlock = 256;
constexpr int64_t kMaxBlocks = int64_t{1} << 20;
constexpr int kRemapItems = 4;  // ids per thread and loop step of remap_kernel

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

// Launch bounds: the occupancy of the three-launch build (ptxas -v, sm_90): a copy <= 48
// registers (5 blocks of 256 per SM), a conversion <= 32 (8 blocks; 34-37 without the bound).
template <typename Tin, typename Tout, typename Idx, int VEC>
__global__ void __launch_bounds__(kBlock, std::is_same<Tin, Tout>::value ? 5 : 8)
    gather_kernel(const Tin* __restrict__ table, int64_t rows, int64_t dim,
                  const Idx* __restrict__ ids, int64_t n, Tout* __restrict__ out, int tpr,
                  DmCallScratch* scratch, int64_t* __restrict__ record) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t groups = static_cast<int64_t>(gridDim.x) * blockDim.x / tpr;
  const int lane = static_cast<int>(tid & (tpr - 1));
  const int64_t nvec = dim / VEC;
  for (int64_t i = tid / tpr; i < n; i += groups) {
    const int64_t id = static_cast<int64_t>(ids[i]);
    Tout* d = out + i * dim;
    if (id < 0 || id >= rows) {
      if (lane == 0) {
        atomicMin(&scratch->bad, static_cast<unsigned long long>(i));
        __threadfence();  // before this thread reaches finish_call's barrier
      }
      // a zero row: the caller may read the output before check_errors raises
      const float zero[VEC] = {};
      for (int64_t v = lane; v < nvec; v += tpr) store_float<Tout, VEC>(d + v * VEC, zero);
      continue;
    }
    const Tin* s = table + id * dim;
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
  finish_call<Idx>(nullptr, scratch, n, DM_ERR_GATHER, ids, rows, LookupValue<int64_t>{nullptr},
                   record);
}

// Each thread takes kRemapItems ids a block width apart per step (coalesced), loading all of
// them before the dependent lookups, so several loads are in flight per thread. <= 32
// registers (it needs 30-32): 8 blocks of 256 per SM, full occupancy on sm_90.
template <typename Idx, typename Lut>
__global__ void __launch_bounds__(kBlock, 8)
    remap_kernel(const Idx* __restrict__ ids, int64_t n, const Lut* __restrict__ lookup,
                 int64_t size, Idx* __restrict__ out, DmCallScratch* scratch,
                 int64_t* __restrict__ record) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x * kRemapItems;
  __shared__ unsigned long long block_bad;
  begin_call(block_bad);
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.x * kRemapItems + threadIdx.x;
       base < n; base += step) {
    int64_t id[kRemapItems];
#pragma unroll
    for (int k = 0; k < kRemapItems; ++k) {
      const int64_t i = base + static_cast<int64_t>(k) * blockDim.x;
      id[k] = i < n ? static_cast<int64_t>(ids[i]) : 0;
    }
#pragma unroll
    for (int k = 0; k < kRemapItems; ++k) {
      const int64_t i = base + static_cast<int64_t>(k) * blockDim.x;
      if (i >= n) break;
      const int64_t v = (id[k] >= 0 && id[k] < size) ? static_cast<int64_t>(lookup[id[k]]) : -1;
      if (v < 0) atomicMin(&block_bad, static_cast<unsigned long long>(i));
      out[i] = v < 0 ? Idx{0} : static_cast<Idx>(v);  // 0 stays in range until check_errors
    }
  }
  finish_call<Idx>(&block_bad, scratch, n, DM_ERR_REMAP_MISSING, ids, size,
                   LookupValue<Lut>{lookup}, record);
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

// Sorted keys: the first index q in [lo, hi) with keys[q] >= key (lower) / > key (upper).
__device__ __forceinline__ int64_t lower_bound(const uint32_t* keys, int64_t lo, int64_t hi,
                                               uint32_t key) {
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (keys[mid] < key) lo = mid + 1; else hi = mid;
  }
  return lo;
}

__device__ __forceinline__ int64_t upper_bound(const uint32_t* keys, int64_t lo, int64_t hi,
                                               uint32_t key) {
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (keys[mid] <= key) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// End of the run of `key` that starts at p (sorted keys): a galloping search, so a short run
// (the common case: distinct or rarely repeated ids) costs one or two loads, not log2(n).
__device__ __forceinline__ int64_t run_end(const uint32_t* keys, int64_t p, int64_t n,
                                           uint32_t key) {
  int64_t lo = p + 1, hi = p + 1, step = 1;  // keys[p, lo) == key
  while (hi < n && keys[hi] == key) {
    lo = hi + 1;
    hi = lo + step;
    step *= 2;
  }
  return upper_bound(keys, lo, hi < n ? hi : n, key);
}

// acc[k] += src row at sorted positions [q0, q1), in ascending order (fp32 adds; the loads
// are independent of the sum, so the unrolled loop keeps several in flight).
template <typename Tsrc, int VEC>
__device__ __forceinline__ void add_rows(float (&acc)[VEC], const Tsrc* __restrict__ src,
                                         int64_t dim, int64_t col, const int32_t* __restrict__ pos,
                                         int64_t q0, int64_t q1) {
#pragma unroll 8
  for (int64_t q = q0; q < q1; ++q) {
    float f[VEC];
    load_float<Tsrc, VEC>(src + static_cast<int64_t>(pos[q]) * dim + col, f);
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[k] += f[k];
  }
}

// Work items are (sorted position or chunk slot, column tile): one warp per item, each lane
// VEC consecutive columns of a 32 * VEC wide tile.
struct Tile {
  int64_t item, col;
  bool valid;
};

__device__ __forceinline__ Tile tile_of(int64_t w, int64_t ntiles, int64_t dim, int lane,
                                        int vec) {
  Tile t;
  t.item = w / ntiles;
  t.col = (w % ntiles) * 32 * vec + static_cast<int64_t>(lane) * vec;
  t.valid = t.col < dim;
  return t;
}

// Chunk partial sums of the long runs. Slot b covers sorted positions [b*C, (b+1)*C). A run
// (destination row) starting at s is cut into chunks [s + kC, s + (k+1)C); chunk k >= 1
// starts at s + kC, and distinct such starts fall into distinct slots (two of them are more
// than C apart), so chunk k >= 1 of a run is stored at partial[(s + kC) / C]. Only the run
// that contains position b*C can have such a start inside slot b.
template <typename Tsrc, int VEC>
__global__ void partial_kernel(float* __restrict__ partial, int64_t dim,
                               const Tsrc* __restrict__ src, int64_t n,
                               const uint32_t* __restrict__ keys,
                               const int32_t* __restrict__ pos,
                               const unsigned long long* __restrict__ bad) {
  if (*bad < static_cast<unsigned long long>(n)) return;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t nwarps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  const int lane = threadIdx.x & 31;
  const int64_t ntiles = (dim + 32 * VEC - 1) / (32 * VEC);
  const int64_t nslots = (n + DM_SCATTER_CHUNK - 1) / DM_SCATTER_CHUNK;
  for (int64_t w = warp; w < nslots * ntiles; w += nwarps) {
    const Tile t = tile_of(w, ntiles, dim, lane, VEC);
    const int64_t b0 = t.item * DM_SCATTER_CHUNK;
    const uint32_t key = keys[b0];
    const int64_t s = lower_bound(keys, 0, b0, key);
    if (s == b0) continue;  // the run starts here: its chunk 0 is summed by final_kernel
    const int64_t q0 = s + (b0 - s + DM_SCATTER_CHUNK - 1) / DM_SCATTER_CHUNK * DM_SCATTER_CHUNK;
    if (q0 >= n || keys[q0] != key) continue;  // the run ends before its next chunk
    if (!t.valid) continue;
    const int64_t end = upper_bound(keys, q0, q0 + DM_SCATTER_CHUNK < n ? q0 + DM_SCATTER_CHUNK : n,
                                    key);
    float acc[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[k] = 0.0f;
    add_rows<Tsrc, VEC>(acc, src, dim, t.col, pos, q0, end);
    float* d = partial + t.item * dim + t.col;
#pragma unroll
    for (int k = 0; k < VEC; ++k) d[k] = acc[k];
  }
}

// One warp per (destination row, column tile): the warp whose sorted position starts a run
// adds chunk 0 of the run to the row's start value (its old value, or 0 for the means), then
// the partial sums of chunks 1, 2, ... in order, and writes the row. Rows of other warps are
// never touched, so no atomics: the order is fixed by the ids alone.
template <typename Tout, typename Tsrc, int VEC>
__global__ void final_kernel(Tout* __restrict__ out, int64_t dim, const Tsrc* __restrict__ src,
                             int64_t n, const uint32_t* __restrict__ keys,
                             const int32_t* __restrict__ pos, const float* __restrict__ partial,
                             int mode, float alpha, const unsigned long long* __restrict__ bad) {
  if (*bad < static_cast<unsigned long long>(n)) return;  // nothing is written on error
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t nwarps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  const int lane = threadIdx.x & 31;
  const int64_t ntiles = (dim + 32 * VEC - 1) / (32 * VEC);
  for (int64_t w = warp; w < n * ntiles; w += nwarps) {
    const Tile t = tile_of(w, ntiles, dim, lane, VEC);
    const int64_t p = t.item;
    const uint32_t r = keys[p];
    if (p > 0 && keys[p - 1] == r) continue;
    if (!t.valid) continue;
    const int64_t end = run_end(keys, p, n, r);
    Tout* d = out + static_cast<int64_t>(r) * dim + t.col;
    float acc[VEC];
    if (mode == DM_SCATTER_ADD) {
      load_float<Tout, VEC>(d, acc);
    } else {
#pragma unroll
      for (int k = 0; k < VEC; ++k) acc[k] = 0.0f;
    }
    add_rows<Tsrc, VEC>(acc, src, dim, t.col, pos, p,
                        end < p + DM_SCATTER_CHUNK ? end : p + DM_SCATTER_CHUNK);
#pragma unroll 8
    for (int64_t q = p + DM_SCATTER_CHUNK; q < end; q += DM_SCATTER_CHUNK) {
      const float* part = partial + (q / DM_SCATTER_CHUNK) * dim + t.col;
#pragma unroll
      for (int k = 0; k < VEC; ++k) acc[k] += part[k];
    }
    // __fmul_rn / __fadd_rn: no contraction into an FMA, so the result rounds like the
    // CPU kernel's and the fallback's separate multiply and add.
    const float count = static_cast<float>(end - p);
    if (mode == DM_SCATTER_MEAN) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) acc[k] = __fmul_rn(alpha, __fdiv_rn(acc[k], count));
    } else if (mode == DM_SCATTER_MEAN_ACCUMULATE) {
      float old[VEC];
      load_float<Tout, VEC>(d, old);
#pragma unroll
      for (int k = 0; k < VEC; ++k)
        acc[k] = __fadd_rn(old[k], __fmul_rn(alpha, __fdiv_rn(acc[k], count)));
    }
    store_float<Tout, VEC>(d, acc);
  }
}

// One thread (the scatters): if the call found an invalid id (*bad < n), write the device's
// error record unless it holds one already, in the layout of kernels.h. (No lookup: only the
// remap's record reads one, and the remap writes its own in finish_call.)
template <typename Idx>
__global__ void record_kernel(const unsigned long long* __restrict__ bad, int64_t n, int op,
                              const Idx* __restrict__ ids, int64_t bound,
                              int64_t* __restrict__ record) {
  const unsigned long long b = *bad;
  if (b >= static_cast<unsigned long long>(n) || record[0] != DM_ERR_NONE) return;
  write_record<Idx>(static_cast<int64_t>(b), op, ids, bound, LookupValue<int64_t>{nullptr},
                    record);
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
  float* partial;  // one fp32 row per chunk slot: ceil(n / DM_SCATTER_CHUNK) x dim
  void* temp;
  size_t temp_bytes;
};

inline size_t partial_bytes(int64_t n, int64_t dim) {
  const int64_t slots = (n + DM_SCATTER_CHUNK - 1) / DM_SCATTER_CHUNK;
  return align256(static_cast<size_t>(slots) * static_cast<size_t>(dim) * sizeof(float));
}

inline Workspace carve(void* base, int64_t n, int64_t dim, size_t total) {
  char* p = static_cast<char*>(base);
  const size_t a = align256(static_cast<size_t>(n) * 4);
  const size_t pb = partial_bytes(n, dim);
  Workspace w;
  w.keys_in = reinterpret_cast<uint32_t*>(p);
  w.keys_out = reinterpret_cast<uint32_t*>(p + a);
  w.pos_in = reinterpret_cast<int32_t*>(p + 2 * a);
  w.pos_out = reinterpret_cast<int32_t*>(p + 3 * a);
  w.partial = reinterpret_cast<float*>(p + 4 * a);
  w.temp = p + 4 * a + pb;
  w.temp_bytes = total > 4 * a + pb ? total - 4 * a - pb : 0;
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
                                      void* out, int out_dtype, DmCallScratch* scratch,
                                      int64_t* record, cudaStream_t stream) {
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
              static_cast<Tout*>(out), tpr, scratch, record);
        } else {
          gather_kernel<Tin, Tout, Idx, 1><<<blocks, kBlock, 0, stream>>>(
              static_cast<const Tin*>(table), rows, dim, static_cast<const Idx*>(ids), n,
              static_cast<Tout*>(out), tpr, scratch, record);
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
                                    void* out, DmCallScratch* scratch, int64_t* record,
                                    cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  bool ok = true;
  if (!with_id_type(ids_dtype, [&](auto idx_tag) {
    using Idx = decltype(idx_tag);
    if (!with_id_type(lookup_dtype, [&](auto lut_tag) {
      using Lut = decltype(lut_tag);
      const int64_t blocks = blocks_for((n + kRemapItems - 1) / kRemapItems);
      remap_kernel<Idx, Lut><<<blocks, kBlock, 0, stream>>>(
          static_cast<const Idx*>(ids), n, static_cast<const Lut*>(lookup), lookup_size,
          static_cast<Idx*>(out), scratch, record);
    }))
      ok = false;
  }))
    ok = false;
  if (!ok) return cudaErrorInvalidValue;
  return cudaGetLastError();
}

extern "C" size_t dm_scatter_workspace_bytes(int64_t n, int64_t rows, int64_t dim) {
  if (n <= 0) return 0;
  return 4 * align256(static_cast<size_t>(n) * 4) + partial_bytes(n, dim) +
         align256(sort_temp_bytes(n, rows));
}

extern "C" cudaError_t dm_scatter_prepare(const void* ids, int ids_dtype, int64_t n,
                                          int64_t rows, int64_t dim, void* workspace,
                                          size_t workspace_bytes, unsigned long long* bad,
                                          cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (n >= (int64_t{1} << 31) || rows > (int64_t{1} << 32)) return cudaErrorInvalidValue;
  if (workspace_bytes < dm_scatter_workspace_bytes(n, rows, dim)) return cudaErrorInvalidValue;
  Workspace w = carve(workspace, n, dim, workspace_bytes);
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
                                        const unsigned long long* bad, cudaStream_t stream) {
  (void)rows;
  if (n == 0 || dim == 0) return cudaSuccess;
  if (mode != DM_SCATTER_ADD && mode != DM_SCATTER_MEAN && mode != DM_SCATTER_MEAN_ACCUMULATE)
    return cudaErrorInvalidValue;
  // carve() needs a mutable base for its pointer types; only the partial rows are written.
  Workspace w = carve(const_cast<void*>(workspace), n, dim, 0);
  bool ok = true;
  if (!with_row_type(out_dtype, [&](auto out_tag) {
    using Tout = decltype(out_tag);
    if (!with_row_type(src_dtype, [&](auto src_tag) {
      using Tsrc = decltype(src_tag);
      constexpr int V = 4;  // 16-byte fp32 accesses, 8-byte half / bf16 accesses
      const bool vec = dim % V == 0 && aligned(out, V * sizeof(Tout)) &&
                       aligned(src, V * sizeof(Tsrc));
      const int vw = vec ? V : 1;
      const int64_t ntiles = (dim + 32 * vw - 1) / (32 * vw);
      const int64_t slots = (n + DM_SCATTER_CHUNK - 1) / DM_SCATTER_CHUNK;
      const int64_t pblocks = blocks_for(slots * ntiles * 32);
      const int64_t fblocks = blocks_for(n * ntiles * 32);
      const Tsrc* s = static_cast<const Tsrc*>(src);
      Tout* o = static_cast<Tout*>(out);
      if (vec) {
        partial_kernel<Tsrc, V><<<pblocks, kBlock, 0, stream>>>(w.partial, dim, s, n, w.keys_out,
                                                                w.pos_out, bad);
        final_kernel<Tout, Tsrc, V><<<fblocks, kBlock, 0, stream>>>(
            o, dim, s, n, w.keys_out, w.pos_out, w.partial, mode, alpha, bad);
      } else {
        partial_kernel<Tsrc, 1><<<pblocks, kBlock, 0, stream>>>(w.partial, dim, s, n, w.keys_out,
                                                                w.pos_out, bad);
        final_kernel<Tout, Tsrc, 1><<<fblocks, kBlock, 0, stream>>>(
            o, dim, s, n, w.keys_out, w.pos_out, w.partial, mode, alpha, bad);
      }
    }))
      ok = false;
  }))
    ok = false;
  if (!ok) return cudaErrorInvalidValue;
  return cudaGetLastError();
}

extern "C" cudaError_t dm_record_error(const unsigned long long* bad, int64_t n, int op,
                                       const void* ids, int ids_dtype, int64_t bound,
                                       int64_t* record, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (!with_id_type(ids_dtype, [&](auto idx_tag) {
    using Idx = decltype(idx_tag);
    record_kernel<Idx><<<1, 1, 0, stream>>>(bad, n, op, static_cast<const Idx*>(ids), bound,
                                            record);
  }))
    return cudaErrorInvalidValue;
  return cudaGetLastError();
}
