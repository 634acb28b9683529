#!/usr/bin/env bash
# Start the process worker of the sidecar-control pool: it runs the parent nightly runs (which plan shards,
# launch them on the sidecar-gpu pool, and ingest their parts into DuckDB; no GPU) and the cost reports, as
# subprocesses of this checkout. The GPU pool's workers: infra/gpu-workers.sh.
# SIDECAR_PREFECT: the prefect executable (default: the checkout's .venv); `sidecar ui` passes its own.
set -euo pipefail
cd "$(dirname "$0")/.."
export PREFECT_API_URL="${PREFECT_API_URL:-http://127.0.0.1:${PREFECT_PORT:-4200}/api}"
export SIDECAR_REPO="${SIDECAR_REPO:-$PWD}"
exec "${SIDECAR_PREFECT:-.venv/bin/prefect}" worker start --pool sidecar-control --type process --name "control-${SIDECAR_HOST:-$HOSTNAME}"
