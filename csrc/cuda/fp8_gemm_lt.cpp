// CUDA kernel of dept_mega::fp8_gemm (semantics and checks: csrc/fp8_gemm.h): one cuBLASLt
// matmul on the current stream, with torch's cuBLASLt handle and a workspace from the caching
// allocator.
//
// UNVERIFIED on a GPU: built only by setup.py's CUDAExtension route (linked with cublasLt);
// CI syntax-checks it against torch's headers and cublasLt.h (tools/check_cuda_compile.sh).
// tests/test_fp8_gemm.py's gpu test compares it with torch._scaled_mm on training shapes.
//
// Why not torch._scaled_mm: it cannot accumulate into its output (beta = 0, a new tensor), so
// the FP8 weight gradient was a bf16 dW then an fp32 add into main_grad; here the GEMM adds into
// main_grad itself (beta = 1, C = D, fp32 output), as Transformer Engine's wgrad does. And
// _scaled_mm creates its descriptors and asks cuBLASLt's heuristic on every call; here the
// algorithm chosen for a problem is cached (AlgoKey below), so a call after the first is the
// descriptors' set-up and cublasLtMatmul. The algorithm is the heuristic's first, or with
// tune > 1 the fastest of its first `tune` candidates timed on the problem's first call
// (pick_fastest; config key fp8_gemm_tuning).
//
// Layout (cuBLASLt is column-major): the row-major [m, n] result D is, read column-major, the
// [n, m] matrix Dᵀ = bᵀ · aᵀ. So cuBLASLt's A is our b ([k, n] column-major: op(A) = transpose,
// its [n, k] bᵀ), its B is our a ([m, k] row-major = [k, m] column-major, not transposed): the
// "TN" form, the one layout cuBLASLt's FP8 kernels take on Ada / Hopper (A transposed, B not),
// with no copy. cuBLASLt's A scale is therefore our scale_b and its B scale our scale_a (a product
// of two scalars either way). Requirements of cuBLASLt's FP8 GEMM honoured (cuBLAS docs,
// cublasLtMatmul, FP8): compute type CUBLAS_COMPUTE_32F, scale type CUDA_R_32F, TN, dimensions
// and leading dimensions multiples of 16, 16-byte aligned pointers (checked before the call:
// check_fp8_gemm_args); types e4m3 x e4m3, e4m3 x e5m2, e5m2 x e4m3 with C = D in bf16 or fp32.
// Accumulation: C and D are the same tensor with the same layout (in place), beta = 1.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cublasLt.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "../fp8_gemm.h"

namespace dept_mega {
namespace {

cudaDataType_t lt_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat8_e4m3fn: return CUDA_R_8F_E4M3;
    case at::kFloat8_e5m2: return CUDA_R_8F_E5M2;
    case at::kBFloat16: return CUDA_R_16BF;
    case at::kFloat: return CUDA_R_32F;
    default: TORCH_CHECK_TYPE(false, "fp8_gemm: no cuBLASLt type for ", dtype_name(t));
  }
}

// The largest power of two (at most 256) that divides the address: cuBLASLt's heuristic is told
// the operands' real alignment (its default assumes 256 bytes) and the choice is cached per
// alignment.
uint32_t alignment(const void* p) {
  const uintptr_t v = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 1;
  while (al < 256 && v % (2 * al) == 0) al *= 2;
  return al;
}

// What the cached algorithm depends on: device, problem size, leading dimensions, types,
// beta != 0, fast accumulation, the pointers' alignments, and how it was chosen (the last: 1 for
// the heuristic's first, untimed, else the `tune` candidates it was timed among), so that a
// problem first seen untuned (tune 0 or 1, or while a stream was captured) is still tuned on its
// first call with tune > 1.
using AlgoKey = std::tuple<int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, int, int,
                           bool, bool, uint32_t, uint32_t, uint32_t, int64_t>;

struct CachedAlgo {
  cublasLtMatmulAlgo_t algo;
  size_t workspace;  // bytes the algorithm asked for
};

