#!/usr/bin/env bash
# Compile-checks the CUDA side of the custom ops without a GPU or a CUDA build of torch:
#  1. csrc/cuda/kernels.cu, remap_ranked.cu, fp8_cast.cu, layernorm_cast.cu and dgelu_cast.cu (plain
#     CUDA C++, no torch headers) with nvcc for sm_90, and checks that the objects export the C interface of csrc/cuda/kernels.h;
#  2. csrc/cuda/ops_cuda.cpp (the torch-facing CUDA operators) with g++ -fsyntax-only against
#     the installed torch's headers and the CUDA toolkit's headers;
#  3. csrc/cuda/fp8_gemm_lt.cpp (the cuBLASLt FP8 GEMM) the same way, plus cublasLt.h (and the
#     cuSPARSE / cuSOLVER headers torch's CUDAContextLight.h includes). They come with a full
#     CUDA toolkit or with NVIDIA's pip wheels (nvidia/cu13/include, nvidia/cublas/include, ...):
#     looked for in CUBLASLT_INCLUDE (folders, ':'-separated), next to nvcc, $CUDA_HOME/include,
#     /usr/local/cuda/include, and the nvidia packages of $PYTHON and of $CUDA_PYTHON (e.g. the
#     python of a CUDA torch). Not found: said, and this file is not checked (not an error).
# Both with the C++ standard the torch of $PYTHON builds extensions with (the -std= flag its
# BuildExtension adds, which setup.py's build passes to nvcc and g++ alike: c++17 for torch 2.11,
# c++20 for later ones; read by tools/torch_cxx_std.py), printed first; c++17 for the .cu files
# when torch is not importable.
# A check, not the build: the .cu files are compiled with the host side at -O0 and the device
# side at nvcc's fastest compile (-Ofc max, where nvcc has it: CUDA 12.8 and later), which cuts
# the check's nvcc time by about 2.5x; setup.py builds them with -O3. What fails the build fails
# the check just the same: front-end and template instantiation errors (every instantiation is
# still compiled), PTX that ptxas rejects (an instruction sm_90 lacks) and ptxas's resource
# limits (static shared memory over 48 KiB); register pressure makes ptxas spill, never fail, at
# any level.
# Exits 0 on success, 1 on a compile error, 77 when nvcc is not found (nothing checked).
# Environment: NVCC (default: nvcc on PATH, else $CUDA_HOME/bin/nvcc, else
# /usr/local/cuda/bin/nvcc), PYTHON (default .venv/bin/python, else python3), CUDA_ARCH
# (default sm_90), CUBLASLT_INCLUDE, CUDA_PYTHON, CXX_STD (e.g. c++17: this standard instead of
# torch's).
set -euo pipefail
cd "$(dirname "$0")/.."

NVCC=${NVCC:-$(command -v nvcc || true)}
if [ -z "$NVCC" ] && [ -n "${CUDA_HOME:-}" ] && [ -x "$CUDA_HOME/bin/nvcc" ]; then NVCC=$CUDA_HOME/bin/nvcc; fi
if [ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ]; then NVCC=/usr/local/cuda/bin/nvcc; fi
if [ -z "$NVCC" ]; then
  echo "check_cuda_compile: nvcc not found; CUDA sources not checked" >&2
  exit 77
fi
ARCH=${CUDA_ARCH:-sm_90}
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

std_rc=0
TORCH_INC=
if [ -n "${CXX_STD:-}" ]; then
  STD=$CXX_STD; std_why="CXX_STD"
else
  # the standard and torch's include folders (for ops_cuda.cpp below) from one Python start
  std_out=$("$PY" tools/torch_cxx_std.py --include-paths 2>"$tmp/std.err") || std_rc=$?
  STD=$(sed -n 1p <<<"$std_out")
  TORCH_INC=$(sed -n 2p <<<"$std_out")
  STD=${STD#-std=}
  case $std_rc in
    0) std_why="what the torch of $PY builds extensions with (tools/torch_cxx_std.py)" ;;
    2) STD=c++17; std_why="torch is not importable with $PY: the .cu files' standard without torch" ;;
    *) cat "$tmp/std.err" >&2
       echo "check_cuda_compile: cannot tell the C++ standard of the torch of $PY (set CXX_STD, e.g. c++17)" >&2
       exit 1 ;;
  esac
