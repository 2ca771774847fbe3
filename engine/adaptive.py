"""Choosing how many tokens to draft, step by step, from measured costs and acceptance.

With per-token acceptance alpha, k drafts yield (1 - alpha^(k+1)) / (1 - alpha) tokens per step
(Leviathan et al., 2023) at a cost of k * c_draft + c_verify(k). The policy picks the k in
[0, limit] (what the request and cache allow) with the most expected tokens per second; k = 0 is plain decoding. The choice depends
only on past steps, never on the current step's draws, so the output distribution is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SMOOTHING = 0.1  # weight of the newest observation in the running averages
PROBE_EVERY = 16  # while plain decoding wins, still draft once in a while to keep alpha current


@dataclass(slots=True)
class AdaptiveK:
    alpha: float = 0.7  # running per-token acceptance
    draft_cost: float | None = None  # seconds per drafted token
    verify_cost: dict[int, float] = field(default_factory=dict)  # seconds per verify pass, by k
    steps_since_draft: int = 0

    def choose(self, limit: int) -> int:
        """The k to draft now, at most ``limit`` (what the request and cache still allow)."""
        if limit <= 0:
            return 0
        if self.draft_cost is None or 0 not in self.verify_cost:
            return 0 if 0 not in self.verify_cost else limit  # measure plain decoding, then drafting
        best = max(range(limit + 1), key=self._tokens_per_second)
        if best == 0 and self.steps_since_draft >= PROBE_EVERY:
            return 1
        return best

    def observe(self, k: int, num_accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        self.verify_cost[k] = _update(self.verify_cost.get(k), verify_seconds)
        if k == 0:
            self.steps_since_draft += 1
            return
        self.steps_since_draft = 0
        self.draft_cost = _update(self.draft_cost, draft_seconds / k)
        # accepted n of k: a truncated geometric sample; n / (n + 1 rejection) estimates alpha when n < k
        observed = num_accepted / k if num_accepted == k else num_accepted / (num_accepted + 1)
        self.alpha = min(0.99, _update(self.alpha, observed))

    def _tokens_per_second(self, k: int) -> float:
        alpha = self.alpha
        expected = (1 - alpha ** (k + 1)) / (1 - alpha)
        verify = self.verify_cost.get(k) or self._nearest_verify_cost(k)
        return expected / (k * (self.draft_cost or 0.0) + verify)

    def _nearest_verify_cost(self, k: int) -> float:
        nearest = min(self.verify_cost, key=lambda measured: abs(measured - k))
        return self.verify_cost[nearest]


def _update(average: float | None, value: float) -> float:
    return value if average is None else (1 - SMOOTHING) * average + SMOOTHING * value