struct AlgoCache {
  std::mutex mu;
  std::map<AlgoKey, CachedAlgo> map;
};

AlgoCache& algo_cache() {
  static auto* cache = new AlgoCache();  // never freed: no CUDA state in a static destructor
  return *cache;
}

struct Problem {  // for messages
  int64_t m, n, k;
  at::ScalarType a, b, d;
  bool accumulate, fast;

  std::string describe() const {
    std::ostringstream s;
    s << "a [" << m << ", " << k << "] " << dtype_name(a) << " x b [" << k << ", " << n << "] "
      << dtype_name(b) << " -> " << dtype_name(d) << " [" << m << ", " << n << "]"
      << (accumulate ? ", accumulating (beta = 1)" : "") << (fast ? ", fast accumulation" : "");
    return s.str();
  }
};

void check_lt(cublasStatus_t st, const char* call, const Problem& p) {
  TORCH_CHECK(st == CUBLAS_STATUS_SUCCESS, "fp8_gemm: ", call, " failed: ",
              cublasLtGetStatusString(st), " (status ", static_cast<int>(st), ") for ",
              p.describe());
}

// Owners of the per-call descriptors (destroyed on every path out, exceptions included).
struct MatmulDesc {
  cublasLtMatmulDesc_t d = nullptr;
  ~MatmulDesc() {
    if (d != nullptr) cublasLtMatmulDescDestroy(d);
  }
};
struct Layout {
  cublasLtMatrixLayout_t l = nullptr;
  ~Layout() {
    if (l != nullptr) cublasLtMatrixLayoutDestroy(l);
  }
};
struct Preference {
  cublasLtMatmulPreference_t p = nullptr;
  ~Preference() {
    if (p != nullptr) cublasLtMatmulPreferenceDestroy(p);
  }
};

template <typename T>
void set_desc(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, const T& value,
              const char* what, const Problem& p) {
  check_lt(cublasLtMatmulDescSetAttribute(d, attr, &value, sizeof(value)), what, p);
}

template <typename T>
void set_pref(cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr,
              const T& value, const char* what, const Problem& p) {
  check_lt(cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value)), what, p);
}

// What a timed candidate runs on: the call's descriptors and operands.
struct Operands {
  cublasLtHandle_t handle;
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t lt_a, lt_b, lt_d;
  const at::Tensor& a;
  const at::Tensor& b;
  const at::Tensor& d;
  bool accumulate;
};

struct Event {  // destroyed on every path out
  cudaEvent_t e = nullptr;
  Event() { C10_CUDA_CHECK(cudaEventCreate(&e)); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  ~Event() {
    if (e != nullptr) cudaEventDestroy(e);
  }
};
struct Events {  // two members, each its own owner: if the second's creation throws, the first's
  // destructor still runs (a constructor that throws skips its own class's destructor)
  Event start, stop;
};

int32_t algo_config(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr) {
  int32_t v = -1;  // -1: cuBLASLt did not say
  size_t written = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, sizeof(v), &written) != CUBLAS_STATUS_SUCCESS) return -1;
  return v;
}

// tune > 1, on the problem's first call: every candidate of cuBLASLt's heuristic (in its order)
// runs once, then kTuneReps times between two events on the call's stream; the fastest is kept,
// the heuristic's first unless another is at least kTuneMargin faster (timing noise must not
// trade a kernel for an equal one). The candidates write into a scratch copy of the output, never
// into it (an accumulating GEMM would add into main_grad). A candidate cuBLASLt refuses to run
// is skipped (its time null). One host synchronisation per candidate, once per problem. Never
// called while the stream is being captured into a CUDA graph (no synchronisation is allowed
// there): fp8_gemm_cuda takes the heuristic's first, cached as untuned, and the problem's next
// uncaptured call times it. Each tuning is one JSON line of fp8_gemm_tuning_log.
constexpr int kTuneReps = 10;
constexpr float kTuneMargin = 0.02f;

