"""The host-memory prefix store: what a reused slot held, kept in blocks for a later request.

When a slot is taken for another sequence, the target's keys, values and kept features of its
prompt and delivered output go here in blocks of ``BLOCK`` positions. A block is keyed by its
scope and by a digest chained over every token up to its end, so a key names the whole prefix,
never a block's tokens alone; a request restores its scope's longest stored prefix into its slot
instead of computing it again. Bounded in bytes, least recently used out first, and fair between
scopes: a scope holds at most ``scope_share`` of the store, and when the store is full the scope
holding the most gives way, so one scope's flood evicts its own blocks before anyone else's.
On CPU a block is a copy in the same memory; on a GPU it lives in pinned host memory.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, defaultdict
from dataclasses import dataclass

import torch

BLOCK = 32  # positions per block


@dataclass(frozen=True, slots=True)
class _Block:
    scope: str
    rows: tuple[torch.Tensor, ...]  # each positional array's [.., BLOCK, ..] slice, on the host
    nbytes: int


def positional(model) -> list[tuple[torch.Tensor, int]]:
    """A model's per-position arrays with the dimension that indexes position: its cache's keys and
    values [L, 1, H_kv, S, D], and kept features [A, S, E] where it keeps them."""
    arrays = [(model.cache.keys, 3), (model.cache.values, 3)]
    if getattr(model, "features", None) is not None:
        arrays.append((model.features, 1))
    return arrays


class PrefixStore:
    def __init__(self, capacity_bytes: int, scope_share: float = 0.5) -> None:
        self.capacity = capacity_bytes
        self.scope_limit = int(capacity_bytes * scope_share)
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()  # least recently used first
        self._scope_bytes: dict[str, int] = defaultdict(int)
        self.nbytes = 0
        self.hits = 0  # requests that restored something
        self.restored_tokens = 0

    @staticmethod
    def _keys(scope: str, token_ids: list[int], blocks: int) -> list[bytes]:
        digest = hashlib.blake2b(scope.encode(), digest_size=16).digest()
        keys = []
        for i in range(blocks):
            chunk = array("q", token_ids[i * BLOCK : (i + 1) * BLOCK]).tobytes()
            digest = hashlib.blake2b(digest + chunk, digest_size=16).digest()
            keys.append(digest)
        return keys

    @torch.inference_mode()
    def save(self, scope: str, token_ids: list[int], arrays: list[tuple[torch.Tensor, int]]) -> int:
        """Keep the whole blocks of ``token_ids`` (the positions ``arrays`` hold for them) not yet
        stored; returns how many blocks were added."""
        if self.capacity <= 0:
            return 0
        keys = self._keys(scope, token_ids, len(token_ids) // BLOCK)
        added = 0
        for i, key in enumerate(keys):
            if key in self._blocks:
                continue
            rows = tuple(self._host(rows_of.narrow(dim, i * BLOCK, BLOCK)) for rows_of, dim in arrays)
            nbytes = sum(row.nbytes for row in rows)
            if not self._make_room(scope, nbytes):
                break
            self._blocks[key] = _Block(scope, rows, nbytes)
            self._scope_bytes[scope] += nbytes
            self.nbytes += nbytes
            added += 1
        for key in reversed(keys):  # the chain's root most recent: a chain loses its tail first
            if key in self._blocks:
                self._blocks.move_to_end(key)
        return added

    def longest(self, scope: str, token_ids: list[int]) -> int:
        """How many leading tokens of ``token_ids`` are stored (whole blocks), leaving at least the
        last token to compute (its logits are needed)."""
        found = 0
        for key in self._keys(scope, token_ids, (len(token_ids) - 1) // BLOCK):
            if key not in self._blocks:
                break
            found += BLOCK
        return found

    @torch.inference_mode()
    def restore(self, scope: str, token_ids: list[int], start: int, end: int, arrays) -> None:
        """Copy stored positions [start, end) (block-aligned, ``longest`` found them) into ``arrays``."""
        keys = self._keys(scope, token_ids, end // BLOCK)
        for i in range(start // BLOCK, end // BLOCK):
            block = self._blocks[keys[i]]
            for (rows_of, dim), row in zip(arrays, block.rows, strict=True):
                rows_of.narrow(dim, i * BLOCK, BLOCK).copy_(row, non_blocking=True)
        for key in reversed(keys):
            self._blocks.move_to_end(key)
        self.hits += 1
        self.restored_tokens += end - start

    def _host(self, rows: torch.Tensor) -> torch.Tensor:
        if rows.device.type == "cpu":
            return rows.clone()
        host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        return host.copy_(rows)

    def _make_room(self, scope: str, nbytes: int) -> bool:
        """Evict until ``nbytes`` more fit: the scope's own oldest blocks past its share, then the
        oldest blocks of whichever scope holds the most. False if it cannot fit at all."""
        if nbytes > min(self.capacity, self.scope_limit):
            return False
        while self._scope_bytes[scope] + nbytes > self.scope_limit:
            self._evict_oldest(scope)
        while self.nbytes + nbytes > self.capacity:
            self._evict_oldest(max(self._scope_bytes, key=self._scope_bytes.__getitem__))
        return True

    def _evict_oldest(self, scope: str) -> None:
        key = next(key for key, block in self._blocks.items() if block.scope == scope)
        block = self._blocks.pop(key)
        self._scope_bytes[scope] -= block.nbytes
        if not self._scope_bytes[scope]:
            del self._scope_bytes[scope]
        self.nbytes -= block.nbytes

    def scope_bytes(self, scope: str) -> int:
        return self._scope_bytes.get(scope, 0)
