"""The work pools, GPU concurrency limits and silent-run automation of a sidecar Prefect server, set up in one
process through Prefect's client: what infra/setup-pool.sh does (it runs this module; see it for the why of each
object). Safe to run again: it creates what is missing, sets every limit back to one slot and replaces the
automation with the file's version.

    python -m flows.pool_setup HOST:GPUS [HOST:GPUS ...]     (PREFECT_API_URL names the server)

One process, not one `prefect` command per object: each command imports Prefect afresh, seconds apiece on a busy
machine, some ten of them per deploy.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
POOLS = ("sidecar-control", "sidecar-gpu")
POOL_TYPE = "process"
SHARED_LIMIT = "gpu"  # the one runs started outside a pool worker hold
AUTOMATION_FILE = Path("infra/crash-silent-runs.yaml")  # relative to the checkout, as the scripts name it
SPEC = re.compile(r"[A-Za-z0-9._-]+:[0-9]+")


def limit_names(specs: list[str]) -> list[str]:
    """``gpu``, then gpu-HOST-0 .. gpu-HOST-(GPUS-1) for each HOST:GPUS; a spec of another form is refused."""
    names = [SHARED_LIMIT]
    for spec in specs:
        if not SPEC.fullmatch(spec):
            raise ValueError(f"expected HOST:GPUS (e.g. gpu-a:8), got '{spec}'")
        host, gpus = spec.rsplit(":", 1)
        names += [f"gpu-{host}-{i}" for i in range(int(gpus))]
    return names


def set_up(specs: list[str], automation_file: Path = REPO / AUTOMATION_FILE) -> list[str]:
    """Pools, limits and the automation on the server PREFECT_API_URL names; returns what was done, a line each."""
    from prefect import get_client
    from prefect.client.schemas.actions import (
        GlobalConcurrencyLimitCreate,
        GlobalConcurrencyLimitUpdate,
        WorkPoolCreate,
    )
    from prefect.events.schemas.automations import AutomationCore
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker

    limits = limit_names(specs)  # a bad spec is refused before the server is touched
    automation = AutomationCore.model_validate(yaml.safe_load(automation_file.read_text()))
    done = []
    with get_client(sync_client=True) as api:
        for pool in POOLS:
            try:
                api.read_work_pool(pool)
            except ObjectNotFound:
                # the template `prefect work-pool create --type process` gives a pool: the process worker's own
                api.create_work_pool(WorkPoolCreate(name=pool, type=POOL_TYPE,
                                                    base_job_template=ProcessWorker.get_default_base_job_template()))
                done.append(f"work pool {pool}: created")
        for name in limits:
            try:
                api.read_global_concurrency_limit_by_name(name)
            except ObjectNotFound:
                api.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
            else:
                api.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(limit=1))
            done.append(f"concurrency limit {name}: 1 slot")
        for old in api.read_automations_by_name(automation.name):
            api.delete_automation(old.id)
        api.create_automation(automation)
        done.append(f"automation {automation.name}: from {automation_file}")
    return done


def main(argv: list[str]) -> int:
    try:
        limit_names(argv)
    except ValueError as refused:
        print(f"setup-pool.sh: {refused}", file=sys.stderr)
        return 2
    for line in set_up(argv, REPO / AUTOMATION_FILE):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
