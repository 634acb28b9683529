"""The chat-completions and completions requests as the API accepts them: a validated request is one the server
can answer as asked.

Every field OpenAI defines for these routes (and vLLM's ``guided_*`` and prompt extensions) is declared
here with its type: each is either honoured, accepted because it cannot change the answer (``user``,
``metadata``), or refused by name with a 400 (:func:`refusal`, the one place that refuses a field whose
value is well formed). A field not declared is refused too (``extra="forbid"``), never ignored: a client
whose ``response_format`` or penalty silently did nothing would get another answer than it asked for.

Output constraints (``response_format``, ``guided_choice``, ``guided_regex``, ``guided_json``) are parsed
into one :class:`OutputConstraint`, which the engine enforces on the main output (docs/constraints.md); a
sidecar spec may constrain its sidecar with ``choices``, ``regex`` or ``json_schema``, as ``SidecarTask``.

Every model here is a :class:`RequestModel`: strict, so a number or flag must have its JSON type (``true``
is not 1, ``"1"`` is not a number; a whole number is a valid float), and every string in it, however
nested, is valid Unicode text.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from sidecar.decoding.constraints import Constraint, ConstraintError, constraint_from, json_schema_constraint
from sidecar.decoding.logprobs import MAX_TOP_LOGPROBS
from sidecar.decoding.sampling import Sampling
from sidecar.decoding.stops import MAX_STOP_CHARS, MAX_STOP_STRINGS
from sidecar.tasks.task import SidecarTask

# vLLM's bound on prompt logprobs and the legacy completions' ``logprobs`` (OpenAI's too)
MAX_PROMPT_LOGPROBS = 5


def _strings(value: object) -> Iterator[str]:
    """The strings in ``value``, through lists and dicts (keys too); a nested model checks its own."""
    stack = [value]  # a loop, not recursion: JSON nests deeper than Python's stack
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, list | tuple):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())


class RequestModel(BaseModel):
    """A part of a request: strict types, and only valid Unicode in any string of any field."""

    model_config = ConfigDict(strict=True)

    @field_validator("*")
    @classmethod
    def _unicode(cls, value: object) -> object:
        # JSON may escape a lone UTF-16 surrogate, which is no character: the tokenizer and UTF-8 cannot take it.
        for text in _strings(value):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(f"not valid Unicode text: a lone UTF-16 surrogate at character {exc.start}"
                                 ) from None
        return value


class TextPart(RequestModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessage(RequestModel):
    model_config = ConfigDict(extra="forbid")

    # "developer" is OpenAI's newer name for the system role; tools are not supported.
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    # declared so that they are refused by name (``refusal``), not as unknown fields
    name: str | None = None
    tool_calls: list[Any] | None = None
    refusal: str | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)

    @property
    def template_role(self) -> str:
        return "system" if self.role == "developer" else self.role

    def refusals(self, where: str) -> Iterator[tuple[str, str]]:
        if self.name is not None:
            yield f"{where}.name", "a message's name is not supported: the chat template has no place for it"
        if self.tool_calls:
            yield f"{where}.tool_calls", "tool_calls are not supported (nor are tools)"
        if self.refusal is not None:
            yield f"{where}.refusal", "an assistant message's refusal is not supported; send its text as content"


class SidecarSpec(RequestModel):
    """A sidecar task as the API spells it (``max_tokens`` like the main request)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    instruction: str
    max_tokens: int = 32
    attend_document: bool = False
    parser: Literal["hashtags", "text"] = "text"
    # the text the draft continues from after the main output; None: the engine task's default
    bridge: str | None = None
    # the sidecar's own stop strings, as the request's stop (which stops the main output)
    stop: str | list[str] | None = None
    # its constrained output, as SidecarTask's (at most one): one of the choices, a regex's match, JSON under a schema
    choices: list[str] | None = None
    regex: str | None = None
    json_schema: dict[str, Any] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> list[str] | None:
        return stop_strings(value)

    def task(self) -> SidecarTask:
        given = {} if self.bridge is None else {"bridge": self.bridge}
        given |= {name: getattr(self, name) for name in ("choices", "regex", "json_schema")
                  if getattr(self, name) is not None}
        return SidecarTask(name=self.name, instruction=self.instruction, max_new_tokens=self.max_tokens,
                           attend_document=self.attend_document, parser=self.parser, **given)


