"""Which capture mode ``auto`` runs a pair's forwards in on a CPU, and why: eager or compiled (inductor),
whichever runs the pair's decode step faster on this machine, as the dtype is chosen (``dtype_choice``).

A compiled forward saves the host work of every layer (dispatch, Python, small ops) but attends over the cache's
whole capacity and costs a compile per shape. Which wins depends on the chip, the thread count, torch, the
model's shape and the step's (a fixed host cost saved weighs less in a wider batch's forward), so ``auto``
measures it at the shape the run will mostly use (``TimedShape``): a step's forwards at the batch bucket of the
run's batch limit (``timed_rows``: capped at ``MAX_ROWS``; ``ROWS`` where the caller names no limit) and its
gamma (a verify of gamma + 1 positions by the target and gamma one-position forwards by the draft, the last
gamma - 1 of them chained in compile mode as the decoder runs them), LM heads included, over a cache ``FILLED``
of ``CAPACITY`` columns, in each mode, compiled first, then timed in turn within a budget, each call's fastest
kept (``fastest_seconds``: robust to bursts of load, not to a machine that stays oversubscribed, where either mode
wins by turns). The runners measured are the ones the decoder then uses, so the compiled one keeps the shape it
compiled.

Compiling takes seconds (tiny models) to minutes (a 1.5B target) at load, so the choice is remembered in
``capture_choice.json`` under ``SIDECAR_HOME``, keyed by what decides it (``choice_key``: the CPU's name, the
thread count, torch's version, each model's architecture, layers, widths, dtype and Linear kernel, the timed
shape and ``SCHEME``): a batch-32 nightly run and a batch-1 server each have their own. A later load with the
same key measures nothing; a changed key (a torch upgrade, another thread count, another batch limit's bucket or
gamma) measures again. A choice timed on a busy machine (``busy``; the reason names the load) is used until a
load finds the machine quiet and times it again. Delete the file to measure again anyway. An unreadable or
corrupt file is ignored with a warning (and rewritten), never an error; a file that cannot be written costs a
warning.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch
from transformers import PreTrainedModel

from sidecar.decoding.draft_chain import warm_chain
from sidecar.fastest import fastest_seconds
from sidecar.models.devices import device_name
from sidecar.models.pair import dtype_name
from sidecar.runtime.capture import attach, batch_bucket
from sidecar.runtime.kv_cache import RowKVCache
from sidecar.settings import Settings

logger = logging.getLogger(__name__)

CACHE_FILE = "capture_choice.json"
SCHEME = 3  # what is measured and how: a change makes every remembered choice stale (2: chains, heads; 3: margin)
ROWS = 4  # rows of the measured step where the caller names no batch limit (the dtype choice times 4 rows too)
# rows timed at most: a wider step takes longer to compile and time at load (a real pair's 4-row step took up to
# 40 s a mode); a larger batch limit is timed at this bucket
MAX_ROWS = 16
GAMMA = 4  # the decoder's default: a verify of 5 positions and 4 draft forwards per step
CAPACITY = 512  # KV columns per row (a compiled forward attends all of them, an eager one the filled ones)
FILLED = CAPACITY // 2  # the columns each row holds: a row is about half way through its cache on average
MIN_CALLS = 3  # timed calls of each forward at least (a real pair's step takes from 0.3 s to seconds on a CPU)
TIMING_BUDGET_S = 0.15  # seconds of timed calls of each forward, unless MIN_CALLS take longer
# seconds of timed rounds in all, after which timing stops even short of MIN_CALLS (one round at least): a real
# pair's step in bf16 on a CPU without native bf16 matmuls took 37-42 s a mode here
TIMING_CAP_S = 30.0
MARGIN = 0.10  # the share of eager's step a compiled step must save to be chosen (``faster_mode``)
BUSY_LOAD = 1.5  # a load average above this many times the cores: the timing shared the machine (``busy``)


@dataclass(frozen=True)
class TimedShape:
    """The step ``auto`` times: ``rows`` rows (a batch bucket) at ``gamma`` drafts per step."""

    rows: int = ROWS
    gamma: int = GAMMA

    def describe(self) -> str:
        return f"{self.rows} rows, gamma {self.gamma}"


def timed_shape(max_batch: int | None, gamma: int = GAMMA) -> TimedShape:
    """The step a run of at most ``max_batch`` rows (None: not known) at ``gamma`` mostly takes: its batch bucket
    at that limit (``capture.batch_bucket``, as its forwards pad), at most ``MAX_ROWS``."""
    if max_batch is None:
        return TimedShape(ROWS, gamma)
    return TimedShape(batch_bucket(min(max_batch, MAX_ROWS), max_batch), gamma)


@dataclass(frozen=True)
class StepTimes:
    """One mode's fastest forwards, LM head included: the target's verify, the draft's one-position forward (0:
    not timed) and the step's other ``gamma`` - 1 draft forwards (None: as many one-position forwards; compiled
    modes run them as one chained call, ``sidecar.decoding.draft_chain``)."""

    verify_s: float
    draft_s: float = 0.0
    rest_s: float | None = None
    gamma: int = GAMMA

    @property
    def drafts_s(self) -> float:
        return self.draft_s + ((self.gamma - 1) * self.draft_s if self.rest_s is None else self.rest_s)

    @property
    def step_s(self) -> float:
        return self.verify_s + self.drafts_s

    def describe(self) -> str:
        if not self.draft_s:
            return f"verify {self.verify_s * 1e3:.2f} ms"
        chained = ", chained" if self.rest_s is not None else ""
        return (f"step {self.step_s * 1e3:.2f} ms (verify {self.verify_s * 1e3:.2f} + {self.gamma} drafts "
                f"{self.drafts_s * 1e3:.2f}{chained})")


def faster_mode(compiled: StepTimes, eager: StepTimes, compile_s: float, load: float | None = None,
                cores: int | None = None, shape: TimedShape = TimedShape()) -> tuple[str, str]:
    """(mode, why): compile where its step took at least ``MARGIN`` less time than eager's, eager otherwise:
    compile mode also compiles every new shape a run meets (seconds to a minute each), which one step's time does
    not show, and on this project's CPU the real pair's two steps came within 0.5% of each other in one quiet run
    and 14% in the next. ``load``, the load average on ``cores`` cores when timed, goes into the reason: a reader
    can tell a choice timed on a busy machine (``busy``), and so does the ``shape`` timed."""
    mode = "compile" if compiled.step_s < (1 - MARGIN) * eager.step_s else "eager"
    machine = f", load {load:.1f} on {cores} cores" if load is not None else ""
    short = f", compiled saves under {MARGIN:.0%}" if mode == "eager" and compiled.step_s < eager.step_s else ""
    return mode, (f"auto: compiled {compiled.describe()} vs eager {eager.describe()}{short}, timed at "
                  f"{shape.describe()}{machine} (compiling took {compile_s:.1f} s)")


def model_key(model: PreTrainedModel) -> dict:
    """What of ``model`` decides how fast its forward runs in each mode."""
    config = model.config.get_text_config()
    layer = model.base_model.layers[0]
    return {"arch": config.model_type, "layers": config.num_hidden_layers, "hidden": config.hidden_size,
            "intermediate": config.intermediate_size, "heads": config.num_attention_heads,
            "kv_heads": config.num_key_value_heads, "dtype": dtype_name(next(model.parameters()).dtype),
            # plain, oneDNN-packed or int8 Linear modules (``sidecar.models.cpu_kernels``) run different kernels
            "linear": type(layer.mlp.up_proj).__name__}


def choice_key(target: PreTrainedModel, draft: PreTrainedModel | None, shape: TimedShape = TimedShape()) -> str:
    """The cache key of the choice for this pair on this machine at the timed ``shape`` (``draft`` None: the
    target alone is timed)."""
    key = {"scheme": SCHEME, "cpu": device_name(torch.device("cpu")), "threads": torch.get_num_threads(),
           "torch": torch.__version__, "target": model_key(target),
           "draft": model_key(draft) if draft is not None else None,
           "rows": shape.rows, "gamma": shape.gamma, "capacity": CAPACITY, "filled": FILLED}
    return json.dumps(key, sort_keys=True)


def cache_path() -> Path:
    return Settings().home / CACHE_FILE


def read_choices(path: Path) -> dict[str, dict]:
    """The choices remembered in ``path`` by key; none (with a warning) where it cannot be read or parsed."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        logger.warning("capture choice cache %s ignored (it will be measured again): %s", path, error)
        return {}
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, dict):
        logger.warning("capture choice cache %s ignored (it will be measured again): no 'choices' object", path)
        return {}
    return choices


