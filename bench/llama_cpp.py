"""A CPU anchor a user would pick instead: llama.cpp on the pair's Q4_K_M target GGUF against the engine, batch 1.

    make llama-cpp                       # once: builds llama-cpp-python from its sdist (optional, bench only)
    python -m bench.llama_cpp            # standard: 4 articles, 64 new tokens
    python -m bench.llama_cpp --quick    # 1 short article, 16 new tokens

Both run in one process on the same prompts as ``bench.engine`` (the target's summary prompt over real news
articles, as token ids, so the two tokenize nothing differently), greedy, one article at a time and on the same
number of CPU threads: llama.cpp (``llama_cpp.Llama``) plain on the 4-bit GGUF file the offline pair was
converted from, the engine (``SpeculativeDecoder``, default settings) on that pair, its weights dequantized to the
dtype ``load_pair`` chooses for this machine. The arithmetic differs, so the outputs can; the table says how many
are identical. Where llama_cpp is not installed it says so in one line and exits 0, so ``make bench`` runs on
without it. Writes bench/results/llama_cpp_cpu.json and a markdown table.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import time
from collections.abc import Sequence

import torch

from bench.common import (
    Stopwatch,
    add_bench_arguments,
    environment,
    markdown_table,
    news_documents,
    parse_sized_args,
    peak_rss_gb,
    result_name,
    write_results,
)
from sidecar import SidecarEngine, SidecarRequest, SpeculativeDecoder, load_pair
from sidecar.models.fetch import OFFLINE_PAIRS, gguf_file

SIZES = {
    "quick": {"articles": 1, "chars": 800, "max_new_tokens": 16},
    "standard": {"articles": 4, "chars": 1500, "max_new_tokens": 64},
    "full": {"articles": 8, "chars": 1500, "max_new_tokens": 64},
}
PAIR = "qwen-coder-small"  # the only pair whose GGUF files are at hand (sidecar.models.fetch.OFFLINE_PAIRS)
NOT_INSTALLED = ("skipped: llama_cpp is not installed (`make llama-cpp` builds it from its sdist, once); "
                 "nothing measured")


def llama_generate(llm, prompt: Sequence[int], max_new_tokens: int, eos: set[int]) -> dict:
    """Greedy tokens from llama.cpp after a fresh prefill of ``prompt`` (no cache kept from the last prompt),
    timed like the engine: prefill until the first token, decode for the rest; an end token ends it, uncounted."""
    llm.reset()
    tokens: list[int] = []
    start = time.perf_counter()
    first = None
    for token in llm.generate(list(prompt), temp=0.0, repeat_penalty=1.0, reset=True):
        first = first or time.perf_counter()
        if token in eos:
            break
        tokens.append(token)
        if len(tokens) == max_new_tokens:
            break
    end = time.perf_counter()
    return {"tokens": tokens, "prefill_s": (first or end) - start, "decode_s": end - (first or end),
            "wall_s": end - start}


def summary(articles: list[dict]) -> dict:
    """The one row: end-to-end tokens/s of each over all articles and engine ÷ llama.cpp, with llama.cpp's
    prefill seconds and decode-phase tokens/s (its first token comes from the prefill, so it is not counted)."""
    def total(key: str) -> float:
        return sum(a[key] for a in articles)

    engine_tps = total("engine_tokens") / total("engine_wall_s")
    llama_tps = total("llama_tokens") / total("llama_wall_s")
    return {"setting": "batch 1", "engine_tps": engine_tps, "llama_tps": llama_tps, "ratio": engine_tps / llama_tps,
            "llama_prefill_s": total("llama_prefill_s") / len(articles),
            "llama_decode_tps": (total("llama_tokens") - len(articles)) / total("llama_decode_s"),
            "engine_prefill_s": total("engine_prefill_s") / len(articles),
            "identical": sum(a["engine_token_ids"] == a["llama_token_ids"] for a in articles)}


def markdown(row: dict, args: argparse.Namespace, env: dict, sizes: str, quantisation: str) -> str:
    table = markdown_table([row], [
        ("setting", "setting"), ("engine_tps", "engine tok/s"), ("llama_tps", "llama.cpp tok/s"),
        ("ratio", "engine ÷ llama.cpp"), ("engine_prefill_s", "engine prefill s"),
        ("llama_prefill_s", "llama.cpp prefill s"), ("llama_decode_tps", "llama.cpp decode-phase tok/s")])
    return (f"Engine vs llama.cpp on {env['device']}, {args.threads} threads each, pair `{PAIR}`, {args.articles} "
            f"real news articles cut to {args.chars} chars, {args.max_new_tokens} new tokens, greedy, one article at "
            f"a time ({sizes}). Tokens/s end to end (prefill included); prefill seconds per article.\n\n{table}\n\n"
            f"llama.cpp runs the target's {quantisation} GGUF (4-bit weights, 8-bit activations in its dot "
            f"products, plain decoding); the engine runs those weights dequantized to {env['dtype']}, with its draft, "
            f"so the outputs can differ: {row['identical']} of {args.articles} identical.")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--articles", type=int)
    parser.add_argument("--chars", type=int, help="cut each article to this many characters")
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--threads", type=int, default=2, help="CPU threads of llama.cpp and of torch")
    add_bench_arguments(parser)
    args, _, sizes = parse_sized_args(parser, argv, SIZES)
    if importlib.util.find_spec("llama_cpp") is None:
        print(NOT_INSTALLED, flush=True)
        return
    from llama_cpp import Llama, llama_print_system_info

    torch.set_num_threads(args.threads)
    pair = load_pair(PAIR, device="cpu")  # llama.cpp is built for the CPU: the engine runs there too
    prompts = [SidecarEngine(pair).prompts(SidecarRequest(d))[0].token_ids
               for d in news_documents(args.articles, args.chars)]
    llm = Llama(model_path=str(gguf_file(PAIR, "target")), n_threads=args.threads, n_threads_batch=args.threads,
                n_ctx=max(map(len, prompts)) + args.max_new_tokens + 1, verbose=False)
    decoder = SpeculativeDecoder(pair)
    eos = set(pair.eos_token_ids)
    env = environment(pair.device, pair.dtype)
    print(f"{env['device']} {env['dtype']} ({pair.dtype_reason}): {len(prompts)} prompts, mean "
          f"{sum(map(len, prompts)) / len(prompts):.0f} tokens", flush=True)

    warm = prompts[0][:64]  # first calls pay one-off allocation and kernel selection costs
    llama_generate(llm, warm, 4, eos)
    decoder.generate([warm], max_new_tokens=4)
    articles = []
    for i, prompt in enumerate(prompts):
        llama = llama_generate(llm, prompt, args.max_new_tokens, eos)
        with Stopwatch(pair.device) as sw:
            out = decoder.generate([prompt], max_new_tokens=args.max_new_tokens)[0]
        articles.append({"article": i, "prompt_tokens": len(prompt), "llama_tokens": len(llama["tokens"]),
                         "llama_prefill_s": llama["prefill_s"], "llama_decode_s": llama["decode_s"],
                         "llama_wall_s": llama["wall_s"], "engine_tokens": len(out.token_ids),
                         "engine_prefill_s": out.stats.prefill_seconds, "engine_decode_s": out.stats.decode_seconds,
                         "engine_wall_s": sw.seconds, "llama_token_ids": llama["tokens"],
                         "engine_token_ids": out.token_ids})
        print({k: v for k, v in articles[-1].items() if not k.endswith("token_ids")}, flush=True)

    row = summary(articles)
    quantisation = OFFLINE_PAIRS[PAIR]["target"].model.rsplit(" ", 1)[-1]
    payload = {"environment": env, "args": vars(args), "summary": row, "articles": articles,
               "llama_cpp": {"version": importlib.metadata.version("llama-cpp-python"), "quantisation": quantisation,
                             "system_info": llama_print_system_info().decode().strip()},  # its CPU features
               "peak_rss_gb": peak_rss_gb()}
    write_results(result_name("llama_cpp", pair.device, PAIR, args.profile, pair.dtype), payload,
                  markdown(row, args, env, sizes, quantisation))


if __name__ == "__main__":
    main()
