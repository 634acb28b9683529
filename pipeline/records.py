"""Storage records of one document in one mode, from the engine's outputs: the main output once, each sidecar
task's output beside it.

``batch_id`` names the engine batch (stream or call) the record's rows ran in; ``*_ended_s`` place each
phase on that batch's clock (``storage.RequestStats.ended_s``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from sidecar.tasks.rows import DocumentResult, SidecarOutput
from storage import Document, OutputRecord, RequestStats, SidecarRecord


def task_record(output: SidecarOutput) -> SidecarRecord:
    """One task's output as ``sidecar_outputs`` stores it: its parsed value as JSON, its tokens and its share
    of the device-time ledger (prefill, decode and masked instruction seconds)."""
    stats = output.stats
    return SidecarRecord.of(
        output.name, output.text, output.parsed, parse_error=output.parse_error,
        finish_reason=output.finish_reason, new_tokens=stats.new_tokens,
        device_s=stats.prefill_device_seconds + stats.decode_device_seconds + stats.instruction_device_seconds)


def _task_records(outputs: Mapping[str, SidecarOutput]) -> list[SidecarRecord]:
    # by name: the engine hands outputs on as they finish
    return [task_record(outputs[name]) for name in sorted(outputs)]


def _sidecar_phase(outputs: Mapping[str, SidecarOutput], ended_s: float | None) -> RequestStats:
    """The request's sidecar phase: all its tasks together."""
    return replace(RequestStats.together([RequestStats.sidecar_phase(o.stats) for o in outputs.values()]),
                   ended_s=ended_s)


def sidecar_record(doc: Document, mode: str, result: DocumentResult, batch_id: int | None,
                   main_ended_s: float | None = None, sidecar_ended_s: float | None = None) -> OutputRecord:
    main = result.main
    return OutputRecord(
        doc_id=doc.doc_id, mode=mode, summary=main.text,
        sidecars=_task_records(result.sidecars), main_tokens=main.stats.new_tokens,
        finish_reason=main.finish_reason, batch_id=batch_id,
        stats=[replace(RequestStats.main_phase(main.stats), ended_s=main_ended_s),
               _sidecar_phase(result.sidecars, sidecar_ended_s)],
    )


def standalone_record(doc: Document, summary: str, outputs: Mapping[str, SidecarOutput], batch_id: int | None,
                      ended_s: float | None = None) -> OutputRecord:
    return OutputRecord(
        doc_id=doc.doc_id, mode="standalone", summary=summary, sidecars=_task_records(outputs),
        batch_id=batch_id, stats=[_sidecar_phase(outputs, ended_s)],
    )
