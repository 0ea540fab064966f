// CPU kernels of the dept_mega ops, parallel over rows with at::parallel_for.
//
// Determinism of the scatters: the ids are grouped by destination row (counting sort, or a
// stable sort when the table is much larger than the id list), and each destination row is
// produced by exactly one task, which adds its contributions in the fixed order of
// csrc/cuda/kernels.h (ascending position, in chunks of DM_SCATTER_CHUNK: chunk 0 added to
// the start value element by element, each later chunk summed from 0 and then added) in
// fp32. The result therefore does not depend on the number of threads, and equals the CUDA
// kernel and the pure PyTorch fallback bit for bit.
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstring>
#include <limits>
#include <numeric>
#include <tuple>
#include <type_traits>
#include <vector>

#include "../common.h"
#include "../fp8_gemm.h"

namespace dept_mega {
namespace {

// Calls f(T{}) for the row dtypes (float32, bfloat16, float16).
template <typename F>
void dispatch_rows(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK_TYPE(false, "dept_mega: unsupported row dtype ", c10::toString(t));
  }
}

template <typename F>
void dispatch_ids(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kInt: f(int32_t{}); break;
    case at::kLong: f(int64_t{}); break;
    default: TORCH_CHECK_TYPE(false, "dept_mega: unsupported id dtype ", c10::toString(t));
  }
}

// Rows per parallel task so that a task moves ~32k elements.
inline int64_t row_grain(int64_t dim) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(dim, 1)); }

// Data errors (an invalid id) are never thrown here: the kernel writes the error record of
// csrc/constants.h, {code, position, id, bound, lookup value}, into the calling thread's record
// and returns (a scatter without writing; a gather / remap with 0 at each invalid position, a zero
// row for a gather, so that a caller that defers the error never reads an id out of range), as the
// CUDA kernels write their device's record. dept_mega.ops reads the record right after the call
// and raises the error that dept_mega.ops.recorded_error decodes (the same function and messages
// for both backends). Why not throw: on the GPU machine's build (torch 2.11, /opt/gcc g++) a C++
// exception thrown from these kernels ended the process with SIGSEGV (tests/test_ops_cpp_errors.py).
// One record per calling thread (the kernels run on the caller's thread; the parallel_for
// workers only compute the position), so two Python threads never see each other's errors.
int64_t* thread_record() {
  thread_local int64_t record[DM_ERR_RECORD_LEN] = {};
  return record;
}

// Keeps the first error since the last check (a later one is dropped), as the CUDA record does.
void record_error(int code, int64_t pos, int64_t id, int64_t bound, int64_t value) {
  int64_t* r = thread_record();
  if (r[0] != DM_ERR_NONE) return;
  r[1] = pos;
  r[2] = id;
  r[3] = bound;
  r[4] = value;
  r[0] = code;
}

// The position of the first id outside [0, num_rows), n if none. Sequential: O(n), small next
// to the rows.
template <typename idx_t>
int64_t first_out_of_range(const idx_t* ids, int64_t n, int64_t num_rows) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t id = static_cast<int64_t>(ids[i]);
    if (id < 0 || id >= num_rows) return i;
  }
  return n;
}

// Records the first id outside [0, num_rows) under `code`; false when there is one.
template <typename idx_t>
bool ids_in_range(int code, const idx_t* ids, int64_t n, int64_t num_rows) {
  const int64_t pos = first_out_of_range(ids, n, num_rows);
  if (pos == n) return true;
  record_error(code, pos, static_cast<int64_t>(ids[pos]), num_rows, 0);
  return false;
}

