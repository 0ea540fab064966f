// Argument checks and their messages, shared by the CPU and CUDA operators of dept_mega.
//
// The pure PyTorch fallback (dept_mega/ops/fallback.py) raises the same exception types with
// the same messages, so callers see one behaviour whatever the backend:
//   ValueError  bad shapes, mixed devices
//   TypeError   an unsupported dtype
// dept_mega.ops checks the arguments in Python before calling an operator, so these throws are
// the last line, reached only through torch.ops.dept_mega.* directly. Invalid ids (data, not
// arguments) are never thrown by a kernel: CPU and CUDA kernels write the error record of
// constants.h, which dept_mega.ops decodes into an IndexError / ValueError (recorded_error, with
// the fallback's messages).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>

#include "constants.h"
#include "fp8_cast.h"

namespace dept_mega {

// The dtype as Python spells it (torch.float64 -> "float64"), for messages.
inline std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kShort: return "int16";
    case at::kChar: return "int8";
    case at::kByte: return "uint8";
    case at::kBool: return "bool";
    case at::kFloat8_e4m3fn: return "float8_e4m3fn";
    case at::kFloat8_e5m2: return "float8_e5m2";
    default: return c10::toString(t);
  }
}

inline bool is_row_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

inline bool is_id_dtype(at::ScalarType t) { return t == at::kInt || t == at::kLong; }

inline void check_rows_dtype(const char* op, const char* what, at::ScalarType t) {
  TORCH_CHECK_TYPE(is_row_dtype(t), op, ": ", what,
                   " must be float32, bfloat16 or float16, got ", dtype_name(t));
}

inline void check_ids_dtype(const char* op, const char* what, at::ScalarType t) {
  TORCH_CHECK_TYPE(is_id_dtype(t), op, ": ", what, " must be int32 or int64, got ",
                   dtype_name(t));
}

inline void check_same_device(const char* op, const at::Tensor& a, const char* an,
                              const at::Tensor& b, const char* bn) {
  TORCH_CHECK_VALUE(a.device() == b.device(), op, ": ", an, " is on ", a.device(), " but ",
                    bn, " is on ", b.device());
}

// gather_rows(table [V, d], ids [n], out_dtype)
inline void check_gather_args(const at::Tensor& table, const at::Tensor& ids,
                              std::optional<at::ScalarType> out_dtype) {
  const char* op = "gather_rows";
  TORCH_CHECK_VALUE(table.dim() == 2, op, ": table must be 2-D [rows, dim], got shape ",
                    table.sizes());
  TORCH_CHECK_VALUE(ids.dim() == 1, op, ": ids must be 1-D, got shape ", ids.sizes());
  check_rows_dtype(op, "table", table.scalar_type());
  check_ids_dtype(op, "ids", ids.scalar_type());
  if (out_dtype.has_value()) check_rows_dtype(op, "out_dtype", *out_dtype);
  check_same_device(op, table, "table", ids, "ids");
}

// scatter_add_rows_(out [V, d], ids [n], rows [n, d]) and scatter_mean_rows_ (same shapes)
inline void check_scatter_args(const char* op, const at::Tensor& out, const at::Tensor& ids,
                               const at::Tensor& rows) {
  TORCH_CHECK_VALUE(out.dim() == 2, op, ": table must be 2-D [rows, dim], got shape ",
                    out.sizes());
  TORCH_CHECK_VALUE(ids.dim() == 1, op, ": ids must be 1-D, got shape ", ids.sizes());
  TORCH_CHECK_VALUE(rows.dim() == 2 && rows.size(0) == ids.size(0) &&
                        rows.size(1) == out.size(1),
                    op, ": rows must have shape [", ids.size(0), ", ", out.size(1),
                    "] (len(ids), table dim), got ", rows.sizes());
  check_rows_dtype(op, "table", out.scalar_type());
  check_rows_dtype(op, "rows", rows.scalar_type());
  check_ids_dtype(op, "ids", ids.scalar_type());
  TORCH_CHECK_VALUE(out.is_contiguous(), op,
                    ": the destination table is updated in place and must be contiguous");
  check_same_device(op, out, "table", ids, "ids");
  check_same_device(op, out, "table", rows, "rows");
}

