"""The auto drafter: candidates chosen per step by expected tokens per second, acceptance per
request, costs shared, and every choice from past steps only. Exactness lives in test_lossless.py
(there auto switches candidates at every step)."""

from __future__ import annotations

import math

import pytest
import torch

from engine import adaptive
from engine.adaptive import ScopePriors, StepCosts, expected_tokens
from engine.drafters.auto_state import (
    DAMPED_MATCH_PRIORS,
    DAMPED_MODEL_FACTOR,
    MATCH_PRIORS,
    SPLIT_MATCH_PRIORS,
    continued,
    damps_repeats,
    match_track,
)
from engine.factory import warm_up
from engine.measure import CONTEXT_CHUNK, VERIFY_CONTEXT, robust_line, verify_prices, verify_seconds
from engine.request import Request
from engine.sampling import RequestSampler, SamplingParams
from tests.tiny import perturbed_copy, tiny_engine, tiny_llama


def auto_engine(noise: float = 0.05):
    target = tiny_llama(seed=3, vocab_size=96, init=0.2)
    return tiny_engine(target, perturbed_copy(target, noise, seed=1), drafter="auto", num_draft_tokens=4)


def test_candidates_are_what_can_run_here():
    assert set(auto_engine().drafter("auto").candidates) == {"suffix", "model", "staged"}
    alone = tiny_engine(tiny_llama(seed=3, vocab_size=96), None, drafter="auto")
    assert set(alone.drafter("auto").candidates) == {"suffix"}


def priced_auto(verify: dict[int, float], model_cost: float, alpha: dict[str, float]):
    """An auto drafter mid-request with these costs and acceptances, every candidate already tried
    (no first runs or probes)."""
    auto = auto_engine().drafter("auto")
    auto.begin([1, 2, 3])
    auto.verify = StepCosts(0.0, verify)
    auto.draft_costs = {"model": StepCosts(model_cost), "staged": StepCosts(0.012)}
    auto._request.alpha |= alpha
    auto._request.last_tried = dict.fromkeys([*auto.candidates, *auto.priors], 0)
    return auto


def offer(num_tokens: int, match_length: int) -> dict[str, tuple[list[int], str]]:
    """Text matching's offer for a step: ``num_tokens`` drafts continuing a match of ``match_length``."""
    return {"suffix": (list(range(num_tokens)), match_track("suffix", match_length))}


def test_the_choice_follows_cost_and_acceptance():
    auto = priced_auto(
        {0: 0.030, 1: 0.033, 2: 0.034, 3: 0.035, 4: 0.036}, 0.010, {"suffix@4": 0.1, "model": 0.9, "staged": 0.5}
    )
    prompt = [1, 2, 3]
    assert auto._choose(prompt, 4, offer(4, 4)) == ("model", 4)
    # the draft model has read none of a 900-token context: at 10 ms a token, catching up loses
    auto.catch_up = {"model": 0.010, "staged": 0.010}
    assert auto._choose([1] * 900, 4) == (None, 0)
    auto._request.alpha["suffix@4"] = 0.9  # as good and nearly free
    assert auto._choose(prompt, 4, offer(4, 4)) == ("suffix", 4)
    auto._request.alpha |= {"suffix@4": 0.05, "model": 0.05, "staged": 0.05}
    assert auto._choose(prompt, 4, offer(4, 4)) == (None, 0)  # nothing pays: plain decoding
    assert auto._choose(prompt, 0) == (None, 0)


def test_a_catch_up_is_paid_back_over_the_steps_text_matching_leaves_to_others():
    """A draft model that must read 300 tokens first pays that back over the next 64 tokens where
    text matching takes no steps; where it took the recent ones, the model would draft only between
    matches, so the same catch-up does not pay (a head read a 1,594-token document for two steps)."""
    auto = priced_auto({0: 0.030, 1: 0.031, 2: 0.032, 3: 0.033, 4: 0.034}, 0.006, {"model": 0.9, "staged": 0.1})
    auto.catch_up = {"model": 0.001, "staged": 0.001}  # 0.3 s for 300 tokens
    context = [1] * 300
    assert auto._request.left_by_text == 1.0 and auto._choose(context, 4)[0] == "model"
    for by_text in (False, True, True, True, True, True, True, True):
        auto._request.note_step(by_text)
    assert auto._request.left_by_text < 0.25 and auto._choose(context, 4) == (None, 0)
    assert auto._choose([1, 2, 3], 4)[0] == "model"  # nothing to catch up: the share does not matter


def test_text_matching_is_judged_by_its_offer_and_the_length_of_its_match():
    """Its proposal is made before the choice: a long match wins the step, a one-token match (which
    seldom holds) or no match leaves it to the draft model, and a short offer is priced as short."""
    auto = priced_auto(
        {0: 0.030, 1: 0.031, 2: 0.032, 3: 0.033, 4: 0.034}, 0.006, {"suffix@1": 0.2, "suffix@8": 0.95, "model": 0.9}
    )
    prompt = [1, 2, 3]
    assert auto._choose(prompt, 4, offer(4, 8)) == ("suffix", 4)
    assert auto._choose(prompt, 4, offer(2, 1))[0] == "model"
    assert auto._choose(prompt, 4, {})[0] == "model"
    assert auto._choose(prompt, 4, offer(1, 8))[0] == "model"  # one token, however sure, against the model's run
    assert [match_track("suffix", n) for n in (1, 2, 3, 4, 7, 8)] == [
        "suffix@1",
        "suffix@2",
        "suffix@2",
        "suffix@4",
        "suffix@4",
        "suffix@8",
    ]


def test_a_short_match_whose_continuation_was_split_is_priced_on_a_track_of_its_own():
    """A one-token match whose first draft was one of several tokens seen after it passes far less
    often than one always followed by the same token: its own track, from a lower prior, so the same
    offer pays where the continuation was the only one and is declined where it was split. Once its
    first draft passed, the next continues a longer match like any other."""
    auto = priced_auto({0: 0.030, 1: 0.036, 2: 0.041, 3: 0.046, 4: 0.051}, 0.010, {"model": 0.0, "staged": 0.0})
    auto.draft_costs = {}  # text matching and plain decoding only
    assert match_track("suffix", 1, split=True) == "suffix@1?" and match_track("suffix", 4, split=True) == "suffix@4"
    assert continued("suffix@1?", 3) == ("suffix@1?", "suffix@2", "suffix@2")
    assert auto._request.alpha["suffix@1?"] == SPLIT_MATCH_PRIORS[1] < MATCH_PRIORS[1] == auto._alpha("suffix@1")
    one_token = [5, 6]
    assert auto._choose([1, 2, 3], 4, {"suffix": (one_token, match_track("suffix", 1))}) == ("suffix", 2)
    assert auto._choose([1, 2, 3], 4, {"suffix": (one_token, match_track("suffix", 1, split=True))}) == (None, 0)
    auto.begin([1, 7, 2, 7, 2, 7, 3, 8, 4])
    # after 7: 2 twice, 3 once; then 7 2 was always followed by 7
    assert auto._offers([1, 7, 2, 7, 2, 7, 3, 8, 4, 7], 4) == {"suffix": ([2, 7], "suffix@1?")}
    assert auto._offers([1, 7, 2, 7, 2, 7, 3, 8, 4, 7, 2], 4) == {"suffix": ([7, 2, 7, 3], "suffix@2")}