at::Tensor gather_rows_cpu(const at::Tensor& table_in, const at::Tensor& ids_in,
                           std::optional<at::ScalarType> out_dtype) {
  check_gather_args(table_in, ids_in, out_dtype);
  const at::Tensor table = table_in.contiguous();
  const at::Tensor ids = ids_in.contiguous();
  const int64_t n = ids.size(0), num_rows = table.size(0), dim = table.size(1);
  const at::ScalarType odt = out_dtype.value_or(table.scalar_type());
  at::Tensor out = at::empty({n, dim}, table.options().dtype(odt));
  if (n == 0) return out;
  dispatch_ids(ids.scalar_type(), [&](auto idx_tag) {
    using idx_t = decltype(idx_tag);
    const idx_t* id_ptr = ids.const_data_ptr<idx_t>();
    ids_in_range(DM_ERR_GATHER, id_ptr, n, num_rows);  // an invalid id's row: zeros, below
    dispatch_rows(table.scalar_type(), [&](auto in_tag) {
      using in_t = decltype(in_tag);
      dispatch_rows(odt, [&](auto out_tag) {
        using out_t = decltype(out_tag);
        const in_t* src = table.const_data_ptr<in_t>();
        out_t* dst = out.data_ptr<out_t>();
        at::parallel_for(0, n, row_grain(dim), [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i) {
            const int64_t id = static_cast<int64_t>(id_ptr[i]);
            out_t* d = dst + i * dim;
            if (id < 0 || id >= num_rows) {
              std::memset(d, 0, sizeof(out_t) * dim);  // +0 in the three float dtypes
              continue;
            }
            const in_t* s = src + id * dim;
            if constexpr (std::is_same_v<in_t, out_t>) {
              std::memcpy(d, s, sizeof(in_t) * dim);
            } else {
              // Through float: exact for the narrow types, one round-to-nearest-even on
              // the way out, as torch's .to(dtype).
              for (int64_t j = 0; j < dim; ++j) d[j] = static_cast<out_t>(static_cast<float>(s[j]));
            }
          }
        });
      });
    });
  });
  return out;
}

// Positions 0..n-1 grouped by destination row; within a row, ascending position.
// seg[k]..seg[k+1] is the k-th group in `order`.
template <typename idx_t>
void group_by_row(const idx_t* ids, int64_t n, int64_t num_rows, std::vector<int64_t>& order,
                  std::vector<int64_t>& seg) {
  order.resize(n);
  seg.clear();
  if (num_rows <= 4 * n + 4096) {
    // Counting sort: stable by construction.
    std::vector<int64_t> start(num_rows + 1, 0);
    for (int64_t i = 0; i < n; ++i) ++start[static_cast<int64_t>(ids[i]) + 1];
    for (int64_t r = 0; r < num_rows; ++r) start[r + 1] += start[r];
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t i = 0; i < n; ++i) order[fill[static_cast<int64_t>(ids[i])]++] = i;
    for (int64_t r = 0; r < num_rows; ++r)
      if (start[r + 1] > start[r]) seg.push_back(start[r]);
  } else {
    std::iota(order.begin(), order.end(), int64_t{0});
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return ids[a] < ids[b]; });
    for (int64_t k = 0; k < n; ++k)
      if (k == 0 || ids[order[k]] != ids[order[k - 1]]) seg.push_back(k);
  }
  seg.push_back(n);
}

enum class ScatterMode { kAdd, kMeanReplace, kMeanAccumulate };

