"""The draft's forwards after a step's first as one compiled call (``sidecar.decoding.draft_chain``): which steps
chain, and that a compiled engine whose steps chain decodes exactly what eager decoding does, sampled rows
included, with one graph call for the chained forwards of a step."""

from __future__ import annotations

import pytest
import torch

from sidecar.decoding.constraints import choices_constraint, token_space
from sidecar.decoding.decoder import SpeculativeDecoder
from sidecar.decoding.draft_chain import chain_applies
from sidecar.decoding.matcher import RowMatcher
from sidecar.decoding.rows import DecodeRow, DraftOnlyRow, MainRow
from sidecar.decoding.sampling import Sampling
from sidecar.models.tiny import tiny_pair
from sidecar.runtime.capture import attach, runner_of
from sidecar.tasks.engine import SidecarEngine
from sidecar.tasks.rows import SidecarRequest
from sidecar.tasks.task import HASHTAGS, SidecarTask
from tests.decoding import random_prompts

TITLE = SidecarTask(name="title", instruction="Then write a title.", max_new_tokens=6)
DOCS = ["The city council approved a new budget on Tuesday after a long debate about schools.",
        "Prices rose 3.5 percent in 2017 while 1,200 workers lost their jobs at the factory in the north.",
        "The president met leaders in Berlin."]


def main_row(sampling: Sampling = Sampling(), top_logprobs: int | None = None) -> MainRow:
    return MainRow(key=0, max_new_tokens=8, sampling=sampling, draw_key=1, top_logprobs=top_logprobs, added=0.0)


def test_a_chain_runs_where_no_host_decision_falls_between_the_draft_forwards():
    """Compiled drafting chains two or more forwards of free rows, sampled ones too; not a single forward, not
    with the early stop, not with a constrained draft-only row (its matcher takes each token) or one asking for
    logprobs (its logits are kept per forward; a main row's come from the target), not a nucleus
    on a CPU (checked on the host), and never in eager mode."""
    pair = tiny_pair(layers=1)
    before = runner_of(pair.draft)
    runner = attach(pair.draft, "compile")  # compiles nothing until a forward runs
    try:
        sampled, nucleus = Sampling(0.8, seed=1), Sampling(0.8, top_p=0.9, seed=1)
        assert chain_applies(runner, [main_row(), main_row(sampled)], forwards=3, stop_early=False)
        assert not chain_applies(runner, [main_row()], forwards=1, stop_early=False)
        assert not chain_applies(runner, [main_row()], forwards=3, stop_early=True)
        assert not chain_applies(runner, [main_row(), main_row(nucleus)], forwards=3, stop_early=False)
        space = token_space(pair.tokenizer, pair.target.get_output_embeddings().out_features, pair.eos_token_ids)
        constrained = DraftOnlyRow(key=1, max_new_tokens=8, sampling=Sampling(), draw_key=0, top_logprobs=None,
                                   added=0.0, matcher=RowMatcher(space, choices_constraint(["yes", "no"])))
        assert not chain_applies(runner, [main_row(), constrained], forwards=3, stop_early=False)
        logprobs = DraftOnlyRow(key=2, max_new_tokens=8, sampling=Sampling(), draw_key=0, top_logprobs=2, added=0.0)
        assert not chain_applies(runner, [main_row(), logprobs], forwards=3, stop_early=False)
        assert chain_applies(runner, [main_row(top_logprobs=2)], forwards=3, stop_early=False)  # the target's
        assert not chain_applies(attach(pair.draft, "eager"), [main_row()], forwards=3, stop_early=False)
    finally:
        attach(pair.draft, before.mode if before is not None else "hf")


def test_compiled_plans_chain_and_never_stop_early_eager_ones_stop_and_chain_nothing():
    """The planner says per step whether its draft forwards chain (``StepPlan.chained_forwards``): in a compiled
    mode all but the first, without the early stop, so the verify always sees the full width; eager keeps
    the adaptive early stop and drafts one forward at a time."""
    pair = tiny_pair(layers=1)
    batch = SpeculativeDecoder(pair, gamma=3, adaptive=False, draft_confidence=0.8, capture="eager").batch(4)
    for key, prompt in enumerate(random_prompts(pair, [5, 9], seed=3)):
        batch.add(key, DecodeRow(prompt, 12))
    batch.step()  # admits the rows and runs a step: the draft holds their prompts now

    def plan():
        return batch.planner.schedule(batch.target_rows, batch.draft_rows, batch._feed, batch.target_pool,
                                      batch.draft_pool)

    eager = plan()
    assert (eager.draft_forwards, eager.stop_early, eager.chained_forwards) == (3, True, 0)
    attach(pair.draft, "compile")  # compiles nothing until a forward runs
    try:
        compiled = plan()
        assert (compiled.draft_forwards, compiled.stop_early, compiled.chained_forwards) == (3, False, 2)
    finally:
        attach(pair.draft, "eager")