class StreamOptions(RequestModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    include_obfuscation: bool | None = None  # refused when true: chunks carry no padding field


# -- output constraints: OpenAI's response_format and vLLM's guided_* fields --


class TextFormat(RequestModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]


class JSONObjectFormat(RequestModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["json_object"]


class JSONSchemaSpec(RequestModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    # "schema" would shadow a BaseModel attribute: the field is schema_, spelled "schema" in JSON
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class JSONSchemaFormat(RequestModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["json_schema"]
    json_schema: JSONSchemaSpec


ResponseFormat = Annotated[TextFormat | JSONObjectFormat | JSONSchemaFormat, Field(discriminator="type")]


@dataclass(frozen=True)
class OutputConstraint:
    """What the output must be, whichever field asked for it (``param``): exactly one of ``choices``, a match of
    ``regex``, or JSON valid under ``json_schema`` (``{}`` for any JSON, ``{"type": "object"}`` for an object).
    ``lenient``: a schema keyword the engine cannot enforce is left unenforced rather than refused (OpenAI's
    ``strict`` not true: its schema guides the output without a guarantee)."""

    param: str
    choices: tuple[str, ...] | None = None
    regex: str | None = None
    json_schema: dict[str, Any] | None = None
    lenient: bool = False
    path: str | None = None  # where in ``param`` the constraint is (a schema inside response_format)

    @property
    def field(self) -> str:
        """The request field that holds what is constrained."""
        return self.path or self.param

    def engine(self) -> Constraint:
        """The engine's constraint (compiled without a tokenizer); ``ConstraintError`` when it cannot be enforced."""
        if self.json_schema is not None and self.lenient:
            return json_schema_constraint(self.json_schema, lenient=True)
        constraint = constraint_from(self.choices, self.regex, self.json_schema)
        assert constraint is not None
        return constraint


class GenerationFields(RequestModel):
    """The fields both routes share: sampling, stops, the penalties and biases OpenAI has, and constraints."""

    model_config = ConfigDict(extra="forbid")

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    # OpenAI's own bound (int64).
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    # OpenAI's ranges; only 0 (no penalty) is supported, refused otherwise
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    # an end-user's id: OpenAI uses it for abuse monitoring; it cannot change the answer
    user: str | None = None
    response_format: ResponseFormat | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_regex: str | None = None
    guided_json: dict[str, Any] | str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> list[str] | None:
        return stop_strings(value)

    @field_validator("guided_json")
    @classmethod
    def _json_schema(cls, value: dict[str, Any] | str | None) -> dict[str, Any] | None:
        if isinstance(value, str):  # vLLM takes the schema as JSON text too
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"not a JSON schema: {exc}") from None
            if not isinstance(value, dict):
                raise ValueError("a JSON schema is a JSON object")
        return value

    @property
    def constraints(self) -> list[OutputConstraint]:
        """The output constraints asked for, in the order of the fields (at most one is allowed)."""
        found = []
        fmt = self.response_format
        if isinstance(fmt, JSONObjectFormat):
            found.append(OutputConstraint("response_format", json_schema={"type": "object"}))
        elif isinstance(fmt, JSONSchemaFormat):
            found.append(OutputConstraint("response_format", json_schema=fmt.json_schema.schema_,
                                          lenient=not fmt.json_schema.strict,
                                          path="response_format.json_schema.schema"))
        if self.guided_choice is not None:
            found.append(OutputConstraint("guided_choice", choices=tuple(self.guided_choice)))
        if self.guided_regex is not None:
            found.append(OutputConstraint("guided_regex", regex=self.guided_regex))
        if self.guided_json is not None:
            found.append(OutputConstraint("guided_json", json_schema=self.guided_json))
        return found

    @property
    def constraint(self) -> OutputConstraint | None:
        """The one output constraint, or None for free text."""
        return self.constraints[0] if self.constraints else None

    def refusals(self) -> Iterator[tuple[str, str]]:
        """(param, why) for each well-formed field this server does not honour as asked."""
        if self.n != 1:
            yield "n", "n must be 1: one choice per request"
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) != 0:
                yield name, f"{name} is not supported: only 0 (no penalty)"
        if self.logit_bias:
            yield "logit_bias", "logit_bias is not supported"
        if self.stream_options is not None and not self.stream:
            yield "stream_options", "stream_options is only allowed together with stream true"
        if self.stream_options is not None and self.stream_options.include_obfuscation:
            yield "stream_options.include_obfuscation", "include_obfuscation is not supported"
        constraints = self.constraints
        if len(constraints) > 1:
            named = " and ".join(c.param for c in constraints)
            yield constraints[1].param, f"give one output constraint, not {named}"

    def engine_constraint(self) -> Constraint | None:
        """The output constraint as the engine enforces it (None: free text); a constraint it cannot enforce (a
        bad regex, a schema that is not JSON Schema or asks for what the engine cannot do) is a
        ``ConstraintError`` whose ``field`` is the request's field (``OutputConstraint.field``)."""
        if (asked := self.constraint) is None:
            return None
        try:
            return asked.engine()
        except ConstraintError as error:
            raise ConstraintError(asked.field, error.reason) from None

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_p, self.seed)


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    # as OpenAI: the most likely alternatives per token, only together with logprobs
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    sidecars: list[dict[str, Any]] | None = Field(None, max_length=16)

    # OpenAI's fields that cannot change the answer here: accepted (metadata and service tier are billing and
    # bookkeeping, the cache key a routing hint, parallel_tool_calls moot without tools)
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default"] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    safety_identifier: str | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI's fields that would: declared so that they are refused by name (``refusals``)
    store: bool | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None

    # vLLM's extensions: each prompt token's log-probability with this many alternatives (the first token's is
    # null), and the prompt ending inside the last message's turn (to continue or score that message)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_PROMPT_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message ends the prompt inside the last message: set "
                             "add_generation_prompt to false with it")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be the assistant's")
        return self

    def refusals(self) -> Iterator[tuple[str, str]]:
        yield from super().refusals()
        for i, message in enumerate(self.messages):
            yield from message.refusals(f"messages.{i}")
        if self.tools:
            yield "tools", "tools are not supported"
        if self.tool_choice not in (None, "none"):
            yield "tool_choice", "tool_choice is not supported (tools are not): only \"none\""
        for name in ("functions", "function_call", "audio", "prediction", "reasoning_effort", "verbosity",
                     "web_search_options", "moderation"):
            if getattr(self, name) is not None:
                yield name, f"{name} is not supported"
        if self.modalities not in (None, ["text"]):
            yield "modalities", "modalities is not supported: only [\"text\"]"
        if self.store:
            yield "store", "store is not supported: the server keeps no completions"
        if self.sidecars is not None and (self.prompt_logprobs is not None or not self.add_generation_prompt):
            yield "sidecars", ("prompt_logprobs, add_generation_prompt and continue_final_message are not "
                               "supported together with sidecars")
        if self.stream and self.prompt_logprobs is not None:
            yield "prompt_logprobs", "prompt_logprobs is not supported when streaming"

    @property
    def engine_top_logprobs(self) -> int | None:
        """What the engine collects: None without logprobs, else the alternatives asked for (0 by default)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(GenerationFields):
    """OpenAI's legacy completions: a raw prompt (text or token ids), no chat template; with ``echo`` and
    ``logprobs`` also each prompt token's log-probability, and ``max_tokens`` 0 to score only."""

    # one prompt per request: text, or token ids (what lm-evaluation-harness sends by default); a list of one
    # prompt is taken as that prompt (clients batch prompts in lists)
    prompt: str | list[int]
    max_tokens: int = Field(16, ge=0)  # OpenAI's default
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_PROMPT_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: object) -> object:
        if isinstance(value, list) and value and all(isinstance(item, str | list) for item in value):
            if len(value) != 1:
                raise ValueError(f"send one prompt per request, not a list of {len(value)}")
            return value[0]
        return value

    @model_validator(mode="after")
    def _consistent(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 generates nothing: it is for scoring the prompt, with echo true")
        return self

    def refusals(self) -> Iterator[tuple[str, str]]:
        yield from super().refusals()
        if self.best_of not in (None, 1):
            yield "best_of", "best_of must be 1: one choice per request"
        if self.stream:
            yield "stream", "stream is not supported on /v1/completions"
        if self.suffix:
            yield "suffix", "suffix is not supported"

    @property
    def scores_prompt(self) -> bool:
        """Whether the response carries the prompt tokens' log-probabilities."""
        return self.echo and self.logprobs is not None

    @property
    def limit(self) -> int:
        return self.max_tokens


def refusal(req: ChatCompletionRequest | CompletionRequest) -> tuple[str, str] | None:
    """(param, why) of the first field of a valid ``req`` that this server does not honour; None if it honours all.

    The one place a well-formed field is refused: when the engine learns a feature, its refusal goes from
    here and the service passes the parsed field on (as it does the output constraints)."""
    return next(iter(req.refusals()), None)


def stop_strings(value: str | list[str] | None) -> list[str] | None:
    """``stop`` as a list, checked against the decoder's bounds; None for no stop strings."""
    stops = [value] if isinstance(value, str) else value
    if stops is not None and (len(stops) > MAX_STOP_STRINGS or any(not s for s in stops)):
        raise ValueError(f"stop takes up to {MAX_STOP_STRINGS} non-empty strings")
    if stops is not None and any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ValueError(f"each stop string may have at most {MAX_STOP_CHARS} characters")
    return stops or None
