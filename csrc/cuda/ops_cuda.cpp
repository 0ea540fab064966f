// CUDA registrations of the dept_mega ops: argument checks, allocation, stream and error
// handling around the C interface of kernels.h.
//
// UNVERIFIED: built only by the CUDAExtension route of setup.py (torch with CUDA + nvcc),
// which this repository's CI (CPU torch, no GPU) cannot build or run. CI compiles the kernels
// themselves (kernels.cu) with nvcc for sm_90 and syntax-checks this file against torch's
// headers (tools/check_cuda_compile.sh). tests/test_ops.py runs every op on CUDA when a GPU
// is present.
//
// Errors: each op reads the first invalid position back from the device (one small
// synchronising copy) and raises exactly what the CPU op raises. The scatters check before
// writing, so a failed call leaves the table unchanged, as on CPU.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../common.h"
#include "kernels.h"

namespace dept_mega {
namespace {

int row_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DM_FLOAT32;
    case at::kBFloat16: return DM_BFLOAT16;
    case at::kHalf: return DM_FLOAT16;
    default: TORCH_CHECK_TYPE(false, "dept_mega: unsupported row dtype ", c10::toString(t));
  }
}

int id_code(at::ScalarType t) {
  switch (t) {
    case at::kInt: return DM_INT32;
    case at::kLong: return DM_INT64;
    default: TORCH_CHECK_TYPE(false, "dept_mega: unsupported id dtype ", c10::toString(t));
  }
}

void check_cuda(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA error: ", cudaGetErrorString(err));
}

// A device counter initialised to n; kernels lower it to the first invalid position.
at::Tensor new_bad_flag(const at::Tensor& like, int64_t n) {
  return at::full({1}, n, like.options().dtype(at::kLong));
}

unsigned long long* bad_ptr(at::Tensor& flag) {
  return reinterpret_cast<unsigned long long*>(flag.data_ptr<int64_t>());
}

// Position of the first invalid id, or n; synchronises with the stream.
int64_t first_bad(const at::Tensor& flag) { return flag.item<int64_t>(); }

int64_t id_at(const at::Tensor& ids, int64_t flat_pos) {
  return ids.reshape({-1})[flat_pos].item<int64_t>();
}

at::Tensor gather_rows_cuda(const at::Tensor& table_in, const at::Tensor& ids_in,
                            std::optional<at::ScalarType> out_dtype) {
  check_gather_args(table_in, ids_in, out_dtype);
  const c10::cuda::CUDAGuard guard(table_in.device());
  const at::Tensor table = table_in.contiguous();
  const at::Tensor ids = ids_in.contiguous();
  const int64_t n = ids.size(0), rows = table.size(0), dim = table.size(1);
  const at::ScalarType odt = out_dtype.value_or(table.scalar_type());
  at::Tensor out = at::empty({n, dim}, table.options().dtype(odt));
  if (n == 0 || dim == 0) {
    // Still validate the ids so that errors do not depend on the row length.
    if (n > 0) {
      const int64_t lo = ids.min().item<int64_t>(), hi = ids.max().item<int64_t>();
      if (lo < 0 || hi >= rows) {
        const at::Tensor badmask = ids.lt(0).logical_or(ids.ge(rows));
        const int64_t pos = badmask.nonzero()[0][0].item<int64_t>();
        fail_id_out_of_range("gather_rows", pos, id_at(ids, pos), rows);
      }
    }
    return out;
  }
  at::Tensor flag = new_bad_flag(ids, n);
  check_cuda(dm_gather_rows(table.const_data_ptr(), row_code(table.scalar_type()), rows, dim,
                            ids.const_data_ptr(), id_code(ids.scalar_type()), n,
                            out.data_ptr(), row_code(odt), bad_ptr(flag),
                            c10::cuda::getCurrentCUDAStream()),
             "gather_rows");
  const int64_t pos = first_bad(flag);
  if (pos < n) fail_id_out_of_range("gather_rows", pos, id_at(ids, pos), rows);
  return out;
}

