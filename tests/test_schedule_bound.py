"""The fastest-schedule bound (study/schedule_bound.py): the dynamic programme against exhaustive search, the
runs it reads off an output, and the draft-cost bisection."""

from __future__ import annotations

import functools
import itertools
import random

import pytest

from sidecar.decoding.lookup import lookup_continuation
from study.lookup_replay import hf_rule, matched
from study.schedule_bound import (
    ForwardCosts,
    batch_bound,
    best_copy_runs,
    copy_candidates,
    copy_runs,
    copying_at_every_boundary,
    draft_runs,
    draft_scale_for,
    fastest_schedule,
    priced_run,
    token_tree,
    tree_kept,
    trees_of_copies_at_every_boundary,
)

COSTS = ForwardCosts(target=(1.0, 1.1, 1.25, 1.4, 1.6), draft=0.45, target_prefill=6.0, draft_prefill=2.0)


def exhaustive(copies: list[int], drafts: list[int] | None, costs: ForwardCosts, max_gamma: int) -> float:
    """Every schedule's seconds, the cheapest: each step from position i is plain, a copy of 1..copies[i] or a
    draft of 1..drafts[i] tokens."""
    n = len(copies)

    def best(at: int, drafted: bool) -> float:
        if at >= n:
            return costs.draft_prefill if drafted else 0.0
        options = [min(costs.target) + best(at + 1, drafted)]  # any width holds a plain step, padded
        options += [min(costs.target[k:]) + best(at + k + 1, drafted)
                    for k in range(1, min(copies[at], costs.widest_verify) + 1)]
        if drafts is not None:
            options += [g * costs.draft + min(costs.target[g:]) + best(at + g + 1, True)
                        for g in range(1, min(drafts[at], max_gamma, costs.widest_verify) + 1)]
        return min(options)

    return costs.target_prefill + best(1, False)


def shared_steps(rows: list[tuple[list[int], list[int] | None]], costs: dict[int, ForwardCosts],
                 max_gamma: int) -> float:
    """Every schedule of a batch whose rows share each step, the cheapest: a step verifies one width ``w`` over the
    live rows (``costs[b]``: forwards over ``b`` rows), each row keeping what its copy, or its draft where the step
    runs ``w`` draft forwards, has right there; a row leaves the batch when its output is done. The draft's prefill
    (the whole batch's) is paid once if some step drafts."""
    lengths = [len(copies) for copies, _ in rows]
    widest = costs[len(rows)].widest_verify

    @functools.cache
    def best(at: tuple[int, ...], drafted: bool) -> float:
        live = [r for r, a in enumerate(at) if a < lengths[r]]
        if not live:
            return costs[len(rows)].draft_prefill if drafted else 0.0
        batch = costs[len(live)]
        options = []
        for w in range(widest + 1):
            for sources in itertools.product(*[("copy", "draft") if rows[r][1] is not None else ("copy",)
                                               for r in live]):
                drafts = "draft" in sources
                if drafts and not 0 < w <= max_gamma:
                    continue
                after = list(at)
                for r, source in zip(live, sources, strict=True):
                    runs = rows[r][0] if source == "copy" else rows[r][1]
                    after[r] += min(runs[at[r]], w) + 1
                seconds = batch.verify(w) + (w * batch.draft if drafts else 0.0)
                options.append(seconds + best(tuple(after), drafted or drafts))
        return min(options)

    return costs[len(rows)].target_prefill + best((1,) * len(rows), False)


