"""Static KV caches: allocated once, written at positions, rolled back by moving a length.

Positions past ``length`` hold stale keys and values that the next write overwrites and that
attention never reads (it reads ``[:length]``, or a longer static window under a mask that hides
every position past the query's own), so rollback costs nothing.
"""

from __future__ import annotations

import mmap

import numpy as np
import torch

UNKNOWN = -1  # a cached position whose token id the host has not seen (fed as a device tensor)


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_layers, 1, num_kv_heads, max_len, head_dim)
        self.keys = lazy_zeros(shape, dtype, device)  # [L, 1, H_kv, S, D]
        self.values = lazy_zeros(shape, dtype, device)  # [L, 1, H_kv, S, D]
        self._by_layer = list(
            zip(self.keys.unbind(0), self.values.unbind(0), strict=True)
        )  # a step asks for these views
        self.max_len = max_len
        # The tokens whose keys and values are in [:length]. Tokens fed as device tensors (drafts
        # sampled on the device) are UNKNOWN here until ``rollback`` is told the committed sequence.
        self.token_ids: list[int] = []
        self._first_unknown: int | None = None  # the first UNKNOWN position, if any

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def rollback(self, length: int, committed: list[int] | None = None) -> None:
        """Forget everything after the first ``length`` tokens. The one way the cache shrinks.

        ``committed`` (the sequence as the host now knows it) names kept positions that were fed as
        device tensors, so that prefix reuse can match them later."""
        del self.token_ids[length:]
        first = self._first_unknown
        if first is None or first >= length:
            self._first_unknown = None
        elif committed is not None and len(committed) >= length:
            self.token_ids[first:length] = committed[first:length]
            self._first_unknown = None

    def append(self, token_ids: list[int] | int) -> None:
        """Record fed tokens: their ids, or how many were fed as device tensors (ids unknown)."""
        if isinstance(token_ids, int):
            if self._first_unknown is None:
                self._first_unknown = len(self.token_ids)
            token_ids = [UNKNOWN] * token_ids
        self.token_ids.extend(token_ids)

    def reuse_prefix(self, token_ids: list[int]) -> int:
        """Keep the longest cached prefix of ``token_ids`` and return its length.

        At least the last token is left to feed, because its logits are needed.
        """
        shared = self.matching(token_ids, 0, min(len(token_ids) - 1, self.length))
        self.rollback(shared)
        return shared

    def matching(self, token_ids: list[int], start: int, limit: int) -> int:
        """The first position in [start, limit) where this cache's tokens differ from ``token_ids``, or limit."""
        position = start
        while position < limit and self.token_ids[position] == token_ids[position]:
            position += 1
        return position

    def copy_from(self, source: KVCache, end: int, token_ids: list[int]) -> None:
        """Take positions [length, end) from ``source`` (a cache of the same geometry, any dtype),
        as far as it holds ``token_ids`` there: keys and values another model computed, cast to
        this cache's dtype."""
        start = self.length
        end = source.matching(token_ids, start, min(end, source.length))
        if end <= start:
            return
        self.keys[:, :, :, start:end].copy_(source.keys[:, :, :, start:end])  # [L, 1, H_kv, end-start, D]
        self.values[:, :, :, start:end].copy_(source.values[:, :, :, start:end])
        self.append(token_ids[start:end])

    def empty_like(self) -> KVCache:
        """A cache of the same geometry holding nothing (another sequence's slot)."""
        num_layers, _, num_kv_heads, max_len, head_dim = self.keys.shape
        return KVCache(num_layers, num_kv_heads, head_dim, max_len, self.keys.dtype, self.keys.device)

    def copy_all_from(self, source: KVCache) -> None:
        """Hold exactly what ``source`` holds (a slot bound by copy, where a captured forward keeps
        this cache's addresses): its first ``source.length`` positions and their token ids."""
        end = source.length
        self.keys[:, :, :, :end].copy_(source.keys[:, :, :, :end])  # [L, 1, H_kv, end, D]
        self.values[:, :, :, :end].copy_(source.values[:, :, :, :end])
        self.token_ids = list(source.token_ids)
        self._first_unknown = source._first_unknown

    def write(
        self, layer: int, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, window: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store keys/values [1, H_kv, T, D] at ``positions`` [T] and return [1, H_kv, window, D] views
        of the first ``window`` positions. Shapes depend only on T and ``window``, never on where
        the tokens go, so one compiled or captured forward serves every position."""
        self.keys[layer].index_copy_(2, positions, keys)
        self.values[layer].index_copy_(2, positions, values)
        return self.keys[layer, :, :, :window], self.values[layer, :, :, :window]

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s keys and values [1, H_kv, S, D], for an op that writes them itself
        (specserve::decode_layer, as ``write_rotating`` does)."""
        return self._by_layer[layer]

    def write_rotating(
        self, layer: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, start: int, window: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``write`` fused with the rotary embedding, by engine/cpu/csrc's op (a CPU float32 cache): a
        layer's qkv [1, T, (H + 2 H_kv) D] at positions [start, start + T) with cos/sin [T, D] ->
        (q rotated [1, H, T, D], and [1, H_kv, window, D] views of keys and values), k rotated and v
        stored. It rounds as the rotation and ``write`` do apart."""
        keys, values = self.layer(layer)  # [1, H_kv, S, D]
        q = torch.ops.specserve.rotate_into_cache.default(qkv, cos, sin, keys, values, heads, start)
        return q, keys[:, :, :window], values[:, :, :window]


@torch.inference_mode(False)
def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros that on CPU take memory only where they are written: ``torch.zeros`` writes every page
    (a 4,096-token cache of the embedded model: 190 MB resident before any request), while an
    anonymous mapping is the system's zero pages until a page is written. A cache is [L, 1, H_kv,
    S, D], so a position's first write touches every layer and head: on huge pages each would
    commit 2 MB (the whole cache at the first token), so the mapping asks for ordinary pages.
    Ordinary tensors wherever they are made (a slot's, inside inference mode): code outside
    inference mode updates caches in place (a draft copying the target's keys and values)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    size = int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=dtype).element_size()
    if size < mmap.PAGESIZE:
        return torch.zeros(shape, dtype=dtype)
    private = {"flags": mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS} if hasattr(mmap, "MAP_PRIVATE") else {}
    pages = mmap.mmap(-1, size, **private)  # anonymous: zeros; unmapped with the last tensor viewing it
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        pages.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)
