"""Suffix decoding (Oliaro et al., 2024, arXiv 2411.04975): propose the most frequent continuation
of the longest context suffix seen before, in this request or in recent outputs.

Two indexes of token continuations: one over this request's prompt and output, one over the outputs
of recent finished requests of the same tenant (API key and ``user``), so no client can probe for
another's outputs through acceptance counts. Each maps every n-gram (n up to ``max_match``) to the
tokens that followed it, with counts. A proposal walks forward greedily: at each step the longest
suffix of context-plus-draft found in an index picks the most frequent next token; the draft grows
while the estimated probability of the whole path stays above ``min_probability`` and its length
stays within ``match_factor`` times the match length (longer matches draft more), up to k.

Proposals are deterministic, so they are verified with a one-hot q, like ``ngram``.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, defaultdict

import torch

from ..model import upload
from ..sampling import RequestSampler
from .base import Drafter, DraftResources, Proposal
from .registry import register

MAX_MATCH = 8  # longest n-gram indexed
MATCH_FACTOR = 2.0  # a match of n tokens may draft up to 2n tokens
MIN_PROBABILITY = 0.1  # stop drafting once the path's estimated probability falls below this


class ContinuationIndex:
    """n-gram (n in 1..max_match) -> Counter of the tokens that followed it."""

    def __init__(self, max_match: int = MAX_MATCH) -> None:
        self.max_match = max_match
        self.table: dict[tuple[int, ...], Counter] = defaultdict(Counter)

    def add(self, token_ids: list[int], start: int = 1, sign: int = 1) -> None:
        """Index every continuation token_ids[end] for end in [start, len): the n-grams ending before it."""
        for end in range(max(start, 1), len(token_ids)):
            following = token_ids[end]
            for n in range(1, min(self.max_match, end) + 1):
                key = tuple(token_ids[end - n : end])
                counts = self.table[key]
                counts[following] += sign
                if counts[following] <= 0:
                    del counts[following]
                    if not counts:
                        del self.table[key]

    def longest_match(self, context: list[int]) -> tuple[int, Counter | None]:
        """(n, counts) for the longest suffix of ``context`` that was seen with a continuation."""
        for n in range(min(self.max_match, len(context)), 0, -1):
            counts = self.table.get(tuple(context[-n:]))
            if counts:
                return n, counts
        return 0, None

    @property
    def size(self) -> int:
        return len(self.table)


class SuffixCache:
    """Recent finished outputs per tenant, at most ``max_requests`` in all; the oldest go first."""

    def __init__(self, max_requests: int, max_match: int = MAX_MATCH) -> None:
        self.max_requests = max_requests
        self.max_match = max_match
        self.indexes: dict[str, ContinuationIndex] = {}
        self._outputs: OrderedDict[int, tuple[str, list[int]]] = OrderedDict()
        self._next_id = 0

    def add(self, tenant: str, output_ids: list[int]) -> None:
        if self.max_requests <= 0 or len(output_ids) < 2:
            return
        self.indexes.setdefault(tenant, ContinuationIndex(self.max_match)).add(output_ids)
        self._outputs[self._next_id] = (tenant, list(output_ids))
        self._next_id += 1
        while len(self._outputs) > self.max_requests:
            _, (old_tenant, old_ids) = self._outputs.popitem(last=False)
            index = self.indexes[old_tenant]
            index.add(old_ids, sign=-1)
            if not index.size:
                del self.indexes[old_tenant]

    def index(self, tenant: str) -> ContinuationIndex | None:
        return self.indexes.get(tenant)

    @property
    def stats(self) -> dict:
        return {
            "requests": len(self._outputs),
            "tenants": len(self.indexes),
            "entries": sum(index.size for index in self.indexes.values()),
        }


class SuffixDrafter(Drafter):
    name = "suffix"

    def __init__(self, device: torch.device, cache: SuffixCache | None, max_match: int = MAX_MATCH) -> None:
        self.device = device
        self.cache = cache  # None: no index across requests (--suffix-global off)
        self.max_match = max_match
        self._local = ContinuationIndex(max_match)
        self._indexed = 0  # continuations before this position are in the local index
        self._tenant = ""
        self._prompt_len = 0
        self._sequence: list[int] = []  # the request's prompt and committed output, as last seen
        self.match_length = 0  # tokens the last proposal's first match spanned (0: none): how far to trust it

    def begin(self, prompt_ids: list[int], tenant: str = "") -> None:
        self._retire()
        self._local = ContinuationIndex(self.max_match)
        self._indexed, self._tenant, self._prompt_len = 0, tenant, len(prompt_ids)
        self._sequence = list(prompt_ids)

    def propose(self, token_ids: list[int], num_draft_tokens: int, sampler: RequestSampler) -> Proposal:
        self._local.add(token_ids, start=self._indexed)
        self._indexed, self._sequence = len(token_ids), token_ids
        shared = self.cache.index(self._tenant) if self.cache is not None else None
        context, drafted, probability, limit = list(token_ids[-self.max_match :]), [], 1.0, num_draft_tokens
        self.match_length = 0
        while len(drafted) < limit:
            n, counts = self._best(context, shared)
            if counts is None:
                break
            if not drafted:  # the first match sets how far this draft may reach
                self.match_length, limit = n, min(num_draft_tokens, max(1, int(MATCH_FACTOR * n)))
            token, count = counts.most_common(1)[0]
            probability *= count / sum(counts.values())
            if probability < MIN_PROBABILITY:
                break
            drafted.append(token)
            context = (context + [token])[-self.max_match :]
        if not drafted:
            return Proposal.empty(self.device)
        return Proposal(upload(drafted, self.device), None)

    def accept(self, num_committed: int) -> None:
        """Nothing to roll back: the indexes hold committed tokens only."""

    def _best(self, context: list[int], shared: ContinuationIndex | None) -> tuple[int, Counter | None]:
        """The longer match of the two indexes; on a tie, their counts together."""
        n_local, local = self._local.longest_match(context)
        n_shared, other = shared.longest_match(context) if shared is not None else (0, None)
        if n_local > n_shared:
            return n_local, local
        if n_shared > n_local:
            return n_shared, other
        if local is None or other is None:
            return n_local, local or other
        return n_local, local + other

    def _retire(self) -> None:
        """The previous request's output joins its tenant's shared index."""
        if self.cache is not None and len(self._sequence) > self._prompt_len:
            self.cache.add(self._tenant, self._sequence[self._prompt_len :])
        self._sequence = []


@register("suffix", SuffixDrafter)
def _build(resources: DraftResources) -> SuffixDrafter:
    config = resources.config
    cache = SuffixCache(config.suffix_cache_requests) if config.suffix_global else None
    return SuffixDrafter(resources.target.device, cache)
