"""LLM-judge comparison of sidecar hashtags against a standalone tagger's hashtags, and of any other sidecar
task's outputs, each task on its own (``tasks``: whether its outputs give a control ladder at all).

Each document is judged twice with the tag sets' positions swapped, because LLM judges favour a
position. The probability mode (the default where the endpoint returns log probabilities) asks for one
letter and averages the sidecar's probability over both orders, which cancels the bias; the text mode
asks for a JSON verdict and counts a win only when both games agree. Control games whose answer is known
run beside the comparison, and a judge that fails them has its run marked unreliable. Calls go through
the official ``openai`` client to any OpenAI-compatible endpoint, with our own retry loop (the client's
retries are switched off so that unusable answers and transport errors share one retry budget).

Beside these pairwise games, the likelihood method (``likelihood``, ``likelihood_run``) scores each tag set
by the judge model's log probability of its tokens given the summary, less given another document's
summary, through the legacy completions route with ``echo``; both methods climb the same control ladder
(``controls``) and are read by the same rules (``reliability``).
"""

from study.judge.answers import Choice, JudgeAnswer, JudgeAnswerError, letter_probabilities, parse_judge_answer
from study.judge.config import API_KEY_ENV_VARS, JudgeConfig, JudgeConfigError, make_judge_client
from study.judge.controls import control_foils, hard_tags, null_tags
from study.judge.games import SIDES, GameKind, GameResult, backoff_seconds, request_options
from study.judge.likelihood import NoPromptLogprobsError, TagLikelihood, tag_likelihood
from study.judge.likelihood_run import (
    LikelihoodOutcome,
    LikelihoodResult,
    TagScore,
    likelihood_reliability,
    score_by_likelihood,
    score_documents,
    unavailable_reason,
)
from study.judge.prompts import (
    DEFAULT_PROMPT_VERSION,
    PROMPTS,
    SCORER_PROMPTS,
    TEXT_FALLBACK,
    JudgeMode,
    render_prompt,
)
from study.judge.reliability import Method, Reliability, Rung, auc, detectable_difference, mean_interval
from study.judge.results import JudgeItem, JudgeResult
from study.judge.run import Detection, detect_prompt_version, judge_pairs
from study.judge.scoring import (
    Verdict,
    bootstrap_ci,
    calibrated_margin,
    final_verdict,
    position_bias,
    preference,
    preference_verdict,
)
from study.judge.summary import JudgeSummary, LikelihoodPart, summarize_judgements, summarize_likelihood
from study.judge.tasks import not_judged_reason

__all__ = [
    "API_KEY_ENV_VARS",
    "DEFAULT_PROMPT_VERSION",
    "PROMPTS",
    "SCORER_PROMPTS",
    "SIDES",
    "TEXT_FALLBACK",
    "Choice",
    "Detection",
    "GameKind",
    "GameResult",
    "JudgeAnswer",
    "JudgeAnswerError",
    "JudgeConfig",
    "JudgeConfigError",
    "JudgeItem",
    "JudgeMode",
    "JudgeResult",
    "JudgeSummary",
    "LikelihoodOutcome",
    "LikelihoodPart",
    "LikelihoodResult",
    "Method",
    "NoPromptLogprobsError",
    "Reliability",
    "Rung",
    "TagLikelihood",
    "TagScore",
    "Verdict",
    "auc",
    "backoff_seconds",
    "bootstrap_ci",
    "calibrated_margin",
    "control_foils",
    "detect_prompt_version",
    "detectable_difference",
    "final_verdict",
    "hard_tags",
    "judge_pairs",
    "letter_probabilities",
    "likelihood_reliability",
    "make_judge_client",
    "mean_interval",
    "not_judged_reason",
    "null_tags",
    "parse_judge_answer",
    "position_bias",
    "preference",
    "preference_verdict",
    "render_prompt",
    "request_options",
    "score_by_likelihood",
    "score_documents",
    "summarize_judgements",
    "summarize_likelihood",
    "tag_likelihood",
    "unavailable_reason",
]