@pytest.mark.parametrize("seed", range(30))
def test_no_shared_schedule_of_a_batch_is_cheaper_than_its_bound(seed: int) -> None:
    rng = random.Random(seed)
    rows = []
    for _ in range(2):
        n = rng.randint(1, 6)
        rows.append(([0] + [rng.choice([0, 0, 1, 2, 4]) for _ in range(n - 1)],
                     [0] + [rng.choice([0, 1, 2, 3]) for _ in range(n - 1)] if seed % 3 else None))
    one = [rng.uniform(0.5, 2.0) for _ in range(4)]
    # two rows cost at most twice one row's forward, and at least as much as one: a row's share never grows
    # with the batch
    two = ForwardCosts(tuple(c * rng.uniform(1.0, 2.0) for c in one), rng.uniform(0.1, 0.8), rng.uniform(0, 5),
                       rng.uniform(0, 3))
    costs = {1: ForwardCosts(tuple(one), two.draft * rng.uniform(0.5, 1.0), 0.0, 0.0), 2: two}
    bound = batch_bound(rows, two, max_gamma=3)
    assert bound <= shared_steps(rows, costs, max_gamma=3) + 1e-9
    # with one row there is nothing to share: the bound is that row's fastest schedule
    single = ForwardCosts(tuple(one), 0.3, 2.0, 1.0)
    assert batch_bound(rows[:1], single, 3) == pytest.approx(fastest_schedule(*rows[0], single, 3).seconds)
    assert batch_bound(rows[:1], single, 3) == pytest.approx(shared_steps(rows[:1], {1: single}, 3))


@pytest.mark.parametrize("seed", range(40))
def test_the_schedule_is_the_cheapest_of_all_schedules(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 10)
    copies = [0] + [rng.choice([0, 0, 1, 2, 3, 5]) for _ in range(n - 1)]
    drafts = [0] + [rng.choice([0, 1, 2, 4, 6]) for _ in range(n - 1)]
    widths = [rng.uniform(0.5, 2.0) for _ in range(5)]  # a wider forward may cost less (bf16 on a CPU)
    costs = ForwardCosts(tuple(widths if seed % 2 else sorted(widths)), rng.uniform(0.05, 1.0),
                         rng.uniform(0.0, 5.0), rng.uniform(0.0, 5.0))
    for offered in (drafts, None):
        schedule = fastest_schedule(copies, offered, costs, max_gamma=3)
        assert schedule.seconds == pytest.approx(exhaustive(copies, offered, costs, 3))
        # the steps it names cover the output and cost what it says
        at, seconds = 1, costs.target_prefill + (costs.draft_prefill if schedule.uses_draft else 0.0)
        for kind, kept in schedule.steps:
            assert kept <= {"plain": 0, "copy": copies[at], "draft": drafts[at] if offered else -1}[kind]
            seconds += costs.verify(kept) + (kept * costs.draft if kind == "draft" else 0.0)
            at += kept + 1
        assert at >= n and seconds == pytest.approx(schedule.seconds)


def test_the_draft_model_is_used_only_where_its_prefill_is_repaid() -> None:
    copies, drafts = [0] * 12, [0] + [11 - i for i in range(11)]
    assert fastest_schedule(copies, drafts, COSTS, 4).uses_draft
    dear = ForwardCosts(COSTS.target, COSTS.draft, COSTS.target_prefill, draft_prefill=100.0)
    schedule = fastest_schedule(copies, drafts, dear, 4)
    assert not schedule.uses_draft and schedule.seconds == pytest.approx(6.0 + 11 * 1.0)
    assert fastest_schedule(copies, None, COSTS, 4).steps == (("plain", 0),) * 11


def test_a_copy_is_taken_where_it_saves_steps_and_never_wider_than_timed() -> None:
    copies = [0, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0]  # a long copy at position 1; verifies hold at most 4 drafts
    schedule = fastest_schedule(copies, None, COSTS, 4)
    assert schedule.steps[0] == ("copy", 4) and schedule.target_forwards == 1 + 1 + 5


def test_runs_are_read_off_the_output() -> None:
    prompt, output = [7, 8, 9, 1], [7, 8, 9, 2, 5]
    # after [7] the engine's rule copies what followed the latest 7 (8, 9, 1): 8 and 9 are kept, 1 is not
    assert copy_runs(prompt, output, 4) == ([0, 4, 4, 4, 0], [0, 2, 1, 0, 0])
    assert draft_runs([7, 0, 9, 2, 5], output) == [1, 0, 3, 2, 1]


