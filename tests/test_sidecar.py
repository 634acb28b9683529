"""Sidecar tasks on the tiny pair: target exactness, hidden instructions, document eviction, branching."""

from __future__ import annotations

import pytest
import torch

from sidecar import (
    HASHTAGS,
    GenerationStats,
    InputError,
    SidecarEngine,
    SidecarRequest,
    SidecarStats,
    SidecarTask,
    SpeculativeDecoder,
    parse_hashtags,
)
from sidecar.runtime.forward import forward, logits_at
from sidecar.runtime.kv_cache import RowKVCache
from sidecar.tasks.prompts import DEFAULT_SYSTEM, build_prompt
from storage import RequestStats

DOCS = [
    "The city council approved a new budget on Tuesday after a long debate about schools and roads.",
    "Prices rose 3.5 percent in 2017 while 1,200 workers lost their jobs at the factory in Berlin.",
    "The president met leaders in Moscow and Doha.",
]
TITLE = SidecarTask(name="title", instruction="Then give the summary a title.", max_new_tokens=6)
HASHTAGS_ATTENDED = SidecarTask(name="hashtags_attended", instruction=HASHTAGS.instruction,
                                max_new_tokens=20, attend_document=True, parser="hashtags", bridge=HASHTAGS.bridge)


def test_target_output_is_identical_with_or_without_sidecars(tiny, prefill_forwards):
    engine = SidecarEngine(tiny, gamma=3, adaptive=False)
    with_sidecars = engine.run([SidecarRequest(d, sidecars=[HASHTAGS, TITLE]) for d in DOCS], max_new_tokens=24,
                               batch_size=3)
    bare = [engine.prompts(SidecarRequest(d))[0].token_ids for d in DOCS]
    alone = SpeculativeDecoder(tiny, gamma=3).generate(bare, max_new_tokens=24)
    for result, reference, prompt in zip(with_sidecars, alone, bare, strict=True):
        assert result.main.token_ids == reference.token_ids
        native = tiny.target.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                      eos_token_id=tiny.eos_token_ids, pad_token_id=0)[0, len(prompt):].tolist()
        assert result.main.token_ids == native


def test_multiple_sidecars_batched_equal_each_request_alone(tiny, prefill_forwards):
    """Rows finish at different steps (different documents, some hit max tokens); the batched sidecar
    phase gives every (request, task) the same output as running that request by itself."""
    engine = SidecarEngine(tiny, gamma=4, adaptive=False)
    tasks = [HASHTAGS, TITLE, HASHTAGS_ATTENDED]
    batched = engine.run([SidecarRequest(d, sidecars=tasks) for d in DOCS], max_new_tokens=16, batch_size=3)
    assert {r.main.finish_reason for r in batched} <= {"eos", "length"}
    assert len({len(r.main.token_ids) for r in batched}) > 1 or all(r.main.finish_reason == "length" for r in batched)
    for doc, result in zip(DOCS, batched, strict=True):
        assert set(result.sidecars) == {"hashtags", "title", "hashtags_attended"}
        alone = engine.run([SidecarRequest(doc, sidecars=tasks)], max_new_tokens=16, batch_size=1)[0]
        assert alone.main.token_ids == result.main.token_ids
        for task in tasks:
            assert alone.sidecars[task.name].token_ids == result.sidecars[task.name].token_ids
            assert len(result.sidecars[task.name].token_ids) <= task.max_new_tokens


def test_sidecar_output_does_not_depend_on_gamma_or_batching(tiny, prefill_forwards):
    """How many main-output tokens the draft cache lacks at the end depends on gamma, plain steps and the
    batch; the sidecar must come out the same whatever they were."""
    requests = [SidecarRequest(d, sidecars=[HASHTAGS, TITLE]) for d in DOCS]
    runs = [SidecarEngine(tiny, gamma=g, adaptive=a).run(requests, max_new_tokens=14, batch_size=b)
            for g, a, b in ((1, False, 3), (4, False, 1), (6, False, 2), (4, True, 3))]
    for other in runs[1:]:
        for first, result in zip(runs[0], other, strict=True):
            assert result.main.token_ids == first.main.token_ids
            for name in ("hashtags", "title"):
                assert result.sidecars[name].token_ids == first.sidecars[name].token_ids