def remembered(choices: dict[str, dict], key: str) -> dict | None:
    """The entry remembered for ``key`` (mode, reason, whether timed on a busy machine), if well-formed."""
    entry = choices.get(key)
    if isinstance(entry, dict) and entry.get("mode") in ("eager", "compile") and isinstance(entry.get("reason"), str):
        return entry
    return None


def busy(load: float | None, cores: int | None) -> bool:
    """Whether others' work competes with a timing: more runnable threads, on the last minute's average, than
    1.5 times the cores (the timing's own threads are at most the cores)."""
    return load is not None and cores is not None and load > BUSY_LOAD * cores


def remember(path: Path, key: str, mode: str, reason: str, timed_busy: bool = False) -> None:
    """Add (mode, why) for ``key`` to the file at ``path``, written whole to a temporary file and renamed over
    it, so a reader never sees half a file; a failure to write is a warning (the next load measures again)."""
    choices = read_choices(path)
    choices[key] = {"mode": mode, "reason": reason, "busy": timed_busy,
                    "measured": datetime.now(UTC).isoformat(timespec="seconds")}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as file:
            json.dump({"choices": choices}, file, indent=1)
        os.replace(file.name, path)
    except OSError as error:
        logger.warning("capture choice not remembered in %s: %s", path, error)


