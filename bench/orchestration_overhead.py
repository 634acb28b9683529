"""What Prefect and DuckDB cost on top of the models: the nightly flow over 100 news articles, tiny pair.

    python -m bench.orchestration_overhead            # 100 articles, 128-token summaries, batch 8, 3 runs
    python -m bench.orchestration_overhead --full     # the same, 5 runs
    python -m bench.orchestration_overhead --quick    # 24 articles, 32-token summaries, 1 run

Goal: the flow takes at most 5% longer than a plain loop doing the same work. Both are timed whole, in the
same process, on the same documents: the nightly flow run (``flows.nightly``: reading and checking the
input, loading the pair, every window, Prefect's task runs and DuckDB's commits) against a plain loop that
reads the same corpus with ``storage.parquet.read_documents``, loads the same pair, makes the same context
check and runs the same windows through ``pipeline.run_window`` with no Prefect and no DuckDB. Whatever the
flow adds shows in the difference, also what no counter sees: the model running slower inside the flow
(Prefect's API server competing for the CPU, a thread more). Other processes slow runs, never speed them:
the fastest run of each side counts, and each repeat's own pair is shown too.

Beside it, where the flow's time went by its own counters (``RunCounts``): engine calls (model), DuckDB
(every call), input (reading and checking the input, loading the pair) and Prefect, the rest of the flow
call's wall time, split in two: inside the flow function (task runs, artifacts, logs, the concurrency slot)
and around it (creating the flow run and its final state). That rest is a residual: it explains the
difference, it is not the overhead.

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
from prefect import flow  # noqa: E402

from bench.common import (  # noqa: E402
    add_bench_arguments,
    apply_profile,
    environment,
    markdown_table,
    news_documents,
    parse_bench_args,
    pin_pair_dtype,
    variant_suffix,
    write_results,
)
from flows.embedded import embedded_prefect  # noqa: E402
from flows.nightly import NightlyParams, nightly  # noqa: E402
from pipeline import plan_windows, run_window, split_by_context, window_size  # noqa: E402
from sidecar import SidecarEngine, load_pair  # noqa: E402
from storage.parquet import read_documents  # noqa: E402

GOAL = 0.05
SIZES = {
    "quick": {"documents": 24, "max_new_tokens": 32, "repeats": 1},
    "standard": {"documents": 100, "max_new_tokens": 128, "repeats": 3},
    "full": {"documents": 100, "max_new_tokens": 128, "repeats": 5},
}


@flow(name="warm-up")
def warm_up() -> None:
    """Nothing: running it starts the embedded Prefect API."""


def plain_loop(params: NightlyParams) -> float:
    """Wall seconds of the flow's work without Prefect and DuckDB, timed whole as the flow is: the same input
    read and checked, the same pair loaded, the same windows run, every output dropped."""

    def drop(docs: list) -> None:
        pass

    started = time.perf_counter()
    docs, _ = read_documents(params.corpus, id_column=params.id_column, text_column=params.text_column,
                             title_column=params.title_column, max_chars=params.max_chars, limit=params.limit)
    engine = SidecarEngine(load_pair(params.pair), gamma=params.gamma)
    settings = params.settings()
    docs, _ = split_by_context(engine, docs, settings)
    windows, _ = plan_windows(docs, window_size(params.batch_size, params.window), set())
    for window in windows:
        run_window(engine, window.docs, settings, params.batch_size, drop)
    return time.perf_counter() - started


def flow_run(params: NightlyParams, plain_s: float | None) -> dict:
    """One nightly flow run, timed whole; its own counters say where the time went."""
    started = time.perf_counter()
    counts = nightly(**params.model_dump())
    flow_s = time.perf_counter() - started
    prefect_s = flow_s - counts.model_seconds - counts.storage_seconds - counts.input_seconds
    return {
        "documents": counts.done, "windows": counts.windows, "commits": counts.commits, "flow_s": flow_s,
        "plain_s": plain_s, "flow_vs_plain_pct": None if plain_s is None else 100 * (flow_s - plain_s) / plain_s,
        "model_s": counts.model_seconds, "input_s": counts.input_seconds, "duckdb_s": counts.storage_seconds,
        "prefect_s": prefect_s, "prefect_around_s": flow_s - counts.process_seconds,
        "residual_pct": 100 * (prefect_s + counts.storage_seconds) / counts.model_seconds,
        "per_window_ms": 1000 * (prefect_s + counts.storage_seconds) / counts.windows,
        "model_per_window_s": counts.model_seconds / counts.windows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int)
    parser.add_argument("--chars", type=int, default=1500)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--repeats", type=int, help="flow runs, each after a plain loop")
    add_bench_arguments(parser)
    args = parse_bench_args(parser)
    apply_profile(args, SIZES)

    # the flow runs and the plain loops all load the pair in the one dtype the result records
    device, dtype = pin_pair_dtype("tiny")
    work = BENCH_HOME / "work"
    work.mkdir()
    texts = news_documents(args.documents, args.chars)
    corpus = work / "news.parquet"
    pq.write_table(pa.table({"id": [f"news-{i:04d}" for i in range(len(texts))], "article": texts}), corpus)

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
            run = flow_run(run_params, plain_loop(run_params))
            assert run["documents"] == len(texts), f"only {run['documents']} of {len(texts)} documents done"
            print(f"repeat {repeat}: flow {run['flow_s']:.1f} s, plain loop {run['plain_s']:.1f} s", flush=True)
            runs.append(run)
    # Other processes on a shared machine slow a run down, never speed it up: the fastest of each side counts.
    flow_s, plain_s = min(r["flow_s"] for r in runs), min(r["plain_s"] for r in runs)
    overhead = (flow_s - plain_s) / plain_s
    fastest = min(runs, key=lambda r: r["flow_s"])

    env = environment(device, dtype)
    # other processes on the machine slow the model and Prefect's server alike; keep the load next to the numbers
    payload = {"environment": env | {"load_average_1_5_15": os.getloadavg()}, "args": vars(args),
               "goal_pct": 100 * GOAL, "flow_s": flow_s, "plain_s": plain_s, "flow_vs_plain_pct": 100 * overhead,
               "meets_goal": overhead <= GOAL, "startup_s": startup_s, "warm_up_run": first_run,
               "fastest_flow_run": fastest, "runs": runs}
    table = markdown_table(runs, [
        ("documents", "docs"), ("windows", "windows"), ("commits", "commits"), ("flow_s", "flow s (whole)"),
        ("plain_s", "plain loop s (whole)"), ("flow_vs_plain_pct", "flow vs plain loop %"),
        ("model_s", "model s"), ("input_s", "input s"), ("duckdb_s", "DuckDB s"), ("prefect_s", "Prefect s"),
        ("prefect_around_s", "of which flow start + finish s"),
        ("residual_pct", "(Prefect + DuckDB) ÷ model %"), ("per_window_ms", "Prefect + DuckDB ms/window"),
        ("model_per_window_s", "model s/window")])
    residual = fastest["prefect_s"] + fastest["duckdb_s"]
    markdown = (
        f"Nightly flow, tiny pair, {len(texts)} real news articles cut to {args.chars} chars, batch "
        f"{args.batch_size}, {args.max_new_tokens}-token summaries, modes sidecar + standalone, on {env['device']} "
        f"({env['cpus']} CPUs, load average {os.getloadavg()[0]:.1f} at the end), {args.repeats} run(s) of each "
        f"side. **The flow took {100 * abs(overhead):.1f}% {'longer' if overhead >= 0 else 'less time'} than a plain "
        f"loop doing the same work** (goal <= "
        f"{GOAL:.0%}: {'met' if overhead <= GOAL else 'not met'}): {flow_s:.2f} s against {plain_s:.2f} s, the "
        f"fastest of each side, both timed whole in the same process (reading and checking the input, loading "
        f"the pair, every window; the plain loop without Prefect and DuckDB). Median of the repeats' own "
        f"pairs: {statistics.median(r['flow_vs_plain_pct'] for r in runs):.1f}%. Where the fastest flow run's "
        f"time went by its own counters: {fastest['model_s']:.2f} s in the models, {fastest['input_s']:.2f} s "
        f"input, {fastest['duckdb_s']:.2f} s DuckDB ({fastest['commits']} commit(s) for {fastest['windows']} "
        f"windows) and {fastest['prefect_s']:.2f} s Prefect (the rest; {fastest['prefect_around_s']:.2f} s of it "
        f"the flow run's start and finish, flow run heartbeats off as on `sidecar nightly`'s embedded API). That "
        f"rest, Prefect + DuckDB = {fastest['residual_pct']:.1f}% of model time, is a residual: the model running "
        f"slower inside the flow does not show in it, the whole comparison does. Not counted: the embedded "
        f"Prefect API took {startup_s:.0f} s to start, once per process, and a warm-up nightly run over one batch "
        f"created the DuckDB file and called each API route once (its Prefect + DuckDB time: "
        f"{first_run['prefect_s'] + first_run['duckdb_s']:.2f} s). At {residual:.2f} s of Prefect + DuckDB per run, "
        f"that part alone stays within the goal for runs whose model time reaches {residual / GOAL:.0f} s.\n\n"
        f"{table}")
    write_results("orchestration_overhead" + variant_suffix(device.type, dtype, args.profile), payload, markdown)


if __name__ == "__main__":
    main()
