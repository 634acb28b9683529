"""Host cost per forward and per step at production depth, where compute is about zero.

    python -m bench.host_overhead              # eager and compile (cudagraph too on CUDA)
    python -m bench.host_overhead --modes eager

The pair is the tiny one at Qwen2.5-1.5B's and -7B's depth (28 layers) and hidden size 64, so a forward's
time is what the host spends on it: Python, dispatch, kernel launches, building its inputs. On a GPU that
cost does not shrink with the model, so it is the floor under every forward at decode widths, and the
quantity that says whether speculation with a 28-layer draft can pay (``study.cost`` reads it as the host
floor of each capture mode).

It runs on CUDA where there is one, in bf16, else on the CPU in fp32 (``dtype_for``: the result is
host_overhead_gpu or host_overhead_cpu, the names ``study.cost.host_floor`` reads). On a lent GPU ``make
gpu-check`` runs it too (its host-floor part, ``bench.gpu_check.host_floor``): the captured floor is measured
nowhere else.
Per capture mode (``sidecar.runtime.capture``), in one process, batch 1, after a warm-up run:

* HF forward: Hugging Face's eager one-token forward (its own cache), the baseline of every ratio;
* our forward: the engine's one-token forward (``sidecar.runtime.forward.forward``, LM head included), timed in
  turn with HF's, call by call, so that the machine's drift between minutes cancels in their ratio; each engine
  run below is likewise divided by HF forwards timed just before it;
* fixed gamma 4 and adaptive: the engine's decoding steps, per target forward and per generated token, next
  to HF ``generate``'s per token (plain greedy decoding, its decode phase: 65 tokens less 1, timed whole);
* plain: the engine's plain step (gamma 0: one target forward per token, no draft), likewise;
* the draft's forwards and graph calls (calls of a compiled region) per step: in compiled modes a step's draft
  forwards after its first run as one chained call (``sidecar.decoding.draft_chain``), and drafting does not
  stop early;
* in compiled modes, the fixed-gamma step's host time outside its compiled calls (the steps' time less the time
  inside them, ``CaptureCounters.graph_seconds``), per step and per forward at each of ``HOST_BATCHES`` identical
  rows: the work a CUDA graph does not take away (planning, bookkeeping, inputs, reads), and how it grows with
  the rows; and the plain step's (one forward a step). Dynamo's guards and inductor's wrapper run inside the
  calls; on a GPU the step's reads also wait there for the graphs' kernels, and a GPU machine's host may be
  faster than this CPU's. ``study.cost.host_floor`` charges a speculative step's per forward and a plain step's
  per plain forward, at the forward's rows, in both capture modes;
* the mode's compiles, recompiles after warm-up (must be 0), graph breaks (must be 0) and distinct shapes.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.common import (
    REFERENCE_DTYPES,
    add_bench_arguments,
    environment,
    markdown_table,
    medians_in_turn,
    parse_bench_args,
    variant_suffix,
    write_results,
)
from bench.gpu_check.capture_modes import compile_events, counters
from sidecar.decoding.decoder import SpeculativeDecoder
from sidecar.models.tiny import tiny_pair
from sidecar.runtime.capture import runner_of
from sidecar.runtime.forward import cache_keyword, forward, logits_at, prefill
from sidecar.runtime.kv_cache import RowKVCache
from sidecar.runtime.step_counters import counters_of
from sidecar.runtime.syncs import synchronize

LAYERS = 28  # Qwen2.5-1.5B and Qwen2.5-7B alike
# batches of identical rows at which a compiled step's host work outside its compiled calls is timed (the first
# gives the per-forward figure ``study.cost.host_floor`` reads)
HOST_BATCHES = (1, 8, 32)
PROMPT = 32
NEW_TOKENS = 64
SIZES = {"quick": dict(calls=30, runs=1), "standard": dict(calls=200, runs=3), "full": dict(calls=500, runs=5)}


def hf_forward_call(model, prompt: list[int], device: torch.device):
    """HF's eager one-token forward over its own cache, after a prompt (the prompt's forward untimed)."""
    from transformers import DynamicCache

    cache = {cache_keyword(type(model)): DynamicCache(config=model.config)}
    model(input_ids=torch.tensor([prompt], device=device), **cache, use_cache=True)
    token = torch.tensor([[prompt[-1]]], device=device)
    return lambda: model(input_ids=token, **cache, use_cache=True)


def our_forward_call(model, prompt: list[int], calls: int, device: torch.device):
    """The engine's one-token forward (and LM head) over a ``RowKVCache``, committing each token."""
    cache = RowKVCache(model, 1, PROMPT + calls + 8)
    prefill(model, cache, [prompt], None)
    token = torch.tensor([[prompt[-1]]], device=device)
    index = torch.zeros(1, 1, dtype=torch.long, device=device)

    def one() -> None:
        logits_at(model, forward(model, cache, token), index)
        cache.commit(1)

    return one


