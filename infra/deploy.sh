#!/usr/bin/env bash
# One-time (and after every change to prefect.yaml) set-up against a running server: the work pool,
# the gpu concurrency limit, then the three deployments of prefect.yaml with their schedule and triggers.
# SIDECAR_PREFECT: the prefect executable (default: the checkout's .venv); `sidecar ui` passes its own.
set -euo pipefail
cd "$(dirname "$0")/.."
export PREFECT_API_URL="${PREFECT_API_URL:-http://127.0.0.1:${PREFECT_PORT:-4200}/api}"
export SIDECAR_REPO="${SIDECAR_REPO:-$PWD}"
prefect="${SIDECAR_PREFECT:-.venv/bin/prefect}"

$prefect work-pool inspect sidecar-pool >/dev/null 2>&1 || $prefect work-pool create sidecar-pool --type process
# A nightly run holds a slot of `gpu` from loading its pair to its last batch: two runs never share the GPU.
$prefect gcl inspect gpu >/dev/null 2>&1 || $prefect gcl create gpu --limit 1
$prefect --no-prompt deploy --all --prefect-file prefect.yaml
