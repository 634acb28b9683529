"""Engine benchmark: sidecar's engine vs HF plain, HF assisted and HF prompt-lookup generation, same process.

    python -m bench.engine           # standard (`make bench`): 4 articles at batch 1, batch 8, 64 new tokens
    python -m bench.engine --full    # issue #2's sizes: 8 articles, batches 8 and 32, fixed-gamma row too
    python -m bench.engine --quick   # 1 short article, batch 2, 16 new tokens, no int8 draft
    python -m bench.engine --lookup-ablation --batches "" --skip-assisted --no-int8-draft
                                     # batch 1 with prompt lookup off / after 2-token matches only

Ratios are measured side by side in one process on the same prompts (the target's summary prompt over
real news articles), so the machine's speed cancels out. HF generate runs on the same loaded models,
so on CPU it gets the same per-shape Linear kernels as the engine (``sidecar.models.cpu_kernels``): the
baseline is the fastest plain decoding this machine offers. Writes bench/results/engine_<device>.json
and a markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from bench.common import (
    Stopwatch,
    add_bench_arguments,
    apply_profile,
    environment,
    markdown_table,
    news_documents,
    parse_bench_args,
    peak_rss_gb,
    result_name,
    write_results,
)
from bench.hf_baselines import hf_assisted_one, hf_plain_batched, hf_plain_one, hf_speculative_one
from bench.identity import compare, exit_on_mismatch, verdict
from sidecar import SidecarEngine, SidecarRequest, SpeculativeDecoder, load_pair
from sidecar.models.cpu_kernels import quantize_int8
from sidecar.models.loading import load_model, pair_model_ids
from sidecar.models.pair import ModelPair
from study.analysis import predicted_target_forwards


def kv_bytes_per_row(pair: ModelPair, tokens: int) -> dict:
    from sidecar.runtime.kv_cache import RowKVCache

    per_column = {name: RowKVCache(model, 1, 1).bytes_per_column()
                  for name, model in (("target", pair.target), ("draft", pair.draft))}
    return {f"{name}_kv_bytes": tokens * b for name, b in per_column.items()}


SIZES = {
    "quick": {"articles": 1, "chars": 800, "max_new_tokens": 16, "batches": "2", "fixed_gamma": False,
              "int8_draft": False},
    "standard": {"articles": 4, "chars": 1500, "max_new_tokens": 64, "batches": "8", "fixed_gamma": False,
                 "int8_draft": True},
    "full": {"articles": 8, "chars": 1500, "max_new_tokens": 64, "batches": "8,32", "fixed_gamma": True,
             "int8_draft": True},
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="qwen-coder-small")
    parser.add_argument("--articles", type=int)
    parser.add_argument("--chars", type=int, help="cut each article to this many characters")
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--max-copy", type=int, default=None,
                        help="the adaptive engines' longest prompt-lookup copy (default: gamma); HF's prompt-lookup "
                             "generate copies as many")
    parser.add_argument("--batches")
    parser.add_argument("--skip-assisted", action="store_true", help="skip HF assisted and prompt-lookup runs")
    parser.add_argument("--fixed-gamma", action=argparse.BooleanOptionalAction,
                        help="also time the engine with gamma fixed, draft model only (adaptive is the default)")
    parser.add_argument("--int8-draft", action=argparse.BooleanOptionalAction,
                        help="also time the engine with its draft quantized to int8 (CPU)")
    parser.add_argument("--lookup-ablation", action="store_true",
                        help="also time the engine without prompt lookup and with 2-token matches only "
                             "(batch 1; writes engine_*_lookup_ablation results)")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--capture", default=None, choices=["auto", "eager", "compile", "cudagraph", "hf"],
                        help="the engine's capture mode (default: SIDECAR_CAPTURE, else auto); a mode named here "
                             "suffixes the result's name with it")
    add_bench_arguments(parser)
    args = parse_bench_args(parser, argv)
    apply_profile(args, SIZES)
    batches = [int(b) for b in args.batches.split(",") if b]

    pair = load_pair(args.pair, dtype=args.dtype, capture=args.capture)
    # the same target with its draft quantized to int8 (CPU, fp32: torch's dynamic int8 Linear takes float32
    # activations): output must stay identical, acceptance may drop
    int8 = None
    if pair.device.type == "cpu" and pair.dtype == torch.float32 and args.int8_draft and args.pair != "tiny":
        draft = quantize_int8(load_model(pair_model_ids(args.pair)[1], pair.device, pair.dtype))
        int8 = dataclasses.replace(pair, draft=draft)
    engine = SidecarEngine(pair)
    documents = news_documents(max([args.articles, *batches]), args.chars)
    prompts = [engine.prompts(SidecarRequest(d))[0].token_ids for d in documents]
    env = environment(pair.device, pair.dtype, pair.capture_mode)
    print(f"{env['device']} {env['dtype']}: {len(prompts)} prompts, mean {sum(map(len, prompts)) / len(prompts):.0f} "
          f"tokens", flush=True)

    # -- batch 1: decode phase and end to end, per article --
    adaptive = SpeculativeDecoder(pair, gamma=args.gamma, adaptive=True, max_copy=args.max_copy)
    # the draft model alone at a fixed gamma: what the teacher-forced prediction below models
    fixed = SpeculativeDecoder(pair, gamma=args.gamma, adaptive=False, prompt_lookup=False)
    warm = prompts[0][:64]  # first calls pay one-off allocation and kernel selection costs
    hf_plain_one(pair, warm, 4)
    fixed.generate([warm], max_new_tokens=4)
    engines = [("engine", adaptive), *([("engine_fixed", fixed)] if args.fixed_gamma else [])]
    if int8 is not None:
        engines.append(("engine_int8", SpeculativeDecoder(int8, gamma=args.gamma, adaptive=True,
                                                          max_copy=args.max_copy)))
        engines[-1][1].generate([warm], max_new_tokens=4)
    if args.lookup_ablation:  # fp32 variants of the default engine, as cold as it
        engines.append(("engine_no_lookup", SpeculativeDecoder(pair, gamma=args.gamma, prompt_lookup=False)))
        engines.append(("engine_ngram2", SpeculativeDecoder(pair, gamma=args.gamma)))
        engines[-1][1].lookup_min_ngram = 2
    checked = []  # every comparison with HF's output, for the exit status

    def check(prompt: list[int], reference: list[int], candidate: list[int], label: str) -> dict:
        checked.append(compare(pair.target, prompt, reference, candidate, label))
        return checked[-1]

    single = []
    for i, prompt in enumerate(prompts[: args.articles]):
        plain = hf_plain_one(pair, prompt, args.max_new_tokens)
        row = {"article": i, "prompt_tokens": len(prompt), "plain_tokens": len(plain["tokens"]),
               "plain_prefill_s": plain["prefill_s"], "plain_decode_s": plain["decode_s"],
               "plain_wall_s": plain["wall_s"]}
        for name, decoder in engines:
            with Stopwatch(pair.device) as sw:
                out = decoder.generate([prompt], max_new_tokens=args.max_new_tokens)[0]
            same = check(prompt, plain["tokens"], out.token_ids, f"article {i}, {name}, batch 1")
            row |= {f"{name}_tokens": len(out.token_ids), f"{name}_prefill_s": out.stats.prefill_seconds,
                    f"{name}_decode_s": out.stats.decode_seconds, f"{name}_wall_s": sw.seconds,
                    f"{name}_identical": same["identical"], f"{name}_identity": same,
                    f"{name}_tokens_per_target_forward": out.stats.tokens_per_target_forward,
                    f"{name}_draft_forwards": out.stats.draft_forwards,
                    f"{name}_lookup_drafted": out.stats.lookup_drafted,
                    f"{name}_lookup_accepted": out.stats.lookup_accepted}
        if not args.skip_assisted:
            assisted = hf_assisted_one(pair, prompt, args.max_new_tokens, args.gamma)
            lookup = hf_speculative_one(pair, prompt, args.max_new_tokens,
                                        prompt_lookup_num_tokens=args.max_copy or args.gamma)
            for method, run in (("assisted", assisted), ("lookup", lookup)):
                same = check(prompt, plain["tokens"], run["tokens"], f"article {i}, HF {method}")
                row |= {f"{method}_wall_s": run["wall_s"], f"{method}_identical": same["identical"],
                        f"{method}_identity": same}
        single.append(row)
        print(row, flush=True)

    def total(key: str) -> float:
        return sum(r[key] for r in single)

    def outputs(names: list[str]) -> dict:
        """The "identical output" fields of a summary row: exact equality and the divergence rule's verdict."""
        comparisons = [r[f"{name}_identity"] for r in single for name in names]
        return {"identical": all(c["identical"] for c in comparisons), "identity": verdict(comparisons)}

    # decode-phase tokens exclude the first one, which each method gets from its prefill
    names = ("plain", *(name for name, _ in engines))
    decode_tps = {name: (total(f"{name}_tokens") - len(single)) / total(f"{name}_decode_s") for name in names}
    e2e_tps = {name: total(f"{name}_tokens") / total(f"{name}_wall_s") for name in names}
    summary_rows = [{
        "setting": "batch 1", "baseline": "HF plain generate",
        "decode_ratio": decode_tps["engine"] / decode_tps["plain"],
        "decode_ratio_fixed_gamma": decode_tps["engine_fixed"] / decode_tps["plain"] if args.fixed_gamma else None,
        "e2e_ratio": e2e_tps["engine"] / e2e_tps["plain"],
        "engine_tps": e2e_tps["engine"], "baseline_tps": e2e_tps["plain"],
        **outputs([name for name, _ in engines]),
    }]
    if int8 is not None:
        summary_rows.append({"setting": "batch 1, int8 draft", "baseline": "HF plain generate",
                             "decode_ratio": decode_tps["engine_int8"] / decode_tps["plain"],
                             "e2e_ratio": e2e_tps["engine_int8"] / e2e_tps["plain"],
                             "engine_tps": e2e_tps["engine_int8"], "baseline_tps": e2e_tps["plain"],
                             **outputs(["engine_int8"])})
    for name, setting in (("engine_no_lookup", "batch 1, no prompt lookup"),
                          ("engine_ngram2", "batch 1, copies after 2-token matches only")):
        if args.lookup_ablation:
            summary_rows.append({"setting": setting, "baseline": "HF plain generate",
                                 "decode_ratio": decode_tps[name] / decode_tps["plain"],
                                 "e2e_ratio": e2e_tps[name] / e2e_tps["plain"], "engine_tps": e2e_tps[name],
                                 "baseline_tps": e2e_tps["plain"],
                                 **outputs([name])})
    if not args.skip_assisted:
        assisted_tps = total("plain_tokens") / total("assisted_wall_s")
        summary_rows.append({"setting": "batch 1", "baseline": "HF assisted generate",
                             "e2e_ratio": e2e_tps["engine"] / assisted_tps, "engine_tps": e2e_tps["engine"],
                             "baseline_tps": assisted_tps,
                             **outputs(["assisted"])})
        lookup_tps = total("plain_tokens") / total("lookup_wall_s")
        summary_rows.append({"setting": "batch 1", "baseline": "HF prompt-lookup generate",
                             "e2e_ratio": e2e_tps["engine"] / lookup_tps, "engine_tps": e2e_tps["engine"],
                             "baseline_tps": lookup_tps, **outputs(["lookup"])})

    # HF assisted, one document at a time, on every document a batch decodes: each batch is compared on its
    # own documents (their summaries differ in length, and tokens/s with them). The target's prefill of each
    # is timed too, for the prefill ceiling.
    assisted_runs = [{"article": r["article"], "tokens": r["plain_tokens"], "wall_s": r["assisted_wall_s"],
                      "prefill_s": r["plain_prefill_s"], "identity": r["assisted_identity"], "token_ids": None}
                     for r in single if "assisted_wall_s" in r]
    if not args.skip_assisted:
        for i in range(len(single), max(batches, default=0)):
            assisted = hf_assisted_one(pair, prompts[i], args.max_new_tokens, args.gamma)
            run = {"article": i, "tokens": len(assisted["tokens"]), "wall_s": assisted["wall_s"],
                   "prefill_s": hf_plain_one(pair, prompts[i], 1)["prefill_s"], "token_ids": assisted["tokens"]}
            assisted_runs.append(run)
            print({k: v for k, v in run.items() if k != "token_ids"}, flush=True)

    # -- batched throughput --
    batched = []
    for batch in batches:
        chunk = prompts[:batch]
        hf = hf_plain_batched(pair, chunk, args.max_new_tokens)
        hf_tokens = sum(map(len, hf["tokens"]))
        with Stopwatch(pair.device) as sw:
            outs = adaptive.generate(chunk, max_new_tokens=args.max_new_tokens, batch_size=batch)
        engine_tokens = sum(len(o.token_ids) for o in outs)
        # HF's reference here is its padded batched generate; each divergence is classified from the target's
        # logits at batch 1 (what bench.identity.compare does), equal to the padded batch's up to rounding
        identity = [check(p, h, o.token_ids, f"article {j}, engine, batch {batch}")
                    for j, (p, h, o) in enumerate(zip(chunk, hf["tokens"], outs, strict=True))]
        row = {"batch": batch, "hf_plain_s": hf["wall_s"], "hf_plain_tps": hf_tokens / hf["wall_s"],
               "engine_s": sw.seconds, "engine_tps": engine_tokens / sw.seconds,
               "engine_prefill_s_per_doc": max(o.stats.prefill_seconds for o in outs) / batch,
               "gamma_decisions": list(adaptive.controller.decisions)[-20:],
               "draft_forwards": sum(o.stats.draft_forwards for o in outs),
               "identical": all(c["identical"] for c in identity), "identity": identity}
        if not args.skip_assisted:
            # HF assisted generation is batch-size 1 only: one document at a time, on this batch's documents
            timed = assisted_runs[:batch]
            assisted_s = sum(r["wall_s"] for r in timed)
            row |= {"assisted_documents": len(timed),
                    "assisted_one_at_a_time_tps": sum(r["tokens"] for r in timed) / assisted_s,
                    # documents assisted decoded only for this comparison are checked against the engine's output
                    "assisted_identity": [r["identity"] if r["token_ids"] is None
                                          else check(prompts[r["article"]], r["token_ids"],
                                                     outs[r["article"]].token_ids,
                                                     f"article {r['article']}, engine, batch {batch} vs HF assisted")
                                          for r in timed],
                    # Any engine must prefill every prompt on the target; on a compute-bound CPU that costs
                    # per prompt what it costs alone, so even with free decoding the engine's lead over
                    # assisted generation is at most assisted time per document / target prefill time.
                    "prefill_ceiling_vs_assisted": assisted_s / sum(r["prefill_s"] for r in timed)}
        batched.append(row)
        summary_rows.append({"setting": f"batch {batch}", "baseline": "HF plain batched generate",
                             "e2e_ratio": row["engine_tps"] / row["hf_plain_tps"], "engine_tps": row["engine_tps"],
                             "baseline_tps": row["hf_plain_tps"], "identical": row["identical"],
                             "identity": verdict(identity)})
        if row.get("assisted_one_at_a_time_tps"):
            summary_rows.append({"setting": f"batch {batch}", "baseline": "HF assisted, one doc at a time",
                                 "e2e_ratio": row["engine_tps"] / row["assisted_one_at_a_time_tps"],
                                 "engine_tps": row["engine_tps"], "baseline_tps": row["assisted_one_at_a_time_tps"],
                                 "ceiling": row["prefill_ceiling_vs_assisted"],
                                 "identical": all(c["identical"] for c in row["assisted_identity"]),
                                 "identity": verdict(row["assisted_identity"])})
        print(row, flush=True)

    # -- acceptance under batching: tokens per target forward vs the teacher-forced prediction --
    batch = min(8, len(prompts))
    outs = fixed.generate(prompts[:batch], max_new_tokens=args.max_new_tokens, batch_size=batch)
    measured = sum(len(o.token_ids) for o in outs) / sum(o.stats.target_forwards for o in outs)
    predicted_forwards = sum(predicted_target_forwards(pair, p, o.token_ids, args.gamma, args.max_new_tokens)
                             for p, o in zip(prompts[:batch], outs, strict=True))
    predicted = sum(len(o.token_ids) for o in outs) / predicted_forwards
    acceptance = {"batch": batch, "gamma": args.gamma, "measured_tokens_per_target_forward": measured,
                  "predicted_tokens_per_target_forward": predicted, "ratio": measured / predicted,
                  "acceptance_rate": sum(o.stats.accepted for o in outs) / max(sum(o.stats.drafted for o in outs), 1)}
    print(acceptance, flush=True)

    mean_tokens = sum(map(len, prompts[: args.articles])) / args.articles + args.max_new_tokens
    memory = {"peak_rss_gb": peak_rss_gb(), **kv_bytes_per_row(pair, int(mean_tokens))}
    payload = {"environment": env, "args": vars(args), "decode_tokens_per_s": decode_tps,
               "end_to_end_tokens_per_s": e2e_tps, "summary": summary_rows, "batch1": single,
               "batched": batched,
               "assisted_one_at_a_time": [{k: v for k, v in r.items() if k != "token_ids"} for r in assisted_runs],
               "acceptance_under_batching": acceptance, "memory": memory}
    table = markdown_table(summary_rows, [
        ("setting", "setting"), ("baseline", "vs"), ("decode_ratio", "decode-phase ratio"),
        ("e2e_ratio", "end-to-end ratio"), ("ceiling", "prefill ceiling"), ("engine_tps", "engine tok/s"),
        ("baseline_tps", "baseline tok/s"), ("identity", "identical output")])
    markdown = (f"Engine on {env['device']} ({env['dtype']}, {env['threads']} threads), pair `{args.pair}`, "
                f"{args.articles} real news articles cut to {args.chars} chars, {args.max_new_tokens} new tokens, "
                f"gamma {args.gamma} ({args.profile} sizes).\n\n{table}\n\n"
                f"HF assisted runs one document at a time over the documents of the batch it is compared with. "
                f"Prefill ceiling: the most any engine could gain over HF assisted generation here, its time per "
                f"document over the target's prefill of that document (measured at batch 1), which no engine "
                f"skips.\n\nTokens per target forward at batch {batch}: "
                f"{measured:.2f} measured vs {predicted:.2f} teacher-forced prediction ({measured / predicted:.0%}). "
                f"Peak RSS {memory['peak_rss_gb']:.1f} GB; KV per row "
                f"{memory['target_kv_bytes'] / 1e6:.1f} MB target + "
                f"{memory['draft_kv_bytes'] / 1e6:.1f} MB draft.")
    name = result_name("engine", pair.device, args.pair, args.profile, pair.dtype)
    name += f"_{args.capture}" if args.capture else ""
    write_results(name + ("_lookup_ablation" if args.lookup_ablation else ""), payload, markdown)
    exit_on_mismatch(checked)


if __name__ == "__main__":
    main()
