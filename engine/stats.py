"""Per-request speculative counters."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecStats:
    drafter: str | None = None  # the drafting strategy, or None for the target alone
    drafted_tokens: int = 0  # draft tokens sent to the target for verification
    accepted_tokens: int = 0  # draft tokens the target kept
    target_forwards: int = 0  # verify passes (one per speculative step)
    emitted_tokens: int = 0  # tokens produced: accepted drafts plus one resampled or bonus token per step
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: steps that kept draft position i
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    def record(self, num_drafted: int, num_accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        self.drafted_tokens += num_drafted
        self.accepted_tokens += num_accepted
        self.target_forwards += 1
        self.emitted_tokens += num_accepted + 1
        self.draft_seconds += draft_seconds
        self.verify_seconds += verify_seconds
        if len(self.accepted_per_position) < num_accepted:
            self.accepted_per_position.extend([0] * (num_accepted - len(self.accepted_per_position)))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def add(self, other: SpecStats) -> None:
        """Fold another request's counters in (for usage over several choices)."""
        self.drafter = self.drafter or other.drafter
        for position, count in enumerate(other.accepted_per_position):
            if position == len(self.accepted_per_position):
                self.accepted_per_position.append(0)
            self.accepted_per_position[position] += count
        self.drafted_tokens += other.drafted_tokens
        self.accepted_tokens += other.accepted_tokens
        self.target_forwards += other.target_forwards
        self.emitted_tokens += other.emitted_tokens
        self.draft_seconds += other.draft_seconds
        self.verify_seconds += other.verify_seconds

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_tokens_per_forward(self) -> float:
        return self.emitted_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def mean_num_draft_tokens(self) -> float:
        return self.drafted_tokens / self.target_forwards if self.target_forwards else 0.0

    def to_dict(self) -> dict:
        return {
            "drafter": self.drafter,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "target_forwards": self.target_forwards,
            "mean_tokens_per_forward": round(self.mean_tokens_per_forward, 4),
            "mean_num_draft_tokens": round(self.mean_num_draft_tokens, 4),
            "accepted_per_position": list(self.accepted_per_position),
            "draft_seconds": round(self.draft_seconds, 6),
            "verify_seconds": round(self.verify_seconds, 6),
        }
