"""Padded one-row forwards: the engine at batch 1 with and without ``StackRunner.pad_to``, and with and without
its controller pricing them at their padded width, in one process.

    python -m bench.padded_widths               # 8 real news articles, 64 new tokens, fastest of 3 runs each
    python -m bench.padded_widths --articles 2 --repeats 1

An eager decode forward of one row runs at the cheapest width that holds it, as timed at load
(``sidecar.runtime.padding``), and the step controller times and prices it at that width
(``GammaController.runs_at``). Here three decoders over the same loaded pair (each its own controller) decode
each article in turn: with the widths the runners measured, priced padded (the engine); the same forwards priced
at their own width (``decode_tokens`` emptied: the controller before it knew the padding); and every forward at
its own width. Each article's fastest run of each counts.

Beside them, the check of the widths themselves: each model's whole one-row forward (our stack, unpadded) at 1 to 8
columns after the first article's prompt, timed in turn (median of ``--rounds``), and the widths those times would
choose by the runners' rule (``PaddedWidths.choose``), beside the widths the runners chose at load from their own
forwards over a scratch cache (``sidecar.runtime.padding``). Writes bench/results/padded_widths_<device>[_bf16].json
and markdown.
"""

from __future__ import annotations

import argparse

import torch

from bench.common import (
    Stopwatch,
    add_bench_arguments,
    environment,
    markdown_table,
    medians_in_turn,
    news_documents,
    parse_bench_args,
    result_name,
    write_results,
)
from sidecar import SidecarEngine, SidecarRequest, SpeculativeDecoder, load_pair
from sidecar.runtime.capture import runner_of
from sidecar.runtime.forward import forward, prefill
from sidecar.runtime.kv_cache import RowKVCache
from sidecar.runtime.padding import MAX_WIDTH, PaddedWidths

# decoder -> its results' key: padded forwards priced padded (the engine), the same priced at their own width, none
VARIANTS = {"padded": "padded", "padded, priced at own width": "padded_unpriced", "own width": "own_width"}