// Shared by scatter_add_rows_ and scatter_mean_rows_ (error record code `code`). Validates
// every id before writing.
void scatter_rows_cpu(const char* op, int code, at::Tensor& out, const at::Tensor& ids_in,
                      const at::Tensor& rows_in, ScatterMode mode, float alpha) {
  check_scatter_args(op, out, ids_in, rows_in);
  const at::Tensor ids = ids_in.contiguous();
  at::Tensor rows = rows_in.contiguous();  // over the table's memory: read as before the call
  if (at::get_overlap_status(out, rows) != at::MemOverlapStatus::No) rows = rows.clone();
  const int64_t n = ids.size(0), num_rows = out.size(0), dim = out.size(1);
  if (n == 0) return;
  std::vector<int64_t> order, seg;
  dispatch_ids(ids.scalar_type(), [&](auto idx_tag) {
    using idx_t = decltype(idx_tag);
    const idx_t* id_ptr = ids.const_data_ptr<idx_t>();
    if (!ids_in_range(code, id_ptr, n, num_rows)) return;  // the table unchanged
    group_by_row(id_ptr, n, num_rows, order, seg);
    const int64_t nseg = static_cast<int64_t>(seg.size()) - 1;
    // Destination rows per task: ~32k accumulated elements (rows per segment x dim).
    const int64_t per_segment = std::max<int64_t>(1, n / std::max<int64_t>(nseg, 1));
    const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, per_segment * dim));
    dispatch_rows(out.scalar_type(), [&](auto out_tag) {
      using out_t = decltype(out_tag);
      dispatch_rows(rows.scalar_type(), [&](auto row_tag) {
        using row_t = decltype(row_tag);
        out_t* dst = out.data_ptr<out_t>();
        const row_t* src = rows.const_data_ptr<row_t>();
        at::parallel_for(0, nseg, grain, [&](int64_t begin, int64_t end) {
          std::vector<float> acc(dim), part(dim);
          for (int64_t k = begin; k < end; ++k) {
            const int64_t first = seg[k], last = seg[k + 1];
            const int64_t r = static_cast<int64_t>(id_ptr[order[first]]);
            out_t* d = dst + r * dim;
            // Adds the contributions of [first, last) to `into` in the fixed chunked order.
            auto reduce = [&](float* into) {
              const int64_t head = std::min(last, first + DM_SCATTER_CHUNK);
              for (int64_t p = first; p < head; ++p) {
                const row_t* s = src + order[p] * dim;
                for (int64_t j = 0; j < dim; ++j) into[j] += static_cast<float>(s[j]);
              }
              for (int64_t c = head; c < last; c += DM_SCATTER_CHUNK) {
                std::fill(part.begin(), part.end(), 0.0f);
                for (int64_t p = c; p < std::min(last, c + DM_SCATTER_CHUNK); ++p) {
                  const row_t* s = src + order[p] * dim;
                  for (int64_t j = 0; j < dim; ++j) part[j] += static_cast<float>(s[j]);
                }
                for (int64_t j = 0; j < dim; ++j) into[j] += part[j];
              }
            };
            if constexpr (std::is_same_v<out_t, float>) {
              if (mode == ScatterMode::kAdd) {
                reduce(d);  // fp32 table: accumulate in place, the same operations
                continue;
              }
            }
            if (mode == ScatterMode::kAdd) {
              for (int64_t j = 0; j < dim; ++j) acc[j] = static_cast<float>(d[j]);
            } else {
              std::fill(acc.begin(), acc.end(), 0.0f);
            }
            reduce(acc.data());
            if (mode == ScatterMode::kAdd) {
              for (int64_t j = 0; j < dim; ++j) d[j] = static_cast<out_t>(acc[j]);
            } else {
              // alpha * (sum / count) [+ old], each step rounded in fp32 (no FMA: built
              // with -ffp-contract=off), as the fallback and the CUDA kernel do.
              const float count = static_cast<float>(last - first);
              if (mode == ScatterMode::kMeanReplace) {
                for (int64_t j = 0; j < dim; ++j)
                  d[j] = static_cast<out_t>(alpha * (acc[j] / count));
              } else {
                for (int64_t j = 0; j < dim; ++j)
                  d[j] = static_cast<out_t>(static_cast<float>(d[j]) + alpha * (acc[j] / count));
              }
            }
          }
        });
      });
    });
  });
}

void scatter_add_rows_cpu(at::Tensor out, const at::Tensor& ids, const at::Tensor& rows) {
  scatter_rows_cpu("scatter_add_rows", DM_ERR_SCATTER_ADD, out, ids, rows, ScatterMode::kAdd,
                   1.0f);
}

void scatter_mean_rows_cpu(at::Tensor table, const at::Tensor& ids, const at::Tensor& rows,
                           bool accumulate, double alpha) {
  scatter_rows_cpu("scatter_mean_rows", DM_ERR_SCATTER_MEAN, table, ids, rows,
                   accumulate ? ScatterMode::kMeanAccumulate : ScatterMode::kMeanReplace,
                   static_cast<float>(alpha));
}

// The remap of both operators: dst[i] = value(src[i]), where value(id) for an id in [0, size) is
// its local id, < 0 for a non-member. Chunks in parallel; the error recorded is the lowest
// position's (out of range, or the non-member with its value), as the CUDA kernels record it.
// An invalid position gets 0 and the chunk goes on: every valid position is written.
template <typename idx_t, typename Value>
void remap_each(const idx_t* src, idx_t* dst, int64_t n, int64_t size, const Value& value) {
  std::atomic<int64_t> first_bad{n};
  at::parallel_for(0, n, 16384, [&](int64_t begin, int64_t end) {
    bool seen = false;  // a chunk's first invalid position is its lowest
    for (int64_t i = begin; i < end; ++i) {
      const int64_t id = static_cast<int64_t>(src[i]);
      const int64_t v = (id >= 0 && id < size) ? value(id) : -1;
      if (v < 0) {
        dst[i] = 0;
        if (!seen) {
          seen = true;
          int64_t cur = first_bad.load();
          while (i < cur && !first_bad.compare_exchange_weak(cur, i)) {
          }
        }
        continue;
      }
      dst[i] = static_cast<idx_t>(v);
    }
  });
  const int64_t pos = first_bad.load();
  if (pos < n) {
    const int64_t id = static_cast<int64_t>(src[pos]);
    if (id < 0 || id >= size) {
      record_error(DM_ERR_REMAP_RANGE, pos, id, size, 0);
    } else {
      record_error(DM_ERR_REMAP_MISSING, pos, id, size, value(id));
    }
  }
}