def test_sidecar_logprobs_are_the_drafts_and_change_no_output(tiny):
    """With logprobs on, every output keeps its tokens; each sidecar token has the draft's log-probability,
    the same whatever gamma and batch the main output was decoded with."""
    requests = [SidecarRequest(d, sidecars=[HASHTAGS, TITLE]) for d in DOCS]
    plain = SidecarEngine(tiny, gamma=4, adaptive=False).run(requests, max_new_tokens=14, batch_size=3)
    runs = [SidecarEngine(tiny, gamma=g, adaptive=False).run(requests, max_new_tokens=14, batch_size=b,
                                                              top_logprobs=3)
            for g, b in ((4, 3), (1, 1))]
    for without, first, other in zip(plain, *runs, strict=True):
        assert first.main.token_ids == without.main.token_ids
        assert [e.token_id for e in first.main.logprobs] == first.main.token_ids
        for name in ("hashtags", "title"):
            got = first.sidecars[name]
            assert without.sidecars[name].logprobs is None and got.token_ids == without.sidecars[name].token_ids
            assert [e.token_id for e in got.logprobs] == got.token_ids
            assert all(e.top[0][0] == e.token_id and e.logprob <= 0 for e in got.logprobs)
            assert [e.logprob for e in other.sidecars[name].logprobs] == pytest.approx(
                [e.logprob for e in got.logprobs], abs=1e-4)


def test_greedy_main_with_sampled_sidecars_branching_from_one_state(tiny):
    """The forced-summary setup: one greedy main output, many sampled copies of a task branching from it."""
    from sidecar.decoding.sampling import Sampling

    engine = SidecarEngine(tiny, gamma=3, adaptive=False)
    copies = [TITLE.model_copy(update={"name": f"title_{k}", "max_new_tokens": 12}) for k in range(12)]
    run = engine.run([SidecarRequest(DOCS[1], sidecars=copies)], max_new_tokens=16,
                     sidecar_sampling=Sampling(temperature=1.5, seed=3))[0]
    greedy = engine.run([SidecarRequest(DOCS[1], sidecars=[TITLE])], max_new_tokens=16)[0]
    assert run.main.token_ids == greedy.main.token_ids
    samples = {tuple(run.sidecars[t.name].token_ids) for t in copies}
    assert len(samples) > 1, "sampled copies of one task should not all coincide"
    again = engine.run([SidecarRequest(DOCS[1], sidecars=copies)], max_new_tokens=16,
                       sidecar_sampling=Sampling(temperature=1.5, seed=3))[0]
    assert [again.sidecars[t.name].token_ids for t in copies] == [run.sidecars[t.name].token_ids for t in copies]


def test_per_row_limits_and_context_check(tiny):
    engine = SidecarEngine(tiny, gamma=3)
    results = engine.run([SidecarRequest(d, sidecars=[TITLE]) for d in DOCS[:2]], max_new_tokens=[3, 9])
    assert [len(r.main.token_ids) <= n for r, n in zip(results, [3, 9], strict=True)] == [True, True]
    huge = SidecarTask(name="long", instruction="Then write an essay.", max_new_tokens=1024)
    document = "word " * 1200
    with pytest.raises(InputError, match="exceed the draft's context"):
        engine.run([SidecarRequest(document, sidecars=[huge, huge.model_copy(update={"name": "b"})])],
                   max_new_tokens=2000)


