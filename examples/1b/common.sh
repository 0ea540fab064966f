# shellcheck shell=bash
# Shared part of the 1B sbatch scripts (examples/1b/{std,glob,trim,spec,spec_opt}.sh).
# The calling script sets VARIANT, CONFIG and its #SBATCH headers, then sources this file; any
# arguments given to sbatch after the script name are passed on to dept_mega.train as
# dotted overrides, e.g.   sbatch examples/1b/spec_opt.sh parallel.tensor=2 parallel.data=4
#
# Environment knobs (all optional):
#   RUN_DIR         where the run writes (default runs/1b/$VARIANT; a rerun with the same
#                   RUN_DIR resumes from RUN_DIR/checkpoints/latest); on a file system every
#                   node sees (not node-local /tmp, /scratch, $TMPDIR: the job is refused);
#                   a train.run_dir=... argument overrides it
#   GPUS_PER_NODE   processes per node (default: Slurm's SLURM_GPUS_ON_NODE, else the count
#                   of SLURM_GPUS_PER_NODE, else 8)
#   MASTER_PORT     rendezvous port on the first node (default derived from the job id)
#   PYTHON          interpreter for the pre-flight check (default: python, after activating
#                   the checkout's .venv when there is one)
#   DEVICE          train.device of the run (default cuda: the job refuses to start, naming why,
#                   where its ranks cannot use CUDA, e.g. a CPU-only torch in the .venv, a step
#                   given no GPUs, a driver too old; instead of training on the CPU); DEVICE=cpu
#                   trains on the CPU over gloo on purpose (the CPU tests of these scripts)
#   PREEMPT_LEAD_S  the N of the script's `#SBATCH --signal=USR1@N` (default 120, as the scripts
#                   ask; change both together): the seconds between SIGUSR1 and the time limit.
#                   torchrun gives the ranks N - 10 of them to save (TORCH_ELASTIC_SHUTDOWN_TIMEOUT,
#                   unless set); --check prints the write rate that needs (docs/launching.md §9)
#   DEPT_SKIP_PREFLIGHT=1  skip the config/layout check before launching
set -euo pipefail
: "${VARIANT:?set VARIANT before sourcing examples/1b/common.sh}"

# sbatch runs a copy of the script from its spool directory, so find the checkout from the
# directory sbatch was called in (submit from the repository root).
ROOT=${DEPT_MEGA_ROOT:-${SLURM_SUBMIT_DIR:-$(pwd)}}
cd "$ROOT"
CONFIG=${CONFIG:-examples/1b/${VARIANT}.yaml}
if [ ! -f "$CONFIG" ]; then
  echo "examples/1b/common.sh: $ROOT/$CONFIG not found; submit from the dept_mega checkout" >&2
  exit 1
fi
if [ -f .venv/bin/activate ]; then
  # shellcheck disable=SC1091
  source .venv/bin/activate
