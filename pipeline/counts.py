"""What a run did, counted for the summary artifact and the command line."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from pipeline.finished import DocumentFailure, FinishedDocument
from storage import RejectedDocument

if TYPE_CHECKING:
    from pipeline.streams import WindowStats  # the engine: a run's counts are made before it loads


@dataclass
class RunCounts:
    """What a run did, for the summary artifact and the command line."""

    run_id: str
    documents: int = 0
    done: int = 0
    skipped_done: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    # windows run, and the engine streams and standalone calls they ran
    windows: int = 0
    engine_batches: int = 0
    # DuckDB transactions that committed outputs (several documents each when they are fast); in a shard, the
    # part files it wrote
    commits: int = 0
    # a sharded run's parent: the attempts it launched, the part files it ingested
    shard_attempts: int = 0
    parts: int = 0
    # and how long its attempts waited for their accelerators, held by other runs (not counted as stalls)
    device_wait_seconds: float = 0.0
    # engine streams and calls given up on out-of-memory and run again smaller
    oom_retries: int = 0
    # where the run's time went: engine calls; DuckDB (every call); reading, tokenizing and checking the
    # input, loading the pair. The rest of a run's wall time is Prefect's: inside the flow function
    # (``process_seconds``, its wall time before judge and cost report), task runs and artifacts; around
    # it, the flow run's start and finish.
    model_seconds: float = 0.0
    storage_seconds: float = 0.0
    input_seconds: float = 0.0
    process_seconds: float = 0.0
    # final state of each flow run afterwards (judge, cost-report), when the run triggered them itself
    downstream: dict[str, str] = field(default_factory=dict)

    @contextlib.contextmanager
    def timed(self, what: Literal["storage", "input"]) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            name = f"{what}_seconds"
            setattr(self, name, getattr(self, name) + time.perf_counter() - started)

    def add_rejects(self, rejects: Iterable[RejectedDocument]) -> None:
        for reject in rejects:
            self.rejected[reject.reason] = self.rejected.get(reject.reason, 0) + 1

    def add_documents(self, docs: Iterable[FinishedDocument]) -> None:
        for doc in docs:
            if isinstance(doc, DocumentFailure):
                self.errors[doc.doc.doc_id] = doc.error
            else:
                self.done += 1

    def add_window(self, stats: WindowStats) -> None:
        self.windows += 1
        self.engine_batches += stats.engine_batches
        self.oom_retries += stats.oom_retries
        self.model_seconds += stats.model_seconds

    def _work_line(self) -> str:
        if self.shard_attempts:  # a sharded run's parent: the engine ran in its shards
            return (f"{self.shard_attempts} shard attempts wrote the {self.parts} part files ingested in "
                    f"{self.commits} transactions ({self.storage_seconds:.2f} s in DuckDB), after waiting "
                    f"{self.device_wait_seconds:.0f} s in all for accelerators other runs held; the engine's "
                    f"counts are in each shard's summary.")
        return (f"{self.windows} windows ({self.engine_batches} engine streams and calls) in {self.commits} commits, "
                f"{self.oom_retries} out-of-memory retries; "
                f"{self.model_seconds:.1f} s in the models, {self.storage_seconds:.2f} s in DuckDB, "
                f"{self.input_seconds:.2f} s reading the input and loading the pair.")

    def markdown(self) -> str:
        lines = [
            f"# Nightly run `{self.run_id}`", "",
            "| documents | count |", "|---|---:|",
            f"| usable in input | {self.documents} |",
            f"| done in this run | {self.done} |",
            f"| skipped, already done | {self.skipped_done} |",
            *(f"| rejected: {reason} | {count} |" for reason, count in sorted(self.rejected.items())),
            f"| errors | {len(self.errors)} |", "",
            self._work_line(),
        ]
        if self.errors:
            lines += ["", "## Errors", "", "| doc | error |", "|---|---|"]
            lines += [f"| {_cell(doc_id)} | {_cell(error)} |" for doc_id, error in self.errors.items()]
        return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")
