"""Prompts built from named spans through the model's chat template, with exact token ranges.

The chat template is rendered once around sentinel strings; the text between sentinels is tokenized
piece by piece, so every span's token range is known exactly and the target's bare prompt is the same
token sequence whether or not sidecars are attached to the draft's prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DEFAULT_SYSTEM = "You are a concise assistant."
SUMMARIZE_INSTRUCTION = "Summarize the document in 3 bullets. Keep each bullet under 18 words."

_CONTENT = "\x00SIDECAR-CONTENT\x00"


@dataclass
class SpannedPrompt:
    token_ids: list[int] = field(default_factory=list)
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> [start, end)

    def add(self, name: str, ids: list[int]) -> None:
        self.spans[name] = (len(self.token_ids), len(self.token_ids) + len(ids))
        self.token_ids.extend(ids)

    def columns(self, *names: str) -> list[int]:
        return [c for name in names for c in range(*self.spans[name])]


def chat_frame(tokenizer: PreTrainedTokenizerBase, system: str | None) -> tuple[str, str]:
    """The chat template's text before and after one user message's content."""
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": _CONTENT})
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    before, after = rendered.split(_CONTENT)
    return before, after


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) if text else []


def build_prompt(tokenizer: PreTrainedTokenizerBase, document: str, instruction: str, system: str | None,
                 sidecar_instructions: dict[str, str] | None = None) -> SpannedPrompt:
    """Spans: ``prefix``, ``document``, ``instruction``, ``sidecar:<name>`` for each sidecar, ``suffix``."""
    before, after = chat_frame(tokenizer, system)
    prompt = SpannedPrompt()
    prompt.add("prefix", encode(tokenizer, before))
    prompt.add("document", encode(tokenizer, document))
    prompt.add("instruction", encode(tokenizer, f"\n\n{instruction}" if instruction else ""))
    for name, text in (sidecar_instructions or {}).items():
        prompt.add(f"sidecar:{name}", encode(tokenizer, f"\n{text}"))
    prompt.add("suffix", encode(tokenizer, after))
    return prompt
