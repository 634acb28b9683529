"""A request nobody waits for leaves its batch at the next step; the rows that stay decode as if it had finished."""

from __future__ import annotations

import pytest

from sidecar import HASHTAGS, SidecarEngine, SidecarRequest, SpeculativeDecoder

DOCS = [
    "The city council approved a new budget on Tuesday after a long debate about schools and roads.",
    "Prices rose 3.5 percent in 2017 while 1,200 workers lost their jobs at the factory in Berlin.",
    "The president met leaders in Moscow and Doha.",
]


def chat_ids(tiny, prompt: str) -> list[int]:
    tok = tiny.tokenizer
    rendered = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                       tokenize=False)
    return tok.encode(rendered, add_special_tokens=False)


class CancelAfter:
    """Cancels row ``row`` once it has ``tokens`` tokens; counts the tokens every row receives."""

    def __init__(self, row: int, tokens: int) -> None:
        self.row, self.tokens, self.seen = row, tokens, {}

    def on_tokens(self, row: int, ids: list[int], _: object) -> None:
        self.seen[row] = self.seen.get(row, 0) + len(ids)

    def __call__(self, row: int) -> bool:
        return row == self.row and self.seen.get(row, 0) >= self.tokens


@pytest.mark.parametrize("adaptive", [False, True])
def test_a_cancelled_row_leaves_and_the_others_are_unchanged(tiny, adaptive: bool) -> None:
    prompts = [chat_ids(tiny, d) for d in DOCS]
    alone = SpeculativeDecoder(tiny, gamma=3, adaptive=adaptive).generate(prompts, max_new_tokens=40)
    cancel = CancelAfter(row=1, tokens=5)
    outs = SpeculativeDecoder(tiny, gamma=3, adaptive=adaptive).generate(
        prompts, max_new_tokens=40, on_tokens=cancel.on_tokens, cancelled=cancel)
    assert outs[1].finish_reason == "cancelled"
    # checked between steps: the row has at most one step's tokens (pending + gamma) beyond the threshold
    assert 5 <= len(outs[1].token_ids) == cancel.seen[1] < 5 + 3 + 1
    assert outs[1].token_ids == alone[1].token_ids[: len(outs[1].token_ids)]
    for i in (0, 2):
        assert (outs[i].token_ids, outs[i].finish_reason) == (alone[i].token_ids, alone[i].finish_reason)


def test_a_cancelled_request_gets_no_sidecars_and_the_others_are_unchanged(tiny) -> None:
    engine = SidecarEngine(tiny, gamma=3, adaptive=False)
    requests = [SidecarRequest(d, sidecars=[HASHTAGS]) for d in DOCS]
    alone = engine.run(requests, max_new_tokens=24)
    cancel = CancelAfter(row=0, tokens=3)
    results = engine.run(requests, max_new_tokens=24, on_tokens=cancel.on_tokens, cancelled=cancel)
    assert results[0].main.finish_reason == "cancelled" and results[0].sidecars == {}
    for i in (1, 2):
        assert results[i].main.token_ids == alone[i].main.token_ids
        assert results[i].sidecars["hashtags"].token_ids == alone[i].sidecars["hashtags"].token_ids
