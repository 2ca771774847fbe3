"""Suffix decoding (Oliaro et al., 2024, arXiv 2411.04975): propose the most frequent continuation
of the longest context suffix seen before, in this request or in recent outputs.

Two indexes of token continuations: one over this request's prompt and output, and the engine's
``OutputCache`` of recent outputs, read under this request's scope only (API key, ``user`` and
``cache_salt``; see engine/outputs.py), so no client can probe for another's outputs through
acceptance counts. Each maps every n-gram (n up to ``max_match``) to the
tokens that followed it, with counts. A proposal walks forward greedily: at each step the longest
suffix of context-plus-draft found in an index picks the most frequent next token; the draft grows
while the estimated probability of the whole path stays above ``min_probability`` and its length
stays within ``match_factor`` times the match length (longer matches draft more), up to k.

Proposals are deterministic, so they are verified with a one-hot q, like ``ngram``.
"""

from __future__ import annotations

from operator import itemgetter

import torch

from ..model.model import upload
from ..outputs import MAX_MATCH, ContinuationIndex, OutputCache
from ..sampling import RequestSampler
from .base import Drafter, DraftResources, Proposal
from .registry import register

MATCH_FACTOR = 2.0  # a match of n tokens may draft up to 2n tokens
MIN_PROBABILITY = 0.1  # stop drafting once the path's estimated probability falls below this


class SuffixDrafter(Drafter):
    name = "suffix"
    per_sequence = ("_local", "_indexed", "_tenant", "match_length", "match_split")

    def __init__(self, device: torch.device, cache: OutputCache | None, max_match: int = MAX_MATCH) -> None:
        self.device = device
        self.cache = cache  # the engine's recent outputs (read only); None: none across requests
        self.max_match = max_match
        self._local = ContinuationIndex(max_match)
        self._indexed = 0  # continuations before this position are in the local index
        self._tenant = ""
        self.match_length = 0  # tokens the last proposal's first match spanned (0: none): how far to trust it

    def begin(self, prompt_ids: list[int], tenant: str = "") -> None:
        self._local = ContinuationIndex(self.max_match)
        self._indexed, self._tenant = 0, tenant

    def propose(self, token_ids: list[int], num_draft_tokens: int, sampler: RequestSampler) -> Proposal:
        drafted = self.offer(token_ids, num_draft_tokens)
        return Proposal(upload(drafted, self.device), None) if drafted else Proposal.empty(self.device)

    def offer(self, token_ids: list[int], limit: int) -> list[int]:
        """The proposal's tokens on the host (``auto`` asks every step, and uploads only what it takes)."""
        self._local.add(token_ids, start=self._indexed)
        self._indexed = len(token_ids)
        shared = self.cache.index(self._tenant) if self.cache is not None else None
        context, drafted, probability = list(token_ids[-self.max_match :]), [], 1.0
        self.match_length, self.match_split = 0, False
        while len(drafted) < limit:
            n, counts = self._best(context, shared)
            if counts is None:
                break
            token, count = max(counts.items(), key=itemgetter(1))  # the most frequent (the first seen, on a tie)
            seen = sum(counts.values())
            if not drafted:  # the first match sets how far this draft may reach
                self.match_length, limit = n, min(limit, max(1, int(MATCH_FACTOR * n)))
                self.match_split = count < seen
            probability *= count / seen
            if probability < MIN_PROBABILITY:
                break
            drafted.append(token)
            context = (context + [token])[-self.max_match :]
        return drafted

    def accept(self, num_committed: int) -> None:
        """Nothing to roll back: the indexes hold committed tokens only."""

    def _best(self, context: list[int], shared: ContinuationIndex | None) -> tuple[int, dict[int, int] | None]:
        """The longer match of the two indexes; on a tie, their counts together."""
        n_local, local = self._local.longest_match(context)
        n_shared, other = shared.longest_match(context) if shared is not None else (0, None)
        if n_local > n_shared:
            return n_local, local
        if n_shared > n_local:
            return n_shared, other
        if local is None or other is None:
            return n_local, local or other
        together = dict(local)
        for token, count in other.items():
            together[token] = together.get(token, 0) + count
        return n_local, together


@register("suffix", SuffixDrafter)
def _build(resources: DraftResources) -> SuffixDrafter:
    return SuffixDrafter(resources.target.device, resources.outputs if resources.config.suffix_global else None)
