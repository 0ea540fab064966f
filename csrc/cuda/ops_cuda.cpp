// CUDA registrations of the dept_mega ops: argument checks, allocation, stream and error
// handling around the C interface of kernels.h.
//
// UNVERIFIED: built only by the CUDAExtension route of setup.py (torch with CUDA + nvcc),
// which this repository's CI (CPU torch, no GPU) cannot build or run. CI compiles the kernels
// themselves (kernels.cu) with nvcc for sm_90 and syntax-checks this file against torch's
// headers (tools/check_cuda_compile.sh). tests/test_ops.py runs every op on CUDA when a GPU
// is present.
//
// Errors, without a host synchronisation inside a call: each op's kernels lower a per-call
// device counter to the first invalid position, and a one-thread kernel copies what the
// message needs into the device's persistent error record (the first error since the last
// check is kept). dept_mega.ops.check_errors() reads the record (one small copy, at the log
// interval) and raises exactly what the CPU op raises. The scatters' writing kernel reads the
// counter on the device and writes nothing on error, so a failed call leaves the table
// unchanged, as on CPU; a failed gather / remap leaves the rows of the invalid ids unset.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <mutex>
#include <vector>

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

// The persistent error record of a CUDA device (zeros until an op records an error). Kept for
// the life of the process: never freed, so no CUDA call runs in a static destructor.
at::Tensor device_record(const at::Device& device) {
  static std::mutex mu;
  static auto* records = new std::vector<at::Tensor>();
  const std::lock_guard<std::mutex> lock(mu);
  const auto idx = static_cast<size_t>(device.index());
  if (records->size() <= idx) records->resize(idx + 1);
  at::Tensor& rec = (*records)[idx];
  if (!rec.defined()) {
    rec = at::zeros({DM_ERR_RECORD_LEN}, at::TensorOptions().dtype(at::kLong).device(device));
  }
  return rec;
}

// Queues the record of this call's first invalid id (if any) on the current stream.
void record_error(at::Tensor& flag, int64_t n, int op, const at::Tensor& ids, int64_t bound,
                  const at::Tensor* lookup, const char* name) {
  at::Tensor rec = device_record(ids.device());
  check_cuda(dm_record_error(bad_ptr(flag), n, op, ids.const_data_ptr(),
                             id_code(ids.scalar_type()), bound,
                             lookup ? lookup->const_data_ptr() : nullptr,
                             lookup ? id_code(lookup->scalar_type()) : DM_INT64,
                             rec.data_ptr<int64_t>(), c10::cuda::getCurrentCUDAStream()),
             name);
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
  if (n == 0) return out;
  // dim == 0 runs the kernel too: it still validates the ids.
  at::Tensor flag = new_bad_flag(ids, n);
  check_cuda(dm_gather_rows(table.const_data_ptr(), row_code(table.scalar_type()), rows, dim,
                            ids.const_data_ptr(), id_code(ids.scalar_type()), n,
                            out.data_ptr(), row_code(odt), bad_ptr(flag),
                            c10::cuda::getCurrentCUDAStream()),
             "gather_rows");
  record_error(flag, n, DM_ERR_GATHER, ids, rows, nullptr, "gather_rows");
  return out;
}

void scatter_rows_cuda(const char* op, int err_code, at::Tensor& out, const at::Tensor& ids_in,
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
  const size_t ws_bytes = dm_scatter_workspace_bytes(n, rows, dim);
  at::Tensor ws = at::empty({static_cast<int64_t>(ws_bytes)}, out.options().dtype(at::kByte));
  at::Tensor flag = new_bad_flag(ids, n);
  check_cuda(dm_scatter_prepare(ids.const_data_ptr(), id_code(ids.scalar_type()), n, rows, dim,
                                ws.data_ptr(), ws_bytes, bad_ptr(flag), stream),
             op);
  record_error(flag, n, err_code, ids, rows, nullptr, op);
  check_cuda(dm_scatter_apply(out.data_ptr(), row_code(out.scalar_type()), rows, dim,
                              src.const_data_ptr(), row_code(src.scalar_type()), n, mode,
                              alpha, ws.const_data_ptr(), bad_ptr(flag), stream),
             op);
}

void scatter_add_rows_cuda(at::Tensor out, const at::Tensor& ids, const at::Tensor& rows) {
  scatter_rows_cuda("scatter_add_rows", DM_ERR_SCATTER_ADD, out, ids, rows, DM_SCATTER_ADD,
                    1.0f);
}

void scatter_mean_rows_cuda(at::Tensor table, const at::Tensor& ids, const at::Tensor& rows,
                            bool accumulate, double alpha) {
  scatter_rows_cuda("scatter_mean_rows", DM_ERR_SCATTER_MEAN, table, ids, rows,
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
  record_error(flag, n, DM_ERR_REMAP_MISSING, ids, size, &lookup, "remap_ids");
  return out;
}

// The device's persistent record (aliased, not copied: the caller reads and clears it).
at::Tensor error_record_cuda(const at::Tensor& like) {
  TORCH_CHECK_VALUE(like.is_cuda(), "error_record: expected a CUDA tensor, got ", like.device());
  return device_record(like.device());
}

}  // namespace

TORCH_LIBRARY_IMPL(dept_mega, CUDA, m) {
  m.impl("gather_rows", &gather_rows_cuda);
  m.impl("scatter_add_rows_", &scatter_add_rows_cuda);
  m.impl("scatter_mean_rows_", &scatter_mean_rows_cuda);
  m.impl("remap_ids", &remap_ids_cuda);
  m.impl("error_record", &error_record_cuda);
}

}  // namespace dept_mega
