"""What the engine keeps of recent outputs, for drafters that match text across requests.

The engine adds an output only when the serving layer says what of it the client received
(``SpecEngine.remember``): never the tokens past a stop string, nor an aborted request's unsent
tail. Each output is indexed under its request's scope, and a drafter reads only its own request's
scope, so no client can probe another's outputs through acceptance counts.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, defaultdict

MAX_MATCH = 8  # longest n-gram indexed


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


class OutputCache:
    """Recent outputs per scope (``Request.tenant``), at most ``max_requests`` in all. When full,
    the scope holding the most outputs gives up its oldest, so one scope's flood evicts its own
    entries before anyone else's. One per engine, whichever drafters read it."""

    def __init__(self, max_requests: int, max_match: int = MAX_MATCH) -> None:
        self.max_requests = max_requests
        self.max_match = max_match
        self.indexes: dict[str, ContinuationIndex] = {}
        self._outputs: OrderedDict[int, tuple[str, list[int]]] = OrderedDict()
        self._counts: Counter = Counter()  # outputs kept per scope
        self._next_id = 0

    def add(self, tenant: str, output_ids: list[int]) -> None:
        if self.max_requests <= 0 or len(output_ids) < 2:
            return
        self.indexes.setdefault(tenant, ContinuationIndex(self.max_match)).add(output_ids)
        self._outputs[self._next_id] = (tenant, list(output_ids))
        self._counts[tenant] += 1
        self._next_id += 1
        while len(self._outputs) > self.max_requests:
            largest = max(self._counts, key=self._counts.__getitem__)
            oldest = next(key for key, (owner, _) in self._outputs.items() if owner == largest)
            old_tenant, old_ids = self._outputs.pop(oldest)
            self._counts[old_tenant] -= 1
            if not self._counts[old_tenant]:
                del self._counts[old_tenant]
            index = self.indexes[old_tenant]
            index.add(old_ids, sign=-1)
            if not index.size:
                del self.indexes[old_tenant]

    def recent(self, tenant: str) -> list[list[int]]:
        """The outputs kept under ``tenant``, oldest first."""
        return [list(ids) for owner, ids in self._outputs.values() if owner == tenant]

    def index(self, tenant: str) -> ContinuationIndex | None:
        return self.indexes.get(tenant)

    @property
    def stats(self) -> dict:
        return {
            "requests": len(self._outputs),
            "tenants": len(self.indexes),
            "entries": sum(index.size for index in self.indexes.values()),
        }
