"""A sidecar request's prompts and rows: what the target and the draft see, checked against both contexts.

Per request the target sees the bare prompt (system, document, main instruction); the draft sees the
compound prompt with every sidecar instruction appended as a hidden span, prefilled once and hidden
from its attention while it drafts the main output. When the main output is final, each sidecar
continues from a view of that draft cache (``sidecar_view``): its own instruction shown, the other
sidecars' instructions dropped, and the document's columns evicted unless the task attends to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from sidecar.decoding.randomness import nth_seed
from sidecar.decoding.rows import DecodeRow
from sidecar.decoding.sampling import Sampling
from sidecar.errors import InputError
from sidecar.models.pair import ModelPair
from sidecar.runtime.slots import row_columns
from sidecar.tasks.prompts import SpannedPrompt, build_prompt, encode, turn_bridge
from sidecar.tasks.rows import SidecarRequest
from sidecar.tasks.task import SidecarTask

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def nth_sampling(sampling: Sampling, i: int) -> Sampling:
    """``sampling`` for request ``i`` of a call: a seeded call's requests draw as seeds ``seed + i``."""
    return sampling if sampling.seed is None else replace(sampling, seed=nth_seed(sampling.seed, i))


class RequestBuilder:
    """Builds each request's prompts and main row for one pair and gamma."""

    def __init__(self, pair: ModelPair, gamma: int) -> None:
        self.pair = pair
        self.gamma = gamma

    def prompts(self, request: SidecarRequest) -> tuple[SpannedPrompt, SpannedPrompt]:
        """(target's bare prompt, draft's compound prompt)."""
        if not request.document.strip():
            raise InputError("empty document")
        names = [t.name for t in request.sidecars]
        if len(set(names)) != len(names):
            raise InputError(f"sidecar task names must be unique, got {names}")
        tok = self.pair.tokenizer
        bare = build_prompt(tok, request.document, request.instruction, request.system, history=request.history)
        compound = build_prompt(tok, request.document, request.instruction, request.system,
                                {t.name: t.instruction for t in request.sidecars}, request.history)
        return bare, compound

    def decode_row(self, index: int, request: SidecarRequest) -> DecodeRow:
        """The main output's row for ``request``, checked against the draft's context, which must also hold
        the main output and the longest sidecar output."""
        bare, compound = self.prompts(request)
        limit = request.max_new_tokens or 128
        draft_context = int(self.pair.draft.config.max_position_embeddings)
        longest_task = max((len(self.bridge(t)) + t.max_new_tokens for t in request.sidecars), default=0)
        if row_columns(len(compound.token_ids) + limit, longest_task, self.gamma) > draft_context:
            raise InputError(f"request {index}: document, main output and sidecar outputs exceed the draft's "
                             f"context of {draft_context} tokens; shorten the document")
        return DecodeRow(bare.token_ids, limit, compound.token_ids,
                         [compound.spans[f"sidecar:{t.name}"] for t in request.sidecars],
                         sampling=request.sampling or Sampling(), stop=request.stop,
                         top_logprobs=request.top_logprobs, keep_draft=bool(request.sidecars),
                         constraint=request.constraint)

    def bridge(self, task: SidecarTask) -> list[int]:
        """What a sidecar is fed after the main output: its ``bridge`` text, or by default the chat template's
        turn boundary (``turn_bridge``)."""
        if task.bridge is None:
            return turn_bridge(self.pair.tokenizer)
        return encode(self.pair.tokenizer, task.bridge)


def sidecar_view(compound: SpannedPrompt, task: SidecarTask, main: list[int]) -> tuple[list[int], list[int]]:
    """The draft-cache columns a sidecar continues from (ascending) and, among them, the positions of its
    instruction, to be shown: the compound prompt without the other sidecars' instructions (and without the
    document and a chat's earlier turns unless the task attends to it), then the main output's ``len(main)`` columns."""
    # a chat's earlier turns go with the document: a task that does not attend to it sees neither
    spans = ["prefix", *(["history", "document"] if task.attend_document else []), "instruction",
             f"sidecar:{task.name}", "suffix"]
    columns = compound.columns(*spans)
    start = len(compound.token_ids)
    columns += range(start, start + len(main))
    instruction = set(compound.columns(f"sidecar:{task.name}"))
    return columns, [i for i, c in enumerate(columns) if c in instruction]


def before_stop(tokenizer: PreTrainedTokenizerBase, ids: list[int], stops: Sequence[str]) -> int:
    """How many of ``ids`` end before the first stop string in their text begins: an output that a stop string
    ended (its last token completes one) as the client sees it, for the sidecars that continue from it."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    starts = [text.find(s) for s in stops if s in text]
    if not starts:
        return len(ids)
    kept = len(ids)
    # only the last few tokens, those that spell the stop string, are decoded again
    while kept and len(tokenizer.decode(ids[:kept], skip_special_tokens=True)) > min(starts):
        kept -= 1
    return kept
