# shellcheck shell=bash
# The stages of benchmarks/gpu_check.sh, which sources this file (it is not a script of its own:
# `bash benchmarks/gpu_check.sh --stages NAME,...` runs stages; `--help` says what each measures,
# its expected seconds and where its figures go). Here: stage_NAME, the commands of stage NAME,
# each run through gpu_check.sh's run or within (under the stage's deadline), and their helpers:
# the extension's build (start_build, wait_build, static_libstdcxx), pytest_args, bench (one
# tools/benchmark.py run) and bench_row (its record as a row of bench.jsonl), reuse, compiled_bench,
# memory_compare and record_row. They read gpu_check.sh's settings (DRY, PY, OUT, WORK, LOG, CFG,
# SHAPE, the dry run's arguments, ...); BIG_SET below reads BIG_VOCAB when sourced, so gpu_check.sh
# sources this file after its settings, before the sequence.
[[ ${BASH_SOURCE[0]} != "$0" ]] || { echo "error: $0 is sourced by benchmarks/gpu_check.sh, not run on its own: bash benchmarks/gpu_check.sh --help" >&2; exit 2; }

BUILD_PID=
# stages that run the extension's operators (the FP8 defaults do on the GPU: the C++ casts, cuBLASLt)
NEEDS_BUILD=(build ops_tests ops fp8 fp8_all_fused fp8_tuned fp8_cuda fp8_lt fp8_lt_fused fp8_tlt_fused fp8_fast_accum fp8_mb8
             fp8_current fp8_lt_mb8 fp8_host fp8_casts)
start_build() {
  if [ -n "$ONLY" ]; then
    local s need=0
    for s in "${NEEDS_BUILD[@]}"; do [[ ",$ONLY," == *",$s,"* ]] && need=1; done
    [ $need = 1 ] || return 0
  fi
  forkserver_up
  if [ "$DRY" = 1 ]; then  # the same command, building nothing (a CPU build takes minutes here)
    (DEPT_MEGA_NO_EXT=1 "$PY" setup.py build_ext --inplace; rc=$?
     [ -z "${GPU_CHECK_DRY_BUILD_NOTE:-}" ] || echo "$GPU_CHECK_DRY_BUILD_NOTE"; exit $rc) >"$OUT/build.log" 2>&1 &
  else
    (TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-8} \
      "$PY" setup.py build_ext --inplace >"$OUT/build.log" 2>&1) &
  fi
  BUILD_PID=$!
  log "### build started in the background (pid $BUILD_PID, log build.log)"
}

stage_env() {
  if command -v nvidia-smi >/dev/null; then
    within nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv >>"$LOG" 2>&1
  fi
  run "$PY" - "$WORK/env.json" <<'EOF'
import datetime, json, sys, torch
d = {"device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
     "torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
     "date": datetime.datetime.now().isoformat(timespec="seconds")}
try:
    from importlib.metadata import version
    d["megatron_core"] = version("megatron-core")
except Exception:
    d["megatron_core"] = None
# the toolchain that builds the extension (torch's cpp_extension runs $CXX, else c++) and the C++
# runtime torch loaded: one build there crashed on some C++ exceptions of the extension
import os, shutil, subprocess
cxx = os.environ.get("CXX", "c++")
try:
    ver = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=20).stdout.splitlines()[0]
except Exception as e:  # noqa: BLE001 (recorded, not fatal)
    ver = f"unavailable: {e}"
d["cxx"] = {"command": cxx, "path": shutil.which(cxx), "version": ver}
d["cxx_runtime"] = sorted({line.split()[-1] for line in open("/proc/self/maps")
                           if "libstdc++" in line or "libgcc_s" in line})
json.dump(d, open(sys.argv[1], "w"), indent=1)
print(json.dumps(d))
EOF
}