def test_the_draft_scale_reaches_the_time_asked_for() -> None:
    rows = [([0] * 30, [0, *range(29, 0, -1)], COSTS)]
    as_measured = fastest_schedule(*rows[0], 4).seconds
    assert draft_scale_for(as_measured, rows, 4) == 1.0
    assert draft_scale_for(COSTS.target_prefill, rows, 4) is None  # the prefill alone already takes that long
    goal = as_measured * 0.85
    scale = draft_scale_for(goal, rows, 4)
    assert scale is not None and 0 < scale < 1
    cheaper = ForwardCosts(COSTS.target, COSTS.draft * scale, COSTS.target_prefill, COSTS.draft_prefill * scale)
    assert fastest_schedule(*rows[0][:2], cheaper, 4).seconds == pytest.approx(goal, rel=1e-6)


def test_copying_at_every_boundary_verifies_what_the_rule_proposes_and_is_never_below_the_bound() -> None:
    proposed, kept = [0, 4, 4, 0, 2, 0, 0, 3], [0, 3, 0, 0, 0, 0, 0, 3]
    schedule = copying_at_every_boundary(proposed, kept, COSTS, width=4)
    # a copy of 4 keeps 3 (to position 5), two plain steps, a copy of 3 keeps its 3 and the target's own: done
    assert schedule.steps == (("copy", 4), ("plain", 0), ("plain", 0), ("copy", 3))
    assert schedule.seconds == pytest.approx(6.0 + 1.6 + 1.0 + 1.0 + 1.4)
    narrow = copying_at_every_boundary(proposed, kept, COSTS, width=1)
    assert narrow.steps[0] == ("copy", 1)
    for width in (1, 2, 4):
        assert copying_at_every_boundary(proposed, kept, COSTS, width).seconds >= fastest_schedule(
            kept, None, COSTS, 4).seconds


def test_a_run_is_priced_step_by_step_like_the_schedules() -> None:
    # a copy of 4, a plain step, a draft step of 2 (two draft forwards): with the draft's prefill where it ran
    steps = [(4, 0), (0, 0), (2, 2)]
    assert priced_run(steps, COSTS, draft_prefilled=True) == pytest.approx(6.0 + 2.0 + 1.6 + 1.0 + 1.25 + 2 * 0.45)
    assert priced_run(steps, COSTS, draft_prefilled=False) == pytest.approx(6.0 + 1.6 + 1.0 + 1.25 + 2 * 0.45)
    walk = copying_at_every_boundary([0, 4, 4, 0, 2, 0, 0, 3], [0, 3, 0, 0, 0, 0, 0, 3], COSTS, width=4)
    assert priced_run([(k, 0) for _, k in walk.steps], COSTS, False) == pytest.approx(walk.seconds)
    with pytest.raises(ValueError, match="4 drafts"):
        priced_run([(5, 0)], COSTS, False)


def test_a_step_runs_padded_to_a_wider_forward_where_that_one_is_cheaper() -> None:
    """On a CPU in bf16 a one-token forward was measured dearer than a two-token one: a plain step padded to
    two columns costs the cheaper forward."""
    costs = ForwardCosts(target=(1.2, 1.0, 1.1, 1.3), draft=0.4, target_prefill=5.0, draft_prefill=2.0)
    assert [costs.verify(k) for k in range(4)] == [1.0, 1.0, 1.1, 1.3]
    assert fastest_schedule([0] * 6, None, costs, 3).seconds == pytest.approx(5.0 + 5 * 1.0)


