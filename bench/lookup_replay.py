"""Prompt lookup on real summaries: the engine's copies against the rule replayed over its own output, and HF's.

    python -m bench.lookup_replay --dtype bf16 --articles 6      # batch 1, gamma 4, 64 new tokens
    python -m bench.lookup_replay --skip-hf                      # without HF's prompt-lookup generate

Per article, the adaptive engine decodes at batch 1; its output then replays (``study.lookup_replay``):
- the engine's own decisions, which must give its lookup counters exactly (exit 1 otherwise);
- a copy at every step boundary at width gamma, by the engine's rule, by HF's, by the occurrence that shares
  the most context (``longest_match_rule``) and by the occurrence whose copy holds longest (``foresight``: an
  oracle, what a choice of occurrence could at best win), in tokens per target forward;
- a copy after every position of the output (the teacher-forced count, which overstates acceptance).
HF's prompt-lookup ``generate`` (``prompt_lookup_num_tokens`` = gamma) is run too, its target forwards counted,
where its output is the engine's. Writes bench/results/lookup_replay_<device>[_bf16].json and a markdown table.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from bench.common import (
    add_bench_arguments,
    environment,
    markdown_table,
    news_documents,
    parse_bench_args,
    result_name,
    write_results,
)
from bench.hf_baselines import hf_speculative_one
from sidecar import SidecarEngine, SidecarRequest, SpeculativeDecoder, load_pair
from sidecar.models.pair import ModelPair
from study.lookup_replay import (
    CopyRule,
    Replay,
    engine_rule,
    engine_steps,
    hf_rule,
    longest_match_rule,
    matched,
    per_position,
    stepped,
)
from study.schedule_bound import copy_candidates


def foresight(prompt: list[int], output: list[int]) -> CopyRule:
    """Not a rule but an oracle over ``output``: of every earlier occurrence of the last 1-3 tokens, the
    continuation that ``output`` repeats longest (``study.schedule_bound.copy_candidates``), the choice a rule of
    which occurrence to copy could at best make."""

    def rule(context: Sequence[int], most: int) -> list[int]:
        at = len(context) - len(prompt)
        candidates = copy_candidates(context, len(context), most)
        return list(max(candidates, key=lambda c: matched(c, output, at), default=()))

    return rule


def measure(pair: ModelPair, prompts: list[list[int]], limit: int, width: int,
            skip_hf: bool = False) -> tuple[list[dict], list[dict], list[int]]:
    """(a row per prompt, the summary rows, the prompts whose counters differ from the replay of the engine's
    decisions), the engine adaptive at gamma ``width``, each prompt alone, ``limit`` new tokens."""
    decoder = SpeculativeDecoder(pair, gamma=width, adaptive=True)
    decoder.generate([prompts[0][:64]], max_new_tokens=4)  # one-off allocation and kernel selection costs
    rules = {"engine rule": engine_rule, "HF rule": hf_rule(), "longest-match rule": longest_match_rule}
    rows, totals, mismatches = [], {}, []
    for i, prompt in enumerate(prompts):
        seen = len(decoder.controller.decisions)
        out = decoder.generate([prompt], max_new_tokens=limit)[0]
        st, tokens = out.stats, out.token_ids
        decisions = list(decoder.controller.decisions)[seen:]
        row = {"article": i, "prompt_tokens": len(prompt), "tokens": len(tokens),
               "engine_target_forwards": st.target_forwards, "engine_draft_forwards": st.draft_forwards,
               "engine_lookup_drafted": st.lookup_drafted, "engine_lookup_accepted": st.lookup_accepted}
        if not st.draft_forwards:  # a draft-model step's acceptance is not the rule's
            replay = engine_steps(prompt, tokens, decisions)
            row["replay_matches_counters"] = (replay.drafted, replay.accepted, replay.target_forwards) == (
                st.lookup_drafted, st.lookup_accepted, st.target_forwards)
            if not row["replay_matches_counters"]:
                mismatches.append(i)
        for name, rule in {**rules, "best occurrence (foresight)": foresight(prompt, tokens)}.items():
            walk, forced = stepped(prompt, tokens, width, rule, limit), per_position(prompt, tokens, width, rule, limit)
            row[f"{name} target_forwards"] = walk.target_forwards
            both = totals.setdefault(name, (Replay(), Replay()))
            totals[name] = (both[0] + walk, both[1] + forced)
        if not skip_hf:
            forwards = []  # HF generate's forwards of the target
            hook = pair.target.register_forward_hook(lambda *_, counted=forwards: counted.append(1))
            try:
                hf = hf_speculative_one(pair, prompt, limit, prompt_lookup_num_tokens=width)
            finally:
                hook.remove()
            row |= {"hf_target_forwards": len(forwards), "hf_same_output": hf["tokens"] == tokens}
        rows.append(row)
        print(row, flush=True)

    engine_tokens = sum(r["tokens"] for r in rows)
    summary = [{"what": "engine (adaptive), as run", "tokens_per_target_forward":
                engine_tokens / sum(r["engine_target_forwards"] for r in rows),
                "acceptance": sum(r["engine_lookup_accepted"] for r in rows)
                / max(sum(r["engine_lookup_drafted"] for r in rows), 1)}]
    for name, (walk, forced) in totals.items():
        summary.append({"what": f"{name}, a copy of {width} at every step boundary",
                        "tokens_per_target_forward": walk.tokens_per_target_forward, "acceptance": walk.acceptance,
                        "per_position_acceptance": forced.acceptance})
    same = [r for r in rows if r.get("hf_same_output")]
    if same:
        summary.append({"what": f"HF prompt-lookup generate, articles with the engine's output ({len(same)})",
                        "tokens_per_target_forward": sum(r["tokens"] for r in same)
                        / sum(r["hf_target_forwards"] for r in same),
                        "replayed": sum(r["tokens"] for r in same) / sum(r["HF rule target_forwards"] for r in same)})
    return rows, summary, mismatches


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="qwen-coder-small")
    parser.add_argument("--articles", type=int, default=6)
    parser.add_argument("--chars", type=int, default=1500, help="cut each article to this many characters")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--skip-hf", action="store_true", help="skip HF's prompt-lookup generate")
    add_bench_arguments(parser)
    args = parse_bench_args(parser, argv)

    pair = load_pair(args.pair, dtype=args.dtype)
    engine = SidecarEngine(pair)
    prompts = [engine.prompts(SidecarRequest(d))[0].token_ids for d in news_documents(args.articles, args.chars)]
    limit, width = args.max_new_tokens, args.gamma
    rows, summary, mismatches = measure(pair, prompts, limit, width, args.skip_hf)
    env = environment(pair.device, pair.dtype, pair.capture_mode)
    table = markdown_table(summary, [("what", "copies"), ("tokens_per_target_forward", "tokens per target forward"),
                                     ("replayed", "HF rule replayed"), ("acceptance", "copied tokens accepted"),
                                     ("per_position_acceptance", "per position (teacher-forced)")])
    checked = [r for r in rows if "replay_matches_counters" in r]
    markdown = (f"Prompt lookup on {len(rows)} real news articles cut to {args.chars} chars, pair `{args.pair}` "
                f"({env['dtype']}), batch 1, {limit} new tokens, width {width}.\n\n{table}\n\nThe engine's counters "
                f"equal the replay of its decisions on {len(checked) - len(mismatches)} of {len(checked)} articles "
                f"decoded without the draft model.")
    write_results(result_name("lookup_replay", pair.device, args.pair, args.profile, pair.dtype),
                  {"environment": env, "args": vars(args), "summary": summary, "articles": rows}, markdown)
    if mismatches:
        sys.exit(f"the engine's lookup counters differ from the replay of its decisions on articles {mismatches}")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
