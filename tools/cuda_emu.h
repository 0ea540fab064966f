// A host emulation of the CUDA features the kernels of csrc/cuda use, to run a kernel's own
// source on the CPU (tools/cuda_emu.py): one std::thread per CUDA thread, one block at a time;
// __shared__ variables are function statics (one block at a time shares them), __syncthreads is
// a barrier of the block's threads, a warp shuffle is an exchange through memory between two
// barriers of the warp's 32 threads (so every lane must take part, as with a full mask). The
// intrinsics are the host's IEEE operations (rsqrtf: 1 / sqrtf, not the GPU's approximation;
// sm_89's FP8 conversion: the kernels' own portable fallback, as __CUDA_ARCH__ is undefined).
// For checking a kernel's indexing, synchronisation and arithmetic without a GPU, not its speed.
#pragma once

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#undef __shared__
#undef __launch_bounds__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)

struct EmuDim3 {
  unsigned x = 0, y = 0, z = 0;
};
inline thread_local EmuDim3 threadIdx, blockIdx, gridDim;

struct EmuBlock {
  explicit EmuBlock(unsigned threads) : block_bar(threads), warps(threads / 32) {
    for (auto& w : warps) w.bar = std::make_unique<std::barrier<>>(32);
  }
  std::barrier<> block_bar;
  struct Warp {
    std::unique_ptr<std::barrier<>> bar;
    uint64_t slot[32];
  };
  std::vector<Warp> warps;
};
inline thread_local EmuBlock* emu_block;

inline void __syncthreads() { emu_block->block_bar.arrive_and_wait(); }

// lane's value of the warp's lane src
template <typename V>
inline V emu_shfl(V v, int src) {
  static_assert(sizeof(V) <= 8, "a shuffle moves at most 8 bytes");
  auto& w = emu_block->warps[threadIdx.x / 32];
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(V));
  w.slot[threadIdx.x % 32] = bits;
  w.bar->arrive_and_wait();
  const uint64_t got = w.slot[src];
  w.bar->arrive_and_wait();
  V r;
  std::memcpy(&r, &got, sizeof(V));
  return r;
}
template <typename V>
inline V __shfl_down_sync(unsigned, V v, int o) {
  const int lane = threadIdx.x % 32;
  return emu_shfl(v, lane + o < 32 ? lane + o : lane);
}
template <typename V>
inline V __shfl_xor_sync(unsigned, V v, int o) {
  return emu_shfl(v, static_cast<int>(threadIdx.x % 32) ^ o);
}
template <typename V>
inline V __shfl_sync(unsigned, V v, int src) {
  return emu_shfl(v, src);
}

template <typename V>
inline V __ldg(const V* p) { return *p; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fmaf(a, b, c); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline int max(int a, int b) { return a > b ? a : b; }
inline std::mutex emu_atomic_mutex;
inline int atomicMax(int* p, int v) {
  const std::lock_guard<std::mutex> lock(emu_atomic_mutex);
  const int old = *p;
  if (v > old) *p = v;
  return old;
}

// Runs body() as grid.x * grid.y blocks of threads threads, one block after another (blockIdx.x
// fastest).
template <typename Body>
void emu_launch(EmuDim3 grid, unsigned threads, Body body) {
  for (unsigned y = 0; y < grid.y; ++y) {
    for (unsigned x = 0; x < grid.x; ++x) {
      EmuBlock block(threads);
      std::vector<std::thread> ts;
      ts.reserve(threads);
      for (unsigned t = 0; t < threads; ++t)
        ts.emplace_back([&, t, x, y] {
          threadIdx.x = t;
          blockIdx.x = x;
          blockIdx.y = y;
          gridDim = grid;
          emu_block = &block;
          body();
        });
      for (auto& th : ts) th.join();
    }
  }
}

// A one-dimensional grid of grid blocks.
template <typename Body>
void emu_launch(unsigned grid, unsigned threads, Body body) {
  emu_launch(EmuDim3{grid, 1, 1}, threads, body);
}
