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

    .venv/bin/python -m bench.server_load            # 64 clients, 30 s per server
    .venv/bin/python -m bench.server_load --quick    # 16 clients, 5 s per server
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
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
    from bench.common import add_profile_arguments, apply_profile, profile_suffix, write_results

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
    add_profile_arguments(parser)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    apply_profile(args, SIZES)
    api_key = os.environ.get(args.api_key_env) or None
    model = args.model or args.pair
    report: dict[str, Any] = {"config": vars(args), "mix": MIX}

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
    name = "server_load" + profile_suffix(args.profile)
    write_results(name, report, to_markdown(report, shlex.join(["python", "-m", "bench.server_load", *argv])))
    for problem in found:
        print(f"FAILED: {problem}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
