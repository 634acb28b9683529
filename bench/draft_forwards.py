"""Forwards of each model for one sidecar workload, counted by forward hooks through the public API only.

    python -m bench.draft_forwards            # the tiny pair, 3 x batch requests at batch 1, 8 and 32
    python -m bench.draft_forwards --print    # print the counts only (to compare a checkout of another commit)

The same requests (a summary and a hashtag sidecar each, greedy, gamma 4 fixed, no prompt lookup, so that
every step drafts from the model) run through ``SidecarEngine.run``; a hook on each model's decoder stack
counts its forwards, prompt prefills included. Since the hooks see only the models, a checkout of an older
commit counts the same way (``--print`` there), which is how the numbers before sidecar rows rode in the
draft's proposal forwards were taken. The workload is the same at every size (``--quick`` and ``--full`` only
name the results). Writes bench/results/draft_forwards[_<profile>].json and .md.
"""

from __future__ import annotations

import argparse

import torch

from bench.common import (
    add_bench_arguments,
    environment,
    markdown_table,
    profile_suffix,
    refuse_a_dirty_tree,
    write_results,
)
from sidecar import HASHTAGS, SidecarEngine, SidecarRequest
from sidecar.models.tiny import tiny_pair

BATCHES = (1, 8, 32)


def count(pair, batch_size: int) -> dict:
    engine = SidecarEngine(pair, gamma=4, adaptive=False)
    engine.decoder.prompt_lookup = False
    requests = [SidecarRequest(f"document number {i} " * (2 + i % 3), sidecars=[HASHTAGS],
                               max_new_tokens=8 + 6 * (i % 5)) for i in range(3 * batch_size)]
    forwards = {"target": 0, "draft": 0}
    hooks = [getattr(pair, name).base_model.register_forward_hook(
        lambda *_, name=name: forwards.__setitem__(name, forwards[name] + 1)) for name in forwards]
    try:
        results = engine.run(requests, batch_size=batch_size)
    finally:
        for hook in hooks:
            hook.remove()
    tags = sum(len(r.sidecars["hashtags"].token_ids) for r in results)
    summary = sum(len(r.main.token_ids) for r in results)
    return {"batch": batch_size, "requests": len(requests), "summary_tokens": summary, "tag_tokens": tags,
            "target_forwards": forwards["target"], "draft_forwards": forwards["draft"]}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--print", action="store_true", help="print the counts, write no results file")
    add_bench_arguments(parser)
    args = parser.parse_args(argv)
    if not args.print:  # a results file must name a clean, committed tree
        refuse_a_dirty_tree(args.allow_dirty)
    torch.set_num_threads(1)
    pair = tiny_pair()
    rows = [count(pair, b) for b in BATCHES]
    for row in rows:
        print(row, flush=True)
    if not args.print:
        env = environment(pair.device, pair.dtype, pair.capture_mode)
        table = markdown_table(rows, [("batch", "batch"), ("requests", "requests"),
                                      ("summary_tokens", "summary tokens"), ("tag_tokens", "tag tokens"),
                                      ("target_forwards", "target forwards"), ("draft_forwards", "draft forwards")])
        write_results("draft_forwards" + profile_suffix(args.profile), {"environment": env, "runs": rows},
                      f"Forwards per model for one sidecar workload on the tiny pair, prompt prefills included "
                      f"(`python -m bench.draft_forwards`).\n\n{table}")
    return rows


if __name__ == "__main__":
    main()
