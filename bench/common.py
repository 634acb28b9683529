"""Shared benchmark plumbing: corpus prompts, timing, results files and markdown tables."""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from sidecar.runtime.syncs import synchronize

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
NEWS = REPO / "data" / "news.parquet"  # `make corpus` builds it


def news_documents(count: int, max_chars: int) -> list[str]:
    """The first ``count`` real news articles (built by ``make corpus``), cut to ``max_chars``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from study.corpus import build_news_corpus

    if not NEWS.exists():
        build_news_corpus(NEWS)
    # each cell decoded alone, as the nightly's reader does: a row that is not UTF-8, or empty, is left out, not
    # the whole corpus. Not storage's reader itself: the GPU check runs this where DuckDB is not installed.
    articles = []
    for cell in pq.read_table(NEWS, columns=["article"]).column("article").cast(pa.binary()).to_pylist():
        try:
            text = (cell or b"").decode("utf-8")
        except UnicodeDecodeError:
            continue
        if text.strip():
            articles.append(text[:max_chars])
        if len(articles) == count:
            break
    return articles


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # Linux reports KiB


class Stopwatch:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __enter__(self) -> Stopwatch:
        synchronize(self.device)
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        synchronize(self.device)
        self.seconds = time.perf_counter() - self.start


def _git(*args: str) -> str:
    """git's output in the benchmarks' checkout, unstripped (a status line starts with a space); "" on failure."""
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return ""


# what a benchmark run writes itself: it does not make the code it measures differ from the commit
OWN_OUTPUTS = (":(exclude)bench/results", ":(exclude)docs/benchmarks.md")
# files named in a result's environment when its tree was dirty; the count is always there
DIRTY_FILES_LISTED = 20


# A copy of the tree sent to a lent GPU machine is no git checkout. The sender names the commit it copied there,
# having checked that the tree was clean (`make gpu-check`'s device form, docs/benchmarks.md): the result names it.
COMMIT_ENV = "SIDECAR_BENCH_COMMIT"


def uncommitted_files() -> list[str] | None:
    """Files of the checkout that differ from its commit: modified, staged, deleted or untracked (but not
    ignored), less the benchmarks' own outputs; None outside a git checkout, where no commit can be named; none
    in a copy whose sender named its clean commit (``COMMIT_ENV``)."""
    if not _git("rev-parse", "HEAD").strip():
        return [] if os.environ.get(COMMIT_ENV, "").strip() else None
    status = _git("status", "--porcelain", "--untracked-files=all", "--", ".", *OWN_OUTPUTS)
    return [line[3:] for line in status.splitlines() if line.strip()]


def environment(device: torch.device | None = None, dtype: torch.dtype | None = None,
                capture: str | None = None) -> dict:
    """Where a result comes from: the commit (``dirty`` when the checkout differs from it, with the files that
    do), the UTC date, the machine (platform, CPU model and cores, GPU), the torch build and the dtype measured
    in (None where no model ran), and the capture mode its engine's forwards ran in (``ModelPair.capture_mode``;
    None where no engine ran). ``device`` is the one measured on, if not the machine's first GPU (else its
    CPU)."""
    from sidecar.models.devices import device_name

    head = _git("rev-parse", "HEAD").strip()
    commit = head or os.environ.get(COMMIT_ENV, "").strip()  # outside a git checkout, the one its sender named
    changed = uncommitted_files()
    cpu = device_name(torch.device("cpu"))
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "device": device_name(device) if device is not None else gpu or cpu,
        "torch": torch.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
        "python": platform.python_version(), "platform": platform.platform(), "cpu": cpu, "gpu": gpu,
        "dtype": None if dtype is None else str(dtype).replace("torch.", ""), "capture": capture,
        "commit": commit or None, "commit_source": ("git" if head else COMMIT_ENV) if commit else None,
        "dirty": None if changed is None else bool(changed),
        "dirty_files": None if changed is None else {"count": len(changed), "files": changed[:DIRTY_FILES_LISTED]},
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def pin_pair_dtype(pair: str) -> tuple[torch.device, torch.dtype]:
    """The device and dtype ``load_pair(pair)`` chooses here (``SIDECAR_DTYPE``, else timed), pinned in
    ``SIDECAR_DTYPE`` for this process and those it starts (flow runs, shards, servers): a benchmark whose
    loads happen out of its sight then runs in the dtype its result records and is named by, even where the
    timing is close enough to go either way from one load to the next."""
    from sidecar.models.dtype_choice import choose_dtype
    from sidecar.models.loading import default_device, target_shape
    from sidecar.models.pair import dtype_name
    from sidecar.settings import pin_dtype

    device = default_device(None)
    dtype = choose_dtype(device, None, *target_shape(pair)).dtype
    pin_dtype(dtype_name(dtype))
    return device, dtype


def refuse_a_dirty_tree(allow_dirty: bool) -> None:
    """A result counts only from a clean, committed tree: exit 2 with a one-line ``error:`` when the checkout
    differs from its commit (or is no git checkout), unless ``allow_dirty``; then say so, as the result will."""
    changed = uncommitted_files()
    if changed is None:
        problem = "this is not a git checkout, so a result could not name the commit it measured"
    elif changed:
        shown = ", ".join(changed[:3]) + (", ..." if len(changed) > 3 else "")
        problem = f"the working tree has {len(changed)} uncommitted file(s) ({shown})"
    else:
        return
    if not allow_dirty:
        print(f"error: {problem}; commit and rerun, or pass --allow-dirty to measure anyway (the result records "
              "that its tree was dirty)", file=sys.stderr)
        sys.exit(2)
    print(f"warning: {problem}; measuring anyway (--allow-dirty), and the result says so", file=sys.stderr)


def provenance(env: dict) -> str:
    """The line under each results table: commit (and whether the tree differed from it), date, machine, torch
    and dtype of ``env`` (older files lack some keys)."""
    commit = env.get("commit") or "unknown"
    changed = (env.get("dirty_files") or {}).get("count")
    commit = f"`{commit[:12]}`" + (f" with uncommitted changes{f' ({changed} files)' if changed else ''}"
                                   if env.get("dirty") else "")
    date = env.get("date", "unknown date")
    if date.endswith("Z"):
        date = date[:-1].replace("T", " ") + " UTC"
    cpu = env.get("cpu") or env.get("device", "unknown machine")
    machine = f"{env['gpu']} with {cpu}" if env.get("gpu") else cpu
    details = ", ".join(x for x in (f"{env['cpus']} CPUs" if env.get("cpus") else "", env.get("platform", "")) if x)
    torch_version = f", torch {env['torch']}" if env.get("torch") else ""
    dtype = f", {env['dtype']}" if env.get("dtype") else ""
    capture = f", capture mode {env['capture']}" if env.get("capture") else ""
    return (f"Measured on commit {commit}, {date}, {machine}{f' ({details})' if details else ''}{torch_version}{dtype}"
            f"{capture}.")


def markdown_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """rows -> a markdown table; columns are (key, header)."""
    def cell(value) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
        return str(value)

    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(k, "")) for k, _ in columns) + " |" for r in rows]
    return "\n".join(lines)


# the file a benchmark run by bench/run_all.py lists the names of the results it wrote in, one a line
WRITTEN_ENV = "SIDECAR_BENCH_WRITTEN"


def write_results(name: str, payload: dict, markdown: str) -> Path:
    """Write NAME.json and NAME.md under bench/results/ and print the markdown. The payload brings its
    ``environment`` (:func:`environment`: commit, date, machine, torch and dtype), and the markdown gets its
    provenance line. NAME is also added to the file ``SIDECAR_BENCH_WRITTEN`` names, where set."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    missing = {"commit", "dirty", "date", "cpu", "cpus", "torch", "dtype"} - set(payload.get("environment", {}))
    if missing:
        raise ValueError(f"result {name} lacks its environment's {', '.join(sorted(missing))}: pass environment()")
    markdown = markdown.rstrip() + "\n\n" + provenance(payload["environment"])
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    (RESULTS / f"{name}.md").write_text(markdown + "\n")
    if os.environ.get(WRITTEN_ENV):  # run_all learns the names its child chose (they carry the dtype)
        with open(os.environ[WRITTEN_ENV], "a") as written:
            written.write(name + "\n")
    print(markdown)
    print(f"wrote {path}")
    return path


