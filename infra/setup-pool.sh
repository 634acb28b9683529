#!/usr/bin/env bash
# The work pools and GPU concurrency limits of a sidecar Prefect server; safe to run again (it creates what is
# missing and sets every limit back to 1).
#
#   infra/setup-pool.sh [HOST:GPUS ...]     e.g. infra/setup-pool.sh gpu-a:8 gpu-b:4
#
# - work pools sidecar-control (the parent nightly runs, cost-report) and sidecar-gpu (shards, judge), both
#   of type process;
# - for each HOST:GPUS, the limits gpu-HOST-0 .. gpu-HOST-(GPUS-1), one slot each: the names the GPU workers of
#   that host give their flow runs in SIDECAR_GPU_LIMIT (infra/gpu-workers.sh, the systemd template unit);
#   HOST is the host name as the worker sees it (`hostname`, systemd's %H);
# - the limit gpu, one slot: the one runs started outside a pool worker hold (SIDECAR_GPU_LIMIT unset);
# - the automation of infra/crash-silent-runs.yaml, which marks a flow run whose heartbeats stopped Crashed
#   (replaced by the file's version on every run).
#
# No argument: this machine, one limit per GPU that nvidia-smi lists, or one (a CPU worker) if none.
# SIDECAR_PREFECT: the prefect executable (default: the checkout's .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
export PREFECT_API_URL="${PREFECT_API_URL:-http://127.0.0.1:${PREFECT_PORT:-4200}/api}"
prefect="${SIDECAR_PREFECT:-.venv/bin/prefect}"

if [ "$#" -eq 0 ]; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
  set -- "${SIDECAR_HOST:-$HOSTNAME}:$(( gpus > 0 ? gpus : 1 ))"
fi
for spec in "$@"; do
  if ! [[ "$spec" =~ ^[A-Za-z0-9._-]+:[0-9]+$ ]]; then
    echo "setup-pool.sh: expected HOST:GPUS (e.g. gpu-a:8), got '$spec'" >&2
    exit 2
  fi
done

pool() {
  $prefect work-pool inspect "$1" >/dev/null 2>&1 || $prefect work-pool create "$1" --type process
}
limit() {  # created, or set back to one slot where it exists: one prefect call on a new server, not two
  if ! $prefect gcl create "$1" --limit 1 >/dev/null 2>&1; then
    $prefect gcl update "$1" --limit 1 >/dev/null
  fi
  echo "concurrency limit $1: 1 slot"
}
automation() {  # the automation named $1, as file $2 has it now
  if $prefect automation inspect "$1" >/dev/null 2>&1; then
    $prefect --no-prompt automation delete "$1" >/dev/null
  fi
  $prefect automation create --from-file "$2" >/dev/null
  echo "automation $1: from $2"
}

pool sidecar-control
pool sidecar-gpu
limit gpu
for spec in "$@"; do
  host="${spec%:*}"
  for (( i = 0; i < ${spec##*:}; i++ )); do
    limit "gpu-$host-$i"
  done
done
automation sidecar-crash-silent-runs infra/crash-silent-runs.yaml
