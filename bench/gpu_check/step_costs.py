"""The step-cost part: ms per forward of random-initialised Qwen2.5-7B and 1.5B, a table the cost model loads
(``study.cost.step_costs``) as a measured calibration in place of the roofline.

Each model is built from its published config (``study.cost.workload``) with random weights, in bf16 (or
``--dtype``) on the check's device: a forward's time depends on the shapes, not the values, so nothing is read
from disk. The timed forwards are the engine's own in ``eager`` mode (``sidecar.runtime.forward`` through our
decoder stack, ``sidecar.runtime.capture.attach``, over a ``RowKVCache``; the table names the mode, whose host
time per forward is in every time): a cache of the largest batch is filled to ``--step-cost-context`` tokens per
row, then at each batch (the cache's first rows) it times

- a draft step: one token per row, its logits at that token (the engine's draft forward);
- a verify at each gamma from 0 to ``--gamma``: gamma + 1 tokens per row, logits at every one (``_verify``).

Nothing is committed, so every timed forward writes the same columns over the same context. A time is the
median of ``REPEATS`` forwards after ``WARMUP``: CUDA events on CUDA, ``perf_counter`` elsewhere (a CPU forward
returns when done). Only the forwards are timed: sampling and acceptance are not in the rows.

``--step-costs full`` (the default on CUDA) builds the real shapes; ``small`` (the default elsewhere: a 7B
does not fit a test machine's time) the same architecture at ``SMALL`` sizes, which runs this code path and
says nothing about real speeds; ``off`` skips the part. Each model gets an equal share of the part's time; a
measurement that would end past it (the last one of the model, scaled by the tokens it feeds) is skipped and
says so, as is a model that runs out of device memory (a smaller GPU than the check is for); the other still runs.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, Qwen2Config

from bench.gpu_check.deadline import Deadline
from sidecar.models.attention import GROUPED_SDPA
from sidecar.runtime.capture import attach
from sidecar.runtime.forward import forward, logits_at
from sidecar.runtime.kv_cache import RowKVCache
from study.cost.workload import QWEN2_5_1_5B_CONFIG, QWEN2_5_7B_CONFIG

# the capture mode the forwards run in: a captured mode would compile each of the table's shapes
CAPTURE = "eager"
# the names the table and ``study.cost.step_costs`` give the models
MODELS = {"7b": QWEN2_5_7B_CONFIG, "1.5b": QWEN2_5_1_5B_CONFIG}
# the sizes ``--step-costs small`` puts in place of the real ones: the code path on a CPU in seconds
SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 128, "vocab_size": 512}
STEP_COST_SCALES = ("full", "small", "off")
WARMUP = 2
REPEATS = 5
# rows fed per prefill forward while the cache fills: bounds the activations of a 7B at batch 64
PREFILL_ROWS = 8


def build_model(config: dict, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
    """A Qwen2 causal LM of ``config``'s shapes with random weights, on ``device`` in ``dtype``."""
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**config, attn_implementation=GROUPED_SDPA),
                                                 dtype=dtype)
    return model.eval()


def fill_cache(model: PreTrainedModel, batch: int, context: int, extra: int) -> RowKVCache:
    """A cache of ``batch`` rows, each holding ``context`` random tokens, with room for ``extra`` more."""
    cache = RowKVCache(model, batch, context + extra)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(model.config.vocab_size, (batch, context), generator=generator)
    for start in range(0, batch, PREFILL_ROWS):
        rows = cache.rows_view(start, min(start + PREFILL_ROWS, batch))
        forward(model, rows, ids[start:start + PREFILL_ROWS].to(cache.device))
        rows.commit(context)
    return cache


def median_ms(run: Callable[[], object], cuda: bool) -> float:
    """Median ms of ``REPEATS`` calls of ``run`` after ``WARMUP``: CUDA events on CUDA, else wall time."""
    for _ in range(WARMUP):
        run()
    times = []
    if cuda:
        torch.cuda.synchronize()
    for _ in range(REPEATS):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            run()
            times.append((time.perf_counter() - began) * 1000)
    return statistics.median(times)


def step(model: PreTrainedModel, cache: RowKVCache, tokens: int, logits: int) -> Callable[[], torch.Tensor]:
    """One forward of ``tokens`` tokens per row of ``cache``, with logits at the first ``logits`` of them."""
    batch, device = cache.batch_size, cache.device
    ids = torch.randint(model.config.vocab_size, (batch, tokens), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    index = torch.arange(logits, device=device)[None, :].expand(batch, -1)
    return lambda: logits_at(model, forward(model, cache, ids), index)


def model_rows(name: str, model: PreTrainedModel, batches: list[int], gammas: list[int], context: int,
               deadline: Deadline) -> list[dict]:
    """The draft step and a verify per gamma at each batch, timed on one model."""
    cache = fill_cache(model, max(batches), context, max(gammas) + 1)
    cuda = cache.device.type == "cuda"
    last: tuple[int, float] | None = None  # (tokens fed in all, ms) of the latest forward timed
    rows = []
    for batch in batches:
        view = cache.rows_view(0, batch)
        kinds = [("draft", None, 1, 1)] + [("verify", g, g + 1, g + 1) for g in gammas]
        for kind, gamma, tokens, logits in kinds:
            row: dict = {"model": name, "kind": kind, "gamma": gamma, "tokens": tokens, "batch": batch}
            # a forward's time grows at most linearly with the tokens it feeds: the latest one bounds the next
            estimate = 0.0 if last is None else last[1] * batch * tokens / last[0] * (WARMUP + REPEATS) / 1000
            if reason := deadline.skip_reason(estimate):
                row["skipped"] = reason
            else:
                row["ms"] = median_ms(step(model, view, tokens, logits), cuda)
                last = (batch * tokens, row["ms"])
            rows.append(row)
    return rows


def step_costs(scale: str, batches: list[int], max_gamma: int, context: int, device: torch.device,
               dtype: torch.dtype, deadline: Deadline) -> dict:
    """Every model's rows at ``scale`` (``full`` or ``small``), each model within its share of ``deadline``."""
    gammas = list(range(max_gamma + 1))
    rows: list[dict] = []
    skipped: dict[str, str] = {}
    for i, (name, config) in enumerate(MODELS.items()):
        if reason := deadline.skip_reason():
            skipped[name] = reason
            continue
        share = deadline.share(1 / (len(MODELS) - i))
        began = time.monotonic()
        try:
            model = build_model(config | SMALL if scale == "small" else config, device, dtype)
            attach(model, CAPTURE)
            with torch.inference_mode():
                rows += model_rows(name, model, batches, gammas, context, share)
            del model
        except torch.cuda.OutOfMemoryError as exc:  # a smaller GPU than the check is for: a limit, not a fault
            skipped[name] = f"skipped: out of memory ({str(exc).splitlines()[0][:200]})"
        print(f"step costs {name}: {time.monotonic() - began:.0f} s", flush=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"scale": scale, "context": context, "dtype": str(dtype).removeprefix("torch."),
            "timer": "CUDA events" if device.type == "cuda" else "perf_counter", "warmup": WARMUP,
            "repeats": REPEATS, "capture": CAPTURE,
            "forward": f"sidecar.runtime.forward ({CAPTURE}: our decoder stack) over a RowKVCache", "rows": rows,
            "skipped_models": skipped}
