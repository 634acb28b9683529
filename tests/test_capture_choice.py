"""``auto`` on a CPU: eager or compile, whichever runs the pair's step faster here, measured once per key
(``sidecar.decoding.capture_choice``)."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from sidecar.decoding.capture_choice import (
    CACHE_FILE,
    CAPACITY,
    StepTimes,
    TimedShape,
    busy,
    choice_key,
    choose_cpu_capture,
    faster_mode,
    remember,
    timed_shape,
)
from sidecar.decoding.decoder import SpeculativeDecoder
from sidecar.errors import InputError
from sidecar.models.cpu_kernels import onednn_layers, use_onednn_linear
from sidecar.models.tiny import tiny_pair
from sidecar.runtime.capture import runner_of
from sidecar.tasks.engine import SidecarEngine
from tests.decoding import random_prompts


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh SIDECAR_HOME, auto asked for (the test session pins eager), and a quiet machine whatever the
    test machine's load: a choice timed busy would be timed again (``busy``)."""
    monkeypatch.setenv("SIDECAR_HOME", str(tmp_path))
    monkeypatch.delenv("SIDECAR_CAPTURE")
    monkeypatch.setattr(os, "getloadavg", lambda: (0.5, 0.5, 0.5))
    return tmp_path


class Timings:
    """A measuring function that returns set times and counts its calls (the real one compiles: one test)."""

    def __init__(self, compiled: StepTimes, eager: StepTimes) -> None:
        self.times, self.calls = (compiled, eager, 3.0), []

    def __call__(self, target, draft, shape):
        self.calls.append((target, draft, shape))
        return self.times


FAST, SLOW = StepTimes(0.004, 0.001), StepTimes(0.006, 0.002)


def runner_modes(model) -> set[str]:
    return set(model.__dict__.get("sidecar_runners", {}))


def test_the_faster_step_wins_and_the_reason_says_what_was_timed():
    mode, reason = faster_mode(FAST, SLOW, 12.34)
    assert mode == "compile"
    assert reason == ("auto: compiled step 8.00 ms (verify 4.00 + 4 drafts 4.00) vs eager step 14.00 ms "
                      "(verify 6.00 + 4 drafts 8.00), timed at 4 rows, gamma 4 (compiling took 12.3 s)")
    assert faster_mode(SLOW, FAST, 1.0)[0] == "eager"
    assert ", timed at 4 rows, gamma 4, load 7.5 on 2 cores (compiling" in faster_mode(SLOW, FAST, 1.0, 7.5, 2)[1]
    assert faster_mode(FAST, FAST, 1.0)[0] == "eager", "a tie keeps eager: nothing to compile"
    # compile must save a tenth of eager's step: it compiles every new shape a run meets besides
    assert faster_mode(StepTimes(0.0089), StepTimes(0.01), 1.0)[0] == "compile"
    assert faster_mode(StepTimes(0.0091), StepTimes(0.01), 1.0) == (
        "eager", "auto: compiled verify 9.10 ms vs eager verify 10.00 ms, compiled saves under 10%, timed at 4 rows, "
        "gamma 4 (compiling took 1.0 s)")
    # the step counts every draft forward: a faster verify with slower drafts loses
    assert faster_mode(StepTimes(0.003, 0.002), StepTimes(0.004, 0.001), 1.0)[0] == "eager"
    assert "compiled verify 3.00 ms vs eager verify 4.00 ms" in faster_mode(StepTimes(0.003), StepTimes(0.004), 1)[1]
    # compiled, the last 3 drafts run as one chained call: it counts once, in place of 3 forwards
    chained = StepTimes(0.004, 0.001, 0.0015)
    assert chained.step_s == pytest.approx(0.0065)
    assert faster_mode(chained, StepTimes(0.005, 0.0008), 1.0) == (
        "compile", "auto: compiled step 6.50 ms (verify 4.00 + 4 drafts 2.50, chained) vs eager step 8.20 ms "
        "(verify 5.00 + 4 drafts 3.20), timed at 4 rows, gamma 4 (compiling took 1.0 s)")
    # a step of gamma 2 drafts twice: one chained call after the first, or one more forward
    assert StepTimes(0.004, 0.001, gamma=2).drafts_s == pytest.approx(0.002)
    assert "16 rows, gamma 2" in faster_mode(StepTimes(0.004, 0.001, 0.0005, 2), StepTimes(0.005, 0.001, gamma=2), 1.0,
                                             shape=TimedShape(16, 2))[1]


def test_a_choice_is_measured_once_per_key_and_remembered(home, monkeypatch):
    pair = tiny_pair(layers=1)
    timings = Timings(FAST, SLOW)
    first = choose_cpu_capture(pair.target, pair.draft, timings)
    assert first[0] == "compile" and len(timings.calls) == 1
    stored = json.loads((home / CACHE_FILE).read_text())["choices"]
    assert stored[choice_key(pair.target, pair.draft)]["reason"] == first[1]
    # the same shapes on the same machine: another load of the pair measures nothing
    assert choose_cpu_capture(tiny_pair(layers=1).target, tiny_pair(layers=1).draft, timings) == first
    assert len(timings.calls) == 1
    # what decides it changed: measured again, and each remembered
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    choose_cpu_capture(pair.target, pair.draft, timings)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 7)
    choose_cpu_capture(pair.target, pair.draft, timings)
    other = tiny_pair(layers=2)
    choose_cpu_capture(other.target, other.draft, timings)
    choose_cpu_capture(other.target, None, timings)  # the target alone: another key
    assert len(timings.calls) == 5
    assert len(json.loads((home / CACHE_FILE).read_text())["choices"]) == 5


