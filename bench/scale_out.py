"""Sharded nightly runs on this machine, tiny pair: real parallelism of shard processes, and what sharding costs.

    python -m bench.scale_out            # 200 documents on 2 workers vs 1; a 3-shard run over 300; 64 tokens
    python -m bench.scale_out --full     # the same sizes, 3 repeats of the parallelism pair
    python -m bench.scale_out --quick    # 24 documents, 16 tokens; the overhead of the 1-worker run, no warm-up

Every run is a sharded ``nightly`` run (``flows.nightly``: the parent ingests the part files its
``nightly-shard`` processes write) with its own run id and DuckDB file, judge and cost report off, modes
sidecar + standalone.

1. Real parallelism (goal >= 1.7x): the same documents cut into 2 shards, run by 2 shard processes at once
   with one torch thread each, against the same 2 shards run one after the other by 1 shard process with one
   thread (``workers=1, shards=2``: a single worker is the in-process path only with a single shard, so the
   sharded single worker runs the same shards and pays the same start-ups). Ratio: the one-worker wall time
   over the two-worker one.
2. Overhead (goal <= 5%): 3 shards run one after the other by one process with one thread
   (``workers=1, shards=3``), so that every second of the parent's wall time is one thing. Model time is what
   the shards' own ``RunCounts`` say (their ``nightly-shard-summary`` artifacts, 0.1 s each). The overhead is
   all the rest of the wall time, counted whole: each shard's process start (from the parent's launch record
   to the shard's flow run being created on the API: the interpreter, importing torch, transformers and
   Prefect), input and model load (the parent reading the corpus and counting tokens; each shard reading its
   manifest, loading the pair, checking the context), Prefect in the shards (the flow run's creation until it
   runs, task runs, logs, artifacts), writing part files, the parent's DuckDB (the run's rows and the ingest of
   every part) and the parent's remainder (polls between attempts, the shards' exits, manifests, attempt rows,
   its own flow run). Each part is shown beside it, and so is what is left once the per-shard start-up and
   model load are taken out: a longer run spreads those over more model time, a shard pays them every time.
   Shards running at once overlap these costs with each other's model time; what parallel shards lose to
   waiting for each other shows in measurement 1. ``--quick`` takes this breakdown from its one-worker run
   instead of a run of its own (``--overhead-documents 0``).

Runs happen on the embedded Prefect API, as ``sidecar nightly --workers N`` runs them; it is started before
the timing by an empty flow. Without ``--quick`` a warm-up sharded run over a few documents (not counted)
starts shard processes once, so the first measured configuration does not pay for a cold file cache alone.
The documents are the first real news articles (data/news.parquet, ``make corpus``) when that file exists,
else short synthetic reports (the result says which).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from bench.prefect_home import throwaway_prefect_home

BENCH_HOME = throwaway_prefect_home("sidecar-bench-scale-out-")

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from prefect import flow, get_client  # noqa: E402
from prefect.client.schemas.filters import (  # noqa: E402
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    ArtifactFilterKey,
    FlowRunFilter,
    FlowRunFilterName,
)

import flows.shard_processes  # noqa: E402
from bench.common import (  # noqa: E402
    NEWS,
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
from storage import Database  # noqa: E402

PARALLEL_GOAL = 1.7
OVERHEAD_GOAL = 0.05
MODES = ["sidecar", "standalone"]
SIZES = {
    "quick": {"documents": 24, "overhead_documents": 0, "max_new_tokens": 16, "repeats": 1, "warm_up": False},
    "standard": {"documents": 200, "overhead_documents": 300, "max_new_tokens": 64, "repeats": 1, "warm_up": True},
    "full": {"documents": 200, "overhead_documents": 300, "max_new_tokens": 64, "repeats": 3, "warm_up": True},
}
SENTENCES = (
    "The city council approved a new budget on Tuesday after a long debate about schools and roads.",
    "Officials said the plan would add jobs at the plant in the north of the state.",
    "The president met leaders in Berlin, Moscow, Beijing and Doha to discuss prices.",
)
# what a shard's summary artifact says of its time (pipeline.counts.RunCounts.markdown); "DuckDB" there is the
# shard's part files
SHARD_TIMES = re.compile(r"([\d.]+) s in the models, ([\d.]+) s in DuckDB, ([\d.]+) s reading the input")


@flow(name="warm-up")
def warm_up() -> None:
    """Nothing: running it starts the embedded Prefect API."""


def write_corpus(path: Path, count: int, chars: int) -> str:
    """The corpus of every run: real news articles if ``make corpus`` built them, else synthetic reports."""
    if NEWS.exists():
        texts, source = news_documents(count, chars), "news"
    else:
        texts = [f"{SENTENCES[i % 3]} Report number {i}. " + " ".join(SENTENCES[(i + j) % 3] for j in range(i % 7))
                 for i in range(count)]
        source = "synthetic"
    if len(texts) < count:
        raise SystemExit(f"the corpus has {len(texts)} documents, {count} wanted")
    pq.write_table(pa.table({"id": [f"doc-{i:04d}" for i in range(count)], "article": texts}), path)
    return source


@contextlib.contextmanager
def threads_per_worker(threads: int, workers: int) -> Iterator[None]:
    """Shard processes get ``threads`` torch threads each, whatever this machine's cores, by telling the
    launcher that it has ``threads * workers`` cores (``flows.shard_processes``)."""
    cores = flows.shard_processes.usable_cores
    flows.shard_processes.usable_cores = lambda: threads * workers
    try:
        yield
    finally:
        flows.shard_processes.usable_cores = cores


def stored_once(db: Database, run_id: str) -> dict:
    """Whether every usable document of the run has exactly one output per mode."""
    docs = [r["doc_id"] for r in db.query("SELECT doc_id FROM documents WHERE run_id = ? AND status = 'ok'",
                                          [run_id])]
    stored = Counter((r["doc_id"], r["mode"]) for r in db.query("SELECT doc_id, mode FROM outputs WHERE run_id = ?",
                                                                [run_id]))
    expected = {(d, m) for d in docs for m in MODES}
    return {"usable_documents": len(docs), "outputs": sum(stored.values()),
            "every_doc_mode_once": set(stored) == expected and all(n == 1 for n in stored.values())}


def shard_times(attempts: list[dict]) -> list[dict]:
    """Per attempt: its flow run's span on the API and what its own counts say (its summary artifact)."""
    launch_ids = [a["launch_id"] for a in attempts]
    with get_client(sync_client=True) as client:
        runs = {r.name: r for r in client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=launch_ids)))}
        missing = set(launch_ids) - set(runs)
        if missing:
            raise AssertionError(f"no flow run on the API for attempts {sorted(missing)}")
        artifacts = {a.flow_run_id: a for a in client.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=["nightly-shard-summary"]),
            flow_run_id=ArtifactFilterFlowRunId(any_=[r.id for r in runs.values()])))}
    shards = []
    for attempt in attempts:
        run = runs[attempt["launch_id"]]
        artifact = artifacts.get(run.id)
        found = SHARD_TIMES.search(str(artifact.data)) if artifact is not None else None
        if found is None:
            raise AssertionError(f"attempt {attempt['launch_id']} left no summary with its times")
        model_s, parts_s, input_s = map(float, found.groups())
        shards.append({
            "launch_id": attempt["launch_id"], "shard": attempt["shard"], "docs": attempt["docs"],
            "status": attempt["status"], "model_s": model_s, "part_files_s": parts_s, "input_s": input_s,
            "flow_s": (run.end_time - run.start_time).total_seconds(),
            "process_start_s": (run.created - attempt["started_at"]).total_seconds(),
            "flow_start_s": (run.start_time - run.created).total_seconds(),
            # the process's exit after its flow run, the parent's poll and its last ingest of the attempt's parts
            "exit_s": (attempt["finished_at"] - run.end_time).total_seconds()})
    return shards