at::Tensor remap_ids_cpu(const at::Tensor& ids_in, const at::Tensor& lookup_in) {
  check_remap_args(ids_in, lookup_in);
  const at::Tensor ids = ids_in.contiguous();
  const at::Tensor lookup = lookup_in.contiguous();
  at::Tensor out = at::empty_like(ids, at::MemoryFormat::Contiguous);
  const int64_t n = ids.numel(), size = lookup.numel();
  if (n == 0) return out;
  dispatch_ids(ids.scalar_type(), [&](auto idx_tag) {
    using idx_t = decltype(idx_tag);
    dispatch_ids(lookup.scalar_type(), [&](auto lut_tag) {
      using lut_t = decltype(lut_tag);
      const lut_t* lut = lookup.const_data_ptr<lut_t>();
      remap_each(ids.const_data_ptr<idx_t>(), out.data_ptr<idx_t>(), n, size,
                 [lut](int64_t id) { return static_cast<int64_t>(lut[id]); });
    });
  });
  return out;
}

// Set bits of x, branch-free (SWAR): __builtin_popcount is a libgcc call without -mpopcnt.
inline uint32_t popcount32(uint32_t x) {
  x = x - ((x >> 1) & 0x55555555u);
  x = (x & 0x33333333u) + ((x >> 2) & 0x33333333u);
  x = (x + (x >> 4)) & 0x0F0F0F0Fu;
  return (x * 0x01010101u) >> 24;
}

// remap_ids through vocabulary ranks (constants.h): member v -> (word >> 32) + the set bits
// below v's in its word; the errors of the equivalent lookup (a non-member's value is -1).
at::Tensor remap_ranked_cpu(const at::Tensor& ids_in, const at::Tensor& words_in, int64_t size,
                            int64_t stage) {
  check_remap_ranked_args(ids_in, words_in, size, stage);
  const at::Tensor ids = ids_in.contiguous();
  const at::Tensor words = words_in.contiguous();
  at::Tensor out = at::empty_like(ids, at::MemoryFormat::Contiguous);
  const int64_t n = ids.numel();
  if (n == 0) return out;
  const uint64_t* wp = reinterpret_cast<const uint64_t*>(words.const_data_ptr<int64_t>());
  dispatch_ids(ids.scalar_type(), [&](auto idx_tag) {
    using idx_t = decltype(idx_tag);
    remap_each(ids.const_data_ptr<idx_t>(), out.data_ptr<idx_t>(), n, size, [wp](int64_t id) {
      const uint64_t w = wp[id / DM_RANK_BITS];
      const uint32_t bits = static_cast<uint32_t>(w), b = static_cast<uint32_t>(id) & 31u;
      if (!((bits >> b) & 1u)) return int64_t{-1};
      return static_cast<int64_t>((w >> 32) + popcount32(bits & ((1u << b) - 1u)));
    });
  });
  return out;
}

// cast_fp8: the bytes of csrc/fp8_cast.h, elementwise, so the result does not depend on the
// thread count. The amax (max of |x|, NaN propagating) is an int max of the magnitudes' bits.
// Tiles of kCastTile x kCastTile elements: each is encoded once into a local buffer and written
// row-major (q) and transposed (q_t) from there.
constexpr int64_t kCastTile = 64;

// The value cast for one input element: the element, or (GELU) GELU of it rounded to T (c10's
// BFloat16 / Half conversions round to nearest even), as the reference F.gelu(t) gives.
template <typename T, bool GELU>
inline float cast_input(T v) {
  const float f = static_cast<float>(v);
  if constexpr (GELU) {
    return static_cast<float>(static_cast<T>(dm_gelu(f)));
  } else {
    return f;
  }
}

