"""Bounded load test of ``sidecar serve`` on loopback: batched vs one-at-a-time, every answer checked.

Starts the server itself (``--pair``, default the tiny random pair) unless ``--base-url`` is given. It first
asks each prompt alone for its greedy reference answer, then runs ``--concurrency`` clients for
``--duration`` seconds with a fixed mix of greedy, streamed, sidecar, sampled and invalid requests. Every
greedy main answer under load must equal its reference; invalid requests must get a 4xx. Reports p50/p99
latency, throughput, status counts and the server's RSS before and after in bench/results/server_load.json
and .md (``_quick`` / ``_full`` for the other sizes). With ``--compare-unbatched`` (the default when it
starts the server) the same load also runs against a server with ``--max-batch 1``, so the report shows
what batching buys. Exits non-zero on a wrong answer, a failed step, or batching that does not raise the
valid requests per second.

``--mixed`` runs another workload instead: half the clients ask for long greedy answers (``--long-tokens``,
128), half for short ones (``--short-tokens``, 8), their arrivals interleaved, every answer checked against
its reference; it reports the latency of each kind in bench/results/server_load_mixed.json and .md. A short
request must not wait for the long ones decoding when it arrives. ``--compare-checkout DIR`` runs the same
load against the server of another checkout too (a git worktree of an older commit), in the same process.

    .venv/bin/python -m bench.server_load            # 64 clients, 30 s per server
    .venv/bin/python -m bench.server_load --quick    # 16 clients, 5 s per server
    .venv/bin/python -m bench.server_load --mixed --compare-checkout /tmp/old   # 8 clients, 60 s per server
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

SENTENCES = [
    "The city council approved a new budget on Tuesday after a long debate about schools.",
    "Officials said the plan would add jobs at the plant in the north of the state.",
    "The president met leaders in Berlin to talk about trade and energy prices.",
    "Prices rose 3.5 percent in 2017 while 1,200 workers lost their jobs at the factory.",
    "Public health experts warned that the new rules came too late for many hospitals.",
    "Roads in the north will be repaired next year, the council said in a statement.",
    "The team won its third game in a row and now leads the league.",
    "Leaders in Doha and Beijing signed an agreement on climate and technology.",
]
HASHTAGS = {"name": "hashtags", "instruction": "Then output 3-5 short hashtags for the summary.", "max_tokens": 8,
            "parser": "hashtags"}
# share of each request kind in the mix; the invalid kinds must all be answered with a 4xx
MIX = {"greedy": 0.45, "stream": 0.2, "sidecar": 0.1, "sampled": 0.1, "bad_json": 0.04, "unknown_model": 0.04,
       "over_context": 0.04, "bad_sidecar": 0.03}
CHECKED = ("greedy", "stream", "sidecar")
INVALID = ("bad_json", "unknown_model", "over_context", "bad_sidecar")
SIZES = {
    "quick": {"concurrency": 16, "duration": 5.0},
    "standard": {"concurrency": 64, "duration": 30.0},
    "full": {"concurrency": 64, "duration": 30.0},
}
# the mixed workload: a long answer takes seconds on the tiny pair, so fewer clients and longer runs
MIXED_SIZES = {
    "quick": {"concurrency": 4, "duration": 20.0},
    "standard": {"concurrency": 8, "duration": 60.0},
    "full": {"concurrency": 16, "duration": 120.0},
}


def prompts(count: int) -> list[str]:
    return [f"{SENTENCES[i % len(SENTENCES)]} {SENTENCES[(3 * i + 1) % len(SENTENCES)]}" for i in range(count)]


@dataclass
class Outcome:
    kind: str
    status: int | str  # HTTP status, or the exception's name when no response came
    latency_s: float
    completion_tokens: int = 0
    correct: bool = False  # greedy answers equal their reference, invalid requests got a 4xx, ...


@dataclass
class LoadClient:
    base_url: str  # the OpenAI base URL, ending in /v1
    model: str
    api_key: str | None
    max_tokens: int
    client: httpx.AsyncClient = field(init=False)

    def __post_init__(self) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self.client = httpx.AsyncClient(headers=headers, timeout=120.0, limits=httpx.Limits(max_connections=1000))

    async def aclose(self) -> None:
        await self.client.aclose()

    async def stats(self) -> dict[str, Any]:
        return await self._get("/stats")

    async def health(self) -> dict[str, Any]:
        return await self._get("/health")

    async def _get(self, path: str) -> dict[str, Any]:
        response = await self.client.get(self.base_url.removesuffix("/v1") + path)
        response.raise_for_status()
        return response.json()

    def body(self, kind: str, prompt: str) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "messages": [{"role": "user", "content": prompt}],
                                "max_tokens": self.max_tokens, "temperature": 0}
        if kind == "stream":
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        elif kind == "sidecar":
            body["sidecars"] = [HASHTAGS]
        elif kind == "sampled":
            body |= {"temperature": 0.8, "top_p": 0.95}
        elif kind == "unknown_model":
            body["model"] = "no-such-model"
        elif kind == "over_context":
            body["messages"][0]["content"] = "city council " * 3000
        elif kind == "bad_sidecar":
            body["sidecars"] = [{"name": "bad name!", "instruction": ""}]
        return body

    async def answer(self, kind: str, prompt: str) -> tuple[int, str | None, int]:
        """(status, answer text as comparable string or None, completion tokens)."""
        url = self.base_url + "/chat/completions"
        if kind == "bad_json":
            response = await self.client.post(url, content=b'{"model": ', headers={"content-type": "application/json"})
            return response.status_code, None, 0
        body = self.body(kind, prompt)
        if kind == "stream":
            return await self._stream(url, body)
        response = await self.client.post(url, json=body)
        if response.status_code != 200:
            return response.status_code, None, 0
        data = response.json()
        # For sidecar requests only the main output is checked: the sidecar text depends on the speculation
        # schedule (how many main tokens the draft had cached), which batching changes.
        return 200, data["choices"][0]["message"]["content"], data["usage"]["completion_tokens"]

    async def _stream(self, url: str, body: dict[str, Any]) -> tuple[int, str | None, int]:
        parts: list[str] = []
        tokens = 0
        async with self.client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return response.status_code, None, 0
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:  # the server failed after the 200 headers went out
                    return 500, None, 0
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk["choices"]:
                    parts.append(choice["delta"].get("content") or "")
        return 200, "".join(parts), tokens


async def references(client: LoadClient, pool: list[str]) -> dict[tuple[str, str], str]:
    """Each checked kind's answer to each prompt, asked alone (one request in flight)."""
    answers: dict[tuple[str, str], str] = {}
    for prompt in pool:
        for kind in CHECKED:
            status, text, _ = await client.answer(kind, prompt)
            if status != 200 or text is None:
                raise RuntimeError(f"reference request {kind!r} failed with {status}")
            answers[(kind, prompt)] = text
    # streamed and plain greedy answers must agree too
    for prompt in pool:
        if answers[("stream", prompt)] != answers[("greedy", prompt)]:
            raise RuntimeError(f"streamed and plain greedy answers differ for {prompt!r}")
    return answers