fi
PYTHON=${PYTHON:-python}
RUN_DIR=${RUN_DIR:-runs/1b/${VARIANT}}
# A train.run_dir=... override after the script name wins over RUN_DIR (the last one, as in the
# trainer): the stale-marker removal, the launch line and the requeue test must look where the
# run writes.
for arg in "$@"; do
  case "$arg" in train.run_dir=*) RUN_DIR=${arg#train.run_dir=} ;; esac
done
DEVICE=${DEVICE:-cuda}
NNODES=${SLURM_NNODES:?not inside a Slurm allocation (SLURM_NNODES unset); use sbatch}
# The GPU count of --gpus-per-node as Slurm passes it in SLURM_GPUS_PER_NODE: a count ("4"), a
# typed count ("h100:4", "gpu:h100:4"), or a comma list of those, summed ("a100:2,v100:2": 4).
# Prints the count; fails (prints nothing) on anything else.
slurm_gpu_count() {
  local item total=0
  local -a items
  [[ $1 =~ ^([A-Za-z0-9_.-]+:){0,2}[0-9]+(,([A-Za-z0-9_.-]+:){0,2}[0-9]+)*$ ]] || return 1
  IFS=, read -ra items <<< "$1"
  for item in "${items[@]}"; do
    total=$((total + 10#${item##*:}))
  done
  echo "$total"
}
# Processes per node: GPUS_PER_NODE, else SLURM_GPUS_ON_NODE (this node's count), else the
# count of SLURM_GPUS_PER_NODE, else 8.
gpus_given=${GPUS_PER_NODE:-}
if [ -n "$gpus_given" ]; then
  gpus_from=GPUS_PER_NODE
elif [ -n "${SLURM_GPUS_ON_NODE:-}" ]; then
  gpus_from=SLURM_GPUS_ON_NODE gpus_given=$SLURM_GPUS_ON_NODE GPUS_PER_NODE=$SLURM_GPUS_ON_NODE
elif [ -n "${SLURM_GPUS_PER_NODE:-}" ]; then
  gpus_from=SLURM_GPUS_PER_NODE gpus_given=$SLURM_GPUS_PER_NODE
  GPUS_PER_NODE=$(slurm_gpu_count "$SLURM_GPUS_PER_NODE") || {
    echo "examples/1b/common.sh: SLURM_GPUS_PER_NODE='$SLURM_GPUS_PER_NODE' is not a GPU count (N, TYPE:N," \
         "gpu:TYPE:N, or a comma list of those); set GPUS_PER_NODE=<processes per node>" >&2
    exit 1
  }
else
  gpus_from=default gpus_given=8 GPUS_PER_NODE=8
fi
case "$GPUS_PER_NODE" in
  '' | *[!0-9]* | 0*) echo "examples/1b/common.sh: $gpus_from='$gpus_given' is not a positive number of GPUs;" \
                           "set GPUS_PER_NODE=<processes per node>" >&2; exit 1 ;;
esac
WORLD=$((NNODES * GPUS_PER_NODE))

# Rendezvous on the first node of the allocation.
# (sed reads the whole list: `head` could end scontrol with SIGPIPE, fatal under pipefail)
MASTER_ADDR=$(scontrol show hostnames "${SLURM_JOB_NODELIST:?not inside a Slurm allocation}" | sed -n 1p)
MASTER_PORT=${MASTER_PORT:-$((29500 + ${SLURM_JOB_ID:-0} % 1000))}
export MASTER_ADDR MASTER_PORT

# Threads per process: the task's CPUs shared by the node's ranks.
THREADS=$(( ${SLURM_CPUS_PER_TASK:-$GPUS_PER_NODE} / GPUS_PER_NODE ))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( THREADS > 0 ? THREADS : 1 ))}

# NCCL. Defaults suit InfiniBand/RoCE clusters; adapt the commented lines to your fabric.
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}              # INFO prints the chosen transports/rings
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}  # a failed collective aborts the job instead of hanging it
export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}       # tolerate transient IB congestion at the outer sync
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}  # keeps TP communication ordered with compute (Megatron's setting)
# export NCCL_SOCKET_IFNAME=ib0,eth0   # bootstrap interface when the default route is wrong
# export NCCL_IB_HCA=mlx5               # restrict to the HCAs of the GPU fabric
# export NCCL_NET_GDR_LEVEL=PHB         # GPUDirect RDMA distance, if your nodes need it

