// The ranked id remap (dm_remap_ranked, kernels.h): global -> local ids through vocabulary
// ranks (../constants.h, DM_RANK_BITS) instead of a lookup table. No torch headers.
//
// Why: a lookup table over a 250,112-id vocabulary is 2 MB of int64, and every id is a random
// read of it (a 32-byte sector fetched for 8 bytes) on top of the streamed ids and output. The
// ranks of the same vocabulary are ceil(V / 32) words, 62.5 KB: they fit in shared memory, so
// every lookup becomes a shared-memory read plus a popcount, and the kernel streams ids in and
// local ids out like a copy.
//
// One launch: each block stages the words in dynamic shared memory (opt-in size, set once per
// device and kernel) or, where that does not pay or does not fit, reads them from global memory
// through the read-only path (62.5 KB stays in L1 / L2). Each thread takes kItems ids a block
// width apart per step (coalesced loads and stores), loads all of them, then all their words,
// before the dependent arithmetic and stores: several loads in flight per thread.
// Invalid ids: the block's lowest invalid position in shared memory, then finish_call
// (call_record.cuh) as the lookup remap does; a non-member is recorded with value -1, the value
// the equivalent lookup holds, so check_errors raises the lookup path's very error.
//
// Staging choice (DM_STAGE_AUTO): a staged block first reads all the words (from L2 after the
// first blocks), so a staged launch uses a grid of at most the resident blocks (grid-stride
// loop) and stages only when those reads are at most 1 / kStageShare of the bytes the call
// streams (ids in + local ids out). 2^25 int64 ids on 132 SMs x 3 blocks: 25 MB staged against
// 512 MB streamed -> staged. A training micro-batch of 8 x 2048 ids (8 blocks): 0.5 MB of
// staging for 0.25 MB of ids -> global reads; the words are then the only random reads and,
// 32x smaller than the lookup, stay cached.
#include <stdint.h>

#include <mutex>
#include <vector>

#include "call_record.cuh"
#include "kernels.h"

namespace {

constexpr int kBlock = 512;  // 3 blocks of 512 with 62.5 KB of words each fit an sm_90 SM
constexpr int kItems = 4;    // ids per thread and loop step
constexpr int64_t kMaxBlocks = int64_t{1} << 20;
constexpr int64_t kStageShare = 4;
static_assert(DM_RANK_BITS == 32, "the kernel's bitmap is the word's low 32 bits");

template <typename Idx, bool kStaged>
__global__ void __launch_bounds__(kBlock)
    ranked_kernel(const Idx* __restrict__ ids, int64_t n,
                  const unsigned long long* __restrict__ words, int64_t nwords, int64_t size,
                  Idx* __restrict__ out, DmCallScratch* scratch, int64_t* __restrict__ record) {
  extern __shared__ unsigned long long staged[];
  __shared__ unsigned long long block_bad;
  if constexpr (kStaged) {
#pragma unroll 4
    for (int64_t w = threadIdx.x; w < nwords; w += blockDim.x) staged[w] = __ldg(words + w);
  }
  begin_call(block_bad);  // its barrier also makes the staged words visible to the block
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x * kItems;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.x * kItems + threadIdx.x;
       base < n; base += step) {
    int64_t id[kItems];
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      const int64_t i = base + static_cast<int64_t>(k) * blockDim.x;
      id[k] = i < n ? static_cast<int64_t>(ids[i]) : -1;
    }
    unsigned long long word[kItems];
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      const bool in = id[k] >= 0 && id[k] < size;
      const int64_t w = in ? id[k] >> 5 : 0;
      if constexpr (kStaged) {
        word[k] = in ? staged[w] : 0ull;
      } else {
        word[k] = in ? __ldg(words + w) : 0ull;
      }
    }
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      const int64_t i = base + static_cast<int64_t>(k) * blockDim.x;
      if (i >= n) break;
      const unsigned bits = static_cast<unsigned>(word[k]);
      const unsigned b = static_cast<unsigned>(id[k]) & 31u;
      // word[k] is 0 for an id out of range: no member bit, an error like a non-member, and a
      // 0 written (in range for whatever reads the output before check_errors raises)
      if ((bits >> b) & 1u) {
        out[i] = static_cast<Idx>((word[k] >> 32) + __popc(bits & ((1u << b) - 1u)));
      } else {
        atomicMin(&block_bad, static_cast<unsigned long long>(i));
        out[i] = Idx{0};
      }
    }
  }
  finish_call<Idx>(&block_bad, scratch, n, DM_ERR_REMAP_MISSING, ids, size, MissingValue{},
                   record);
}

// What the launcher needs of a device, read once per device; and, per id dtype, the staged
// kernel's opt-in shared memory (set once) and its occupancy for the last word count.
struct DeviceInfo {
  bool ready = false;
  int sms = 0;
  int optin = 0;  // bytes of shared memory (static + dynamic) a block may opt in to
  bool opted[2] = {false, false};
  int dyn_max[2] = {0, 0};  // the staged kernel's dynamic shared memory limit, set at opt-in
  int64_t occ_bytes[2] = {-1, -1};
  int occ[2] = {0, 0};
};