template <typename T, bool GELU>
int32_t amax_bits_cpu(const T* x, int64_t n) {
  return at::parallel_reduce(
      int64_t{0}, n, int64_t{32768}, int32_t{0},
      [&](int64_t begin, int64_t end, int32_t acc) {
        for (int64_t i = begin; i < end; ++i)
          acc = std::max(acc, dm_abs_bits(cast_input<T, GELU>(x[i])));
        return acc;
      },
      [](int32_t a, int32_t b) { return std::max(a, b); });
}

template <typename T, bool GELU>
void cast_tiles_cpu(const T* x, int64_t rows, int64_t cols, int64_t out_rows, float scale,
                    const DmFp8Format& fmt, uint8_t* q, uint8_t* qt) {
  const int64_t tiles = (out_rows + kCastTile - 1) / kCastTile;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> tile(kCastTile * kCastTile);
    for (int64_t tr = begin; tr < end; ++tr) {
      const int64_t r0 = tr * kCastTile, nr = std::min(kCastTile, out_rows - r0);
      for (int64_t c0 = 0; c0 < cols; c0 += kCastTile) {
        const int64_t nc = std::min(kCastTile, cols - c0);
        for (int64_t i = 0; i < nr; ++i) {
          const int64_t r = r0 + i;
          uint8_t* dst = tile.data() + i * kCastTile;
          if (r < rows) {
            const T* src = x + r * cols + c0;
            for (int64_t j = 0; j < nc; ++j) dst[j] = dm_fp8_cast_one(cast_input<T, GELU>(src[j]), scale, fmt);
          } else {  // a pad row: zeros cast as the reference casts them (0 * scale)
            for (int64_t j = 0; j < nc; ++j) dst[j] = dm_fp8_cast_one(0.0f, scale, fmt);
          }
          if (q != nullptr) std::memcpy(q + r * cols + c0, dst, static_cast<size_t>(nc));
        }
        if (qt != nullptr) {
          for (int64_t j = 0; j < nc; ++j) {
            uint8_t* dst = qt + (c0 + j) * out_rows + r0;
            for (int64_t i = 0; i < nr; ++i) dst[i] = tile[i * kCastTile + j];
          }
        }
      }
    }
  });
}

// slot = max(slot, amax), NaN propagating: the int max of the bits
void record_amax(const std::optional<at::Tensor>& amax_out, int64_t amax_index, int32_t amax) {
  int32_t* slot = reinterpret_cast<int32_t*>(amax_out->data_ptr<float>() + amax_index);
  *slot = std::max(*slot, amax);
}

template <typename T, bool GELU>
void cast_fp8_typed(const T* x, int64_t rows, int64_t cols, int64_t out_rows, const DmFp8Format& fmt,
                    const std::optional<at::Tensor>& scale, int64_t scale_index,
                    const std::optional<at::Tensor>& amax_out, int64_t amax_index, at::Tensor& inv,
                    uint8_t* q, uint8_t* qt) {
  const bool record = amax_out.has_value();
  // the amax is needed by current scaling and by a recording cast
  const int32_t amax = (!scale.has_value() || record) ? amax_bits_cpu<T, GELU>(x, rows * cols) : 0;
  float s;
  if (scale.has_value()) {
    s = scale->const_data_ptr<float>()[scale_index];
  } else {
    s = dm_fp8_current_scale(dm_u2f(static_cast<uint32_t>(amax)), fmt.fmax);
    inv = at::empty({}, at::TensorOptions().dtype(at::kFloat));
    *inv.data_ptr<float>() = dm_reciprocal(s);
  }
  if (record) record_amax(amax_out, amax_index, amax);
  cast_tiles_cpu<T, GELU>(x, rows, cols, out_rows, s, fmt, q, qt);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cast_fp8_cpu(
    const at::Tensor& t_in, at::ScalarType dtype, int64_t pad, bool rowwise, bool colwise,
    const std::optional<at::Tensor>& scale, int64_t scale_index,
    const std::optional<at::Tensor>& amax_out, int64_t amax_index, bool gelu) {
  const DmFp8Format fmt =
      dm_fp8_format(check_cast_fp8_args(t_in, dtype, pad, scale, scale_index, amax_out, amax_index));
  const at::Tensor t = t_in.contiguous();
  const int64_t rows = t.size(0), cols = t.size(1), out_rows = rows + pad;
  at::Tensor q, qt, inv;  // undefined: None in Python
  if (rowwise) q = at::empty({out_rows, cols}, t.options().dtype(dtype));
  if (colwise) qt = at::empty({cols, out_rows}, t.options().dtype(dtype));
  uint8_t* qp = rowwise ? reinterpret_cast<uint8_t*>(q.data_ptr()) : nullptr;
  uint8_t* qtp = colwise ? reinterpret_cast<uint8_t*>(qt.data_ptr()) : nullptr;
  dispatch_rows(t.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, float>) {
      const T* x = t.const_data_ptr<T>();
      if (gelu) {
        cast_fp8_typed<T, true>(x, rows, cols, out_rows, fmt, scale, scale_index, amax_out, amax_index, inv, qp, qtp);
      } else {
        cast_fp8_typed<T, false>(x, rows, cols, out_rows, fmt, scale, scale_index, amax_out, amax_index, inv, qp, qtp);
      }
    }
  });
  return {q, qt, inv};
}

