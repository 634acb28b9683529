"""Shard attempts as flow runs of a deployment (``nightly-shard/nightly-shard`` in prefect.yaml): a worker of its
pool picks each up, on whichever GPU is free.

Each attempt is one ``run_deployment(..., timeout=0)``: the flow run is created and the call returns at once,
the parent polls it. The flow run is named after the attempt's launch id and the launch id is its idempotency
key, so a launch repeated after a lost answer from the API creates no second run. It is linked to the parent
as a subflow: the parent's page lists its shards, and cancelling the parent cancels them. It carries no tags
(task runs inherit them, and each tag would cost every task run a concurrency check).

Its state is the attempt's status: Scheduled (Late and AwaitingConcurrencySlot included) -> queued, as no
worker has taken it yet; Completed -> completed; Failed -> failed; Crashed or Cancelled -> crashed (its
process died, or it was given up); anything else, Pending (a worker took it) and Cancelling included,
-> running.
"""

from __future__ import annotations

import time

from prefect import get_client
from prefect.client.schemas.objects import StateType
from prefect.deployments import run_deployment
from prefect.states import Cancelling

from flows.shard_launch import ShardLaunch, ShardStatus

STATUSES: dict[StateType, ShardStatus] = {
    StateType.SCHEDULED: "queued",
    StateType.COMPLETED: "completed",
    StateType.FAILED: "failed",
    StateType.CRASHED: "crashed",
    StateType.CANCELLED: "crashed",
}


class DeploymentShard:
    """One attempt's flow run on the server (a ``flows.shard_launch.ShardHandle``)."""

    def __init__(self, flow_run_id: str) -> None:
        self.flow_run_id = flow_run_id

    def status(self) -> ShardStatus:
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(self.flow_run_id).state
        return STATUSES.get(state.type, "running") if state is not None else "running"

    def cancel(self) -> None:
        """Ask the server to cancel the run: one not started yet becomes Cancelled at once, a running one
        Cancelling until its worker has stopped its process. A run already over is left as it is."""
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(self.flow_run_id).state
            if state is None or not state.is_final():
                client.set_flow_run_state(self.flow_run_id, Cancelling(message="given up by the parent run"))


class ShardDeployments:
    """Launches each shard attempt as a flow run of ``deployment`` ("flow name/deployment name"); a
    ``flows.shard_launch.ShardLauncher``."""

    def __init__(self, deployment: str) -> None:
        self.deployment = deployment

    def launch(self, launch: ShardLaunch) -> DeploymentShard:
        flow_run = run_deployment(self.deployment, parameters=launch.parameters(), timeout=0,
                                  flow_run_name=launch.launch_id, idempotency_key=launch.launch_id)
        return DeploymentShard(str(flow_run.id))

    def wait(self, timeout_s: float) -> None:
        """The whole ``timeout_s``: a run's end is seen only by asking the server, at the parent's poll."""
        time.sleep(timeout_s)
