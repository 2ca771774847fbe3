"""Attention over the cache: one fused SDPA call, or split over chunks of a long window.

``CausalLM`` attends by SDPA; ``engine/runner.py`` measures at CUDA warm-up whether a long window
attends faster split (``split_attention``) and keeps the faster per window.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attend(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float, chunks: int
) -> torch.Tensor:
    """query [1, H_kv, Q, D] over keys and values [1, H_kv, W, D] (mask [Q, W], True: attend; None:
    all) -> [1, H_kv, Q, D]: one SDPA call, or ``split_attention`` in ``chunks`` chunks."""
    if chunks:
        return split_attention(query, keys, values, mask, scale, chunks)
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale)


def split_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float, chunks: int
) -> torch.Tensor:
    """Attention over a long window with the work spread over ``chunks`` pieces of it. query
    [1, H_kv, Q, D], keys and values [1, H_kv, W, D], mask [Q, W] (True: attend) -> [1, H_kv, Q, D].

    One softmax over the whole window (exact, in float32), then each chunk's probabilities times
    its values as one batched product, and the chunks' results summed. A decode query is a few rows
    per KV head: one fused attention kernel parallelises over heads and query rows, so it leaves
    most of a GPU idle while it streams a long window; the batched products here run
    H_kv * chunks independent pieces at once."""
    _, kv_heads, num_queries, dim = query.shape
    window = keys.shape[2]
    rows, columns = query[0], keys[0].transpose(-1, -2)  # [H_kv, Q, D], [H_kv, D, W]
    if query.is_cuda and query.dtype != torch.float32:  # half-precision products, float32 scores
        scores = torch.bmm(rows, columns, out_dtype=torch.float32)  # [H_kv, Q, W]
    else:
        scores = torch.bmm(rows, columns).float()
    probs = (scores * scale).masked_fill(~mask, float("-inf")).softmax(dim=-1).to(values.dtype)  # [H_kv, Q, W]
    length = window // chunks
    pieces = probs.view(kv_heads, num_queries, chunks, length).transpose(1, 2)  # [H_kv, C, Q, L]
    partial = torch.matmul(pieces, values[0].view(kv_heads, chunks, length, dim))  # [H_kv, C, Q, D]
    return partial.float().sum(dim=1).to(values.dtype)[None]  # [1, H_kv, Q, D]


def attention_chunks(window: int, target_length: int = 1024, most: int = 64) -> int:
    """How many equal chunks ``split_attention`` cuts a window into: about ``target_length``
    positions each, at most ``most``, and a divisor of the window (1 where none fits)."""
    chunks = min(most, max(1, window // target_length))
    while window % chunks:
        chunks -= 1
    return chunks
