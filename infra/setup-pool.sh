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
# The work is flows/pool_setup.py's, in one Python process: a `prefect` command per object imports Prefect
# each time, seconds apiece on a busy machine.
# SIDECAR_PREFECT: the prefect executable (default: the checkout's .venv); the Python beside it runs the module
# (SIDECAR_PYTHON names another).
set -euo pipefail
cd "$(dirname "$0")/.."
export PREFECT_API_URL="${PREFECT_API_URL:-http://127.0.0.1:${PREFECT_PORT:-4200}/api}"
prefect="${SIDECAR_PREFECT:-.venv/bin/prefect}"
beside="$(dirname "$(command -v "$prefect" || echo "$prefect")")/python3"
python="${SIDECAR_PYTHON:-$([ -x "$beside" ] && echo "$beside" || echo python3)}"

if [ "$#" -eq 0 ]; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
  set -- "${SIDECAR_HOST:-$HOSTNAME}:$(( gpus > 0 ? gpus : 1 ))"
fi
exec "$python" -m flows.pool_setup "$@"