def test_a_choice_is_timed_at_the_runs_batch_bucket_and_gamma_and_remembered_per_shape(home):
    """A run's batch limit and gamma pick the step timed (its bucket at the limit, at most 16 rows), and the
    choice is remembered per shape: a batch-32 nightly run and a batch-1 server each time their own, and a
    limit of 24 shares the 32's bucket."""
    assert [timed_shape(n).rows for n in (None, 1, 3, 8, 12, 24, 32, 512)] == [4, 1, 3, 8, 12, 16, 16, 16]
    assert timed_shape(32, gamma=2) == TimedShape(16, 2)
    pair = tiny_pair(layers=1)
    timings = Timings(FAST, SLOW)
    nightly = choose_cpu_capture(pair.target, pair.draft, timings, shape=timed_shape(32, 3))
    server = choose_cpu_capture(pair.target, pair.draft, timings, shape=timed_shape(1, 4))
    assert [shape for _, _, shape in timings.calls] == [TimedShape(16, 3), TimedShape(1, 4)]
    assert "timed at 16 rows, gamma 3" in nightly[1] and "timed at 1 rows, gamma 4" in server[1]
    assert choose_cpu_capture(pair.target, pair.draft, timings, shape=timed_shape(24, 3)) == nightly
    assert choose_cpu_capture(pair.target, pair.draft, timings, shape=timed_shape(1, 4)) == server
    assert len(timings.calls) == 2, "a shape timed before was timed again"
    choose_cpu_capture(pair.target, pair.draft, timings, shape=timed_shape(32, 4))  # another gamma: its own
    assert len(timings.calls) == 3
    assert len(json.loads((home / CACHE_FILE).read_text())["choices"]) == 3


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"choices": 3}', ""])
def test_a_corrupt_cache_is_ignored_with_a_warning_and_rewritten(home, caplog, content):
    pair = tiny_pair(layers=1)
    (home / CACHE_FILE).write_text(content)
    timings = Timings(SLOW, FAST)
    with caplog.at_level(logging.WARNING, "sidecar.decoding.capture_choice"):
        assert choose_cpu_capture(pair.target, pair.draft, timings)[0] == "eager"
    assert len(timings.calls) == 1 and "capture choice cache" in caplog.text and "ignored" in caplog.text
    assert choice_key(pair.target, pair.draft) in json.loads((home / CACHE_FILE).read_text())["choices"]


def test_a_choice_timed_on_a_busy_machine_is_timed_again_once_it_is_quiet(home):
    assert busy(3.1, 2) and not busy(3.0, 2) and not busy(None, None)
    pair = tiny_pair(layers=1)
    timings, machine = Timings(FAST, SLOW), {"load": 9.0}

    def load():
        return machine["load"], 2

    assert "load 9.0 on 2 cores" in choose_cpu_capture(pair.target, pair.draft, timings, load)[1]
    choose_cpu_capture(pair.target, pair.draft, timings, load)
    assert len(timings.calls) == 1, "still busy: the busy choice is used, not timed again"
    machine["load"] = 1.0
    assert "load 1.0 on 2 cores" in choose_cpu_capture(pair.target, pair.draft, timings, load)[1]
    assert len(timings.calls) == 2, "quiet now: timed again"
    machine["load"] = 9.0
    choose_cpu_capture(pair.target, pair.draft, timings, load)
    assert len(timings.calls) == 2, "a choice timed quiet stands"
    stored = json.loads((home / CACHE_FILE).read_text())["choices"][choice_key(pair.target, pair.draft)]
    assert stored["busy"] is False and "load 1.0" in stored["reason"]


def test_a_malformed_entry_is_measured_again_and_an_unwritable_home_costs_a_warning(home, monkeypatch, caplog):
    tmp_path = home
    pair = tiny_pair(layers=1)
    key = choice_key(pair.target, pair.draft)
    (tmp_path / CACHE_FILE).write_text(json.dumps({"choices": {key: {"mode": "cudagraph", "reason": "?"}}}))
    timings = Timings(FAST, SLOW)
    assert choose_cpu_capture(pair.target, pair.draft, timings)[0] == "compile" and len(timings.calls) == 1
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("SIDECAR_HOME", str(blocked / "home"))  # its parent is a file: nothing can be written
    with caplog.at_level(logging.WARNING, "sidecar.decoding.capture_choice"):
        assert choose_cpu_capture(pair.target, pair.draft, timings)[0] == "compile"
    assert "not remembered" in caplog.text and len(timings.calls) == 2


