"""The memory part (CUDA): ``torch.cuda.max_memory_allocated`` of the engine and of HF generate at the largest batch."""

from __future__ import annotations

import torch

from bench.gpu_check.check import NO_CUDA, Check
from bench.gpu_check.deadline import Deadline
from sidecar.runtime.pools import release_free


def memory(check: Check, deadline: Deadline) -> dict:
    if not check.cuda:
        return {"skipped": NO_CUDA}
    batch = max(int(b) for b in check.args.batches.split(","))
    prompts = check.prompts[:batch]
    release_free()  # KV caches kept from earlier parts' batches are neither weights nor this run's
    weights = torch.cuda.memory_allocated(check.pair.device) / 2**30
    result = {"batch": batch, "max_new_tokens": check.args.max_new_tokens, "weights_gb": weights}
    for name, run in (("engine_static", lambda: check.timed_engine(prompts, batch)),
                      ("hf_plain", lambda: check.timed_hf_plain(prompts))):
        if reason := deadline.skip_reason():
            result[name] = reason
            continue
        release_free()  # each run's peak counts the KV caches it allocates, none kept from the run before
        try:
            result[f"{name}_peak_gb"] = run()["peak_gb"]
        except torch.cuda.OutOfMemoryError as exc:
            torch.cuda.empty_cache()
            result[name] = f"out of memory: {str(exc).splitlines()[0][:160]}"
    return result
