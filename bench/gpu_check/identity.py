"""The identity part: the engine's greedy output at one batch against HF ``generate`` on the target alone.

HF runs one prompt at a time, the engine all of them in one batch. Each row is identical, diverges at a near-tie
(reduced precision rounds differently at different batch shapes: allowed and counted) or mismatches (fails the
check), by ``sidecar.decoding.divergence``'s rule, the one the identity tests use, worded as every bench words
it (``bench.identity``): every divergence is listed with its position, the gap between the two tokens' logits in
the target's reference forward, and the bound.
"""

from __future__ import annotations

from bench.gpu_check.check import Check
from bench.gpu_check.deadline import Deadline
from bench.hf_baselines import hf_plain_one
from bench.identity import IDENTICAL, compare, failures, verdict
from sidecar.decoding.divergence import MISMATCH, NEAR_TIE


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
    rows, comparisons, matched, total = [], [], 0, 0
    for i, (prompt, reference, out) in enumerate(zip(prompts, references, outs, strict=True)):
        same = compare(check.pair.target, prompt, reference, out.token_ids, f"prompt {i}")
        comparisons.append(same)
        total += len(reference)
        matched += len(reference) if same["identical"] else same["position"]
        row = {"prompt": i, "prompt_tokens": len(prompt), "hf_tokens": len(reference),
               "engine_tokens": len(out.token_ids), "verdict": same["kind"]}
        if not same["identical"]:
            row |= {"position": same["position"], "hf_token": same["reference_token"],
                    "engine_token": same["candidate_token"], "gap": same["gap"], "top2_gap": same["top2_gap"],
                    "bound": same["bound"]}
        rows.append(row)
    count = {kind: sum(r["verdict"] == kind for r in rows) for kind in (IDENTICAL, NEAR_TIE, MISMATCH)}
    divergences = [r for r in rows if r["verdict"] != IDENTICAL]
    return {"batch": len(prompts), "rows_identical": count[IDENTICAL], "rows_near_tie": count[NEAR_TIE],
            "rows_mismatch": count[MISMATCH], "rows": len(rows), "match_rate": count[IDENTICAL] / len(rows),
            "tokens_before_divergence": matched / total if total else 1.0,
            "identical_output": verdict(comparisons), "divergences": divergences, "per_row": rows,
            "failed": failures(comparisons)}
