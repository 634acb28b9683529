"""The device-time ledger (``sidecar.runtime.ledger``): every forward is timed and charged to the rows it
served, and for every batch and stream the charged seconds sum to the measured forward times.

The independent count is a forward hook on each model's decoder stack: every forward the models make must
have gone through the ledger, and the ledger's time for them covers at least what the hooks saw.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

from sidecar.decoding.batch import SlotBatch, stream_through
from sidecar.decoding.decoder import SpeculativeDecoder
from sidecar.decoding.rows import DecodeRow
from sidecar.runtime.capture import forward_module
from sidecar.runtime.ledger import Account, Charge, Ledger
from sidecar.runtime.timing import DeviceTimer
from sidecar.tasks.engine import SidecarEngine
from sidecar.tasks.rows import DocumentResult, SidecarRequest
from sidecar.tasks.task import HASHTAGS, SidecarTask
from tests.decoding import random_prompts

TITLE = SidecarTask(name="title", instruction="Then write a title.", max_new_tokens=6)


class ForwardHooks:
    """Counts and times every forward of the pair's decoder stacks (pre and post hooks, on the host clock)."""

    def __init__(self, pair) -> None:
        self.count, self.seconds, self._start = 0, 0.0, 0.0
        self._handles = []
        for model in (pair.target, pair.draft):
            self._handles.append(forward_module(model).register_forward_pre_hook(self._pre))
            self._handles.append(forward_module(model).register_forward_hook(self._post))

    def _pre(self, *_) -> None:
        self._start = time.perf_counter()

    def _post(self, *_) -> None:
        self.count += 1
        self.seconds += time.perf_counter() - self._start

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