def sharded_run(work: Path, corpus: Path, name: str, documents: int, workers: int, shards: int,
                threads: int, max_new_tokens: int) -> dict:
    """One sharded nightly run in a database of its own: wall time, the parent's and the shards' counts."""
    db_path = work / name / "sidecar.duckdb"
    params = NightlyParams(corpus=str(corpus), pair="tiny", limit=documents, max_new_tokens=max_new_tokens,
                           modes=MODES, db_path=str(db_path), run_id=f"bench-{name}", workers=workers,
                           shards=shards, trigger_judge=False, trigger_cost_report=False)
    with threads_per_worker(threads, workers):
        started = time.perf_counter()
        counts = nightly(**params.model_dump())
        wall_s = time.perf_counter() - started
    db = Database(db_path)
    [run] = db.query("SELECT status FROM runs WHERE run_id = ?", [params.run_id])
    attempts = db.shard_attempts(params.run_id)
    per_shard = shard_times(attempts)
    model_s = sum(s["model_s"] for s in per_shard)
    return {
        "name": name, "documents": documents, "workers": workers, "shards": shards,
        "threads_per_worker": threads,
        "status": run["status"], "attempts": len(attempts), "parts": counts.parts, "done": counts.done,
        **stored_once(db, params.run_id), "wall_s": wall_s, "docs_per_s": documents / wall_s,
        "model_s": model_s, "shard_input_s": sum(s["input_s"] for s in per_shard),
        "part_files_s": sum(s["part_files_s"] for s in per_shard),
        "shard_prefect_s": sum(s["flow_start_s"] + s["flow_s"] - s["model_s"] - s["input_s"] - s["part_files_s"]
                               for s in per_shard),
        "process_start_s": sum(s["process_start_s"] for s in per_shard),
        "shard_exit_s": sum(s["exit_s"] for s in per_shard),
        "parent_input_s": counts.input_seconds, "parent_duckdb_s": counts.storage_seconds,
        "per_shard": per_shard,
    }