inline void check_remap_args(const at::Tensor& ids, const at::Tensor& lookup) {
  const char* op = "remap_ids";
  TORCH_CHECK_VALUE(lookup.dim() == 1, op, ": lookup must be 1-D, got shape ",
                    lookup.sizes());
  check_ids_dtype(op, "ids", ids.scalar_type());
  check_ids_dtype(op, "lookup", lookup.scalar_type());
  check_same_device(op, ids, "ids", lookup, "lookup");
}

// remap_ranked(ids, words, size, stage): words int64 [ceil(size / DM_RANK_BITS)] (the layout
// of constants.h; dept_mega.ops.VocabRanks builds and checks its contents).
inline void check_remap_ranked_args(const at::Tensor& ids, const at::Tensor& words, int64_t size,
                                    int64_t stage) {
  const char* op = "remap_ids";
  TORCH_CHECK_VALUE(size >= 0 && size < (int64_t{1} << 31), op,
                    ": the ranks' vocabulary size must be in [0, 2^31), got ", size);
  const int64_t nwords = (size + DM_RANK_BITS - 1) / DM_RANK_BITS;
  TORCH_CHECK_VALUE(words.dim() == 1 && words.size(0) == nwords, op,
                    ": ranks words must have shape [", nwords, "] for a vocabulary of ", size,
                    " ids, got ", words.sizes());
  TORCH_CHECK_TYPE(words.scalar_type() == at::kLong, op, ": ranks words must be int64, got ",
                   dtype_name(words.scalar_type()));
  TORCH_CHECK_VALUE(stage >= -1 && stage <= 1, op,
                    ": stage must be -1 (auto), 0 (global memory) or 1 (shared memory), got ",
                    stage);
  check_ids_dtype(op, "ids", ids.scalar_type());
  check_same_device(op, ids, "ids", words, "ranks");
}

// The input checks every cast operator makes first: a 2-D bf16 / fp16 tensor.
inline void check_cast_input(const char* op, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.dim() == 2, op, ": takes a 2-D tensor, got shape ", t.sizes());
  TORCH_CHECK_TYPE(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf, op,
                   ": takes a bfloat16 or float16 tensor, got ", dtype_name(t.scalar_type()));
}

// cast_fp8(t [rows, cols] bf16/fp16, dtype e4m3fn/e5m2, pad >= 0, ..., scale fp32 (element
// scale_index), amax_out fp32 (element amax_index)); the FP8 format code (DM_FP8_*) of dtype.
inline int check_cast_fp8_args(const at::Tensor& t, at::ScalarType dtype, int64_t pad,
                               const std::optional<at::Tensor>& scale, int64_t scale_index,
                               const std::optional<at::Tensor>& amax_out, int64_t amax_index,
                               const char* op = "cast_fp8") {
  check_cast_input(op, t);
  TORCH_CHECK_TYPE(dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2, op,
                   ": casts to float8_e4m3fn or float8_e5m2, got ", dtype_name(dtype));
  TORCH_CHECK_VALUE(pad >= 0, op, ": pad must be >= 0, got ", pad);
  const std::optional<at::Tensor>* slots[2] = {&scale, &amax_out};
  const int64_t index[2] = {scale_index, amax_index};
  const char* names[2] = {"scale", "amax_out"};
  for (int k = 0; k < 2; ++k) {
    if (!slots[k]->has_value()) continue;
    const at::Tensor& s = **slots[k];
    TORCH_CHECK_TYPE(s.scalar_type() == at::kFloat, op, ": ", names[k], " must be float32, got ",
                     dtype_name(s.scalar_type()));
    TORCH_CHECK_VALUE(s.is_contiguous(), op, ": ", names[k], " must be contiguous");
    TORCH_CHECK_VALUE(index[k] >= 0 && index[k] < s.numel(), op, ": ", names[k], " index ",
                      index[k], " is out of range for ", s.numel(), " elements");
    const char* tn = std::strcmp(op, "cast_fp8") == 0 ? "t" : std::strcmp(op, "dgelu_cast_fp8") == 0 ? "grad" : "x";
    check_same_device(op, t, tn, s, names[k]);
  }
  return dtype == at::kFloat8_e4m3fn ? DM_FP8_E4M3 : DM_FP8_E5M2;
}