def test_evicted_document_costs_fewer_kv_bytes(tiny):
    engine = SidecarEngine(tiny, gamma=3)
    result = engine.run([SidecarRequest(DOCS[1] * 4, sidecars=[HASHTAGS, HASHTAGS_ATTENDED])], max_new_tokens=8)[0]
    evicted, attended = result.sidecars["hashtags"].stats, result.sidecars["hashtags_attended"].stats
    assert not evicted.attended_document and attended.attended_document
    document_tokens = len(tiny.tokenizer.encode(DOCS[1] * 4))
    assert attended.prompt_tokens - evicted.prompt_tokens == document_tokens
    assert evicted.kv_bytes < attended.kv_bytes


def test_main_and_sidecar_outputs_carry_one_stats_record_that_storage_reads(tiny):
    """A row's counters are one record from the batch to the stored phases: the main output's and each sidecar
    output's (the server's usage reads both), which ``storage.RequestStats`` takes by attribute."""
    result = SidecarEngine(tiny, gamma=3).run([SidecarRequest(DOCS[0], sidecars=[HASHTAGS])], max_new_tokens=6)[0]
    main, tags = result.main.stats, result.sidecars["hashtags"].stats
    assert type(main) is type(tags) is GenerationStats
    assert SidecarStats is GenerationStats  # the public name of the sidecar's stats is the same class
    main_phase, sidecar_phase = RequestStats.main_phase(main), RequestStats.sidecar_phase(tags)
    assert (main_phase.new_tokens, main_phase.prompt_tokens) == (len(result.main.token_ids), main.prompt_tokens)
    assert (sidecar_phase.new_tokens, sidecar_phase.prompt_tokens, sidecar_phase.instruction_tokens) == (
        len(result.sidecars["hashtags"].token_ids), tags.prefill_tokens, tags.instruction_tokens)
    assert tags.instruction_tokens > 0 and sidecar_phase.wall_s == tags.wall_seconds


def _main_phase_cache(pair, prompt, main_tokens):
    """Prefill the compound prompt with the sidecar spans hidden, then feed the main output."""
    cache = RowKVCache(pair.draft, 1, len(prompt.token_ids) + len(main_tokens) + 16)
    ids = torch.tensor([prompt.token_ids])
    span = torch.full_like(ids, -1)
    for k, name in enumerate(n for n in prompt.spans if n.startswith("sidecar:")):
        start, end = prompt.spans[name]
        span[0, start:end] = k
    with torch.inference_mode():
        forward(pair.draft, cache, ids, span)
        cache.commit(torch.tensor([ids.shape[1]]))
        hidden = forward(pair.draft, cache, torch.tensor([main_tokens]))
        cache.commit(torch.tensor([len(main_tokens)]))
        main_logits = logits_at(pair.draft, hidden, torch.arange(len(main_tokens))[None])[0]
    return cache, main_logits


def _sidecar_logits(pair, cache, prompt, keep_spans, show_span, bridge):
    columns = prompt.columns(*keep_spans) + list(range(len(prompt.token_ids), int(cache.lengths[0])))
    snap = cache.snapshot(0, torch.tensor(columns))
    start = len(prompt.columns(*keep_spans[: keep_spans.index(show_span)]))
    rows = RowKVCache.from_snapshots(pair.draft, [snap], len(bridge) + 1)
    rows.visible[0, start : start + len(prompt.columns(show_span))] = True
    with torch.inference_mode():
        hidden = forward(pair.draft, rows, torch.tensor([bridge]))
        return logits_at(pair.draft, hidden, torch.arange(len(bridge))[None])[0]


def _perturb_span(prompt, name, seed):
    ids = list(prompt.token_ids)
    start, end = prompt.spans[name]
    g = torch.Generator().manual_seed(seed)
    ids[start:end] = torch.randint(3, 500, (end - start,), generator=g).tolist()
    return type(prompt)(ids, dict(prompt.spans))


