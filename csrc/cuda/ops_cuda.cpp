// CUDA registrations of the dept_mega ops: argument checks, allocation, stream and error
// handling around the C interface of kernels.h.
//
// UNVERIFIED: built only by the CUDAExtension route of setup.py (torch with CUDA + nvcc),
// which this repository's CI (CPU torch, no GPU) cannot build or run. CI compiles the kernels
// themselves (kernels.cu) with nvcc for sm_90 and syntax-checks this file against torch's
// headers (tools/check_cuda_compile.sh). tests/test_ops.py runs every op on CUDA when a GPU
// is present.
//
// Errors, without a host synchronisation inside a call: the kernels copy what the message of a
// call's first invalid id needs into the device's persistent error record (the first error
// since the last check is kept). dept_mega.ops.check_errors() reads the record (one small
// copy, at the log interval) and raises exactly what the CPU op raises.
// - gather_rows / remap_ids launch one kernel: it lowers the current stream's persistent
//   DmCallScratch to the first invalid position, and its last block writes the record and
//   resets the scratch (kernels.h). A failed call writes 0 (a remap) or a zero row (a gather)
//   at each invalid id and the right value elsewhere: an output read before the check is in range.
// - the scatters fill a per-call flag, and a one-thread kernel copies the flag's position into
//   the record; their writing kernel reads the flag on the device and writes nothing on error,
//   so a failed call leaves the table unchanged, as on CPU.
// Streams: a scratch belongs to one (device, stream), so calls on two streams never share one
// (a shared one would mix the block counts and positions of two concurrent launches); the
// record is per device. Two streams that run failing calls concurrently: the record keeps the
// error whose kernel claims it first (atomicCAS on the code, never a mix of two errors), which
// need not be the one queued first; check_errors copies the record on its current stream, so
// it sees another stream's errors once that stream's calls are ordered before the copy (the
// usual cross-stream rule: synchronize or wait_stream first).
// CUDA graphs: the scratch of a stream is created (and filled) by the stream's first
// gather / remap, and the record by the device's first op or check_errors; run both once on the
// capturing stream before a capture, which then records kernels that use them (each replay
// leaves the scratch reset). A replay uses the capture stream's scratch, so it must not overlap
// gather / remap calls on that stream.
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <map>
#include <mutex>
#include <tuple>
#include <utility>
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

// The scatters' per-call flag: a device counter initialised to n; kernels lower it to the
// first invalid position.
at::Tensor new_bad_flag(const at::Tensor& like, int64_t n) {
  return at::full({1}, n, like.options().dtype(at::kLong));
}

unsigned long long* bad_ptr(at::Tensor& flag) {
  return reinterpret_cast<unsigned long long*>(flag.data_ptr<int64_t>());
}

// The persistent error records (one per CUDA device, zeros until an op records an error) and
// the gather / remap scratch of each (device, stream) used so far. Kept for the life of the
// process: never freed, so no CUDA call runs in a static destructor.
struct ErrorState {
  std::mutex mu;
  std::vector<at::Tensor> records;                           // by device index
  std::map<std::pair<int, int64_t>, at::Tensor> scratches;  // (device index, stream id)
};

ErrorState& error_state() {
  static auto* state = new ErrorState();
  return *state;
}

at::Tensor& device_record_locked(ErrorState& st, const at::Device& device) {
  const auto idx = static_cast<size_t>(device.index());
  if (st.records.size() <= idx) st.records.resize(idx + 1);
  at::Tensor& rec = st.records[idx];
  if (!rec.defined()) {
    rec = at::zeros({DM_ERR_RECORD_LEN}, at::TensorOptions().dtype(at::kLong).device(device));
  }
  return rec;
}

at::Tensor device_record(const at::Device& device) {
  ErrorState& st = error_state();
  const std::lock_guard<std::mutex> lock(st.mu);
  return device_record_locked(st, device);
}