def hf_forward_seconds(model, prompt: list[int], calls: int, device: torch.device) -> float:
    """The median of ``calls`` HF one-token forwards on a fresh cache: the baseline an engine run is paired with."""
    return medians_in_turn([hf_forward_call(model, prompt, device)], calls, device)[0]


def hf_decode_seconds_per_token(model, prompt: list[int], device: torch.device) -> float:
    """HF ``generate``'s greedy decode phase per token: (65 tokens - 1 token) / 64, each run timed whole."""
    ids = torch.tensor([prompt], device=device)

    def run(tokens: int) -> float:
        synchronize(device)
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        synchronize(device)
        return time.perf_counter() - start

    run(2)
    return (min(run(NEW_TOKENS + 1) for _ in range(2)) - min(run(1) for _ in range(2))) / NEW_TOKENS


def engine_step(pair, prompt: list[int], adaptive: bool, runs: int, calls: int, gamma: int = 4) -> dict:
    """The engine's decode phase at batch 1, fixed ``gamma`` (0: plain steps) or adaptive: seconds per target
    forward and per token, with the forwards per step, and each run's time per target forward in HF forwards timed
    just before it (``calls`` of them), so that the ratio does not drift with the machine; the run of the smallest
    ratio of ``runs`` after one warm-up run."""
    decoder = SpeculativeDecoder(pair, gamma=gamma, adaptive=adaptive, prompt_lookup=False)
    decoder.generate([prompt], max_new_tokens=NEW_TOKENS, batch_size=1)  # warm-up: compiles happen here
    draft = runner_of(pair.draft).counters
    warm = compile_events(counters(pair))
    best = None
    for _ in range(runs):
        hf = hf_forward_seconds(pair.target, prompt, calls, pair.device)
        graph_calls = draft.graph_calls
        stats = decoder.generate([prompt], max_new_tokens=NEW_TOKENS, batch_size=1)[0].stats
        steps = stats.target_forwards - 1  # the prefill yields the first token
        row = {"seconds_per_target_forward": stats.decode_seconds / steps,
               "seconds_per_token": stats.decode_seconds / (stats.new_tokens - 1),
               "draft_forwards_per_step": stats.draft_forwards / steps,
               # compiled calls the draft's forwards took (0 in eager mode): one per chain of forwards
               "draft_graph_calls_per_step": (draft.graph_calls - graph_calls) / steps,
               "hf_forwards_per_step": stats.decode_seconds / steps / hf,
               "tokens_per_step": (stats.new_tokens - 1) / steps}
        if best is None or row["hf_forwards_per_step"] < best["hf_forwards_per_step"]:
            best = row
    # compiles of any shape, new or seen, in the timed runs: after warm-up there must be none
    return best | {"compiles_after_warmup": compile_events(counters(pair)) - warm}


def host_outside_graphs(pair, prompt: list[int], batch: int, runs: int, gamma: int = 4) -> tuple[float, float]:
    """A compiled fixed-``gamma`` step's (0: a plain step's) host seconds outside its compiled calls at ``batch``
    identical rows: the steps' wall time (``sidecar.runtime.step_counters``) less the time inside compiled calls,
    per step, the least of ``runs`` after a warm-up run; and that run's forwards per step (the target's one and
    the draft's)."""
    decoder = SpeculativeDecoder(pair, gamma=gamma, adaptive=False, prompt_lookup=False)
    rows = [prompt] * batch
    decoder.generate(rows, max_new_tokens=NEW_TOKENS, batch_size=batch)  # warm-up: this batch's compiles
    runners = [runner_of(pair.target).counters, runner_of(pair.draft).counters]
    steps = counters_of(pair)
    best = (float("inf"), 0.0)
    for _ in range(runs):
        before = (steps.steps, steps.step_seconds, sum(c.graph_seconds for c in runners))
        stats = decoder.generate(rows, max_new_tokens=NEW_TOKENS, batch_size=batch)[0].stats
        count = steps.steps - before[0]
        outside = steps.step_seconds - before[1] - (sum(c.graph_seconds for c in runners) - before[2])
        # identical rows share every step: one row's forwards are the batch's
        forwards = 1 + stats.draft_forwards / (stats.target_forwards - 1)
        best = min(best, (outside / count, forwards))
    return best


