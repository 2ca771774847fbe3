"""What ``auto`` (engine/drafters/auto.py) keeps per request and per step: its acceptance evidence
and what each step chose, so the choice after it can be priced and learned from."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from math import exp, log

from ..adaptive import ALPHA_PRIOR
from ..sampling import SamplingParams

PRIOR_TOKENS = 2.0  # a request's prior counts as this many proposed tokens of evidence
# a draft model's prior (its agreement measured at start-up, or a head's recorded beside it) counts as
# more: its acceptance moves less along a request than a text match's, which holds or breaks with the text
MODEL_PRIOR_TOKENS = 8.0
EVIDENCE_DECAY = 0.9  # each step of a candidate fades its earlier evidence (a request's text changes)
LEFT_PRIOR_STEPS = 2.0  # a request starts as if text matching had left two steps to others
PACE_DECAY = 0.5  # each step fades text matching's earlier pace: a burst of matches is soon forgotten
# A text match's acceptance before any request ran, by the length of the match its proposal
# continues (suffix on bench/prompts.yaml: 0.1-0.4 after a one-token match, 0.8-1.0 after two
# tokens or more, in chat as in code; a one-token match whose continuation was split is apart, below,
# and the rest pass 0.21-0.47, so 0.35). A draft model's is ALPHA_PRIOR until start-up measures it.
MATCH_PRIORS = {1: 0.35, 2: 0.75, 4: 0.85, 8: 0.85}
# A damped request's text match passes as the target draws the token it continues with (sampled
# hot), or in spite of a penalty on the repeat it drafts: its own tracks (``suffix@2~``), from lower
# priors. First drafts that passed on chat and prose / code and summaries after a match of one token
# (bench/studies/match_acceptance.py): 0.10-0.12 / 0.27-0.33 from temperature 0 to 0.5, 0.06-0.11 /
# 0.20-0.24 at 0.8 and 1, 0.07-0.16 / 0.08-0.17 under a repetition penalty of 1.1 (greedy to 0.8);
# after two to three: 0.34-0.50 / 0.79-0.87, then 0.13-0.19 / 0.50-0.62, and 0 of 25 / 0.33-0.40.
HOT_TEMPERATURE = 0.7
DAMPED_MATCH_PRIORS = {1: 0.15, 2: 0.4, 4: 0.75, 8: 0.85}
DAMPED = "~"  # what ends a damped request's track
# A short match whose first draft was one of several tokens seen after it (not the only one) passes
# far less often than one whose continuation was always the same: its own tracks (``suffix@1?``).
# First drafts that passed after a one-token match on chat and prose / code and summaries
# (bench/studies/match_acceptance.py): greedy 0.21 / 0.47 where the continuation had always been the
# same, 0.02 / 0.09 where it had not; at 0.8, 0.15 / 0.31 against 0.02 / 0.14. Split matches of two
# or three tokens are few (3 of 26 greedy) (docs/drafters.md#a-split-continuation).
SPLIT_MATCH_PRIORS = {1: 0.1, 2: 0.3}
DAMPED_SPLIT_MATCH_PRIORS = {1: 0.05, 2: 0.15}
SPLIT = "?"  # what marks a split continuation's track, before DAMPED
# A model candidate's drafts (a draft model's, a head's) in a damped request pass less often than a greedy
# one's: on a track of its own (``eagle3~``), from its prior times this. The shipped head's one-draft steps
# on the bench's chat and prose / code and summaries (bench/studies/match_acceptance.py --head): greedy
# 0.335 / 0.323 passed, at 0.8 0.256 / 0.266, at 1.0 0.167 / 0.205, greedy under a repetition penalty of
# 1.1 and top_p 0.9 0.249 / 0.279 (docs/drafters.md#a-damped-head).
DAMPED_MODEL_FACTOR = 0.75
SHIFT_SPREAD = 1.5  # the spread (sd, in log-odds) of requests' text shifts about their priors
SHIFT_ITERATIONS = 2  # Newton steps per refit, from the last shift


def damps_repeats(params: SamplingParams) -> bool:
    """Whether a request's text matches pass less often than a greedy one's: sampled at
    HOT_TEMPERATURE or above, or penalising repeats (a text match drafts a repeat)."""
    return params.temperature >= HOT_TEMPERATURE or params.uses_history


@cache  # asked several times a step, of a handful of names and lengths
def match_track(name: str, match_length: int, damped: bool = False, split: bool = False) -> str:
    """suffix@4: a match of 4 to 7 tokens; suffix@1?: of one, whose first draft was one of several
    continuations seen (split, for the lengths SPLIT_MATCH_PRIORS names)."""
    bucket = max(bucket for bucket in MATCH_PRIORS if bucket <= max(match_length, 1))
    return f"{name}@{bucket}{SPLIT if split and bucket in SPLIT_MATCH_PRIORS else ''}{DAMPED if damped else ''}"


def match_priors(names: list[str]) -> dict[str, float]:
    """The text matchers' tracks' priors, damped and not, split and not."""
    tables = ((False, False, MATCH_PRIORS), (True, False, DAMPED_MATCH_PRIORS))
    tables += ((False, True, SPLIT_MATCH_PRIORS), (True, True, DAMPED_SPLIT_MATCH_PRIORS))
    return {
        match_track(name, length, damped, split): prior
        for name in names
        for damped, split, priors in tables
        for length, prior in priors.items()
    }


def model_track(name: str, damped: bool) -> str:
    """eagle3~: the model candidate's track in a damped request."""
    return f"{name}{DAMPED}" if damped else name


