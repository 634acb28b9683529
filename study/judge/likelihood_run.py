"""The likelihood method: every tag set of a document scored by pointwise mutual information with its summary.

A tag set's score is the mean log probability of its tokens after the scorer prompt with the document's
summary, less the same after the prompt with a baseline document's summary (the next document's, a fixed
derangement): how much this summary, rather than any summary, makes these tags likely. A document's
difference for a comparison is its subject side's score less the other side's: the sidecar's tags against
the standalone tagger's, and on the control ladder (``study.judge.controls``) the own tags against another
document's (easy), against the half-replaced set (hard) and against themselves reversed (null, true
difference 0). Any other sidecar task is scored the same way, its output after the scorer prompt's task form
(``study.judge.likelihood``) with the task's instruction. Verdicts and controls are read by the same rule as
the pairwise method's (``study.judge.reliability``), with a margin in nats per token.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field, JsonValue

from study.judge.answers import JudgeAnswerError
from study.judge.config import JudgeConfig
from study.judge.controls import control_foils, hard_tags, null_tags
from study.judge.games import MAX_ERROR_CHARS, SIDES, GameKind, Redactor, Winner, backoff_seconds, is_retryable, logger
from study.judge.likelihood import NoPromptLogprobsError, TagLikelihood, tag_likelihood
from study.judge.reliability import Reliability, auc, detectable_difference, mean_interval, rung
from study.judge.results import JudgeItem
from study.judge.run import client_and_redactor, in_turn
from study.judge.scoring import Verdict

if TYPE_CHECKING:
    import openai


class TagScore(BaseModel):
    """One tag set (or a task's output) of a document, scored after its own summary and after the baseline
    document's."""

    kind: GameKind
    side: Winner
    tags: JsonValue
    given_own: float | None = None
    given_baseline: float | None = None
    tokens: int | None = None
    error: str | None = None

    @property
    def pmi(self) -> float | None:
        if self.given_own is None or self.given_baseline is None:
            return None
        return self.given_own - self.given_baseline


class LikelihoodResult(BaseModel):
    doc_id: str
    scores: list[TagScore]
    verdict: Verdict
    # the document whose summary every score here is compared against, and whose tags the controls use
    baseline_doc_id: str | None = None
    foil_doc_id: str | None = None
    skip_reason: str | None = None

    def score(self, kind: GameKind, side: Winner) -> TagScore | None:
        return next((s for s in self.scores if s.kind == kind and s.side == side), None)

    def difference(self, kind: GameKind) -> float | None:
        """The subject side's score less the other side's, for ``kind``; None unless both were scored."""
        subject, other = (self.score(kind, side) for side in SIDES[kind])
        if subject is None or other is None or subject.pmi is None or other.pmi is None:
            return None
        return subject.pmi - other.pmi


def scored(client: openai.OpenAI, model: str, prompt_version: str, config: JudgeConfig, redact: Redactor,
           summary: str, tags: JsonValue, instruction: str | None = None) -> TagLikelihood:
    """``tag_likelihood`` retried as a game is: transport failures and 5xx/429 with backoff. An endpoint
    without prompt log probabilities is not asked again."""
    import openai  # imported when the judge asks, not with the flows that import study.judge

    for attempt in range(1, config.retries + 2):
        try:
            return tag_likelihood(client, model, summary, tags, prompt_version, instruction)
        except NoPromptLogprobsError:
            raise
        except (openai.OpenAIError, JudgeAnswerError) as exc:
            if not is_retryable(exc) or attempt > config.retries:
                raise
            logger.warning("likelihood score attempt %d failed, retrying: %s", attempt,
                           redact(str(exc))[:MAX_ERROR_CHARS])
            time.sleep(backoff_seconds(attempt, config.backoff_base_s, config.backoff_max_s))
    raise AssertionError("unreachable")  # the loop returns or raises


def unavailable_reason(item: JudgeItem, config: JudgeConfig, client: openai.OpenAI, model: str,
                       prompt_version: str, redact: Redactor) -> str | None:
    """Why ``model`` cannot score by likelihood, asked once with ``item``'s sidecar tags; None when it can
    (or when the probe failed otherwise, which decides nothing: the scores will fail the same way)."""
    import openai  # imported when the judge asks, not with the flows that import study.judge

    try:
        scored(client, model, prompt_version, config, redact, item.summary, item.sidecar_tags, item.instruction)
    except NoPromptLogprobsError as exc:
        return redact(str(exc))[:MAX_ERROR_CHARS]
    except (openai.OpenAIError, JudgeAnswerError):
        return None
    return None


def score_documents(items: list[JudgeItem], config: JudgeConfig, client: openai.OpenAI, model: str,
                    prompt_version: str, redact: Redactor,
                    on_result: Callable[[LikelihoodResult], None] | None = None,
                    run: list[JudgeItem] | None = None) -> list[LikelihoodResult]:
    """Score every item's tag sets; results in the order of ``items``, each heard by ``on_result`` as it
    comes (``in_turn``: when it raises, no queued item is scored). Baselines, and which documents climb the
    control ladder (the first ``config.controls`` with both tag sets), come from ``run``, every document of
    the run (default ``items``): a resumed pass that scores a few documents gives each the baseline and
    ladder a whole pass would, and a lone pending document still has the others as baselines."""
    import openai  # imported when the judge asks, not with the flows that import study.judge

    judgeable = [item for item in (items if run is None else run) if item.comparable]
    summaries = {item.doc_id: item.summary for item in judgeable}
    baselines = control_foils([(item.doc_id, item.sidecar_tags) for item in judgeable], len(judgeable))
    in_sample = {item.doc_id for item in judgeable[:config.controls]}

    def one(item: JudgeItem) -> LikelihoodResult:
        if not item.comparable or item.doc_id not in baselines:
            reason = "no baseline document with other tags" if item.comparable else "missing tags"
            return LikelihoodResult(doc_id=item.doc_id, scores=[], verdict="skipped", skip_reason=reason)
        baseline = baselines[item.doc_id]
        sets: list[tuple[GameKind, Winner, JsonValue]] = [
            ("main", "sidecar", item.sidecar_tags), ("main", "standalone", item.standalone_tags)]
        foil = baseline if item.doc_id in in_sample else None
        if foil is not None:
            sets += [("control", "own", item.sidecar_tags), ("control", "other", foil.tags)]
            if (mixed := hard_tags(item.sidecar_tags, foil.tags)) is not None:
                sets += [("hard", "own", item.sidecar_tags), ("hard", "mixed", mixed)]
            if (flipped := null_tags(item.sidecar_tags)) is not None:
                sets += [("null", "original", item.sidecar_tags), ("null", "reversed", flipped)]
        cache: dict[tuple[str, str], TagLikelihood | str] = {}

        def likelihood(summary_of: str, tags: JsonValue) -> TagLikelihood | str:
            key = (summary_of, json.dumps(tags, ensure_ascii=False))  # order kept: a null game's output is reordered
            if key not in cache:
                try:
                    cache[key] = scored(client, model, prompt_version, config, redact, summaries[summary_of], tags,
                                        item.instruction)
                except (openai.OpenAIError, JudgeAnswerError) as exc:
                    cache[key] = redact(f"{type(exc).__name__}: {exc}")[:MAX_ERROR_CHARS]
            return cache[key]

        scores = []
        for kind, side, tags in sets:
            own, other = likelihood(item.doc_id, tags), likelihood(baseline.doc_id, tags)
            errors = [r for r in (own, other) if isinstance(r, str)]
            scores.append(TagScore(
                kind=kind, side=side, tags=tags, error="; ".join(errors) or None,
                given_own=None if isinstance(own, str) else own.mean_logprob,
                given_baseline=None if isinstance(other, str) else other.mean_logprob,
                tokens=None if isinstance(own, str) else own.tokens))
        return LikelihoodResult(doc_id=item.doc_id, scores=scores, verdict="error", baseline_doc_id=baseline.doc_id,
                                foil_doc_id=None if foil is None else foil.doc_id)

    logger.info("scoring %d documents by likelihood with %s (prompt %s)", len(items), model, prompt_version)
    with ThreadPoolExecutor(max_workers=max(1, min(config.concurrency, len(items))),
                            thread_name_prefix="likelihood") as pool:
        results = in_turn(pool, items, one, config.concurrency, on_result)
    margin = likelihood_margin(results, config)
    return [result if result.verdict == "skipped" else result.model_copy(update={"verdict": verdict(result, margin)})
            for result in results]


class LikelihoodOutcome(BaseModel):
    """What one scorer (model and scorer prompt) gave a run: its results, or why it gave none."""

    model: str
    prompt_version: str
    results: list[LikelihoodResult] = Field(default_factory=list)
    # why the endpoint cannot score by likelihood (then the run's verdict rests on the pairwise method)
    unavailable: str | None = None


def score_by_likelihood(items: list[JudgeItem], config: JudgeConfig, model: str, prompt_version: str,
                        client: openai.OpenAI | None = None,
                        on_result: Callable[[LikelihoodResult], None] | None = None,
                        run: list[JudgeItem] | None = None) -> LikelihoodOutcome:
    """Probe once whether ``model`` gives prompt log probabilities, then score ``items`` (``score_documents``,
    baselines from ``run``); an endpoint that gives none is asked nothing more and the outcome says why.
    Without a judgeable item nothing is asked."""
    client, redact = client_and_redactor(config, client)
    probe = next((item for item in items if item.comparable), None)
    if probe is None:
        return LikelihoodOutcome(model=model, prompt_version=prompt_version)
    reason = unavailable_reason(probe, config, client, model, prompt_version, redact)
    if reason is not None:
        logger.warning("likelihood scoring with %s is unavailable, the pairwise method stands: %s", model, reason)
        return LikelihoodOutcome(model=model, prompt_version=prompt_version, unavailable=reason)
    return LikelihoodOutcome(model=model, prompt_version=prompt_version,
                             results=score_documents(items, config, client, model, prompt_version, redact, on_result,
                                                     run))


def likelihood_margin(results: list[LikelihoodResult], config: JudgeConfig) -> float:
    """Twice the root mean square of the null documents' differences, at least ``config.likelihood_floor``.

    Reordering a tag set changes its likelihood (on real news by up to half a nat per token), so the null
    rung measures the method's own noise; its true difference is 0, so the root mean square is taken about 0
    and a bias widens the margin. Two of them bound a normal noise's 95%: a null document outside them is
    one whose noise the others do not share, which is how the null rung can fail."""
    nulls = [d for r in results if (d := r.difference("null")) is not None]
    spread = 2 * math.sqrt(math.fsum(d * d for d in nulls) / len(nulls)) if nulls else 0.0
    return max(config.likelihood_floor, spread)


def verdict(result: LikelihoodResult, margin: float) -> Verdict:
    difference = result.difference("main")
    if difference is None:
        return "error"
    return "sidecar" if difference > margin else "standalone" if difference < -margin else "tie"


def likelihood_reliability(results: list[LikelihoodResult], config: JudgeConfig) -> Reliability:
    """The likelihood method's ladder in this run; own and foil scores for the AUC are the easy rung's PMIs."""
    margin = likelihood_margin(results, config)

    def differences(kind: GameKind) -> list[float]:
        return [d for r in results if (d := r.difference(kind)) is not None]

    easy = [r for r in results if r.difference("control") is not None]
    own = [s.pmi for r in easy if (s := r.score("control", "own")) is not None and s.pmi is not None]
    foil = [s.pmi for r in easy if (s := r.score("control", "other")) is not None and s.pmi is not None]
    mains = differences("main")
    floor = config.likelihood_floor
    return Reliability(
        method="likelihood", margin=margin, floor=floor, null_band=margin, threshold=config.threshold,
        easy=rung("easy", differences("control"), margin, floor), hard=rung("hard", differences("hard"), margin, floor),
        # the null rung ties within the margin its own noise sets (``likelihood_margin``)
        null=rung("null", differences("null"), margin, margin), auc=auc(own, foil),
        detectable=detectable_difference(mains), interval=mean_interval(mains))
