#!/usr/bin/env bash
# The GPU check: the GPU tests and the benchmarks behind docs/performance.md on one GPU, the stages
# in order of value inside a time budget. Every figure goes to the output folder as soon as it
# exists and summary.md (the targets, each run's tokens/s over its base runs and over the bf16 run
# of this call, the command that reruns what failed or did not fit) is rewritten after every
# stage, so a job cut off at its time limit still leaves everything measured until then.
#
#   bash benchmarks/gpu_check.sh --out DIR [--budget SECONDS] [--stages a,b,...] [--dry-run]
#
#   --out DIR      output folder, created if needed (without --out: the folder named by the OUT
#                  environment variable; one of the two is required)
#   --budget S     seconds for the whole script (default 420; --dry-run: 240). A stage starts only
#                  when its expected time (below) is left. Its limit, twice that or the budget left
#                  less 8 s (kept for the summary), is a deadline from its start that all its commands
#                  share: the command running then is stopped, none starts after it, and summary.md
#                  says "cut at its limit of N s" with what it stopped. The default runs the stages
#                  in order of value until it is spent (at an H100's expected times: env to fp8_lt,
#                  then fp8_host); the expected times of all stages add up to 1699 s, so --budget
#                  1800 runs everything unless stages overrun
#   --stages LIST  only these stages, comma-separated, run in the order listed (e.g. a second call
#                  for what failed or was skipped: summary.md ends with that command, in the same
#                  order), so list first what matters most within the budget. The build starts first
#                  (in the background) wherever it is listed; env runs first when listed (summary.md's
#                  device line reads what it writes); a list with memory before bf16, fp8 or
#                  vocab250k (the runs whose peaks it compares) or fp8_lt_fused before fp8_all_fused
#                  (whose run it reuses) is an error. Without --stages: every stage in the order below
#   --dry-run      the same sequence on the CPU with a tiny model of the same config, writing the
#                  same files: a rehearsal of the script, no figure means anything (about a minute
#                  on 2 cores; the test suite runs it: tests/test_gpu_check.py). Its Python commands
#                  are forked from one interpreter that has imported torch and the training
#                  modules (benchmarks/forkserver.py)
#   -h, --help     this text
#
# Environment: run from a checkout with its environment active (a CUDA build of torch; the test
# dependencies: pip install --no-build-isolation -e ".[test]"). The script runs python3 unless
# PYTHON names the interpreter (PYTHON=.venv/bin/python bash benchmarks/gpu_check.sh ...);
# TORCH_CUDA_ARCH_LIST (default 9.0) and MAX_JOBS (default 8) set the extension's build.
# On a SLURM cluster:
#   srun -N1 --gpus=1 bash benchmarks/gpu_check.sh --out gpu_check_out --budget 1800
#
# What it changes besides the output folder:
# - the build stage rebuilds the CUDA extension in the checkout (python setup.py build_ext
#   --inplace, in the background from the start), replacing dept_mega/ops/_C*.so and build/: with
#   an editable install that is the extension every run from this checkout loads, so on a shared
#   file system run it in a checkout no running job uses. A --stages list without a stage that
#   needs the extension builds nothing.
# - at the start it deletes its eight files (listed at the end) from the output folder; other
#   files there are left alone. Scratch files go to a temporary folder under $TMPDIR (/tmp),
#   removed at the end.
#
# The megatron and torchao stages need megatron-core and torchao 0.17.0: installed in the
# environment (pip install -e ".[benchmark]" for megatron-core), or as wheels in .whl/, which the
# script installs with --no-deps into its temporary folder (for a GPU node without network). To
# fetch the wheels on a machine with network (.whl/ is ignored by git; CPython 3.12 wheels):
#   bash benchmarks/fetch_device_wheels.sh        # megatron-core's and torchao's wheels into .whl/
# and copy .whl/ to the GPU node with the checkout (a tool that copies the working tree takes an
# ignored folder only when told: carry: [".whl"]). When a planned stage needs one of them and it is
# neither in .whl/ nor importable, the script says so in one warning line at its start.
#
# Stages, in the order they run without --stages (expected seconds: measured on one H100,
# 2026-11-26, or, for ops_tests, ops and torchao, on one H200, 2026-11-27, with room; a stage
# starts only when its expected time is left, and its commands are stopped at twice it in all):
#   build      the CUDA extension (setup.py build_ext --inplace), in the background from the start (20 s)
#   env        GPU, driver, torch / CUDA versions                                            8
#   ops_tests  waits for the build, checks the CUDA backend, tests/test_ops_cpp_errors.py, then
#              pytest -m gpu tests/test_ops.py, tests/test_ops_errors.py, tests/test_ops_gpu.py and
#              tests/test_fp8_cuda_cast.py, tests/test_fp8_gemm.py, tests/test_fp8_gemm_tuning.py,
#              tests/test_fp8_fused_op.py (the C++ FP8 cast, fused LayerNorm/GELU/dGELU cast and GEMM
#              operators against Triton's, torch and torch._scaled_mm; the GEMM's algorithm tuning, left
#              out when build.log says the extension holds a static copy of libstdc++: it crashed)  40
#   bf16       the paper's 1B model (examples/1b/spec_opt.yaml shape, synthetic batches), bf16,
#              4 warm-up steps, 6 timed, then 1 profiled -> bench.jsonl, kernel breakdown -> kernels.txt 45
#   fp8        the same in native FP8 with the FP8 defaults (fp8=hybrid backend=local; on the GPU
#              fp8_casts auto = cuda, fp8_gemm auto = cublaslt, fp8_fused_casts null = every C++
#              cast fused: LayerNorm, GELU, dGELU) -> bench.jsonl, kernels.txt                 55
#              (if it fails: once more with fp8_casts=torch fp8_gemm=torch, recorded as fp8_torch_casts)
#   fp8_prev   the previous FP8 defaults: fp8_casts=triton fp8_gemm=torch fp8_fused_casts=false
#              -> bench.jsonl                                                  55 (an estimate)
#   fp8_all_fused  fp8_casts=cuda fp8_gemm=cublaslt fp8_fused_casts=true: what the defaults resolve to
#              with the extension built, named (1.293x bf16 on an H200, 2026-11-28; beside fp8, a
#              check that auto took them), profiled -> bench.jsonl, kernels.txt   55 (an estimate)
#   fp8_tuned  fp8_all_fused's settings with fp8_gemm_tuning=8: each FP8 GEMM problem's first call times
#              8 of cuBLASLt's candidate algorithms and keeps the fastest (the heuristic's first unless
#              another is 2 % faster); its record lists every problem's candidates -> bench.jsonl  60 (an estimate)
#              (skipped when build.log says the extension holds a static copy of libstdc++: its tuning
#              record crashed the process there, 2026-11-28)
#   fp8_cuda   fp8_casts=cuda fp8_gemm=torch fp8_fused_casts=false: each cast the C++/CUDA operator
#              dept_mega::cast_fp8 (a dispatcher call instead of Triton's launcher), beside fp8_prev,
#              profiled -> bench.jsonl, kernels.txt                            55 (an estimate)
#   fp8_lt     fp8_casts=cuda fp8_gemm=cublaslt fp8_fused_casts=false: the GEMMs through cuBLASLt
#              directly (dept_mega::fp8_gemm), the weight gradients accumulated into the fp32
#              gradient buffer inside the GEMM, profiled -> bench.jsonl, kernels.txt  55 (an estimate)
#   fp8_fused  fp8_casts=triton fp8_gemm=torch fp8_fused_casts=true: the LayerNorm before QKV / fc1 and
#              the GELU before fc2 fused into the Triton casts of their outputs, profiled
#              -> bench.jsonl, kernels.txt                                     55 (an estimate)
#   fp8_lt_fused  fp8_casts=cuda fp8_gemm=cublaslt fp8_fused_casts=true (the fp8_lt run fused), profiled
#              -> bench.jsonl, kernels.txt: fp8_all_fused's settings, so after it in the same call
#              its record again (named fp8_lt_fused, same_run_as: fp8_all_fused), not run twice  55
#   fp8_tlt_fused  fp8_casts=triton fp8_gemm=cublaslt fp8_fused_casts=true: the Triton casts (launched
#              directly) with the GEMM that accumulates the weight gradients, profiled
#              -> bench.jsonl, kernels.txt                                     55 (an estimate)
#   fp8_host   benchmarks/fp8_host_bench.py --device cuda: the host's µs per linear call, forward and
#              backward apart, and its dispatcher ops, by casts x GEMM (triton|cuda casts, torch|cublaslt
#              GEMM, bf16 beside), and what the Triton launches, cast_fp8's Python and _scaled_mm's host
#              path each cost over the C++ operators, and what the direct launch saves over Triton's
#              kernel[grid] (the tritonrun row; tiny operands, wall time) -> one "kind":
#              "fp8_host" row of bench.jsonl                40 (an estimate; H200: 15-19)
#   fp8_casts  benchmarks/fp8_cast_bench.py: device µs per cast at the 1B shapes by kernel (Triton tiles,
#              the C++ operator, inductor's) against a copy of the same bytes, bytes compared; and the
#              LayerNorm / GELU casts fused (fp8_fused_casts) against the producer then the cast, per path
#              -> one "kind": "fp8_cast_bench" row of bench.jsonl                       60 (an estimate)
#   attention  benchmarks/attention_bench.py: device ms of the 1B model's ALiBi attention core, forward +
#              backward, by kernel (the model's compiled flex_attention, flex with kernel_options
#              candidates, SDPA with the materialised bias on the efficient / cuDNN backends, the
#              no-ALiBi flash / cuDNN ceiling), each with its error against an fp32 reference
#              -> one "kind": "attention_bench" row of bench.jsonl                 90 (an estimate)
#   fp8_fast_accum   the FP8 run (the defaults) with fp8_fast_accum=forward: the forward GEMM sums in the
#              tensor cores' fast accumulation (the default, none, promotes every sum) -> bench.jsonl  50
#   ops        benchmarks/ops_bench.py: custom ops vs a device-to-device copy -> ops_bench.json  15
#   tests      pytest -m gpu, all but the ops' tests (ops on the PyTorch fallback; test files in
#              parallel with pytest-xdist when available)                                       70
#   fp8_compile_triton  the FP8 run with train.compile=true and fp8_casts=triton: our one-pass
#              Triton cast kernel inside the compiled blocks (one op per cast, instead of
#              inductor's casts), profiled -> bench.jsonl, kernels.txt                   60
#   compile    the bf16 run with train.compile=true, profiled -> bench.jsonl, kernels.txt       60
#   fp8_compile  the FP8 run (delayed scaling, the default recipe) with train.compile=true: the FP8
#              GEMMs traced into the compiled blocks, profiled -> bench.jsonl, kernels.txt     60
#   torchao    benchmarks/vs_torchao.py: torchao's float8 (tensorwise) against bf16, both compiled,
#              on a plain PyTorch GPT of the same shape (needs torchao; without it the stage
#              records "skipped") -> one "kind": "vs_torchao" row of bench.jsonl               60
#   megatron   benchmarks/vs_megatron.py (needs megatron-core; fails without it) -> vs_megatron.json 60
#   flex_autotune  the bf16 run with TORCHINDUCTOR_MAX_AUTOTUNE=1: inductor tries block sizes for
#              the compiled flex_attention kernels (and the other compiled regions) and keeps the
#              fastest; profiled, so attention's ms compare with bf16's -> bench.jsonl, kernels.txt
#              120 (an estimate: not yet measured)
#   fp8_current  the eager FP8 run (the defaults) with fp8_recipe=current (what the tracing is compared with)  50
#   fp8_current_compile  FP8 with train.compile=true, fp8_recipe=current: the FP8 GEMMs traced into the
#              compiled blocks (no graph break) -> bench.jsonl                                  60
#   fp8_mb8    the FP8 run (the defaults) with micro-batches of 8 (half the host work per token)  50
#   fp8_lt_mb8 the fp8_lt run (C++ casts, cuBLASLt GEMMs, nothing fused) with micro-batches of 8: the two ways to
#              less host work per token together (compare with mb8)                       50 (an estimate)
#   vocab250k  the STD variant with the 250,112-token head -> bench.jsonl                        45
#   memory     tools/dept_costs.py --memory vs the peaks of the bf16, fp8 and vocab250k runs
#              -> memory.json                                                                   16
#   nofusion   the bf16 run with optim.grad_accum_fusion=false (what the fusion gains) -> bench.jsonl 45
#   compile_nofusion  the compiled run with optim.grad_accum_fusion=false (each block one graph)  60
#   mb8        the bf16 run with micro-batches of 8 sequences (2 per step instead of 4)          45
# Files in the output folder (8 at most): summary.md, gpu_check.log (every command and its
# output), build.log, ops_bench.json, bench.jsonl, kernels.txt, memory.json, vs_megatron.json.
#
# The script is two files: this one (the options, the environment, what differs in the dry run,
# the plumbing: the dry run's fork server, the stages' deadlines, run / within / stage / summary,
# and the sequence) and benchmarks/gpu_check_stages.sh, which it sources: each stage's commands
# (stage_NAME) and their helpers (the build, bench, bench_row, reuse, record_row, ...).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