def measure_modes(target: PreTrainedModel, draft: PreTrainedModel | None, shape: TimedShape = TimedShape(),
                  budget_s: float = TIMING_BUDGET_S) -> tuple[StepTimes, StepTimes, float]:
    """(compiled, eager, compile seconds): the step's forwards of each mode at ``shape``, LM head included (the
    verify's at every position, a draft's at its last), in compile mode the draft's last gamma - 1 as one chain
    (``warm_chain``: greedy; none at gamma 1), timed in turn (``fastest_seconds``, whose untimed first calls
    compile). Leaves both modes' runners in the models' runner sets (``attach``): the decoder attaches the
    winner's, which keeps what it compiled."""
    calls: dict[str, list[Callable[[], object]]] = {"compile": [], "eager": []}  # per mode: verify, draft, chain
    compiled = []
    target_vocab = target.get_output_embeddings().out_features
    rows, gamma = shape.rows, shape.gamma
    with torch.inference_mode():  # as the engine's batches run
        for mode, timed in calls.items():
            for model, width in ((target, gamma + 1), (draft, 1)):
                if model is None:
                    continue
                runner = attach(model, mode)
                compiled += [(runner, runner.counters.compile_seconds)] if mode == "compile" else []
                cache = RowKVCache(model, rows, CAPACITY)  # a pool of ``rows`` slots: its bucket is all of them
                cache.lengths[:] = FILLED
                ids = torch.zeros(rows, width, dtype=torch.long, device=cache.device)
                head = model.get_output_embeddings()
                timed.append(lambda runner=runner, cache=cache, ids=ids, head=head, width=width:
                             head(runner(cache, ids)[:, -width:]))
                if mode == "compile" and model is draft and gamma > 1:
                    timed.append(lambda runner=runner, cache=cache: warm_chain(runner, cache, gamma - 1, target_vocab))
        best = iter(fastest_seconds([*calls["compile"], *calls["eager"]], budget_s, min_calls=MIN_CALLS,
                                    cap_s=TIMING_CAP_S))
    compile_s = sum(runner.counters.compile_seconds - before for runner, before in compiled)
    # each mode's times in its calls' order: (verify[, draft[, chain]]), StepTimes' own fields
    compiled_times, eager_times = (StepTimes(*(next(best) for _ in timed), gamma=gamma) for timed in calls.values())
    return compiled_times, eager_times, compile_s


def machine_load() -> tuple[float | None, int | None]:
    """The last minute's load average and the cores it compares with (None where the OS gives none)."""
    try:
        return os.getloadavg()[0], os.cpu_count()
    except (AttributeError, OSError):
        return None, None


Measure = Callable[[PreTrainedModel, PreTrainedModel | None, TimedShape], tuple[StepTimes, StepTimes, float]]


def choose_cpu_capture(target: PreTrainedModel, draft: PreTrainedModel | None, measure: Measure = measure_modes,
                       load: Callable[[], tuple[float | None, int | None]] = machine_load,
                       shape: TimedShape = TimedShape()) -> tuple[str, str]:
    """(mode, why) of ``auto`` on a CPU for this pair (``draft`` None: the target's forwards alone) at the step
    ``shape`` its run will mostly take (``timed_shape``): remembered for its key, else measured and remembered.
    A choice timed on a busy machine (``busy``; on this project's 2-core box, other work made either mode win by
    turns) is used until a load finds the machine quiet, which times it again; one timed quiet stands. A
    measurement that fails (a kernel inductor cannot compile) gives eager, remembered too: a load never fails
    for auto's sake. ``load`` says the load average and cores."""
    key, path = choice_key(target, draft, shape), cache_path()
    entry = remembered(read_choices(path), key)
    if entry is not None and not (entry.get("busy") and not busy(*load())):
        logger.info("capture mode %s, remembered in %s: %s", entry["mode"], path, entry["reason"])
        return entry["mode"], entry["reason"]
    began = time.perf_counter()
    timed_busy = False
    try:
        compiled, eager, compile_s = measure(target, draft, shape)
        timed_busy = busy(*(machine := load()))
        mode, reason = faster_mode(compiled, eager, compile_s, *machine, shape=shape)
    except Exception as error:  # whatever compiling raises: the load goes on in eager mode
        logger.warning("capture mode auto: timing the compiled forwards failed, eager", exc_info=True)
        first_line = (str(error).strip().splitlines() or [""])[0][:200]
        mode, reason = "eager", f"auto: eager (compiling failed: {type(error).__name__}: {first_line})"
    logger.info("capture mode %s, measured in %.1f s: %s", mode, time.perf_counter() - began, reason)
    remember(path, key, mode, reason, timed_busy)
    return mode, reason
