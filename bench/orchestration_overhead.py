"""What Prefect and DuckDB cost on top of the models: the nightly flow over 100 news articles, tiny pair.

    python -m bench.orchestration_overhead            # 100 articles, 128-token summaries, batch 8, 3 runs
    python -m bench.orchestration_overhead --full     # the same, 5 runs
    python -m bench.orchestration_overhead --quick    # 24 articles, 32-token summaries, 1 run

Goal: Prefect + DuckDB time <= 5% of model time. Two measurements of one workload:

1. Inside the flow run (``RunCounts``): time in engine calls (model), in DuckDB (every call), reading and
   checking the input and loading the pair (input); Prefect's share is the rest of the flow call's wall
   time, split in two: inside the flow function (task runs, artifacts, logs, the concurrency slot) and
   around it (creating the flow run and its final state).
2. Against a plain loop: the same windows through ``pipeline.run_window`` without Prefect or
   DuckDB, so that Prefect's API server competing for the CPU shows too.

Flows run as ``sidecar nightly`` runs them, inside ``flows.embedded.embedded_prefect``: on the embedded
API, flow run heartbeats are off (stopping Prefect 3.9's heartbeat thread waits for its 1 s sleep, 0-1 s
per flow run; a run against a server with heartbeats on pays that on top). Before the timing, an empty
flow starts the embedded Prefect API and a warm-up nightly run over one batch creates the DuckDB file and
calls every API route the flow uses once, as a long-lived server and an existing results file have them
on every night but the first; both are reported apart (start-up seconds, and the warm-up run's own
Prefect + DuckDB seconds).
The tiny pair makes model time as short as it gets; a real pair's windows take 10-100x longer while the
orchestration cost per window stays the same.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from bench.prefect_home import throwaway_prefect_home

BENCH_HOME = throwaway_prefect_home("sidecar-bench-prefect-")

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402
from prefect import flow  # noqa: E402

from bench.common import (  # noqa: E402
    add_profile_arguments,
    apply_profile,
    environment,
    markdown_table,
    news_documents,
    profile_suffix,
    write_results,
)
from flows.embedded import embedded_prefect  # noqa: E402
from flows.nightly import NightlyParams, nightly  # noqa: E402
from pipeline import plan_windows, run_window, window_size  # noqa: E402
from sidecar import SidecarEngine, load_pair  # noqa: E402
from storage import Document  # noqa: E402

GOAL = 0.05
SIZES = {
    "quick": {"documents": 24, "max_new_tokens": 32, "repeats": 1},
    "standard": {"documents": 100, "max_new_tokens": 128, "repeats": 3},
    "full": {"documents": 100, "max_new_tokens": 128, "repeats": 5},
}


@flow(name="warm-up")
def warm_up() -> None:
    """Nothing: running it starts the embedded Prefect API."""


def plain_loop(params: NightlyParams, docs: list[Document]) -> float:
    """Wall seconds of the flow's model work without Prefect and DuckDB: same pair, settings and windows."""
    engine = SidecarEngine(load_pair(params.pair), gamma=params.gamma)
    settings = params.settings()

    def drop(docs: list) -> None:
        pass

    # first-call costs (allocator, kernels) out of the timing
    run_window(engine, docs[:2], settings, params.batch_size, drop)
    windows, _ = plan_windows(docs, window_size(params.batch_size, params.window), set())
    started = time.perf_counter()
    for window in windows:
        run_window(engine, window.docs, settings, params.batch_size, drop)
    return time.perf_counter() - started


