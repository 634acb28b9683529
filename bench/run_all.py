"""Run every benchmark, refresh bench/results/ and the README's benchmark tables.

    python -m bench.run_all            # full (the engine benchmark alone: 34 minutes on a 2-core CPU)
    python -m bench.run_all --quick    # reduced sizes

Each benchmark runs in its own process (so peak memory is its own) and writes bench/results/NAME.json
and NAME.md; the README shows each NAME.md between `<!-- bench:NAME -->` markers.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

from bench.common import REPO, RESULTS

BENCHMARKS = [
    ("engine", "bench.engine", "engine_cpu"),
    ("sidecar", "bench.sidecar", "sidecar_cpu"),
    ("orchestration", "bench.orchestration_overhead", "orchestration_overhead"),
    ("server", "bench.server_load", "server_load"),
]


def splice_readme(name: str, markdown: str) -> bool:
    readme = REPO / "README.md"
    text = readme.read_text()
    pattern = re.compile(rf"(<!-- bench:{name} -->\n).*?(\n<!-- /bench:{name} -->)", re.DOTALL)
    if not pattern.search(text):
        return False
    readme.write_text(pattern.sub(lambda m: m.group(1) + markdown.strip() + m.group(2), text))
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", default="", help="comma-separated subset of: " + ", ".join(b[0] for b in BENCHMARKS))
    args = parser.parse_args()
    chosen = [b for b in BENCHMARKS if not args.only or b[0] in args.only.split(",")]
    failed = []
    for name, module, result in chosen:
        command = [sys.executable, "-m", module, *(["--quick"] if args.quick else [])]
        print(f"== {' '.join(command[1:])}", flush=True)
        if subprocess.run(command, cwd=REPO).returncode != 0:
            failed.append(name)
            continue
        md = RESULTS / f"{result}{'_quick' if args.quick else ''}.md"
        if md.exists() and not args.quick and splice_readme(name, md.read_text()):
            print(f"README table '{name}' refreshed from {md.name}")
    if failed:
        sys.exit(f"benchmarks failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
