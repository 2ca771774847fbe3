"""Per-request speculative counters."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SpecStats:
    drafted_tokens: int = 0  # draft tokens sent to the target for verification
    accepted_tokens: int = 0  # draft tokens the target kept
    target_forwards: int = 0  # verify passes (one per speculative step)
    emitted_tokens: int = 0  # tokens produced: accepted drafts plus one resampled or bonus token per step

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.drafted_tokens += num_drafted
        self.accepted_tokens += num_accepted
        self.target_forwards += 1
        self.emitted_tokens += num_accepted + 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_tokens_per_forward(self) -> float:
        return self.emitted_tokens / self.target_forwards if self.target_forwards else 0.0

    def to_dict(self) -> dict[str, float | int]:
        return {
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "target_forwards": self.target_forwards,
            "mean_tokens_per_forward": round(self.mean_tokens_per_forward, 4),
        }
