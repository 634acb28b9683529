"""One run at a time on an accelerator: its OS lock on this machine, and on a Prefect server a slot of
the global concurrency limit named by ``$SIDECAR_GPU_LIMIT`` (default ``gpu``).

The lock is a file per physical device (``sidecar.models.devices.accelerator_id``: a CUDA device, or ``cpu``) in
``$SIDECAR_LOCK_DIR`` (default ``~/.cache/sidecar/locks``); the kernel drops it when its process ends,
however it ends. It keeps runs on one machine apart also on the embedded API, where the ``gpu`` limit
does not exist and, created, would be seen by this process alone. The limit keeps apart the runs of a
Prefect server's workers on several machines. A pool of several GPUs has one limit per GPU: the worker
pinned to GPU ``i`` of ``host`` sets ``SIDECAR_GPU_LIMIT=gpu-<host>-<i>`` for its flow runs
(``infra/gpu-workers.sh``), so two runs wait for each other only when they would share a device. Create
each limit once per server (``infra/setup-pool.sh``; without it, runs do not wait for each other there)::

    prefect gcl create gpu-host1-0 --limit 1

The slot is taken first, so a run waiting for it holds no device. It is a lease the run renews while it
lives: a run killed outright (SIGKILL, a lost machine) cannot release it, and the server revokes it once it
is not renewed for ``LEASE_S``, so a relaunch on the same GPU waits that long at most.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from prefect import get_run_logger
from prefect.concurrency.sync import concurrency

from flows.embedded import on_embedded_api
from sidecar.models.devices import accelerator_id
from sidecar.settings import Settings, lock_dir
from storage.errors import LockHolder
from storage.locks import exclusive

# the shortest lease the Prefect API grants (its default, 300 s, would idle a GPU 5 minutes after a crash)
LEASE_S = 60.0


def gpu_limit() -> str:
    """The global concurrency limit a run holds a slot of while its pair is loaded: ``$SIDECAR_GPU_LIMIT``,
    default ``gpu``."""
    return Settings().gpu_limit


def accelerator_lock(device: str) -> Path:
    """The lock file of accelerator ``device`` (an ``accelerator_id``)."""
    return lock_dir() / f"accelerator-{device}.lock"


@contextlib.contextmanager
def holding_accelerator(what: str, wait_s: float | None) -> Iterator[str]:
    """Hold the accelerator a pair loaded here would use, for ``what`` (a run, a judge); yields its id.

    Another process holding the device makes this one wait up to ``wait_s`` seconds (None: as long as it
    takes; 0: refuse at once), logging who holds it, then raise ``storage.LockHeldError``.
    """
    logger = get_run_logger()
    device = accelerator_id()
    with contextlib.ExitStack() as stack:
        if not on_embedded_api():
            limit = gpu_limit()
            logger.info("%s: taking a slot of the %r concurrency limit (waits while other runs hold it)", what, limit)
            stack.enter_context(concurrency(limit, occupy=1, lease_duration=LEASE_S))

        def waiting(holder: LockHolder, waited_s: float) -> None:
            limit = "as long as it takes" if wait_s is None else f"up to {wait_s:.0f} s"
            logger.warning("%s: accelerator %s is in use by %s; waited %.0f s, waiting %s", what, device,
                           holder.describe(), waited_s, limit)

        stack.enter_context(exclusive(accelerator_lock(device), f"accelerator {device}", wait_s, waiting))
        logger.info("%s: holding accelerator %s", what, device)
        yield device
