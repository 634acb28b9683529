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
import socket
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from flows.accelerator import holding_accelerator
from flows.nightly import run_window_task
from flows.nightly_params import NightlyParams
from flows.process_exit import exit_now
from pipeline import (
    FinishedDocument,
    PendingCommit,
    RunCounts,
    plan_windows,
    split_by_context,
    warm_run,
    window_size,
)
from sidecar.decoding.decoder import recorded_counters
from sidecar.models.loading import load_pair
from sidecar.tasks.engine import SidecarEngine
from storage import Document
from storage.parts import PartCapture, PartStore, PartWriter, ShardInfo
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
    docs = manifest.docs
    what = f"shard {shard} (attempt {attempt}, {launch_id}) of run {run_id}"
    # the parent's stall clock waits while the device is busy with another run, and starts once it is held
    store.write_device_state(run_id, launch_id, "waiting")
    with holding_accelerator(what, run.device_wait_s):
        store.write_device_state(run_id, launch_id, "held")
        get_run_logger().info("%s: loading the %s pair for %d documents", what, run.pair, len(docs))
        with counts.timed("input"):
            engine = SidecarEngine(load_pair(run.pair), gamma=run.gamma, max_batch=run.batch_size)
        pair = engine.pair
        # the run's nonce from the manifest, and the documents' texts, bind the parts to this start of the run
        # each part says how the attempt's forwards ran so far: the parent keeps its latest part's counters
        writer = store.writer(ShardInfo(run_id=run_id, launch_id=launch_id, shard=shard, attempt=attempt,
                                        host=socket.gethostname(), device=str(pair.device), gpu_type=pair.gpu_type,
                                        run_nonce=manifest.run_nonce), docs,
                              capture=lambda: PartCapture(pair.capture_report, recorded_counters(pair)))
        _run_shard(engine, run, writer, docs, counts)
    create_markdown_artifact(counts.markdown(), key="nightly-shard-summary", description=f"Nightly {what}")
    return counts


def _run_shard(engine: SidecarEngine, run: NightlyParams, writer: PartWriter, docs: list[Document],
               counts: RunCounts) -> None:
    """The windows of ``docs``, their finished documents written as parts; on failure the documents finished
    so far are written before the error goes on."""
    settings = run.settings()
    with counts.timed("input"):
        docs, over_context = split_by_context(engine, docs, settings)
    counts.documents = len(docs)
    counts.add_rejects(over_context)
    if over_context:
        writer.write([], over_context)
    warm_run(engine, docs, settings, run.batch_size, get_run_logger().info)  # compiles before the first window
    pending = PendingCommit(run.commit_every_s)

    def write() -> None:
        if pending.docs:
            counts.commits += 1
        with counts.timed("storage"):
            pending.write_part(writer)

    def finished(done: list[FinishedDocument]) -> None:
        counts.add_documents(done)
        pending.add(done)
        if pending.due():
            write()

    windows, _ = plan_windows(docs, window_size(run.batch_size, run.window), set())
    try:
        for window in windows:
            counts.add_window(run_window_task(engine, window, settings, run.batch_size, finished))
    finally:
        write()


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