# The preemption's lead time (see "Preemption" below): the save's time limit, before the
# pre-flight, which prints the write rate it needs.
PREEMPT_LEAD_S=${PREEMPT_LEAD_S:-120}
if [[ ! $PREEMPT_LEAD_S =~ ^[0-9]+$ ]] || (( 10#$PREEMPT_LEAD_S <= 10 )); then
  echo "examples/1b/common.sh: PREEMPT_LEAD_S='$PREEMPT_LEAD_S' is not a number of seconds above 10" \
       "(the N of #SBATCH --signal=USR1@N)" >&2
  exit 1
fi
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-$((10#$PREEMPT_LEAD_S - 10))}

# Pre-flight (python -m dept_mega.train --check, docs/launching.md): the config, its overrides,
# the layout for this world size, CUDA on this (the first) node for train.device=cuda, the data
# and tokenizer files and the memory per rank, checked before any rank starts; a warning when the
# run directory has less room than the checkpoints the run keeps.
if [ "${DEPT_SKIP_PREFLIGHT:-0}" != 1 ]; then
  "$PYTHON" -m dept_mega.train --config "$CONFIG" train.run_dir="$RUN_DIR" train.device="$DEVICE" "$@" \
    --check --world-size "$WORLD"
fi

echo "launch: $VARIANT on $NNODES node(s) x $GPUS_PER_NODE GPU(s), rendezvous $MASTER_ADDR:$MASTER_PORT, run dir $RUN_DIR"
mkdir -p "$RUN_DIR"

# Preemption (docs/launching.md, "Preemption and requeue"): `#SBATCH --signal=USR1@120` makes
# Slurm send SIGUSR1 to the job step 120 s (PREEMPT_LEAD_S) before the time limit (SIGTERM on
# scancel or preemption). torchrun passes SIGUSR1 on to its workers only when told to handle it
# (without this it would die of it); every rank then finishes its step, rank 0 writes
# $RUN_DIR/preempted.json (naming the last complete checkpoint), the job saves a checkpoint,
# rewrites the marker and the ranks exit with status 75. torchrun gives its workers
# TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds to do that (set above: PREEMPT_LEAD_S - 10, leaving the
# script time to requeue before the time limit) before it kills them; the checkpoint is atomic,
# so a killed save only loses that save, and the marker written before it still requeues the job.
# (torchrun's --signals-to-handle reads PET_SIGNALS_TO_HANDLE; torch versions without that
# flag read TORCHELASTIC_SIGNALS_TO_HANDLE)
export PET_SIGNALS_TO_HANDLE=${PET_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}
export TORCHELASTIC_SIGNALS_TO_HANDLE=${TORCHELASTIC_SIGNALS_TO_HANDLE:-$PET_SIGNALS_TO_HANDLE}
rm -f "$RUN_DIR/preempted.json"  # a stale marker must not requeue a job that failed otherwise

# One torchrun per node (ntasks-per-node=1); torchrun starts the node's GPU processes and
# assigns global ranks node by node, so consecutive ranks (a source group: tp fastest, then
# dp, pp, group) sit on the same node (docs/launching.md).
# The rendezvous store runs on the first node. torchrun decides whether it is that node by
# comparing host names, which fails where Slurm's node names are not what the machine calls
# itself (an interface alias, another domain; pytorch/pytorch#73656): then no node hosts the
# store and the job hangs at start-up. So each node's task says it (is_host), from Slurm's name
# of its node, SLURMD_NODENAME, against the allocation's first node, MASTER_ADDR.
# shellcheck disable=SC2016  # expanded by the bash of each task, not here
TORCHRUN_ON_NODE='h=()
if [ -n "${SLURMD_NODENAME:-}" ]; then
  if [ "$SLURMD_NODENAME" = "$MASTER_ADDR" ]; then h=(--rdzv-conf is_host=1); else h=(--rdzv-conf is_host=0); fi
fi
exec torchrun "${h[@]}" "$@"'
rc=0
# Slurm >= 22.05 no longer passes the allocation's --cpus-per-task on to srun: without it, on
# clusters that bind tasks to cores, every rank of a node would share one core.
srun --kill-on-bad-exit=1 --ntasks-per-node=1 ${SLURM_CPUS_PER_TASK:+--cpus-per-task=$SLURM_CPUS_PER_TASK} \
  bash -c "$TORCHRUN_ON_NODE" torchrun \
    --nnodes "$NNODES" \
    --nproc-per-node "$GPUS_PER_NODE" \
    --rdzv-id "${SLURM_JOB_ID:-dept}" \
    --rdzv-backend c10d \
    --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" \
    -m dept_mega.train --config "$CONFIG" train.run_dir="$RUN_DIR" train.device="$DEVICE" "$@" || rc=$?

# Preempted (status 75 from the ranks; torchrun reports its own status, so the marker decides):
# put the job back in the queue (#SBATCH --requeue); it resumes from the checkpoint just written.
if [ -f "$RUN_DIR/preempted.json" ] || [ "$rc" -eq 75 ]; then
  echo "preempted: $(cat "$RUN_DIR/preempted.json" 2>/dev/null); requeueing job ${SLURM_JOB_ID:-?}"
  scontrol requeue "${SLURM_JOB_ID:?}"
  exit 0
fi
exit "$rc"
