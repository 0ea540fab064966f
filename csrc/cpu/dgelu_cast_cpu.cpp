// CPU kernel of dept_mega::dgelu_cast_fp8 (schema: csrc/registration.cpp; Python wrapper:
// dept_mega/parallel/fp8_casts.py): the GELU backward rounded to the gradient's dtype (dh, csrc/
// fp8_cast.h's dm_dgelu, elementwise in parallel: the result does not depend on the thread count),
// then the CPU kernel of cast_fp8 on dh (reached by a redispatch to its CPU kernel: the same bytes,
// amax and pad rows as cast_fp8 of dh). Two passes: this kernel is for verification (the tests
// compare it with the reference and with the CUDA kernel run through tools/cuda_emu.py), the fused
// pass is the CUDA kernel's (csrc/cuda/dgelu_cast.cu).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "../common.h"

namespace dept_mega {
namespace {

using CastResult = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

template <typename T>
void dgelu_cpu(const T* g, const T* x, T* dh, int64_t n) {
  at::parallel_for(0, n, 32768, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      dh[i] = static_cast<T>(dm_dgelu(static_cast<float>(g[i]), static_cast<float>(x[i])));  // nearest-even
  });
}

CastResult dgelu_cast_fp8_cpu(const at::Tensor& grad_in, const at::Tensor& x_in, at::ScalarType dtype,
                              int64_t pad, bool rowwise, bool colwise, const std::optional<at::Tensor>& scale,
                              int64_t scale_index, const std::optional<at::Tensor>& amax_out,
                              int64_t amax_index) {
  check_dgelu_cast_fp8_args(grad_in, x_in, dtype, pad, scale, scale_index, amax_out, amax_index);
  const at::Tensor grad = grad_in.contiguous();
  const at::Tensor x = x_in.contiguous();
  at::Tensor dh = at::empty_like(grad, at::MemoryFormat::Contiguous);
  if (grad.scalar_type() == at::kBFloat16) {
    dgelu_cpu(grad.const_data_ptr<at::BFloat16>(), x.const_data_ptr<at::BFloat16>(), dh.data_ptr<at::BFloat16>(),
              grad.numel());
  } else {
    dgelu_cpu(grad.const_data_ptr<at::Half>(), x.const_data_ptr<at::Half>(), dh.data_ptr<at::Half>(), grad.numel());
  }
  static const auto cast = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("dept_mega::cast_fp8", "")
                               .typed<CastResult(const at::Tensor&, at::ScalarType, int64_t, bool, bool,
                                                 const std::optional<at::Tensor>&, int64_t,
                                                 const std::optional<at::Tensor>&, int64_t, bool)>();
  auto [q, qt, inv] = cast.redispatch(c10::DispatchKeySet(c10::DispatchKey::CPU), dh, dtype, pad, rowwise, colwise,
                                      scale, scale_index, amax_out, amax_index, false);
  return {dh, q, qt};
}

}  // namespace

TORCH_LIBRARY_IMPL(dept_mega, CPU, m) { m.impl("dgelu_cast_fp8", &dgelu_cast_fp8_cpu); }

}  // namespace dept_mega
