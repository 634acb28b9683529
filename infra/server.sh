#!/usr/bin/env bash
# Start the Prefect API and UI on the loopback interface only (reach it from elsewhere via an SSH tunnel
# or a reverse proxy with authentication). Settings come from the environment, see prefect.env.example; in
# production its state is in Postgres, as in docker-compose.yml:
#   PREFECT_API_DATABASE_CONNECTION_URL=postgresql+asyncpg://prefect:<password>@127.0.0.1:5432/prefect
#   PREFECT_API_DATABASE_MIGRATE_ON_START=true
# (tests/test_deployments_postgres.py starts it so on a throwaway cluster); without them, SQLite under PREFECT_HOME.
# SIDECAR_PREFECT: the prefect executable (default: the checkout's .venv); `sidecar ui` passes its own.
set -euo pipefail
cd "$(dirname "$0")/.."
export PREFECT_SERVER_ANALYTICS_ENABLED="${PREFECT_SERVER_ANALYTICS_ENABLED:-false}"
# A run killed outright cannot give its GPU slot back: the server revokes the slot's lease once it has expired
# (60 s, flows/accelerator.py). By default it looks for expired leases every 15 s and tells a run denied a slot
# to ask again in up to 39 s (30 s, jittered), so a relaunch on that GPU would idle it up to 54 s past the lease;
# every 2 s and up to 6.5 s (5 s, jittered) cost a few requests more per waiting run.
export PREFECT_SERVER_SERVICES_REPOSSESSOR_LOOP_SECONDS="${PREFECT_SERVER_SERVICES_REPOSSESSOR_LOOP_SECONDS:-2}"
export PREFECT_SERVER_CONCURRENCY_MAXIMUM_CONCURRENCY_SLOT_WAIT_SECONDS="${PREFECT_SERVER_CONCURRENCY_MAXIMUM_CONCURRENCY_SLOT_WAIT_SECONDS:-5}"
exec "${SIDECAR_PREFECT:-.venv/bin/prefect}" server start --host 127.0.0.1 --port "${PREFECT_PORT:-4200}"
