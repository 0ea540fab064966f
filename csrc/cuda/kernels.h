// Thin C interface to the CUDA kernels of dept_mega (csrc/cuda/kernels.cu).
//
// Plain CUDA C++: no torch headers, so the kernels compile with nvcc alone (CI checks them
// with `nvcc -arch=sm_90 -c`, tools/check_cuda_compile.sh). The torch-facing operators in
// csrc/cuda/ops_cuda.cpp allocate memory, pick the stream and turn the reported first bad
// position into the same errors as the CPU operators.
//
// Conventions: every pointer is a device pointer to a contiguous row-major array; `rows` is
// the number of rows of a table, `dim` its row length; dtype codes below. Nothing about an
// invalid id is read back on the host during a call: the kernels write what the message needs
// into a per-device error record int64[DM_ERR_RECORD_LEN] (../constants.h), which the host
// reads when it checks (dept_mega.ops.check_errors). A record that holds an error is kept
// (the first error since the last check), so a later failing call changes nothing.
// - gather / remap: one kernel launch per call. `scratch` is a DmCallScratch that the caller
//   keeps for one stream (set once to {DM_NO_BAD, 0}); the kernel lowers scratch->bad to the
//   call's first invalid position, its last block to finish writes the record and resets the
//   scratch to {DM_NO_BAD, 0}, ready for the stream's next call. Calls that use one scratch
//   must not run concurrently (one stream: they run one after another).
// - scatters: `bad` points to one device uint64 that the caller sets to n before the call; the
//   kernels lower it (atomicMin) to the first invalid position, and dm_record_error copies the
//   error into the record.
#pragma once

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "../constants.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { DM_FLOAT32 = 0, DM_BFLOAT16 = 1, DM_FLOAT16 = 2 };  // row dtypes
enum { DM_INT32 = 0, DM_INT64 = 1 };                         // id dtypes
enum { DM_SCATTER_ADD = 0, DM_SCATTER_MEAN = 1, DM_SCATTER_MEAN_ACCUMULATE = 2 };

// Per-stream state of the one-launch error reporting of gather and remap (16 bytes, device
// memory): the call's lowest invalid position (DM_NO_BAD: none yet) and its finished blocks.
// Both are back at {DM_NO_BAD, 0} when a call's kernel has finished.
typedef struct DmCallScratch {
  unsigned long long bad;
  unsigned long long blocks;
} DmCallScratch;
#define DM_NO_BAD (~0ull)

// DM_SCATTER_CHUNK and the error codes: ../constants.h (shared with the CPU kernels).

// out[i, :] = (out_dtype) table[ids[i], :] for i < n. Rows with an invalid id are not
// written; the first one is recorded (code DM_ERR_GATHER, bound = rows).
cudaError_t dm_gather_rows(const void* table, int table_dtype, int64_t rows, int64_t dim,
                           const void* ids, int ids_dtype, int64_t n, void* out, int out_dtype,
                           DmCallScratch* scratch, int64_t* record, cudaStream_t stream);

// out[i] = lookup[ids[i]] (out has ids' dtype) for i < n; an id outside [0, lookup_size)
// (recorded as DM_ERR_REMAP_RANGE) or with lookup[id] < 0 (DM_ERR_REMAP_MISSING, with the
// value) is invalid and its entry of out is not written.
cudaError_t dm_remap_ids(const void* ids, int ids_dtype, int64_t n, const void* lookup,
                         int lookup_dtype, int64_t lookup_size, void* out,
                         DmCallScratch* scratch, int64_t* record, cudaStream_t stream);

// Ranked remap (remap_ranked.cu): the same as dm_remap_ids for the lookup that the vocabulary
// ranks `words` stand for (layout: ../constants.h, DM_RANK_BITS), one launch.
// An id outside [0, size) is DM_ERR_REMAP_RANGE, a non-member DM_ERR_REMAP_MISSING with value
// -1. stage: DM_STAGE_AUTO lets the launcher choose between the words in shared memory and
// reads from global memory (see remap_ranked.cu), DM_STAGE_NEVER / DM_STAGE_ALWAYS force one
// (tests); ALWAYS falls back to global reads when the words exceed the device's shared memory.
// Limits: 0 <= size < 2^31, nwords = ceil(size / 32).
enum { DM_STAGE_AUTO = -1, DM_STAGE_NEVER = 0, DM_STAGE_ALWAYS = 1 };
cudaError_t dm_remap_ranked(const void* ids, int ids_dtype, int64_t n, const int64_t* words,
                            int64_t size, void* out, int stage, DmCallScratch* scratch,
                            int64_t* record, cudaStream_t stream);