def test_a_draft_model_must_beat_text_matchings_pace_over_the_last_steps():
    """Right after a run of long matches, a step without one goes to plain decoding (the next match
    comes sooner than four drafted tokens); once the pace has faded, the draft model takes over."""
    auto = priced_auto({0: 0.030, 1: 0.031, 2: 0.032, 3: 0.033, 4: 0.034}, 0.006, {"model": 0.9})
    auto._request.text_pace = (9.0, 0.07)  # lately about 4.5 tokens a step at 35 ms
    assert auto._choose([1, 2, 3], 4, {}) == (None, 0)
    auto._request.text_pace = (2.5, 0.12)  # three plain steps later
    assert auto._choose([1, 2, 3], 4, {})[0] == "model"


def test_the_offer_is_what_a_step_choosing_text_matching_drafts():
    engine = auto_engine()
    warm_up(engine)
    auto = engine.drafter("auto")
    prompt = [7, 8, 9, 10, 11, 12, 7, 8, 9, 10, 11]  # suffix continues [7 .. 11] with 12, 7, 8, ...
    auto.begin(prompt)
    auto._request.alpha |= {"suffix@4": 0.99, "model": 0.1, "staged": 0.1}
    auto._request.last_tried = dict.fromkeys([*auto.candidates, *auto.priors], 0)
    sampler = RequestSampler(SamplingParams(temperature=0.0), 96, torch.device("cpu"), prompt, seed=0)
    proposal = auto.propose(prompt, 4, sampler)
    assert proposal.drafter == "suffix" and proposal.token_ids.tolist() == [12, 7, 8, 9]
    assert auto._choice.track == "suffix@4" and auto.candidates["suffix"].match_length == 5
    # the step's offer joined text matching's pace: its expected tokens, at its verify's cost
    assert auto._request.text_pace == (auto._tokens("suffix@4", 4), auto.verify.verify_cost(4))
    auto.accept(len(prompt) + 4)
    assert auto._request.evidence["suffix@4"] == (4, 0)  # all four passed, on the track of a 4-7 token match


def test_a_damped_request_prices_its_text_matches_on_tracks_of_their_own():
    """A text match passes only where the target draws the token it continues with, against any
    penalty on repeating it: a request sampled hot, or penalising repeats, has tracks of its own
    (``suffix@1~``) from lower priors, so where a verify row costs a fifth of a step, the one-token
    match a greedy (or cool) request drafts is left to a plain step, and scored as declined."""
    engine = auto_engine()
    warm_up(engine)
    auto = engine.drafter("auto")
    auto.verify = StepCosts(0.0, {k: 0.030 * (1 + 0.2 * k) for k in range(5)})
    assert auto.priors["suffix@1~"] == DAMPED_MATCH_PRIORS[1] < auto.priors["suffix@1"] == MATCH_PRIORS[1]
    prompt = [7, 8, 9, 10, 11, 12, 9]  # 9 was followed by 10: a one-token match
    for temperature, penalty, drafter, track in (
        (0.0, 1.0, "suffix", "suffix@1"),
        (0.3, 1.0, "suffix", "suffix@1"),
        (0.8, 1.0, "none", "suffix@1~"),
        (0.0, 1.1, "none", "suffix@1~"),
    ):
        auto.begin(prompt)
        auto._request.alpha |= dict.fromkeys(["model", "staged", "model~", "staged~"], 0.0)
        auto._request.last_tried = dict.fromkeys([*auto.candidates, *auto.priors], 0)
        params = SamplingParams(temperature=temperature, repetition_penalty=penalty)
        sampler = RequestSampler(params, 96, torch.device("cpu"), prompt, seed=0)
        proposal = auto.propose(prompt, 1, sampler)
        assert proposal.drafter == drafter and proposal.token_ids.tolist() == ([10] if drafter == "suffix" else [])
        assert auto._choice.track == (track if drafter == "suffix" else None)
        assert auto._request.declined == ([] if drafter == "suffix" else [(len(prompt), (10,), track, 0)])
        auto.accept(len(prompt))


def test_a_damped_request_prices_its_model_candidates_on_tracks_of_their_own():
    """A draft model's (or head's) drafts pass less often where the request samples hot or penalises
    repeats (the shipped head: 0.26 at 0.8, 0.25 under a penalty, against 0.33 greedy): such a request
    prices them on a track of its own (``model~``) from a lower prior, so where the greedy prior pays
    one draft, a damped request decodes plainly; and what its steps learn leaves the greedy track be."""
    auto = auto_engine().drafter("auto")
    auto.expect_agreement(0.4)
    assert auto.priors["model~"] == pytest.approx(DAMPED_MODEL_FACTOR * 0.4) and auto.priors["model"] == 0.4
    prompt = [1, 2, 3]
    for temperature, penalty, chosen in ((0.0, 1.0, ("model", 1)), (0.8, 1.0, (None, 0)), (0.0, 1.1, (None, 0))):
        auto.begin(prompt, tenant=f"{temperature} {penalty}")  # each its own scope: start-up's priors
        auto.verify = StepCosts(0.0, {k: 0.030 + 0.002 * k for k in range(5)})  # one draft pays above 1/3
        auto.draft_costs = {"model": StepCosts(0.008), "staged": StepCosts(1.0)}
        sampler = RequestSampler(
            SamplingParams(temperature=temperature, repetition_penalty=penalty), 96, torch.device("cpu"), prompt, 0
        )
        auto._request.damped = damps_repeats(sampler.params)
        assert auto._choose(prompt, 4) == chosen
        auto._request.alpha["model~"] = 0.9  # a damped request whose drafts do pass: they pass on its track
        proposal = auto.propose(prompt, 1, sampler)
        assert proposal.drafter == "model" and auto._choice.track == ("model~" if chosen[0] is None else "model")
        auto.accept(len(prompt))  # the draft failed
        assert ("model~" in auto._request.evidence) == (chosen[0] is None)
        assert auto._request.alpha["model"] == 0.4 if chosen[0] is None else auto._request.alpha["model"] < 0.4


