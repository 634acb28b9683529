"""The deployment tests that matter most, on a Prefect server that keeps its state in PostgreSQL, as
infra/docker-compose.yml and infra/prefect.env.example run it in production (`infra/server.sh` with
``PREFECT_API_DATABASE_CONNECTION_URL=postgresql+asyncpg://prefect:...@127.0.0.1:<port>/prefect``): a sharded
nightly deployment run on two GPU-pool workers, judged once; a shard killed under its worker, relaunched with only
its unfinished documents; two runs at once, each on its own GPU's limit. Concurrency limits, several workers
polling and two runs at once are where Postgres and SQLite differ. The deploy and parameter tests of
tests/test_deployments.py run here too, on the same server and deploy, and skip there.

The cluster is a throwaway one (tests/postgres.py), removed after the module however its tests end; without
PostgreSQL's server or asyncpg the tests are skipped, saying why (`make test` installs both where root with
apt-get).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import test_deployments
from postgres import postgres_cluster, unavailable
from test_deployments import api, deployed, pool_workers, prefect_server  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.servers, pytest.mark.timeout(900)]
if (reason := unavailable()) is not None:
    pytestmark.append(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="module")
def database_url() -> Iterator[str]:
    with postgres_cluster() as url:
        yield url


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, database_url: str) -> Iterator[dict[str, str]]:
    """The Prefect server on the cluster, as prefect.env.example configures it."""
    home = tmp_path_factory.mktemp("prefect-server-home")
    with prefect_server(home, {"PREFECT_API_DATABASE_CONNECTION_URL": database_url,
                               "PREFECT_API_DATABASE_MIGRATE_ON_START": "true"}) as env:
        yield env


@pytest.mark.usefixtures("deployed")
def test_the_server_keeps_its_deployments_in_postgres_and_no_sqlite_file(server: dict[str, str],
                                                                         database_url: str) -> None:
    import asyncpg

    async def deployments() -> set[str]:
        connection = await asyncpg.connect(database_url.replace("postgresql+asyncpg://", "postgresql://"))
        try:
            return {row["name"] for row in await connection.fetch("SELECT name FROM deployment")}
        finally:
            await connection.close()

    assert asyncio.run(deployments()) == {"nightly", "nightly-shard", "judge", "cost-report"}
    assert not list(Path(server["PREFECT_HOME"]).glob("*.db")), "the server wrote a SQLite database"


# The tests of the SQLite module, collected here instead where this module runs (they skip there then): this
# module's `server` fixture puts them on Postgres. In this order: those without workers before the module's
# workers start, so that no worker picks up the runs they create.
test_deploy_creates_the_four_deployments_on_two_pools_and_a_limit_per_gpu = (
    test_deployments.test_deploy_creates_the_four_deployments_on_two_pools_and_a_limit_per_gpu)
test_deploy_again_changes_nothing = test_deployments.test_deploy_again_changes_nothing
test_the_server_gives_a_killed_runs_gpu_slot_back_seconds_after_its_lease_expires = (
    test_deployments.test_the_server_gives_a_killed_runs_gpu_slot_back_seconds_after_its_lease_expires)
test_triggers_start_judge_after_nightly_and_cost_report_after_judge = (
    test_deployments.test_triggers_start_judge_after_nightly_and_cost_report_after_judge)
test_one_overridden_parameter_keeps_every_other_one_through_the_api_and_the_cli = (
    test_deployments.test_one_overridden_parameter_keeps_every_other_one_through_the_api_and_the_cli)
test_a_value_a_field_refuses_is_refused_when_the_run_is_created = (
    test_deployments.test_a_value_a_field_refuses_is_refused_when_the_run_is_created)
test_the_triggers_hand_the_runs_db_path_and_pair_on_when_it_overrides_only_one_field = (
    test_deployments.test_the_triggers_hand_the_runs_db_path_and_pair_on_when_it_overrides_only_one_field)
test_a_sharded_nightly_deployment_run_on_two_gpu_workers_stores_each_document_once_and_is_judged_once = (
    test_deployments.test_a_sharded_nightly_deployment_run_on_two_gpu_workers_stores_each_document_once_and_is_judged_once)
test_a_shard_killed_under_its_worker_crashes_and_is_relaunched_with_only_its_unfinished_documents = (
    test_deployments.test_a_shard_killed_under_its_worker_crashes_and_is_relaunched_with_only_its_unfinished_documents)
test_two_runs_at_once_on_two_gpu_workers_both_finish_each_on_its_own_gpu = (
    test_deployments.test_two_runs_at_once_on_two_gpu_workers_both_finish_each_on_its_own_gpu)
