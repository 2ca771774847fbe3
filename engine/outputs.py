"""What the engine keeps of recent outputs, for drafters that match text across requests.

The engine adds an output only when the serving layer says what of it the client received
(``SpecEngine.remember``): never the tokens past a stop string, nor an aborted request's unsent
tail. Each output is indexed under its request's scope, and a drafter reads only its own request's
scope, so no client can probe another's outputs through acceptance counts.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

MAX_MATCH = 8  # longest n-gram indexed


class ContinuationIndex:
    """n-gram (n in 1..max_match) -> {token that followed it: count}. Plain dicts, not ``Counter``s:
    a step indexes each new token under max_match keys, and a Counter per new key (built in Python)
    cost a step more than the lookups."""

    def __init__(self, max_match: int = MAX_MATCH) -> None:
        self.max_match = max_match
        self.table: dict[tuple[int, ...], dict[int, int]] = {}

    def add(self, token_ids: list[int], start: int = 1, sign: int = 1) -> None:
        """Index every continuation token_ids[end] for end in [start, len): the n-grams ending before it."""
        table, longest = self.table, self.max_match
        for end in range(max(start, 1), len(token_ids)):
            following, before = token_ids[end], tuple(token_ids[max(end - longest, 0) : end])
            for n in range(1, len(before) + 1):
                key = before[-n:]
                counts = table.get(key)
                if counts is None:
                    if sign > 0:
                        table[key] = {following: sign}
                    continue
                count = counts.get(following, 0) + sign
                if count > 0:
                    counts[following] = count
                elif following in counts:
                    del counts[following]
                    if not counts:
                        del table[key]

    def longest_match(self, context: list[int]) -> tuple[int, dict[int, int] | None]:
        """(n, counts) for the longest suffix of ``context`` that was seen with a continuation. The
        keys are closed under suffixes (``add`` indexes every n-gram ending before a token, and takes
        away as it added), so the search climbs from one token and stops at the first miss: a text
        that seldom repeats looks up one or two keys a step, not max_match."""
        tail, found = tuple(context[-self.max_match :]), (0, None)
        for n in range(1, len(tail) + 1):
            counts = self.table.get(tail[-n:])
            if not counts:
                break
            found = n, counts
        return found

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