def test_a_text_match_that_holds_one_more_token_is_priced_as_the_longer_match():
    """A one-token match seldom holds, but once its first draft passed the match is two tokens long,
    and its second draft passes as a two-token match's does: the offer is taken whole, where pricing
    both drafts at the one-token match's acceptance cut it to one (and lost the second token)."""
    auto = priced_auto(
        {0: 0.030, 1: 0.031, 2: 0.033}, 0.050, {"suffix@1": 0.25, "suffix@2": 0.9, "model": 0.0, "staged": 0.0}
    )
    assert auto._tokens("suffix@1", 2) == pytest.approx(1 + 0.25 + 0.25 * 0.9)
    assert auto._choose([1, 2, 3], 2, offer(2, 1)) == ("suffix", 2)
    auto._observe("suffix@1", 2, 2)  # both passed: one success as a one-token match, one as a two-token one
    assert auto._request.evidence["suffix@1"] == (1, 0) and auto._request.evidence["suffix@2"] == (1, 0)
    auto._observe("suffix@1", 1, 2)  # the second failed: a rejection for the two-token match
    assert auto._request.evidence["suffix@1"] == (0.9 + 1, 0) and auto._request.evidence["suffix@2"] == (0.9, 1)


def test_one_lucky_step_of_a_draft_model_moves_its_acceptance_less_than_a_text_matchs():
    """A draft model's prior (measured at start-up, or recorded beside a head) counts as eight tokens,
    a text match's as two: a head at 0.3 whose first step passed both drafts drafted four at the
    next step at 0.65, and lost them, where a text match's acceptance does swing with the text."""
    auto = priced_auto({0: 0.030, 1: 0.031, 2: 0.032}, 0.050, {})
    auto._request.priors |= {"model": 0.3, "suffix@1": 0.3}
    auto._observe("model", 2, 2)
    auto._observe("suffix@1", 1, 1)
    assert auto._alpha("model") == pytest.approx((2 + 8 * 0.3) / (2 + 8))
    assert auto._alpha("suffix@1") == pytest.approx((1 + 2 * 0.3) / (1 + 2))


def test_one_token_matches_that_fail_lower_the_price_of_longer_matches_before_they_are_tried():
    """A request whose text matches fail more often than their priors say (chat and prose: one-token
    matches hold a third as often as in code) says so first through its many one-token offers: one
    shift of every match length's prior in log-odds, fitted to all of them, lowers the two-token
    match's before it has failed itself, and its four-draft offer is cut to one. Where they pass more
    often, no prior is raised: a summary's long matches hold where its short ones break."""
    costs = {0: 0.030, 1: 0.040, 2: 0.050, 3: 0.060, 4: 0.070}  # a verify row costs a third of a step
    auto = priced_auto(costs, 0.010, {"model": 0.05, "staged": 0.05})
    assert auto._choose([1, 2, 3], 4, offer(4, 2)) == ("suffix", 3)  # at the prior, 0.75
    for _ in range(8):
        auto._observe("suffix@1", 0, 1)  # eight one-token matches failed
    assert "suffix@2" not in auto._request.evidence
    assert auto._alpha("suffix@2") < 0.5
    assert auto._choose([1, 2, 3], 4, offer(4, 2)) == ("suffix", 1)
    lucky = priced_auto(costs, 0.010, {"model": 0.05, "staged": 0.05})
    for _ in range(8):
        lucky._observe("suffix@1", 1, 1)
    assert lucky._alpha("suffix@2") == MATCH_PRIORS[2] and lucky._alpha("suffix@1") > MATCH_PRIORS[1]


def test_a_draft_models_step_is_priced_at_the_geometric_yield_of_its_pooled_acceptance():
    """A draft model's drafts pass alike (one model, one acceptance): k drafts yield the geometric
    (1 - a^(k+1)) / (1 - a) tokens, the target's own among them, whatever its last steps yielded."""
    auto = priced_auto({0: 0.030, 1: 0.031, 2: 0.032}, 0.050, {"suffix@1": 0.3, "model": 0.5, "staged": 0.0})
    auto._observe("model", 2, 2)  # one step, both passed
    alpha = auto._alpha("model")
    assert 0.5 < alpha < 1.0
    assert auto._tokens("model", 4) == pytest.approx(expected_tokens(alpha, 4))


def test_probes_take_a_draft_model_unused_lately_with_one_token_and_never_a_text_match():
    auto = priced_auto(
        {0: 0.030, 1: 0.033, 2: 0.034, 3: 0.035, 4: 0.036}, 0.010, {"suffix@2": 0.05, "model": 0.9, "staged": 0.05}
    )
    assert auto._choose([1, 2, 3], 4, offer(3, 2)) == ("model", 4)  # on merit
    auto._request.step = 500  # a text match's track unused for 500 steps: no probe (declined offers are scored)
    auto._request.last_tried |= {"model": 500, "staged": 500}
    assert auto._choose([1, 2, 3], 4, offer(3, 2)) == ("model", 4)
    auto._request.alpha["model"] = 0.4
    auto._request.last_tried["model"] = 475  # 25 steps at acceptance 0.4 make it due (20 at 0.5)
    auto.catch_up["model"] = 0.002  # its three unread positions: a fifth of a plain step
    assert auto._choose([1, 2, 3], 4, offer(3, 2)) == ("model", 1)  # a probe, one token, for a plain step
    auto.catch_up["model"] = 0.004  # 12 ms of a 30 ms plain step: a probe catches up a quarter at most
    assert auto._choose([1, 2, 3], 4, offer(3, 2)) == (None, 0)
    auto.catch_up["model"] = 0.002
    auto._request.alpha["suffix@2"] = 0.95
    assert auto._choose([1, 2, 3], 4, offer(3, 2)) == ("suffix", 3)  # a text match that wins: no detour
    auto._request.alpha["suffix@2"] = 0.05
    auto._request.last_tried["model"] = 485
    assert auto._choose([1, 2, 3], 4, offer(3, 2)) == (None, 0)


