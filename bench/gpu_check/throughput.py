"""The throughput part: tokens/s of HF plain (batched), HF assisted (``assistant_model=``, batch 1 only) and the
engine under each of ``ENGINE_SCHEDULES`` at each batch size.

A run is skipped when the latest smaller run of the same method says it would end past the deadline. Where the
engine's forwards compile (``compile``, ``cudagraph``), each of its timed runs follows an untimed one of the same
batch and schedule: a new batch's shapes compile (and in ``cudagraph`` mode are captured) there, not in the time.
"""

from __future__ import annotations

from bench.gpu_check.check import Check
from bench.gpu_check.deadline import Deadline
from bench.gpu_check.schedules import ENGINE_SCHEDULES
from bench.hf_baselines import hf_assisted_one
from sidecar.runtime.capture import compiles


def throughput(check: Check, deadline: Deadline) -> dict:
    batches = [int(b) for b in check.args.batches.split(",") if b]
    last: dict[str, tuple[int, float]] = {}  # method -> (batch, seconds) of its latest run
    compiled = compiles(check.pair.target) or compiles(check.pair.draft)

    def skip(method: str, batch: int, runs: int = 1) -> str | None:
        # a run's time grows at most linearly with its batch: the latest smaller run bounds the next
        estimate = last[method][1] * batch / last[method][0] if method in last else 0.0
        return deadline.skip_reason(runs * estimate)

    # HF assisted generation takes one prompt at a time, so it has a batch-1 figure only; it runs first, so that
    # a large batch that uses up the time leaves the batch-1 comparison whole
    assisted: dict = {"documents": 0, "tokens": 0, "seconds": 0.0}
    for prompt in check.prompts[: check.args.assisted_documents]:
        estimate = assisted["seconds"] / assisted["documents"] if assisted["documents"] else 0.0
        if reason := deadline.skip_reason(estimate):
            assisted["stopped"] = reason
            break
        run = hf_assisted_one(check.pair, prompt, check.args.max_new_tokens, check.decoder.gamma)
        assisted["documents"] += 1
        assisted["tokens"] += len(run["tokens"])
        assisted["seconds"] += run["wall_s"]
    if assisted["documents"]:
        assisted["tps"] = assisted["tokens"] / assisted["seconds"]
    rows = []
    for batch in batches:
        prompts = check.prompts[:batch]
        row: dict = {"batch": batch}
        if batch == 1 and "tps" in assisted:
            row["hf_assisted_tps"] = assisted["tps"]
        if reason := skip("hf_plain", batch):
            row["hf_plain"] = reason
            hf = None
        else:
            hf = check.timed_hf_plain(prompts)
            last["hf_plain"] = (batch, hf["seconds"])
            row |= {"hf_plain_tps": hf["tokens"] / hf["seconds"], "hf_plain_peak_gb": hf["peak_gb"]}
        for schedule in ENGINE_SCHEDULES:
            key = f"engine_{schedule}"
            if reason := skip(key, batch, runs=2 if compiled else 1):
                row[key] = reason
                continue
            if compiled:
                check.timed_engine(prompts, batch, schedule)  # untimed: a new batch's shapes compile here
            run = check.timed_engine(prompts, batch, schedule)
            last[key] = (batch, run["seconds"])
            row |= {f"{key}_tps": run["tokens"] / run["seconds"], f"{key}_peak_gb": run["peak_gb"]}
            if hf is not None:
                row[f"{key}_vs_hf_plain"] = row[f"{key}_tps"] / row["hf_plain_tps"]
                # bf16 batched HF and the engine may break near-ties differently; the identity part says where
                row[f"{key}_rows_identical_to_hf_plain"] = sum(
                    o.token_ids == h for o, h in zip(run["outs"], hf["rows"], strict=True))
        rows.append(row)
    return {"rows": rows, "hf_assisted_one_at_a_time": assisted, "schedules": list(ENGINE_SCHEDULES),
            "engine_warmed_per_run": compiled}
