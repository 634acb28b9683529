"""The fastest schedule a speculative decoder could follow over a finished greedy output: a bound on any engine.

Under greedy decoding the output does not depend on the drafts, and so one decoded output, with the forward
costs of the two models, tells what every schedule of steps would have cost. At each step boundary (output
position ``i``, the tokens before it committed) a decoder has three kinds of step:

- *plain*: one target forward of width 1; it yields the target's own token.
- *copy* of ``k`` tokens (prompt lookup, ``sidecar.decoding.lookup``): a verify of width ``k + 1``; it keeps
  the copied tokens up to the first the target disagrees with, and the target's own token after them.
- *draft* of ``g`` tokens from the draft model: ``g`` draft forwards and a verify of width ``g + 1``; the draft's
  greedy guesses agree with the output as long as its prefix is the output's, so the draft's argmax after each
  true prefix (one teacher-forced forward, ``study.analysis.scored_logits``) tells how many it would get right.

The bound is an oracle: it knows which drafts will be accepted, so it drafts or copies exactly what will be
kept, never stops a draft early, never pays a forward it did not need, pads each verify to the cheapest width
timed (``ForwardCosts.verify``), and prices every step at the measured forward costs alone (no host work between
forwards, no catch-up of the draft's cache after copies: each draft step's first forward is priced as a one-token
forward). The draft model's prefill is paid once when some
step drafts from it. Every simplification makes the oracle faster, never slower, so no decoder that verifies
one chain per step from these two sources, with these forwards, can beat it.

At batch ``B`` (``batch_bound``) the rows share each step: one verify of one width over every live row, and
the draft model's forwards over all of them. The bound relaxes that: every row follows its own fastest
schedule, paying its share of each forward of the full batch (``c_B(w) / B`` for a verify of width ``w``), and
the batch's prefill is paid once. No shared schedule is cheaper, given one property of the forwards, that a
forward's cost per row does not fall as the batch shrinks (``c_b(w) / b >= c_B(w) / B`` for ``b <= B``; the bench
checks it at ``b = 1``): a shared step of width ``w`` over ``b`` live rows costs ``c_b(w) >= b * c_B(w) / B``, at
least what the relaxation charges its rows, each of which it lets verify only the drafts it keeps.

What it does not bound: tree verification (several candidates in one verify), and a cheaper draft forward or
other kernels (``draft_scale_for`` says how cheap the draft would have to be). ``trees_of_copies_at_every_boundary``
prices one tree decoder without foresight: every earlier occurrence's continuation, merged into a token tree that
one verify checks (SpecInfer's and REST's token trees, whose nodes attend to their ancestors only).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from sidecar.decoding.lookup import lookup_continuation
from study.lookup_replay import matched


@dataclass(frozen=True)
class ForwardCosts:
    """Seconds per forward. ``target[w - 1]``: a target decode forward of ``w`` tokens (a plain step is w = 1, a
    verify of ``k`` drafts w = k + 1); ``draft``: one draft decode forward; the prefills: one forward over the
    prompt each (the target's yields the first output token)."""

    target: tuple[float, ...]
    draft: float
    target_prefill: float
    draft_prefill: float

    @property
    def widest_verify(self) -> int:
        """The most drafts one verify may hold: the widest target forward timed, less the target's own token."""
        return len(self.target) - 1

    def verify(self, drafts: int) -> float:
        """A target forward over ``drafts`` drafts and its own token, padded to whichever width timed at least as
        wide is cheapest: padding columns are computed and dropped, and on a CPU a wider forward can cost less
        (a one-token bf16 forward took longer than a two-token one where this was measured)."""
        return min(self.target[drafts:])


@dataclass(frozen=True)
class Schedule:
    seconds: float  # prefills and steps
    steps: tuple[tuple[str, int], ...]  # (kind, drafts) per step: ("plain", 0), ("copy", k), ("draft", g)
    uses_draft: bool

    @property
    def target_forwards(self) -> int:
        return 1 + len(self.steps)  # the prefill and one verify (or plain forward) per step


def copy_runs(prompt: Sequence[int], output: Sequence[int], most: int) -> tuple[list[int], list[int]]:
    """Per output position ``i``: how many tokens the engine's copy rule proposes there (up to ``most``; 0 where it
    has none), and how many of them greedy verification keeps; position 0 comes from the prefill."""
    context = list(prompt)
    proposed, kept = [0], [0]
    for i in range(1, len(output)):
        context.append(output[i - 1])
        copy = lookup_continuation(context, most)
        proposed.append(len(copy))
        kept.append(matched(copy, output, i))
    return proposed, kept


def best_copy_runs(prompt: Sequence[int], output: Sequence[int], most: int, max_ngram: int = 3) -> list[int]:
    """Per output position ``i``: the most tokens (up to ``most``) any copy rule could have had kept there: over
    every earlier occurrence of every suffix of 1 to ``max_ngram`` tokens, the longest continuation that the
    output repeats. The engine's rule and HF's each take one of these occurrences; an oracle may take the best."""
    text = [*prompt, *output]
    best = [0]
    for i in range(1, len(output)):
        end = len(prompt) + i  # the context is text[:end]
        kept = 0
        for start in range(end - 1):  # an occurrence of a suffix ending at ``start``, before the context's end
            n = 0
            while n < max_ngram and start - n >= 0 and text[start - n] == text[end - 1 - n]:
                n += 1
            if n:
                kept = max(kept, matched(text[start + 1 : min(start + 1 + most, end)], output, i))
        best.append(kept)
    return best


def copying_at_every_boundary(proposed: Sequence[int], kept: Sequence[int], costs: ForwardCosts,
                              width: int) -> Schedule:
    """Not a bound: the schedule of a decoder without foresight that copies up to ``width`` tokens at every step
    boundary where the rule has a copy (a plain step where it has none), priced like the bound (padded forwards)."""
    steps: list[tuple[str, int]] = []
    seconds, at = costs.target_prefill, 1
    while at < len(kept):
        copied = min(proposed[at], width)
        seconds += costs.verify(copied)
        steps.append(("copy", copied) if copied else ("plain", 0))
        at += min(kept[at], copied) + 1
    return Schedule(seconds, tuple(steps), uses_draft=False)


def priced_run(steps: Sequence[tuple[int, int]], costs: ForwardCosts, draft_prefilled: bool) -> float:
    """A decoder's own run priced like the schedules: its prefills (the draft's where it was prefilled) and, per
    step (``(width, draft_forwards)``: drafts verified, forwards of the draft model), the verify at the cheapest
    width that holds it and each draft forward at ``costs.draft``. Beside the run's measured time it tells its
    schedule apart from how its forwards ran: what the schedules' prices leave out (host work, forwards slower
    than the fastest of their rounds)."""
    if any(width > costs.widest_verify for width, _ in steps):
        raise ValueError(f"a step verifies more than the {costs.widest_verify} drafts whose forwards were timed")
    seconds = costs.target_prefill + (costs.draft_prefill if draft_prefilled else 0.0)
    return seconds + sum(costs.verify(width) + forwards * costs.draft for width, forwards in steps)


def copy_candidates(text: Sequence[int], end: int, most: int, max_ngram: int = 3) -> list[tuple[int, ...]]:
    """The distinct continuations (up to ``most`` tokens, within ``text[:end]``) that follow the earlier occurrences of
    the last ``max_ngram`` down to 1 tokens of ``text[:end]``: longer suffixes first, later occurrences first within
    one, so the first is the engine's copy rule's (``lookup_continuation``)."""
    candidates: dict[tuple[int, ...], None] = {}  # ordered and distinct
    for n in range(min(max_ngram, end - 1), 0, -1):
        suffix = list(text[end - n : end])
        for last in range(end - 2, n - 2, -1):  # an occurrence ending at ``last``, before the suffix itself
            if list(text[last - n + 1 : last + 1]) == suffix and (after := tuple(text[last + 1 : min(last + 1 + most,
                                                                                                      end)])):
                candidates.setdefault(after)
    return list(candidates)


def token_tree(candidates: Sequence[Sequence[int]], nodes: int) -> tuple[dict, int]:
    """The candidates merged into a token tree (nested dicts, token -> subtree) of at most ``nodes`` nodes, in their
    order: each adds the tokens it does not share with an earlier one, until the tree is full. Returns the tree and
    its nodes."""
    tree: dict = {}
    used = 0
    for candidate in candidates:
        at = tree
        for token in candidate:
            if token not in at:
                if used == nodes:
                    return tree, used
                at[token] = {}
                used += 1
            at = at[token]
    return tree, used


def tree_kept(tree: dict, output: Sequence[int], at: int) -> int:
    """How many of ``output[at:]`` a verify of ``tree`` keeps under greedy decoding: the path from its root that the
    output follows."""
    kept = 0
    while at + kept < len(output) and output[at + kept] in tree:
        tree = tree[output[at + kept]]
        kept += 1
    return kept


def trees_of_copies_at_every_boundary(prompt: Sequence[int], output: Sequence[int], costs: ForwardCosts, nodes: int,
                                      depth: int) -> Schedule:
    """Not a bound: a decoder without foresight that verifies, at every step boundary, a token tree of up to ``nodes``
    copied tokens (every candidate continuation of up to ``depth`` tokens, ``copy_candidates``), priced as a verify of
    that many drafts (``ForwardCosts.verify``; a plain step where no suffix occurred before). It keeps the path the
    output follows, so it keeps at least what a copy of the rule's first candidate alone would."""
    text = [*prompt, *output]
    steps: list[tuple[str, int]] = []
    seconds, at = costs.target_prefill, 1
    while at < len(output):
        tree, used = token_tree(copy_candidates(text, len(prompt) + at, depth), nodes)
        seconds += costs.verify(used)
        steps.append(("tree", used) if used else ("plain", 0))
        at += tree_kept(tree, output, at) + 1
    return Schedule(seconds, tuple(steps), uses_draft=False)


def draft_runs(predictions: Sequence[int], output: Sequence[int]) -> list[int]:
    """Per output position ``i``: how many draft tokens from ``i`` on equal the output, where ``predictions[j]`` is
    the draft's greedy token after the true prefix ``output[:j]``."""
    runs = [0] * (len(output) + 1)
    for j in range(len(output) - 1, -1, -1):
        runs[j] = runs[j + 1] + 1 if predictions[j] == output[j] else 0
    return runs[:-1]


def fastest_schedule(copies: Sequence[int], drafts: Sequence[int] | None, costs: ForwardCosts,
                     max_gamma: int) -> Schedule:
    """The cheapest schedule that produces an output of ``len(copies)`` tokens: plain steps, copies of up to
    ``costs.widest_verify`` tokens (``copies[i]`` of them kept at position ``i``) and, where ``drafts`` is given,
    draft steps of up to ``max_gamma`` tokens (``drafts[i]`` kept at ``i``). With the draft model its prefill is
    paid once, so the schedule is the cheaper of the best one with it and the best one without it."""
    if not copies:
        raise ValueError("an output has at least one token (the prefill's)")
    without = cheapest_steps(copies, None, costs, max_gamma)
    if drafts is None:
        return without
    return min(without, cheapest_steps(copies, drafts, costs, max_gamma), key=lambda s: s.seconds)


def cheapest_steps(copies: Sequence[int], drafts: Sequence[int] | None, costs: ForwardCosts,
                   max_gamma: int) -> Schedule:
    """``fastest_schedule`` with the draft model's steps offered (``drafts``) or not (None), by dynamic programming
    over output positions; the draft's prefill is charged if some step drafts."""
    n = len(copies)
    best = [float("inf")] * (n + 1)
    came_from: list[tuple[int, str, int]] = [(0, "plain", 0)] * (n + 1)  # (position, kind, drafts) of the last step
    best[1] = 0.0  # the prefill yields the first token; its cost is added below
    for i in range(1, n):
        options = [("plain", 0, costs.verify(0))]
        options += [("copy", k, costs.verify(k)) for k in range(1, min(copies[i], costs.widest_verify) + 1)]
        if drafts is not None:
            options += [("draft", g, g * costs.draft + costs.verify(g))
                        for g in range(1, min(drafts[i], max_gamma, costs.widest_verify) + 1)]
        for kind, kept, seconds in options:
            after = min(i + kept + 1, n)
            if best[i] + seconds < best[after]:
                best[after] = best[i] + seconds
                came_from[after] = (i, kind, kept)
    steps: list[tuple[str, int]] = []
    at = n
    while at > 1:
        at, kind, kept = came_from[at]
        steps.append((kind, kept))
    steps.reverse()
    uses_draft = any(kind == "draft" for kind, _ in steps)
    prefills = costs.target_prefill + (costs.draft_prefill if uses_draft else 0.0)
    return Schedule(best[n] + prefills, tuple(steps), uses_draft)


def draft_scale_for(seconds: float, rows: Sequence[tuple[Sequence[int], Sequence[int], ForwardCosts]],
                    max_gamma: int, iterations: int = 40) -> float | None:
    """The largest factor (at most 1) on the draft model's costs, its forwards and its prefill alike, at which the
    fastest schedules of ``rows`` (``copies``, ``drafts``, ``costs`` per output) take ``seconds`` in all or less,
    by bisection; None when even a free draft model cannot (the copies and the target's forwards alone are too
    dear). 1 means the draft as measured is cheap enough."""

    def total(factor: float) -> float:
        return sum(fastest_schedule(copies, drafts, replace(costs, draft=costs.draft * factor,
                                                            draft_prefill=costs.draft_prefill * factor),
                                    max_gamma).seconds for copies, drafts, costs in rows)

    if total(0.0) > seconds:
        return None
    if total(1.0) <= seconds:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(iterations):
        middle = (low + high) / 2
        low, high = (middle, high) if total(middle) <= seconds else (low, middle)
    return low


def batch_bound(rows: Sequence[tuple[Sequence[int], Sequence[int] | None]], batch_costs: ForwardCosts,
                max_gamma: int) -> float:
    """The least seconds any decoder takes over a batch of ``len(rows)`` outputs (``copies``, ``drafts`` per row, as
    ``fastest_schedule`` reads them): the batch's target prefill plus each row's fastest schedule at its share of
    the batch's forwards (the module docstring says why no shared schedule is cheaper). ``batch_costs`` holds the
    whole batch's forwards: ``target[w - 1]`` a verify of width ``w`` over every row, ``draft`` one draft forward
    over every row, the prefills of all rows (the draft's charged only to the rows that draft, in shares)."""
    if not rows:
        raise ValueError("a batch has at least one row")
    per_row = row_share(batch_costs, len(rows))
    return batch_costs.target_prefill + sum(fastest_schedule(copies, drafts, per_row, max_gamma).seconds
                                            for copies, drafts in rows)


def row_share(batch_costs: ForwardCosts, rows: int) -> ForwardCosts:
    """One row's share of a batch's forwards (``batch_bound``): each forward and the draft's prefill over ``rows``;
    no target prefill (the batch pays it once)."""
    return ForwardCosts(tuple(s / rows for s in batch_costs.target), batch_costs.draft / rows, 0.0,
                        batch_costs.draft_prefill / rows)
