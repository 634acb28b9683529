"""Sidecar measurements on the real pair and real news: acceptance parity, leakage and cost.

    python -m bench.sidecar           # standard (`make bench`): 6 articles, batches 1,16,64, 20 forced runs
    python -m bench.sidecar --full    # 20 articles, 64-token summaries, batches 1,16,64,128, 60 forced runs
    python -m bench.sidecar --quick   # 2 articles cut to 800 chars, 16-token summaries, batches 1,8, 2 forced runs

1. Acceptance parity: teacher-forced alpha = mean over summary positions of sum_v min(p_v, q_v), target p
   on the bare prompt, draft q on (a) the bare prompt, (b) the compound prompt with the sidecar
   instruction visible, (c) the compound prompt with it hidden (what sidecar does while drafting).
2. Leakage (``study.leakage``): names and numbers found in the document but not in its summary; the
   share of tags built from such terms, for the sidecar with the document evicted, with it attended, and
   the standalone tagger (which never sees the document, so its rate is the heuristic's false-positive
   floor). Plus a forced-summary experiment: one greedy summary, N sampled tag generations per
   condition branching from it.
3. Cost: KV bytes per request in the sidecar phase, sidecar-phase decode step time at several batch
   sizes with the document attended vs evicted, next to a bandwidth roofline for this machine, and
   tagging latency per request, sidecar vs standalone.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import (
    Stopwatch,
    add_bench_arguments,
    apply_profile,
    environment,
    markdown_table,
    news_documents,
    parse_bench_args,
    result_name,
    write_results,
)
from sidecar import HASHTAGS, SidecarEngine, SidecarRequest, load_pair
from sidecar.decoding.rows import DecodeRow, DraftHandoff
from sidecar.decoding.sampling import Sampling
from sidecar.runtime.forward import forward, logits_at
from sidecar.runtime.kv_cache import RowKVCache
from study.analysis import alpha, scored_logits
from study.leakage import document_only_terms, leak_rate, leaked_terms

ATTENDED = HASHTAGS.model_copy(update={"name": "hashtags_attended", "attend_document": True})


def acceptance_parity(engine: SidecarEngine, documents: list[str], summaries: list[list[int]]) -> dict:
    pair = engine.pair
    rows = []
    for doc, summary in zip(documents, summaries, strict=True):
        if len(summary) < 2:
            continue
        bare, compound = engine.prompts(SidecarRequest(doc, sidecars=[HASHTAGS]))
        p = scored_logits(pair.target, bare.token_ids, summary)
        rows.append({
            "bare": alpha(p, scored_logits(pair.draft, bare.token_ids, summary)),
            "visible": alpha(p, scored_logits(pair.draft, compound.token_ids, summary)),
            "masked": alpha(p, scored_logits(pair.draft, compound.token_ids, summary,
                                             compound.spans["sidecar:hashtags"])),
        })
    mean = {k: statistics.mean(r[k] for r in rows) for k in ("bare", "visible", "masked")}
    return {"documents": len(rows), **mean,
            "visible_change_pct": 100 * (mean["visible"] / mean["bare"] - 1),
            "masked_change_pct": 100 * (mean["masked"] / mean["bare"] - 1),
            "source_study_small_pair": {"bare": 0.649, "visible": 0.616, "masked": 0.645}}


def leakage(engine: SidecarEngine, documents: list[str], results, standalone, forced_runs: int, seed: int,
            max_new_tokens: int) -> dict:
    terms = [document_only_terms(d, r.main.text) for d, r in zip(documents, results, strict=True)]
    corpus = {}
    for name, tags in (("evicted", [r.sidecars["hashtags"].parsed for r in results]),
                       ("attended", [r.sidecars["hashtags_attended"].parsed for r in results]),
                       ("standalone", [s["hashtags"].parsed for s in standalone])):
        rate, count = leak_rate(tags, terms)
        corpus[name] = {"leak_rate": rate, "tags": count}

    # forced summary: the document whose summary leaves out the most names. Its greedy summary is decoded
    # once; forced_runs sampled copies of each tagging task branch from that one end-of-main state.
    index = max(range(len(documents)), key=lambda i: len(terms[i]))
    copies = {condition: [task.model_copy(update={"name": f"{task.name}_{k}"}) for k in range(forced_runs)]
              for condition, task in (("evicted", HASHTAGS), ("attended", ATTENDED))}
    request = SidecarRequest(documents[index], sidecars=[t for tasks in copies.values() for t in tasks])
    forced_run = engine.run([request], max_new_tokens=max_new_tokens, batch_size=16,
                            sidecar_sampling=Sampling(temperature=0.8, seed=seed))[0]
    alone = engine.standalone([forced_run.main.text] * forced_runs, [HASHTAGS], temperature=0.8, seed=seed,
                              batch_size=16)
    doc_terms = terms[index]
    samples = {condition: [forced_run.sidecars[t.name].parsed for t in tasks] for condition, tasks in copies.items()}
    samples["standalone"] = [s["hashtags"].parsed for s in alone]
    forced = {}
    for name, tag_lists in samples.items():
        leaked = [sorted({t for tag in (tags or []) for t in leaked_terms(tag, doc_terms)}) for tags in tag_lists]
        runs_with_leak = sum(bool(terms_) for terms_ in leaked)
        forced[name] = {"runs": len(tag_lists), "runs_with_a_leaked_tag": runs_with_leak,
                        "share": runs_with_leak / len(tag_lists),
                        "leaked_terms": sorted({t for terms_ in leaked for t in terms_})}
    return {"corpus": corpus, "forced": forced, "forced_document": index,
            "forced_summary": forced_run.main.text, "forced_summary_is_the_corpus_one":
                forced_run.main.token_ids == results[index].main.token_ids,
            "forced_document_only_terms": sorted(doc_terms)[:60]}


def memory_bandwidth_gbs(device: torch.device) -> float:
    """Copy bandwidth (read + write) of a 512 MB buffer: the roofline's bytes-per-second for this machine."""
    src = torch.ones(128 * 1024 * 1024, device=device)  # 512 MB fp32
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        with Stopwatch(device) as sw:
            dst.copy_(src)
        best = min(best, sw.seconds)
    return 2 * src.numel() * 4 / best / 1e9