PROFILES = ("quick", "standard", "full")


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """What every benchmark takes: ``--quick`` / ``--full`` next to the default ``standard`` sizes (see
    bench/run_all.py for the budgets), and ``--allow-dirty`` (:func:`parse_bench_args`)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--quick", dest="profile", action="store_const", const="quick",
                       help="small sizes: `make bench-quick`, every benchmark within 5 minutes")
    group.add_argument("--full", dest="profile", action="store_const", const="full",
                       help="the sizes the issues specify: `make bench-full`, over an hour on a 2-core CPU")
    parser.set_defaults(profile="standard")
    parser.add_argument("--allow-dirty", action="store_true",
                        help="measure a checkout with uncommitted changes (refused otherwise); the result says so")


def parse_bench_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The benchmark's arguments; refuses (exit 2) a checkout that differs from its commit unless
    ``--allow-dirty``, before anything is measured."""
    args = parser.parse_args(argv)
    refuse_a_dirty_tree(args.allow_dirty)
    return args


def add_host_overhead_argument(parser: argparse.ArgumentParser) -> None:
    """``--host-overhead``: the host-overhead result whose captured floor a benchmark's GPU projection charges
    (``study.cost.host_floor``)."""
    parser.add_argument("--host-overhead", metavar="PATH",
                        help="the host-overhead result whose captured floor each projected forward pays (default: "
                             "the committed one, study.cost.host_floor's)")


