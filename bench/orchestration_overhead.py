"""What Prefect and DuckDB cost on top of the models: the nightly flow over 100 news articles, tiny pair.

    python -m bench.orchestration_overhead            # 100 articles, 128-token summaries, batch 8
    python -m bench.orchestration_overhead --quick    # 24 articles, 32-token summaries

Goal: Prefect + DuckDB time <= 5% of model time. Two measurements of one workload:

1. Inside the flow run (``RunCounts``): time in engine calls (model), in DuckDB (every call), reading and
   checking the input and loading the pair (input); Prefect's share is the rest of the flow call's wall
   time: the flow and task runs, artifacts and API calls, including about 1 s per flow run that Prefect
   3.9's heartbeat thread takes to stop.
2. Against a plain loop: the same batches through ``sidecar.pipeline.run_batch`` without Prefect or
   DuckDB, so that Prefect's API server competing for the CPU shows too.

The embedded Prefect API starts before the timing (a warm-up flow); its start-up time is reported apart.
The tiny pair makes model time as short as it gets; a real pair's batches take 10-100x longer while the
orchestration cost per batch stays the same.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

BENCH_HOME = Path(tempfile.mkdtemp(prefix="sidecar-bench-prefect-"))
# Before Prefect is imported: a throwaway Prefect home, no analytics, time for the embedded API to start.
os.environ["PREFECT_HOME"] = str(BENCH_HOME)
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.pop("PREFECT_API_URL", None)

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402
from prefect import flow  # noqa: E402

from bench.common import environment, markdown_table, news_documents, write_results  # noqa: E402
from flows.nightly import NightlyParams, nightly  # noqa: E402
from sidecar import SidecarEngine, load_pair  # noqa: E402
from sidecar.pipeline import plan_batches, run_batch  # noqa: E402
from storage import Document  # noqa: E402

GOAL = 0.05


@flow(name="warm-up")
def warm_up() -> None:
    """Nothing: running it starts the embedded Prefect API."""


def plain_loop(params: NightlyParams, docs: list[Document]) -> dict:
    """The flow's model work without Prefect and DuckDB: same pair, settings and batches."""
    engine = SidecarEngine(load_pair(params.pair), gamma=params.gamma)
    settings = params.settings()
    run_batch(engine, docs[:2], settings)  # first-call costs (allocator, kernels) out of the timing
    batches, _ = plan_batches(docs, params.batch_size, set())
    started = time.perf_counter()
    model = sum(run_batch(engine, batch.docs, settings).model_seconds for batch in batches)
    return {"wall_s": time.perf_counter() - started, "model_s": model}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, default=100)
    parser.add_argument("--chars", type=int, default=1500)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.documents, args.max_new_tokens = 24, 32

    work = BENCH_HOME / "work"
    work.mkdir()
    texts = news_documents(args.documents, args.chars)
    corpus = work / "news.parquet"
    pq.write_table(pa.table({"id": [f"news-{i:04d}" for i in range(len(texts))], "article": texts}), corpus)
    params = NightlyParams(corpus=str(corpus), pair="tiny", batch_size=args.batch_size,
                           max_new_tokens=args.max_new_tokens, db_path=str(work / "sidecar.duckdb"),
                           trigger_judge=False, trigger_cost_report=False)

    started = time.perf_counter()
    warm_up()
    startup_s = time.perf_counter() - started

    plain = plain_loop(params, [Document(f"news-{i:04d}", t, i) for i, t in enumerate(texts)])
    print(f"plain loop: {plain['wall_s']:.1f} s", flush=True)

    started = time.perf_counter()
    counts = nightly(params)
    flow_s = time.perf_counter() - started
    assert counts.done == len(texts), f"only {counts.done} of {len(texts)} documents done"

    prefect_s = flow_s - counts.model_seconds - counts.storage_seconds - counts.input_seconds
    overhead = (prefect_s + counts.storage_seconds) / counts.model_seconds
    versus_plain = (flow_s - counts.input_seconds - plain["wall_s"]) / plain["wall_s"]
    row = {
        "documents": counts.done, "batches": counts.batches, "batch_size": args.batch_size,
        "max_new_tokens": args.max_new_tokens, "flow_s": flow_s, "model_s": counts.model_seconds,
        "input_s": counts.input_seconds, "duckdb_s": counts.storage_seconds, "prefect_s": prefect_s,
        "overhead_pct": 100 * overhead, "plain_s": plain["wall_s"], "vs_plain_pct": 100 * versus_plain,
        "startup_s": startup_s,
    }
    env = environment(torch.device("cpu"), torch.float32)
    # other processes on the machine slow the model and Prefect's server alike; keep the load next to the numbers
    payload = {"environment": env | {"load_average_1_5_15": os.getloadavg()}, "args": vars(args),
               "goal_pct": 100 * GOAL, "result": row, "meets_goal": overhead <= GOAL}
    table = markdown_table([row], [
        ("documents", "docs"), ("batches", "batches"), ("flow_s", "flow s"), ("model_s", "model s"),
        ("input_s", "input s"), ("duckdb_s", "DuckDB s"), ("prefect_s", "Prefect s"),
        ("overhead_pct", "(Prefect + DuckDB) ÷ model %"), ("plain_s", "plain loop s"),
        ("vs_plain_pct", "flow − input vs plain loop %")])
    markdown = (
        f"Nightly flow, tiny pair, {counts.done} real news articles cut to {args.chars} chars, batch "
        f"{args.batch_size}, {args.max_new_tokens}-token summaries, modes sidecar + standalone, on {env['device']} "
        f"({env['cpus']} CPUs, load average {os.getloadavg()[0]:.1f} at the end). "
        f"Goal: Prefect + DuckDB <= {GOAL:.0%} of model time: "
        f"{'met' if overhead <= GOAL else 'not met'} ({100 * overhead:.1f}%). Input (Parquet, tokenizing for the "
        f"context check, loading the pair) is counted apart; the embedded Prefect API took {startup_s:.0f} s to "
        f"start, once per process, not counted.\n\n{table}")
    name = "orchestration_overhead" + ("_quick" if args.quick else "")
    write_results(name, payload, markdown)


if __name__ == "__main__":
    main()
