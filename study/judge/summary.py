"""A judge run in numbers: verdict counts, the mean preference with its bootstrap interval, the controls
and the position bias, and whether the run's verdicts can be trusted."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from pydantic import BaseModel, Field

from study.judge.config import JudgeConfig
from study.judge.games import GameKind, GameResult
from study.judge.likelihood_run import LikelihoodOutcome, likelihood_reliability
from study.judge.prompts import JudgeMode
from study.judge.reliability import Reliability, auc, detectable_difference, mean_interval, rung
from study.judge.results import JudgeResult
from study.judge.scoring import (
    TEXT_MARGIN,
    bootstrap_ci,
    calibrated_margin,
    position_bias,
    preference,
    text_preference,
)

VERDICT_WORDS = {"sidecar": "the sidecar's tags are better", "standalone": "the standalone tagger's tags are better",
                 "tie": "no difference found"}
SOURCE_STUDY = ("For comparison, the source study's numbers, not ours: on 100 CNN/DailyMail articles its LLM judge "
                "reported 86 ties, the other 14 split 9-5.")


class LikelihoodPart(BaseModel):
    """One likelihood scorer's (model and scorer prompt's) part of a run."""

    model: str
    prompt_version: str
    wins: int = 0
    losses: int = 0
    ties: int = 0
    errors: int = 0
    reliability: Reliability | None = None
    # why the endpoint gave no scores: the pairwise method's verdict then stands alone
    unavailable: str | None = None

    def markdown_row(self) -> str:
        if self.unavailable is not None:
            return f"| {self.model} | {self.prompt_version} | unavailable: {self.unavailable} | | |"
        if self.reliability is None:
            return f"| {self.model} | {self.prompt_version} | nothing scored | | |"
        ladder = self.reliability
        verdict = "UNRELIABLE" if ladder.verdict == "UNRELIABLE" else VERDICT_WORDS[ladder.verdict]
        return (f"| {self.model} | {self.prompt_version} | {ladder.ladder()}; margin {ladder.margin:.3f}, AUC "
                f"{_number(ladder.auc)} | {self.wins}/{self.ties}/{self.losses} ({self.errors} errors) | {verdict} |")


def summarize_likelihood(outcome: LikelihoodOutcome, config: JudgeConfig) -> LikelihoodPart:
    """A scorer's verdict counts and ladder, or why it gave nothing."""
    verdicts = [result.verdict for result in outcome.results]
    scored = [result for result in outcome.results if result.verdict != "skipped"]
    return LikelihoodPart(
        model=outcome.model, prompt_version=outcome.prompt_version, wins=verdicts.count("sidecar"),
        losses=verdicts.count("standalone"), ties=verdicts.count("tie"), errors=verdicts.count("error"),
        reliability=likelihood_reliability(outcome.results, config) if scored else None,
        unavailable=outcome.unavailable)


