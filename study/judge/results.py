"""What the judge is given per document, and what it found."""

from __future__ import annotations

from pydantic import BaseModel, Field

from study.judge.games import GameKind, GameResult
from study.judge.scoring import Verdict


class JudgeItem(BaseModel):
    doc_id: str
    summary: str
    sidecar_tags: list[str] | None
    standalone_tags: list[str] | None


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
