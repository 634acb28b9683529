"""What a tag token costs, sidecar against standalone, from the device-time ledger, on one stream of real news.

    python -m bench.tagging_cost            # 20 articles cut to 1500 chars, max batch 8, 64-token summaries
    python -m bench.tagging_cost --quick    # the tiny random pair, 6 short articles, 16 new tokens
    python -m bench.tagging_cost --fixed-gamma   # gamma 4 fixed in every run, no adaptive controller

Four runs of the same greedy requests, in one process, each through a fresh engine:

- **plain**, before and after the sidecar run: the summaries without a sidecar (they must be the same tokens);
  the two plain runs' difference is the noise floor of the whole measure below;
- **sidecar**: summaries with the hashtag sidecar (document evicted), rows joining as slots free;
- **standalone**: the draft as a separate tagger, prompted with each plain summary only.

Measured two ways, so that the ledger's attribution can be checked against a whole measurement:

- **Attributed** (the ledger's rule, ``sidecar.runtime.ledger``): device seconds charged to the sidecar rows
  (their prefill, their decode) and to their masked instructions in the main rows' draft prefill, against
  those charged to the standalone rows. This is what the cost report's verdict reads.
- **Whole**: the sidecar run's measured forward time minus the plain runs' mean (what adding the sidecar cost,
  main-phase effects included), against the standalone run's; and the same for wall time, end to end: the
  sidecar run against the plain run plus the standalone run.

Each run's forward census (forwards, rows and tokens by model and kind) shows, in counts that do not depend
on the machine's speed, what work the sidecar added to the main phase, if any.

The adaptive controller picks gamma from forward times it measures, so the sidecar and plain runs may draft
differently (each run's summary target forwards and acceptance are in the table); ``--fixed-gamma`` takes the
controller out, so that the whole measure compares like with like.

GPU projection: each run's recorded forwards replayed through the roofline (``study.cost.replay``) for the
source study's Qwen2.5-7B target and 1.5B draft in bf16 on every catalog GPU, priced by the same phases, each
forward paying the captured (CUDA graphs) host floor of ``--host-overhead`` (default: the committed result). With
``--step-costs PATH`` (the table ``make gpu-check`` writes: bench/results/gpu_check_step_costs.json) one more row
prices the decode forwards from those measured steps on the GPU they were measured on, its prefills by the roofline.

Writes bench/results/tagging_cost_<device>[_<pair>][_<profile>].json and .md.
"""

from __future__ import annotations

import argparse

from bench.common import (
    Stopwatch,
    add_bench_arguments,
    add_host_overhead_argument,
    add_stream_arguments,
    environment,
    markdown_table,
    parse_sized_args,
    result_name,
    write_results,
)
from bench.gpu_check.pairs import documents
from sidecar import HASHTAGS, SidecarEngine, SidecarRequest, load_pair
from sidecar.decoding.batch import stream_through
from sidecar.runtime.ledger import ForwardRecord, Ledger
from study.cost import (
    GPU,
    CostInputError,
    HostFloor,
    StepCosts,
    find_gpu,
    load_catalog,
    load_host_floors,
    load_step_costs,
)
from study.cost.replay import replay
from study.cost.workload import QWEN2_5_1_5B, QWEN2_5_7B

SIZES = {
    "quick": {"pair": "tiny", "articles": 6, "chars": 400, "max_new_tokens": 16, "max_batch": 4},
    "standard": {"pair": "qwen-coder-small", "articles": 20, "chars": 1500, "max_new_tokens": 64, "max_batch": 8},
    "full": {"pair": "qwen-coder-small", "articles": 64, "chars": 1500, "max_new_tokens": 128, "max_batch": 8},
}
TAG_PHASES = ("sidecar", "instruction")  # the ledger labels a sidecar tag token's cost is charged to
CENSUS_ORDER = ("target prefill", "target decode", "draft prefill", "draft decode")


