"""What one tagging decode step reads, per mode: the weights once, and each request's KV cache.

The three modes stored per document (see docs/CONTRACTS.md) differ only in the KV cache a tagging step
reads: ``sidecar_attended`` keeps the document, ``sidecar`` has evicted it, ``standalone`` is the draft model
alone given just the summary.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

from sidecar.cost.errors import CostInputError
from sidecar.cost.facts import ModelFacts
from sidecar.cost.units import GB, MB
from sidecar.modes import MODES, Mode


@dataclass(frozen=True)
class TagTokens:
    """Token counts of one request at the tagging phase.

    The defaults are estimates for the study's prompts under Qwen's ChatML template: ``system`` is the
    template and system line, ``instruction`` the summarize instruction with its turn markers,
    ``sidecar_instruction`` the hashtag instruction (the study's n ~ 25), ``tags`` the sidecar's token budget.
    Pass measured counts where you have them.
    """

    document: int
    summary: int
    system: int = 14
    instruction: int = 21
    sidecar_instruction: int = 25
    tags: int = 32

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value < 0:
                raise CostInputError(f"{name} tokens must not be negative, got {value}")
        if self.tags < 1:
            raise CostInputError("tags must be at least 1 token")

    @classmethod
    def from_measured(cls, main_prompt: float, summary: float, tags: float) -> TagTokens:
        """From a run's mean counts per request: the main task's prompt as the target sees it (system,
        document and instruction), the summary and the tags. The document is that prompt less the template
        estimates, which, like the hashtag instruction, keep their defaults."""
        return cls(
            document=max(0, round(main_prompt) - cls.system - cls.instruction),
            summary=round(summary),
            tags=max(1, round(tags)),
        )

    def mean_context(self, mode: Mode) -> float:
        """KV entries per request that a tagging decode step reads, averaged over the tag tokens."""
        # Tag token i is generated reading the prompt plus i earlier tag tokens.
        tags_so_far = (self.tags - 1) / 2
        standalone = self.system + self.summary + self.sidecar_instruction + tags_so_far
        if mode == "standalone":
            return standalone
        evicted = standalone + self.instruction  # the sidecar keeps the main instruction's entries
        if mode == "sidecar":
            return evicted
        if mode == "sidecar_attended":
            return evicted + self.document
        raise CostInputError(f"unknown mode {mode!r}; known: {', '.join(MODES)}")


@dataclass(frozen=True)
class Workload:
    """What one tagging decode step reads: the weights once, and each request's KV cache per mode.

    ``name`` labels projections (the ``pair`` column of stored cost estimates).
    """

    name: str
    weight_bytes_per_step: float
    kv_bytes_per_request: Mapping[Mode, float]
    description: str

    def __post_init__(self) -> None:
        if self.weight_bytes_per_step <= 0:
            raise CostInputError("weight bytes per step must be positive")
        for mode, kv_bytes in self.kv_bytes_per_request.items():
            if mode not in MODES:
                raise CostInputError(f"unknown mode {mode!r}; known: {', '.join(MODES)}")
            if kv_bytes <= 0:
                raise CostInputError(f"KV bytes per request for {mode} must be positive")

    @classmethod
    def from_model(cls, facts: ModelFacts, tokens: TagTokens, name: str) -> Workload:
        return cls(
            name=name,
            weight_bytes_per_step=facts.weight_bytes_per_step,
            kv_bytes_per_request={m: tokens.mean_context(m) * facts.kv_bytes_per_token for m in MODES},
            description=(
                f"{facts.model_type} draft, {facts.weight_bytes_per_step / GB:.2f} GB of weights per step, "
                f"{facts.kv_bytes_per_token / 1024:.0f} KiB of KV per token; {tokens.document} document, "
                f"{tokens.summary} summary and {tokens.tags} tag tokens per request"
            ),
        )

    def step_bytes(self, mode: Mode, batch: int) -> float:
        return self.weight_bytes_per_step + batch * self.kv_bytes_per_request[mode]

    def step_seconds(self, mode: Mode, batch: int, bandwidth_bytes_s: float) -> float:
        return self.step_bytes(mode, batch) / bandwidth_bytes_s


STUDY_WORKLOAD = Workload(
    name="source study shapes: Qwen2.5-7B/1.5B",
    weight_bytes_per_step=3.09 * GB,
    kv_bytes_per_request={"sidecar_attended": 18 * MB, "sidecar": 3.7 * MB, "standalone": 3 * MB},
    description=(
        "the source study's figures: Qwen2.5-1.5B draft in bf16 (3.09 GB of weights per step), "
        "KV per request 18 MB with the document, 3.7 MB evicted, 3 MB standalone"
    ),
)
