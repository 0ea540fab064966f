#!/usr/bin/env bash
# Issue 12 on a lent H100 / H200 (the device tool runs this in a copy of the repository).
#
#   bash benchmarks/h100_suite.sh [STAGE ...]        # default: every stage, in this order
#
# Stages (each logs "### stage NAME finished: rc=N" to OUT/suite.log and never stops the others):
#   env       GPU, driver, torch / CUDA versions, ops backend          -> env.json
#   build     pip install --no-build-isolation --no-deps -e . (CUDA kernels of csrc/)
#   test      pytest -m gpu (CUDA ops variants, tests/test_gpu.py, ...)
#   ops       benchmarks/ops_bench.py --device cuda                     -> ops_bench.json
#   bench     the paper's 1B model (examples/1b/spec_opt.yaml) on one GPU, synthetic batches:
#             bf16, bf16 + train.compile, native FP8, the 250,112-vocabulary STD head
#                                                                        -> bench.jsonl
#   memory    tools/dept_costs.py --memory against the bf16 run's peak   -> memory.json
#   profile   a torch.profiler trace of one 1B step, kernel breakdown    -> kernels.txt
#   megatron  benchmarks/vs_megatron.py (needs the megatron-core wheel in .whl/, see
#             benchmarks/fetch_device_wheels.sh)                         -> vs_megatron.json
# and at the end OUT/summary.md (benchmarks/suite_summary.py). OUT defaults to ./suite_out; the
# device tool returns at most 8 files of OUT: these are the 8.
#
# One device command may run 10 minutes; split the stages over calls, e.g.
#   call 1: bash benchmarks/h100_suite.sh env build test ops          (~6-9 min)
#   call 2: bash benchmarks/h100_suite.sh env bench memory profile    (~6-9 min)
#   call 3: bash benchmarks/h100_suite.sh env megatron                (~3-6 min, carry .whl)
# (see docs/performance.md, "Running the GPU suite"). STAGE_TIMEOUT (seconds, default 420)
# bounds every python command of a stage.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/suite_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
LOG="$OUT/suite.log"
STAGE_TIMEOUT=${STAGE_TIMEOUT:-420}
export PYTHONUNBUFFERED=1
# the model and its one-GPU shape; SUITE_CONFIG / SUITE_OVERRIDES replace them (e.g. a tiny
# config for a dry run of the script's mechanics on a CPU)
CFG=${SUITE_CONFIG:-examples/1b/spec_opt.yaml}
read -r -a ONE_GPU <<< "${SUITE_OVERRIDES:-parallel.data=1 model.vocab_size=50257 train.micro_batch_size=4 train.global_batch_size=32}"
VARIANT=${SUITE_VARIANT:-spec_opt}
WORK=${TMPDIR:-/tmp}/dept_suite
mkdir -p "$WORK"

log() { echo "$*" | tee -a "$LOG"; }
run() { log "\$ $*"; timeout "$STAGE_TIMEOUT" "$@" 2>&1 | tee -a "$LOG"; return "${PIPESTATUS[0]}"; }

# wheels carried with the call (.whl/, e.g. megatron-core): installed apart, --no-deps
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" .whl/*.whl \
    >>"$LOG" 2>&1 && export PYTHONPATH="$WORK/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi

stage_env() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv 2>&1 | tee -a "$LOG"
  run "$PY" - "$OUT/env.json" <<'EOF'
import datetime, json, sys, torch
import dept_mega.ops as ops
d = {"device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
     "torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
     "date": datetime.datetime.now().isoformat(timespec="seconds"),
     "ops_backend": ops.backend("cuda" if torch.cuda.is_available() else "cpu"),
     "ops_extension": str(ops.extension_status())}
try:
    from importlib.metadata import version
    d["megatron_core"] = version("megatron-core")
except Exception:
    d["megatron_core"] = None
json.dump(d, open(sys.argv[1], "w"), indent=1)
print(json.dumps(d))
EOF
}

stage_build() {
  run "$PY" -m pip install --no-build-isolation --no-deps -e . || true
  tail -n 20 build/dept_mega_ops_build.log 2>/dev/null | tee -a "$LOG"
  run "$PY" -c "import dept_mega.ops as o; b = o.backend('cuda'); print('ops backend:', b, o.extension_status()); raise SystemExit(b != 'cuda')"
}

