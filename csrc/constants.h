// Constants shared by the CPU kernels (csrc/cpu), the CUDA kernels (csrc/cuda) and, by
// value, the PyTorch fallback (dept_mega/ops/fallback.py). Plain C: no torch or CUDA headers.
#pragma once

// Contributions per chunk of the scatters' fixed summation order (see dm_scatter_apply). The
// CPU kernel (csrc/cpu/ops_cpu.cpp) and the fallback (dept_mega/ops/fallback.py, CHUNK) use
// the same value so that every backend gives the same bits.
#define DM_SCATTER_CHUNK 64

// Vocabulary ranks (dept_mega.ops.VocabRanks), the succinct form of a monotone remap table
// (lookup[v] = rank of v in a sorted set of ids, -1 for a non-member) over ids [0, size): int64
// word w = (members below DM_RANK_BITS * w) << 32 | the membership bitmap of ids
// DM_RANK_BITS * w ... DM_RANK_BITS * w + 31 (bit b: id DM_RANK_BITS * w + b). Member v maps to
// (word >> 32) + popcount(bitmap & ((1 << (v % 32)) - 1)).
#define DM_RANK_BITS 32

// Error record: int64[DM_ERR_RECORD_LEN] = {code, position, id, bound, lookup value}; code 0 = no
// error. Codes name the op and the kind of error; dept_mega.ops.recorded_error decodes a record
// into its exception (the messages are dept_mega/ops/fallback.py's). Written by the CUDA kernels
// (one record per device) and the CPU kernels (one per calling thread) instead of throwing.
enum {
  DM_ERR_NONE = 0,
  DM_ERR_GATHER = 1,         // gather_rows: id outside [0, bound)
  DM_ERR_SCATTER_ADD = 2,    // scatter_add_rows: id outside [0, bound)
  DM_ERR_SCATTER_MEAN = 3,   // scatter_mean_rows: id outside [0, bound)
  DM_ERR_REMAP_RANGE = 4,    // remap_ids: global id outside [0, bound = lookup size)
  DM_ERR_REMAP_MISSING = 5   // remap_ids: lookup[id] < 0 (value)
};
#define DM_ERR_RECORD_LEN 5  // int64 entries of a record
