"""The capture-mode part: plain and speculative tokens/s of the largest pair that fits, per capture mode
(``sidecar.runtime.capture``: eager and cudagraph on CUDA, eager and compile elsewhere), with what capturing costs.

The pair is ``synthetic_pair``'s: random weights of Qwen2.5-7B's and -1.5B's published shapes (``full``, the
default on CUDA; Qwen2.5-1.5B and -0.5B when the first does not fit) or ``SMALL`` ones (``small``: the code path
only), whose draft agrees with the target on ``AGREEMENT`` of the tokens. Per mode, in one process, after a
warm-up run of every shape (where compiles and CUDA graph captures happen), the fastest of ``TIMED_RUNS``:

* plain: the target alone, one token per forward (``sidecar.runtime.forward`` in the mode, greedy on the device),
  ``--max-new-tokens`` tokens, at each of ``--capture-batches`` (identical rows); with the share of the GPU's
  peak memory bandwidth it reaches: the target's weights but its input embedding (of which a forward reads one
  row per token) per forward, over the time per forward, over the peak bandwidth of ``study/cost/gpus.json``
  (unknown for a GPU it does not list), and over the bandwidth a large copy reaches on the device
  (``bandwidth.copy_bandwidth``, measured before the pair loads);
* speculative: ``SpeculativeDecoder`` in the mode, fixed gamma (``--gamma``), no prompt lookup, static batches
  of identical rows at each of ``--capture-batches`` (so every row accepts alike and the step's shapes stay
  those of the warm-up), ``--max-new-tokens`` tokens each; tokens/s of the decode phase (prefill excluded, as
  in plain), its ratio to plain at the same batch in the same mode, captured over eager at the same batch, and
  how many rows wrote exactly plain decoding's tokens (greedy: all of them);
* plain (engine): the same engine at gamma 0 (``ENGINE_PLAIN``), likewise: plain decoding with the engine's step
  work around each forward (planning, the step's one read, bookkeeping), so its ratio to plain is what that work
  costs on this device, and speculation's ratio to it (``vs_engine_plain``) compares like with like; the goal
  is read against the loop above, the faster plain. Each run is a ``generate`` call as
  a user makes it: its KV caches are those the warm-up run gave back (``sidecar.runtime.pools``), so in
  cudagraph mode the timed runs replay the graphs the warm-up captured over their addresses; the warm-up
  compiles greedy chains only (``set_sampled``);
* the mode's compiles, recompiles after warm-up (must be 0), graph breaks (must be 0), in cudagraph mode the
  graphs inductor left uncaptured with its reasons (must be 0: such a graph runs at compile mode's speed),
  distinct shapes and compile seconds (``runner_of(model).counters``), and on CUDA the memory the mode still
  holds once its decoder is gone and the allocator's free blocks are returned: ``torch.cuda.memory_allocated``
  and ``memory_reserved`` less before its first forward (CUDA graphs' pools and static buffers; eager's row is
  the baseline, about 0).

Goals (issue 40), each reported met or not met: the captured plain step reaches >= 70% of memory bandwidth (the
catalog's peak; on a GPU it does not list, the measured copy bandwidth, and the verdict says so);
speculation at batch 1 >= 1.5x captured plain; captured is never slower than eager at any batch. A measurement
that would end past the part's deadline is skipped and says so; a pair that runs out of memory gives way to the
next smaller one; a batch that runs out of memory is skipped and says so.
"""

from __future__ import annotations

import gc
import time

import torch
import torch._dynamo

from bench.gpu_check.bandwidth import copy_bandwidth
from bench.gpu_check.deadline import Deadline
from bench.gpu_check.step_costs import SMALL
from bench.gpu_check.synthetic_pair import AGREEMENT, prompt_for, synthetic_pair
from sidecar.decoding.decoder import SpeculativeDecoder
from sidecar.models.pair import ModelPair
from sidecar.runtime.capture import runner_of
from sidecar.runtime.forward import forward, logits_at, prefill
from sidecar.runtime.kv_cache import RowKVCache
from sidecar.runtime.pools import release_free
from sidecar.runtime.syncs import synchronize
from sidecar.runtime.warmup import batch_buckets, set_sampled
from study.cost.catalog import GPU, find_gpu, load_catalog
from study.cost.workload import QWEN2_5_1_5B_CONFIG, QWEN2_5_7B_CONFIG

