"""When a start under an existing run id is a resume of that run; checked inside the start's transaction.

A run's rows only mean something together: outputs are keyed by document id, documents by input row, and
the views read one pair, gamma and set of modes per run. A start under an existing run id is therefore
taken as a resume only when it proves to be the same run, and is refused with :class:`RunMismatchError`
otherwise, before anything is written:

- the run's own columns that the views read once per run are the same: ``pair`` and ``gamma`` (each
  throughput and cost row of the run is reported under them) and the set of ``modes`` (``results`` shows a
  document once every mode is written);
- the ``identity`` the caller declares, what else decides the outputs (the nightly flow's task, prompts
  and token limits), is equal as JSON;
- every input row the run stored comes again with the same id, title and text. Rows may be added (a
  larger limit extends the run), none may be left out or replaced.

What does not decide the outputs may change: the batch size, the device and GPU type (each request-stats
row names where it ran, and the views report it there, so a run started in-process on one GPU may be
resumed as shards on others, or the other way round), the corpus's path (its rows are compared instead),
``params`` (kept as the run's first start recorded them) and the code version (a resume after a fix is what
resuming is for).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import duckdb
import pyarrow as pa

from storage.errors import RunMismatchError

# the columns of `runs` a resume must repeat
RUN_COLUMNS = ("pair", "gamma", "modes")
_SHOWN_CHARS = 60
_PROPOSED = "proposed_documents"
_NEW_RUN = "use another run id for a new run"


def canonical_identity(identity: Mapping[str, Any] | None) -> str | None:
    """``identity`` as the JSON text stored in ``runs.identity``; values JSON cannot hold become ``str()``."""
    return None if identity is None else json.dumps(identity, sort_keys=True, default=str)


def _first_row(cursor: duckdb.DuckDBPyConnection) -> tuple[Any, ...] | None:
    # fetched to the end: a half-read result blocks the connection's next statement
    rows = cursor.fetchall()
    return rows[0] if rows else None


def _show(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "..."


def _names(value: Any) -> list[str] | None:
    """The names of a list of named settings (the sidecar tasks), else None."""
    if isinstance(value, list) and value and all(isinstance(v, dict) and "name" in v for v in value):
        return [str(v["name"]) for v in value]
    return None


def _named_difference(key: str, before: list[dict[str, Any]], now: list[dict[str, Any]]) -> str:
    """How two lists of named settings differ, by name: another list of names, or the fields one of them
    changed (a JSON dump of whole task lists would be cut off before the difference)."""
    names_before, names_now = _names(before), _names(now)
    if names_before != names_now:
        return f"{key} {', '.join(names_before or [])} (this start: {', '.join(names_now or [])})"
    changed = [f"{b['name']}.{field}" for b, n in zip(before, now, strict=True)
               for field in sorted(set(b) | set(n)) if b.get(field) != n.get(field)]
    return f"{key} differ in {', '.join(changed)}"


def _differences(stored: Mapping[str, Any], wanted: Mapping[str, Any], missing: str) -> list[str]:
    """``key stored (this start: wanted)`` for each key whose values differ; ``missing`` shows an absent one.
    Lists of named settings (the sidecar tasks) are told apart by their names, or by the fields that differ."""
    absent = object()
    found = []
    for key in sorted(set(stored) | set(wanted)):
        before, now = stored.get(key, absent), wanted.get(key, absent)
        if before != now and _names(before) is not None and _names(now) is not None:
            found.append(_named_difference(key, before, now))
        elif before != now:
            shown_before = missing if before is absent else _show(before)
            shown_now = missing if now is absent else _show(now)
            found.append(f"{key} {shown_before} (this start: {shown_now})")
    return found


def check_same_run(con: duckdb.DuckDBPyConnection, run_id: str, columns: Mapping[str, Any],
                   identity_json: str | None) -> bool:
    """False when ``run_id`` does not exist, True when it exists with these ``columns`` (:data:`RUN_COLUMNS`)
    and identity; raises :class:`RunMismatchError`, naming each difference, otherwise."""
    row = _first_row(con.execute(f"SELECT {', '.join(RUN_COLUMNS)}, identity FROM runs WHERE run_id = ?", [run_id]))
    if row is None:
        return False
    stored = dict(zip(RUN_COLUMNS, row[:-1], strict=True))
    # the modes are a set: their order changes nothing that is stored
    stored["modes"], wanted = sorted(set(stored["modes"])), {**columns, "modes": sorted(set(columns["modes"]))}
    differences = _differences(stored, wanted, missing="not given")
    stored_identity = json.loads(row[-1]) if row[-1] is not None else {}
    wanted_identity = json.loads(identity_json) if identity_json is not None else {}
    differences += _differences(stored_identity, wanted_identity, missing="not recorded")
    if differences:
        raise RunMismatchError(f"run {run_id!r} exists with other settings: {'; '.join(differences)}. A resume "
                               f"must repeat them; {_NEW_RUN}")
    return True


def check_same_documents(con: duckdb.DuckDBPyConnection, run_id: str, rows: pa.Table | duckdb.DuckDBPyRelation,
                         whole_input: bool) -> None:
    """Refuse ``rows`` (``documents`` rows about to be written) that put another document on a stored row:
    another id, title or text. With ``whole_input`` (the start of a run, which writes every input row) the
    stored rows must also all come again."""
    con.register(_PROPOSED, rows)
    changed = _first_row(con.execute(
        f"SELECT s.row_index, s.doc_id, p.doc_id, count(*) OVER () FROM documents AS s "
        f"JOIN {_PROPOSED} AS p ON p.row_index = s.row_index WHERE s.run_id = ? AND "
        f"(s.doc_id IS DISTINCT FROM p.doc_id OR s.title IS DISTINCT FROM p.title OR s.text IS DISTINCT FROM p.text) "
        f"ORDER BY s.row_index LIMIT 1", [run_id]))
    if changed is not None:
        row_index, stored_id, proposed_id, n = changed
        what = (f"row {row_index} is {stored_id!r} there and {proposed_id!r} here" if stored_id != proposed_id
                else f"row {row_index} ({stored_id!r}) has other content (title or text) here")
        raise RunMismatchError(f"run {run_id!r} stored other input rows: {what}; {n} rows differ. A resume must "
                               f"read the same corpus; {_NEW_RUN}")
    if not whole_input:
        return
    [(n, first)] = con.execute(
        f"SELECT count(*), min(row_index) FROM documents AS s WHERE s.run_id = ? "
        f"AND NOT EXISTS (SELECT 1 FROM {_PROPOSED} AS p WHERE p.row_index = s.row_index)", [run_id]).fetchall()
    if n:
        raise RunMismatchError(f"run {run_id!r} has {n} stored input rows this start does not read (the first: row "
                               f"{first}). A resume must read every row the run stored (the same corpus, no "
                               f"smaller limit); {_NEW_RUN}")


def check_unique_ids(con: duckdb.DuckDBPyConnection, run_id: str) -> None:
    """Refuse a write after which two usable rows of the run share a document id (the key of its outputs)."""
    repeated = _first_row(con.execute(
        "SELECT doc_id, list(row_index ORDER BY row_index) FROM documents WHERE run_id = ? AND status = 'ok' "
        "GROUP BY doc_id HAVING count(*) > 1 ORDER BY min(row_index) LIMIT 1", [run_id]))
    if repeated is not None:
        doc_id, rows = repeated
        raise ValueError(f"run {run_id!r} would have usable documents with the same id {doc_id!r} on rows "
                         f"{', '.join(map(str, rows))}; a document id must be unique in its run")