def add_stream_arguments(parser: argparse.ArgumentParser) -> None:
    """The sizes of a benchmark over one stream of articles; each left unset comes from its profile."""
    parser.add_argument("--pair", help="default: qwen-coder-small (tiny with --quick)")
    parser.add_argument("--articles", type=int)
    parser.add_argument("--chars", type=int, help="cut each article to this many characters")
    parser.add_argument("--max-new-tokens", type=int, help="summary tokens")
    parser.add_argument("--max-batch", type=int)


def parse_sized_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
                     sizes: dict[str, dict]) -> tuple[argparse.Namespace, list[str], str]:
    """``parse_bench_args``, then every size left unset filled from its profile; also the sizes set on the
    command line, and the line that says which sizes ran ("standard sizes, max_batch set on the command line")."""
    args = parse_bench_args(parser, argv)
    overridden = sorted(k for k in sizes[args.profile] if getattr(args, k) is not None)
    apply_profile(args, sizes)
    line = f"{args.profile} sizes" + (f", {', '.join(overridden)} set on the command line" if overridden else "")
    return args, overridden, line


def apply_profile(args: argparse.Namespace, sizes: dict[str, dict]) -> None:
    """Fill every size the command line left unset (None) from ``sizes[args.profile]``."""
    for key, value in sizes[args.profile].items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def profile_suffix(profile: str) -> str:
    """How result names of a size are marked: nothing for standard, ``_quick`` / ``_full`` otherwise."""
    return "" if profile == "standard" else f"_{profile}"


# the dtype each device's results were first measured in: their names stay unmarked
REFERENCE_DTYPES = {"cpu": torch.float32, "cuda": torch.bfloat16}


def dtype_suffix(device_type: str, dtype: torch.dtype | str | None) -> str:
    """How result names of a dtype are marked: nothing for the device's reference dtype (fp32 on a CPU, bf16
    on CUDA) or where no model ran (None), ``_bf16`` / ``_fp32`` / ``_fp16`` otherwise. A string is a dtype as
    a result's environment records it ("bfloat16")."""
    from sidecar.models.dtype_choice import DTYPES
    from sidecar.models.pair import dtype_name

    if dtype is None:
        return ""
    if isinstance(dtype, str):
        dtype = DTYPES[dtype.replace("torch.", "")]
    return "" if dtype == REFERENCE_DTYPES[device_type] else "_" + dtype_name(dtype)


def variant_suffix(device_type: str, dtype: torch.dtype | str | None, profile: str) -> str:
    """What follows a result's base name, and a docs/benchmarks.md key: its dtype (:func:`dtype_suffix`), then
    its size (:func:`profile_suffix`). The one naming rule of results and tables: a bf16 run never overwrites
    an fp32 one, a quick run never a standard one."""
    return dtype_suffix(device_type, dtype) + profile_suffix(profile)


def result_name(benchmark: str, device: torch.device, pair: str, profile: str, dtype: torch.dtype | None) -> str:
    """engine_cpu, engine_cpu_bf16_quick, engine_gpu_quick, sidecar_cpu_full, sidecar_cpu_tiny ...: runs on
    other pairs, in other dtypes or at other sizes never overwrite the standard fp32 (CPU) ones."""
    device_type = "cuda" if device.type == "cuda" else "cpu"
    name = f"{benchmark}_{'gpu' if device_type == 'cuda' else 'cpu'}"
    if pair != "qwen-coder-small":
        name += "_" + re.sub(r"[^A-Za-z0-9]+", "-", pair).strip("-")[:40]
    return name + variant_suffix(device_type, dtype, profile)


def medians_in_turn(calls: Sequence[Callable[[], object]], count: int, device: torch.device,
                    untimed: int = 3, statistic: Callable[[list[float]], float] = statistics.median) -> list[float]:
    """The median seconds (or another ``statistic``) of each of ``calls`` over ``count`` timed calls, after
    ``untimed`` rounds (one-off allocations, compiles), the calls made in turn (one of each per round, each
    synchronised): a machine that speeds up or slows down between minutes moves them alike, so their ratio holds
    where blocks timed one after the other would drift apart."""
    times: list[list[float]] = [[] for _ in calls]
    for i in range(count + untimed):
        for call, kept in zip(calls, times, strict=True):
            synchronize(device)
            start = time.perf_counter()
            call()
            synchronize(device)
            if i >= untimed:
                kept.append(time.perf_counter() - start)
    return [statistic(kept) for kept in times]
