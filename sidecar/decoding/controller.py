"""Choosing how many tokens to draft from measured costs and acceptance.

Drafting pays only when the tokens it wins are worth more than what the draft forwards and the wider
verify forward cost. On a GPU at small batch a verify forward costs about as much as a plain step; on a
CPU, or at large batch anywhere, forward time grows with the number of tokens processed, and
speculation can lose. The controller fits, for each model, forward seconds ~ a + b * tokens (tokens =
batch rows x query length) from the forwards it has timed, estimates the per-position acceptance rate
alpha, and picks the gamma in 0..max that maximises expected tokens per second:

    E[tokens](g) = (1 - alpha^(g+1)) / (1 - alpha)
    cost(g)      = g * t_draft(batch) + t_target(batch * (g + 1))      (g = 0: one plain target step)

gamma = 0 is plain decoding, still lossless. Until both models have been timed at two sizes it explores:
one speculative step at the maximum gamma, then one plain step.

Drafts have two sources, each with its own acceptance: the draft model, and prompt lookup
(``sidecar.decoding.lookup``), offered when every row of the batch has a continuation to copy. Lookup drafts cost
no draft forwards, only the wider verify, so for them cost(g) = t_target(batch * (g + 1)), and g runs up to
``max_copy``, which may exceed the draft model's ``max_gamma`` (the planner offers the widths the target's
forwards can take: ``sidecar.decoding.plan.copy_widths``).

A one-row eager forward runs padded to the cheapest width that holds it, where a CPU's narrower products are
measured slower (``sidecar.runtime.padding``: on this project's EPYC in bf16 every width of 1-5 runs at 5). Its
timings are kept, and its cost predicted, at the width it runs at (``runs_at``): a plain step and a verify of
four drafts then cost alike, as they do, instead of the fit's slope making each extra draft look dear, and the
noise between such near-equal timings cannot tilt the choice toward shorter copies.

A fit from small forwards cannot see where a device runs out of parallel work: on a CPU, a decode forward
timed at 1-5 tokens looks flat, and a verify of 40 tokens at batch 8 would look nearly free. So no forward is
priced below what the model's prefill costs per token (``forward_seconds``): a prefill is the most tokens per
second the model does, on any device (on a GPU its floor is far below a decode forward's time, and binds nowhere).

At a batch of several rows a copy step need not wait for every row to have a copy: rows copy what they have,
each up to the step's width, and the others verify only their pending token (``copy_lengths``). Where the
target's forward packs the rows' real tokens (an eager decoder stack, ``sidecar.runtime.decoder_stack``) such a
step costs t_target(sum of the rows' 1 + copy), and yields each row's expected tokens for its own copy; where it
runs the padded shape, it costs t_target(batch x (g + 1)) whatever the rows copy.

Before a batch starts, ``draft_pays`` also prices the draft's own prefill, which on a CPU is a large
fixed cost (prefill is compute-bound there): unless the decode-phase gain repays it with a margin, the
batch decodes without the draft model (plain steps, and copies for the rows that have one). The gain is
counted against that alternative, not against plain decoding alone: where copying beats the draft model
the draft only helps on the steps without a copy.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Literal

import torch

from sidecar.runtime.timing import DeviceTimer

# draft_pays wants speculation to promise at least this share of the plain batch's time back: the draft's
# prefill is a certain cost, while the gain is a forecast from costs fitted at other batch sizes and from
# acceptance measured on other rows, so a near-even forecast can as well be a loss.
MIN_PREDICTED_SAVING = 0.1

# The latest decisions kept for inspection: a long-lived server's controller stays the same size.
DECISIONS_KEPT = 1024

# After this many steps in a row without a copy (plain or from the draft model) the controller copies when
# some row has something to copy.
LOOKUP_PROBE_EVERY = 8

Source = Literal["draft", "lookup"]


def is_copy(step: tuple[int, Source]) -> bool:
    gamma, source = step
    return gamma > 0 and source == "lookup"


def fixed_step(max_gamma: int, max_lookup: int) -> tuple[int, Source]:
    """The step of a fixed gamma: ``max_gamma`` drafts, copied when every row can copy that many (it spares
    the draft model's forwards), else from the draft model; (0, "draft") is a plain step."""
    if 0 < max_gamma <= max_lookup:
        return max_gamma, "lookup"
    return max_gamma, "draft"


class LinearCost:
    """Least-squares fit of seconds = a + b * tokens over the forward sizes seen, one point per size: the
    recent mean of its timings.

    One point per size, not a window of raw timings: once the controller settles on plain decoding every
    new timing is a one-token step, and a window would forget what wider forwards cost. With one size
    left the slope reads 0, and a verify of 40 tokens at batch 8 looks as cheap as one step.
    """

    def __init__(self, max_sizes: int = 16, decay: float = 0.7) -> None:
        self.decay = decay
        self.max_sizes = max_sizes
        self.means: dict[float, float] = {}  # insertion order is recency: the oldest size is dropped first
        self.timed_once: set[float] = set()

    def add(self, tokens: int, seconds: float) -> None:
        size = float(tokens)
        previous = self.means.pop(size, None)
        # A size's first forward pays one-off costs (oneDNN builds its kernels per shape, a GPU's allocator
        # grows): the second timing replaces it instead of being blended with it, so one slow first timing
        # does not keep that size looking dear.
        if previous is None:
            self.means[size] = seconds
            self.timed_once.add(size)
        elif size in self.timed_once:
            self.means[size] = seconds
            self.timed_once.discard(size)
        else:
            self.means[size] = self.decay * previous + (1 - self.decay) * seconds
        if len(self.means) > self.max_sizes:
            dropped = next(iter(self.means))
            del self.means[dropped]
            self.timed_once.discard(dropped)

    def distinct_sizes(self) -> int:
        return len(self.means)

    def predict(self, tokens: int) -> float:
        points = list(self.means.items())
        mean_x = sum(x for x, _ in points) / len(points)
        mean_y = sum(y for _, y in points) / len(points)
        var = sum((x - mean_x) ** 2 for x, _ in points)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / var if var else 0.0
        slope = max(slope, 0.0)  # more tokens never make a forward cheaper
        intercept = max(mean_y - slope * mean_x, 0.0)
        return intercept + slope * tokens


class Acceptance:
    """Per-position acceptance of one draft source as a running ratio with a weak prior, decayed so that
    it follows the current batch."""

    def __init__(self, prior_alpha: float) -> None:
        self.accepted = prior_alpha * 4
        self.drafted = 4.0

    @property
    def alpha(self) -> float:
        return min(self.accepted / self.drafted, 0.99)

    def observe(self, accepted: Sequence[int], gamma: int) -> None:
        """One verify: each row's accepted count is a geometric run of successes out of ``gamma`` drafts."""
        decay = 0.9
        self.accepted = decay * self.accepted + sum(accepted)
        self.drafted = decay * self.drafted + sum(min(a + 1, gamma) for a in accepted)


class GammaController:
    def __init__(self, max_gamma: int, adaptive: bool = True, prior_alpha: float = 0.7,
                 max_copy: int | None = None) -> None:
        self.max_gamma = max_gamma
        self.max_copy = max_gamma if max_copy is None else max_copy  # the longest copy a step may verify
        self.adaptive = adaptive
        self.costs = {"draft": LinearCost(), "target": LinearCost()}
        # copied text is accepted less often than a model's guess until measured otherwise
        self.acceptance: dict[Source, Acceptance] = {"draft": Acceptance(prior_alpha),
                                                     "lookup": Acceptance(prior_alpha / 2)}
        self.decisions: deque[tuple[int, Source]] = deque(maxlen=DECISIONS_KEPT)
        self.steps_without_copy = 0  # plain or draft-model steps in a row, up to the latest decision
        self.prefill_seconds_per_token: dict[str, float] = {}  # the latest prefill's, per model
        self.fastest_prefill_per_token: dict[str, float] = {}  # the least seen, per model: ``forward_seconds``'s floor
        # the share of rows that had something to copy, per step (decayed); None until observed
        self.row_copy_share: float | None = None
        # per model, the tokens a decode forward of (rows, tokens) computes (``runs_at``); the decoder sets it
        self.decode_tokens: dict[str, Callable[[int, int], int]] = {}
        self._timers: dict[torch.device, DeviceTimer] = {}

    def runs_at(self, model: str, rows: int, tokens: int) -> int:
        """The tokens a decode forward of ``model`` over ``rows`` rows and ``tokens`` tokens computes
        (``decode_tokens``: a one-row forward's padded width), else ``tokens``."""
        computed = self.decode_tokens.get(model)
        return tokens if computed is None else computed(rows, tokens)

    def explored(self, batch: int, widest: int) -> bool:
        """Whether the target's cost fit has what it needs for steps of ``batch`` rows and up to ``widest`` drafts
        per row: timings at two sizes, or at the sizes a plain step and the widest one run at where those are
        one (``runs_at``: one-row forwards padded alike)."""
        timed = self.costs["target"].means
        return len(timed) >= 2 or all(self.runs_at("target", batch, batch * (g + 1)) in timed for g in (0, widest))

    def observe_copies(self, rows_with_copy: int, rows: int) -> None:
        share = rows_with_copy / rows
        self.row_copy_share = share if self.row_copy_share is None else 0.9 * self.row_copy_share + 0.1 * share

    def observe_acceptance(self, accepted: Sequence[int], gamma: int, source: Source = "draft") -> None:
        self.acceptance[source].observe(accepted, gamma)

    def expected_tokens_per_second(self, gamma: int, batch: int, source: Source = "draft", riders: int = 0,
                                   copy_lengths: Sequence[int] | None = None, packed: bool = False) -> float:
        """Main tokens per second, per row, of a step of ``gamma`` drafts from ``source`` over ``batch`` main rows,
        with ``riders`` other rows in the draft forwards (which then run at least once whatever the choice).
        ``copy_lengths``: a copy step's rows each copy up to their own length (at most ``gamma``); ``packed``: the
        verify then costs the rows' real tokens, not ``batch`` x (``gamma`` + 1)."""
        alpha = self.acceptance[source].alpha

        def expected(drafts: int) -> float:
            return (1 - alpha ** (drafts + 1)) / (1 - alpha)

        if source == "lookup" and copy_lengths is not None:
            drafts = [min(length, gamma) for length in copy_lengths]
            tokens = sum(d + 1 for d in drafts) if packed else batch * (gamma + 1)
            gained = sum(map(expected, drafts)) / batch
        else:
            tokens, gained = batch * (gamma + 1), expected(gamma)
        target = self.forward_seconds("target", batch, tokens)
        draft_forwards = gamma if gamma and source == "draft" else int(riders > 0)
        rows = batch + riders  # a draft forward is one column per row
        draft = draft_forwards * self.forward_seconds("draft", rows, rows) if draft_forwards else 0.0
        return gained / max(draft + target, 1e-9)

    def forward_seconds(self, model: str, rows: int, tokens: int) -> float:
        """A decode forward of ``model`` over ``rows`` rows and ``tokens`` tokens: its cost fit at the tokens it runs
        at (``runs_at``), but no less than its fastest prefill per token times those (the module docstring says
        why)."""
        computed = self.runs_at(model, rows, tokens)
        return max(self.costs[model].predict(computed), self.fastest_prefill_per_token.get(model, 0.0) * computed)

    def observe_prefill(self, model: str, tokens: int, seconds: float) -> None:
        rate = seconds / max(tokens, 1)
        self.prefill_seconds_per_token[model] = rate
        self.fastest_prefill_per_token[model] = min(rate, self.fastest_prefill_per_token.get(model, rate))

    def draft_pays(self, batch: int, draft_prompt_tokens: int, new_tokens: int, draft_size_ratio: float,
                   packed: bool = False) -> bool:
        """Whether prefilling the draft for a batch and speculating beats decoding it without the draft.

        ``draft_prompt_tokens`` is the batch's total; ``new_tokens`` the most any row may produce. Until
        the draft has been timed, its prefill is priced as the target's scaled by their parameter ratio.
        With a share ``c`` of rows having a copy (rows taken as independent; no copy seen yet counts as none),
        a step of one row copies ``c`` of the time; a step of several copies when some row has a copy,
        ``1 - (1 - c) ** batch`` of the time, for about ``c * batch`` of its rows (``choose``'s ``copy_lengths``,
        priced as ``packed`` says).
        """
        self.collect_timings()
        # only a model never timed is explored here: a target fit short of two sizes at this batch (one-row
        # forwards padded to one width leave one) still forecasts, and ``choose`` explores the rest for free,
        # where prefilling the draft to learn it is a certain cost for a draft the steps may never choose
        never_timed = self.costs["draft"].distinct_sizes() == 0 or self.costs["target"].distinct_sizes() == 0
        if not self.adaptive or never_timed or "target" not in self.prefill_seconds_per_token:
            return True  # fixed gamma, or a model never timed: speculate, and learn the costs
        rate = self.prefill_seconds_per_token.get("draft",
                                                  self.prefill_seconds_per_token["target"] * draft_size_ratio)
        gammas = range(1, self.max_gamma + 1)
        plain_rate = self.expected_tokens_per_second(0, batch)
        draft_rate = max(plain_rate, *(self.expected_tokens_per_second(g, batch) for g in gammas))
        share = self.row_copy_share or 0.0
        copying = max(1, round(share * batch))
        copy_rate = max(self.expected_tokens_per_second(
            g, batch, "lookup", copy_lengths=[g] * copying + [0] * (batch - copying) if batch > 1 else None,
            packed=packed) for g in range(1, self.max_copy + 1))
        copy_steps = 1 - (1 - share) ** batch
        with_draft = copy_steps * max(draft_rate, copy_rate) + (1 - copy_steps) * draft_rate
        without_draft = copy_steps * max(plain_rate, copy_rate) + (1 - copy_steps) * plain_rate
        speculative = rate * draft_prompt_tokens + new_tokens / with_draft
        return speculative <= (1 - MIN_PREDICTED_SAVING) * new_tokens / without_draft

    def choose(self, batch: int, max_gamma: int | None = None, max_lookup: int = 0,
               riders: int = 0, copy_widths: Iterable[int] | None = None,
               copy_lengths: Sequence[int] | None = None, packed: bool = False) -> tuple[int, Source]:
        """The next step: (gamma, source); gamma 0 is a plain step. ``max_gamma`` bounds the draft model's
        tokens (0: the draft is not running), ``max_lookup`` the lookup tokens every row has, ``riders``
        the draft-only rows sharing the draft forwards; ``copy_widths``, the copy lengths a step may verify
        (None: any), narrows the lookup options up to ``max_lookup``. ``copy_lengths`` (adaptive mode, several
        rows): each row's copy, where rows may copy unequal lengths (the module docstring); the lookup options
        then reach the longest, priced per row, ``packed`` saying whether the verify costs only real tokens."""
        self.collect_timings()
        limit = self.max_gamma if max_gamma is None else max_gamma
        if self.adaptive and copy_lengths is not None and len(copy_lengths) > 1:
            max_lookup = max(copy_lengths)
        else:
            copy_lengths = None  # one row, or a fixed gamma: copies of what every row has
        copies = [g for g in (range(1, max_lookup + 1) if copy_widths is None else copy_widths) if 0 < g <= max_lookup]
        max_lookup = max(copies, default=0)  # the probe's and exploration's copy: the longest a step may verify
        options = [(g, "draft") for g in range(limit + 1)] + [(g, "lookup") for g in copies]
        if not self.adaptive:
            choice = fixed_step(limit, max_lookup)
        elif limit and self.costs["draft"].distinct_sizes() == 0:
            choice = (limit, "draft")  # explore: time the draft and a wide verify
        elif not self.explored(batch, max(limit, max_lookup)):
            # explore: time a plain step, then the widest step whose size is not timed yet
            timed = self.costs["target"].means
            untimed = [o for o in ((max_lookup, "lookup"), (limit, "draft"))
                       if o[0] and self.runs_at("target", batch, batch * (o[0] + 1)) not in timed]
            choice = untimed[0] if self.runs_at("target", batch, batch) in timed and untimed else (0, "draft")
        else:
            choice = max(options, key=lambda o: self.expected_tokens_per_second(o[0], batch, o[1], riders,
                                                                                copy_lengths, packed))
            if not is_copy(choice) and max_lookup and self.steps_without_copy >= LOOKUP_PROBE_EVERY:
                # An option never chosen is never timed or measured again, so one unlucky timing, a few
                # rejected copies, or a draft model that did well early would rule copying out for good.
                # The probe copies all it can: a wide verify timed once during a stall steepens the cost
                # fit's slope, and only timing that width again takes it back. Accepted tokens are kept.
                choice = (max_lookup, "lookup")
        self.steps_without_copy = 0 if is_copy(choice) else self.steps_without_copy + 1
        self.decisions.append(choice)
        return choice

    def timer(self, device: torch.device) -> DeviceTimer:
        """The timer of work on ``device``, whose timings reach this controller by ``collect_timings``."""
        if device not in self._timers:
            self._timers[device] = DeviceTimer(device)
        return self._timers[device]

    def forward_cost(self, model: str, rows: int, tokens: int) -> Callable[[float], None]:
        """What hears the time of one decode forward of ``model`` over ``rows`` rows and ``tokens`` tokens (for
        ``timer``): kept at the tokens it runs at (``runs_at``)."""
        computed = self.runs_at(model, rows, tokens)
        return lambda seconds: self.costs[model].add(computed, seconds)

    def collect_timings(self) -> None:
        for timer in self._timers.values():
            timer.collect()
