"""Prompt lookup: propose what followed the latest earlier occurrence of the current suffix.

No model at all. Proposals are deterministic, so the verifier treats q as one-hot (``probs=None``)
and the output stays exactly the target's.
"""

from __future__ import annotations

import torch

from ..model.model import upload
from ..sampling import RequestSampler
from .base import Drafter, DraftResources, Proposal
from .registry import register


class NgramDrafter(Drafter):
    name = "ngram"
    per_sequence = ("_index", "_indexed")

    def __init__(self, min_n: int, max_n: int, device: torch.device) -> None:
        self.sizes = range(max_n, min_n - 1, -1)  # longest match first
        self.device = device
        self._index: dict[int, dict[tuple[int, ...], int]] = {}  # n -> n-gram -> index after its latest occurrence
        self._indexed = 0  # n-grams ending before this position are in the index

    def begin(self, prompt_ids: list[int], tenant: str = "") -> None:
        self._index = {n: {} for n in self.sizes}
        self._indexed = 0

    def propose(self, token_ids: list[int], num_draft_tokens: int, sampler: RequestSampler) -> Proposal:
        self._extend_index(token_ids)
        for n in self.sizes:
            if len(token_ids) <= n:
                continue
            follows = self._index[n].get(tuple(token_ids[-n:]))
            if follows is not None:
                continuation = token_ids[follows : follows + num_draft_tokens]
                return Proposal(upload(continuation, self.device), None)
        return Proposal.empty(self.device)

    def accept(self, num_committed: int) -> None:
        """Nothing to roll back: the index only holds committed tokens."""

    def _extend_index(self, token_ids: list[int]) -> None:
        # Index every n-gram that ends before the last token, so a lookup of the current suffix
        # finds an earlier occurrence that has at least one token after it.
        for end in range(max(self._indexed, 1), len(token_ids)):
            for n in self.sizes:
                if end >= n:
                    self._index[n][tuple(token_ids[end - n : end])] = end
        self._indexed = max(self._indexed, len(token_ids))


@register("ngram", NgramDrafter)
def _build(resources: DraftResources) -> NgramDrafter:
    low, high = resources.config.ngram_sizes
    return NgramDrafter(low, high, resources.target.device)