async def run_load(client: LoadClient, pool: list[str], refs: dict[tuple[str, str], str], concurrency: int,
                   duration_s: float, seed: int = 0) -> dict[str, Any]:
    """``concurrency`` clients send the mix until ``duration_s`` is over; returns the summary."""
    kinds, weights = list(MIX), list(MIX.values())
    outcomes: list[Outcome] = []
    before = await client.stats()
    deadline = time.monotonic() + duration_s

    async def one_client(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        while time.monotonic() < deadline:
            kind = rng.choices(kinds, weights)[0]
            prompt = rng.choice(pool)
            started = time.perf_counter()
            try:
                status, text, tokens = await client.answer(kind, prompt)
            except httpx.HTTPError as exc:
                outcomes.append(Outcome(kind, type(exc).__name__, time.perf_counter() - started))
                continue
            if kind in CHECKED:
                correct = status == 200 and text == refs[(kind, prompt)]
            elif kind in INVALID:
                correct = 400 <= status < 500
            else:  # sampled: no reference to compare with, but it must succeed
                correct = status == 200
            outcomes.append(Outcome(kind, status, time.perf_counter() - started, tokens, correct))

    started = time.perf_counter()
    await asyncio.gather(*(one_client(i) for i in range(concurrency)))
    wall = time.perf_counter() - started
    after = await client.stats()
    return summarize(outcomes, wall, before, after, concurrency)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def summarize(outcomes: list[Outcome], wall_s: float, before: dict[str, Any], after: dict[str, Any],
              concurrency: int) -> dict[str, Any]:
    ok = [o for o in outcomes if o.status == 200]
    latencies = [o.latency_s for o in ok]
    sizes_before = Counter({int(k): v for k, v in before["step_sizes"].items()})
    sizes_after = Counter({int(k): v for k, v in after["step_sizes"].items()})
    sizes = sizes_after - sizes_before
    steps = sum(sizes.values())
    return {
        "concurrency": concurrency,
        "wall_s": wall_s,
        "requests": len(outcomes),
        "ok": len(ok),
        "status_counts": dict(Counter(str(o.status) for o in outcomes)),
        "by_kind": {kind: dict(Counter(str(o.status) for o in outcomes if o.kind == kind)) for kind in MIX},
        "wrong": [{"kind": o.kind, "status": o.status} for o in outcomes if not o.correct],
        "latency_ok_s": {"p50": _percentile(latencies, 50), "p99": _percentile(latencies, 99),
                         "max": max(latencies, default=None)},
        "throughput": {"requests_per_s": len(outcomes) / wall_s, "ok_per_s": len(ok) / wall_s,
                       "completion_tokens_per_s": sum(o.completion_tokens for o in ok) / wall_s},
        "server": {"rss_before_bytes": before["rss_bytes"], "rss_after_bytes": after["rss_bytes"],
                   # decoding steps, and how many requests each worked on
                   "steps": steps, "step_sizes": {str(k): v for k, v in sorted(sizes.items())},
                   "mean_step_size": sum(k * v for k, v in sizes.items()) / steps if steps else 0.0,
                   "failed_steps": after["failed_steps"] - before["failed_steps"]},
    }


async def greedy_references(client: LoadClient, pool: list[str]) -> dict[str, tuple[str, int]]:
    """Each prompt's greedy answer asked alone, with its completion tokens."""
    answers = {}
    for prompt in pool:
        status, text, tokens = await client.answer("greedy", prompt)
        if status != 200 or text is None:
            raise RuntimeError(f"reference request failed with {status}")
        answers[prompt] = (text, tokens)
    return answers


async def run_mixed(long: LoadClient, short: LoadClient, long_refs: dict[str, str], short_refs: dict[str, str],
                    concurrency: int, duration_s: float, seed: int = 0) -> dict[str, Any]:
    """Clients 0, 2, 4, ... ask ``long`` for answers to ``long_refs``' prompts, the others ``short`` for
    ``short_refs``'; starts are staggered over the first tenth of the run so that arrivals interleave."""
    outcomes: list[Outcome] = []
    deadline = time.monotonic() + duration_s

    async def one_client(index: int) -> None:
        kind, client, refs = ("long", long, long_refs) if index % 2 == 0 else ("short", short, short_refs)
        rng = random.Random(seed * 1000 + index)
        await asyncio.sleep(index * duration_s / 10 / concurrency)
        while time.monotonic() < deadline:
            prompt = rng.choice(list(refs))
            started = time.perf_counter()
            try:
                status, text, tokens = await client.answer("greedy", prompt)
            except httpx.HTTPError as exc:
                outcomes.append(Outcome(kind, type(exc).__name__, time.perf_counter() - started))
                continue
            outcomes.append(Outcome(kind, status, time.perf_counter() - started, tokens,
                                    status == 200 and text == refs[prompt]))

    started = time.perf_counter()
    await asyncio.gather(*(one_client(i) for i in range(concurrency)))
    wall = time.perf_counter() - started
    by_kind = {}
    for kind in ("short", "long"):
        ok = [o for o in outcomes if o.kind == kind and o.status == 200]
        latencies = [o.latency_s for o in ok]
        by_kind[kind] = {"requests": sum(o.kind == kind for o in outcomes), "ok": len(ok),
                         "mean_completion_tokens": statistics.fmean([o.completion_tokens for o in ok]) if ok else 0.0,
                         "latency_ok_s": {"p50": _percentile(latencies, 50), "p99": _percentile(latencies, 99),
                                          "max": max(latencies, default=None)}}
    return {"concurrency": concurrency, "wall_s": wall, "requests": len(outcomes),
            "status_counts": dict(Counter(str(o.status) for o in outcomes)),
            "wrong": [{"kind": o.kind, "status": o.status} for o in outcomes if not o.correct],
            "completion_tokens_per_s": sum(o.completion_tokens for o in outcomes if o.status == 200) / wall,
            **by_kind}


async def bench_mixed(base_url: str, model: str, api_key: str | None, args: argparse.Namespace) -> dict[str, Any]:
    long = LoadClient(base_url, model, api_key, args.long_tokens)
    short = LoadClient(base_url, model, api_key, args.short_tokens)
    try:
        device = (await long.health())["device"]
        pool = prompts(args.prompts)
        # long requests use the prompts whose answer runs to the limit, so that every one of them is long
        long_refs = {p: text for p, (text, tokens) in (await greedy_references(long, pool)).items()
                     if tokens == args.long_tokens}
        if not long_refs:
            raise RuntimeError(f"no prompt of the pool has a greedy answer of {args.long_tokens} tokens")
        short_refs = {p: text for p, (text, _) in (await greedy_references(short, pool)).items()}
        summary = await run_mixed(long, short, long_refs, short_refs, args.concurrency, args.duration, args.seed)
    finally:
        await long.aclose()
        await short.aclose()
    summary["device"] = device
    return summary


async def bench(base_url: str, model: str, api_key: str | None, args: argparse.Namespace) -> dict[str, Any]:
    client = LoadClient(base_url, model, api_key, args.max_tokens)
    try:
        device = (await client.health())["device"]
        pool = prompts(args.prompts)
        refs = await references(client, pool)
        summary = await run_load(client, pool, refs, args.concurrency, args.duration, args.seed)
    finally:
        await client.aclose()
    summary["server"]["device"] = device
    return summary


def _status_counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{status}: {count}" for status, count in sorted(counts.items()))


def _latency(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds:.2f}"


def to_markdown(report: dict[str, Any], command: str) -> str:
    """The results table, one row per server, with what the run found above it."""
    config = report["config"]
    labels = {"batched": f"`{config['base_url']}`" if config["base_url"] else
              f"continuous batching (max batch {config['max_batch']})", "unbatched": "one at a time (max batch 1)"}
    runs = {name: report[name] for name in labels if name in report}
    text = (f"Pair `{config['model'] or config['pair']}` on {report['batched']['server']['device']}, "
            f"{config['concurrency']} concurrent clients for {config['duration']:.0f} s per server "
            f"{'against ' + config['base_url'] if config['base_url'] else 'on loopback'}, mixed valid (greedy, "
            "streaming, sidecars, sampled) and invalid requests (bad JSON, unknown model, over-context, bad sidecar "
            "spec).")
    speedup = report.get("speedup_ok_per_s")
    if speedup is not None:
        verb = "raised" if speedup > 1 else "did not raise"
        text += f" Batching {verb} valid requests per second ({speedup:.1f}×)."
    text += f" Command: `{command}`."
    lines = [text, "", "| server | requests | status counts | wrong answers | p50 / p99 latency s | valid req/s "
             "| RSS MB before → after |", "|---|---|---|---|---|---|---|"]
    for name, run in runs.items():
        latency, server = run["latency_ok_s"], run["server"]
        lines.append(f"| {labels[name]} | {run['requests']} | {_status_counts(run['status_counts'])} | "
                     f"{len(run['wrong'])} | {_latency(latency['p50'])} / {_latency(latency['p99'])} | "
                     f"{run['throughput']['ok_per_s']:.1f} | {server['rss_before_bytes'] / 1e6:.0f} → "
                     f"{server['rss_after_bytes'] / 1e6:.0f} |")
    return "\n".join(lines)


def mixed_markdown(report: dict[str, Any], command: str) -> str:
    """The mixed workload's table: latency of short and long requests, one row per server."""
    config = report["config"]
    runs = report["runs"]
    first = next(iter(runs.values()))
    text = (f"Pair `{config['model'] or config['pair']}` on {first['device']}, {config['concurrency']} clients for "
            f"{config['duration']:.0f} s per server (max batch {config['max_batch']}), half asking for "
            f"{config['long_tokens']}-token greedy answers and half for {config['short_tokens']}-token ones, their "
            "arrivals interleaved; every answer checked against the same request sent alone.")
    if len(runs) == 2:
        (label, run), (base_label, base) = runs.items()
        ratio = base["short"]["latency_ok_s"]["p50"] / max(run["short"]["latency_ok_s"]["p50"], 1e-9)
        text += f" Short requests' p50 latency: {ratio:.1f}× lower on {label} than on {base_label}."
    text += f" Command: `{command}`."
    lines = [text, "", "| server | short requests | short p50 / p99 s | long requests | long p50 / p99 s | "
             "long tokens (mean) | wrong answers | completion tokens/s |", "|---|---|---|---|---|---|---|---|"]
    for label, run in runs.items():
        short, long = run["short"], run["long"]
        lines.append(f"| {label} | {short['ok']} | {_latency(short['latency_ok_s']['p50'])} / "
                     f"{_latency(short['latency_ok_s']['p99'])} | {long['ok']} | "
                     f"{_latency(long['latency_ok_s']['p50'])} / {_latency(long['latency_ok_s']['p99'])} | "
                     f"{long['mean_completion_tokens']:.0f} | {len(run['wrong'])} | "
                     f"{run['completion_tokens_per_s']:.0f} |")
    return "\n".join(lines)


def mixed_problems(report: dict[str, Any]) -> list[str]:
    """Why a mixed run fails: a wrong or failed answer anywhere, or short requests no sooner done than long
    ones on the server of this checkout (the first run)."""
    found = [f"{label}: {len(run['wrong'])} wrong or failed answer(s)" for label, run in report["runs"].items()
             if run["wrong"]]
    run = next(iter(report["runs"].values()))
    short, long = run["short"]["latency_ok_s"]["p50"], run["long"]["latency_ok_s"]["p50"]
    if short is None or long is None or short >= long:
        found.append(f"short requests did not finish sooner than long ones (p50 {short} s vs {long} s)")
    return found


def problems(report: dict[str, Any]) -> list[str]:
    """Why the run fails, if it does."""
    found = [f"{name}: {len(report[name]['wrong'])} wrong answer(s), {report[name]['server']['failed_steps']} "
             "failed step(s)" for name in ("batched", "unbatched")
             if name in report and (report[name]["wrong"] or report[name]["server"]["failed_steps"])]
    speedup = report.get("speedup_ok_per_s")
    if speedup is not None and speedup <= 1:
        found.append(f"batching did not raise valid requests per second over one at a time ({speedup:.2f}×)")
    return found


def main(argv: list[str] | None = None) -> int:
    # Imported here, not at the top: bench is not an installed package, and tests load this module by file path
    # for its load client; only running the benchmark (python -m bench.server_load) needs bench importable.
    from bench.common import add_bench_arguments, apply_profile, parse_bench_args, write_results

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="tiny", help="pair the started server loads")
    parser.add_argument("--base-url", help="test this running server (OpenAI base URL, .../v1) instead")
    parser.add_argument("--model", help="model id to ask for; default the pair name")
    parser.add_argument("--api-key-env", default="SIDECAR_API_KEY", help="env variable holding the key, if any")
    parser.add_argument("--concurrency", type=int, help="concurrent clients (quick 16, else 64)")
    parser.add_argument("--duration", type=float, help="seconds of load per server (quick 5, else 30)")
    parser.add_argument("--max-batch", type=int, default=16, help="--max-batch of the batched server")
    parser.add_argument("--batch-wait-ms", type=float, default=5.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=12, help="distinct prompts in the pool")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compare-unbatched", action=argparse.BooleanOptionalAction, default=None,
                        help="also run against a --max-batch 1 server (default: on when starting servers)")
    parser.add_argument("--mixed", action="store_true", help="the long/short workload instead of the request mix")
    parser.add_argument("--long-tokens", type=int, default=128, help="--mixed: max_tokens of the long requests")
    parser.add_argument("--short-tokens", type=int, default=8, help="--mixed: max_tokens of the short requests")
    parser.add_argument("--compare-checkout", type=Path,
                        help="--mixed: also run the load against the server of this checkout (e.g. a git worktree)")
    add_bench_arguments(parser)
    argv = sys.argv[1:] if argv is None else argv
    args = parse_bench_args(parser, argv)
    apply_profile(args, MIXED_SIZES if args.mixed else SIZES)
    api_key = os.environ.get(args.api_key_env) or None
    model = args.model or args.pair
    command = shlex.join(["python", "-m", "bench.server_load", *argv])
    if args.mixed:
        return mixed_main(args, model, api_key, command)
    env, suffix = server_environment(args)
    report: dict[str, Any] = {"environment": env, "config": vars(args), "mix": MIX}

    if args.base_url:
        report["batched"] = asyncio.run(bench(args.base_url, model, api_key, args))
    else:
        from server.launcher import running_server

        runs = [("batched", args.max_batch)]
        if args.compare_unbatched is not False:
            runs.append(("unbatched", 1))
        for name, max_batch in runs:
            with running_server(args.pair, api_key=api_key, max_batch=max_batch,
                                batch_wait_ms=args.batch_wait_ms) as url:
                print(f"{name}: server up at {url} (max batch {max_batch}); {args.duration:.0f}s of load",
                      file=sys.stderr)
                report[name] = asyncio.run(bench(url, model, api_key, args))
    if "unbatched" in report:
        batched, unbatched = report["batched"]["throughput"], report["unbatched"]["throughput"]
        report["speedup_ok_per_s"] = batched["ok_per_s"] / max(unbatched["ok_per_s"], 1e-9)
    found = problems(report)
    report["problems"] = found
    write_results("server_load" + suffix, report, to_markdown(report, command))
    for problem in found:
        print(f"FAILED: {problem}", file=sys.stderr)
    return 1 if found else 0