def forward_ms(model, context: list[int], rounds: int) -> list[float]:
    """Median ms of ``model``'s one-row decode forward of 1 .. ``MAX_WIDTH`` columns after ``context``, unpadded
    (the caller empties the runner's ``pad_to``), timed in turn; the cache rolled back after each."""
    with torch.inference_mode():
        cache = RowKVCache(model, 1, len(context) + MAX_WIDTH)
        prefill(model, cache, [context], None)

    def call(width: int):
        return lambda: (forward(model, cache, torch.tensor([context[-width:]], device=model.device)),
                        cache.rollback([len(context)]))

    with torch.inference_mode():  # as the engine runs them
        return [s * 1e3 for s in medians_in_turn([call(w) for w in range(1, MAX_WIDTH + 1)], rounds, model.device)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="qwen-coder-small")
    parser.add_argument("--articles", type=int, default=8)
    parser.add_argument("--chars", type=int, default=1500, help="cut each article to this many characters")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each decoder per article (the fastest counts)")
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds of the whole forwards at each width")
    parser.add_argument("--dtype", default=None)
    add_bench_arguments(parser)
    args = parse_bench_args(parser)

    pair = load_pair(args.pair, dtype=args.dtype, capture="eager")
    prompts = [SidecarEngine(pair).prompts(SidecarRequest(d))[0].token_ids
               for d in news_documents(args.articles, args.chars)]
    runners = [runner_of(pair.target), runner_of(pair.draft)]
    measured = [runner.pad_to for runner in runners]
    decoders = {name: SpeculativeDecoder(pair, gamma=4, adaptive=True) for name in VARIANTS}
    decoders["padded, priced at own width"].controller.decode_tokens = {}

    def run(name: str, prompt: list[int], limit: int) -> tuple[float, int]:
        for runner, widths in zip(runners, measured, strict=True):
            runner.pad_to = widths if name != "own width" else PaddedWidths()
        with Stopwatch(pair.device) as sw:
            out = decoders[name].generate([prompt], max_new_tokens=limit)[0]
        return sw.seconds, out.stats.target_forwards

    for name in decoders:  # one-off allocation and kernel selection costs
        run(name, prompts[0][:64], 4)
    for runner in runners:
        runner.pad_to = PaddedWidths()
    widths = []
    for name, model, chosen in (("target", pair.target, measured[0]), ("draft", pair.draft, measured[1])):
        ms = forward_ms(model, prompts[0], args.rounds)
        widths.append({"model": name, "forward_ms": ms, "chosen_at_load": str(chosen.widths),
                       "from_whole_forwards": str(PaddedWidths.choose(ms).widths)})
        print(widths[-1], flush=True)
    rows = []
    for i, prompt in enumerate(prompts):
        runs = {name: [run(name, prompt, args.max_new_tokens) for _ in range(args.repeats)] for name in decoders}
        rows.append({"article": i, **{f"{key}_s": min(seconds for seconds, _ in runs[name])
                                      for name, key in VARIANTS.items()},
                     **{f"{key}_target_forwards": runs[name][0][1] for name, key in VARIANTS.items()}})
        print(rows[-1], flush=True)
    padded, unpriced, own = (sum(r[f"{key}_s"] for r in rows) for key in VARIANTS.values())
    summary = [{"articles": len(rows), "padded_s": padded, "padded_unpriced_s": unpriced, "own_width_s": own,
                "speedup": own / padded, "faster_articles": sum(r["padded_s"] < r["own_width_s"] for r in rows),
                "pricing_speedup": unpriced / padded,
                "faster_priced": sum(r["padded_s"] < r["padded_unpriced_s"] for r in rows),
                "target_widths": str(measured[0].widths), "draft_widths": str(measured[1].widths)}]
    env = environment(pair.device, pair.dtype, pair.capture_mode)
    table = markdown_table(summary, [("articles", "articles"), ("own_width_s", "forwards at their own width, s"),
                                     ("padded_unpriced_s", "padded, priced at own width, s"),
                                     ("padded_s", "padded, s"), ("speedup", "speed-up of padding"),
                                     ("faster_articles", "articles faster padded"),
                                     ("pricing_speedup", "speed-up of pricing padded"),
                                     ("faster_priced", "articles faster priced padded"),
                                     ("target_widths", "target: width of 1..8 columns"),
                                     ("draft_widths", "draft: width of 1..8 columns")])
    width_table = markdown_table(
        [{**w, **{f"w{k + 1}": ms for k, ms in enumerate(w["forward_ms"])}} for w in widths],
        [("model", "model"), *((f"w{k}", f"{k} col, ms") for k in range(1, MAX_WIDTH + 1)),
         ("chosen_at_load", "widths chosen at load"),
         ("from_whole_forwards", "widths these forwards choose")])
    markdown = (f"The engine at batch 1 ({env['dtype']}, capture mode eager), pair `{args.pair}`, "
                f"{args.max_new_tokens} new tokens per article, with one-row forwards at the widths the runners "
                f"measured at load (the controller pricing them at those widths, or at their own) and at their own "
                f"width, in turn in one process, fastest of {args.repeats} runs per article "
                f"(bench/padded_widths.py).\n\n{table}\n\nThe widths checked against whole forwards: each model's "
                f"one-row forward, unpadded, after the first article's prompt ({len(prompts[0])} tokens), median of "
                f"{args.rounds} rounds in turn, and the widths of 1..{MAX_WIDTH} columns those times choose "
                f"(`PaddedWidths.choose`).\n\n{width_table}")
    name = result_name("padded_widths", pair.device, args.pair, args.profile, pair.dtype)
    write_results(name, {"environment": env, "args": vars(args), "summary": summary, "rows": rows,
                                "widths": widths}, markdown)


if __name__ == "__main__":
    main()