def test_a_failed_measurement_gives_eager_and_says_why(home):
    pair = tiny_pair(layers=1)

    def broken(target, draft, shape):
        raise RuntimeError("inductor cannot lower this\nmore")

    assert choose_cpu_capture(pair.target, pair.draft, broken) == (
        "eager", "auto: eager (compiling failed: RuntimeError: inductor cannot lower this)")
    assert choose_cpu_capture(pair.target, pair.draft, Timings(FAST, SLOW))[0] == "eager", "remembered"


def test_the_decoder_records_the_remembered_choice_on_the_pair_and_measures_nothing(home):
    """A load whose key is remembered attaches that mode's runners only (measuring attaches both) and records
    the remembered reason, which a run stores as its capture (``ModelPair.capture_report``). The key is the
    step the decoder's run will take: its batch limit's bucket and its gamma."""
    pair = tiny_pair(layers=1)
    reason = "auto: compiled step 1.00 ms vs eager step 2.00 ms"
    remember(home / CACHE_FILE, choice_key(pair.target, pair.draft), "eager", reason)
    SpeculativeDecoder(pair)
    assert pair.capture_report == f"eager ({reason})"
    assert runner_modes(pair.target) == {"eager"} == runner_modes(pair.draft)
    engine_pair = tiny_pair(layers=1)
    remember(home / CACHE_FILE, choice_key(engine_pair.target, engine_pair.draft, TimedShape(8, 2)), "eager", "8 x 2")
    SidecarEngine(engine_pair, gamma=2, max_batch=8)
    assert engine_pair.capture_report == "eager (8 x 2)"
    with pytest.raises(InputError, match="max_batch"):
        SpeculativeDecoder(tiny_pair(layers=1), max_batch=0)


@pytest.mark.parametrize("explicit", ["argument", "environment"])
def test_explicit_modes_never_measure(home, monkeypatch, explicit):
    pair = tiny_pair(layers=1)
    if explicit == "argument":
        SpeculativeDecoder(pair, capture="compile")
        assert pair.capture_report == "compile (capture=compile)"
    else:
        monkeypatch.setenv("SIDECAR_CAPTURE", "compile")
        SpeculativeDecoder(pair)
        assert pair.capture_report == "compile (SIDECAR_CAPTURE=compile)"
    assert runner_modes(pair.target) == {"compile"} and runner_of(pair.target).counters.compiles == 0
    assert not (home / CACHE_FILE).exists()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_auto_on_a_cpu_times_the_pair_compiled_and_eager_and_a_second_load_measures_nothing(home):
    """The real measurement (one-layer pair: compiling is slow on a CPU): both modes' forwards timed, the
    faster attached with its reason, the compiled runner holding the shape it compiled; a second pair of the
    same shapes attaches the remembered mode without timing anything."""
    pair = tiny_pair(layers=1)
    SpeculativeDecoder(pair, gamma=2, max_batch=2)
    assert pair.capture_reason.startswith("auto: compiled step ") and " vs eager step " in pair.capture_reason
    assert "timed at 2 rows, gamma 2" in pair.capture_reason
    assert runner_modes(pair.target) == {"eager", "compile"} == runner_modes(pair.draft), "both timed"
    assert runner_of(pair.target).mode == pair.capture_mode in ("eager", "compile")
    compiled = pair.target.__dict__["sidecar_runners"]["compile"]
    assert compiled.counters.compiles == 1 and compiled.counters.recompiles == 0
    assert set(compiled.counters.shapes) == {(2, 3, CAPACITY + 1)}, "the run's step was not the one timed"
    again = tiny_pair(layers=1)
    SpeculativeDecoder(again, gamma=2, max_batch=2)
    assert again.capture_report == pair.capture_report
    assert runner_modes(again.target) == {pair.capture_mode}, "nothing timed"



def test_fp32_packed_layers_keep_auto_eager_unmeasured_and_compile_by_name_unpacks_them(home):
    """fp32 Linear layers in oneDNN's packed layout (how a CPU load runs fp32: ``use_onednn_linear``) are a
    module buffer inductor cannot lower (an InductorError at the first compiled forward): auto keeps them and
    eager without timing anything, saying why; compile asked for by name unpacks them to the same weights in
    the plain layout and decodes what eager decodes over the packed ones."""
    pair = tiny_pair(layers=1)
    assert use_onednn_linear(pair.target) and use_onednn_linear(pair.draft)
    prompts = random_prompts(pair, [5, 9])
    eager = [o.token_ids for o in SpeculativeDecoder(pair, gamma=2).generate(prompts, max_new_tokens=6)]
    assert pair.capture_mode == "eager" and "packed layout" in pair.capture_reason
    assert runner_modes(pair.target) == {"eager"} and not (home / CACHE_FILE).exists(), "auto timed something"
    packed = onednn_layers(pair.target) + onednn_layers(pair.draft)
    compiled = SpeculativeDecoder(pair, gamma=2, capture="compile").generate(prompts, max_new_tokens=6)
    assert [o.token_ids for o in compiled] == eager
    assert f"{packed} oneDNN-packed Linear layers unpacked" in pair.capture_reason
    assert onednn_layers(pair.target) == onednn_layers(pair.draft) == 0
    assert runner_of(pair.target).counters.compiles >= 1
