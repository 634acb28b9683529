"""The engine's logprob entries as OpenAI's ``logprobs`` object: ``{"content": [...], "refusal": None}``.

Each content entry is ``{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}``.
``token`` is the token decoded alone (special tokens by name; a byte-level piece of a multi-byte character
decodes to U+FFFD), ``bytes`` its exact UTF-8 bytes, so concatenating the ``bytes`` of a completion's
tokens gives the bytes of its text.
"""

from __future__ import annotations

from typing import Any

from tokenizers import decoders
from transformers import PreTrainedTokenizerBase

from sidecar.decoding.logprobs import TokenLogprob


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