def with_damped_tracks(priors: dict[str, float]) -> dict[str, float]:
    """Model candidates' priors by name, with their damped tracks' beside them (DAMPED_MODEL_FACTOR)."""
    return priors | {model_track(name, True): DAMPED_MODEL_FACTOR * prior for name, prior in priors.items()}


@cache
def continued(track: str, count: int) -> tuple[str, ...]:
    """The tracks a text match's drafts 1..count are accepted on: draft i continues the match i - 1
    tokens further (suffix@1's drafts: suffix@1, suffix@2, suffix@2, suffix@4; suffix@1?'s: suffix@1?,
    suffix@2, ...: once its first draft passed, the match is a longer one like any other)."""
    name, length = track.rsplit("@", 1)
    damped = length.endswith(DAMPED)
    start = int(length.rstrip(DAMPED).rstrip(SPLIT))
    return (track, *(match_track(name, start + index, damped) for index in range(1, count)))[:count]


@dataclass(slots=True)
class StepChoice:
    name: str | None  # None: no drafting this step
    num_draft_tokens: int
    sequence_length: int  # committed tokens when the proposal was made
    # the candidate also ran the step before, so its time is one step's drafting; after a gap it
    # first catches up on everything since (the whole prompt, for a draft model's first step)
    steady: bool = False
    lag: int = 0  # tokens the candidate read before proposing
    track: str | None = None  # whose acceptance the step informs: the name, or a text match's length bucket
    drafted: int = 0  # tokens actually proposed
    draft_seconds: float = 0.0
    proposed_at: float = 0.0