void scatter_rows_cuda(const char* op, at::Tensor& out, const at::Tensor& ids_in,
                       const at::Tensor& rows_in, int mode, float alpha) {
  check_scatter_args(op, out, ids_in, rows_in);
  const c10::cuda::CUDAGuard guard(out.device());
  const at::Tensor ids = ids_in.contiguous();
  const at::Tensor src = rows_in.contiguous();
  const int64_t n = ids.size(0), rows = out.size(0), dim = out.size(1);
  if (n == 0) return;
  TORCH_CHECK_VALUE(n < (int64_t{1} << 31), op, ": at most 2^31 - 1 ids per call on CUDA");
  TORCH_CHECK_VALUE(rows <= (int64_t{1} << 32), op, ": at most 2^32 table rows on CUDA");
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const size_t ws_bytes = dm_scatter_workspace_bytes(n, rows);
  at::Tensor ws = at::empty({static_cast<int64_t>(ws_bytes)}, out.options().dtype(at::kByte));
  at::Tensor flag = new_bad_flag(ids, n);
  check_cuda(dm_scatter_prepare(ids.const_data_ptr(), id_code(ids.scalar_type()), n, rows,
                                ws.data_ptr(), ws_bytes, bad_ptr(flag), stream),
             op);
  const int64_t pos = first_bad(flag);
  if (pos < n) fail_id_out_of_range(op, pos, id_at(ids, pos), rows);
  check_cuda(dm_scatter_apply(out.data_ptr(), row_code(out.scalar_type()), rows, dim,
                              src.const_data_ptr(), row_code(src.scalar_type()), n, mode,
                              alpha, ws.const_data_ptr(), stream),
             op);
}

void scatter_add_rows_cuda(at::Tensor out, const at::Tensor& ids, const at::Tensor& rows) {
  scatter_rows_cuda("scatter_add_rows", out, ids, rows, DM_SCATTER_ADD, 1.0f);
}

void scatter_mean_rows_cuda(at::Tensor table, const at::Tensor& ids, const at::Tensor& rows,
                            bool accumulate, double alpha) {
  scatter_rows_cuda("scatter_mean_rows", table, ids, rows,
                    accumulate ? DM_SCATTER_MEAN_ACCUMULATE : DM_SCATTER_MEAN,
                    static_cast<float>(alpha));
}

at::Tensor remap_ids_cuda(const at::Tensor& ids_in, const at::Tensor& lookup_in) {
  check_remap_args(ids_in, lookup_in);
  const c10::cuda::CUDAGuard guard(ids_in.device());
  const at::Tensor ids = ids_in.contiguous();
  const at::Tensor lookup = lookup_in.contiguous();
  at::Tensor out = at::empty_like(ids, at::MemoryFormat::Contiguous);
  const int64_t n = ids.numel(), size = lookup.numel();
  if (n == 0) return out;
  at::Tensor flag = new_bad_flag(ids, n);
  check_cuda(dm_remap_ids(ids.const_data_ptr(), id_code(ids.scalar_type()), n,
                          lookup.const_data_ptr(), id_code(lookup.scalar_type()), size,
                          out.data_ptr(), bad_ptr(flag), c10::cuda::getCurrentCUDAStream()),
             "remap_ids");
  const int64_t pos = first_bad(flag);
  if (pos < n) {
    const int64_t id = id_at(ids, pos);
    if (id < 0 || id >= size) fail_remap_out_of_range(pos, id, size);
    fail_remap_missing(pos, id, lookup[id].item<int64_t>());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dept_mega, CUDA, m) {
  m.impl("gather_rows", &gather_rows_cuda);
  m.impl("scatter_add_rows_", &scatter_add_rows_cuda);
  m.impl("scatter_mean_rows_", &scatter_mean_rows_cuda);
  m.impl("remap_ids", &remap_ids_cuda);
}

}  // namespace dept_mega