@pytest.mark.parametrize("seed", range(20))
def test_the_best_copy_is_never_shorter_than_the_engines_or_hfs(seed: int) -> None:
    rng = random.Random(seed)
    prompt = [rng.randrange(6) for _ in range(rng.randint(2, 30))]  # a small vocabulary: many matches
    output = [rng.randrange(6) for _ in range(rng.randint(1, 20))]
    best = best_copy_runs(prompt, output, 4)
    engine = copy_runs(prompt, output, 4)[1]
    hf = [0] + [matched(hf_rule()([*prompt, *output[:i]], 4), output, i) for i in range(1, len(output))]
    assert len(best) == len(output) and all(b >= max(e, h) for b, e, h in zip(best, engine, hf, strict=True))


def test_the_best_copy_takes_the_occurrence_whose_continuation_holds() -> None:
    # after "... 9 1" the engine's rule copies what followed the longest earlier suffix, "9 1": "5 6", which the
    # output does not repeat; the best copy follows the first "1": "2 3", which it does
    prompt, output = [1, 2, 3, 9, 1, 5, 6, 9], [1, 2, 3]
    assert copy_runs(prompt, output, 4)[1] == [0, 0, 1]
    assert best_copy_runs(prompt, output, 4) == [0, 2, 1]


def test_a_token_tree_merges_shared_prefixes_within_its_nodes_and_keeps_the_path_the_output_follows() -> None:
    tree, used = token_tree([(5, 6, 7), (5, 8), (9,)], nodes=10)
    assert tree == {5: {6: {7: {}}, 8: {}}, 9: {}} and used == 5
    assert tree_kept(tree, [0, 5, 8, 1], 1) == 2 and tree_kept(tree, [0, 5, 6, 7, 1], 1) == 3
    assert tree_kept(tree, [0, 1], 1) == 0 and tree_kept(tree, [0, 5], 1) == 1  # the output's end stops the walk
    small, used = token_tree([(5, 6, 7), (5, 8), (9,)], nodes=4)
    assert small == {5: {6: {7: {}}, 8: {}}} and used == 4


@pytest.mark.parametrize("seed", range(20))
def test_copy_candidates_start_with_the_engines_copy_and_a_whole_tree_keeps_the_best_copy(seed: int) -> None:
    rng = random.Random(seed)
    prompt = [rng.randrange(6) for _ in range(rng.randint(2, 30))]
    output = [rng.randrange(6) for _ in range(rng.randint(2, 20))]
    text, best = [*prompt, *output], best_copy_runs(prompt, output, 4)
    for i in range(1, len(output)):
        candidates = copy_candidates(text, len(prompt) + i, 4)
        assert len(set(candidates)) == len(candidates)
        assert list(candidates[0] if candidates else ()) == lookup_continuation(text[: len(prompt) + i], 4)
        assert tree_kept(token_tree(candidates, nodes=10_000)[0], output, i) == best[i]


@pytest.mark.parametrize("seed", range(10))
def test_a_tree_of_copies_at_every_boundary_keeps_at_least_the_rules_copy_and_is_never_below_the_bound(
        seed: int) -> None:
    rng = random.Random(seed)
    prompt = [rng.randrange(5) for _ in range(rng.randint(2, 30))]
    output = [rng.randrange(5) for _ in range(rng.randint(2, 20))]
    text, kept = [*prompt, *output], copy_runs(prompt, output, 4)[1]
    for i in range(1, len(output)):  # the rule's copy comes first and fills the tree first
        assert tree_kept(token_tree(copy_candidates(text, len(prompt) + i, 4), nodes=4)[0], output, i) >= kept[i]
    free = ForwardCosts(target=(1.0,) * 5, draft=0.45, target_prefill=6.0, draft_prefill=2.0)  # every width alike
    for costs in (COSTS, free):
        for nodes, depth in ((4, 4), (4, 2), (2, 1)):
            assert trees_of_copies_at_every_boundary(prompt, output, costs, nodes, depth).seconds >= fastest_schedule(
                best_copy_runs(prompt, output, 4), None, costs, 4).seconds - 1e-9
