"""A decode waits for the device at most once per forward, whatever the batch size (``sidecar.runtime.syncs``).

The budget: syncs <= decode target forwards + decode draft forwards + 1 per prefilled batch.

* A target forward (verify or plain step) is read back once: accepted counts, next tokens and drafts
  in one transfer.
* A draft forward is read back at most once: when drafting may stop early, whether any row's token
  was confident.
* A prefill's forwards read nothing; each admitted group's first tokens are one transfer.

Nothing else may wait: no per-row reads, no lengths read back for the masks, no timer that
synchronizes. Asking for logprobs adds one transfer per forward that commits tokens (their entries).
The count runs on the CPU, where the same calls are made as on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from unittest import mock

import pytest
import torch
from decoding import assert_speculated

from sidecar.decoding import batch
from sidecar.decoding.batch import stream_through
from sidecar.decoding.decoder import SpeculativeDecoder
from sidecar.runtime import step_counters
from sidecar.runtime import syncs as runtime_syncs
from sidecar.runtime.capture import forward_module
from sidecar.runtime.syncs import SyncCounter
from sidecar.runtime.timing import DeviceTimer
from sidecar.tasks.batch import SidecarBatch
from sidecar.tasks.engine import SidecarEngine
from sidecar.tasks.requests import RequestBuilder
from sidecar.tasks.rows import SidecarRequest
from sidecar.tasks.task import HASHTAGS, SidecarTask


def random_prompts(pair, batch: int, seed: int, every_token: bool = False) -> list[list[int]]:
    """Random prompts; with ``every_token`` each holds every ordinary token once, so that prompt lookup
    finds a continuation to copy whatever token a row has just produced."""
    g = torch.Generator().manual_seed(seed)
    if every_token:
        return [(torch.randperm(len(pair.tokenizer) - 3, generator=g) + 3).tolist() for _ in range(batch)]
    lengths = torch.randint(4, 30, (batch,), generator=g).tolist()
    return [torch.randint(3, len(pair.tokenizer), (n,), generator=g).tolist() for n in lengths]


class Forwards:
    """Forwards of the target and the draft made outside a prefill."""

    def __init__(self, pair) -> None:
        self.pair = pair
        self.decode = {"target": 0, "draft": 0}
        self.prefills = 0
        self.first_token_reads = 0  # prefills that yield first tokens: the target's, and the plain batch's
        self._depth = 0
        self._handles = [forward_module(model).register_forward_hook(self._hook(name))
                         for name, model in (("target", pair.target), ("draft", pair.draft))]

    def _hook(self, name: str) -> Callable:
        def hook(*args) -> None:
            if not self._depth:
                self.decode[name] += 1
        return hook

    def wrap(self, prefill: Callable) -> Callable:
        def counted(*args, **kwargs):
            self.prefills += not self._depth
            # the target's prefill yields first tokens; the draft's for a main row does not (it is never read)
            self.first_token_reads += not self._depth and args[0] is self.pair.target
            self._depth += 1
            try:
                return prefill(*args, **kwargs)
            finally:
                self._depth -= 1
        return counted

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def count(pair, run: Callable[[], object]) -> tuple[SyncCounter, Forwards, object]:
    forwards = Forwards(pair)
    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(batch, "prefill", forwards.wrap(batch.prefill)))
        syncs = stack.enter_context(SyncCounter())
        result = run()
    forwards.remove()
    return syncs, forwards, result


def assert_within_budget(syncs: SyncCounter, forwards: Forwards, logprobs: bool = False) -> None:
    token_prefills = forwards.first_token_reads
    budget = forwards.decode["target"] + forwards.decode["draft"] + token_prefills
    if logprobs:
        budget += forwards.decode["target"] + token_prefills
    assert syncs.total <= budget, (
        f"{syncs.total} syncs for {forwards.decode} decode forwards and {token_prefills} prefilled batches "
        f"(budget {budget}); by call site:\n{syncs.busiest()}")


MODES = {
    "fixed": dict(decoder=dict(adaptive=False)),
    "fixed, early stop": dict(decoder=dict(adaptive=False, draft_confidence=0.5)),
    "adaptive": dict(decoder=dict(adaptive=True)),
    "sampled": dict(decoder=dict(adaptive=False, draft_confidence=0.5), generate=dict(temperature=0.9, seed=3)),
    "copying": dict(decoder=dict(adaptive=False), every_token=True),
    "logprobs": dict(decoder=dict(adaptive=False), generate=dict(top_logprobs=2)),
}


@pytest.mark.parametrize("batch", [1, 8, 32])
@pytest.mark.parametrize("mode", list(MODES))
def test_a_decode_syncs_at_most_once_per_forward(tiny, mode: str, batch: int) -> None:
    config = MODES[mode]
    prompts = random_prompts(tiny, batch, seed=batch, every_token=config.get("every_token", False))
    decoder = SpeculativeDecoder(tiny, gamma=4, **config["decoder"])
    syncs, forwards, outputs = count(tiny, lambda: decoder.generate(
        prompts, max_new_tokens=24, batch_size=batch, **config.get("generate", {})))
    # the paths each mode is for ran
    if mode == "copying":
        assert sum(o.stats.lookup_drafted for o in outputs) > 0
    elif not decoder.adaptive:
        assert forwards.prefills == 2 and forwards.decode["draft"] > 0
    else:
        assert_speculated(outputs)  # the adaptive controller's steps, not plain decoding alone
    assert forwards.first_token_reads == 1  # one group: the whole batch joins at once
    assert_within_budget(syncs, forwards, logprobs="top_logprobs" in config.get("generate", {}))


def test_sidecar_tasks_sync_at_most_once_per_forward(tiny) -> None:
    engine = SidecarEngine(tiny, gamma=3, adaptive=False)
    requests = [SidecarRequest(document=f"document number {i} " * (2 + i % 3), sidecars=[HASHTAGS]) for i in range(8)]
    syncs, forwards, _ = count(tiny, lambda: engine.run(requests, max_new_tokens=16, batch_size=8))
    # the main batch's prefill yields first tokens; sidecar rows join from snapshots and ride the next step
    assert forwards.first_token_reads >= 1
    assert_within_budget(syncs, forwards)


def test_constrained_sidecar_tasks_sync_at_most_once_per_draft_forward(tiny) -> None:
    """A constrained sidecar row's tokens are read in the early stop's transfer: at most one read per draft
    forward of each step, while the rows ride wide steps beside drafting main rows. The mask's bit unpacking
    on the host (``matcher.unpack_on_host``: ``.cpu()``/``.numpy()`` of the host-made mask) is counted on a
    CPU but waits for nothing; an accelerator copies the mask to the device instead."""
    tasks = [SidecarTask(name="topic", instruction="Then give its topic.", max_new_tokens=8,
                         choices=["politics", "sport", "science"]),
             SidecarTask(name="tags", instruction="Then give hashtags.", max_new_tokens=24,
                         regex=r"#[a-z]{2,8}( #[a-z]{2,8}){1,3}")]
    # drafting may stop early, so that the constrained rows' tokens share the early stop's read
    decoder = SpeculativeDecoder(tiny, gamma=3, adaptive=False, draft_confidence=0.5)
    requests = [SidecarRequest(document=f"document number {i} " * (2 + i % 3), sidecars=tasks,
                               max_new_tokens=4 + 7 * (i % 3)) for i in range(6)]
    sidecar_batch = SidecarBatch(RequestBuilder(tiny, 3), decoder, 3)
    step, reads = sidecar_batch.slots.step, []

    def draft_reads() -> int:
        return sum(n for site, n in syncs.sites.items() if "(_draft)" in site)

    def counted() -> list:
        before, recorded = draft_reads(), sidecar_batch.slots.trace.steps_recorded
        done = step()
        if sidecar_batch.slots.trace.steps_recorded > recorded:
            reads.append((draft_reads() - before, sidecar_batch.slots.trace.steps[-1]))
        return done

    sidecar_batch.slots.step = counted
    forwards = Forwards(tiny)
    with mock.patch.object(batch, "prefill", forwards.wrap(batch.prefill)), SyncCounter() as syncs:
        results = [r for _, r in stream_through(sidecar_batch, requests)]
    forwards.remove()
    assert all(r.sidecars[t.name].parse_error is None for r in results for t in tasks)
    assert any(n and record.riders and record.draft_forwards > 1 for n, record in reads), "no wide constrained step"
    for n, record in reads:
        assert n <= record.draft_forwards, (n, record)
    unpacking = [site for site in syncs.sites if site.startswith("sidecar/decoding/matcher.py")]
    assert unpacking, "no mask was applied"
    for site in unpacking:
        del syncs.sites[site]
    assert_within_budget(syncs, forwards)


def test_the_counter_counts_every_kind_of_wait() -> None:
    t = torch.arange(4)
    with SyncCounter() as syncs:
        int(t[0]), float(t[1]), bool(t[2]), [0, 1, 2, 3][t[3]]
        t.tolist(), t[0].item(), t.cpu(), t.numpy()
        t[t > 1]
        torch.tensor([1, 2], device=t.device)
        runtime_syncs.synchronize(torch.device("cpu"))  # on a GPU a synchronize: counted on a CPU too
        torch.zeros(3) + t[:3]  # stays on the device: not counted
    kinds = sorted(site.rsplit(" ", 1)[1] for site in syncs.sites.elements())
    assert kinds == sorted(["__int__", "__float__", "__bool__", "__index__", "tolist", "item", "cpu", "numpy",
                            "__getitem__[bool]", "tensor(device=)", "synchronize"])
    assert all(site.startswith("tests/test_syncs.py:") for site in syncs.sites)


def test_gpu_forward_timings_are_read_once_done_without_waiting(monkeypatch) -> None:
    """On a GPU the timer brackets work with CUDA events and reads them only once they have completed
    (``query``), oldest first: it never waits for the device."""
    recorded = []

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing
            self.done, self.at = False, len(recorded)

        def record(self) -> None:
            self.at = len(recorded)
            recorded.append(self)

        def query(self) -> bool:
            return self.done

        def elapsed_time(self, end: Event) -> float:
            assert self.done and end.done, "reading an unfinished event waits or fails"
            return 1000.0 * (end.at - self.at)

        def synchronize(self) -> None:
            raise AssertionError("the timer waited for the device")

    monkeypatch.setattr(torch.cuda, "Event", Event)
    timer = DeviceTimer(torch.device("cuda"))
    heard: list[float] = []
    for _ in range(2):
        with timer(heard.append):
            pass
    timer.collect()
    assert heard == []  # nothing has run yet
    recorded[0].done = recorded[1].done = True
    timer.collect()
    assert heard == [1.0]
    for event in recorded:
        event.done = True
    timer.collect()
    assert heard == [1.0, 1.0]


@pytest.mark.parametrize("batch_size", [1, 8, 32])
def test_a_step_runs_one_draft_forward_per_draft_position(tiny, batch_size: int) -> None:
    """Sidecar rows ride in the main rows' proposal forwards: a step with drafting rows and sidecar rows runs
    the draft as often as the verify is wide, never once more for the sidecars."""
    engine = SidecarEngine(tiny, gamma=4, adaptive=False)
    requests = [SidecarRequest(document=f"document number {i} " * (2 + i % 3), sidecars=[HASHTAGS],
                               max_new_tokens=4 + 7 * (i % 5)) for i in range(2 * batch_size + 3)]
    counts = Forwards(tiny)
    steps: list[tuple[int, object]] = []
    sidecar_batch = engine.batch(batch_size)
    step = sidecar_batch.slots.step

    def counted() -> list:
        before, recorded = counts.decode["draft"], sidecar_batch.slots.trace.steps_recorded
        done = step()
        if sidecar_batch.slots.trace.steps_recorded > recorded:
            steps.append((counts.decode["draft"] - before, sidecar_batch.slots.trace.steps[-1]))
        return done

    sidecar_batch.slots.step = counted
    with mock.patch.object(batch, "prefill", counts.wrap(batch.prefill)):
        results = [r for _, r in stream_through(sidecar_batch, requests)]
    counts.remove()
    assert len(results) == len(requests)
    mixed = [(n, s) for n, s in steps if s.live and s.riders and s.width and s.source == "draft"]
    assert mixed, "no step had drafting main rows and sidecar rows together"
    for forwards, record in steps:
        assert forwards == record.draft_forwards
        assert forwards <= max(record.width, 1) <= engine.decoder.gamma
    assert all(n == s.width for n, s in mixed)


@pytest.mark.parametrize("mode", ["fixed, early stop", "sampled", "copying", "logprobs"])
def test_the_steps_counted_syncs_are_every_sync_a_step_makes(tiny, mode: str) -> None:
    """The run's syncs per step (``sidecar.runtime.step_counters``, counted where the step reads) agree with
    the counter that intercepts every torch call, step by step: no read of a step escapes its count."""
    config = MODES[mode]
    prompts = random_prompts(tiny, 4, seed=5, every_token=config.get("every_token", False))
    decoder = SpeculativeDecoder(tiny, gamma=4, **config["decoder"])
    counters = step_counters.counters_of(tiny)
    before = (counters.steps, counters.syncs)
    intercepted = []
    real_counting = batch.counting

    @contextmanager
    def both(step_counters_):
        with real_counting(step_counters_), SyncCounter() as syncs:
            yield step_counters_
        intercepted.append(syncs.total)

    with mock.patch.object(batch, "counting", both):
        decoder.generate(prompts, max_new_tokens=20, batch_size=4, **config.get("generate", {}))
    steps, syncs = counters.steps - before[0], counters.syncs - before[1]
    assert steps == len(intercepted) > 3
    assert syncs == sum(intercepted) >= steps, (syncs, intercepted)
    stats = step_counters.counters_of(tiny).as_dict()
    assert stats["syncs_per_step"] >= 1 and stats["host_ms_per_step"] > 0
