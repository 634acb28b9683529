"""What the tagging phase costs per mode: one prefill forward, then a decode step per further tag token, and
for a sidecar the instruction line it adds to the main phase.

The three modes stored per document (see docs/CONTRACTS.md) differ in the KV cache a tagging step reads
and in what they prefill: ``sidecar_attended`` keeps the document, ``sidecar`` has evicted it, and both feed
only a few tokens into a cache that already holds the summary; ``standalone`` is the draft model alone,
which prefills its whole prompt (template, summary, tag instruction) first. A sidecar's instruction rides,
masked, in the main row's draft prefill: its share of that forward is the sidecar's too. These are the
lines of the engine's device-time ledger (``sidecar/runtime/ledger.py``), priced by the roofline of
``roofline`` and shared out by the ledger's rule, in proportion to tokens, so a projected line means what a
measured one does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING

from study.cost.errors import CostInputError, count, number
from study.cost.facts import ModelFacts
from study.cost.roofline import Device, forward_flops, prefill_seconds
from study.cost.units import GB, MB
from vocab.modes import MODES, Mode

if TYPE_CHECKING:
    from study.cost.host_floor import HostFloor


@dataclass(frozen=True)
class TagTokens:
    """Token counts of one request at the tagging phase.

    The defaults are estimates for the study's prompts under Qwen's ChatML template: ``system`` is the
    template and system line, ``instruction`` the summarize instruction with its turn markers,
    ``sidecar_instruction`` the hashtag instruction (the study's n ~ 25), ``tags`` the sidecar's token budget,
    ``sidecar_feed`` what a sidecar feeds before its first tag: the summary tokens its draft cache lacks
    (a few after speculative decoding) and the bridge. Pass measured counts where you have them.
    """

    document: int
    summary: int
    system: int = 14
    instruction: int = 21
    sidecar_instruction: int = 25
    tags: int = 32
    sidecar_feed: int = 3

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            count(f"{name} tokens", value, 0)
        count("tags tokens", self.tags, 1)
        if not 1 <= self.sidecar_feed <= self.prompt("sidecar"):
            raise CostInputError(f"sidecar_feed must be between 1 and the sidecar's prompt, got {self.sidecar_feed}")

    @classmethod
    def from_measured(cls, main_prompt: float, summary: float, tags: float, sidecar_instruction: float | None = None,
                      sidecar_feed: float | None = None) -> TagTokens:
        """From a run's mean counts per request: the main task's prompt as the target sees it (system,
        document and instruction), the summary and the tags; where the run's ledger counted them, the
        sidecar's masked instruction tokens and the tokens it fed before tagging. The document is that prompt
        less the template estimates, which, like whatever was not counted, keep their defaults."""
        for name, value in (("main prompt", main_prompt), ("summary", summary), ("tags", tags),
                            ("sidecar instruction", sidecar_instruction), ("sidecar feed", sidecar_feed)):
            if value is not None:
                number(f"measured mean {name} tokens", value, positive=False)
        instruction = cls.sidecar_instruction if sidecar_instruction is None else round(sidecar_instruction)
        document = max(0, round(main_prompt) - cls.system - cls.instruction)
        feed = cls.sidecar_feed
        if sidecar_feed is not None:
            # at least one token yields the first tag; at most the whole prompt the sidecar attends
            feed = min(max(1, round(sidecar_feed)), cls.system + round(summary) + instruction + cls.instruction)
        return cls(document=document, summary=round(summary), sidecar_instruction=instruction,
                   tags=max(1, round(tags)), sidecar_feed=feed)

    def prompt(self, mode: Mode) -> int:
        """KV entries per request when the first tag token is computed: what the tag tokens attend besides
        each other."""
        standalone = self.system + self.summary + self.sidecar_instruction
        if mode == "standalone":
            return standalone
        evicted = standalone + self.instruction  # the sidecar keeps the main instruction's entries
        if mode == "sidecar":
            return evicted
        if mode == "sidecar_attended":
            return evicted + self.document
        raise CostInputError(f"unknown mode {mode!r}; known: {', '.join(MODES)}")

    def prefill(self, mode: Mode) -> tuple[int, int]:
        """(tokens fed, entries already cached) of the forward that computes the first tag token: the standalone
        tagger prefills its whole prompt; a sidecar feeds ``sidecar_feed`` tokens into the cache it kept."""
        if mode == "standalone":
            return self.prompt(mode), 0
        return self.sidecar_feed, self.prompt(mode) - self.sidecar_feed

    @property
    def main_prefill(self) -> int:
        """Tokens of the main row's draft prefill: the target's prompt (system, document, instruction) and the
        sidecar instruction, hidden from the draft while it drafts."""
        return self.system + self.document + self.instruction + self.sidecar_instruction

    def mean_context(self, mode: Mode) -> float:
        """KV entries per request that a tagging decode step reads, averaged over the tag tokens."""
        # Tag token i is generated reading the prompt plus i earlier tag tokens.
        return self.prompt(mode) + (self.tags - 1) / 2


@dataclass(frozen=True)
class TaggingTime:
    """Roofline seconds of one batch's tagging phase: its prefill forward, then ``tags - 1`` decode steps; for a
    sidecar also ``instruction_s``, its instruction's share of the main rows' draft prefill."""

    prefill_s: float
    decode_s: float
    instruction_s: float = 0.0

    @property
    def seconds(self) -> float:
        return self.prefill_s + self.decode_s + self.instruction_s


@dataclass(frozen=True)
class Workload:
    """What one tagging decode step reads: the weights once, and each request's KV cache per mode; with the
    draft's shape (``facts``) and token counts (``tokens``) also what it computes, and what each mode prefills.

    ``name`` labels projections (the ``pair`` column of stored cost estimates). Without ``facts`` and
    ``tokens`` a step is priced by its bytes alone and the prefill not at all.
    """

    name: str
    weight_bytes_per_step: float
    kv_bytes_per_request: Mapping[Mode, float]
    description: str
    facts: ModelFacts | None = None
    tokens: TagTokens | None = None

    def __post_init__(self) -> None:
        number("weight bytes per step", self.weight_bytes_per_step)
        for mode, kv_bytes in self.kv_bytes_per_request.items():
            if mode not in MODES:
                raise CostInputError(f"unknown mode {mode!r}; known: {', '.join(MODES)}")
            number(f"KV bytes per request for {mode}", kv_bytes)

    @classmethod
    def from_model(cls, facts: ModelFacts, tokens: TagTokens, name: str, unit: str = "tag") -> Workload:
        """``unit``: what the sidecar output tokens are called in the description (``vocab.task_nouns``)."""
        return cls(
            name=name,
            weight_bytes_per_step=facts.weight_bytes_per_step,
            kv_bytes_per_request={m: tokens.mean_context(m) * facts.kv_bytes_per_token for m in MODES},
            description=(
                f"{facts.model_type} draft, {facts.weight_bytes_per_step / GB:.2f} GB of weights per step, "
                f"{facts.kv_bytes_per_token / 1024:.0f} KiB of KV per token; {tokens.document} document, "
                f"{tokens.summary} summary and {tokens.tags} {unit} tokens per request"
            ),
            facts=facts,
            tokens=tokens,
        )

    @property
    def prices_compute(self) -> bool:
        """Whether FLOPs, and so the prefill, can be priced: the draft's shape and token counts are known."""
        return self.facts is not None and self.tokens is not None

    def step_bytes(self, mode: Mode, batch: int) -> float:
        return self.weight_bytes_per_step + batch * self.kv_bytes_per_request[mode]

    def step_flops(self, mode: Mode, batch: int) -> float | None:
        """FLOPs of a tagging decode step; None without the draft's shape and token counts."""
        if self.facts is None or self.tokens is None:
            return None
        # A step that reads n entries feeds one token into a cache of n - 1.
        return forward_flops(self.facts, batch, 1, max(0.0, self.tokens.mean_context(mode) - 1))

    def step_seconds(self, mode: Mode, batch: int, bandwidth_bytes_s: float, flops_s: float | None = None,
                     host: HostFloor | None = None) -> float:
        """Bytes over bandwidth; with ``flops_s`` and a shape, the longer of that and FLOPs over ``flops_s``; plus
        ``host``'s floor at the draft's depth (the benchmark's depth without a shape): a plain step's, one draft
        forward a step."""
        memory = self.step_bytes(mode, batch) / bandwidth_bytes_s
        flops = self.step_flops(mode, batch)
        roofline = memory if flops is None or flops_s is None else max(memory, flops / flops_s)
        layers = None if self.facts is None else self.facts.layers
        return roofline if host is None else host.plain.forward_seconds(roofline, layers, batch)

    def tagging_time(self, mode: Mode, batch: int, device: Device, host: HostFloor | None = None
                     ) -> TaggingTime | None:
        """One batch's tagging phase on ``device``: the prefill that yields the first tag token, then a decode
        step per further tag token; for a sidecar, the instruction's share of the batch's main draft prefill,
        in proportion to its tokens there, as the ledger shares a forward out. None without the draft's shape
        and token counts."""
        if self.facts is None or self.tokens is None:
            return None
        tokens, context = self.tokens.prefill(mode)
        step = self.step_seconds(mode, batch, device.bandwidth_bytes_s, device.flops_s, host)
        instruction_s = 0.0
        if mode != "standalone" and self.tokens.sidecar_instruction:
            main = self.tokens.main_prefill
            instruction_s = (prefill_seconds(self.facts, device, batch, main, host=host)
                             * self.tokens.sidecar_instruction / main)
        return TaggingTime(
            prefill_s=prefill_seconds(self.facts, device, batch, tokens, context, host=host),
            decode_s=(self.tokens.tags - 1) * step,
            instruction_s=instruction_s,
        )


def qwen2_facts(config: dict, dtype_bytes: int = 2) -> ModelFacts:
    """The sizes of a Qwen2 model of published ``config`` (its hidden size, layers, heads...), as the cost model
    reads them."""
    return ModelFacts.from_config(SimpleNamespace(model_type="qwen2", **config), dtype_bytes)


# Qwen2.5-1.5B-Instruct's published config (the study's draft): its shapes price the study's FLOPs.
QWEN2_5_1_5B_CONFIG = {
    "hidden_size": 1536,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "intermediate_size": 8960,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}
QWEN2_5_1_5B = qwen2_facts(QWEN2_5_1_5B_CONFIG)
# Qwen2.5-7B-Instruct's published config (the study's target), for replaying a whole decode (``replay``).
QWEN2_5_7B_CONFIG = {
    "hidden_size": 3584,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "intermediate_size": 18944,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
}
QWEN2_5_7B = qwen2_facts(QWEN2_5_7B_CONFIG)
# Token counts that give the study's KV figures at the draft's 28 KiB per token (3.0, 3.6 and 18.0 MB).
STUDY_TOKENS = TagTokens(document=502, summary=51)

STUDY_WORKLOAD = Workload(
    name="source study shapes: Qwen2.5-7B/1.5B",
    weight_bytes_per_step=3.09 * GB,
    kv_bytes_per_request={"sidecar_attended": 18 * MB, "sidecar": 3.7 * MB, "standalone": 3 * MB},
    description=(
        "the source study's figures: Qwen2.5-1.5B draft in bf16 (3.09 GB of weights per step), "
        "KV per request 18 MB with the document, 3.7 MB evicted, 3 MB standalone; FLOPs from the draft's "
        f"published shapes with {STUDY_TOKENS.document} document, {STUDY_TOKENS.summary} summary and "
        f"{STUDY_TOKENS.tags} tag tokens per request, the counts that give those KV figures"
    ),
    facts=QWEN2_5_1_5B,
    tokens=STUDY_TOKENS,
)