pytest_args() {
  local x=()
  # a test file per worker: 3 workers, 6 where the host has 12 cores or more (the device: 16),
  # so that the files whose tests compile with inductor run side by side; the dry run in one
  # process (its tests all skip: workers would only add their start-up)
  local n=3
  (( $(nproc) >= 12 )) && n=6
  [ "$DRY" = 0 ] && "$PY" -c "import xdist" 2>/dev/null && x=(-n "$n" --dist loadfile)
  echo "-q -m gpu -p no:cacheprovider -rfEs ${x[*]}"
}

stage_tests() {  # GPU tests that do not need the extension, while it builds
  local files=()
  for f in $(grep -l "mark.gpu" tests/test_*.py); do  # (one grep: a stage's time is its commands')
    case $f in tests/test_ops.py|tests/test_ops_errors.py|tests/test_ops_gpu.py|tests/test_fp8_cuda_cast.py|tests/test_fp8_gemm.py|tests/test_fp8_gemm_tuning.py|tests/test_fp8_fused_op.py|tests/test_triton_launch.py) continue ;; esac
    files+=("$f")
  done
  local rc=0
  # shellcheck disable=SC2046
  DEPT_MEGA_OPS=torch run "$PY" -m pytest $(pytest_args) "${files[@]}" || rc=1
  # the Triton casts' direct launch, whole: its checks against this Triton's own launch path
  # need Triton, which the CPU test environment lacks, and its gpu test the device
  DEPT_MEGA_OPS=torch run "$PY" -m pytest -q -p no:cacheprovider -rfEs tests/test_triton_launch.py || rc=1
  return $rc
}

# The GPU image's /opt/gcc g++ linked a static copy of libstdc++ into the extension (2026-11-28):
# every C++ message with a number crashed the process, the FP8 GEMM tuning's record first (the
# fp8_tuned run and tests/test_fp8_gemm_tuning.py). setup.py now links the runtime's libstdc++ and
# checks the built library; where build.log still has its warning, those are not run (a known crash).
static_libstdcxx() {  # why, when the finished build's log says the extension defines libstdc++'s own symbols
  [ -z "$BUILD_PID" ] && [ -f "$OUT/build.log" ] || return 1
  local syms
  syms=$(sed -n "s/.* defines libstdc++'s own \([^:]*\):.*/\1/p; T; q" "$OUT/build.log")
  [ -n "$syms" ] || return 1
  echo "the extension carries a static copy of libstdc++ (build.log: it defines libstdc++'s own $syms), with which the FP8 GEMM tuning crashes the process (its record formats numbers; a segmentation fault on the H200, 2026-11-28): rebuild with CXX=/usr/bin/g++"
}

wait_build() {  # the stages that run the extension's operators wait for its build first
  [ -n "$BUILD_PID" ] || return 0
  log "waiting for the build (pid $BUILD_PID)"
  local t0=$SECONDS
  while kill -0 "$BUILD_PID" 2>/dev/null && (( $(date +%s) < STAGE_END )); do sleep 1; done
  if kill -0 "$BUILD_PID" 2>/dev/null; then
    log "the build is still running after $(( SECONDS - t0 ))s: the wait stopped at the stage's limit of ${LIMIT}s"
    CUT+=("stopped: the wait for the build"); return 124
  fi
  # what the build did and setup.py's check of the built library (a static libstdc++ in it crashes
  # every C++ message with a number): its last two "dept_mega setup:" lines
  wait "$BUILD_PID"; local rc=$?
  log "build finished: rc=$rc ($(grep '^dept_mega setup: ' "$OUT/build.log" 2>/dev/null | tail -n 2 | tr '\n' ' '))"
  BUILD_PID=
  tail -n 5 build/dept_mega_ops_build.log >>"$LOG" 2>/dev/null
  # which compilers built the extension and which C++ runtime it links (see stage_env's cxx)
  local so
  for so in dept_mega/ops/_C*.so; do
    [ -f "$so" ] || continue
    { readelf -p .comment "$so" 2>/dev/null | grep -o 'GCC: .*\|clang .*' | sort -u
      ldd "$so" 2>/dev/null | grep -E 'libstdc\+\+|libgcc_s'; } >>"$LOG" 2>&1
  done
  return 0
}