static_assert(sizeof(DmCallScratch) == 2 * sizeof(int64_t), "DmCallScratch is two int64");

struct CallState {
  int64_t* record;
  DmCallScratch* scratch;
  cudaStream_t stream;
};

// The record of `device` and the scratch of its current stream (the guard has made `device`
// current). A new scratch is filled with {DM_NO_BAD, 0} by two kernels on that stream, queued
// before the call's kernel; later calls find it reset by the previous call's last block.
CallState call_state(const at::Device& device) {
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(device.index());
  ErrorState& st = error_state();
  const std::lock_guard<std::mutex> lock(st.mu);
  at::Tensor& rec = device_record_locked(st, device);
  auto it = st.scratches.find({device.index(), stream.id()});
  if (it == st.scratches.end()) {
    at::Tensor scratch = at::zeros({2}, at::TensorOptions().dtype(at::kLong).device(device));
    scratch.narrow(0, 0, 1).fill_(-1);  // DM_NO_BAD: all bits set
    it = st.scratches.emplace(std::make_pair(device.index(), stream.id()), scratch).first;
  }
  return {rec.data_ptr<int64_t>(), reinterpret_cast<DmCallScratch*>(it->second.data_ptr<int64_t>()),
          stream.stream()};
}

// Scatters: queues the record of this call's first invalid id (if any) on the current stream.
void record_error(at::Tensor& flag, int64_t n, int op, const at::Tensor& ids, int64_t bound,
                  const char* name) {
  at::Tensor rec = device_record(ids.device());
  check_cuda(dm_record_error(bad_ptr(flag), n, op, ids.const_data_ptr(),
                             id_code(ids.scalar_type()), bound, rec.data_ptr<int64_t>(),
                             c10::cuda::getCurrentCUDAStream()),
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
  const CallState cs = call_state(ids.device());
  check_cuda(dm_gather_rows(table.const_data_ptr(), row_code(table.scalar_type()), rows, dim,
                            ids.const_data_ptr(), id_code(ids.scalar_type()), n,
                            out.data_ptr(), row_code(odt), cs.scratch, cs.record, cs.stream),
             "gather_rows");
  return out;
}

void scatter_rows_cuda(const char* op, int err_code, at::Tensor& out, const at::Tensor& ids_in,
                       const at::Tensor& rows_in, int mode, float alpha) {
  check_scatter_args(op, out, ids_in, rows_in);
  const c10::cuda::CUDAGuard guard(out.device());
  const at::Tensor ids = ids_in.contiguous();
  // rows over the table's own memory are read as they were before the call (as on CPU and by
  // the fallback), not while other warps rewrite them
  at::Tensor src = rows_in.contiguous();
  if (at::get_overlap_status(out, src) != at::MemOverlapStatus::No) src = src.clone();
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
  record_error(flag, n, err_code, ids, rows, op);
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
  const CallState cs = call_state(ids.device());
  check_cuda(dm_remap_ids(ids.const_data_ptr(), id_code(ids.scalar_type()), n,
                          lookup.const_data_ptr(), id_code(lookup.scalar_type()), size,
                          out.data_ptr(), cs.scratch, cs.record, cs.stream),
             "remap_ids");
  return out;
}

at::Tensor remap_ranked_cuda(const at::Tensor& ids_in, const at::Tensor& words_in, int64_t size,
                             int64_t stage) {
  check_remap_ranked_args(ids_in, words_in, size, stage);
  const c10::cuda::CUDAGuard guard(ids_in.device());
  const at::Tensor ids = ids_in.contiguous();
  const at::Tensor words = words_in.contiguous();
  at::Tensor out = at::empty_like(ids, at::MemoryFormat::Contiguous);
  const int64_t n = ids.numel();
  if (n == 0) return out;
  const CallState cs = call_state(ids.device());
  check_cuda(dm_remap_ranked(ids.const_data_ptr(), id_code(ids.scalar_type()), n,
                             words.const_data_ptr<int64_t>(), size, out.data_ptr(),
                             static_cast<int>(stage), cs.scratch, cs.record, cs.stream),
             "remap_ids");
  return out;
}

// cast_fp8 (kernels in fp8_cast.cu): allocation and the launch on the current stream, no host
// synchronisation. The Python caller checks the arguments first (dept_mega/parallel/fp8_casts.py,
// see dept_mega.ops._route on C++ throws from CUDA ops); these checks stay as the last line.
std::tuple<at::Tensor, at::Tensor, at::Tensor> cast_fp8_cuda(
    const at::Tensor& t_in, at::ScalarType dtype, int64_t pad, bool rowwise, bool colwise,
    const std::optional<at::Tensor>& scale, int64_t scale_index,
    const std::optional<at::Tensor>& amax_out, int64_t amax_index, bool gelu) {
  const int fmt = check_cast_fp8_args(t_in, dtype, pad, scale, scale_index, amax_out, amax_index);
  TORCH_CHECK_VALUE(t_in.size(1) <= dm_fp8_max_cols(), "cast_fp8: at most ", dm_fp8_max_cols(),
                    " columns on CUDA, got ", t_in.size(1));
  const c10::cuda::CUDAGuard guard(t_in.device());
  const at::Tensor t = t_in.contiguous();
  const int64_t rows = t.size(0), cols = t.size(1), out_rows = rows + pad;
  at::Tensor q, qt, inv, parts;  // undefined: None in Python
  if (rowwise) q = at::empty({out_rows, cols}, t.options().dtype(dtype));
  if (colwise) qt = at::empty({cols, out_rows}, t.options().dtype(dtype));
  if (!scale.has_value()) {
    inv = at::empty({}, t.options().dtype(at::kFloat));
    parts = at::empty({dm_fp8_amax_parts(rows * cols)}, t.options().dtype(at::kInt));
  }
  check_cuda(dm_fp8_cast(t.const_data_ptr(), row_code(t.scalar_type()), rows, cols, pad, fmt,
                         rowwise ? q.data_ptr() : nullptr, colwise ? qt.data_ptr() : nullptr,
                         scale.has_value() ? scale->const_data_ptr<float>() + scale_index : nullptr,
                         scale.has_value() ? nullptr : inv.data_ptr<float>(),
                         scale.has_value() ? nullptr : parts.data_ptr(),
                         amax_out.has_value() ? amax_out->data_ptr<float>() + amax_index : nullptr,
                         gelu ? 1 : 0, c10::cuda::getCurrentCUDAStream()),
             "cast_fp8");
  return {q, qt, inv};
}

// layernorm_cast_fp8 (kernel in layernorm_cast.cu): one launch on the current stream, no host
// synchronisation; mean / rstd float32 [rows, 1], as aten::native_layer_norm gives them on CUDA.
// Arguments checked in Python first (fp8_casts.check_layernorm_args), these checks the last line.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> layernorm_cast_fp8_cuda(
    const at::Tensor& x_in, const at::Tensor& weight_in, const std::optional<at::Tensor>& bias_in,
    double eps, at::ScalarType dtype, int64_t pad, bool rowwise, bool colwise,
    const std::optional<at::Tensor>& scale, int64_t scale_index,
    const std::optional<at::Tensor>& amax_out, int64_t amax_index) {
  const int fmt = check_layernorm_cast_fp8_args(x_in, weight_in, bias_in, dtype, pad, scale,
                                                scale_index, amax_out, amax_index);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  const at::Tensor weight = weight_in.contiguous();
  const at::Tensor bias = bias_in.has_value() ? bias_in->contiguous() : at::Tensor();
  const int64_t rows = x.size(0), cols = x.size(1), out_rows = rows + pad;
  TORCH_CHECK_VALUE(out_rows < (int64_t{1} << 31) * 32, "layernorm_cast_fp8: too many rows on CUDA: ",
                    out_rows);
  at::Tensor q, qt;
  if (rowwise) q = at::empty({out_rows, cols}, x.options().dtype(dtype));
  if (colwise) qt = at::empty({cols, out_rows}, x.options().dtype(dtype));
  at::Tensor mean = at::empty({rows, 1}, x.options().dtype(at::kFloat));
  at::Tensor rstd = at::empty({rows, 1}, x.options().dtype(at::kFloat));
  check_cuda(dm_layernorm_cast_fp8(x.const_data_ptr(), row_code(x.scalar_type()), weight.const_data_ptr(),
                                   bias.defined() ? bias.const_data_ptr() : nullptr,
                                   row_code(weight.scalar_type()), rows, cols, pad,
                                   static_cast<float>(eps), fmt, rowwise ? q.data_ptr() : nullptr,
                                   colwise ? qt.data_ptr() : nullptr,
                                   scale->const_data_ptr<float>() + scale_index,
                                   amax_out.has_value() ? amax_out->data_ptr<float>() + amax_index : nullptr,
                                   mean.data_ptr<float>(), rstd.data_ptr<float>(),
                                   c10::cuda::getCurrentCUDAStream()),
             "layernorm_cast_fp8");
  return {q, qt, mean, rstd};
}

