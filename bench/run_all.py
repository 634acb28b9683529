"""Run every benchmark, refresh bench/results/ and the tables of docs/benchmarks.md.

    python -m bench.run_all            # standard sizes (`make bench`): about 2 hours on a 2-core CPU
    python -m bench.run_all --quick    # small sizes (`make bench-quick`): under 5 minutes
    python -m bench.run_all --full     # the sizes the issues specify (`make bench-full`): over an hour

Each benchmark runs in its own process (so peak memory is its own) and writes bench/results/NAME.json and
NAME.md (NAME_quick, NAME_full for the other sizes; NAME_bf16, NAME_bf16_quick ... for a CPU run in bf16, which
``load_pair`` picks on a CPU where bf16 matmuls are faster, see bench.common.variant_suffix), each with its
environment (commit, date, machine, torch, dtype) and a line saying it. A checkout with uncommitted changes is
refused unless ``--allow-dirty`` (passed on to every benchmark; the results then say their tree was dirty);
docs/benchmarks.md shows the standard and full NAME.md files between `<!-- bench:KEY -->` and
`<!-- /bench:KEY -->` markers (KEY_full for the full sizes, KEY_bf16 and KEY_bf16_full for CPU runs in bf16,
KEY_gpu for GPU runs). Quick results stay in bench/results/. ``SIDECAR_DTYPE=fp32 make bench`` measures in fp32
on any CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import REPO, RESULTS, WRITTEN_ENV, add_bench_arguments, parse_bench_args, variant_suffix

TABLES = REPO / "docs" / "benchmarks.md"

# (docs/benchmarks.md key, module, result name without its dtype and size suffixes); CPU-only benchmarks say so in
# their name
BENCHMARKS = [
    ("kernels", "bench.kernels", "kernels_cpu"),
    ("engine", "bench.engine", "engine_{device}"),
    ("continuous", "bench.continuous", "continuous_{device}"),
    ("sidecar", "bench.sidecar", "sidecar_{device}"),
    ("tagging_cost", "bench.tagging_cost", "tagging_cost_{device}"),
    ("draft_forwards", "bench.draft_forwards", "draft_forwards"),
    ("orchestration", "bench.orchestration_overhead", "orchestration_overhead"),
    ("server", "bench.server_load", "server_load"),
    ("syncs", "bench.syncs", "syncs"),
    ("host_overhead", "bench.host_overhead", "host_overhead_{device}"),
    ("ingest", "bench.ingest", "ingest_cpu"),
    ("scale_out", "bench.scale_out", "scale_out"),
    # skips, saying so, where llama-cpp-python is not installed (`make llama-cpp`)
    ("llama_cpp", "bench.llama_cpp", "llama_cpp_cpu"),
]
# benchmarks of the CPU alone: the kernel choice exists on CPU only, and llama.cpp is built for the CPU here
CPU_ONLY = ("kernels", "llama_cpp")


def splice(key: str, markdown: str, path: Path = TABLES) -> bool:
    """Put ``markdown`` between the ``bench:KEY`` markers of ``path``; False when it has no such markers."""
    text = path.read_text()
    pattern = re.compile(rf"(<!-- bench:{key} -->\n).*?(\n<!-- /bench:{key} -->)", re.DOTALL)
    if not pattern.search(text):
        return False
    path.write_text(pattern.sub(lambda m: m.group(1) + markdown.strip() + m.group(2), text))
    return True


def table_to_splice(key: str, result: str, device: str, profile: str, written: list[str],
                    results: Path = RESULTS) -> tuple[str, str, str] | None:
    """(docs/benchmarks.md key, markdown, result name) of the benchmark's result among the names its run
    ``written`` under ``results``; None when none is its. The key and the name both end in the result's
    ``variant_suffix`` (dtype, then size), read from the dtype the result records: a bf16 table goes under
    ``KEY_bf16``, a GPU one under ``KEY_gpu``, never over the CPU fp32 one."""
    device_type = "cuda" if device == "gpu" else "cpu"
    for name in written:
        dtype = json.loads((results / f"{name}.json").read_text())["environment"]["dtype"]
        suffix = variant_suffix(device_type, dtype, profile)
        if name == result.format(device=device) + suffix:
            return key + ("_gpu" if device == "gpu" else "") + suffix, (results / f"{name}.md").read_text(), name
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated subset of: " + ", ".join(b[0] for b in BENCHMARKS))
    add_bench_arguments(parser)
    args = parse_bench_args(parser)
    device = "gpu" if torch.cuda.is_available() else "cpu"
    chosen = [b for b in BENCHMARKS if (not args.only or b[0] in args.only.split(","))
              and not (device == "gpu" and b[0] in CPU_ONLY)]
    failed, timings = [], []
    started = time.perf_counter()
    for key, module, result in chosen:
        command = [sys.executable, "-m", module, *([f"--{args.profile}"] if args.profile != "standard" else []),
                   *(["--allow-dirty"] if args.allow_dirty else [])]
        print(f"== {' '.join(command[1:])}", flush=True)
        began = time.perf_counter()
        with tempfile.NamedTemporaryFile("r", suffix=".txt") as written:
            returncode = subprocess.run(command, cwd=REPO, env=os.environ | {WRITTEN_ENV: written.name}).returncode
            names = written.read().split()
        timings.append(f"{module} {time.perf_counter() - began:.0f} s")
        if returncode != 0:
            failed.append(key)
            continue
        if args.profile == "quick":
            continue
        table = table_to_splice(key, result, device, args.profile, names, RESULTS)
        if table and splice(table[0], table[1], TABLES):
            print(f"{TABLES.relative_to(REPO)} table '{table[0]}' refreshed from {table[2]}.md")
    print(f"== {args.profile} benchmarks: {', '.join(timings)}; {(time.perf_counter() - started) / 60:.1f} min in all")
    if failed:
        sys.exit(f"benchmarks failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
