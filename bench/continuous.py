"""Continuous batching vs static batches vs HF plain batched generate, one stream of real news, one process.

    python -m bench.continuous           # 32 articles cut to 1500 chars, max batch 8, 128 new tokens, hashtags on
    python -m bench.continuous --full    # 64 articles
    python -m bench.continuous --quick   # the tiny random pair, 12 short articles, max batch 4, 16 new tokens

The same requests (a summary and a hashtag sidecar per article, greedy, in corpus order) run through
``SidecarEngine.batch`` under the "continuous" schedule (rows join as slots free) and the "static" one
(fixed batches of ``--max-batch``, each running to its end, sidecars included), then HF plain batched
``generate`` of the target does the summaries alone, in the same batches of ``--max-batch``.

- End to end: wall time of the whole stream, from the first admission to the last result.
- Prefill: time inside admissions, ``SlotBatch._admit`` (target and draft prefill and first tokens; sidecar
  rows join from snapshots there, their bridge riding in the next step). For HF: each batch's time to its
  first new token.
- Decode phase: end to end minus prefill; ``steps_s`` is the part spent inside decoding steps
  (``StepRunner.run``: draft forwards, which also decode the sidecar rows, and the target's forward). HF's
  decode phase decodes summaries only, the engine's also the hashtags, so the engine's ratio over HF is
  conservative.
- Draft forwards per step: all steps, and the steps where drafting main rows and sidecar rows shared them.
- Device time per phase: the device-time ledger (``sidecar.runtime.ledger``): seconds charged to the main
  outputs, the sidecar rows, and the sidecars' masked instructions in the draft prefill.
- Occupancy: ``BatchTrace.occupancy()``, the share of main slot-steps with a live row before the final drain.
- Identity: static and continuous give the same main and sidecar token ids; main ids also match HF's.
- GPU projection: both runs' recorded forwards replayed through the roofline (``study.cost.replay``) for the
  source study's Qwen2.5-7B target and 1.5B draft in bf16 on the catalog GPUs, each forward paying the captured
  (CUDA graphs) host floor of ``--host-overhead`` (default: the committed result), the host work around a step
  once per step: a schedule of fewer, fuller steps pays it fewer times.

Writes bench/results/continuous_<device>[_<pair>][_<profile>].json and .md.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

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
from bench.hf_baselines import FirstTokenClock, new_tokens_until_eos
from bench.identity import compare, exit_on_mismatch, verdict
from sidecar import HASHTAGS, SidecarEngine, SidecarRequest, load_pair
from sidecar.decoding.batch import stream_through
from sidecar.models.pair import ModelPair
from sidecar.runtime.syncs import synchronize
from sidecar.tasks.batch import SidecarBatch
from study.cost import CostInputError, HostFloor, load_catalog, load_host_floors
from study.cost.replay import replay
from study.cost.workload import QWEN2_5_1_5B, QWEN2_5_7B

SCHEDULES = ("continuous", "static")
SIZES = {
    "quick": {"pair": "tiny", "articles": 12, "chars": 400, "max_new_tokens": 16, "max_batch": 4},
    "standard": {"pair": "qwen-coder-small", "articles": 32, "chars": 1500, "max_new_tokens": 128, "max_batch": 8},
    "full": {"pair": "qwen-coder-small", "articles": 64, "chars": 1500, "max_new_tokens": 128, "max_batch": 8},
}


class PhaseClock:
    """Times the admissions and decoding steps of one ``SidecarBatch`` by wrapping its slot batch's methods on
    the instance (the engine is not changed)."""

    def __init__(self, batch: SidecarBatch, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = defaultdict(float)
        self._time(batch.slots, "_admit", "prefill_s")
        self._time(batch.slots.runner, "run", "steps_s")

    def _time(self, obj, name: str, bucket: str) -> None:
        method = getattr(obj, name)

        def timed(*args, **kwargs):
            synchronize(self.device)
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                synchronize(self.device)
                self.seconds[bucket] += time.perf_counter() - start

        setattr(obj, name, timed)


def run_schedule(engine: SidecarEngine, requests: list[SidecarRequest], max_batch: int, schedule: str) -> dict:
    """The stream of ``requests`` through one ``SidecarBatch``, pulled as it has room (as ``SidecarEngine.stream``
    does, with the batch kept for its trace and ledger)."""
    batch = engine.batch(max_batch, schedule, expected=len(requests), trace_keep=None)
    clock = PhaseClock(batch, engine.pair.device)
    with Stopwatch(engine.pair.device) as sw:
        results = dict(stream_through(batch, requests))
    outputs = [results[i] for i in range(len(requests))]
    main_tokens = sum(len(r.main.token_ids) for r in outputs)
    sidecar_tokens = sum(len(s.token_ids) for r in outputs for s in r.sidecars.values())
    steps = batch.trace.steps
    mixed = [s for s in steps if s.live and s.riders and s.source == "draft" and s.width]
    ledger = batch.ledger
    phases = ledger.charged_by_label
    return {
        "schedule": schedule, "wall_s": sw.seconds, "prefill_s": clock.seconds["prefill_s"],
        "decode_s": sw.seconds - clock.seconds["prefill_s"], "steps_s": clock.seconds["steps_s"],
        "main_tokens": main_tokens, "sidecar_tokens": sidecar_tokens,
        "main_steps": len(steps), "prefill_groups": len(batch.trace.prefills),
        "draft_forwards_per_step": sum(s.draft_forwards for s in steps) / max(len(steps), 1),
        "mixed_steps": len(mixed),
        "mixed_draft_forwards_per_step": sum(s.draft_forwards for s in mixed) / max(len(mixed), 1),
        "mixed_width_per_step": sum(s.width for s in mixed) / max(len(mixed), 1),
        "occupancy": batch.trace.occupancy(), "occupancy_with_drain": batch.trace.occupancy(include_drain=True),
        "device_s": ledger.measured_seconds, "device_main_s": phases.get("main", 0.0),
        "device_sidecar_s": phases.get("sidecar", 0.0), "device_instruction_s": phases.get("instruction", 0.0),
        "device_s_per_tag_token": (phases.get("sidecar", 0.0) + phases.get("instruction", 0.0))
        / max(sidecar_tokens, 1),
        "e2e_tps": main_tokens / sw.seconds,
        "decode_tps": main_tokens / (sw.seconds - clock.seconds["prefill_s"]),
        # kept for identity and the replay, dropped from the results file
        "_outputs": outputs, "_forwards": list(ledger.records),
    }


def hf_plain_stream(pair: ModelPair, prompts: list[list[int]], max_batch: int, max_new: int) -> dict:
    """HF plain batched generate of the target over ``prompts`` in consecutive batches of ``max_batch``."""
    pad = pair.tokenizer.pad_token_id if pair.tokenizer.pad_token_id is not None else pair.eos_token_ids[0]
    eos = set(pair.eos_token_ids)
    tokens, wall, prefill = [], 0.0, 0.0
    for start in range(0, len(prompts), max_batch):
        chunk = prompts[start:start + max_batch]
        width = max(map(len, chunk))
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(chunk):  # left padding, as HF decoder-only batching requires
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        clock = FirstTokenClock()
        with torch.inference_mode(), Stopwatch(pair.device) as sw:
            began = time.perf_counter()
            out = pair.target.generate(ids.to(pair.device), attention_mask=mask.to(pair.device),
                                       max_new_tokens=max_new, do_sample=False, eos_token_id=pair.eos_token_ids,
                                       pad_token_id=pad, streamer=clock)
        wall += sw.seconds
        prefill += clock.first_token_at - began
        tokens += [new_tokens_until_eos(r, eos, pad) for r in out[:, width:].tolist()]
    main_tokens = sum(map(len, tokens))
    return {"schedule": "hf_plain_batched", "wall_s": wall, "prefill_s": prefill, "decode_s": wall - prefill,
            "main_tokens": main_tokens, "e2e_tps": main_tokens / wall, "decode_tps": main_tokens / (wall - prefill),
            "_tokens": tokens}


def projection(runs: dict[str, dict], catalog: dict, host: HostFloor | None = None) -> list[dict]:
    """Projected summary tokens/s of each schedule's forwards on each catalog GPU, for the study's 7B/1.5B in bf16,
    each forward paying ``host``'s floor."""
    rows = []
    for gpu in catalog.values():
        row = {"gpu": gpu.name}
        for schedule, run in runs.items():
            projected = replay(run["_forwards"], QWEN2_5_7B, QWEN2_5_1_5B, gpu, host=host)
            row[f"{schedule}_tps"] = run["main_tokens"] / projected.seconds
            row[f"{schedule}_decode_tps"] = run["main_tokens"] / projected.decode_s
            row[f"{schedule}_prefill_share"] = projected.prefill_s / projected.seconds
            tags = projected.by_phase.get("sidecar", 0.0) + projected.by_phase.get("instruction", 0.0)
            row[f"{schedule}_ms_per_tag_token"] = 1000 * tags / max(run["sidecar_tokens"], 1)
        row["ratio"] = row["continuous_tps"] / row["static_tps"]
        row["decode_ratio"] = row["continuous_decode_tps"] / row["static_decode_tps"]
        rows.append(row)
    return rows


