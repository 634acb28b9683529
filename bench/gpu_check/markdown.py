"""The check's report in markdown: a header, then per pair its load line and one paragraph or table per part.

A part that was skipped or raised says so in one line; the others go through their renderer in ``RENDERERS``.
"""

from __future__ import annotations

from bench import host_overhead
from bench.common import markdown_table
from bench.gpu_check import parts


def identity_markdown(ident: dict, r: dict) -> str:
    lines = [f"Identity (engine at batch {ident['batch']} vs HF `generate` on the target alone, batch 1, greedy): "
             f"{ident['identical_output']}: {ident['rows_identical']}/{ident['rows']} rows identical, "
             f"{ident['rows_near_tie']} diverged at a near-tie (allowed), {ident['rows_mismatch']} mismatched (fail); "
             f"{ident['tokens_before_divergence']:.1%} of reference tokens before the first divergence. Reduced "
             f"precision rounds differently at different batch shapes, so where the two tokens' logits are within "
             f"a few roundings of their magnitude (`sidecar.decoding.divergence`) a flip is rounding, not a bug; "
             f"a larger gap is one."]
    if ident["divergences"]:
        lines.append("\n" + markdown_table(ident["divergences"], [
            ("prompt", "prompt"), ("position", "first divergence"), ("hf_token", "HF token"),
            ("engine_token", "engine token"), ("gap", "logit gap"), ("bound", "near-tie bound"),
            ("top2_gap", "target top-2 gap"), ("verdict", "verdict")]))
    return "\n".join(lines)


def syncs_markdown(result: dict, r: dict) -> str:
    runs = [x | {"where": ", ".join(f"{k} ×{v}" for k, v in list(x.get("top_sites", {}).items())[:3])}
            for x in result["runs"]]
    return (f"Device-to-host synchronisations of one decode (counted by {result['counted_by']}), budget: one per "
            "target forward plus one per draft forward:\n\n"
            + markdown_table(runs, [
                ("batch", "batch"), ("syncs", "syncs"), ("target_forwards", "target forwards"),
                ("draft_forwards", "draft forwards"), ("syncs_per_target_forward", "per target forward"),
                ("within_budget", "within budget"), ("hf_plain_syncs_per_step", "HF plain per step"),
                ("where", "top sources"), *([("skipped", "skipped")] if any("skipped" in x for x in runs) else [])]))


def sdpa_markdown(s: dict, r: dict) -> str:
    ops = ", ".join(f"`{k}` ×{v}" for k, v in s["aten_ops"].items()) or "none seen"
    kernels = ", ".join(f"`{k}`" for k in s["cuda_kernels"]) or "–"
    alone = "; ".join(f"{k}: {v}" for k, v in s["backends_alone"].items())
    return f"SDPA ({s['attn_implementation']}): ops {ops}; attention kernels {kernels}. Each backend alone: {alone}."


def memory_markdown(m: dict, r: dict) -> str:
    def gb(key: str) -> str:
        return f"{m[key]:.1f} GB" if key in m else m.get(key.removesuffix("_peak_gb"), "–")

    return (f"Peak memory at batch {m['batch']} ({m['max_new_tokens']} new tokens, `torch.cuda.max_memory_allocated`): "
            f"engine {gb('engine_static_peak_gb')}, HF plain {gb('hf_plain_peak_gb')}; weights "
            f"{m['weights_gb']:.1f} GB.")


def throughput_markdown(t: dict, r: dict) -> str:
    columns = [("batch", "batch"), ("hf_plain_tps", "HF plain tok/s"), ("hf_assisted_tps", "HF assisted tok/s")]
    for schedule in t["schedules"]:
        key = f"engine_{schedule}"
        columns += [(f"{key}_tps", f"engine {schedule} tok/s"), (f"{key}_vs_hf_plain", "vs HF plain"),
                    (f"{key}_rows_identical_to_hf_plain", "rows = HF plain"),
                    *([(f"{key}_peak_gb", "peak GB")] if r["device"].startswith("cuda") else [])]
    # the string values of a row are the reasons its measurements were skipped
    notes = [f"{k} at batch {row['batch']}: {v}" for row in t["rows"] for k, v in row.items() if isinstance(v, str)]
    if "stopped" in t["hf_assisted_one_at_a_time"]:
        notes.append(f"HF assisted: {t['hf_assisted_one_at_a_time']['stopped']}")
    text = ("Tokens/s end to end (prefill included); HF assisted runs one prompt at a time, so it has a batch-1 "
            "figure only:\n\n" + markdown_table(t["rows"], columns))
    return text + ("\n\n" + "; ".join(notes) + "." if notes else "")


RENDERERS = {"identity": identity_markdown, "syncs": syncs_markdown, "sdpa": sdpa_markdown,
             "memory": memory_markdown, "throughput": throughput_markdown}