stage_test() {
  run "$PY" -m pytest -q -m gpu tests -p no:cacheprovider -rs
}

stage_ops() {
  run "$PY" benchmarks/ops_bench.py --device cuda --out "$OUT/ops_bench.json"
}

bench_one() {  # NAME EXTRA_OVERRIDES...
  local name=$1; shift
  local out="$WORK/bench_$name.json" err="$WORK/bench_$name.err"
  rm -f "$out"
  log "\$ tools/benchmark.py --config $CFG ${ONE_GPU[*]} $* --steps 10 --warmup 3"
  timeout "$STAGE_TIMEOUT" "$PY" tools/benchmark.py --config "$CFG" "${ONE_GPU[@]}" "$@" --steps 10 --warmup 3 \
    --out "$out" 2> >(tee "$err" >>"$LOG") | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  "$PY" - "$name" "$out" "$err" "$rc" "$OUT/bench.jsonl" <<'EOF'
import json, os, sys
name, out, err, rc, dst = sys.argv[1:]
if rc == "0" and os.path.exists(out):
    rec = json.load(open(out)); rec["name"] = name; rec.pop("config", None)
else:
    tail = [l for l in open(err).read().splitlines() if l.strip()][-1:] if os.path.exists(err) else []
    rec = {"name": name, "error": f"rc={rc}: " + (tail[0][:300] if tail else "no output")}
open(dst, "a").write(json.dumps(rec) + "\n")
EOF
  return "$rc"
}

stage_bench() {
  local rc=0
  bench_one bf16 || rc=1
  bench_one bf16_compile train.compile=true || rc=1
  bench_one fp8 fp8=hybrid backend=local || rc=1
  bench_one std_vocab250k model.vocab_size=250112 || rc=1
  return $rc
}

stage_memory() {
  local bench="$WORK/bench_bf16.json"
  [ -f "$bench" ] || bench_one bf16 || return 1
  log "\$ tools/dept_costs.py --config $CFG ${ONE_GPU[*]} --memory --json"
  timeout "$STAGE_TIMEOUT" "$PY" tools/dept_costs.py --config "$CFG" "${ONE_GPU[@]}" --memory --json \
    > "$WORK/costs.json" 2>>"$LOG" || { log "tools/dept_costs.py --memory failed or is not available"; return 1; }
  run "$PY" benchmarks/memory_vs_model.py --bench "$bench" --costs "$WORK/costs.json" --variant "$VARIANT" \
    --out "$OUT/memory.json"
}

stage_profile() {
  rm -rf "$WORK/prof"
  run "$PY" tools/benchmark.py --config "$CFG" "${ONE_GPU[@]}" train.run_dir="$WORK/prof" \
    train.profile.start=2 train.profile.stop=3 --warmup 4 --steps 2 --out "$WORK/bench_prof.json" || return 1
  log "\$ benchmarks/kernel_breakdown.py $WORK/prof/profile/rank0_steps2-3.json --top 30"
  "$PY" benchmarks/kernel_breakdown.py "$WORK"/prof/profile/rank0_steps2-3.json --top 30 > "$OUT/kernels.txt" \
    2>>"$LOG"
  local rc=$?
  cat "$OUT/kernels.txt" >> "$LOG"
  return $rc
}

stage_megatron() {
  run "$PY" benchmarks/vs_megatron.py --config "$CFG" --vocab "${SUITE_VOCAB:-50257}" --micro-batch 4 --accum 2 \
    --steps 10 --warmup 3 --out "$OUT/vs_megatron.json" ${SUITE_MEGATRON_ARGS:-}
}

stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(env build test ops bench memory profile megatron)
for s in "${stages[@]}"; do
  if ! declare -F "stage_$s" >/dev/null; then
    log "unknown stage '$s' (env build test ops bench memory profile megatron)"; continue
  fi
  log "### stage $s ($(date -Is))"
  t0=$(date +%s)
  "stage_$s"
  log "### stage $s finished: rc=$? in $(( $(date +%s) - t0 )) s"
done
"$PY" benchmarks/suite_summary.py "$OUT" | tee -a "$LOG"
