#!/bin/bash
#SBATCH --job-name=dept-1b-fed-group
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=12:00:00
#SBATCH --output=slurm-%x-%j.out
#SBATCH --exclusive
#SBATCH --signal=USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
# One source group of a federated DEPT run as its own job (docs/launching.md, "Federated source
# groups"): one node (tensor 1 x data 8), joined to the other group jobs only through the
# outer synchronisation, via the lighthouse (examples/1b/lighthouse.sh). Submit one per group,
# on any cluster that reaches the lighthouse and the other groups' nodes:
#   sbatch --export=ALL,DEPT_GROUP=0,LIGHTHOUSE=host:29510 examples/1b/federated_group.sh [key=value ...]
# CONFIG (default examples/1b/spec.yaml; CONFIG=examples/1b/spec_opt.yaml for SPEC-OPT, any of
# glob / trim / spec / spec_opt) must list at least as many data.sources as groups
# (federation.groups = FEDERATION_GROUPS; data.sources[i].group says which group job holds each
# when there are more). This job reads only its own sources' files; of the others it needs their
# summaries (python -m dept_mega.data.summary PREFIX at their sites; docs/launching.md §12 Sources).
# A requeued job resumes from its own RUN_DIR and rejoins at the next round boundary.
# Federation settings (docs/launching.md §12): FEDERATION_GROUPS (default 8), FEDERATION_MIN_GROUPS
# (2), FEDERATION_TIMEOUT_S (600) and, when set, FEDERATION_QUORUM_GIVE_UP_S (seconds a quorum wait
# lasts before the job saves and exits for a requeue; null: never; unset: the config's, 3600 by
# default) and FEDERATION_ADVERTISE_HOST (the name / address the other sites reach this job by:
# fqdn, route (this node's address on its route to the lighthouse), or this node's literal
# address); any other key=value argument is passed on as well.
CONFIG=${CONFIG:-examples/1b/spec.yaml}
# the variant (the log's "launch:" line): the config's dept.variant
config_file=$CONFIG
[[ $config_file = /* ]] || config_file=${DEPT_MEGA_ROOT:-${SLURM_SUBMIT_DIR:-$(pwd)}}/$CONFIG
VARIANT=$(grep -o 'variant:[[:space:]]*[A-Za-z_]*' "$config_file" 2>/dev/null | sed -n '1s/variant:[[:space:]]*//p' || true)
VARIANT=${VARIANT:-unknown}
: "${DEPT_GROUP:?set DEPT_GROUP (the group index of this job)}"
: "${LIGHTHOUSE:?set LIGHTHOUSE=host:port of python -m dept_mega.lighthouse}"
export DEPT_GROUP
RUN_DIR=${RUN_DIR:-runs/1b/federated/${VARIANT}/group${DEPT_GROUP}}  # per variant: a SPEC-OPT run does not resume a SPEC one
set -- federation.lighthouse="$LIGHTHOUSE" federation.groups="${FEDERATION_GROUPS:-8}" \
  federation.min_groups="${FEDERATION_MIN_GROUPS:-2}" federation.timeout_s="${FEDERATION_TIMEOUT_S:-600}" \
  ${FEDERATION_QUORUM_GIVE_UP_S:+federation.quorum_give_up_s="$FEDERATION_QUORUM_GIVE_UP_S"} \
  ${FEDERATION_ADVERTISE_HOST:+federation.advertise_host="$FEDERATION_ADVERTISE_HOST"} "$@"
source "${DEPT_MEGA_ROOT:-${SLURM_SUBMIT_DIR:-$(pwd)}}/examples/1b/common.sh"