def census(records: list[ForwardRecord]) -> dict[str, dict]:
    """Forwards by model and kind: how many, their rows, seconds, and tokens by ledger label. Counts do not
    depend on the machine's speed, so they show where a difference in seconds between two runs comes from."""
    out: dict[str, dict] = {}
    for r in records:
        c = out.setdefault(f"{r.model} {r.kind}", {"forwards": 0, "rows": 0, "seconds": 0.0, "tokens": {}})
        c["forwards"] += 1
        c["rows"] += r.rows
        c["seconds"] += r.seconds
        for label, tokens in r.tokens.items():
            c["tokens"][label] = c["tokens"].get(label, 0.0) + tokens
    return out


def census_row(census: dict[str, dict], key: str) -> dict:
    """One line of the census table: a model's forwards of one kind in one run."""
    c = census[key]
    tags = sum(t for label, t in c["tokens"].items() if label in TAG_PHASES)
    return {"count": c["forwards"], "rows": c["rows"] / c["forwards"], "main": c["tokens"].get("main", 0.0),
            "tags": tags, "seconds": c["seconds"], "ms": 1000 * c["seconds"] / c["forwards"]}


def ledger_run(ledger: Ledger, wall_s: float, tag_tokens: int) -> dict:
    """One run's totals: wall time, measured forward time, seconds charged per ledger label, forward census."""
    records = list(ledger.records)
    return {"wall_s": wall_s, "device_s": ledger.measured_seconds, "charged_s": ledger.charged_seconds,
            "by_phase": dict(ledger.charged_by_label), "tag_tokens": tag_tokens, "census": census(records),
            "_forwards": records}


def sidecar_runs(pair, requests: list[SidecarRequest], max_batch: int, adaptive: bool = True) -> tuple[dict, list]:
    """``requests`` through one continuous batch; the run's totals and its results in request order."""
    batch = SidecarEngine(pair, adaptive=adaptive).batch(max_batch, expected=len(requests), trace_keep=None)
    with Stopwatch(pair.device) as sw:
        results = dict(stream_through(batch, requests))
    ordered = [results[i] for i in range(len(requests))]
    tags = sum(len(s.token_ids) for r in ordered for s in r.sidecars.values())
    run = ledger_run(batch.ledger, sw.seconds, tags)
    # the main phase's own work: a sidecar that made the draft's proposals worse would show here
    main = [r.main.stats for r in ordered]
    run["main"] = {"tokens": sum(m.new_tokens for m in main), "target_forwards": sum(m.target_forwards for m in main),
                   "drafted": sum(m.drafted for m in main), "accepted": sum(m.accepted for m in main)}
    # the rows' own accounts, per line, as request_stats stores them
    stats = [s.stats for r in ordered for s in r.sidecars.values()]
    run["lines"] = {"prefill": sum(s.prefill_device_seconds for s in stats),
                    "decode": sum(s.decode_device_seconds for s in stats),
                    "instruction": sum(s.instruction_device_seconds for s in stats)}
    return run, ordered


def standalone_run(pair, summaries: list[str], max_batch: int, adaptive: bool = True) -> tuple[dict, list]:
    """The standalone tagger over ``summaries``; its batch is captured as it is made, for its ledger."""
    engine = SidecarEngine(pair, adaptive=adaptive)
    made = []
    make = engine.decoder.batch

    def capture(*args, **options):
        made.append(make(*args, trace_keep=None, **options))
        return made[-1]

    engine.decoder.batch = capture
    with Stopwatch(pair.device) as sw:
        outputs = engine.standalone(summaries, [HASHTAGS], batch_size=max_batch)
    tags = [o["hashtags"] for o in outputs]
    run = ledger_run(made[0].ledger, sw.seconds, sum(len(t.token_ids) for t in tags))
    run["lines"] = {"prefill": sum(t.stats.prefill_device_seconds for t in tags),
                    "decode": sum(t.stats.decode_device_seconds for t in tags), "instruction": 0.0}
    return run, tags


def per_tag_token(seconds: float, run: dict) -> float:
    return seconds / max(run["tag_tokens"], 1)


