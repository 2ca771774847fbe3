"""What ``auto`` (engine/drafters/auto.py) keeps per request and per step: its acceptance evidence
and what each step chose, so the choice after it can be priced and learned from."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    # per text-match track: (drafts its steps got accepted, drafts the geometric estimate expected to
    # pass), faded: the ratio corrects the estimate
    yields: dict[str, tuple[float, float]] = field(default_factory=dict)
    last_tried: dict[str, int] = field(default_factory=dict)  # step number each candidate and track last ran
    # (tokens, seconds) text matching or plain decoding made of the last few steps: a draft step must beat it
    text_pace: tuple[float, float] = (0.0, 0.0)
    step: int = 0