def pair_markdown(r: dict) -> str:
    if "error" in r:
        return f"### `{r['pair']}`\n\nCould not be loaded and warmed up: {r['error']}."
    capture = f"capture mode {r['capture']}; " if r.get("capture") else ""
    lines = [f"### `{r['pair']}` ({r['dtype']}, {r['dtype_reason']}; {capture}on {r['device']}, loaded in "
             f"{r['load_s']:.0f} s; prompts: {r['prompts']}, mean {r['mean_prompt_tokens']:.0f} tokens)"]
    for part, _, _ in parts.PARTS:  # the module's list, not a copy: the parts check_pair ran, in its order
        value = r.get(part)
        if value is None:
            continue
        if "skipped" in value or "error" in value:
            lines.append(f"\n{part}: {value.get('skipped') or 'error: ' + value['error']}.")
        elif part in RENDERERS:
            lines.append("\n" + RENDERERS[part](value, r))
        lines += [f"\n**{part} failed**: {why}." for why in value.get("failed", [])]
    return "\n".join(lines)


def step_costs_markdown(s: dict) -> str:
    """The step-cost table: one row per model and batch, ms per forward of the draft step and of each verify."""
    if "rows" not in s:
        return f"Step costs: {s.get('skipped') or 'error: ' + s['error']}."
    gammas = sorted({r["gamma"] for r in s["rows"] if r["kind"] == "verify"})
    table: dict[tuple[str, int], dict] = {}
    for r in s["rows"]:
        cell = "draft" if r["kind"] == "draft" else f"verify{r['gamma']}"
        table.setdefault((r["model"], r["batch"]), {"model": r["model"], "batch": r["batch"]})[cell] = r.get("ms", "–")
    size = ("the published shapes" if s["scale"] == "full"
            else "small shapes (the code path only: these times say nothing about the real models)")
    skipped = [f"{r['model']} {r['kind']}{'' if r['gamma'] is None else ' γ=' + str(r['gamma'])} at batch "
               f"{r['batch']}: {r['skipped']}" for r in s["rows"] if "skipped" in r]
    skipped += [f"{model}: {reason}" for model, reason in s["skipped_models"].items()]
    text = (f"Step costs (ms per forward, random-initialised Qwen2.5 at {size}, {s['dtype']}, {s['context']} "
            f"tokens of context per row, median of {s['repeats']} after {s['warmup']} by {s['timer']}; "
            f"`{s.get('table', 'not written')}`):\n\n"
            + markdown_table(list(table.values()), [("model", "model"), ("batch", "batch"), ("draft", "draft step"),
                                                    *((f"verify{g}", f"verify γ={g}") for g in gammas)]))
    return text + ("\n\n" + "; ".join(skipped) + "." if skipped else "")


