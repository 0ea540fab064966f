#!/bin/bash
#SBATCH --job-name=dept-1b-lighthouse
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=2
#SBATCH --time=7-00:00:00
#SBATCH --output=slurm-%x-%j.out
# The lighthouse of a federated DEPT run (docs/launching.md, "Federated source groups"): a
# small CPU job every group job reaches over TCP. It prints its address; give it to the group
# jobs as LIGHTHOUSE=host:port (examples/1b/federated_group.sh).
#   sbatch examples/1b/lighthouse.sh        (PORT, MIN_GROUPS, JOIN_TIMEOUT_S to change them)
set -euo pipefail
cd "${DEPT_MEGA_ROOT:-${SLURM_SUBMIT_DIR:-$(pwd)}}"
# shellcheck disable=SC1091
[ -f .venv/bin/activate ] && source .venv/bin/activate
echo "lighthouse host: $(hostname -f)"
# MIN_GROUPS: a round needs at least this many groups, and at least the group jobs'
# federation.min_groups (FEDERATION_MIN_GROUPS): with two sites, 1 in both for one to go on alone.
# JOIN_TIMEOUT_S: the spread of the groups' arrival at a round start, well below the group jobs'
# federation.timeout_s (600 in federated_group.sh): survivors of a slow group wait both
# HEARTBEAT_TIMEOUT_S: 30, not the command's default 5: between sites a few seconds without packets
# must not count a live group as gone (docs/launching.md §12, Heartbeats)
# BIND: the address to listen on; nothing here is authenticated (its /status page can kill a group
# job): give the private / VPN interface's address (default: every interface)
exec python -m dept_mega.lighthouse --port "${PORT:-29510}" --min-groups "${MIN_GROUPS:-2}" \
  --join-timeout-s "${JOIN_TIMEOUT_S:-60}" --heartbeat-timeout-s "${HEARTBEAT_TIMEOUT_S:-30}" \
  --bind "${BIND:-[::]}"
