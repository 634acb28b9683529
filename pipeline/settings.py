"""What every document of a run goes through: its main task's prompts and its sidecar tasks, in a set of modes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sidecar.tasks.prompts import DEFAULT_SYSTEM, SUMMARIZE_INSTRUCTION
from sidecar.tasks.task import SidecarTask
from vocab.modes import MODES, Mode

DEFAULT_MODES: tuple[Mode, ...] = ("sidecar", "standalone")


@dataclass(frozen=True)
class BatchSettings:
    """What every document of a run goes through: the main task (``instruction`` after the document,
    ``system`` before it, None for no system turn) and its sidecar tasks (each decoded from the one main
    output), in the given modes."""

    tasks: Sequence[SidecarTask]
    modes: tuple[Mode, ...] = DEFAULT_MODES
    max_new_tokens: int = 128
    instruction: str = SUMMARIZE_INSTRUCTION
    system: str | None = DEFAULT_SYSTEM

    def __post_init__(self) -> None:
        unknown = sorted(set(self.modes) - set(MODES))
        if not self.modes or unknown:
            raise ValueError(f"modes must be a non-empty subset of {', '.join(MODES)}; got {list(self.modes)}")
        if isinstance(self.tasks, SidecarTask):
            raise TypeError("tasks takes a sequence of sidecar tasks, not one task")
        names = [t.name for t in self.tasks]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"tasks must be at least one sidecar task, each with its own name; got {names}")
        object.__setattr__(self, "tasks", tuple(self.tasks))

    def mode_tasks(self, mode: str) -> list[SidecarTask]:
        """The tasks as a mode runs them: only ``sidecar_attended`` keeps the document in the draft's cache."""
        return [t.model_copy(update={"attend_document": mode == "sidecar_attended"}) for t in self.tasks]