def test_sidecar_instruction_is_invisible_while_drafting_and_visible_after(tiny):
    engine = SidecarEngine(tiny)
    _, prompt = engine.prompts(SidecarRequest(DOCS[0], sidecars=[HASHTAGS]))
    other = _perturb_span(prompt, "sidecar:hashtags", seed=1)
    main = tiny.tokenizer.encode(" The council approved the budget.")
    cache_a, main_a = _main_phase_cache(tiny, prompt, main)
    cache_b, main_b = _main_phase_cache(tiny, other, main)
    assert (main_a - main_b).abs().max().item() < 1e-4  # drafting does not see the instruction
    keep = ["prefix", "instruction", "sidecar:hashtags", "suffix"]
    bridge = tiny.tokenizer.encode("\n\n#")
    after_a = _sidecar_logits(tiny, cache_a, prompt, keep, "sidecar:hashtags", bridge)
    after_b = _sidecar_logits(tiny, cache_b, other, keep, "sidecar:hashtags", bridge)
    assert (after_a - after_b).abs().max().item() > 1e-2  # the sidecar does


def test_eviction_is_exact_and_document_columns_are_not_read(tiny):
    engine = SidecarEngine(tiny)
    _, prompt = engine.prompts(SidecarRequest(DOCS[1], sidecars=[HASHTAGS]))
    main = tiny.tokenizer.encode(" Prices rose and jobs were lost.")
    cache, _ = _main_phase_cache(tiny, prompt, main)
    bridge = tiny.tokenizer.encode("\n\n#")
    evicted = _sidecar_logits(tiny, cache, prompt, ["prefix", "instruction", "sidecar:hashtags", "suffix"],
                              "sidecar:hashtags", bridge)
    # the document kept in the cache but masked: same logits as evicting it
    masked_cache, _ = _main_phase_cache(tiny, prompt, main)
    masked_cache.visible[0, slice(*prompt.spans["document"])] = False
    masked = _sidecar_logits(tiny, masked_cache, prompt, ["prefix", "document", "instruction", "sidecar:hashtags",
                                                          "suffix"], "sidecar:hashtags", bridge)
    assert (evicted - masked).abs().max().item() < 1e-4
    # overwriting the document's KV entries changes nothing while it is masked ...
    start, end = prompt.spans["document"]
    for layer in range(masked_cache.layers):
        masked_cache.keys[layer][0, :, start:end] = torch.randn_like(masked_cache.keys[layer][0, :, start:end])
        masked_cache.values[layer][0, :, start:end] = torch.randn_like(masked_cache.values[layer][0, :, start:end])
    still = _sidecar_logits(tiny, masked_cache, prompt, ["prefix", "document", "instruction", "sidecar:hashtags",
                                                         "suffix"], "sidecar:hashtags", bridge)
    assert (still - masked).abs().max().item() < 1e-4
    # ... and changes the output of a task that attends to the document
    masked_cache.visible[0, start:end] = True
    attended = _sidecar_logits(tiny, masked_cache, prompt, ["prefix", "document", "instruction", "sidecar:hashtags",
                                                            "suffix"], "sidecar:hashtags", bridge)
    assert (attended - masked).abs().max().item() > 1e-2


def test_a_task_without_a_bridge_answers_in_a_turn_of_its_own(tiny):
    """Its default bridge closes the main answer's turn and opens an assistant turn, its control tokens as tokens;
    the hashtags task keeps the blank line it was measured with."""
    engine = SidecarEngine(tiny)
    tok = tiny.tokenizer
    turn = engine.builder.bridge(TITLE)
    assert TITLE.bridge is None and tok.decode(turn) == "<|im_end|>\n<|im_start|>assistant\n"
    assert turn[0] in tiny.eos_token_ids and tok.convert_tokens_to_ids("<|im_start|>") in turn
    assert engine.builder.bridge(HASHTAGS) == tok.encode("\n\n", add_special_tokens=False)
    # the engine feeds it: with a blank-line bridge the same request's sidecar attends to that many tokens fewer
    blank = TITLE.model_copy(update={"bridge": "\n\n"})
    [own, inline] = [engine.run([SidecarRequest(DOCS[0], sidecars=[task])], max_new_tokens=8)[0].sidecars["title"]
                     for task in (TITLE, blank)]
    assert own.stats.prompt_tokens - inline.stats.prompt_tokens == len(turn) - len(tok.encode("\n\n"))


