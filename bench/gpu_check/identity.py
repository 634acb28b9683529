"""The identity part: the engine's greedy output at one batch against HF ``generate`` on the target alone.

HF runs one prompt at a time, the engine all of them in one batch. Every divergence is listed with its position and
the target's top-2 logit gap there, and fails the check.
"""

from __future__ import annotations

import torch

from bench.gpu_check.check import Check
from bench.gpu_check.deadline import Deadline
from bench.hf_baselines import hf_plain_one
from sidecar.models.pair import ModelPair


def first_divergence(reference: list[int], candidate: list[int]) -> int | None:
    """The first position where the token lists differ (a length difference counts), None when equal."""
    for position, (a, b) in enumerate(zip(reference, candidate, strict=False)):
        if a != b:
            return position
    return None if len(reference) == len(candidate) else min(len(reference), len(candidate))


def top2_gap(pair: ModelPair, context: list[int], tokens: list[int | None]) -> dict:
    """The target's next-token logits after ``context``, from one forward at batch 1: the top-1 minus top-2
    logit gap, and each of ``tokens``' rank there (0: the argmax)."""
    with torch.inference_mode():
        logits = pair.target(torch.tensor([context], device=pair.device)).logits[0, -1].float()
    top = logits.topk(2)
    ranks = [None if t is None else int((logits > logits[t]).sum()) for t in tokens]
    return {"top2_gap": float(top.values[0] - top.values[1]), "ranks": ranks}


def identity(check: Check, deadline: Deadline) -> dict:
    prompts = check.prompts[: check.args.identity_prompts]
    references = []
    for prompt in prompts:
        if reason := deadline.skip_reason():
            return {"skipped": f"{reason} after {len(references)} of {len(prompts)} HF reference runs"}
        references.append(hf_plain_one(check.pair, prompt, check.args.max_new_tokens)["tokens"])
    if reason := deadline.skip_reason():
        return {"skipped": reason}
    outs = check.decoder.generate(prompts, max_new_tokens=check.args.max_new_tokens, batch_size=len(prompts))
    rows, matched, total = [], 0, 0
    for i, (prompt, reference, out) in enumerate(zip(prompts, references, outs, strict=True)):
        position = first_divergence(reference, out.token_ids)
        total += len(reference)
        matched += len(reference) if position is None else position
        row = {"prompt": i, "prompt_tokens": len(prompt), "hf_tokens": len(reference),
               "engine_tokens": len(out.token_ids), "identical": position is None}
        if position is not None:
            hf_token = reference[position] if position < len(reference) else None
            engine_token = out.token_ids[position] if position < len(out.token_ids) else None
            gap = top2_gap(check.pair, prompt + reference[:position], [hf_token, engine_token])
            row |= {"position": position, "hf_token": hf_token, "engine_token": engine_token,
                    "top2_gap": gap["top2_gap"], "hf_token_rank": gap["ranks"][0],
                    "engine_token_rank": gap["ranks"][1]}
        rows.append(row)
    divergences = [r for r in rows if not r["identical"]]
    return {"batch": len(prompts), "rows_identical": sum(r["identical"] for r in rows), "rows": len(rows),
            "match_rate": sum(r["identical"] for r in rows) / len(rows),
            "tokens_before_divergence": matched / total if total else 1.0,
            "divergences": divergences, "per_row": rows,
            "failed": [f"prompt {r['prompt']} diverges from HF at token {r['position']} (HF {r['hf_token']}, engine "
                       f"{r['engine_token']}, target top-2 gap {r['top2_gap']:.3g})" for r in divergences]}