stage_ops_tests() {
  wait_build || return 1
  local files=(tests/test_ops.py tests/test_ops_errors.py tests/test_ops_gpu.py tests/test_fp8_cuda_cast.py
               tests/test_fp8_gemm.py tests/test_fp8_gemm_tuning.py tests/test_fp8_fused_op.py) why f kept=()
  if why=$(static_libstdcxx); then
    log "### note: ops_tests: tests/test_fp8_gemm_tuning.py left out: $why"
    for f in "${files[@]}"; do [ "$f" = tests/test_fp8_gemm_tuning.py ] || kept+=("$f"); done
    files=("${kept[@]}")
  fi
  local want=cuda
  [ "$DRY" = 1 ] && want="cpp torch"
  run "$PY" -c "import sys, dept_mega.ops as o; b = o.backend(); print('ops backend:', b, o.extension_status()); \
sys.exit(b not in '$want'.split())" || return 1
  # every C++ throw site of the ops reaches Python (one build crashed on some: the test names which)
  local rc=0
  run "$PY" -m pytest -q -p no:cacheprovider -rfEs tests/test_ops_cpp_errors.py || rc=1
  # shellcheck disable=SC2046
  run "$PY" -m pytest $(pytest_args) "${files[@]}" || rc=1
  return $rc
}

stage_ops() {
  wait_build || return 1
  run "$PY" benchmarks/ops_bench.py "${OPS_ARGS[@]}" --out "$OUT/ops_bench.json"
}

bench() {  # NAME [--profile] OVERRIDES...: one tools/benchmark.py run, its record appended to bench.jsonl
  local name=$1 profile=0 rc; shift
  [ "${1:-}" = --profile ] && { profile=1; shift; }
  local rec="$WORK/bench_$name.json" prof=()
  wait_build || return 1  # a run loads the extension: never while the build writes it
  [ $profile = 1 ] && prof=(train.run_dir="$WORK/run_$name" "${PROFILED[@]}")
  run "$PY" tools/benchmark.py --config "$CFG" "${SHAPE[@]}" "$@" "${prof[@]}" "${STEPS[@]}" --out "$rec"
  rc=$?
  bench_row "$name" "$rec" "$rc"
  if [ $profile = 1 ] && [ $rc = 0 ]; then
    local trace
    trace=$(ls "$WORK/run_$name"/profile/rank0_steps*.json 2>/dev/null | head -n 1)
    if [ -z "$trace" ]; then log "no profiler trace under $WORK/run_$name/profile"; return 1; fi
    local cat=kernel
    [ "$DRY" = 1 ] && cat=cpu_op
    echo "# kernels: $name ($(basename "$trace"))" >>"$OUT/kernels.txt"
    within "$PY" benchmarks/kernel_breakdown.py "$trace" --top 25 --category $cat >>"$OUT/kernels.txt" 2>>"$LOG" || return 1
    echo >>"$OUT/kernels.txt"
  fi
  return $rc
}

bench_row() {  # NAME RECORD RC [SAME_AS]: a tools/benchmark.py record as NAME's row of bench.jsonl (an
  # error row with the log's last line when the run failed; a record marked invalid, e.g. timed
  # steps that skipped the optimizer, with its figures and the reason as the row's error); SAME_AS:
  # the run whose record it is
  "$PY" - "$@" "$LOG" "$OUT/bench.jsonl" <<'EOF'
import json, os, sys
name, rec, rc, *same, log, dst = sys.argv[1:]
r = json.load(open(rec)) if os.path.exists(rec) else {}
if rc == "0" or r.get("invalid"):
    r["name"] = name
    r["micro_batch_size"] = ((r.pop("config", None) or {}).get("train") or {}).get("micro_batch_size")
    if same:
        r["same_run_as"] = same[0]
    if r.get("invalid"):
        r["error"] = f"rc={rc}: invalid: {r['invalid']}"
else:
    lines = [l for l in open(log, errors="replace").read().splitlines() if l.strip()]
    r = {"name": name, "error": f"rc={rc}: " + (lines[-1][:300] if lines else "no output")}
open(dst, "a").write(json.dumps(r) + "\n")
EOF
}
reuse() {  # NAME SAME_AS: SAME_AS ran NAME's settings earlier in this call: its record as NAME's row
  # (1: no such record; 2: the record is marked invalid, its row says why)
  local rec="$WORK/bench_$2.json" rc=0
  [ -f "$rec" ] || return 1
  log "$1: the settings of $2, which ran in this call: its record again as $1's row (not run twice)"
  grep -q '"invalid"' "$rec" && rc=1
  bench_row "$1" "$rec" $rc "$2"
  (( rc == 0 )) || return 2
  if grep -q "^# kernels: $2 " "$OUT/kernels.txt" 2>/dev/null; then
    printf '# kernels: %s: the run of %s, above\n\n' "$1" "$2" >>"$OUT/kernels.txt"
  fi
}

