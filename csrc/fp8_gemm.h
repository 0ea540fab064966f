// Argument checks of the FP8 GEMM operator dept_mega::fp8_gemm, shared by its CPU kernel
// (csrc/cpu/ops_cpu.cpp) and its cuBLASLt kernel (csrc/cuda/fp8_gemm_lt.cpp); the Python checks
// of dept_mega/parallel/fp8_gemm.py raise the same exceptions with the same messages.
//
// D = scale_a * scale_b * (a . b)            out undefined: a new bfloat16 [m, n] tensor
// out = scale_a * scale_b * (a . b) + out    out given, first = false (accumulate, beta = 1)
// out = scale_a * scale_b * (a . b)          out given, first = true (overwrite, beta = 0)
//
// The layout rule is torch._scaled_mm's (cuBLASLt's FP8 GEMM): a [m, k] row-major, b [k, n]
// column-major, m, k, n multiples of 16, every pointer (scales and out included) 16-byte
// aligned, float8_e4m3fn x float8_e4m3fn / float8_e5m2 in either order (not e5m2 x e5m2),
// per-tensor float32 scales (one element each). out: [m, n] float32 or bfloat16, contiguous.
// Checked on every device (the CPU kernel would take anything), so CPU tests hold the
// operands to the rule the GPU needs.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <optional>
#include <string>

#include "common.h"

namespace dept_mega {

constexpr int64_t kFp8GemmAlign = 16;  // dimension multiple and pointer alignment (bytes)
constexpr int64_t kFp8GemmMaxTune = 64;  // the most algorithms fp8_gemm(tune=...) times

// Appends one line (a JSON object) to what fp8_gemm_tuning_log returns (csrc/registration.cpp).
void record_fp8_gemm_tuning(std::string line);

inline bool is_fp8_dtype(at::ScalarType t) {
  return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2;
}

inline bool fp8_misaligned(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % kFp8GemmAlign != 0;
}

inline void check_fp8_gemm_args(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                                const at::Tensor& scale_b, const std::optional<at::Tensor>& out,
                                bool first, int64_t tune) {
  const char* op = "fp8_gemm";
  TORCH_CHECK_VALUE(a.dim() == 2 && b.dim() == 2, op, ": a and b must be 2-D, got shapes ",
                    a.sizes(), " and ", b.sizes());
  TORCH_CHECK_TYPE(is_fp8_dtype(a.scalar_type()) && is_fp8_dtype(b.scalar_type()), op,
                   ": a and b must be float8_e4m3fn or float8_e5m2, got ",
                   dtype_name(a.scalar_type()), " and ", dtype_name(b.scalar_type()));
  TORCH_CHECK_TYPE(!(a.scalar_type() == at::kFloat8_e5m2 && b.scalar_type() == at::kFloat8_e5m2),
                   op, ": float8_e5m2 x float8_e5m2 has no FP8 GEMM (one operand must be float8_e4m3fn)");
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  TORCH_CHECK_VALUE(b.size(0) == k, op, ": a ", a.sizes(), " and b ", b.sizes(),
                    " cannot be multiplied");
  TORCH_CHECK_VALUE(m % kFp8GemmAlign == 0 && k % kFp8GemmAlign == 0 && n % kFp8GemmAlign == 0,
                    op, ": m, k, n must be multiples of ", kFp8GemmAlign, ", got ", m, ", ", k,
                    ", ", n);
  // row-major a (leading dimension a.stride(0)), column-major b (leading dimension b.stride(1));
  // the leading dimensions in bytes (1 per FP8 element) multiples of 16 as cuBLASLt needs
  TORCH_CHECK_VALUE(a.stride(1) == 1 && a.stride(0) >= k && a.stride(0) % kFp8GemmAlign == 0, op,
                    ": a must be row-major (strides [ld, 1], ld >= k and a multiple of 16), got strides ",
                    a.strides());
  TORCH_CHECK_VALUE(b.stride(0) == 1 && b.stride(1) >= k && b.stride(1) % kFp8GemmAlign == 0, op,
                    ": b must be column-major (strides [1, ld], ld >= k and a multiple of 16; e.g. "
                    "the .t() of a row-major [n, k] tensor), got strides ",
                    b.strides());
  const at::Tensor* scales[2] = {&scale_a, &scale_b};
  const char* scale_names[2] = {"scale_a", "scale_b"};
  for (int i = 0; i < 2; ++i) {
    TORCH_CHECK_TYPE(scales[i]->scalar_type() == at::kFloat, op, ": ", scale_names[i],
                     " must be float32, got ", dtype_name(scales[i]->scalar_type()));
    TORCH_CHECK_VALUE(scales[i]->numel() == 1, op, ": ", scale_names[i],
                      " must have one element (per-tensor scaling), got shape ", scales[i]->sizes());
    check_same_device(op, a, "a", *scales[i], scale_names[i]);
  }
  check_same_device(op, a, "a", b, "b");
  TORCH_CHECK_VALUE(out.has_value() || !first, op,
                    ": first=True (overwrite) needs an out tensor to write into");
  if (out.has_value()) {
    const at::Tensor& o = *out;
    TORCH_CHECK_TYPE(o.scalar_type() == at::kFloat || o.scalar_type() == at::kBFloat16, op,
                     ": out must be float32 or bfloat16, got ", dtype_name(o.scalar_type()));
    TORCH_CHECK_VALUE(o.dim() == 2 && o.size(0) == m && o.size(1) == n, op, ": out must have shape [",
                      m, ", ", n, "], got ", o.sizes());
    TORCH_CHECK_VALUE(o.is_contiguous(), op, ": out must be contiguous (row-major), got strides ",
                      o.strides());
    check_same_device(op, a, "a", o, "out");
  }
  TORCH_CHECK_VALUE(tune >= 0 && tune <= kFp8GemmMaxTune, op, ": tune must be between 0 and ",
                    kFp8GemmMaxTune, " (the algorithms to time), got ", tune);
  const bool bad[5] = {fp8_misaligned(a), fp8_misaligned(b), fp8_misaligned(scale_a),
                       fp8_misaligned(scale_b), out.has_value() && fp8_misaligned(*out)};
  const char* names[5] = {"a", "b", "scale_a", "scale_b", "out"};
  for (int i = 0; i < 5; ++i) {
    TORCH_CHECK_VALUE(!bad[i], op, ": ", names[i], " is not ", kFp8GemmAlign,
                      "-byte aligned (a view at an offset into a larger tensor?); cuBLASLt rejects it");
  }
}

}  // namespace dept_mega