fi
echo "check_cuda_compile: -std=$STD: $std_why"

echo "check_cuda_compile: $("$NVCC" --version | tail -1)"
# With the restrictive defines torch's CUDAExtension passes to nvcc (no implicit half /
# bf16 conversions), so the kernels compile in both settings.
TORCH_NVCC_FLAGS=(-D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__
                  -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__
                  --expt-relaxed-constexpr)
# csrc/cuda/*.cu, the kernels behind kernels.h, in two nvcc lanes of about the same time (kernels.cu,
# with cub, is the longest), while g++ checks ops_cuda.cpp against torch's headers
CU_LANES=("kernels remap_ranked" "fp8_cast layernorm_cast dgelu_cast")
read -r -a CU_SOURCES <<<"${CU_LANES[*]}"
# the check's optimisation levels (see the top; setup.py: -O3)
CHECK_OPT=(-O0)
nvcc_help=$("$NVCC" --help 2>/dev/null || true)  # (not piped into grep -q: pipefail, SIGPIPE)
if grep -q -- '--Ofast-compile' <<<"$nvcc_help"; then CHECK_OPT+=(-Ofc max); fi
echo "check_cuda_compile: nvcc -arch=$ARCH -std=$STD -c csrc/cuda/{$(IFS=,; echo "${CU_SOURCES[*]}")}.cu" \
     "(${CHECK_OPT[*]}: a compile check, the build uses -O3)"
nvcc_lane() {  # compiles the sources $@ one after the other; stops at the first error
  local src
  for src in "$@"; do
    "$NVCC" -arch="$ARCH" "${CHECK_OPT[@]}" --fmad=false -std="$STD" "${TORCH_NVCC_FLAGS[@]}" -Xcompiler -Wall \
      -c "csrc/cuda/$src.cu" -o "$tmp/$src.o" || return $?
  done
}
NVCC_PIDS=()
for i in "${!CU_LANES[@]}"; do
  # shellcheck disable=SC2086  # a lane: names without spaces
  nvcc_lane ${CU_LANES[$i]} >"$tmp/nvcc$i.log" 2>&1 &
  NVCC_PIDS+=($!)
done
finish_nvcc() {  # wait for the nvcc lanes; fail with their output, or check the symbols they export
  local rc=0 lane_rc i
  for i in "${!NVCC_PIDS[@]}"; do
    lane_rc=0
    wait "${NVCC_PIDS[$i]}" || lane_rc=$?
    cat "$tmp/nvcc$i.log"
    if [ $lane_rc -ne 0 ]; then rc=$lane_rc; fi
  done
  if [ $rc -ne 0 ]; then
    echo "check_cuda_compile: nvcc failed (rc=$rc)" >&2
    exit 1
  fi
  local syms
  syms=$(for src in "${CU_SOURCES[@]}"; do nm -g --defined-only "$tmp/$src.o"; done)
  for sym in dm_gather_rows dm_remap_ids dm_remap_ranked dm_scatter_workspace_bytes dm_scatter_prepare dm_scatter_apply \
             dm_record_error dm_fp8_amax_parts dm_fp8_max_cols dm_fp8_cast dm_layernorm_cast_fp8 \
             dm_dgelu_cast_fp8; do
    if ! grep -qw "$sym" <<<"$syms"; then
      echo "check_cuda_compile: the CUDA objects do not export $sym" >&2
      exit 1
    fi
  done
}

if [ -n "${CXX_STD:-}" ]; then
  TORCH_INC=$("$PY" -c "from torch.utils.cpp_extension import include_paths; print(' '.join(include_paths()))" 2>/dev/null || true)
fi
if [ -z "$TORCH_INC" ]; then
  echo "check_cuda_compile: torch not importable with $PY; ops_cuda.cpp not checked" >&2
  finish_nvcc
  exit 0
fi
CUDA_INC=
for d in "$(dirname "$(dirname "$(readlink -f "$NVCC")")")/include" "${CUDA_HOME:-/nonexistent}/include" \
         /usr/local/cuda/include; do
  if [ -f "$d/cuda_runtime_api.h" ]; then CUDA_INC=$d; break; fi