# Qwen2.5-0.5B-Instruct's published config: the draft of the fallback pair
QWEN2_5_0_5B_CONFIG = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
                       "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936,
                       "tie_word_embeddings": True}
# largest first: the first that fits the device's memory is measured
FULL_PAIRS = {"Qwen2.5-7B + 1.5B (random weights)": (QWEN2_5_7B_CONFIG, QWEN2_5_1_5B_CONFIG),
              "Qwen2.5-1.5B + 0.5B (random weights)": (QWEN2_5_1_5B_CONFIG, QWEN2_5_0_5B_CONFIG)}
# small: one layer each keeps a CPU compile per shape to seconds
SMALL_PAIR = {"small random pair (code path only)": (SMALL | {"num_hidden_layers": 1},
                                                     SMALL | {"num_hidden_layers": 1})}
CAPTURE_SCALES = ("full", "small", "off")
CAPTURE_MODES = ("eager", "compile", "cudagraph")
PROMPT_TOKENS = 64
PLAIN_WARMUP_TOKENS = 4
TIMED_RUNS = 2  # after the warm-up; the fastest counts (a host's other work only ever slows a run)
GOAL_BANDWIDTH = 0.70
GOAL_SPECULATION = 1.5
ENGINE_PLAIN = "plain (engine)"


def default_modes(device: torch.device) -> list[str]:
    return ["eager", "cudagraph"] if device.type == "cuda" else ["eager", "compile"]


