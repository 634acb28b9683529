"""The parameters of a nightly run (the Prefect UI's run form), and which of them decide what it computes.

A run's id is derived from its decisive fields; a resume must repeat them (:meth:`NightlyParams.resume_identity`);
the fields in :data:`NOT_DECISIVE` change where, how fast or when the outputs are made, so a run may be
resumed with other values of them (more workers, another commit cadence).
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pipeline import BatchSettings
from sidecar.tasks.prompts import DEFAULT_SYSTEM, SUMMARIZE_INSTRUCTION
from sidecar.tasks.task import HASHTAGS, SidecarTask
from storage.run_keys import check_run_id
from vocab.modes import Mode

# Fields that change where, how fast or when the outputs are made, not what they are.
NOT_DECISIVE = frozenset({"batch_size", "window", "db_path", "run_id", "commit_every_s", "trigger_judge",
                          "trigger_cost_report", "lock_wait_s", "run_wait_s", "device_wait_s", "workers", "shards",
                          "results_uri", "shard_retries", "shard_stall_s", "shard_deployment"})
# Decisive fields a resume proves otherwise: the corpus by its stored rows (ids, titles and texts; a larger
# limit may extend a run), and pair, gamma and modes by the run's own columns (storage.resume).
PROVEN_BY_STORAGE = frozenset({"corpus", "limit", "pair", "gamma", "modes"})


class NightlyParams(BaseModel):
    """Everything a nightly run needs; the Prefect UI renders it as the run form."""

    model_config = ConfigDict(extra="forbid")

    corpus: str = Field("data/news.parquet", description="Corpus file with one document per row: .parquet, .jsonl "
                                                         "(one JSON object per line) or .csv (with a header row).")
    id_column: str = Field("id", description="Column with a unique document id.")
    text_column: str = Field("article", description="Column with the document text.")
    title_column: str | None = Field(None, description="Optional column with a title, stored with the document.")
    limit: int | None = Field(None, ge=1, description="Run only the first N usable documents.")
    max_chars: int | None = Field(
        100_000, ge=1, description="Reject longer texts before tokenizing them (the token check follows).")
    batch_size: int = Field(8, ge=1, le=1024, description="Documents decoded together, at most (the engine's "
                                                          "max batch); they join as others finish.")
    window: int | None = Field(
        None, ge=1, le=1_000_000,
        description="Documents read ahead and sorted by length before they stream through the engine; "
                    "default 8 x batch_size. With standalone among the modes, a window's documents are done "
                    "together at its end.")
    pair: str = Field("qwen-coder-small", description="Model pair: tiny, qwen-coder-small, qwen2.5-7b or T,D.")
    gamma: int = Field(4, ge=1, le=16, description="Tokens the draft proposes per target forward (adaptive).")
    max_new_tokens: int = Field(128, ge=1, le=4096, description="Main output tokens per document.")
    instruction: str = Field(
        SUMMARIZE_INSTRUCTION, max_length=20_000,
        description="The main task: what the target writes about each document, after it ('' for none).")
    system: str = Field(DEFAULT_SYSTEM, max_length=20_000,
                        description="The system prompt before each document ('' for none).")
    commit_every_s: float = Field(
        10.0, ge=0, le=3600,
        description="Commit finished documents at least this often (0: as they finish); a crash loses at "
                    "most this much finished work plus the documents in flight.")
    sidecar_tasks: list[SidecarTask] = Field(
        default_factory=lambda: [HASHTAGS],
        description="The sidecar tasks the draft runs after the main output, each from the one main output, with "
                    "a name, an instruction and optionally max_new_tokens, attend_document, parser, bridge and one "
                    "constraint (choices, regex or json_schema) (docs/tasks.md); default: hashtags.")
    modes: list[Mode] = Field(default_factory=lambda: ["sidecar", "standalone"],
                              description="sidecar (document evicted), sidecar_attended, standalone.")
    db_path: str = Field("data/sidecar.duckdb", description="The results database.")
    lock_wait_s: float = Field(
        600.0, ge=0, le=86_400,
        description="How long each database transaction waits while another process (a notebook, the judge) "
                    "holds the file before the run gives up; finished documents are then kept beside the file "
                    "for its next open to commit.")
    run_wait_s: float = Field(
        0.0, ge=0, le=86_400,
        description="How long to wait while another process runs the same run id (0: refuse at once); then "
                    "this run resumes it.")
    device_wait_s: float | None = Field(
        None, ge=0, description="How long to wait while another run holds the accelerator (None: as long "
                                "as it takes; 0: refuse at once).")
    run_id: str | None = Field(
        None, description="Resume or name a run: letters, digits, '.', '_' and '-' (a name, never a path); "
                          "default: derived from these parameters and the scheduled date.")
    trigger_judge: bool = Field(True, description="Run `judge` afterwards (direct runs; deployments use triggers).")
    trigger_cost_report: bool = Field(True, description="Run `cost-report` afterwards (direct runs only).")
    workers: int = Field(
        1, ge=1, le=1024,
        description="Shard processes on this machine at once: one per GPU, or on a CPU each with its share of the "
                    "cores. 1 (and no shard_deployment): the run in this process, as one shard.")
    shards: int | None = Field(
        None, ge=1, le=100_000,
        description="Shards the run's documents are cut into, balanced by tokens (default: workers).")
    results_uri: str | None = Field(
        None, min_length=1,
        description="Where shards write their part files: a directory, a shared mount or a URI pyarrow opens "
                    "(default: beside the database, `<db_path>.runs/parts`).")
    shard_retries: int = Field(2, ge=0, le=100,
                               description="Relaunches per shard after a failed, crashed or stalled attempt.")
    shard_stall_s: float = Field(
        3600.0, gt=0, le=7 * 86_400,
        description="An attempt with no new part and no state change for this long is cancelled and relaunched.")
    shard_deployment: str | None = Field(
        None, min_length=1,
        description="Launch shards as flow runs of this deployment (e.g. nightly-shard/nightly-shard) on a work "
                    "pool; default: local shard processes.")

    @field_validator("sidecar_tasks")
    @classmethod
    def _named_tasks(cls, tasks: list[SidecarTask]) -> list[SidecarTask]:
        # sidecar_outputs stores one output per (document, mode, task): each task needs its own name
        names = [t.name for t in tasks]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"give at least one sidecar task, each with its own name, got {names}")
        return tasks

    @field_validator("run_id")
    @classmethod
    def _plain_run_id(cls, run_id: str | None) -> str | None:
        return None if run_id is None else check_run_id(run_id)

    @field_validator("modes")
    @classmethod
    def _distinct_modes(cls, modes: list[Mode]) -> list[Mode]:
        if not modes:
            raise ValueError("give at least one mode")
        return list(dict.fromkeys(modes))

    def sharded(self) -> bool:
        """Whether the run is cut into shards run elsewhere (processes, a work pool) that write part files;
        otherwise this process runs it and commits to the database itself."""
        return self.workers > 1 or (self.shards or 1) > 1 or self.shard_deployment is not None

    def shard_count(self) -> int:
        return self.shards or self.workers

    def settings(self) -> BatchSettings:
        return BatchSettings(tuple(self.sidecar_tasks), tuple(self.modes), self.max_new_tokens, self.instruction,
                             self.system or None)

    def decisive(self) -> dict[str, object]:
        """The fields that decide what a run computes: all but :data:`NOT_DECISIVE`."""
        return self.model_dump(mode="json", exclude=set(NOT_DECISIVE))

    def resume_identity(self) -> dict[str, object]:
        """What a resume of the run must repeat besides what storage checks itself
        (:data:`PROVEN_BY_STORAGE`): the id, text and title columns and ``max_chars`` (which rows are
        usable), and ``max_new_tokens``, the ``instruction`` and ``system`` prompts and the sidecar tasks
        (the outputs)."""
        return {k: v for k, v in self.decisive().items() if k not in PROVEN_BY_STORAGE}

    def resolved_run_id(self, day: datetime) -> str:
        """``run_id``, else ``nightly-YYYYMMDD-<hash of the decisive fields>``: a rerun of the same night
        with the same parameters gets the same id and resumes."""
        if self.run_id:
            return self.run_id
        digest = hashlib.sha256(json.dumps(self.decisive(), sort_keys=True).encode()).hexdigest()[:10]
        return f"nightly-{day:%Y%m%d}-{digest}"
