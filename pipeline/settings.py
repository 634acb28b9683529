"""What every document of a run goes through: its main task's prompts and one sidecar task, in a set of modes."""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.tasks.prompts import DEFAULT_SYSTEM, SUMMARIZE_INSTRUCTION
from sidecar.tasks.task import SidecarTask
from vocab.modes import MODES, Mode

DEFAULT_MODES: tuple[Mode, ...] = ("sidecar", "standalone")


@dataclass(frozen=True)
class BatchSettings:
    """What every document of a run goes through: the main task (``instruction`` after the document,
    ``system`` before it, None for no system turn) and one sidecar task, in the given modes."""

    task: SidecarTask
    modes: tuple[Mode, ...] = DEFAULT_MODES
    max_new_tokens: int = 128
    instruction: str = SUMMARIZE_INSTRUCTION
    system: str | None = DEFAULT_SYSTEM

    def __post_init__(self) -> None:
        unknown = sorted(set(self.modes) - set(MODES))
        if not self.modes or unknown:
            raise ValueError(f"modes must be a non-empty subset of {', '.join(MODES)}; got {list(self.modes)}")

    def mode_task(self, mode: str) -> SidecarTask:
        """The task as a mode runs it: only ``sidecar_attended`` keeps the document in the draft's cache."""
        return self.task.model_copy(update={"attend_document": mode == "sidecar_attended"})