def catalog_gpu(pair: ModelPair) -> GPU | None:
    """The device's entry in the GPU catalog, None when it is not listed (or not a GPU)."""
    return find_gpu(pair.gpu_type, load_catalog()) if pair.device.type == "cuda" else None


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights one decode token reads: every parameter but the input embedding (one row of it)."""
    embed = model.get_input_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not embed)


def counters(pair: ModelPair) -> dict[str, dict]:
    return {name: runner_of(model).counters.as_dict() for name, model in (("target", pair.target),
                                                                          ("draft", pair.draft))}


def compile_events(counts: dict[str, dict]) -> int:
    return sum(c["compiles"] + c["recompiles"] for c in counts.values())


def memory(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    synchronize(device)
    return {"allocated": torch.cuda.memory_allocated(device), "reserved": torch.cuda.memory_reserved(device)}


def plain_decode(pair: ModelPair, cache: RowKVCache, prompt: list[int], tokens: int) -> tuple[list[int], float]:
    """The target alone, greedy, one token per forward for each of ``cache``'s rows (all ``prompt``; emptied
    first): (the first row's tokens, seconds of the decode phase). No host read per token: an upper bound on plain
    decoding's speed.

    Every run reuses one cache: a CUDA graph replays over the buffers it was captured with, and a new cache
    would make it capture again inside the timed run."""
    model, device, rows = pair.target, pair.device, cache.batch_size
    cache.rollback([0] * rows)
    hidden = prefill(model, cache, [prompt] * rows, None)
    index = torch.zeros(rows, 1, dtype=torch.long, device=device)
    token = logits_at(model, hidden, index).argmax(-1)  # [rows, 1], stays on the device
    out = [token]
    synchronize(device)
    began = time.perf_counter()
    for _ in range(tokens - 1):
        token = logits_at(model, forward(model, cache, token), index).argmax(-1)
        cache.commit(1)
        out.append(token)
    synchronize(device)
    return [int(t) for t in torch.cat(out, 1)[0]], time.perf_counter() - began


def shapes_to_compile(pair: ModelPair, batch: int, compiled: set[int]) -> int:
    """The decode shapes a warm-up of a new cache of ``batch`` rows compiles (``sidecar.runtime.warmup``): both
    models' widths and chains at each of its batch buckets not ``compiled`` yet (0 in eager mode)."""
    runners = [r for r in (runner_of(pair.target), runner_of(pair.draft)) if r is not None and r.static]
    per_bucket = sum(len(r.widths) + len(r.chain_forwards) * (2 if r.warm_sampled else 1) for r in runners)
    return per_bucket * len(set(batch_buckets(batch)) - compiled)


def engine_decode(decoder: SpeculativeDecoder, prompt: list[int], tokens: int, batch: int) -> dict:
    """``batch`` identical rows in one static batch through the engine (speculative, or plain at gamma 0):
    decode-phase tokens/s and acceptance."""
    outs = decoder.generate([prompt] * batch, max_new_tokens=tokens, batch_size=batch, schedule="static")
    stats = [o.stats for o in outs]
    decoded = sum(s.new_tokens - 1 for s in stats)  # the first token comes from the prefill
    seconds = max(s.decode_seconds for s in stats)
    steps = sum(s.target_forwards - 1 for s in stats)
    return {"tokens_per_s": decoded / seconds, "tokens_per_step": decoded / steps,
            "acceptance": sum(s.accepted for s in stats) / max(sum(s.drafted for s in stats), 1),
            "rows": [o.token_ids for o in outs]}


def measure_mode(pair: ModelPair, mode: str, batches: list[int], tokens: int, gamma: int,
                 deadline: Deadline) -> dict:
    """One mode's rows (plain, then speculative, at each batch) and what it cost."""
    device = pair.device
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    before = memory(device)
    decoder = SpeculativeDecoder(pair, gamma=gamma, adaptive=False, prompt_lookup=False, capture=mode)
    # gamma 0, from the start: its widths join the warm-ups' (the target's plain width is the speculative one's, so
    # it compiles nothing of its own; the draft's catch-up width is warmed though no row here needs it) and its
    # runs take the caches the speculative ones gave back (one capacity bucket: 4 columns fewer)
    engine_plain = SpeculativeDecoder(pair, gamma=0, adaptive=False, prompt_lookup=False)
    set_sampled(pair.draft, False)  # greedy rows only: the sampled chains would compile for nothing
    # rows end at EOS before their limit, so no step narrows near a limit: the warm-up's shapes are the run's
    prompt = prompt_for(pair, PROMPT_TOKENS, tokens)
    limit = tokens + 2 * gamma + 2
    capacity = PROMPT_TOKENS + tokens + 8
    rows: list[dict] = []
    after_warmup = 0  # compiles and recompiles of the timed runs
    seconds_at: dict[tuple[str, int], float] = {}  # (decoding, batch) -> a timed run's seconds
    compiled: set[int] = set()  # the batch buckets the engine's warm-ups compiled

    def compile_estimate(new_shapes: int) -> float:
        counts = counters(pair)
        events = compile_events(counts)
        return new_shapes * sum(c["compile_seconds"] for c in counts.values()) / events if events else 0.0

    def run_estimate(decoding: str, batch: int) -> float:
        """A run's time grows at most linearly with its batch: from the latest batch of ``decoding`` measured, else
        from the latest run of any."""
        done = [(b, s) for (d, b), s in seconds_at.items() if d == decoding] or list(
            (b, s) for (_, b), s in seconds_at.items())
        if not done:
            return 0.0
        measured, seconds = done[-1]
        return seconds * batch / measured

    for batch in batches:
        row: dict = {"mode": mode, "decoding": "plain", "batch": batch}
        # a plain run at a new batch compiles its one shape
        if reason := deadline.skip_reason((1 + TIMED_RUNS) * run_estimate("plain", batch) + compile_estimate(1)):
            row["skipped"] = reason
        else:
            try:
                cache = RowKVCache(pair.target, batch, capacity)
                plain_decode(pair, cache, prompt, PLAIN_WARMUP_TOKENS)
                warm = compile_events(counters(pair))
                plain_tokens, seconds = min((plain_decode(pair, cache, prompt, tokens) for _ in range(TIMED_RUNS)),
                                            key=lambda run: run[1])
                del cache
                after_warmup += compile_events(counters(pair)) - warm
                row |= {"tokens_per_s": batch * (tokens - 1) / seconds, "tokens": plain_tokens}
                seconds_at["plain", batch] = seconds
            except torch.cuda.OutOfMemoryError as exc:  # a larger batch than the device holds: a limit
                row["skipped"] = f"skipped: out of memory ({str(exc).splitlines()[0][:160]})"
                gc.collect()
                torch.cuda.empty_cache()
        rows.append(row)
        plain = row
        for name, engine in ((f"speculative γ={gamma}", decoder), (ENGINE_PLAIN, engine_plain)):
            row = {"mode": mode, "decoding": name, "batch": batch}
            estimate = ((1 + TIMED_RUNS) * run_estimate(name, batch)
                        + compile_estimate(shapes_to_compile(pair, batch, compiled)))
            if reason := deadline.skip_reason(estimate):
                row["skipped"] = reason
                rows.append(row)
                continue
            warm = None
            try:
                engine_decode(engine, prompt, limit, batch)  # warm-up: compiles and captures happen here
                compiled |= set(batch_buckets(batch))
                warm = compile_events(counters(pair))
                began = time.perf_counter()
                run = max((engine_decode(engine, prompt, limit, batch) for _ in range(TIMED_RUNS)),
                          key=lambda run: run["tokens_per_s"])
            except torch.cuda.OutOfMemoryError as exc:  # a larger batch than the device holds: a limit, not a fault
                row["skipped"] = f"skipped: out of memory ({str(exc).splitlines()[0][:160]})"
                rows.append(row)
                gc.collect()
                torch.cuda.empty_cache()
                continue
            finally:
                if warm is not None:
                    after_warmup += compile_events(counters(pair)) - warm
            seconds_at[name, batch] = (time.perf_counter() - began) / TIMED_RUNS
            row |= run
            if "tokens" in plain:  # greedy: every row writes what plain decoding wrote
                row["rows_identical_to_plain"] = sum(r[:tokens] == plain["tokens"] for r in run["rows"])
            rows.append(row)
    counts = counters(pair)
    result = {"mode": mode, "reason": pair.capture_reason, "rows": rows,
              "compiles": sum(c["compiles"] for c in counts.values()),
              "recompiles_after_warmup": after_warmup,
              "graph_breaks": sum(c["graph_breaks"] for c in counts.values()),
              "cudagraph_skips": sum(c["cudagraph_skips"] for c in counts.values()),
              "skip_reasons": sorted({r for c in counts.values() for r in c["skip_reasons"]}),
              "distinct_shapes": {name: c["distinct_shapes"] for name, c in counts.items()},
              "compile_seconds": sum(c["compile_seconds"] for c in counts.values())}
    # what is still held once the decoder and its caches are gone and the allocator's free blocks are returned:
    # the graphs' pools and static buffers (eager: about nothing, the baseline)
    del decoder, engine_plain
    release_free()  # the KV caches kept for the next batches are not the graphs'
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    after = memory(device)
    if after:
        result |= {f"memory_{k}_gb": (after[k] - before[k]) / 2**30 for k in after}
    return result


def compare(modes: list[dict], peak: float | None, bytes_per_token: int, copy: float | None = None) -> list[dict]:
    """Each row's ratio to plain decoding at its batch in its mode (a speculative row's to the engine's plain too),
    share of bandwidth (plain: the weights one forward reads, times forwards per second, over the catalog's
    ``peak`` and over the ``copy`` bandwidth measured on the device), and ratio to eager at its batch."""
    eager = {(r["decoding"], r["batch"]): r for m in modes if m["mode"] == "eager" for r in m["rows"]}
    table = []
    for m in modes:
        plain = {r["batch"]: r for r in m["rows"] if r["decoding"] == "plain" and "tokens_per_s" in r}
        engine_plain = {r["batch"]: r for r in m["rows"] if r["decoding"] == ENGINE_PLAIN and "tokens_per_s" in r}
        for r in m["rows"]:
            row = {k: v for k, v in r.items() if k not in ("rows", "tokens")}
            if "tokens_per_s" not in r:
                table.append(row)
                continue
            if r["decoding"] == "plain":
                forwards_per_s = r["tokens_per_s"] / r["batch"]
                row["bandwidth_share"] = bytes_per_token * forwards_per_s / peak if peak else "unknown"
                if copy:
                    row["copy_bandwidth_share"] = bytes_per_token * forwards_per_s / copy
            elif r["batch"] in plain:
                row["vs_plain"] = r["tokens_per_s"] / plain[r["batch"]]["tokens_per_s"]
            if r["decoding"] not in ("plain", ENGINE_PLAIN) and r["batch"] in engine_plain:
                row["vs_engine_plain"] = r["tokens_per_s"] / engine_plain[r["batch"]]["tokens_per_s"]
            base = eager.get((r["decoding"], r["batch"]))
            if m["mode"] != "eager" and base and "tokens_per_s" in base:
                row["vs_eager"] = r["tokens_per_s"] / base["tokens_per_s"]
            table.append(row)
    return table


def goals(table: list[dict]) -> dict[str, str]:
    """Issue 40's GPU goals, each met, not met (with the rows that miss it) or not measured."""
    captured = [r for r in table if r["mode"] != "eager" and "tokens_per_s" in r]

    def verdict(misses: list[str], measured: bool) -> str:
        return "not measured" if not measured else ("met" if not misses else "not met: " + "; ".join(misses))

    plain = [r for r in captured if r["decoding"] == "plain" and r["batch"] == 1]
    # against the catalog's peak; on a GPU the catalog does not list, against the bandwidth a copy reached there
    share, against = "bandwidth_share", ""
    if not any(isinstance(r.get(share), float) for r in plain):
        share, against = "copy_bandwidth_share", " (against the copy bandwidth measured here: no catalog peak)"
    shares = [r for r in plain if isinstance(r.get(share), float)]
    spec1 = [r for r in captured if r["decoding"].startswith("speculative") and r["batch"] == 1 and "vs_plain" in r]
    vs_eager = [r for r in captured if "vs_eager" in r]
    return {
        f"captured plain reaches >= {GOAL_BANDWIDTH:.0%} of memory bandwidth": verdict(
            [f"{r['mode']} {r[share]:.0%}" for r in shares if r[share] < GOAL_BANDWIDTH], bool(shares))
        + (against if shares else ""),
        f"speculation at batch 1 >= {GOAL_SPECULATION}x captured plain": verdict(
            [f"{r['mode']} {r['vs_plain']:.2f}x" for r in spec1 if r["vs_plain"] < GOAL_SPECULATION], bool(spec1)),
        "captured is never slower than eager at any batch": verdict(
            [f"{r['mode']} {r['decoding']} batch {r['batch']}: {r['vs_eager']:.2f}x" for r in vs_eager
             if r["vs_eager"] < 1], bool(vs_eager)),
    }


def faults(modes: list[dict]) -> list[str]:
    """What must hold in every mode (``sidecar.runtime.capture``), each miss a fault, not a speed: no graph break,
    no recompile after warm-up, and in cudagraph mode no graph left uncaptured (its rows would time compile mode
    under cudagraph's name)."""
    failed = [f"{m['mode']}: {m[key]} {key.replace('_', ' ')}" for m in modes
              for key in ("graph_breaks", "recompiles_after_warmup") if m[key]]
    failed += [f"{m['mode']}: {m['cudagraph_skips']} graphs not captured ("
               f"{'; '.join(m['skip_reasons']) or 'no reason logged'})"
               for m in modes if m["mode"] == "cudagraph" and m["cudagraph_skips"]]
    return failed


def capture_modes(scale: str, modes: list[str], batches: list[int], tokens: int, gamma: int, device: torch.device,
                  dtype: torch.dtype, deadline: Deadline) -> dict:
    """Every mode's rows on the largest pair of ``scale`` that fits, within ``deadline``."""
    candidates = FULL_PAIRS if scale == "full" else SMALL_PAIR
    copy = copy_bandwidth(device)  # before the pair takes the device's memory
    skipped: dict[str, str] = {}
    for name, (target_config, draft_config) in candidates.items():
        try:
            pair = synthetic_pair(name, target_config, draft_config, device, dtype)
            break
        except torch.cuda.OutOfMemoryError as exc:  # a smaller GPU: the next pair down
            skipped[name] = f"out of memory ({str(exc).splitlines()[0][:160]})"
            gc.collect()
            torch.cuda.empty_cache()
    else:
        return {"skipped": "no pair fits: " + "; ".join(f"{k}: {v}" for k, v in skipped.items())}
    gpu = catalog_gpu(pair)
    peak = None if gpu is None else gpu.bandwidth_bytes_s
    bytes_per_token = weight_bytes_per_token(pair.target)
    measured = []
    with torch.inference_mode():
        for mode in modes:
            began = time.monotonic()
            measured.append(measure_mode(pair, mode, batches, tokens, gamma, deadline))
            print(f"capture {mode}: {time.monotonic() - began:.0f} s", flush=True)
    table = compare(measured, peak, bytes_per_token, copy)
    failed = faults(measured)
    del pair
    if any(mode != "eager" for mode in modes):
        torch._dynamo.reset()  # the compiled graphs (and on CUDA their graph pools) die with the pair
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"pair": name, "scale": scale, "skipped_pairs": skipped, "dtype": str(dtype).removeprefix("torch."),
            "agreement": AGREEMENT, "gamma": gamma, "prompt_tokens": PROMPT_TOKENS, "new_tokens": tokens,
            "peak_bandwidth_gb_s": peak / 1e9 if peak else "unknown", "copy_bandwidth_gb_s": copy / 1e9,
            "weight_gb_per_token": bytes_per_token / 1e9,
            "catalog_gpu": None if gpu is None else gpu.name, "rows": table,
            "modes": [{k: v for k, v in m.items() if k != "rows"} for m in measured],
            "goals": goals(table), "failed": failed}