// dgelu_cast_fp8 (kernel in dgelu_cast.cu): one launch on the current stream, no host
// synchronisation. Arguments checked in Python first (fp8_casts.check_dgelu_args), these checks the
// last line.
std::tuple<at::Tensor, at::Tensor, at::Tensor> dgelu_cast_fp8_cuda(
    const at::Tensor& grad_in, const at::Tensor& x_in, at::ScalarType dtype, int64_t pad, bool rowwise,
    bool colwise, const std::optional<at::Tensor>& scale, int64_t scale_index,
    const std::optional<at::Tensor>& amax_out, int64_t amax_index) {
  const int fmt = check_dgelu_cast_fp8_args(grad_in, x_in, dtype, pad, scale, scale_index, amax_out, amax_index);
  TORCH_CHECK_VALUE(grad_in.size(1) <= dm_fp8_max_cols(), "dgelu_cast_fp8: at most ", dm_fp8_max_cols(),
                    " columns on CUDA, got ", grad_in.size(1));
  const c10::cuda::CUDAGuard guard(grad_in.device());
  const at::Tensor grad = grad_in.contiguous();
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = grad.size(0), cols = grad.size(1), out_rows = rows + pad;
  at::Tensor dh = at::empty_like(grad, at::MemoryFormat::Contiguous);
  at::Tensor q, qt;
  if (rowwise) q = at::empty({out_rows, cols}, grad.options().dtype(dtype));
  if (colwise) qt = at::empty({cols, out_rows}, grad.options().dtype(dtype));
  check_cuda(dm_dgelu_cast_fp8(grad.const_data_ptr(), x.const_data_ptr(), row_code(grad.scalar_type()),
                               dh.data_ptr(), rows, cols, pad, fmt, rowwise ? q.data_ptr() : nullptr,
                               colwise ? qt.data_ptr() : nullptr, scale->const_data_ptr<float>() + scale_index,
                               amax_out.has_value() ? amax_out->data_ptr<float>() + amax_index : nullptr,
                               c10::cuda::getCurrentCUDAStream()),
             "dgelu_cast_fp8");
  return {dh, q, qt};
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
  m.impl("remap_ranked", &remap_ranked_cuda);
  m.impl("error_record", &error_record_cuda);
  m.impl("cast_fp8", &cast_fp8_cuda);
  m.impl("layernorm_cast_fp8", &layernorm_cast_fp8_cuda);
  m.impl("dgelu_cast_fp8", &dgelu_cast_fp8_cuda);
}

}  // namespace dept_mega
