// Operator schemas of the dept_mega custom ops, and the Python module stub that lets
// `import dept_mega.ops._C` load this library (the ops register themselves on load).
//
// Kernels: csrc/cpu/ops_cpu.cpp (CPU), csrc/cuda/ops_cuda.cpp (CUDA, built only when torch
// has CUDA and nvcc is found). Fake (meta) kernels and autograd live in Python:
// dept_mega/ops/registration.py.
#include <Python.h>
#include <torch/library.h>

#include <mutex>
#include <string>
#include <vector>

#include "fp8_gemm.h"

namespace dept_mega {
namespace {

struct TuningLog {
  std::mutex mu;
  std::vector<std::string> lines;
};

TuningLog& tuning_log() {
  static auto* log = new TuningLog();  // never freed, as the algorithm cache it describes
  return *log;
}

std::vector<std::string> fp8_gemm_tuning_log(bool clear) {
  TuningLog& log = tuning_log();
  const std::lock_guard<std::mutex> lock(log.mu);
  std::vector<std::string> out = log.lines;
  if (clear) log.lines.clear();
  return out;
}

}  // namespace

void record_fp8_gemm_tuning(std::string line) {
  TuningLog& log = tuning_log();
  const std::lock_guard<std::mutex> lock(log.mu);
  log.lines.push_back(std::move(line));
}

}  // namespace dept_mega

TORCH_LIBRARY(dept_mega, m) {
  // rows[i] = table[ids[i]], optionally cast to out_dtype.
  m.def("gather_rows(Tensor table, Tensor ids, ScalarType? out_dtype=None) -> Tensor");
  // out[ids[i]] += rows[i], in place; deterministic (fixed chunked order, csrc/cuda/kernels.h).
  m.def("scatter_add_rows_(Tensor(a!) out, Tensor ids, Tensor rows) -> ()");
  // Per touched row r: table[r] = alpha * mean_i rows[i] (accumulate=False) or
  // table[r] += alpha * mean_i rows[i] (accumulate=True); untouched rows unchanged.
  m.def(
      "scatter_mean_rows_(Tensor(a!) table, Tensor ids, Tensor rows, bool accumulate=False, "
      "float alpha=1.0) -> ()");
  // local = lookup[ids], any shape of ids; lookup entries < 0 are an error.
  m.def("remap_ids(Tensor ids, Tensor lookup) -> Tensor");
  // remap_ids through vocabulary ranks (csrc/constants.h, DM_RANK_BITS; dept_mega.ops.VocabRanks):
  // the result and errors of remap_ids with the equivalent lookup (-1 for a non-member).
  // stage (CUDA only; the CPU kernel checks and ignores it): -1 the launcher picks shared or
  // global memory for the words, 0 / 1 force global / shared (tests; csrc/cuda/remap_ranked.cu).
  m.def("remap_ranked(Tensor ids, Tensor words, int size, int stage=-1) -> Tensor");
  // FP8 cast of a 2-D bf16/fp16 tensor (dept_mega/parallel/fp8_casts.py; the bytes of the
  // reference math fp8._cast_math, csrc/fp8_cast.h): q [rows + pad, cols] when rowwise, q_t
  // [cols, rows + pad] when colwise; scale[scale_index] (delayed scaling) or, without a scale,
  // current scaling (the returned 1/scale, 0-d fp32); amax(t) maxed into amax_out[amax_index]
  // when given. Outputs not asked for are None (undefined tensors): an eager operator.
  // gelu: casts GELU(t) (erf form, rounded to t's dtype; the amax is of those values).
  m.def(
      "cast_fp8(Tensor t, ScalarType dtype, int pad=0, bool rowwise=True, bool colwise=False, "
      "Tensor? scale=None, int scale_index=0, Tensor(a!)? amax_out=None, int amax_index=0, "
      "bool gelu=False) -> (Tensor, Tensor, Tensor)");
  // LayerNorm over the last dimension (fp32, biased variance) * weight (+ bias), rounded to x's
  // dtype, then cast_fp8 of it with the delayed scale scale[scale_index] (required), its amax
  // maxed into amax_out[amax_index] when given; pad rows are zero FP8. Returns (q, q_t, mean,
  // rstd): q / q_t as cast_fp8's (None when not asked for), mean and rstd [rows, 1] in the form
  // aten::native_layer_norm_backward takes on the device (CPU: x's dtype; CUDA: float32).
  m.def(
      "layernorm_cast_fp8(Tensor x, Tensor weight, Tensor? bias, float eps, ScalarType dtype, "
      "int pad=0, bool rowwise=True, bool colwise=False, Tensor? scale=None, int scale_index=0, "
      "Tensor(a!)? amax_out=None, int amax_index=0) -> (Tensor, Tensor, Tensor, Tensor)");
  // The GELU backward (erf form, fp32, as aten::gelu_backward(grad, x)) rounded to grad's dtype:
  // dh, returned, then cast_fp8 of dh with the delayed scale scale[scale_index] (required), its
  // amax maxed into amax_out[amax_index] when given; pad rows are zero FP8. Returns (dh, q, q_t):
  // q / q_t as cast_fp8's (None when not asked for). x: grad's shape and dtype.
  m.def(
      "dgelu_cast_fp8(Tensor grad, Tensor x, ScalarType dtype, int pad=0, bool rowwise=True, "
      "bool colwise=False, Tensor? scale=None, int scale_index=0, Tensor(a!)? amax_out=None, "
      "int amax_index=0) -> (Tensor, Tensor, Tensor)");
  // FP8 GEMM with per-tensor scales (csrc/fp8_gemm.h; dept_mega/parallel/fp8_gemm.py): a
  // float8 [m, k] row-major, b float8 [k, n] column-major. Without out: returns
  // scale_a * scale_b * (a . b) as a new bfloat16 [m, n] tensor. With out (float32 or bfloat16
  // [m, n], contiguous): adds the product into out in place (first=True: overwrites), returns
  // None (an undefined tensor). On CUDA one cuBLASLt matmul (csrc/cuda/fp8_gemm_lt.cpp).
  // tune (0 to 64; 0 and 1: cuBLASLt's heuristic's first algorithm): on the first call of a
  // problem, the heuristic's first `tune` algorithms are timed and the fastest is kept for it;
  // ignored on the CPU (one kernel there).
  m.def(
      "fp8_gemm(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, bool use_fast_accum=False, "
      "Tensor(a!)? out=None, bool first=False, int tune=0) -> Tensor");
  // One JSON object per problem that fp8_gemm tuned (tune > 1) in this process, in order:
  // the problem, every candidate's milliseconds (null: it failed), the one kept (clear: empty
  // the list after reading it). Empty on the CPU.
  m.def("fp8_gemm_tuning_log(bool clear=False) -> str[]", &dept_mega::fp8_gemm_tuning_log);
  // Lazy error checks of the CUDA ops (no host synchronisation inside a call): the persistent
  // int64[DM_ERR_RECORD_LEN] error record of `like`'s device (CUDA kernel only), decoded into
  // the exception the CPU op raises by dept_mega.ops.check_errors.
  m.def("error_record(Tensor like) -> Tensor");
}

extern "C" {
// The module holds nothing: loading the shared object runs the registrations above.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", "dept_mega custom operators (see torch.ops.dept_mega)", -1,
      nullptr, nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module_def);
}
}
