"""auto: at every step, the candidate drafter (and k) with the most expected tokens per second.

Candidates are what can run here: ``suffix``, ``model`` when a draft model is loaded, and the
staged chain ``suffix,model``; drafting nothing (k = 0) is always an option. For candidate c at k
drafts the expected rate is (1 - a_c^(k+1)) / (1 - a_c) tokens per k * d_c + v(k) seconds, where the
acceptance a_c is this request's own (it starts from a per-drafter prior), and the draft cost d_c
and verify cost v(k) are measured live on this host and shared by requests. A candidate that has not
run for a while is tried again with one token, so its acceptance stays current at a bounded cost.

Every choice depends only on earlier steps, never on the current step's random draws, so the output
is still distributed exactly as the target's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from ..adaptive import ALPHA_PRIOR, PROBE_EVERY, StepCosts, _update, expected_tokens, observed_acceptance
from ..sampling import RequestSampler
from .base import Drafter, DraftResources, Proposal, build, register

PRIORS = {"suffix": 0.5, "model": ALPHA_PRIOR, "staged": ALPHA_PRIOR}  # acceptance before a request has any


@dataclass(slots=True)
class _Choice:
    name: str | None  # None: no drafting this step
    num_draft_tokens: int
    sequence_length: int  # committed tokens when the proposal was made
    drafted: int = 0  # tokens actually proposed
    draft_seconds: float = 0.0
    proposed_at: float = 0.0


@dataclass(slots=True)
class _Request:
    alpha: dict[str, float] = field(default_factory=dict)
    last_tried: dict[str, int] = field(default_factory=dict)  # step number each candidate last ran
    step: int = 0


class AutoDrafter:
    name = "auto"
    probe_every = PROBE_EVERY  # steps after which an unused candidate is tried again

    def __init__(self, candidates: dict[str, Drafter]) -> None:
        self.candidates = candidates
        self.draft_costs: dict[str, StepCosts] = {name: StepCosts() for name in candidates}  # across requests
        self.verify = StepCosts()  # verify cost by k, whatever drafted
        self._request = _Request()
        self._choice: _Choice | None = None

    @property
    def fixed_choice(self) -> str:
        """The candidate a seeded request runs instead: timing-driven choices would change its draws."""
        return "model" if "model" in self.candidates else "suffix"

    def begin(self, prompt_ids: list[int], tenant: str = "") -> None:
        for candidate in self.candidates.values():
            candidate.begin(prompt_ids, tenant)
        self._request = _Request(alpha={name: PRIORS.get(name, ALPHA_PRIOR) for name in self.candidates})
        self._choice = None

    def propose(self, token_ids: list[int], num_draft_tokens: int, sampler: RequestSampler) -> Proposal:
        request = self._request
        request.step += 1
        name, k = self._choose(num_draft_tokens)
        choice = _Choice(name, k, len(token_ids))
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
        self.verify.observe(choice.drafted, 0.0, verify_seconds)
        if choice.name is None or choice.num_draft_tokens == 0:
            return
        self.draft_costs[choice.name].observe(max(choice.drafted, 1), choice.draft_seconds, verify_seconds)
        # A proposal shorter than asked counts its missing tokens as rejected: asking this drafter for
        # k tokens yields that many less often, which is what the next choice needs to know.
        accepted = num_committed - choice.sequence_length
        observed = observed_acceptance(accepted, choice.num_draft_tokens)
        alpha = self._request.alpha
        alpha[choice.name] = min(0.99, _update(alpha[choice.name], observed))

    def _choose(self, limit: int) -> tuple[str | None, int]:
        """(candidate, k) with the most expected tokens per second; (None, 0) to draft nothing."""
        if limit <= 0:
            return None, 0
        request = self._request
        for name, costs in self.draft_costs.items():
            if costs.draft is None:  # measure every candidate once
                return name, limit
        if 0 not in self.verify.verify:
            return None, 0  # and plain decoding once
        for name in self.candidates:  # keep each candidate's acceptance current, one token at a time
            if request.step - request.last_tried.get(name, 0) > self.probe_every:
                return name, 1
        best, best_rate = (None, 0), self.verify.tokens_per_second(0.0, 0)
        for name, costs in self.draft_costs.items():
            alpha = request.alpha[name]
            for k in range(1, limit + 1):
                rate = expected_tokens(alpha, k) / (k * (costs.draft or 0.0) + self.verify.verify_cost(k))
                if rate > best_rate:
                    best, best_rate = (name, k), rate
        return best


@register("auto")
def _build(resources: DraftResources) -> AutoDrafter:
    candidates: dict[str, Drafter] = {"suffix": build("suffix", resources)}
    if resources.draft is not None:
        candidates["model"] = build("model", resources)
        staged = replace(resources, config=replace(resources.config, stages=("suffix", "model")))
        candidates["staged"] = build("staged", staged)
    return AutoDrafter(candidates)