class JudgeSummary(BaseModel):
    total: int
    judged: int
    wins: int
    losses: int
    ties: int
    # Ties that come from the two games disagreeing rather than both answering tie.
    inconsistent: int
    errors: int
    skipped: int
    order_consistency_rate: float | None
    model: str | None = None
    prompt_version: str | None = None
    mode: JudgeMode = "text"
    # probability mode: the mean debiased preference for the sidecar's tags and its bootstrap 95% interval
    mean_preference: float | None = None
    preference_ci: tuple[float, float] | None = None
    margin: float | None = None
    control_documents: int = 0
    control_accuracy: float | None = None
    position_bias: float | None = None
    threshold: float = 0.9
    reliable: bool = False
    # the controls against the run's margin: separation, the share that cleared it, AUC, detectable difference
    reliability: Reliability | None = None
    # the likelihood method's scorers, each with its own ladder
    likelihood: list[LikelihoodPart] = Field(default_factory=list)
    # why the mode is what it is (an endpoint without log probabilities falls back to the text mode)
    mode_note: str | None = None
    error_docs: dict[str, str] = Field(default_factory=dict)
    # the sidecar task judged here, and the instruction the judge asked about (None: tag lists, hashtag prompts)
    task: str = "hashtags"
    instruction: str | None = None
    # the run's other judged tasks, each with its own summary
    tasks: list[JudgeSummary] = Field(default_factory=list)
    # the run's sidecar tasks the judge cannot score, each with why: not judged, which is no verdict on them
    not_judged: dict[str, str] = Field(default_factory=dict)

    def reliability_line(self) -> str:
        """One sentence on whether the verdicts measure anything, UNRELIABLE in capitals when they do not; a run
        none of whose tasks the judge can score is not judged, with the reasons."""
        if self.not_judged and self.judged == 0:
            return f"Not judged: {self.not_judged_line()}."
        if self.reliability is None:
            return "UNRELIABLE: nothing was judged."
        return self.reliability.line()

    def not_judged_line(self) -> str:
        return "; ".join(f"task {task} is not judged: {reason}" for task, reason in self.not_judged.items())

    def ladders(self) -> list[tuple[str, Reliability]]:
        """Every method's ladder in this run, named by method, judge model and prompt version."""
        pairwise = [] if self.reliability is None else [(f"pairwise {self.model} {self.prompt_version}",
                                                         self.reliability)]
        return pairwise + [(f"likelihood {part.model} {part.prompt_version}", part.reliability)
                           for part in self.likelihood if part.reliability is not None]

    def verdict_line(self) -> str:
        """The run's verdict, only from trusted methods: theirs when they agree, split when they do not,
        else UNRELIABLE and no verdict."""
        trusted = [(name, ladder) for name, ladder in self.ladders() if ladder.verdict != "UNRELIABLE"]
        if not trusted and self.not_judged and self.judged == 0:
            return "none, not judged"
        if not trusted:
            return "none, UNRELIABLE (no method's controls passed)"
        said = [f"{name}: {VERDICT_WORDS[ladder.verdict]}, mean difference {_interval(ladder.interval)}, smallest "
                f"detectable {_number(ladder.detectable)}" for name, ladder in trusted]
        verdicts = {ladder.verdict for _, ladder in trusted}
        head = VERDICT_WORDS[verdicts.pop()] if len(verdicts) == 1 else "split between the trusted methods"
        return f"{head} ({'; '.join(said)})"

    def to_markdown(self) -> str:
        rate = "n/a" if self.order_consistency_rate is None else f"{self.order_consistency_rate:.1%}"
        what = "tags" if self.instruction is None else "outputs"
        title = "hashtags" if self.task == "hashtags" else f"task `{self.task}`"
        lines = [f"# Sidecar vs standalone {title} (LLM judge)", ""]
        if self.instruction is not None:
            lines += [f"The judge asked about the task by its instruction: {self.instruction.strip()}", ""]
        if self.model or self.prompt_version:
            lines += [f"Judge `{self.model}`, prompt `{self.prompt_version}` ({self.mode} mode).", ""]
        if self.mode_note:
            lines += [self.mode_note, ""]
        lines += [f"**{self.reliability_line()}**", "", f"**Verdict of the run: {self.verdict_line()}**", ""]
        if self.not_judged and self.judged:
            lines += [f"Not judged: {self.not_judged_line()}.", ""]
        lines += [
            "| outcome | documents |",
            "|---|---:|",
            f"| sidecar better | {self.wins} |",
            f"| standalone better | {self.losses} |",
            f"| tie | {self.ties} |",
            f"| of which order-inconsistent | {self.inconsistent} |",
            f"| error | {self.errors} |",
            f"| skipped (missing {what}) | {self.skipped} |",
            f"| total | {self.total} |",
            "",
            f"Order consistency (both games agree, over {self.judged} judged documents): {rate}.",
            "",
        ]
        if self.mode == "probability":
            lines += [f"Mean preference for the sidecar's {what}: "
                      f"{_preference(self.mean_preference, self.preference_ci)}"
                      f"; a verdict needs more than {_number(self.margin)} from 0.5 (the margin the null games "
                      "calibrated).", ""]
        bias = _number(self.position_bias)
        detectable = None if self.reliability is None else self.reliability.detectable
        if self.likelihood:
            lines += ["## Likelihood method", "",
                      f"Each {'tag set' if self.instruction is None else 'output'} scored by its tokens' mean log "
                      "probability given the summary, less given another document's summary (nats per token); sidecar "
                      "against standalone by the difference.", "",
                      "| scorer | prompt | ladder (passed/documents) | sidecar wins/ties/losses | verdict |",
                      "|---|---|---|---|---|", *(part.markdown_row() for part in self.likelihood), ""]
        lines += [f"Controls: {self.control_documents} documents, share clearing the margin "
                  f"{_number(self.control_accuracy)} (threshold {self.threshold:.2f}); position bias {bias} (share "
                  "for the set shown first, 0.5 = none); the smallest mean difference this run could detect "
                  f"{_number(detectable)}.", "", SOURCE_STUDY]
        if self.error_docs:
            lines += ["", "## Errors", "", "| doc | error |", "|---|---|"]
            lines += [
                f"| {doc_id} | {error.replace('|', '/').replace(chr(10), ' ')} |"
                for doc_id, error in self.error_docs.items()
            ]
        return "\n".join(lines) + "\n" + "".join("\n" + task.to_markdown() for task in self.tasks)


