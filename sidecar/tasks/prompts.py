"""Prompts built from named spans through the model's chat template, with exact token ranges.

Only the chat template writes control tokens. The template is rendered around sentinel strings in place of
every message's content, so its own text is known apart from the content; text from users and documents
is encoded as text, with special-token strings like ``<|im_end|>`` split into ordinary tokens, so no
message or document can forge a chat turn. Text between two of the template's control tokens is encoded
as one string, which keeps an ordinary chat's ids exactly those of encoding the rendered template.

A sidecar prompt's spans are tokenized piece by piece, so every span's token range is known exactly and
the target's bare prompt is the same token sequence whether or not sidecars are attached to the draft's
prompt.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DEFAULT_SYSTEM = "You are a concise assistant."
SUMMARIZE_INSTRUCTION = "Summarize the document in 3 bullets. Keep each bullet under 18 words."

# \x00 keeps the sentinels out of any real text a template writes; the number says which message's content it is.
_CONTENT = "\x00SIDECAR-CONTENT-{}\x00"
_CONTENT_RE = re.compile("\x00SIDECAR-CONTENT-([0-9]+)\x00")


@dataclass
class SpannedPrompt:
    token_ids: list[int] = field(default_factory=list)
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> [start, end)

    def add(self, name: str, ids: list[int]) -> None:
        self.spans[name] = (len(self.token_ids), len(self.token_ids) + len(ids))
        self.token_ids.extend(ids)

    def columns(self, *names: str) -> list[int]:
        return [c for name in names for c in range(*self.spans[name])]


def chat_frame(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]],
               add_generation_prompt: bool = True) -> list[str]:
    """The chat template's own text around each message's content: one piece more than there are messages.
    ``add_generation_prompt`` ends it with the assistant's turn opened."""
    marked = [{**message, "content": _CONTENT.format(i)} for i, message in enumerate(messages)]
    pieces = _CONTENT_RE.split(tokenizer.apply_chat_template(marked, add_generation_prompt=add_generation_prompt,
                                                             tokenize=False))
    frame = pieces[::2]
    # a template that edits, drops or branches on content would make the frame spell another chat
    rendered = tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                             tokenize=False)
    if [int(i) for i in pieces[1::2]] != list(range(len(messages))) or rendered != _join(frame, messages):
        raise ValueError("the chat template must write every message's content once, in order, unchanged")
    return frame


def _join(frame: Sequence[str], messages: Sequence[dict[str, str]]) -> str:
    return "".join(piece + (messages[i]["content"] if i < len(messages) else "") for i, piece in enumerate(frame))


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Text as text: a special token's string inside it is split into ordinary tokens, never the control token.

    Every encoding here splits special tokens, so the fast tokenizer's backend flag for it (set per call)
    never flips between the server's threads sharing one tokenizer.
    """
    return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True) if text else []


@cache
def _added_tokens_re(added: tuple[str, ...]) -> re.Pattern[str]:
    # longest first, so a token that another one starts with cannot win, as in the tokenizer's own matching
    return re.compile("|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)) or "(?!)")


def encode_chat(tokenizer: PreTrainedTokenizerBase, frame: Sequence[str], contents: Sequence[str]) -> list[int]:
    """``frame[0] + contents[0] + frame[1] + ... + frame[-1]`` where only the frame's added tokens are tokens.

    The text between two of the frame's tokens is encoded as one string, content and template text together,
    as the tokenizer encodes a whole rendered chat; so ordinary content gives exactly the ids of that.
    """
    if len(frame) != len(contents) + 1:
        raise ValueError(f"a frame of {len(frame)} pieces holds {len(frame) - 1} contents, not {len(contents)}")
    added = tokenizer.added_tokens_encoder
    tokens_re = _added_tokens_re(tuple(added))
    ids: list[int] = []
    text = ""
    for i, piece in enumerate(frame):
        at = 0
        for match in tokens_re.finditer(piece):
            ids += encode(tokenizer, text + piece[at : match.start()])
            ids.append(added[match.group()])
            text, at = "", match.end()
        text += piece[at:] + (contents[i] if i < len(contents) else "")
    return ids + encode(tokenizer, text)


def chat_prompt(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]],
                add_generation_prompt: bool = True, continue_final_message: bool = False) -> list[int]:
    """A chat's prompt ids, the assistant's turn opened unless not ``add_generation_prompt``; the messages'
    contents are text. ``continue_final_message`` ends the prompt right after the last message's content,
    inside its turn, as transformers' option of that name does (to continue or to score that message)."""
    frame = chat_frame(tokenizer, messages, add_generation_prompt and not continue_final_message)
    if continue_final_message:
        frame[-1] = ""
    return encode_chat(tokenizer, frame, [m["content"] for m in messages])


@cache
def _turn_bridge(tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    messages = [{"role": "user", "content": "question"}, {"role": "assistant", "content": "answer"}]
    return tuple(encode_chat(tokenizer, chat_frame(tokenizer, messages)[-1:], []))


def turn_bridge(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The chat template's own text after an assistant message's content, up to a new assistant turn's
    content (ChatML: ``<|im_end|>\n<|im_start|>assistant\n``), its control tokens as tokens: a sidecar
    fed this answers in a turn of its own and ends it with its end-of-turn token."""
    return list(_turn_bridge(tokenizer))


def build_prompt(tokenizer: PreTrainedTokenizerBase, document: str, instruction: str, system: str | None,
                 sidecar_instructions: dict[str, str] | None = None,
                 history: Sequence[tuple[str, str]] = ()) -> SpannedPrompt:
    """Spans: ``prefix``, ``history``, ``document``, ``instruction``, ``sidecar:<name>`` for each sidecar,
    ``suffix``. ``history`` is a chat's earlier turns, (role, content) after the system message: the span
    holds them with the template's text around them, up to the content of the user message that the document
    is (empty without history)."""
    # the prefix is the template up to the first turn's content (a system message's text included)
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": role, "content": content} for role, content in history] + [{"role": "user", "content": ""}]
    frame = chat_frame(tokenizer, messages)
    first = 1 if system else 0
    prompt = SpannedPrompt()
    prompt.add("prefix", encode_chat(tokenizer, frame[: first + 1], [system] if system else []))
    prompt.add("history", encode_chat(tokenizer, ["", *frame[first + 1 : -1]], [c for _, c in history])
               if history else [])
    prompt.add("document", encode(tokenizer, document))
    prompt.add("instruction", encode(tokenizer, f"\n\n{instruction}" if instruction else ""))
    for name, text in (sidecar_instructions or {}).items():
        prompt.add(f"sidecar:{name}", encode(tokenizer, f"\n{text}"))
    prompt.add("suffix", encode_chat(tokenizer, frame[-1:], []))
    return prompt