// layernorm_cast_fp8(x [rows, cols] bf16/fp16 (cols >= 1), weight [cols] (x's dtype or float32),
// bias None or like weight, ..., scale fp32 (required: delayed scaling), amax_out fp32): the
// checks of cast_fp8 plus the LayerNorm's; the FP8 format code of dtype.
inline int check_layernorm_cast_fp8_args(const at::Tensor& x, const at::Tensor& weight,
                                         const std::optional<at::Tensor>& bias,
                                         at::ScalarType dtype, int64_t pad,
                                         const std::optional<at::Tensor>& scale,
                                         int64_t scale_index,
                                         const std::optional<at::Tensor>& amax_out,
                                         int64_t amax_index) {
  const char* op = "layernorm_cast_fp8";
  check_cast_input(op, x);
  TORCH_CHECK_VALUE(x.size(1) >= 1, op, ": takes a tensor of at least one column, got shape ",
                    x.sizes());
  TORCH_CHECK_VALUE(scale.has_value(), op,
                    ": needs a delayed scale (scale tensor); current scaling is not fused");
  const std::optional<at::Tensor> w_opt = weight;
  const std::optional<at::Tensor>* params[2] = {&w_opt, &bias};
  const char* pnames[2] = {"weight", "bias"};
  for (int k = 0; k < 2; ++k) {
    if (!params[k]->has_value()) continue;
    const at::Tensor& p = **params[k];
    TORCH_CHECK_VALUE(p.dim() == 1 && p.size(0) == x.size(1), op, ": ", pnames[k],
                      " must have shape [", x.size(1), "], got ", p.sizes());
    TORCH_CHECK_TYPE(p.scalar_type() == x.scalar_type() || p.scalar_type() == at::kFloat, op,
                     ": ", pnames[k], " must be float32 or the input's dtype (",
                     dtype_name(x.scalar_type()), "), got ", dtype_name(p.scalar_type()));
    check_same_device(op, x, "x", p, pnames[k]);
  }
  TORCH_CHECK_TYPE(!bias.has_value() || bias->scalar_type() == weight.scalar_type(), op,
                   ": bias must have weight's dtype (", dtype_name(weight.scalar_type()),
                   "), got ", dtype_name(bias.has_value() ? bias->scalar_type() : at::kFloat));
  // the FP8 side: cast_fp8's checks, under this operator's name
  return check_cast_fp8_args(x, dtype, pad, scale, scale_index, amax_out, amax_index, op);
}

// dgelu_cast_fp8(grad [rows, cols] bf16/fp16, x like grad (same shape, dtype, device), ...,
// scale fp32 (required: delayed scaling), amax_out fp32): the checks of cast_fp8 plus these;
// the FP8 format code of dtype.
inline int check_dgelu_cast_fp8_args(const at::Tensor& grad, const at::Tensor& x,
                                     at::ScalarType dtype, int64_t pad,
                                     const std::optional<at::Tensor>& scale, int64_t scale_index,
                                     const std::optional<at::Tensor>& amax_out,
                                     int64_t amax_index) {
  const char* op = "dgelu_cast_fp8";
  check_cast_input(op, grad);
  TORCH_CHECK_VALUE(x.sizes() == grad.sizes(), op, ": x must have grad's shape ", grad.sizes(),
                    ", got ", x.sizes());
  TORCH_CHECK_TYPE(x.scalar_type() == grad.scalar_type(), op, ": x must have grad's dtype (",
                   dtype_name(grad.scalar_type()), "), got ", dtype_name(x.scalar_type()));
  check_same_device(op, grad, "grad", x, "x");
  TORCH_CHECK_VALUE(scale.has_value(), op,
                    ": needs a delayed scale (scale tensor); current scaling is not fused");
  return check_cast_fp8_args(grad, dtype, pad, scale, scale_index, amax_out, amax_index, op);
}

}  // namespace dept_mega