def _interval(interval: tuple[float, float] | None) -> str:
    return "n/a" if interval is None else f"95% interval {interval[0]:.3f} to {interval[1]:.3f}"


def _number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _preference(mean: float | None, ci: tuple[float, float] | None) -> str:
    if mean is None:
        return "n/a"
    return f"{mean:.3f}" + ("" if ci is None else f" (95% CI {ci[0]:.3f}-{ci[1]:.3f})")


def summarize_judgements(results: Sequence[JudgeResult], config: JudgeConfig | None = None,
                         mode_note: str | None = None, likelihood: Sequence[LikelihoodPart] = ()) -> JudgeSummary:
    """Counts of verdicts, ``order_consistency_rate`` over documents judged without error, and the
    run's quality from its control and null games (see ``study.judge.scoring``)."""
    defaults = JudgeConfig(model="-") if config is None else config
    all_games = [game for result in results for game in (*result.games, *result.controls)]
    mode: JudgeMode = config.mode if config is not None else (
        "probability" if any(game.p_first is not None for game in all_games) else "text")
    verdicts = [result.verdict for result in results]
    judged = [result for result in results if result.order_consistent is not None]
    consistent = sum(1 for result in judged if result.order_consistent)
    preferences = [result.preference for result in results if result.preference is not None]
    nulls = [preference(result.games_of("null")) for result in results]
    margin = calibrated_margin(nulls, defaults.margin_floor) if mode == "probability" else TEXT_MARGIN
    controls = _bases(results, "control")
    mains = [score - 0.5 for score in _bases(results, "main")]
    floor = defaults.margin_floor if mode == "probability" else TEXT_MARGIN
    reliability = Reliability(
        method="pairwise", margin=margin, floor=floor, threshold=defaults.threshold,
        easy=rung("easy", [c - 0.5 for c in controls], margin, floor),
        hard=rung("hard", [h - 0.5 for h in _bases(results, "hard")], margin, floor),
        null=rung("null", [n - 0.5 for n in _bases(results, "null")], margin, floor),
        auc=auc(controls, [1 - c for c in controls]), detectable=detectable_difference(mains),
        interval=mean_interval(mains))
    return JudgeSummary(
        total=len(results),
        judged=len(judged),
        wins=verdicts.count("sidecar"),
        losses=verdicts.count("standalone"),
        ties=verdicts.count("tie"),
        inconsistent=len(judged) - consistent,
        errors=verdicts.count("error"),
        skipped=verdicts.count("skipped"),
        order_consistency_rate=consistent / len(judged) if judged else None,
        model=None if config is None else config.model,
        prompt_version=None if config is None else config.prompt_version,
        mode=mode,
        mean_preference=statistics.fmean(preferences) if preferences else None,
        preference_ci=bootstrap_ci(preferences, defaults.bootstrap_resamples, defaults.seed),
        margin=margin if mode == "probability" else None,
        control_documents=len(controls),
        control_accuracy=reliability.easy.share,
        position_bias=position_bias(all_games),
        threshold=defaults.threshold,
        reliable=reliability.trusted,
        reliability=reliability,
        likelihood=list(likelihood),
        mode_note=mode_note,
        error_docs={
            result.doc_id: "; ".join(f"game {g.game}: {g.error}" for g in result.games if g.error)
            for result in results
            if result.verdict == "error"
        },
    )


def _bases(results: Sequence[JudgeResult], kind: GameKind) -> list[float]:
    """Per document with both games of ``kind`` answered, its preference for the kind's subject side."""
    return [score for result in results if (score := _basis(result.games_of(kind))) is not None]


def _basis(games: Sequence[GameResult]) -> float | None:
    value = preference(games)
    return value if value is not None else text_preference(games)
