"""Token ids to text: released only at whole characters, never past a stop string, same text streamed or not."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase


class TextStream:
    """Text of a growing list of token ids, released only at whole characters and never past a stop string.

    Decoding looks back only to where the previous release ended (which is a clean character boundary),
    so a step costs O(new tokens). The whole answer fed at once gives exactly the tokenizer's decode;
    streaming releases prefixes of that same text.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.ids: list[int] = []
        self.text = ""  # decoded so far, up to a clean boundary
        self.sent = 0  # characters of self.text released
        self.stopped = False
        self._prefix = 0  # ids[_prefix:_read] decode to the tail of self.text
        self._read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _advance(self, final: bool) -> None:
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        # A trailing U+FFFD is an incomplete multi-byte character: wait for its next token.
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(self.ids)

    def _release(self, final: bool) -> str:
        end = len(self.text)
        hits = [i for i in (self.text.find(s) for s in self.stop) if i >= 0]
        if hits:
            end, self.stopped = min(hits), True
        elif not final:
            # hold back a tail that may grow into a stop string
            end -= max((k for s in self.stop for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        end = max(end, self.sent)
        chunk, self.sent = self.text[self.sent : end], end
        return chunk

    def push(self, ids: list[int]) -> str:
        """Add new ids; returns newly releasable text (possibly empty)."""
        if self.stopped:
            return ""
        self.ids.extend(ids)
        self._advance(final=False)
        return self._release(final=False)

    def finish(self) -> str:
        """The rest of the text once the ids are complete."""
        if self.stopped:
            return ""
        self._advance(final=True)
        return self._release(final=True)


def full_text(tokenizer: PreTrainedTokenizerBase, ids: list[int], stop: Sequence[str]) -> tuple[str, bool]:
    """(text, cut at a stop string): the same text a stream of ``ids`` releases."""
    stream = TextStream(tokenizer, stop)
    text = stream.push(ids) + stream.finish()
    return text, stream.stopped
