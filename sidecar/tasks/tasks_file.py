"""Sidecar tasks from a file: a YAML (``.yaml``, ``.yml``) or JSON (``.json``) list of tasks, each a mapping
of :class:`SidecarTask`'s fields (docs/tasks.md). An error names the file, the task (1-based, with its name
when it has one) and the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from sidecar.errors import InputError
from sidecar.tasks.task import SidecarTask

FORMATS = {".yaml": "YAML", ".yml": "YAML", ".json": "JSON"}


def _parse(path: Path) -> Any:
    kind = FORMATS.get(path.suffix.lower())
    if kind is None:
        raise InputError(f"tasks file {path}: give a .yaml, .yml or .json file, not {path.suffix or 'no extension'}")
    text = path.read_text(encoding="utf-8")
    try:
        return json.loads(text) if kind == "JSON" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise InputError(f"tasks file {path} is not valid {kind}: {' '.join(str(exc).split())}") from None


def _field_error(error: Any) -> str:
    field = ".".join(str(part) for part in error["loc"])
    if error["type"] == "extra_forbidden":
        return f"unknown field {field!r} (a task's fields: {', '.join(SidecarTask.model_fields)})"
    if error["type"] == "missing":
        return f"field {field!r} is missing"
    return f"field {field!r}: {error['msg']}"


def load_tasks(path: str | Path) -> list[SidecarTask]:
    """The tasks in ``path``, in order; :class:`InputError` (``FileNotFoundError`` for a missing file) naming
    the file, the task and the field for anything else."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tasks file {path} does not exist")
    data = _parse(path)
    if not isinstance(data, list) or not data:
        raise InputError(f"tasks file {path}: expected a non-empty list of tasks, got {type(data).__name__}")
    tasks: list[SidecarTask] = []
    for number, item in enumerate(data, start=1):
        where = f"tasks file {path}: task {number} of {len(data)}"
        if not isinstance(item, dict):
            raise InputError(f"{where}: expected a mapping of fields, got {type(item).__name__}")
        if isinstance(item.get("name"), str):
            where += f" ({item['name']!r})"
        try:
            tasks.append(SidecarTask.model_validate(item))
        except ValidationError as exc:
            raise InputError(f"{where}: {'; '.join(_field_error(e) for e in exc.errors())}") from None
    names = [task.name for task in tasks]
    for number, name in enumerate(names, start=1):
        if names.index(name) + 1 != number:
            raise InputError(f"tasks file {path}: tasks {names.index(name) + 1} and {number} are both named "
                             f"{name!r}; a task's name names its output")
    return tasks
