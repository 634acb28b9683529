"""Numbered SQL migrations (``storage/migrations/NNN_name.sql``) applied in one transaction at open."""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import duckdb

from storage.connection import RetryPolicy, in_transaction
from storage.errors import SchemaTooNewError

_MIGRATION_NAME = re.compile(r"^(?P<version>\d{3})_(?P<name>[a-z0-9_]+)\.sql$")

_CREATE_MIGRATIONS_TABLE = """
CREATE TABLE IF NOT EXISTS schema_migrations (
    version    INTEGER PRIMARY KEY,
    name       VARCHAR NOT NULL,
    applied_at TIMESTAMPTZ NOT NULL DEFAULT current_timestamp
)
"""


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


def known_migrations() -> list[Migration]:
    """The migrations shipped with this code, in order; numbering must run 1, 2, 3 ... without gaps."""
    found: list[Migration] = []
    for entry in (resources.files("storage") / "migrations").iterdir():
        match = _MIGRATION_NAME.match(entry.name)
        if match is None:
            continue
        found.append(Migration(int(match["version"]), match["name"], entry.read_text(encoding="utf-8")))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if versions != list(range(1, len(found) + 1)):
        raise RuntimeError(f"storage/migrations must be numbered 001, 002, ... without gaps; found {versions}")
    return found


def migrate(path: Path, retry: RetryPolicy, migrations: list[Migration] | None = None) -> int:
    """Bring the database at ``path`` up to the newest known schema; returns its schema version.

    All pending migrations and their ``schema_migrations`` rows commit together or not at all. A
    database newer than the code raises :class:`SchemaTooNewError` and is left untouched.
    """
    migrations = known_migrations() if migrations is None else migrations
    latest = migrations[-1].version if migrations else 0

    def apply(con: duckdb.DuckDBPyConnection) -> int:
        con.execute(_CREATE_MIGRATIONS_TABLE)
        [(current,)] = con.execute("SELECT coalesce(max(version), 0) FROM schema_migrations").fetchall()
        if current > latest:
            raise SchemaTooNewError(path, current, latest)
        for migration in migrations:
            if migration.version > current:
                con.execute(migration.sql)
                con.execute("INSERT INTO schema_migrations (version, name) VALUES (?, ?)",
                            [migration.version, migration.name])
        return latest

    return in_transaction(path, retry, apply)
