"""The parent's ingest of part files into DuckDB (``Database.ingest_parts``), on synthetic parts.

    python -m bench.ingest            # 1,000,000 documents x 2 modes; writes bench/results/ingest_cpu.json and .md
    python -m bench.ingest --quick    # 2,000 documents, a few seconds

Each document gets a ``sidecar`` and a ``standalone`` output of realistic size: a summary of about 300
characters, five hashtags and the tagger's text, and the stats a run records (the sidecar mode's main and
sidecar phases, the standalone tagger's one); the last document of each part is an ``oom`` reject instead. The
parts are spread over 8 shards' attempts with ``--docs-per-part`` documents each (a shard writes one part
per ``commit_every_s``). Timed: the first ingest of every part, and the rerun that finds all of them
ingested (what a parent pays each time it looks, and after a restart). Goal for 1M documents: <= 60 s.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import shutil
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from bench.common import (
    add_bench_arguments,
    apply_profile,
    environment,
    markdown_table,
    parse_bench_args,
    profile_suffix,
    write_results,
)
from storage import (
    Database,
    Document,
    OutputRecord,
    PartStore,
    RejectedDocument,
    RequestStats,
    ShardInfo,
    SidecarRecord,
)
from storage.database import INGEST_CHUNK_PARTS
from storage.parts import part_table, text_sha256, write_atomically

RUN = "bench-ingest"
SHARDS = 8
GOAL_S = 60.0
SIZES = {"quick": {"docs": 2_000, "docs_per_part": 250}, "standard": {"docs": 1_000_000, "docs_per_part": 500},
         "full": {"docs": 1_000_000, "docs_per_part": 500}}
WORDS = ("the", "council", "said", "on", "tuesday", "that", "a", "new", "plan", "for", "city", "would", "cut",
         "costs", "and", "add", "homes", "near", "river", "while", "critics", "warned", "of", "delays", "higher",
         "taxes", "traffic", "in", "old", "town", "where", "shops", "have", "closed")


def _summary(rng: random.Random) -> str:
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < 300:
        words.append(rng.choice(WORDS))
    return " ".join(words).capitalize() + "."


def template_part(docs: int, seed: int = 0) -> pa.Table:
    """One part's rows for ``docs`` documents, made by the shards' own writer code (``part_table``); the
    copies written differ in their document ids and writers."""
    rng = random.Random(seed)
    records: list[OutputRecord] = []
    rejects: list[RejectedDocument] = []
    for i in range(docs):
        doc_id = f"t{i:06d}"
        if i == docs - 1:
            rejects.append(RejectedDocument(doc_id, "oom", i, detail="CUDA out of memory. Tried to allocate 2.00 GiB",
                                            title=f"Title {i}", text=_summary(rng)))
            continue
        summary = _summary(rng)
        tags = [f"#{rng.choice(WORDS)}{rng.randrange(100)}" for _ in range(5)]
        main = RequestStats("main", new_tokens=rng.randrange(60, 128), drafted=rng.randrange(100, 200),
                            accepted=rng.randrange(50, 100), target_forwards=rng.randrange(20, 40),
                            draft_forwards=rng.randrange(80, 160), prompt_tokens=rng.randrange(300, 900),
                            prefill_s=0.05, decode_s=rng.uniform(1, 3), wall_s=rng.uniform(1, 3), batch_size=32,
                            ended_s=rng.uniform(1, 60))
        tagging = RequestStats("sidecar", new_tokens=rng.randrange(10, 30), draft_forwards=20,
                               prompt_tokens=rng.randrange(20, 60), prefill_s=0.01, decode_s=0.2, wall_s=0.21,
                               kv_bytes=rng.randrange(1_000_000, 9_000_000), batch_size=32,
                               ended_s=rng.uniform(1, 60))
        sidecars = [SidecarRecord.of("hashtags", " ".join(tags), tags, finish_reason="eos",
                                     new_tokens=tagging.new_tokens)]
        common = dict(doc_id=doc_id, summary=summary, sidecars=sidecars, finish_reason="eos", batch_id=i // 64)
        records.append(OutputRecord(mode="sidecar", main_tokens=main.new_tokens, stats=[main, tagging], **common))
        records.append(OutputRecord(mode="standalone", stats=[tagging], **common))
    info = ShardInfo(RUN, "s0000-a01-template", 0, 1, "bench-host", "cuda:0", "NVIDIA H100 80GB HBM3", "template")
    return part_table(info, records, rejects, {r.doc_id: "" for r in records})


def _text(doc_id: str) -> str:
    return f"The text of {doc_id}."


def write_parts(store: PartStore, docs: int, docs_per_part: int, nonce: str) -> tuple[int, int, list[Document]]:
    """Copies of one template part with ``docs`` document ids in all, over :data:`SHARDS` launches, of the run
    start ``nonce``; returns (parts written, bytes of part files, the documents their outputs are of)."""
    template = template_part(min(docs, docs_per_part))
    names = template.schema.names
    local_ids = [int(d[1:]) for d in template.column("doc_id").to_pylist()]
    parts = 0
    usable: list[Document] = []
    for first in range(0, docs, docs_per_part):
        count = min(docs_per_part, docs - first)
        table = template.filter(pa.array([i < count for i in local_ids])) if count < len(local_ids) else template
        shard = parts % SHARDS
        launch_id = f"s{shard:04d}-a01-bench{shard:03d}"
        ids = [f"doc-{first + int(d[1:]):07d}" for d in table.column("doc_id").to_pylist()]
        outputs = [kind == "output" for kind in table.column("kind").to_pylist()]
        # a document's input row is its number, as a reject's row_index is
        usable += {d: Document(d, _text(d), int(d[4:]))
                   for d, output in zip(ids, outputs, strict=True) if output}.values()
        columns = {"doc_id": pa.array(ids, pa.string()),
                   "text_sha256": pa.array([text_sha256(_text(d)) for d in ids], pa.string()),
                   "run_nonce": pa.array([nonce] * table.num_rows, pa.string()),
                   "row_index": pc.add(table.column("row_index"), pa.scalar(first, pa.int32())),
                   "launch_id": pa.array([launch_id] * table.num_rows, pa.string()),
                   "shard": pa.array([shard] * table.num_rows, pa.int32())}
        for name, column in columns.items():
            table = table.set_column(names.index(name), table.schema.field(name), column)
        write_atomically(store.filesystem, f"{store.launch_dir(RUN, launch_id)}/part-{parts // SHARDS + 1:06d}.parquet",
                         table)
        parts += 1
    size = sum(p.stat().st_size for p in Path(store.run_dir(RUN)).rglob("part-*.parquet"))
    return parts, size, usable


def measure(workdir: Path, docs: int, docs_per_part: int, chunk_parts: int = INGEST_CHUNK_PARTS) -> dict:
    db = Database(workdir / "ingest.duckdb")
    db.start_run(RUN, {"bench": "ingest"}, "synthetic", None, None, 4, 32, code_version="bench")
    store = PartStore.beside(db.path)
    started = time.perf_counter()
    parts, part_bytes, usable = write_parts(store, docs, docs_per_part, db.get_run(RUN)["nonce"])
    written_s = time.perf_counter() - started
    # the parts' outputs are checked against the run's documents, as a sharded run's parent has them
    db.record_documents(RUN, usable, [])
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    first = db.ingest_parts(RUN, store, chunk_parts=chunk_parts)
    first_s = time.perf_counter() - started
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    load_after = os.getloadavg()[0]
    started = time.perf_counter()
    rerun = db.ingest_parts(RUN, store, chunk_parts=chunk_parts)
    rerun_s = time.perf_counter() - started
    [stored] = db.query("SELECT (SELECT count(*) FROM outputs) AS outputs, "
                        "(SELECT count(*) FROM request_stats) AS stats, "
                        "(SELECT count(*) FROM documents WHERE status = 'rejected') AS rejects")
    if (stored["outputs"], stored["rejects"]) != (first.outputs, first.rejects) or rerun.parts or rerun.outputs:
        raise AssertionError(f"ingest stored {stored}, reported {first}, then {rerun}")
    return {
        "documents": docs, "modes": 2, "docs_per_part": docs_per_part, "parts": parts, "chunk_parts": chunk_parts,
        "part_bytes": part_bytes, "db_bytes": db.path.stat().st_size, "write_parts_s": written_s,
        "output_rows": first.outputs, "stats_rows": stored["stats"], "rejects": first.rejects,
        "ingest_s": first_s, "output_rows_per_s": first.outputs / first_s,
        "all_rows_per_s": (first.outputs + stored["stats"] + first.rejects) / first_s,
        "rerun_s": rerun_s, "rerun_skipped": rerun.skipped,
        # ru_maxrss is the process's peak: the ingest's own when it rose above what writing the parts took
        "peak_rss_mb_before_ingest": rss_before / 1024, "peak_rss_mb_after_ingest": rss_after / 1024,
        # the machine is shared: the 1-minute load average (of its CPUs) says how much of it the ingest had
        "load_avg_1min_before_ingest": load_before, "load_avg_1min_after_ingest": load_after,
        "cpus": os.cpu_count(), "goal_s": GOAL_S, "goal_met": first_s <= GOAL_S if docs >= 1_000_000 else None,
    }


def markdown(result: dict, command: str) -> str:
    row = {**result, "part_mb": result["part_bytes"] / 1e6, "db_mb": result["db_bytes"] / 1e6,
           "goal": "n/a at this size" if result["goal_met"] is None else ("met" if result["goal_met"] else "missed")}
    load = (f"; 1-minute load average {result['load_avg_1min_before_ingest']:.1f} before and "
            f"{result['load_avg_1min_after_ingest']:.1f} after the ingest on {result['cpus']} CPUs")
    return (f"Ingest of synthetic part files into DuckDB, {result['documents']:,} documents x 2 modes, "
            f"{result['docs_per_part']} documents per part, {result['chunk_parts']} parts per transaction "
            f"(`{command}`{load}):\n\n"
            + markdown_table([row], [("parts", "parts"), ("part_mb", "part files (MB)"),
                                     ("output_rows", "output rows"), ("stats_rows", "stats rows"),
                                     ("rejects", "rejects"), ("ingest_s", "ingest (s)"),
                                     ("output_rows_per_s", "output rows/s"), ("rerun_s", "rerun, all ingested (s)"),
                                     ("db_mb", "DuckDB file (MB)"), ("peak_rss_mb_after_ingest", "peak RSS (MB)"),
                                     ("goal", f"goal <= {GOAL_S:.0f} s for 1M")]))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=None, help="documents (default 1,000,000; --quick 2,000)")
    parser.add_argument("--docs-per-part", type=int, default=None, help="documents per part file")
    parser.add_argument("--chunk-parts", type=int, default=INGEST_CHUNK_PARTS, help="parts per ingest transaction")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the parts and the database go (default: a temporary directory, removed after)")
    add_bench_arguments(parser)
    args = parse_bench_args(parser, argv)
    apply_profile(args, SIZES)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-ingest-"))
    try:
        result = measure(workdir, args.docs, args.docs_per_part, args.chunk_parts)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    command = "python -m bench.ingest" + {"quick": " --quick", "full": " --full"}.get(args.profile, "")
    # no model runs here: the environment's dtype is None
    write_results(f"ingest_cpu{profile_suffix(args.profile)}",
                  {"environment": environment(), "command": command, "result": result}, markdown(result, command))
    return result


if __name__ == "__main__":
    main()