def counters(pair) -> dict:
    return {name: runner_of(model).counters for name, model in (("target", pair.target), ("draft", pair.draft))}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_chained_compiled_engine_samples_exactly_what_eager_sampling_does():
    """Seeded sampled rows (main rows drawing their proposals, sidecar rows drawing their output, with logprobs)
    in a batch of 2 that rows join and leave, each sidecar after its main output with the document evicted:
    compiled, with the draft forwards after each step's first chained, the tokens are eager's and the logprobs
    eager's to rounding. The chain ran (one graph call for several forwards), nothing recompiled, and a second
    run compiles nothing."""
    pair = tiny_pair(layers=1)
    requests = [SidecarRequest(doc, sidecars=[HASHTAGS, TITLE]) for doc in DOCS]

    def run() -> list:
        results = SidecarEngine(pair, gamma=3, adaptive=False).run(requests, max_new_tokens=8, batch_size=2,
                                                                   temperature=0.9, seed=11, top_logprobs=2)
        return [(r.main.token_ids, {n: (s.token_ids, [e.logprob for e in s.logprobs]) for n, s in r.sidecars.items()})
                for r in results]

    SpeculativeDecoder(pair, capture="eager")
    eager = run()
    SpeculativeDecoder(pair, capture="compile")
    compiled = run()
    draft = counters(pair)["draft"]
    assert draft.chained_forwards > 0, "no step chained its draft forwards"
    chains = sum(calls for shape, calls in draft.shapes.items() if len(shape) > 3)
    assert draft.chained_forwards > chains, "no chain ran more than one forward in its graph call"
    compiles = {name: c.compiles for name, c in counters(pair).items()}
    assert run() == compiled, "a second compiled run differs"
    assert {name: c.compiles for name, c in counters(pair).items()} == compiles, "the second run compiled"
    assert all(c.recompiles == 0 and c.graph_breaks == 0 for c in counters(pair).values())
    SpeculativeDecoder(pair, capture="eager")
    for (main, sidecars), (main_eager, sidecars_eager) in zip(compiled, eager, strict=True):
        assert main == main_eager
        assert {n: s[0] for n, s in sidecars.items()} == {n: s[0] for n, s in sidecars_eager.items()}
        for name, (_, logprobs) in sidecars.items():
            torch.testing.assert_close(logprobs, sidecars_eager[name][1], atol=1e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_warmed_compiled_decoder_samples_without_compiling():
    """Warm-up (``SpeculativeDecoder.warm``) compiles each batch bucket's chains of every length twice: greedy,
    and one graph for a batch with sampled rows whatever its mix (greedy rows by their mask, each row its own
    temperature and top_p). After it, a sampled batch and one mixing greedy and sampled rows compile nothing, and
    decode as eager does. A greedy deployment's warm-up (``sampled=False``, the nightly run's) skips them."""
    # dynamo keeps graphs by code object, across pairs: an earlier test's chains of these shapes would leave this
    # warm-up nothing to compile
    torch._dynamo.reset()
    pair = tiny_pair(layers=1)
    prompts = random_prompts(pair, [6, 13, 9, 11], seed=7)
    samplings = [Sampling(0.9, 1.0, 5), Sampling(), Sampling(1.3, 1.0, 6), Sampling(0.7, 1.0, 8)]

    def decode() -> list[list[int]]:
        decoder = SpeculativeDecoder(pair, gamma=3, adaptive=False, prompt_lookup=False)
        sampled = decoder.generate(prompts, max_new_tokens=8, temperature=1.0, seed=3, batch_size=2)
        mixed = decoder.decode([DecodeRow(p, 8, sampling=s) for p, s in zip(prompts, samplings, strict=True)],
                               batch_size=2)
        return [o.token_ids for o in sampled + mixed]

    decoder = SpeculativeDecoder(pair, gamma=3, adaptive=False, prompt_lookup=False, capture="compile")
    greedy = decoder.warm(max_batch=2, columns=64, sampled=False)
    # batch buckets 1, 2: the draft's widths 1, 2, 6 and its greedy chains of 1 and 2 forwards
    assert greedy["draft"]["shapes"] == 2 * 3 + 2 * 2
    compiles = counters(pair)["draft"].compiles
    reports = decoder.warm(max_batch=2, columns=64)  # the same cache, now for sampled rows too
    assert reports["draft"]["shapes"] == 2 * 3 + 2 * 2 * 2, "the sampled chains were not warmed"
    assert counters(pair)["draft"].compiles > compiles, "the sampled chains compiled nothing"
    compiles = {name: (c.compiles, c.recompiles) for name, c in counters(pair).items()}
    compiled = decode()
    assert {name: (c.compiles, c.recompiles) for name, c in counters(pair).items()} == compiles, \
        "a sampled batch compiled"
    draft = counters(pair)["draft"]
    sampled_chains = [shape for shape in draft.shapes if len(shape) > 3 and dict(shape[4])["sampled"]]
    assert sampled_chains, "no sampled batch chained its draft forwards"
    assert all(c.recompiles == 0 and c.graph_breaks == 0 for c in counters(pair).values())
    SpeculativeDecoder(pair, capture="eager")
    assert decode() == compiled
