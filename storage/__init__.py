"""DuckDB storage for sidecar runs; all of the project's SQL lives in this package (see README.md)."""

from storage.connection import RetryPolicy
from storage.database import (
    DEFAULT_DB_PATH,
    RESULTS_TABLE_SQL,
    Database,
    RunStart,
    current_code_version,
    default_db_path,
)
from storage.errors import (
    DatabaseLockedError,
    DatabaseOpenError,
    InputSchemaError,
    InvalidRunIdError,
    LockHeldError,
    PartRunMismatchError,
    ResultsLocationError,
    RunMismatchError,
    SchemaTooNewError,
    StorageError,
    UnknownAttemptError,
    UnknownRunError,
)
from storage.parts import IngestResult, PartStore, PartWriter, ShardInfo
from storage.records import (
    CostRecord,
    Document,
    JudgementRecord,
    JudgeSettingsRecord,
    OutputRecord,
    RanOn,
    RejectedDocument,
    RequestStats,
)
from vocab.modes import MODES, SIDECAR_MODES

__all__ = [
    "DEFAULT_DB_PATH",
    "MODES",
    "RESULTS_TABLE_SQL",
    "SIDECAR_MODES",
    "CostRecord",
    "Database",
    "DatabaseLockedError",
    "DatabaseOpenError",
    "Document",
    "IngestResult",
    "InputSchemaError",
    "InvalidRunIdError",
    "JudgeSettingsRecord",
    "JudgementRecord",
    "LockHeldError",
    "OutputRecord",
    "PartRunMismatchError",
    "PartStore",
    "PartWriter",
    "RanOn",
    "RejectedDocument",
    "RequestStats",
    "ResultsLocationError",
    "RetryPolicy",
    "RunMismatchError",
    "RunStart",
    "SchemaTooNewError",
    "ShardInfo",
    "StorageError",
    "UnknownAttemptError",
    "UnknownRunError",
    "current_code_version",
    "default_db_path",
]
