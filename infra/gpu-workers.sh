#!/usr/bin/env bash
# One process worker of the sidecar-gpu pool per visible GPU of this machine, in the foreground until SIGTERM or
# Ctrl-C (which stop them all) or until one of them exits (which stops the others; the exit status is its).
#
#   infra/gpu-workers.sh            # one worker per GPU of CUDA_VISIBLE_DEVICES, else of `nvidia-smi -L`;
#                                   # one CPU worker if there is none
#   infra/gpu-workers.sh --cpu N    # N CPU workers, each with its share of the cores
#
# Worker i takes one flow run at a time (`--limit 1`) and hands its runs CUDA_VISIBLE_DEVICES=<i> and
# SIDECAR_GPU_LIMIT=gpu-<host>-<i>, the concurrency limit infra/setup-pool.sh creates for that GPU. CPU
# worker i hides the GPUs and runs its flow runs on its share of the cores, as a device of its own
# (SIDECAR_CPU_SLOT=i, OMP_NUM_THREADS=cores/N), so that N CPU workers run side by side.
# SIDECAR_PREFECT: the prefect executable (default: the checkout's .venv); SIDECAR_HOST: the host name in the
# limit names (default: this machine's).
set -euo pipefail
cd "$(dirname "$0")/.."
export PREFECT_API_URL="${PREFECT_API_URL:-http://127.0.0.1:${PREFECT_PORT:-4200}/api}"
export SIDECAR_REPO="${SIDECAR_REPO:-$PWD}"
prefect="${SIDECAR_PREFECT:-.venv/bin/prefect}"
host="${SIDECAR_HOST:-$HOSTNAME}"

cpu=0
case "${1:-}" in
  --cpu)
    if ! [[ "${2:-}" =~ ^[1-9][0-9]*$ ]]; then echo "gpu-workers.sh: --cpu needs a count of workers" >&2; exit 2; fi
    cpu=$2 ;;
  "") ;;
  *) echo "usage: gpu-workers.sh [--cpu N]" >&2; exit 2 ;;
esac

devices=()
if [ "$cpu" -eq 0 ]; then
  if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    IFS=, read -r -a devices <<< "$CUDA_VISIBLE_DEVICES"
  else
    mapfile -t devices < <(nvidia-smi -L 2>/dev/null | sed -n 's/^GPU \([0-9]\+\):.*/\1/p' || true)
  fi
  [ "${#devices[@]}" -gt 0 ] || cpu=1
fi

pids=()
# SIGTERM to every worker, SIGKILL to those still up after 3 s: Prefect 3.9's process worker turns the SIGTERM
# into a SIGINT to itself and often stays up after it, so a longer wait only delays the stop (its flow runs run
# in sessions of their own and get signals of their own)
stop() {
  trap - TERM INT
  kill -TERM "${pids[@]}" 2>/dev/null || true
  for _ in $(seq 30); do
    alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ "$alive" -eq 1 ] || break
    sleep 0.1
  done
  kill -KILL "${pids[@]}" 2>/dev/null || true
  wait || true
}
trap 'stop; exit 143' TERM
trap 'stop; exit 130' INT

start() {  # index, then the worker's extra environment
  local index=$1; shift
  env "$@" SIDECAR_GPU_LIMIT="gpu-$host-$index" \
    "$prefect" worker start --pool sidecar-gpu --type process --limit 1 --name "gpu-$host-$index" &
  pids+=("$!")
  echo "gpu-workers.sh: worker gpu-$host-$index (PID $!, $*)"
}

if [ "$cpu" -gt 0 ]; then
  threads=$(( $(nproc) / cpu > 0 ? $(nproc) / cpu : 1 ))
  for (( i = 0; i < cpu; i++ )); do
    start "$i" CUDA_VISIBLE_DEVICES= SIDECAR_CPU_SLOT="$i" OMP_NUM_THREADS="$threads" MKL_NUM_THREADS="$threads"
  done
else
  for device in "${devices[@]}"; do
    start "${device// /}" CUDA_VISIBLE_DEVICES="${device// /}"
  done
fi

# the first worker to exit ends them all: a supervisor (systemd, sidecar ui) sees it and can restart the set
status=0
wait -n || status=$?
stop
exit "$status"
