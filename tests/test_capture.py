"""Capture modes (``sidecar.runtime.capture``): our decoder stack equals Hugging Face's forward, and a compiled
engine keeps greedy identity with rows joining and leaving and sidecars evicting their document, with no graph
break and no recompile after warm-up. Compiled tests use a one-layer pair: compiling is slow on a CPU."""

from __future__ import annotations

import re
import threading
from collections import Counter

import pytest
import torch

from sidecar.decoding.batch import stream_through
from sidecar.decoding.decoder import SpeculativeDecoder
from sidecar.decoding.divergence import NEAR_TIE, divergence
from sidecar.decoding.draft_chain import chained_drafts
from sidecar.decoding.lookup import lookup_continuation
from sidecar.decoding.rows import DecodeRow
from sidecar.decoding.trace import BatchTrace
from sidecar.errors import InputError
from sidecar.models.cpu_kernels import onednn_available
from sidecar.models.tiny import tiny_pair
from sidecar.runtime.capture import (
    ACCUMULATED_LIMIT,
    RECOMPILE_LIMIT,
    ForwardShape,
    StackRunner,
    batch_bucket,
    capacity_bucket,
    resolve_capture,
    runner_of,
    width_bucket,
)
from sidecar.runtime.kv_cache import RowKVCache
from sidecar.runtime.warmup import allocation_default, load_capacities, set_sampled, warms_at_load
from sidecar.tasks.engine import SidecarEngine
from sidecar.tasks.rows import SidecarRequest
from sidecar.tasks.task import HASHTAGS, SidecarTask
from tests.decoding import assert_speculated, hidden_states, random_prompts, target_alone

TITLE = SidecarTask(name="title", instruction="Then write a title.", max_new_tokens=6)
# a constrained sidecar: its row's matcher masks each draft forward's logits, so it drafts a forward at a time
TOPIC = SidecarTask(name="topic", instruction="Then give its topic.", max_new_tokens=12,
                    choices=["politics", "economy", "city news"])
DOCS = ["The city council approved a new budget on Tuesday after a long debate about schools.",
        "Prices rose 3.5 percent in 2017 while 1,200 workers lost their jobs at the factory in the north.",
        "The president met leaders in Berlin."]


