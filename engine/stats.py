"""Per-step records and per-request speculative counters.

Every counter describes the tokens the client received: a step cut short by end-of-sequence,
``max_tokens`` or a stop string counts only the tokens it kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What one speculative step did, for metrics and usage."""

    num_drafted: int  # draft tokens sent to the target for verification
    num_accepted: int  # accepted draft tokens among those emitted
    draft_seconds: float
    verify_seconds: float
    num_emitted: int = 0  # tokens the step delivered: accepted drafts plus the resampled or bonus token
    drafter: str = "none"  # who drafted this step (auto picks one per step); "none" when nothing was drafted

    def truncated(self, kept: int) -> StepRecord:
        """The same step when only its first ``kept`` tokens reach the client."""
        kept = min(kept, self.num_emitted)
        return replace(self, num_accepted=min(self.num_accepted, kept), num_emitted=kept)


@dataclass(slots=True)
class SpecStats:
    drafter: str | None = None  # the drafting strategy; None (reported as "none") for the target alone
    drafted_tokens: int = 0  # draft tokens sent to the target for verification
    accepted_tokens: int = 0  # draft tokens the target kept (and the client received)
    target_forwards: int = 0  # verify passes (one per speculative step)
    emitted_tokens: int = 0  # tokens delivered: accepted drafts plus one resampled or bonus token per step
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: steps that kept draft position i
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    steps_by_drafter: dict[str, int] = field(default_factory=dict)  # who drafted each step ("none": nobody)

    def record(self, step: StepRecord) -> None:
        self._count(step, 1)

    def retract(self, step: StepRecord) -> None:
        """Undo ``record(step)``: the step turned out to deliver fewer tokens."""
        self._count(step, -1)

    def _count(self, step: StepRecord, sign: int) -> None:
        self.drafted_tokens += sign * step.num_drafted
        self.accepted_tokens += sign * step.num_accepted
        self.target_forwards += sign
        self.emitted_tokens += sign * step.num_emitted
        self.draft_seconds += sign * step.draft_seconds
        self.verify_seconds += sign * step.verify_seconds
        if len(self.accepted_per_position) < step.num_accepted:
            self.accepted_per_position.extend([0] * (step.num_accepted - len(self.accepted_per_position)))
        for position in range(step.num_accepted):
            self.accepted_per_position[position] += sign
        self.steps_by_drafter[step.drafter] = self.steps_by_drafter.get(step.drafter, 0) + sign

    def copy(self) -> SpecStats:
        """A snapshot that later steps do not change."""
        return replace(
            self, accepted_per_position=list(self.accepted_per_position), steps_by_drafter=dict(self.steps_by_drafter)
        )

    def add(self, other: SpecStats) -> None:
        """Fold another request's counters in (for usage over several choices)."""
        self.drafter = self.drafter or other.drafter
        for position, count in enumerate(other.accepted_per_position):
            if position == len(self.accepted_per_position):
                self.accepted_per_position.append(0)
            self.accepted_per_position[position] += count
        for name, steps in other.steps_by_drafter.items():
            self.steps_by_drafter[name] = self.steps_by_drafter.get(name, 0) + steps
        self.drafted_tokens += other.drafted_tokens
        self.accepted_tokens += other.accepted_tokens
        self.target_forwards += other.target_forwards
        self.emitted_tokens += other.emitted_tokens
        self.draft_seconds += other.draft_seconds
        self.verify_seconds += other.verify_seconds

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted over drafted tokens; None when nothing was drafted (there is no rate to report)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None

    @property
    def mean_tokens_per_forward(self) -> float:
        return self.emitted_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def mean_num_draft_tokens(self) -> float:
        return self.drafted_tokens / self.target_forwards if self.target_forwards else 0.0

    def to_dict(self) -> dict:
        return {
            "drafter": self.drafter or "none",
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": None if self.acceptance_rate is None else round(self.acceptance_rate, 4),
            "target_forwards": self.target_forwards,
            "mean_tokens_per_forward": round(self.mean_tokens_per_forward, 4),
            "mean_num_draft_tokens": round(self.mean_num_draft_tokens, 4),
            "accepted_per_position": list(self.accepted_per_position),
            "draft_seconds": round(self.draft_seconds, 6),
            "verify_seconds": round(self.verify_seconds, 6),
            "steps_by_drafter": {name: steps for name, steps in self.steps_by_drafter.items() if steps},
        }


@dataclass(slots=True)
class DrafterSpeeds:
    """Decode speed by the drafter requests asked for, measured on this server since it started:
    tokens delivered over the draft and verify time of their steps. Shows which drafters pay here."""

    tokens: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    min_tokens: int = 32  # below this a figure is noise

    def add(self, drafter: str, step: StepRecord) -> None:
        self.tokens[drafter] = self.tokens.get(drafter, 0) + step.num_emitted
        self.seconds[drafter] = self.seconds.get(drafter, 0.0) + step.draft_seconds + step.verify_seconds

    def tokens_per_second(self) -> dict[str, float]:
        return {
            name: round(tokens / self.seconds[name], 1)
            for name, tokens in list(self.tokens.items())
            if tokens >= self.min_tokens and self.seconds.get(name)
        }
