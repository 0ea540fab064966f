// The tile of the FP8 cast kernels that cast a kTile x kTile tile of the padded output from
// registers and write both layouts: fp8_cast.cu's cast_kernel and dgelu_cast.cu's
// dgelu_cast_kernel. Each kernel loads (and transforms) its thread's values itself; from the
// values on, the code is this header's, so the two kernels write the same bytes the same way.
//
// One block of kThreads threads per tile (blockIdx.x: row tiles, blockIdx.y: column tiles); a
// thread owns kRowsPerThread consecutive rows x kColsPerThread columns (TileThread). Its values
// become FP8 bytes by cast2 pairs (tile_cast, which also maxes their |v| into the block's amax);
// q gets one 8-byte store per row (tile_store_rows); for q_t the thread packs its 4 rows' bytes of
// each column into a 32-bit word of a shared tile stored transposed ([column][row], pitch kPitch
// bytes: at most 2-way bank conflicts; tile_put_columns), and after a barrier each thread stores
// 16-byte rows of q_t (four lanes write a 64-byte segment of one q_t row; tile_store_transposed),
// so both outputs are written coalesced. VEC false: scalar, bounds-checked stores (cols % 8 or
// out_rows % 16 not 0, or a misaligned pointer). Plain CUDA C++, internal linkage.
#pragma once

#include <stdint.h>

#include "fp8_device.cuh"

namespace {

constexpr int kTile = 64;
constexpr int kThreads = 128;             // 16 row groups of 4 rows x 8 column groups of 8
constexpr int kRowsPerThread = 4;
constexpr int kColsPerThread = 8;
constexpr int kPitch = kTile + 4;         // bytes per transposed tile row (a multiple of 4)

static_assert((kTile / kRowsPerThread) * (kTile / kColsPerThread) == kThreads, "thread layout");
static_assert(kTile * (kTile / 16) == 2 * kThreads, "two 16-byte q_t stores per thread");

// The thread's place: rows row(i) (i < kRowsPerThread), columns gc + k (k < kColsPerThread).
struct TileThread {
  int rg, lc;          // row group (rows 4 rg .. 4 rg + 3 of the tile), first column inside the tile
  int64_t r0, c0, gc;  // the tile's first row and column, the thread's first column (c0 + lc)
  __device__ __forceinline__ int64_t row(int i) const { return r0 + rg * kRowsPerThread + i; }
};

__device__ __forceinline__ TileThread tile_thread() {
  TileThread t;
  t.rg = threadIdx.x / (kTile / kColsPerThread);
  t.lc = (threadIdx.x % (kTile / kColsPerThread)) * kColsPerThread;
  t.r0 = static_cast<int64_t>(blockIdx.x) * kTile;
  t.c0 = static_cast<int64_t>(blockIdx.y) * kTile;
  t.gc = t.c0 + t.lc;
  return t;
}

// b = the FP8 bytes of v * scale; m maxed with the values' |v| bits (zeros outside the tensor
// change nothing).
template <int FMT>
__device__ __forceinline__ void tile_cast(const float (&v)[kRowsPerThread][kColsPerThread], float scale,
                                          uint8_t (&b)[kRowsPerThread][kColsPerThread], int32_t& m) {
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
#pragma unroll
    for (int k = 0; k < kColsPerThread; k += 2) {
      m = max(m, max(dm_abs_bits(v[i][k]), dm_abs_bits(v[i][k + 1])));
      const uint32_t two = cast2<FMT>(v[i][k], v[i][k + 1], scale);
      b[i][k] = static_cast<uint8_t>(two);
      b[i][k + 1] = static_cast<uint8_t>(two >> 8);
    }
  }
}

// The thread's rows of q ([out_rows, cols]; pad rows too: their bytes are the zeros'). VEC:
// cols % 8 == 0, so the 8 columns are all inside or all outside.
template <bool VEC>
__device__ __forceinline__ void tile_store_rows(const uint8_t (&b)[kRowsPerThread][kColsPerThread], uint8_t* q,
                                                const TileThread& t, int64_t cols, int64_t out_rows) {
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int64_t gr = t.row(i);
    if (gr >= out_rows) continue;
    if (VEC) {
      if (t.gc < cols) {
        uint2 w;
        w.x = b[i][0] | (b[i][1] << 8) | (b[i][2] << 16) | (static_cast<uint32_t>(b[i][3]) << 24);
        w.y = b[i][4] | (b[i][5] << 8) | (b[i][6] << 16) | (static_cast<uint32_t>(b[i][7]) << 24);
        *reinterpret_cast<uint2*>(q + gr * cols + t.gc) = w;
      }
    } else {
#pragma unroll
      for (int k = 0; k < kColsPerThread; ++k)
        if (t.gc + k < cols) q[gr * cols + t.gc + k] = b[i][k];
    }
  }
}

// tile[column][row] (kTile * kPitch bytes): one word holds the thread's 4 rows of a column.
__device__ __forceinline__ void tile_put_columns(const uint8_t (&b)[kRowsPerThread][kColsPerThread], uint8_t* tile,
                                                 const TileThread& t) {
#pragma unroll
  for (int k = 0; k < kColsPerThread; ++k) {
    const uint32_t w = b[0][k] | (b[1][k] << 8) | (b[2][k] << 16) | (static_cast<uint32_t>(b[3][k]) << 24);
    *reinterpret_cast<uint32_t*>(tile + (t.lc + k) * kPitch + t.rg * kRowsPerThread) = w;
  }
}

// q_t ([cols, out_rows]) from the shared tile, after a barrier that follows every thread's
// tile_put_columns: 64 q_t rows x 4 chunks of 16 bytes, two per thread. VEC: out_rows % 16 == 0,
// so the 16 rows of a chunk are all inside or all outside.
template <bool VEC>
__device__ __forceinline__ void tile_store_transposed(const uint8_t* tile, uint8_t* qt, const TileThread& t,
                                                      int64_t cols, int64_t out_rows) {
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    const int idx = threadIdx.x + s * kThreads;
    const int col = idx / 4, part = (idx % 4) * 16;
    const int64_t qc = t.c0 + col, qr = t.r0 + part;
    if (qc >= cols) continue;
    const uint8_t* src = tile + col * kPitch + part;
    if (VEC) {
      if (qr < out_rows) {
        const uint32_t* w = reinterpret_cast<const uint32_t*>(src);
        *reinterpret_cast<uint4*>(qt + qc * out_rows + qr) = make_uint4(w[0], w[1], w[2], w[3]);
      }
    } else {
      for (int k = 0; k < 16 && qr + k < out_rows; ++k) qt[qc * out_rows + qr + k] = src[k];
    }
  }
}

}  // namespace
