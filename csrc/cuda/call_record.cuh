// Device helpers of the one-launch error reporting (kernels.h: DmCallScratch and the error
// record), shared by the kernels of kernels.cu (gather, remap, scatters) and remap_ranked.cu.
// Plain CUDA C++, no torch headers. Everything here has internal linkage (each .cu gets its
// own copy; there is no separate device linking).
#pragma once

#include <stdint.h>

#include "kernels.h"

namespace {

constexpr unsigned long long kNoBad = DM_NO_BAD;

// The "lookup value" field of a remap error record: what the lookup holds at a valid id
// that is not in the vocabulary. LookupValue reads the generic table; the ranked form
// (remap_ranked.cu) stands for a table whose non-members are -1 (MissingValue). The ops other
// than the remap never ask (their records hold 0).
template <typename Lut>
struct LookupValue {
  const Lut* __restrict__ lookup;
  __device__ __forceinline__ int64_t operator()(int64_t id) const {
    return lookup == nullptr ? 0 : static_cast<int64_t>(lookup[id]);
  }
};

struct MissingValue {
  __device__ __forceinline__ int64_t operator()(int64_t) const { return -1; }
};

// Writes the error record of an invalid id at position p of a call of op `op` unless the
// record holds an error (kept until check_errors clears it). The code is claimed with
// atomicCAS, so two writers (two streams' calls) never mix their fields. Not inlined: cold.
// For op DM_ERR_REMAP_MISSING the id decides the code: outside [0, bound) it is
// DM_ERR_REMAP_RANGE, else the record carries value_of(id).
template <typename Idx, typename Value>
__device__ __noinline__ void write_record(int64_t p, int op, const Idx* __restrict__ ids,
                                          int64_t bound, Value value_of,
                                          int64_t* __restrict__ record) {
  const int64_t id = static_cast<int64_t>(ids[p]);
  int code = op;
  int64_t value = 0;
  if (op == DM_ERR_REMAP_MISSING) {
    if (id < 0 || id >= bound) {
      code = DM_ERR_REMAP_RANGE;
    } else {
      value = value_of(id);
    }
  }
  if (atomicCAS(reinterpret_cast<unsigned long long*>(record), 0ull,
                static_cast<unsigned long long>(code)) != 0ull) {
    return;  // an earlier error is kept
  }
  record[1] = p;
  record[2] = id;
  record[3] = bound;
  record[4] = value;
}

// Invalid ids of a gather / remap call (one launch). A thread that meets one lowers either
// scratch->bad itself, then __threadfence() (gather), or its block's lowest position
// `block_bad` in shared memory (remap), which begin_call sets to kNoBad before a barrier: the
// split that costs fewest registers (ptxas -v, sm_90; a per-thread minimum carried through the
// loop cost the gather 8 to 14). finish_call ends the kernel, called by every thread of every
// block (it has a barrier: no thread may return before it): thread 0 lowers scratch->bad to
// *block_bad (when given) and counts the block as done (threadFenceReduction pattern); the
// thread 0 that counts the grid's last block reads the call's lowest invalid position, writes
// the record if there is one, and resets the scratch to {kNoBad, 0} for the stream's next call.
__device__ __forceinline__ void begin_call(unsigned long long& block_bad) {
  if (threadIdx.x == 0) block_bad = kNoBad;
  __syncthreads();
}

template <typename Idx, typename Value>
__device__ __forceinline__ void finish_call(const unsigned long long* block_bad,
                                            DmCallScratch* scratch, int64_t n, int op,
                                            const Idx* __restrict__ ids, int64_t bound,
                                            Value value_of, int64_t* __restrict__ record) {
  __syncthreads();  // the block's atomicMin (shared, or global and fenced) are all done
  if (threadIdx.x != 0) return;
  if (block_bad != nullptr && *block_bad != kNoBad) atomicMin(&scratch->bad, *block_bad);
  // Release: the block's invalid positions are visible device-wide before it counts as done.
  __threadfence();
  const unsigned long long done = atomicAdd(&scratch->blocks, 1ull);
  if (done != static_cast<unsigned long long>(gridDim.x) - 1) return;
  // The last block. Acquire: every block lowered scratch->bad before its count, so the
  // exchange reads the call's lowest invalid position.
  __threadfence();
  const unsigned long long b = atomicExch(&scratch->bad, kNoBad);
  atomicExch(&scratch->blocks, 0ull);
  if (b < static_cast<unsigned long long>(n)) {
    write_record<Idx, Value>(static_cast<int64_t>(b), op, ids, bound, value_of, record);
  }
}

}  // namespace