// layernorm_cast_fp8: per row (in parallel) the statistics in double (two passes: the mean, then
// the biased variance around it), mean and rstd = 1 / sqrt(var + eps) in fp32 as PyTorch's CPU
// kernel keeps them, y = fma(fma(x, rstd, -rstd * mean), w, b) in fp32 (PyTorch's vectorised CPU
// kernel computes (x * rstd + (-rstd * mean)) * w + b with FMAs: a one-column row gives its
// noise too; without a bias no + 0, which would turn -0 into +0) rounded to T into a temporary;
// then the cast of that temporary as cast_fp8 with a delayed scale. The statistics are returned
// [rows, 1] in W, as aten::native_layer_norm gives them on the CPU (T, or float32 for float32
// parameters: its backward wants that dtype there).
template <typename T, typename W>
void layernorm_rows_cpu(const T* x, const W* w, const W* b, int64_t rows, int64_t cols, float eps,
                        T* y, W* mean_out, W* rstd_out) {
  at::parallel_for(0, rows, row_grain(cols), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * cols;
      double sum = 0.0;
      for (int64_t j = 0; j < cols; ++j) sum += static_cast<double>(static_cast<float>(xr[j]));
      const double mean_d = sum / static_cast<double>(cols);
      double sq = 0.0;
      for (int64_t j = 0; j < cols; ++j) {
        const double d = static_cast<double>(static_cast<float>(xr[j])) - mean_d;
        sq += d * d;
      }
      const float mean = static_cast<float>(mean_d);
      const float var = static_cast<float>(sq / static_cast<double>(cols));
      const float rstd = 1.0f / std::sqrt(var + eps);
      const float shift = -rstd * mean;
      T* yr = y + r * cols;
      for (int64_t j = 0; j < cols; ++j) {
        const float t = std::fma(static_cast<float>(xr[j]), rstd, shift);
        yr[j] = static_cast<T>(b != nullptr ? std::fma(t, static_cast<float>(w[j]), static_cast<float>(b[j]))
                                            : t * static_cast<float>(w[j]));
      }
      mean_out[r] = static_cast<W>(mean);
      rstd_out[r] = static_cast<W>(rstd);
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> layernorm_cast_fp8_cpu(
    const at::Tensor& x_in, const at::Tensor& weight_in, const std::optional<at::Tensor>& bias_in,
    double eps, at::ScalarType dtype, int64_t pad, bool rowwise, bool colwise,
    const std::optional<at::Tensor>& scale, int64_t scale_index,
    const std::optional<at::Tensor>& amax_out, int64_t amax_index) {
  const DmFp8Format fmt = dm_fp8_format(check_layernorm_cast_fp8_args(
      x_in, weight_in, bias_in, dtype, pad, scale, scale_index, amax_out, amax_index));
  const at::Tensor x = x_in.contiguous();
  const at::Tensor weight = weight_in.contiguous();
  const at::Tensor bias = bias_in.has_value() ? bias_in->contiguous() : at::Tensor();
  const int64_t rows = x.size(0), cols = x.size(1), out_rows = rows + pad;
  at::Tensor q, qt, inv;
  if (rowwise) q = at::empty({out_rows, cols}, x.options().dtype(dtype));
  if (colwise) qt = at::empty({cols, out_rows}, x.options().dtype(dtype));
  at::Tensor y = at::empty_like(x);
  // x's dtype, or float32 with float32 parameters (PyTorch's mixed-type CPU kernel): W below
  at::Tensor mean = at::empty({rows, 1}, x.options().dtype(weight.scalar_type()));
  at::Tensor rstd = at::empty({rows, 1}, x.options().dtype(weight.scalar_type()));
  uint8_t* qp = rowwise ? reinterpret_cast<uint8_t*>(q.data_ptr()) : nullptr;
  uint8_t* qtp = colwise ? reinterpret_cast<uint8_t*>(qt.data_ptr()) : nullptr;
  dispatch_rows(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, float>) {
      dispatch_rows(weight.scalar_type(), [&](auto wtag) {
        using W = decltype(wtag);
        if constexpr (std::is_same_v<W, float> || std::is_same_v<W, T>) {
          layernorm_rows_cpu<T, W>(x.const_data_ptr<T>(), weight.const_data_ptr<W>(),
                                   bias.defined() ? bias.const_data_ptr<W>() : nullptr, rows, cols,
                                   static_cast<float>(eps), y.data_ptr<T>(), mean.data_ptr<W>(),
                                   rstd.data_ptr<W>());
        }
      });
      cast_fp8_typed<T, false>(y.const_data_ptr<T>(), rows, cols, out_rows, fmt, scale, scale_index,
                               amax_out, amax_index, inv, qp, qtp);
    }
  });
  return {q, qt, mean, rstd};
}

