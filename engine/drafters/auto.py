"""auto: at every step, the candidate drafter (and k) with the most expected tokens per second.

Candidates are what can run here: ``suffix``, ``model`` when a draft model is loaded, and the
staged chain ``suffix,model``; drafting nothing (k = 0) is always an option. For candidate c at k
drafts the expected rate is (1 - a_c^(k+1)) / (1 - a_c) tokens per k * d_c + v(k) seconds, where the
acceptance a_c is this request's own: accepted tokens over accepted tokens plus rejections, pooled
over the steps c ran (recent ones weigh more), counting only what c actually proposed. A request starts
from a per-drafter prior: for a draft model, one that follows the acceptance of recent requests on
this server (a bfloat16 copy of the target agrees with it far more often than a fixed prior
assumes); for suffix matching a fixed one, since how well text repeats is the request's own affair.
A candidate that found nothing to propose in part of its steps (text matching often does) yields one
token at a plain step's cost in that share of steps, and a candidate whose steps yield more or less
than the geometric estimate (text matching's runs are all or nothing, and shorter than asked when
its match is short) has the estimate scaled by its realised over expected tokens. The draft cost d_c
and verify cost v(k) are timed at start-up, then measured live on this host and shared by requests
(v as a line over k that live steps move as a whole, ``StepCosts``; a request's first verify, which
reads the prompt, is not timed).

A draft model that has not run lately must first read what it missed (at a request's start, the
whole prompt; after another candidate's run, a few tokens): that catch-up, at its measured cost
(per token of a prefill; per extra row of a short read, which on CPU in bfloat16 costs a large part
of a step), is spread over the next ``HORIZON`` tokens when candidates are compared, so a long
prompt is not prefilled into a draft that cannot win it back. (A draft that copies the target's
keys and values, ``draft_kv``, has nothing to catch up on.) A candidate whose catch-up is cheap
(suffix has none) runs once early in every request, since a chat prompt's acceptance says little
about the code or tool call that follows. After a while unused, text matching is tried again at full
k (its drafts cost only their verify rows), a draft model with one token, so acceptance stays
current at a bounded cost; a draft model is not tried early, as its prior is its measured agreement.

Every choice depends only on earlier steps, never on the current step's random draws, so the output
is still distributed exactly as the target's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from ..adaptive import ALPHA_PRIOR, PROBE_EVERY, StepCosts, _update, expected_tokens
from ..sampling import RequestSampler
from .base import Drafter, DraftResources, Proposal, build, register

PRIORS = {"suffix": 0.5, "model": ALPHA_PRIOR, "staged": ALPHA_PRIOR}  # acceptance before any request ran
PRIOR_WEIGHT = 0.3  # how much one finished request moves a drafter's prior
HORIZON = 64  # tokens over which a candidate's catch-up is paid back
CHEAP_PROBE_EVERY = 4  # candidates without a draft model (suffix) are retried this often: a probe costs a row
PRIOR_TOKENS = 2.0  # a request's prior counts as this many proposed tokens of evidence
EVIDENCE_DECAY = 0.9  # each step of a candidate fades its earlier evidence (a request's text changes)


@dataclass(slots=True)
class _Choice:
    name: str | None  # None: no drafting this step
    num_draft_tokens: int
    sequence_length: int  # committed tokens when the proposal was made
    # the candidate also ran the step before, so its time is one step's drafting; after a gap it
    # first catches up on everything since (the whole prompt, for a draft model's first step)
    steady: bool = False
    lag: int = 0  # tokens the candidate read before proposing
    drafted: int = 0  # tokens actually proposed
    draft_seconds: float = 0.0
    proposed_at: float = 0.0


@dataclass(slots=True)
class _Request:
    alpha: dict[str, float] = field(default_factory=dict)  # each candidate's acceptance estimate now
    # per candidate: (accepted tokens, rejections) seen this request, older steps faded
    evidence: dict[str, tuple[float, float]] = field(default_factory=dict)
    # per candidate: (steps it proposed anything, steps it ran), older steps faded. Text matching often
    # finds nothing to propose, and such a step yields one token at a plain step's cost, whatever alpha says
    coverage: dict[str, tuple[float, float]] = field(default_factory=dict)
    # per candidate: (tokens its proposing steps yielded, tokens the geometric estimate expected of
    # them), older steps faded: their ratio corrects the estimate where acceptance is not geometric
    yields: dict[str, tuple[float, float]] = field(default_factory=dict)
    last_tried: dict[str, int] = field(default_factory=dict)  # step number each candidate last ran
    step: int = 0


class AutoDrafter:
    name = "auto"
    probe_every = PROBE_EVERY  # steps after which an unused candidate is tried again

    def __init__(self, candidates: dict[str, Drafter]) -> None:
        self.candidates = candidates
        self.draft_costs: dict[str, StepCosts] = {name: StepCosts() for name in candidates}  # across requests
        self.verify = StepCosts()  # verify cost by k, whatever drafted
        self.catch_up: dict[str, float] = {}  # seconds per token a candidate takes to read what it missed
        self.extra_row: dict[str, float] = {}  # seconds per row beyond the first of a short read
        self.priors = {name: PRIORS.get(name, ALPHA_PRIOR) for name in candidates}  # across requests
        self._request = _Request()
        self._choice: _Choice | None = None

    @property
    def fixed_choice(self) -> str:
        """The candidate a seeded request runs instead: timing-driven choices would change its draws."""
        return "model" if "model" in self.candidates else "suffix"

    def begin(self, prompt_ids: list[int], tenant: str = "") -> None:
        for candidate in self.candidates.values():
            candidate.begin(prompt_ids, tenant)
        finished = self._request
        for name in finished.last_tried:  # what the last request learned about the draft models it ran
            if self._reads(name):  # a model's agreement carries over; a text match's does not
                self.priors[name] = (1 - PRIOR_WEIGHT) * self.priors[name] + PRIOR_WEIGHT * finished.alpha[name]
        self._request = _Request(alpha=dict(self.priors))
        self._choice = None

    def propose(self, token_ids: list[int], num_draft_tokens: int, sampler: RequestSampler) -> Proposal:
        request = self._request
        request.step += 1
        name, k = self._choose(token_ids, num_draft_tokens)
        steady = request.last_tried.get(name) == request.step - 1
        choice = _Choice(name, k, len(token_ids), steady=steady, lag=self._lag(name, token_ids) or 0)
        started = time.perf_counter()
        proposal = Proposal.empty(sampler.device)
        if name is not None and k > 0:
            proposal = self.candidates[name].propose(token_ids, k, sampler)
            request.last_tried[name] = request.step
        choice.drafted = proposal.token_ids.shape[0]
        choice.proposed_at = time.perf_counter()
        choice.draft_seconds = choice.proposed_at - started
        self._choice = choice
        return replace(proposal, drafter=name if choice.drafted else "none")

    def accept(self, num_committed: int) -> None:
        for candidate in self.candidates.values():
            candidate.accept(num_committed)
        choice, self._choice = self._choice, None
        if choice is None:
            return
        verify_seconds = time.perf_counter() - choice.proposed_at  # the target's pass ran in between
        if self._request.step > 1:  # a request's first verify also reads the prompt
            self.verify.observe(choice.drafted, 0.0, verify_seconds)
        if choice.name is None or choice.num_draft_tokens == 0:
            return
        costs = self.draft_costs[choice.name]
        if choice.steady:  # a step that caught up first would price drafting at prefill cost
            costs.observe(max(choice.drafted, 1), choice.draft_seconds, verify_seconds)
        elif choice.lag > choice.num_draft_tokens + 2 and costs.draft is not None:
            reading = max(choice.draft_seconds - choice.drafted * costs.draft, 0.0) / choice.lag
            self.catch_up[choice.name] = _update(self.catch_up.get(choice.name), reading)
        proposed, ran = self._request.coverage.get(choice.name, (0.0, 0.0))
        self._request.coverage[choice.name] = (
            EVIDENCE_DECAY * proposed + (choice.drafted > 0),
            EVIDENCE_DECAY * ran + 1,
        )
        if choice.drafted == 0:  # nothing proposed (no match): the step cost a plain decode, says nothing of a
            return
        self._observe(choice.name, num_committed - choice.sequence_length, choice.drafted, choice.num_draft_tokens)

    def _observe(self, name: str, accepted: int, drafted: int, asked: int | None = None) -> None:
        """A step's accepted run is a truncated geometric sample: ``accepted`` successes, then one
        rejection unless all ``drafted`` passed. Pooling them (rather than averaging per-step
        ratios, where one early rejection reads as acceptance 0) gives the maximum-likelihood
        acceptance; the prior counts as PRIOR_TOKENS tokens of evidence.

        The step's tokens are also set against what the choice expected of it at the k it asked
        for (``asked``): text matching proposes fewer tokens than asked when its match is short,
        and its runs are all or nothing, so the geometric yield can be off either way."""
        request = self._request
        yielded, expected = request.yields.get(name, (0.0, 0.0))
        request.yields[name] = (
            EVIDENCE_DECAY * yielded + accepted + 1,
            EVIDENCE_DECAY * expected + expected_tokens(request.alpha[name], asked or drafted),
        )
        successes, rejections = request.evidence.get(name, (0.0, 0.0))
        successes = EVIDENCE_DECAY * successes + accepted
        rejections = EVIDENCE_DECAY * rejections + (accepted < drafted)
        request.evidence[name] = (successes, rejections)
        estimate = (successes + PRIOR_TOKENS * self.priors[name]) / (successes + rejections + PRIOR_TOKENS)
        request.alpha[name] = min(0.99, estimate)

    def expect_catch_up(self, seconds_per_token: float, seconds_per_extra_row: float | None = None) -> None:
        """Start-up's measures of a draft model's reading cost: per token of a long prefill (until
        requests measure it), and per row beyond the first of a short one. Without the first, a
        catch-up would be priced at a draft step per token, several times too much, and a draft
        model would never be tried on a request whose prompt it has not read. The second prices the
        few tokens a draft model must read after another candidate's run was accepted."""
        for name in self.candidates:
            if self._reads(name):
                self.catch_up.setdefault(name, seconds_per_token)
                if seconds_per_extra_row is not None:
                    self.extra_row[name] = seconds_per_extra_row

    def expect_step_costs(self, verify_seconds: dict[int, float], draft_step_seconds: float | None) -> None:
        """Start-up's timings of the target's forward over k + 1 tokens (each k) and of the draft
        model's one-token step: without them a server's first request spends its first steps
        measuring every candidate at full k (a staged step costs a model step and more), and
        plain decoding once. Each is replaced by the first live measure of the same thing."""
        self.verify.expect(verify=verify_seconds)
        if draft_step_seconds is not None:
            for name in self.candidates:
                if self._reads(name):
                    self.draft_costs[name].expect(draft=draft_step_seconds)

    def expect_agreement(self, acceptance: float) -> None:
        """Start-up's measure of how often the draft model's tokens pass: the draft-model
        candidates' prior, which finished requests then move."""
        for name in self.candidates:
            if self._reads(name):
                self.priors[name] = acceptance
        self._request = _Request(alpha=dict(self.priors))

    def _reads(self, name: str | None) -> bool:
        """Whether the candidate runs a draft model, which must read the sequence before proposing."""
        return hasattr(self.candidates.get(name), "lag")

    def _lag(self, name: str | None, token_ids: list[int]) -> int | None:
        """Tokens a candidate with a draft model must read first; None for candidates without one."""
        return self.candidates[name].lag(token_ids) if self._reads(name) else None

    def _catch_up_seconds(self, name: str, token_ids: list[int], limit: int) -> float:
        """What reading its lag would cost the candidate now. A short lag (a few tokens another
        candidate got accepted) is priced per row beyond the one every draft step reads; a long one
        (a prompt) as a prefill, per token (before a measurement: at the draft step cost)."""
        lag = self._lag(name, token_ids)
        if lag is None or lag <= 1:  # the newest token, which every draft step reads
            return 0.0
        if lag <= limit + 2 and name in self.extra_row:
            return (lag - 1) * self.extra_row[name]
        return lag * self.catch_up.get(name, self.draft_costs[name].draft or 0.0)

    def _choose(self, token_ids: list[int], limit: int) -> tuple[str | None, int]:
        """(candidate, k) with the most expected tokens per second; (None, 0) to draft nothing."""
        if limit <= 0:
            return None, 0
        request = self._request
        for name, costs in self.draft_costs.items():
            if costs.draft is None:  # measure every candidate once, over two consecutive steps (see steady)
                return name, limit
        if not self.verify.knows(0):
            return None, 0  # and plain decoding once
        plain_step = self.verify.verify_cost(0)
        catch_up = {name: self._catch_up_seconds(name, token_ids, limit) for name in self.candidates}
        for name in self.candidates:  # probes keep each candidate's acceptance current
            if catch_up[name] > plain_step:
                continue  # a probe must stay cheap
            # text matching's prior says nothing of this request's text: try it at once. A draft
            # model's prior is its measured agreement, moved by recent requests: it runs when it
            # wins on that, and its probes keep the estimate current.
            if name not in request.last_tried and not self._reads(name):
                return name, limit
            if self._reads(name):  # a draft model's probe drafts one token: each costs a forward
                if request.step - request.last_tried.get(name, 0) > self.probe_every:
                    return name, 1
            elif request.step - request.last_tried.get(name, 0) > min(self.probe_every, CHEAP_PROBE_EVERY):
                return name, limit  # text matching's drafts cost nothing but their verify rows
        best, best_rate = (None, 0), 1.0 / plain_step
        for name, costs in self.draft_costs.items():
            alpha = request.alpha[name]
            proposed, ran = request.coverage.get(name, (0.0, 0.0))
            covered = (proposed + 1) / (ran + 1)  # the share of steps with a proposal, from 1 before any ran
            yielded, expected = request.yields.get(name, (0.0, 0.0))
            bias = (yielded + PRIOR_TOKENS) / (expected + PRIOR_TOKENS)  # realised over expected, from 1
            for k in range(1, limit + 1):
                # a step without a proposal is a plain step: one token at the plain cost
                tokens = covered * min(bias * expected_tokens(alpha, k), k + 1.0) + (1 - covered)
                verify = covered * self.verify.verify_cost(k) + (1 - covered) * plain_step
                seconds = k * (costs.draft or 0.0) + verify + catch_up[name] * tokens / HORIZON
                if tokens / seconds > best_rate:
                    best, best_rate = (name, k), tokens / seconds
        return best


@register("auto")
def _build(resources: DraftResources) -> AutoDrafter:
    candidates: dict[str, Drafter] = {"suffix": build("suffix", resources)}
    if resources.draft is not None:
        candidates["model"] = build("model", resources)
        staged = replace(resources, config=replace(resources.config, stages=("suffix", "model")))
        candidates["staged"] = build("staged", staged)
    return AutoDrafter(candidates)