// One JSON line of fp8_gemm_tuning_log: the problem, how the algorithm was chosen, each
// candidate's milliseconds (null: not run or failed) and algorithm / tile ids, the one kept.
void record_tuning(const Problem& prob, const char* why,
                   const std::vector<cublasLtMatmulHeuristicResult_t>& results, const std::vector<float>& ms,
                   int pick) {
  const int n = static_cast<int>(results.size());
  std::ostringstream line;
  line << "{\"m\": " << prob.m << ", \"n\": " << prob.n << ", \"k\": " << prob.k << ", \"a\": \""
       << dtype_name(prob.a) << "\", \"b\": \"" << dtype_name(prob.b) << "\", \"out\": \"" << dtype_name(prob.d)
       << "\", \"accumulate\": " << (prob.accumulate ? "true" : "false")
       << ", \"fast_accum\": " << (prob.fast ? "true" : "false") << ", \"how\": \"" << why << "\", \"ms\": [";
  for (int i = 0; i < n; ++i) {
    line << (i ? ", " : "");
    if (i < static_cast<int>(ms.size()) && ms[i] >= 0.0f) {
      line << ms[i];
    } else {
      line << "null";
    }
  }
  line << "], \"algo_ids\": [";
  for (int i = 0; i < n; ++i) line << (i ? ", " : "") << algo_config(results[i].algo, CUBLASLT_ALGO_CONFIG_ID);
  line << "], \"tile_ids\": [";
  for (int i = 0; i < n; ++i) line << (i ? ", " : "") << algo_config(results[i].algo, CUBLASLT_ALGO_CONFIG_TILE_ID);
  line << "], \"chosen\": " << pick << "}";
  record_fp8_gemm_tuning(line.str());
}

int pick_fastest(const Operands& o, const std::vector<cublasLtMatmulHeuristicResult_t>& results,
                 const Problem& prob) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int n = static_cast<int>(results.size());
  std::vector<float> ms(n, -1.0f);  // -1: not run
  int pick = 0;
  const char* why = "timed";
  if (n > 1) {
    at::Tensor scratch = o.accumulate ? o.d.clone() : at::empty_like(o.d);
    size_t ws_bytes = 0;
    for (const auto& r : results) ws_bytes = std::max(ws_bytes, r.workspaceSize);
    at::Tensor ws;
    if (ws_bytes > 0) ws = at::empty({static_cast<int64_t>(ws_bytes)}, o.a.options().dtype(at::kByte));
    void* ws_ptr = ws_bytes > 0 ? ws.data_ptr() : nullptr;
    const float alpha = 1.0f, beta = o.accumulate ? 1.0f : 0.0f;
    void* s_ptr = scratch.data_ptr();
    const Events ev;
    for (int i = 0; i < n; ++i) {
      if (results[i].state != CUBLAS_STATUS_SUCCESS) continue;
      auto run = [&]() {
        return cublasLtMatmul(o.handle, o.desc, &alpha, o.b.const_data_ptr(), o.lt_a, o.a.const_data_ptr(),
                              o.lt_b, &beta, s_ptr, o.lt_d, s_ptr, o.lt_d, &results[i].algo, ws_ptr,
                              results[i].workspaceSize, stream);
      };
      if (run() != CUBLAS_STATUS_SUCCESS) continue;  // warm-up; refused: skipped
      bool ok = true;
      C10_CUDA_CHECK(cudaEventRecord(ev.start.e, stream));
      for (int r = 0; r < kTuneReps && ok; ++r) ok = run() == CUBLAS_STATUS_SUCCESS;
      C10_CUDA_CHECK(cudaEventRecord(ev.stop.e, stream));
      C10_CUDA_CHECK(cudaEventSynchronize(ev.stop.e));
      float elapsed = 0.0f;
      C10_CUDA_CHECK(cudaEventElapsedTime(&elapsed, ev.start.e, ev.stop.e));
      if (ok) ms[i] = elapsed / kTuneReps;
    }
    int best = -1;
    for (int i = 0; i < n; ++i) {
      if (ms[i] >= 0.0f && (best < 0 || ms[i] < ms[best])) best = i;
    }
    TORCH_CHECK(best >= 0, "fp8_gemm: tuning ", prob.describe(), ": none of cuBLASLt's ", n,
                " candidate algorithms ran");
    if (best > 0 && (ms[0] < 0.0f || ms[best] < (1.0f - kTuneMargin) * ms[0])) pick = best;
  } else {
    why = "one candidate";
  }
  record_tuning(prob, why, results, ms, pick);
  return pick;
}

