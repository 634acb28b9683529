"""The cost report in one breath: the first measured verdict with the lines it follows from, and the KV a tagging
request keeps per mode.

This is what a person reads before opening the report (``sidecar demo`` prints it). The verdict compares
attributed device seconds per tag token of the sidecar (evicted; prefill + decode + instruction line) and the
standalone tagger (prefill + decode) at one measured batch size; each mode's lines per request come with it
(``sidecar``, ``standalone``: tag tokens and device seconds per line), so a reader can redo the division. The
KV per request comes from the roofline workload of the same pair, modelled from its measured token counts in
the dtype it is loaded in on a GPU, so that evicted, attended and standalone are given for every run, also
one that never ran attended. ``unit`` names the tokens (``vocab.task_nouns``) and ``tasks`` holds the cost
verdict per sidecar task, which the demo prints each in its own words.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from study.report.assemble import ReportData
from study.report.tagging_cost import TaggingCost


@dataclass(frozen=True)
class Headline:
    gpu_type: str
    pair: str
    basis: str
    batch: int
    # per request: tag_tokens, prefill_s, decode_s, instruction_s (device seconds per line)
    sidecar: dict[str, float | None]
    standalone: dict[str, float | None]
    sidecar_ms_per_tag_token: float
    standalone_ms_per_tag_token: float
    sidecar_saving_pct: float  # from the two lines above: 1 - sidecar / standalone ms per tag token
    sidecar_tokens_per_s: float
    standalone_tokens_per_s: float
    usd_per_gpu_hour: float | None
    sidecar_usd_per_mtok: float | None
    standalone_usd_per_mtok: float | None
    # modelled per request; None when the pair has no roofline workload
    kv_evicted_bytes: float | None
    kv_attended_bytes: float | None
    kv_standalone_bytes: float | None
    # what the tokens above are called ("tag", "headline", "output" for several tasks: vocab.task_nouns), and the
    # cost verdict per sidecar task (study.report.task_costs.TaskCost.as_dict: task, noun, ms per token per mode,
    # tokens, saving_pct)
    unit: str = "tag"
    tasks: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _lines(cost: TaggingCost) -> dict[str, float | None]:
    return {"tag_tokens": cost.tag_tokens, "prefill_s": cost.prefill_s, "decode_s": cost.decode_s,
            "instruction_s": cost.instruction_s}


def headline(data: ReportData) -> Headline | None:
    """None when nothing was measured in both the sidecar and the standalone mode with a ledger."""
    verdict = next((v for v in data.verdicts if v.basis == "measured"), None)
    if verdict is None:
        return None
    own = data.pair_projections.get(verdict.pair)
    kv = own.workload.kv_bytes_per_request if own is not None else {}
    return Headline(
        gpu_type=verdict.gpu_type, pair=verdict.pair, basis=verdict.basis, batch=verdict.batch,
        sidecar=_lines(verdict.sidecar), standalone=_lines(verdict.standalone),
        sidecar_ms_per_tag_token=verdict.sidecar.seconds_per_tag_token * 1000,
        standalone_ms_per_tag_token=verdict.standalone.seconds_per_tag_token * 1000,
        sidecar_saving_pct=verdict.sidecar_saving_pct,
        sidecar_tokens_per_s=verdict.sidecar_tokens_per_s, standalone_tokens_per_s=verdict.standalone_tokens_per_s,
        usd_per_gpu_hour=verdict.usd_per_gpu_hour, sidecar_usd_per_mtok=verdict.sidecar_usd_per_mtok,
        standalone_usd_per_mtok=verdict.standalone_usd_per_mtok, kv_evicted_bytes=kv.get("sidecar"),
        kv_attended_bytes=kv.get("sidecar_attended"), kv_standalone_bytes=kv.get("standalone"),
        unit=data.unit, tasks=[t.as_dict() for t in data.tasks],
    )