def overhead(run: dict) -> dict:
    """A serial run's wall time cut into model time and the overhead, counted whole: start-up and model load
    (process start, input) and the rest; the parts add up to the wall time."""
    input_s = run["parent_input_s"] + run["shard_input_s"]
    startup_s = input_s + run["process_start_s"]
    overhead_s = run["wall_s"] - run["model_s"]
    after_startup_s = overhead_s - startup_s
    parent_rest_s = after_startup_s - run["shard_prefect_s"] - run["part_files_s"] - run["parent_duckdb_s"]
    return {"documents": run["documents"], "shards": run["shards"], "wall_s": run["wall_s"],
            "model_s": run["model_s"], "input_s": input_s, "process_start_s": run["process_start_s"],
            "shard_prefect_s": run["shard_prefect_s"], "part_files_s": run["part_files_s"],
            "parent_duckdb_s": run["parent_duckdb_s"], "parent_rest_s": parent_rest_s,
            "shard_exit_s": run["shard_exit_s"], "overhead_s": overhead_s,
            "overhead_pct": 100 * overhead_s / run["model_s"],
            "startup_pct": 100 * startup_s / run["model_s"],
            "after_startup_pct": 100 * after_startup_s / run["model_s"],
            "startup_per_shard_s": startup_s / run["shards"]}


def check(run: dict) -> None:
    if run["status"] != "completed" or not run["every_doc_mode_once"] or run["usable_documents"] != run["documents"]:
        raise AssertionError(f"run {run['name']} did not store every document once per mode: "
                             f"{ {k: v for k, v in run.items() if k != 'per_shard'} }")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, help="documents of the parallelism pair of runs")
    parser.add_argument("--overhead-documents", type=int, help="documents of the 3-shard overhead run")
    parser.add_argument("--chars", type=int, default=1500, help="news articles are cut to this many characters")
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--repeats", type=int, help="parallelism pairs (the least disturbed of each side counts)")
    parser.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=None,
                        help="a sharded run over a few documents first, not counted")
    add_bench_arguments(parser)
    args = parse_bench_args(parser, argv)
    apply_profile(args, SIZES)

    # every shard loads the pair in the one dtype the result records
    device, dtype = pin_pair_dtype("tiny")
    work = BENCH_HOME / "work"
    work.mkdir(exist_ok=True)
    corpus = work / "corpus.parquet"
    source = write_corpus(corpus, max(args.documents, args.overhead_documents), args.chars)

    def run(name: str, documents: int, workers: int, shards: int) -> dict:
        # one torch thread per shard process: the tiny pair's forwards are a few small matmuls, which a second
        # thread does not speed up, and which two threads on a busy machine slow down many times
        result = sharded_run(work, corpus, name, documents, workers, shards, 1, args.max_new_tokens)
        check(result)
        print(f"{name}: {result['wall_s']:.1f} s, {result['model_s']:.1f} s in the models", flush=True)
        return result

    with embedded_prefect():
        started = time.perf_counter()
        warm_up()
        startup_s = time.perf_counter() - started
        if args.warm_up:
            run("warm-up", 4, 2, 2)
        one, two = [], []
        for repeat in range(args.repeats):
            # alternating, so that load from other processes falls on both sides alike
            one.append(run(f"one-worker-{repeat}", args.documents, 1, 2))
            two.append(run(f"two-workers-{repeat}", args.documents, 2, 2))
        serial = run("three-shards", args.overhead_documents, 1, 3) if args.overhead_documents else None

    # other processes slow a run down, never speed it up: the fastest run of each side was disturbed least
    best_one, best_two = min(one, key=lambda r: r["wall_s"]), min(two, key=lambda r: r["wall_s"])
    serial = serial or best_one
    speedup = best_one["wall_s"] / best_two["wall_s"]
    cost = overhead(serial)
    env = environment(device, dtype)
    command = "python -m bench.scale_out" + {"quick": " --quick", "full": " --full"}.get(args.profile, "")
    payload = {
        "environment": env | {"load_average_1_5_15": os.getloadavg()}, "command": command, "args": vars(args),
        "corpus": source, "startup_s": startup_s,
        "parallelism": {"goal": PARALLEL_GOAL, "speedup": speedup, "meets_goal": speedup >= PARALLEL_GOAL,
                        "one_worker": one, "two_workers": two},
        "overhead": {"goal_pct": 100 * OVERHEAD_GOAL, **cost,
                     "meets_goal": cost["overhead_pct"] <= 100 * OVERHEAD_GOAL, "run": serial},
    }
    write_results("scale_out" + variant_suffix(device.type, dtype, args.profile), payload, markdown(payload))
    return payload


