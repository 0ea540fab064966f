#!/bin/bash
#SBATCH --job-name=dept-1b-spec_opt
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
# DEPT SPEC-OPT, 1B model: 8 source groups, one per node (tensor 1 x data 8), per-source tokenizers and embeddings, body averaged per round.
# Submit from the repository root:   sbatch examples/1b/spec_opt.sh [key.sub=value ...]
# Shared environment, pre-flight check and launch: examples/1b/common.sh.
VARIANT=spec_opt
CONFIG=examples/1b/spec_opt.yaml
source "${DEPT_MEGA_ROOT:-${SLURM_SUBMIT_DIR:-$(pwd)}}/examples/1b/common.sh"
