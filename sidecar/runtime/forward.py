"""One forward of a model over a ``RowKVCache``, and prefill: feeding whole prompts into a cache's rows.

``forward`` builds positions and the mask from the cache's host lengths and runs the decoder stack;
``prefill`` groups rows into forwards within a padded-token budget (chosen at run time by
``sidecar.runtime.prefill_plan``) and computes a prompt prefix all rows share once.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

import numpy as np
import torch
from transformers import PreTrainedModel

from sidecar.runtime.capture import ForwardShape, check_shape, runner_of
from sidecar.runtime.decoder_stack import real_columns
from sidecar.runtime.kv_cache import RowKVCache
from sidecar.runtime.prefill_plan import group_rows
from sidecar.runtime.transfers import to_device


def forward(model: PreTrainedModel, cache: RowKVCache, input_ids: torch.Tensor,
            query_span: torch.Tensor | None = None, valid: list[int] | None = None,
            decode: bool = True, shape: ForwardShape | None = None) -> torch.Tensor:
    """Run the decoder stack on ``input_ids`` [B, q] over ``cache``; returns hidden states [B, q, H].

    ``valid[b]``: the real columns of row b (the rest pad it to q); ``decode``: a step's forward (compiled where
    the model's capture mode says so), not a prefill's; ``shape``: the padded shape a decode forward runs at, as
    the step plan names it (None: ``capture.decode_shape``'s). Models without an attached runner
    (``sidecar.runtime.capture.attach``) run Hugging Face's forward, at the real shape."""
    runner = runner_of(model)
    if runner is not None:
        return runner(cache, input_ids, query_span, valid, decode, shape)
    if shape is not None:
        check_shape(shape, *input_ids.shape, cache.root.batch_size - cache.start, static=False)
    positions, mask = cache.prepare(input_ids.shape[1], model.dtype, query_span)
    # A target with more embedding rows than its draft can emit ids the draft cannot embed; the draft
    # only proposes, so feeding it a stand-in id there costs acceptance, never correctness.
    vocab = model.get_input_embeddings().num_embeddings
    input_ids = torch.where(input_ids < vocab, input_ids, 0)
    out = model.base_model(input_ids=input_ids, position_ids=positions, attention_mask=mask,
                           **{cache_keyword(type(model.base_model)): cache}, use_cache=True)
    return out.last_hidden_state


@functools.cache
def cache_keyword(model_class: type) -> str:
    """The keyword a Hugging Face model's forward takes its cache by: ``cache`` (transformers 5.25 on; it still
    renames the older one, with a warning) or ``past_key_values`` (before, as the GPU image's 5.17, where an
    unknown ``cache`` would be swallowed by its ``**kwargs`` and the forward would attend to its own tokens only)."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def logits_at(model: PreTrainedModel, hidden: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Logits [B, k, V] at per-row positions ``index`` [B, k]: only those rows reach the LM head."""
    picked = hidden.gather(1, index[..., None].expand(-1, -1, hidden.shape[-1]))
    return model.get_output_embeddings()(picked).float()


def logits_of_real_columns(model: PreTrainedModel, hidden: torch.Tensor, valid: Sequence[int]) -> torch.Tensor:
    """Logits [B, q, V] of ``hidden`` [B, q, H] where row b's first ``valid[b]`` columns are real: only those reach
    the LM head (a verify whose rows keep unequal drafts), the padded columns' logits are 0."""
    batch, width, size = hidden.shape
    real = to_device(real_columns(valid, width), hidden.device)
    picked = model.get_output_embeddings()(hidden.reshape(batch * width, size).index_select(0, real)).float()
    return picked.new_zeros(batch * width, picked.shape[-1]).index_copy_(0, real, picked).view(batch, width, -1)


def pad_rows(rows: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """Right-pad token lists into [B, q] on ``device``; returns (ids, valid lengths on the host)."""
    lengths = [len(r) for r in rows]
    ids = np.zeros((len(rows), max(lengths)), dtype=np.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    return to_device(ids, device), lengths


def last_columns(lengths: list[int], device: torch.device) -> torch.Tensor:
    """Index [B, 1] of each row's last valid column, for ``logits_at`` or a gather."""
    return to_device([[n - 1] for n in lengths], device)


# (index of the forward's first row, real tokens of each of its rows, padded tokens, the leading tokens of its
# first row that are a prefix computed once for ``sharers`` rows, sharers) -> a context that times that prefill
# forward: for ``sidecar.runtime.prefill_plan`` and the device-time ledger
TimeForward = Callable[[int, list[int], int, int, int], AbstractContextManager]


def shared_prefix_length(rows: list[list[int]], hidden_spans: list[list[tuple[int, int]]] | None) -> int:
    """How many leading tokens every row has in common, short of a hidden span and of each row's last token."""
    limit = min(len(r) for r in rows) - 1  # every row keeps a token of its own: its last state is needed
    if hidden_spans is not None:
        limit = min([limit, *(start for spans in hidden_spans for start, _ in spans)])
    first = rows[0]
    shared = 0
    while shared < limit and all(r[shared] == first[shared] for r in rows):
        shared += 1
    return shared


def prefill(model: PreTrainedModel, cache: RowKVCache, rows: list[list[int]], budget: int | None,
            hidden_spans: list[list[tuple[int, int]]] | None = None, share_prefix: bool = True,
            on_rows: Callable[[int], None] | None = None, time_forward: TimeForward | None = None) -> torch.Tensor:
    """Feed ``rows[i]`` into row ``i`` of ``cache`` and commit it; returns each row's hidden state at its
    last token [B, 1, H]. Consecutive rows share a forward while its padded size stays within ``budget``
    tokens (``group_rows``; a ``PrefillPlanner`` chooses it). ``hidden_spans[i]`` lists row ``i``'s hidden
    spans as (start, stop) token ranges (``DecodeRow.draft_hidden``). ``on_rows(k)`` hears after each
    forward that the first ``k`` rows are in; ``time_forward`` times each forward.

    Into an empty cache, a prefix all rows share (the chat template's system turn: 14 tokens of ~330 on a
    news prompt) is computed once, with the first row, and copied to the others (``share_prefix``).
    """
    can_share = share_prefix and len(rows) > 1 and int(cache.lengths.max()) == 0
    shared = shared_prefix_length(rows, hidden_spans) if can_share else 0
    if shared:
        computed_once = None if time_forward is None else (
            lambda first, tokens, padded, *_: time_forward(first, tokens, padded, shared, len(rows)))
        last = [prefill(model, cache.rows_view(0, 1), rows[:1], budget,
                        None if hidden_spans is None else hidden_spans[:1], time_forward=computed_once)]
        if on_rows is not None:
            on_rows(1)
        cache.copy_prefix(0, shared)
        rest = cache.rows_view(1, len(rows))
        rest_spans = None if hidden_spans is None else [
            [(start - shared, stop - shared) for start, stop in spans] for spans in hidden_spans[1:]]
        shifted = None if time_forward is None else (
            lambda first, tokens, padded, *_: time_forward(first + 1, tokens, padded, 0, 1))
        last.append(prefill(model, rest, [r[shared:] for r in rows[1:]], budget, rest_spans, share_prefix=False,
                            on_rows=None if on_rows is None else lambda k: on_rows(1 + k), time_forward=shifted))
        return torch.cat(last)
    device = cache.device
    last: list[torch.Tensor] = []
    lengths = [len(r) for r in rows]
    for start, stop in group_rows(lengths, budget):
        part = cache if (start, stop) == (0, len(rows)) else cache.rows_view(start, stop)
        ids, valid = pad_rows(rows[start:stop], device)
        span_ids = None
        if hidden_spans is not None:
            spans = np.full(tuple(ids.shape), -1, dtype=np.int64)
            for i, row_spans in enumerate(hidden_spans[start:stop]):
                for span_id, (s, e) in enumerate(row_spans):
                    spans[i, s:e] = span_id
            span_ids = to_device(spans, device)
        with nullcontext() if time_forward is None else time_forward(start, valid, ids.numel(), 0, 1):
            hidden = forward(model, part, ids, span_ids, valid, decode=False)
        part.commit(valid)
        index = last_columns(valid, device)[:, :, None].expand(-1, 1, hidden.shape[-1])
        last.append(hidden.gather(1, index))
        if on_rows is not None:
            on_rows(stop)
    return torch.cat(last)


