"""Prompt lookup: drafts copied from the row's own text, at no model cost.

A summary repeats names and phrases of its document. When the last few committed tokens also occur
earlier in the prompt or the output, the tokens that followed them there are a free guess at what comes
next. The target verifies that guess like any draft, so the output is unchanged; the guess only saves
draft-model forwards.

A copy may be longer than the draft model's gamma (``SpeculativeDecoder``'s ``max_copy``, adaptive mode): it
costs no draft forward per token, only a wider verify, so its width can be sized apart from the draft's (as
Hugging Face's ``prompt_lookup_num_tokens`` and vLLM's n-gram proposer are), and the controller
(``sidecar.decoding.controller``) chooses each step's width up to it from its cost fit. By default it is gamma:
on the CPU it was measured on, a bound of 10 made the controller copy less per step, not more (docs/design.md,
Prompt lookup).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

# The longest suffix is tried first: a longer match predicts better, a shorter one matches more often.
# Down to a single token, since the controller stops copying when copies stop being accepted. Of several
# matches the latest is taken.
MAX_NGRAM = 3
MIN_NGRAM = 1


def lookup_continuation(context: Sequence[int], max_tokens: int, max_ngram: int = MAX_NGRAM,
                        min_ngram: int = MIN_NGRAM) -> list[int]:
    """Up to ``max_tokens`` tokens that followed the latest earlier occurrence of the longest suffix of
    ``context`` (``max_ngram`` down to ``min_ngram`` tokens); empty when no suffix occurs earlier."""
    length = len(context)
    # searched as bytes, in C: it runs for every row at every step, next to GPU steps of a few ms
    tokens = array("i", context)
    data, size = tokens.tobytes(), tokens.itemsize
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        needle = data[(length - n) * size :]
        # an earlier occurrence starts at token length - n - 1 at the latest
        end = (length - 1) * size
        while (found := data.rfind(needle, 0, end)) >= 0:
            if found % size == 0:  # aligned on a token, not straddling two
                first = found // size + n
                return list(context[first : first + max_tokens])
            end = found + len(needle) - 1
    return []