def public(run: dict) -> dict:
    return {k: v for k, v in run.items() if not k.startswith("_")}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_stream_arguments(parser)
    parser.add_argument("--skip-hf", action="store_true", help="skip HF plain batched generate")
    add_host_overhead_argument(parser)
    add_bench_arguments(parser)
    args, overridden, sizes = parse_sized_args(parser, argv, SIZES)
    try:  # before any run: a bad result costs nothing
        host = load_host_floors(args.host_overhead).of("captured")
    except CostInputError as exc:
        parser.error(str(exc))

    pair = load_pair(args.pair)
    engine = SidecarEngine(pair)
    texts, source = documents(args.articles, args.chars)
    requests = [SidecarRequest(t, sidecars=[HASHTAGS], max_new_tokens=args.max_new_tokens) for t in texts]
    prompts = [engine.prompts(r)[0].token_ids for r in requests]
    env = environment(pair.device, pair.dtype, pair.capture_mode)
    print(f"{env['device']} {env['dtype']}: {len(prompts)} prompts ({source}), mean "
          f"{sum(map(len, prompts)) / len(prompts):.0f} tokens", flush=True)
    # first calls pay one-off allocation and kernel selection costs
    run_schedule(engine, [SidecarRequest(texts[0][:200], sidecars=[HASHTAGS], max_new_tokens=4)] * 2, 2,
                 "continuous")

    runs = {}
    for schedule in SCHEDULES:
        # a fresh engine per schedule: each starts with the same untrained gamma and prefill controllers
        runs[schedule] = run_schedule(SidecarEngine(pair), requests, args.max_batch, schedule)
        print(public(runs[schedule]), flush=True)
    hf = None if args.skip_hf else hf_plain_stream(pair, prompts, args.max_batch, args.max_new_tokens)
    if hf is not None:
        print(public(hf), flush=True)

    cont, static = runs["continuous"]["_outputs"], runs["static"]["_outputs"]
    # HF's reference is its padded batched generate; each divergence is classified from the target's logits at
    # batch 1 (what bench.identity.compare does), equal to the padded batch's up to rounding
    against_hf = [] if hf is None else [
        compare(pair.target, p, h, r.main.token_ids, f"document {i}, continuous")
        for i, (p, h, r) in enumerate(zip(prompts, hf["_tokens"], cont, strict=True))]
    identity = {
        "main_static_vs_continuous": [r.main.token_ids for r in cont] == [r.main.token_ids for r in static],
        "sidecar_static_vs_continuous": ([{n: s.token_ids for n, s in r.sidecars.items()} for r in cont]
                                         == [{n: s.token_ids for n, s in r.sidecars.items()} for r in static]),
        "main_vs_hf_plain": None if hf is None else all(c["identical"] for c in against_hf),
        "main_vs_hf_plain_verdict": None if hf is None else verdict(against_hf),
    }
    c, s = runs["continuous"], runs["static"]
    ratios = {"decode_continuous_over_static": s["decode_s"] / c["decode_s"],
              "e2e_continuous_over_static": s["wall_s"] / c["wall_s"],
              "steps_continuous_over_static": s["steps_s"] / c["steps_s"]}
    if hf is not None:
        for name, run in runs.items():
            ratios[f"decode_{name}_over_hf_plain"] = run["decode_tps"] / hf["decode_tps"]
            ratios[f"e2e_{name}_over_hf_plain"] = run["e2e_tps"] / hf["e2e_tps"]
    gpus = projection(runs, load_catalog(), host)
    payload = {"environment": env, "args": vars(args), "set_on_command_line": overridden, "documents": source,
               "ratios": ratios, "identity": identity, "divergences_from_hf_plain": against_hf,
               "runs": [public(r) for r in (*runs.values(), *([hf] if hf else []))], "gpu_projection": gpus,
               "host_floor": host.label}

    table = markdown_table([public(r) for r in (*runs.values(), *([hf] if hf else []))], [
        ("schedule", "schedule"), ("wall_s", "end to end s"), ("prefill_s", "prefill s"),
        ("decode_s", "decode phase s"), ("steps_s", "in decoding steps s"), ("main_tokens", "summary tokens"),
        ("sidecar_tokens", "hashtag tokens"), ("e2e_tps", "end-to-end summary tok/s"),
        ("decode_tps", "decode-phase summary tok/s"), ("main_steps", "main steps"),
        ("draft_forwards_per_step", "draft forwards per step"),
        ("mixed_draft_forwards_per_step", "… in steps with sidecar rows riding"),
        ("mixed_width_per_step", "their verify width"),
        ("device_s_per_tag_token", "device s per tag token"),
        ("occupancy", "slot occupancy (no drain)"), ("occupancy_with_drain", "with drain")])
    projected = markdown_table(gpus, [
        ("gpu", "GPU"), ("static_tps", "static tok/s"), ("continuous_tps", "continuous tok/s"),
        ("ratio", "continuous ÷ static"), ("static_decode_tps", "static decode tok/s"),
        ("continuous_decode_tps", "continuous decode tok/s"), ("decode_ratio", "decode ratio"),
        ("continuous_prefill_share", "continuous prefill share"),
        ("continuous_ms_per_tag_token", "continuous ms per tag token")])
    hf_line = "" if hf is None else (
        f" Against HF plain batched generate (summaries only, batches of {args.max_batch}): continuous "
        f"{ratios['e2e_continuous_over_hf_plain']:.2f}x end to end, "
        f"{ratios['decode_continuous_over_hf_plain']:.2f}x decode phase; static "
        f"{ratios['e2e_static_over_hf_plain']:.2f}x / {ratios['decode_static_over_hf_plain']:.2f}x.")
    markdown = (
        f"Continuous batching on {env['device']} ({env['dtype']}, {env['threads']} threads), pair `{args.pair}`, "
        f"a stream of {len(texts)} {source} cut to {args.chars} chars, max batch {args.max_batch}, "
        f"{args.max_new_tokens} new tokens, hashtag sidecar on, greedy ({sizes}; "
        f"`python -m bench.continuous`).\n\n{table}\n\n"
        f"Continuous over static: decode phase {ratios['decode_continuous_over_static']:.2f}x (goal 1.3x), end to "
        f"end {ratios['e2e_continuous_over_static']:.2f}x (goal 1.1x); slot occupancy {c['occupancy']:.3f} "
        f"continuous vs {s['occupancy']:.3f} static (goal 0.95, final drain excluded).{hf_line} Identical "
        f"outputs, static vs continuous: summaries {identity['main_static_vs_continuous']}, hashtags "
        f"{identity['sidecar_static_vs_continuous']}; summaries vs HF plain: {identity['main_vs_hf_plain_verdict']}. "
        f"Decode phase = end to end minus time inside admissions (target and draft prefill, sidecar joins).\n\n"
        f"**Projection, not a measurement**: the forwards of the two runs above (as the device-time ledger "
        f"recorded them: model, rows, tokens, context) replayed through the roofline of `study.cost` "
        f"(`study/cost/replay.py`) with the source study's Qwen2.5-7B target and 1.5B draft in bf16 at their "
        f"catalog peaks, each forward paying the host floor of CUDA graphs (`study/cost/host_floor.py`; the host "
        f"work around a step priced once per step): {host.label}; summary tokens per second.\n\n{projected}")
    write_results(result_name("continuous", pair.device, args.pair, args.profile, pair.dtype), payload, markdown)
    exit_on_mismatch(against_hf)
    return payload


if __name__ == "__main__":
    main()
