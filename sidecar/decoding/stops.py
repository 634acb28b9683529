"""Stop strings: how many and how long a request may give, and a search for them that is linear in the output.

An output ends at its first stop string, so text searched so far holds none, and a new occurrence ends in
what was just appended. Each stop string keeps a Knuth-Morris-Pratt state (the length of its longest prefix
that the text ends with), so appending n characters costs O(n) per stop string whatever the output's or
the stop string's length; the same state says how much text a stream must hold back as a possible start.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from sidecar.decoding.detokenize import IncrementalDecoder

MAX_STOP_STRINGS = 4  # OpenAI's bound
# Longer than any end marker or delimiter a client needs; a bound keeps a request's stop strings small
# next to the output they are searched in.
MAX_STOP_CHARS = 256


def _failure(stop: str) -> list[int]:
    """KMP failure table: ``table[i]`` is the longest proper prefix of ``stop[: i + 1]`` that is also its suffix."""
    table = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = table[k - 1]
        if stop[i] == stop[k]:
            k += 1
        table[i] = k
    return table


class StopMatcher:
    """Finds the stop strings in text fed piece by piece; ``length`` characters have been fed."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self._tables = [_failure(s) for s in self.stops]
        self.states = [0] * len(self.stops)
        self.length = 0

    def search(self, text: str) -> tuple[int | None, list[int]]:
        """(where the earliest-starting stop string in the fed text plus ``text`` starts, as an index of
        that whole text, or None; the states after ``text`` when there is none). Nothing is fed."""
        if "" in self.stops:  # the empty string occurs everywhere, first at 0
            return 0, self.states
        start: int | None = None
        states = list(self.states)
        for n, (stop, table) in enumerate(zip(self.stops, self._tables, strict=True)):
            q = states[n]
            for i, char in enumerate(text):
                while q and stop[q] != char:
                    q = table[q - 1]
                if stop[q] == char:
                    q += 1
                if q == len(stop):  # its first occurrence; a later one cannot start earlier
                    found = self.length + i + 1 - len(stop)
                    start = found if start is None else min(start, found)
                    break
            states[n] = q
        return start, states

    def feed(self, text: str, states: list[int]) -> None:
        """Append ``text``, whose ``search`` found no stop string and gave ``states``."""
        self.states = states
        self.length += len(text)

    @property
    def held(self) -> int:
        """Characters at the end of the fed text that may yet grow into a stop string."""
        return max(self.states, default=0)


class TokenStops:
    """Where a growing list of token ids first decodes to text that holds a stop string.

    Token by token, as if the whole list were decoded after each one (``tokenizer.decode``, special tokens
    kept): a stop string that spans tokens is found at the token completing it, and text that a later
    token rewrites (a partial character) is searched as it reads at each token.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stops: Sequence[str]) -> None:
        self.decoder = IncrementalDecoder(tokenizer, skip_special_tokens=False)
        self.matcher = StopMatcher(stops)

    def first(self, tokens: list[int]) -> int | None:
        """Append ``tokens`` up to the first whose text completes a stop string; returns its index or None."""
        for k, token in enumerate(tokens):
            tail = self.decoder.push([token])
            start, states = self.matcher.search(tail)
            if start is not None:
                return k
            settled = self.decoder.settle(tail)
            if settled:
                self.matcher.feed(settled, states)
        return None