@pytest.fixture
def ledgers(monkeypatch: pytest.MonkeyPatch) -> list[Ledger]:
    """Every ledger made while the test runs."""
    made: list[Ledger] = []
    init = Ledger.__init__

    def recording(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(Ledger, "__init__", recording)
    return made


def run_hooked(pair, run: Callable[[], object]) -> tuple[ForwardHooks, object]:
    hooks = ForwardHooks(pair)
    try:
        return hooks, run()
    finally:
        hooks.remove()


def assert_balanced(ledgers: list[Ledger], hooks: ForwardHooks, charged_to_rows: float) -> None:
    measured = sum(ledger.measured_seconds for ledger in ledgers)
    assert sum(ledger.forwards for ledger in ledgers) == hooks.count, "a forward escaped the ledger"
    assert hooks.seconds <= measured * 1.001, "the ledger timed less than the forwards took"
    assert sum(ledger.charged_seconds for ledger in ledgers) == pytest.approx(measured, rel=1e-9)
    assert charged_to_rows == pytest.approx(measured, rel=0.01), "the rows' accounts miss part of the forwards"


def document_seconds(result: DocumentResult) -> float:
    main = result.main.stats
    seconds = main.prefill_device_seconds + main.decode_device_seconds
    for output in result.sidecars.values():
        st = output.stats
        seconds += st.prefill_device_seconds + st.decode_device_seconds + st.instruction_device_seconds
    return seconds


def test_a_forward_is_split_by_the_tokens_each_row_had_in_it() -> None:
    ledger = Ledger(DeviceTimer(torch.device("cpu")))
    a, b, instruction = Account(), Account(), Account()
    charges = [Charge(a, "decode", 3, "main"), Charge(b, "prefill", 5, "main"), Charge(instruction, "prefill", 2,
                                                                                         "instruction")]
    with ledger.forward("draft", "decode", 2, charges, padded_tokens=12, context=40):
        torch.randn(200, 200) @ torch.randn(200, 200)
    seconds = ledger.measured_seconds
    assert seconds > 0 and ledger.forwards == 1
    assert a.decode_seconds == pytest.approx(seconds * 3 / 10)
    assert b.prefill_seconds == pytest.approx(seconds * 5 / 10) and b.decode_seconds == 0
    assert instruction.prefill_tokens == 2 and instruction.prefill_forwards == 1
    assert ledger.charged_by_label == pytest.approx({"main": seconds * 0.8, "instruction": seconds * 0.2})
    record = ledger.records[-1]
    assert (record.rows, record.padded_tokens, record.tokens) == (2, 12, {"main": 8, "instruction": 2})


def test_a_chain_of_forwards_timed_as_one_is_charged_as_that_many_equal_forwards() -> None:
    """A compiled chain of draft forwards (``sidecar.decoding.draft_chain``) runs in one call no clock can split:
    each of its forwards is charged an equal share, and each record's context grows by the tokens written."""
    ledger = Ledger(DeviceTimer(torch.device("cpu")))
    a, b = Account(), Account()
    heard = []
    with ledger.forward("draft", "decode", 2, [Charge(a, "decode", 1, "main"), Charge(b, "decode", 1, "sidecar")],
                        padded_tokens=2, context=30, also=heard.append, forwards=3):
        torch.randn(200, 200) @ torch.randn(200, 200)
    seconds = ledger.measured_seconds
    assert ledger.forwards == 3 and a.decode_forwards == 3 and a.decode_tokens == 3
    assert a.decode_seconds == pytest.approx(seconds / 2) and heard == pytest.approx([seconds / 3] * 3)
    assert [r.context for r in ledger.records] == [30, 32, 34]


def test_a_decode_steps_forwards_name_their_step_and_a_prefill_none(tiny, ledgers) -> None:
    """Each decode step's records share its number, one target forward and the draft's (a fixed gamma of 3 without
    prompt lookup: up to 3 each), the steps numbered in order; prefills name none. ``study.cost.replay`` prices
    the host work around a step once by it."""
    prompts = random_prompts(tiny, [5, 17, 9], seed=3)
    SpeculativeDecoder(tiny, gamma=3, adaptive=False, prompt_lookup=False).generate(prompts, max_new_tokens=12,
                                                                                    batch_size=2)
    records = [r for ledger in ledgers for r in ledger.records]
    assert {r.step for r in records if r.kind == "prefill"} == {None}
    decode = [r for r in records if r.kind == "decode"]
    steps = sorted({r.step for r in decode})
    assert None not in steps and steps == list(range(1, len(steps) + 1)), "steps numbered in order, from 1"
    assert [r.step for r in decode] == sorted(r.step for r in decode)
    for step in steps:
        models = [r.model for r in decode if r.step == step]
        assert models.count("target") == 1 and 1 <= models.count("draft") <= 3, (step, models)


@pytest.mark.parametrize("schedule", ["static", "continuous"])
def test_a_decode_charges_every_forward_to_its_rows(tiny, ledgers, schedule: str) -> None:
    prompts = random_prompts(tiny, [5, 17, 9, 30, 12, 7], seed=3)
    decoder = SpeculativeDecoder(tiny, gamma=4)
    hooks, outputs = run_hooked(tiny, lambda: decoder.generate(prompts, max_new_tokens=20, batch_size=4,
                                                               schedule=schedule))
    rows = sum(o.stats.prefill_device_seconds + o.stats.decode_device_seconds for o in outputs)
    assert_balanced(ledgers, hooks, rows)
    assert all(o.stats.prefill_forwards >= 1 and o.stats.decode_forwards >= 1 for o in outputs)


def test_a_stream_with_sidecars_beside_main_rows_charges_every_forward(tiny, ledgers) -> None:
    engine = SidecarEngine(tiny, gamma=3, adaptive=False)
    requests = [SidecarRequest(f"document number {i} " * (2 + i % 4), sidecars=[HASHTAGS, TITLE],
                               max_new_tokens=6 + 9 * (i % 3)) for i in range(7)]
    batch = engine.batch(3)

    def run() -> list[DocumentResult]:
        return [result for _, result in stream_through(batch, requests)]

    hooks, results = run_hooked(tiny, run)
    assert_balanced(ledgers, hooks, sum(map(document_seconds, results)))
    # sidecar rows rode in draft forwards beside live main rows, and their instructions were charged to them
    assert any(step.live and step.riders for step in batch.trace.steps)
    for result in results:
        for output in result.sidecars.values():
            assert output.stats.instruction_tokens > 0 and output.stats.instruction_device_seconds > 0
            assert output.stats.decode_forwards >= 1


def test_the_standalone_tagger_charges_every_forward(tiny, ledgers) -> None:
    engine = SidecarEngine(tiny)
    summaries = ["The council approved the budget.", "Jobs were lost in Berlin.", "Rain over the weekend."]
    hooks, outputs = run_hooked(tiny, lambda: engine.standalone(summaries, [HASHTAGS, TITLE], batch_size=4))
    rows = sum(o.stats.prefill_device_seconds + o.stats.decode_device_seconds for out in outputs for o in out.values())
    assert_balanced(ledgers, hooks, rows)
    assert all(o.stats.instruction_tokens == 0 for out in outputs for o in out.values())


def test_a_prefix_computed_once_is_shared_by_the_rows_it_was_copied_to(tiny, ledgers) -> None:
    prefix = random_prompts(tiny, [20], seed=5)[0]
    prompts = [prefix + tail for tail in random_prompts(tiny, [3, 6, 9], seed=6)]
    outputs = SpeculativeDecoder(tiny, gamma=2, adaptive=False).generate(prompts, max_new_tokens=3, batch_size=3)
    # every row's prefill is its own tokens plus an equal share of the prefix: nothing is charged twice
    target = [o.stats.prefill_tokens for o in outputs]
    assert sum(target) == pytest.approx(2 * sum(len(p) for p in prompts) - 2 * 2 * len(prefix), abs=3)
    assert max(target) - min(target) <= 2 * 6 + 3


def test_a_server_batch_s_ledger_is_bounded_and_balanced(tiny) -> None:
    batch: SlotBatch = SpeculativeDecoder(tiny, gamma=2).batch(2, trace_keep=50)
    for i, prompt in enumerate(random_prompts(tiny, [4, 6, 8, 5, 7, 9, 3, 4], seed=2)):
        batch.add(i, DecodeRow(prompt, 30))
    while batch.busy:
        batch.step()
    totals = batch.ledger.totals()
    assert len(batch.ledger.records) == 50 and batch.ledger.forwards > 50
    assert totals["charged_seconds"] == pytest.approx(totals["measured_seconds"], rel=1e-9)
    assert sum(totals["charged_seconds_by_phase"].values()) == pytest.approx(totals["measured_seconds"], rel=1e-9)