def test_a_declined_text_offer_is_scored_by_how_many_of_its_drafts_the_committed_text_matches():
    """A deterministic draft passes with the target's probability of it, the chance that a step
    commits it there (greedy: exactly when it is the token), and the next, once it did, with the
    next token's: once the text has passed a declined offer, the tokens committed say how many of
    its drafts would have passed, pooled as a drafted step's, on the tracks they continue. Scored
    from its first draft alone, a track learned only from the steps that drafted, taken when its
    estimate ran high, and they fell short of it: greedy code lost 6% of its steps to `suffix` alone."""
    auto = priced_auto({0: 0.030, 1: 0.033, 2: 0.034, 3: 0.035, 4: 0.036}, 0.010, {"suffix@1": 0.3})
    auto._request.declined = [(3, (7, 9), "suffix@1", 0), (4, (8, 5, 6), "suffix@2", 0)]
    auto._request.score_declined([1, 2, 3, 7, 8, 5])  # 7 then 8 at 3: the first draft passed, the second not
    assert auto._request.evidence == {"suffix@1": (1, 0), "suffix@2": (0, 1)}
    assert auto._request.last_tried["suffix@1"] == auto._request.step
    assert auto._request.declined == [(4, (8, 5, 6), "suffix@2", 0)]  # 8, 5 so far: its third is not yet known
    auto._request.score_declined([1, 2, 3, 7, 8, 5, 6, 4])  # all three held
    assert auto._request.evidence["suffix@2"] == (2, 0.9) and auto._request.evidence["suffix@4"] == (1, 0)
    assert not auto._request.declined
    auto._request.declined = [(4, (9,), "suffix@1", 0)]
    held = auto._alpha("suffix@1")
    auto._request.score_declined([1, 2, 3, 7, 8])  # 8, not 9
    assert auto._alpha("suffix@1") < held


def test_an_offer_taken_in_part_is_scored_past_its_taken_drafts_where_they_passed():
    """A step that drafts the first k of a longer offer learns nothing of the rest from its verify:
    a match priced short-lived in another type of text (a scope's chat before its summaries) would
    stay cut short, its longer drafts never tried (summaries took 48 steps to `suffix` alone's 44).
    Once the text has passed the rest, it is scored as a declined offer's, on the tracks it continues,
    unless a taken draft was rejected (what followed a rejected token says nothing)."""
    auto = priced_auto({0: 0.030, 1: 0.033, 2: 0.034, 3: 0.035, 4: 0.036}, 0.010, {"suffix@2": 0.6})
    auto._request.declined = [(3, (7, 8, 9, 5), "suffix@2", 2), (3, (5, 8, 9), "suffix@2", 1)]
    auto._request.score_declined([1, 2, 3, 7, 8, 9, 4])  # the first two passed, then the third; the fourth not
    # the first offer's drafts 3 and 4 continue the match 4 and 5 tokens long; the second's taken draft failed
    assert auto._request.evidence == {"suffix@4": (1, 1)}
    assert not auto._request.declined


class FixedCosts(StepCosts):
    """Step costs as set, whatever the steps take."""

    def observe(self, k: int, draft_seconds: float, verify_seconds: float) -> None:
        pass


def test_text_matching_learned_useless_in_a_scope_recovers_where_the_text_repeats():
    """A scope whose requests found no text match holding starts the next with every match track
    near 0: declined offers, scored by the text that follows, bring the track back and suffix
    drafts. Before, a track that low waited hundreds of steps for a probe and the request drafted
    nothing."""
    target = tiny_llama(seed=3, vocab_size=96, init=0.2)
    engine = tiny_engine(target, None, drafter="auto")
    warm_up(engine)
    auto = engine.drafter("auto")
    auto.scope_priors = ScopePriors(dict.fromkeys(auto.priors, 0.02), 0.3)  # as a scope's requests left them
    step = auto.verify.verify_cost(0)  # a verify row costing a third of a step, as on CPU: a track at 0.02 never pays
    auto.verify = FixedCosts()  # not moved by this tiny model's own timings (a plain step is priced apart)
    auto.verify.expect(verify={k: step * (1 + k / 3) for k in range(5)})
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    prompt = [5, 9, 11, 5, 9, 11, 5, 9, 11, 5, 9, 11]
    outputs = list(engine.generate(Request("r", prompt, params, drafter="auto", tenant="a")))
    expected = [t for o in tiny_engine(target, None).generate(Request("t", prompt, params)) for t in o.token_ids]
    assert [t for o in outputs for t in o.token_ids] == expected
    steps = outputs[-1].stats.to_dict()["steps_by_drafter"]
    assert steps.get("suffix", 0) >= 3, steps


def test_a_weak_text_match_is_taken_cut_to_the_tokens_that_pay():
    """Where each verify row costs a third of a step, a match at acceptance 0.5 pays at one token
    (1.5 tokens for 1.33 steps) and not at four (1.94 tokens for 2.33 steps)."""
    auto = priced_auto(
        {0: 0.030, 1: 0.040, 2: 0.050, 3: 0.060, 4: 0.070}, 0.010, {"suffix@2": 0.5, "model": 0.05, "staged": 0.05}
    )
    assert auto._choose([1, 2, 3], 4, offer(4, 2)) == ("suffix", 1)
    auto._request.alpha["suffix@2"] = 0.95
    assert auto._choose([1, 2, 3], 4, offer(4, 2)) == ("suffix", 4)
    auto._request.alpha["suffix@2"] = 0.2
    assert auto._choose([1, 2, 3], 4, offer(4, 2)) == (None, 0)


def test_a_draft_model_is_not_tried_at_once_in_a_request():
    auto = auto_engine().drafter("auto")
    auto.begin([1, 2, 3])
    auto.verify = StepCosts(0.0, {0: 0.030, 1: 0.033, 2: 0.034, 3: 0.035, 4: 0.036})
    auto.draft_costs = {"model": StepCosts(0.010), "staged": StepCosts(0.012)}
    auto._request.alpha |= {"model": 0.05, "staged": 0.05}  # its prior says it would not pay
    auto._request.step = 2
    assert auto._choose([1, 2, 3], 4)[0] != "model"


def test_text_matchings_acceptance_by_match_length_carries_across_requests():
    auto = auto_engine().drafter("auto")
    assert auto.priors["suffix@1"] == MATCH_PRIORS[1] < auto.priors["suffix@8"] == MATCH_PRIORS[8]
    auto.begin([1, 2, 3])
    auto._request.alpha["suffix@1"] = 0.05  # a request where one-token matches never held
    auto._request.last_tried["suffix@1"] = 1
    auto.begin([1, 2, 3])
    assert auto._request.alpha["suffix@1"] == pytest.approx(0.7 * MATCH_PRIORS[1] + 0.3 * 0.05)
    assert auto._request.alpha["suffix@8"] == MATCH_PRIORS[8]  # a length the request never took: unchanged


def test_steps_report_who_drafted_and_greedy_output_is_the_targets():
    engine = auto_engine()
    engine.drafter("auto").probe_every = 1
    target_only = tiny_engine(tiny_llama(seed=3, vocab_size=96, init=0.2), None)  # the same target, its own modules
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    prompt = [5, 9, 11, 5, 9, 11, 5, 9]
    outputs = list(engine.generate(Request("a", prompt, params)))
    expected = [t for o in target_only.generate(Request("t", prompt, params)) for t in o.token_ids]
    assert [t for o in outputs for t in o.token_ids] == expected
    used = outputs[-1].stats.steps_by_drafter
    assert outputs[-1].stats.drafter == "auto" and len({name for name in used if name != "none"}) >= 2


