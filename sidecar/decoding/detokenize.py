"""Incremental detokenization: the text of a growing list of token ids, at a cost per token that stays flat.

``settled`` text ends at a whole character; the ids after it decode to the ``tail``, which may end in an
incomplete multi-byte character (U+FFFD). Decoding starts one settled piece back (where the previous
piece began, a clean boundary), so each call costs O(tokens since then), not O(all ids). ``settled +
tail`` is ``tokenizer.decode(ids)`` for tokenizers that decode piecewise at whole characters, which
byte-level BPE (Qwen, the tiny pair) and SentencePiece (given the token before as context) do.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


class IncrementalDecoder:
    """Token ids in, text out; only the text since the last whole character is decoded again."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read] decode to the last settled piece: context for the next one
        self._read = 0  # ids[:_read] are settled
        self._context = ""  # decode(ids[_prefix:_read])

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, ids: list[int]) -> str:
        """Append ``ids``; returns the tail: the text of every id after the settled text."""
        self.ids.extend(ids)
        text = self._decode(self.ids[self._prefix :])
        return text[len(self._context) :] if len(text) > len(self._context) else ""

    def settle(self, tail: str, final: bool = False) -> str:
        """Make ``tail`` (what ``push`` returned last) settled text unless it may end in a partial character
        (``final``: the ids are complete, so it is whole); returns the text settled (possibly empty)."""
        if not tail or (not final and tail.endswith("\ufffd")):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        self._context = self._decode(self.ids[self._prefix : self._read])
        return tail
