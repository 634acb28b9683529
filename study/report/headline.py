"""The cost report in one breath: the first measured verdict, and the KV a tagging request keeps per mode.

This is what a person reads before opening the report (``sidecar demo`` prints it). Throughput and
price come from the measured verdict (sidecar with the document evicted against standalone, pooled over
the batch sizes measured in both modes); the KV per request comes from the roofline workload of the
same pair, modelled from its measured token counts in the dtype it is loaded in on a GPU, so that
evicted, attended and standalone are given for every run, also one that never ran attended.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from study.report.assemble import ReportData


@dataclass(frozen=True)
class Headline:
    gpu_type: str
    pair: str
    basis: str
    batch_sizes: tuple[int, ...]
    sidecar_tokens_per_s: float
    standalone_tokens_per_s: float
    usd_per_gpu_hour: float | None
    sidecar_usd_per_mtok: float | None
    standalone_usd_per_mtok: float | None
    # modelled per request; None when the pair has no roofline workload
    kv_evicted_bytes: float | None
    kv_attended_bytes: float | None
    kv_standalone_bytes: float | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def headline(data: ReportData) -> Headline | None:
    """None when nothing was measured in both the sidecar and the standalone mode."""
    verdict = next((v for v in data.verdicts if v.basis == "measured"), None)
    if verdict is None:
        return None
    own = data.pair_projections.get(verdict.pair)
    kv = own.workload.kv_bytes_per_request if own is not None else {}
    return Headline(
        gpu_type=verdict.gpu_type, pair=verdict.pair, basis=verdict.basis, batch_sizes=verdict.batch_sizes,
        sidecar_tokens_per_s=verdict.sidecar_tokens_per_s, standalone_tokens_per_s=verdict.standalone_tokens_per_s,
        usd_per_gpu_hour=verdict.usd_per_gpu_hour, sidecar_usd_per_mtok=verdict.sidecar_usd_per_mtok,
        standalone_usd_per_mtok=verdict.standalone_usd_per_mtok, kv_evicted_bytes=kv.get("sidecar"),
        kv_attended_bytes=kv.get("sidecar_attended"), kv_standalone_bytes=kv.get("standalone"),
    )