def bytes_read_per_step(model: torch.nn.Module) -> int:
    """Weight bytes one decode step reads: every layer's weights (a CPU ``OneDNNLinear``'s packed buffer),
    but only one row of the input embedding."""
    total = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            continue
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total


def step_time(engine: SidecarEngine, snapshot, batch: int, steps: int) -> float:
    draft = engine.pair.draft
    cache = RowKVCache.from_snapshots(draft, [snapshot] * batch, steps + 2)
    token = torch.full((batch, 1), 13, dtype=torch.long, device=engine.pair.device)
    times = []
    with torch.inference_mode():
        for _ in range(steps):
            with Stopwatch(engine.pair.device) as sw:
                h = forward(draft, cache, token)
                cache.commit(1)
                logits_at(draft, h, torch.zeros(batch, 1, dtype=torch.long, device=token.device))
            times.append(sw.seconds)
    return statistics.median(times[1:])


def cost(engine: SidecarEngine, document: str, batches: list[int], steps: int) -> dict:
    """Sidecar-phase decode step time at several batch sizes, document attended vs evicted."""
    snapshots = {}

    def keep(handoff: DraftHandoff) -> None:
        _, compound = engine.prompts(SidecarRequest(document, sidecars=[HASHTAGS]))
        cache, slot = handoff.cache, handoff.slot
        main_cols = list(range(len(compound.token_ids), int(cache.lengths[slot])))
        for name, spans in (("evicted", ["prefix", "instruction", "sidecar:hashtags", "suffix"]),
                            ("attended", ["prefix", "document", "instruction", "sidecar:hashtags", "suffix"])):
            snapshots[name] = cache.snapshot(slot, compound.columns(*spans) + main_cols)

    bare, compound = engine.prompts(SidecarRequest(document, sidecars=[HASHTAGS]))
    engine.decoder.decode([DecodeRow(bare.token_ids, 48, compound.token_ids, [compound.spans["sidecar:hashtags"]],
                                     keep_draft=True)], Sampling(), on_handoff=keep)
    weights = bytes_read_per_step(engine.pair.draft)
    bandwidth = memory_bandwidth_gbs(engine.pair.device)
    rows = []
    for batch in batches:
        row = {"batch": batch}
        for name, snap in snapshots.items():
            row[f"{name}_ms"] = 1000 * step_time(engine, snap, batch, steps)
            row[f"{name}_roofline_ms"] = 1000 * (weights + batch * snap.nbytes) / (bandwidth * 1e9)
        row["evicted_over_attended"] = row["evicted_ms"] / row["attended_ms"]
        rows.append(row)
        print(row, flush=True)
    return {"kv_bytes_attended": snapshots["attended"].nbytes, "kv_bytes_evicted": snapshots["evicted"].nbytes,
            "evicted_share": snapshots["evicted"].nbytes / snapshots["attended"].nbytes,
            "draft_weight_bytes_read_per_step": weights, "copy_bandwidth_gbs": bandwidth, "steps": rows}


