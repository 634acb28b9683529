"""Sidecar tasks: what the draft model does after the main output, and how its text is parsed."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from sidecar.decoding.constraints import (
    CONSTRAINT_FIELDS,
    Constraint,
    ConstraintError,
    check_choices,
    constraint_from,
    json_schema_constraint,
    parse_constrained,
    regex_constraint,
)


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
    # constrained output, at most one of them (sidecar.decoding.constraints, docs/constraints.md): exactly one
    # of the choices, a whole-output match of a regex, or one JSON value valid under a JSON Schema
    choices: list[str] | None = Field(None, description="The output is exactly one of these strings.")
    regex: str | None = Field(None, description="The whole output matches this regular expression.")
    json_schema: dict[str, Any] | None = Field(None, description="The output is one JSON value valid under this "
                                                                 "JSON Schema.")
    _constraint: Constraint | None = PrivateAttr(default=None)

    @field_validator("instruction")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("instruction must not be blank")
        return value

    # each constraint is checked on its own field, so that a bad one's error names it
    @field_validator("choices")
    @classmethod
    def _choices(cls, value: list[str] | None) -> list[str] | None:
        return None if value is None else _reason(check_choices, value)

    @field_validator("regex")
    @classmethod
    def _regex(cls, value: str | None) -> str | None:
        if value is not None:
            _reason(regex_constraint, value)
        return value

    @field_validator("json_schema")
    @classmethod
    def _json_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            _reason(json_schema_constraint, value)
        return value

    @model_validator(mode="after")
    def _one_constraint(self) -> SidecarTask:
        try:
            self._constraint = constraint_from(self.choices, self.regex, self.json_schema)
        except ConstraintError as error:
            raise ValueError(str(error)) from None
        if self._constraint is not None and self.parser != "text":
            raise ValueError(f"parser: {self.parser!r} parses free text; a task with {self._constraint.kind} is "
                             "parsed by its constraint, so leave parser as 'text'")
        return self

    @model_serializer(mode="wrap")
    def _without_absent_constraints(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # a free-text task dumps as before the constraint fields existed: run ids and resume identities hash
        # the dump, so runs started before them keep their ids
        data = handler(self)
        for name in CONSTRAINT_FIELDS:
            if data.get(name) is None:
                data.pop(name, None)
        return data

    @property
    def constraint(self) -> Constraint | None:
        """The task's constraint, compiled once when the task was made (None: free text)."""
        return self._constraint

    @property
    def standalone_instruction(self) -> str:
        """The instruction for a tagger that sees only the main output: no 'Then ...' continuation."""
        text = self.instruction.strip()
        if text.lower().startswith("then "):
            text = text[5:]
            text = text[:1].upper() + text[1:]
        return text

    def parse(self, text: str) -> tuple[Any, str | None]:
        """(parsed value, error). Unparseable output keeps its raw text and gets an error, never dropped.

        A constrained task's value is the choice, the regex's match or the JSON value (any JSON type)."""
        if self._constraint is not None:
            return parse_constrained(self._constraint, text)
        if self.parser == "hashtags":
            tags = parse_hashtags(text)
            return (tags, None) if tags else (None, "no hashtags found")
        stripped = text.strip()
        return (stripped, None) if stripped else (None, "empty output")


def _reason(check: Any, value: Any) -> Any:
    """``check(value)``, its ``ConstraintError`` as pydantic's ValueError (pydantic adds the field's name)."""
    try:
        return check(value)
    except ConstraintError as error:
        raise ValueError(error.reason) from None


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
