"""Progress of a long engine call, for a progress bar: ``on_progress(phase, done, total)``.

The engine calls it between forwards with Python counters it already holds, so reporting costs no
device sync. A phase starts with its first report (``done`` 0, or the tokens already committed), ``done``
only grows within it, and it ends with ``done == total``.
"""

from __future__ import annotations

from collections.abc import Callable

ProgressCallback = Callable[[str, int, int], None]

TARGET_PREFILL = "target prefill"  # prompts fed to the target, in rows
DRAFT_PREFILL = "draft prefill"  # prompts fed to the draft (with the hidden sidecar instructions), in rows
DECODE = "decode"  # main-output tokens committed, of the rows' token limits
SIDECAR_TASKS = "sidecar tasks"  # sidecar outputs written by the draft, in rows
STANDALONE = "standalone"  # standalone tagger outputs, in rows
