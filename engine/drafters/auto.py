"""auto: at every step, the candidate drafter (and k) with the most expected tokens per second.

Candidates: ``suffix``; ``model`` and the chain ``suffix,model`` with a draft model; ``eagle3`` with a head
(named, or shipped for the target, priced by its own timing, and left out at start-up where that price does
not pay: ``HEAD_PAYS``); and drafting nothing (k = 0). Candidate c at k drafts is expected to make
(1 - a_c^(k+1)) / (1 - a_c) tokens in k * d_c + v(k) seconds. The acceptance a_c is this request's own, pooled
over the steps c ran (recent ones weigh more), from a prior its scope's finished requests move (a draft
model's agreement measured at start-up, or a head's recorded beside it, worth 8 tokens of evidence and apart,
lower, in a request sampled hot or penalising repeats: ``eagle3~``; a text match's worth 2). Draft cost d_c
and verify cost v(k) are timed at start-up, then live, shared by requests (``StepCosts``).

Text matching is asked first at every step (a table lookup), so the choice knows how many tokens it offers
and how long a match they continue; its acceptance is tracked per match length (``suffix@1``, ``@2``, ``@4``,
``@8``; ``@2~`` when damped), its draft i passing, once those before it did, as a match i - 1 tokens longer
does. Its cost is its verify rows alone. An offer the step declines is scored, once the text has passed it,
by how many of its drafts the committed tokens match, so every offer is learned from without probes. A draft
model's step must also beat the pace text matching (or plain decoding) kept over the last few steps, and
pays for reading what it missed (a prompt, or another candidate's accepted tokens) spread over the next
``HORIZON`` tokens it may draft. Where the step's best is another, a draft model unused for a while
(``probe_every`` steps at acceptance 0.5) drafts one token; one that could not pay even at the most it may
accept is probed ``RARELY`` times less often (docs/drafters.md has the measurements behind each rule).

Every choice depends only on earlier steps and the committed tokens, never on the current step's random
draws, so the output is still distributed exactly as the target's.
"""

from __future__ import annotations

import time
from dataclasses import replace

from .. import measure
from ..adaptive import ALPHA_PRIOR, PROBE_EVERY, ScopePriors, StepCosts, _update, expected_tokens, gain_over_plain
from ..model.model import upload
from ..sampling import RequestSampler
from .auto_state import (
    MODEL_PRIOR_TOKENS,
    RequestState,
    StepChoice,
    continued,
    damps_repeats,
    is_text,
    match_priors,
    match_track,
    model_track,
    with_damped_tracks,
)
from .base import Drafter, DraftResources, Proposal
from .eagle3 import head_drafter
from .registry import build, register

PRIOR_WEIGHT = 0.3  # how much one finished request moves a prior
HORIZON = 64  # tokens over which a candidate's catch-up is paid back, where text matching takes no steps
PROBE_ALPHA = 0.5  # the acceptance at which an unused draft model is probed after probe_every steps
RARELY = 8  # how many times longer a draft model that cannot pay here goes unprobed
PROBE_CATCH_UP = 0.25  # the most a probe may spend catching up, in plain steps (docs/drafters.md)
HEAD_PAYS = 1.1  # a head promising less over plain decoding at start-up is left out (docs/drafters.md#a-head-left-out)
Offers = dict[str, tuple[list[int], str]]  # by text matcher: what it would draft now, and the track it is priced on


