"""Storage records of one document in one mode, from the engine's outputs.

``batch_id`` names the engine batch (stream or call) the record's rows ran in; ``*_ended_s`` place each
phase on that batch's clock (``storage.RequestStats.ended_s``).
"""

from __future__ import annotations

from dataclasses import replace

from sidecar.tasks.rows import DocumentResult, SidecarOutput
from storage import Document, OutputRecord, RequestStats


def _tags(output: SidecarOutput) -> list[str] | None:
    return output.parsed if isinstance(output.parsed, list) else None


def sidecar_record(doc: Document, mode: str, result: DocumentResult, task_name: str, batch_id: int | None,
                   main_ended_s: float | None = None, sidecar_ended_s: float | None = None) -> OutputRecord:
    main = result.main
    output = result.sidecars[task_name]
    return OutputRecord(
        doc_id=doc.doc_id, mode=mode, summary=main.text, sidecar_name=task_name, sidecar_text=output.text,
        tags=_tags(output), main_tokens=main.stats.new_tokens, parse_error=output.parse_error,
        finish_reason=main.finish_reason, sidecar_finish_reason=output.finish_reason, batch_id=batch_id,
        stats=[replace(RequestStats.main_phase(main.stats.as_dict()), ended_s=main_ended_s),
               replace(RequestStats.sidecar_phase(output.stats.as_dict()), ended_s=sidecar_ended_s)],
    )


def standalone_record(doc: Document, summary: str, output: SidecarOutput, batch_id: int | None,
                      ended_s: float | None = None) -> OutputRecord:
    return OutputRecord(
        doc_id=doc.doc_id, mode="standalone", summary=summary, sidecar_name=output.name,
        sidecar_text=output.text, tags=_tags(output), parse_error=output.parse_error,
        sidecar_finish_reason=output.finish_reason, batch_id=batch_id,
        stats=[replace(RequestStats.sidecar_phase(output.stats.as_dict()), ended_s=ended_s)],
    )