@pytest.mark.parametrize("mode", ["eager", pytest.param("compile", marks=pytest.mark.slow)])
def test_our_stack_equals_hugging_faces_forward(mode):
    pair = tiny_pair(layers=1)
    for ours, theirs in zip(hidden_states(pair, mode), hidden_states(pair, "hf"), strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_a_torch_compile_without_the_region_limit_keyword_still_compiles(monkeypatch):
    """torch 2.11, the GPU image's, has no ``recompile_limit`` keyword on ``torch.compile`` (2.12 added it): the
    runner compiles without it there, dynamo's per-thread config holding the limit (``configure_thread``)."""
    from sidecar.runtime import capture

    real, modes = torch.compile, []

    def compile_of_torch_2_11(model=None, *, fullgraph=False, dynamic=None, backend="inductor", mode=None,
                              options=None, disable=False):
        modes.append(mode)
        return real(model, fullgraph=fullgraph, dynamic=dynamic, backend=backend, mode=mode, options=options,
                    disable=disable)

    monkeypatch.setattr(torch, "compile", compile_of_torch_2_11)
    monkeypatch.setattr(capture, "_compile_parameters", lambda: frozenset({"model", "fullgraph", "mode"}))
    assert capture.region_limits() == {}
    pair = tiny_pair(layers=1)
    for ours, theirs in zip(hidden_states(pair, "compile"), hidden_states(pair, "hf"), strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert modes == [None]
    monkeypatch.undo()
    assert capture.region_limits() == {"recompile_limit": RECOMPILE_LIMIT}  # torch 2.12 on: the region's own too


def test_hugging_faces_forward_gets_the_cache_by_the_keyword_its_version_takes():
    """transformers 5.25 takes the cache as ``cache``; 5.17, the GPU image's, as ``past_key_values``, and would
    swallow ``cache`` in its ``**kwargs``: the forward would attend to its own tokens only."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Model

    from sidecar.runtime.forward import cache_keyword

    class OlderQwen2Model(Qwen2Model):  # the keyword as transformers 5.17 names it
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                    use_cache=None, **kwargs):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   cache=past_key_values, use_cache=use_cache, **kwargs)

    assert cache_keyword(Qwen2Model) == "cache" and cache_keyword(OlderQwen2Model) == "past_key_values"
    pair = tiny_pair(layers=1)
    expected = hidden_states(pair, "hf")
    pair.target.base_model.__class__ = OlderQwen2Model
    for older, newer in zip(hidden_states(pair, "hf"), expected, strict=True):
        torch.testing.assert_close(older, newer)


def test_buckets():
    assert [batch_bucket(n, 12) for n in (1, 3, 5, 9, 12)] == [1, 4, 8, 12, 12]
    assert [width_bucket(n) for n in (1, 5, 8, 9, 17)] == [1, 5, 8, 16, 32]
    assert [capacity_bucket(n) for n in (1, 64, 65, 300)] == [64, 64, 128, 512]


def test_warm_up_setting_says_which_modes_warm_at_load_and_on_allocation(monkeypatch):
    """``SIDECAR_WARMUP``: auto warms ``cudagraph`` only, on ``compile`` too, off nothing; eager and hf never.
    It is ``SpeculativeDecoder``'s default for warming each new cache; a bad value names the variable."""
    expected = {"auto": {"cudagraph"}, "on": {"compile", "cudagraph"}, "off": set()}
    for setting, modes in expected.items():
        monkeypatch.setenv("SIDECAR_WARMUP", setting)
        assert {mode for mode in ("eager", "compile", "cudagraph", "hf") if warms_at_load(mode)} == modes
        assert allocation_default() == {"auto": None, "on": True, "off": False}[setting]
    pair = tiny_pair(layers=1)
    monkeypatch.setenv("SIDECAR_WARMUP", "on")
    SpeculativeDecoder(pair, capture="compile")
    assert runner_of(pair.target).warm_on_allocate and runner_of(pair.draft).warm_on_allocate
    monkeypatch.setenv("SIDECAR_WARMUP", "sometimes")
    with pytest.raises(InputError, match="SIDECAR_WARMUP"):
        warms_at_load("compile")


def test_a_load_warms_the_capacity_buckets_from_the_shortest_need_at_most_four():
    """Every bucket from the shortest row's to the longest's, but no more than the pools keep free per model."""
    assert load_capacities(1, 4096) == [64, 128, 256, 512]
    assert load_capacities(100, 300) == [128, 256, 512]
    assert load_capacities(600, 100) == [1024]


def test_modes_resolve_with_their_reason(monkeypatch):
    model = tiny_pair(layers=1).target
    cpu = torch.device("cpu")
    monkeypatch.delenv("SIDECAR_CAPTURE", raising=False)
    assert resolve_capture(None, cpu, model)[0] == "eager", "auto on a CPU with nothing to decide it"
    decided = ("compile", "auto: compiled step 1 ms vs eager step 2 ms")
    assert resolve_capture(None, cpu, model, lambda: decided) == decided, "the CPU's auto decides"
    assert resolve_capture("auto", cpu, model, lambda: decided) == decided

    def never() -> tuple[str, str]:
        raise AssertionError("an explicit mode measures nothing")

    monkeypatch.setenv("SIDECAR_CAPTURE", "compile")
    assert resolve_capture(None, cpu, model, never) == ("compile", "SIDECAR_CAPTURE=compile")
    assert resolve_capture("eager", cpu, model, never) == ("eager", "capture=eager")
    with pytest.raises(InputError, match="CUDA"):
        resolve_capture("cudagraph", cpu, model)
    monkeypatch.setenv("SIDECAR_CAPTURE", "graphs")
    with pytest.raises(InputError, match="SIDECAR_CAPTURE"):
        resolve_capture(None, cpu, model)


def counters(pair) -> dict:
    return {name: runner_of(model).counters for name, model in (("target", pair.target), ("draft", pair.draft))}


def planned_shapes(traces: list[BatchTrace]) -> dict[str, Counter]:
    """Per model, the (batch, width) of every decode forward the steps' plans named (a chain's as (batch, 1,
    its forwards); a first draft forward's once per feed chunk), from the batches' traces."""
    planned = {"target": Counter(), "draft": Counter()}
    for step in (step for trace in traces for step in trace.steps):
        if step.target_shape is not None:
            planned["target"][(step.target_shape.batch, step.target_shape.width)] += 1
        if step.draft_shape is not None:  # a wide feed's chunks each run it
            planned["draft"][(step.draft_shape.batch, step.draft_shape.width)] += step.feed_chunks
        if step.next_draft_shape is not None:
            later = (step.next_draft_shape.batch, step.next_draft_shape.width)
            if step.chained_forwards:
                planned["draft"][(*later, step.chained_forwards)] += 1
            else:
                planned["draft"][later] += step.draft_forwards - 1
    return planned


def ran_shapes(pair) -> dict[str, Counter]:
    """Per model, the (batch, width) of every decode forward its runner ran outside warm-up (a chain's as
    (batch, 1, its forwards)): the counters' shapes without their KV columns."""
    ran = {}
    for name, counter in counters(pair).items():
        ran[name] = Counter()
        warm = sum((w.calls for w in runner_of(getattr(pair, name)).warm_ups), Counter())
        for shape, calls in (counter.shapes - warm).items():
            ran[name][shape[:2] if len(shape) == 3 else (*shape[:2], shape[3])] += calls
    return ran


def quoting_its_continuation(pair, prompt: list[int], gamma: int) -> list[int]:
    """``prompt`` with two of its tokens replaced by the target's first two greedy tokens after it, at the
    first place where the target then still continues with them: a document its continuation quotes, what
    prompt lookup is for. The row's first step, its first token pending, finds ``gamma`` tokens to copy and
    the target accepts the first, whatever the timing (greedy tokens only decide it)."""
    first = target_alone(pair, prompt, 2)
    for start in range(len(prompt) - 2):
        quoted = first
        for _ in range(4):  # planting the tokens changes what follows them: plant what follows then
            planted = prompt[:start] + quoted + prompt[start + 2 :]
            following = target_alone(pair, planted, 2)
            copies = lookup_continuation(planted + following[:1], gamma)
            if following == quoted and len(quoted) == 2 and max(quoted) < len(pair.tokenizer) \
                    and len(copies) == gamma and copies[0] == quoted[1]:
                return planted
            quoted = following
    raise AssertionError(f"no prompt of {len(prompt)} tokens quotes its continuation: pick other prompts")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("asked", "packed"), [("eager", True), ("compile", False), (None, False)])
def test_a_pair_asked_to_compile_on_a_cpu_keeps_plain_linear_layers_for_inductor(monkeypatch, asked, packed):
    """fp32 on a CPU packs Linear weights for oneDNN, which inductor's lowering refuses (it asserts the packed
    weight is a frozen constant): a pair asked to compile, by argument or SIDECAR_CAPTURE, keeps plain layers."""
    from sidecar.models.cpu_kernels import OneDNNLinear
    from sidecar.models.loading import load_pair

    if not onednn_available():
        pytest.skip("this torch build has no oneDNN")
    monkeypatch.setenv("SIDECAR_CAPTURE", "compile")
    pair = load_pair("tiny", dtype="fp32", capture=asked)
    layer = pair.target.model.layers[0].mlp.up_proj
    assert isinstance(layer, OneDNNLinear) is packed and isinstance(layer, torch.nn.Linear) is not packed


def test_compiled_engine_is_identical_and_compiles_nothing_after_warm_up(monkeypatch):
    """Compiled forwards (one-layer pair: compiling is slow on a CPU), every cache warmed as it is allocated
    (``SIDECAR_WARMUP=on``): rows of varied lengths join a batch of 4 as slots free, each equal to the target alone,
    at a fixed gamma (the prompts quote their continuation: the first step copies, runs no draft forward and leaves
    a 3-column backlog) and adaptive (its exploration takes a plain step, growing the backlog); then sidecar tasks
    after the main output (the document evicted, three tasks, one constrained to its choices: bridges wider than any
    warmed width, finished rows catching up) decode exactly as in eager mode, the draft forwards after each step's
    first chained into one graph call (``sidecar.decoding.draft_chain``). Every forward ran the padded shape its
    step's plan named, no other, and none compiled outside warm-up: a first draft feed takes the widths 1, 2 and
    gamma + 3 only, wider ones in chunks (``sidecar.decoding.plan.feed_chunking``). No forward breaks the graph, and
    no shape compiles twice. No assertion rests on timings, whatever the load: of the adaptive stream's choices
    (``GammaController.choose``, fitted to timed forwards) only its exploration's are read, made before any fit, and
    the rest holds whatever it chooses."""
    monkeypatch.setenv("SIDECAR_WARMUP", "on")
    pair = tiny_pair(layers=1)
    SpeculativeDecoder(pair, gamma=3, capture="compile")
    set_sampled(pair.draft, False)  # greedy rows only here; tests/test_draft_chain.py warms the sampled chains
    lengths = torch.randint(3, 30, (7,), generator=torch.Generator().manual_seed(0)).tolist()
    # each prompt quotes its continuation, so the fixed gamma's first step copies for all four rows: random
    # prompts alone never all have a copy at once, and the adaptive stream copies only when timings say so
    prompts = [quoting_its_continuation(pair, prompt, 3) for prompt in random_prompts(pair, lengths)]
    # every row needs more than 64 KV columns: one capacity (128), as the sidecars', so one warm-up per pool
    limits = [62 + 3 * (i % 4) for i in range(len(prompts))]
    traces = []
    for adaptive in (False, True):
        batch = SpeculativeDecoder(pair, gamma=3, adaptive=adaptive).batch(4)
        traces.append(batch.trace)
        order = sorted(range(len(prompts)), key=lambda i: lengths[i])  # as ``generate`` admits them
        outputs = dict(stream_through(batch, [DecodeRow(prompts[i], limits[i]) for i in order], order))
        outputs = [outputs[i] for i in range(len(prompts))]
        for prompt, limit, output in zip(prompts, limits, outputs, strict=True):
            assert output.token_ids == target_alone(pair, prompt, limit)
        assert_speculated(outputs)
    copied = [k for k, step in enumerate(traces[0].steps) if step.source == "lookup" and step.width
              and not step.draft_forwards]
    assert copied, "the fixed gamma took no lookup step"
    after = traces[0].steps[copied[0] + 1]  # fed the pending token, the copy accepted and the new pending one
    assert after.draft_feed >= 3, "no lookup step left the draft a backlog"
    assert after.draft_shape is not None and after.draft_shape.width == 6, f"a backlog not padded: {after}"
    assert any(step.live and not step.width and not step.draft_forwards for step in traces[1].steps[:3]), \
        "the adaptive stream's exploration took no plain step"

    # with logprobs, or constrained: a sidecar row drafts one forward at a time (``chain_applies``), main rows
    # still chain
    requests = [SidecarRequest(doc, sidecars=[HASHTAGS, TITLE, TOPIC], max_new_tokens=8, top_logprobs=1)
                for doc in DOCS]

    def sidecars() -> list:
        engine = SidecarEngine(pair, gamma=3, adaptive=False)
        batch = engine.batch(2)
        traces.append(batch.trace)
        order = sorted(range(len(requests)), key=lambda i: len(engine.prompts(requests[i])[0].token_ids))
        results = dict(stream_through(batch, [requests[i] for i in order], order))  # as ``SidecarEngine.run``
        return [(results[i].main.token_ids, {name: s.token_ids for name, s in results[i].sidecars.items()})
                for i in range(len(requests))]

    compiled = sidecars()
    compiles = {name: c.compiles for name, c in counters(pair).items()}
    assert compiled == sidecars(), "a second compiled run differs"
    assert {name: c.compiles for name, c in counters(pair).items()} == compiles, "the second run compiled"
    assert ran_shapes(pair) == planned_shapes(traces), "a forward ran a shape its plan did not name"
    planned = [shape for trace in traces for step in trace.steps
               for shape in (step.target_shape, step.draft_shape) if shape is not None]
    assert any(shape.batch > shape.rows for shape in planned), "no step padded its batch: the check proves little"
    for name, counter in counters(pair).items():
        runner = runner_of(getattr(pair, name))
        assert counter.graph_breaks == 0, name
        assert counter.recompiles == 0, name
        assert counter.compiles >= 1, f"the {name}'s forwards were never compiled"
        assert counter.compiles == sum(w.compiles for w in runner.warm_ups), f"the {name} compiled after warm-up"
        assert len(counter.shapes) <= sum(w.shapes for w in runner.warm_ups), f"{name}: {sorted(counter.shapes)}"
    steps = [step for trace in traces for step in trace.steps]
    fed = {(step.draft_feed, step.draft_shape.width, step.feed_chunks) for step in steps if step.draft_shape}
    assert any(3 <= feed <= 6 and width == 6 for feed, width, _ in fed), f"no feed padded to gamma + 3: {fed}"
    assert any(chunks > 1 for *_, chunks in fed), f"no feed ran in chunks: {fed}"
    draft = counters(pair)["draft"]  # a chain's shape names its forwards: (batch, 1, columns, forwards, flags)
    chains = sum(calls for shape, calls in draft.shapes.items() if len(shape) > 3)
    assert draft.chained_forwards > chains > 0, "a step's draft forwards after its first did not run as one call"
    SpeculativeDecoder(pair, capture="eager")
    assert sidecars() == compiled


def test_a_compiled_gamma_zero_decodes_plainly_and_its_sidecars_catch_up_in_warmed_chunks(monkeypatch):
    """gamma 0 compiled (one-layer pair, every cache warmed as allocated): rows joining and leaving a batch of 2
    decode plainly at the one verify width warm-up compiled, equal to the target alone; a sidecar row's draft,
    never fed while its main output decodes, catches up on all of it in chunks of the feed width warm-up
    compiled, and its tags equal eager mode's. Nothing compiles after warm-up; no graph breaks."""
    monkeypatch.setenv("SIDECAR_WARMUP", "on")
    pair = tiny_pair(layers=1)
    SpeculativeDecoder(pair, gamma=0, capture="compile")
    set_sampled(pair.draft, False)
    prompts = random_prompts(pair, [4, 11, 7], seed=9)
    outputs = SpeculativeDecoder(pair, gamma=0).generate(prompts, max_new_tokens=10, batch_size=2)
    assert [o.token_ids for o in outputs] == [target_alone(pair, p, 10) for p in prompts]
    assert all(o.stats.draft_forwards == 0 for o in outputs)
    assert runner_of(pair.draft).warm_ups == [], "the draft was prefilled without a sidecar"

    def tags() -> list:
        engine = SidecarEngine(pair, gamma=0)
        batch = engine.batch(2)
        results = dict(stream_through(batch, [SidecarRequest(doc, sidecars=[HASHTAGS], max_new_tokens=8)
                                              for doc in DOCS[:2]]))
        return batch.trace, [(results[i].main.token_ids, results[i].sidecars["hashtags"].token_ids) for i in (0, 1)]

    trace, compiled = tags()
    assert any(step.feed_chunks > 1 for step in trace.steps), "no catch-up ran in chunks"
    for name, counter in counters(pair).items():
        assert counter.graph_breaks == 0 and counter.recompiles == 0, name
        assert counter.compiles == sum(w.compiles for w in runner_of(getattr(pair, name)).warm_ups), \
            f"the {name} compiled after warm-up"
    SpeculativeDecoder(pair, capture="eager")
    assert tags()[1] == compiled


def test_a_compiled_copy_past_gamma_verifies_at_the_width_warm_up_compiled(monkeypatch):
    """An adaptive step may copy more than gamma tokens (``max_copy``, 10 here): where the target compiles, the
    longest copy's verify (11 columns, padded to 16) is warmed with the others, copies past gamma take only the
    lengths that pad to it (``sidecar.decoding.plan.copy_widths``), and nothing compiles after warm-up. The
    draft does not pay its prefill here, so only the target's cache is allocated and warmed (batch bucket 1)."""
    from tests.test_engine import copying_controller, lookup_widths, reference_copier

    monkeypatch.setenv("SIDECAR_WARMUP", "on")
    pair = tiny_pair(layers=1)
    prompts = random_prompts(pair, [9], seed=3)
    expected, copy = reference_copier(pair, prompts, 30, miss=0.0, corrupt=0.5)
    monkeypatch.setattr("sidecar.decoding.plan.lookup_continuation", copy)
    decoder = SpeculativeDecoder(pair, gamma=2, capture="compile", max_copy=10)
    copying_controller(decoder)
    batch = decoder.batch(1)
    outputs = dict(stream_through(batch, [DecodeRow(prompts[0], 30)]))
    assert outputs[0].token_ids == expected[tuple(prompts[0])]
    assert max(lookup_widths(decoder)) > 2 and set(lookup_widths(decoder)) <= {1, 2, 8, 9, 10}
    runner = runner_of(pair.target)
    warmed = {shape[:2] for w in runner.warm_ups for shape in w.calls}
    assert (1, 16) in warmed, f"the longest copy's verify was not warmed: {sorted(warmed)}"
    assert any(step.target_shape == ForwardShape(1, 1, 16) for step in batch.trace.steps)
    assert set(ran_shapes(pair)["target"]) <= warmed, "a verify ran a width warm-up did not compile"
    target = counters(pair)["target"]
    assert target.recompiles == 0 and target.compiles == sum(w.compiles for w in runner.warm_ups)


def test_a_decode_forward_runs_the_shape_it_is_given_and_refuses_one_no_bucket_of_its_mode():
    """The step plan's shape is what runs (``StackRunner.shape_for``): a compiled forward pads to the batch it
    is given, here 8 where 3 rows would bucket to 4, and the runner refuses a shape that is no bucket of its
    mode (eager: the real shape) or does not hold the forward, rather than choose one itself."""
    pair = tiny_pair(layers=1)
    model = pair.target
    cache = RowKVCache(model, 8, 64)
    view = cache.rows_view(0, 3)
    ids = torch.tensor(random_prompts(pair, [2, 2, 2], seed=7))
    eager, compiled = StackRunner(model, "eager"), StackRunner(model, "compile")  # compiles nothing yet
    refused = {
        ForwardShape(3, 3, 2): "not a batch bucket", ForwardShape(3, 16, 2): "not a batch bucket",
        ForwardShape(3, 4, 9): "not a width bucket", ForwardShape(3, 2, 2): "smaller than",
        ForwardShape(3, 4, 1): "smaller than", ForwardShape(2, 4, 2): "names 2 rows"}
    with torch.inference_mode():
        for shape, why in refused.items():
            with pytest.raises(ValueError, match=why):
                compiled(view, ids, shape=shape)
        with pytest.raises(ValueError, match="not a batch bucket"):
            compiled.chain(view, chained_drafts, ids[:, 0], 2, shape=ForwardShape(3, 3, 1), vocab=8, sampled=False,
                           nucleus=False)
        with pytest.raises(ValueError, match="eager forwards run their real shape"):
            eager(view, ids, shape=ForwardShape(3, 4, 2))
        assert compiled.counters.forwards == eager.counters.forwards == compiled.counters.graph_calls == 0
        expected = eager(view, ids, shape=ForwardShape(3, 3, 2))
        hidden = compiled(view, ids, shape=ForwardShape(3, 8, 2))
    assert compiled.counters.shapes == Counter({(8, 2, 65): 1}), "the runner padded to a batch of its own"
    # the time inside compiled calls, which a step's time less it leaves as host work (bench.host_overhead)
    assert compiled.counters.graph_seconds > 0 and eager.counters.graph_seconds == 0
    torch.testing.assert_close(hidden, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_a_compiled_forward_writes_the_cache_in_place_and_compiles_each_layer_once(monkeypatch):
    """Inductor's code for a decode forward of a three-layer stack: it allocates no buffer of a cache layer's shape
    (a scatter_ into the cache, read after it, copied every layer's keys and values whole on every forward:
    the cache is written with index_put_), and it defines the layer's two regions once, called by every layer
    (``DecoderStack``'s nested regions: a compile does not grow with the depth)."""
    from torch._inductor import config
    from torch._inductor.utils import run_and_get_code

    from sidecar.runtime import capture

    monkeypatch.setattr(capture, "REGIONAL_DEPTH", 3)
    pair = tiny_pair(layers=3)
    cache = RowKVCache(pair.target, 2, 64)
    cache.commit(5)
    runner = StackRunner(pair.target, "compile")
    ids = torch.tensor(random_prompts(pair, [2, 2], seed=3))
    with torch.inference_mode(), config.patch(force_disable_caches=True):
        hidden, code = run_and_get_code(lambda: runner(cache, ids))
        expected = StackRunner(pair.target, "eager")(cache, ids)
    torch.testing.assert_close(hidden, expected, atol=1e-5, rtol=1e-5)
    source = "\n".join(code)
    layer_shape = tuple(cache.keys[0].shape)
    assert f"empty_strided_cpu({layer_shape}" not in source.replace("\n", ""), "a cache layer was copied"
    regions = {line.split("(")[0] for line in source.splitlines() if line.lstrip().startswith("def repeated_subgraph")}
    assert len(regions) == 2, f"the layer's regions were not reused: {sorted(regions)}"
    assert len(re.findall(r"= repeated_subgraph\d+\(", source)) == 2 * 3, "every layer calls both regions"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_warmed_up_compiled_engine_compiles_nothing_while_it_decodes():
    """Warm-up (``SpeculativeDecoder.warm``) compiles every bucket's decode forwards of a batch limit and a row
    length; then two batches of that shape compile nothing, run on the same KV buffers (``sidecar.runtime.pools``)
    and decode as eager does. A decoder asked to warm up compiles a new cache's shapes when it allocates it."""
    from tests.test_kv_pools import Buffers

    # dynamo keeps graphs by code object, across pairs: an earlier test's warm-up at these shapes (a one-layer
    # pair's, batch 4, 64 columns) would leave this one nothing to compile
    torch._dynamo.reset()
    pair = tiny_pair(layers=1)
    prompts = random_prompts(pair, [6, 13, 9], seed=4)

    def generate(prompts=prompts, warm_up=None) -> list[list[int]]:
        decoder = SpeculativeDecoder(pair, gamma=1, adaptive=False, prompt_lookup=False, warm_up=warm_up)
        return [o.token_ids for o in decoder.generate(prompts, max_new_tokens=5, batch_size=2)]

    decoder = SpeculativeDecoder(pair, gamma=1, adaptive=False, prompt_lookup=False, capture="compile")
    reports = decoder.warm(max_batch=2, columns=64)
    assert {name: (r["shapes"], r["capacity"]) for name, r in reports.items()} == {
        "target": (4, 64), "draft": (6, 64)}  # batch buckets 1, 2 at widths 1, 2 (and the draft's feed width 4)
    assert all(r["compiles"] >= 1 for r in reports.values())
    assert decoder.warm(max_batch=2, columns=64) == {}, "a warmed shape is warmed again"
    compiles = {name: c.compiles for name, c in counters(pair).items()}
    target = Buffers(pair.target)
    first, outputs = target.run(generate)
    again, outputs_again = target.run(generate)
    assert {name: c.compiles for name, c in counters(pair).items()} == compiles, "a warmed batch compiled"
    assert again == first and outputs_again == outputs

    longer = random_prompts(pair, [70], seed=5)  # 70 + 5 + 2 columns: a cache of 128, new
    generate(longer, warm_up=True)
    assert [w.capacity for w in runner_of(pair.target).warm_ups] == [64, 128]
    assert sum(w.compiles for model in (pair.target, pair.draft) for w in runner_of(model).warm_ups) == sum(
        c.compiles for c in counters(pair).values()), "a forward compiled outside warm-up"
    assert all(c.recompiles == 0 and c.graph_breaks == 0 for c in counters(pair).values())

    SpeculativeDecoder(pair, capture="eager")
    assert generate() == outputs


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bf16_compiled_decoding_keeps_the_near_tie_rule():
    """In bf16, compiled forwards sum in another order than eager ones: an output may leave eager's only where the
    target's two candidates are within rounding (``sidecar.decoding.divergence``), never further. (On the CPU this
    was written on, the last prompt leaves eager's output at its 9th token, where the target's two best logits
    are equal in bf16.)"""
    pair = tiny_pair(layers=1, dtype=torch.bfloat16)
    prompts = random_prompts(pair, [5, 17, 11, 8], seed=6)

    def generate(capture: str) -> list[list[int]]:
        decoder = SpeculativeDecoder(pair, gamma=1, adaptive=False, prompt_lookup=False, capture=capture)
        return [o.token_ids for o in decoder.generate(prompts, max_new_tokens=12, batch_size=2)]

    eager, compiled = generate("eager"), generate("compile")
    SpeculativeDecoder(pair, capture="eager")
    found = [divergence(pair.target, prompt, reference, candidate)
             for prompt, reference, candidate in zip(prompts, eager, compiled, strict=True)]
    assert all(d is None or d.kind == NEAR_TIE for d in found), [d for d in found if d is not None]
    assert all(len(tokens) == 12 or tokens[-1] in pair.eos_token_ids for tokens in compiled)


def test_cudagraph_mode_marks_each_bucket_buffer_static_once():
    """The graphs read the cache's buffers at their addresses, so each is marked static for them: once per bucket's
    buffers, not on every forward (58 calls at 28 layers). The bookkeeping only: a CPU has no CUDA graphs."""
    from torch._dynamo.utils import get_static_address_type

    model = tiny_pair(layers=2).target
    runner = StackRunner(model, "cudagraph")  # compiles nothing until a forward runs
    cache = RowKVCache(model, 8, 64)
    buffers = {live: runner.static_buffers(cache.rows_view(0, live), batch_bucket(live, 8))
               for live in (3, 3, 4, 2, 3, 8, 5, 1)}
    per_bucket = 2 * 2 + 2  # keys and values per layer, visible, span
    assert runner.counters.static_marks == 4 * per_bucket  # buckets 1, 2, 4 and 8
    assert buffers[3] is buffers[4] and buffers[5] is buffers[8] and buffers[8].rows == 8
    assert all(get_static_address_type(t) is not None for b in buffers.values() for t in b.tensors())
    assert buffers[8].keys[1].data_ptr() == cache.keys[1].data_ptr()
    compiled = StackRunner(model, "compile")
    compiled.static_buffers(cache.rows_view(0, 3), 4)
    assert compiled.counters.static_marks == 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cudagraph_modes_host_paths_run_on_a_cpu_where_inductor_leaves_each_graph_uncaptured(monkeypatch):
    """``cudagraph`` mode's own host paths (each bucket's cache buffers marked static once, a step begun before
    each graph call, a chain's outputs cloned before a replay could overwrite them, each new cache warmed as it is
    allocated, ``CAPTURE_CALLS`` calls a shape) run on a CPU, where inductor compiles each graph and leaves it
    uncaptured (the mode is refused on a CPU; here its resolution is replaced): greedy rows equal the target
    alone, nothing breaks a graph or compiles after warm-up, and every graph is counted uncaptured, which on CUDA
    must stay 0."""
    from sidecar.decoding import decoder as decoder_module

    monkeypatch.setattr(decoder_module, "resolve_capture", lambda *args, **kwargs: ("cudagraph", "simulated"))
    torch._dynamo.reset()  # dynamo keeps graphs by code object, across pairs: this pair compiles its own
    pair = tiny_pair(layers=1)
    decoder = SpeculativeDecoder(pair, gamma=3, adaptive=False, prompt_lookup=False)
    set_sampled(pair.draft, False)  # greedy rows only: the sampled chains are not warmed
    prompts = random_prompts(pair, [5, 17, 9, 12], seed=3)
    outputs = decoder.generate(prompts, max_new_tokens=12, batch_size=4)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.token_ids == target_alone(pair, prompt, 12)
    assert_speculated(outputs)
    for name in ("target", "draft"):
        runner = runner_of(getattr(pair, name))
        counters = runner.counters
        assert runner.mode == pair.capture_mode == "cudagraph" and runner.warm_ups, f"{name}: not warmed"
        assert all(w.calls and min(w.calls.values()) >= 3 for w in runner.warm_ups), "a shape called once"
        assert counters.compiles == sum(w.compiles for w in runner.warm_ups) > 0, f"{name} compiled after warm-up"
        assert counters.graph_breaks == counters.recompiles == 0
        assert counters.cudagraph_skips == counters.compiles and counters.static_marks > 0, counters.as_dict()
    assert runner_of(pair.draft).counters.chained_forwards > 0, "no chain ran: its outputs' clone went untried"
    torch._dynamo.reset()  # later tests compile their own


@pytest.mark.slow
def test_a_graph_inductor_leaves_uncaptured_is_counted_with_its_reason(monkeypatch):
    """In ``cudagraph`` mode a graph inductor compiles but does not capture (on CUDA: an input mutated unmarked, a
    CPU tensor, a re-record limit) runs at compiled speed, a fault only a counter shows: each is counted, with
    inductor's message for it. On a CPU every graph is one (inductor counts them, logs no message); a CUDA skip's
    message comes through inductor's own reporting function, called here as a CUDA compile would."""
    from torch._inductor.cudagraph_utils import log_cudagraph_skip_and_bump_counter

    from sidecar.runtime import capture

    pair = tiny_pair(layers=1)
    runner = StackRunner(pair.target, "cudagraph")
    cache = RowKVCache(pair.target, 2, 64)
    cache.commit(3)
    ids = torch.tensor(random_prompts(pair, [1, 1], seed=4))
    with torch.inference_mode():
        hidden = runner(cache, ids)
        expected = StackRunner(pair.target, "eager")(cache, ids)
        assert runner.counters.compiles == 1 and runner.counters.cudagraph_skips == 1, runner.counters.as_dict()
        assert runner.counters.skip_reasons == []
        runner(cache, ids)
        assert runner.counters.cudagraph_skips == 1, "a replay of an uncaptured graph counted again"
        compiled = runner._compiled
        reason = "skipping cudagraphs due to mutated inputs (2 instances)"

        def skipped(*args, **kwargs):
            log_cudagraph_skip_and_bump_counter(reason)
            return compiled(*args, **kwargs)

        monkeypatch.setattr(runner, "_compiled", skipped)
        runner(cache, ids)
        runner(cache, ids)  # as past the re-record limit: each call logs again; the runner keeps it once
    torch.testing.assert_close(hidden, expected, atol=1e-5, rtol=1e-5)
    assert runner.counters.cudagraph_skips == 3 and runner.counters.skip_reasons == [reason]
    assert capture._skip_messages().since(capture._skip_messages().emitted - 2) == [reason, reason]
    assert {k: runner.counters.as_dict()[k] for k in ("cudagraph_skips", "skip_reasons")} == {
        "cudagraph_skips": 3, "skip_reasons": [reason]}


@pytest.mark.slow
def test_compiled_forwards_on_a_worker_thread_run_under_our_dynamo_limits():
    """Dynamo's config is per thread: the server's batch worker starts from the defaults (an accumulated 256
    compiled entries of the stack's forward, every model's and bucket's, and a fullgraph compile past it fails).
    A compiled forward on another thread raises that thread's caps to ours first."""
    import torch._dynamo

    model = tiny_pair(layers=1).target
    runner = StackRunner(model, "compile")
    seen = {}

    def work() -> None:
        seen["before"] = torch._dynamo.config.accumulated_recompile_limit
        with torch.inference_mode():
            runner(RowKVCache(model, 1, 64), torch.zeros(1, 1, dtype=torch.long))
        seen["after"] = (torch._dynamo.config.recompile_limit, torch._dynamo.config.accumulated_recompile_limit)

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    assert seen["before"] < ACCUMULATED_LIMIT, "a new thread no longer starts from dynamo's defaults"
    assert seen["after"] == (RECOMPILE_LIMIT, ACCUMULATED_LIMIT)
    assert runner.counters.graph_calls == 1  # the forward ran compiled (its graph may be one compiled before)
