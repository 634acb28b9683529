"""The real pair's identity evidence: HF references decoded once, and every greedy output checked against its
reference by the divergence rule (``sidecar.decoding.divergence``), each outcome kept for the run's record."""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from sidecar.decoding.divergence import MISMATCH, NEAR_TIE, Divergence, divergence
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


@dataclass(frozen=True)
class Outcome:
    name: str
    tokens: int  # tokens of the candidate compared with the reference
    identical: int  # of them, identical up to the first divergence
    divergence: Divergence | None


class Identity:
    """Greedy outputs checked against their references; a near-tie is reported with its gap, a mismatch fails
    at ``assert_no_mismatch``."""

    def __init__(self, pair: ModelPair) -> None:
        self.pair = pair
        self.outcomes: list[Outcome] = []
        self.reported = 0  # outcomes whose near-ties were warned about

    @property
    def exact(self) -> bool:
        """fp32's rounding bound is about 1e-5 of a logit: identity is exact in practice."""
        return self.pair.dtype == torch.float32

    def check(self, name: str, prompt: list[int], reference: list[int], candidate: list[int],
              finished_by_stop: bool = False) -> Divergence | None:
        """Record how ``candidate`` compares with ``reference``; a row a stop string ended must be a prefix."""
        if finished_by_stop:
            reference = reference[: len(candidate)]
        found = divergence(self.pair.target, prompt, reference, candidate)
        identical = len(candidate) if found is None else found.position
        self.outcomes.append(Outcome(name, len(candidate), identical, found))
        return found

    def of_kind(self, kind: str) -> list[Outcome]:
        return [o for o in self.outcomes if o.divergence is not None and o.divergence.kind == kind]

    def assert_no_mismatch(self) -> None:
        """Warn about each near-tie recorded since the last call, then fail on any mismatch."""
        new, self.reported = self.outcomes[self.reported:], len(self.outcomes)
        for o in new:
            d = o.divergence
            if d is None or d.kind != NEAR_TIE:
                continue
            warnings.warn(f"{o.name}: near-tie in {dtype_name(self.pair.dtype)} at token {d.position} (gap "
                          f"{d.gap:.3f} <= bound {d.bound:.3f}, top-2 gap {d.top2_gap:.3f}); identical before it",
                          stacklevel=2)
        mismatches = self.of_kind(MISMATCH)
        assert not mismatches, "\n".join(f"{o.name}: {o.divergence}" for o in mismatches)

    def write(self, path: Path) -> None:
        """Every outcome of the module's tests, for the run's record (test-artifacts/)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({
            "pair": self.pair.name, "dtype": dtype_name(self.pair.dtype),
            "dtype_reason": getattr(self.pair, "dtype_reason", None),
            "rows": len(self.outcomes), "identical_rows": sum(o.divergence is None for o in self.outcomes),
            "near_ties": len(self.of_kind(NEAR_TIE)), "mismatches": len(self.of_kind(MISMATCH)),
            "outcomes": [asdict(o) for o in self.outcomes]}, indent=1, default=str) + "\n")
