"""Choosing how many tokens to draft, step by step, from measured costs and acceptance.

With per-token acceptance alpha, k drafts yield (1 - alpha^(k+1)) / (1 - alpha) tokens per step
(Leviathan et al., 2023) at a cost of k * c_draft + c_verify(k). The policy picks the k in
[0, limit] (what the request and cache allow) with the most expected tokens per second; k = 0 is
plain decoding. Costs belong to the host and are learned across requests (``StepCosts``, one per
drafter); acceptance belongs to the request (chat and code differ), so each request starts from a
prior. The choice depends only on past steps, never on the current step's draws, so the output
distribution is unchanged.
"""

from __future__ import annotations

import statistics
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

SMOOTHING = 0.1  # weight of the newest observation in the running averages
PROBE_EVERY = 16  # while plain decoding wins, still draft once in a while to keep alpha current
ALPHA_PRIOR = 0.7
ROW_READINGS = 15  # the latest per-row verify costs between consecutive live steps kept (StepCosts)
MIN_ROW_READINGS = 5  # how many it takes to replace the start-up line's slope
CONTEXT_DECAY = 0.995  # each live step of a kind fades the earlier evidence of how its cost grows with context
MIN_CONTEXT_SPREAD = 128.0  # cached tokens: how far steps' contexts must spread to learn a slope from them
MIN_CONTEXT_STEPS = 8  # ... and over as many steps' worth: a sum of squares about their mean (``ContextSlope``)
STALE_PLAIN_STEPS = 16  # plain steps in a row above the line's bound after which the line is raised to meet them
TRUSTED_PLAIN_STEPS = 8  # live plain steps after which their average prices a plain step, up to a verify of one draft


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one step yields with k drafts at per-token acceptance alpha (bonus token included)."""
    return k + 1.0 if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)


def observed_acceptance(num_accepted: int, num_drafted: int) -> float:
    """n accepted of k is a truncated geometric sample: n / (n + 1 rejection) estimates alpha when n < k."""
    return num_accepted / num_drafted if num_accepted == num_drafted else num_accepted / (num_accepted + 1)


@dataclass(slots=True)
class StepCosts:
    """What a step costs on this host: seconds per drafted token, and per verify pass by k.

    Verify costs come either from steps alone, one running average per k, or from start-up's timings
    (``expect``): a plain step's (k = 0), which plain steps then replace by their running average, and a
    line over k >= 1 that drafting steps correct as a whole: its level by one shift shared by all k
    (every drafting step, whatever its k, updates it), its slope by the median of the last ROW_READINGS
    slopes between consecutive drafting steps of different k. A plain step is priced apart, as it runs:
    the first drafted row cost the int8 target 1.5-1.7 ms where each further one cost 0.8-1.2 (a step of
    6.1 ms), so one line through k = 0 priced a plain step 0.3-0.9 ms high and one draft as much too
    low. Start-up times a verify after a chat turn's context (``measure.VERIFY_CONTEXT``); over a longer
    one each row also attends to more cached tokens, so a row costs more (float32: 0.96 ms a row at a
    few tokens, 1.25 at 200, 2.0 at 1,600), and with the start-up slope the steps that drafted pushed
    the shared shift, and with it the price of a plain step, up by what their rows cost more: drafting
    looked cheaper than it was. Consecutive steps read nearly the same context, and a median is not
    moved by one slow reading (a busy host), as a least-squares slope would be. A k the policy seldom
    picks is priced from what the others measure, and one slow reading cannot keep its k from being
    tried again. Nor can one slow plain step keep plain decoding from being chosen again: until
    TRUSTED_PLAIN_STEPS live plain steps are seen, a plain step is never priced above a verify of one
    draft less a row (a fresh process's first sampled step, 6.9 ms against 4.4, replaced start-up's
    reading and priced plain decoding above a verify of one draft, so every later step drafted, and
    none corrected the price). From then on their average is the price, at most a verify of one
    draft: where each further row costs more than the first drafted one (the int8 target on a Zen 3
    host: 1.3 ms, then 1.4-1.7), the bound held plain steps about 0.45 ms under what they took, and the
    offers after a one-token match were declined where they paid.

    All of these price a step at start-up's context (the anchor); a step at another (``at``) costs the
    tokens between times a slope more (``ContextSlope``): a plain step's slope once, whatever its rows,
    and a drafted row's for each draft, and is learned from as it would have cost at the anchor. Most
    of a step's growth is shared by its rows (the int8 target on a Zen 3 host: 2.4 us a cached token
    a plain step, 0.65 more a drafted row); slopes of every row alike, fitted to verifies of mostly four
    drafts, priced one draft a millisecond low over a long context and four drafts as much high, so
    the row read between them after a long prompt fell by more than half. Where a host's caches do
    not hold a long context (a Zen 3 EPYC, int8: a four-draft verify 12 ms after 150 tokens, 26 after
    1,560), one shift for every context, learned over a long prompt, priced one draft at 20 ms in the
    short requests after it, where it cost 7.5, and they seldom drafted until it faded."""

    draft: float | None = None
    verify: dict[int, float] = field(default_factory=dict)  # by k: running averages, or the start-up line
    shift: float | None = None  # what live steps add to the start-up line; None: no line, or no step yet
    from_line: bool = False  # verify holds a start-up line
    provisional_draft: bool = False  # draft was timed at start-up: the first live measure replaces it
    row: float | None = None  # seconds per verify row live steps show: the line's slope until they do
    row_readings: deque = field(default_factory=lambda: deque(maxlen=ROW_READINGS))
    last: tuple[int, float] | None = None  # the last live step over a start-up line: (k, seconds)
    mean_k: float | None = None  # the k of the live steps the shift was learned from, on average
    plain: float | None = None  # a plain step's live seconds (k = 0): priced apart from the line over k >= 1
    capped: int = 0  # plain steps in a row whose average sat above the line's bound (``_meet_plain_steps``)
    plain_steps: int = 0  # live plain steps observed: from TRUSTED_PLAIN_STEPS on, their average is the price
    anchor: int = 0  # the cached tokens start-up timed its line after: the fields above price a step there
    context: int = 0  # the cached tokens of the step priced, then observed, now (``at``)
    # how a step's seconds grow with the cached tokens beyond the anchor: a plain step's, a verify's drafted rows'
    by_context: tuple[ContextSlope, ContextSlope] = field(default_factory=lambda: (ContextSlope(), ContextSlope()))
    # their slopes, a step's and a drafted row's, as of the last step (``_beyond`` asks several times a step)
    growth: tuple[float, float] = (0.0, 0.0)

    def expect(self, draft: float | None = None, verify: dict[int, float] | None = None, context: int = 0) -> None:
        """Start-up timings, for what has no live measurement yet: the first request then need not
        spend steps measuring what it could have known (its verifies timed after ``context`` tokens)."""
        if draft is not None and self.draft is None:
            self.draft, self.provisional_draft = draft, True
        if verify and not self.verify:
            self.verify, self.from_line, self.anchor = dict(verify), True, context

    def at(self, context: int) -> None:
        """The step priced next, and then observed, reads ``context`` cached tokens."""
        self.context = context

    def _beyond(self, k: int) -> float:
        """What a step of k drafts costs more at this context than at the anchor, for the tokens between:
        once a step, whatever its rows, as a plain step (its slope), and for each drafted row (the
        verifies' slope). Each is 0 until its steps' contexts spread."""
        per_step, per_row = self.growth
        return (per_step + per_row * k) * (self.context - self.anchor)

    def observe(self, k: int, draft_seconds: float, verify_seconds: float) -> None:
        if self.from_line and k in self.verify:  # learned as the step would have cost at the anchor
            between = self.context - self.anchor
            if k:  # the drafted rows' part: what the step cost beyond its line, less a plain step's growth
                self.by_context[1].add(k * between, verify_seconds - self._line(k), between)
            else:
                self.by_context[0].add(between, verify_seconds, between)
            per_step = self.by_context[0].slope()
            self.growth = (per_step, self.by_context[1].slope(per_step))
            verify_seconds -= self._beyond(k)
        if self.from_line and k == 0:
            self.plain, self.plain_steps = _update(self.plain, verify_seconds), self.plain_steps + 1
            self._meet_plain_steps()
        elif self.from_line and k in self.verify:
            self.capped = 0
            if self.last is not None and self.last[0] != k:
                self.row_readings.append((verify_seconds - self.last[1]) / (k - self.last[0]))
                if len(self.row_readings) >= MIN_ROW_READINGS:
                    row = max(statistics.median(self.row_readings), 0.0)
                    if self.shift is not None:  # the same price as before at the k the shift was learned at
                        self.shift -= (row - self._slope()) * (self.mean_k - self._base)
                    self.row = row
            self.last = (k, verify_seconds)
            self.shift = _update(self.shift, verify_seconds - self._line(k))
            self.mean_k = _update(self.mean_k, float(k))
        else:
            self.verify[k] = _update(self.verify.get(k), verify_seconds)
        if k > 0:
            # a request's step includes sampling and bookkeeping: trust its measure over start-up's
            self.draft = draft_seconds / k if self.provisional_draft else _update(self.draft, draft_seconds / k)
            self.provisional_draft = False

    def _meet_plain_steps(self) -> None:
        """Raise the line over drafting steps where STALE_PLAIN_STEPS plain steps in a row averaged above a
        verify of one draft less a row, the bound ``plain_price`` holds a plain step to (its floor, half
        the cheapest start-up price, aside: a plain step above the bound but under that floor counts too,
        and the raised line then prices a plain step below a verify of one draft, as it should). The
        line and its slope are learned from drafting steps alone: after a long prompt had put a row at
        9.2 ms (float32 on a Zen 3 host), the cap priced plain steps of 15-20 ms at 7.4, no step drafted
        again, and none corrected the line. One cold plain step is still held to the cap; a host slower
        for good is met. It still runs once plain steps are their own price (TRUSTED_PLAIN_STEPS), so
        where each further row costs more than the first drafted one it keeps raising the line to a
        plain step's average plus a row (docs/drafters.md#verify-prices-by-context)."""
        if self._base != 1 or self.plain is None:
            return  # no line over drafting steps
        short = self.plain - (self._line(1) + (self.shift or 0.0) - self._slope())
        self.capped = self.capped + 1 if short > 0 else 0
        if self.capped >= STALE_PLAIN_STEPS:
            self.shift, self.capped = (self.shift or 0.0) + short, 0

    def _slope(self) -> float:
        """Seconds per verify row: what live steps show, else the start-up line's slope."""
        if self.row is not None:
            return self.row
        most = max(self.verify)
        return (self.verify[most] - self.verify[self._base]) / (most - self._base) if most > self._base else 0.0

    @property
    def _base(self) -> int:
        """The k the line over drafting steps starts at: 1, where it has one (a plain step is apart)."""
        return 1 if len(self.verify) > 1 else 0

    def _line(self, k: int) -> float:
        """The start-up line at k, at the slope live steps show once they show one."""
        return self.verify[k] if self.row is None else self.verify[self._base] + self.row * (k - self._base)

    def knows(self, k: int) -> bool:
        return k in self.verify

    def verify_cost(self, k: int) -> float:
        """The cost at k, or at the nearest k with one, plus the live shift of a start-up line."""
        nearest = k if k in self.verify else min(self.verify, key=lambda measured: abs(measured - k))
        if not self.from_line:
            return max(self.verify[nearest], 1e-9)
        if nearest == 0:
            plain = (self.verify[0] if self.plain is None else self.plain) + self._beyond(0)
            if len(self.verify) == 1:  # no drafts to price it against
                return plain
            if self.plain_steps >= TRUSTED_PLAIN_STEPS:
                return min(plain, self.verify_cost(1))
            return plain_price(plain, self.verify_cost(1), self._slope(), min(self.verify.values()))
        return max(self._line(nearest) + (self.shift or 0.0) + self._beyond(nearest), 1e-9)

    def prices(self, limit: int) -> list[float]:
        """``verify_cost`` at every k in 0..limit, for a step that asks for them a dozen times."""
        return [self.verify_cost(k) for k in range(max(limit, 0) + 1)]

    def tokens_per_second(self, alpha: float, k: int) -> float:
        return expected_tokens(alpha, k) / (k * (self.draft or 0.0) + self.verify_cost(k))


@dataclass(slots=True)
class ContextSlope:
    """How a kind of step's seconds grow with the cached tokens beyond the anchor, for a verify's drafted
    rows times those tokens (x): a least-squares slope over its live steps, each fading the ones before
    by CONTEXT_DECAY, of their seconds less what their k costs at the anchor (y); for a verify, of y less
    a plain step's growth over those tokens (z) at the plain steps' slope as it is when asked, not as it
    was when each step came (over a long prompt's first steps it was still 0, and the rows took a
    plain step's growth for theirs: 2.1-2.4 us a token a row where 0.65 was measured). 0 until their
    contexts spread (``spread``), and never below 0."""

    # faded: weight, x, y, x x, x y, z, x z, z z
    sums: tuple[float, float, float, float, float, float, float, float] = (0.0,) * 8

    def add(self, x: float, y: float, z: float) -> None:
        """A step: x as above, y its seconds less its k's price at the anchor, z its tokens beyond the anchor."""
        weight, xs, ys, xxs, xys, zs, xzs, zzs = self.sums
        d = CONTEXT_DECAY  # each faded, then this step's added (written out: a generator over them took 2.6x as long)
        self.sums = (
            d * weight + 1.0, d * xs + x, d * ys + y, d * xxs + x * x, d * xys + x * y, d * zs + z, d * xzs + x * z,
            d * zzs + z * z,
        )  # fmt: skip

    def spread(self) -> bool:
        """Whether the steps' contexts (z) spread enough to learn a slope from: their faded squares about
        their mean as large as MIN_CONTEXT_STEPS steps' MIN_CONTEXT_SPREAD tokens from it. A sum, not a
        variance, which more steps at one context shrink: served, one plain step after a long prompt
        among the short requests' steps fell under 128 tokens' spread within 85 plain steps, its slope
        went to 0, and the drafted rows took a plain step's growth for theirs
        (docs/drafters.md#a-slope-kept-among-short-steps)."""
        weight, zs, zzs = self.sums[0], self.sums[5], self.sums[7]
        return weight > 0.0 and zzs - zs * zs / weight >= MIN_CONTEXT_STEPS * MIN_CONTEXT_SPREAD**2

    def slope(self, less: float = 0.0) -> float:
        """Seconds per x of y less ``less`` times z; 0 until the steps' contexts (z, not x, which a
        verify's k spreads at one context) spread."""
        if not self.spread():
            return 0.0
        weight, xs, ys, xxs, xys, zs, xzs, zzs = self.sums
        x_spread = xxs - xs * xs / weight  # weight times the variance of x
        return max((xys - less * xzs - xs * (ys - less * zs) / weight) / x_spread, 0.0) if x_spread > 0.0 else 0.0


def gain_over_plain(alpha: float, draft: float, prices: Sequence[float]) -> float:
    """The most tokens per second drafting k in 1..len(prices) - 1 tokens at ``draft`` seconds a token and
    acceptance ``alpha`` yields, over plain decoding's (``prices``: a verify's seconds by k, k = 0 a plain step)."""
    best = max((expected_tokens(alpha, k) / (k * draft + prices[k]) for k in range(1, len(prices))), default=0.0)
    return best * prices[0]


@dataclass(slots=True)
class AdaptiveK:
    costs: StepCosts = field(default_factory=StepCosts)  # shared by the requests of one drafter
    alpha: float = ALPHA_PRIOR  # this request's running per-token acceptance
    steps_since_draft: int = 0
    last_made: int = 1  # tokens the last step made (served, the next step's verify waits on their events)

    def choose(self, limit: int) -> int:
        """The k to draft now, at most ``limit`` (what the request and cache still allow)."""
        if limit <= 0:
            return 0
        if self.costs.draft is None or not self.costs.knows(0):
            return 0 if not self.costs.knows(0) else limit  # measure plain decoding, then drafting
        best = max(range(limit + 1), key=lambda k: self.costs.tokens_per_second(self.alpha, k))
        if best == 0 and self.steps_since_draft >= PROBE_EVERY:
            return 1
        return best

    def observe(
        self, k: int, num_accepted: int, draft_seconds: float, verify_seconds: float, timed: bool = True
    ) -> None:
        """``timed``: the step's seconds are a step's costs (a request's first step also reads the prompt).
        Nor is a step after one that made several tokens timed: served, its seconds also hold the events
        of those tokens, whatever its k, as ``auto`` found (docs/drafters.md#on-a-zen-4-host)."""
        if timed and self.last_made == 1:
            self.costs.observe(k, draft_seconds, verify_seconds)
        self.last_made = num_accepted + 1
        if k == 0:
            self.steps_since_draft += 1
            return
        self.steps_since_draft = 0
        self.alpha = min(0.99, _update(self.alpha, observed_acceptance(num_accepted, k)))


def plain_price(plain: float, one_draft: float, row: float, cheapest: float) -> float:
    """A plain step's price from a reading of it: at most a verify of one draft less a row (a plain step
    does less than that verify, whose first row costs at least each further one, so a reading above
    it was disturbed), never below half the cheapest price (nothing is free). Start-up's reading
    (``measure.verify_prices``) and the live average (``StepCosts.verify_cost``) alike."""
    return min(plain, max(one_draft - row, cheapest / 2))


def _update(average: float | None, value: float) -> float:
    return value if average is None else (1 - SMOOTHING) * average + SMOOTHING * value


class ScopePriors:
    """Acceptance priors by track, as each scope's finished requests moved them from start-up's
    (``start``, which start-up may still set): no scope's prior learns from another scope's text.
    The ``max_scopes`` most recently active scopes are kept."""

    def __init__(self, start: dict[str, float], weight: float, max_scopes: int = 256) -> None:
        self.start, self.weight, self.max_scopes = start, weight, max_scopes
        self._by_scope: OrderedDict[str, dict[str, float]] = OrderedDict()

    def of(self, scope: str) -> dict[str, float]:
        return dict(self._by_scope.get(scope, self.start))

    def fold(self, scope: str, alpha: dict[str, float], tracks) -> None:
        """A finished request of ``scope`` measured ``alpha`` on ``tracks``: move its priors."""
        priors = self._by_scope.pop(scope, None) or dict(self.start)
        for track in tracks:
            if track in priors:
                priors[track] = (1 - self.weight) * priors[track] + self.weight * alpha[track]
        self._by_scope[scope] = priors  # most recent last
        while len(self._by_scope) > self.max_scopes:
            self._by_scope.popitem(last=False)