def test_acceptance_is_learned_per_request_and_costs_across_requests():
    engine = auto_engine(noise=2.0)  # a draft that disagrees: model acceptance falls within the request
    auto = engine.drafter("auto")
    engine._seeds.manual_seed(0)
    params = SamplingParams(max_tokens=40, temperature=1.0)
    list(engine.generate(Request("a", [1, 2, 3], params, drafter="auto")))
    assert all(costs.draft is not None for costs in auto.draft_costs.values())  # measured, kept for later
    prior = auto.priors["model~"]  # sampled hot: the model's damped track, from a lower prior
    assert prior == DAMPED_MODEL_FACTOR * auto.priors["model"]
    learned = auto._request.alpha["model~"]
    assert learned < prior
    auto.begin([4, 5, 6])
    # the next request starts from the prior, which moved toward what the last request measured
    assert auto._request.alpha["model~"] == pytest.approx(0.7 * prior + 0.3 * learned)
    assert learned < auto._request.alpha["model~"] < prior


def test_a_seeded_request_under_an_auto_default_keeps_auto_and_repeats_the_targets_text():
    """auto's timing-driven choices cannot change a seeded text (position-keyed draws): no fixed stand-in."""
    engine = auto_engine()
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=5)
    runs = [list(engine.generate(Request(str(i), [1, 2, 3], params))) for i in range(3)]
    alone = list(engine.generate(Request("alone", [1, 2, 3], params, drafter="none")))
    assert {outputs[-1].stats.drafter for outputs in runs} == {"auto"}
    texts = {tuple(t for o in outputs for t in o.token_ids) for outputs in [*runs, alone]}
    assert len(texts) == 1


def test_warm_up_measures_the_draft_models_agreement_and_prefill_cost():
    close, far = auto_engine(noise=0.05), auto_engine(noise=3.0)
    for engine in (close, far):
        warm_up(engine)
    near_prior, far_prior = close.drafter("auto").priors, far.drafter("auto").priors
    assert near_prior["model"] == near_prior["staged"] and near_prior["suffix@2"] == MATCH_PRIORS[2]  # its own
    assert 0.0 < far_prior["model"] < near_prior["model"] <= 1.0
    assert close.drafter("auto")._request.alpha["model"] == near_prior["model"]  # the next request starts there
    assert all(seconds > 0 for seconds in close.drafter("auto").catch_up.values())
    assert set(close.drafter("auto").extra_row) == {"model", "staged"}


def test_warm_up_times_the_steps_so_the_first_request_need_not():
    engine = auto_engine()
    warm_up(engine)
    auto = engine.drafter("auto")
    assert sorted(auto.verify.verify) == [0, 1, 2, 3, 4] and all(s > 0 for s in auto.verify.verify.values())
    assert auto.draft_costs["model"].draft == auto.draft_costs["staged"].draft > 0
    assert "suffix" not in auto.draft_costs  # text matching's offer is made every step, whatever runs
    # the first live measure of the draft cost replaces the start-up timing; later ones average in
    model_costs = auto.draft_costs["model"]
    model_costs.observe(4, 4 * 0.5, 0.25)
    assert model_costs.draft == 0.5
    model_costs.observe(4, 4 * 1.5, 0.25)
    assert 0.5 < model_costs.draft < 1.5


@pytest.mark.parametrize(
    "timed",
    [
        [6.0, 8.0, 10.0, 12.0, 14.0],
        [6.0, 8.0, 10.0, 12.0, 60.0],
        [30.0, 8.0, 10.0, 12.0, 14.0],
        [6.0, 8.0, 45.0, 12.0, 14.0],
    ],
)
def test_one_disturbed_start_up_timing_cannot_tip_the_verify_line(timed):
    """Start-up times the forward at each k; a busy host can catch one of them. The line auto prices
    k by stays the one the other four lie on (a least-squares line through the spike at k = 4 put
    plain decoding at -3.2 ms, and every step then looked free)."""
    assert robust_line(timed) == pytest.approx([6.0, 8.0, 10.0, 12.0, 14.0])
    assert robust_line([5.0, 4.0, 3.0, 2.0, 1.0]) == [3.0] * 5  # no k is cheaper than a smaller one
    assert min(robust_line([1.0, 1.0, 1.0, 9.0, 9.0])) == 0.5  # and none is free


def test_a_disturbed_start_up_reading_of_a_plain_step_is_priced_below_a_verify_of_one_draft():
    """A plain step does less than a verify of one draft, whose first row costs at least each further
    one. Start-up read a plain step at 11.3 ms against 10.4 at k = 1 (a busy moment of the host): every
    one-token draft then looked free, and the plain steps that would correct the price were seldom
    taken (chat at 0.8 ran 0.94x target-only). Priced at most the line at 1 less a row, a weak match
    goes to plain decoding."""
    disturbed = [0.0113, 0.0104, 0.0112, 0.0120, 0.0128]
    prices = verify_prices(disturbed)
    assert prices[0] == pytest.approx(0.0096) and [prices[k] for k in range(1, 5)] == pytest.approx(disturbed[1:])
    assert verify_prices([0.0082, 0.0095, 0.0103, 0.0112, 0.0121])[0] == 0.0082  # an undisturbed reading stands
    assert verify_prices([0.0082]) == {0: 0.0082}  # no drafts: a plain step alone
    assert verify_prices([0.008, 0.010, 0.011, 0.040, 0.041])[0] == 0.004  # a line steeper than its start: not free
    auto = priced_auto({0: 1.0}, 0.006, {"suffix@1": 0.05, "model": 0.05, "staged": 0.05})
    auto.verify = StepCosts()
    auto.verify.expect(verify=prices)
    assert auto._choose([1, 2, 3], 4, offer(1, 1)) == (None, 0)
    raw = StepCosts()
    raw.expect(verify=dict(enumerate(disturbed)))  # the reading as it was is priced by the same bound
    assert raw.verify_cost(0) == pytest.approx(0.0096)


