"""What the judge is given per document, and what it found."""

from __future__ import annotations

from pydantic import BaseModel, Field, JsonValue

from study.judge.games import GameKind, GameResult
from study.judge.scoring import Verdict


class JudgeItem(BaseModel):
    """A document's main output (``summary``) and one sidecar task's parsed output in each mode: the tags of the
    hashtag task, any JSON value of another (a string, a label, an object); None where it did not parse."""

    doc_id: str
    summary: str
    sidecar_tags: JsonValue
    standalone_tags: JsonValue
    task: str = "hashtags"
    # what the judge asks about: the task's instruction as a tagger that sees only the main output reads it;
    # None for tag lists, which the hashtag prompts judge
    instruction: str | None = None

    @property
    def comparable(self) -> bool:
        """Whether both modes have an output to compare."""
        return has_output(self.sidecar_tags) and has_output(self.standalone_tags)


def has_output(value: JsonValue) -> bool:
    """An output that parsed and is not empty (no tags, a blank string, an empty object)."""
    return value is not None and value not in ("", [], {})


class JudgeResult(BaseModel):
    doc_id: str
    # the two main games: the sidecar's tags against the standalone tagger's
    games: list[GameResult]
    verdict: Verdict
    skip_reason: str | None = None
    # probability mode: the debiased probability that the sidecar's tags are better
    preference: float | None = None
    # the document's control and null games, when it is in the run's control sample
    controls: list[GameResult] = Field(default_factory=list)
    foil_doc_id: str | None = None

    def games_of(self, kind: GameKind) -> list[GameResult]:
        return [game for game in (*self.games, *self.controls) if game.kind == kind]

    @property
    def order_consistent(self) -> bool | None:
        """Whether both games named the same side; None when the document was not fully judged."""
        if self.verdict in ("error", "skipped"):
            return None
        return self.games[0].winner == self.games[1].winner
