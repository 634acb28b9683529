"""How the engine is fed prompts: each schedule decodes a list of prompts at a batch size.

Every part that times the engine (memory, throughput) goes through ``ENGINE_SCHEDULES``; the throughput part
times every entry at every batch size.
"""

from __future__ import annotations

from collections.abc import Callable

from sidecar.decoding.decoder import SpeculativeDecoder
from sidecar.decoding.rows import GenerationOutput


def static_batches(decoder: SpeculativeDecoder, prompts: list[list[int]], max_new: int,
                   batch: int) -> list[GenerationOutput]:
    """Fixed chunks of ``batch`` prompts, each decoded until its last row finishes."""
    return decoder.generate(prompts, max_new_tokens=max_new, batch_size=batch, schedule="static")


def continuous_batch(decoder: SpeculativeDecoder, prompts: list[list[int]], max_new: int,
                     batch: int) -> list[GenerationOutput]:
    """Up to ``batch`` rows at a time, a waiting prompt joining as soon as a row finishes."""
    return decoder.generate(prompts, max_new_tokens=max_new, batch_size=batch, schedule="continuous")


EngineSchedule = Callable[[SpeculativeDecoder, list[list[int]], int, int], list[GenerationOutput]]
ENGINE_SCHEDULES: dict[str, EngineSchedule] = {"static": static_batches, "continuous": continuous_batch}
