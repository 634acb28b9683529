"""The chat-completions and completions requests as the API accepts them: a validated request is one the server
can answer as asked.

Unknown fields are ignored, as other OpenAI-compatible servers do; fields that would silently change the
answer's meaning (``n`` > 1, ``tools``) are refused. Every model here is a :class:`RequestModel`: strict, so
a number or flag must have its JSON type (``true`` is not 1, ``"1"`` is not a number; a whole number is a
valid float), and every string in it, however nested, is valid Unicode text.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

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
    model_config = ConfigDict(extra="ignore")

    # "developer" is OpenAI's newer name for the system role; tools are not supported.
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)

    @property
    def template_role(self) -> str:
        return "system" if self.role == "developer" else self.role


class SidecarSpec(RequestModel):
    """A sidecar task as the API spells it (``max_tokens`` like the main request)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    instruction: str
    max_tokens: int = 32
    attend_document: bool = False
    parser: Literal["hashtags", "text"] = "text"

    def task(self) -> SidecarTask:
        return SidecarTask(name=self.name, instruction=self.instruction, max_new_tokens=self.max_tokens,
                           attend_document=self.attend_document, parser=self.parser)


class StreamOptions(RequestModel):
    include_usage: bool = False


class ChatCompletionRequest(RequestModel):
    # Unknown fields (user, metadata, penalties, ...) are ignored like other OpenAI-compatible servers do;
    # fields that would silently change the answer's meaning are refused below.
    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    # OpenAI's own bound (int64).
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    tools: list[Any] | None = None
    logprobs: bool | None = False
    # as OpenAI: the most likely alternatives per token, only together with logprobs
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    sidecars: list[dict[str, Any]] | None = Field(None, max_length=16)

    # vLLM's extensions: each prompt token's log-probability with this many alternatives (the first token's is
    # null), and the prompt ending inside the last message's turn (to continue or score that message)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_PROMPT_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> list[str] | None:
        return stop_strings(value)

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return value

    @model_validator(mode="after")
    def _supported(self) -> ChatCompletionRequest:
        if self.n != 1:
            raise ValueError("n must be 1: one choice per request")
        if self.tools:
            raise ValueError("tools are not supported")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message ends the prompt inside the last message: set "
                             "add_generation_prompt to false with it")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be the assistant's")
        if self.sidecars is not None and (self.prompt_logprobs is not None or not self.add_generation_prompt):
            raise ValueError("prompt_logprobs, add_generation_prompt and continue_final_message are not supported "
                             "together with sidecars")
        if self.stream and self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not supported when streaming")
        return self

    @property
    def engine_top_logprobs(self) -> int | None:
        """What the engine collects: None without logprobs, else the alternatives asked for (0 by default)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_p, self.seed)


class CompletionRequest(RequestModel):
    """OpenAI's legacy completions: a raw prompt (text or token ids), no chat template; with ``echo`` and
    ``logprobs`` also each prompt token's log-probability, and ``max_tokens`` 0 to score only."""

    model_config = ConfigDict(extra="ignore")

    model: str
    # one prompt per request: text, or token ids (what lm-evaluation-harness sends by default); a list of one
    # prompt is taken as that prompt (clients batch prompts in lists)
    prompt: str | list[int]
    max_tokens: int = Field(16, ge=0)  # OpenAI's default
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_PROMPT_LOGPROBS)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    n: int = 1
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

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> list[str] | None:
        return stop_strings(value)

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        if self.n != 1 or self.best_of not in (None, 1):
            raise ValueError("n and best_of must be 1: one choice per request")
        if self.stream:
            raise ValueError("stream is not supported on /v1/completions")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 generates nothing: it is for scoring the prompt, with echo true")
        return self

    @property
    def scores_prompt(self) -> bool:
        """Whether the response carries the prompt tokens' log-probabilities."""
        return self.echo and self.logprobs is not None

    @property
    def limit(self) -> int:
        return self.max_tokens

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_p, self.seed)


def stop_strings(value: str | list[str] | None) -> list[str] | None:
    """``stop`` as a list, checked against the decoder's bounds; None for no stop strings."""
    stops = [value] if isinstance(value, str) else value
    if stops is not None and (len(stops) > MAX_STOP_STRINGS or any(not s for s in stops)):
        raise ValueError(f"stop takes up to {MAX_STOP_STRINGS} non-empty strings")
    if stops is not None and any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ValueError(f"each stop string may have at most {MAX_STOP_CHARS} characters")
    return stops or None