stage_bf16() { bench bf16 --profile; }
stage_nofusion() { bench bf16_nofusion optim.grad_accum_fusion=false; }
stage_fp8() {  # the FP8 defaults; if that run fails, the PyTorch casts and GEMM (fp8_torch_casts) in the same stage
  bench fp8 --profile fp8=hybrid backend=local && return 0
  log "the FP8 run with the defaults failed: once more with fp8_casts=torch fp8_gemm=torch"
  bench fp8_torch_casts fp8=hybrid backend=local fp8_casts=torch fp8_gemm=torch
  return 1
}
# the previous defaults, and the fastest combination measured before the defaults (which differ
# from it by the C++ LayerNorm cast's fusion only)
stage_fp8_prev() { bench fp8_prev fp8=hybrid backend=local fp8_casts="$TRITON_CASTS" fp8_gemm=torch fp8_fused_casts=false; }
stage_fp8_all_fused() {
  bench fp8_all_fused --profile fp8=hybrid backend=local fp8_casts=cuda fp8_gemm=cublaslt fp8_fused_casts=true; }
stage_fp8_tuned() {
  local why
  wait_build || return 1
  if why=$(static_libstdcxx); then log "fp8_tuned not run: $why"; return 1; fi
  bench fp8_tuned fp8=hybrid backend=local fp8_casts=cuda fp8_gemm=cublaslt fp8_gemm_tuning=8 fp8_fused_casts=true; }
BIG_SET=(dept.variant=std model.vocab_size=$BIG_VOCAB)  # the vocab250k run (and its memory comparison)
stage_vocab250k() { bench std_vocab250k "${BIG_SET[@]}"; }
compiled_bench() {  # bench NAME [--profile] OVERRIDES... with train.compile=true (a stage that
  # calls it is listed in gpu_check.sh's COMPILED_STAGES: the dry run's fork server imports the compiler)
  if [ "$DRY" = 1 ]; then  # inductor's CPU build alone takes ~45 s here: the stage's plumbing only
    TORCH_COMPILE_DISABLE=1 bench "$@" train.compile=true
  else
    bench "$@" train.compile=true
  fi
}
stage_compile() { compiled_bench bf16_compile --profile; }
stage_mb8() { bench bf16_mb8 train.micro_batch_size=$((2 * MB)); }
# attention is 17 % of the bf16 step's GPU time (flex_attention with its default block sizes)
stage_flex_autotune() { TORCHINDUCTOR_MAX_AUTOTUNE=1 bench bf16_flex_autotune --profile; }
stage_fp8_cuda() { bench fp8_cuda --profile fp8=hybrid backend=local fp8_casts=cuda fp8_gemm=torch fp8_fused_casts=false; }
stage_fp8_lt() { bench fp8_lt --profile fp8=hybrid backend=local fp8_casts=cuda fp8_gemm=cublaslt fp8_fused_casts=false; }
stage_fp8_fused() {
  bench fp8_fused --profile fp8=hybrid backend=local fp8_casts="$TRITON_CASTS" fp8_gemm=torch fp8_fused_casts=true; }