def flow_run(params: NightlyParams, plain_s: float | None) -> dict:
    started = time.perf_counter()
    counts = nightly(params)
    flow_s = time.perf_counter() - started
    prefect_s = flow_s - counts.model_seconds - counts.storage_seconds - counts.input_seconds
    return {
        "documents": counts.done, "windows": counts.windows, "commits": counts.commits, "flow_s": flow_s,
        "model_s": counts.model_seconds, "input_s": counts.input_seconds, "duckdb_s": counts.storage_seconds,
        "prefect_s": prefect_s, "prefect_around_s": flow_s - counts.process_seconds,
        "overhead_pct": 100 * (prefect_s + counts.storage_seconds) / counts.model_seconds,
        "per_window_ms": 1000 * (prefect_s + counts.storage_seconds) / counts.windows,
        "model_per_window_s": counts.model_seconds / counts.windows, "plain_s": plain_s,
        "vs_plain_pct": None if plain_s is None else 100 * (flow_s - counts.input_seconds - plain_s) / plain_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int)
    parser.add_argument("--chars", type=int, default=1500)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--repeats", type=int, help="flow runs, each after a plain loop")
    add_profile_arguments(parser)
    args = parser.parse_args()
    apply_profile(args, SIZES)

    work = BENCH_HOME / "work"
    work.mkdir()
    texts = news_documents(args.documents, args.chars)
    corpus = work / "news.parquet"
    pq.write_table(pa.table({"id": [f"news-{i:04d}" for i in range(len(texts))], "article": texts}), corpus)
    docs = [Document(f"news-{i:04d}", t, i) for i, t in enumerate(texts)]

    def params(run_id: str, limit: int | None = None) -> NightlyParams:
        return NightlyParams(corpus=str(corpus), pair="tiny", batch_size=args.batch_size, limit=limit,
                             max_new_tokens=args.max_new_tokens, db_path=str(work / "sidecar.duckdb"),
                             run_id=run_id, trigger_judge=False, trigger_cost_report=False)

    with embedded_prefect():
        started = time.perf_counter()
        warm_up()
        startup_s = time.perf_counter() - started
        first_run = flow_run(params("bench-warm-up", limit=args.batch_size), plain_s=None)

        runs = []
        for repeat in range(args.repeats):
            run_params = params(f"bench-{repeat}")
            # alternating, so that load from other processes falls on both sides alike
            run = flow_run(run_params, plain_loop(run_params, docs))
            assert run["documents"] == len(texts), f"only {run['documents']} of {len(texts)} documents done"
            print(f"repeat {repeat}: {run['overhead_pct']:.1f}% of model time", flush=True)
            runs.append(run)
    # Other processes on a shared machine slow the model far more than the orchestration, which flatters the
    # ratio; the run with the shortest model time was disturbed least and is the one that counts.
    best = min(runs, key=lambda r: r["model_s"])
    overhead = best["overhead_pct"] / 100

    env = environment(torch.device("cpu"), torch.float32)
    # other processes on the machine slow the model and Prefect's server alike; keep the load next to the numbers
    payload = {"environment": env | {"load_average_1_5_15": os.getloadavg()}, "args": vars(args),
               "goal_pct": 100 * GOAL, "startup_s": startup_s, "warm_up_run": first_run,
               "least_disturbed": best, "runs": runs,
               "meets_goal": overhead <= GOAL}
    table = markdown_table(runs, [
        ("documents", "docs"), ("windows", "windows"), ("commits", "commits"), ("flow_s", "flow s"),
        ("model_s", "model s"), ("input_s", "input s"), ("duckdb_s", "DuckDB s"), ("prefect_s", "Prefect s"),
        ("prefect_around_s", "of which flow start + finish s"),
        ("overhead_pct", "(Prefect + DuckDB) ÷ model %"), ("per_window_ms", "Prefect + DuckDB ms/window"),
        ("model_per_window_s", "model s/window"), ("plain_s", "plain loop s"),
        ("vs_plain_pct", "flow − input vs plain loop %")])
    markdown = (
        f"Nightly flow, tiny pair, {len(texts)} real news articles cut to {args.chars} chars, batch "
        f"{args.batch_size}, {args.max_new_tokens}-token summaries, modes sidecar + standalone, on {env['device']} "
        f"({env['cpus']} CPUs, load average {os.getloadavg()[0]:.1f} at the end), {args.repeats} run(s). "
        f"Goal: Prefect + DuckDB <= {GOAL:.0%} of model time: {'met' if overhead <= GOAL else 'not met'} "
        f"({100 * overhead:.1f}% in the run with the shortest model time, the least disturbed by other "
        f"processes). Input (Parquet, tokenizing for the context check, loading the pair) is counted apart; the "
        f"embedded Prefect API took {startup_s:.0f} s to start, once per process, and a warm-up nightly run over "
        f"one batch (not counted) created the DuckDB file and called each API route once: its Prefect + "
        f"DuckDB time was {first_run['prefect_s'] + first_run['duckdb_s']:.2f} s. Median over the "
        f"runs: {statistics.median(r['overhead_pct'] for r in runs):.1f}%. Of the counted run's "
        f"{best['prefect_s'] + best['duckdb_s']:.2f} s, {best['prefect_around_s']:.2f} s are the flow run's start "
        f"and finish (flow run heartbeats off, as on `sidecar nightly`'s embedded API), and "
        f"{best['duckdb_s']:.2f} s are DuckDB ({best['commits']} commit(s) for {best['windows']} windows). The goal "
        f"holds for runs whose model time reaches {(best['prefect_s'] + best['duckdb_s']) / GOAL:.0f} s or "
        f"more.\n\n{table}")
    write_results("orchestration_overhead" + profile_suffix(args.profile), payload, markdown)


if __name__ == "__main__":
    main()
