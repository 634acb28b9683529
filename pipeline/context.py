"""The token-level context check, made before any window runs."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from pipeline.settings import BatchSettings
from storage import Document, RejectedDocument
from vocab.modes import SIDECAR_MODES

if TYPE_CHECKING:
    from sidecar.tasks.engine import SidecarEngine


def context_need(engine: SidecarEngine, doc: Document, settings: BatchSettings) -> tuple[int, int]:
    """(tokens the document's longest phase needs, the context it has), as the engine will count them."""
    # the engine's modules (torch) load where an engine exists: not in a sharded run's parent, which only keeps
    # the over-context rejects its shards found (keep_over_context)
    from sidecar.tasks.rows import SidecarRequest

    sidecar_modes = [mode for mode in settings.modes if mode in SIDECAR_MODES]
    tasks = settings.mode_tasks(sidecar_modes[0]) if sidecar_modes else []
    # the draft's compound prompt holds every task's instruction
    bare, compound = engine.prompts(SidecarRequest(doc.text, settings.instruction, settings.system, sidecars=tasks))
    gamma = engine.decoder.gamma
    # the speculative phase checks prompt + new tokens + one draft window against the target's context
    need = max(len(bare.token_ids), len(compound.token_ids)) + settings.max_new_tokens + gamma + 1
    if tasks:
        # the draft continues the same cache with each task's bridge and tokens: the longest task counts
        longest = max(len(engine.builder.bridge(t)) + t.max_new_tokens for t in tasks)
        need = max(need, len(compound.token_ids) + settings.max_new_tokens + longest + 1)
    limit = min(engine.pair.max_context, int(engine.pair.draft.config.max_position_embeddings))
    return need, limit


def split_by_context(engine: SidecarEngine, docs: Iterable[Document],
                     settings: BatchSettings) -> tuple[list[Document], list[RejectedDocument]]:
    """Documents that fit the models' context, and rejects (reason ``over_context``) for those that do not.

    Checked in tokens before any window runs, so one over-long article is a reject instead of an
    InputError that fails its whole window.
    """
    fit: list[Document] = []
    rejects: list[RejectedDocument] = []
    for doc in docs:
        need, limit = context_need(engine, doc, settings)
        if need <= limit:
            fit.append(doc)
        else:
            rejects.append(RejectedDocument(
                doc_id=doc.doc_id, reason="over_context", row_index=doc.row_index, title=doc.title, text=doc.text,
                detail=f"needs {need} tokens (prompt, {settings.max_new_tokens} summary tokens and the sidecar "
                       f"tasks); the model context is {limit} tokens"))
    return fit, rejects


def keep_over_context(docs: Iterable[Document], stored: Iterable[RejectedDocument]
                      ) -> tuple[list[Document], list[RejectedDocument]]:
    """``docs`` less those a run already stored as ``over_context`` rejects (the same row, id, title and
    text), and those rejects: a sharded run's parent has no model to check the context with, and without this
    every rerun would launch a shard only to reject the same documents again."""
    over = {r.row_index: r for r in stored if r.reason == "over_context"}
    fit: list[Document] = []
    kept: list[RejectedDocument] = []
    for doc in docs:
        reject = over.get(doc.row_index)
        if reject is not None and (reject.doc_id, reject.title, reject.text) == (doc.doc_id, doc.title, doc.text):
            kept.append(reject)
        else:
            fit.append(doc)
    return fit, kept