def test_one_slow_plain_step_cannot_price_plain_decoding_above_a_verify_of_one_draft():
    """A fresh process's first sampled step ran 6.9 ms where a plain step takes 4.4 and a verify of
    one draft 5.0. It replaced start-up's reading; plain decoding then looked dearer than drafting one
    token, every later step drafted (the head 42-54 of about 70 steps at 0.8, with an acceptance near
    0.3), and no plain step came to correct the price. Priced at most a verify of one draft less a
    row, a weak one-token draft goes to plain decoding, whose steps then bring the average down."""
    costs = StepCosts()
    costs.expect(verify={0: 0.0044, 1: 0.0050, 2: 0.0055, 3: 0.0060, 4: 0.0065})
    costs.observe(0, 0.0, 0.0069)  # the first plain step, cold
    assert costs.plain == 0.0069 and costs.verify_cost(0) == pytest.approx(0.0045)  # 5.0 less a 0.5 ms row
    auto = priced_auto({0: 1.0}, 0.0013, {"suffix@1": 0.1, "model": 0.1, "staged": 0.1})
    auto.verify = costs
    assert auto._choose([1, 2, 3], 4, offer(1, 1)) == (None, 0)
    for _ in range(60):
        costs.observe(0, 0.0, 0.0044)
    assert costs.verify_cost(0) == pytest.approx(0.0044, abs=0.0001)  # plain steps themselves, below the bound


def test_plain_steps_once_eight_are_seen_price_a_plain_step_up_to_a_verify_of_one_draft():
    """The int8 target on a Zen 3 host (AVX2): a plain step 6.0 ms, the first drafted row 1.3 ms more,
    each further one 1.4-1.7, so a plain step's bound, a verify of one draft less the line's row, sat
    about 0.45 ms under what plain steps took, and the offers after a one-token match, whose first drafts
    pass 0.2-0.3 on code, were declined where they paid. Start-up's reading and a few live steps keep
    that bound (one cold step is no price); eight live plain steps are their own price, never above a
    verify of one draft."""
    costs = StepCosts()
    costs.expect(verify={0: 0.0052, 1: 0.0065, 2: 0.0079, 3: 0.0093, 4: 0.0107})
    one_token = {"suffix": ([5, 6], match_track("suffix", 1))}
    auto = priced_auto({0: 1.0}, 1.0, {"suffix@1": 0.22, "suffix@2": 0.75, "model": 0.05, "staged": 0.05})
    auto.verify = costs
    for _ in range(adaptive.TRUSTED_PLAIN_STEPS):
        assert costs.verify_cost(0) == pytest.approx(0.0051)  # one draft less a row: the bound
        assert auto._choose([1, 2, 3], 4, one_token) == (None, 0)
        costs.observe(0, 0.0, 0.0060)
    assert costs.verify_cost(0) == pytest.approx(0.0060)
    assert auto._choose([1, 2, 3], 4, one_token) == ("suffix", 1)  # 1.22 tokens in 6.5 ms against 1 in 6.0
    for _ in range(5):
        costs.observe(0, 0.0, 0.0200)  # plain steps slower than a verify of one draft: a disturbed spell
    assert costs.plain > 0.011 and costs.verify_cost(0) == pytest.approx(costs.verify_cost(1)) == pytest.approx(0.0065)


def test_plain_steps_that_stay_above_the_lines_bound_raise_the_line_so_drafting_resumes():
    """The float32 target on a Zen 3 host, after a long prompt: drafting steps had put a verify row at
    9.2 ms and a verify of one draft at 15.2 (the line is learned from drafting steps alone), so the
    bound of a plain step, one draft less a row, held plain steps of 19 ms at 7.5 (half start-up's
    cheapest). No match could pay against that, no step drafted again, and nothing corrected the
    line. Sixteen plain steps in a row above the bound raise the line to meet them."""
    costs = StepCosts()
    costs.expect(verify={0: 0.0150, 1: 0.0193, 2: 0.0236, 3: 0.0280, 4: 0.0323})
    for k in [4, 1] * 6:  # a long prompt's drafting steps: 9.2 ms a row
        costs.observe(k, 0.0, 0.0060 + 0.0092 * k)
    assert costs.verify_cost(1) == pytest.approx(0.0152, abs=0.0005)
    costs.observe(0, 0.0, 0.019)
    assert costs.verify_cost(0) == pytest.approx(0.0075)  # the bound: one plain step does not move the line
    for _ in range(adaptive.STALE_PLAIN_STEPS):
        costs.observe(0, 0.0, 0.019)
    assert costs.verify_cost(0) == pytest.approx(0.019, rel=0.02)
    assert costs.verify_cost(1) - costs.verify_cost(0) == pytest.approx(0.0092, rel=0.02)  # a row more
    assert expected_tokens(0.85, 4) / costs.verify_cost(4) > 1 / costs.verify_cost(0)  # a long match pays again


