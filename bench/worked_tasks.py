"""The worked sidecar tasks of docs/tasks.md, run for real: a tasks file on real news articles.

    python -m bench.worked_tasks                           # docs/examples/tasks.yaml, 2 articles, the offline pair
    python -m bench.worked_tasks --tasks my.yaml --articles 4

Prints, per article, the summary and each task's raw text, parsed value, parse error and finish reason, as JSON,
with the pair's dtype and capture mode: what docs/tasks.md quotes.
"""

from __future__ import annotations

import argparse
import json
import time

from bench.common import REPO, news_documents
from sidecar.models.loading import load_pair
from sidecar.tasks.engine import SidecarEngine
from sidecar.tasks.rows import SidecarRequest
from sidecar.tasks.tasks_file import load_tasks


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", default=str(REPO / "docs" / "examples" / "tasks.yaml"))
    parser.add_argument("--articles", type=int, default=2)
    parser.add_argument("--chars", type=int, default=1500)
    parser.add_argument("--pair", default="qwen-coder-small")
    args = parser.parse_args(argv)
    tasks = load_tasks(args.tasks)
    started = time.perf_counter()
    pair = load_pair(args.pair)
    documents = news_documents(args.articles, args.chars)
    results = SidecarEngine(pair).run([SidecarRequest(d, sidecars=tasks) for d in documents], max_new_tokens=96,
                                      batch_size=2)
    out = {"pair": pair.name, "dtype": pair.dtype_report, "capture": pair.capture_report,
           "seconds": round(time.perf_counter() - started, 1), "documents": [
               {"document": d[:300], "summary": r.main.text,
                "sidecars": {name: {"text": s.text, "parsed": s.parsed, "parse_error": s.parse_error,
                                    "finish_reason": s.finish_reason} for name, s in r.sidecars.items()}}
               for d, r in zip(documents, results, strict=True)]}
    print(json.dumps(out, indent=1, default=str))
    return out


if __name__ == "__main__":
    main()
