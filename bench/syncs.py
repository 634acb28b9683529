"""Host-device synchronisations per decoding step, counted on the tiny pair (``sidecar.runtime.syncs``).

    python -m bench.syncs          # batch 1, 8 and 32; writes bench/results/syncs.json and syncs.md

A GPU idles at every synchronisation until the host has queued the next kernels, so a loop that syncs
once per row or once per draft token stalls more the larger the batch. The count does not depend on the
machine or on the weights' values beyond how many tokens each step accepts, which is why the tiny random
pair on a CPU measures it. Each "one decode" row decodes ``--batch`` random prompts for ``--new-tokens``
tokens with prompt lookup on and gamma 4: fixed (every step drafts 4), fixed with early stopping at draft
confidence ``DRAFT_CONFIDENCE`` (which reads the device once per draft forward), or adaptive (the
controller's choice of step, with that early stopping). Each "stream" row runs twice as many prompts with
limits between half and all of ``--new-tokens`` through a batch of ``--batch`` slots, adaptive, under the
continuous schedule (rows join as slots free) and the static one (fixed batches). ``steps`` are decoding
steps (one target forward each); target and draft forwards count every forward outside a prefill; the
budget is those forwards plus one read per prefilled group (its first tokens).
"""

from __future__ import annotations

import argparse
from contextlib import ExitStack
from unittest import mock

import torch

import sidecar.decoding.batch as decode_batch
from bench.common import (
    add_bench_arguments,
    environment,
    markdown_table,
    parse_bench_args,
    profile_suffix,
    write_results,
)
from sidecar.decoding.batch import SCHEDULES
from sidecar.decoding.decoder import SpeculativeDecoder
from sidecar.decoding.plan import DRAFT_CONFIDENCE
from sidecar.models.tiny import tiny_pair
from sidecar.runtime.capture import forward_module
from sidecar.runtime.syncs import SyncCounter

BATCHES = (1, 8, 32)
MODES = {
    "fixed": dict(adaptive=False),
    "fixed, early stop": dict(adaptive=False, draft_confidence=DRAFT_CONFIDENCE),
    "adaptive": dict(adaptive=True),
}


class ForwardCount:
    """Forwards of one model, told apart by whether a prefill was running."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.prefill = self.decode = 0
        self.in_prefill = 0
        self.handle = forward_module(model).register_forward_hook(self._hook)

    def _hook(self, *args) -> None:
        if self.in_prefill:
            self.prefill += 1
        else:
            self.decode += 1


def measure(pair, batch: int, mode: str, new_tokens: int, seed: int = 0, schedule: str = "continuous",
            stream: bool = False) -> dict:
    """One decode of ``batch`` random prompts (``stream``: of 2 x ``batch`` prompts with mixed limits through
    ``batch`` slots under ``schedule``): its syncs, decoding steps and forwards."""
    g = torch.Generator().manual_seed(seed)
    count = 2 * batch if stream else batch
    lengths = torch.randint(4, 40, (count,), generator=g).tolist()
    prompts = [torch.randint(3, len(pair.tokenizer), (n,), generator=g).tolist() for n in lengths]
    limits = torch.randint(new_tokens // 2, new_tokens + 1, (count,), generator=g).tolist() if stream \
        else new_tokens
    decoder = SpeculativeDecoder(pair, gamma=4, **MODES[mode])
    counts = [ForwardCount(pair.target), ForwardCount(pair.draft)]
    original = decode_batch.prefill
    groups = []  # target prefills: each admitted group's first tokens are one read

    def counted_prefill(model, *args, **kwargs):
        groups.append(model is pair.target)
        for c in counts:
            c.in_prefill += 1
        try:
            return original(model, *args, **kwargs)
        finally:
            for c in counts:
                c.in_prefill -= 1

    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(decode_batch, "prefill", counted_prefill))
        syncs = stack.enter_context(SyncCounter())
        decoder.generate(prompts, max_new_tokens=limits, batch_size=batch, schedule=schedule)
    for c in counts:
        c.handle.remove()
    target, draft = counts
    steps = target.decode  # one target forward per decoding step
    return {
        "kind": "stream" if stream else "one decode", "schedule": schedule, "rows": count,
        "batch": batch, "mode": mode, "steps": steps,
        "target_forwards": target.decode, "draft_forwards": draft.decode,
        "prefill_forwards": target.prefill + draft.prefill, "prefilled_groups": sum(groups), "syncs": syncs.total,
        "syncs_per_step": syncs.total / max(steps, 1),
        "budget": target.decode + draft.decode + sum(groups),
        "top_sites": syncs.sites.most_common(8),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, nargs="+", default=list(BATCHES))
    # counts do not depend on the machine's speed, so every profile measures the same sizes under its own name
    add_bench_arguments(parser)
    args = parse_bench_args(parser)
    pair = tiny_pair()
    rows = [measure(pair, batch, mode, args.new_tokens) for mode in MODES for batch in args.batch]
    rows += [measure(pair, batch, "adaptive", args.new_tokens, schedule=schedule, stream=True)
             for schedule in SCHEDULES for batch in args.batch]
    table = markdown_table(rows, [
        ("kind", "run"), ("schedule", "schedule"), ("mode", "mode"), ("batch", "batch"), ("rows", "rows"),
        ("steps", "steps"), ("target_forwards", "target forwards"), ("draft_forwards", "draft forwards"),
        ("prefilled_groups", "prefilled groups"), ("syncs", "syncs"), ("syncs_per_step", "syncs per step"),
        ("budget", "budget (forwards + groups)")])
    heading = (f"Host-device synchronisations of one decode, tiny pair, {args.new_tokens} new tokens per row, "
               "gamma 4, prompt lookup on (`python -m bench.syncs`):")
    payload = {"environment": environment(pair.device, pair.dtype, pair.capture_mode),
               "new_tokens": args.new_tokens, "rows": rows}
    write_results("syncs" + profile_suffix(args.profile), payload,
                  heading + "\n\n" + table)


if __name__ == "__main__":
    main()
