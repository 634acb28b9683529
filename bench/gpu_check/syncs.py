"""The syncs part: device-to-host synchronisations of one engine decode, per target forward and by source line,
next to HF generate's per step; and ``SyncCounter``, which counts them on CUDA.

On CUDA the driver says where the host waited (``SyncCounter``); on another device nothing waits, so the torch
calls that would wait on a GPU are counted instead (``sidecar.runtime.syncs.SyncCounter``, what tests/test_syncs.py
counts). The budget is one synchronisation per target forward (the prefill's included) plus one per draft forward,
whatever the batch: a decode over it fails the check.
"""

from __future__ import annotations

import sys
import warnings
from collections import Counter
from pathlib import Path

import torch

from bench.common import REPO
from bench.gpu_check.check import Check
from bench.gpu_check.deadline import Deadline
from bench.hf_baselines import hf_plain_batched
from sidecar.runtime.syncs import SyncCounter as CallCounter

SYNC_WARNING = "synchronizing CUDA operation"  # what set_sync_debug_mode("warn") says at each sync


def source_line(filename: str, lineno: int) -> str:
    """``path:line``, the path relative to the repository (or its last two parts outside it)."""
    path = Path(filename)
    where = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else "/".join(path.parts[-2:])
    return f"{where}:{lineno}"


class SyncCounter:
    """Counts device-to-host synchronisations inside ``with``, per source line: the implicit ones (``.item()``,
    ``.tolist()``, ``int(tensor)``...) from ``torch.cuda.set_sync_debug_mode("warn")``'s warnings, and explicit
    ``torch.cuda.synchronize()`` calls, which that mode does not report, at the line that asked for them (not in
    a ``synchronize`` helper). The stopwatches of bench/ are left out."""

    def __enter__(self) -> SyncCounter:
        self.sites: Counter = Counter()
        self._warnings = warnings.catch_warnings(record=True)
        self._caught = self._warnings.__enter__()
        warnings.simplefilter("always")  # the same line warns every time, not once
        self._synchronize = torch.cuda.synchronize

        def counted(*args, **kwargs):
            caller = sys._getframe(1)
            while caller.f_back is not None and caller.f_code.co_name == "synchronize":  # helpers that wrap it
                caller = caller.f_back
            where = source_line(caller.f_code.co_filename, caller.f_lineno)
            if not where.startswith("bench/"):  # the check's own stopwatches are not the code measured
                self.sites[where + " synchronize()"] += 1
            return self._synchronize(*args, **kwargs)

        torch.cuda.synchronize = counted
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize = self._synchronize
        self._warnings.__exit__(*exc)
        for w in self._caught:
            if SYNC_WARNING in str(w.message):
                self.sites[source_line(w.filename, w.lineno)] += 1
            else:  # not ours to swallow
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)

    @property
    def count(self) -> int:
        return sum(self.sites.values())


def over_budget(run: dict) -> str | None:
    """Why a run's decode waited for the device more than its budget allows, or None when it did not."""
    if run.get("within_budget", True):
        return None
    return (f"batch {run['batch']}: {run['syncs']} syncs, over the budget of {run['budget']} (target forwards "
            f"{run['target_forwards']} + draft forwards {run['draft_forwards']}); top sources {run['top_sites']}")


def syncs(check: Check, deadline: Deadline) -> dict:
    counter, counted_by = ((SyncCounter, "CUDA sync debug mode and torch.cuda.synchronize calls") if check.cuda else
                           (CallCounter, "torch calls that wait for a GPU (sidecar.runtime.syncs), on "
                                         f"{check.pair.device.type}"))
    batches = [int(b) for b in check.args.sync_batches.split(",") if b]
    runs = []
    for batch in batches:
        if reason := deadline.skip_reason():
            runs.append({"batch": batch, "skipped": reason})
            continue
        prompts = check.prompts[:batch]
        with counter() as engine:
            outs = check.decoder.generate(prompts, max_new_tokens=check.args.max_new_tokens, batch_size=batch)
        with counter() as hf:
            rows = hf_plain_batched(check.pair, prompts, check.args.max_new_tokens)["tokens"]
        engine_syncs, hf_syncs = sum(engine.sites.values()), sum(hf.sites.values())
        target = max(o.stats.target_forwards for o in outs)  # rows share forwards: the longest row saw all
        draft = max(o.stats.draft_forwards for o in outs)
        hf_steps = max(map(len, rows))
        runs.append({"batch": batch, "syncs": engine_syncs, "target_forwards": target, "draft_forwards": draft,
                     "syncs_per_target_forward": engine_syncs / target,
                     # the goal: one per target forward plus one per draft forward, whatever the batch
                     "budget": target + draft, "within_budget": engine_syncs <= target + draft,
                     "top_sites": dict(engine.sites.most_common(8)),
                     "hf_plain_syncs": hf_syncs, "hf_plain_steps": hf_steps,
                     "hf_plain_syncs_per_step": hf_syncs / hf_steps})
    return {"counted_by": counted_by, "runs": runs, "failed": [f for r in runs if (f := over_budget(r))]}