usage() { sed -n '2,/^[^#]/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }  # the header comment, whole
DRY=0
OUT_DIR=${OUT:-}
BUDGET=
ONLY=
while [ $# -gt 0 ]; do
  case $1 in
    --dry-run) DRY=1 ;;
    --out) [ $# -ge 2 ] || { echo "error: --out needs a folder" >&2; exit 2; }; OUT_DIR=$2; shift ;;
    --budget) [ $# -ge 2 ] || { echo "error: --budget needs seconds" >&2; exit 2; }; BUDGET=$2; shift ;;
    --stages) [ $# -ge 2 ] || { echo "error: --stages needs a list" >&2; exit 2; }; ONLY=$2; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "error: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
  shift
done
[ -n "$OUT_DIR" ] || { echo "error: no output folder: set OUT or pass --out DIR" >&2; exit 2; }
[ -z "$BUDGET" ] && BUDGET=$(( DRY ? 240 : 420 ))
[[ $BUDGET =~ ^[0-9]+$ ]] || { echo "error: --budget must be a number of seconds, got '$BUDGET'" >&2; exit 2; }
STAGES=(build env ops_tests bf16 fp8 fp8_prev fp8_all_fused fp8_tuned fp8_cuda fp8_lt fp8_fused fp8_lt_fused fp8_tlt_fused fp8_host fp8_casts attention fp8_fast_accum ops tests fp8_compile_triton
        compile fp8_compile torchao megatron flex_autotune fp8_current fp8_current_compile fp8_mb8 fp8_lt_mb8 vocab250k memory nofusion
        compile_nofusion mb8)
# the stages this call runs, in the order they run: --stages' order, else STAGES'
ORDER=()
if [ -n "$ONLY" ]; then
  declare -A POS=()
  IFS=, read -ra LISTED <<<"$ONLY"
  for s in "${LISTED[@]}"; do
    [[ " ${STAGES[*]} " == *" $s "* ]] || { echo "error: --stages: unknown stage '$s' (${STAGES[*]})" >&2; exit 2; }
    [ -z "${POS[$s]:-}" ] || { echo "error: --stages: stage '$s' is listed twice" >&2; exit 2; }
    POS[$s]=${#ORDER[@]}
    ORDER+=("$s")
  done
  # a stage that reads what another of the same call wrote comes after it: STAGE:WHAT_IT_READS
  for dep in memory:bf16 memory:fp8 memory:vocab250k fp8_lt_fused:fp8_all_fused; do
    a=${dep%%:*} b=${dep#*:}
    if [ -n "${POS[$a]:-}" ] && [ -n "${POS[$b]:-}" ] && (( POS[$a] < POS[$b] )); then
      case $a in
        memory) why="it compares the memory model with the peaks of the $b run of the same call" ;;
        *) why="it reuses the $b run of the same call (the same settings) instead of running them twice" ;;
      esac
      echo "error: --stages: list $b before $a: $why" >&2; exit 2
    fi
  done
  # env first: summary.md's device line reads what it writes, from the first summary on
  if [ -n "${POS[env]:-}" ] && [ "${POS[env]}" != 0 ]; then
    ORDER=(env); for s in "${LISTED[@]}"; do [ "$s" = env ] || ORDER+=("$s"); done
  fi
else
  ORDER=("${STAGES[@]}")
fi
mkdir -p "$OUT_DIR" && OUT=$(cd "$OUT_DIR" && pwd) || exit 2
PY=${PYTHON:-python3}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
LOG=$OUT/gpu_check.log
T0=$(date +%s)
RESERVE=8  # seconds kept for the last summary
export PYTHONUNBUFFERED=1
rm -f "$OUT"/{summary.md,gpu_check.log,build.log,ops_bench.json,bench.jsonl,kernels.txt,memory.json,vs_megatron.json}

# wheels in .whl/ (benchmarks/fetch_device_wheels.sh), installed apart into the temporary folder
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
    .whl/*.whl >>"$LOG" 2>&1 && export PYTHONPATH="$PYTHONPATH:$WORK/site"
fi
# One line on stderr and at the top of the log when a planned stage needs megatron-core or torchao
# and neither a wheel in .whl/ nor an importable package provides it: a GPU node without network
# cannot install it, and .whl/ (ignored by git) reaches a machine that gets a copy of the working
# tree only when the copy names it (a device tool's carry list)
wheel_warning() {
  local need st whl mod what missing=()
  for need in "megatron:megatron_core:megatron.core:megatron-core (the megatron stage fails without it)" \
              "torchao:torchao:torchao:torchao (the torchao stage records skipped without it)"; do
    IFS=: read -r st whl mod what <<<"$need"
    [[ " ${PLANNED[*]} " == *" $st "* ]] || continue
    ls .whl/"$whl"-*.whl >/dev/null 2>&1 && continue
    "$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('$mod') is None)" 2>/dev/null && continue
    missing+=("$what")
  done
  (( ${#missing[@]} )) || return 0
  local line
  line="warning: not in .whl/ and not importable here: $(IFS=';'; echo "${missing[*]}" | sed 's/;/, /'): before the"
  line+=" GPU call run \`bash benchmarks/fetch_device_wheels.sh\` and let .whl travel with the checkout (.whl/ is"
  line+=" ignored by git: the device tool's carry must name it, carry: [\".whl\"])"
  echo "$line" >&2
  echo "$line" >>"$LOG"
}

# ------------------------------------------------------------------ what differs in the dry run
declare -A HANG=()  # (the dry run's GPU_CHECK_DRY_HANG, below)
CFG=examples/1b/spec_opt.yaml
VOCAB=50257
if [ "$DRY" = 1 ]; then
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} CUDA_VISIBLE_DEVICES=
  VOCAB=1000; BIG_VOCAB=2000
  MB=2
  SHAPE=(parallel.data=1 model.vocab_size=$VOCAB model.num_layers=2 model.hidden_size=32
         model.num_attention_heads=4 model.num_query_groups=4 model.ffn_hidden_size=64 model.seq_length=32
         train.micro_batch_size=$MB train.global_batch_size=4)
  WARMUP=2 TIMED=1
  OPS_ARGS=(--device cpu --small --iters 2)
  # Megatron's RoPE needs CUDA: learned positions on both sides here
  MEGATRON=(--vocab $VOCAB --micro-batch 2 --accum 2 --steps 1 --warmup 1 --position config)
  MEGATRON_SET=(model.position_embedding=learned)
  # eager (an inductor build of each arm would take a minute on the CPU): the plumbing only
  TORCHAO=(--vocab $VOCAB --micro-batch 2 --accum 2 --steps 1 --warmup 1 --no-compile)
  # the CPU has no Triton launcher: the benchmark skips the triton casts there (and says so); the
  # operators' real CPU kernels (--kernels stub would compile its stub kernels first: ~45 s)
  FP8_HOST=(--device cpu --kernels real --repeats 4 --per-step 2 --depth 2)
  CAST_BENCH=(--device cpu --iters 1)
  ATTN_BENCH=(--device cpu --batch 2 --heads 4 --seq 128 --head-dim 32 --iters 2)
  # the Triton casts need a GPU (Triton is not installed here) and nothing is traced under
  # TORCH_COMPILE_DISABLE: the fp8_compile_triton stage's plumbing with the torch casts
  GRAPH_CASTS=torch
  # the stages that name the Triton casts (fp8_prev, fp8_fused, fp8_tlt_fused) run the torch casts
  # here, for the same reason: their plumbing
  TRITON_CASTS=torch
  # expected seconds on a 2-core CPU machine; a stage may take CAP times that (a loaded machine)
  declare -A EXPECT=([env]=4 [tests]=10 [ops_tests]=8 [ops]=8 [bf16]=12 [nofusion]=12 [fp8]=12 [vocab250k]=8 [memory]=8
                     [megatron]=15 [compile]=8 [compile_nofusion]=8 [mb8]=8 [fp8_mb8]=12 [fp8_lt_mb8]=12
                     [fp8_compile]=8 [fp8_compile_triton]=8 [fp8_current_compile]=8 [fp8_current]=12 [torchao]=6
                     [fp8_host]=12 [flex_autotune]=12 [fp8_cuda]=12 [fp8_fast_accum]=12 [fp8_casts]=8 [fp8_lt]=12
                     [fp8_fused]=12 [fp8_lt_fused]=12 [fp8_tlt_fused]=12 [fp8_prev]=12 [fp8_all_fused]=12 [fp8_tuned]=12 [attention]=6)
  CAP=8
  # rehearsals for tests/test_gpu_check.py. GPU_CHECK_DRY_HANG=STAGE:SECONDS[,...]: STAGE's limit is
  # SECONDS and each of its commands hangs (sleep 600 instead of the command) until the stage's
  # deadline stops it. GPU_CHECK_DRY_BUILD_NOTE=LINE: a line added to build.log after the build (e.g.
  # setup.py's warning that the built library carries a static libstdc++)
  IFS=, read -ra _hang <<<"${GPU_CHECK_DRY_HANG:-}"
  for h in "${_hang[@]}"; do
    [[ $h =~ ^[a-z0-9_]+:[0-9]+$ ]] || { echo "error: GPU_CHECK_DRY_HANG: want STAGE:SECONDS, got '$h'" >&2; exit 2; }
    HANG[${h%%:*}]=${h#*:}
  done
else
  BIG_VOCAB=250112
  MB=4
  SHAPE=(parallel.data=1 model.vocab_size=$VOCAB train.micro_batch_size=$MB train.global_batch_size=16)
  WARMUP=4 TIMED=6
  OPS_ARGS=(--device cuda)
  MEGATRON=(--vocab $VOCAB --micro-batch 4 --accum 4 --steps 5 --warmup 2)
  MEGATRON_SET=()
  TORCHAO=(--vocab $VOCAB --micro-batch 4 --accum 4 --steps 5 --warmup 3)
  FP8_HOST=(--device cuda --repeats 200)
  CAST_BENCH=(--device cuda)
  ATTN_BENCH=(--device cuda)
  GRAPH_CASTS=triton
  TRITON_CASTS=triton
  # seconds measured on the first H100 run (2026-11-26), rounded up; ops_tests, ops and torchao:
  # the H200 run (2026-11-27: 17, 5 and 39 s) with room
  declare -A EXPECT=([env]=8 [tests]=70 [ops_tests]=40 [ops]=15 [bf16]=45 [nofusion]=45 [fp8]=55 [vocab250k]=45
                     [memory]=16 [megatron]=60 [compile]=60 [compile_nofusion]=60 [mb8]=45
                     [fp8_mb8]=50 [fp8_lt_mb8]=50 [fp8_compile]=60 [fp8_compile_triton]=60 [fp8_current_compile]=60 [fp8_current]=50
                     [torchao]=60 [fp8_host]=40 [flex_autotune]=120 [fp8_cuda]=55
                     [fp8_fast_accum]=50 [fp8_casts]=60 [fp8_lt]=55 [fp8_fused]=55 [fp8_lt_fused]=55 [fp8_tlt_fused]=55
                     [fp8_prev]=55 [fp8_all_fused]=55 [fp8_tuned]=60 [attention]=90)
  CAP=2  # a stage is stopped at twice its expected seconds (a hang costs no more)
fi

# tools/benchmark.py's steps: WARMUP untimed, TIMED timed; a --profile run traces one more step
# after them (a profiler session leaves CUPTI attached, slowing the steps after it: none is timed)
STEPS=(--warmup "$WARMUP" --steps "$TIMED")
PROFILED=(train.profile.start=$(( WARMUP + TIMED )) train.profile.stop=$(( WARMUP + TIMED + 1 )))

# ------------------------------------------------------------------ plumbing
FORK_PID=
# the stages whose dry-run command sets TORCH_COMPILE_DISABLE=1 (compiled_bench, in
# gpu_check_stages.sh): their commands import inductor's compiler, which the fork server then
# imports once (tests/test_gpu_check.py checks the list against the stage functions)
COMPILED_STAGES=(compile compile_nofusion fp8_compile fp8_compile_triton fp8_current_compile)
# what the dry run's commands import besides torch: the modules of tools/benchmark.py (~0.4 s a command)
FORK_PRELOAD=(torch torch._dynamo dept_mega.trainer dept_mega.model dept_mega.metrics dept_mega.profiling
              dept_mega.megatron_flags dept_mega.run_inputs dept_mega.variant)
forkserver_up() {
  # the dry run, from its first stage or build on: each Python command forked from one interpreter
  # that has imported torch, torch._dynamo and the project's training modules (~3.5 s of the
  # 2-core machine per command otherwise), with the command's own arguments, environment and
  # stdio; the compiled stages' TORCH_COMPILE_DISABLE=1 and the max-autotune run's
  # TORCHINDUCTOR_MAX_AUTOTUNE=1 are set in their forks as torch's imports would set them
  # (benchmarks/forkserver.py's SETTINGS); a command whose other start-up variables differ from
  # the server's starts a fresh interpreter
  [ "$DRY" = 1 ] && [ -z "$FORK_PID" ] || return 0
  local sock=$WORK/forkserver.sock preload=("${FORK_PRELOAD[@]}") s compiled=0 hung=${#HANG[@]}
  for s in "${PLANNED[@]}"; do [ -n "${HANG[$s]:-}" ] || hung=0; done
  (( hung )) && return 0  # (GPU_CHECK_DRY_HANG: every stage hangs, so no Python command to serve)
  for s in "${COMPILED_STAGES[@]}"; do
    [[ " ${ORDER[*]} " == *" $s "* ]] && compiled=1
  done
  if [ $compiled = 1 ]; then
    # (torch.compile imports inductor's compiler even when disabled: ~2 s, imported once here)
    preload+=(torch._inductor.compile_fx torch._dynamo.repro.after_dynamo)
    log "# fork server: torch, the training modules and inductor's compiler (the compiled stages: TORCH_COMPILE_DISABLE=1 set in their forks)"
  else
    log "# fork server: torch and the training modules (no compiled stage in this call: not inductor's compiler)"
  fi
  "$PY" benchmarks/forkserver.py serve "$sock" "${preload[@]}" </dev/null >>"$LOG" 2>&1 &
  FORK_PID=$!
  # its imports before the first stage's clock starts (a loaded machine takes tens of seconds)
  local t0=$SECONDS
  while [ ! -e "$sock.ready" ] && kill -0 "$FORK_PID" 2>/dev/null && (( SECONDS - t0 < 300 )); do sleep 0.2; done
  if [ -e "$sock.ready" ]; then log "#   its imports done after $(( SECONDS - t0 )) s (before the first stage's clock)"
  else log "#   its imports not done after $(( SECONDS - t0 )) s: the commands wait for them"; fi
  # (the client needs only the standard library: -S skips site's start-up, ~12 ms a command)
  cat >"$WORK/python" <<EOF
#!/bin/sh
exec "$PY" -S "$ROOT/benchmarks/forkserver.py" run "$sock" "\$@"
EOF
  chmod +x "$WORK/python"
  PY=$WORK/python
}
log() { echo "$*" | tee -a "$LOG"; }
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
# A stage's limit is a deadline that all its commands share: stage() sets STAGE_END (its start +
# LIMIT) and each command (run, within) gets only the time left to it; a command reached after it
# is not started. What the deadline stopped goes to the log and to CUT, which the stage's 'finished'
# line gives (within writes to the log file directly: its caller may send its output there too).
STAGE=
LIMIT=0
STAGE_END=0
CUT=()
within() {  # CMD...: CMD with the time left to the stage's deadline (timeout -k 5); rc 124 without starting it when none is left
  local what="${1##*/} ${2:-}" lim rc
  [ "${2:-}" = -m ] && what+=" ${3:-}"
  lim=$(( STAGE_END - $(date +%s) ))
  if (( lim <= 0 )); then
    echo "(not started: the stage's limit of ${LIMIT}s is spent: $what)" >>"$LOG"
    CUT+=("not started: $what"); return 124
  fi
  [ -n "$STAGE" ] && [ -n "${HANG[$STAGE]:-}" ] && set -- sleep 600  # (the dry run's GPU_CHECK_DRY_HANG)
  timeout -k 5 "$lim" "$@"
  rc=$?
  if (( rc == 124 || rc == 137 )) && (( $(date +%s) >= STAGE_END )); then
    echo "(stopped at the stage's limit of ${LIMIT}s: $what)" >>"$LOG"
    CUT+=("stopped: $what")
  fi
  return $rc
}
run() {  # a command under the stage's deadline (within), its output in the log
  log "\$ $*"
  within "$@" >>"$LOG" 2>&1
}
PLANNED=()  # the stages this call runs but build, in their order, for summary.md's rerun line
for s in "${ORDER[@]}"; do [ "$s" = build ] || PLANNED+=("$s"); done
summary() {
  local dry=() planned
  [ "$DRY" = 1 ] && dry=(--dry-run)
  planned=$(IFS=,; echo "${PLANNED[*]}")
  "$PY" benchmarks/suite_summary.py "$OUT" --env "$WORK/env.json" --budget "$BUDGET" \
    --elapsed $(( $(date +%s) - T0 )) --planned "$planned" "${dry[@]}" >/dev/null 2>>"$LOG" \
    || log "suite_summary.py failed"
}
stage() {  # NAME: run stage_NAME (gpu_check_stages.sh) if its expected time is left
  local name=$1 exp=${EXPECT[$1]} rem t rc why
  if [ "$name" = fp8_tuned ] && why=$(static_libstdcxx); then  # (stage_fp8_tuned checks again after a build it waited for)
    log "### stage $name skipped: $why"
    summary; return 0
  fi
  rem=$(left)
  (( rem - RESERVE < exp )) || { forkserver_up; rem=$(left); }  # (the dry run's server: its imports first)
  if (( rem - RESERVE < exp )); then
    log "### stage $name skipped: expected ${exp}s, $((rem - RESERVE))s left"
    summary; return 0
  fi
  LIMIT=$(( rem - RESERVE < CAP * exp ? rem - RESERVE : CAP * exp ))
  [ -n "${HANG[$name]:-}" ] && LIMIT=${HANG[$name]}
  log "### stage $name (expected ${exp}s, limit ${LIMIT}s, $(date -Is))"
  t=$(date +%s)
  STAGE=$name STAGE_END=$(( t + LIMIT )) CUT=()
  "stage_$name"
  rc=$?
  local cut=
  if (( ${#CUT[@]} )); then  # a stage its deadline stopped did not finish, whatever it returned
    (( rc == 0 )) && rc=124
    cut=$(printf '; %s' "${CUT[@]}")
    cut=", cut at its limit of ${LIMIT} s (${cut#; })"
  fi
  log "### stage $name finished: rc=$rc in $(( $(date +%s) - t )) s$cut"
  STAGE=
  summary
}

# ------------------------------------------------------------------ stages
# stage_NAME for each stage and their helpers (bench, bench_row, reuse, the build, ...):
# benchmarks/gpu_check_stages.sh, sourced after the settings above (it reads BIG_VOCAB as it is sourced)
# shellcheck source=benchmarks/gpu_check_stages.sh
source "$ROOT/benchmarks/gpu_check_stages.sh" || exit 2

# ------------------------------------------------------------------ the sequence
wheel_warning
log "# gpu_check $( [ "$DRY" = 1 ] && echo "(dry run on the CPU) " )budget ${BUDGET}s, output $OUT, $(date -Is)"
log "# stages, in this order: ${PLANNED[*]}"
start_build
for s in "${PLANNED[@]}"; do stage "$s"; done
if [ -n "$BUILD_PID" ] && kill -0 "$BUILD_PID" 2>/dev/null; then
  log "the build is still running at the end: stopped"; kill "$BUILD_PID" 2>/dev/null
fi
log "# gpu_check done in $(( $(date +%s) - T0 )) s"
summary
cat "$OUT/summary.md"
# shellcheck disable=SC2086
[ -n "$FORK_PID" ] && kill $FORK_PID 2>/dev/null
rm -rf "$WORK"