class AutoDrafter(Drafter):
    name = "auto"
    per_sequence = ("_request", "_choice")
    probe_every = PROBE_EVERY  # steps after which an unused candidate (or match length) is tried again

    def __init__(self, candidates: dict[str, Drafter], resources: DraftResources | None = None) -> None:
        self.candidates = candidates
        self.resources = resources  # the models whose step costs warm-up measures
        self.draft_agreement = None if resources is None else resources.draft_agreement
        readers = [name for name in candidates if self._reads(name)]
        self.draft_costs: dict[str, StepCosts] = {name: StepCosts() for name in readers}  # across requests
        self.verify = StepCosts()  # verify cost by k, whatever drafted
        self.catch_up: dict[str, float] = {}  # seconds per token a candidate takes to read what it missed
        self.extra_row: dict[str, float] = {}  # seconds per row beyond the first of a short read
        self.priors = with_damped_tracks(dict.fromkeys(readers, ALPHA_PRIOR))  # by track, as start-up knows them
        texts = self._texts = [name for name in candidates if name not in readers]  # text matchers: ``offer``
        self.priors |= match_priors(texts)
        self.scope_priors = ScopePriors(self.priors, PRIOR_WEIGHT)  # as each scope's requests moved them
        self._request = RequestState()
        self._choice: StepChoice | None = None

    def warm_up(self) -> str | None:
        """Price the candidates before the first request: the target's verify over k + 1 tokens for each k after a
        chat turn's context (best of three, priced by ``measure.verify_prices``: a robust line over k >= 1, a plain
        step apart and below it), the draft model's step and catch-up, its agreement (unless measured); then
        leave out a head that cannot pay here (``_leave_out``)."""
        if self.resources is None:
            return None
        target, draft, config = self.resources.target, self.resources.draft, self.resources.config
        max_query = config.num_draft_tokens + 2
        timed = measure.verify_seconds(target, max_query - 2)
        draft_step = None
        if draft is not None:
            draft_step = measure.read_seconds(draft, 1, repeats=3)
            readers = [candidate for candidate in self.candidates.values() if candidate.runs_model]
            if not all(reader.reads_target_cache for reader in readers):  # one reading the target's cache has none
                per_token = measure.prefill_seconds_per_token(draft)
                self.expect_catch_up(per_token, measure.extra_row_seconds(draft, max_query, draft_step))
            if self.draft_agreement is None:
                self.draft_agreement = measure.agreement(draft, target)
            self.expect_agreement(self.draft_agreement)
        self.expect_step_costs(measure.verify_prices(timed), draft_step)
        for name, candidate in self.candidates.items():  # a model of its own (an EAGLE-3 head): its own price
            if (own := candidate.own_costs() if candidate.runs_model else None) is not None:
                self.draft_costs[name] = StepCosts(draft=own.step_seconds, provisional_draft=True)
                self.catch_up[name] = own.seconds_per_token
                self.priors |= with_damped_tracks({name: own.acceptance or ALPHA_PRIOR})
                self.extra_row.pop(name, None)
        self._request = RequestState(alpha=dict(self.priors), priors=dict(self.priors))
        return self._leave_out(config.num_draft_tokens)

    def _leave_out(self, limit: int) -> str | None:
        """Take out each head (a model priced by its own start-up timing) whose step at its recorded acceptance
        promises under HEAD_PAYS times plain decoding's tokens a second at start-up's prices (a request may
        still name it); say which, for the start-up line."""
        said, prices = [], self.verify.prices(limit)
        for name, costs in list(self.draft_costs.items()):
            alpha = self.priors.get(name, ALPHA_PRIOR)
            gain = gain_over_plain(alpha, costs.draft or 0.0, prices)
            if self.candidates[name].own_model is not None and limit > 0 and gain < HEAD_PAYS:
                for table in (self.candidates, self.draft_costs, self.catch_up, self.extra_row):
                    table.pop(name, None)
                said.append(f"{name} ({costs.draft * 1e3:.2f} ms a draft at acceptance {alpha:.2f}: {gain:.2f}x)")
        return f"auto leaves out {', '.join(said)}: under {HEAD_PAYS}x plain decoding's pace" if said else None

    def begin(self, prompt_ids: list[int], tenant: str = "") -> None:
        for candidate in self.candidates.values():
            candidate.begin(prompt_ids, tenant)
        finished = self._request  # the last request begun here (each moves its scope's priors once)
        if not finished.folded and finished.last_tried:
            finished.folded = True
            self.scope_priors.fold(finished.tenant, finished.alpha, finished.last_tried)
        priors = self.scope_priors.of(tenant)
        self._request = RequestState(alpha=dict(priors), priors=priors, tenant=tenant)
        self._choice = None

    def parts(self) -> list[Drafter]:
        return list(self.candidates.values())

    def propose(self, token_ids: list[int], num_draft_tokens: int, sampler: RequestSampler) -> Proposal:
        request = self._request
        request.step, request.damped = request.step + 1, damps_repeats(sampler.params)
        self.verify.at(len(token_ids))  # priced, then timed, at the step's context
        request.score_declined(token_ids)
        offers = self._offers(token_ids, num_draft_tokens)
        prices = self.verify.prices(num_draft_tokens) if self.verify.knows(0) else None  # this step's, by k
        text_step = self._text_step(offers, prices) if prices is not None else None
        if text_step is not None:
            request.keep_pace(*text_step[1:])
        name, k = self._choose(token_ids, num_draft_tokens, offers, text_step, prices)
        request.note_step(name in offers)
        steady = request.last_tried.get(name) == request.step - 1
        lag = self.candidates[name].lag(token_ids) if name in self.draft_costs else 0
        choice = StepChoice(name, k, len(token_ids), steady=steady, lag=lag)
        started = time.perf_counter()
        if name in offers:
            drafts, choice.track = offers[name]
            proposal = Proposal(upload(drafts[:k], sampler.device), None)  # its best length
        elif name is not None and k > 0:
            proposal, choice.track = self.candidates[name].propose(token_ids, k, sampler), self._track(name)
        else:
            proposal = Proposal.empty(sampler.device)
        if choice.track is not None:
            request.last_tried[name] = request.last_tried[choice.track] = request.step
        # scored as the text passes them: the offers not taken, and the one taken past its first k drafts
        declined = [(*offer, k * (each == name)) for each, offer in offers.items() if each != name or k < len(offer[0])]
        request.declined += [(len(token_ids), tuple(drafts), track, taken) for drafts, track, taken in declined]
        choice.drafted, choice.proposed_at = proposal.token_ids.shape[0], time.perf_counter()
        choice.draft_seconds = choice.proposed_at - started
        self._choice = choice
        drafter = name if choice.drafted else "none"
        return Proposal(proposal.token_ids, proposal.probs, drafter, proposal.num_proposed)

    def accept(self, num_committed: int) -> None:
        for candidate in self.candidates.values():
            candidate.accept(num_committed)
        choice, self._choice = self._choice, None
        if choice is None:
            return
        verify_seconds = time.perf_counter() - choice.proposed_at  # the target's pass ran in between
        # Not a request's first verify, which also reads the prompt, nor one after a step that made
        # several tokens: served, it also waits on their events, whatever its k (docs/drafters.md#on-a-zen-4-host)
        if self._request.step > 1 and self._request.last_made == 1:
            self.verify.observe(choice.drafted, 0.0, verify_seconds)
        self._request.last_made = num_committed - choice.sequence_length + 1
        if choice.track is None:
            return
        costs = self.draft_costs.get(choice.name)  # None for text matching: its offer is made every step
        if costs is not None:
            # A step that caught up first would price drafting at prefill cost. One that read only the
            # newest token costs a step's drafting whatever ran before it: so a draft on the target's
            # keys and values (always one token) is timed by its probes too, and a start-up timing on
            # a busy host is replaced by the next probe, not keeping the draft out for good. A request's
            # first step is not timed, nor its catch-up where the drafter reads the target's cache.
            first = self._request.step == 1
            if choice.steady or (choice.lag <= 1 and not first):
                costs.observe(max(choice.drafted, 1), choice.draft_seconds, verify_seconds)
            elif (
                costs.draft is not None
                and choice.lag > choice.num_draft_tokens + 2
                and not (first and self.candidates[choice.name].reads_target_cache)
            ):
                reading = max(choice.draft_seconds - choice.drafted * costs.draft, 0.0) / choice.lag
                self.catch_up[choice.name] = _update(self.catch_up.get(choice.name), reading)
        if choice.drafted == 0:  # nothing proposed: the step cost a plain decode, says nothing of acceptance
            return
        self._observe(choice.track, num_committed - choice.sequence_length, choice.drafted)

    def _observe(self, track: str, accepted: int, drafted: int) -> None:
        """A step's drafts: ``accepted`` passed of ``drafted``, pooled into their tracks' acceptance
        (``RequestState.pool``), a text match's draft i as the match i - 1 tokens longer's."""
        if not is_text(track):
            self._request.pool([track] * drafted, accepted, MODEL_PRIOR_TOKENS)
        else:
            self._request.pool(continued(track, drafted), accepted)

    def _alpha(self, track: str) -> float:
        return self._request.alpha.get(track, self._request.priors.get(track, ALPHA_PRIOR))

    def _track(self, name: str) -> str:  # a model candidate's in this request
        return model_track(name, self._request.damped)

    def _drafts_passing(self, track: str, k: int) -> float:
        """Drafts of k expected to pass: geometric at the track's acceptance, for a text match along
        the tracks its drafts continue (a match that held one more token is a match one token longer:
        after a one-token match's first draft passes, the next is a two-token match's)."""
        if not is_text(track):
            return expected_tokens(self._alpha(track), k) - 1
        passing, chance = 0.0, 1.0
        for each in continued(track, k):
            chance *= self._alpha(each)
            passing += chance
        return passing

    def _tokens(self, track: str, k: int) -> float:
        """Tokens a step drafting k is expected to yield: the target's own and the drafts expected to pass."""
        return 1.0 + self._drafts_passing(track, k)

    def _text_step(
        self, offers: Offers, prices: list[float] | None = None
    ) -> tuple[tuple[str | None, int], float, float]:
        """The best of the text matchers' offers (whole, or their first k tokens: where a verify row
        costs a large part of a step, a weak match pays at one token and not at four) and a plain
        step, by expected tokens per second: ((candidate, k), expected tokens, seconds)."""
        prices = prices or self.verify.prices(max((len(drafts) for drafts, _ in offers.values()), default=0))
        best, tokens, seconds = (None, 0), 1.0, prices[0]
        for name, (drafts, track) in offers.items():
            for k in range(1, len(drafts) + 1):
                offered, cost = self._tokens(track, k), prices[k]
                if offered / cost > tokens / seconds:
                    best, tokens, seconds = (name, k), offered, cost
        return best, tokens, seconds

    def _offers(self, token_ids: list[int], limit: int) -> Offers:
        """What each text matcher that found something would draft now (up to ``limit`` tokens, on the
        host), with the track its acceptance is read from: a table lookup, cheap enough to ask first."""
        offers, damped = {}, self._request.damped
        for name in self._texts if limit > 0 else ():
            if drafts := (matcher := self.candidates[name]).offer(token_ids, limit):
                offers[name] = (drafts, match_track(name, matcher.match_length, damped, matcher.match_split))
        return offers

    def expect_catch_up(self, seconds_per_token: float, seconds_per_extra_row: float | None = None) -> None:
        """Start-up's measures of a draft model's reading cost: per token of a long prefill (else a
        draft step per token, several times too much, would keep it off any prompt it has not read),
        and per row beyond the first of a short read (the tokens another candidate got accepted)."""
        for name in self.draft_costs:  # the candidates that run a model
            self.catch_up.setdefault(name, seconds_per_token)
            if seconds_per_extra_row is not None:
                self.extra_row[name] = seconds_per_extra_row

    def expect_step_costs(self, verify_seconds: dict[int, float], draft_step_seconds: float | None) -> None:
        """Start-up's timings of the target's forward over k + 1 tokens (each k) and of the draft
        model's step, so a first request measures nothing at full k; live measures replace them."""
        self.verify.expect(verify=verify_seconds, context=measure.VERIFY_CONTEXT)
        if draft_step_seconds is not None:
            for costs in self.draft_costs.values():
                costs.expect(draft=draft_step_seconds)

    def expect_agreement(self, acceptance: float) -> None:  # start-up's, of the draft model: its prior
        self.priors |= with_damped_tracks(dict.fromkeys(self.draft_costs, acceptance))
        self._request = RequestState(alpha=dict(self.priors), priors=dict(self.priors))

    def _reads(self, name: str | None) -> bool:  # it runs a model, which must read the sequence first
        return name in self.candidates and self.candidates[name].runs_model

    def _catch_up_seconds(self, name: str, lag: int, limit: int) -> float:
        """What reading its lag (tokens) would cost the candidate now. A short lag (a few tokens another
        candidate got accepted) is priced per row beyond the one every draft step reads; a long one
        (a prompt) as a prefill, per token (before a measurement: at the draft step cost)."""
        if lag <= 1:  # the newest token, which every draft step reads
            return 0.0
        if lag <= limit + 2 and name in self.extra_row:
            return (lag - 1) * self.extra_row[name]
        return lag * self.catch_up.get(name, self.draft_costs[name].draft or 0.0)

    def _choose(
        self, token_ids: list[int], limit: int, offers: Offers | None = None, text_step=None, prices=None
    ) -> tuple[str | None, int]:
        """(candidate, k) with the most expected tokens per second; (None, 0) to draft nothing.
        ``offers``: the text matchers' proposals for this step (``_offers``); ``text_step``: their best
        (``_text_step``) and ``prices`` a verify's by k (``StepCosts.prices``), where the step already asked."""
        if limit <= 0:
            return None, 0
        request, offers = self._request, offers or {}
        for name, costs in self.draft_costs.items():
            if costs.draft is None:  # measure every draft model once, over two consecutive steps (see steady)
                return name, limit
        if not self.verify.knows(0):
            return None, 0  # and plain decoding once
        prices = prices or self.verify.prices(limit)
        catch_up = {
            name: self._catch_up_seconds(name, self.candidates[name].lag(token_ids), limit) for name in self.draft_costs
        }
        tracks = {name: self._track(name) for name in self.draft_costs}
        horizon = HORIZON * max(request.left_by_text, 1 / HORIZON)  # the tokens it is paid back over
        # A draft model's step must beat text matching's pace over the last few steps, not only this
        # step's offer: where the text repeats, a plain step reaches the next match sooner.
        best, tokens, seconds = text_step or self._text_step(offers, prices)  # or a plain step
        paced_tokens, paced_seconds = request.text_pace
        best_rate = max(tokens / seconds, paced_tokens / paced_seconds if paced_seconds else 0.0)
        for name, costs in self.draft_costs.items():
            track = tracks[name]
            for k in range(1, limit + 1):
                tokens = self._tokens(track, k)
                seconds = k * costs.draft + prices[k] + catch_up[name] * tokens / horizon
                if tokens / seconds > best_rate:
                    best, best_rate = (name, k), tokens / seconds
        # Probes keep a draft model's acceptance current (text matching needs none: its declined offers
        # are scored, ``RequestState.score_declined``) where the best is another model or a plain step,
        # never a text match (taken without detour), at one token, once unused a while (probe_every steps
        # at acceptance 0.5, longer for a weaker one) and with little to catch up. One whose live step could
        # not beat plain decoding even at the most it may accept (its prior or this request's estimate, the
        # higher) is probed RARELY as often.
        if best[0] in offers:
            return best
        plain_step, due = prices[0], self.probe_every * PROBE_ALPHA
        for name, costs in self.draft_costs.items():
            track = tracks[name]
            unused = (request.step - request.last_tried.get(name, 0)) * self._alpha(track)
            if name == best[0] or unused <= due or catch_up[name] > PROBE_CATCH_UP * plain_step:
                continue  # not due (whether it could pay is asked only then), or dear to catch up
            most = max(request.priors.get(track, ALPHA_PRIOR), self._alpha(track))
            hopeless = not costs.provisional_draft and gain_over_plain(most, costs.draft or 0.0, prices) <= 1.0
            if unused > due * (RARELY if hopeless else 1):
                return name, 1
        return best


@register("auto", AutoDrafter)
def _build(resources: DraftResources) -> AutoDrafter:
    candidates: dict[str, Drafter] = {"suffix": build("suffix", resources)}
    if resources.draft is not None:
        candidates["model"] = build("model", resources)
        staged = replace(resources, config=replace(resources.config, stages=("suffix", "model")))
        candidates["staged"] = build("staged", staged)
    head = head_drafter(resources)  # an EAGLE-3 head named, or shipped for this target
    if head is not None:
        candidates["eagle3"] = head
    return AutoDrafter(candidates, resources)
