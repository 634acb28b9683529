"""Integration tests on the real offline Qwen2.5-Coder 1.5B/0.5B pair and real news articles."""

from __future__ import annotations

import pytest
import torch

from sidecar import HASHTAGS, SidecarEngine, SidecarRequest, SpeculativeDecoder
from study.analysis import predicted_target_forwards

# the first test's setup loads the pair and decodes the references with the target alone: ~8 minutes on a busy CPU
pytestmark = [pytest.mark.real, pytest.mark.slow, pytest.mark.timeout(1800)]

NEW_TOKENS = 48


@pytest.fixture(scope="module")
def prompts_and_references(real_pair, news_articles):
    engine = SidecarEngine(real_pair)
    prompts = [engine.prompts(SidecarRequest(doc[:900]))[0].token_ids for doc in news_articles[:8]]
    references = []
    with torch.inference_mode():
        for prompt in prompts:
            out = real_pair.target.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                            eos_token_id=real_pair.eos_token_ids)
            references.append(out[0, len(prompt):].tolist())
    return prompts, references


@pytest.mark.parametrize(("batch_size", "count", "adaptive"), [(1, 3, False), (3, 3, True), (8, 8, False)])
def test_greedy_identical_to_target_on_real_news(real_pair, prompts_and_references, batch_size, count, adaptive):
    prompts, references = prompts_and_references
    # fixed gamma drafts with the draft model alone: that is what the teacher-forced prediction models
    outputs = SpeculativeDecoder(real_pair, gamma=4, adaptive=adaptive, prompt_lookup=adaptive).generate(
        prompts[:count], max_new_tokens=NEW_TOKENS, batch_size=batch_size)
    for out, reference in zip(outputs, references[:count], strict=True):
        assert out.token_ids == reference
    assert sum(len(o.token_ids) for o in outputs) >= NEW_TOKENS * count * 0.75  # real summaries, not early EOS
    if not adaptive:
        # batching loses no acceptance: each row needs exactly the target forwards that teacher forcing predicts
        assert sum(o.stats.accepted for o in outputs) > 0
        for prompt, out in zip(prompts[:count], outputs, strict=True):
            assert out.stats.target_forwards == predicted_target_forwards(real_pair, prompt, out.token_ids, 4,
                                                                          NEW_TOKENS)


def test_sidecar_hashtags_on_real_news(real_pair, prompts_and_references, news_articles):
    _, references = prompts_and_references
    engine = SidecarEngine(real_pair, gamma=4)
    attended = HASHTAGS.model_copy(update={"name": "hashtags_attended", "attend_document": True})
    results = engine.run([SidecarRequest(doc[:900], sidecars=[HASHTAGS, attended]) for doc in news_articles[:2]],
                         max_new_tokens=NEW_TOKENS, batch_size=2)
    for result, reference in zip(results, references[:2], strict=True):
        assert result.main.token_ids == reference  # the sidecar never changes the target's output
        tags = result.sidecars["hashtags"]
        assert tags.parsed, f"no hashtags parsed from {tags.text!r}"
        assert tags.stats.kv_bytes < result.sidecars["hashtags_attended"].stats.kv_bytes
    standalone = engine.standalone([r.main.text for r in results], [HASHTAGS], batch_size=2)
    assert all(s["hashtags"].token_ids for s in standalone)


def test_rows_joining_a_running_batch_decode_as_alone_on_real_news(real_pair, prompts_and_references):
    """Continuous batching on the real pair: rows join at random steps with mixed limits, a stop string, and
    greedy and seeded sampled rows side by side; each decodes what it decodes alone (greedy: the target's)."""
    import random

    from sidecar.decoding.rows import DecodeRow
    from sidecar.decoding.sampling import Sampling

    prompts, references = prompts_and_references
    limits = [NEW_TOKENS, 12, 30, NEW_TOKENS, 20, 40]
    samplings = [Sampling(), Sampling(), Sampling(0.8, 0.95, seed=7), Sampling(), Sampling(0.7, seed=8), Sampling()]
    rows = [DecodeRow(p, limit, sampling=s) for p, limit, s in zip(prompts, limits, samplings, strict=False)]
    text = real_pair.tokenizer.decode(references[3][:NEW_TOKENS], skip_special_tokens=True)
    rows[3].stop = [text[len(text) // 2 : len(text) // 2 + 3]]
    # a greedy row without a stop decodes the target's own greedy tokens alone (the test above, at batch 1);
    # the others are decoded alone here
    alone = SpeculativeDecoder(real_pair, gamma=4)
    expected = [references[i][: row.max_new_tokens] if row.sampling.greedy and not row.stop
                else alone.decode([row], batch_size=1)[0].token_ids for i, row in enumerate(rows)]
    rng = random.Random(1)
    batch = SpeculativeDecoder(real_pair, gamma=4).batch(3)
    waiting, outputs, joined = list(enumerate(rows)), {}, 0
    while waiting or batch.busy:
        if waiting and rng.random() < 0.4:
            joined += bool(batch.target_rows)
            batch.add(*waiting.pop(0))
        outputs.update(batch.step())
    assert joined >= 2
    for i, tokens in enumerate(expected):
        assert outputs[i].token_ids == tokens
    assert outputs[3].finish_reason == "stop"