// fp8_gemm (csrc/fp8_gemm.h): the product through PyTorch's own CPU kernel of _scaled_mm with
// an fp32 output (both operands converted to fp32 and scaled, one fp32 matmul), oneDNN switched
// off for the call as dept_mega/parallel/fp8.py's _scaled_mm does (its FP8 GEMM is ~200x slower
// at our sizes and computes differently). The bf16 output is that product rounded once, the
// bytes of torch._scaled_mm(out_dtype=bfloat16); accumulation adds it to out in fp32 (a
// bfloat16 out: fp32 sum, rounded once), first=True copies it.
struct MkldnnOff {
  bool was = at::globalContext().userEnabledMkldnn();
  MkldnnOff() { at::globalContext().setUserEnabledMkldnn(false); }
  ~MkldnnOff() { at::globalContext().setUserEnabledMkldnn(was); }
};

at::Tensor fp8_gemm_cpu(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                        const at::Tensor& scale_b, bool use_fast_accum,
                        const std::optional<at::Tensor>& out, bool first, int64_t tune) {
  check_fp8_gemm_args(a, b, scale_a, scale_b, out, first, tune);  // tune: one kernel here
  at::Tensor prod;
  {
    const MkldnnOff off;
    prod = at::_scaled_mm(a, b, scale_a, scale_b, std::nullopt, std::nullopt, at::kFloat,
                          use_fast_accum);
  }
  if (!out.has_value()) return prod.to(at::kBFloat16);
  at::Tensor o = *out;
  if (first) {
    o.copy_(prod);
  } else if (o.scalar_type() == at::kFloat) {
    o.add_(prod);
  } else {
    o.copy_(prod.add_(o.to(at::kFloat)));
  }
  return at::Tensor();  // None: the result is in out
}

// The calling thread's error record as a tensor over its memory (no copy): dept_mega.ops reads
// and clears it after each CPU call. Valid while the thread lives.
at::Tensor error_record_cpu(const at::Tensor& like) {
  TORCH_CHECK_VALUE(like.is_cpu(), "error_record: expected a CPU tensor, got ", like.device());
  return at::from_blob(thread_record(), {DM_ERR_RECORD_LEN}, at::TensorOptions().dtype(at::kLong));
}

}  // namespace

TORCH_LIBRARY_IMPL(dept_mega, CPU, m) {
  m.impl("gather_rows", &gather_rows_cpu);
  m.impl("scatter_add_rows_", &scatter_add_rows_cpu);
  m.impl("scatter_mean_rows_", &scatter_mean_rows_cpu);
  m.impl("remap_ids", &remap_ids_cpu);
  m.impl("remap_ranked", &remap_ranked_cpu);
  m.impl("cast_fp8", &cast_fp8_cpu);
  m.impl("layernorm_cast_fp8", &layernorm_cast_fp8_cpu);
  m.impl("fp8_gemm", &fp8_gemm_cpu);
  m.impl("error_record", &error_record_cpu);
}

}  // namespace dept_mega
