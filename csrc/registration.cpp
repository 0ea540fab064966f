// Operator schemas of the dept_mega custom ops, and the Python module stub that lets
// `import dept_mega.ops._C` load this library (the ops register themselves on load).
//
// Kernels: csrc/cpu/ops_cpu.cpp (CPU), csrc/cuda/ops_cuda.cpp (CUDA, built only when torch
// has CUDA and nvcc is found). Fake (meta) kernels and autograd live in Python:
// dept_mega/ops/registration.py.
#include <Python.h>
#include <torch/library.h>

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