@dataclass(slots=True)
class RequestState:
    alpha: dict[str, float] = field(default_factory=dict)  # each track's acceptance estimate now
    priors: dict[str, float] = field(default_factory=dict)  # what it started from: its scope's priors
    tenant: str = ""  # its scope, whose priors its acceptance moves once
    folded: bool = False  # whether it has moved them
    # per track: (accepted tokens, rejections) seen this request, older steps faded
    evidence: dict[str, tuple[float, float]] = field(default_factory=dict)
    last_tried: dict[str, int] = field(default_factory=dict)  # step number each candidate and track last ran
    # (tokens, seconds) text matching or plain decoding made of the last few steps: a draft step must beat it
    text_pace: tuple[float, float] = (0.0, 0.0)
    # text offers steps did not take, (position, drafts, track, drafts taken): the tokens committed from
    # there say how many of its drafts would have passed (``score_declined``)
    declined: list[tuple[int, tuple[int, ...], str, int]] = field(default_factory=list)
    # (steps a text match took, steps), older ones faded, from LEFT_PRIOR_STEPS it did not take: a
    # draft model that catches up drafts only on the steps text matching leaves to others, so its
    # catch-up is paid back over those
    text_taken: tuple[float, float] = field(default_factory=lambda: (0.0, LEFT_PRIOR_STEPS))
    step: int = 0
    last_made: int = 1  # tokens the last step made (served, the next step's verify waits on their events)
    damped: bool = False  # sampled hot or penalising repeats: its text matches' and models' tracks are their own
    # log-odds by which this request's text matches pass more (or less) often than their priors say,
    # whatever their length: one shift, fitted to every text track's evidence (``_fit_shift``)
    shift: float = 0.0
    # by kind (damped or not): its text tracks and their priors' log-odds, taken once (``_fit_shift``)
    text_logits: dict[bool, tuple[list[str], list[float]]] = field(default_factory=dict)

    def keep_pace(self, tokens: float, seconds: float) -> None:
        """This step's best of text matching and a plain step, into the pace a draft step must beat."""
        paced_tokens, paced_seconds = self.text_pace
        self.text_pace = (PACE_DECAY * paced_tokens + tokens, PACE_DECAY * paced_seconds + seconds)

    def note_step(self, by_text: bool) -> None:
        taken, steps = self.text_taken
        self.text_taken = (EVIDENCE_DECAY * taken + by_text, EVIDENCE_DECAY * steps + 1)

    @property
    def left_by_text(self) -> float:
        """The faded share of this request's steps text matching did not take (1 before any)."""
        taken, steps = self.text_taken
        return 1.0 - taken / steps

    def score_declined(self, token_ids: list[int]) -> None:
        """Score the text offers earlier steps declined, each once the committed tokens have passed
        it, by how many of its drafts they match: how many would have passed. (A deterministic draft
        passes with the target's probability of it, which is the chance the step commits it, and the
        next, once it did, with the next token's: greedy, exactly when they are the tokens.) Evidence
        as good as a drafted step's, for free, so a track learned low elsewhere recovers where this
        text repeats; and learned from every offer, where drafted steps alone, taken when the estimate
        ran high, fell short of it (regression to the mean) and priced weak matches low. One taken in
        part is scored past the ``taken`` drafts where they passed: else a match cut short stays so."""
        pending = []
        for position, drafts, track, taken in self.declined:
            seen = token_ids[position : position + len(drafts)]
            matched = next((i for i, token in enumerate(seen) if token != drafts[i]), len(seen))
            if matched == len(seen) < len(drafts):  # the text has not passed it yet
                pending.append((position, drafts, track, taken))
            elif matched >= taken:  # (a part taken and rejected says nothing of what followed it)
                self.pool(continued(track, len(drafts))[taken:], matched - taken)
                self.last_tried[track] = self.step
        self.declined = pending

    def pool(self, tracks: Sequence[str], accepted: int, prior_tokens: float = PRIOR_TOKENS) -> None:
        """One step's drafts, each on the track it was accepted on: the first ``accepted`` passed,
        the next (if any) was rejected. Each track's acceptance is its faded successes over
        successes and rejections, its prior counting as ``prior_tokens`` tokens (maximum likelihood
        for a truncated geometric run); a text track's prior as the request's shift moves it."""
        seen: dict[str, tuple[int, int]] = {}
        for index, track in enumerate(tracks[: accepted + 1]):
            passed, failed = seen.get(track, (0, 0))
            seen[track] = (passed + (index < accepted), failed + (index == accepted))
        for track, (passed, failed) in seen.items():
            successes, rejections = self.evidence.get(track, (0.0, 0.0))
            successes, rejections = EVIDENCE_DECAY * successes + passed, EVIDENCE_DECAY * rejections + failed
            self.evidence[track] = (successes, rejections)
            if not is_text(track):
                prior = self.priors.get(track, ALPHA_PRIOR)
                self.alpha[track] = _estimate(successes, rejections, prior, prior_tokens)
        texts = [track for track in seen if is_text(track)]
        if texts:
            self._fit_shift(texts[0].endswith(DAMPED), prior_tokens)

    def _fit_shift(self, damped: bool, prior_tokens: float) -> None:
        """Refit the request's text shift to its text tracks' evidence (of its kind: damped or not),
        then each such track's acceptance from its own evidence and its prior moved by the shift."""
        if damped not in self.text_logits:  # a request's priors stay as it began
            tracks = [t for t in self.priors if is_text(t) and t.endswith(DAMPED) == damped]
            self.text_logits[damped] = (tracks, [_logit(self.priors[t]) for t in tracks])
        tracks, logits = self.text_logits[damped]
        counts = [self.evidence.get(t, (0.0, 0.0)) for t in tracks]
        self.shift = _fit(logits, counts, self.shift)
        shift = min(self.shift, 0.0)  # lowers priors, never raises them (docs/drafters.md)
        for track, logit, (successes, rejections) in zip(tracks, logits, counts, strict=True):
            self.alpha[track] = _estimate(successes, rejections, _sigmoid(logit + shift), prior_tokens)


def _fit(logits: list[float], counts: list[tuple[float, float]], shift: float) -> float:
    """The log-odds shift of these tracks' priors their evidence makes most likely, a priori about 0
    (spread SHIFT_SPREAD): Newton's method on the concave log-posterior, from ``shift``."""
    for _ in range(SHIFT_ITERATIONS):
        slope, curve = -shift / SHIFT_SPREAD**2, 1.0 / SHIFT_SPREAD**2
        for logit, (successes, rejections) in zip(logits, counts, strict=True):
            chance = _sigmoid(logit + shift)
            slope += successes - (successes + rejections) * chance
            curve += (successes + rejections) * chance * (1.0 - chance)
        shift += slope / curve
    return shift


def is_text(track: str) -> bool:
    return "@" in track


def _estimate(successes: float, rejections: float, prior: float, prior_tokens: float) -> float:
    return min(0.99, (successes + prior_tokens * prior) / (successes + rejections + prior_tokens))


def _logit(chance: float) -> float:
    chance = min(max(chance, 0.01), 0.99)
    return log(chance / (1.0 - chance))


def _sigmoid(value: float) -> float:
    return 1.0 / (1.0 + exp(-value))