SIZES = {
    "quick": {"articles": 2, "chars": 800, "max_new_tokens": 16, "batches": "1,8", "forced_runs": 2},
    "standard": {"articles": 6, "chars": 3000, "max_new_tokens": 64, "batches": "1,16,64", "forced_runs": 20},
    "full": {"articles": 20, "chars": 3000, "max_new_tokens": 64, "batches": "1,16,64,128", "forced_runs": 60},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="qwen-coder-small")
    parser.add_argument("--articles", type=int)
    parser.add_argument("--chars", type=int, help="the source study cut articles to 3,000 characters")
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--batches")
    parser.add_argument("--forced-runs", type=int)
    parser.add_argument("--seed", type=int, default=7)
    add_bench_arguments(parser)
    args = parse_bench_args(parser)
    apply_profile(args, SIZES)
    pair = load_pair(args.pair)
    engine = SidecarEngine(pair)
    documents = news_documents(args.articles, args.chars)
    env = environment(pair.device, pair.dtype, pair.capture_mode)

    requests = [SidecarRequest(d, sidecars=[HASHTAGS, ATTENDED]) for d in documents]
    start = time.perf_counter()
    results = engine.run(requests, max_new_tokens=args.max_new_tokens, batch_size=8)
    print(f"summaries + sidecars in {time.perf_counter() - start:.0f}s", flush=True)
    summaries = [r.main.token_ids[:-1] if r.main.finish_reason == "eos" else r.main.token_ids for r in results]
    standalone = engine.standalone([r.main.text for r in results], [HASHTAGS], batch_size=8)

    parity = acceptance_parity(engine, documents, summaries)
    print(parity, flush=True)
    leaks = leakage(engine, documents, results, standalone, args.forced_runs, args.seed, args.max_new_tokens)
    print(leaks, flush=True)
    costs = cost(engine, documents[0], [int(b) for b in args.batches.split(",")], steps=6)

    # tagging latency per request at batch 1: sidecar continues from its cache; standalone prefills
    one = engine.run([SidecarRequest(documents[0], sidecars=[HASHTAGS])], max_new_tokens=args.max_new_tokens)[0]
    alone = engine.standalone([one.main.text], [HASHTAGS], batch_size=1)[0]["hashtags"]
    tags = one.sidecars["hashtags"].stats
    latency = {"sidecar_s": tags.wall_seconds, "standalone_s": alone.stats.wall_seconds,
               "sidecar_s_per_token": tags.wall_seconds / tags.new_tokens,
               "standalone_s_per_token": alone.stats.wall_seconds / alone.stats.new_tokens,
               "sidecar_feed_tokens": one.sidecars["hashtags"].stats.prefill_tokens,
               "standalone_feed_tokens": alone.stats.prefill_tokens,
               "sidecar_tokens": one.sidecars["hashtags"].stats.new_tokens, "standalone_tokens": alone.stats.new_tokens}

    examples = [{"summary": r.main.text, "sidecar": r.sidecars["hashtags"].parsed,
                 "attended": r.sidecars["hashtags_attended"].parsed, "standalone": s["hashtags"].parsed}
                for r, s in zip(results[:5], standalone[:5], strict=True)]
    payload = {"environment": env, "args": vars(args), "acceptance_parity": parity, "leakage": leaks, "cost": costs,
               "tagging_latency_batch1": latency, "examples": examples}
    table = markdown_table(costs["steps"], [("batch", "batch"), ("attended_ms", "attended ms/step"),
                                            ("evicted_ms", "evicted ms/step"),
                                            ("attended_roofline_ms", "attended roofline ms"),
                                            ("evicted_roofline_ms", "evicted roofline ms"),
                                            ("evicted_over_attended", "evicted ÷ attended")])
    c, f = leaks["corpus"], leaks["forced"]
    markdown = (
        f"Sidecar on {env['device']} ({env['dtype']}), pair `{args.pair}`, {parity['documents']} real news articles "
        f"cut to {args.chars} chars, {args.max_new_tokens}-token summaries ({args.profile} sizes).\n\n"
        f"- Acceptance parity (teacher-forced alpha): bare {parity['bare']:.3f}, instruction visible "
        f"{parity['visible']:.3f} ({parity['visible_change_pct']:+.1f}%), masked {parity['masked']:.3f} "
        f"({parity['masked_change_pct']:+.1f}%).\n"
        f"- Leak rate over the corpus (share of tags built from document-only terms): evicted "
        f"{c['evicted']['leak_rate']:.1%} of {c['evicted']['tags']}, attended {c['attended']['leak_rate']:.1%} of "
        f"{c['attended']['tags']}, standalone {c['standalone']['leak_rate']:.1%} of {c['standalone']['tags']}.\n"
        f"- Forced summary (article {leaks['forced_document']}, one greedy summary, {args.forced_runs} sampled tag "
        f"generations per condition): runs with a leaked tag: evicted {f['evicted']['share']:.0%}, attended "
        f"{f['attended']['share']:.0%}, standalone {f['standalone']['share']:.0%}; leaked terms: evicted "
        f"{', '.join(f['evicted']['leaked_terms']) or 'none'}; attended "
        f"{', '.join(f['attended']['leaked_terms']) or 'none'}; standalone "
        f"{', '.join(f['standalone']['leaked_terms']) or 'none'}.\n"
        f"- KV per request in the sidecar phase: attended {costs['kv_bytes_attended'] / 1e6:.1f} MB, evicted "
        f"{costs['kv_bytes_evicted'] / 1e6:.1f} MB ({costs['evicted_share']:.0%}); copy bandwidth "
        f"{costs['copy_bandwidth_gbs']:.1f} GB/s.\n"
        f"- Tagging latency at batch 1: sidecar {latency['sidecar_s']:.2f}s (feeds {latency['sidecar_feed_tokens']} "
        f"tokens) vs standalone {latency['standalone_s']:.2f}s (prefills {latency['standalone_feed_tokens']}).\n\n"
        f"{table}")
    write_results(result_name("sidecar", pair.device, args.pair, args.profile, pair.dtype), payload, markdown)


if __name__ == "__main__":
    main()