std::mutex g_mu;
std::vector<DeviceInfo> g_devices;

template <typename Idx>
constexpr int idx_slot() {
  return sizeof(Idx) == 8 ? 1 : 0;
}

// Resident blocks of the staged kernel with `bytes` of words per block (0: cannot stage).
template <typename Idx>
cudaError_t staged_capacity(int dev, size_t bytes, int64_t* resident) {
  *resident = 0;
  const std::lock_guard<std::mutex> lock(g_mu);
  if (g_devices.size() <= static_cast<size_t>(dev)) g_devices.resize(dev + 1);
  DeviceInfo& d = g_devices[dev];
  cudaError_t err;
  if (!d.ready) {
    if ((err = cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, dev)) != cudaSuccess)
      return err;
    if ((err = cudaDeviceGetAttribute(&d.optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev)) !=
        cudaSuccess)
      return err;
    d.ready = true;
  }
  const int s = idx_slot<Idx>();
  if (!d.opted[s]) {
    // the kernel's static shared memory (block_bad) counts against the same opt-in limit
    cudaFuncAttributes attr;
    if ((err = cudaFuncGetAttributes(&attr, ranked_kernel<Idx, true>)) != cudaSuccess) return err;
    d.dyn_max[s] = d.optin - static_cast<int>(attr.sharedSizeBytes);
    err = cudaFuncSetAttribute(ranked_kernel<Idx, true>,
                               cudaFuncAttributeMaxDynamicSharedMemorySize, d.dyn_max[s]);
    if (err != cudaSuccess) return err;
    d.opted[s] = true;
  }
  if (bytes > static_cast<size_t>(d.dyn_max[s])) return cudaSuccess;  // does not fit: global
  if (d.occ_bytes[s] != static_cast<int64_t>(bytes)) {
    int occ = 0;
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, ranked_kernel<Idx, true>, kBlock,
                                                        bytes);
    if (err != cudaSuccess) return err;
    d.occ_bytes[s] = static_cast<int64_t>(bytes);
    d.occ[s] = occ;
  }
  *resident = static_cast<int64_t>(d.occ[s]) * d.sms;
  return cudaSuccess;
}

template <typename Idx>
cudaError_t launch(const Idx* ids, int64_t n, const int64_t* words, int64_t size, Idx* out,
                   int stage, DmCallScratch* scratch, int64_t* record, cudaStream_t stream) {
  const int64_t nwords = (size + DM_RANK_BITS - 1) / DM_RANK_BITS;
  const size_t bytes = static_cast<size_t>(nwords) * sizeof(unsigned long long);
  int64_t want = (n + int64_t{kBlock} * kItems - 1) / (int64_t{kBlock} * kItems);
  if (want > kMaxBlocks) want = kMaxBlocks;
  const auto* w = reinterpret_cast<const unsigned long long*>(words);
  int64_t resident = 0;
  if (stage != DM_STAGE_NEVER && nwords > 0) {
    int dev = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err == cudaSuccess) err = staged_capacity<Idx>(dev, bytes, &resident);
    if (err != cudaSuccess) return err;
  }
  const int64_t grid = want < resident ? want : resident;
  const bool pays = static_cast<double>(grid) * static_cast<double>(bytes) * kStageShare <=
                    static_cast<double>(n) * 2.0 * sizeof(Idx);
  if (resident > 0 && (stage == DM_STAGE_ALWAYS || pays)) {
    ranked_kernel<Idx, true><<<static_cast<unsigned>(grid), kBlock, bytes, stream>>>(
        ids, n, w, nwords, size, out, scratch, record);
  } else {
    ranked_kernel<Idx, false><<<static_cast<unsigned>(want), kBlock, 0, stream>>>(
        ids, n, w, nwords, size, out, scratch, record);
  }
  return cudaGetLastError();
}

}  // namespace

extern "C" cudaError_t dm_remap_ranked(const void* ids, int ids_dtype, int64_t n,
                                       const int64_t* words, int64_t size, void* out, int stage,
                                       DmCallScratch* scratch, int64_t* record,
                                       cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (size < 0 || size >= (int64_t{1} << 31)) return cudaErrorInvalidValue;
  if (stage != DM_STAGE_AUTO && stage != DM_STAGE_NEVER && stage != DM_STAGE_ALWAYS)
    return cudaErrorInvalidValue;
  switch (ids_dtype) {
    case DM_INT32:
      return launch<int32_t>(static_cast<const int32_t*>(ids), n, words, size,
                             static_cast<int32_t*>(out), stage, scratch, record, stream);
    case DM_INT64:
      return launch<int64_t>(static_cast<const int64_t*>(ids), n, words, size,
                             static_cast<int64_t*>(out), stage, scratch, record, stream);
    default:
      return cudaErrorInvalidValue;
  }
}
