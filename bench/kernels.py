"""CPU kernel benchmark: one forward of each model per shape, the default matmul vs oneDNN packed weights.

    python -m bench.kernels                # standard and --full: fp32, context 400, 5 timed forwards per cell
    python -m bench.kernels --dtype bf16   # the same in bf16 (where ``load_pair`` packs bf16 layers when timed faster)
    python -m bench.kernels --quick        # 1 timed forward per cell

The table behind ``sidecar.models.cpu_kernels``: ``OneDNNLinear`` keeps every Linear weight in oneDNN's packed
layout, laid out for ``PACKED_ROWS`` input rows. Each cell is the median wall time of one forward over a KV
cache of ``--context`` positions, through the engine's own ``forward``:

* the target with the default matmul, with oneDNN weights packed for 1 row, and packed for
  ``PACKED_ROWS`` rows (the engine's);
* in fp32, the draft with the engine's kernels, and with dynamic int8 weights (``load_pair(..., draft_int8=True)``);
  in bf16, the draft with the default matmul and packed (torch's dynamic int8 Linear takes fp32 only).

Each variant is a load of its own, since the swap drops the plain weight. The variants of one model are
in memory together and timed in turn, one forward each per round, so that the machine slowing down or
speeding up between minutes (it does, on a shared 2-core VM) moves them all alike instead of favouring
whichever ran in the quiet minute. The target's three variants take ~13 GB. On a GPU there is nothing to
choose (cuBLAS for every shape); the benchmark is CPU-only.
"""

from __future__ import annotations

import argparse

import torch
from transformers import PreTrainedModel

from bench.common import (
    add_bench_arguments,
    apply_profile,
    environment,
    markdown_table,
    medians_in_turn,
    parse_bench_args,
    variant_suffix,
    write_results,
)
from sidecar.models import cpu_kernels
from sidecar.models.loading import default_device_dtype, load_model, pair_model_ids
from sidecar.runtime.forward import forward
from sidecar.runtime.kv_cache import RowKVCache

# (rows, positions): decode steps at batch 1, verifies of gamma+1 positions, decode steps of a batch, a
# 128-token prefill
SHAPES = [(1, 1), (1, 2), (1, 3), (1, 5), (4, 1), (8, 1), (16, 1), (1, 128)]
SIZES = {"quick": {"repeats": 1}, "standard": {"repeats": 5}, "full": {"repeats": 5}}


def interleaved_ms(models: list[PreTrainedModel], rows: int, positions: int, context: int,
                   repeats: int) -> list[float]:
    """Median ms of one forward of ``rows`` x ``positions`` new tokens over ``context`` cached positions,
    for each of ``models``; each round times every model once."""
    caches = []
    for model in models:
        cache = RowKVCache(model, rows, context + positions)
        cache.commit(context)  # only the length matters for the time, not the values
        caches.append(cache)
    ids = torch.randint(0, 1000, (rows, positions))
    calls = [lambda model=model, cache=cache: forward(model, cache, ids) for model, cache in zip(models, caches,
                                                                                                   strict=True)]
    with torch.inference_mode():  # the first round pays one-off allocations
        seconds = medians_in_turn(calls, repeats, ids.device, untimed=1)
    return [1000 * s for s in seconds]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="qwen-coder-small")
    parser.add_argument("--context", type=int, default=400)
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    add_bench_arguments(parser)
    args = parse_bench_args(parser)
    apply_profile(args, SIZES)

    device, dtype = default_device_dtype("cpu", args.dtype)
    target_id, draft_id = pair_model_ids(args.pair)

    def target(packed_rows: int | None) -> PreTrainedModel:
        model = load_model(target_id, device, dtype)
        if packed_rows is not None:
            cpu_kernels.use_onednn_linear(model, packed_rows)
        return model

    def draft(kernel: str) -> PreTrainedModel:
        model = load_model(draft_id, device, dtype)
        if kernel == "int8":
            return cpu_kernels.quantize_int8(model)
        if kernel == "packed":
            cpu_kernels.use_onednn_linear(model)
        return model

    drafts = ([("draft fp32 (engine)", "packed"), ("draft int8", "int8")] if dtype == torch.float32 else
              [("draft, default kernel", "default"), ("draft, oneDNN packed (engine)", "packed")])

    groups = [
        [("target, default kernel", lambda: target(None)),
         ("target, oneDNN packed for 1 row", lambda: target(1)),
         (f"target, oneDNN packed for {cpu_kernels.PACKED_ROWS} rows (engine)",
          lambda: target(cpu_kernels.PACKED_ROWS))],
        [(name, lambda kernel=kernel: draft(kernel)) for name, kernel in drafts],
    ]
    rows = []
    for group in groups:
        models = [build() for _, build in group]
        group_rows = [{"model": name} for name, _ in group]
        for batch, positions in SHAPES:
            for row, ms in zip(group_rows, interleaved_ms(models, batch, positions, args.context, args.repeats),
                               strict=True):
                row[f"{batch}x{positions}"] = ms
            print(f"{batch}x{positions}", [row[f"{batch}x{positions}"] for row in group_rows], flush=True)
        rows += group_rows
        del models  # one model's variants in memory at a time

    env = environment(device, dtype)
    table = markdown_table(rows, [("model", "model / kernel"), *((f"{b}x{p}", f"{b}x{p}") for b, p in SHAPES)])
    markdown = (f"One forward, ms (median of {args.repeats}, the variants of one model timed in turn), "
                f"pair `{args.pair}` on {env['device']} ({env['dtype']}, "
                f"{env['threads']} threads), context {args.context}; columns are rows x new positions.\n\n{table}")
    payload = {"environment": env, "args": vars(args), "shapes": SHAPES, "rows": rows}
    write_results("kernels_cpu" + variant_suffix("cpu", dtype, args.profile), payload, markdown)


if __name__ == "__main__":
    main()