stage_fp8_lt_fused() {
  reuse fp8_lt_fused fp8_all_fused
  case $? in 0) return 0 ;; 2) return 1 ;; esac
  bench fp8_lt_fused --profile fp8=hybrid backend=local fp8_casts=cuda fp8_gemm=cublaslt fp8_fused_casts=true; }
stage_fp8_tlt_fused() {
  bench fp8_tlt_fused --profile fp8=hybrid backend=local fp8_casts="$TRITON_CASTS" fp8_gemm=cublaslt fp8_fused_casts=true; }
stage_fp8_fast_accum() { bench fp8_fast_accum fp8=hybrid backend=local fp8_fast_accum=forward; }
stage_fp8_mb8() { bench fp8_mb8 fp8=hybrid backend=local train.micro_batch_size=$((2 * MB)); }
stage_fp8_lt_mb8() {
  bench fp8_lt_mb8 fp8=hybrid backend=local fp8_casts=cuda fp8_gemm=cublaslt fp8_fused_casts=false \
    train.micro_batch_size=$((2 * MB)); }
stage_compile_nofusion() { compiled_bench bf16_compile_nofusion optim.grad_accum_fusion=false; }
stage_fp8_compile() { compiled_bench fp8_compile --profile fp8=hybrid backend=local; }
stage_fp8_compile_triton() { compiled_bench fp8_compile_triton --profile fp8=hybrid backend=local fp8_casts="$GRAPH_CASTS"; }
stage_fp8_current_compile() { compiled_bench fp8_current_compile fp8=hybrid backend=local fp8_recipe=current; }
stage_fp8_current() { bench fp8_current fp8=hybrid backend=local fp8_recipe=current; }

stage_memory() {  # the memory model against the bf16 run's peak, and the FP8 run's and the 250,112-token head's when they ran
  local rec="$WORK/bench_bf16.json"
  [ -f "$rec" ] || { log "no bf16 benchmark record: the memory stage needs the bf16 stage"; return 1; }
  # shellcheck disable=SC2153  # VOCAB: gpu_check.sh's setting (not memory_compare's local vocab)
  memory_compare "$rec" spec_opt "$VOCAB" "$OUT/memory.json" || return 1
  local extra=0
  if [ -f "$WORK/bench_fp8.json" ]; then
    memory_compare "$WORK/bench_fp8.json" spec_opt "$VOCAB" "$WORK/memory_fp8.json" fp8=hybrid backend=local || return 1
    extra=1
  else
    log "no fp8 benchmark record: its memory comparison is left out"
  fi
  if [ -f "$WORK/bench_std_vocab250k.json" ]; then
    memory_compare "$WORK/bench_std_vocab250k.json" std "$BIG_VOCAB" "$WORK/memory_250k.json" "${BIG_SET[@]}" || return 1
    extra=1
  else
    log "no vocab250k benchmark record: its memory comparison is left out"
  fi
  [ $extra = 1 ] || return 0
  "$PY" - "$OUT/memory.json" "$WORK/memory_fp8.json" "$WORK/memory_250k.json" <<'EOF'
import json, os, sys
main = json.load(open(sys.argv[1]))
for path, name in zip(sys.argv[2:], ("trainer, FP8 (fp8=hybrid backend=local)", "trainer, STD 250,112-token head")):
    if os.path.exists(path):
        main["comparison"][name] = json.load(open(path))["comparison"]["trainer"]
json.dump(main, open(sys.argv[1], "w"), indent=1)
EOF
}
memory_compare() {  # BENCH_RECORD VARIANT VOCAB OUT [OVERRIDES...]
  local rec=$1 variant=$2 vocab=$3 out=$4; shift 4
  # the config's tokenizer files do not exist here: the vocabulary sizes are given
  log "\$ tools/dept_costs.py --config $CFG ${SHAPE[*]} $* --global-vocab $vocab --source-vocab $vocab --memory --json"
  within "$PY" tools/dept_costs.py --config "$CFG" "${SHAPE[@]}" "$@" --global-vocab "$vocab" \
    --source-vocab "$vocab" --memory --json >"$WORK/costs_$variant.json" 2>>"$LOG" || { log "dept_costs.py failed"; return 1; }
  run "$PY" benchmarks/memory_vs_model.py --bench "$rec" --costs "$WORK/costs_$variant.json" --variant "$variant" \
    --out "$out"
}