def measure_mode(mode: str, calls: int, runs: int, device: torch.device, layers: int | None = None) -> dict:
    """One capture mode's row, on ``device`` in its reference dtype (``dtype_for``), the pair ``layers`` deep
    (default ``LAYERS``)."""
    pair = tiny_pair(device, dtype_for(device), layers=layers or LAYERS)
    prompt = torch.randint(3, len(pair.tokenizer), (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.inference_mode():
        hf_token = hf_decode_seconds_per_token(pair.target, prompt, device)
        SpeculativeDecoder(pair, capture=mode)  # attaches the mode's runners (HF's own forward stays as it is)
        # HF's forward and ours in turn, call by call
        hf, ours = medians_in_turn([hf_forward_call(pair.target, prompt, device),
                                    our_forward_call(pair.target, prompt, calls, device)], calls, device)
        fixed = engine_step(pair, prompt, adaptive=False, runs=runs, calls=calls)
        adaptive = engine_step(pair, prompt, adaptive=True, runs=runs, calls=calls)
        plain = engine_step(pair, prompt, adaptive=False, runs=runs, calls=calls, gamma=0)
        # the step's own host work, where a graph takes the rest, and how it grows with its rows; a speculative
        # step's and a plain one's
        outside, plain_outside = ({} if mode == "eager" else {
            batch: (seconds * 1e3, forwards)
            for batch in HOST_BATCHES for seconds, forwards in [host_outside_graphs(pair, prompt, batch, runs, gamma)]}
            for gamma in (4, 0))
    counts = counters(pair)
    return {
        "mode": mode, "capture_reason": pair.capture_reason, "hf_forward_ms": hf * 1e3, "our_forward_ms": ours * 1e3,
        "our_over_hf": ours / hf, "hf_decode_ms_per_token": hf_token * 1e3,
        "fixed_ms_per_target_forward": fixed["seconds_per_target_forward"] * 1e3,
        "fixed_hf_forwards_per_step": fixed["hf_forwards_per_step"],
        "fixed_ms_per_token": fixed["seconds_per_token"] * 1e3,
        "fixed_per_token_over_hf": fixed["seconds_per_token"] / hf_token,
        "fixed_draft_forwards_per_step": fixed["draft_forwards_per_step"],
        "fixed_draft_graph_calls_per_step": fixed["draft_graph_calls_per_step"],
        "fixed_tokens_per_step": fixed["tokens_per_step"],
        **({"fixed_host_ms_per_step_outside_graphs": outside[1][0],
            # per forward (the target's and the draft's): how the cost model charges it
            "fixed_host_ms_per_forward_outside_graphs": outside[1][0] / outside[1][1],
            **{f"fixed_host_ms_per_step_outside_graphs_at_{b}": ms for b, (ms, _) in outside.items() if b != 1},
            **{f"fixed_host_ms_per_forward_outside_graphs_at_{b}": ms / forwards
               for b, (ms, forwards) in outside.items() if b != 1}}
           if outside else {}),
        "adaptive_ms_per_target_forward": adaptive["seconds_per_target_forward"] * 1e3,
        "adaptive_hf_forwards_per_step": adaptive["hf_forwards_per_step"],
        "adaptive_ms_per_token": adaptive["seconds_per_token"] * 1e3,
        "adaptive_per_token_over_hf": adaptive["seconds_per_token"] / hf_token,
        "adaptive_tokens_per_step": adaptive["tokens_per_step"],
        "adaptive_draft_forwards_per_step": adaptive["draft_forwards_per_step"],
        "adaptive_draft_graph_calls_per_step": adaptive["draft_graph_calls_per_step"],
        "plain_ms_per_token": plain["seconds_per_token"] * 1e3,
        "plain_hf_forwards_per_step": plain["hf_forwards_per_step"],
        "plain_per_token_over_hf": plain["seconds_per_token"] / hf_token,
        # one forward a step: per step is per forward
        **({"plain_host_ms_per_step_outside_graphs": plain_outside[1][0],
            **{f"plain_host_ms_per_step_outside_graphs_at_{b}": ms for b, (ms, _) in plain_outside.items() if b != 1}}
           if plain_outside else {}),
        "chained_forwards": {name: c["chained_forwards"] for name, c in counts.items()},
        "compiles": sum(c["compiles"] for c in counts.values()),
        "recompiles": sum(c["recompiles"] for c in counts.values()),
        "recompiles_after_warmup": (fixed["compiles_after_warmup"] + adaptive["compiles_after_warmup"]
                                    + plain["compiles_after_warmup"]),
        "graph_breaks": sum(c["graph_breaks"] for c in counts.values()),
        # cudagraph mode: graphs inductor left uncaptured (must be 0 on CUDA: such a row times compile mode)
        "cudagraph_skips": sum(c["cudagraph_skips"] for c in counts.values()),
        "skip_reasons": sorted({r for c in counts.values() for r in c["skip_reasons"]}),
        "distinct_shapes": {name: c["distinct_shapes"] for name, c in counts.items()},
        "compile_seconds": sum(c["compile_seconds"] for c in counts.values()),
    }


def dtype_for(device: torch.device) -> torch.dtype:
    """The dtype the pair runs in: the device's reference one (fp32 on a CPU, bf16 on CUDA, what the engine runs
    there), so the result's name carries no dtype and ``study.cost.host_floor`` finds it."""
    return REFERENCE_DTYPES["cuda" if device.type == "cuda" else "cpu"]


def default_modes(device: torch.device) -> list[str]:
    return ["eager", "compile", "cudagraph"] if device.type == "cuda" else ["eager", "compile"]


def table(rows: list[dict]) -> str:
    """The rows as the markdown table the result and the GPU check show."""
    return markdown_table(rows, [
        ("mode", "mode"), ("hf_forward_ms", "HF forward ms"), ("our_forward_ms", "our forward ms"),
        ("our_over_hf", "ours / HF (goal <= 0.65)"),
        ("fixed_ms_per_target_forward", "fixed-γ4 ms / target forward"),
        ("fixed_hf_forwards_per_step", "fixed-γ4 step in HF forwards (goal <= 3.0)"),
        ("fixed_per_token_over_hf", "fixed-γ4 per token / HF plain"),
        ("fixed_draft_forwards_per_step", "fixed-γ4 draft forwards / step"),
        ("fixed_draft_graph_calls_per_step", "fixed-γ4 draft graph calls / step"),
        ("adaptive_hf_forwards_per_step", "adaptive step in HF forwards"),
        ("adaptive_per_token_over_hf", "adaptive per token / HF plain"),
        ("plain_hf_forwards_per_step", "plain step in HF forwards"),
        ("fixed_host_ms_per_step_outside_graphs", "fixed-γ4 host ms / step outside compiled calls"),
        ("fixed_host_ms_per_forward_outside_graphs", "the same per forward"),
        *[(f"fixed_host_ms_per_step_outside_graphs_at_{b}", f"the same per step at batch {b}")
          for b in HOST_BATCHES if b != 1],
        *[(f"fixed_host_ms_per_forward_outside_graphs_at_{b}", f"per forward at batch {b}")
          for b in HOST_BATCHES if b != 1],
        ("plain_host_ms_per_step_outside_graphs", "plain step host ms outside compiled calls"),
        *[(f"plain_host_ms_per_step_outside_graphs_at_{b}", f"plain, at batch {b}") for b in HOST_BATCHES if b != 1],
        ("compiles", "compiles"), ("recompiles_after_warmup", "compiles after warm-up"),
        ("graph_breaks", "graph breaks"),
        *([("cudagraph_skips", "graphs not captured")] if any(r.get("mode") == "cudagraph" for r in rows) else [])])


def write(rows: list[dict], device: torch.device, profile: str, sizes: dict, layers: int | None = None) -> str:
    """Write the rows as host_overhead_gpu or host_overhead_cpu (with the profile's suffix); the name written."""
    layers = layers or LAYERS
    heading = (f"Host cost at production depth ({layers} layers, hidden 64: compute about zero), batch 1, "
               f"{PROMPT}-token prompt, {NEW_TOKENS} new tokens (`python -m bench.host_overhead`):")
    dtype = dtype_for(device)
    payload = {"environment": environment(device, dtype), "layers": layers, "profile": profile,
               "sizes": sizes, "rows": rows}
    name = "host_overhead_" + ("gpu" if device.type == "cuda" else "cpu") + variant_suffix(device.type, dtype, profile)
    write_results(name, payload, heading + "\n\n" + table(rows))
    return name


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", choices=("eager", "compile", "cudagraph"))
    add_bench_arguments(parser)
    args = parse_bench_args(parser, argv)
    sizes = SIZES[args.profile]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = [measure_mode(mode, sizes["calls"], sizes["runs"], device) for mode in args.modes or default_modes(device)]
    write(rows, device, args.profile, sizes)


if __name__ == "__main__":
    main()
