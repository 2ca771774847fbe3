"""Static KV caches: allocated once, written at positions, rolled back by moving a length.

Positions past ``length`` hold stale keys and values that the next write overwrites and that
attention never reads (it only reads ``[:length]``), so rollback costs nothing.
"""

from __future__ import annotations

import torch


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
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # [L, 1, H_kv, S, D]
        self.values = torch.zeros(shape, dtype=dtype, device=device)  # [L, 1, H_kv, S, D]
        self.max_len = max_len
        self.token_ids: list[int] = []  # the tokens whose keys and values are in [:length]

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def rollback(self, length: int) -> None:
        """Forget everything after the first ``length`` tokens. The one way the cache shrinks."""
        del self.token_ids[length:]

    def reuse_prefix(self, token_ids: list[int]) -> int:
        """Keep the longest cached prefix of ``token_ids`` and return its length.

        At least the last token is left to feed, because its logits are needed.
        """
        limit = min(len(token_ids) - 1, self.length)
        shared = 0
        while shared < limit and self.token_ids[shared] == token_ids[shared]:
            shared += 1
        self.rollback(shared)
        return shared

    def write(
        self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store keys/values [1, H_kv, T, D] at [start, start+T) and return the live [1, H_kv, start+T, D] views."""
        end = start + keys.shape[2]
        self.keys[layer, :, :, start:end] = keys
        self.values[layer, :, :, start:end] = values
        return self.keys[layer, :, :, :end], self.values[layer, :, :, :end]
