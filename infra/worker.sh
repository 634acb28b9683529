#!/usr/bin/env bash
# Start a process worker for the sidecar-pool work pool: it runs the flow runs of the deployments in
# prefect.yaml as subprocesses of this checkout, on this machine's GPU.
# SIDECAR_PREFECT: the prefect executable (default: the checkout's .venv); `sidecar ui` passes its own.
set -euo pipefail
cd "$(dirname "$0")/.."
export PREFECT_API_URL="${PREFECT_API_URL:-http://127.0.0.1:${PREFECT_PORT:-4200}/api}"
export SIDECAR_REPO="${SIDECAR_REPO:-$PWD}"
exec "${SIDECAR_PREFECT:-.venv/bin/prefect}" worker start --pool sidecar-pool --type process