// Deterministic scatter in two calls:
// 1. dm_scatter_prepare validates the ids (lowering `bad`) and sorts positions by
//    destination row (stable radix sort, in `workspace` of
//    dm_scatter_workspace_bytes(n, rows, dim) bytes);
// 2. dm_scatter_apply, which writes nothing when *bad < n (so a failed call leaves the table
//    unchanged without the host looking), reduces each destination row in a fixed order in
//    fp32: its contributions in ascending position order are cut into chunks of
//    DM_SCATTER_CHUNK; start = out[r] (ADD) or 0 (MEAN*); start += chunk 0 element by element;
//    then for k = 1, 2, ...: start += (0 + the rows of chunk k in order). It writes
//    out[r] = start (ADD), alpha * (start / count) (MEAN) or out[r] + alpha * (start / count)
//    (MEAN_ACCUMULATE); every step rounded in fp32 (no FMA), as on CPU. Chunks 1, 2, ... of
//    all rows are summed in parallel, so a heavily repeated id is not a serial loop.
// Limits: n < 2^31, rows < 2^32.
size_t dm_scatter_workspace_bytes(int64_t n, int64_t rows, int64_t dim);
cudaError_t dm_scatter_prepare(const void* ids, int ids_dtype, int64_t n, int64_t rows,
                               int64_t dim, void* workspace, size_t workspace_bytes,
                               unsigned long long* bad, cudaStream_t stream);
cudaError_t dm_scatter_apply(void* out, int out_dtype, int64_t rows, int64_t dim,
                             const void* src, int src_dtype, int64_t n, int mode, float alpha,
                             const void* workspace, const unsigned long long* bad,
                             cudaStream_t stream);

// Scatters: if *bad < n (the call of op `op` found an invalid id) and the record is empty,
// writes the error record: position *bad, ids[*bad] and `bound` (the table rows). One thread,
// no host synchronisation.
cudaError_t dm_record_error(const unsigned long long* bad, int64_t n, int op, const void* ids,
                            int ids_dtype, int64_t bound, int64_t* record, cudaStream_t stream);

// FP8 cast (dept_mega::cast_fp8; the bytes of csrc/fp8_cast.h; kernels in fp8_cast.cu). x:
// [rows, cols] bf16/fp16 (x_dtype DM_BFLOAT16 | DM_FLOAT16), fp8_format DM_FP8_E4M3 |
// DM_FP8_E5M2. Writes q [rows + pad, cols] (when not null) and qt [cols, rows + pad] (when not
// null), pad rows zero before the cast. scale: the fp32 scale (delayed scaling), or null: current
// scaling, which needs `parts` (int32[dm_fp8_amax_parts(rows * cols)], scratch of this call) and
// writes 1/scale to *inv. amax (not null): the input's amax is atomically maxed into *amax. No
// host synchronisation. gelu != 0: the values cast (and their amax) are GELU(x) rounded to
// x's dtype (csrc/fp8_cast.h, dm_gelu). Limits: cols <= dm_fp8_max_cols() (the operator checks).
int dm_fp8_amax_parts(int64_t n);
int64_t dm_fp8_max_cols(void);
cudaError_t dm_fp8_cast(const void* x, int x_dtype, int64_t rows, int64_t cols, int64_t pad,
                        int fp8_format, void* q, void* qt, const float* scale, float* inv,
                        void* parts, float* amax, int gelu, cudaStream_t stream);

// LayerNorm + FP8 cast (dept_mega::layernorm_cast_fp8; layernorm_cast.cu). x [rows, cols]
// bf16/fp16 (x_dtype), weight / bias [cols] (w_dtype: x_dtype or DM_FLOAT32; bias may be null),
// y = LayerNorm(x) * weight + bias in fp32 rounded to x's dtype, cast with the delayed scale
// *scale into q / qt (as dm_fp8_cast, either may be null; pad zero rows), its amax maxed into
// *amax (may be null); mean / rstd (fp32 [rows]) written. One launch, no host synchronisation.
cudaError_t dm_layernorm_cast_fp8(const void* x, int x_dtype, const void* weight, const void* bias,
                                  int w_dtype, int64_t rows, int64_t cols, int64_t pad, float eps,
                                  int fp8_format, void* q, void* qt, const float* scale, float* amax,
                                  float* mean, float* rstd, cudaStream_t stream);

// GELU backward + FP8 cast (dept_mega::dgelu_cast_fp8; dgelu_cast.cu). grad, x [rows, cols] (dtype
// DM_BFLOAT16 | DM_FLOAT16): dh [rows, cols] = gelu_backward(grad, x) (csrc/fp8_cast.h, dm_dgelu)
// rounded to dtype, written; its cast with the delayed scale *scale into q / qt (as dm_fp8_cast,
// either may be null; pad zero rows), its amax maxed into *amax (may be null). One launch, no host
// synchronisation. Limits: cols <= dm_fp8_max_cols() (the operator checks).
cudaError_t dm_dgelu_cast_fp8(const void* grad, const void* x, int dtype, void* dh, int64_t rows, int64_t cols,
                              int64_t pad, int fp8_format, void* q, void* qt, const float* scale, float* amax,
                              cudaStream_t stream);

#ifdef __cplusplus
}
#endif
