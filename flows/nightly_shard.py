"""The ``nightly-shard`` flow: one attempt of one shard of a sharded nightly run, writing part files.

The parent (``flows.nightly``) wrote the attempt's documents to a manifest under the results location and
alone writes the database; this flow reads the manifest, holds its accelerator (``flows.accelerator``; it says
in the results location while it waits for it, ``PartStore.write_device_state``), loads
the pair and runs the documents' windows as an in-process run does, writing its finished documents as part
files (``storage.parts``) at least every ``commit_every_s`` instead of committing them. A part is written
under a temporary name and renamed, so a killed attempt leaves only complete parts; whatever it finished
before is kept. Documents over the models' context become rejects in its first part. Each part carries who
wrote it: run, launch id, shard, attempt, host, device and GPU type; how its forwards ran so far: the capture
mode and counters (``storage.parts.PartCapture``); and what binds it to the run's start and inputs: the run
nonce of its manifest, and the SHA-256 of each document's text.

Its parameters are JSON only (``flows.shard_launch.ShardLaunch``), so a deployment's flow run can carry them;
locally it runs as ``python -m flows.nightly_shard --launch '<ShardLaunch as JSON>'`` (``flows.shard_processes``).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from flows.nightly_params import NightlyParams
from flows.process_exit import exit_now
from pipeline import RunCounts
from storage.parts import PartStore
from storage.run_keys import check_run_id


@flow(name="nightly-shard", flow_run_name="{launch_id}")
def nightly_shard(run_id: str, launch_id: str, shard: int, attempt: int, results_uri: str,
                  params: dict[str, Any]) -> RunCounts:
    """Run the documents of attempt ``launch_id`` of shard ``shard`` of run ``run_id``, writing parts under
    ``results_uri``; ``params`` are the run's :class:`NightlyParams` as JSON."""
    check_run_id(run_id)
    run = NightlyParams.model_validate(params)
    counts = RunCounts(run_id)
    store = PartStore(results_uri)
    with counts.timed("input"):
        manifest = store.read_manifest(run_id, launch_id)
    what = f"shard {shard} (attempt {attempt}, {launch_id}) of run {run_id}"
    # the parent's stall clock waits while the device is busy with another run, and starts once it is held
    store.write_device_state(run_id, launch_id, "waiting")
    # the engine (torch, transformers) loads here, not with this module: deploying the flow only reads it
    from flows.nightly_decode import run_shard

    run_shard(run, store, manifest, run_id, launch_id, shard, attempt, what, counts)
    create_markdown_artifact(counts.markdown(), key="nightly-shard-summary", description=f"Nightly {what}")
    return counts


def main(argv: list[str] | None = None) -> int:
    """``python -m flows.nightly_shard --launch JSON``: run one attempt; exit 0 once every document of its
    manifest is written, 1 when the flow run failed (run as a script, through ``flows.process_exit.exit_now``:
    Prefect's workers drained, no interpreter teardown)."""
    parser = argparse.ArgumentParser(prog="python -m flows.nightly_shard", description=main.__doc__)
    parser.add_argument("--launch", required=True, help="The attempt's ShardLaunch as a JSON object.")
    launch = json.loads(parser.parse_args(argv).launch)
    from flows.embedded import embedded_prefect

    with embedded_prefect():
        state = nightly_shard(**launch, return_state=True)
    return 0 if state.is_completed() else 1


if __name__ == "__main__":
    # the attempt is over once its flow run is: the parent waits for this process's exit, not its teardown
    exit_now(main())