def capture_markdown(c: dict) -> str:
    """The capture-mode tables: tokens/s per mode, decoding and batch; then each mode's compile counters and
    memory; then issue 40's goals, met or not."""
    if "rows" not in c:
        return f"Capture modes: {c.get('skipped') or 'error: ' + c['error']}."
    peak = c["peak_bandwidth_gb_s"]
    bandwidth = f"{peak:.0f} GB/s peak" if isinstance(peak, float) else "peak bandwidth unknown (not in the catalog)"
    if "copy_bandwidth_gb_s" in c:
        bandwidth += f", a copy reached {c['copy_bandwidth_gb_s']:.0f} GB/s here"
    lines = [f"Capture modes on {c['pair']} ({c['dtype']}; the draft agrees with the target on {c['agreement']:.0%} "
             f"of tokens; {c['prompt_tokens']}-token prompt, {c['new_tokens']} new tokens, decode phase only; "
             f"{c['weight_gb_per_token']:.2f} GB of target weights per token, {bandwidth}). Speculative rows: "
             f"fixed γ={c['gamma']}, no prompt lookup, a static batch of identical rows; \"plain (engine)\": the same "
             "engine at γ=0, its step work around each forward; \"vs plain\" is against the plain loop at the same "
             "batch in the same mode, \"vs engine plain\" against the engine's plain, \"vs eager\" the same row in "
             "eager mode:\n",
             markdown_table([r | {key: f"{r[key]:.0%}" for key in ("bandwidth_share", "copy_bandwidth_share")
                                  if isinstance(r.get(key), float)} for r in c["rows"]], [
                 ("mode", "mode"), ("decoding", "decoding"), ("batch", "batch"), ("tokens_per_s", "tok/s"),
                 ("bandwidth_share", "share of bandwidth"), ("copy_bandwidth_share", "share of copy bandwidth"),
                 ("tokens_per_step", "tokens / target forward"),
                 ("vs_plain", "vs plain"), ("vs_engine_plain", "vs engine plain"), ("vs_eager", "vs eager"),
                 ("rows_identical_to_plain", "rows = plain"),
                 *([("projected_tokens_per_s", "projected tok/s"), ("vs_projected", "measured / projected")]
                   if any("vs_projected" in r for r in c["rows"]) else []),
                 *([("projected_overlapped_tokens_per_s", "projected tok/s, host overlapped"),
                    ("vs_projected_overlapped", "measured / projected overlapped")]
                   if any("vs_projected_overlapped" in r for r in c["rows"]) else []),
                 *([("skipped", "skipped")] if any("skipped" in r for r in c["rows"]) else [])])]
    lines.append("\n" + projection_markdown(c.get("projection", {"skipped": "not run (a result from before it was)"})))
    modes = [m | {"shapes": f"{m['distinct_shapes']['target']} / {m['distinct_shapes']['draft']}"}
             for m in c["modes"]]
    memory = any("memory_allocated_gb" in m for m in modes)
    lines += ["\nPer mode (memory: held once its decoder is gone, less before its first forward: the CUDA graphs' "
              "pools and static buffers; eager is the baseline):\n",
              markdown_table(modes, [
                  ("mode", "mode"), ("compiles", "compiles"), ("recompiles_after_warmup", "recompiles after warm-up"),
                  ("graph_breaks", "graph breaks"), ("cudagraph_skips", "graphs not captured"),
                  ("shapes", "distinct shapes (target / draft)"), ("compile_seconds", "compile s"),
                  *([("memory_allocated_gb", "allocated GB"), ("memory_reserved_gb", "reserved GB")] if memory
                    else [])])]
    lines.append("\nGoals: " + "; ".join(f"{goal}: {verdict}" for goal, verdict in c["goals"].items()) + ".")
    lines += [f"\n**capture modes failed**: {why}." for why in c.get("failed", [])]
    if c["skipped_pairs"]:
        lines.append("\n" + "; ".join(f"{k}: {v}" for k, v in c["skipped_pairs"].items()) + ".")
    return "\n".join(lines)


def host_floor_markdown(h: dict) -> str:
    """The host-floor part: ``bench.host_overhead``'s table on this device, and where it was written."""
    if "rows" not in h:
        return f"Host floors: {h.get('skipped') or 'error: ' + h['error']}."
    where = (f"written to `{h['written']}`, which the cost model reads" if h["written"]
             else "no result file (the code path only)" if h["scale"] == "small" else "no result file")
    lines = [f"Host floors (`bench.host_overhead` on this device: the tiny pair at {h['layers']} layers, hidden 64, "
             f"{h['dtype']}; {where}):\n", host_overhead.table(h["rows"]) if h["rows"] else "No mode measured."]
    if h["skipped_modes"]:
        lines.append("\n" + "; ".join(f"{mode}: {why}" for mode, why in h["skipped_modes"].items()) + ".")
    lines += [f"\n**host floor failed**: {why}." for why in h["failed"]]
    return "\n".join(lines)


def projection_markdown(projection: dict) -> str:
    """What the projected column assumed, or why there is none."""
    if "skipped" in projection:
        return f"Not projected by the cost model: {projection['skipped']}."
    floors = projection["floors"]
    return (f"Projected: the cost model's tokens/s for each row on {projection['gpu']} (`study.cost`: the roofline "
            f"over {projection['context']:g} entries of context per row, plus the host floor of the row's mode, "
            "named below; speculative rows at their measured acceptance; `bench/gpu_check/projected.py`); above 1 "
            "the GPU ran faster than projected. Eager rows also as overlapped: a forward taking the larger of its "
            f"device time and its own host cost. Eager: {floors['eager']}. Cudagraph: {floors['captured']}.")


def markdown(payload: dict) -> str:
    env = payload["environment"]
    lines = [f"GPU check on {env['device']} ({payload['args']['profile']} sizes, {payload['args']['max_new_tokens']} "
             f"new tokens, budget {payload['args']['budget_s']:.0f} s, took {payload['seconds']:.0f} s)."]
    if not payload.get("complete", True):
        lines.append("\n**Incomplete**: written while the check ran, after its last finished part; the parts "
                     "marked not reached had not run.")
    for name, reason in payload["absent"].items():
        lines.append(f"\n`{name}`: skipped, {reason}.")
    if payload.get("fallback"):
        lines.append(f"\n{payload['fallback']}")
    lines += ["\n" + pair_markdown(r) for r in payload["pairs"]]
    if "step_costs" in payload:
        lines.append("\n" + step_costs_markdown(payload["step_costs"]))
    if "host_floor" in payload:
        lines.append("\n" + host_floor_markdown(payload["host_floor"]))
    if "capture" in payload:
        lines.append("\n" + capture_markdown(payload["capture"]))
    return "\n".join(lines)
