"""How the parent starts a shard attempt, wherever it runs: one protocol for every launcher.

A launcher turns a :class:`ShardLaunch` into a running ``nightly-shard`` flow run (a local process,
``flows.shard_processes``; a deployment's flow run on a work pool, ``flows.shard_deployments``) and hands back
a :class:`ShardHandle` the parent polls. Invariant: a handle's status moves from ``queued`` (waiting for a
worker of its pool; a local process is never queued) to ``running`` to one final status, and stays there;
``completed`` means the attempt wrote every document of its manifest to parts.
"""

from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol

ShardStatus = Literal["queued", "running", "completed", "failed", "crashed"]
FINAL_STATUSES: frozenset[ShardStatus] = frozenset({"completed", "failed", "crashed"})


def new_launch_id(shard: int, attempt: int) -> str:
    """A globally unique name for one attempt: a parent rerun restarts attempt numbers, the uuid keeps the
    attempt's part files apart from those of an earlier parent's attempt of the same number."""
    return f"s{shard:04d}-a{attempt:02d}-{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class ShardLaunch:
    """One attempt of one shard: what the ``nightly-shard`` flow gets as its (JSON) parameters. Its
    documents are in the manifest the parent wrote under ``results_uri`` for ``launch_id``."""

    run_id: str
    launch_id: str
    shard: int
    attempt: int
    results_uri: str
    # NightlyParams as a JSON dict
    params: dict[str, Any] = field(default_factory=dict)

    def parameters(self) -> dict[str, Any]:
        """The shard flow's parameters."""
        return asdict(self)


class ShardHandle(Protocol):
    """A launched attempt, as the parent sees it."""

    @property
    def flow_run_id(self) -> str | None:
        """The attempt's flow run, once the launcher knows it."""
        ...

    def status(self) -> ShardStatus: ...

    def cancel(self) -> None:
        """Stop the attempt (a stalled one); its visible parts stay valid."""
        ...


class ShardLauncher(Protocol):
    def launch(self, launch: ShardLaunch) -> ShardHandle: ...

    def wait(self, timeout_s: float) -> None:
        """Return after ``timeout_s``, or sooner when the launcher sees one of its attempts end."""
        ...
