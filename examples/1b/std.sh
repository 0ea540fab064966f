#!/bin/bash
#SBATCH --job-name=dept-1b-std
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=12:00:00
#SBATCH --output=slurm-%x-%j.out
#SBATCH --exclusive
#SBATCH --signal=USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
# STD baseline, 1B model: one group of 64 data-parallel ranks (8 nodes x 8 GPUs), per-step all-reduce.
# Submit from the repository root:   sbatch examples/1b/std.sh [key.sub=value ...]
# Shared environment, pre-flight check and launch: examples/1b/common.sh.
VARIANT=std
CONFIG=examples/1b/std.yaml
source "${DEPT_MEGA_ROOT:-${SLURM_SUBMIT_DIR:-$(pwd)}}/examples/1b/common.sh"
