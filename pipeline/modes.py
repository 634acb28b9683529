"""One batch's documents in every mode: engine passes out, storage records in."""

from __future__ import annotations

from collections.abc import Sequence

from pipeline.settings import BatchSettings
from sidecar.engine import SidecarEngine
from sidecar.modes import SIDECAR_MODES
from sidecar.progress import ProgressCallback
from sidecar.sidecar_rows import DocumentResult, SidecarOutput, SidecarRequest
from storage import Document, OutputRecord, RequestStats


def run_modes(engine: SidecarEngine, docs: Sequence[Document], settings: BatchSettings,
              batch_id: int | None = None, on_progress: ProgressCallback | None = None) -> list[OutputRecord]:
    """One engine pass per sidecar mode, then the standalone tagger on the summaries; records per mode.
    ``on_progress`` hears the engine's phases, named ``"<mode>: <phase>"``.

    The two sidecar modes run as separate passes although one pass could carry both tasks: the engine
    decodes all of a pass's sidecar rows in shared chunks, and rows of both modes in one chunk would
    give neither mode its own batch time in ``request_stats``.
    """
    size = len(docs)
    records: list[OutputRecord] = []
    sidecar_modes = [m for m in settings.modes if m in SIDECAR_MODES]
    summaries: list[DocumentResult] | None = None

    def progress_of(mode: str) -> ProgressCallback | None:
        if on_progress is None:
            return None
        return lambda phase, done, total: on_progress(f"{mode}: {phase}", done, total)

    for mode in sidecar_modes:
        task = settings.mode_task(mode)
        results = engine.run([SidecarRequest(d.text, sidecars=[task]) for d in docs],
                             max_new_tokens=settings.max_new_tokens, batch_size=size, on_progress=progress_of(mode))
        records += [sidecar_record(d, mode, r, task.name, batch_id) for d, r in zip(docs, results, strict=True)]
        summaries = summaries or results
    if "standalone" in settings.modes:
        if summaries is None:  # standalone only: the summaries still come from the speculative pass
            summaries = engine.run([SidecarRequest(d.text) for d in docs], max_new_tokens=settings.max_new_tokens,
                                   batch_size=size, on_progress=progress_of("standalone"))
        task = settings.mode_task("standalone")
        texts = [r.main.text for r in summaries]
        tagged = engine.standalone(texts, [task], batch_size=size, on_progress=progress_of("standalone"))
        records += [standalone_record(d, text, outputs[task.name], batch_id)
                    for d, text, outputs in zip(docs, texts, tagged, strict=True)]
    return records


def _tags(output: SidecarOutput) -> list[str] | None:
    return output.parsed if isinstance(output.parsed, list) else None


def sidecar_record(doc: Document, mode: str, result: DocumentResult, task_name: str,
                   batch_id: int | None) -> OutputRecord:
    main = result.main
    output = result.sidecars[task_name]
    main_stats = main.stats.as_dict()
    return OutputRecord(
        doc_id=doc.doc_id, mode=mode, summary=main.text, sidecar_name=task_name, sidecar_text=output.text,
        tags=_tags(output), main_tokens=main.stats.new_tokens, parse_error=output.parse_error,
        finish_reason=main.finish_reason, sidecar_finish_reason=output.finish_reason, batch_id=batch_id,
        stats=[RequestStats.main_phase(main_stats),
               RequestStats.sidecar_phase(output.stats.as_dict())],
    )


def standalone_record(doc: Document, summary: str, output: SidecarOutput, batch_id: int | None) -> OutputRecord:
    return OutputRecord(
        doc_id=doc.doc_id, mode="standalone", summary=summary, sidecar_name=output.name,
        sidecar_text=output.text, tags=_tags(output), parse_error=output.parse_error,
        sidecar_finish_reason=output.finish_reason, batch_id=batch_id,
        stats=[RequestStats.sidecar_phase(output.stats.as_dict())],
    )