def test_start_up_times_every_k_after_a_chat_turns_context():
    """Each verify row attends to every cached token: timed from an empty cache a row cost half what
    it does in a chat turn, and the first request drafted at that price. The context is read once,
    in chunks, every k timed after it in rounds, and the cache left empty."""
    target = auto_engine().target
    calls, extend = [], target.extend
    target.extend = lambda token_ids, num_logits=1: (
        calls.append((target.cache.length, len(token_ids), num_logits)) or extend(token_ids, num_logits)
    )
    line = verify_seconds(target, 3, rounds=2)
    context = min(VERIFY_CONTEXT, target.max_len - 4)
    assert context > 100 and len(line) == 4 and all(seconds > 0 for seconds in line) and target.cache.length == 0
    chunks = -(-context // CONTEXT_CHUNK)  # read once, a chunk at a time (the blocks' own kernels: no tiles)
    assert calls[:chunks] == [
        (start, min(CONTEXT_CHUNK, context - start), 0) for start in range(0, context, CONTEXT_CHUNK)
    ]
    assert calls[chunks:] == [(context, k + 1, k + 1) for k in range(4)] * 2  # every k over it, all rows scored


def test_a_server_that_drafts_nothing_times_a_plain_step_alone():
    """With k = 0 start-up times one plain step and no line over drafting steps: the line's fit of no
    readings raised at start-up once the plain step was priced apart."""
    engine = tiny_engine(tiny_llama(seed=1, vocab_size=96), None, num_draft_tokens=0, drafter="auto")
    warm_up(engine)
    costs = engine.drafter("auto").verify
    assert list(costs.verify) == [0] and costs.verify_cost(0) == costs.verify[0] > 0


def test_live_verify_timings_move_the_start_up_line_as_a_whole():
    """A drafting step at one k shifts every drafting k's cost: a k seldom chosen is priced from what
    the others measure, and one slow reading at a k cannot keep that k from being tried again."""
    costs = StepCosts()
    costs.expect(verify={0: 0.060, 1: 0.062, 2: 0.064, 3: 0.066, 4: 0.068})
    costs.observe(2, 0.0, 0.074)  # this host runs 10 ms slower than start-up timed
    assert [round(costs.verify_cost(k), 4) for k in range(5)] == [0.060, 0.072, 0.074, 0.076, 0.078]
    costs.observe(4, 0.0, 0.300)  # one outlier (a busy host) moves all k alike, by a tenth of its excess
    assert costs.verify_cost(4) - costs.verify_cost(3) == pytest.approx(0.002)
    assert costs.verify_cost(4) < 0.11
    plain = StepCosts()  # without a start-up line: an average per k
    plain.observe(0, 0.0, 0.05)
    plain.observe(3, 0.3, 0.07)
    assert (plain.verify_cost(0), plain.verify_cost(3), plain.verify_cost(4)) == (0.05, 0.07, 0.07)


def test_a_plain_step_is_priced_apart_from_the_line_over_drafting_steps():
    """The first drafted row costs more than each one after it (the int8 target: 6.1 ms plain, 7.8
    with one draft, then about 1 ms a row). One line through every k priced a plain step high and one
    draft low, so a one-token match was taken where it could not pay. Plain steps price k = 0 alone;
    drafting steps, the line."""
    costs = StepCosts()
    costs.expect(verify={0: 0.0063, 1: 0.0078, 2: 0.0087, 3: 0.0097, 4: 0.0103})  # start-up: the line over k >= 1

    def true_cost(k: int) -> float:
        return 0.0061 if k == 0 else 0.0078 + 0.001 * (k - 1)

    assert costs.verify_cost(0) == 0.0063  # start-up's own reading until a plain step is seen
    for k in [0, 4, 0, 2, 0, 0, 4, 1, 0, 4, 3, 0, 0, 4, 2, 0, 1, 4, 0, 0]:
        costs.observe(k, 0.0, true_cost(k))
    assert all(abs(costs.verify_cost(k) - true_cost(k)) < 0.0002 for k in range(5))
    assert costs.verify_cost(1) / costs.verify_cost(0) == pytest.approx(0.0078 / 0.0061, rel=0.03)


def test_live_steps_replace_the_start_up_lines_slope_with_the_one_they_show():
    """Start-up times a verify on a context of a few tokens; over a long one each row costs more.
    Consecutive drafting steps of different k show the slope (their median, so one slow reading does
    not tilt it), and the shift keeps the price at the k it was learned at."""
    costs = StepCosts()
    costs.expect(verify={k: 0.018 + 0.001 * k for k in range(5)})  # start-up: 1 ms a row

    def true_cost(k: int) -> float:  # a long context: 6 ms more a step, 2 ms a row
        return 0.024 + 0.002 * k

    steps = [4, 2, 4, 0, 3, 4, 1, 4, 2, 4, 0, 4]
    for k in steps[:3]:
        costs.observe(k, 0.0, true_cost(k))
    assert costs.verify_cost(1) - true_cost(1) > 0.002  # the start-up slope: one draft priced high
    for k in steps[3:]:
        costs.observe(k, 0.0, true_cost(k))
    assert costs.verify_cost(4) - costs.verify_cost(3) == pytest.approx(0.002)
    assert all(abs(costs.verify_cost(k) - true_cost(k)) < 0.001 for k in range(5))
    costs.observe(1, 0.0, 0.300)  # one outlier (a busy host): two slope readings of many
    assert costs.verify_cost(4) - costs.verify_cost(3) == pytest.approx(0.002)


def long_then_short(costs: StepCosts) -> None:
    """Requests of short and of long contexts in turn, each step at its true cost (``true_cost``), the
    last request a long one."""
    costs.expect(verify={0: 0.0045, 1: 0.0055, 2: 0.0063, 3: 0.0071, 4: 0.0079}, context=256)
    steps = [0, 4, 0, 2, 1, 4, 0, 3, 0, 4, 2, 0, 1, 4, 0, 0, 4, 3, 0, 2]
    for start in (150, 1500, 300, 1200, 200, 1560):
        for index, k in enumerate(steps):
            costs.at(start + 3 * index)
            costs.observe(k, 0.0, true_cost(k, start + 3 * index))


def true_cost(k: int, context: int) -> float:
    """As the int8 target's verifies grew on a Zen 3 host between 256 and 1,560 cached tokens: 2.4 us a
    token a step, whatever its rows (reading the cached keys and values), and 0.65 us more a drafted row."""
    return (0.0045 if k == 0 else 0.0047 + 0.0008 * k) + (2.4e-6 + 0.65e-6 * k) * (context - 256)


def test_verify_prices_follow_the_steps_context(monkeypatch):
    """On a host whose caches do not hold a long context, a four-draft verify cost 26 ms after 1,560
    tokens where it cost 12 after 150 (a Zen 3 EPYC, int8). One shift for every context, learned over
    a long prompt, then priced one draft at 20 ms in the short requests after it, where it costs 7.5,
    and they seldom drafted. A slope by context, learned as the steps' contexts spread, prices each
    step at its own context, short after long and long after short. Most of a step's growth is shared
    by its rows: slopes of every row alike priced one draft 1.3 ms high in the short request after a
    long one, and read a row at 0.3 ms where it costs 0.8."""
    costs = StepCosts()
    long_then_short(costs)
    for context in (200, 1600):
        costs.at(context)
        assert all(abs(costs.verify_cost(k) - true_cost(k, context)) < 0.0006 for k in range(5)), context
    monkeypatch.setattr(adaptive, "MIN_CONTEXT_SPREAD", math.inf)  # the control: one shift for every context
    one_shift = StepCosts()
    long_then_short(one_shift)
    one_shift.at(200)
    assert one_shift.verify_cost(1) - true_cost(1, 200) > 0.0025


def test_a_long_prompts_drafting_steps_before_its_plain_ones_leave_the_rows_slope_as_measured():
    """Over a long prompt that repeats its context, the first steps draft: the plain steps' slope is
    still 0 until plain steps at that context come. Learned then, each verify's growth was taken for
    its rows' (2.1-2.4 us a token a row where 0.65 was measured), and a faded sum kept it: four drafts
    were priced 3.3 ms high at 1,600 tokens. The rows' slope is fitted to each verify less a plain
    step's growth at the plain steps' slope as it is when asked. What is left (1.1 ms at four drafts)
    comes from the line's row, read between those first steps while the slopes were still wrong."""
    costs = StepCosts()
    costs.expect(verify={0: 0.0045, 1: 0.0055, 2: 0.0063, 3: 0.0071, 4: 0.0079}, context=256)
    requests = [(160, [0, 1, 0, 2, 0, 0, 1, 0] * 3), (1500, [4, 3, 4, 2, 4, 1, 4, 4] * 3 + [0, 4, 0, 0, 2, 0] * 3)]
    for start, steps in requests + [(200, [0, 1, 0, 2, 0, 4, 0, 1] * 3)]:
        for index, k in enumerate(steps):
            costs.at(start + 3 * index)
            costs.observe(k, 0.0, true_cost(k, start + 3 * index))
    costs.at(1600)
    assert all(abs(costs.verify_cost(k) - true_cost(k, 1600)) < 0.0015 for k in range(5))


def test_a_plain_step_after_a_long_prompt_keeps_its_slope_among_many_short_ones():
    """Served, where a long prompt repeats its context, its steps draft and few are plain: one plain
    step at 1,500 tokens among a hundred after short prompts. Their contexts' variance fell under 128
    tokens' spread, the plain steps' slope went to 0, and the drafted rows took a plain step's growth
    for theirs: at the next long prompt a plain step was priced 3.3 ms low and one draft 2.4 ms too far
    above it, and auto cut its offers to two drafts where suffix drafted four (docs/drafters.md). The
    spread is a sum of squares, which more steps at one context do not shrink."""
    costs = StepCosts()
    costs.expect(verify={0: 0.0045, 1: 0.0055, 2: 0.0063, 3: 0.0071, 4: 0.0079}, context=256)
    short = [0, 1, 0, 2, 0, 0, 1, 0] * 3
    requests = [(160, short), (1500, [4, 3, 4, 2, 4, 4] * 4 + [0] + [4, 4, 4])] + [(150, [0] * 30)] * 4
    for start, steps in requests + [(1500, [4, 4])]:
        for index, k in enumerate(steps):
            costs.at(start + 3 * index)
            costs.observe(k, 0.0, true_cost(k, start + 3 * index))
    costs.at(1600)
    assert abs(costs.verify_cost(0) - true_cost(0, 1600)) < 0.0003
    # what is left comes from the first long prompt's drafting steps, read before any plain one there
    assert all(abs(costs.verify_cost(k) - true_cost(k, 1600)) < 0.0016 for k in range(1, 5))


def test_a_requests_first_verify_which_reads_the_prompt_is_not_timed():
    engine = auto_engine()
    warm_up(engine)
    auto = engine.drafter("auto")
    line = dict(auto.verify.verify)
    list(engine.generate(Request("long", list(range(1, 90)), SamplingParams(max_tokens=2, temperature=0.0))))
    assert auto.verify.shift is None and auto.verify.verify == line


def test_a_verify_after_a_step_that_made_several_tokens_does_not_move_the_prices(monkeypatch):
    """Served, such a verify also waits on the events of the tokens before it, whatever its k: taken
    as its rows' cost, it priced a row at three times what it was (docs/drafters.md#on-a-zen-4-host)."""
    engine = auto_engine()
    warm_up(engine)
    auto = engine.drafter("auto")
    observed, verify = [], auto.verify
    seen = lambda costs, k, draft, seconds: costs is verify and observed.append(k)  # noqa: E731
    monkeypatch.setattr(StepCosts, "observe", seen)
    tokens = list(range(1, 40))
    auto.begin(tokens)
    sampler = RequestSampler(SamplingParams(max_tokens=16, temperature=0.0), 96, torch.device("cpu"), tokens, 0)
    timed = []
    for made in (1, 1, 3, 1, 1):  # the tokens each step commits
        before = len(observed)
        auto.propose(tokens, 4, sampler)
        auto.accept(len(tokens) + made - 1)
        tokens = tokens + [7] * made
        timed.append(len(observed) > before)
    # the first reads the prompt; the fourth comes after the third's three tokens
    assert timed == [False, True, True, False, True]


def test_acceptance_pools_the_steps_of_a_request():
    """One early rejection does not read as acceptance 0: 3 of 4, then 4 of 4, is close to 7 of 8."""
    auto = auto_engine().drafter("auto")
    auto.begin([1, 2, 3])
    auto._observe("model", 0, 4)
    after_one_miss = auto._request.alpha["model"]
    assert 0.2 < after_one_miss < 0.7  # the prior (0.7 over 2 tokens) and one rejection
    for accepted in (3, 4, 4, 4):
        auto._observe("model", accepted, 4)
    assert auto._request.alpha["model"] > 0.8


def test_a_start_up_draft_cost_taken_on_a_busy_host_is_replaced_by_the_next_probe():
    """A draft on the target's keys and values reads one token whatever ran before, so its probes
    time it: a start-up timing that came out far too high (a host busy while the server warmed
    up) must not keep the draft model out for the rest of the server's life."""
    target = tiny_llama(seed=3, vocab_size=96, init=0.2)
    engine = tiny_engine(target, perturbed_copy(target, 0.05, seed=1), drafter="auto", draft_kv="target")
    warm_up(engine)
    auto = engine.drafter("auto")
    measured = auto.draft_costs["model"].draft
    auto.draft_costs["model"].draft = 1000 * measured  # as if start-up had timed it under heavy load
    outputs = list(engine.generate(Request("r", [1, 2, 3, 4], SamplingParams(max_tokens=48, temperature=0.0))))
    assert outputs[-1].stats.to_dict()["steps_by_drafter"].get("model", 0) >= 1  # a probe ran
    assert auto.draft_costs["model"].draft < 100 * measured  # and its timing replaced the start-up one


def test_a_draft_model_whose_live_step_cannot_pay_here_is_seldom_probed():
    """Timed live at ten target steps a drafted token, the draft cannot beat plain decoding even if
    every draft passed: it is probed RARELY times less often (a timing from start-up still gets
    its probe, the test above). Without the rule it is probed every few steps."""
    target = tiny_llama(seed=3, vocab_size=96, init=0.2)
    engine = tiny_engine(target, perturbed_copy(target, 0.05, seed=1), drafter="auto", draft_kv="target")
    warm_up(engine)
    auto = engine.drafter("auto")
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for name in ("model", "staged"):  # as if live steps had timed them so
        costs = auto.draft_costs[name]
        costs.draft, costs.provisional_draft = 10 * auto.verify.verify_cost(0), False
    outputs = list(engine.generate(Request("r", [1, 2, 3, 4], params, drafter="auto")))
    steps = outputs[-1].stats.to_dict()["steps_by_drafter"]
    assert steps.get("model", 0) + steps.get("staged", 0) == 0, steps  # without the rule: a probe every ~9 steps


def test_a_scopes_finished_requests_move_its_own_priors_and_no_other_scopes():
    engine = auto_engine()
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for i in range(3):  # scope a's requests, each moving a's priors as it finishes
        list(engine.generate(Request(f"a{i}", [5, 6, 7, 5, 6, 7, 5], params, tenant="a")))
    auto = engine.drafter("auto")
    auto.begin([1, 2], "b")
    assert auto._request.priors == auto.priors  # b starts from start-up's priors
    auto.begin([1, 2], "a")
    assert auto._request.priors != auto.priors  # a starts from what its own requests measured
