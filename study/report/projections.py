"""Projections of the measured pairs: each pair's draft and measured token counts as a roofline workload.

Each measured pair is projected from its draft's config in the dtype ``load_pair`` gives it on a CUDA
device, with the measured mean prompt, summary and tag tokens per request. A pair whose config is not on
this machine, or rows without a pair, get no workload, and the reason is kept for the report. The report
prices a tag token over every line of the tagging phase (prefill, decode, a sidecar's instruction line)
wherever the workload can price the prefill (``tag_tokens_per_s``), as a measured tag tok/s counts it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from study.cost import CostInputError, ModelFacts, ProjectionRow, TagTokens, Workload, default_dtype
from study.report.measurements import Measurement
from vocab.modes import Mode

if TYPE_CHECKING:
    from types import SimpleNamespace

    from transformers import PretrainedConfig

# a pair's name -> its draft's config (``study.cost.draft_config``: the tiny pair's as a namespace of its fields)
DraftConfig = Callable[[str], "PretrainedConfig | SimpleNamespace"]


@dataclass(frozen=True)
class Projection:
    """One workload on every catalog GPU; ``pair`` is the measured pair it models, None for the study's."""

    workload: Workload
    rows: dict[str, list[ProjectionRow]]  # by catalog GPU name
    pair: str | None = None

    def row(self, gpu_name: str, mode: Mode, batch: int) -> ProjectionRow | None:
        return next((r for r in self.rows.get(gpu_name, ()) if r.mode == mode and r.batch == batch), None)


def tag_tokens_per_s(row: ProjectionRow) -> float:
    """Tag tokens/s over the tagging phase, every line included, where priced; else over decode steps."""
    return row.tokens_per_s if row.tag_tokens_per_s is None else row.tag_tokens_per_s


def tag_usd_per_million(row: ProjectionRow) -> float | None:
    """$ per 1M tag tokens at :func:`tag_tokens_per_s`; None without a price."""
    return row.usd_per_million_tokens if row.tag_tokens_per_s is None else row.usd_per_million_tag_tokens


def _per_ledgered_request(rows: Sequence[Measurement], tokens: str) -> float | None:
    """Mean of a ledger token count (``prefill_tokens``, ``instruction_tokens``) per request that has one."""
    ledgered = [r for r in rows if r.has_ledger and getattr(r, tokens) is not None]
    requests = sum(r.ledger_requests or 0 for r in ledgered)
    return sum(getattr(r, tokens) for r in ledgered) / requests if requests else None


def _measured_tag_tokens(rows: Sequence[Measurement]) -> TagTokens | None:
    """Mean token counts per request: the main phase's prompt and summary, and the tags of every mode; where
    the ledger counted them, the evicted sidecar's instruction tokens and its feed before tagging."""
    main = [r for r in rows if not r.is_tagging and r.requests and r.prompt_tokens is not None and r.tokens]
    tag = [r for r in rows if r.is_tagging and r.requests and r.tokens]
    if not main or not tag:
        return None
    main_requests = sum(r.requests or 0 for r in main)
    sidecar = [r for r in tag if r.mode == "sidecar"]
    return TagTokens.from_measured(
        main_prompt=sum((r.prompt_tokens or 0) * (r.requests or 0) for r in main) / main_requests,
        summary=sum(r.tokens or 0 for r in main) / main_requests,
        tags=sum(r.tokens or 0 for r in tag) / sum(r.requests or 0 for r in tag),
        sidecar_instruction=_per_ledgered_request(sidecar, "instruction_tokens"),
        sidecar_feed=_per_ledgered_request(sidecar, "prefill_tokens"),
    )


def pair_workloads(
    measurements: Sequence[Measurement], draft_config: DraftConfig, unit: str = "tag"
) -> tuple[dict[str, Workload], list[str]]:
    """A workload per measured pair, and why the measurements that have none have none; ``unit`` names the
    sidecar output tokens (``vocab.task_nouns``)."""
    by_pair: dict[str, list[Measurement]] = defaultdict(list)
    for m in measurements:
        by_pair[m.pair].append(m)
    unnamed = by_pair.pop("", [])
    missing = [f"rows without a pair (on {', '.join(sorted({m.gpu_type for m in unnamed}))})"] if unnamed else []
    # The catalog's GPUs are CUDA devices: a pair is projected in the dtype load_pair gives it there.
    dtype, dtype_bytes = default_dtype("cuda")
    workloads = {}
    for pair, rows in sorted(by_pair.items()):
        tokens = _measured_tag_tokens(rows)
        if tokens is None:
            missing.append(f"{pair}: no main-phase prompt and summary tokens with {unit} tokens were measured")
            continue
        try:
            facts = ModelFacts.from_config(draft_config(pair), dtype_bytes)
        except CostInputError as exc:
            missing.append(f"{pair}: {exc}")
            continue
        workloads[pair] = Workload.from_model(facts, tokens, name=f"{pair} ({dtype})", unit=unit)
    return workloads, missing
