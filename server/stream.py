"""Token ids to text: released only at whole characters, never past a stop string, same text streamed or not."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from sidecar.decoding.detokenize import IncrementalDecoder
from sidecar.decoding.stops import StopMatcher


class TextStream:
    """Text of a growing list of token ids, released only at whole characters and never past a stop string.

    A push costs O(new tokens + new characters) whatever the length of the answer so far or of the stop
    strings: ids are decoded from the last whole character on (``sidecar.decoding.detokenize``), and stop strings
    are searched in the new text only, which also says how much to hold back (``sidecar.decoding.stops``). The
    whole answer fed at once gives exactly the tokenizer's decode; streaming releases prefixes of it.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: Sequence[str] = ()) -> None:
        self.decoder = IncrementalDecoder(tokenizer, skip_special_tokens=True)
        self.matcher = StopMatcher(stop)
        self.stopped = False
        self._unsent = ""  # settled text not released yet: what may still be the start of a stop string

    def _release(self, tail: str, final: bool) -> str:
        new = self.decoder.settle(tail, final)
        start, states = self.matcher.search(new)
        sent = self.matcher.length - len(self._unsent)  # characters released so far
        self._unsent += new
        if start is not None:
            self.stopped = True
            end = max(start, sent)
        else:
            self.matcher.feed(new, states)
            end = max(self.matcher.length - (0 if final else self.matcher.held), sent)
        chunk, self._unsent = self._unsent[: end - sent], self._unsent[end - sent :]
        return chunk

    def push(self, ids: list[int]) -> str:
        """Add new ids; returns newly releasable text (possibly empty)."""
        if self.stopped:
            return ""
        return self._release(self.decoder.push(ids), final=False)

    def finish(self) -> str:
        """The rest of the text once the ids are complete."""
        if self.stopped:
            return ""
        return self._release(self.decoder.push([]), final=True)


def full_text(tokenizer: PreTrainedTokenizerBase, ids: list[int], stop: Sequence[str]) -> tuple[str, bool]:
    """(text, cut at a stop string): the same text a stream of ``ids`` releases."""
    stream = TextStream(tokenizer, stop)
    text = stream.push(ids) + stream.finish()
    return text, stream.stopped
