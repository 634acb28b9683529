"""The real pair's identity evidence: every greedy output checked against the target's own greedy choices by the
divergence rule (``sidecar.decoding.divergence``), each outcome kept for the run's record.

The reference of an output is teacher-forced: the target's forward over the prompt (once per prompt), then one
over the output on the prompt's keys and values, gives at every position the token greedy decoding picks after
the output's own prefix (``teacher_forced_reference``). Greedy output is the target's exactly when each token is
that pick, which is what HF ``generate`` decodes one forward per token; the two differ only by the rounding of
wide forwards against incremental ones, which the near-tie rule already allows for. HF ``generate`` itself stays
the reference of one row (``greedy_references``), so the two references are checked against each other on every
run.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import torch
from transformers import Cache

from bench.identity import IDENTICAL, compare, failures, verdict
from sidecar.decoding.divergence import MISMATCH, NEAR_TIE, classify_divergence, first_divergence
from sidecar.models.pair import ModelPair, dtype_name


def greedy_references(pair: ModelPair, prompts: list[list[int]], limits: list[int]) -> list[list[int]]:
    """HF ``generate`` of the target alone, greedy, one prompt at a time, ``limits[i]`` new tokens for prompt
    ``i``: each output ends at its end-of-sequence token (kept) or its limit. One at a time because on a CPU
    in bf16 HF's padded batches cost as much per row-step as single rows (0.19 s at batch 8 vs 0.2-0.4 s at 1),
    and a padded batch would itself be another rounding of the reference."""
    references = []
    with torch.inference_mode():
        for prompt, limit in zip(prompts, limits, strict=True):
            out = pair.target.generate(torch.tensor([prompt], device=pair.device), do_sample=False,
                                       max_new_tokens=limit, eos_token_id=pair.eos_token_ids)
            references.append(out[0, len(prompt):].tolist())
    return references


def prompt_state(pair: ModelPair, prompt: list[int]) -> tuple[Cache, torch.Tensor]:
    """The target's keys and values over ``prompt`` (a Hugging Face cache) and its logits [1, V] after it: what
    ``teacher_forced`` needs of a prompt, computed once for the outputs of every row that has it."""
    with torch.inference_mode():
        # the LM head at the prompt's last position only (151,936 entries a position: over all ~230 it was ~15%
        # of the forward)
        out = pair.target(torch.tensor([prompt], device=pair.device), use_cache=True, logits_to_keep=1)
    return out.cache, out.logits[0]


def teacher_forced(pair: ModelPair, prompt: list[int], candidate: list[int], limit: int,
                   state: tuple[Cache, torch.Tensor] | None = None) -> tuple[list[int], torch.Tensor | None]:
    """The target's greedy continuation of ``prompt`` as far as ``candidate`` follows it: ``candidate`` up to its
    first token that is not the target's argmax after the tokens before it, then that argmax. An output that
    ends before ``limit`` without an end-of-sequence token gets the target's next pick appended, so ending early
    is a divergence too. One forward at batch 1 over the output, after the prompt's ``state`` (``prompt_state``,
    computed here when not given; the cache is left as it was given); with the reference, the target's logits
    [V] where it leaves ``candidate`` (None where it does not), which classify that divergence
    (``sidecar.decoding.divergence.classify_divergence``) without another forward over the same tokens."""
    cache, last = state if state is not None else prompt_state(pair, prompt)
    fed = candidate[: len(candidate) - (len(candidate) >= limit)]
    logits = last
    if fed:
        with torch.inference_mode():
            try:
                fed_logits = pair.target(torch.tensor([fed], device=pair.device), cache=cache, use_cache=True).logits
            finally:
                cache.crop(len(prompt) - cache.get_seq_length())  # the prompt's again, for the next output
        logits = torch.cat([last, fed_logits[0]])  # [n (+1), V]: after the prompt, then after each output token
    picks = logits.argmax(-1).tolist()
    for position, token in enumerate(candidate):
        if token != picks[position]:
            return [*candidate[:position], picks[position]], logits[position].clone()
    ended = bool(candidate) and candidate[-1] in pair.eos_token_ids
    if ended or len(candidate) >= limit:
        return candidate, None
    return [*candidate, picks[len(candidate)]], logits[len(candidate)].clone()


def teacher_forced_reference(pair: ModelPair, prompt: list[int], candidate: list[int], limit: int) -> list[int]:
    """``teacher_forced``'s reference alone."""
    return teacher_forced(pair, prompt, candidate, limit)[0]


