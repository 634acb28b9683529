"""Where and how to ask the judge, and the OpenAI client that asks it."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import httpx
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from study.judge.prompts import DEFAULT_PROMPT_VERSION, DEFAULT_SCORER_PROMPTS, PROMPTS, SCORER_PROMPTS, JudgeMode

if TYPE_CHECKING:
    import openai

API_KEY_ENV_VARS = ("SIDECAR_JUDGE_API_KEY", "OPENAI_API_KEY")


class JudgeConfigError(ValueError):
    """A judge configuration that cannot be used, such as one with no API key to be found."""


class JudgeConfig(BaseModel):
    """Where and how to ask the judge. The API key is a ``SecretStr``: masked in repr, logs and dumps."""

    # a timeout, backoff or floor of infinity or NaN passes a lone lower bound: refused like any other bad value
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    model: str
    base_url: str | None = None
    api_key: SecretStr | None = None
    concurrency: int = Field(default=4, ge=1)
    # Retries after the first attempt, so a game makes at most ``retries + 1`` calls.
    retries: int = Field(default=3, ge=0)
    timeout_s: float = Field(default=60.0, gt=0)
    prompt_version: str = DEFAULT_PROMPT_VERSION
    backoff_base_s: float = Field(default=1.0, ge=0)
    backoff_max_s: float = Field(default=30.0, ge=0)
    # the text mode's answer budget; the probability mode asks for one token
    max_tokens: int = Field(default=200, ge=16)
    # documents that also climb the control ladder (study.judge.controls); a run needs two documents with
    # tags for any control
    controls: int = Field(default=20, ge=0)
    # a method is trusted when its easy rung cleared the margin and its null rung tied in at least this
    # share of documents; otherwise its verdicts are UNRELIABLE
    threshold: float = Field(default=0.9, ge=0, le=1)
    # the least margin from 0.5 a probability verdict needs, whatever the null games' noise
    margin_floor: float = Field(default=0.02, ge=0, le=0.5)
    # the likelihood method (study.judge.likelihood_run): its scorer prompts, the model that scores besides
    # ``model`` (another model of the pair, e.g. ``<served name>/draft``: a second judge), and the least
    # margin of a verdict in nats per token, whatever the null documents' noise
    likelihood_prompts: tuple[str, ...] = DEFAULT_SCORER_PROMPTS
    likelihood_model: str | None = None
    likelihood_floor: float = Field(default=0.1, ge=0)
    # the confidence interval of the mean preference: bootstrap resamples over documents, and their seed
    bootstrap_resamples: int = Field(default=2000, ge=100)
    seed: int = 0

    @field_validator("prompt_version")
    @classmethod
    def _known_prompt_version(cls, version: str) -> str:
        if version not in PROMPTS:
            raise ValueError(f"unknown prompt_version {version!r}; known: {sorted(PROMPTS)}")
        return version

    @field_validator("likelihood_prompts")
    @classmethod
    def _known_scorer_prompts(cls, versions: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [version for version in versions if version not in SCORER_PROMPTS]
        if unknown:
            raise ValueError(f"unknown likelihood_prompts {unknown}; known: {sorted(SCORER_PROMPTS)}")
        return versions

    @property
    def scorers(self) -> list[tuple[str, str]]:
        """(model, scorer prompt version) of every likelihood score a run asks for."""
        models = [self.model] + ([self.likelihood_model] if self.likelihood_model else [])
        return [(model, version) for model in models for version in self.likelihood_prompts]

    @property
    def mode(self) -> JudgeMode:
        """The answer mode of ``prompt_version``: ``probability`` or ``text``."""
        return PROMPTS[self.prompt_version].mode

    def resolved_api_key(self) -> SecretStr:
        """The key to call the judge with: ``api_key``, else the first of ``SIDECAR_JUDGE_API_KEY`` /
        ``OPENAI_API_KEY`` that is set. (The judge flow reads a Prefect Secret block into ``api_key``.)"""
        if self.api_key is not None:
            return self.api_key
        for name in API_KEY_ENV_VARS:
            value = os.environ.get(name)
            if value:
                return SecretStr(value)
        raise JudgeConfigError(
            "no judge API key: set api_key (the judge flow: api_key_secret_block) or one of "
            f"{', '.join(API_KEY_ENV_VARS)} (any non-empty value for a server that does not check keys)"
        )


def make_judge_client(config: JudgeConfig, http_client: httpx.Client | None = None) -> openai.OpenAI:
    """An OpenAI client for the judge endpoint; the client's own retries are off (the games retry)."""
    import openai  # imported when the judge asks, not with the flows that import study.judge

    return openai.OpenAI(
        base_url=config.base_url,
        api_key=config.resolved_api_key().get_secret_value(),
        timeout=config.timeout_s,
        max_retries=0,
        http_client=http_client,
    )
