"""Sidecar tasks: what the draft model does after the main output, and how its text is parsed."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class SidecarTask(BaseModel):
    """A task the draft runs after the main output (docs/tasks.md). Unknown fields are refused, by name."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-]+$",
                      description="The output's name: letters, digits, '_' and '-'; unique among a request's tasks.")
    instruction: str = Field(min_length=1, max_length=2000,
                             description="What the draft writes, appended to the user's message as a hidden line "
                                         "and shown once the main output is final.")
    max_new_tokens: int = Field(32, ge=1, le=1024, description="At most this many output tokens.")
    attend_document: bool = Field(False, description="Keep the document in the draft's cache for the task "
                                                     "(default: evicted; the task sees the main output).")
    parser: Literal["hashtags", "text"] = Field("text", description="How the output is parsed: hashtags (a list) "
                                                                   "or text (stripped).")
    # "\n\n" as the default let the draft go on in the main answer's turn: on the real pair, after a finished
    # summary, a headline task wrote "This headline captures the key points of the document:" and more bullets
    bridge: str | None = Field(
        None, description="What the draft continues from after the main output. Default (null): the chat "
                          "template's turn boundary, so the task is answered in a new assistant turn that ends with "
                          "the model's end-of-turn token. A string: text it continues from inside the main output's "
                          "turn, whose end-of-turn is dropped (the hashtags task's is a blank line).")

    @field_validator("instruction")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("instruction must not be blank")
        return value

    @property
    def standalone_instruction(self) -> str:
        """The instruction for a tagger that sees only the main output: no 'Then ...' continuation."""
        text = self.instruction.strip()
        if text.lower().startswith("then "):
            text = text[5:]
            text = text[:1].upper() + text[1:]
        return text

    def parse(self, text: str) -> tuple[list[str] | str | None, str | None]:
        """(parsed value, error). Unparseable output keeps its raw text and gets an error, never dropped."""
        if self.parser == "hashtags":
            tags = parse_hashtags(text)
            return (tags, None) if tags else (None, "no hashtags found")
        stripped = text.strip()
        return (stripped, None) if stripped else (None, "empty output")


# its bridge is the one it was measured with (bench/results, docs/benchmarks.md): a blank line in the answer's turn
HASHTAGS = SidecarTask(name="hashtags", instruction="Then output 3-5 short hashtags for the summary.",
                       max_new_tokens=32, parser="hashtags", bridge="\n\n")

_HASHTAG = re.compile(r"#([^\s#,;.!?()\[\]{}\"'`]+)")
_SEPARATORS = re.compile(r"[,;\n|]+|\s-\s|^\s*[-*•]\s*", re.MULTILINE)
_MAX_TAGS = 5


def normalise_tag(raw: str) -> str:
    tag = raw.strip().lstrip("#").strip()
    tag = re.sub(r"^[\d]+[.)]\s*", "", tag)  # list numbering: "1. climate"
    tag = re.sub(r"[^\w\s-]", "", tag).strip().lower()
    return re.sub(r"[\s-]+", "", tag)


def parse_hashtags(text: str) -> list[str] | None:
    """Up to 5 normalised tags (no '#', lowercase, deduplicated, order kept); None when there are none.

    '#tags' anywhere in the text win; otherwise short comma/line/bullet separated phrases count.
    """
    candidates = _HASHTAG.findall(text)
    if not candidates:
        candidates = [part for part in _SEPARATORS.split(text) if 0 < len(part.split()) <= 3]
    tags: list[str] = []
    for raw in candidates:
        tag = normalise_tag(raw)
        if tag and tag not in tags and len(tag) <= 40:
            tags.append(tag)
    return tags[:_MAX_TAGS] or None