class Identity:
    """Greedy outputs checked against their references (``bench.identity.compare``, the benchmarks' wording); a
    near-tie is reported with its gap, a mismatch fails at ``assert_no_mismatch``."""

    def __init__(self, pair: ModelPair) -> None:
        self.pair = pair
        self.outcomes: list[dict] = []  # compare's fields, and the candidate's length as "tokens"
        self.reported = 0  # outcomes whose near-ties were warned about
        # teacher-forced references and their logits where they leave the candidate, by (prompt, candidate,
        # limit): the module's tests decode the same rows more than once, mostly to the same output, and a
        # reference is one forward over its ~50 output tokens (over ~240 with its prompt's, seconds here)
        self.references: dict[tuple[tuple[int, ...], tuple[int, ...], int],
                              tuple[list[int], torch.Tensor | None]] = {}
        # each prompt's keys and values: a row decoded to another output in a later test (in bf16, 3-4 of the
        # fixed-gamma test's 8) forwards only its ~50 output tokens, not its ~230-token prompt again
        self.prompts: dict[tuple[int, ...], tuple[Cache, torch.Tensor]] = {}

    @property
    def exact(self) -> bool:
        """fp32's rounding bound is about 1e-5 of a logit: identity is exact in practice."""
        return self.pair.dtype == torch.float32

    def check(self, name: str, prompt: list[int], candidate: list[int], limit: int, reference: list[int] | None = None,
              finished_by_stop: bool = False) -> dict:
        """Record how ``candidate`` (at most ``limit`` tokens) compares with ``reference`` (default: teacher-forced);
        a row a stop string ended must be a prefix."""
        if reference is not None:
            reference = reference[: len(candidate)] if finished_by_stop else reference
            outcome = compare(self.pair.target, prompt, reference, candidate, name)
        else:
            limit = len(candidate) if finished_by_stop else limit
            key = (tuple(prompt), tuple(candidate), limit)
            if key not in self.references:
                if key[0] not in self.prompts:
                    self.prompts[key[0]] = prompt_state(self.pair, prompt)
                self.references[key] = teacher_forced(self.pair, prompt, candidate, limit, self.prompts[key[0]])
            reference, logits = self.references[key]
            if finished_by_stop:
                reference = reference[: len(candidate)]
            # compare's outcome, its divergence classified from the teacher-forced forward's logits there: the
            # prompt and the same prefix, so compare would run that forward again
            position = first_divergence(reference, candidate)
            outcome = {"label": name, "identical": True, "kind": IDENTICAL} if position is None else {
                "label": name, "identical": False, **dataclasses.asdict(classify_divergence(
                    position, logits, reference[position] if position < len(reference) else None,
                    candidate[position] if position < len(candidate) else None, self.pair.target.dtype))}
        self.outcomes.append(outcome | {"tokens": len(candidate)})
        return self.outcomes[-1]

    def count(self, kind: str) -> int:
        return sum(o["kind"] == kind for o in self.outcomes)

    def assert_no_mismatch(self) -> None:
        """Warn about each near-tie recorded since the last call, then fail on any mismatch."""
        new, self.reported = self.outcomes[self.reported:], len(self.outcomes)
        for o in new:
            if o["kind"] == NEAR_TIE:
                warnings.warn(f"{o['label']}: near-tie in {dtype_name(self.pair.dtype)} at token {o['position']} "
                              f"(gap {o['gap']:.3f} <= bound {o['bound']:.3f}, top-2 gap {o['top2_gap']:.3f}); "
                              "identical before it", stacklevel=2)
        mismatches = failures(self.outcomes)
        assert not mismatches, "\n".join(mismatches)

    def write(self, path: Path) -> None:
        """Every outcome of the module's tests, for the run's record (test-artifacts/)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({
            "pair": self.pair.name, "dtype": dtype_name(self.pair.dtype),
            "dtype_reason": getattr(self.pair, "dtype_reason", None),
            "rows": len(self.outcomes), "identical_rows": self.count(IDENTICAL), "near_ties": self.count(NEAR_TIE),
            "mismatches": self.count(MISMATCH), "verdict": verdict(self.outcomes), "outcomes": self.outcomes},
            indent=1) + "\n")
