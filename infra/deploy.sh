#!/usr/bin/env bash
# One-time (and after every change to prefect.yaml) set-up against a running server: the work pools and the
# GPU concurrency limits (infra/setup-pool.sh, given the same HOST:GPUS arguments), then the four deployments
# of prefect.yaml with their schedule and triggers.
#
#   infra/deploy.sh [HOST:GPUS ...]     e.g. infra/deploy.sh gpu-a:8 gpu-b:4; none: this machine
#
# SIDECAR_PREFECT: the prefect executable (default: the checkout's .venv); `sidecar ui` passes its own.
# SIDECAR_REPO: the checkout the workers run flows from (default: this one; the same path on every machine).
set -euo pipefail
cd "$(dirname "$0")/.."
export PREFECT_API_URL="${PREFECT_API_URL:-http://127.0.0.1:${PREFECT_PORT:-4200}/api}"
export SIDECAR_REPO="${SIDECAR_REPO:-$PWD}"
prefect="${SIDECAR_PREFECT:-.venv/bin/prefect}"

infra/setup-pool.sh "$@"
$prefect --no-prompt deploy --all --prefect-file prefect.yaml
