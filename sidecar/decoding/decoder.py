"""Batched speculative decoding: the draft proposes, the target verifies every row in one forward.

``SpeculativeDecoder`` is the public front: ``generate`` and ``decode`` (outputs in input order),
``stream`` (outputs as rows finish) and ``batch`` (an empty running batch to add rows to and step, the
server's loop). The batch (``sidecar.decoding.batch``) admits, plans (``sidecar.decoding.plan``), runs
(``sidecar.decoding.step``) and records; the acceptance rule is ``sidecar.decoding.acceptance``. Greedy
output is token-identical to the target decoding alone; sampled output follows the target's distribution.

Costs learned in one call carry over to the next: the step controller and the prefill planners belong to
the decoder, not to a batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import replace
from functools import partial
from typing import Any

from sidecar.decoding.batch import SlotBatch, check_row, stream_through
from sidecar.decoding.capture_choice import choose_cpu_capture, timed_shape
from sidecar.decoding.controller import GammaController
from sidecar.decoding.draft_chain import warm_chain
from sidecar.decoding.plan import DRAFT_CONFIDENCE, StepPlanner, feed_widths, verify_widths
from sidecar.decoding.randomness import nth_seed
from sidecar.decoding.rows import CancelCheck, DecodeRow, GenerationOutput, HandoffCallback, TokenCallback
from sidecar.decoding.sampling import Sampling
from sidecar.errors import InputError
from sidecar.models.cpu_kernels import onednn_layers, unpack_onednn_linear
from sidecar.models.pair import ModelPair
from sidecar.progress import ProgressCallback
from sidecar.runtime.capture import attach, decode_tokens, resolve_capture, runner_of
from sidecar.runtime.decoder_stack import supports
from sidecar.runtime.prefill_plan import PrefillPlanner
from sidecar.runtime.step_counters import counters_of
from sidecar.runtime.warmup import (
    allocation_default,
    load_capacities,
    set_chains,
    set_sampled,
    set_widths,
    warm_up,
    warms_at_load,
)


def use_capture(pair: ModelPair, requested: str | None, max_batch: int | None = None, gamma: int = 4) -> None:
    """Run both models' forwards in the capture mode ``requested`` resolves to (``sidecar.runtime.capture``) and
    record it on the pair, as its dtype is. ``auto`` on a CPU times the pair's step in eager and compiled mode
    (``sidecar.decoding.capture_choice``) where both models run our stack, at the step a run of at most
    ``max_batch`` rows (None: not known) at ``gamma`` mostly takes (``timed_shape``)."""
    shape = timed_shape(max_batch, gamma)
    packed = sum(onednn_layers(model) for model in (pair.target, pair.draft))

    def cpu_auto() -> tuple[str, str]:
        if packed:  # a CPU's packed layout: compiling would first undo what makes eager fast here
            return "eager", (f"auto: eager ({packed} Linear layers in oneDNN's packed layout, which inductor "
                             "cannot compile; compile: SIDECAR_CAPTURE=compile)")
        return choose_cpu_capture(pair.target, pair.draft, shape=shape)

    mode, reason = resolve_capture(requested, pair.device, pair.target, cpu_auto if supports(pair.draft) else None)
    if mode != "hf" and not supports(pair.draft):
        mode, reason = resolve_capture("hf", pair.device, pair.draft)
    if mode in ("compile", "cudagraph") and packed:  # asked for by name: the compiled forwards get the plain layout
        unpacked = unpack_onednn_linear(pair.target) + unpack_onednn_linear(pair.draft)
        reason += f"; {unpacked} oneDNN-packed Linear layers unpacked for inductor"
    attach(pair.target, mode)
    attach(pair.draft, mode)
    pair.capture_mode, pair.capture_reason = mode, reason


def capture_stats(pair: ModelPair) -> dict:
    """The pair's capture mode and why, with each model's counters (compiles, recompiles, graph breaks,
    forwards, distinct decode shapes, and each warm-up's compiles, seconds and graph bytes) since it was attached,
    and its decoding steps' (``steps``: ``sidecar.runtime.step_counters``, syncs and host time per step among them):
    for ``GET /stats`` and run reports."""
    counters = {name: {**runner.counters.as_dict(), "warm_ups": [w.as_dict() for w in runner.warm_ups]}
                for name, model in (("target", pair.target), ("draft", pair.draft))
                if (runner := runner_of(model)) is not None}
    return {"mode": pair.capture_mode, "reason": pair.capture_reason, "counters": counters,
            "steps": counters_of(pair).as_dict()}


def recorded_counters(pair: ModelPair) -> dict:
    """What a run records of this process's decoding (``storage.capture_counters``): each model's capture counters
    and, under ``steps``, its steps' (steps, syncs, step and read seconds)."""
    stats = capture_stats(pair)
    return {**stats["counters"], "steps": stats["steps"]}


class SpeculativeDecoder:
    """Batched speculative decoding of ``pair``.

    ``gamma`` bounds the tokens drafted per step; 0 decodes plainly, one target forward per token, the draft
    model prefilled and run only for sidecar tasks (the same engine's baseline for speculation). ``adaptive``
    picks each step's width from measured costs and acceptance (down to plain steps) and stops drafting at
    ``draft_confidence`` (default ``DRAFT_CONFIDENCE``; 0 never stops early); without it every step drafts exactly
    ``gamma``.
    ``prompt_lookup`` also drafts by copying from each row's own text (``sidecar.decoding.lookup``): adaptive,
    for the rows that have something to copy; in fixed mode when every row has ``gamma`` tokens.
    ``max_copy`` (default ``gamma``) bounds an adaptive step's copy, which costs no draft forward and so may be
    longer than ``gamma``; fixed mode copies exactly ``gamma`` (``max_copy``, if given, must equal it).

    While a seeded sampled row is in the batch, steps follow a fixed rule instead, row by row: each row
    drafts up to ``gamma`` (fewer near its limit), copying when its own text offers that many, so that its
    tokens depend on nothing but its own prompt and seed.

    ``capture`` (default: the pair's, asked at load or attached by an earlier decoder, else ``SIDECAR_CAPTURE``,
    else auto) is how forwards run: eager, compiled
    or captured as CUDA graphs over bucketed shapes, or Hugging Face's forward (``sidecar.runtime.capture``).
    ``max_batch``, the batch limit the caller will mostly run (a server's, a nightly run's; None: not known),
    is the batch ``auto`` on a CPU times its choice at, with ``gamma`` (``sidecar.decoding.capture_choice``).
    ``warm_up`` (default: ``SIDECAR_WARMUP``; auto: in ``cudagraph`` mode) runs every batch bucket's decode
    forwards of a KV cache as soon as it is allocated (``sidecar.runtime.warmup``); ``warm`` does it at load for
    a batch limit and row length, ``warm_at_load`` for the capacities a server or a nightly run will use.

    A row asking for ``top_logprobs`` gets each token's log-probability under the target and that many
    top alternatives (``sidecar.decoding.logprobs``), read from the logits the prefill, plain step or
    verify forward computed anyway for the position that committed the token.
    """

    def __init__(self, pair: ModelPair, gamma: int = 4, adaptive: bool = True, prompt_lookup: bool = True,
                 draft_confidence: float | None = None, capture: str | None = None,
                 warm_up: bool | None = None, max_batch: int | None = None, max_copy: int | None = None) -> None:
        if not isinstance(gamma, int) or isinstance(gamma, bool) or gamma < 0:
            raise InputError(f"gamma must be an integer >= 0 (0: plain decoding), got {gamma!r}")
        if max_copy is not None and (not isinstance(max_copy, int) or isinstance(max_copy, bool) or max_copy < 1):
            raise InputError(f"max_copy must be an integer >= 1, got {max_copy!r}")
        if not adaptive and max_copy not in (None, gamma):
            raise InputError(f"max_copy={max_copy} needs adaptive=True: a fixed gamma copies exactly gamma ({gamma}) "
                             "tokens")
        if max_copy is None:
            max_copy = gamma
        if draft_confidence is None:
            draft_confidence = DRAFT_CONFIDENCE if adaptive else 0.0
        if not 0 <= draft_confidence <= 1:
            raise InputError(f"draft_confidence must be in [0, 1], got {draft_confidence!r}")
        self.pair = pair
        if max_batch is not None and (not isinstance(max_batch, int) or max_batch < 1):
            raise InputError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        use_capture(pair, capture or pair.capture or pair.capture_mode or None, max_batch, gamma)
        warm_up = allocation_default() if warm_up is None else warm_up
        # a plain step, a verify of 1 .. gamma drafts, and of the longest copy (every longer copy pads to it)
        set_widths(pair.target, verify_widths(gamma, max_copy), warm_up)
        set_widths(pair.draft, feed_widths(gamma), warm_up)  # a first feed's widths: wider ones run in chunks
        # a step's draft forwards after its first, chained (``sidecar.decoding.draft_chain``): 1 .. gamma - 1
        target_vocab = pair.target.get_output_embeddings().out_features
        set_chains(pair.draft, set(range(1, gamma)),
                   partial(warm_chain, runner_of(pair.draft), target_vocab=target_vocab))
        self.gamma = gamma
        self.adaptive = adaptive
        self.controller = GammaController(gamma, adaptive, max_copy=max_copy)
        # read at each call, so a runner attached or re-padded later is priced as it runs
        self.controller.decode_tokens = {"target": partial(decode_tokens, pair.target),
                                         "draft": partial(decode_tokens, pair.draft)}
        self.planner = StepPlanner(self.controller, gamma, prompt_lookup, draft_confidence)
        self.prefill_plans = {"target": PrefillPlanner(pair.device), "draft": PrefillPlanner(pair.device)}

    @property
    def prompt_lookup(self) -> bool:
        return self.planner.prompt_lookup

    @prompt_lookup.setter
    def prompt_lookup(self, value: bool) -> None:
        self.planner.prompt_lookup = value

    # -- public API --

    def warm(self, max_batch: int = 8, columns: int = 512, max_draft_rows: int = 0,
             sampled: bool = True) -> dict[str, dict]:
        """Compile (and in ``cudagraph`` mode record) every decode forward a batch of ``max_batch`` rows (and
        ``max_draft_rows`` draft-only rows) needing ``columns`` KV columns a row will run, now: compiles,
        seconds and graph bytes per model (empty where forwards are eager; a shape warmed before is skipped).
        ``sampled`` False: the rows decode greedy only, and the draft's sampled chains are not warmed (here
        nor in caches warmed later as they are allocated)."""
        set_sampled(self.pair.draft, sampled)
        reports = {name: warm_up(model, rows, columns, name) for name, model, rows in (
            ("target", self.pair.target, max_batch), ("draft", self.pair.draft, max_batch + max_draft_rows))}
        return {name: report.as_dict() for name, report in reports.items() if report is not None}

    def warm_at_load(self, max_batch: int, shortest: int, longest: int, max_draft_rows: int = 0,
                     sampled: bool = True) -> list[dict]:
        """``warm`` (``sampled`` as there) for each capacity ``load_capacities`` picks for rows needing
        ``shortest`` .. ``longest`` KV columns, where ``SIDECAR_WARMUP`` warms this pair's mode at load
        (``warms_at_load``); one report per capacity warmed (none in eager and hf modes, or with warm-up off),
        each logged."""
        if not warms_at_load(self.pair.capture_mode):
            return []
        reports = []
        for capacity in load_capacities(shortest, longest):
            report = self.warm(max_batch, capacity, max_draft_rows, sampled)
            if report:
                reports.append({"capacity": capacity, **report})
        return reports

    def generate(self, prompt_ids: list[list[int]], max_new_tokens: int | list[int] = 64,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None, batch_size: int = 8,
                 stop: list[str] | None = None, on_tokens: TokenCallback | None = None,
                 top_logprobs: int | None = None, cancelled: CancelCheck | None = None,
                 schedule: str = "continuous") -> list[GenerationOutput]:
        limits = [max_new_tokens] * len(prompt_ids) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        rows = [DecodeRow(list(p), m) for p, m in zip(prompt_ids, limits, strict=True)]
        return self.decode(rows, Sampling(temperature, top_p, seed), batch_size, stop, on_tokens,
                           top_logprobs=top_logprobs, cancelled=cancelled, schedule=schedule)

    def decode(self, rows: list[DecodeRow], sampling: Sampling | None = None, batch_size: int = 8,
               stop: list[str] | None = None, on_tokens: TokenCallback | None = None,
               on_handoff: HandoffCallback | None = None, on_progress: ProgressCallback | None = None,
               top_logprobs: int | None = None, cancelled: CancelCheck | None = None,
               schedule: str = "continuous") -> list[GenerationOutput]:
        """Decode ``rows``, at most ``batch_size`` at a time, outputs in input order. ``sampling``, ``stop``
        and ``top_logprobs``, when given, apply to every row (row ``i`` of a call seeded ``s`` draws as a
        row seeded ``s + i``); otherwise each row's own apply. A row that ``cancelled`` reports between
        two steps leaves at once with what it has (finish reason "cancelled", no handoff)."""
        rows = self.with_call_settings(rows, sampling, stop, top_logprobs)
        self.validate(rows, batch_size)
        # similar lengths are admitted together, so right-padding wastes little prefill
        order = sorted(range(len(rows)), key=lambda i: len(rows[i].target_prompt))
        outputs: dict[int, GenerationOutput] = {}
        stream = self.stream((rows[i] for i in order), batch_size, schedule, on_tokens=on_tokens,
                             on_handoff=on_handoff, on_progress=on_progress, cancelled=cancelled,
                             expected_rows=len(rows), indices=order)
        for index, output in stream:
            outputs[index] = output
        return [outputs[i] for i in range(len(rows))]

    def stream(self, rows: Iterable[DecodeRow], max_batch: int = 8, schedule: str = "continuous",
               indices: list[int] | None = None, **options: Any) -> Iterator[tuple[int, GenerationOutput]]:
        """Decode rows as they come: (index, output) as each row finishes (``batch.stream_through``);
        ``options`` are ``SlotBatch``'s callbacks and settings."""
        return stream_through(self.batch(max_batch, schedule, **options), rows, indices)

    def batch(self, max_batch: int = 8, schedule: str = "continuous", **options: Any) -> SlotBatch:
        """An empty running batch to ``add`` rows to and ``step`` (the server's admit-then-step loop)."""
        if max_batch < 1 and not options.get("max_draft_rows"):
            raise InputError(f"batch_size must be >= 1, got {max_batch}")
        return SlotBatch(self.pair, self.planner, self.prefill_plans, max_batch, schedule, **options)

    @staticmethod
    def with_call_settings(rows: list[DecodeRow], sampling: Sampling | None, stop: list[str] | None,
                           top_logprobs: int | None) -> list[DecodeRow]:
        changes: list[dict] = [{} for _ in rows]
        for i, change in enumerate(changes):
            if sampling is not None:
                change["sampling"] = replace(sampling, seed=nth_seed(sampling.seed, i))
            if stop is not None:
                change["stop"] = stop
            if top_logprobs is not None:
                change["top_logprobs"] = top_logprobs
        return [replace(row, **change) if change else row for row, change in zip(rows, changes, strict=True)]

    def validate(self, rows: list[DecodeRow], batch_size: int, first_index: int = 0) -> None:
        if batch_size < 1:
            raise InputError(f"batch_size must be >= 1, got {batch_size}")
        for i, row in enumerate(rows, start=first_index):
            check_row(self.pair, self.gamma, row, i)
