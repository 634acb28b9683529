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
exec "${SIDECAR_PREFECT:-.venv/bin/prefect}" server start --host 127.0.0.1 --port "${PREFECT_PORT:-4200}"