def server_environment(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """This machine and checkout, and the device and dtype a server started here loads its pair in, pinned
    for the servers this run starts (``pin_pair_dtype``); a server given by ``--base-url`` runs elsewhere, in a
    dtype this process cannot know (None). Also the suffix of the result's name (``variant_suffix``)."""
    from bench.common import environment, pin_pair_dtype, variant_suffix

    if args.base_url:
        return environment(), variant_suffix("cpu", None, args.profile)
    device, dtype = pin_pair_dtype(args.pair)
    return environment(device, dtype), variant_suffix(device.type, dtype, args.profile)


def _commit(checkout: Path) -> str:
    done = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip()[:12] or "unknown commit"


def mixed_main(args: argparse.Namespace, model: str, api_key: str | None, command: str) -> int:
    from bench.common import write_results

    config = vars(args) | {"compare_checkout": str(args.compare_checkout) if args.compare_checkout else None}
    env, suffix = server_environment(args)
    report: dict[str, Any] = {"environment": env, "config": config, "runs": {}}
    if args.base_url:
        report["runs"][f"`{args.base_url}`"] = asyncio.run(bench_mixed(args.base_url, model, api_key, args))
    else:
        from server.launcher import running_server

        servers = [("this checkout", None)]
        if args.compare_checkout is not None:
            servers.append((f"`{args.compare_checkout}` at `{_commit(args.compare_checkout)}`", args.compare_checkout))
        for label, checkout in servers:
            with running_server(args.pair, api_key=api_key, max_batch=args.max_batch,
                                batch_wait_ms=args.batch_wait_ms, checkout=checkout) as url:
                print(f"{label}: server up at {url}; {args.duration:.0f}s of mixed load", file=sys.stderr)
                report["runs"][label] = asyncio.run(bench_mixed(url, model, api_key, args))
    found = mixed_problems(report)
    report["problems"] = found
    write_results("server_load_mixed" + suffix, report, mixed_markdown(report, command))
    for problem in found:
        print(f"FAILED: {problem}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
