"""Run every benchmark, refresh bench/results/ and the tables of docs/benchmarks.md.

    python -m bench.run_all            # standard sizes (`make bench`): about 2 hours on a 2-core CPU
    python -m bench.run_all --quick    # small sizes (`make bench-quick`): under 5 minutes
    python -m bench.run_all --full     # the sizes the issues specify (`make bench-full`): over an hour

Each benchmark runs in its own process (so peak memory is its own) and writes bench/results/NAME.json and
NAME.md (NAME_quick, NAME_full for the other sizes), each with its environment (commit, date, machine, torch,
dtype) and a line saying it. A checkout with uncommitted changes is refused unless ``--allow-dirty`` (passed on
to every benchmark; the results then say their tree was dirty);
docs/benchmarks.md shows the standard and full NAME.md files between `<!-- bench:KEY -->` and
`<!-- /bench:KEY -->` markers (KEY_full for the full sizes). Quick results stay in bench/results/.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.common import REPO, RESULTS, add_bench_arguments, parse_bench_args, profile_suffix

TABLES = REPO / "docs" / "benchmarks.md"

# (docs/benchmarks.md key, module, result name without the profile suffix); CPU-only benchmarks say so in their name
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated subset of: " + ", ".join(b[0] for b in BENCHMARKS))
    add_bench_arguments(parser)
    args = parse_bench_args(parser)
    device = "gpu" if torch.cuda.is_available() else "cpu"
    chosen = [b for b in BENCHMARKS if (not args.only or b[0] in args.only.split(","))
              and not (device == "gpu" and b[0] in CPU_ONLY)]
    # GPU tables go under their own keys, never over the CPU ones
    suffix = ("" if device == "cpu" else "_gpu") + profile_suffix(args.profile)
    failed, timings = [], []
    started = time.perf_counter()
    for key, module, result in chosen:
        command = [sys.executable, "-m", module, *([f"--{args.profile}"] if args.profile != "standard" else []),
                   *(["--allow-dirty"] if args.allow_dirty else [])]
        print(f"== {' '.join(command[1:])}", flush=True)
        began = time.perf_counter()
        returncode = subprocess.run(command, cwd=REPO).returncode
        timings.append(f"{module} {time.perf_counter() - began:.0f} s")
        if returncode != 0:
            failed.append(key)
            continue
        md = RESULTS / f"{result.format(device=device)}{profile_suffix(args.profile)}.md"
        if args.profile != "quick" and md.exists() and splice(key + suffix, md.read_text()):
            print(f"{TABLES.relative_to(REPO)} table '{key + suffix}' refreshed from {md.name}")
    print(f"== {args.profile} benchmarks: {', '.join(timings)}; {(time.perf_counter() - started) / 60:.1f} min in all")
    if failed:
        sys.exit(f"benchmarks failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
