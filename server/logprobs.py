"""The engine's logprob entries as the API spells them: OpenAI's chat ``logprobs``, vLLM's ``prompt_logprobs``,
and the legacy completions' ``logprobs``.

Chat: ``{"content": [...], "refusal": None}``, each content entry ``{"token", "logprob", "bytes",
"top_logprobs": [{"token", "logprob", "bytes"}]}``. ``token`` is the token decoded alone (special tokens by
name; a byte-level piece of a multi-byte character decodes to U+FFFD), ``bytes`` its exact UTF-8 bytes, so
concatenating the ``bytes`` of a completion's tokens gives the bytes of its text.

Prompt (vLLM): one entry per prompt token, ``None`` for the first, else ``{"<token id>": {"logprob", "rank",
"decoded_token"}}`` for the token itself and its top alternatives.

Legacy completions: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, parallel lists; a
``top_logprobs`` entry maps token text to logprob for the top alternatives and the token itself (a token
whose bytes are not UTF-8 alone, a piece of a split character, as ``bytes:\\xNN...``: ``legacy_token``), and
``text_offset`` is where each token starts in the response's ``text``, in characters: of the text as the
client sent it for an echoed prompt, whatever the tokenizer's normalisation (``offsets_in``).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Any

from tokenizers import decoders
from transformers import PreTrainedTokenizerBase

from sidecar.decoding.logprobs import TokenLogprob
from sidecar.decoding.scoring import PromptLogprob


class LogprobFormatter:
    """Entries to JSON for one tokenizer; each token's text and bytes are computed once."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._tokens: dict[int, tuple[str, list[int]]] = {}
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._byte_of: dict[str, int] | None = None
        if backend is not None and isinstance(backend.decoder, decoders.ByteLevel):
            from transformers.convert_slow_tokenizer import bytes_to_unicode

            # byte-level BPE spells each byte as one printable character; this undoes that spelling
            self._byte_of = {char: byte for byte, char in bytes_to_unicode().items()}

    def token(self, token_id: int) -> tuple[str, list[int]]:
        """(text, UTF-8 bytes) of one token."""
        if token_id not in self._tokens:
            text = self.tokenizer.decode([token_id])
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            special = token_id in self.tokenizer.added_tokens_decoder
            if self._byte_of is not None and piece is not None and not special and all(
                    c in self._byte_of for c in piece):
                raw = bytes(self._byte_of[c] for c in piece)
            else:
                raw = text.encode()
            self._tokens[token_id] = text, list(raw)
        return self._tokens[token_id]

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = self.token(token_id)
        return {"token": text, "logprob": logprob, "bytes": raw}

    def content(self, entries: list[TokenLogprob]) -> list[dict[str, Any]]:
        return [self._entry(e.token_id, e.logprob) | {"top_logprobs": [self._entry(t, p) for t, p in e.top]}
                for e in entries]

    def logprobs(self, entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
        """OpenAI's ``logprobs`` object, or None when none were asked for."""
        return None if entries is None else {"content": self.content(entries), "refusal": None}

    def prompt_logprobs(self, entries: list[PromptLogprob]) -> list[dict[str, Any] | None]:
        """vLLM's ``prompt_logprobs`` of a prompt whose tokens after the first have ``entries``: the token
        itself with its rank, and its top alternatives, ranked 1 on."""
        def entry(token_id: int, logprob: float, rank: int) -> dict[str, Any]:
            return {"logprob": logprob, "rank": rank, "decoded_token": self.token(token_id)[0]}

        body: list[dict[str, Any] | None] = [None]
        body += [{str(e.token_id): entry(e.token_id, e.logprob, e.rank)}
                 | {str(t): entry(t, p, rank) for rank, (t, p) in enumerate(e.top, 1) if t != e.token_id}
                 for e in entries]
        return body

    def legacy_token(self, token_id: int) -> str:
        """A token as the legacy completions spell it in ``tokens`` and as a ``top_logprobs`` key: its text
        when its bytes are UTF-8 on their own, else ``bytes:`` and each byte as ``\\xNN`` (OpenAI's spelling),
        so that the pieces of a split character, which all decode to U+FFFD, keep keys of their own."""
        text, raw = self.token(token_id)
        try:
            bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)
        return text

    def width(self, token_id: int) -> bytes:
        """The bytes ``token_id`` adds to a response's text: none for a special token, which the text skips."""
        special = token_id in self.tokenizer.added_tokens_decoder and self.tokenizer.added_tokens_decoder[
            token_id].special
        return b"" if special else bytes(self.token(token_id)[1])

    def offsets_in(self, text: str, token_ids: Sequence[int]) -> list[int]:
        """Where each of ``token_ids`` starts in ``text`` itself, in characters, when they are ``text``'s
        encoding (after a BOS the tokenizer adds, which takes no characters).

        The tokenizer may normalise ``text`` before it splits it (Qwen2's: NFC), so the tokens' bytes need not
        spell ``text``: a decomposed "é" is two characters there and one in the tokens. Its offset mapping says
        which characters of ``text`` each token came from; a token that begins inside a character, or inside
        what characters normalise to, points at where they start. (Qwen2's and the tiny pair's mapping keep a
        token's leading space: no ``trim_offsets``.) A tokenizer without offsets (not a fast one), or ids
        that are not this encoding, fall back to the tokens' own bytes (``text_offsets``)."""
        widths = [self.width(t) for t in token_ids]
        if not getattr(self.tokenizer, "is_fast", False):
            return text_offsets(widths)
        encoding = self.tokenizer(text, add_special_tokens=False, split_special_tokens=True,
                                  return_offsets_mapping=True)
        lead = len(token_ids) - len(encoding["input_ids"])
        if lead < 0 or list(token_ids[lead:]) != list(encoding["input_ids"]):
            return text_offsets(widths)
        return [0] * lead + [start for start, _ in encoding["offset_mapping"]]

    def legacy(self, token_ids: Sequence[int], entries: Sequence[PromptLogprob | TokenLogprob | None],
               offsets: Sequence[int]) -> dict[str, list]:
        """The legacy ``logprobs`` of ``token_ids``, their entries and ``text_offset`` parallel (an entry None
        where a token has none: the prompt's first)."""
        top_logprobs: list[dict[str, float] | None] = []
        for e in entries:
            if e is None:
                top_logprobs.append(None)
                continue
            top = {self.legacy_token(t): p for t, p in e.top}
            top.setdefault(self.legacy_token(e.token_id), e.logprob)
            top_logprobs.append(top)
        return {"tokens": [self.legacy_token(t) for t in token_ids],
                "token_logprobs": [None if e is None else e.logprob for e in entries],
                "top_logprobs": top_logprobs,
                "text_offset": list(offsets)}


def text_offsets(pieces: Sequence[bytes], start: int = 0) -> list[int]:
    """Where each piece starts, in characters from ``start``, in the text the pieces' bytes spell: the whole
    characters before its first byte, so a piece that begins inside a character points at that character."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    offsets, chars = [], start
    for piece in pieces:
        offsets.append(chars)
        chars += len(decoder.decode(piece))
    return offsets