at::Tensor fp8_gemm_cuda(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                         const at::Tensor& scale_b, bool use_fast_accum,
                         const std::optional<at::Tensor>& out, bool first, int64_t tune) {
  check_fp8_gemm_args(a, b, scale_a, scale_b, out, first, tune);
  const c10::cuda::CUDAGuard guard(a.device());
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  at::Tensor d = out.has_value() ? *out : at::empty({m, n}, a.options().dtype(at::kBFloat16));
  const bool accumulate = out.has_value() && !first;
  if (m == 0 || n == 0) return out.has_value() ? at::Tensor() : d;
  if (k == 0) {  // an empty product: D = beta * C
    if (!accumulate) d.zero_();
    return out.has_value() ? at::Tensor() : d;
  }
  const Problem prob{m, n, k, a.scalar_type(), b.scalar_type(), d.scalar_type(), accumulate,
                     use_fast_accum};
  const int64_t lda = a.stride(0), ldb = b.stride(1), ldd = d.stride(0);
  const cudaDataType_t a_t = lt_type(a.scalar_type()), b_t = lt_type(b.scalar_type()),
                       d_t = lt_type(d.scalar_type());

  MatmulDesc desc;
  check_lt(cublasLtMatmulDescCreate(&desc.d, CUBLAS_COMPUTE_32F, CUDA_R_32F),
           "cublasLtMatmulDescCreate", prob);
  set_desc(desc.d, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T, "setting TRANSA", prob);
  set_desc(desc.d, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N, "setting TRANSB", prob);
  const void* lt_a_scale = scale_b.const_data_ptr();  // cuBLASLt's A is our b (see the top)
  const void* lt_b_scale = scale_a.const_data_ptr();
  set_desc(desc.d, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, lt_a_scale, "setting A_SCALE_POINTER", prob);
  set_desc(desc.d, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, lt_b_scale, "setting B_SCALE_POINTER", prob);
  const int8_t fast = use_fast_accum ? 1 : 0;
  set_desc(desc.d, CUBLASLT_MATMUL_DESC_FAST_ACCUM, fast, "setting FAST_ACCUM", prob);

  // column-major: cuBLASLt's A = b as [k rows, n cols], B = a as [k, m], C = D = d as [n, m]
  Layout lt_a, lt_b, lt_d;
  check_lt(cublasLtMatrixLayoutCreate(&lt_a.l, b_t, k, n, ldb), "cublasLtMatrixLayoutCreate (b)", prob);
  check_lt(cublasLtMatrixLayoutCreate(&lt_b.l, a_t, k, m, lda), "cublasLtMatrixLayoutCreate (a)", prob);
  check_lt(cublasLtMatrixLayoutCreate(&lt_d.l, d_t, n, m, ldd), "cublasLtMatrixLayoutCreate (out)", prob);

  cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  const uint32_t al_a = alignment(b.const_data_ptr()), al_b = alignment(a.const_data_ptr()),
                 al_d = alignment(d.const_data_ptr());
  // tune 0 and 1 choose alike (the heuristic's first): one key
  const int64_t how = tune > 1 ? tune : 1;
  AlgoKey key{static_cast<int>(a.device().index()), m, n, k, lda, ldb, ldd,
              static_cast<int>(a_t), static_cast<int>(b_t), static_cast<int>(d_t), accumulate,
              use_fast_accum, al_a, al_b, al_d, how};
  CachedAlgo chosen{};
  AlgoCache& cache = algo_cache();
  auto lookup = [&]() {
    const std::lock_guard<std::mutex> lock(cache.mu);
    auto it = cache.map.find(key);
    if (it == cache.map.end()) return false;
    chosen = it->second;
    return true;
  };
  bool cached = lookup();
  bool captured = false;  // a tuned problem's first call inside a CUDA graph capture: untimed
  if (!cached && how > 1) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(), &capture));
    if (capture != cudaStreamCaptureStatusNone) {
      // no timing (no host synchronisation) while capturing: the untuned choice, under the
      // untuned key, so that the tuned key stays free for the next uncaptured call to time
      captured = true;
      std::get<15>(key) = 1;
      cached = lookup();
    }
  }
  if (!cached) {
    Preference pref;
    check_lt(cublasLtMatmulPreferenceCreate(&pref.p), "cublasLtMatmulPreferenceCreate", prob);
    const uint64_t max_ws = static_cast<uint64_t>(at::cuda::getCUDABlasLtWorkspaceSize());
    set_pref(pref.p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, max_ws, "setting MAX_WORKSPACE_BYTES", prob);
    set_pref(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, al_a, "setting MIN_ALIGNMENT_A_BYTES", prob);
    set_pref(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, al_b, "setting MIN_ALIGNMENT_B_BYTES", prob);
    set_pref(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, al_d, "setting MIN_ALIGNMENT_C_BYTES", prob);
    set_pref(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, al_d, "setting MIN_ALIGNMENT_D_BYTES", prob);
    const int asked = std::get<15>(key) > 1 ? static_cast<int>(tune) : 1;
    std::vector<cublasLtMatmulHeuristicResult_t> results(asked);
    int found = 0;
    check_lt(cublasLtMatmulAlgoGetHeuristic(handle, desc.d, lt_a.l, lt_b.l, lt_d.l, lt_d.l, pref.p, asked,
                                            results.data(), &found),
             "cublasLtMatmulAlgoGetHeuristic", prob);
    TORCH_CHECK(found > 0 && results[0].state == CUBLAS_STATUS_SUCCESS,
                "fp8_gemm: cuBLASLt has no algorithm for ", prob.describe(), " (workspace limit ",
                max_ws, " bytes, alignments ", al_a, "/", al_b, "/", al_d, " bytes)");
    results.resize(found);
    int pick = 0;
    if (asked > 1) {
      const Operands ops{handle, desc.d, lt_a.l, lt_b.l, lt_d.l, a, b, d, accumulate};
      pick = pick_fastest(ops, results, prob);
    } else if (captured) {  // said once per problem (the untuned key is cached from now on)
      record_tuning(prob, "not timed: the stream is being captured (the next uncaptured call times it)",
                    results, {}, 0);
    }
    chosen = CachedAlgo{results[pick].algo, results[pick].workspaceSize};
    const std::lock_guard<std::mutex> lock(cache.mu);
    cache.map.emplace(key, chosen);
  }

  at::Tensor workspace;  // from the caching allocator, on the current stream (freed after the call)
  void* ws_ptr = nullptr;
  if (chosen.workspace > 0) {
    workspace = at::empty({static_cast<int64_t>(chosen.workspace)}, a.options().dtype(at::kByte));
    ws_ptr = workspace.data_ptr();
  }
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  void* d_ptr = d.data_ptr();
  check_lt(cublasLtMatmul(handle, desc.d, &alpha, b.const_data_ptr(), lt_a.l, a.const_data_ptr(), lt_b.l,
                          &beta, d_ptr, lt_d.l, d_ptr, lt_d.l, &chosen.algo, ws_ptr, chosen.workspace,
                          c10::cuda::getCurrentCUDAStream()),
           "cublasLtMatmul", prob);
  return out.has_value() ? at::Tensor() : d;
}

}  // namespace

TORCH_LIBRARY_IMPL(dept_mega, CUDA, m) { m.impl("fp8_gemm", &fp8_gemm_cuda); }

}  // namespace dept_mega
