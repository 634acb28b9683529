"""Prompt lookup replayed over a finished greedy output: how much a copy rule would win, without a model.

Under greedy decoding the output does not depend on the drafts, and a copy's proposal depends only on the
text before it, so one decoded output tells what any copy rule would have proposed and had accepted. Two
ways to count it:

- ``per_position``: a copy proposed after every prefix of the output. This is the usual teacher-forced
  estimate, and it overstates a decoder's acceptance: a decoder proposes only at step boundaries, so a run
  of ``n`` tokens that copy well takes about ``n / (width + 1)`` of its steps, while a stretch that copies
  nothing takes a step per token. Counting every position weights the well-copied stretches ``width + 1``
  times over.
- ``stepped``: the decoder's walk, a copy at each step boundary (a plain step where the rule has none),
  advancing by the accepted copies plus the target's own token. Its tokens per target forward are what a
  decoder copying at every chance would reach.

``engine_steps`` walks the engine's own recorded decisions (``GammaController.decisions``) instead, which
checks the engine's lookup counters (``GenerationStats.lookup_drafted``/``lookup_accepted``) against the rule.
The rules replayed: the engine's, Hugging Face's, and ``longest_match_rule``, which weighs how much context an
occurrence shares.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sidecar.decoding.lookup import lookup_continuation

# (context, most tokens) -> the copy proposed after ``context``
CopyRule = Callable[[Sequence[int], int], list[int]]


@dataclass
class Replay:
    drafted: int = 0  # copied tokens verified
    accepted: int = 0  # of them, accepted
    copy_steps: int = 0
    plain_steps: int = 0
    tokens: int = 0  # output tokens the walk produced (the first one from the prefill)
    prefills: int = 0  # rows walked: each one's prefill is a target forward, and yields its first token

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def target_forwards(self) -> int:
        """Each row's prefill (which yields its first token) and one forward per step."""
        return self.prefills + self.copy_steps + self.plain_steps

    @property
    def tokens_per_target_forward(self) -> float:
        return self.tokens / self.target_forwards if self.target_forwards else 0.0

    def step(self, proposal: Sequence[int], output: Sequence[int], at: int) -> int:
        """One target forward at output position ``at``: verifying ``proposal`` (a plain step where it is
        empty). Returns the position after the tokens it kept and the target's own."""
        if not proposal:
            self.plain_steps += 1
            return at + 1
        run = matched(proposal, output, at)
        self.copy_steps += 1
        self.drafted += len(proposal)
        self.accepted += run
        return at + run + 1

    def __add__(self, other: Replay) -> Replay:
        return Replay(self.drafted + other.drafted, self.accepted + other.accepted,
                      self.copy_steps + other.copy_steps, self.plain_steps + other.plain_steps,
                      self.tokens + other.tokens, self.prefills + other.prefills)


def engine_rule(context: Sequence[int], most: int) -> list[int]:
    """The engine's rule (``sidecar.decoding.lookup``)."""
    return lookup_continuation(context, most)


def hf_rule(max_ngram: int = 2) -> CopyRule:
    """Hugging Face's prompt lookup (``PromptLookupCandidateGenerator``, transformers 5): the longest suffix of up
    to ``max_ngram`` tokens, its earliest occurrence whose continuation is not empty."""

    def rule(context: Sequence[int], most: int) -> list[int]:
        tokens = list(context)
        length = len(tokens)
        for n in range(min(max_ngram, length - 1), 0, -1):
            suffix = tokens[length - n :]
            for start in range(length - n):
                if tokens[start : start + n] == suffix:
                    return tokens[start + n : start + n + most]
        return []

    return rule


def longest_match_rule(context: Sequence[int], most: int) -> list[int]:
    """Of every earlier occurrence of the context's last token, the one whose preceding tokens agree with the
    context's for longest (the latest of equals): a rule that weighs how much context a match shares where the
    engine's looks at the last 1-3 tokens only."""
    tokens = list(context)
    end = len(tokens)
    best, start = 0, -1
    for last in range(end - 2, -1, -1):  # an occurrence ending at ``last``, before the context's own last token
        length = 0
        while length <= last and tokens[last - length] == tokens[end - 1 - length]:
            length += 1
        if length > best:
            best, start = length, last + 1
    return tokens[start : start + most] if best else []


def matched(proposal: Sequence[int], output: Sequence[int], at: int) -> int:
    """How many of ``proposal`` greedy verification accepts at output position ``at``."""
    run = 0
    while run < len(proposal) and at + run < len(output) and proposal[run] == output[at + run]:
        run += 1
    return run


def room(at: int, limit: int | None, width: int) -> int:
    """The longest copy at output position ``at`` under a token limit, as the engine sizes it: one token is
    always the target's own (``StepPlanner.choose``)."""
    return width if limit is None else max(min(width, limit - at - 1), 0)


def per_position(prompt: Sequence[int], output: Sequence[int], width: int, rule: CopyRule = engine_rule,
                 limit: int | None = None) -> Replay:
    """A copy of up to ``width`` tokens proposed after every prefix of ``output`` past its first token."""
    replay = Replay(tokens=len(output), prefills=1)
    for at in range(1, len(output)):
        proposal = rule([*prompt, *output[:at]], room(at, limit, width))
        if proposal:
            replay.copy_steps += 1
            replay.drafted += len(proposal)
            replay.accepted += matched(proposal, output, at)
    return replay


def stepped(prompt: Sequence[int], output: Sequence[int], width: int, rule: CopyRule = engine_rule,
            limit: int | None = None, min_copy: int = 1) -> Replay:
    """The decoder's walk over ``output``: at each step boundary a copy of up to ``width`` tokens when the rule
    has at least ``min_copy``, else a plain step."""
    replay = Replay(tokens=len(output), prefills=1)
    at = 1
    while at < len(output):
        proposal = rule([*prompt, *output[:at]], room(at, limit, width))
        at = replay.step(proposal if len(proposal) >= min_copy else [], output, at)
    return replay


def engine_steps(prompt: Sequence[int], output: Sequence[int], decisions: Sequence[tuple[int, str]],
                 rule: CopyRule = engine_rule) -> Replay:
    """Walk the engine's decisions for one row, (width, source) per step: copies of ``width`` tokens from
    ``rule`` and plain steps. A step drafting from the draft model is refused: its acceptance is not the rule's."""
    replay = Replay(tokens=len(output), prefills=1)
    at = 1
    for width, source in decisions:
        if at >= len(output):
            break
        if width and source == "draft":
            raise ValueError("a draft-model step cannot be replayed without the draft model")
        proposal = rule([*prompt, *output[:at]], width)[:width] if width else []
        if len(proposal) < width:
            raise ValueError(f"the engine copied {width} tokens at output position {at}; the rule has "
                             f"{len(proposal)}")
        at = replay.step(proposal, output, at)
    return replay