stage_megatron() {  # (our side loads the extension: never while the build writes it)
  wait_build || return 1
  within "$PY" -c "import megatron.core" 2>/dev/null
  case $? in
    0) ;;
    124) return 124 ;;  # (the stage's deadline)
    *) log "megatron-core is not importable: pip install -e '.[benchmark]', or put its wheel in .whl/ (bash benchmarks/fetch_device_wheels.sh)"
       return 1 ;;
  esac
  run "$PY" benchmarks/vs_megatron.py --config "$CFG" "${MEGATRON[@]}" --out "$OUT/vs_megatron.json" \
    "${SHAPE[@]}" "${MEGATRON_SET[@]}"
}

record_row() {  # KIND NAME RECORD RC ok|any: RECORD's JSON (less its config) as one row of bench.jsonl,
  # read when it exists and (ok) the command succeeded, else an error row with the log's last line
  "$PY" - "$@" "$LOG" "$OUT/bench.jsonl" <<'EOF'
import json, os, sys
kind, name, rec, rc, when, log, dst = sys.argv[1:]
if os.path.exists(rec) and (rc == "0" or when == "any"):
    r = json.load(open(rec)); r.pop("config", None)
else:
    lines = [l for l in open(log, errors="replace").read().splitlines() if l.strip()]
    r = {"error": f"rc={rc}: " + (lines[-1][:300] if lines else "no output")}
r.update(kind=kind, name=name, rc=int(rc))
open(dst, "a").write(json.dumps(r) + "\n")
EOF
}

stage_fp8_host() {  # fp8_host_bench.py's record as one "kind": "fp8_host" row of bench.jsonl
  local rec="$WORK/fp8_host.json" rc
  rm -f "$rec"
  wait_build || return 1
  run "$PY" benchmarks/fp8_host_bench.py "${FP8_HOST[@]}" --json "$rec"
  rc=$?
  record_row fp8_host fp8_host "$rec" $rc ok
  return $rc
}

stage_fp8_casts() {  # fp8_cast_bench.py's rows as one "kind": "fp8_cast_bench" row of bench.jsonl
  local rec="$WORK/fp8_casts.json" rc
  rm -f "$rec"
  wait_build || return 1
  run "$PY" benchmarks/fp8_cast_bench.py "${CAST_BENCH[@]}" --json "$rec"
  rc=$?
  record_row fp8_cast_bench fp8_casts "$rec" $rc any  # rows also when some kernels' bytes differed
  return $rc
}

stage_attention() {  # attention_bench.py's rows as one "kind": "attention_bench" row of bench.jsonl
  local rec="$WORK/attention.json" rc
  rm -f "$rec"
  run "$PY" benchmarks/attention_bench.py "${ATTN_BENCH[@]}" --json "$rec"
  rc=$?
  [ -f "$rec" ] && "$PY" -c 'import json, sys; json.dump({"rows": json.load(open(sys.argv[1]))}, open(sys.argv[1], "w"))' "$rec"
  record_row attention_bench attention "$rec" $rc any  # rows also when some kernels refused the inputs
  return $rc
}

stage_torchao() {  # vs_torchao.py's record (less its config) as one row of bench.jsonl; skipped without torchao
  local rec="$WORK/vs_torchao.json" rc
  rm -f "$rec"
  run "$PY" benchmarks/vs_torchao.py --config "$CFG" "${TORCHAO[@]}" --out "$rec" "${SHAPE[@]}"
  rc=$?
  record_row vs_torchao torchao "$rec" $rc any  # its record says why an arm failed or was skipped
  return $rc
}