def projection(sidecar: dict, plain: dict, standalone: dict, catalog: dict,
               steps: StepCosts | None = None, host: HostFloor | None = None) -> list[dict]:
    """Projected ms per tag token on each catalog GPU, attributed and whole, for the study's 7B/1.5B in bf16, each
    roofline-priced forward paying ``host``'s floor (``study.cost.replay``: a step's host work once per step); with
    ``steps``, one more row on the GPU they were measured on, its decode forwards priced from them."""
    priced: list[tuple[GPU, StepCosts | None]] = [(gpu, None) for gpu in catalog.values()]
    if steps is not None:
        gpu = find_gpu(steps.device, catalog)
        if gpu is None:
            raise CostInputError(f"the step costs were measured on {steps.device!r}, which is not in the GPU "
                                 "catalog: their prefills could not be priced")
        priced.append((gpu, steps))
    rows = []
    for gpu, measured in priced:
        side, base, alone = (replay(r["_forwards"], QWEN2_5_7B, QWEN2_5_1_5B, gpu, measured, host)
                             for r in (sidecar, plain, standalone))
        roofline = "roofline" if host is None else f"roofline + {host.capture} host floor"
        attributed = sum(side.by_phase.get(p, 0.0) for p in TAG_PHASES)
        rows.append({
            "gpu": gpu.name,
            "priced_by": roofline if measured is None else f"{measured.source} for decode forwards, {roofline} "
                                                           "for the rest",
            "sidecar_ms": 1000 * per_tag_token(attributed, sidecar),
            "standalone_ms": 1000 * per_tag_token(alone.seconds, standalone),
            "saving": 1 - per_tag_token(attributed, sidecar) / per_tag_token(alone.seconds, standalone),
            "whole_sidecar_ms": 1000 * per_tag_token(side.seconds - base.seconds, sidecar),
        })
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_stream_arguments(parser)
    parser.add_argument("--fixed-gamma", action="store_true", help="gamma 4 in every run, no adaptive controller")
    parser.add_argument("--step-costs", metavar="PATH",
                        help="a step-cost table `make gpu-check` wrote: one more projection row priced from it")
    add_host_overhead_argument(parser)
    add_bench_arguments(parser)
    args, overridden, sizes = parse_sized_args(parser, argv, SIZES)
    try:  # before any run: a bad table costs nothing
        steps = None if args.step_costs is None else load_step_costs(args.step_costs)
        if steps is not None and find_gpu(steps.device, load_catalog()) is None:
            raise CostInputError(f"{args.step_costs}: measured on {steps.device!r}, which is not in the GPU catalog")
        host = load_host_floors(args.host_overhead).of("captured")
    except CostInputError as exc:
        parser.error(str(exc))

    pair = load_pair(args.pair)
    adaptive = not args.fixed_gamma
    texts, source = documents(args.articles, args.chars)
    env = environment(pair.device, pair.dtype, pair.capture_mode)
    # first calls pay one-off allocation and kernel selection costs
    sidecar_runs(pair, [SidecarRequest(texts[0][:200], sidecars=[HASHTAGS], max_new_tokens=4)] * 2, 2)

    plain_requests = [SidecarRequest(t, sidecars=[], max_new_tokens=args.max_new_tokens) for t in texts]
    # the plain run on both sides of the sidecar run: their difference is the whole measure's noise floor
    plain_before, _ = sidecar_runs(pair, plain_requests, args.max_batch, adaptive)
    sidecar, with_tags = sidecar_runs(pair, [SidecarRequest(t, sidecars=[HASHTAGS], max_new_tokens=args.max_new_tokens)
                                             for t in texts], args.max_batch, adaptive)
    plain, summaries = sidecar_runs(pair, plain_requests, args.max_batch, adaptive)
    standalone, _ = standalone_run(pair, [r.main.text for r in summaries], args.max_batch, adaptive)
    same_summaries = [r.main.token_ids for r in with_tags] == [r.main.token_ids for r in summaries]

    attributed = sum(sidecar["by_phase"].get(p, 0.0) for p in TAG_PHASES)
    plain_s = (plain_before["device_s"] + plain["device_s"]) / 2
    whole = sidecar["device_s"] - plain_s
    noise = abs(plain["device_s"] - plain_before["device_s"])
    measured = {
        "sidecar_s_per_tag_token": per_tag_token(attributed, sidecar),
        "standalone_s_per_tag_token": per_tag_token(standalone["device_s"], standalone),
        "whole_sidecar_s_per_tag_token": per_tag_token(whole, sidecar),
        "whole_noise_s_per_tag_token": per_tag_token(noise, sidecar),
        "main_extra_s": sidecar["by_phase"].get("main", 0.0) - plain_s,
        "e2e_sidecar_s": sidecar["wall_s"], "e2e_plain_plus_standalone_s": plain["wall_s"] + standalone["wall_s"],
    }
    measured["saving"] = 1 - measured["sidecar_s_per_tag_token"] / measured["standalone_s_per_tag_token"]
    measured["whole_saving"] = 1 - measured["whole_sidecar_s_per_tag_token"] / measured["standalone_s_per_tag_token"]
    measured["e2e_ratio"] = measured["e2e_plain_plus_standalone_s"] / measured["e2e_sidecar_s"]
    # the invariant of the ledger, on this run: what the rows carry adds up to what the ledger charged them
    # the target's prefill is the same work in the sidecar and plain runs (the sidecar never rides in it):
    # how far its seconds differ between runs is how far identical work varies in this process
    prefills = {name: r["census"]["target prefill"] for name, r in
                (("sidecar", sidecar), ("plain", plain), ("plain_before", plain_before))}
    measured["identical_work_s"] = {name: c["seconds"] for name, c in prefills.items()}
    # with gamma fixed it is identical; the adaptive controller may admit rows at other steps
    measured["identical_target_prefill_work"] = len({(c["forwards"], c["rows"], tuple(sorted(c["tokens"].items())))
                                                     for c in prefills.values()}) == 1
    checks = {"same_summaries": same_summaries,
              "sidecar_lines_match_ledger": abs(sum(sidecar["lines"].values()) - attributed) <= 0.01 * attributed,
              "charged_equals_measured": all(abs(r["charged_s"] - r["device_s"]) <= 0.01 * r["device_s"]
                                             for r in (sidecar, plain, standalone))}
    gpus = projection(sidecar, plain, standalone, load_catalog(), steps, host)
    runs = {"sidecar": sidecar, "plain": plain, "plain_before": plain_before, "standalone": standalone}
    payload = {"environment": env, "args": vars(args), "set_on_command_line": overridden, "documents": source,
               "measured": measured, "checks": checks,
               "runs": {name: {k: v for k, v in r.items() if not k.startswith("_")} for name, r in runs.items()},
               "gpu_projection": gpus, "host_floor": host.label}
    print(payload["measured"], payload["checks"], flush=True)

    n = max(sidecar["tag_tokens"], 1), max(standalone["tag_tokens"], 1)
    lines = markdown_table([
        {"mode": "sidecar", "tags": sidecar["tag_tokens"], **{k: 1000 * v / n[0] for k, v in sidecar["lines"].items()},
         "total": 1000 * measured["sidecar_s_per_tag_token"]},
        {"mode": "standalone", "tags": standalone["tag_tokens"],
         **{k: 1000 * v / n[1] for k, v in standalone["lines"].items()},
         "total": 1000 * measured["standalone_s_per_tag_token"]},
    ], [("mode", "mode"), ("tags", "tag tokens"), ("prefill", "prefill ms/tag tok"), ("decode", "decode ms/tag tok"),
        ("instruction", "instruction ms/tag tok"), ("total", "device ms per tag token")])
    walls = markdown_table([{"run": name, "wall_s": r["wall_s"], "device_s": r["device_s"],
                             **{f"{p}_s": r["by_phase"].get(p, 0.0) for p in ("main", *TAG_PHASES, "standalone")},
                             **({"target_forwards": r["main"]["target_forwards"],
                                 "acceptance": r["main"]["accepted"] / max(r["main"]["drafted"], 1)}
                                if "main" in r else {})}
                            for name, r in runs.items()],
                           [("run", "run"), ("wall_s", "end to end s"), ("device_s", "forwards s"),
                            ("main_s", "main s"), ("sidecar_s", "sidecar s"), ("instruction_s", "instruction s"),
                            ("standalone_s", "standalone s"), ("target_forwards", "summary target forwards"),
                            ("acceptance", "summary acceptance")])
    forwards = markdown_table([{"run": name, "forwards": key, **census_row(r["census"], key)}
                               for name, r in runs.items() for key in CENSUS_ORDER if key in r["census"]],
                              [("run", "run"), ("forwards", "forwards"), ("count", "count"),
                               ("rows", "rows per forward"), ("main", "main tokens"), ("tags", "sidecar tokens"),
                               ("seconds", "s"), ("ms", "ms per forward")])
    projected = markdown_table(gpus, [("gpu", "GPU"), ("priced_by", "priced by"), ("sidecar_ms", "sidecar ms/tag tok"),
                                      ("standalone_ms", "standalone ms/tag tok"), ("saving", "saving"),
                                      ("whole_sidecar_ms", "sidecar, whole, ms/tag tok")])
    verdict = "cheaper" if measured["saving"] >= 0 else "dearer"
    name = "tagging_cost_fixed_gamma" if args.fixed_gamma else "tagging_cost"
    schedule = "gamma 4 fixed" if args.fixed_gamma else "adaptive gamma"
    command = f"python -m bench.tagging_cost{' --fixed-gamma' if args.fixed_gamma else ''}"
    markdown = (
        f"Tagging cost on {env['device']} ({env['dtype']}, {env['threads']} threads), pair `{args.pair}`, "
        f"{len(texts)} {source} cut to {args.chars} chars, max batch {args.max_batch}, {args.max_new_tokens}-token "
        f"summaries, hashtag sidecar, greedy, {schedule} ({sizes}; `{command}`).\n\n"
        f"Attributed by the ledger: a sidecar tag token took {1000 * measured['sidecar_s_per_tag_token']:.1f} device "
        f"ms, a standalone one {1000 * measured['standalone_s_per_tag_token']:.1f}: the sidecar's is "
        f"{abs(measured['saving']):.0%} {verdict}.\n\n{lines}\n\n"
        f"Whole, not attributed: the sidecar run's forwards took {whole:.2f} s more than the plain runs' mean "
        f"({1000 * measured['whole_sidecar_s_per_tag_token']:.1f} ms per tag token, saving "
        f"{measured['whole_saving']:.0%}); the two plain runs differed by {noise:.2f} s "
        f"({1000 * measured['whole_noise_s_per_tag_token']:.1f} ms per tag token), the noise floor of that "
        f"measure. The main phase was charged {measured['main_extra_s']:+.2f} s against the plain runs' mean. "
        f"The target's prefill forwards, the same work in every run "
        f"({measured['identical_target_prefill_work']}), took "
        f"{' / '.join(f'{v:.1f}' for v in measured['identical_work_s'].values())} s in the sidecar / plain / "
        f"earlier plain run: identical work varies that much between runs here. "
        f"End to end, the sidecar run took {sidecar['wall_s']:.1f} s against "
        f"{measured['e2e_plain_plus_standalone_s']:.1f} s for the plain run and the standalone tagger "
        f"({measured['e2e_ratio']:.2f}x). Same summaries with and without the sidecar: {same_summaries}; "
        f"rows' lines add up to the ledger: {checks['sidecar_lines_match_ledger']}; charged = measured: "
        f"{checks['charged_equals_measured']}.\n\n{walls}\n\n"
        f"Forward census: each model's forwards by kind, their rows and the tokens charged to the main rows "
        f"and to the sidecar (its rows, its instruction, its share of the catch-up feed).\n\n{forwards}\n\n"
        f"**Projection, not a measurement**: each run's recorded forwards replayed through the roofline of "
        f"`study.cost` (`study/cost/replay.py`) for the source study's Qwen2.5-7B target and 1.5B draft in bf16 at "
        f"their catalog peaks, at this run's batch, each forward paying the host floor of CUDA graphs "
        f"(`study/cost/host_floor.py`; the host work around a step priced once per step): {host.label}. ms per "
        f"tag token (a row priced by measured step costs, `--step-costs`, takes its decode forwards from them)."
        f"\n\n{projected}")
    write_results(result_name(name, pair.device, args.pair, args.profile, pair.dtype), payload, markdown)
    return payload


if __name__ == "__main__":
    main()
