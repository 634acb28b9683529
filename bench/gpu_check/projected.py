"""The cost model's projection beside each capture-mode row: what ``study.cost`` says that decoding takes on this
GPU, so that the first run on a GPU tells how far the cost report's projections are from a measurement.

Per row, over the decode phase's mean context per row (the prompt and half the new tokens), with the pair's
shapes in the check's dtype, each forward paying the host floor of the row's mode
(``study.cost.host_floor``'s default result: this check's own where its host-floor part wrote one on the GPU,
else the committed one; at the row's batch: eager's for eager, the captured one for cudagraph; the cost model has
no compile mode, so a compile row is not projected):

* plain, and the engine's plain: ``batch`` tokens per one-token target forward
  (``study.cost.roofline.decode_step_seconds``), its floor a plain engine step's (``HostFloor.plain``); the part's
  plain loop does no step work around its forwards, so its measured / projected may exceed 1 by that work;
* speculative: ``speculation_vs_plain`` at the row's measured acceptance and the check's gamma.

An eager row is projected in both readings of its host cost (``HostFloor.overlapped``): added to the device's time
(``projected_tokens_per_s``, as the cost report projects) and overlapping it (``projected_overlapped_tokens_per_s``:
a forward takes the larger of the two). Measured between them, or nearer one, says which reading the GPU follows.

The check projects the capture part's rows after its host-floor part (``with_projection``).
``measured / projected`` above 1: the GPU ran faster than projected. Nothing is projected on a device the GPU
catalog does not list (a CPU rehearsal), or without a host-overhead result; the part says why.
"""

from __future__ import annotations

import torch

from bench.gpu_check.capture_modes import ENGINE_PLAIN, FULL_PAIRS, SMALL_PAIR
from study.cost.catalog import GPU, find_gpu, load_catalog
from study.cost.errors import CostInputError
from study.cost.facts import ModelFacts
from study.cost.host_floor import HostFloor, HostFloors, load_host_floors
from study.cost.roofline import decode_step_seconds
from study.cost.speculation import speculation_vs_plain
from study.cost.workload import qwen2_facts

# the check's capture modes the cost model projects, by the name it gives them
MODE_CAPTURE = {"eager": "eager", "cudagraph": "captured"}


def row_seconds_per_token(row: dict, target: ModelFacts, draft: ModelFacts, gpu: GPU, context: float, gamma: int,
                          host: HostFloor) -> float:
    """The projected seconds per token of each of the row's rows, each forward paying ``host``'s floor."""
    if row["decoding"] in ("plain", ENGINE_PLAIN):
        return decode_step_seconds(target, gpu, row["batch"], context, host)
    return speculation_vs_plain(target, draft, gpu, row["batch"], context, row["acceptance"], host,
                                gamma).speculative_s_per_token


def projected(table: list[dict], configs: tuple[dict, dict], dtype_bytes: int, gpu: GPU | None, context: float,
              gamma: int, floors: HostFloors | None = None) -> tuple[list[dict], dict]:
    """``table``'s rows, each measured row of a projected mode with ``projected_tokens_per_s`` and
    ``vs_projected``; and what the projection assumed (the floors' labels), or why nothing was projected.
    ``configs``: the target's and the draft's; ``floors``: default ``study.cost.host_floor``'s."""
    if gpu is None:
        return table, {"skipped": "the device is not in the GPU catalog (study/cost/gpus.json)"}
    try:
        floors = floors or load_host_floors()
    except CostInputError as exc:
        return table, {"skipped": str(exc)}
    target, draft = (qwen2_facts(config, dtype_bytes) for config in configs)
    rows = []
    for row in table:
        if "tokens_per_s" in row and row["mode"] in MODE_CAPTURE:
            host = floors.of(MODE_CAPTURE[row["mode"]])
            tokens_per_s = row["batch"] / row_seconds_per_token(row, target, draft, gpu, context, gamma, host)
            row = row | {"projected_tokens_per_s": tokens_per_s, "vs_projected": row["tokens_per_s"] / tokens_per_s}
            if row["mode"] == "eager":  # the other reading of its host cost: overlapping the device
                overlapped = row["batch"] / row_seconds_per_token(row, target, draft, gpu, context, gamma,
                                                                  host.overlapping())
                row |= {"projected_overlapped_tokens_per_s": overlapped,
                        "vs_projected_overlapped": row["tokens_per_s"] / overlapped}
        rows.append(row)
    return rows, {"gpu": gpu.name, "context": context,
                  "floors": {capture: floors.of(capture).label for capture in MODE_CAPTURE.values()}}


def with_projection(capture: dict, floors: HostFloors | None = None) -> dict:
    """The capture-mode part's result with the projection of each row (``projected``) on the GPU it ran on, over
    the decode phase's mean context: the prompt and half the new tokens per row."""
    if "rows" not in capture:
        return capture
    configs = (FULL_PAIRS | SMALL_PAIR)[capture["pair"]]
    gpu = None if capture.get("catalog_gpu") is None else find_gpu(capture["catalog_gpu"], load_catalog())
    rows, projection = projected(capture["rows"], configs, getattr(torch, capture["dtype"]).itemsize, gpu,
                                 capture["prompt_tokens"] + capture["new_tokens"] / 2, capture["gamma"], floors)
    return capture | {"rows": rows, "projection": projection}
