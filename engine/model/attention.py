"""Attention over the cache: one fused SDPA call, split over chunks of a long window, or, for a few
query rows on CPU, engine/cpu/csrc's kernel.

``CausalLM`` attends by SDPA; ``engine/model/runner.py`` measures at CUDA warm-up whether a long window
attends faster split (``split_attention``) and keeps the faster per window. A CPU float32 model
whose eager kernels are native (``engine/model/kernels.py``) attends through ``specserve::decode_attention``
at decode and verify: each (KV head, query row) one task with a vectorised softmax, where torch's
CPU flash attention spends more on setting up its blocks than on a window of a few hundred keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NATIVE_QUERY_ROWS = 64  # the most query rows per KV head (grouped heads times new tokens) the kernel takes


def native_attention(rows: int, dim: int, any_rows: bool = False) -> bool:
    """Whether engine/cpu/csrc's kernel takes ``rows`` query rows per KV head of head size ``dim``
    (``any_rows``: as many as come, a prompt's too)."""
    return (any_rows or rows <= NATIVE_QUERY_ROWS) and dim % 4 == 0 and dim <= 256


def attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    chunks: int,
    native: bool = False,
    rows_alike: bool = False,
) -> torch.Tensor:
    """query [1, H_kv, Q, D] over keys and values [1, H_kv, W, D] (mask [Q, W], True: attend; None:
    all) -> [1, H_kv, Q, D]: one SDPA call, ``split_attention`` in ``chunks`` chunks, or (``native``,
    a few rows of a head size the kernel takes) engine/cpu/csrc's kernel, at any number of rows where
    ``rows_alike`` (each row's arithmetic then never depends on the rows beside it, as SDPA's may)."""
    if native and not chunks and native_attention(query.shape[2], query.shape[3], rows_alike):
        return torch.ops.specserve.decode_attention.default(query, keys, values, mask, scale)
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