def markdown(payload: dict) -> str:
    args, par, cost = payload["args"], payload["parallelism"], payload["overhead"]
    corpus = (f"real news articles cut to {args['chars']} chars" if payload["corpus"] == "news"
              else "short synthetic reports (data/news.parquet absent)")
    rows = [{**r, "config": f"{r['workers']} worker(s) x {r['threads_per_worker']} thread, {r['shards']} shards"}
            for r in par["one_worker"] + par["two_workers"]]
    speed = markdown_table(rows, [
        ("config", "configuration"), ("documents", "docs"), ("wall_s", "wall s"), ("docs_per_s", "docs/s"),
        ("model_s", "model s (sum of shards)"), ("process_start_s", "process start s (sum of shards)"),
        ("parts", "parts")])
    cost_table = markdown_table([cost], [
        ("documents", "docs"), ("shards", "shards"), ("wall_s", "wall s"), ("model_s", "model s"),
        ("overhead_pct", "overhead ÷ model %"), ("process_start_s", "process start s"),
        ("input_s", "input + model load s"), ("startup_pct", "of which start-up + model load ÷ model %"),
        ("shard_prefect_s", "Prefect in shards s"), ("part_files_s", "part files s"),
        ("parent_duckdb_s", "parent DuckDB + ingest s"), ("parent_rest_s", "parent rest s"),
        ("shard_exit_s", "shard exits s (in the two before)"),
        ("after_startup_pct", "overhead after start-up ÷ model %")])
    own_run = ("a run of its own" if cost["run"]["name"] == "three-shards"
               else "the one-worker run above (`--overhead-documents 0`)")
    env = payload["environment"]
    return (
        f"Sharded nightly runs, tiny pair, {corpus}, {args['max_new_tokens']}-token summaries, batch 8, modes "
        f"sidecar + standalone, on {env['device']} ({env['cpus']} CPUs, load average "
        f"{env['load_average_1_5_15'][0]:.1f} at the end); each run its own database, judge and cost report off, "
        f"one torch thread per shard process (`{payload['command']}`).\n\n"
        f"**Real parallelism**: {args['documents']} documents in 2 shards, run by 2 shard processes at once "
        f"against the same 2 shards one after the other by 1 process. Speed-up {par['speedup']:.2f}x (goal >= "
        f"{par['goal']}x: {'met' if par['meets_goal'] else 'not met'}; the fastest of {args['repeats']} run(s) "
        f"of each side).\n\n{speed}\n\n"
        f"**Overhead**: {cost['documents']} documents in {cost['shards']} shards run one after the other "
        f"({own_run}), so that the parent's wall time adds up. Everything but the models came to "
        f"{cost['overhead_pct']:.1f}% of model time (goal <= {cost['goal_pct']:.0f}%: "
        f"{'met' if cost['meets_goal'] else 'not met'}), shard start-up and model load counted: "
        f"{cost['startup_pct']:.1f}% of model time ({cost['startup_per_shard_s']:.1f} s per shard) went to process "
        f"start (from the parent's launch record to the shard's flow run on the API: the interpreter, importing "
        f"torch, transformers and Prefect) and input (the parent reading the corpus and counting tokens; each "
        f"shard reading its manifest, loading the pair, checking the context). The rest, "
        f"{cost['after_startup_pct']:.1f}%, is Prefect in the shards (flow run start, task runs, logs, "
        f"artifacts), writing part files, the parent's DuckDB (run rows, ingest) and the parent's rest (polls "
        f"between attempts, shard exits, manifests, attempt rows, its own flow run); of these two, the shards' "
        f"exits (from a flow run's end until the parent records the attempt ended: the process's exit, the "
        f"parent's poll, its last ingest of the attempt's parts) are shown apart too. Model time is the shards' "
        f"own count (their summaries, 0.1 s each). The embedded Prefect API took {payload['startup_s']:.0f} s to "
        f"start, once, not counted.\n\n{cost_table}")


if __name__ == "__main__":
    main()