done
if [ -z "$CUDA_INC" ]; then
  echo "check_cuda_compile: cuda_runtime_api.h not found next to $NVCC; ops_cuda.cpp not checked" >&2
  finish_nvcc
  exit 1
fi
INCS=()
for d in $TORCH_INC; do INCS+=(-isystem "$d"); done
first_inc=${TORCH_INC%% *}
if [ ! -f "$first_inc/c10/cuda/impl/cuda_cmake_macros.h" ]; then
  mkdir -p "$tmp/stub/c10/cuda/impl"
  echo '#define C10_CUDA_BUILD_SHARED_LIBS' > "$tmp/stub/c10/cuda/impl/cuda_cmake_macros.h"
  INCS=(-isystem "$tmp/stub" "${INCS[@]}")
fi
echo "check_cuda_compile: g++ -std=$STD -fsyntax-only csrc/cuda/ops_cuda.cpp"
gxx_rc=0
"${CXX:-g++}" -std="$STD" -fsyntax-only -Wall "${INCS[@]}" -isystem "$CUDA_INC" csrc/cuda/ops_cuda.cpp || gxx_rc=$?

# csrc/cuda/fp8_gemm_lt.cpp: needs cublasLt.h (see the top)
nvidia_includes() {  # the include folders of the nvidia pip packages of python $1
  [ -n "$1" ] || return 0
  "$1" - <<'PYEOF' 2>/dev/null || true
import os
try:
    import nvidia
except ImportError:
    raise SystemExit(0)
for base in getattr(nvidia, "__path__", []):
    for name in sorted(os.listdir(base)):
        inc = os.path.join(base, name, "include")
        if os.path.isdir(inc):
            print(inc)
PYEOF
}
LT_CANDIDATES=()
IFS=: read -r -a _extra <<<"${CUBLASLT_INCLUDE:-}"
for d in "${_extra[@]}"; do [ -n "$d" ] && LT_CANDIDATES+=("$d"); done
LT_CANDIDATES+=("$CUDA_INC" "${CUDA_HOME:-/nonexistent}/include" /usr/local/cuda/include)
while IFS= read -r d; do LT_CANDIDATES+=("$d"); done < <(nvidia_includes "$PY"; nvidia_includes "${CUDA_PYTHON:-}")
LT_INCS=()
have_lt=0
for d in "${LT_CANDIDATES[@]}"; do
  [ -d "$d" ] || continue
  if [ -f "$d/cublasLt.h" ]; then have_lt=1; fi
  # every folder with one of the headers CUDAContextLight.h includes (a wheel per library)
  if [ -f "$d/cublasLt.h" ] || [ -f "$d/cusparse.h" ] || [ -f "$d/cusolverDn.h" ]; then LT_INCS+=(-isystem "$d"); fi
done
lt_rc=0
if [ $have_lt -eq 1 ]; then
  echo "check_cuda_compile: g++ -std=$STD -fsyntax-only csrc/cuda/fp8_gemm_lt.cpp"
  "${CXX:-g++}" -std="$STD" -fsyntax-only -Wall "${INCS[@]}" -isystem "$CUDA_INC" "${LT_INCS[@]}" \
    csrc/cuda/fp8_gemm_lt.cpp || lt_rc=$?
else
  echo "check_cuda_compile: cublasLt.h not found (CUBLASLT_INCLUDE, next to nvcc, CUDA_HOME, the nvidia" \
       "packages of $PY${CUDA_PYTHON:+ and $CUDA_PYTHON}); csrc/cuda/fp8_gemm_lt.cpp not checked"
fi
finish_nvcc
if [ $gxx_rc -ne 0 ]; then
  echo "check_cuda_compile: ops_cuda.cpp failed the syntax check (rc=$gxx_rc)" >&2
  exit 1
fi
if [ $lt_rc -ne 0 ]; then
  echo "check_cuda_compile: fp8_gemm_lt.cpp failed the syntax check (rc=$lt_rc)" >&2
  exit 1
fi
echo "check_cuda_compile: OK"