def test_standalone_tagger_sees_only_the_summary(tiny):
    engine = SidecarEngine(tiny)
    summaries = ["The council approved the budget.", "Jobs were lost in Berlin."]
    out = engine.standalone(summaries, [HASHTAGS, TITLE], batch_size=3)
    assert [set(o) for o in out] == [{"hashtags", "title"}] * 2
    for summary, outputs in zip(summaries, out, strict=True):
        alone = engine.standalone([summary], [HASHTAGS], batch_size=1)[0]["hashtags"]
        assert alone.token_ids == outputs["hashtags"].token_ids
        prompt = build_prompt(tiny.tokenizer, summary, HASHTAGS.standalone_instruction, DEFAULT_SYSTEM)
        assert outputs["hashtags"].stats.prompt_tokens == len(prompt.token_ids)
        assert tiny.tokenizer.decode(prompt.token_ids).count(summary) == 1


def test_parse_hashtags():
    assert parse_hashtags("#Climate #climate #EnergyPolicy, #Oklahoma!") == ["climate", "energypolicy", "oklahoma"]
    assert parse_hashtags("1. Climate change\n2. Oil\n3. Jobs") == ["climatechange", "oil", "jobs"]
    assert parse_hashtags("politics, economy; Berlin") == ["politics", "economy", "berlin"]
    assert parse_hashtags("#a #b #c #d #e #f #g") == ["a", "b", "c", "d", "e"]
    assert parse_hashtags("") is None
    assert parse_hashtags("I cannot help with that request because it is unclear.") is None
    assert HASHTAGS.parse("nothing here at all, really nothing to see")[1] == "no hashtags found"
    assert HASHTAGS.standalone_instruction == "Output 3-5 short hashtags for the summary."


def test_progress_reports_every_phase_up_to_its_total_and_changes_nothing(tiny):
    from sidecar import progress

    engine = SidecarEngine(tiny, gamma=3, adaptive=False)
    requests = [SidecarRequest(d, sidecars=[HASHTAGS]) for d in DOCS]
    events: list[tuple[str, int, int]] = []
    reported = engine.run(requests, max_new_tokens=16, batch_size=3, on_progress=lambda *e: events.append(e))
    quiet = engine.run(requests, max_new_tokens=16, batch_size=3)
    assert [r.main.token_ids for r in reported] == [r.main.token_ids for r in quiet]
    assert [r.sidecars["hashtags"].token_ids for r in reported] == [r.sidecars["hashtags"].token_ids for r in quiet]

    phases = list(dict.fromkeys(phase for phase, _, _ in events))
    assert phases == [progress.TARGET_PREFILL, progress.DRAFT_PREFILL, progress.DECODE, progress.SIDECAR_TASKS]
    for phase in phases:
        seen = [(done, total) for p, done, total in events if p == phase]
        assert [done for done, _ in seen] == sorted(done for done, _ in seen)
        # a bar appears when its phase starts, not after its first forward
        assert seen[0][0] <= len(DOCS) if phase == progress.DECODE else seen[0][0] == 0
        assert seen[-1][0] == seen[-1][1] == {progress.DECODE: 3 * 16}.get(phase, len(DOCS))

    standalone: list[tuple[str, int, int]] = []
    engine.standalone([r.main.text for r in quiet], [HASHTAGS], batch_size=2,
                      on_progress=lambda *e: standalone.append(e))
    assert standalone[0] == (progress.STANDALONE, 0, 3) and standalone[-1] == (progress.STANDALONE, 3, 3)
    assert [done for _, done, _ in standalone] == sorted({done for _, done, _ in standalone})
